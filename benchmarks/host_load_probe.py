"""Does a reference bound by the host time differently on a quiet machine and a busy one?
(issue 11, "what pairing does not cancel")

On the H200, 3:28's reference (kernelbench-v0: training mode, autograd on) timed 1.47 ms in a
busy pipeline and 2.90 ms with one evaluation at a time, while its candidate timed 1.144 ms in
both. This probe times KernelBench references in ONE process (so that no process offset enters)
in three phases: quiet, with every other CPU busy spinning, quiet again; each call between CUDA
events after a synchronize, as KernelBench's harness does. It reports each phase's median, IQR
and the CPUs' mean clock (/proc/cpuinfo) while it ran. Quiet, busy, quiet tells load from drift.

    python benchmarks/host_load_probe.py --tasks 3:28,3:42,3:18 [--seconds 3]

Writes `host_load_probe-<date>[-<tag>].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git

from kernelfleet.core.tasks import load_tasks


def spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def cpu_mhz() -> float | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as handle:
            clocks = [float(line.split(":")[1]) for line in handle if line.startswith("cpu MHz")]
    except OSError:
        return None
    return round(statistics.mean(clocks), 1) if clocks else None


def time_calls(model: Any, inputs: list[Any], seconds: float, cuda: bool) -> dict[str, Any]:
    """Calls between CUDA events after a synchronize (on a CPU, a wall clock: a smoke run)."""

    def one() -> float:
        if not cuda:
            begin = time.perf_counter()
            model(*inputs)
            return (time.perf_counter() - begin) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        model(*inputs)
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))

    for _ in range(3):
        one()
    times: list[float] = []
    clocks: list[float | None] = []
    began = time.monotonic()
    while time.monotonic() - began < seconds or len(times) < 10:
        times.append(one())
        if len(times) % 10 == 0:
            clocks.append(cpu_mhz())
    q = statistics.quantiles(times, n=4)
    known = [c for c in clocks if c is not None]
    return {
        "calls": len(times),
        "median_ms": round(statistics.median(times), 4),
        "iqr_share": round((q[2] - q[0]) / statistics.median(times), 4),
        "min_ms": round(min(times), 4),
        "cpu_mhz": round(statistics.mean(known), 1) if known else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="3:28,3:42,3:18")
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per task and phase")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the probe itself")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    wanted = [name.strip() for name in args.tasks.split(",") if name.strip()]
    tasks = {f"{t.level}:{t.task_id}": t for t in load_tasks("kernelbench-v0")}
    missing = [name for name in wanted if name not in tasks]
    if missing:
        parser.error(f"--tasks {missing}: not kernelbench-v0 tasks; name them LEVEL:ID, e.g. 3:28")
    subjects = []
    for name in wanted:
        space: dict[str, Any] = {}
        exec(compile(tasks[name].code, name, "exec"), space)  # KernelBench's own reference
        torch.manual_seed(0)
        model = space["Model"](*space["get_init_inputs"]()).to(args.device)  # v0: training mode, autograd on
        inputs = [x.to(args.device) if isinstance(x, torch.Tensor) else x for x in space["get_inputs"]()]
        subjects.append((name, model, inputs))
    rows = []
    busy = max(1, (os.cpu_count() or 2) - 1)
    for phase in ("quiet", "busy", "quiet again"):
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(busy)]
        if phase == "busy":
            for process in spinners:
                process.start()
            time.sleep(0.5)
        try:
            for name, model, inputs in subjects:
                rows.append(
                    {
                        "task": name,
                        "phase": phase,
                        **time_calls(model, inputs, args.seconds, args.device.startswith("cuda")),
                    }
                )
                print(rows[-1], flush=True)
        finally:
            stop.set()
            for process in spinners:
                if process.is_alive():
                    process.join(5)
    report = {
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "spinning_processes": busy,
        "rows": rows,
    }
    lines = [
        f"# A host-bound reference on a quiet and a busy machine, {report['date'][:10]}",
        "",
        f"{report['gpu']}, torch {report['torch']}, {report['cpus']} CPUs, commit `{report['commit']}`; "
        f"one process, kernelbench-v0 (training mode, autograd on); busy: {busy} processes spinning.",
        "",
        "| task | phase | calls | median ms | IQR / median | min ms | CPUs' mean MHz |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['phase']} | {r['calls']} | {r['median_ms']} | {r['iqr_share']:.1%} | "
            f"{r['min_ms']} | {r['cpu_mhz']} |"
        )
    name = f"host_load_probe-{report['date'][:10]}{'-' + args.tag if args.tag else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
