"""Running a training run: one stage (a pod's command), or all of them in order (a local run).

`run_stage` is what a TrainingRun's Job runs: it is idempotent (a stage whose `done.json` exists
is skipped; an unfinished one resumes from the store), so the operator may restart it after any
failure or eviction. After the stage, its model optimises the held-out tasks and the report is
written again with the new row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Task
from kernelfleet.core.resources import StageType
from kernelfleet.core.settings import merged
from kernelfleet.core.store import NotFound, ObjectConflict, Store, open_store
from kernelfleet.core.tasks import load_tasks
from kernelfleet.core.training import TrainingLayout, run_record, stage_done
from kernelfleet.trainer._context import StageContext, fetch_model
from kernelfleet.trainer._grpo import run_grpo
from kernelfleet.trainer._heldout import evaluate_held_out, format_report
from kernelfleet.trainer._selftrain import run_selftrain
from kernelfleet.trainer._sft import run_sft
from kernelfleet.trainer._spec import RunConfig, default_prefix
from kernelfleet.trainer._split import Split, split_tasks

log = logging.getLogger(__name__)

BASE_LABEL = "base-model"


def default_work_dir(prefix: str) -> Path:
    root = os.environ.get("KERNELFLEET_TRAIN_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kernelfleet" / "train"
    return base / prefix.replace("/", "-")


def load_run_tasks(config: RunConfig) -> list[Task]:
    tasks: dict[str, Task] = {}
    for selection in config.spec.tasks:
        for task in load_tasks(selection):
            tasks.setdefault(task.hash, task)
    if not tasks:
        raise UsageError(f"the run {config.name} selects no tasks")
    return list(tasks.values())


@dataclass
class Run:
    """An opened training run: its config, store, layout, split and evaluator."""

    config: RunConfig
    ctx: StageContext
    split: Split

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def layout(self) -> TrainingLayout:
        return self.ctx.layout


@contextmanager
def open_run(
    config: RunConfig,
    *,
    store: Store | str | None = None,
    prefix: str | None = None,
    work_dir: Path | None = None,
    device: str | None = None,
    eval_overrides: dict[str, Any] | None = None,
    extra_callbacks: list[Any] | None = None,
) -> Iterator[Run]:
    """Open the run's store and evaluator; write (or check) the spec under the run's prefix."""
    from kernelfleet.evaluator import EvalConfig, Evaluator

    opened = store if isinstance(store, Store) else open_store(store or config.spec.store or None)
    layout = TrainingLayout(prefix or default_prefix(config))
    try:
        opened.put_json(layout.spec, run_record(config.name, config.spec))
    except ObjectConflict:
        raise UsageError(
            f"{opened.url_for(layout.spec)} holds another spec: a changed configuration is a new run; give "
            "another --prefix, or leave it out to get one derived from the configuration"
        ) from None
    tasks = load_run_tasks(config)
    split = split_tasks(tasks, config.spec.held_out)
    evaluation = config.spec.evaluation
    settings = merged(evaluation.model_dump(), {"device": device or _default_device()})
    with Evaluator(EvalConfig.model_validate(merged(settings, eval_overrides or {}))) as evaluator:
        ctx = StageContext(
            config=config,
            store=opened,
            layout=layout,
            work_dir=work_dir or default_work_dir(layout.prefix),
            evaluator=evaluator,
            environment=evaluator.environment,
            extra_callbacks=list(extra_callbacks or []),
        )
        ctx.work_dir.mkdir(parents=True, exist_ok=True)
        yield Run(config, ctx, split)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


STAGE_RUNNERS: dict[StageType, Callable[..., Any]] = {
    StageType.SFT: run_sft,
    StageType.SELF_TRAIN: run_selftrain,
    StageType.GRPO: lambda ctx, stage, tasks: run_grpo(ctx, stage, tasks).summary,
}


def run_stage(run: Run, name: str, *, held_out: bool = True) -> dict[str, Any]:
    """Train one stage (skipped when done), then evaluate its model on the held-out tasks."""
    stage = run.config.stage(name)
    ctx = run.ctx
    train = list(run.split.train)
    if not train:
        raise UsageError(
            f"every task of {run.config.name} is held out; select more tasks or lower heldOut.fraction"
        )
    spec = run.config.spec.held_out
    evaluate = held_out and spec.evaluate and bool(run.split.held_out)
    if evaluate and run.config.previous(name) is None:
        base = fetch_model(ctx, run.config.spec.base_model, "base")
        evaluate_held_out(ctx, BASE_LABEL, base, run.split.held_out, spec)
    if stage_done(ctx.store, ctx.layout, name):
        log.info("stage %s is done already (%s)", name, ctx.store.url_for(ctx.layout.done(name)))
        summary = ctx.store.get_json(ctx.layout.done(name))
    else:
        summary = STAGE_RUNNERS[stage.type](ctx, stage, train)
    if evaluate:
        local = ctx.work_dir / "models" / f"{name}-final"
        ctx.store.download_dir(ctx.layout.model(name), local)
        evaluate_held_out(ctx, name, local, run.split.held_out, spec)
        write_report(run)
    return summary


def run_all(run: Run, stages: list[str] | None = None) -> list[dict[str, Any]]:
    names = stages or [stage.name for stage in run.config.spec.stages]
    return [run_stage(run, name) for name in names]


def report_rows(run: Run) -> list[dict[str, Any]]:
    rows = []
    for label in [BASE_LABEL, *(stage.name for stage in run.config.spec.stages)]:
        try:
            rows.append(run.store.get_json(f"{run.layout.heldout(label)}/row.json"))
        except NotFound:
            continue
    return rows


def write_report(run: Run) -> dict[str, Any]:
    rows = report_rows(run)
    report = {
        "run": run.config.name,
        "held_out_tasks": [task.name for task in run.split.held_out],
        "train_tasks": len(run.split.train),
        "rows": rows,
        "table": format_report(rows),
    }
    with contextlib.suppress(ObjectConflict):
        run.store.put_json(run.layout.report(int(time.time() * 1000)), report)
    return report
