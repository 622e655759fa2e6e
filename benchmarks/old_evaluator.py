"""The evaluator as it was before the pipeline (issue 11's "today's"), on a workload: run by
`reward_service.py`'s `before-pipeline` mode in a process of its own, with the old tree first on
PYTHONPATH, so that nothing of this tree's kernelfleet loads. It imports only the old tree.

Make the old tree with `mkdir -p .old && git archive 777a4df | tar -x -C .old` (777a4df: the last
commit before the pipeline). Reads a manifest of {"task": "LEVEL:ID", "code": ...} lines, evaluates
them one after another with one Evaluator, as `kernelfleet optimize` then did (kernelbench-v0, no
baselines, a cold build cache), and writes one JSON line per candidate as it finishes; it starts
no candidate after --max-seconds.

    PYTHONPATH=.old/core:.old/evaluator python benchmarks/old_evaluator.py \\
        --manifest m.jsonl --results r.jsonl --device cuda --max-seconds 300
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

# The OLD tree's evaluator, by name: this tree's type checker must not take it for its own.
old: Any = importlib.import_module("kernelfleet.evaluator")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, required=True)
    args = parser.parse_args()
    began = time.monotonic()
    tasks = {f"{t.level}:{t.task_id}": t for t in old.load_tasks("kernelbench-v0")}
    rows = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory(prefix="kf-old-builds-") as builds, args.results.open("w") as out:
        config = old.EvalConfig(
            device=args.device, profile="kernelbench-v0", timing_trials=args.trials, cache_dir=builds
        )
        with old.Evaluator(config) as evaluator:
            for row in rows:
                if time.monotonic() - began >= args.max_seconds:
                    break
                start = time.monotonic()
                result = evaluator.evaluate(tasks[row["task"]], row["code"])
                line = {
                    "task": row["task"],
                    "verdict": str(result.verdict),
                    "speedup": result.speedup,
                    "seconds": round(time.monotonic() - start, 3),
                    "reasons": list(result.reasons)[:3],
                }
                out.write(json.dumps(line) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
