"""GPU benchmark of the evaluator, for the H200 machine (any CUDA GPU works).

Three parts, each written to the results file as soon as it is done, so a run cut short still
leaves what it measured:

- baselines: on `--count` KernelBench tasks (levels 1 to 3 of the chosen version), the
  reference timed eagerly, under torch.compile and as a CUDA-graph replay, with the evaluator's
  own protocol. torch.compile is warmed first in parallel CPU-side processes (the inductor and
  Triton caches are on disk), so the timed pass does not wait for the compiler.
- repeat: the same candidate (the reference itself, renamed) evaluated in two separate
  processes per task: the spread of the ratio of the two speedups is the evaluator's noise.
- throughput: a mixed set of candidates (plain PyTorch variants and load_inline CUDA kernels
  with cold build caches) evaluated one after another, then as one batch with the build pool
  compiling while the GPU times: candidates per GPU-hour and how busy the GPU was.

    python benchmarks/gpu_evaluator.py --tasks kernelbench-v0 --count 40 --out benchmarks/results

Writes `gpu_evaluator-<date>.json` and `.md` into --out, with the GPU, driver, torch, CUDA and
the commit ($KERNELFLEET_COMMIT, else `git rev-parse HEAD`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for part in ("core", "evaluator"):
    if str(ROOT / part) not in sys.path:
        sys.path.insert(0, str(ROOT / part))

from kernelfleet.core.models import Task, Verdict  # noqa: E402
from kernelfleet.evaluator import EVALUATOR_VERSION, EvalConfig, Evaluator, load_tasks  # noqa: E402

# A spread over the levels: every 5th single op, every 7th fusion, and six small architectures.
DEFAULT_SELECTION = {1: list(range(1, 101, 5)), 2: list(range(1, 101, 7)), 3: [1, 2, 3, 4, 8, 17]}
THROUGHPUT_TASK = (1, 19)  # ReLU: every candidate below is an honest ReLU

PYTHON_RELUS = [
    "torch.relu(x)",
    "torch.clamp_min(x, 0.0)",
    "torch.nn.functional.relu(x)",
    "torch.maximum(x, torch.zeros((), device=x.device))",
    "x * (x > 0)",
    "torch.where(x > 0, x, torch.zeros_like(x))",
]

CUDA_RELU = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = """
#define BLOCK @BLOCK@
__global__ void relu_kernel(const float* x, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
torch::Tensor relu(torch::Tensor x) {
  auto y = torch::empty_like(x);
  long n = x.numel();
  relu_kernel<<<(n + BLOCK - 1) / BLOCK, BLOCK>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}
"""
_ext = load_inline(name="kf_bench_relu_@BLOCK@", cpp_sources="torch::Tensor relu(torch::Tensor x);",
                   cuda_sources=_CUDA, functions=["relu"])


class ModelNew(nn.Module):
    def forward(self, x):
        return _ext.relu(x.contiguous())
'''


def python_candidate(expression: str) -> str:
    return (
        "import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
        f"    def forward(self, x):\n        return {expression}\n"
    )


def cuda_candidate(block: int) -> str:
    return CUDA_RELU.replace("@BLOCK@", str(block))


# ---------------------------------------------------------------- environment


def commit() -> str:
    if os.environ.get("KERNELFLEET_COMMIT"):
        return os.environ["KERNELFLEET_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that runs `tree`'s kernelfleet (an exported older commit, or
    this tree): that tree first on PYTHONPATH in place of this one; other entries (the GPU
    machine's carried wheels) stay."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    others = [p for p in inherited if not Path(p).resolve().is_relative_to(ROOT)]
    paths = [str(tree / part) for part in ("core", "evaluator", "search")] + others
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class UtilizationSampler:
    """Samples nvidia-smi's GPU utilisation and SM clock twice a second while a part runs (a GPU
    idle between timed calls may clock down, which stretches short kernels)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.clocks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=utilization.gpu,clocks.sm",
                        "--format=csv,noheader,nounits",
                        "-i",
                        "0",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                )
                utilization, clock = out.stdout.strip().splitlines()[0].split(",")
                self.samples.append(float(utilization))
                self.clocks.append(float(clock))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return

    def __enter__(self) -> UtilizationSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(10)

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 1) if self.samples else None

    @property
    def clock_mhz(self) -> dict[str, float] | None:
        """The SM clock's 10th percentile, median and largest sample."""
        if not self.clocks:
            return None
        ordered = sorted(self.clocks)
        return {"p10": ordered[len(ordered) // 10], "median": statistics.median(ordered), "max": ordered[-1]}


# ---------------------------------------------------------------- parts


def select_tasks(spec: str, count: int) -> list[Task]:
    chosen: list[Task] = []
    for level, ids in DEFAULT_SELECTION.items():
        try:
            chosen += load_tasks(f"{spec}:{level}:{','.join(map(str, ids))}")
        except Exception as error:  # a version without some ids: take what there is
            print(f"selection of level {level} failed: {error}", file=sys.stderr)
    if len(chosen) < count:
        known = {(t.level, t.task_id) for t in chosen}
        chosen += [t for t in load_tasks(spec) if (t.level, t.task_id) not in known][: count - len(chosen)]
    return chosen[:count]


def part_baselines(tasks: list[Task], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    modes = ("eager", "compile", "cudagraph")
    warm = EvalConfig(
        device=args.device,
        baseline_modes=("compile",),
        timing_trials=3,
        warmup=1,
        timeout_seconds=args.task_timeout,
    )
    started = time.monotonic()
    with Evaluator(warm) as evaluator, concurrent.futures.ThreadPoolExecutor(args.compile_jobs) as pool:
        # Warm torch.compile's on-disk caches, several tasks at a time; these timings are discarded.
        list(pool.map(lambda t: _quietly(evaluator.baselines_detail, t), tasks))
    warm_seconds = time.monotonic() - started
    config = EvalConfig(
        device=args.device,
        baseline_modes=modes,
        timing_trials=args.trials,
        warmup=args.warmup,
        timeout_seconds=args.task_timeout,
    )
    rows = []
    with Evaluator(config) as evaluator:
        for index, task in enumerate(tasks):
            if time.monotonic() > deadline:
                print(f"baselines: time budget spent after {index} tasks", file=sys.stderr)
                break
            begin = time.monotonic()
            row: dict[str, Any] = {"task": task.name, "level": task.level, "task_id": task.task_id}
            try:
                timings, missing = evaluator.baselines_detail(task)
                for mode in modes:
                    if mode in timings:
                        t = timings[mode]
                        row[mode] = {"median_ms": t.median_ms, "iqr_ms": t.iqr_ms, "trials": t.trials}
                    else:
                        row[mode] = {"unavailable": missing.get(mode, "")[:200]}
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            row["seconds"] = round(time.monotonic() - begin, 2)
            rows.append(row)
            print(f"[{index + 1}/{len(tasks)}] {task.name}: {_short(row)}", file=sys.stderr)

    def ratios(mode: str) -> list[float]:
        return [
            r["eager"]["median_ms"] / r[mode]["median_ms"]
            for r in rows
            if "median_ms" in r.get("eager", {}) and "median_ms" in r.get(mode, {})
        ]

    summary = {}
    for mode in ("compile", "cudagraph"):
        values = ratios(mode)
        summary[f"eager_over_{mode}"] = _describe(values)
    return {
        "modes": list(modes),
        "trials": args.trials,
        "tasks_timed": len(rows),
        "compile_warmup_seconds": round(warm_seconds, 1),
        "summary": summary,
        "rows": rows,
    }


def part_repeat(tasks: list[Task], args: argparse.Namespace) -> dict[str, Any]:
    config = EvalConfig(
        device=args.device, timing_trials=args.repeat_trials, speedup_recheck=None, max_speedup_cv=None
    )
    rows = []
    with Evaluator(config) as evaluator:
        for task in tasks:
            candidate = task.code + "\n\nModelNew = Model\n"
            first = evaluator.evaluate(task, candidate)
            second = evaluator.evaluate(task, candidate + "\n# second run\n")
            row: dict[str, Any] = {"task": task.name, "verdicts": [str(first.verdict), str(second.verdict)]}
            if first.speedup and second.speedup:
                row.update(first=first.speedup, second=second.speedup, ratio=first.speedup / second.speedup)
            rows.append(row)
            print(f"repeat {task.name}: {row}", file=sys.stderr)
    logs = [abs(math.log(r["ratio"])) for r in rows if "ratio" in r]
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    return {
        "timing_trials": args.repeat_trials,
        "candidate": "the reference itself as ModelNew (true speedup 1.0)",
        "ratio": _describe(ratios),
        "median_abs_log_ratio": round(statistics.median(logs), 4) if logs else None,
        "max_abs_ratio_deviation": round(max((abs(r - 1) for r in ratios), default=0.0), 4),
        "rows": rows,
    }


def part_throughput(args: argparse.Namespace) -> dict[str, Any]:
    task = load_tasks(f"{args.tasks}:{THROUGHPUT_TASK[0]}:{THROUGHPUT_TASK[1]}")[0]
    python = [python_candidate(e) for e in PYTHON_RELUS]
    native = [cuda_candidate(block) for block in (128, 256, 512, 1024)[: args.native]]
    items = [(task, code) for code in python + native]
    has_ninja = shutil.which("ninja") is not None
    base = {
        "device": args.device,
        "timing_trials": args.throughput_trials,
        "speedup_recheck": None,
        "compile_timeout_s": 900.0,
    }
    out: dict[str, Any] = {"candidates": len(items), "native": len(native), "ninja": has_ninja}
    for mode in ("sequential", "overlapped"):
        build_root = tempfile.mkdtemp(prefix=f"kf-bench-{mode}-")
        config = EvalConfig(**base, cache_dir=build_root, compile_workers=None if mode == "overlapped" else 1)
        begin = time.monotonic()
        with UtilizationSampler() as sampler, Evaluator(config) as evaluator:
            if mode == "sequential":
                # One candidate after another: the GPU waits while each extension compiles.
                results = [evaluator.evaluate(t, c) for t, c in items]
            else:
                results = evaluator.evaluate_batch(items, progress=False)
        wall = time.monotonic() - begin
        busy = sum(r.seconds for r in results if r.verdict != Verdict.COMPILE_ERROR)
        out[mode] = {
            "wall_s": round(wall, 1),
            "candidates_per_gpu_hour": round(len(items) / wall * 3600, 1),
            "gpu_lane_busy_fraction": round(busy / wall, 3),
            "nvidia_smi_mean_utilization_pct": sampler.mean,
            "verdicts": dict(Counter(str(r.verdict) for r in results)),
        }
        print(f"throughput {mode}: {out[mode]}", file=sys.stderr)
        shutil.rmtree(build_root, ignore_errors=True)
    if out["overlapped"]["wall_s"]:
        out["speedup_of_overlap"] = round(out["sequential"]["wall_s"] / out["overlapped"]["wall_s"], 2)
    return out


# ---------------------------------------------------------------- helpers and output


def _quietly(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except Exception as error:
        return error


def _describe(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 4),
        "median": round(statistics.median(values), 4),
        "geomean": round(math.exp(statistics.fmean(math.log(v) for v in values)), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
    }


def _short(row: dict[str, Any]) -> str:
    parts = []
    for mode in ("eager", "compile", "cudagraph"):
        value = row.get(mode, {})
        parts.append(f"{mode}={value['median_ms']:.4f}ms" if "median_ms" in value else f"{mode}=n/a")
    return " ".join(parts) + (f" error={row['error']}" if "error" in row else "")


def environment(device: str) -> dict[str, Any]:
    with Evaluator(EvalConfig(device=device)) as evaluator:
        env = evaluator.environment
    return {
        "gpu": env.device,
        "gpu_class": env.gpu_class,
        "driver": env.driver,
        "torch": env.torch,
        "cuda": env.cuda,
        "evaluator_version": EVALUATOR_VERSION,
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Evaluator benchmark, {env['date'][:10]}",
        "",
        f"GPU {env['gpu']} (driver {env['driver']}), torch {env['torch']}, CUDA {env['cuda']}, "
        f"evaluator {env['evaluator_version']}, commit `{env['commit']}`.",
        "",
    ]
    if "baselines" in report:
        b = report["baselines"]
        lines += [
            f"## Baselines ({b['tasks_timed']} KernelBench tasks, {b['trials']} timed calls each)",
            "",
            "Speedup of each mode over the eager reference (eager median / mode median):",
            "",
            "| mode | n | mean | median | geomean | min | max |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for key, s in b["summary"].items():
            if s.get("n"):
                lines.append(
                    f"| {key.removeprefix('eager_over_')} | {s['n']} | {s['mean']} | {s['median']} | "
                    f"{s['geomean']} | {s['min']} | {s['max']} |"
                )
        lines += ["", "| task | eager ms | compile ms | cudagraph ms |", "| --- | --- | --- | --- |"]
        for row in b["rows"]:
            cells = [
                f"{row[m]['median_ms']:.4f}" if "median_ms" in row.get(m, {}) else "n/a"
                for m in ("eager", "compile", "cudagraph")
            ]
            lines.append(f"| {row['task']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "repeat" in report:
        r = report["repeat"]
        ratio = r["ratio"]
        lines += [
            f"## Repeatability ({len(r['rows'])} tasks, {r['timing_trials']} timed calls, "
            "two processes each)",
            "",
            f"Candidate: {r['candidate']}. Ratio of the two measured speedups over "
            f"{ratio.get('n', 0)} tasks: median {ratio.get('median')}, min {ratio.get('min')}, "
            f"max {ratio.get('max')}, stdev {ratio.get('stdev')}; median |log ratio| "
            f"{r['median_abs_log_ratio']}, largest deviation from 1: {r['max_abs_ratio_deviation']}.",
            "",
        ]
    if "throughput" in report:
        t = report["throughput"]
        lines += [
            f"## Throughput ({t['candidates']} candidates, {t['native']} of them load_inline CUDA, "
            "cold builds)",
            "",
            "| mode | wall s | candidates per GPU-hour | GPU lane busy | nvidia-smi util % |",
            "| --- | --- | --- | --- | --- |",
        ]
        for mode in ("sequential", "overlapped"):
            if mode in t:
                m = t[mode]
                lines.append(
                    f"| {mode} | {m['wall_s']} | {m['candidates_per_gpu_hour']} | "
                    f"{m['gpu_lane_busy_fraction']} | {m['nvidia_smi_mean_utilization_pct']} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="kernelbench-v0")
    parser.add_argument("--device", default="cuda:0", help="cuda:N; cpu only to try the script itself")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--parts", default="repeat,throughput,baselines")
    parser.add_argument("--trials", type=int, default=30, help="timed calls per baseline mode")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat-tasks", type=int, default=8)
    parser.add_argument("--repeat-trials", type=int, default=50)
    parser.add_argument("--throughput-trials", type=int, default=50)
    parser.add_argument("--native", type=int, default=2, help="load_inline candidates in the throughput set")
    parser.add_argument("--compile-jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--task-timeout", type=float, default=180.0)
    parser.add_argument("--max-seconds", type=float, default=480.0, help="stop starting baseline tasks after")
    args = parser.parse_args()

    started = time.monotonic()
    deadline = started + args.max_seconds
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    json_path = out_dir / f"gpu_evaluator-{stamp}.json"
    md_path = out_dir / f"gpu_evaluator-{stamp}.md"
    arguments = {key: value for key, value in vars(args).items() if key != "out"}  # no machine paths
    report: dict[str, Any] = {"environment": environment(args.device), "arguments": arguments}

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        md_path.write_text(markdown(report) + "\n")

    save()
    tasks = select_tasks(args.tasks, args.count)
    print(f"{len(tasks)} tasks selected from {args.tasks}", file=sys.stderr)
    for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
        begin = time.monotonic()
        if part == "repeat":
            light = [t for t in tasks if t.level in (1, 2)][: args.repeat_tasks]
            report["repeat"] = part_repeat(light, args)
        elif part == "throughput":
            report["throughput"] = part_throughput(args)
        elif part == "baselines":
            report["baselines"] = part_baselines(tasks, args, deadline)
        else:
            print(f"unknown part {part!r}; choose from repeat, throughput, baselines", file=sys.stderr)
            return 2
        report.setdefault("seconds", {})[part] = round(time.monotonic() - begin, 1)
        save()
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
