"""Is a process's timing offset in its kernel launches or in its memory traffic? (issue 11)

placement_probe --epochs showed that a 45-65 us KernelBench call keeps an offset for its process's
life (1-3% sd over processes) that neither time nor a fresh placement inside the process moves,
and that several subjects in one process share it. This probe times, in fresh processes, the way
the timing lane does (a ~1 ms lead of flush writes, one call between events): a chain of small
kernels (launch-bound on the GPU side) and one large copy (bandwidth-bound). If the chain's
median moves over processes and the copy's does not, the offset is per launch.

    python benchmarks/launch_offset.py --processes 6 [--device cuda] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, statistics, sys, time
import torch
dev = torch.device(sys.argv[1]); cuda = dev.type == "cuda"
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
out = {}
for name, fn in (("chain of 20 small kernels", chain), ("one 64 MiB copy", copy)):
    for _ in range(5):
        timed(fn)
    times = []
    for _ in range(200):
        time.sleep(0.002)
        times.append(timed(fn))
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    name = f"launch_offset-{stamp}{'-' + args.tag if args.tag else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, float]] = []
    for index in range(args.processes):
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, args.device],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            print(f"process {index + 1}: {done.stderr[-400:]}", file=sys.stderr)
            continue
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"process {index + 1}/{args.processes}: {runs[-1]}", file=sys.stderr)
        lines = [
            f"# Launches or traffic: a process's offset, {stamp}",
            "",
            f"commit `{commit()}`, device {args.device}, {len(runs)} fresh processes, 200 rounds each "
            "behind a ~1 ms lead of flush writes; per-process medians in us.",
            "",
            "| subject | medians per process | sd over the mean | max/min - 1 |",
            "|---|---|---|---|",
        ]
        for subject in runs[0]:
            values = [run[subject] for run in runs]
            sd = statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0
            each = ", ".join(f"{v * 1000:.1f}" for v in values)
            lines.append(f"| {subject} | {each} | {sd:.4f} | {max(values) / min(values) - 1:.4f} |")
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        (args.out / f"{name}.json").write_text(
            json.dumps({"date": stamp, "commit": commit(), "runs": runs}) + "\n"
        )
    print((args.out / f"{name}.md").read_text() if runs else "no process finished")
    return 0 if runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
