"""A torch.compile candidate compiles once, in the build pool, into a cache that is sealed when
the build has exited; each of its processes restores it, checked against the seal, before it
loads the candidate. A candidate that rewrites its cache after its correctness check is caught,
and where Landlock stands it cannot rewrite it at all."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.models import Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator import reasons as R
from kernelfleet.evaluator._compiled import restore, seal
from kernelfleet.evaluator._ops import uses_torch_compile
from kernelfleet.evaluator._sandbox import detect
from tests.support import evaluator_cases as C

# The second pair restores what the first could have rewritten.
FAST: dict[str, Any] = merged(C.FAST_CPU, {"timing": {"processes": 2}})
MATMUL = Task(name="matmul", code=C.MATMUL_TASK)

# Calls: one in its build's warm-up (its own process); in each evaluation process 3 trials, the
# cache probe and the traced call, then timing. The 6th call of a process is in its timing.
REWRITES_ITS_CACHE = """
import glob
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.compiled = torch.compile(self.product, dynamic=False)
        self.calls = 0

    def product(self, A, B):
        return torch.relu(torch.mm(A, B))

    def forward(self, A, B):
        self.calls += 1
        if self.calls == 6:  # its correctness is checked: for the next process, a faster "kernel"
            for path in glob.glob("ROOT/compiled/*/*/inductor/**/*.py", recursive=True):
                try:
                    with open(path, "a") as code:
                        code.write("\\ncall = lambda args: [args[0].new_zeros(args[0].shape)]\\n")
                except OSError:
                    pass
        return self.compiled(A, B)
"""


def _digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_the_seal_holds_what_the_build_left_and_refuses_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sealed = tmp_path / "sealed"
    (sealed / "inductor" / "ab").mkdir(parents=True)
    (sealed / "inductor" / "ab" / "kernel.py").write_text("call = 1\n")
    (sealed / "triton" / "cd").mkdir(parents=True)
    (sealed / "triton" / "cd" / "kernel.cubin").write_bytes(b"\x7fELF")
    (sealed / "inductor" / "link").symlink_to("/etc/hostname")
    files = seal(sealed, 1 << 20)
    assert files is not None and set(files) == {"inductor/ab/kernel.py", "triton/cd/kernel.cubin"}
    assert seal(sealed, 4) is None  # more than a process may copy: it compiles for itself

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine" / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine" / "triton"))
    assert restore(str(sealed), files) == ""
    assert (tmp_path / "mine" / "inductor" / "ab" / "kernel.py").read_text() == "call = 1\n"
    assert (tmp_path / "mine" / "triton" / "cd" / "kernel.cubin").read_bytes() == b"\x7fELF"

    (sealed / "inductor" / "ab" / "kernel.py").write_text("call = 2\n")
    again = tmp_path / "again"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(again / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(again / "triton"))
    assert "inductor/ab/kernel.py differs" in restore(str(sealed), files)
    assert not [path for path in again.rglob("*") if path.is_file()]  # nothing of it is loaded
    (sealed / "inductor" / "ab" / "kernel.py").unlink()
    (sealed / "inductor" / "ab" / "kernel.py").symlink_to(sealed / "triton" / "cd" / "kernel.cubin")
    assert "no longer be read as a regular file" in restore(str(sealed), files)
    assert "is not a path" in restore(str(sealed), {"../escape": files["inductor/ab/kernel.py"]})


def test_torch_compile_is_recognised() -> None:
    assert uses_torch_compile(REWRITES_ITS_CACHE)
    assert uses_torch_compile("import torch as _kf_torch\nf = _kf_torch.compile(g)\n")
    assert uses_torch_compile("from torch import compile\n")
    assert not uses_torch_compile(C.HONEST)
    assert not uses_torch_compile("import re\npattern = re.compile('x')\n")


def test_a_candidate_that_rewrites_its_cache_for_its_next_process_is_caught(tmp_path: Path) -> None:
    """Without Landlock the rewrite succeeds (any process of the user can write there): the
    second process pair finds the cache changed and rejects the candidate before loading it."""
    config = EvalConfig(**FAST, cache_dir=str(tmp_path), isolation={"level": "process"})
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, REWRITES_ITS_CACHE.replace("ROOT", str(tmp_path)))
    assert result.verdict == Verdict.REJECTED, (result.reasons, result.log)
    assert R.COMPILE_CACHE_CHANGED in R.codes(result.reasons)
    assert "build" in result.stages and "more_pairs" in result.stages


@pytest.mark.skipif(not detect().landlock_abi, reason="Landlock is not available on this kernel")
def test_under_landlock_a_candidate_cannot_rewrite_its_cache(tmp_path: Path) -> None:
    """With Landlock its processes may only read the sealed cache: the rewrite fails, both pairs
    load what the build compiled (the second compiles nothing), and the cache is unchanged."""
    config = EvalConfig(**FAST, cache_dir=str(tmp_path))
    code = REWRITES_ITS_CACHE.replace("ROOT", str(tmp_path))
    with Evaluator(config) as evaluator:
        results = [evaluator.evaluate(MATMUL, code) for _ in range(2)]  # the second finds the seal
        ((key, files),) = evaluator._seals.items()
        assert files  # what the build compiled, sealed
        sealed = next((tmp_path / "compiled").iterdir()) / key
        assert {name: _digests(sealed)[name] for name in files} == files
    for result in results:
        assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
        assert "more_pairs" in result.stages
    assert "build" in results[0].stages and "build" not in results[1].stages
    assert not list((tmp_path / "compiled").iterdir())  # the session's caches go with the evaluator
