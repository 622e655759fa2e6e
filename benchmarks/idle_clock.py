"""Does a timed call start late after the timing thread waited? (issue 11, repeatability)

In the evaluation pipeline a timed round is a few milliseconds of process-to-process messages
with the GPU idle, then a cache flush, a synchronisation and one timed call. Small kernels
(50-500 us) spread by 25-50% there while the same kernels time steadily in a tight loop. This
probe imitates the round without any of the pipeline: for each gap and kernel size it waits the
gap, flushes the last-level cache, synchronises and times one call with CUDA events, and reports
the median and IQR/median of each cell, with the SM clock that NVML reads after the gap. The
thread waits in one of three ways: asleep on the CPU (`sleep`); asleep, then a 1 ms spin of the
GPU (`gpu-spin`, `torch.cuda._sleep`: does a GPU clocked down while idle explain it?); or
polling the CPU clock the whole gap (`poll`: does the waiting thread's own sleep explain it?).

    python benchmarks/idle_clock.py --device cuda:0 [--waits sleep,poll,gpu-spin]

Writes `idle_clock-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git

ROOT = Path(__file__).resolve().parents[1]
GAPS_MS = (0.0, 0.5, 2.0, 10.0, 50.0)
FLUSH_BYTES = 256 * 1024**2
SPIN_CYCLES = 2_000_000  # about 1 ms at 2 GHz


def sm_clock() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # no NVML bindings: the clock column stays empty
        return lambda: None


def wait(gap_ms: float, how: str) -> None:
    if how == "poll":
        until = time.perf_counter() + gap_ms / 1e3
        while time.perf_counter() < until:
            pass
    else:
        time.sleep(gap_ms / 1e3)


def cell(n: int, gap_ms: float, how: str, reps: int, clock: Any) -> dict[str, Any]:
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, clocks = [], []
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    for _ in range(reps):
        wait(gap_ms, how)
        clocks.append(clock())
        if how == "gpu-spin":
            torch.cuda._sleep(SPIN_CYCLES)
        flush.zero_()
        torch.cuda.synchronize()
        start.record()
        torch.mm(a, b)
        torch.cuda.synchronize()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    known = [c for c in clocks if c is not None]
    return {
        "n": n,
        "gap_ms": gap_ms,
        "wait": how,
        "median_ms": round(median, 4),
        "min_ms": round(min(times), 4),
        "iqr_over_median": round((q[2] - q[0]) / median, 4),
        "sm_clock_mhz_median": statistics.median(known) if known else None,
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Idle GPU and timed calls, {report['date']}",
        "",
        f"{env['gpu']}, torch {env['torch']}, commit `{env['commit']}`, {report['reps']} calls per cell. "
        "Each call: the wait, cache flush, synchronise, one timed fp32 matmul.",
        "",
        "| n | gap ms | wait | median ms | min ms | IQR / median | SM MHz after gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        lines.append(
            f"| {c['n']} | {c['gap_ms']} | {c['wait']} | {c['median_ms']} | {c['min_ms']} "
            f"| {c['iqr_over_median']:.1%} | {c['sm_clock_mhz_median']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--waits", default="sleep,poll", help="of sleep, poll, gpu-spin")
    parser.add_argument("--sizes", default="1024,2048,4096", help="matmul sizes (n x n, fp32)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.cuda.set_device(torch.device(args.device))
    clock = sm_clock()
    sizes = [int(n) for n in args.sizes.split(",")]
    waits = args.waits.split(",")
    cells = [cell(n, gap, how, args.reps, clock) for n in sizes for gap in GAPS_MS for how in waits]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    report = {
        "date": stamp,
        "environment": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "commit": commit(),
        },
        "reps": args.reps,
        "cells": cells,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"idle_clock-{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"idle_clock-{stamp}.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
