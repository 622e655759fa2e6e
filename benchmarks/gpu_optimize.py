"""GPU benchmark of the optimisation loop: the `compile` policy alone, and best-of with `replay`.

On at least 40 KernelBench v0 tasks it runs
  A. the compile policy alone (torch.compile and CUDA-graph rewrites of the reference), and
  B. the compile policy together with a replay file of hand-written variants, best of both,
and reports, for each, the speedup of the best verified-correct variant per task over the eager
reference and over torch.compile of the reference: mean, median, geometric mean, and how many
tasks improved by more than 1%. The statistics take the best correct variant as measured, also
when it is slower than eager (below 1.0x); a task with no correct variant counts as 1.0x.

Both runs share one store prefix, so B reuses every sample and result of A and evaluates only
the replay candidates; and a run cut short (the device's per-command limit) resumes where it
stopped when the same command is run again. "Over torch.compile" divides by the speedup the
compile policy's plain `torch.compile` variant reached in the same protocol (interleaved with
eager, same process), which needs no separate baseline measurement; `--baselines` also measures
the evaluator's own eager/torch.compile baselines per task.

    PYTHONPATH=core:evaluator:search python benchmarks/gpu_optimize.py --out benchmarks/results

Writes `gpu_optimize-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import EvaluationResult, TaskSummary, Verdict
from kernelfleet.core.store import open_store
from kernelfleet.evaluator import CorrectnessConfig, EvalConfig, Evaluator, TimingConfig, load_tasks
from kernelfleet.search import (
    Budget,
    CompilePolicy,
    LiveProgress,
    LoopSettings,
    Policy,
    ReplayPolicy,
    optimize,
    speedup_stats,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = ["kernelbench-v0:1:1-25", "kernelbench-v0:2:1-14,40"]
DEFAULT_VARIANTS = "compile-default,cudagraph,compile-reduce-overhead"


def commit() -> str:
    if os.environ.get("KERNELFLEET_COMMIT"):
        return os.environ["KERNELFLEET_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def compile_speedup(
    results: dict[str, list[EvaluationResult]], task_hash: str, compile_hash: str
) -> float | None:
    for result in results.get(task_hash, []):
        if result.variant_hash == compile_hash and result.verdict == Verdict.CORRECT:
            return result.speedup
    return None


def summarise(
    label: str,
    summaries: list[TaskSummary],
    compile_speedups: dict[str, float | None],
) -> dict[str, Any]:
    over_eager = [s.best_speedup for s in summaries]
    over_compile = []
    for summary in summaries:
        reference = compile_speedups.get(summary.task_hash)
        if reference is None and summary.speedup_vs_compile is not None:
            over_compile.append(summary.speedup_vs_compile)
        elif reference:
            over_compile.append((summary.best_speedup or 1.0) / reference)
    policies: dict[str, int] = {}
    for summary in summaries:
        if summary.best_speedup is not None and summary.best_speedup > 1.01:
            key = f"{summary.best_policy}:{summary.best_name}"
            policies[key] = policies.get(key, 0) + 1
    return {
        "run": label,
        "tasks": len(summaries),
        "unfinished": sum(1 for summary in summaries if summary.stop_reason == "wall-time"),
        "over_eager": speedup_stats(over_eager).as_dict(),
        "over_compile": speedup_stats(over_compile).as_dict(),
        "over_compile_tasks": len(over_compile),
        "winners": dict(sorted(policies.items(), key=lambda item: -item[1])),
    }


def fmt(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Optimisation loop on {env['device']} ({report['date']})",
        "",
        f"- commit `{report['commit']}`, evaluator `{env['evaluator_version']}`, torch {env['torch']}, "
        f"CUDA {env['cuda'] or '-'}, driver {env['driver'] or '-'}",
        f"- tasks: {report['task_count']} ({', '.join(report['selections'])})",
        f"- compile variants: {', '.join(report['settings']['variants'])}; replay file: "
        f"`{report['settings']['replay']}`",
        f"- evaluation: profile {report['settings']['profile']}, {report['settings']['correctness_trials']} "
        f"correctness trials, {report['settings']['timing_trials']} timing trials; best variant re-verified: "
        f"{report['settings']['verify']}",
        f"- wall time {report['wall_s']:.0f} s, {report['evaluations']} evaluations "
        f"({report['evaluation_seconds']:.0f} s of evaluator time)",
        "",
        "| run | tasks | vs eager: mean | median | geomean | >1% | vs torch.compile: mean | median | geomean "
        "| >1% |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in report["runs"]:
        eager, comp = run["over_eager"], run["over_compile"]
        lines.append(
            f"| {run['run']} | {run['tasks']} | {fmt(eager['mean'])} | {fmt(eager['median'])} | "
            f"{fmt(eager['geomean'])} | {eager['improved_over_1pct']} | {fmt(comp['mean'])} | "
            f"{fmt(comp['median'])} | {fmt(comp['geomean'])} | {comp['improved_over_1pct']} "
            f"(of {run['over_compile_tasks']}) |"
        )
    unfinished = sum(run["unfinished"] for run in report["runs"])
    if unfinished:
        lines += [
            "",
            f"**Incomplete:** {unfinished} task searches stopped on --wall-time; run the same "
            "command again to finish them.",
        ]
    lines += ["", "Where the >1% wins came from:", ""]
    for run in report["runs"]:
        winners = ", ".join(f"{name} {count}" for name, count in run["winners"].items()) or "none"
        lines.append(f"- {run['run']}: {winners}")
    lines += [
        "",
        "torch.compile of the reference over eager (the compile-default variant, same protocol): "
        + ", ".join(f"{k} {fmt(report['compile_over_eager'][k])}" for k in ("mean", "median", "geomean")),
        "",
        "| task | compile best | by | best-of | by | torch.compile vs eager |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["per_task"]:
        lines.append(
            f"| {row['task']} | {fmt(row['compile_best'])} | {row['compile_by'] or '-'} | "
            f"{fmt(row['bestof'])} | {row['bestof_by'] or '-'} | {fmt(row['compile_over_eager'])} |"
        )
    lines += [
        "",
        "Speedups are over the eager reference, median of the evaluator's interleaved timings. The "
        "statistics take the best correct variant as measured, also when it is slower than eager (below "
        "1.0x; a user would keep the reference); a task with no correct variant counts as 1.0x. Speedups "
        "of 3x and more were re-timed by the evaluator in a fresh process (the lower counts).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS, help="task selections (>= 40 tasks)")
    parser.add_argument("--replay", default=str(ROOT / "benchmarks" / "replay-kernelbench-v0.jsonl"))
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="compile variants, comma-separated")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--store", default=str(ROOT / "results" / "tmp" / "gpu-optimize-store"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timing-trials", type=int, default=30)
    parser.add_argument("--correctness-trials", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", default="strict", choices=("strict", "kernelbench-v0"))
    parser.add_argument(
        "--verify", action="store_true", help="re-verify each run's best variant (costs time)"
    )
    parser.add_argument("--baselines", action="store_true", help="also measure the evaluator's baselines")
    parser.add_argument("--wall-time", type=float, default=None, help="stop each run after this many seconds")
    args = parser.parse_args(argv)

    started = time.monotonic()
    tasks = []
    seen: set[str] = set()
    for selection in args.tasks:
        for task in load_tasks(selection):
            if task.hash not in seen:
                seen.add(task.hash)
                tasks.append(task)
    compile_policy = CompilePolicy.only([name.strip() for name in args.variants.split(",") if name.strip()])
    replay_policy = ReplayPolicy.from_file(args.replay)
    store = open_store(args.store)
    config = EvalConfig(
        device=args.device,
        correctness=CorrectnessConfig(profile=args.profile, trials=args.correctness_trials),
        timing=TimingConfig(
            trials=args.timing_trials, warmup=args.warmup, baseline_modes=("eager", "compile")
        ),
    )
    settings = LoopSettings(verify_best=args.verify, measure_baselines=args.baselines)
    with Evaluator(config) as evaluator:
        environment = evaluator.environment
        prefix = f"benchmarks/gpu-optimize/{environment.gpu_class}"
        print(
            f"{len(tasks)} tasks on {environment.device}; store {store.url} prefix {prefix}", file=sys.stderr
        )
        runs: dict[str, list[TaskSummary]] = {}
        plans: list[tuple[str, list[Policy]]] = [
            ("compile", [compile_policy]),
            ("compile+replay", [compile_policy, replay_policy]),
        ]
        for label, policies in plans:
            print(f"== run {label}", file=sys.stderr)
            runs[label] = optimize(
                tasks,
                policies,
                store=store,
                prefix=prefix,
                evaluator=evaluator,
                environment=environment,
                # One round proposes every variant; a second one lets the loop notice exhaustion.
                budget=Budget(rounds=2, samples_per_round=8, wall_time_seconds=args.wall_time),
                settings=settings,
                progress=LiveProgress(),
            )

    results: dict[str, list[EvaluationResult]] = {}
    for result in store.list_results(prefix):
        if result.environment.evaluator_version == environment.evaluator_version:
            results.setdefault(result.task_hash, []).append(result)
    default_code = {
        task.hash: dict(compile_policy.variants_for(task, on_gpu=environment.gpu_class != "cpu")).get(
            "compile-default"
        )
        for task in tasks
    }
    compile_speedups = {
        task.hash: compile_speedup(results, task.hash, source_hash(code)) if code else None
        for task, code in ((task, default_code[task.hash]) for task in tasks)
    }
    per_task = []
    for compiled, bestof in zip(runs["compile"], runs["compile+replay"], strict=True):
        per_task.append(
            {
                "task": compiled.task_name,
                "task_hash": compiled.task_hash,
                "compile_best": compiled.best_speedup,
                "compile_by": compiled.best_name,
                "bestof": bestof.best_speedup,
                "bestof_by": f"{bestof.best_policy}:{bestof.best_name}" if bestof.best_policy else "",
                "compile_over_eager": compile_speedups.get(compiled.task_hash),
                "stop": bestof.stop_reason,
                "verdicts": bestof.verdicts,
            }
        )
    all_results = [r for rs in results.values() for r in rs]
    today = dt.date.today().isoformat()
    report = {
        "benchmark": "gpu_optimize",
        "date": today,
        "commit": commit(),
        "environment": environment.model_dump(mode="json"),
        "selections": args.tasks,
        "task_count": len(tasks),
        "settings": {
            "variants": list(compile_policy.variant_names),
            "replay": os.path.relpath(args.replay, ROOT),
            "profile": args.profile,
            "timing_trials": args.timing_trials,
            "correctness_trials": args.correctness_trials,
            "warmup": args.warmup,
            "verify": args.verify,
            "baselines": args.baselines,
        },
        "wall_s": round(time.monotonic() - started, 1),
        "evaluations": len(all_results),
        "evaluation_seconds": round(sum(r.seconds for r in all_results), 1),
        "verdicts": dict(sorted(verdict_counts(all_results).items())),
        "runs": [summarise(label, summaries, compile_speedups) for label, summaries in runs.items()],
        "compile_over_eager": speedup_stats(v for v in compile_speedups.values() if v is not None).as_dict(),
        "per_task": per_task,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_optimize-{today}-{environment.gpu_class}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    return 0


def verdict_counts(results: list[EvaluationResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for result in results:
        counts[str(result.verdict)] = counts.get(str(result.verdict), 0) + 1
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
