"""Do fresh processes time the same call differently, and does pinning them to one CPU help?
(issue 11, repeatability)

In the repeat benchmark a candidate's speedup moved between two fresh process pairs by far more
than either pair's own 95% interval (1:39 on the H200: 0.90x with interval 0.87-0.93, then
1.13x): something fixed for a process's life, not round-to-round noise. This probe times one
call in many fresh processes, one after another, each as a timing side does (a short sleep,
a cache flush, a synchronisation, one call between CUDA events, 150 rounds), and reports each
process's median. Processes run free (the scheduler places them), pinned to one fixed CPU, or
pinned to each of a few CPUs in turn (does the CPU itself matter?), interleaved so that drift
over the run falls on every mode alike.

    python benchmarks/process_spread.py --device cuda:0 [--processes 8]

Writes `process_spread-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, statistics, sys, time
cpu = sys.argv[1]
if cpu != "free":
    os.sched_setaffinity(0, {int(cpu)})
import torch
def on_cpu():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
flush = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
out, seen = {}, set()
for n in (1024, 2048):
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    for _ in range(5):
        torch.mm(a, b)
    times = []
    for _ in range(150):
        time.sleep(0.002)
        flush.zero_()
        torch.cuda.synchronize()
        start.record()
        torch.mm(a, b)
        torch.cuda.synchronize()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        seen.add(on_cpu())
    out[str(n)] = statistics.median(times)
print(json.dumps({"medians": out, "cpus_seen": sorted(seen)}))
"""


def run_child(cpu: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, cpu], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        return {"cpu": cpu, "error": done.stderr[-400:]}
    return {"cpu": cpu, **json.loads(done.stdout.strip().splitlines()[-1])}


def spread(values: list[float]) -> float | None:
    """max/min - 1 over the processes' medians (4 decimals); None for fewer than two."""
    return round(max(values) / min(values) - 1, 4) if len(values) > 1 and min(values) > 0 else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in ("free", "pinned"):
        chosen = [r for r in rows if r["mode"] == mode and "medians" in r]
        summary[mode] = {
            n: {
                "medians_ms": [round(r["medians"][n], 4) for r in chosen],
                "max_over_min_minus_1": spread([r["medians"][n] for r in chosen]),
            }
            for n in ("1024", "2048")
        }
    per_cpu = [r for r in rows if r["mode"] == "per-cpu" and "medians" in r]
    summary["per_cpu"] = {n: {r["cpu"]: round(r["medians"][n], 4) for r in per_cpu} for n in ("1024", "2048")}
    return summary


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"# Fresh processes timing one call, {report['date']}",
        "",
        f"{report['environment']['gpu']}, {report['environment']['cpus']} CPUs, commit "
        f"`{report['environment']['commit']}`. Each process: 150 rounds of (2 ms sleep, flush, sync, "
        "one timed fp32 matmul); its median. max/min - 1 over the processes of a mode.",
        "",
        "| mode | n | medians (ms), one per process | max/min - 1 |",
        "|---|---|---|---|",
    ]
    for mode in ("free", "pinned"):
        for n, cell in s[mode].items():
            medians = ", ".join(map(str, cell["medians_ms"]))
            lines.append(f"| {mode} | {n} | {medians} | {cell['max_over_min_minus_1']} |")
    for n, by_cpu in s["per_cpu"].items():
        lines.append(f"| per CPU | {n} | {', '.join(f'cpu {c}: {v}' for c, v in by_cpu.items())} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8, help="per mode (free, pinned)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pinned = str(cpus[-1])
    others = [str(c) for c in cpus[:: max(1, len(cpus) // 4)]]
    rows: list[dict[str, Any]] = []
    for index in range(args.processes):
        rows.append({"mode": "free", **run_child("free")})
        rows.append({"mode": "pinned", **run_child(pinned)})
        if index < len(others):
            rows.append({"mode": "per-cpu", **run_child(others[index])})
        print(json.dumps(rows[-3:]), file=sys.stderr)
    import torch

    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    report = {
        "date": stamp,
        "environment": {"gpu": torch.cuda.get_device_name(), "cpus": len(cpus), "commit": commit()},
        "rows": rows,
        "summary": summarise(rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"process_spread-{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"process_spread-{stamp}.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
