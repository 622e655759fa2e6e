"""What a TrainingRun needs next: which stage runs, whether its Job and evaluation service exist.

The controller is level-based: every tick it looks at the run's spec, its stage Jobs and its
evaluation service, and `plan_run` says what the world should look like. Nothing here talks to
Kubernetes or the store, so every rule is a unit test.

The rules:

- Stages run in the spec's order, one Job each. A stage is finished when its Job completed;
  a stage whose Job failed (its retries spent, or a deterministic error) fails the run.
- A pod that fails or is evicted is replaced by the Job controller, and the new pod resumes
  from the stage's newest checkpoint in the store (`kernelfleet train stage` is idempotent).
- An RL stage whose rewards run on an evaluation service of the run's own (`rewardGpus` > 0
  and no `reward.serviceUrl` in the spec) gets a Deployment of `kernelfleet eval serve` on
  `rewardGpuClass`, behind a Service; the stage's Job is created suspended and released once
  the service is ready, so the training GPUs never wait for an evaluator that is loading. The
  service is removed as soon as the stage finishes, fails, or the run is suspended.
- `suspend: true` suspends the current stage's Job (its pod stops; resuming continues from the
  newest checkpoint) and removes the evaluation service, freeing every GPU the run holds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelfleet.core.resources import RewardSpec, StageType, TrainingRunSpec, TrainingStage
from kernelfleet.operator._jobs import job_name

EVAL_PORT = 8470
"""The port of the run's evaluation service (`kernelfleet eval serve`'s default)."""


class Phase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class JobState(enum.StrEnum):
    """A stage Job as far as the plan cares."""

    MISSING = "Missing"
    SUSPENDED = "Suspended"
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class JobView:
    """The parts of a stage Job the plan and the status need."""

    state: JobState
    message: str = ""
    running: bool = False
    """A pod of the Job is running (not only created and waiting for a node)."""
    failed_pods: int = 0
    """Pods that failed so far (each one was replaced, and its successor resumed)."""


MISSING_JOB = JobView(JobState.MISSING)


def job_view(job: Mapping[str, Any] | None) -> JobView:
    """Read a batch/v1 Job (as a dict, the way kopf and the API return it)."""
    if job is None:
        return MISSING_JOB
    spec, status = job.get("spec") or {}, job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = int(status.get("failed") or 0)
    for kind, state in (("Complete", JobState.SUCCEEDED), ("Failed", JobState.FAILED)):
        if kind in conditions:
            condition = conditions[kind]
            message = condition.get("message") or condition.get("reason") or ""
            return JobView(state, message, failed_pods=failed)
    if spec.get("suspend"):
        return JobView(JobState.SUSPENDED, failed_pods=failed)
    running = int(status.get("ready") or 0) > 0 or (
        int(status.get("active") or 0) > 0 and status.get("ready") is None
    )
    return JobView(JobState.ACTIVE, running=running, failed_pods=failed)


# ---------------------------------------------------------------- names and places


def stage_job_name(run: str, uid: str, stage: str) -> str:
    """Deterministic, so a handler that runs twice finds the Job instead of making another."""
    return job_name(run, stage, uid=uid)


def eval_service_name(run: str, uid: str, stage: str) -> str:
    """The Deployment and Service of a stage's evaluator; a Service name starts with a letter."""
    return job_name("eval", run, stage, uid=uid)


@dataclass(frozen=True)
class RunRef:
    """One TrainingRun, by namespace, name and uid: what every name and place derives from."""

    namespace: str
    name: str
    uid: str

    @property
    def prefix(self) -> str:
        """The run's root in the store; the uid keeps a re-created run of the same name apart."""
        return f"trainingruns/{self.namespace}/{self.name}/{self.uid}"

    def job_name(self, stage: str) -> str:
        return stage_job_name(self.name, self.uid, stage)

    def eval_name(self, stage: str) -> str:
        return eval_service_name(self.name, self.uid, stage)

    def eval_token_name(self, stage: str) -> str:
        return self.eval_name(stage) + "-token"

    def eval_url(self, stage: str) -> str:
        return f"http://{self.eval_name(stage)}.{self.namespace}.svc:{EVAL_PORT}"


def reward_gpu_class(spec: TrainingRunSpec) -> str:
    return spec.reward_gpu_class or spec.gpu_class


def runs_own_evaluator(spec: TrainingRunSpec, stage: TrainingStage, run: RunRef) -> bool:
    """An RL stage gets an evaluation service of the run's own unless the spec names another
    (`reward.serviceUrl`) or gives it no GPUs (`rewardGpus: 0`: rewards in the training pod).
    In the recorded spec the URL is the run's own service's (see `resolved_spec`)."""
    if stage.type != StageType.GRPO or spec.reward_gpus == 0:
        return False
    url = stage.reward.service_url if stage.reward is not None else ""
    return url in ("", run.eval_url(stage.name))


def resolved_spec(spec: TrainingRunSpec, run: RunRef, default_reward_class: str = "") -> TrainingRunSpec:
    """The spec the stage pods train with, as recorded in the store at the run's start.

    `suspend` is the operator's business, not the trainer's, so it is recorded as False; an RL
    stage with an evaluator of its own gets that service's URL as `reward.serviceUrl`, which is
    how the stage's pod finds it, and an empty `rewardGpuClass` becomes the class the service
    runs on (`default_reward_class`, the operator's, else `gpuClass`), fixed for the whole run.
    """
    stages = []
    own = False
    for stage in spec.stages:
        if runs_own_evaluator(spec, stage, run):
            own = True
            reward = (stage.reward or RewardSpec()).model_copy(
                update={"service_url": run.eval_url(stage.name)}
            )
            stage = stage.model_copy(update={"reward": reward})
        stages.append(stage)
    update: dict[str, object] = {"stages": stages, "suspend": False}
    if own and not spec.reward_gpu_class:
        update["reward_gpu_class"] = default_reward_class or spec.gpu_class
    return spec.model_copy(update=update)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """What should exist now, and how the run stands."""

    phase: Phase
    message: str
    stage: TrainingStage | None = None
    """The stage that runs now (or waits, or failed); None when every stage is finished."""
    create_job: bool = False
    job_suspend: bool | None = None
    """The `spec.suspend` the current stage's Job should have (None: no Job to touch)."""
    eval_service: bool = False
    """Whether the current stage's evaluation service should exist (all others never should)."""


def current_stage(spec: TrainingRunSpec, jobs: Mapping[str, JobView]) -> TrainingStage | None:
    """The first stage whose Job has not completed."""
    for stage in spec.stages:
        if jobs.get(stage.name, MISSING_JOB).state != JobState.SUCCEEDED:
            return stage
    return None


def plan_run(
    spec: TrainingRunSpec,
    run: RunRef,
    jobs: Mapping[str, JobView],
    *,
    service_ready: bool,
    suspend: bool | None = None,
) -> Plan:
    """The next step of the run from its spec and the state of its stage Jobs.

    `service_ready`: the current stage's evaluation service has a ready pod. `suspend` defaults
    to the spec's.
    """
    suspend = spec.suspend if suspend is None else suspend
    stage = current_stage(spec, jobs)
    total = len(spec.stages)
    if stage is None:
        return Plan(Phase.SUCCEEDED, f"all {total} stages finished")
    index = [s.name for s in spec.stages].index(stage.name) + 1
    where = f"stage {index}/{total} {stage.name}"
    job = jobs.get(stage.name, MISSING_JOB)
    if job.state == JobState.FAILED:
        return Plan(Phase.FAILED, f"{where} failed: {job.message or 'its Job failed'}", stage)
    needs_service = runs_own_evaluator(spec, stage, run)
    if suspend:
        return Plan(
            Phase.SUSPENDED,
            f"suspended at {where}; resuming continues from its newest checkpoint",
            stage,
            create_job=job.state == JobState.MISSING,
            job_suspend=True,
        )
    waiting = needs_service and not service_ready
    if job.state == JobState.MISSING:
        hold = waiting
        message = f"{where}: waiting for its evaluation service" if hold else f"{where}: starting"
        return Plan(Phase.PENDING, message, stage, True, hold, needs_service)
    # A suspended Job stays suspended until its evaluator is ready; a running Job is never
    # suspended because its evaluator restarts (its reward requests wait and retry).
    hold = job.state == JobState.SUSPENDED and waiting
    if hold:
        return Plan(Phase.PENDING, f"{where}: waiting for its evaluation service", stage, False, True, True)
    if not job.running:
        return Plan(
            Phase.PENDING, f"{where}: waiting for its pod to start", stage, False, False, needs_service
        )
    return Plan(Phase.RUNNING, f"{where} running", stage, False, False, needs_service)
