"""Would timing in two process pairs make re-timings agree? (issue 11, `timing_processes`)

Re-analyses a repeat run of `benchmarks/reward_service.py` with two settings side by side
(`--repeat-config A;B`): each candidate was then timed in four fresh process pairs, two per
setting. Taking one pair of each setting as one evaluation of two pairs (two ways to split the
four), it compares, at the 50th and 90th percentile (nearest rank) over candidates of 50 us and
more, the disagreement |s1/s2 - 1| of:

- single pairs (what one pair per evaluation gives: both settings' own two pairs);
- two pairs combined as `timing_processes` does (geometric mean of the pairs' speedups);
- two pairs pooled under one median (all their calls together);
- each side's fastest process: the lower of the two pairs' reference medians over the lower of
  their candidate medians (a process's offset only ever slows it, so the faster process of each
  side is the nearer to none).

The two settings should be ones that do not move the speedup; where one does for a candidate,
pairing a process of each flatters the combination for it (the report lists each candidate's
four speedups so that a reader can see).

    python benchmarks/process_pairs.py benchmarks/results/reward_service-2026-12-03-spread-samples.json.gz

Writes `process_pairs-<date>[-<tag>].json` and `.md` into --out.
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

Calls = dict[str, list[float]]


def ratio(calls: Calls) -> float:
    return statistics.median(calls["reference"]) / statistics.median(calls["candidate"])


def pooled(a: Calls, b: Calls) -> float:
    return statistics.median(a["reference"] + b["reference"]) / statistics.median(
        a["candidate"] + b["candidate"]
    )


def fastest(a: Calls, b: Calls) -> float:
    return min(statistics.median(a["reference"]), statistics.median(b["reference"])) / min(
        statistics.median(a["candidate"]), statistics.median(b["candidate"])
    )


def apart(x: float, y: float) -> float:
    return abs(x / y - 1)


def analyse(report: dict[str, Any], min_ms: float) -> dict[str, Any]:
    runs = report["runs"]
    if len(runs) < 2:
        raise SystemExit("the samples hold one setting: run the repeat part with --repeat-config 'A;B'")
    by_row = [
        {row["row"]: row for row in run["rows"] if len(row.get("samples", [])) == 2} for run in runs[:2]
    ]
    rows: list[dict[str, Any]] = []
    figures: dict[str, list[float]] = {
        "single": [],
        "geometric mean": [],
        "pooled median": [],
        "fastest process": [],
    }
    for index in sorted(set(by_row[0]) & set(by_row[1])):
        (w1, w2), (s1, s2) = by_row[0][index]["samples"], by_row[1][index]["samples"]
        if statistics.median(w1["candidate"]) < min_ms:
            continue
        r = [ratio(c) for c in (w1, w2, s1, s2)]
        figures["single"] += [apart(r[0], r[1]), apart(r[2], r[3])]
        for first, second in (((0, 2), (1, 3)), ((0, 3), (1, 2))):  # the two ways to split four in two
            geo = [math.sqrt(r[i] * r[j]) for i, j in (first, second)]
            figures["geometric mean"].append(apart(*geo))
        calls = [w1, w2, s1, s2]
        figures["pooled median"] += [
            apart(pooled(calls[0], calls[2]), pooled(calls[1], calls[3])),
            apart(pooled(calls[0], calls[3]), pooled(calls[1], calls[2])),
        ]
        figures["fastest process"] += [
            apart(fastest(calls[0], calls[2]), fastest(calls[1], calls[3])),
            apart(fastest(calls[0], calls[3]), fastest(calls[1], calls[2])),
        ]
        rows.append({"task": by_row[0][index]["task"], "speedups": [round(v, 4) for v in r]})
    summary = {
        name: {
            "comparisons": len(values),
            "p50": quantile(sorted(values), 0.5),
            "p90": quantile(sorted(values), 0.9),
            "max": max(values, default=None),
        }
        for name, values in figures.items()
    }
    return {"settings": [run["settings"] for run in runs[:2]], "candidates": rows, "summary": summary}


def markdown(result: dict[str, Any], source: str, min_ms: float) -> str:
    lines = [
        f"# Two process pairs against one, re-analysed: `{source}`",
        "",
        f"Settings {result['settings'][0]} and {result['settings'][1]}; candidates of {min_ms * 1000:g} us "
        f"and more: {len(result['candidates'])}. Disagreement |s1/s2 - 1| (nearest rank).",
        "",
        "| combination | comparisons | p50 | p90 | largest |",
        "|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        cells = [f"{s[k]:.2%}" if s[k] is not None else "-" for k in ("p50", "p90", "max")]
        lines.append(f"| {name} | {s['comparisons']} | {' | '.join(cells)} |")
    lines += ["", "| task | speedups: setting 1 twice, setting 2 twice |", "|---|---|"]
    lines += [f"| {r['task']} | {', '.join(map(str, r['speedups']))} |" for r in result["candidates"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", help="a reward_service-...-samples.json.gz of a run with two settings")
    parser.add_argument("--min-ms", type=float, default=0.05, help="smallest candidate median counted")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    with gzip.open(args.samples, "rt", encoding="utf-8") as handle:
        report = json.load(handle)
    result = analyse(report, args.min_ms)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    name = f"process_pairs-{stamp}{'-' + args.tag if args.tag else ''}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"source": args.samples, **result}, indent=1) + "\n")
    text = markdown(result, Path(args.samples).name, args.min_ms)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
