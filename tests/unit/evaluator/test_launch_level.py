"""A process slow to launch kernels is replaced before anything loads (EvalConfig.launch_tolerance).

On a GPU each process keeps a launch level for life; the evaluator measures it first thing and
starts a fresh process in place of one above the device's fastest. The measurement and the
replacement run here on the CPU through real sandboxed children; only the floor is forced, since
a CPU has no such levels and the evaluator never holds a CPU lane to one."""

from __future__ import annotations

import math

import pytest
import torch

from kernelfleet.core.models import Task
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator._evaluator import _Lane
from kernelfleet.evaluator._protocol import Evaluation
from kernelfleet.evaluator._timing import LaunchFloor, launch_level_us
from tests.support import evaluator_cases as C


def test_the_floor_keeps_processes_near_the_fastest_and_replaces_slower_ones() -> None:
    floor = LaunchFloor()
    assert floor.keeps(39.5, 0.04)  # the first sets the floor
    assert floor.keeps(36.5, 0.04)  # a faster one lowers it
    assert floor.keeps(37.5, 0.04)  # within 4%
    assert not floor.keeps(39.5, 0.04)  # the slow level
    assert (floor.best_us, floor.processes) == (36.5, 4)


def test_the_launch_level_is_a_time() -> None:
    level = launch_level_us(torch.device("cpu"))
    assert math.isfinite(level) and level > 0


@pytest.mark.parametrize("tolerance", [0.04, None])
def test_a_process_slow_to_launch_is_replaced_and_the_evaluation_goes_on(
    monkeypatch: pytest.MonkeyPatch, tolerance: float | None
) -> None:
    # The lane's own floor, held to on the CPU too (a GPU lane's rule otherwise)
    monkeypatch.setattr(
        _Lane,
        "launch_floor",
        lambda self, config: self.launch if config.launch_tolerance is not None else None,
    )
    config = EvalConfig(**C.FAST_CPU, launch_tolerance=tolerance, launch_rerolls=2)
    with Evaluator(config) as evaluator:
        floor = evaluator._probe_lanes()[0].launch
        floor.best_us = 1e-9  # every real process is slower: each is replaced up to launch_rerolls times
        result = evaluator.evaluate(Task(name="t", code=C.TINY_OUTPUT_TASK), C.TINY_OUTPUT_HONEST)
        metrics = evaluator.metrics.snapshot()
    assert result.verdict == "correct", result.reasons
    if tolerance is None:
        assert floor.processes == 0  # not measured at all
        assert "launch_level" not in result.stages
        assert metrics["launch_processes"] == {}
    else:
        # judge and candidate: each measured three times (the first and two replacements); the
        # last is kept whatever its level, so the evaluation goes on
        # each slow figure was measured again with the lane held before its process went
        assert (floor.processes, floor.replaced, floor.rechecked) == (6, 4, 6)
        assert (metrics["launch_processes"], metrics["launch_replaced"]) == ({"0": 6}, {"0": 4})
        assert metrics["launch_rechecked"] == {"0": 6}
        assert "launch_level" in result.stages
        assert config.result_version.endswith(".launch0.04")


def test_a_process_slow_only_beside_other_evaluations_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a timing the device is shared with other evaluations' correctness steps, which slow
    the chain; a process is replaced only when a measurement on a quiet device (lane held, gate
    closed) says so too."""
    monkeypatch.setattr(_Lane, "launch_floor", lambda self, config: self.launch)
    quiet_calls: list[bool] = []

    def level(self: Evaluation, child: object, message: object) -> float:
        quiet = self.timing_now  # the lane held: the device is this evaluation's alone
        quiet_calls.append(quiet)
        return 36.5 if quiet else 52.0  # slow only as if time-sliced beside a neighbour

    monkeypatch.setattr(Evaluation, "_launch_level", level)
    config = EvalConfig(**C.FAST_CPU, launch_tolerance=0.04, launch_rerolls=2)
    with Evaluator(config) as evaluator:
        floor = evaluator._probe_lanes()[0].launch
        floor.best_us = 36.5
        result = evaluator.evaluate(Task(name="t", code=C.TINY_OUTPUT_TASK), C.TINY_OUTPUT_HONEST)
    assert result.verdict == "correct", result.reasons
    assert quiet_calls == [False, True, False, True]  # judge, then candidate: each measured again
    assert (floor.processes, floor.replaced, floor.rechecked) == (2, 0, 2)
