"""Building the batch/v1 Jobs and pods that the operator creates: the one place that says what
a kernelfleet pod may do.

Worker and trainer pods run code a language model wrote, so every pod is locked down the same
way: a non-root user, no privilege escalation, every capability dropped, the runtime's default
seccomp profile, a read-only root filesystem (scratch space, build caches and /dev/shm are
`emptyDir` volumes), no service-account token and no service links. The store credentials come
from a Secret mounted as files, never from the environment.

Everything here is a pure function from settings to plain dicts (the JSON the API takes), so it
is unit-tested without a cluster and reused by every custom resource's module:

    pod = pod_spec(container(...), gpu_class=pools["h100"], gpus=1, settings=settings)
    job = indexed_job(name, namespace, owner, labels, pod, completions=10, parallelism=2, ...)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernelfleet.core.jobplan import EXIT_DETERMINISTIC
from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.operator._pools import GpuClass
from kernelfleet.operator._settings import OperatorSettings

LABEL_PREFIX = GROUP  # kernelfleet.io
LABEL_OWNER_UID = f"{LABEL_PREFIX}/owner-uid"
LABEL_GPU_CLASS = f"{LABEL_PREFIX}/gpu-class"
LABEL_ROLE = f"{LABEL_PREFIX}/role"
LABEL_SHARD = f"{LABEL_PREFIX}/shard"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kernelfleet-operator"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

WORKER_CONTAINER = "worker"
RUN_AS_USER = 10001
SCRATCH_DIR = "/scratch"
SHM_DIR = "/dev/shm"
CREDENTIALS_DIR = "/var/run/secrets/kernelfleet/store"

# A Job's pods are named `<job>-<index>-<random>`, and `<job>-<index>` must be a DNS label
# (63 characters): with up to 99,999 indexes the Job's name keeps 57.
MAX_JOB_NAME = 57
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def label_value(text: str) -> str:
    """`text` as a label value (63 characters at most, alphanumeric at both ends); a long one is
    shortened with a digest so that two long names stay distinct."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    if len(cleaned) <= 63:
        return cleaned
    return f"{cleaned[:54].rstrip('-._')}-{_digest(text)}"


def job_name(*parts: str, uid: str, max_length: int = MAX_JOB_NAME) -> str:
    """A deterministic Job name: the same resource and parts always give the same name, so a
    handler that runs twice finds its Job instead of creating a second one. The uid's first
    characters keep a recreated resource of the same name clear of its predecessor's Jobs."""
    base = _DNS_LABEL.sub("-", "-".join(parts).lower()).strip("-")
    tail = f"-{uid.replace('-', '')[:6]}"
    room = max_length - len(tail)
    if len(base) > room:
        base = f"{base[: room - 9].rstrip('-')}-{_digest(base)}"
    return base + tail


@dataclass(frozen=True)
class Owner:
    """The custom resource that owns the Jobs: deleting it deletes them (garbage collection)."""

    kind: str
    name: str
    namespace: str
    uid: str
    api_version: str = f"{GROUP}/{VERSION}"

    @property
    def label(self) -> str:
        """The label that names the owner on its Jobs and pods: kernelfleet.io/<kind>=<name>."""
        return f"{LABEL_PREFIX}/{self.kind.lower()}"

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def labels(self) -> dict[str, str]:
        return {
            self.label: label_value(self.name),
            LABEL_OWNER_UID: self.uid,
            LABEL_MANAGED_BY: MANAGED_BY,
        }


# ---------------------------------------------------------------------- containers


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def env_list(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in values.items()]


def scratch_env() -> dict[str, str]:
    """Every cache and temporary directory on the scratch volume: the root filesystem is read-only.

    HOME and TMPDIR are the volume itself, which exists when the pod starts (an emptyDir is an
    empty directory; a subdirectory would not exist, and Python would fall back to /tmp)."""
    return {
        "HOME": SCRATCH_DIR,
        "TMPDIR": SCRATCH_DIR,
        "XDG_CACHE_HOME": f"{SCRATCH_DIR}/.cache",
        "TORCH_EXTENSIONS_DIR": f"{SCRATCH_DIR}/.cache/torch_extensions",
        "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/.cache/triton",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def store_env(settings: OperatorSettings, store_url: str) -> dict[str, str]:
    """How a pod reaches the store: the URL, the endpoint, and the mounted credentials."""
    env = {"KERNELFLEET_STORE": store_url}
    if settings.s3_endpoint:
        env["KERNELFLEET_S3_ENDPOINT"] = settings.s3_endpoint
    if settings.s3_secure is not None and "://" not in (settings.s3_endpoint or ""):
        env["KERNELFLEET_S3_SECURE"] = "true" if settings.s3_secure else "false"
    if settings.s3_region:
        env["KERNELFLEET_S3_REGION"] = settings.s3_region
    if settings.s3_create_bucket:
        env["KERNELFLEET_S3_CREATE_BUCKET"] = "true"
    if settings.store_secret:
        env["KERNELFLEET_S3_CREDENTIALS_DIR"] = CREDENTIALS_DIR
    return env


def container(
    *,
    name: str,
    image: str,
    command: Sequence[str],
    env: Mapping[str, str],
    pull_policy: str = "IfNotPresent",
    gpu_resource: str = "",
    gpus: int = 0,
    requests: Mapping[str, str] | None = None,
    store_secret: bool = False,
    env_from_secrets: Sequence[tuple[str, str, str]] = (),
) -> dict[str, Any]:
    """A locked-down container with the scratch volumes (and the store credentials) mounted.

    `env_from_secrets` are (variable, Secret, key) triples: values that stay in their Secret
    (an endpoint's API key) and reach the process through a secretKeyRef.
    """
    resources: dict[str, Any] = {}
    if gpus and gpu_resource:
        resources["limits"] = {gpu_resource: str(gpus)}
    if requests:
        resources["requests"] = dict(requests)
    mounts: list[dict[str, Any]] = [
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        {"name": "shm", "mountPath": SHM_DIR},
    ]
    if store_secret:
        mounts.append({"name": "store-credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True})
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": list(command),
        "env": env_list({**scratch_env(), **env})
        + [
            {"name": variable, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for variable, secret, key in env_from_secrets
        ],
        "resources": resources,
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def pod_spec(
    containers: Sequence[Mapping[str, Any]],
    *,
    settings: OperatorSettings,
    gpu_class: GpuClass | None = None,
    priority_class_name: str = "",
    restart_policy: str = "Never",
    scratch_size: str = "50Gi",
    shm_size: str = "8Gi",
) -> dict[str, Any]:
    """A locked-down pod: placed on `gpu_class`'s pool when given; see the module docstring."""
    volumes: list[dict[str, Any]] = [
        {"name": "scratch", "emptyDir": {"sizeLimit": scratch_size}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
    ]
    if settings.store_secret:
        volumes.append(
            {
                "name": "store-credentials",
                "secret": {
                    "secretName": settings.store_secret,
                    "items": [
                        {"key": "accesskey", "path": "accesskey"},
                        {"key": "secretkey", "path": "secretkey"},
                    ],
                },
            }
        )
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [dict(c) for c in containers],
        "volumes": volumes,
    }
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in settings.image_pull_secrets]
    if priority_class_name:
        spec["priorityClassName"] = priority_class_name
    if gpu_class is not None:
        spec.update(gpu_class.placement())
    return spec


# ---------------------------------------------------------------------- Jobs


def pod_failure_policy(container_name: str = WORKER_CONTAINER) -> dict[str, Any]:
    """Fail an index at once on the worker's deterministic-error exit code; do not count pods
    that were disrupted (preempted, evicted, drained) against the retry budget."""
    return {
        "rules": [
            {
                "action": "FailIndex",
                "onExitCodes": {
                    "containerName": container_name,
                    "operator": "In",
                    "values": [EXIT_DETERMINISTIC],
                },
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


@dataclass(frozen=True)
class JobOptions:
    """The Job-level settings a custom resource's spec passes through."""

    parallelism: int = 1
    suspend: bool = False
    backoff_limit_per_index: int = 2
    ttl_seconds_after_finished: int | None = None
    active_deadline_seconds: int | None = None
    queue_name: str = ""
    # batch/v1 Job spec.managedBy: another controller (MultiKueue) runs the Job; "" the Job controller.
    managed_by: str = ""


def indexed_job(
    *,
    name: str,
    owner: Owner,
    labels: Mapping[str, str],
    pod: Mapping[str, Any],
    completions: int,
    options: JobOptions,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """An Indexed Job: each pod reads JOB_COMPLETION_INDEX and does that slice of the work.

    With a Kueue queue the Job carries the queue label and is created suspended: Kueue admits it
    by resuming it. The same labels go on the pods, so `kubectl get pods -l` finds them.
    """
    all_labels = {**owner.labels(), **labels}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": dict(all_labels),
        "ownerReferences": [owner.reference()],
    }
    if options.queue_name:
        metadata["labels"][KUEUE_QUEUE_LABEL] = options.queue_name
    if annotations:
        metadata["annotations"] = dict(annotations)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": completions,
        "parallelism": min(options.parallelism, completions),
        "backoffLimitPerIndex": options.backoff_limit_per_index,
        # The Job itself never gives up on the first failed index: the others still run, and
        # the status says which tasks failed.
        "maxFailedIndexes": completions,
        "podFailurePolicy": pod_failure_policy(),
        "suspend": bool(options.suspend or options.queue_name),
        "template": {"metadata": {"labels": dict(all_labels)}, "spec": dict(pod)},
    }
    if options.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = options.ttl_seconds_after_finished
    if options.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = options.active_deadline_seconds
    if options.managed_by:
        spec["managedBy"] = options.managed_by
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def job_finished(job: Mapping[str, Any]) -> str | None:
    """'Complete' or 'Failed' when the Job has ended, else None."""
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


def count_indexes(ranges: str | None) -> int:
    """How many indexes a Job status range string such as '1,3-7' holds."""
    total = 0
    for part in (ranges or "").split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total
