"""Budgets are bounds: at the wall-time or GPU-seconds limit nothing new starts, the evaluation
in flight is cancelled (not recorded, so a resumed run evaluates it) and the summary is written,
with a deliberately slow candidate and the real evaluator on the CPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kernelfleet.core.models import Task, Verdict
from kernelfleet.core.store import open_store
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.search import Budget, LoopSettings, QuietProgress, ReplayPolicy, ReplayRow, optimize
from tests.support import evaluator_cases as C

CONFIG = EvalConfig.model_validate(
    {
        "device": "cpu",
        "correctness": {"trials": 2},
        "timing": {
            "trials": 3,
            "warmup": 1,
            "flush_bytes": 0,
            "max_speedup_cv": None,
            "speedup_recheck": None,
            "retries": 0,
        },
    }
)


@pytest.mark.parametrize("limit", ["wall-time", "gpu-seconds"])
def test_a_budget_cancels_the_evaluation_in_flight_and_resume_runs_it(tmp_path: Path, limit: str) -> None:
    slow_until = time.time() + 25.0  # slow in the first run, fast once resumed after it
    task = Task(name="matmul", code=C.MATMUL_TASK)
    slow = ReplayRow(task="matmul", code=C.sleeper(20.0, slow_until), name="slow")
    store = open_store(tmp_path / "store")
    settings = LoopSettings(measure_baselines=False)
    budget = Budget(
        rounds=1, samples_per_round=1, **{"wall_time_seconds" if limit == "wall-time" else "gpu_seconds": 8.0}
    )
    with Evaluator(CONFIG) as evaluator:
        environment = evaluator.environment
        begin = time.monotonic()
        [summary] = optimize(
            [task],
            [ReplayPolicy([slow])],
            store=store,
            prefix="runs/budget",
            evaluator=evaluator,
            environment=environment,
            budget=budget,
            settings=settings,
            progress=QuietProgress(),
        )
        elapsed = time.monotonic() - begin
    # Each correctness call alone sleeps 20 s: the candidate could not have finished.
    assert elapsed < 8.0 + 30.0, elapsed
    assert summary.stop_reason == limit
    assert summary.not_evaluated == 1 and summary.variants == 0
    assert list(store.list_results("runs/budget")) == []

    time.sleep(max(0.0, slow_until - time.time()))  # the same code is fast now: the resumed run evaluates it
    with Evaluator(CONFIG) as evaluator:
        [again] = optimize(
            [task],
            [ReplayPolicy([slow])],
            store=store,
            prefix="runs/budget",
            evaluator=evaluator,
            environment=evaluator.environment,
            budget=Budget(rounds=1, samples_per_round=1, wall_time_seconds=600.0),
            settings=settings,
            progress=QuietProgress(),
        )
    results = list(store.list_results("runs/budget"))
    assert len(results) == 1 and results[0].verdict == Verdict.CORRECT
    assert again.not_evaluated == 0 and again.variants == 1
