"""How well do two fresh processes agree on a speedup, estimator by estimator? (issue 11)

Reads the timed calls that `benchmarks/reward_service.py`'s repeat part keeps
(`reward_service-<date>[-<tag>]-samples.json.gz`: per run, per candidate, both evaluations'
reference and candidate milliseconds, round by round) and computes, for each estimator of the
speedup, the disagreement of the two evaluations |s1/s2 - 1| at the 50th and 90th percentile
over candidates of 50 us and more. Every estimator sees the same calls, so the comparison is
side by side by construction: only the statistic differs. For each it also gives the median 95%
bootstrap half width (paired rounds, or runs of --block rounds, resampled together), how often
the two evaluations' intervals overlap, and the two estimates' gap in standard errors (z: about
|N(0, 1)| when the intervals hold across processes).

    python benchmarks/timing_estimators.py benchmarks/results/reward_service-2026-12-03-turns-samples.json.gz

Writes `timing_estimators-<date>[-<tag>].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from reward_service import quantile  # nearest rank: the repeat part's own p50 and p90

Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]


def trimmed_mean(values: np.ndarray, share: float) -> np.ndarray:
    """Mean of what is left after cutting `share` off each end, along the last axis."""
    ordered = np.sort(values, axis=-1)
    n = ordered.shape[-1]
    cut = int(share * n)
    return ordered[..., cut : n - cut].mean(axis=-1)


def _log_ratio(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(ref, 1e-9)) - np.log(np.maximum(cand, 1e-9))


# Each takes the reference and candidate calls, paired round by round along the last axis (a
# leading axis holds bootstrap resamples), and returns the speedup.
ESTIMATORS: dict[str, Estimator] = {
    "median ratio (today)": lambda r, c: np.median(r, axis=-1) / np.median(c, axis=-1),
    "mean ratio": lambda r, c: r.mean(axis=-1) / c.mean(axis=-1),
    "10%-trimmed mean ratio": lambda r, c: trimmed_mean(r, 0.1) / trimmed_mean(c, 0.1),
    "interquartile mean ratio": lambda r, c: trimmed_mean(r, 0.25) / trimmed_mean(c, 0.25),
    "10th percentile ratio": lambda r, c: np.quantile(r, 0.1, axis=-1) / np.quantile(c, 0.1, axis=-1),
    "paired median": lambda r, c: np.exp(np.median(_log_ratio(r, c), axis=-1)),
    "paired interquartile mean": lambda r, c: np.exp(trimmed_mean(_log_ratio(r, c), 0.25)),
}


def interval(
    ref: np.ndarray, cand: np.ndarray, estimator: Estimator, seed: int, block: int = 1
) -> tuple[float, float, float]:
    """The estimate and its 95% paired-bootstrap interval (1000 resamples), resampling runs of
    `block` consecutive rounds (1: single rounds, as the evaluator does): rounds close in time
    share a slow or fast spell, which single-round resampling takes for independent evidence."""
    n = len(cand)
    block = max(1, min(block, n))
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - block + 1, size=(1000, -(-n // block)))
    picks = (starts[:, :, None] + np.arange(block)).reshape(1000, -1)[:, :n]
    resampled = estimator(ref[picks], cand[picks])
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float(estimator(ref, cand)), float(low), float(high)


def analyse_run(run: dict[str, Any], min_ms: float, block: int, clock: str = "") -> dict[str, Any]:
    """`clock` "stream": the calls' caller's-stream figures (`<side>_stream`) instead of the samples;
    the candidates counted are the same (their reported median)."""
    suffix = "_stream" if clock == "stream" else ""
    rows = [
        row
        for row in run["rows"]
        if len(row.get("samples", [])) == 2
        and row["candidate_ms"] >= min_ms
        and all(f"candidate{suffix}" in evaluation for evaluation in row["samples"])
    ]
    figures: dict[str, Any] = {}
    for name, estimator in ESTIMATORS.items():
        disagreements, half_widths, overlaps, scores = [], [], 0, []
        per_task = {}
        for number, row in enumerate(rows):
            ends = []
            for side, evaluation in enumerate(row["samples"]):
                ref = np.asarray(evaluation[f"reference{suffix}"], dtype=np.float64)
                cand = np.asarray(evaluation[f"candidate{suffix}"], dtype=np.float64)
                n = min(len(ref), len(cand))
                ends.append(interval(ref[:n], cand[:n], estimator, seed=number * 2 + side, block=block))
            (s1, l1, h1), (s2, l2, h2) = ends
            disagreement = abs(s1 / s2 - 1)
            disagreements.append(disagreement)
            half_widths += [(h1 - l1) / 2 / s1, (h2 - l2) / 2 / s2]
            overlaps += int(l1 <= h2 and l2 <= h1)
            # The gap in standard errors (from each interval's log width): about |N(0, 1)|, with
            # p90 near 1.64, when the intervals hold across processes.
            errors = [(np.log(h) - np.log(lo)) / 2 / 1.96 for lo, h in ((l1, h1), (l2, h2))]
            scores.append(float(abs(np.log(s1 / s2)) / max(float(np.hypot(*errors)), 1e-12)))
            per_task[row["task"]] = round(disagreement, 4)
        figures[name] = {
            "pairs": len(rows),
            "p50": quantile(sorted(disagreements), 0.5),
            "p90": quantile(sorted(disagreements), 0.9),
            "max": quantile(sorted(disagreements), 1.0),
            "median_half_width": quantile(sorted(half_widths), 0.5),
            "intervals_overlap": overlaps,
            "z_p50": quantile(sorted(scores), 0.5),
            "z_p90": quantile(sorted(scores), 0.9),
            "per_task": per_task,
        }
    return {"settings": run.get("settings", {}), "clock": clock or "as timed", "estimators": figures}


def _stream_is_sample(row: dict[str, Any]) -> bool:
    return all(
        evaluation.get(f"{side}_stream") == evaluation.get(side)
        for evaluation in row.get("samples", [])
        for side in ("reference", "candidate")
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Speedup estimators on the same timed calls, {report['date']}",
        "",
        f"Source: {', '.join(report['sources'])} ({report['environment'].get('gpu', '?')}, commit "
        f"`{report['environment'].get('commit', '?')}`). Disagreement of two fresh-process evaluations "
        f"|s1/s2 - 1| over candidates of {report['min_ms'] * 1000:g} us and more; half width: the median "
        f"95% paired-bootstrap half width over the evaluations (runs of {report['block']} rounds resampled); "
        "overlap: pairs whose two intervals overlap; z: the two estimates' gap in standard errors taken "
        "from their intervals (p50 0.67 and p90 1.64 when the intervals hold across processes).",
        "",
    ]
    for run in report["runs"]:
        lines += [
            f"## {run['source']}: {run['settings']}, clock {run['clock']}",
            "",
            "| estimator | pairs | p50 | p90 | max | half width | intervals overlap | z p50 / p90 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, f in run["estimators"].items():
            lines.append(
                f"| {name} | {f['pairs']} | {f['p50']} | {f['p90']} | {f['max']} | {f['median_half_width']} "
                f"| {f['intervals_overlap']} of {f['pairs']} | {f['z_p50']} / {f['z_p90']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", nargs="+", help="reward_service-...-samples.json.gz files")
    parser.add_argument("--min-ms", type=float, default=0.05, help="smallest candidate median counted")
    parser.add_argument("--block", type=int, default=1, help="rounds per resampled run (1: single rounds)")
    parser.add_argument(
        "--clocks",
        default="",
        help="also 'stream': the same calls' caller's-stream figures, where the samples file has them",
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    environment: dict[str, Any] = {}
    for path in map(Path, args.samples):
        data = json.loads(gzip.decompress(path.read_bytes()))
        environment = data.get("environment", environment)
        for run in data["runs"]:
            for clock in ["", *[c for c in args.clocks.split(",") if c]]:
                figures = analyse_run(run, args.min_ms, args.block, clock)
                if clock and not any(f["pairs"] for f in figures["estimators"].values()):
                    continue  # no caller's-stream figures kept in this file
                if clock and all(_stream_is_sample(row) for row in run["rows"]):
                    continue  # timed on the stream clock: its samples are those figures already
                runs.append({"source": path.name, **figures})
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    report = {
        "date": stamp,
        "environment": environment,
        "sources": [Path(p).name for p in args.samples],
        "min_ms": args.min_ms,
        "block": args.block,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"timing_estimators-{stamp}{'-' + args.tag if args.tag else ''}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    print(f"wrote {out / name}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
