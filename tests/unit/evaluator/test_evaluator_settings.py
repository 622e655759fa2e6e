"""Settings, not hacks: cudnn.benchmark (and TF32 where the profile allows it) runs on both
sides and is named in the result; every other global change is still a rejection."""

from __future__ import annotations

from typing import Any

import pytest

from kernelfleet.core.models import EvaluationResult, Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import PROFILES, EvalConfig, Evaluator
from kernelfleet.evaluator import reasons as R
from tests.support import evaluator_cases as C

FAST: dict[str, Any] = {
    "device": "cpu",
    "correctness": {"trials": 2},
    "timing": {
        "trials": 3,
        "warmup": 1,
        "flush_bytes": 0,
        "max_speedup_cv": None,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
        "retries": 0,
    },
}
MATMUL = Task(name="matmul", code=C.MATMUL_TASK)


def judge_all(profile: str, candidates: list[str]) -> list[EvaluationResult]:
    with Evaluator(
        EvalConfig.model_validate(merged({"correctness": {"profile": profile}}, FAST))
    ) as evaluator:
        return evaluator.evaluate_batch([(MATMUL, code) for code in candidates], progress=False)


def test_strict_applies_cudnn_benchmark_to_both_sides_and_rejects_the_rest() -> None:
    benchmark, in_init, tf32, deterministic = judge_all(
        "strict",
        [C.CUDNN_BENCHMARK_HACK, C.CUDNN_BENCHMARK_IN_INIT, C.TF32_AT_IMPORT_HACK, C.DETERMINISTIC_FLAG_HACK],
    )
    for result in (benchmark, in_init):
        assert result.verdict == Verdict.CORRECT, result.reasons
        assert result.settings == {"cudnn.benchmark": "True"}
        assert R.SETTING_APPLIED in R.codes(result.reasons)
    assert tf32.verdict == Verdict.REJECTED and R.PRECISION_DOWNGRADE in R.codes(tf32.reasons)
    assert deterministic.verdict == Verdict.REJECTED
    assert R.GLOBAL_FLAG_CHANGED in R.codes(deterministic.reasons)


def test_strict_tf32_allows_tf32_on_both_sides_but_never_bf16() -> None:
    tf32, medium = judge_all("strict-tf32", [C.TF32_AT_IMPORT_HACK, C.MEDIUM_PRECISION_AT_IMPORT])
    assert tf32.verdict == Verdict.CORRECT, tf32.reasons
    assert tf32.settings.get("cuda.matmul.allow_tf32") == "True"
    assert tf32.environment.evaluator_version.endswith("+strict-tf32.pairs1")  # FAST: one process pair
    assert medium.verdict == Verdict.REJECTED and R.PRECISION_DOWNGRADE in R.codes(medium.reasons)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_allows_cudnn_benchmark_and_no_bf16(name: str) -> None:
    profile = PROFILES[name]
    assert profile.allows("cudnn.benchmark", True)
    assert not profile.allows("float32_matmul_precision", "medium")
    assert not profile.allows("num_threads", 4)
