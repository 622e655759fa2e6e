"""One source for each setting: the resources, the runtime and the command line agree.

The job spec and `kernelfleet optimize` share `Budget` and `EvaluationSettings`; the
evaluator's `EvalConfig` extends the latter; the flags are generated from the fields. These
tests pin that the defaults seen from each side are the same values, and that a bad option
is refused with the flag's name.
"""

from __future__ import annotations

import argparse

import pytest

from kernelfleet.core.errors import UsageError
from kernelfleet.core.options import Flag, ModelOptions, leaf_fields, lookup
from kernelfleet.core.resources import OptimizationJobSpec, PolicySpec, RewardSpec, TrainingRunSpec
from kernelfleet.core.settings import Budget, EvaluationProfile, EvaluationSettings
from kernelfleet.evaluator import PROFILES, EvalConfig
from kernelfleet.search import LoopSettings, PolicyOptions
from kernelfleet.search import cli as search_cli


def optimize_args(*argv: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kernelfleet")
    search_cli.register_optimize(root.add_subparsers(dest="command"))
    return root.parse_args(["optimize", "tasks", *argv])


def test_the_resource_and_the_runtime_share_their_defaults() -> None:
    spec = OptimizationJobSpec(tasks=["kernelbench-v0:1:1"])
    assert spec.budget == Budget()
    assert spec.evaluation == EvaluationSettings()
    assert TrainingRunSpec.model_fields["evaluation"].annotation is EvaluationSettings
    # Every shared setting, group by group, has the same default in the evaluator's config.
    config = EvalConfig()
    for path in leaf_fields(EvaluationSettings):
        assert lookup(config, path) == lookup(EvaluationSettings(), path), path
    # The trainer's reward prompts and the loop show the same number of exemplars by default.
    assert RewardSpec().exemplars == LoopSettings().exemplars
    assert RewardSpec().bucket_temperature == LoopSettings().bucket_temperature
    policy = PolicySpec(kind="openai")
    assert (policy.concurrency, policy.temperature) == (
        PolicyOptions().concurrency,
        PolicyOptions().temperature,
    )


def test_the_command_line_defaults_are_the_models() -> None:
    args = optimize_args()
    assert search_cli.BUDGET_OPTIONS.build(args) == Budget()
    assert search_cli.EVALUATION_OPTIONS.build(args) == EvaluationSettings()
    assert search_cli.SEARCH_OPTIONS.build(args) == LoopSettings()
    assert search_cli.POLICY_OPTIONS.build(args) == PolicyOptions()
    assert search_cli.BUDGET_OPTIONS.given(args) == {}


def test_every_profile_has_rules_and_a_flag_choice() -> None:
    assert set(PROFILES) == set(EvaluationProfile)
    args = optimize_args("--profile", "strict-tf32")
    assert search_cli.EVALUATION_OPTIONS.build(args).correctness.profile == EvaluationProfile.STRICT_TF32


def test_a_job_spec_takes_camel_case_and_the_runtime_names() -> None:
    spec = OptimizationJobSpec.model_validate(
        {"tasks": ["x"], "budget": {"samplesPerRound": 2, "wallTimeSeconds": 60}}
    )
    assert spec.budget == Budget(samples_per_round=2, wall_time_seconds=60.0)
    assert spec.model_dump(by_alias=True)["budget"]["wallTimeSeconds"] == 60.0


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (["--timing-trials", "2"], "--timing-trials", "greater than or equal to 3"),
        (["--target-speedup", "nan"], "--target-speedup", "finite"),
        (["--wall-time", "inf"], "--wall-time", "finite"),
        (["--wall-time", "soon"], "--wall-time", "not a duration"),
        (["--exemplars", "-1"], "--exemplars", "greater than or equal to 0"),
        (["--device", "tpu"], "--device", "'cpu', 'cuda' or 'cuda:N'"),
        (["--rounds", "two"], "--rounds", "valid integer"),
        (["--profile", "loose"], "--correctness-profile/--profile", "input should be 'strict'"),
    ],
)
def test_a_bad_option_names_the_flag(
    argv: list[str], flag: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        optimize_args(*argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and why in err, err
    assert "Traceback" not in err


def test_durations_and_fields_errors_from_build() -> None:
    assert optimize_args("--wall-time", "15m").wall_time_seconds == 900.0
    options = ModelOptions(Budget, Flag("samples_per_round", "--samples"))
    with pytest.raises(UsageError, match=r"--samples: input should be greater than or equal to 1"):
        options.build_from({"samples_per_round": 0})
    with pytest.raises(ValueError, match="no field"):
        ModelOptions(Budget, Flag("samples", "--samples"))


def test_help_shows_the_fields_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        optimize_args("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "Contrastive rounds, per task (default: 4)" in out
    assert "Timed calls of each side, per timing batch (default: 100)" in out
    assert "(default: no limit)" in out
    assert "skip re-verifying the best variant" in out


def test_a_model_written_back_as_flags_parses_to_itself() -> None:
    """`argv` is `build`'s inverse: every field with a value is written (so a program with other
    defaults still gets it), a boolean flag only when it says something, None never."""
    options = ModelOptions(EvaluationSettings)
    settings = EvaluationSettings.model_validate(
        {
            "correctness": {"profile": EvaluationProfile.KERNELBENCH_V0, "require_kernel": True},
            "timing": {"reference_processes": 4, "processes_max": 4},
        }
    )
    words = options.argv(settings)
    assert (
        "--correctness-require-kernel" in words
        and words[words.index("--timing-reference-processes") + 1] == "4"
    )
    assert "--limits-memory" not in words  # None: the reader's own default
    parser = argparse.ArgumentParser()
    options.add_to(parser)
    assert options.build(parser.parse_args(words)) == settings
    assert "--correctness-require-kernel" not in options.argv(EvaluationSettings())


def test_more_pairs_than_always_timed_is_checked_where_users_set_it() -> None:
    """timing.processes_max is an evaluation setting (a flag, a job's spec): one below
    timing.processes is refused with both names and the fix."""
    with pytest.raises(
        ValueError, match=r"timing.processes_max \(2\) is below timing.processes \(3\): set it to 3"
    ):
        EvaluationSettings.model_validate({"timing": {"processes": 3, "processes_max": 2}})


def test_a_reference_pool_of_one_process_is_refused_and_zero_is_off() -> None:
    """0 turns the pool off where a default turns it on (eval serve); 1 would pool a single
    process, which says nothing an evaluation's own pairs do not: refused with the fix."""
    assert (
        EvaluationSettings.model_validate({"timing": {"reference_processes": 0}}).timing.reference_processes
        == 0
    )
    with pytest.raises(ValueError, match=r"reference_processes 1 .* set 0 \(off\) or 2 and more"):
        EvaluationSettings.model_validate({"timing": {"reference_processes": 1}})


def test_help_says_what_a_setting_does_never_a_measured_figure() -> None:
    """Field help (and so CLI help and the CRDs' descriptions) names no GPU model and quotes no
    measured share: figures live in docs/measurements.md, where they can be dated and sourced."""
    import re

    measured = re.compile(r"\bH[12]00s?\b|\bp90\b|\d+\.\d+%|per (GPU-)?hour")
    for model in (Budget, EvaluationSettings, EvalConfig, LoopSettings):
        for name, info in model.model_fields.items():
            text = info.description or ""
            assert not measured.search(text), f"{model.__name__}.{name}: {text}"
