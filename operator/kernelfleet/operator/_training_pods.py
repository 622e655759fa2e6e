"""The objects a TrainingRun owns: one JobSet per stage, and an RL stage's service token.

A stage's JobSet (sigs.k8s.io/jobset v1alpha2) has up to three roles, each a replicated Job:

- `trainer`: an Indexed Job of `nodes` pods, each with `gpusPerNode` GPUs of `gpuClass`, running

      kernelfleet train stage --stage NAME --prefix trainingruns/<ns>/<name>/<uid> --store URL

  (under `torchrun`: one process per GPU, and with several nodes a c10d rendezvous on the first
  pod's stable host name, `<jobset>-trainer-0-0.<jobset>`, which the JobSet's headless Service
  resolves). The pods get no configuration file: the spec they train with is the one the
  operator recorded in the store at the start (`kernelfleet.core.training.run_record`), so pods
  started again after a restart train the same thing and resume from the newest checkpoint.
- `generator` (an RL stage with `generatorGpus`): trl's vLLM server (`kernelfleet train
  generator` fetches the stage's starting weights from the store, then runs `trl vllm-serve`)
  on `generatorGpus` GPUs of `gpuClass`; the trainer reaches it at its stable host name.
- `reward` (an RL stage that evaluates on a service of its own): `kernelfleet eval serve` on
  `rewardGpus` GPUs of `rewardGpuClass`, behind a bearer token: the Secret `reward.tokenSecret`
  names, or one the operator creates for the stage (owned by the run, so it goes with it).

The trainer starts once the server it needs first is ready (`dependsOn`); the JobSet succeeds
when the trainer's Job does (its success policy), and then stops the servers. Any pod that fails
fails its Job (no retries inside a Job: ranks must restart together), and the JobSet restarts
every role, up to `backoffLimit` times (the evaluation service's container alone is restarted
in place, up to `backoffLimit` times, while the trainer's reward requests wait); a usage error
(exit status 2: the same pods would fail the same way) fails the JobSet at once, and an eviction
or preemption (the pod's `DisruptionTarget` condition) restarts it without counting. With
`queueName` the JobSet carries Kueue's queue label and is created suspended: Kueue admits every
role's pods as one workload. Every pod is the locked-down pod of `_jobs.pod_spec`.
"""

from __future__ import annotations

import secrets
from typing import Any

from kernelfleet.core.job_options import EVALUATION_OPTIONS
from kernelfleet.core.resources import PodRequests, TrainingRunSpec, TrainingStage
from kernelfleet.core.settings import EvaluationSettings
from kernelfleet.operator._jobs import (
    KUEUE_QUEUE_LABEL,
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
from kernelfleet.operator._training_plan import (
    EVAL_PORT,
    GENERATOR_PORT,
    RENDEZVOUS_PORT,
    ROLE_GENERATOR,
    ROLE_REWARD,
    ROLE_TRAINER,
    RunRef,
    runs_own_evaluator,
    runs_own_generator,
)

KIND = "TrainingRun"
LABEL_STAGE = "kernelfleet.io/stage"
ROLE_STAGE = "training-stage"
ROLE_EVAL = "reward-evaluator"
LABEL_JOBSET = "jobset.sigs.k8s.io/jobset-name"
LABEL_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINER_CONTAINER = "trainer"
GENERATOR_CONTAINER = "generator"
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


def stage_command(
    spec: TrainingRunSpec, stage: TrainingStage, prefix: str, store_url: str, run: RunRef
) -> list[str]:
    """The trainer pod's command. The work directory comes from $KERNELFLEET_TRAIN_DIR."""
    args = ["train", "stage", "--stage", stage.name, "--prefix", prefix, "--store", store_url]
    module = ["-m", "kernelfleet.core.cli", *args]
    if spec.nodes > 1:
        # Every pod's torchrun meets the others at the first pod's (the pod that matches the
        # endpoint's host name hosts the rendezvous store); a JobSet restart is a new rendezvous.
        return [
            "torchrun",
            f"--nnodes={spec.nodes}",
            f"--nproc-per-node={spec.gpus_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={run.leader_host(stage.name)}:{RENDEZVOUS_PORT}",
            f"--rdzv-id={run.jobset_name(stage.name)}",
            *module,
        ]
    if spec.gpus_per_node > 1:
        # One process per GPU; the trainer's rank 0 writes to the store.
        return ["torchrun", "--standalone", f"--nproc-per-node={spec.gpus_per_node}", *module]
    return ["kernelfleet", *args]


def generator_command(spec: TrainingRunSpec, stage: TrainingStage, prefix: str, store_url: str) -> list[str]:
    """`trl vllm-serve` on the stage's starting weights (fetched from the store first)."""
    return [
        "kernelfleet",
        "train",
        "generator",
        "--stage",
        stage.name,
        "--prefix",
        prefix,
        "--store",
        store_url,
        "--host",
        "0.0.0.0",
        "--port",
        str(GENERATOR_PORT),
        "--tensor-parallel-size",
        str(spec.generator_gpus),
    ]


def _requests(requests: PodRequests) -> dict[str, str]:
    return {name: value for name, value in (("cpu", requests.cpu), ("memory", requests.memory)) if value}


def _failure_policy(container_name: str) -> dict[str, Any]:
    """A Job of the JobSet fails on its first failed pod: the JobSet's failure policy decides."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container_name, "operator": "In", "values": [EXIT_USAGE]},
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def _replicated_job(
    role: str,
    pods: int,
    pod: dict[str, Any],
    labels: dict[str, str],
    container_name: str,
    depends_on: str = "",
    restarts_in_place: int = 0,
) -> dict[str, Any]:
    """One role. `restarts_in_place` > 0: the container is restarted where it runs (restart
    policy OnFailure) up to that many times before its Job fails; else the first failed pod
    fails the Job, and the JobSet's failure policy restarts every role."""
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pods,
        "parallelism": pods,
        "backoffLimit": restarts_in_place,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }
    if restarts_in_place:
        pod["restartPolicy"] = "OnFailure"
    else:
        job_spec["podFailurePolicy"] = _failure_policy(container_name)
    job: dict[str, Any] = {
        "name": role,
        "replicas": 1,
        "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec},
    }
    if depends_on:
        job["dependsOn"] = [{"name": depends_on, "status": "Ready"}]
    return job


def _trainer_image_pod(
    spec: TrainingRunSpec,
    *,
    name: str,
    command: list[str],
    gpus: int,
    requests: PodRequests,
    store_url: str,
    gpu_class: GpuClass,
    settings: OperatorSettings,
    token: str = "",
    ports: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A pod of the trainer image (a trainer rank group, or the vLLM server): the store, the
    scratch volume its checkpoints and weights live on until uploaded, shared memory for NCCL."""
    main = container(
        name=name,
        image=settings.trainer_image,
        pull_policy=settings.trainer_pull_policy,
        command=command,
        env={**store_env(settings, store_url), "KERNELFLEET_TRAIN_DIR": TRAIN_DIR},
        gpu_resource=gpu_class.gpu_resource,
        gpus=gpus,
        requests=_requests(requests),
        store_secret=bool(settings.store_secret),
        env_from_secrets=[(TOKEN_ENV, token, TOKEN_KEY)] if token else [],
    )
    if ports:
        main["ports"] = [
            {"name": port, "containerPort": number, "protocol": "TCP"} for port, number in ports.items()
        ]
    pod = pod_spec(
        [main],
        settings=settings,
        gpu_class=gpu_class,
        priority_class_name=spec.priority_class_name,
        scratch_size="500Gi",
        shm_size="64Gi" if gpus > 1 else "8Gi",
    )
    return pod


def _trainer(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    prefix: str,
    store_url: str,
    gpu_class: GpuClass,
    settings: OperatorSettings,
) -> tuple[dict[str, Any], dict[str, str]]:
    pod = _trainer_image_pod(
        spec,
        name=TRAINER_CONTAINER,
        command=stage_command(spec, stage, prefix, store_url, ref_of(owner)),
        gpus=spec.gpus_per_node,
        requests=spec.trainer_requests,
        store_url=store_url,
        gpu_class=gpu_class,
        settings=settings,
        token=token_secret(spec, stage, owner),
        ports={"rendezvous": RENDEZVOUS_PORT} if spec.nodes > 1 else None,
    )
    return pod, {**stage_labels(owner, stage.name, ROLE_STAGE), LABEL_GPU_CLASS: gpu_class.name}


def _generator(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    prefix: str,
    store_url: str,
    gpu_class: GpuClass,
    settings: OperatorSettings,
) -> tuple[dict[str, Any], dict[str, str]]:
    pod = _trainer_image_pod(
        spec,
        name=GENERATOR_CONTAINER,
        command=generator_command(spec, stage, prefix, store_url),
        gpus=spec.generator_gpus,
        requests=spec.generator_requests,
        store_url=store_url,
        gpu_class=gpu_class,
        settings=settings,
        ports={"http": GENERATOR_PORT},
    )
    # The server answers /health once the model is loaded, which can take minutes.
    pod["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/health", "port": GENERATOR_PORT},
        "periodSeconds": 10,
        "failureThreshold": 3,
    }
    return pod, {**stage_labels(owner, stage.name, ROLE_GENERATOR), LABEL_GPU_CLASS: gpu_class.name}


def stage_jobset(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    prefix: str,
    store_url: str,
    gpu_class: GpuClass,
    reward_class: GpuClass | None,
    settings: OperatorSettings,
    suspend: bool,
) -> dict[str, Any]:
    """The JobSet of one stage; see the module docstring."""
    run = ref_of(owner)
    replicated: list[dict[str, Any]] = []
    if runs_own_evaluator(spec, stage, run):
        if reward_class is None:
            raise ValueError("an RL stage with an evaluation service of its own needs its reward class")
        pod, labels = _evaluator(spec, stage, owner, gpu_class=reward_class, settings=settings)
        # The evaluation service restarts on its own: the trainer's reward requests wait and retry.
        replicated.append(
            _replicated_job(
                ROLE_REWARD, 1, pod, labels, EVAL_CONTAINER, restarts_in_place=spec.backoff_limit or 1
            )
        )
    if runs_own_generator(spec, stage):
        pod, labels = _generator(
            spec, stage, owner, prefix=prefix, store_url=store_url, gpu_class=gpu_class, settings=settings
        )
        replicated.append(_replicated_job(ROLE_GENERATOR, 1, pod, labels, GENERATOR_CONTAINER))
    pod, labels = _trainer(
        spec, stage, owner, prefix=prefix, store_url=store_url, gpu_class=gpu_class, settings=settings
    )
    # The trainer waits for the server it calls first (the generator), else the evaluator.
    waits_for = replicated[-1]["name"] if replicated else ""
    replicated.append(_replicated_job(ROLE_TRAINER, spec.nodes, pod, labels, TRAINER_CONTAINER, waits_for))
    metadata = _metadata(owner, run.jobset_name(stage.name), stage_labels(owner, stage.name, ROLE_STAGE))
    if spec.queue_name:
        metadata["labels"][KUEUE_QUEUE_LABEL] = spec.queue_name
    usage = f"failed with exit code {EXIT_USAGE} matching FailJob rule"
    jobset_spec: dict[str, Any] = {"suspend": suspend or bool(spec.queue_name)}
    if spec.managed_by:
        # Another controller (MultiKueue) runs the JobSet; this cluster's JobSet controller leaves it.
        jobset_spec["managedBy"] = spec.managed_by
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            **jobset_spec,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [ROLE_TRAINER]},
            "failurePolicy": {
                "maxRestarts": spec.backoff_limit,
                "rules": [
                    {
                        "name": "UsageError",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [usage],
                    },
                    {
                        "name": "Disrupted",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching"],
                    },
                ],
            },
            "replicatedJobs": replicated,
        },
    }


# ---------------------------------------------------------------- the evaluation service


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


def _evaluator(
    spec: TrainingRunSpec,
    stage: TrainingStage,
    owner: Owner,
    *,
    gpu_class: GpuClass,
    settings: OperatorSettings,
) -> tuple[dict[str, Any], dict[str, str]]:
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
        requests=_requests(spec.reward_requests),
    )
    evaluator["ports"] = [{"name": "http", "containerPort": EVAL_PORT, "protocol": "TCP"}]
    evaluator["readinessProbe"] = {
        "httpGet": {"path": "/healthz", "port": EVAL_PORT},
        "periodSeconds": 5,
        "failureThreshold": 3,
    }
    evaluator["volumeMounts"].append({"name": "eval-token", "mountPath": TOKEN_DIR, "readOnly": True})
    pod = pod_spec(
        [evaluator], settings=settings, gpu_class=gpu_class, priority_class_name=spec.priority_class_name
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
    return pod, labels


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
