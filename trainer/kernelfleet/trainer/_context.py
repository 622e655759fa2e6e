"""What every stage shares: the store, the run's layout, a local work directory, status and checkpoints.

A stage is one process (one pod on a cluster). It reads its input model from the store (the
previous stage's final weights) or from the base model, trains in a local work directory, and
keeps in the store everything that must survive the process: a checkpoint at every `save_steps`
(uploaded as soon as the trainer has written it, manifest last), metrics at every
`logging_steps`, and a status record the operator copies into the TrainingRun's status. After a
kill, the next process downloads the newest complete checkpoint and resumes from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Environment
from kernelfleet.core.resources import TrainingStage, TrainingStageStatus
from kernelfleet.core.store import NotFound, ObjectConflict, Store, open_store
from kernelfleet.core.training import TrainingLayout, latest_stage_status, newest_checkpoint
from kernelfleet.search._loop import EvaluatorLike
from kernelfleet.trainer._spec import RunConfig

log = logging.getLogger(__name__)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _millis() -> int:
    return int(time.time() * 1000)


@dataclass
class StageContext:
    """One stage's view of the run."""

    config: RunConfig
    store: Store
    layout: TrainingLayout
    work_dir: Path
    evaluator: EvaluatorLike
    environment: Environment
    attempt: str = field(default_factory=lambda: secrets.token_hex(3))
    extra_callbacks: list[Any] = field(default_factory=list)

    def stage_dir(self, stage: str) -> Path:
        path = self.work_dir / "stages" / stage
        path.mkdir(parents=True, exist_ok=True)
        return path


class StatusWriter:
    """Writes a stage's status records; each is a new object, the newest is the status."""

    def __init__(self, ctx: StageContext, stage: TrainingStage) -> None:
        self.ctx = ctx
        self.stage = stage
        previous = latest_stage_status(ctx.store, ctx.layout, stage.name)
        self.current = previous or TrainingStageStatus(name=stage.name, type=str(stage.type))

    def update(self, **changes: Any) -> TrainingStageStatus:
        metrics = changes.pop("metrics", None)
        if metrics is not None:
            merged = dict(self.current.metrics)
            merged.update({k: float(v) for k, v in metrics.items() if _finite(v)})
            changes["metrics"] = merged
        self.current = self.current.model_copy(update={**changes, "updated_at": _now()})
        key = self.ctx.layout.status(self.stage.name, _millis(), self.current.step)
        with contextlib.suppress(ObjectConflict):
            self.ctx.store.put_json(key, self.current)
        return self.current


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class StoreCallback(TrainerCallback):
    """Keeps a trl/transformers training in the store: checkpoints, metrics and status."""

    def __init__(
        self, ctx: StageContext, stage: TrainingStage, status: StatusWriter, store_prefix: str
    ) -> None:
        self.ctx = ctx
        self.stage = stage
        self.status = status
        self.store_prefix = store_prefix  # where checkpoints go: the stage, or one self-training round

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero:
            # `ranks`: the processes that train together (a multi-node stage shows all of them).
            self.status.update(
                phase="Running",
                step=state.global_step,
                max_steps=state.max_steps,
                metrics={"ranks": args.world_size},
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        values = {key: float(value) for key, value in logs.items() if _finite(value)}
        record = {
            "step": state.global_step,
            "epoch": state.epoch,
            "round": self.status.current.round,
            **values,
        }
        key = self.ctx.layout.metrics(self.stage.name, state.global_step, _millis())
        with contextlib.suppress(ObjectConflict):
            self.ctx.store.put_json(key, record)
        self.status.update(step=state.global_step, max_steps=state.max_steps, metrics=values)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        if not folder.is_dir():
            log.warning("the trainer reported a save, but %s does not exist; nothing uploaded", folder)
            return
        key = checkpoint_key(self.ctx, self.store_prefix, state.global_step)
        self.ctx.store.upload_dir(folder, key)
        url = self.ctx.store.url_for(key)
        log.info("checkpoint %d of %s uploaded to %s", state.global_step, self.stage.name, url)
        self.status.update(step=state.global_step, checkpoint=url)


def checkpoint_key(ctx: StageContext, store_prefix: str, step: int) -> str:
    return f"{store_prefix}/checkpoints/step-{step:08d}-{ctx.attempt}"


def restore_checkpoint(ctx: StageContext, store_prefix: str, output_dir: Path) -> Path | None:
    """Download the newest complete checkpoint under `store_prefix` into `output_dir`; its path.

    With several ranks (their process group set up: the trainer's arguments' `device`), rank 0's
    choice is every rank's: ranks that looked at the store a moment apart could otherwise resume
    from different steps while an earlier attempt's upload completes."""
    found = _agreed(newest_checkpoint(ctx.store, f"{store_prefix}/checkpoints/"))
    if found is None:
        return None
    step, key = found
    target = output_dir / f"checkpoint-{step}"
    ctx.store.download_dir(key, target)
    log.info("resuming from checkpoint %d (%s)", step, ctx.store.url_for(key))
    return target


class RunPlace(Protocol):
    """Where a run's weights come from and go: what `fetch_model` and `input_model` need (a
    StageContext, or the generator's, which evaluates nothing)."""

    @property
    def config(self) -> RunConfig: ...
    @property
    def store(self) -> Store: ...
    @property
    def layout(self) -> TrainingLayout: ...
    @property
    def work_dir(self) -> Path: ...


def _agreed(found: tuple[int, str] | None) -> tuple[int, str] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    box = [found]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def fetch_model(ctx: RunPlace, source: str, name: str) -> Path:
    """A local directory holding the weights named by `source`.

    `source` is a local directory, a store URL (file:// or s3://) of a directory uploaded with
    upload_dir, or a key in the run's store. A model id that none of these match is returned as
    given for transformers to resolve (a cache, or a hub when the cluster allows downloads).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    target = ctx.work_dir / "models" / name
    if (target / "config.json").is_file():
        return target
    if source.startswith(("s3://", "file://")):
        store = open_store(source)
        try:
            store.download_dir("", target)
        except NotFound:
            raise UsageError(f"no model at {source}: upload one with `kernelfleet store` first") from None
        return target
    if ctx.store.dir_complete(source):
        ctx.store.download_dir(source, target)
        return target
    return Path(source)


def input_model(ctx: RunPlace, stage: TrainingStage) -> Path:
    """The weights `stage` starts from: the previous stage's final model, or the base model."""
    previous = ctx.config.previous(stage.name)
    if previous is None:
        return fetch_model(ctx, ctx.config.spec.base_model, "base")
    key = ctx.layout.model(previous.name)
    if not ctx.store.dir_complete(key):
        raise UsageError(
            f"stage {stage.name} starts from the model of stage {previous.name}, which is not in the store "
            f"yet ({ctx.store.url_for(key)}); run stage {previous.name} first"
        )
    target = ctx.work_dir / "models" / previous.name
    ctx.store.download_dir(key, target)
    return target


def upload_model(ctx: StageContext, local: Path, key: str) -> str:
    """Upload final weights (idempotent after a kill: only what is missing is sent)."""
    try:
        ctx.store.upload_dir(local, key)
    except ObjectConflict:
        # A different model is already complete there: an earlier attempt finished this upload.
        if not ctx.store.dir_complete(key):
            raise
        log.info("a model is already stored at %s; keeping it", ctx.store.url_for(key))
    return ctx.store.url_for(key)


def write_done(ctx: StageContext, stage: TrainingStage, summary: dict[str, Any]) -> None:
    with contextlib.suppress(ObjectConflict):
        ctx.store.put_json(ctx.layout.done(stage.name), summary)


def reset_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def dump_jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows).encode()


def load_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
