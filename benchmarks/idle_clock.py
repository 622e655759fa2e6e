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

With `--clocks device,stream,stream+lead300` it times the same cells with the evaluator's own
clocks instead (`EvalConfig.timing_clock` and `timing_lead_us`, written `<clock>[+lead<us>]`),
each clock's calls interleaved with the others' so that all see the same machine, and adds a
small elementwise call (a 16M-element tanh) to the matmuls. (The second run of 2026-12-03 also
had a warm-up waited for on the host, `+warm<us>`, since withdrawn: it did not help.)

Writes `idle_clock-<date>[-clocks].json` and `.md` into --out.
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
    known = [c for c in clocks if c is not None]
    return {
        "n": n,
        "gap_ms": gap_ms,
        "wait": how,
        **spread(times),
        "sm_clock_mhz_median": statistics.median(known) if known else None,
    }


def spread(times: list[float]) -> dict[str, float]:
    """A cell's median, fastest call and IQR over median (ms, 4 decimals)."""
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    return {
        "median_ms": round(median, 4),
        "min_ms": round(min(times), 4),
        "iqr_over_median": round((q[2] - q[0]) / median, 4),
    }


def parse_clock(name: str) -> dict[str, Any]:
    """`stream+lead300` -> {"mode": "stream", "lead_us": 300.0}."""
    mode, _, lead = name.partition("+lead")
    return {"mode": mode, "lead_us": float(lead or 0)}


def clock_cells(size: str, gap_ms: float, clocks: list[str], reps: int) -> list[dict[str, Any]]:
    """One call timed `reps` times by each clock, the clocks taking turns after each wait."""
    from kernelfleet.evaluator._timing import _Clock

    device = torch.device("cuda", torch.cuda.current_device())
    if size.startswith("tanh"):
        x = torch.randn(int(size[4:]), device=device)

        def call() -> Any:
            return torch.tanh(x)
    else:
        a = torch.randn(int(size), int(size), device=device)
        b = torch.randn(int(size), int(size), device=device)

        def call() -> Any:
            return torch.mm(a, b)

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    timers = {name: _Clock(device, flush=flush, **parse_clock(name)) for name in clocks}
    samples: dict[str, list[float]] = {name: [] for name in clocks}
    naive: dict[str, list[float]] = {name: [] for name in clocks}
    for _ in range(3):
        call()
    for _ in range(reps):
        for name, timer in timers.items():
            time.sleep(gap_ms / 1e3)
            flush.zero_()
            timer.sync()
            ms, stream_ms, _, _ = timer.measure(call)
            samples[name].append(ms)
            naive[name].append(stream_ms if stream_ms is not None else ms)
    return [
        {
            "size": size,
            "gap_ms": gap_ms,
            "clock": name,
            **spread(samples[name]),
            "stream_median_ms": round(statistics.median(naive[name]), 4),
        }
        for name in clocks
    ]


def clocks_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# The evaluator's clocks on one process's calls, {report['date']}",
        "",
        f"{env['gpu']}, torch {env['torch']}, commit `{env['commit']}`, {report['reps']} calls per cell and "
        "clock, the clocks taking turns. Each call: a CPU sleep of the gap, cache flush, synchronise, one "
        "call timed by the clock. stream ms: the caller's-stream figure of the same calls.",
        "",
        "| call | gap ms | clock | median ms | min ms | IQR / median | stream ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        lines.append(
            f"| {c['size']} | {c['gap_ms']} | {c['clock']} | {c['median_ms']} | {c['min_ms']} "
            f"| {c['iqr_over_median']:.1%} | {c['stream_median_ms']} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--clocks", default="", help="evaluator clocks, e.g. device,stream,stream+lead300")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.cuda.set_device(torch.device(args.device))
    clock = sm_clock()
    sizes = [int(n) for n in args.sizes.split(",")]
    waits = args.waits.split(",")
    clocks = [c for c in args.clocks.split(",") if c]
    if clocks:
        cells = [
            c
            for size in ("512", "1024", "2048", "tanh16777216")
            for gap in (0.0, 2.0, 10.0)
            for c in clock_cells(size, gap, clocks, args.reps)
        ]
    else:
        cells = [cell(n, gap, how, args.reps, clock) for n in sizes for gap in GAPS_MS for how in waits]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d") + ("-clocks" if clocks else "")
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
    text = clocks_markdown(report) if clocks else markdown(report)
    (out / f"idle_clock-{stamp}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
