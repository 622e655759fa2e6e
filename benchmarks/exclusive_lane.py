"""The exclusive timing lane, side by side with a shared one, in one run (issue 11).

Identical candidates should get identical speedups. Each of the bundled example tasks gets
--copies copies of its replay candidate (differing by a comment, so each is evaluated afresh),
and the whole set goes through one `evaluate_batch` with several candidates per device at once,
first with `exclusive_timing` off (the other candidates' correctness runs beside each timing),
then on (their GPU or CPU steps wait while one times), then off and on again. Per mode: wall
seconds, evaluations per hour, and how far the copies' speedups spread (max/min - 1 per task;
the median and the largest over tasks). The device is --device: the GPU machine's GPU, or this
machine's CPU, where the slots contend for the cores instead of GPU time slices.

    python benchmarks/exclusive_lane.py --device cpu --copies 3 --trials 30

Writes `exclusive_lane-<date>[-cpu].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for part in ("core", "evaluator"):
    if str(ROOT / part) not in sys.path:
        sys.path.insert(0, str(ROOT / part))

from gpu_evaluator import commit  # noqa: E402

from kernelfleet.evaluator import EVALUATOR_VERSION, EvalConfig, Evaluator, load_tasks  # noqa: E402


def workload(copies: int) -> list[tuple[Any, str, str]]:
    """(task, candidate code, task name) for each bundled task's first replay candidate."""
    tasks = {task.name: task for task in load_tasks(ROOT / "examples" / "tasks")}
    chosen: dict[str, str] = {}
    for line in (ROOT / "examples" / "candidates.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["task"] in tasks and row["task"] not in chosen:
            chosen[row["task"]] = row["code"]
    return [
        (tasks[name], f"{code}\n# copy {copy}\n", name)
        for name, code in chosen.items()
        for copy in range(copies)
    ]


def run_mode(items: list[tuple[Any, str, str]], args: argparse.Namespace, exclusive: bool) -> dict[str, Any]:
    config = EvalConfig(
        device=args.device,
        timing_trials=args.trials,
        correctness_trials=2,
        speedup_recheck=None,
        lane_slots=args.slots,
        exclusive_timing=exclusive,
    )
    begin = time.monotonic()
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch([(task, code) for task, code, _ in items], progress=False)
    wall = time.monotonic() - begin
    speedups: dict[str, list[float]] = defaultdict(list)
    for (_, _, name), result in zip(items, results, strict=True):
        if result.speedup:
            speedups[name].append(result.speedup)
    spreads = {name: max(v) / min(v) - 1 for name, v in speedups.items() if len(v) >= 2}
    return {
        "exclusive_timing": exclusive,
        "wall_s": round(wall, 1),
        "evaluations_per_hour": round(len(items) / wall * 3600, 1),
        "speedups": {name: [round(s, 4) for s in v] for name, v in speedups.items()},
        "spread_median": round(statistics.median(spreads.values()), 4) if spreads else None,
        "spread_max": round(max(spreads.values()), 4) if spreads else None,
        "gpu_wait_s": round(sum(r.stages.get("gpu_wait", 0.0) for r in results), 1),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Exclusive timing lane, side by side, {report['date'][:10]}",
        "",
        f"Device {report['device']} ({report['cpus']} CPUs), evaluator {report['evaluator_version']}, commit "
        f"`{report['commit']}`. {report['candidates']} candidates: {report['copies']} copies of each bundled "
        f"task's replay candidate, {report['slots']} at once, {report['trials']} timed rounds.",
        "",
        "| run | exclusive timing | wall s | evaluations per hour "
        "| copies' speedup spread: median / max over tasks | seconds waited at the gate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for index, m in enumerate(report["runs"], 1):
        mode = "on" if m["exclusive_timing"] else "off"
        lines.append(
            f"| {index} | {mode} | {m['wall_s']} | {m['evaluations_per_hour']} | "
            f"{m['spread_median']} / {m['spread_max']} | {m['gpu_wait_s']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--slots", type=int, default=3, help="candidates per device at once")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    items = workload(args.copies)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "cpus": os.cpu_count(),
        "evaluator_version": EVALUATOR_VERSION,
        "commit": commit(),
        "candidates": len(items),
        "copies": args.copies,
        "slots": args.slots,
        "trials": args.trials,
        "runs": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device.startswith("cuda") else f"-{args.device}"
    stem = out / f"exclusive_lane-{report['date'][:10]}{suffix}"
    for _ in range(args.rounds):
        for exclusive in (False, True):
            report["runs"].append(run_mode(items, args, exclusive))
            print(json.dumps(report["runs"][-1]), file=sys.stderr)
            stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
            stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
