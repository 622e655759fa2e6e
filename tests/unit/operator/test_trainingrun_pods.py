"""The objects a TrainingRun owns, as the API receives them: the stage JobSet (trainer ranks on
the run's pool, resumable; for the RL stage a vLLM generator and the evaluation service) and the
service's token."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kernelfleet.core.resources import TrainingRunSpec
from kernelfleet.operator._jobs import Owner
from kernelfleet.operator._pools import default_pools
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._training_plan import (
    EVAL_PORT,
    GENERATOR_PORT,
    RENDEZVOUS_PORT,
    RunRef,
    resolved_spec,
)
from kernelfleet.operator._training_pods import (
    EXIT_USAGE,
    TOKEN_ENV,
    eval_command,
    eval_token,
    served_settings,
    stage_command,
    stage_jobset,
    token_secret,
)

OWNER = Owner(
    kind="TrainingRun", name="coder", namespace="team-a", uid="4f7d8e1c-0000-4000-8000-000000000001"
)
SETTINGS = OperatorSettings(
    trainer_image="registry.example/trainer:1",
    worker_image="registry.example/worker:1",
    store_secret="s3-credentials",
    s3_endpoint="minio.storage:9000",
)
POOLS = default_pools()
PREFIX = "trainingruns/team-a/coder/" + OWNER.uid


def spec(**extra: Any) -> TrainingRunSpec:
    data: dict[str, Any] = {
        "baseModel": "s3://models/tiny",
        "tasks": ["kernelbench-v0:1"],
        "stages": [{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
        "gpuClass": "h100",
        "rewardGpuClass": "l40",
        "rewardGpus": 2,
        **extra,
    }
    return TrainingRunSpec.model_validate(data)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


REF = RunRef(OWNER.namespace, OWNER.name, OWNER.uid)


def jobset_of(run: TrainingRunSpec, stage: int, *, suspend: bool = False) -> dict[str, Any]:
    return stage_jobset(
        run,
        run.stages[stage],
        OWNER,
        prefix=PREFIX,
        store_url="s3://kf/root",
        gpu_class=POOLS["h100"],
        reward_class=POOLS["l40"],
        settings=SETTINGS,
        suspend=suspend,
    )


def roles(jobset: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["name"]: job for job in jobset["spec"]["replicatedJobs"]}


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = job["template"]["spec"]["template"]["spec"]
    return pod


def test_an_sft_stage_is_one_jobset_of_locked_down_resumable_trainer_pods() -> None:
    run = spec(backoffLimit=5, priorityClassName="training")
    jobset = jobset_of(run, 0)
    meta, jobset_spec = jobset["metadata"], jobset["spec"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    assert meta["name"] == REF.jobset_name("sft")
    assert (
        meta["ownerReferences"][0]["uid"] == OWNER.uid and meta["ownerReferences"][0]["kind"] == "TrainingRun"
    )
    assert meta["labels"]["kernelfleet.io/trainingrun"] == "coder"
    assert meta["labels"]["kernelfleet.io/stage"] == "sft"
    assert "kueue.x-k8s.io/queue-name" not in meta["labels"]
    assert jobset_spec["suspend"] is False
    assert jobset_spec["network"]["enableDNSHostnames"] is True
    assert jobset_spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    # A usage error fails the stage at once; a disruption restarts it without counting; any other
    # failed pod restarts it (every pod), up to backoffLimit times.
    policy = jobset_spec["failurePolicy"]
    assert policy["maxRestarts"] == 5
    usage, disrupted = policy["rules"]
    assert (
        usage["action"] == "FailJobSet"
        and f"exit code {EXIT_USAGE} matching" in usage["onJobFailureMessagePatterns"][0]
    )
    assert disrupted["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert "DisruptionTarget" in disrupted["onJobFailureMessagePatterns"][0]
    (trainer_job,) = jobset_spec["replicatedJobs"]
    assert (
        trainer_job["name"] == "trainer" and trainer_job["replicas"] == 1 and "dependsOn" not in trainer_job
    )
    job_spec = trainer_job["template"]["spec"]
    assert (job_spec["completions"], job_spec["parallelism"], job_spec["backoffLimit"]) == (1, 1, 0)
    assert job_spec["completionMode"] == "Indexed"
    rules = job_spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [EXIT_USAGE]
    assert rules[1] == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    pod = pod_of(trainer_job)
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "training"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "NVIDIA-H100-80GB-HBM3" in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    (trainer,) = pod["containers"]
    assert trainer["image"] == "registry.example/trainer:1"
    assert trainer["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert trainer["securityContext"]["readOnlyRootFilesystem"] is True
    assert trainer["command"] == [
        "kernelfleet",
        "train",
        "stage",
        "--stage",
        "sft",
        "--prefix",
        PREFIX,
        "--store",
        "s3://kf/root",
    ]
    env = env_of(trainer)
    assert (
        env["KERNELFLEET_STORE"] == "s3://kf/root" and env["KERNELFLEET_S3_ENDPOINT"] == "minio.storage:9000"
    )
    assert env["KERNELFLEET_TRAIN_DIR"].startswith("/scratch/")
    assert TOKEN_ENV not in env  # an sft stage talks to no evaluation service


def test_several_gpus_on_one_node_start_one_process_per_gpu_with_torchrun() -> None:
    run = spec(gpusPerNode=8)
    command = stage_command(run, run.stages[0], PREFIX, "s3://kf", REF)
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node=8", "-m"]
    assert command[4:8] == ["kernelfleet.core.cli", "train", "stage", "--stage"]


def test_several_nodes_meet_at_the_first_trainer_pods_stable_host_name() -> None:
    run = spec(nodes=2, gpusPerNode=8, trainerRequests={"cpu": "96", "memory": "1600Gi"})
    jobset = jobset_of(run, 0)
    job = roles(jobset)["trainer"]
    assert (job["template"]["spec"]["completions"], job["template"]["spec"]["parallelism"]) == (2, 2)
    (trainer,) = pod_of(job)["containers"]
    name = jobset["metadata"]["name"]
    assert trainer["command"][:6] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={name}-trainer-0-0.{name}:{RENDEZVOUS_PORT}",
        f"--rdzv-id={name}",
    ]
    assert trainer["ports"] == [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    assert trainer["resources"] == {
        "limits": {"nvidia.com/gpu": "8"},
        "requests": {"cpu": "96", "memory": "1600Gi"},
    }


def test_the_rl_stage_has_a_generator_and_a_reward_role_that_the_trainer_waits_for() -> None:
    run = resolved_spec(spec(generatorGpus=4, rewardRequests={"cpu": "16"}), REF)
    rl = run.stages[1]
    secret = token_secret(run, rl, OWNER)
    jobset = jobset_of(run, 1, suspend=True)
    assert jobset["spec"]["suspend"] is True
    assert list(roles(jobset)) == ["reward", "generator", "trainer"]
    trainer_job = roles(jobset)["trainer"]
    assert trainer_job["dependsOn"] == [{"name": "generator", "status": "Ready"}]
    env = env_of(pod_of(trainer_job)["containers"][0])
    assert env[TOKEN_ENV] == {"secretKeyRef": {"name": secret, "key": "token"}}

    token = eval_token(rl, OWNER)
    assert token["metadata"]["name"] == secret and len(token["stringData"]["token"]) >= 32
    assert token["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid

    generator = pod_of(roles(jobset)["generator"])
    assert "NVIDIA-H100-80GB-HBM3" in str(generator["affinity"])
    (server,) = generator["containers"]
    assert server["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert server["command"][:3] == ["kernelfleet", "train", "generator"]
    assert server["command"][server.get("command").index("--tensor-parallel-size") + 1] == "4"
    assert server["ports"][0]["containerPort"] == GENERATOR_PORT
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": GENERATOR_PORT}

    # The evaluation service restarts in place (the trainer's reward requests wait and retry);
    # only its Job's restarts spent restart the whole stage.
    reward_job = roles(jobset)["reward"]["template"]["spec"]
    assert reward_job["backoffLimit"] == 3 and "podFailurePolicy" not in reward_job
    reward = pod_of(roles(jobset)["reward"])
    assert reward["restartPolicy"] == "OnFailure" and reward["automountServiceAccountToken"] is False
    assert "NVIDIA-L40" in str(reward["affinity"])
    (evaluator,) = reward["containers"]
    assert evaluator["image"] == "registry.example/worker:1"
    assert evaluator["resources"] == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"cpu": "16"}}
    command = evaluator["command"]
    assert command[:3] == ["kernelfleet", "eval", "serve"]
    assert command[command.index("--port") + 1] == str(EVAL_PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    token_file = command[command.index("--token-file") + 1]
    mount = next(m for m in evaluator["volumeMounts"] if token_file.startswith(m["mountPath"]))
    volume = next(v for v in reward["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret
    assert command[command.index("--correctness-profile") + 1] == "strict"
    assert evaluator["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": EVAL_PORT}
    name = jobset["metadata"]["name"]
    assert rl.reward is not None and rl.reward.service_url == f"http://{name}-reward-0-0.{name}:{EVAL_PORT}"


def test_without_a_generator_the_trainer_waits_for_the_evaluation_service() -> None:
    run = resolved_spec(spec(), REF)
    jobset = jobset_of(run, 1)
    assert list(roles(jobset)) == ["reward", "trainer"]
    assert roles(jobset)["trainer"]["dependsOn"] == [{"name": "reward", "status": "Ready"}]


def test_a_queued_stage_carries_the_queue_label_and_starts_suspended() -> None:
    jobset = jobset_of(spec(queueName="team-a-gpus"), 0)
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert jobset["spec"]["suspend"] is True


def test_managed_by_is_passed_to_each_stage_jobset_for_multikueue() -> None:
    for stage in (0, 1):
        jobset = jobset_of(spec(managedBy="kueue.x-k8s.io/multikueue", queueName="team-a-gpus"), stage)
        assert jobset["spec"]["managedBy"] == "kueue.x-k8s.io/multikueue"
    # Unset: the field is left out, so this cluster's JobSet controller runs the JobSet.
    assert "managedBy" not in jobset_of(spec(), 0)["spec"]
    with pytest.raises(ValidationError, match="managedBy"):
        spec(managedBy="not a controller name")


def test_the_evaluation_service_gets_every_evaluation_setting_of_the_spec() -> None:
    """The command the operator writes, read back by the real `kernelfleet eval serve` parser,
    gives the spec's evaluation settings: a setting the service left out (a session's reference
    pool, a timeout) would make the run's rewards other than the ones its spec asked for."""
    import argparse

    from kernelfleet.core.options import leaf_fields, lookup
    from kernelfleet.core.settings import EvaluationSettings
    from kernelfleet.evaluator import cli as eval_cli

    evaluation = {
        "correctness": {"profile": "kernelbench-v0", "requireKernel": True},
        "timing": {"referenceProcesses": 4},
        "limits": {"timeoutSeconds": 120, "memory": "8G"},
    }
    run = resolved_spec(spec(evaluation=evaluation), REF)
    command = pod_of(roles(jobset_of(run, 1))["reward"])["containers"][0]["command"]
    parser = argparse.ArgumentParser(prog="kernelfleet")
    eval_cli.register(parser.add_subparsers())
    args = parser.parse_args(command[1:])
    served = eval_cli._config(args, eval_cli.SERVE_OPTIONS, eval_cli.SERVE_DEFAULTS)
    for path in leaf_fields(EvaluationSettings):
        assert lookup(served, path) == lookup(served_settings(run.evaluation), path), path
    assert served.timing.reference_processes == 4 and served.correctness.require_kernel is True
    # timingProcessesMax left out of the spec: exactly timing_processes pairs, as a local run
    # evaluates, not the service's own default of 4; the same result-cache key as well.
    assert served.timing.processes_max == served.timing.processes == 2
    assert ".pairsmax" not in served.result_version


def test_a_spec_without_a_reference_pool_turns_the_services_pool_off() -> None:
    """`kernelfleet eval serve` pools references by default; a TrainingRun whose spec sets no pool
    gets `--reference-processes 0`, so that its cluster rewards match a local run's."""
    run = resolved_spec(spec(), REF)
    command = eval_command(run)
    assert command[command.index("--timing-reference-processes") + 1] == "0"
    assert command[command.index("--timing-processes-max") + 1] == str(run.evaluation.timing.processes)


def test_a_token_secret_named_in_the_spec_is_used_as_is() -> None:
    run = spec(stages=[{"name": "rl", "type": "grpo", "reward": {"tokenSecret": "my-eval-token"}}])
    assert token_secret(run, run.stages[0], OWNER) == "my-eval-token"
    assert token_secret(spec(), spec().stages[0], OWNER) == ""
