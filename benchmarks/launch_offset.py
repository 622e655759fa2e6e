"""Is a process's timing offset in its kernel launches or in its memory traffic? (issue 11)

placement_probe --epochs showed that a 45-65 us KernelBench call keeps an offset for its process's
life (1-3% sd over processes) that neither time nor a fresh placement inside the process moves,
and that several subjects in one process share it. This probe times, in fresh processes, the way
the timing lane does (a ~1 ms lead of flush writes, one call between events): a chain of small
kernels (launch-bound on the GPU side), the same chain captured as one CUDA graph, and one large
copy (bandwidth-bound). If the chain's median moves over processes and the copy's does not, the
offset is per launch; if the graph's holds still, it is in submitting launches, not running them.

On the H200 (launch_offset-2026-12-03-h200.md) the chain moved by 10% over 8 processes (two
levels, about 37.0 and 39.6-40.4 us) and the copy by 0.5%. --pins asks whether that is where the
process started its CUDA context: pinned, before CUDA starts, to the CPUs local to the GPU, to the
others, or left free, interleaved. On the one-node H200 machine (launch_offset-2026-12-03-pins.md)
every CPU is local, the two levels came whatever the pin, and the chain as one CUDA graph held within
0.3%: the level is in submitting launches one by one (placement_probe --chain then showed that real
short calls follow it, which EvalConfig.launch_tolerance uses).

    python benchmarks/launch_offset.py --processes 6 --pins free,local,remote [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git

from kernelfleet.evaluator._environment import local_cpus

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, statistics, sys, time
cpus = json.loads(sys.argv[2])
if cpus:  # before torch and its CUDA context: where the driver's host-side buffers are first touched
    os.sched_setaffinity(0, cpus)
import torch
dev = torch.device(sys.argv[1]); cuda = dev.type == "cuda"
torch.zeros(1, device=dev)  # the context, created here
init_cpu = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])  # field 39: the CPU it ran on
flush = torch.empty(256 * 1024**2, dtype=torch.uint8, device=dev)
small = torch.zeros(1024, device=dev)
big_in = torch.ones(16 * 1024**2, device=dev); big_out = torch.empty_like(big_in)
def chain():
    for _ in range(20):
        small.add_(1.0)
def copy():
    big_out.copy_(big_in)
def timed(fn):
    for _ in range(12):
        flush.zero_()
    if not cuda:
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(); e.record(); e.synchronize()
    return s.elapsed_time(e)
subjects = [("chain of 20 small kernels", chain), ("one 64 MiB copy", copy)]
if cuda:  # the same chain submitted as one launch: is the offset in submitting or in running kernels?
    chain(); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    subjects.append(("the chain as one CUDA graph", graph.replay))
out = {}
for name, fn in subjects:
    for _ in range(5):
        timed(fn)
    times = []
    for _ in range(200):
        time.sleep(0.002)
        times.append(timed(fn))
    out[name] = statistics.median(times)
print(json.dumps({"medians": out, "init_cpu": init_cpu}))
"""


def cpu_sets() -> dict[str, list[int]]:
    """The CPUs this process may use, split into those local to GPU 0 (the evaluator's
    `local_cpus`, by the PCI address nvidia-smi gives) and the others; an empty local list
    where the machine does not say."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        bus = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        bus = ""
    # nvidia-smi names the domain with 8 digits ('00000000:19:00.0'), sysfs with 4.
    local = list(local_cpus(bus[-12:])) if bus else []
    return {"free": [], "local": local, "remote": [cpu for cpu in allowed if cpu not in local]}


def node_of(cpu: int) -> int | None:
    """The NUMA node of one CPU (sysfs), None where it does not say."""
    nodes = list(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"))
    return int(nodes[0].name[4:]) if nodes else None


def report_lines(
    stamp: str, device: str, runs: list[dict[str, Any]], sets: dict[str, list[int]]
) -> list[str]:
    lines = [
        f"# Launches or traffic: a process's offset, {stamp}",
        "",
        f"commit `{commit()}`, device {device}, {len(runs)} fresh processes, 200 rounds each behind a "
        "~1 ms lead of flush writes; per-process medians in us, with the CPU (NUMA node) the process "
        f"created its CUDA context on. CPUs local to GPU 0: {sets['local'] or 'not known'}; others: "
        f"{sets['remote'] or 'none'}.",
        "",
        "| subject | pinned to | medians per process (CPU/node at init) | sd over the mean | max/min - 1 |",
        "|---|---|---|---|---|",
    ]
    for subject in runs[0]["medians"]:
        for mode in sets:
            chosen = [run for run in runs if run["pin"] == mode]
            if not chosen:
                continue
            values = [run["medians"][subject] for run in chosen]
            sd = statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0
            each = ", ".join(
                f"{run['medians'][subject] * 1000:.1f} ({run['init_cpu']}/{run['init_node']})"
                for run in chosen
            )
            lines.append(f"| {subject} | {mode} | {each} | {sd:.4f} | {max(values) / min(values) - 1:.4f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6, help="fresh processes per pinning")
    parser.add_argument(
        "--pins",
        default="free",
        help="comma list, interleaved: free (no affinity), local (the CPUs local to GPU 0, set before "
        "CUDA starts), remote (the other CPUs); one a machine cannot tell apart is skipped",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    sets = cpu_sets()
    pins = [pin.strip() for pin in args.pins.split(",") if pin.strip()]
    unknown = sorted(set(pins) - set(sets))
    if unknown:
        raise SystemExit(f"--pins {','.join(unknown)}: choose from {', '.join(sets)}")
    pins = [pin for pin in pins if pin == "free" or sets[pin]]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    name = f"launch_offset-{stamp}{'-' + args.tag if args.tag else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for index in range(args.processes * len(pins)):
        pin = pins[index % len(pins)]
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, args.device, json.dumps(sets[pin])],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            print(f"process {index + 1}: {done.stderr[-400:]}", file=sys.stderr)
            continue
        run = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append({"pin": pin, **run, "init_node": node_of(run["init_cpu"])})
        print(f"process {index + 1}/{args.processes * len(pins)}: {runs[-1]}", file=sys.stderr)
        # Saved after every process: a run cut short by its call's limit still leaves its figures.
        lines = report_lines(stamp, args.device, runs, sets)
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        (args.out / f"{name}.json").write_text(
            json.dumps({"date": stamp, "commit": commit(), "cpus": sets, "runs": runs}) + "\n"
        )
    print((args.out / f"{name}.md").read_text() if runs else "no process finished")
    return 0 if runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
