"""Where a training run keeps its objects in the store, and how its stage status is read back.

This lives in core, not in the trainer, because two sides share it: the trainer (one stage per
pod on a cluster) writes the objects, and the operator, which never imports torch or the
trainer, reads each stage's status from them to fill the TrainingRun's status.

The store is immutable, so nothing here is ever rewritten; progress is a sequence of new
objects, and "the current state" is the newest of them:

    <prefix>/run.json                                      the TrainingRunSpec the run was started with
    <prefix>/stages/<stage>/status/<millis>-<step>.json    TrainingStageStatus, newest last
    <prefix>/stages/<stage>/metrics/<step>-<millis>.json   one logging event (loss, reward, shares)
    <prefix>/stages/<stage>/checkpoints/step-<step>-<attempt>/   a trainer checkpoint, manifest last
    <prefix>/stages/<stage>/data/<name>.jsonl              the stage's dataset(s)
    <prefix>/stages/<stage>/collect/...                    the loop's samples and results of data collection
    <prefix>/stages/<stage>/model/                          the stage's final weights, manifest last
    <prefix>/stages/<stage>/done.json                       written last: the stage is complete
    <prefix>/heldout/<stage>/...                            the held-out tasks optimised by that stage's model
    <prefix>/heldout/<stage>/row.json                       that stage's row of the held-out report
    <prefix>/reports/<millis>.json                          the stage-by-stage held-out report, newest last

A checkpoint's key names the process attempt that wrote it: a stage killed after uploading part
of a checkpoint, then resumed from an earlier one, writes the same step again under a new
attempt instead of colliding with the partial upload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import TrainingRunSpec, TrainingStageStatus
from kernelfleet.core.store import MANIFEST_NAME, NotFound, Store

_CHECKPOINT = re.compile(r"/checkpoints/step-(?P<step>\d+)-(?P<attempt>[0-9a-z]+)/$")


@dataclass(frozen=True)
class TrainingLayout:
    """Keys of one training run's objects; `prefix` is the run's root in the store."""

    prefix: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", self.prefix.strip("/"))

    @property
    def spec(self) -> str:
        return f"{self.prefix}/run.json"

    @property
    def reports(self) -> str:
        return f"{self.prefix}/reports/"

    def report(self, millis: int) -> str:
        return f"{self.reports}{millis:015d}.json"

    def stage(self, stage: str) -> str:
        return f"{self.prefix}/stages/{stage}"

    def status_prefix(self, stage: str) -> str:
        return f"{self.stage(stage)}/status/"

    def status(self, stage: str, millis: int, step: int) -> str:
        return f"{self.status_prefix(stage)}{millis:015d}-{step:08d}.json"

    def metrics_prefix(self, stage: str) -> str:
        return f"{self.stage(stage)}/metrics/"

    def metrics(self, stage: str, step: int, millis: int) -> str:
        return f"{self.metrics_prefix(stage)}{step:08d}-{millis:015d}.json"

    def checkpoints(self, stage: str) -> str:
        return f"{self.stage(stage)}/checkpoints/"

    def checkpoint(self, stage: str, step: int, attempt: str) -> str:
        return f"{self.checkpoints(stage)}step-{step:08d}-{attempt}"

    def data(self, stage: str, name: str) -> str:
        return f"{self.stage(stage)}/data/{name}.jsonl"

    def collect(self, stage: str, part: str = "") -> str:
        return f"{self.stage(stage)}/collect" + (f"/{part}" if part else "")

    def model(self, stage: str) -> str:
        return f"{self.stage(stage)}/model"

    def done(self, stage: str) -> str:
        return f"{self.stage(stage)}/done.json"

    def heldout(self, stage: str) -> str:
        return f"{self.prefix}/heldout/{stage}"


def run_record(name: str, spec: TrainingRunSpec) -> dict[str, Any]:
    """What `<prefix>/run.json` holds: the run's name and the spec it was started with.

    Whoever starts a run writes it (the trainer for a local run, the operator for a TrainingRun,
    before the first stage's pod starts); the same record written again is a no-op, a different
    one a conflict, so a changed spec can never silently continue an old run's checkpoints.
    """
    return {"name": name, "spec": spec.model_dump(mode="json")}


def read_run_record(store: Store, layout: TrainingLayout) -> tuple[str, TrainingRunSpec]:
    """The (name, spec) under `layout`, as `run_record` wrote them."""
    try:
        data = store.get_json(layout.spec)
    except NotFound:
        raise UsageError(
            f"{store.url_for(layout.spec)} does not exist: the run was never started there; check "
            "--store and --prefix, or give --run-config"
        ) from None
    try:
        return str(data["name"]), TrainingRunSpec.model_validate(data["spec"])
    except (KeyError, ValidationError) as error:
        raise UsageError(
            f"{store.url_for(layout.spec)} is not a training run record ({error.__class__.__name__}: "
            f"{error}); it was written by another program"
        ) from None


def newest_checkpoint(store: Store, checkpoints_prefix: str) -> tuple[int, str] | None:
    """(step, key prefix) of the newest complete checkpoint below `checkpoints_prefix`, if any.

    Complete means its manifest exists: an upload cut short by a kill is ignored.
    """
    best: tuple[int, str] | None = None
    base = checkpoints_prefix.rstrip("/") + "/"
    for key in store.list(base):
        if not key.endswith("/" + MANIFEST_NAME):
            continue
        folder = key[: -len(MANIFEST_NAME)]
        match = _CHECKPOINT.search("/checkpoints/" + folder[len(base) :])
        if match is None:
            continue
        step = int(match.group("step"))
        if best is None or step > best[0]:
            best = (step, folder.rstrip("/"))
    return best


def latest_checkpoint(store: Store, layout: TrainingLayout, stage: str) -> tuple[int, str] | None:
    """The newest complete checkpoint of `stage` (see `newest_checkpoint`)."""
    return newest_checkpoint(store, layout.checkpoints(stage))


def latest_stage_status(store: Store, layout: TrainingLayout, stage: str) -> TrainingStageStatus | None:
    """The stage's newest status record, or None when the stage has not started."""
    keys = [key for key in store.list(layout.status_prefix(stage)) if key.endswith(".json")]
    if not keys:
        return None
    try:
        return TrainingStageStatus.model_validate(store.get_json(keys[-1]))
    except NotFound:  # listed, then gone: only a test that wipes the store does this
        return None


def latest_report(store: Store, layout: TrainingLayout) -> dict[str, Any] | None:
    """The newest held-out report of the run, if one was written."""
    keys = [key for key in store.list(layout.reports) if key.endswith(".json")]
    return store.get_json(keys[-1]) if keys else None


def stage_done(store: Store, layout: TrainingLayout, stage: str) -> bool:
    return store.exists(layout.done(stage))
