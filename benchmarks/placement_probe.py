"""Why does a short call time differently in a fresh process: the kernels it picked, or where its
memory lies? (issue 11, repeatability)

Under evaluator 0.7.0's clock, calls of 0.1 ms and more agree within 0.7% between two fresh
processes, but a few level-2 calls of 50-70 us moved by up to 6% with tight distributions inside
each process (2:33's reference: 0.0487 then 0.0512 ms). This probe times real KernelBench
subjects (references, and the published candidates that build nothing) in several fresh
processes, the way the timing lane does (strict profile: eval mode, no grad, no TF32; a cache
flush, about 1 ms of lead writes, one call between events on the caller's stream, a 2 ms host
wait between rounds). In each process every subject is built once and then copied a few times
into new memory, a padding allocation of random size between copies, and the copies' rounds are
interleaved. Per subject it reports:

- whether every process launched the same kernels (torch.profiler's kernel names): if not, the
  shift is an algorithm choice made per process;
- the spread of the first copy's median over processes (what two evaluations see today);
- the spread of the copies' medians inside one process (placement alone, same process);
- the spread over processes of the median over all copies (what timing over several placements
  would see).

With --epochs N each subject is instead timed in N blocks of rounds, alternating a pause in one
placement with a fresh placement (weights, inputs, outputs and intermediates all elsewhere): does a
process's offset move with time, with where its memory lies, or only with the process?

    python benchmarks/placement_probe.py --kernels .data/cuda-l1-h100-kernels.jsonl \\
        --tasks 2:33,2:22 [--processes 8 --copies 4 --rounds 60]

Writes `placement_probe-<date>[-<tag>].json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_evaluator import commit  # $KERNELFLEET_COMMIT, else git
from process_spread import spread
from reward_service import is_native, load_workload

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import copy, hashlib, json, random, statistics, sys, time
import torch
spec = json.loads(sys.stdin.read())
if spec["profile"] == "strict":  # eval mode, no grad, no TF32; kernelbench-v0 leaves torch's defaults
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
torch.backends.cudnn.benchmark = spec["cudnn_benchmark"]
dev = torch.device(spec["device"])
cuda = dev.type == "cuda"
size = (256 if cuda else 8) * 1024**2
began = time.perf_counter()
flush = torch.empty(size, dtype=torch.uint8, device=dev)  # the CUDA context is made here
context_s = time.perf_counter() - began
pool = torch.empty(2 * size, dtype=torch.uint8, device=dev) if "spread" in spec["flushes"] else None
sink = torch.zeros((), dtype=torch.int64, device=dev)
rng = random.Random()
if cuda:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.zero_(); torch.cuda.synchronize()
    start.record()
    for _ in range(4):
        flush.zero_()
    end.record(); end.synchronize()
    reps = max(1, round(1000 / (start.elapsed_time(end) * 1e3 / 4)))
    torch.cuda._sleep(1000); torch.cuda.synchronize()
    start.record(); torch.cuda._sleep(1_000_000); end.record(); end.synchronize()
    spin = int(1_000_000 * 1.0 / start.elapsed_time(end))  # cycles of about 1 ms
else:  # a smoke test of the probe itself: wall clock, no lead
    reps = 1
def lead(kind):
    # write: the evaluator's default (the flush buffer written, the call starts after its dirty
    # lines); spread: a window at a random place in a buffer twice the size, then read (clean
    # lines, a different place each call); warm: no flush, a spin of the same length.
    if kind == "warm":
        if cuda:
            torch.cuda._sleep(spin)
        return
    window = flush
    if kind == "spread":
        window = pool.narrow(0, rng.randrange(0, size + 1, 2 * 1024**2), size)
    for _ in range(reps):
        window.zero_()
    if kind == "spread":
        torch.sum(window, dim=0, dtype=torch.int64, out=sink)
def timed(model, inputs, kind):
    lead(kind)
    if not cuda:
        begin = time.perf_counter()
        model(*inputs)
        return (time.perf_counter() - begin) * 1e3
    start.record()
    out = model(*inputs)
    end.record()
    end.synchronize()
    torch.cuda.synchronize()
    del out
    return start.elapsed_time(end)
def kernels(model, inputs):
    from torch.profiler import ProfilerActivity, profile
    kind = "CUDA" if cuda else "CPU"
    with profile(activities=[getattr(ProfilerActivity, kind)]) as prof:
        model(*inputs)
        if cuda:
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == kind]
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:10], names
def epochs(make, model, inputs):
    # Blocks of rounds of one subject: an odd block is the block before it again after a pause
    # (same memory, later in time); an even one, after the first, a fresh copy placed anew (the
    # cache released, a held pad of random size ahead of it, so its inputs, weights, outputs and
    # intermediates all land elsewhere). Time against placement, inside one process.
    base_inputs = [x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs]
    held, medians = [], []
    for block in range(spec["epochs"]):
        if block and block % 2 == 0:
            del held[:]
            model = inputs = None
            if cuda:
                torch.cuda.empty_cache()
            held = [torch.empty(rng.randrange(1, 256) * 1024**2 + rng.randrange(4096) * 512,
                                dtype=torch.uint8, device=dev) for _ in range(1 + rng.randrange(3))]
            model = make()  # built again from the same seed: deepcopy fails on some candidates
            inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in base_inputs]
            for _ in range(3):
                model(*inputs)
        elif block:
            time.sleep(spec["epoch_gap"])
        times = []
        for _ in range(spec["rounds"]):
            time.sleep(0.002)
            times.append(timed(model, inputs, spec["flushes"][0]))
        medians.append(statistics.median(times))
    return medians
subjects = spec["subjects"]
order = list(range(len(subjects)))
rng.shuffle(order)
out = {}
def probe(s):
    ns = {}
    exec(compile(s["code"], s["label"], "exec"), ns)
    def make():
        torch.manual_seed(0)
        model = ns[s["cls"]](*ns["get_init_inputs"]()).to(dev)
        return model.eval() if spec["profile"] == "strict" else model
    model = make()
    torch.manual_seed(1)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in ns["get_inputs"]()]
    for _ in range(10):
        model(*inputs)
    if cuda:
        torch.cuda.synchronize()
    digest, names = kernels(model, inputs)
    if spec["epochs"]:
        return {"kernels": digest, "names": names[:40], "epochs": epochs(make, model, inputs)}
    copies, pads = [(model, inputs)], []
    for _ in range(spec["copies"] - 1):
        pad = rng.randrange(1, 64) * 1024**2 + rng.randrange(4096) * 512
        pads.append(torch.empty(pad, dtype=torch.uint8, device=dev))
        clones = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        copies.append((copy.deepcopy(model), clones))
    for m, x in copies:
        for _ in range(3):
            m(*x)
    cells = [(c, kind) for c in range(len(copies)) for kind in spec["flushes"]]
    times = {cell: [] for cell in cells}
    for r in range(spec["rounds"]):
        rng.shuffle(cells)
        for c, kind in cells:
            time.sleep(0.002)
            times[(c, kind)].append(timed(*copies[c], kind))
    medians = {k: [statistics.median(times[(c, k)]) for c in range(len(copies))] for k in spec["flushes"]}
    result = {"kernels": digest, "names": names[:40], "medians": medians}
    del copies, pads, model, inputs
    if cuda:
        torch.cuda.empty_cache()
    return result
for i in order:
    try:
        out[subjects[i]["label"]] = probe(subjects[i])
    except Exception as error:  # one subject that cannot be copied (say, it holds a CUDA graph)
        out[subjects[i]["label"]] = {"error": repr(error)[:300]}
print(json.dumps({"reps": reps, "context_s": round(context_s, 3), "cudnn": torch.backends.cudnn.version(),
                  "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "subjects": out}))
"""


# A built-in subject (--chain): 20 small kernels, launch-bound on the GPU side. launch_offset showed
# such a chain at one of two levels per process (9% apart on the H200); beside real subjects it asks
# whether a process's level predicts their offsets, as a calibration at process start would need.
CHAIN = "launch chain (20 small kernels)"
_CHAIN_CODE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        for _ in range(20):
            x = x + 1.0
        return x
def get_inputs():
    return [torch.zeros(1024)]
def get_init_inputs():
    return []
"""


def subjects_for(kernels: Path, tasks: list[str]) -> list[dict[str, str]]:
    rows = {name: (task, code) for task, code, name in load_workload(kernels, "kernelbench-v0")}
    chosen = []
    for name in tasks:
        if name not in rows:
            raise SystemExit(f"task {name} has no published kernel in {kernels}: pick another with --tasks")
        task, code = rows[name]
        chosen.append({"label": f"{name} reference", "code": task.code, "cls": "Model"})
        if not is_native(code):  # a candidate that builds nothing: time it as well
            chosen.append({"label": f"{name} candidate", "code": code, "cls": "ModelNew"})
    return chosen


def run_child(spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        return {"error": done.stderr[-600:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarise(processes: list[dict[str, Any]], labels: list[str], flushes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label in labels:
        seen = [p["subjects"][label] for p in processes if "medians" in p.get("subjects", {}).get(label, {})]
        for flush in flushes:
            if not seen:
                continue
            medians = [s["medians"][flush] for s in seen]
            firsts = [m[0] for m in medians]
            inside = [spread(m) or 0.0 for m in medians]
            rows.append(
                {
                    "subject": label,
                    "flush": flush,
                    "processes": len(seen),
                    "kernel_lists": len({s["kernels"] for s in seen}),
                    "median_ms": round(statistics.median(firsts), 4),
                    "first_copy_over_processes": spread(firsts),
                    "first_copy_process_sd": round(statistics.stdev(firsts) / statistics.fmean(firsts), 4)
                    if len(firsts) > 1
                    else None,
                    "copies_inside_a_process": round(statistics.median(inside), 4),
                    "all_copies_over_processes": spread([statistics.median(m) for m in medians]),
                }
            )
    return rows


def parse_envs(text: str) -> list[tuple[str, dict[str, str]]]:
    """--envs as (name, settings) pairs; none given: one arm, the inherited environment."""
    arms = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, _, pairs = part.partition(":")
        settings = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
        if not name or not settings:
            raise SystemExit(
                f"--envs {part!r}: write NAME:KEY=VALUE[,KEY=VALUE], e.g. eager:CUDA_MODULE_LOADING=EAGER"
            )
        arms.append((name, settings))
    return arms or [("inherited", {})]


def process_costs(chosen: list[dict[str, Any]]) -> dict[str, float | None]:
    """What one setting costs a process: its CUDA context's creation and its whole life (medians)."""
    contexts = [p["context_s"] for p in chosen if "context_s" in p]
    lives = [p["process_s"] for p in chosen if "process_s" in p]
    return {
        "context_s": round(statistics.median(contexts), 3) if contexts else None,
        "process_s": round(statistics.median(lives), 2) if lives else None,
    }


def relative_sd(values: list[float]) -> float | None:
    """Standard deviation over the mean (4 decimals); None for fewer than two values."""
    return round(statistics.stdev(values) / statistics.fmean(values), 4) if len(values) > 1 else None


def summarise_epochs(processes: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per subject, from blocks (a, a again later, b placed anew, b again, ...): how much one block
    moves over processes, over time in one placement, and over placements in one process. If
    placements inside one process spread as far as processes do, a process's offset is where its
    memory lies and re-placing inside one process would average it; if they stay tight while the
    first block moves over processes, the offset belongs to the process itself."""
    rows = []
    for label in labels:
        entries = [p.get("subjects", {}).get(label, {}) for p in processes]
        seen = [entry["epochs"] for entry in entries if "epochs" in entry]
        if not seen:
            continue
        # Over processes: how this subject's first block follows the launch chain's (--chain).
        chain = [
            (p["subjects"][CHAIN]["epochs"][0], p["subjects"][label]["epochs"][0])
            for p in processes
            if "epochs" in p.get("subjects", {}).get(CHAIN, {}) and "epochs" in p["subjects"].get(label, {})
        ]
        follows = (
            round(statistics.correlation(*zip(*chain, strict=True)), 3)
            if label != CHAIN
            and len(chain) > 2
            and len({a for a, _ in chain}) > 1
            and len({b for _, b in chain}) > 1
            else None
        )
        over_time, over_placements = [], []
        for blocks in seen:
            pairs = list(zip(blocks[0::2], blocks[1::2], strict=False))
            # one block against the same placement later: half the squared log ratio estimates the variance
            over_time.append(statistics.fmean((math.log(a / b)) ** 2 / 2 for a, b in pairs) ** 0.5)
            over_placements.append(relative_sd([math.sqrt(a * b) for a, b in pairs]) or 0.0)
        rows.append(
            {
                "subject": label,
                "processes": len(seen),
                "median_ms": round(statistics.median(b[0] for b in seen), 4),
                "first_block_over_processes_sd": relative_sd([b[0] for b in seen]),
                "first_block_over_processes": spread([b[0] for b in seen]),
                "time_in_one_placement_sd": round(statistics.median(over_time), 4),
                "placements_in_one_process_sd": round(statistics.median(over_placements), 4),
                "all_blocks_over_processes_sd": relative_sd([statistics.geometric_mean(b) for b in seen]),
                "correlation_with_chain": follows,
            }
        )
    return rows


def markdown_epochs(report: dict[str, Any]) -> str:
    lines = [
        f"# Time, placement or process: one subject in blocks of rounds, {report['date']}",
        "",
        f"{report['environment']['gpu']}, torch {report['environment']['torch']}, commit "
        f"`{report['environment']['commit']}`; profile {report['profile']}, {report['processes']} processes, "
        f"{report['epochs']} blocks of {report['rounds']} rounds per subject: each odd block repeats the "
        f"block before it after {report['epoch_gap']} s, each even one (after the first) is a fresh copy "
        "placed anew "
        "(cache released, a random pad held ahead of it). sd: standard deviation over the mean.",
        "",
        "| subject | median ms | first block over processes: sd (max/min - 1) | one placement over time: sd "
        "| placements in one process: sd | mean of all blocks over processes: sd "
        "| correlation with the launch chain over processes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        lines.append(
            f"| {r['subject']} | {r['median_ms']} | {r['first_block_over_processes_sd']} "
            f"({r['first_block_over_processes']}) | {r['time_in_one_placement_sd']} "
            f"| {r['placements_in_one_process_sd']} | {r['all_blocks_over_processes_sd']} "
            f"| {r.get('correlation_with_chain', '')} |"
        )
    return "\n".join(lines + failures(report))


def failures(report: dict[str, Any]) -> list[str]:
    errors = [p["error"] for p in report["raw"] if "error" in p]
    errors += [v["error"] for p in report["raw"] for v in p.get("subjects", {}).values() if "error" in v]
    if not errors:
        return []
    return ["", f"{len(errors)} process(es) or subjects failed; the first: `{errors[0][-300:]}`"]


def markdown(report: dict[str, Any]) -> str:
    if report.get("epochs"):
        return markdown_epochs(report)
    lines = [
        f"# Kernels, placement or flush: one subject in fresh processes, {report['date']}",
        "",
        f"{report['environment']['gpu']}, torch {report['environment']['torch']}, commit "
        f"`{report['environment']['commit']}`; profile {report['profile']}, {report['processes']} processes, "
        f"{report['copies']} copies each in new memory, {report['rounds']} rounds per copy and flush, "
        "interleaved. Spreads are max/min - 1; sd is the standard deviation over processes over the mean.",
        "",
        "| subject | cudnn.benchmark | environment (context s, process s) | flush | median ms | kernel lists "
        "| first copy over processes: spread, sd | copies in one process (median) "
        "| median of copies over processes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        lines.append(
            f"| {r['subject']} | {r['cudnn_benchmark']} | {r.get('env', 'inherited')} "
            f"({r.get('context_s')}, {r.get('process_s')}) | {r['flush']} | {r['median_ms']} "
            f"| {r['kernel_lists']} "
            f"| {r['first_copy_over_processes']}, {r['first_copy_process_sd']} "
            f"| {r['copies_inside_a_process']} | {r['all_copies_over_processes']} |"
        )
    return "\n".join(lines + failures(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True)
    parser.add_argument("--tasks", default="2:33,2:22,2:21,2:25,2:1,2:4,1:87,2:16")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument(
        "--flushes",
        default="write",
        help="comma list, timed interleaved: write (the evaluator's default lead), spread (timing_flush="
        "'spread'), warm (no flush: a spin of the lead's length)",
    )
    parser.add_argument("--profile", choices=("strict", "kernelbench-v0"), default="strict")
    parser.add_argument(
        "--both-cudnn-modes",
        action="store_true",
        help="every other process with cudnn.benchmark on (does autotuning steady the choice?)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="instead of copies: this many blocks of --rounds per subject, alternating a pause in one "
        "placement and a fresh placement (time against placement inside a process); 6 is three of each",
    )
    parser.add_argument(
        "--epoch-gap", type=float, default=0.5, help="seconds between two blocks of one placement"
    )
    parser.add_argument(
        "--chain",
        action="store_true",
        help="also time a chain of 20 small kernels in every process, and give each subject's correlation "
        "with it over processes (does a process's launch level predict its offset?)",
    )
    parser.add_argument(
        "--envs",
        default="",
        help="environment settings the processes take in turn, ';'-separated NAME:KEY=VALUE[,KEY=VALUE] "
        "(e.g. 'lazy:CUDA_MODULE_LOADING=LAZY;eager:CUDA_MODULE_LOADING=EAGER'): does a driver setting "
        "made before the CUDA context remove a process's offset? Summarised per setting",
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    subjects = subjects_for(args.kernels, [t.strip() for t in args.tasks.split(",") if t.strip()])
    if args.chain:
        subjects.insert(0, {"label": CHAIN, "code": _CHAIN_CODE, "cls": "Model"})
    flushes = [f.strip() for f in args.flushes.split(",") if f.strip()]
    unknown = sorted(set(flushes) - {"write", "spread", "warm"})
    if unknown:
        raise SystemExit(f"--flushes {','.join(unknown)}: choose from write, spread, warm")
    spec = {
        "subjects": subjects,
        "copies": args.copies,
        "rounds": args.rounds,
        "device": args.device,
        "profile": args.profile,
        "flushes": flushes,
        "epochs": args.epochs,
        "epoch_gap": args.epoch_gap,
    }
    modes = [False, True] if args.both_cudnn_modes else [False]
    envs = parse_envs(args.envs)
    arms = [(mode, env) for mode in modes for env in envs]
    processes: list[dict[str, Any]] = []
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    name = f"placement_probe-{stamp}{'-' + args.tag if args.tag else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    for index in range(args.processes):
        benchmark, (env_name, env) = arms[index % len(arms)]
        began = time.monotonic()
        child = run_child({**spec, "cudnn_benchmark": benchmark}, env)
        child["process_s"] = round(time.monotonic() - began, 2)
        processes.append({"cudnn_benchmark": benchmark, "env": env_name, **child})
        print(f"process {index + 1}/{args.processes}: {json.dumps(processes[-1])[:300]}", file=sys.stderr)
        # Saved after every process: a run cut short by its call's limit still leaves its figures.
        report = {
            "date": stamp,
            "environment": {
                "gpu": next((p["gpu"] for p in processes if "gpu" in p), "unknown"),
                "torch": next((p["torch"] for p in processes if "torch" in p), "unknown"),
                "commit": commit(),
            },
            "processes": len(processes),
            "copies": args.copies,
            "rounds": args.rounds,
            "profile": args.profile,
            "epochs": args.epochs,
            "epoch_gap": args.epoch_gap,
            "summary": summarise_epochs(processes, [s["label"] for s in subjects])
            if args.epochs
            else [
                {"cudnn_benchmark": mode, "env": env_name, **row, **process_costs(chosen)}
                for mode, (env_name, _) in arms
                for chosen in [[p for p in processes if (p["cudnn_benchmark"], p["env"]) == (mode, env_name)]]
                for row in summarise(chosen, [s["label"] for s in subjects], flushes)
            ],
            "raw": processes,
        }
        (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
