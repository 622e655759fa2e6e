"""The objects a TrainingRun owns: one Job per stage, and for an RL stage the evaluation service.

A stage's Job is one pod with the run's `gpus` GPUs of `gpuClass`, running

    kernelfleet train stage --stage NAME --prefix trainingruns/<ns>/<name>/<uid> --store URL

(`torchrun --nproc-per-node N -m kernelfleet.core.cli train stage ...` with several GPUs). The
pod gets no configuration file: the spec it trains with is the one the operator recorded in the
store at the start (`kernelfleet.core.training.run_record`), so a pod started again after an
eviction trains the same thing and resumes from the newest checkpoint. The Job retries failed
pods up to `backoffLimit`; evictions and preemptions (the `DisruptionTarget` condition) do not
count, and a usage error (exit status 2: the same pod would fail the same way) fails the Job at once.

An RL stage's rewards come from `kernelfleet eval serve` in a Deployment on `rewardGpuClass`
behind a Service, which the stage reaches at the URL recorded in its spec. The service requires a
bearer token: the Secret `reward.tokenSecret` names, or one the operator creates for the stage
(owned by the run, so it goes with it). Every pod is the locked-down pod of `_jobs.pod_spec`.
"""

from __future__ import annotations

import secrets
from typing import Any

from kernelfleet.core.job_options import EVALUATION_OPTIONS
from kernelfleet.core.resources import TrainingRunSpec, TrainingStage
from kernelfleet.core.settings import EvaluationSettings
from kernelfleet.operator._jobs import (
    LABEL_GPU_CLASS,
    LABEL_ROLE,
    SCRATCH_DIR,
    Owner,
    container,
    label_value,
    pod_spec,
    store_env,
)
from kernelfleet.operator._pools import GpuClass
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._training_plan import EVAL_PORT, RunRef, runs_own_evaluator

KIND = "TrainingRun"
LABEL_STAGE = "kernelfleet.io/stage"
ROLE_STAGE = "training-stage"
ROLE_EVAL = "reward-evaluator"
TRAINER_CONTAINER = "trainer"
EVAL_CONTAINER = "evaluator"
TOKEN_KEY = "token"
TOKEN_DIR = "/var/run/secrets/kernelfleet/eval"
TOKEN_ENV = "KERNELFLEET_EVAL_TOKEN"
TRAIN_DIR = f"{SCRATCH_DIR}/train"
EXIT_USAGE = 2
"""`kernelfleet`'s exit status for bad input: a retry would fail the same way."""


def owner_of(body: Any) -> Owner:
    metadata = body["metadata"]
    return Owner(kind=KIND, name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])


def ref_of(owner: Owner) -> RunRef:
    return RunRef(owner.namespace, owner.name, owner.uid)


def stage_labels(owner: Owner, stage: str, role: str) -> dict[str, str]:
    return {**owner.labels(), LABEL_STAGE: label_value(stage), LABEL_ROLE: role}


def _metadata(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }


def token_secret(spec: TrainingRunSpec, stage: TrainingStage, owner: Owner) -> str:
    """The Secret that holds the bearer token of the stage's evaluation service ('' for none)."""
    if stage.reward is not None and stage.reward.token_secret:
        return stage.reward.token_secret
    run = ref_of(owner)
    if runs_own_evaluator(spec, stage, run):
        return run.eval_token_name(stage.name)
    return ""


def stage_command(spec: TrainingRunSpec, stage: TrainingStage, prefix: str, store_url: str) -> list[str]:
    # The work directory comes from $KERNELFLEET_TRAIN_DIR, on the scratch volume.
    args = ["train", "stage", "--stage", stage.name, "--prefix", prefix, "--store", store_url]
    if spec.gpus > 1:
        # One process per GPU; the trainer's rank 0 writes to the store.
        return [
            "torchrun",
            "--standalone",
            f"--nproc-per-node={spec.gpus}",
            "-m",
            "kernelfleet.core.cli",
            *args,
        ]
    return ["kernelfleet", *args]


def stage_job(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    prefix: str,
    store_url: str,
    gpu_class: GpuClass,
    settings: OperatorSettings,
    suspend: bool,
) -> dict[str, Any]:
    """The batch/v1 Job of one stage: one pod, restarted from the newest checkpoint on failure."""
    labels = {**stage_labels(owner, stage.name, ROLE_STAGE), LABEL_GPU_CLASS: gpu_class.name}
    trainer = container(
        name=TRAINER_CONTAINER,
        image=settings.trainer_image,
        pull_policy=settings.trainer_pull_policy,
        command=stage_command(spec, stage, prefix, store_url),
        env={**store_env(settings, store_url), "KERNELFLEET_TRAIN_DIR": TRAIN_DIR},
        gpu_resource=gpu_class.gpu_resource,
        gpus=spec.gpus,
        store_secret=bool(settings.store_secret),
        env_from_secrets=[(TOKEN_ENV, secret, TOKEN_KEY)]
        if (secret := token_secret(spec, stage, owner))
        else [],
    )
    pod = pod_spec(
        [trainer],
        settings=settings,
        gpu_class=gpu_class,
        priority_class_name=spec.priority_class_name,
        # Checkpoints and downloaded weights live on the scratch volume until they are uploaded.
        scratch_size="500Gi",
        shm_size="64Gi" if spec.gpus > 1 else "8Gi",
    )
    job_spec: dict[str, Any] = {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": spec.backoff_limit,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": TRAINER_CONTAINER,
                        "operator": "In",
                        "values": [EXIT_USAGE],
                    },
                },
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "suspend": suspend,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }
    name = ref_of(owner).job_name(stage.name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(owner, name, labels),
        "spec": job_spec,
    }


# ---------------------------------------------------------------- the evaluation service


def eval_selector(owner: Owner, stage: str) -> dict[str, str]:
    return {owner.label: label_value(owner.name), LABEL_STAGE: label_value(stage), LABEL_ROLE: ROLE_EVAL}


def served_settings(evaluation: EvaluationSettings) -> EvaluationSettings:
    """The spec's evaluation settings with "off" spelled out where `kernelfleet eval serve` has a
    default of its own (a reference pool, more pairs): a setting left off the command line would
    get the service's default, and the cluster's rewards would differ from a local run of the same
    spec, which evaluates in process with exactly these settings."""
    timing = evaluation.timing
    return evaluation.model_copy(
        update={
            "timing": timing.model_copy(
                update={
                    "reference_processes": timing.reference_processes or 0,
                    "processes_max": timing.processes_max or timing.processes,
                }
            ),
        }
    )


def eval_command(spec: TrainingRunSpec) -> list[str]:
    """`kernelfleet eval serve` with every evaluation setting of the run's spec on its command line
    (the reward service is one long session over many candidates of each task: the case that
    `referenceProcesses` pays for, which the TrainingRun example sets)."""
    return [
        "kernelfleet",
        "eval",
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(EVAL_PORT),
        "--token-file",
        f"{TOKEN_DIR}/{TOKEN_KEY}",
        *EVALUATION_OPTIONS.argv(served_settings(spec.evaluation)),
    ]


def eval_deployment(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    gpu_class: GpuClass,
    settings: OperatorSettings,
) -> dict[str, Any]:
    """`kernelfleet eval serve` on `rewardGpus` GPUs of the reward class, ready once /healthz answers."""
    labels = {**stage_labels(owner, stage.name, ROLE_EVAL), LABEL_GPU_CLASS: gpu_class.name}
    evaluator = container(
        name=EVAL_CONTAINER,
        image=settings.worker_image,
        pull_policy=settings.worker_pull_policy,
        command=eval_command(spec),
        env={},
        gpu_resource=gpu_class.gpu_resource,
        gpus=spec.reward_gpus,
    )
    evaluator["ports"] = [{"name": "http", "containerPort": EVAL_PORT, "protocol": "TCP"}]
    evaluator["readinessProbe"] = {
        "httpGet": {"path": "/healthz", "port": EVAL_PORT},
        "periodSeconds": 5,
        "failureThreshold": 3,
    }
    evaluator["volumeMounts"].append({"name": "eval-token", "mountPath": TOKEN_DIR, "readOnly": True})
    pod = pod_spec(
        [evaluator],
        settings=settings,
        gpu_class=gpu_class,
        priority_class_name=spec.priority_class_name,
        restart_policy="Always",
    )
    pod["volumes"].append(
        {
            "name": "eval-token",
            "secret": {
                "secretName": token_secret(spec, stage, owner),
                "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
            },
        }
    )
    name = ref_of(owner).eval_name(stage.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name, labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": eval_selector(owner, stage.name)},
            # The old pod must free its GPUs before a new one asks for them.
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }


def eval_service(stage: TrainingStage, owner: Owner) -> dict[str, Any]:
    name = ref_of(owner).eval_name(stage.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, name, stage_labels(owner, stage.name, ROLE_EVAL)),
        "spec": {
            "type": "ClusterIP",
            "selector": eval_selector(owner, stage.name),
            "ports": [{"name": "http", "port": EVAL_PORT, "targetPort": EVAL_PORT, "protocol": "TCP"}],
        },
    }


def eval_token(stage: TrainingStage, owner: Owner) -> dict[str, Any]:
    """A fresh random token for the stage's service; created once, kept until the run is deleted."""
    name = ref_of(owner).eval_token_name(stage.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, name, stage_labels(owner, stage.name, ROLE_EVAL)),
        "stringData": {TOKEN_KEY: secrets.token_urlsafe(32)},
    }


def deployment_ready(deployment: dict[str, Any] | None) -> bool:
    return bool(deployment and int((deployment.get("status") or {}).get("readyReplicas") or 0) > 0)
