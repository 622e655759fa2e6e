"""The contract between the operator and its worker pods: the plan of one OptimizationJob.

The operator resolves a job's task selections once, writes the plan to the store under the
job's uid, and creates Indexed Jobs whose pods read it back. Both sides import this module
(it is in core: no torch, no Kubernetes client), so the key layout, the slicing of tasks over
completion indexes and the worker's exit codes cannot drift apart.

Store layout of a job, under `optimizationjobs/<namespace>/<name>/<uid>` (the run prefix that
`kernelfleet results` reads; the loop's own objects live under it too, see search/_layout.py):

    plan/tasks-00000.json                       tasks 0..CHUNK-1 with their code (written first)
    plan.json                                   the plan: spec, shards, task count (written last:
                                                its presence means the plan is complete)
    outcomes/<role>/<class>/<task16>.json       one small record per finished task, written last
                                                for the task; the operator folds these into status
    logs/<role>/<class>/<task16>.log            the worker's log lines of one task (a retried pod
                                                writes `<task16>.1.log`, `.2.log`, ...)

`role` is `search` (the optimisation) or `verify` (re-timing the best variants on another
class, `spec.verifyOn`). Tasks are kept in chunks so that a pod reads only the few tasks of its
slice, however large the job.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from kernelfleet.core.models import Task
from kernelfleet.core.resources import OptimizationJobSpec

PLAN_VERSION = 1
PLAN_NAME = "plan.json"
CHUNK_SIZE = 100
OUTCOMES_DIR = "outcomes"
LOGS_DIR = "logs"

# Exit codes of `kernelfleet worker`. The Jobs' podFailurePolicy fails an index at once on
# EXIT_DETERMINISTIC (a retry would fail the same way: no plan, a slice the plan lacks, a task
# whose code does not match its hash); any other failure (an evicted pod, a store outage, a GPU
# fault) is retried up to backoffLimitPerIndex, and the retried pod resumes from the store.
EXIT_OK = 0
EXIT_DETERMINISTIC = 3


class Role(enum.StrEnum):
    SEARCH = "search"
    VERIFY = "verify"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Shard(_Frozen):
    """One Indexed Job: plan positions [start, stop), `tasks_per_index` of them per index."""

    role: Role = Role.SEARCH
    gpu_class: str
    number: int
    start: int
    stop: int
    tasks_per_index: int = Field(ge=1)
    job_name: str

    @property
    def completions(self) -> int:
        return math.ceil((self.stop - self.start) / self.tasks_per_index)

    def positions(self, index: int) -> range:
        """Plan positions of the tasks of completion index `index`."""
        if not 0 <= index < self.completions:
            raise ValueError(f"completion index {index} is outside 0..{self.completions - 1}")
        first = self.start + index * self.tasks_per_index
        return range(first, min(first + self.tasks_per_index, self.stop))


class PlannedTask(_Frozen):
    """A task as the plan stores it: the fields of `Task`, whose hash is computed on reading."""

    name: str
    code: str
    level: int | None = None
    task_id: int | None = None
    source: str = ""

    @classmethod
    def of(cls, task: Task) -> PlannedTask:
        return cls(name=task.name, code=task.code, level=task.level, task_id=task.task_id, source=task.source)

    def task(self) -> Task:
        return Task(
            name=self.name, code=self.code, level=self.level, task_id=self.task_id, source=self.source
        )


class TaskChunk(_Frozen):
    """Tasks at plan positions [start, start + len(tasks))."""

    start: int
    tasks: tuple[PlannedTask, ...]


class JobPlan(_Frozen):
    """What the workers of one OptimizationJob do."""

    version: int = PLAN_VERSION
    namespace: str
    name: str
    uid: str
    prefix: str = Field(description="The run's prefix in the store.")
    spec: OptimizationJobSpec
    tasks_total: int
    chunk_size: int = CHUNK_SIZE
    shards: tuple[Shard, ...]

    def shard(self, role: Role | str, gpu_class: str, number: int) -> Shard:
        for shard in self.shards:
            if shard.role == role and shard.gpu_class == gpu_class and shard.number == number:
                return shard
        raise KeyError(f"the plan has no {role} shard {number} for GPU class {gpu_class!r}")

    def chunks_for(self, positions: range) -> list[int]:
        """The chunk numbers that hold `positions`."""
        if not positions:
            return []
        return list(range(positions[0] // self.chunk_size, positions[-1] // self.chunk_size + 1))


def chunk_tasks(tasks: Sequence[Task], size: int = CHUNK_SIZE) -> list[TaskChunk]:
    return [
        TaskChunk(start=start, tasks=tuple(PlannedTask.of(t) for t in tasks[start : start + size]))
        for start in range(0, len(tasks), size)
    ]


def job_prefix(namespace: str, name: str, uid: str) -> str:
    return f"optimizationjobs/{namespace}/{name}/{uid}"


def plan_key(prefix: str) -> str:
    return f"{prefix}/{PLAN_NAME}"


def chunk_key(prefix: str, number: int) -> str:
    return f"{prefix}/plan/tasks-{number:05d}.json"


def outcome_dir(prefix: str, role: Role | str, gpu_class: str) -> str:
    return f"{prefix}/{OUTCOMES_DIR}/{role}/{gpu_class}/"


def outcome_key(prefix: str, role: Role | str, gpu_class: str, task_hash: str) -> str:
    return f"{outcome_dir(prefix, role, gpu_class)}{task_hash[:16]}.json"


def task_log_key(prefix: str, role: Role | str, gpu_class: str, task_hash: str, attempt: int = 0) -> str:
    """Log lines of one task. Attempt 0 is the first pod to run it; a retried pod writes the
    next free attempt, so nothing an earlier pod logged is overwritten (objects are immutable)."""
    suffix = "" if attempt == 0 else f".{attempt}"
    return f"{prefix}/{LOGS_DIR}/{role}/{gpu_class}/{task_hash[:16]}{suffix}.log"


def logs_prefix(prefix: str) -> str:
    return f"{prefix}/{LOGS_DIR}/"


class TaskOutcome(_Frozen):
    """The small record a worker writes when a task ends; the operator folds these into status."""

    task_hash: str
    task_name: str
    gpu_class: str = Field(description="The pool class the worker ran on (not the measured one).")
    role: Role = Role.SEARCH
    ok: bool = Field(description="The task ended normally (with or without a faster variant).")
    error: str = ""
    stop_reason: str = ""
    variants: int = 0
    best_speedup: float | None = None
    verified: bool = False
    source_class: str = Field(default="", description="verify: the class whose best variant was re-timed.")
    source_speedup: float | None = Field(default=None, description="verify: its speedup there.")
    variant_hash: str | None = None
