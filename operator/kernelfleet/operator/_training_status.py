"""A TrainingRun's status: each stage's phase, step, checkpoint and metrics, folded from two sources.

The trainer writes what only it knows into the store (`kernelfleet.core.training`: step, round,
newest checkpoint, metrics, the final model); the stage Jobs say what only Kubernetes knows
(the pod waits for a node, was evicted and replaced, the Job is suspended, its retries are
spent). The fold puts both into `TrainingRunStatus`, so `kubectl get kftrain -o yaml` answers
"where is my run" without a look at the store or the pods.

Reading the store costs a listing per stage, so only stages that may still change are read:
a stage whose status is already final (its JobSet completed or failed, and the status says so)
keeps what the resource holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kernelfleet.core.resources import TrainingRunSpec, TrainingStageStatus
from kernelfleet.core.store import Store
from kernelfleet.core.training import TrainingLayout, latest_checkpoint, latest_stage_status
from kernelfleet.operator._training_plan import MISSING_JOB, JobState, JobView, Phase, Plan

FINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class StageRecord:
    """A stage as the store holds it: the trainer's newest status, and the newest complete
    checkpoint (which the trainer's status may not name yet: it is listed directly)."""

    status: TrainingStageStatus | None
    checkpoint: str = ""


def stages_to_read(
    spec: TrainingRunSpec, jobs: Mapping[str, JobView], previous: list[TrainingStageStatus]
) -> list[str]:
    """Stages whose store records may have changed since the status was last written."""
    known = {status.name: status for status in previous}
    names = []
    for stage in spec.stages:
        job = jobs.get(stage.name, MISSING_JOB)
        if job.state == JobState.MISSING:
            continue
        old = known.get(stage.name)
        final = job.state in (JobState.SUCCEEDED, JobState.FAILED)
        if final and old is not None and old.phase in FINAL_PHASES:
            continue
        names.append(stage.name)
    return names


def read_stage(store: Store, layout: TrainingLayout, stage: str) -> StageRecord:
    status = latest_stage_status(store, layout, stage)
    found = latest_checkpoint(store, layout, stage)
    return StageRecord(status, store.url_for(found[1]) if found else "")


def _stage_status(
    name: str,
    stage_type: str,
    record: StageRecord | None,
    old: TrainingStageStatus | None,
    job: JobView,
    plan: Plan,
) -> TrainingStageStatus:
    fresh = record.status if record is not None else None
    base = fresh or old or TrainingStageStatus()
    checkpoint = (record.checkpoint if record is not None else "") or base.checkpoint
    phase, message = base.phase or "Pending", base.message
    current = plan.stage is not None and plan.stage.name == name
    if job.state == JobState.SUCCEEDED:
        phase = "Succeeded"
    elif job.state == JobState.FAILED:
        phase, message = "Failed", job.message or message
    elif job.state == JobState.MISSING:
        phase = "Pending"
        if current:
            message = plan.message
    elif current and plan.phase == Phase.SUSPENDED:
        phase, message = "Suspended", plan.message
    elif job.state == JobState.SUSPENDED or not job.running:
        phase = "Pending"
        message = plan.message if current else message
    else:
        phase = "Running"
    if job.restarts and phase not in FINAL_PHASES:
        restarts = (
            f"restarted {job.restarts} time(s) after a failed or evicted pod; each restart resumed "
            "from the newest checkpoint"
        )
        message = f"{message}; {restarts}" if message else restarts
    return base.model_copy(
        update={
            "name": name,
            "type": stage_type,
            "phase": phase,
            "checkpoint": checkpoint,
            "message": message,
        }
    )


@dataclass(frozen=True)
class FoldedStages:
    stages: list[TrainingStageStatus]
    current_stage: str
    stages_done: int
    checkpoint: str


def fold_stages(
    spec: TrainingRunSpec,
    plan: Plan,
    jobs: Mapping[str, JobView],
    records: Mapping[str, StageRecord],
    previous: list[TrainingStageStatus],
) -> FoldedStages:
    """Each stage's status from the store records just read, else the resource's, and the Jobs."""
    known = {status.name: status for status in previous}
    stages = [
        _stage_status(
            stage.name,
            stage.type.value,
            records.get(stage.name),
            known.get(stage.name),
            jobs.get(stage.name, MISSING_JOB),
            plan,
        )
        for stage in spec.stages
    ]
    done = sum(1 for stage in spec.stages if jobs.get(stage.name, MISSING_JOB).state == JobState.SUCCEEDED)
    checkpoint = next((status.checkpoint for status in reversed(stages) if status.checkpoint), "")
    return FoldedStages(stages, plan.stage.name if plan.stage is not None else "", done, checkpoint)
