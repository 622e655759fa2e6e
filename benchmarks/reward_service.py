"""Benchmark of the evaluation pipeline on published kernels (issue 11), for the GPU machine.

The workload is CUDA-L1's published H100 kernels replayed on their KernelBench v0 tasks (a
JSONL file of {"task": "LEVEL:ID", "name", "code"}; 1.6 MB, so it is not in the repository:
pass --kernels or set $KERNELFLEET_CUDA_L1_KERNELS). Two parts, each saved as soon as it ends:

- throughput: the same candidates evaluated the old way (one after another, one process at a
  time, as `kernelfleet optimize` did before the pipeline) and the new way (one batch through
  the pipeline: build pool, several processes per GPU, one timing lane), each with a cold build
  cache. Evaluations per GPU-hour, per-stage seconds, timing-lane busy share, nvidia-smi
  utilisation and verdict counts, side by side.
- repeat: each candidate evaluated twice in fresh processes; the disagreement of the two
  speedups |s1/s2 - 1| at the 50th and 90th percentile, over candidates of 50 us and more.

KernelBench's own harness is not run here (its code is not vendored); its published per-call
protocol is described in docs/evaluator.md.

    python benchmarks/reward_service.py --kernels cuda-l1-h100-kernels.jsonl --device cuda:0
    python benchmarks/reward_service.py --kernels ... --device cpu --count 3 --repeat-tasks 2  # smoke

Writes `reward_service-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for part in ("core", "evaluator"):
    if str(ROOT / part) not in sys.path:
        sys.path.insert(0, str(ROOT / part))

from gpu_evaluator import UtilizationSampler, commit  # noqa: E402

from kernelfleet.core.errors import EvaluationCancelled  # noqa: E402
from kernelfleet.core.models import EvaluationResult, Task  # noqa: E402
from kernelfleet.evaluator import EVALUATOR_VERSION, EvalConfig, Evaluator, load_tasks  # noqa: E402

STAGES = (
    "process_start",
    "cuda_init",
    "build",
    "reference",
    "candidate_load",
    "correctness",
    "lane_wait",
    "timing",
    "recheck",
)


def load_workload(kernels: Path, tasks_spec: str, count: int) -> list[tuple[Task, str, str]]:
    """(task, candidate code, row name) for the first `count` kernels whose task exists."""
    tasks = {f"{t.level}:{t.task_id}": t for t in load_tasks(tasks_spec)}
    chosen = []
    for line in kernels.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        task = tasks.get(str(row.get("task", "")).replace(" ", ""))
        if task is None or not row.get("code"):
            continue
        chosen.append((task, row["code"], f"{row['task']}"))
        if len(chosen) >= count:
            break
    return chosen


def summarise(
    results: list[EvaluationResult], wall: float, metrics: dict[str, Any], util: float | None
) -> dict[str, Any]:
    stages: dict[str, dict[str, float]] = {}
    for stage in STAGES:
        values = [r.stages[stage] for r in results if stage in r.stages]
        if values:
            stages[stage] = {
                "n": len(values),
                "median_s": round(statistics.median(values), 3),
                "total_s": round(sum(values), 1),
            }
    return {
        "evaluations": len(results),
        "wall_s": round(wall, 1),
        "evaluations_per_gpu_hour": round(len(results) / wall * 3600, 1) if wall > 0 else None,
        "median_seconds_per_evaluation": round(statistics.median(r.seconds for r in results), 2)
        if results
        else None,
        "verdicts": dict(Counter(str(r.verdict) for r in results)),
        "stages": stages,
        "timing_lane_busy_share": metrics.get("timing_lane_busy_share"),
        "lane_active_share": metrics.get("lane_active_share"),
        "nvidia_smi_mean_utilization_pct": util,
    }


def part_throughput(
    workload: list[tuple[Task, str, str]], args: argparse.Namespace, budget: float
) -> dict[str, Any]:
    base: dict[str, Any] = {
        "device": args.device,
        "profile": args.profile,
        "timing_trials": args.trials,
        "timeout_seconds": args.task_timeout,
        "compile_timeout_s": args.task_timeout,
    }
    items = [(task, code) for task, code, _ in workload]
    out: dict[str, Any] = {"candidates": len(items), "trials": args.trials}
    # New first: if the old way runs out of time, its rate still comes from what it finished.
    for mode in ("pipeline", "one-at-a-time"):
        build_root = tempfile.mkdtemp(prefix=f"kf-reward-{mode}-")
        slots = 1 if mode == "one-at-a-time" else args.lane_slots
        config = EvalConfig(
            **base,
            cache_dir=build_root,
            lane_slots=slots,
            compile_workers=1 if mode == "one-at-a-time" else None,
        )
        deadline = time.monotonic() + budget / 2

        def past_deadline(_: float, end: float = deadline) -> bool:
            return time.monotonic() > end

        results: list[EvaluationResult] = []
        begin = time.monotonic()
        with UtilizationSampler() as sampler, Evaluator(config) as evaluator:
            if mode == "pipeline":
                try:
                    results = evaluator.evaluate_batch(items, progress=False, stop=past_deadline)
                except EvaluationCancelled as cancelled:
                    results = [r for r in (cancelled.results or []) if isinstance(r, EvaluationResult)]
            else:
                for task, code in items:
                    if time.monotonic() > deadline:
                        break
                    results.append(evaluator.evaluate(task, code))
            metrics = evaluator.metrics.snapshot()
        wall = time.monotonic() - begin
        out[mode] = summarise(results, wall, metrics, sampler.mean)
        out[mode]["lane_slots"] = slots
        print(f"throughput {mode}: {json.dumps(out[mode])}", file=sys.stderr)
        shutil.rmtree(build_root, ignore_errors=True)
    old, new = (
        out["one-at-a-time"].get("evaluations_per_gpu_hour"),
        out["pipeline"].get("evaluations_per_gpu_hour"),
    )
    if old and new:
        out["pipeline_over_one_at_a_time"] = round(new / old, 2)
    return out


def part_repeat(
    workload: list[tuple[Task, str, str]], args: argparse.Namespace, budget: float
) -> dict[str, Any]:
    config = EvalConfig(
        device=args.device,
        profile=args.profile,
        timing_trials=args.trials,
        speedup_recheck=None,
        timeout_seconds=args.task_timeout,
        compile_timeout_s=args.task_timeout,
    )
    chosen = workload[: args.repeat_tasks]
    items = []
    for task, code, _ in chosen:
        items += [(task, code + "\n# first process\n"), (task, code + "\n# second process\n")]
    deadline = time.monotonic() + budget

    def past_deadline(_: float) -> bool:
        return time.monotonic() > deadline

    with Evaluator(config) as evaluator:
        try:
            results: list[EvaluationResult | None] = list(
                evaluator.evaluate_batch(items, progress=False, stop=past_deadline)
            )
        except EvaluationCancelled as cancelled:
            results = [
                r if isinstance(r, EvaluationResult) else None
                for r in cancelled.results or [None] * len(items)
            ]
    rows = []
    for index, (_, _, name) in enumerate(chosen):
        first, second = results[2 * index], results[2 * index + 1]
        row: dict[str, Any] = {"task": name}
        if first is not None and second is not None and first.speedup and second.speedup:
            assert first.candidate is not None
            row.update(
                first=round(first.speedup, 4),
                second=round(second.speedup, 4),
                first_ci=first.speedup_ci,
                candidate_ms=round(first.candidate.median_ms, 4),
                disagreement=round(abs(first.speedup / second.speedup - 1), 4),
            )
        else:
            row["verdicts"] = [str(r.verdict) if r else "not evaluated" for r in (first, second)]
        rows.append(row)
    big = sorted(r["disagreement"] for r in rows if "disagreement" in r and r["candidate_ms"] >= 0.05)
    every = sorted(r["disagreement"] for r in rows if "disagreement" in r)

    def quantile(values: list[float], q: float) -> float | None:
        if not values:
            return None
        return round(values[min(len(values) - 1, int(q * len(values)))], 4)

    return {
        "tasks": len(chosen),
        "timed_pairs": len(every),
        "pairs_50us_and_up": len(big),
        "p50_disagreement_50us_and_up": quantile(big, 0.5),
        "p90_disagreement_50us_and_up": quantile(big, 0.9),
        "p90_disagreement_all": quantile(every, 0.9),
        "rows": rows,
    }


def environment(device: str) -> dict[str, Any]:
    # Probing the device starts the sandbox's zygote (torch imported once per benchmark
    # process) before either mode runs, so that neither pays for it.
    with Evaluator(EvalConfig(device=device)) as evaluator:
        env = evaluator.environment
    return {
        "gpu": env.device,
        "gpu_class": env.gpu_class,
        "driver": env.driver,
        "torch": env.torch,
        "cuda": env.cuda,
        "cpus": os.cpu_count(),
        "evaluator_version": EVALUATOR_VERSION,
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Reward-service benchmark, {env['date'][:10]}",
        "",
        f"{env['gpu']} (driver {env['driver']}), {env['cpus']} CPUs, torch {env['torch']}, "
        f"CUDA {env['cuda']}, "
        f"evaluator {env['evaluator_version']}, commit `{env['commit']}`. Workload: CUDA-L1's published H100 "
        "kernels on their KernelBench v0 tasks.",
        "",
    ]
    if "throughput" in report:
        t = report["throughput"]
        lines += [
            f"## Throughput ({t['candidates']} candidates, {t['trials']} timed rounds per batch, "
            "cold build caches)",
            "",
            "| | evaluations | wall s | per GPU-hour | median s/eval | timing lane busy | nvidia-smi % "
            "| verdicts |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode in ("one-at-a-time", "pipeline"):
            if mode in t:
                m = t[mode]
                lines.append(
                    f"| {mode} | {m['evaluations']} | {m['wall_s']} | {m['evaluations_per_gpu_hour']} | "
                    f"{m['median_seconds_per_evaluation']} | {m['timing_lane_busy_share']} | "
                    f"{m['nvidia_smi_mean_utilization_pct']} | {m['verdicts']} |"
                )
        lines += ["", f"Pipeline over one-at-a-time: {t.get('pipeline_over_one_at_a_time')}x.", ""]
        lines += [
            "Seconds per stage (median per evaluation / total):",
            "",
            "| stage | one-at-a-time | pipeline |",
            "| --- | --- | --- |",
        ]
        for stage in STAGES:
            cells = []
            for mode in ("one-at-a-time", "pipeline"):
                s = t.get(mode, {}).get("stages", {}).get(stage)
                cells.append(f"{s['median_s']} / {s['total_s']}" if s else "-")
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        lines.append("")
    if "repeat" in report:
        r = report["repeat"]
        lines += [
            f"## Repeatability ({r['tasks']} tasks, each candidate timed in two fresh processes)",
            "",
            f"|s1/s2 - 1| over {r['pairs_50us_and_up']} candidates of 50 us and more: p50 "
            f"{r['p50_disagreement_50us_and_up']}, p90 {r['p90_disagreement_50us_and_up']} "
            f"(all {r['timed_pairs']} "
            f"timed: p90 {r['p90_disagreement_all']}).",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kernels", default=os.environ.get("KERNELFLEET_CUDA_L1_KERNELS"), help="published-kernel JSONL"
    )
    parser.add_argument("--tasks", default="kernelbench-v0")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--profile", default="kernelbench-v0")
    parser.add_argument("--count", type=int, default=40, help="candidates in the throughput part")
    parser.add_argument("--repeat-tasks", type=int, default=40)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--lane-slots", type=int, default=4)
    parser.add_argument("--task-timeout", type=float, default=180.0)
    parser.add_argument("--parts", default="throughput,repeat")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="the whole run; parts split it")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not args.kernels or not Path(args.kernels).is_file():
        parser.error("give --kernels FILE (or $KERNELFLEET_CUDA_L1_KERNELS): the published-kernel JSONL")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    suffix = "" if args.device.startswith("cuda") else f"-{args.device}"
    json_path = out_dir / f"reward_service-{stamp}{suffix}.json"
    md_path = out_dir / f"reward_service-{stamp}{suffix}.md"
    arguments = {k: v for k, v in vars(args).items() if k not in ("out", "kernels")}  # no machine paths
    report: dict[str, Any] = {"environment": environment(args.device), "arguments": arguments}

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        md_path.write_text(markdown(report) + "\n")

    save()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    workload = load_workload(Path(args.kernels), args.tasks, max(args.count, args.repeat_tasks))
    print(f"{len(workload)} published kernels matched to {args.tasks} tasks", file=sys.stderr)
    started = time.monotonic()
    shares = {"throughput": 0.6, "repeat": 0.4} if len(parts) > 1 else {parts[0]: 1.0}
    for part in parts:
        begin = time.monotonic()
        left = args.max_seconds - (begin - started)
        budget = left if part == parts[-1] else args.max_seconds * shares.get(part, 0.5)
        if part == "throughput":
            report["throughput"] = part_throughput(workload[: args.count], args, budget)
        elif part == "repeat":
            report["repeat"] = part_repeat(workload, args, budget)
        else:
            print(f"unknown part {part!r}; choose from throughput, repeat", file=sys.stderr)
            return 2
        report.setdefault("seconds", {})[part] = round(time.monotonic() - begin, 1)
        save()
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
