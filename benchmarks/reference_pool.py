"""Would a session's reference pool make re-timings agree? (issue 11, repeatability)

Issue 11 asks for reference timings "computed once per task and session and reused". A pool
would keep every process's reference median for a task and set each candidate's speedup
against the pool's geometric mean instead of against the reference processes of its own
evaluation. This re-analyses repeat runs of `benchmarks/reward_service.py` made with two process
pairs per evaluation (`-samples.json.gz`; every timed call of both evaluations, each
evaluation's calls in the order timed, first pair then second) and compares, at the 50th and
90th percentile (nearest rank) over candidates of 50 us and more, the disagreement |s1/s2 - 1| of:

- paired: what the evaluator reports, each evaluation against its own two reference processes;
- pool: the first evaluation as paired, the second against all four reference processes (the
  pool it would meet), its own two candidate processes;
- pool with a drift check: as pool, but an evaluation whose own reference is more than
  --drift away from the pool's stays paired;
- and, beside them, the candidate's own time |c1/c2 - 1| (each evaluation's geometric mean of its
  pairs' medians, as the evaluator reports `candidate.median_ms`): re-timing the candidate alone,
  where the reference's per-process modes stay out. "check" is the largest gap between the first
  evaluation's figure here and the one the evaluator reported, a measure of the approximation.

An approximation: an evaluation's calls are split in two halves, one per pair, which holds when
both pairs timed the same number of rounds (a candidate with an odd count is left out).

    python benchmarks/reference_pool.py benchmarks/results/reward_service-2026-12-0*-samples.json.gz

Writes `reference_pool-<date>[-<tag>].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import math
import statistics
from pathlib import Path
from typing import Any

from reward_service import quantile  # nearest rank: the repeat part's own p50 and p90


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pair_medians(calls: list[float]) -> list[float] | None:
    """The two pairs' medians of one evaluation's calls, or None when they cannot be split."""
    if len(calls) < 2 or len(calls) % 2:
        return None
    half = len(calls) // 2
    return [statistics.median(calls[:half]), statistics.median(calls[half:])]


def disagreements(row: dict[str, Any], drift: float) -> dict[str, float] | None:
    if len(row["samples"]) < 2:
        return None
    sides = []
    for evaluation in row["samples"][:2]:
        reference, candidate = pair_medians(evaluation["reference"]), pair_medians(evaluation["candidate"])
        if reference is None or candidate is None:
            return None
        sides.append((reference, candidate))
    (r1, c1), (r2, c2) = sides
    first, second = geometric_mean(r1) / geometric_mean(c1), geometric_mean(r2) / geometric_mean(c2)
    pool = geometric_mean(r1 + r2)
    pooled = pool / geometric_mean(c2)
    checked = second if abs(geometric_mean(r2) / pool - 1) > drift else pooled
    return {
        "paired": abs(first / second - 1),
        "pool": abs(first / pooled - 1),
        "pool_drift_checked": abs(first / checked - 1),
        "candidate_time": abs(geometric_mean(c1) / geometric_mean(c2) - 1),
        "check": abs(geometric_mean(c1) / row["candidate_ms"] - 1),
    }


WAYS = ("paired", "pool", "pool_drift_checked", "candidate_time")


def analyse(path: Path, drift: float) -> list[dict[str, Any]]:
    with gzip.open(path) as handle:
        data = json.loads(handle.read())
    runs = []
    for run in data["runs"]:
        rows = []
        for row in run["rows"]:
            if row["candidate_ms"] < 0.05:
                continue
            found = disagreements(row, drift)
            if found is not None:
                rows.append({"task": row["task"], **{k: round(v, 4) for k, v in found.items()}})
        if not rows:
            continue
        summary: dict[str, Any] = {
            "file": path.name,
            "evaluator_version": data["environment"].get("evaluator_version"),
            "settings": run["settings"],
            "candidates": len(rows),
        }
        for way in WAYS:
            values = sorted(r[way] for r in rows)
            summary[way] = {"p50": quantile(values, 0.5), "p90": quantile(values, 0.9)}
        summary["check"] = max(r["check"] for r in rows)
        summary["rows"] = sorted(rows, key=lambda r: -r["paired"])
        runs.append(summary)
    return runs


def markdown(runs: list[dict[str, Any]], drift: float) -> str:
    lines = [
        f"# A session reference pool, re-analysed from saved repeat runs, {dt.date.today()}",
        "",
        "Disagreement |s1/s2 - 1| over candidates of 50 us and up (p50 / p90): as reported (paired), "
        f"against a pool of both evaluations' reference processes, and the pool with a {drift:.0%} "
        "drift check; and the candidate's own time re-timed, |c1/c2 - 1|. Approximate: each evaluation's "
        "calls split in halves, one per pair (check: the largest gap from the evaluator's own candidate "
        "median in the first evaluation).",
        "",
        "| run | evaluator | settings | candidates | paired | pool | pool, drift-checked "
        "| candidate's own time | check | largest (paired, pool) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        cells = [f"{run[w]['p50']:.2%} / {run[w]['p90']:.2%}" for w in WAYS] + [f"{run['check']:.2%}"]
        largest = ", ".join(f"{r['task']} ({r['paired']:.1%}, {r['pool']:.1%})" for r in run["rows"][:3])
        lines.append(
            f"| {run['file']} | {run['evaluator_version']} | {run['settings']} | {run['candidates']} | "
            + " | ".join(cells)
            + f" | {largest} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "samples", nargs="+", type=Path, help="-samples.json.gz files of two-pair repeat runs"
    )
    parser.add_argument("--drift", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    runs = [run for path in args.samples for run in analyse(path, args.drift)]
    name = f"reference_pool-{dt.date.today()}{'-' + args.tag if args.tag else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"drift": args.drift, "runs": runs}, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(runs, args.drift))
    print(markdown(runs, args.drift))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
