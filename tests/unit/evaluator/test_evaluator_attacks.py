"""The attack suite (issue 9): candidates that go for the machinery, at the strongest isolation
this machine offers. Each must get its expected verdict, leave no mark outside its sandbox,
and leave the evaluator working. (tests/gpu/test_gpu_attacks.py runs them on the GPU;
benchmarks/attacks.py prints the table for every level.)"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.models import Environment, EvaluationResult, Task, Timing, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.core.store import open_store
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator._sandbox import detect
from tests.support import evaluator_cases as C
from tests.support.attacks import ATTACKS, MARKER, Attack

FAST: dict[str, Any] = {
    "device": "cpu",
    "seed": 20261201,
    "correctness": {"trials": 2},
    "timing": {
        "trials": 10,
        "warmup": 1,
        "flush_bytes": 0,
        "max_speedup_cv": None,
        "retries": 1,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
    },
    "limits": {"timeout_seconds": 120.0, "memory": "2Gi", "scratch_bytes": 256 * 1024**2},
}
TASK = Task(name="matmul", code=C.MATMUL_TASK)


@pytest.fixture(scope="module")
def evaluator() -> Iterator[Evaluator]:
    with Evaluator(EvalConfig.model_validate(FAST)) as shared:
        yield shared


def make_result() -> EvaluationResult:
    timing = Timing(median_ms=1.0, mean_ms=1.0, min_ms=1.0, max_ms=1.0, iqr_ms=0.0, trials=10)
    return EvaluationResult(
        task_hash="a" * 64,
        variant_hash="b" * 64,
        verdict=Verdict.CORRECT,
        reference=timing,
        candidate=timing,
        speedup=1.0,
        environment=Environment(device="cpu", gpu_class="cpu", evaluator_version="0.0.0"),
    )


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _outside_marks(*directories: Path) -> list[str]:
    found: list[str] = []
    for directory in directories:
        found += glob.glob(str(directory / "kf-attack-outside-*"))
    return found


def _daemons() -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == "kf-attack-daemon":
                    alive.append(int(entry))
            except OSError:
                continue
    return alive


def _check(attack: Attack, result: EvaluationResult) -> None:
    harm = attack.harm(str(result.verdict), result.reasons, result.speedup, result.log)
    assert not harm, (harm, result.verdict, result.reasons, result.log[-2000:])
    assert result.isolation == detect().level


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_gets_its_verdict_and_leaves_no_mark(
    attack: Attack, evaluator: Evaluator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The working directory holds a store with a run in it: what the store attacks look for.
    monkeypatch.chdir(tmp_path)
    store = open_store(tmp_path / ".kernelfleet")
    store.put_result("runs/victim", make_result())
    before = _snapshot(tmp_path / ".kernelfleet")
    home = Path(os.path.expanduser("~"))
    stale = _outside_marks(Path("/tmp"), home, tmp_path)
    try:
        result = evaluator.evaluate(TASK, attack.source)
        _check(attack, result)
        assert _snapshot(tmp_path / ".kernelfleet") == before, "the store changed"
        assert _outside_marks(Path("/tmp"), home, tmp_path) == stale, "a file was written outside"
        deadline = time.monotonic() + 5
        while _daemons() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _daemons(), "a daemon the candidate forked outlived it"
    finally:
        for path in set(_outside_marks(Path("/tmp"), home, tmp_path)) - set(stale):
            Path(path).unlink(missing_ok=True)
    # Whatever the attack did, the evaluator goes on judging.
    honest = evaluator.evaluate(TASK, C.HONEST)
    assert honest.verdict == Verdict.CORRECT, (honest.reasons, honest.log)


def test_concurrent_candidates_cannot_reach_each_other() -> None:
    """Candidates in flight side by side: the attacker's kills and ptrace reach neither the
    evaluator nor its neighbour, which is judged as usual."""
    with Evaluator(EvalConfig.model_validate({**FAST, "lane_slots": 3})) as evaluator:
        attacks = [
            evaluator.submit(TASK, a.source)
            for a in ATTACKS
            if a.name in ("kill_grandparent", "ptrace_parent")
        ]
        honest = evaluator.submit(TASK, C.HONEST)
        assert honest.result().verdict == Verdict.CORRECT
        for future in attacks:
            result = future.result()
            assert MARKER not in result.log and result.verdict == Verdict.CORRECT, result.reasons


# A C++/CUDA candidate (the build pool takes anything naming load_inline) works in its own build
# directory. From there it reaches for a neighbour's build directory (to plant a remembered
# build failure in it), for the directory above, and marks its own directory.
_BUILD_DIR_ATTACK = (
    C.HONEST
    + """
# load_inline
from pathlib import Path

_here = Path.cwd()
(_here / "own-mark").write_text("the working directory is the build directory")
for _target in (
    _here.parent / "victim" / ".kf-failed-builds" / "planted",
    _here.parent / "kf-attack-outside-build",
    _here.parent.parent / "kf-attack-outside-build",
):
    try:
        _target.parent.mkdir(parents=True, exist_ok=True)
        _target.write_text("planted")
    except OSError:
        pass
"""
)


def test_a_native_candidate_writes_only_its_own_build_directory(tmp_path: Path) -> None:
    """Its working directory is its build directory (shared by its build, evaluation and
    re-check); a neighbour's build directory, with its remembered failures, stays out of reach."""
    config = EvalConfig.model_validate(
        merged(
            {"cache_dir": str(tmp_path), "isolation": {"min_level": "landlock"}},
            merged(FAST, {"timing": {"speedup_recheck": 0.0}}),
        )
    )
    with Evaluator(config) as evaluator:
        first = evaluator.evaluate(TASK, _BUILD_DIR_ATTACK)
        own = [p.parent for p in tmp_path.rglob("own-mark")]
        assert len(own) == 1, own
        victim = own[0].parent / "victim"
        (victim / ".kf-failed-builds").mkdir(parents=True)
        again = evaluator.evaluate(TASK, _BUILD_DIR_ATTACK)  # the build, evaluation and re-check again
    for result in (first, again):
        assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
        assert "recheck" in result.stages
    assert list((victim / ".kf-failed-builds").iterdir()) == []
    assert list(tmp_path.rglob("kf-attack-outside-build")) == []
