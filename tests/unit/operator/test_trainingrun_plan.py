"""The TrainingRun plan: stages in order, one JobSet each, suspend, Kueue, failure; names and the
spec recorded for the pods. Pure functions: no cluster, no store."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kernelfleet.core.resources import TrainingRunSpec
from kernelfleet.operator._lifecycle import active, expiring
from kernelfleet.operator._training_plan import (
    EVAL_PORT,
    GENERATOR_PORT,
    MAX_JOBSET_NAME,
    JobState,
    JobView,
    Phase,
    RunRef,
    eval_service_name,
    jobset_view,
    plan_run,
    resolved_spec,
    runs_own_evaluator,
    stage_jobset_name,
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


def test_a_new_run_creates_the_first_stage_jobset_only() -> None:
    plan = plan_run(spec(), {})
    assert plan.phase == Phase.PENDING
    assert plan.stage is not None and plan.stage.name == "sft"
    assert plan.create_jobset and plan.suspend_jobset is False and not plan.delete_jobset


def test_stages_run_in_order_each_after_the_previous_jobset_completed() -> None:
    plan = plan_run(spec(), {"sft": DONE})
    assert plan.stage is not None and plan.stage.name == "selftrain" and plan.create_jobset
    plan = plan_run(spec(), {"sft": DONE, "selftrain": RUNNING})
    assert plan.phase == Phase.RUNNING and not plan.create_jobset
    assert "stage 2/3 selftrain" in plan.message


def test_a_stage_whose_pods_wait_is_pending() -> None:
    plan = plan_run(spec(), {"sft": JobView(JobState.ACTIVE)})
    assert plan.phase == Phase.PENDING and "waiting for its pods" in plan.message


def test_the_run_succeeds_once_the_last_jobset_completed() -> None:
    plan = plan_run(spec(), {"sft": DONE, "selftrain": DONE, "grpo": DONE})
    assert plan.phase == Phase.SUCCEEDED and plan.stage is None
    assert not plan.create_jobset and plan.suspend_jobset is None


def test_a_failed_stage_fails_the_run() -> None:
    failed = JobView(JobState.FAILED, "jobset failed due to reaching max number of restarts")
    plan = plan_run(spec(), {"sft": DONE, "selftrain": DONE, "grpo": failed})
    assert plan.phase == Phase.FAILED and not plan.create_jobset
    assert plan.message == "stage 3/3 grpo failed: jobset failed due to reaching max number of restarts"


def test_suspend_suspends_the_current_jobset() -> None:
    jobs = {"sft": DONE, "selftrain": DONE, "grpo": RUNNING}
    plan = plan_run(spec(suspend=True), jobs)
    assert plan.phase == Phase.SUSPENDED and plan.suspend_jobset is True and not plan.delete_jobset
    assert "newest checkpoint" in plan.message
    fresh = plan_run(spec(suspend=True), {})
    assert fresh.create_jobset and fresh.suspend_jobset is True


def test_a_queued_stage_is_created_suspended_and_left_to_kueue() -> None:
    queued = spec(queueName="team-a")
    plan = plan_run(queued, {})
    assert plan.create_jobset and plan.suspend_jobset is True and "queued in team-a" in plan.message
    waiting = plan_run(queued, {"sft": JobView(JobState.SUSPENDED)})
    assert waiting.phase == Phase.PENDING and waiting.suspend_jobset is None
    assert "waiting for Kueue to admit it" in waiting.message
    admitted = plan_run(queued, {"sft": RUNNING})
    assert admitted.phase == Phase.RUNNING and admitted.suspend_jobset is None


def test_a_suspended_queued_run_deletes_its_jobset_to_free_the_quota() -> None:
    plan = plan_run(spec(queueName="team-a", suspend=True), {"sft": RUNNING})
    assert plan.phase == Phase.SUSPENDED and plan.delete_jobset and not plan.create_jobset
    gone = plan_run(spec(queueName="team-a", suspend=True), {})
    assert gone.phase == Phase.SUSPENDED and not gone.delete_jobset and not gone.create_jobset


def test_the_old_gpus_field_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"spec\.gpus was replaced by spec\.nodes and spec\.gpusPer"):
        spec(gpus=8)
    assert spec(nodes=2, gpusPerNode=8).trainer_gpus == 16


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


def test_past_the_deadline_a_running_run_fails_and_its_stage_jobset_goes() -> None:
    plan = plan_run(spec(), {"sft": DONE, "selftrain": RUNNING}, deadline_exceeded=True)
    assert plan.phase == Phase.FAILED and plan.reason == "DeadlineExceeded"
    assert plan.stage is not None and plan.stage.name == "selftrain"
    assert plan.delete_jobset and not plan.create_jobset
    assert "activeDeadlineSeconds" in plan.message and "checkpoints stay" in plan.message
    # Gone already (an earlier pass deleted it): still Failed, nothing more to delete or create.
    gone = plan_run(spec(), {"sft": DONE}, deadline_exceeded=True)
    assert gone.phase == Phase.FAILED and not gone.delete_jobset and not gone.create_jobset
    # A run that ended before its deadline keeps its end.
    done = {"sft": DONE, "selftrain": DONE, "grpo": DONE}
    assert plan_run(spec(), done, deadline_exceeded=True).phase == Phase.SUCCEEDED
    failed = plan_run(spec(), {"sft": JobView(JobState.FAILED, message="oom")}, deadline_exceeded=True)
    assert failed.phase == Phase.FAILED and failed.reason == ""


def test_the_spec_is_immutable_but_for_suspend_ttl_and_deadline() -> None:
    assert TrainingRunSpec.MUTABLE == ("suspend", "ttlSecondsAfterFinished", "activeDeadlineSeconds")
    fields = {field.alias or name for name, field in TrainingRunSpec.model_fields.items()}
    assert set(TrainingRunSpec.MUTABLE) <= fields


def test_the_recorded_spec_leaves_out_what_may_change_during_the_run() -> None:
    run = spec(suspend=True, ttlSecondsAfterFinished=60, activeDeadlineSeconds=3600)
    recorded = resolved_spec(run, RUN)
    # The record the pods train with equals the one of the same run with other mutable values,
    # so an edit of suspend, the TTL or the deadline is never a "changed spec".
    assert recorded == resolved_spec(spec(), RUN)
    assert recorded.ttl_seconds_after_finished is None and recorded.active_deadline_seconds is None


def test_the_recorded_spec_names_the_services_and_never_suspend() -> None:
    run = spec(
        suspend=True,
        generatorGpus=4,
        stages=[{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
    )
    recorded = resolved_spec(run, RUN)
    assert recorded.suspend is False
    assert recorded.stages[0] == run.stages[0]
    reward = recorded.stages[1].reward
    assert reward is not None
    jobset = RUN.jobset_name("rl")
    # The stable host names of the JobSet's reward and generator pods (its headless Service).
    assert reward.service_url == RUN.eval_url("rl") == f"http://{jobset}-reward-0-0.{jobset}:{EVAL_PORT}"
    grpo = recorded.stages[1].grpo
    assert grpo is not None and grpo.use_vllm
    assert grpo.vllm_server_base_url == f"http://{jobset}-generator-0-0.{jobset}:{GENERATOR_PORT}"
    assert reward.clip == 1.5  # the other reward settings keep their defaults
    # Recording is deterministic (the operator compares it with the store's copy), and the run's
    # own service is still recognised as its own in the recorded spec.
    assert resolved_spec(run, RUN) == recorded
    assert resolved_spec(recorded, RUN) == recorded
    assert runs_own_evaluator(recorded, recorded.stages[1], RUN)


def test_names_are_deterministic_short_dns_labels_that_differ_per_uid() -> None:
    long_run, long_stage = "a-very-long-training-run-name-" * 4, "self-training-with-many-rounds-x"
    name = stage_jobset_name(long_run, UID, long_stage)
    assert len(name) <= MAX_JOBSET_NAME and name == name.lower()
    assert name[0].isalpha() and name[-1].isalnum()
    # The longest pod host name of its JobSet stays a DNS label.
    assert len(f"{name}-generator-0-0") <= 63
    token = eval_service_name(long_run, UID, long_stage) + "-token"
    assert len(token) <= 63
    assert stage_jobset_name("r", UID, "sft") == stage_jobset_name("r", UID, "sft")
    assert stage_jobset_name("r", UID, "sft") != stage_jobset_name("r", "another-uid", "sft")
    assert RunRef("ns", "r", UID).prefix == f"trainingruns/ns/r/{UID}"


def test_jobset_view_reads_the_jobset_controllers_status() -> None:
    assert jobset_view(None).state == JobState.MISSING
    assert jobset_view({"spec": {"suspend": True}, "status": {}}).state == JobState.SUSPENDED
    two_nodes = {"replicatedJobs": [{"name": "reward", "replicas": 1}, {"name": "trainer", "replicas": 1}]}
    pending = jobset_view(
        {"spec": two_nodes, "status": {"replicatedJobsStatus": [{"name": "reward", "ready": 1}]}}
    )
    assert pending.state == JobState.ACTIVE and not pending.running
    restarted = jobset_view(
        {
            "spec": two_nodes,
            "status": {"restarts": 2, "replicatedJobsStatus": [{"name": "trainer", "ready": 1, "active": 1}]},
        }
    )
    assert restarted.running and restarted.restarts == 2
    complete = {"status": {"conditions": [{"type": "Completed", "status": "True"}]}}
    assert jobset_view(complete).state == JobState.SUCCEEDED
    failed = {
        "spec": {"suspend": False},
        "status": {
            "restarts": 3,
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "ReachedMaxRestarts",
                    "message": "jobset failed due to reaching max number of restarts",
                }
            ],
        },
    }
    assert jobset_view(failed) == JobView(
        JobState.FAILED, "jobset failed due to reaching max number of restarts", restarts=3
    )


def test_the_reward_class_is_fixed_in_the_record_from_the_spec_the_operator_or_the_run() -> None:
    stages = [{"name": "rl", "type": "grpo"}]
    assert resolved_spec(spec(stages=stages), RUN, "a100").reward_gpu_class == "l40"  # the spec's
    own_default = spec(stages=stages, rewardGpuClass="")
    assert resolved_spec(own_default, RUN, "a100").reward_gpu_class == "a100"  # the operator's
    assert resolved_spec(own_default, RUN).reward_gpu_class == "h100"  # the run's gpuClass
    no_service = spec(stages=stages, rewardGpuClass="", rewardGpus=0)
    assert resolved_spec(no_service, RUN, "a100").reward_gpu_class == ""


def test_an_ended_run_is_not_reconciled_and_expires_only_with_a_ttl() -> None:
    assert active({}) and active({"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    assert not active({"phase": "Succeeded", "completionTime": "2026-01-01T00:00:00Z"})
    ended = {"completionTime": "2026-01-01T00:00:00Z"}
    assert expiring(spec={"ttlSecondsAfterFinished": 0}, status=ended)
    assert not expiring(spec={}, status=ended)  # null: kept until deleted
    assert not expiring(spec={"ttlSecondsAfterFinished": 60}, status={"phase": "Running"})


def test_a_run_that_ended_before_completion_time_existed_gets_one_and_nothing_else() -> None:
    import asyncio

    from kernelfleet.operator.trainingrun import reconcile

    ended = {"phase": "Succeeded", "stagesDone": 3, "conditions": [{"type": "Complete", "status": "True"}]}
    body = {"metadata": {"namespace": "team-a", "name": "coder", "uid": UID}, "spec": {}, "status": ended}
    # No runtime: such a run's JobSets may be gone, and planning it again would restart its stages.
    status = asyncio.run(reconcile(body, rt=None, memo=None))  # type: ignore[arg-type]
    assert status == {**ended, "completionTime": status["completionTime"]} and status["completionTime"]
    assert not active(status)
