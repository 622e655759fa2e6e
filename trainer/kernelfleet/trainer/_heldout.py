"""Held-out evaluation: after each stage, its model optimises the held-out tasks through the normal loop.

The tasks were never trained on (see `_split`). The model is an ordinary policy (`hf`, or `vllm`
with vLLM and a GPU) in `kernelfleet.search.optimize`, with the run's evaluator, re-verification
of the best variant included, so a stage's number means what `kernelfleet optimize` means. Each
stage's search lives under `<run>/heldout/<stage>/` and resumes like any run. The report puts
the stages side by side: tasks with a verified variant, tasks faster than eager, mean, median
and geometric-mean best speedup (a task without a verified variant counts 1.0x, as everywhere).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernelfleet.core.models import Task, TaskSummary
from kernelfleet.core.resources import HeldOutSpec, SelfTrainStageConfig
from kernelfleet.core.store import NotFound
from kernelfleet.search import Budget, LoopSettings, optimize, speedup_stats
from kernelfleet.trainer._context import StageContext
from kernelfleet.trainer._selftrain import generation_policy

log = logging.getLogger(__name__)


def evaluate_held_out(
    ctx: StageContext, label: str, model: Path, tasks: Sequence[Task], spec: HeldOutSpec
) -> dict[str, Any]:
    """Optimise `tasks` with `model`; one report row (also stored as <run>/heldout/<label>/row.json)."""
    prefix = ctx.layout.heldout(label)
    key = f"{prefix}/row.json"
    try:
        return ctx.store.get_json(key)
    except NotFound:
        pass
    generation = SelfTrainStageConfig(temperature=0.8, max_new_tokens=spec.max_new_tokens)
    policy = generation_policy(model, generation)
    try:
        summaries = optimize(
            tasks,
            [policy],
            store=ctx.store,
            prefix=prefix,
            evaluator=ctx.evaluator,
            environment=ctx.environment,
            budget=Budget(rounds=spec.rounds, samples_per_round=spec.samples_per_round),
            settings=LoopSettings(measure_baselines=False),
        )
    finally:
        policy.close()
    row = report_row(label, summaries)
    ctx.store.put_json(key, row)
    return row


def report_row(label: str, summaries: Sequence[TaskSummary]) -> dict[str, Any]:
    verified = [s.best_speedup if s.verified else None for s in summaries]
    stats = speedup_stats(verified)
    answers = sum(s.samples for s in summaries)
    correct = sum(s.verdicts.get("correct", 0) for s in summaries)
    return {
        "stage": label,
        "tasks": len(summaries),
        "with_verified_variant": sum(1 for value in verified if value is not None),
        "answers": answers,
        "correct_variants": correct,
        **{f"speedup_{name}": value for name, value in stats.as_dict().items()},
    }


def format_report(rows: Sequence[dict[str, Any]]) -> str:
    """The stages side by side, as a text table."""
    header = ("stage", "tasks", "verified", "faster", "mean", "median", "geomean", "answers", "correct")
    lines = [header]
    for row in rows:

        def number(value: Any) -> str:
            return f"{value:.3f}x" if isinstance(value, float) else "-"

        lines.append(
            (
                str(row["stage"]),
                str(row["tasks"]),
                str(row["with_verified_variant"]),
                str(row.get("speedup_improved_over_1pct", 0)),
                number(row.get("speedup_mean")),
                number(row.get("speedup_median")),
                number(row.get("speedup_geomean")),
                str(row["answers"]),
                str(row["correct_variants"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines
    )
