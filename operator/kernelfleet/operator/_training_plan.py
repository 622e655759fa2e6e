"""What a TrainingRun needs next: which stage runs, and whether its JobSet exists or is suspended.

The controller is level-based: every tick it looks at the run's spec and its stage JobSets, and
`plan_run` says what the world should look like. Nothing here talks to Kubernetes or the store,
so every rule is a unit test.

The rules:

- Stages run in the spec's order, one JobSet each (sigs.k8s.io/jobset). Its roles: `trainer`
  (`nodes` pods, one torchrun rank per GPU), and for an RL stage `generator` (vLLM in trl's
  server mode, when `generatorGpus` > 0) and `reward` (`kernelfleet eval serve`, when the run
  evaluates rewards on a service of its own). A stage is finished when its JobSet completed,
  which the trainer's success decides (the JobSet's success policy; the servers are stopped
  with it); a JobSet that failed (its restarts spent, or a usage error) fails the run.
- A failed pod restarts the stage's JobSet (every role, together), and the new trainer pods
  resume from the stage's newest checkpoint in the store (`kernelfleet train stage` is
  idempotent). The trainer pods start once the server they wait for is ready (`dependsOn`).
- `suspend: true` suspends the current stage's JobSet (its pods stop; resuming continues from
  the newest checkpoint). With a Kueue `queueName`, the JobSet is created suspended and Kueue
  admits it as one workload; a suspended run's JobSet is deleted instead (Kueue owns `suspend`
  of what it admitted), and resuming creates it again, to queue again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelfleet.core.resources import GRPOStageConfig, RewardSpec, StageType, TrainingRunSpec, TrainingStage
from kernelfleet.operator._jobs import job_name

EVAL_PORT = 8470
"""The port of the run's evaluation service (`kernelfleet eval serve`'s default)."""
GENERATOR_PORT = 8000
"""The port of the vLLM server (`trl vllm-serve`'s default)."""
RENDEZVOUS_PORT = 29500
"""torchrun's c10d rendezvous on the first trainer pod (torch's default port)."""
ROLE_TRAINER = "trainer"
ROLE_GENERATOR = "generator"
ROLE_REWARD = "reward"
MAX_JOBSET_NAME = 42
"""A JobSet's pods are `<jobset>-<role>-<job>-<pod>`, a host name (63 characters at most)."""


class Phase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


DEADLINE_EXCEEDED = "DeadlineExceeded"


class JobState(enum.StrEnum):
    """A stage JobSet as far as the plan cares."""

    MISSING = "Missing"
    SUSPENDED = "Suspended"
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class JobView:
    """The parts of a stage JobSet the plan and the status need."""

    state: JobState
    message: str = ""
    running: bool = False
    """Every trainer pod is running (not only created and waiting for a node or a server)."""
    restarts: int = 0
    """Times the JobSet was restarted after a failed pod (each restart resumed from a checkpoint)."""


MISSING_JOB = JobView(JobState.MISSING)


def jobset_view(jobset: Mapping[str, Any] | None) -> JobView:
    """Read a JobSet (as a dict, the way kopf and the API return it)."""
    if jobset is None:
        return MISSING_JOB
    spec, status = jobset.get("spec") or {}, jobset.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    restarts = int(status.get("restarts") or 0)
    for kind, state in (("Completed", JobState.SUCCEEDED), ("Failed", JobState.FAILED)):
        if kind in conditions:
            condition = conditions[kind]
            message = condition.get("message") or condition.get("reason") or ""
            return JobView(state, message, restarts=restarts)
    if spec.get("suspend"):
        return JobView(JobState.SUSPENDED, restarts=restarts)
    trainer: Mapping[str, Any] = next(
        (r for r in status.get("replicatedJobsStatus") or [] if r.get("name") == ROLE_TRAINER), {}
    )
    replicas = next(
        (
            int(r.get("replicas") or 1)
            for r in spec.get("replicatedJobs") or []
            if r.get("name") == ROLE_TRAINER
        ),
        1,
    )
    running = int(trainer.get("ready") or 0) >= replicas
    return JobView(JobState.ACTIVE, running=running, restarts=restarts)


# ---------------------------------------------------------------- names and places


def stage_jobset_name(run: str, uid: str, stage: str) -> str:
    """Deterministic, so a handler that runs twice finds the JobSet instead of making another;
    short enough that its pods' host names stay DNS labels."""
    return job_name(run, stage, uid=uid, max_length=MAX_JOBSET_NAME)


def eval_service_name(run: str, uid: str, stage: str) -> str:
    """The stem of a stage's evaluation service token's Secret."""
    return job_name("eval", run, stage, uid=uid)


def pod_host(jobset: str, role: str, job_index: int = 0, pod_index: int = 0) -> str:
    """A JobSet pod's stable host name, resolvable in its namespace through the JobSet's
    headless Service (the subdomain, the JobSet's name)."""
    return f"{jobset}-{role}-{job_index}-{pod_index}.{jobset}"


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

    def jobset_name(self, stage: str) -> str:
        return stage_jobset_name(self.name, self.uid, stage)

    def eval_token_name(self, stage: str) -> str:
        return eval_service_name(self.name, self.uid, stage) + "-token"

    def leader_host(self, stage: str) -> str:
        """The first trainer pod: torchrun's rendezvous."""
        return pod_host(self.jobset_name(stage), ROLE_TRAINER)

    def eval_url(self, stage: str) -> str:
        return f"http://{pod_host(self.jobset_name(stage), ROLE_REWARD)}:{EVAL_PORT}"

    def generator_url(self, stage: str) -> str:
        return f"http://{pod_host(self.jobset_name(stage), ROLE_GENERATOR)}:{GENERATOR_PORT}"


def reward_gpu_class(spec: TrainingRunSpec) -> str:
    return spec.reward_gpu_class or spec.gpu_class


def runs_own_evaluator(spec: TrainingRunSpec, stage: TrainingStage, run: RunRef) -> bool:
    """An RL stage gets an evaluation service of the run's own (its JobSet's `reward` role)
    unless the spec names another (`reward.serviceUrl`) or gives it no GPUs (`rewardGpus: 0`:
    rewards in the trainer pod). In the recorded spec the URL is the role's (see `resolved_spec`)."""
    if stage.type != StageType.GRPO or spec.reward_gpus == 0:
        return False
    url = stage.reward.service_url if stage.reward is not None else ""
    return url in ("", run.eval_url(stage.name))


def runs_own_generator(spec: TrainingRunSpec, stage: TrainingStage) -> bool:
    """An RL stage gets a vLLM server of its own (the `generator` role) when `generatorGpus` > 0."""
    return stage.type == StageType.GRPO and spec.generator_gpus > 0


def resolved_spec(spec: TrainingRunSpec, run: RunRef, default_reward_class: str = "") -> TrainingRunSpec:
    """The spec the stage pods train with, as recorded in the store at the run's start.

    The spec's MUTABLE fields (`suspend`, the TTL, the deadline) are the operator's business, not
    the trainer's, and may change while the run goes on, so they are recorded unset; an RL
    stage with an evaluator of its own gets that role's URL as `reward.serviceUrl`, and one with
    a generator of its own that server's URL as `grpo.vllm_server_base_url`, which is how the
    trainer finds them; an empty `rewardGpuClass` becomes the class the service runs on
    (`default_reward_class`, the operator's, else `gpuClass`), fixed for the whole run.
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
        if runs_own_generator(spec, stage):
            grpo = (stage.grpo or GRPOStageConfig()).model_copy(
                update={"vllm_server_base_url": run.generator_url(stage.name), "use_vllm": True}
            )
            stage = stage.model_copy(update={"grpo": grpo})
        stages.append(stage)
    update: dict[str, object] = {
        "stages": stages,
        "suspend": False,
        "ttl_seconds_after_finished": None,
        "active_deadline_seconds": None,
    }
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
    create_jobset: bool = False
    suspend_jobset: bool | None = None
    """The `spec.suspend` the current stage's JobSet should have (None: leave it as it is)."""
    delete_jobset: bool = False
    """Delete the current stage's JobSet (a queued run that is suspended frees its quota, a run
    past its deadline stops)."""
    reason: str = ""
    """The conditions' reason when it is not the phase's name (DeadlineExceeded)."""


def current_stage(spec: TrainingRunSpec, jobs: Mapping[str, JobView]) -> TrainingStage | None:
    """The first stage whose JobSet has not completed."""
    for stage in spec.stages:
        if jobs.get(stage.name, MISSING_JOB).state != JobState.SUCCEEDED:
            return stage
    return None


def plan_run(
    spec: TrainingRunSpec,
    jobs: Mapping[str, JobView],
    *,
    suspend: bool | None = None,
    queue: str | None = None,
    deadline_exceeded: bool = False,
) -> Plan:
    """The next step of the run from its spec and the state of its stage JobSets.

    `suspend` and `queue` (the Kueue LocalQueue) default to the spec's. Past the deadline
    (`spec.activeDeadlineSeconds`) a run that has not ended fails and its current stage's JobSet
    goes; the checkpoints that stage saved stay in the store.
    """
    suspend = spec.suspend if suspend is None else suspend
    queue = spec.queue_name if queue is None else queue
    stage = current_stage(spec, jobs)
    total = len(spec.stages)
    if stage is None:
        return Plan(Phase.SUCCEEDED, f"all {total} stages finished")
    index = [s.name for s in spec.stages].index(stage.name) + 1
    where = f"stage {index}/{total} {stage.name}"
    job = jobs.get(stage.name, MISSING_JOB)
    if job.state == JobState.FAILED:
        return Plan(Phase.FAILED, f"{where} failed: {job.message or 'its JobSet failed'}", stage)
    if deadline_exceeded:
        message = f"spec.activeDeadlineSeconds passed at {where}: stopped; its checkpoints stay in the store"
        stop = job.state != JobState.MISSING
        return Plan(Phase.FAILED, message, stage, delete_jobset=stop, reason=DEADLINE_EXCEEDED)
    if suspend:
        message = f"suspended at {where}; resuming continues from its newest checkpoint"
        if queue:
            return Plan(Phase.SUSPENDED, message, stage, delete_jobset=job.state != JobState.MISSING)
        return Plan(
            Phase.SUSPENDED, message, stage, create_jobset=job.state == JobState.MISSING, suspend_jobset=True
        )
    if job.state == JobState.MISSING:
        message = f"{where}: queued in {queue}" if queue else f"{where}: starting"
        # Kueue admits a queued JobSet by resuming it: it is created suspended.
        return Plan(Phase.PENDING, message, stage, create_jobset=True, suspend_jobset=bool(queue))
    if queue:
        if job.state == JobState.SUSPENDED:
            return Plan(Phase.PENDING, f"{where}: queued in {queue}, waiting for Kueue to admit it", stage)
        resume = None
    else:
        resume = False
    if not job.running:
        return Plan(Phase.PENDING, f"{where}: waiting for its pods to start", stage, suspend_jobset=resume)
    return Plan(Phase.RUNNING, f"{where} running", stage, suspend_jobset=resume)
