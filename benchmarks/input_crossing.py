"""Correctness time on tasks with large inputs: this tree against an earlier one, side by side.

    mkdir -p /tmp/before && git archive <rev> | tar -x -C /tmp/before
    python benchmarks/input_crossing.py --before /tmp/before --tasks kernelbench-v0:1:36 \\
        --device cpu --repeats 2 --out benchmarks/results --tag cpu

Each task's reference is evaluated as its own candidate (ModelNew is Model), so that every
correctness call (the trials, the cache probe, the traced call) runs to the end and its time is
the protocol's: the judge making inputs and writing them, the candidate reading them, calling and
writing its output, the judge reading that and comparing. Timing is off (`timing=False`): only
process start, loading and correctness are measured. Each tree runs in a process of its own with
that tree first on PYTHONPATH, the two alternating per repeat, one evaluation at a time. Writes
`input_crossing-<date>[-tag].json` and `.md` with the device, torch, the commit and per-arm
figures (the median over repeats of the correctness stage and of the evaluation's wall time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(tasks: list[str], device: str, trials: int) -> None:
    """In the tree on PYTHONPATH: evaluate each task's reference as its own candidate; one JSON
    line per task on stdout."""
    from kernelfleet.core.tasks import load_tasks
    from kernelfleet.evaluator import EvalConfig, Evaluator

    chosen = [task for selection in tasks for task in load_tasks(selection)]
    config = EvalConfig(
        device=device,
        profile="kernelbench-v0",
        correctness_trials=trials,
        timing=False,
        speedup_recheck=None,
        timeout_seconds=900,
    )
    with Evaluator(config) as evaluator:
        for task in chosen:
            candidate = task.code.replace("class Model(", "class ModelNew(").replace(
                "super(Model,", "super(ModelNew,"
            )
            begin = time.monotonic()
            result = evaluator.evaluate(task, candidate)
            line = {
                "task": f"{task.level}:{task.task_id}",
                "verdict": str(result.verdict),
                "seconds": round(time.monotonic() - begin, 3),
                "stages": {k: round(v, 3) for k, v in (result.stages or {}).items()},
            }
            print(json.dumps(line), flush=True)


def run_arm(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    # Imported here, in the parent: the module puts this tree on sys.path, which in a child
    # would shadow the tree under test.
    from gpu_evaluator import tree_env

    env = tree_env(tree)
    command = [sys.executable, __file__, "--child", "--device", args.device, "--trials", str(args.trials)]
    command += ["--tasks", *args.tasks]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {tree} arm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def environment(device: str) -> dict[str, Any]:
    import torch
    from gpu_evaluator import commit

    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    return {"device": name, "torch": torch.__version__, "commit": commit()[:12], "cpus": os.cpu_count()}


def median_text(entry: dict[str, Any], key: str) -> str:
    return f"{statistics.median(entry[key]):.2f}" if entry.get(key) else "-"


PARTS = ("correctness_", "judge_")  # correctness in parts, as evaluations report it from 0.8.6


def parts_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Where the correctness time goes, per task and arm (median seconds over repeats); an arm
    whose evaluator reports no parts (an older tree) is left out."""
    names = sorted({p for arms in summary.values() for e in arms.values() for p in e.get("parts", {})})
    if not names:
        return []
    lines = [
        "",
        "Correctness in parts (median s): `correctness_*` as the evaluation waited for them (inputs not "
        "made ahead, the candidate's calls, the judge's comparisons); `judge_*` the judge's own work "
        "(`judge_compare` includes `judge_reference` and `judge_output_read`).",
        "",
        "| task | arm | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for task, arms_seen in summary.items():
        for arm, entry in arms_seen.items():
            parts = entry.get("parts")
            if parts:
                cells = [f"{statistics.median(parts[n]):.2f}" if n in parts else "-" for n in names]
                lines.append(f"| {task} | {arm} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="the earlier tree (git archive REV | tar -x -C DIR)")
    parser.add_argument("--tasks", nargs="+", default=["kernelbench-v0:1:36"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trials", type=int, default=5, help="correctness trials")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.tasks, args.device, args.trials)
        return 0
    if args.before is None or not (args.before / "evaluator" / "kernelfleet").is_dir():
        parser.error("give --before DIR: an exported tree (git archive REV | tar -x -C DIR)")
    arms = {"before": args.before.resolve(), "this tree": ROOT}
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in arms}
    for repeat in range(args.repeats):
        for name, tree in arms.items():
            rows = run_arm(tree, args)
            runs[name].append(rows)
            seen = [(r["task"], r["stages"].get("correctness")) for r in rows]
            print(f"repeat {repeat + 1} {name}: {seen}", flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for name, repeats in runs.items():
        for row in (r for rows in repeats for r in rows):
            entry = summary.setdefault(row["task"], {}).setdefault(
                name, {"correctness": [], "seconds": [], "verdicts": []}
            )
            entry["correctness"].append(row["stages"].get("correctness", 0.0))
            entry["seconds"].append(row["seconds"])
            entry["verdicts"].append(row["verdict"])
            for part, seconds in row["stages"].items():
                if part.startswith(PARTS):
                    entry.setdefault("parts", {}).setdefault(part, []).append(seconds)
    report = {"environment": environment(args.device), "trials": args.trials, "tasks": summary}
    day = datetime.date.today().isoformat()
    stem = Path(args.out) / f"input_crossing-{day}{'-' + args.tag if args.tag else ''}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    env = report["environment"]
    lines = [
        f"# Input crossing, {day}",
        "",
        f"{env['device']}, torch {env['torch']}, commit `{env['commit']}`; {args.trials} correctness "
        f"trials, the reference as its own candidate, timing off, {args.repeats} repeats, arms alternating.",
        "",
        "| task | before: correctness s (median) | this tree | before: evaluation s | this tree | verdicts |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for task, arms_seen in summary.items():
        b, n = arms_seen.get("before", {}), arms_seen.get("this tree", {})
        verdicts = sorted(set(b.get("verdicts", []) + n.get("verdicts", [])))
        lines.append(
            f"| {task} | {median_text(b, 'correctness')} | {median_text(n, 'correctness')} | "
            f"{median_text(b, 'seconds')} | {median_text(n, 'seconds')} | {', '.join(verdicts)} |"
        )
    lines += parts_table(summary)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
