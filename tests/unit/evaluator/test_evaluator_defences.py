"""Every reward-hack defence that exists on the CPU: the hack is rejected with its named reason,
its honest twin passes. (Side streams, load_inline CUDA kernels and the L2 flush are checked
on the GPU by tests/gpu/test_gpu_evaluator.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from kernelfleet.core.models import EvaluationResult, Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator import reasons as R
from tests.support import evaluator_cases as C

FAST: dict[str, Any] = C.FAST_CPU


def task(code: str, name: str = "t") -> Task:
    return Task(name=name, code=code)


def judge(task_code: str, candidate: str, **overrides: Any) -> EvaluationResult:
    with Evaluator(EvalConfig.model_validate(merged(FAST, overrides))) as evaluator:
        return evaluator.evaluate(task(task_code), candidate)


def assert_rejected(result: EvaluationResult, code: str) -> None:
    assert result.verdict == Verdict.REJECTED, result.reasons
    assert code in R.codes(result.reasons), result.reasons


def assert_correct(result: EvaluationResult) -> None:
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert not any(R.is_rejecting(text) for text in result.reasons), result.reasons


HACKS = [
    ("threads", C.MATMUL_TASK, C.THREAD_HACK, R.THREADS, {}),
    ("pointer-cache", C.MATMUL_TASK, C.POINTER_CACHE_HACK, R.CACHED_OUTPUT, {}),
    ("shape-cache", C.MATMUL_TASK, C.SHAPE_CACHE_HACK, R.CACHED_OUTPUT, {}),
    (
        "sampled-value-cache",
        C.MATMUL_TASK,
        C.SAMPLED_VALUE_CACHE_HACK,
        R.CACHED_OUTPUT,
        {"timing": {"trials": 8}},
    ),
    ("lazy-subclass", C.MATMUL_TASK, C.LAZY_SUBCLASS_HACK, R.LAZY_OUTPUT, {}),
    ("meta-output", C.MATMUL_TASK, C.META_OUTPUT_HACK, R.LAZY_OUTPUT, {}),
    ("input-mutation", C.MATMUL_TASK, C.INPUT_MUTATION_HACK, R.INPUT_MUTATED, {}),
    (
        "fp16",
        C.MATMUL_TASK,
        C.FP16_HACK,
        R.PRECISION_DOWNGRADE,
        {"correctness": {"profile": "kernelbench-v0"}},
    ),
    ("fp16-strict", C.MATMUL_TASK, C.FP16_HACK, R.PRECISION_DOWNGRADE, {}),
    (
        "autocast",
        C.MATMUL_TASK,
        C.AUTOCAST_HACK,
        R.PRECISION_DOWNGRADE,
        {"correctness": {"profile": "kernelbench-v0"}},
    ),
    ("tf32-at-import", C.MATMUL_TASK, C.TF32_AT_IMPORT_HACK, R.PRECISION_DOWNGRADE, {}),
    ("precision-during-call", C.MATMUL_TASK, C.TF32_DURING_CALL_HACK, R.PRECISION_DOWNGRADE, {}),
    ("num-threads", C.MATMUL_TASK, C.THREADS_FLAG_HACK, R.GLOBAL_FLAG_CHANGED, {}),
    ("timer-patched", C.MATMUL_TASK, C.TIMER_PATCH_HACK, R.HARNESS_PATCHED, {}),
    ("sync-patched", C.MATMUL_TASK, C.SYNC_PATCH_HACK, R.HARNESS_PATCHED, {}),
    ("reference-slowed", C.MATMUL_TASK, C.SLOWER_REFERENCE_HACK, R.HARNESS_PATCHED, {}),
    ("constant-output", C.TINY_OUTPUT_TASK, C.TINY_OUTPUT_CONSTANT, R.CONSTANT_OUTPUT, {}),
    ("no-kernel", C.MATMUL_TASK, C.HONEST, R.NO_CUSTOM_KERNEL, {"correctness": {"require_kernel": True}}),
    (
        "reference-fallback",
        C.MATMUL_TASK,
        C.FALLBACK_HACK,
        R.REFERENCE_FALLBACK,
        {"correctness": {"require_kernel": True}},
    ),
    (
        "torch-fallback",
        C.MATMUL_TASK,
        C.PARTIAL_FALLBACK_HACK,
        R.TORCH_FALLBACK,
        {"correctness": {"require_kernel": True}},
    ),
]


@pytest.mark.parametrize(
    ("task_code", "candidate", "code", "overrides"), [h[1:] for h in HACKS], ids=[h[0] for h in HACKS]
)
def test_hack_is_rejected_with_its_reason(
    task_code: str, candidate: str, code: str, overrides: dict[str, Any]
) -> None:
    result = judge(task_code, candidate, **overrides)
    assert_rejected(result, code)
    assert result.speedup is None


HONEST = [
    ("plain", C.MATMUL_TASK, C.HONEST, {}),
    ("kernelbench-v0", C.MATMUL_TASK, C.HONEST, {"correctness": {"profile": "kernelbench-v0"}}),
    ("weights", C.LINEAR_TASK, C.LINEAR_HONEST, {}),
    ("scratch-mutation", C.MATMUL_TASK, C.INPUT_MUTATION_HONEST, {}),
    ("tiny-output", C.TINY_OUTPUT_TASK, C.TINY_OUTPUT_HONEST, {}),
    ("algebraic-shortcut", C.DIAG_TASK, C.DIAG_FAST, {}),
    ("float64-reference", C.MATMUL_TASK, C.HONEST, {"correctness": {"float64_reference": True}}),
    ("prints", C.MATMUL_TASK, C.PRINTS, {}),
]


@pytest.mark.parametrize(
    ("task_code", "candidate", "overrides"), [h[1:] for h in HONEST], ids=[h[0] for h in HONEST]
)
def test_honest_twin_passes(task_code: str, candidate: str, overrides: dict[str, Any]) -> None:
    result = judge(task_code, candidate, **overrides)
    assert_correct(result)
    assert result.speedup is not None and result.speedup > 0
    assert result.reference is not None and result.candidate is not None
    # Adaptive timing takes whole batches of timing_trials rounds until the speedup settles.
    assert result.reference.trials == result.candidate.trials
    assert result.candidate.trials % FAST["timing"]["trials"] == 0
    assert result.max_abs_error is not None


def test_stale_memory_never_passes() -> None:
    result = judge(C.MATMUL_TASK, C.STALE_MEMORY_HACK)
    assert result.verdict in (Verdict.REJECTED, Verdict.INCORRECT), result.reasons
    # When the allocator hands back a block it poisoned, the reason says so by name.
    if result.verdict == Verdict.REJECTED:
        assert R.STALE_MEMORY in R.codes(result.reasons)


def test_the_reference_is_out_of_the_candidates_reach() -> None:
    """The hack that shrank the reference's sizes through the garbage collector finds no
    reference to shrink: the reference lives in the judge's process, never in the candidate's.
    What is left is an honest candidate, judged as one."""
    result = judge(C.MATMUL_TASK, C.REFERENCE_PATCH_HACK)
    assert_correct(result)
    assert result.speedup is not None


def test_kernelbench_shadowing_cannot_shrink_the_reference() -> None:
    """A candidate's own N and get_inputs live in its own module: the reference keeps its sizes,
    so a candidate that computes on the shrunken problem fails the shape check."""
    result = judge(C.MATMUL_TASK, C.SHADOW_SIZES)
    assert result.verdict == Verdict.INCORRECT
    assert R.SHAPE_MISMATCH in R.codes(result.reasons)


def test_degenerate_task_is_flagged_not_rejected() -> None:
    honest = C.CONSTANT_TASK.replace("class Model(", "class ModelNew(").split("def get_inputs")[0]
    result = judge(C.CONSTANT_TASK, honest)
    assert result.verdict == Verdict.CORRECT
    assert R.DEGENERATE_TASK in R.codes(result.reasons)
    assert result.flagged_for_review


def test_review_ceiling_and_recheck_are_reported() -> None:
    result = judge(C.DIAG_TASK, C.DIAG_FAST, timing={"speedup_recheck": 0.0, "review_ceiling": 1e-6})
    assert result.verdict == Verdict.CORRECT
    found = R.codes(result.reasons)
    assert found & {R.RECHECKED, R.NOT_REPRODUCIBLE}, result.reasons
    assert R.REVIEW in found
    assert result.flagged_for_review


def test_variance_gate_refuses_a_noisy_speedup() -> None:
    result = judge(C.MATMUL_TASK, C.HONEST, timing={"max_speedup_cv": 0.0, "trials": 9, "retries": 0})
    assert result.verdict == Verdict.CORRECT
    assert R.TIMING_NOISY in R.codes(result.reasons)
    assert result.candidate is not None  # the timings are still reported
    # The same code on both sides is usually inseparable, so no speedup. On a loaded machine the
    # two may still separate by chance: then, and only then, the speedup stands with an interval
    # wholly on one side of 1 (the rule `decide` implements; tested on synthetic pairs elsewhere).
    if result.speedup is not None:
        assert result.speedup_ci is not None
        low, high = result.speedup_ci
        assert low > 1.0 or high < 1.0, result.speedup_ci


def test_correctness_only_mode_skips_timing() -> None:
    result = judge(C.MATMUL_TASK, C.HONEST, timing={"enabled": False})
    assert result.verdict == Verdict.CORRECT
    assert result.speedup is None and result.reference is None
