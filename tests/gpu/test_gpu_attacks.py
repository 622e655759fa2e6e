"""The attack suite (issue 9) on a GPU, at the strongest isolation the machine offers: the
GPU device files pass through the sandbox (an honest candidate runs on the GPU), and every
attack gets its expected verdict and leaves no mark outside.

Run on the GPU machine: `python -m pytest -m gpu tests/gpu/test_gpu_attacks.py` (scripts/
gpu-check.sh runs it with the GPU tier; `python -m benchmarks attacks` prints the table).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kernelfleet.core.models import Task, Verdict  # noqa: E402
from kernelfleet.evaluator import EvalConfig, Evaluator  # noqa: E402
from kernelfleet.evaluator._sandbox import detect  # noqa: E402
from tests.support import evaluator_cases as C  # noqa: E402
from tests.support.attacks import ATTACKS, Attack  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU: dict[str, Any] = {
    "device": "cuda:0",
    "seed": 20261201,
    "correctness": {"trials": 2},
    "timing": {
        "trials": 20,
        "warmup": 3,
        "max_speedup_cv": None,
        "retries": 1,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
    },
    "limits": {"timeout_seconds": 300.0, "memory": "8Gi", "scratch_bytes": 256 * 1024**2},
}
TASK = Task(name="matmul", code=C.MATMUL_TASK)


@pytest.fixture(scope="module")
def evaluator() -> Iterator[Evaluator]:
    with Evaluator(EvalConfig.model_validate(GPU)) as shared:
        yield shared


def test_the_gpu_is_reachable_from_inside_the_sandbox(evaluator: Evaluator) -> None:
    result = evaluator.evaluate(TASK, C.HONEST)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert result.isolation == detect().level
    print(f"isolation on this GPU machine: {detect().describe()}")


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_on_the_gpu(
    attack: Attack, evaluator: Evaluator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    marks = [Path("/tmp"), Path(os.path.expanduser("~")), tmp_path]
    stale = {p for d in marks for p in d.glob("kf-attack-outside-*")}
    try:
        result = evaluator.evaluate(TASK, attack.source)
        harm = attack.harm(str(result.verdict), result.reasons, result.speedup, result.log)
        assert not harm, (harm, result.reasons, result.log[-2000:])
        assert {p for d in marks for p in d.glob("kf-attack-outside-*")} == stale
    finally:
        for path in {p for d in marks for p in d.glob("kf-attack-outside-*")} - stale:
            path.unlink(missing_ok=True)
    assert evaluator.evaluate(TASK, C.HONEST).verdict == Verdict.CORRECT
