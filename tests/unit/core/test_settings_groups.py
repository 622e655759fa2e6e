"""Evaluation settings are grouped by topic (correctness, timing, isolation, limits), with one name
for each setting in Python, in a resource and on the command line; a flat key of before the
groups is refused with its new place named."""

from __future__ import annotations

import argparse

import pytest

from kernelfleet.core.options import leaf_fields
from kernelfleet.core.resources import OptimizationJobSpec
from kernelfleet.core.settings import EvaluationSettings
from kernelfleet.evaluator import EvalConfig
from kernelfleet.search import cli as search_cli


def optimize_args(*argv: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kernelfleet")
    search_cli.register_optimize(root.add_subparsers(dest="command"))
    return root.parse_args(["optimize", "tasks", *argv])


def test_a_setting_has_one_name_in_python_a_resource_and_the_command_line() -> None:
    spec = OptimizationJobSpec.model_validate(
        {"tasks": ["kernelbench-v0:1:1"], "evaluation": {"timing": {"processesMax": 3}}}
    )
    assert spec.evaluation.timing.processes_max == 3
    args = optimize_args("--timing-processes", "3", "--correctness-trials", "2", "--timeout", "90")
    built = search_cli.EVALUATION_OPTIONS.build(args)
    assert (built.timing.processes, built.correctness.trials, built.limits.timeout_seconds) == (3, 2, 90.0)
    assert search_cli.EVALUATION_OPTIONS.given(args) == {
        "correctness": {"trials": 2},
        "timing": {"processes": 3},
        "limits": {"timeout_seconds": 90.0},
    }
    for path in leaf_fields(EvaluationSettings):
        flag = f"--{path.replace('.', '-').replace('_', '-')}"
        assert flag in search_cli.EVALUATION_OPTIONS.names(path), path


@pytest.mark.parametrize(
    ("flat", "grouped"),
    [
        ({"timing_trials": 7}, "timing.trials"),
        ({"timingProcessesMax": 4}, "timing.processes_max"),
        ({"min_isolation": "landlock"}, "isolation.min_level"),
        ({"memory_limit": "8G"}, "limits.memory"),
    ],
)
def test_a_flat_key_of_before_the_groups_is_refused_with_its_new_place(
    flat: dict[str, object], grouped: str
) -> None:
    with pytest.raises(ValueError, match=f"is now {grouped}"):
        EvaluationSettings.model_validate(flat)
    with pytest.raises(ValueError, match=f"is now {grouped}"):
        EvalConfig.model_validate(flat)


@pytest.mark.parametrize(
    ("flat", "grouped"),
    [
        ({"timing": False}, "timing.enabled"),
        ({"isolation": "landlock"}, "isolation.level"),
        ({"exclusive_timing": False}, "timing.exclusive"),
        ({"scratch_bytes": 1024}, "limits.scratch_bytes"),
    ],
)
def test_the_evaluators_own_flat_keys_are_refused_with_their_new_place(
    flat: dict[str, object], grouped: str
) -> None:
    with pytest.raises(ValueError, match=f"is now {grouped}"):
        EvalConfig.model_validate(flat)
