"""The objects a TrainingRun owns, as the API receives them: the stage Job (one locked-down pod on
the run's pool, resumable), and the RL stage's evaluation Deployment, Service and token."""

from __future__ import annotations

from typing import Any

from kernelfleet.core.resources import TrainingRunSpec
from kernelfleet.operator._jobs import Owner
from kernelfleet.operator._pools import default_pools
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._training_plan import EVAL_PORT, RunRef, resolved_spec
from kernelfleet.operator._training_pods import (
    EXIT_USAGE,
    TOKEN_ENV,
    deployment_ready,
    eval_command,
    eval_deployment,
    eval_service,
    eval_token,
    served_settings,
    stage_command,
    stage_job,
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
        "gpus": 1,
        "rewardGpuClass": "l40",
        "rewardGpus": 2,
        **extra,
    }
    return TrainingRunSpec.model_validate(data)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_a_stage_job_is_one_locked_down_resumable_pod_on_the_runs_pool() -> None:
    run = spec(gpus=1, backoffLimit=5, priorityClassName="training")
    job = stage_job(
        run,
        run.stages[0],
        OWNER,
        prefix=PREFIX,
        store_url="s3://kf/root",
        gpu_class=POOLS["h100"],
        settings=SETTINGS,
        suspend=False,
    )
    meta, job_spec = job["metadata"], job["spec"]
    assert (
        meta["ownerReferences"][0]["uid"] == OWNER.uid and meta["ownerReferences"][0]["kind"] == "TrainingRun"
    )
    assert meta["labels"]["kernelfleet.io/trainingrun"] == "coder"
    assert meta["labels"]["kernelfleet.io/stage"] == "sft"
    assert (job_spec["completions"], job_spec["parallelism"], job_spec["backoffLimit"]) == (1, 1, 5)
    assert job_spec["suspend"] is False
    rules = job_spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [EXIT_USAGE]
    assert rules[1] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    pod = job_spec["template"]["spec"]
    assert job_spec["template"]["metadata"]["labels"] == meta["labels"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "training"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "NVIDIA-H100-80GB-HBM3" in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    (trainer,) = pod["containers"]
    assert trainer["image"] == "registry.example/trainer:1"
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": "1"}
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


def test_several_gpus_start_one_process_per_gpu_with_torchrun() -> None:
    run = spec(gpus=8)
    command = stage_command(run, run.stages[0], PREFIX, "s3://kf")
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node=8", "-m"]
    assert command[4:8] == ["kernelfleet.core.cli", "train", "stage", "--stage"]


def test_the_rl_stage_talks_to_its_evaluation_service_with_the_token_from_a_secret() -> None:
    ref = RunRef(OWNER.namespace, OWNER.name, OWNER.uid)
    run = resolved_spec(spec(), ref)
    rl = run.stages[1]
    secret = token_secret(run, rl, OWNER)
    job = stage_job(
        run,
        rl,
        OWNER,
        prefix=PREFIX,
        store_url="s3://kf",
        gpu_class=POOLS["h100"],
        settings=SETTINGS,
        suspend=True,
    )
    assert job["spec"]["suspend"] is True
    env = env_of(job["spec"]["template"]["spec"]["containers"][0])
    assert env[TOKEN_ENV] == {"secretKeyRef": {"name": secret, "key": "token"}}

    token = eval_token(rl, OWNER)
    assert token["metadata"]["name"] == secret and len(token["stringData"]["token"]) >= 32
    assert token["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid

    deployment = eval_deployment(run, rl, OWNER, gpu_class=POOLS["l40"], settings=SETTINGS)
    name = ref.eval_name("rl")
    assert deployment["metadata"]["name"] == name
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    template = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["restartPolicy"] == "Always" and pod["automountServiceAccountToken"] is False
    assert "NVIDIA-L40" in str(pod["affinity"])
    (evaluator,) = pod["containers"]
    assert evaluator["image"] == "registry.example/worker:1"
    assert evaluator["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    command = evaluator["command"]
    assert command[:3] == ["kernelfleet", "eval", "serve"]
    assert command[command.index("--port") + 1] == str(EVAL_PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    token_file = command[command.index("--token-file") + 1]
    mount = next(m for m in evaluator["volumeMounts"] if token_file.startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret
    assert command[command.index("--correctness-profile") + 1] == "strict"
    assert evaluator["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": EVAL_PORT}

    service = eval_service(rl, OWNER)
    assert service["metadata"]["name"] == name
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["port"] == EVAL_PORT
    assert rl.reward is not None and rl.reward.service_url == f"http://{name}.team-a.svc:{EVAL_PORT}"


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
    run = resolved_spec(spec(evaluation=evaluation), RunRef(OWNER.namespace, OWNER.name, OWNER.uid))
    command = eval_deployment(run, run.stages[1], OWNER, gpu_class=POOLS["l40"], settings=SETTINGS)["spec"][
        "template"
    ]["spec"]["containers"][0]["command"]
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
    run = resolved_spec(spec(), RunRef(OWNER.namespace, OWNER.name, OWNER.uid))
    command = eval_command(run)
    assert command[command.index("--timing-reference-processes") + 1] == "0"
    assert command[command.index("--timing-processes-max") + 1] == str(run.evaluation.timing.processes)


def test_a_token_secret_named_in_the_spec_is_used_as_is() -> None:
    run = spec(stages=[{"name": "rl", "type": "grpo", "reward": {"tokenSecret": "my-eval-token"}}])
    assert token_secret(run, run.stages[0], OWNER) == "my-eval-token"
    assert token_secret(spec(), spec().stages[0], OWNER) == ""


def test_a_deployment_is_ready_once_a_replica_is() -> None:
    assert not deployment_ready(None)
    assert not deployment_ready({"status": {"replicas": 1}})
    assert deployment_ready({"status": {"replicas": 1, "readyReplicas": 1}})
