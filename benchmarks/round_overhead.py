"""What one timed round costs beyond the two timed calls, this tree against an older commit,
side by side in one run (issue 11).

A timed round sends one request to each side and each side refills its inputs, reseeds, flushes,
synchronises and times one call. Whatever it does besides the call is time the timing lane is
held and the device sits idle. This runs the same evaluation (one honest candidate of a small
matmul task, one batch of --rounds rounds, no re-check) in fresh interpreters, alternately from
this tree and from a worktree of --old, --repeats times each, and reports per run the seconds
per round and both sides' median call.

    python benchmarks/round_overhead.py --old 9d3bb89 --device cpu
    python benchmarks/round_overhead.py --old 9d3bb89 --old-tree .old --device cuda:0

--old-tree takes an exported copy of that commit instead of a git worktree (on a machine whose
copy of the repository has no history: `git archive 9d3bb89 | tar -x -C .old`, carried along).

Writes `round_overhead-<date>[-cpu].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Run inside each tree: one evaluation, its rounds and timing stage as JSON on the last line.
_PROBE = """
import json, sys
from kernelfleet.core.models import Task
from kernelfleet.evaluator import EvalConfig, Evaluator
from tests.support import evaluator_cases as C
rounds, device = int(sys.argv[1]), sys.argv[2]
config = EvalConfig(device=device, correctness_trials=1, timing_trials=rounds, warmup=2,
                    max_speedup_cv=None, speedup_recheck=None, timing_retries=0,
                    **({"timing_batch_s": 1e6} if "timing_batch_s" in EvalConfig.model_fields else {}))
with Evaluator(config) as evaluator:
    result = evaluator.evaluate(Task(name="matmul", code=C.MATMUL_TASK), C.HONEST)
assert result.reference is not None and result.candidate is not None, result.reasons
print(json.dumps({"rounds": result.candidate.trials, "timing_s": result.stages["timing"],
                  "reference_ms": result.reference.median_ms, "candidate_ms": result.candidate.median_ms}))
"""


def probe(tree: Path, rounds: int, device: str) -> dict[str, Any]:
    paths = [str(tree / part) for part in ("core", "evaluator", "search")] + [str(tree)]
    # Keep what else is on the path (carried packages), never the other tree's folders.
    inherited = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not p.startswith(str(ROOT))
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + inherited)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(rounds), device],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    row["ms_per_round"] = round(row["timing_s"] / row["rounds"] * 1e3, 3)
    return row


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare with (a git revision)")
    parser.add_argument("--old-tree", help="an exported copy of --old to use instead of a git worktree")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    old_rev = args.old
    new_rev = os.environ.get("KERNELFLEET_COMMIT") or git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain")) and "KERNELFLEET_COMMIT" not in os.environ
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    with tempfile.TemporaryDirectory(prefix="kf-round-overhead-") as scratch:
        old_tree = Path(args.old_tree).resolve() if args.old_tree else Path(scratch) / "old"
        if not args.old_tree:
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(old_tree), old_rev], cwd=ROOT, check=True
            )
        try:
            for repeat in range(args.repeats):
                for name, tree in (("new", ROOT), ("old", old_tree)):
                    row = probe(tree, args.rounds, args.device)
                    runs[name].append(row)
                    print(
                        f"{repeat + 1}/{args.repeats} {name}: {row['ms_per_round']} ms per round",
                        file=sys.stderr,
                    )
        finally:
            if not args.old_tree:
                subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False)

    summary = {
        name: {
            "ms_per_round_median": round(statistics.median(r["ms_per_round"] for r in rows), 3),
            "reference_call_ms_median": round(statistics.median(r["reference_ms"] for r in rows), 4),
            "candidate_call_ms_median": round(statistics.median(r["candidate_ms"] for r in rows), 4),
        }
        for name, rows in runs.items()
    }
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "cpus": os.cpu_count(),
        "new": new_rev + ("+dirty" if dirty else ""),
        "old": old_rev,
        "rounds": args.rounds,
        "runs": runs,
        "summary": summary,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"round_overhead-{report['date'][:10]}" + (
        "" if args.device.startswith("cuda") else f"-{args.device}"
    )
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Cost of a timed round, {report['date'][:10]}",
        "",
        f"{args.device}, {report['cpus']} CPUs; one honest candidate of a small matmul task, "
        f"{args.rounds} rounds per evaluation, {args.repeats} evaluations per tree, alternating, "
        "each in a fresh interpreter.",
        "",
        "| tree | ms per round (median) | reference call ms | candidate call ms | runs (ms per round) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, rev in (("new", report["new"]), ("old", report["old"])):
        s = summary[name]
        each = ", ".join(str(r["ms_per_round"]) for r in runs[name])
        lines.append(
            f"| {name} `{rev}` | {s['ms_per_round_median']} | {s['reference_call_ms_median']} | "
            f"{s['candidate_call_ms_median']} | {each} |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
