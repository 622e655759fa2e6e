"""Verified training data: ask policies, verify every answer, keep the correct ones, fastest first.

Collection is the optimisation loop itself (`kernelfleet.search.optimize`) under the stage's
prefix, without re-verification or baselines: the loop already stores every answer and every
result as it arrives, and resumes by replaying them, so a killed collection loses at most what
was in flight. The dataset is then read back from the store.

An example is chat-format prompt and completion. The prompt is the contrastive prompt the loop
and the RL stage use (`kernelfleet.search.build_messages`): the exemplars a language-model
policy saw when it wrote the answer, or, for a policy that saw none (replay files, compile),
up to K correct variants of the task that are slower than the kept one, so the model learns to
answer exactly the question it will be asked later. The completion has the three sections the
prompt asks for; where the policy wrote only code, the analysis and design name what it did.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kernelfleet.core.models import EvaluationResult, Task, Verdict
from kernelfleet.search import Budget, Exemplar, LoopSettings, Policy, RunLayout, build_messages, optimize
from kernelfleet.search._answers import parse_answer
from kernelfleet.search._layout import iter_samples
from kernelfleet.trainer._context import StageContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """One correct variant with what the policy said about it."""

    task: Task
    code: str
    variant_hash: str
    speedup: float
    policy: str
    name: str
    answer: str
    analysis: str
    design: str
    parents: tuple[str, ...]


def collect(
    ctx: StageContext,
    tasks: Sequence[Task],
    policies: Sequence[Policy],
    prefix: str,
    *,
    rounds: int,
    samples: int,
    exemplars: int = 2,
    seed: int = 0,
) -> dict[str, list[Verified]]:
    """Run the loop over `tasks` with `policies` under `prefix`.

    Returns the correct variants per task hash, fastest first.
    """
    optimize(
        tasks,
        policies,
        store=ctx.store,
        prefix=prefix,
        evaluator=ctx.evaluator,
        environment=ctx.environment,
        budget=Budget(rounds=rounds, samples_per_round=samples),
        settings=LoopSettings(exemplars=exemplars, verify_best=False, measure_baselines=False, seed=seed),
    )
    return read_verified(ctx, tasks, prefix)


def read_verified(ctx: StageContext, tasks: Sequence[Task], prefix: str) -> dict[str, list[Verified]]:
    env = ctx.environment
    results: dict[tuple[str, str], EvaluationResult] = {}
    for result in ctx.store.list_results(prefix):
        key = result.key
        if key.gpu_class == env.gpu_class and key.evaluator_version == env.evaluator_version:
            results[(result.task_hash, result.variant_hash)] = result
    layout = RunLayout(prefix)
    found: dict[str, list[Verified]] = {}
    for task in tasks:
        seen: dict[str, Verified] = {}
        for record in iter_samples(ctx.store, layout, task.hash, env.gpu_class):
            if not record.variant_hash or record.variant_hash in seen:
                continue
            found_result = results.get((task.hash, record.variant_hash))
            if found_result is None or found_result.verdict != Verdict.CORRECT:
                continue
            result = found_result
            speedup = result.speedup if result.speedup is not None else 1.0
            seen[record.variant_hash] = Verified(
                task=task,
                code=ctx.store.get_variant(record.variant_hash),
                variant_hash=record.variant_hash,
                speedup=speedup,
                policy=record.policy,
                name=record.name,
                answer=record.answer,
                analysis=record.analysis,
                design=record.design,
                parents=record.parent_hashes,
            )
        found[task.hash] = sorted(seen.values(), key=lambda v: (-v.speedup, v.variant_hash))
    return found


def completion_text(item: Verified) -> str:
    """The assistant's answer: the policy's own when it has all three sections, else one around the code."""
    if item.answer:
        parsed = parse_answer(item.answer)
        if parsed.ok and not parsed.missing_sections:
            return item.answer.strip() + "\n"
    label = f"`{item.name}`" if item.name else "this variant"
    analysis = item.analysis or (
        f"The reference runs each PyTorch operation as a separate pass over memory; {label} "
        f"restructures the computation to remove that overhead."
    )
    design = (
        item.design or f"Keep the reference's numerics and parameters, and implement {label} in ModelNew."
    )
    return (
        f"## Performance Analysis\n{analysis.strip()}\n\n## Algorithm Design\n{design.strip()}\n\n"
        f"## Code Implementation\n```python\n{item.code.strip()}\n```\n"
    )


def build_rows(
    verified: dict[str, list[Verified]],
    *,
    keep_per_task: int,
    exemplars: int,
    device: str,
    gpu_class: str,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Chat-format prompt/completion rows: the `keep_per_task` fastest correct variants of each task."""
    rows: list[dict[str, Any]] = []
    for task_hash, items in verified.items():
        by_hash = {item.variant_hash: item for item in items}
        for item in items[:keep_per_task]:
            shown = [by_hash[h] for h in item.parents if h in by_hash]
            if not shown and exemplars > 0:
                slower = [other for other in items if other.speedup < item.speedup]
                rng = random.Random(f"{seed}:{task_hash}:{item.variant_hash}")
                shown = rng.sample(slower, min(exemplars, len(slower)))
            messages = build_messages(
                item.task,
                [Exemplar(other.code, other.speedup, other.variant_hash) for other in shown],
                device,
                gpu_class,
            )
            rows.append(
                {
                    "prompt": messages,
                    "completion": [{"role": "assistant", "content": completion_text(item)}],
                    "task_hash": task_hash,
                    "task_name": item.task.name,
                    "variant_hash": item.variant_hash,
                    "speedup": item.speedup,
                    "policy": item.policy,
                }
            )
    return rows
