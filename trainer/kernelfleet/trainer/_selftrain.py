"""Stage 2: self-training. The model generates, the evaluator verifies, only correct answers train it.

Each round: the current model answers contrastive prompts for the training tasks (vLLM's offline
engine when vLLM is installed and a GPU is present, else transformers), through the normal loop,
so every answer and result is in the store; the correct answers, fastest first, become the next
fine-tuning set; `fine_tune` trains the model on them. This is the paper's positive-only stage:
reward 1 for correct, 0 otherwise, no baseline, no negative updates. A round with no correct
answer leaves the model as it was. Each round's model is kept in the store, so a killed stage
resumes at the round (and within it, at the checkpoint) where it stopped.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Task
from kernelfleet.core.resources import SelfTrainStageConfig, SFTStageConfig, StageType, TrainingStage
from kernelfleet.search import HFPolicy, Policy, VLLMPolicy
from kernelfleet.trainer._context import (
    StageContext,
    StatusWriter,
    input_model,
    upload_model,
    write_done,
)
from kernelfleet.trainer._data import build_rows, collect
from kernelfleet.trainer._sft import fine_tune

log = logging.getLogger(__name__)


def vllm_usable() -> bool:
    """vLLM's offline engine is worth using: installed, and a GPU to run it on."""
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def generation_policy(path: Path, config: SelfTrainStageConfig) -> Policy:
    if config.use_vllm and vllm_usable():
        return VLLMPolicy(
            str(path), temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_new_tokens
        )
    if config.use_vllm:
        log.info("vLLM is not usable here (not installed or no GPU): generating with transformers")
    return HFPolicy(
        str(path),
        temperature=config.temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        batch_size=8,
    )


def run_selftrain(ctx: StageContext, stage: TrainingStage, train_tasks: list[Task]) -> dict[str, Any]:
    if stage.type != StageType.SELF_TRAIN:
        raise UsageError(f"stage {stage.name} is a {stage.type} stage, not selftrain")
    config = stage.selftrain or SelfTrainStageConfig()
    sft_config = stage.sft or SFTStageConfig()
    status = StatusWriter(ctx, stage)
    status.update(phase="Running", message="starting")
    model = input_model(ctx, stage)
    rounds: list[dict[str, Any]] = []
    for number in range(1, config.rounds + 1):
        root = f"{ctx.layout.stage(stage.name)}/round-{number:02d}"
        model_key = f"{root}/model"
        local = ctx.work_dir / "models" / f"{stage.name}-round-{number:02d}"
        if ctx.store.dir_complete(model_key):
            ctx.store.download_dir(model_key, local)
            model = local
            rounds.append({"round": number, "resumed": True})
            continue
        status.update(round=number, message=f"round {number}: generating")
        # The policy's id names its samples in the store; a directory per round keeps rounds apart.
        policy = generation_policy(model, config)
        try:
            verified = collect(
                ctx, train_tasks, [policy], f"{root}/collect", rounds=1, samples=config.samples_per_task
            )
        finally:
            policy.close()
        rows = build_rows(
            verified,
            keep_per_task=config.keep_per_task,
            exemplars=2,
            device=ctx.environment.device,
            gpu_class=ctx.environment.gpu_class,
            seed=number,
        )
        correct = sum(len(items) for items in verified.values())
        if rows:
            status.update(message=f"round {number}: fine-tuning on {len(rows)} correct answers")
            model_dir = fine_tune(
                ctx,
                stage,
                status,
                model_path=model,
                rows=rows,
                config=sft_config,
                store_prefix=root,
                work=ctx.stage_dir(stage.name) / f"round-{number:02d}",
            )
        else:
            log.info("self-training round %d: no correct answer; the model stays as it was", number)
            model_dir = model
        upload_model(ctx, model_dir, model_key)
        ctx.store.download_dir(model_key, local)
        model = local
        rounds.append({"round": number, "correct_variants": correct, "examples": len(rows)})
        status.update(metrics={"selftrain/correct_variants": correct, "selftrain/examples": len(rows)})
    url = upload_model(ctx, model, ctx.layout.model(stage.name))
    summary = {"stage": stage.name, "type": str(stage.type), "rounds": rounds, "model": url}
    status.update(phase="Succeeded", model=url, message=f"{config.rounds} round(s) done")
    write_done(ctx, stage, summary)
    return summary
