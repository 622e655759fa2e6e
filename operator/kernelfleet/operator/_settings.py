"""The operator's settings: what it passes on to the pods it creates, and how it behaves.

They come from the command line and the environment the chart sets (`KERNELFLEET_WORKER_IMAGE`,
`KERNELFLEET_STORE_SECRET`, ...); a flag wins over the environment. The operator reads no Helm
values itself, so the chart stays the one place to configure a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kernelfleet.core.errors import UsageError
from kernelfleet.operator._pools import Pools, default_pools

DEFAULT_WORKER_IMAGE = "ghcr.io/kernelfleet/worker:0.1.0"
DEFAULT_TRAINER_IMAGE = "ghcr.io/kernelfleet/trainer:0.1.0"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class OperatorSettings:
    """Everything the handlers need besides the resource itself. Frozen: read once at start."""

    pools: Pools = field(default_factory=default_pools)
    default_store: str = ""
    worker_image: str = DEFAULT_WORKER_IMAGE
    worker_pull_policy: str = "IfNotPresent"
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    trainer_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    # The store as the pods reach it. The credentials stay in the Secret `store_secret`, which
    # must exist in each job's namespace; the pods mount it.
    store_secret: str = ""
    s3_endpoint: str = ""
    s3_secure: bool | None = None
    s3_region: str = ""
    s3_create_bucket: bool = False
    # The worker's command: the image's entry point, overridable for images that differ.
    worker_command: tuple[str, ...] = ("kernelfleet", "worker")
    # Jobs: how many completion indexes one Indexed Job holds before the work is sharded.
    max_indexes_per_job: int = 2000
    # Status: how often each job's status is folded, and the least time between two patches.
    status_interval_s: float = 5.0
    min_patch_interval_s: float = 5.0
    operator_namespace: str = ""
    # The pool of a TrainingRun's evaluation service when its spec names none (the chart's
    # evalService.gpuClass); empty: the run's own gpuClass.
    eval_gpu_class: str = ""

    def __post_init__(self) -> None:
        for name in ("worker_pull_policy", "trainer_pull_policy"):
            if getattr(self, name) not in PULL_POLICIES:
                raise UsageError(
                    f"{name} must be one of {', '.join(PULL_POLICIES)}, not {getattr(self, name)!r}"
                )
        if self.max_indexes_per_job < 1:
            raise UsageError("max_indexes_per_job must be at least 1")
        if self.status_interval_s <= 0 or self.min_patch_interval_s < 0:
            raise UsageError("the status interval must be positive and the patch interval not negative")


def _bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"{name}={value!r} is not a boolean: set it to 'true' or 'false'")


def settings_from_env(environ: Mapping[str, str] | None = None, **overrides: object) -> OperatorSettings:
    """Settings from the chart's environment variables; `overrides` (flags) win."""
    env = os.environ if environ is None else environ

    def get(name: str) -> str:
        return env.get(name, "").strip()

    values: dict[str, object] = {}
    if get("KERNELFLEET_STORE"):
        values["default_store"] = get("KERNELFLEET_STORE")
    if get("KERNELFLEET_WORKER_IMAGE"):
        values["worker_image"] = get("KERNELFLEET_WORKER_IMAGE")
    if get("KERNELFLEET_WORKER_IMAGE_PULL_POLICY"):
        values["worker_pull_policy"] = get("KERNELFLEET_WORKER_IMAGE_PULL_POLICY")
    if get("KERNELFLEET_TRAINER_IMAGE"):
        values["trainer_image"] = get("KERNELFLEET_TRAINER_IMAGE")
    if get("KERNELFLEET_TRAINER_IMAGE_PULL_POLICY"):
        values["trainer_pull_policy"] = get("KERNELFLEET_TRAINER_IMAGE_PULL_POLICY")
    if get("KERNELFLEET_IMAGE_PULL_SECRETS"):
        values["image_pull_secrets"] = tuple(
            s.strip() for s in get("KERNELFLEET_IMAGE_PULL_SECRETS").split(",") if s.strip()
        )
    if get("KERNELFLEET_STORE_SECRET"):
        values["store_secret"] = get("KERNELFLEET_STORE_SECRET")
    if get("KERNELFLEET_S3_ENDPOINT"):
        values["s3_endpoint"] = get("KERNELFLEET_S3_ENDPOINT")
    if get("KERNELFLEET_S3_SECURE"):
        values["s3_secure"] = _bool("KERNELFLEET_S3_SECURE", get("KERNELFLEET_S3_SECURE"))
    if get("KERNELFLEET_S3_REGION"):
        values["s3_region"] = get("KERNELFLEET_S3_REGION")
    if get("KERNELFLEET_S3_CREATE_BUCKET"):
        values["s3_create_bucket"] = _bool(
            "KERNELFLEET_S3_CREATE_BUCKET", get("KERNELFLEET_S3_CREATE_BUCKET")
        )
    if get("KERNELFLEET_WORKER_COMMAND"):
        values["worker_command"] = tuple(get("KERNELFLEET_WORKER_COMMAND").split())
    if get("KERNELFLEET_OPERATOR_NAMESPACE"):
        values["operator_namespace"] = get("KERNELFLEET_OPERATOR_NAMESPACE")
    if get("KERNELFLEET_EVAL_GPU_CLASS"):
        values["eval_gpu_class"] = get("KERNELFLEET_EVAL_GPU_CLASS")
    values.update({key: value for key, value in overrides.items() if value is not None})
    return OperatorSettings(**values)  # type: ignore[arg-type]
