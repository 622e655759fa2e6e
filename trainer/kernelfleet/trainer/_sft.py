"""Stage 1: supervised fine-tuning on verified code, with trl's SFTTrainer (full or LoRA through peft).

`fine_tune` is the one place that runs SFTTrainer; self-training calls it once per round. It
resumes from the newest complete checkpoint in the store, and always leaves full weights behind
(a LoRA adapter is merged), so the next stage, the held-out evaluation and a vLLM server can
load the result without peft.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import PeftFields, SFTStageConfig, StageType, TrainingStage
from kernelfleet.core.store import NotFound, ObjectConflict, open_store
from kernelfleet.search import make_policy
from kernelfleet.search.policies import PolicyOptions
from kernelfleet.trainer._context import (
    StageContext,
    StatusWriter,
    StoreCallback,
    dump_jsonl,
    input_model,
    load_jsonl,
    reset_dir,
    restore_checkpoint,
    upload_model,
    write_done,
)
from kernelfleet.trainer._data import build_rows, collect
from kernelfleet.trainer._spec import policy_string

log = logging.getLogger(__name__)


def use_bf16(requested: bool) -> bool:
    """bf16 when asked for and the GPU has it; on a CPU it is turned off (trl would refuse)."""
    if requested and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        log.warning("bf16 asked for, but no GPU here supports it: training in fp32")
        return False
    return requested


def cpu_ranks() -> dict[str, Any]:
    """Trainer settings for several ranks without a GPU (a CPU run of a multi-node stage under
    torchrun): accelerate then runs them as one gloo world (without `use_cpu` it would leave each
    rank training alone); nothing otherwise (NCCL between GPUs; one process needs no world)."""
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return {"use_cpu": True, "ddp_backend": "gloo"} if several and not torch.cuda.is_available() else {}


def lora_config(fields: PeftFields) -> Any:
    if not fields.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=fields.lora_r,
        lora_alpha=fields.lora_alpha,
        lora_dropout=fields.lora_dropout,
        target_modules=fields.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_final(trainer: Any, tokenizer: Any, target: Path) -> Path:
    """Full weights and tokenizer in `target`; a peft adapter is merged first."""
    reset_dir(target)
    model = trainer.model
    unwrapped = trainer.accelerator.unwrap_model(model) if hasattr(trainer, "accelerator") else model
    if hasattr(unwrapped, "merge_and_unload"):
        unwrapped = unwrapped.merge_and_unload()
    if trainer.args.process_index == 0:
        unwrapped.save_pretrained(str(target))
        tokenizer.save_pretrained(str(target))
    return target


def fine_tune(
    ctx: StageContext,
    stage: TrainingStage,
    status: StatusWriter,
    *,
    model_path: Path,
    rows: list[dict[str, Any]],
    config: SFTStageConfig,
    store_prefix: str,
    work: Path,
) -> Path:
    """Run SFTTrainer on `rows` from `model_path`; the merged final model's local directory."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if not rows:
        raise UsageError(f"stage {stage.name}: no training examples; nothing to fine-tune on")
    output_dir = work / "trainer"
    output_dir.mkdir(parents=True, exist_ok=True)
    args = SFTConfig(
        output_dir=str(output_dir),
        learning_rate=config.learning_rate,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_length=config.max_length,
        packing=config.packing,
        bf16=use_bf16(config.bf16),
        gradient_checkpointing=config.gradient_checkpointing,
        logging_steps=config.logging_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        seed=config.seed,
        report_to="none",
        disable_tqdm=True,
        **cpu_ranks(),
    )
    _ = args.device  # sets up the ranks' process group, in which they agree on the checkpoint
    resume = restore_checkpoint(ctx, store_prefix, output_dir)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "completion": row["completion"]} for row in rows])
    tokenizer = load_tokenizer(model_path)
    trainer = SFTTrainer(
        model=str(model_path),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(config),
        callbacks=[StoreCallback(ctx, stage, status, store_prefix), *ctx.extra_callbacks],
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return save_final(trainer, tokenizer, work / "final")


def sft_rows(
    ctx: StageContext, stage: TrainingStage, train_tasks: list[Any], status: StatusWriter
) -> list[dict[str, Any]]:
    """The stage's dataset: stored already (a resumed stage), a given file, or collected now."""
    key = ctx.layout.data(stage.name, "train")
    try:
        return load_jsonl(ctx.store.get_bytes(key))
    except NotFound:
        pass
    data = stage.data
    if data is None or (not data.dataset and not data.policies):
        raise UsageError(
            f"stage {stage.name} (sft) needs `data`: policies to collect verified code from, or a dataset"
        )
    if data.dataset:
        rows = _read_dataset(ctx, data.dataset)
    else:
        status.update(phase="Running", message="collecting verified examples")
        options = PolicyOptions(device=None)
        policies = [make_policy(policy_string(spec), options) for spec in data.policies]
        try:
            verified = collect(
                ctx,
                train_tasks,
                policies,
                ctx.layout.collect(stage.name),
                rounds=data.rounds,
                samples=data.samples_per_task,
            )
        finally:
            for policy in policies:
                policy.close()
        rows = build_rows(
            verified,
            keep_per_task=data.keep_per_task,
            exemplars=2,
            device=ctx.environment.device,
            gpu_class=ctx.environment.gpu_class,
        )
    try:
        ctx.store.put_bytes(key, dump_jsonl(rows))
    except ObjectConflict:  # a racing or earlier attempt stored it first: use theirs
        return load_jsonl(ctx.store.get_bytes(key))
    return rows


def _read_dataset(ctx: StageContext, source: str) -> list[dict[str, Any]]:
    path = Path(source).expanduser()
    if path.is_file():
        return load_jsonl(path.read_bytes())
    if source.startswith(("s3://", "file://")):
        base, _, name = source.rpartition("/")
        return load_jsonl(open_store(base).get_bytes(name))
    try:
        return load_jsonl(ctx.store.get_bytes(source))
    except NotFound:
        raise UsageError(f"dataset {source} is neither a file nor an object in {ctx.store.url}") from None


def run_sft(ctx: StageContext, stage: TrainingStage, train_tasks: list[Any]) -> dict[str, Any]:
    """Stage 1 from start (or from its last checkpoint) to a final model in the store."""
    if stage.type != StageType.SFT:
        raise UsageError(f"stage {stage.name} is a {stage.type} stage, not sft")
    status = StatusWriter(ctx, stage)
    status.update(phase="Running", message="starting")
    rows = sft_rows(ctx, stage, train_tasks, status)
    status.update(message=f"fine-tuning on {len(rows)} examples")
    work = ctx.stage_dir(stage.name)
    final = fine_tune(
        ctx,
        stage,
        status,
        model_path=input_model(ctx, stage),
        rows=rows,
        config=stage.sft or SFTStageConfig(),
        store_prefix=ctx.layout.stage(stage.name),
        work=work,
    )
    url = upload_model(ctx, final, ctx.layout.model(stage.name))
    summary = {"stage": stage.name, "type": str(stage.type), "examples": len(rows), "model": url}
    status.update(phase="Succeeded", model=url, message=f"trained on {len(rows)} examples")
    write_done(ctx, stage, summary)
    return summary
