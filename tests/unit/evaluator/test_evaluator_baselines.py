"""The compile baselines measure what a user of `torch.compile` gets: warm-up leaves nothing to
recompile for the timed calls, and compiled CPU kernels use the child's thread count (inductor
bakes the compiling process's OpenMP team size into its kernels). Run in process; no timing is
asserted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig
from kernelfleet.evaluator import _child as C

TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * self.scale + 1.0


def get_inputs():
    return [torch.randn(8, 64)]


def get_init_inputs():
    return [0.5]
"""


@pytest.fixture
def torch_state() -> Iterator[None]:
    """The child's setup changes process-wide torch state; give the other tests theirs back."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    cpp_threads = inductor_config.cpp.threads
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        inductor_config.cpp.threads = cpp_threads
        torch.set_float32_matmul_precision(precision)
        torch._dynamo.reset()


def _job(tmp_path: Path, **overrides: Any) -> C.Job:
    config = EvalConfig.model_validate(
        merged({"device": "cpu", "timing": {"warmup": 2, "trials": 3}}, overrides)
    )
    return C.Job(mode="baselines", config=config, reference=TASK, work_dir=str(tmp_path), seed=3)


@pytest.mark.usefixtures("torch_state")
def test_compiled_kernels_are_keyed_by_the_childs_thread_count(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    inductor_config.cpp.threads = -1  # torch's default: the compiling process's count, unkeyed
    session = C.Session(_job(tmp_path, cpu_threads=1))
    session.setup_torch()
    assert torch.get_num_threads() == 1
    assert inductor_config.cpp.threads == 1
    # The setting is part of what inductor's cache key hashes, so a kernel compiled for another
    # thread count is never reused by this child.
    assert inductor_config.save_config_portable(ignore_private_configs=False)["cpp.threads"] == 1


@pytest.mark.usefixtures("torch_state")
def test_timed_calls_of_the_compile_baselines_never_recompile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch._dynamo.reset()
    counters.clear()
    seen: dict[str, Any] = {}
    timing = C.run_timing

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen["grad_enabled"] = torch.is_grad_enabled()
        seen["before"] = dict(counters["stats"])
        run = timing(*args, **kwargs)
        seen["after"] = dict(counters["stats"])
        return run

    monkeypatch.setattr(C, "run_timing", watched)
    answer = C.baselines(_job(tmp_path, timing={"baseline_modes": ("eager", "compile")}))
    assert answer["status"] == "ok"
    assert set(answer["samples"]) == {"eager", "compile"}, answer.get("unavailable")
    assert seen["before"].get("unique_graphs", 0) >= 1  # compiled during warm-up
    assert seen["after"] == seen["before"]  # no frame compiled or recompiled while timed
    assert seen["grad_enabled"] is False  # the task's profile times without autograd
