"""The TrainingRun plan: stages in order, the RL stage's evaluation service, suspend, failure;
names and the spec recorded for the pods. Pure functions: no cluster, no store."""

from __future__ import annotations

from typing import Any

import pytest

from kernelfleet.core.resources import TrainingRunSpec
from kernelfleet.operator._training_plan import (
    EVAL_PORT,
    JobState,
    JobView,
    Phase,
    RunRef,
    eval_service_name,
    job_view,
    plan_run,
    resolved_spec,
    runs_own_evaluator,
    stage_job_name,
)

UID = "0b8c6a5e-3f0e-4a43-9c55-8f1e2a7d9b11"
RUN = RunRef("team-a", "coder", UID)


def spec(**extra: Any) -> TrainingRunSpec:
    data: dict[str, Any] = {
        "baseModel": "s3://models/tiny",
        "tasks": ["kernelbench-v0:1"],
        "stages": [
            {"name": "sft", "type": "sft"},
            {"name": "selftrain", "type": "selftrain"},
            {"name": "grpo", "type": "grpo"},
        ],
        "gpuClass": "h100",
        "rewardGpuClass": "l40",
        "rewardGpus": 2,
        **extra,
    }
    return TrainingRunSpec.model_validate(data)


DONE = JobView(JobState.SUCCEEDED)
RUNNING = JobView(JobState.ACTIVE, running=True)


def test_a_new_run_creates_the_first_stage_job_only() -> None:
    plan = plan_run(spec(), RUN, {}, service_ready=False)
    assert plan.phase == Phase.PENDING
    assert plan.stage is not None and plan.stage.name == "sft"
    assert plan.create_job and plan.job_suspend is False
    assert not plan.eval_service


def test_stages_run_in_order_each_after_the_previous_job_completed() -> None:
    plan = plan_run(spec(), RUN, {"sft": DONE}, service_ready=False)
    assert plan.stage is not None and plan.stage.name == "selftrain" and plan.create_job
    plan = plan_run(spec(), RUN, {"sft": DONE, "selftrain": RUNNING}, service_ready=False)
    assert plan.phase == Phase.RUNNING and not plan.create_job
    assert "stage 2/3 selftrain" in plan.message


def test_the_rl_stage_job_waits_suspended_for_its_evaluation_service() -> None:
    jobs = {"sft": DONE, "selftrain": DONE}
    plan = plan_run(spec(), RUN, jobs, service_ready=False)
    assert plan.stage is not None and plan.stage.name == "grpo"
    assert plan.eval_service and plan.create_job and plan.job_suspend is True
    assert "evaluation service" in plan.message
    waiting = {**jobs, "grpo": JobView(JobState.SUSPENDED)}
    assert plan_run(spec(), RUN, waiting, service_ready=False).job_suspend is True
    released = plan_run(spec(), RUN, waiting, service_ready=True)
    assert released.job_suspend is False and released.eval_service


def test_a_running_rl_job_is_never_suspended_because_its_evaluator_restarts() -> None:
    jobs = {"sft": DONE, "selftrain": DONE, "grpo": RUNNING}
    plan = plan_run(spec(), RUN, jobs, service_ready=False)
    assert plan.phase == Phase.RUNNING and plan.job_suspend is False and plan.eval_service


def test_the_evaluation_service_goes_once_the_rl_stage_is_finished() -> None:
    plan = plan_run(spec(), RUN, {"sft": DONE, "selftrain": DONE, "grpo": DONE}, service_ready=True)
    assert plan.phase == Phase.SUCCEEDED and plan.stage is None
    assert not plan.eval_service and not plan.create_job and plan.job_suspend is None


def test_a_failed_stage_fails_the_run_and_removes_its_service() -> None:
    failed = JobView(JobState.FAILED, "Job has reached the specified backoff limit")
    plan = plan_run(spec(), RUN, {"sft": DONE, "selftrain": DONE, "grpo": failed}, service_ready=True)
    assert plan.phase == Phase.FAILED and not plan.eval_service and not plan.create_job
    assert plan.message == "stage 3/3 grpo failed: Job has reached the specified backoff limit"


def test_suspend_suspends_the_current_job_and_frees_the_reward_gpus() -> None:
    jobs = {"sft": DONE, "selftrain": DONE, "grpo": RUNNING}
    plan = plan_run(spec(suspend=True), RUN, jobs, service_ready=True)
    assert plan.phase == Phase.SUSPENDED and plan.job_suspend is True and not plan.eval_service
    assert "newest checkpoint" in plan.message
    fresh = plan_run(spec(suspend=True), RUN, {}, service_ready=False)
    assert fresh.create_job and fresh.job_suspend is True


@pytest.mark.parametrize(
    ("extra", "reward", "own"),
    [
        ({}, None, True),
        ({"rewardGpus": 0}, None, False),
        ({}, {"serviceUrl": "http://eval.shared:8470"}, False),
    ],
)
def test_who_evaluates_the_rewards(extra: dict[str, Any], reward: dict[str, Any] | None, own: bool) -> None:
    stage: dict[str, Any] = {"name": "grpo", "type": "grpo"}
    if reward is not None:
        stage["reward"] = reward
    run = spec(stages=[stage], **extra)
    assert runs_own_evaluator(run, run.stages[0], RUN) is own
    assert plan_run(run, RUN, {}, service_ready=False).eval_service is own


def test_the_recorded_spec_names_the_service_and_never_suspend() -> None:
    run = spec(suspend=True, stages=[{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}])
    recorded = resolved_spec(run, RUN)
    assert recorded.suspend is False
    assert recorded.stages[0] == run.stages[0]
    reward = recorded.stages[1].reward
    assert reward is not None
    assert reward.service_url == RUN.eval_url("rl")
    assert reward.service_url.endswith(f".team-a.svc:{EVAL_PORT}")
    assert reward.clip == 1.5  # the other reward settings keep their defaults
    # Recording is deterministic (the operator compares it with the store's copy), and the run's
    # own service is still recognised as its own in the recorded spec.
    assert resolved_spec(run, RUN) == recorded
    assert resolved_spec(recorded, RUN) == recorded
    assert runs_own_evaluator(recorded, recorded.stages[1], RUN)


def test_names_are_deterministic_short_dns_labels_that_differ_per_uid() -> None:
    long_run, long_stage = "a-very-long-training-run-name-" * 4, "self-training-with-many-rounds-x"
    for name in (stage_job_name(long_run, UID, long_stage), eval_service_name(long_run, UID, long_stage)):
        assert len(name) <= 63 and name == name.lower()
        assert name[0].isalpha() and name[-1].isalnum()
    assert stage_job_name("r", UID, "sft") == stage_job_name("r", UID, "sft")
    assert stage_job_name("r", UID, "sft") != stage_job_name("r", "another-uid", "sft")
    assert eval_service_name("9lives", UID, "rl").startswith("eval-")
    assert RunRef("ns", "r", UID).prefix == f"trainingruns/ns/r/{UID}"


def test_job_view_reads_the_job_controllers_status() -> None:
    assert job_view(None).state == JobState.MISSING
    assert job_view({"spec": {"suspend": True}, "status": {}}).state == JobState.SUSPENDED
    pending = job_view({"spec": {}, "status": {"active": 1, "ready": 0}})
    assert pending.state == JobState.ACTIVE and not pending.running
    evicted = job_view({"spec": {}, "status": {"active": 1, "ready": 1, "failed": 2}})
    assert evicted.running and evicted.failed_pods == 2
    complete = {"status": {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}}
    assert job_view(complete).state == JobState.SUCCEEDED
    failed = {
        "spec": {"suspend": False},
        "status": {
            "conditions": [
                {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "exit code 2"}
            ]
        },
    }
    assert job_view(failed) == JobView(JobState.FAILED, "exit code 2")


def test_the_reward_class_is_fixed_in_the_record_from_the_spec_the_operator_or_the_run() -> None:
    stages = [{"name": "rl", "type": "grpo"}]
    assert resolved_spec(spec(stages=stages), RUN, "a100").reward_gpu_class == "l40"  # the spec's
    own_default = spec(stages=stages, rewardGpuClass="")
    assert resolved_spec(own_default, RUN, "a100").reward_gpu_class == "a100"  # the operator's
    assert resolved_spec(own_default, RUN).reward_gpu_class == "h100"  # the run's gpuClass
    no_service = spec(stages=stages, rewardGpuClass="", rewardGpus=0)
    assert resolved_spec(no_service, RUN, "a100").reward_gpu_class == ""
