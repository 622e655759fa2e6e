"""The judge draws a task's inputs on the evaluation's device, and on the host where the task's
`get_inputs` cannot run there. The `meta` device stands in for a GPU: a factory call under it
makes a meta tensor, so where the inputs were drawn shows without one. Run in process."""

from __future__ import annotations

from pathlib import Path

import torch

from kernelfleet.evaluator import EvalConfig
from kernelfleet.evaluator import _child as C

TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return x * y


def get_inputs():
{body}


def get_init_inputs():
    return []
"""

ANY_DEVICE = "    return [torch.randn(8, 64), torch.rand(8, 64)]"
HOST_ONLY = """    if torch.get_default_device().type != "cpu":
        raise RuntimeError("this task draws with a host generator")
    return [torch.randn(8, 64), torch.rand(8, 64)]"""


def _session(tmp_path: Path, body: str) -> C.Session:
    config = EvalConfig(device="cpu")
    job = C.Job(
        mode="evaluate", config=config, reference=TASK.format(body=body), work_dir=str(tmp_path), seed=3
    )
    session = C.Session(job)
    session.load_reference()
    return session


def test_inputs_are_drawn_on_the_evaluations_device(tmp_path: Path) -> None:
    session = _session(tmp_path, ANY_DEVICE)
    assert session.inputs_device == torch.device("cpu")
    first, again, other = session.made_inputs(5), session.made_inputs(5), session.made_inputs(6)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))  # a seed fixes the draw
    assert not torch.equal(first[0], other[0])
    session.inputs_device = torch.device("meta")  # as a GPU would be
    assert [t.device.type for t in session.made_inputs(5)] == ["meta", "meta"]


def test_a_task_that_needs_the_host_is_drawn_there_from_then_on(tmp_path: Path) -> None:
    session = _session(tmp_path, HOST_ONLY)
    host = session.made_inputs(5)
    session.inputs_device = torch.device("meta")
    drawn = session.made_inputs(5)
    assert session.inputs_device is None
    # Seeded again before the host draw: the same values the host gives for this seed.
    assert all(torch.equal(a, b) for a, b in zip(drawn, host, strict=True))
    assert [t.device.type for t in session.made_inputs(6)] == ["cpu", "cpu"]
