"""Stage 3: contrastive RL with trl's GRPOTrainer, the evaluator's speedup as the reward.

Prompts. The dataset holds one exemplar-free contrastive prompt per training task; it names the
task. At generation time each prompt group gets fresh exemplars, two earlier verified variants
of that task with their speedups drawn from distinct speedup buckets of the live variant
database (`kernelfleet.search.VariantDatabase`, the loop's own), built with the loop's prompt
builder. Every verified variant the model writes goes back into that database (and the store),
so the exemplars improve as training goes on. The database starts from every correct variant
the earlier stages verified.

Overlap. Rewards take seconds (GPU timing in other processes, or a service on GPUs of its own),
so generation and evaluation run as a pipeline, through trl's `rollout_func`: the trainer
generates one prompt group (G completions), hands that group's code to the reward backend, and
generates the next group while the first is timed. After the last group it waits for what is
still being measured; that wait is the only part of reward time the step pays for, and it is
measured (`timing/reward_wait_share`: wait / step time). The rollout returns the rewards it
collected as a column, which the reward function passes on to trl.

Resuming. Checkpoints go to the store as in every stage; results are cached in the store under
the stage, so after a kill the variant database is rebuilt from them and no variant is timed twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import EvaluationResult, Task, Verdict
from kernelfleet.core.resources import GRPOStageConfig, RewardSpec, StageType, TrainingStage
from kernelfleet.search import Entry, Exemplar, VariantDatabase, build_messages
from kernelfleet.search._answers import parse_answer
from kernelfleet.trainer._context import (
    StageContext,
    StatusWriter,
    StoreCallback,
    input_model,
    restore_checkpoint,
    upload_model,
    write_done,
)
from kernelfleet.trainer._rewards import (
    Outcome,
    RewardBackend,
    RewardShaper,
    StoreResultCache,
    batch_metrics,
    make_backend,
)
from kernelfleet.trainer._sft import cpu_ranks, load_tokenizer, lora_config, save_final, use_bf16

log = logging.getLogger(__name__)

REWARD_COLUMN = "kf_reward"

AnswerFilter = Callable[[Task, str, int], str]
"""Rewrites a completion's text before it is parsed: (task, text, step) -> text. The GPU benchmark
uses it to load the evaluator with real candidates while a random model generates."""


class ContrastivePrompts:
    """The live variant database of every training task, and the prompts built from it."""

    def __init__(
        self, tasks: Sequence[Task], device: str, gpu_class: str, spec: RewardSpec, seed: int = 0
    ) -> None:
        self.tasks = {task.hash: task for task in tasks}
        self.device = device
        self.gpu_class = gpu_class
        self.spec = spec
        self.seed = seed
        self.dbs = {task.hash: VariantDatabase(task.hash, gpu_class) for task in tasks}
        self._by_prompt = {self._key(self.base_messages(task)): task for task in tasks}

    @staticmethod
    def _key(messages: Sequence[dict[str, Any]]) -> str:
        return hashlib.sha256("\x00".join(str(m.get("content", "")) for m in messages).encode()).hexdigest()

    def base_messages(self, task: Task) -> list[dict[str, str]]:
        return build_messages(task, [], self.device, self.gpu_class)

    def rows(self) -> list[dict[str, Any]]:
        return [{"prompt": self.base_messages(task), "task_hash": h} for h, task in self.tasks.items()]

    def task_of(self, prompt: Sequence[dict[str, Any]]) -> Task:
        task = self._by_prompt.get(self._key(prompt))
        if task is None:
            raise RuntimeError(
                "a GRPO prompt that is no training task's: the dataset and the prompts disagree"
            )
        return task

    def messages(self, task: Task, step: int, group: int) -> list[dict[str, str]]:
        """The contrastive prompt for one group: exemplars drawn from the live database."""
        rng = random.Random(f"{self.seed}:{task.hash}:{step}:{group}")
        chosen = self.dbs[task.hash].sample_exemplars(self.spec.exemplars, self.spec.bucket_temperature, rng)
        exemplars = [Exemplar(e.code, e.speedup or 0.0, e.variant_hash) for e in chosen]
        return build_messages(task, exemplars, self.device, self.gpu_class)

    def add(self, task: Task, code: str, result: EvaluationResult, policy: str, step: int) -> bool:
        """Remember a verified variant; True when it is new."""
        if result.verdict != Verdict.CORRECT or result.speedup is None or result.task_hash != task.hash:
            return False
        return self.dbs[task.hash].add(Entry(code=code, result=result, policy=policy, round=step))

    def seed_from(self, ctx: StageContext, prefixes: Sequence[str]) -> int:
        """Load every correct variant of these tasks stored under `prefixes` (earlier stages, a resume)."""
        added = 0
        env = ctx.environment
        for prefix in prefixes:
            for key in ctx.store.list(prefix.rstrip("/") + "/"):
                if "/results/" not in key or not key.endswith(".json"):
                    continue
                result = EvaluationResult.model_validate(ctx.store.get_json(key))
                task = self.tasks.get(result.task_hash)
                same_env = (
                    result.environment.gpu_class == env.gpu_class
                    and result.environment.evaluator_version == env.evaluator_version
                )
                if task is None or not same_env or result.verdict != Verdict.CORRECT:
                    continue
                if result.variant_hash in self.dbs[task.hash]:
                    continue
                code = ctx.store.get_variant(result.variant_hash)
                added += self.add(task, code, result, "earlier", 0)
        return added


@dataclass
class RewardTimer:
    """Where step time goes: generation, waiting for rewards, the rest (the update)."""

    steps: int = 0
    step_s: float = 0.0
    generation_s: float = 0.0
    wait_s: float = 0.0
    evaluations: int = 0
    last: dict[str, float] = field(default_factory=dict)
    _step_started: float | None = None

    def share(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "step_s": self.step_s,
            "generation_s": self.generation_s,
            "reward_wait_s": self.wait_s,
            "reward_wait_share": self.share(),
            "evaluations": self.evaluations,
        }


class OverlappedRollout:
    """trl `rollout_func`: generate group by group, evaluate each group while generating the next."""

    def __init__(
        self,
        prompts: ContrastivePrompts,
        backend: RewardBackend,
        shaper: RewardShaper,
        tokenizer: Any,
        timer: RewardTimer,
        *,
        timeout_s: float,
        policy_name: str = "grpo",
        answer_filter: AnswerFilter | None = None,
    ) -> None:
        self.prompts = prompts
        self.backend = backend
        self.shaper = shaper
        self.tokenizer = tokenizer
        self.timer = timer
        self.timeout_s = timeout_s
        self.policy_name = policy_name
        self.answer_filter = answer_filter
        self.last_outcomes: list[Outcome] = []
        self.new_variants = 0

    def _eos_ids(self, model: Any) -> set[int]:
        ids = model.generation_config.eos_token_id
        found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            found.add(self.tokenizer.eos_token_id)
        return found

    def _generate(
        self, trainer: Any, prompt_ids: list[int], count: int
    ) -> tuple[list[list[int]], list[list[float | None]] | None]:
        """`count` completions of one prompt, and with vLLM each token's sampling logprob (trl's
        importance-sampling correction needs them; transformers generates with the model itself)."""
        if getattr(trainer, "use_vllm", False):
            # trl syncs the weights into vLLM before calling the rollout; the prompts are the
            # group's, repeated, as trl's own generation passes them (in server mode, rank 0 sends
            # each distinct prompt once with n=count and broadcasts the answers).
            _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
                prompts=[prompt_ids] * count,
                images=None,
                num_generations=count,
                profiler=contextlib.nullcontext(),
            )
            sampled = None if logprobs is None else [[lp[0] for lp in seq] for seq in logprobs]
            return [list(ids) for ids in completion_ids], sampled
        from trl.models.utils import unwrap_model_for_generation

        device = trainer.accelerator.device
        inputs = torch.tensor([prompt_ids] * count, device=device)
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
        ):
            output = model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                generation_config=trainer.generation_config,
            )
            eos = self._eos_ids(model)
        completions = []
        for row in output[:, len(prompt_ids) :].tolist():
            cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            completions.append(row[:cut])
        return completions, None

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        group = max(1, int(getattr(trainer, "num_generations", 1)))
        step = int(trainer.state.global_step)
        started = time.monotonic()
        pending: list[tuple[Task, list[str | None], list[str], Any]] = []
        prompt_ids: list[list[int]] = []
        completion_ids: list[list[int]] = []
        logprobs: list[list[float | None]] | None = []
        for index in range(0, len(prompts), group):
            members = prompts[index : index + group]
            task = self.prompts.task_of(members[0])
            messages = self.prompts.messages(task, step, index // group)
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            completions, sampled = self._generate(trainer, ids, len(members))
            logprobs = None if sampled is None or logprobs is None else logprobs + sampled
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            if self.answer_filter is not None:
                texts = [self.answer_filter(task, text, step) for text in texts]
            parsed = [parse_answer(text) for text in texts]
            codes = [answer.code for answer in parsed]
            errors = [answer.error for answer in parsed]
            items = [(task, code) for code in codes if code is not None]
            future = self.backend.submit(items) if items else None
            pending.append((task, codes, errors, future))
            prompt_ids += [ids] * len(members)
            completion_ids += completions
        generated = time.monotonic()
        outcomes: list[Outcome] = []
        for task, codes, errors, future in pending:
            results: list[EvaluationResult] = []
            if future is not None:
                try:
                    results = list(future.result(timeout=self.timeout_s))
                except Exception as failure:  # the evaluator failed, not the code: unscorable
                    log.warning("rewards of a %s group could not be measured: %s", task.name, failure)
                    results = []
            measured = iter(results)
            for code, error in zip(codes, errors, strict=True):
                if code is None:
                    outcomes.append(self.shaper.outcome(None, parse_error=error or "no code"))
                    continue
                result = next(measured, None)
                outcomes.append(self.shaper.outcome(result))
                if result is not None and self.prompts.add(task, code, result, self.policy_name, step):
                    self.new_variants += 1
        waited = time.monotonic() - generated
        self.timer.generation_s += generated - started
        self.timer.wait_s += waited
        self.timer.evaluations += sum(1 for o in outcomes if o.kind not in ("unparsable",))
        self.timer.last = {"generation_s": generated - started, "reward_wait_s": waited}
        self.last_outcomes = outcomes
        shaped = self.shaper.shape([outcome.raw for outcome in outcomes])
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            REWARD_COLUMN: shaped,
        }


def make_reward_function(rollout: OverlappedRollout) -> Any:
    """The trl reward function: hands over what the rollout measured, and logs it."""

    def speedup_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        rewards = kwargs.get(REWARD_COLUMN)
        if rewards is None or len(rewards) != len(completions):
            raise RuntimeError("the rollout did not provide rewards for every completion")
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            for name, value in batch_metrics(rollout.last_outcomes).items():
                log_metric(name, value)
            for name, value in rollout.timer.last.items():
                log_metric(f"timing/{name}", value)
            log_metric("variants/new", float(rollout.new_variants))
        return [None if value is None else float(value) for value in rewards]

    return speedup_reward


class TimingCallback(TrainerCallback):
    """Times each optimizer step and adds the share spent waiting for rewards to the logs."""

    def __init__(self, timer: RewardTimer) -> None:
        self.timer = timer

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.timer._step_started = time.monotonic()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.timer._step_started is not None:
            self.timer.step_s += time.monotonic() - self.timer._step_started
            self.timer.steps += 1
            self.timer._step_started = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is not None and self.timer.steps:
            logs["timing/reward_wait_share"] = self.timer.share()
            logs["timing/step_s"] = self.timer.step_s / self.timer.steps


def grpo_args(config: GRPOStageConfig, output_dir: Path) -> Any:
    from trl import GRPOConfig

    server = config.vllm_server_base_url
    local = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    # A server (trl's server mode) is used whenever one is named: trl itself says what is missing.
    use_vllm = config.use_vllm and (bool(server) or local)
    if config.use_vllm and not use_vllm:
        log.info("vLLM is not usable here (not installed or no GPU): GRPO generates with transformers")
    server_mode: dict[str, Any] = {}
    if use_vllm and server:
        server_mode = {
            "vllm_mode": "server",
            "vllm_server_base_url": server,
            "vllm_server_timeout": config.vllm_server_timeout,
        }
    return GRPOConfig(
        **server_mode,
        output_dir=str(output_dir),
        learning_rate=config.learning_rate,
        num_generations=config.num_generations,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        loss_type=config.loss_type,
        scale_rewards=config.scale_rewards,
        max_completion_length=config.max_completion_length,
        mask_truncated_completions=config.mask_truncated_completions,
        temperature=config.temperature,
        top_p=config.top_p,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        use_vllm=use_vllm,
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


@dataclass
class GRPORun:
    """What a GRPO stage leaves behind for callers that look inside (tests, the benchmark)."""

    summary: dict[str, Any]
    timer: RewardTimer
    prompts: ContrastivePrompts


def run_grpo(
    ctx: StageContext,
    stage: TrainingStage,
    train_tasks: list[Task],
    *,
    backend: RewardBackend | None = None,
    answer_filter: AnswerFilter | None = None,
) -> GRPORun:
    """Stage 3 from start (or its last checkpoint) to a final model in the store.

    `backend` replaces the one the stage's reward spec names; `answer_filter` rewrites completions
    before they are parsed (see `AnswerFilter`).
    """
    from datasets import Dataset
    from trl import GRPOTrainer

    if stage.type != StageType.GRPO:
        raise UsageError(f"stage {stage.name} is a {stage.type} stage, not grpo")
    if not train_tasks:
        raise UsageError(f"stage {stage.name}: no training tasks (all are held out?)")
    config = stage.grpo or GRPOStageConfig()
    spec = stage.reward or RewardSpec()
    status = StatusWriter(ctx, stage)
    status.update(phase="Running", message="starting")
    prompts = ContrastivePrompts(
        train_tasks, ctx.environment.device, ctx.environment.gpu_class, spec, seed=config.seed
    )
    names = [s.name for s in ctx.config.spec.stages]
    earlier = [ctx.layout.stage(name) for name in names[: names.index(stage.name) + 1]]
    seeded = prompts.seed_from(ctx, earlier)
    log.info("variant database seeded with %d verified variants", seeded)
    cache = StoreResultCache(ctx.store, ctx.layout.stage(stage.name))
    own_backend = backend is None
    # The service's bearer token: from the Secret the spec names, mounted as this variable.
    token = os.environ.get("KERNELFLEET_EVAL_TOKEN", "")
    reward_backend: RewardBackend = backend or make_backend(spec, ctx.evaluator, cache, token)
    model_path = input_model(ctx, stage)
    tokenizer = load_tokenizer(model_path)
    timer = RewardTimer()
    rollout = OverlappedRollout(
        prompts,
        reward_backend,
        RewardShaper(spec),
        tokenizer,
        timer,
        timeout_s=spec.timeout_seconds,
        answer_filter=answer_filter,
    )
    work = ctx.stage_dir(stage.name)
    output_dir = work / "trainer"
    output_dir.mkdir(parents=True, exist_ok=True)
    args = grpo_args(config, output_dir)
    _ = args.device  # sets up the ranks' process group, in which they agree on the checkpoint
    resume = restore_checkpoint(ctx, ctx.layout.stage(stage.name), output_dir)
    try:
        trainer = GRPOTrainer(
            model=str(model_path),
            reward_funcs=make_reward_function(rollout),
            args=args,
            train_dataset=Dataset.from_list(prompts.rows()),
            processing_class=tokenizer,
            peft_config=lora_config(config),
            rollout_func=rollout,
            callbacks=[
                TimingCallback(timer),
                StoreCallback(ctx, stage, status, ctx.layout.stage(stage.name)),
                *ctx.extra_callbacks,
            ],
        )
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        final = save_final(trainer, tokenizer, work / "final")
    finally:
        if own_backend:
            reward_backend.close()
    url = upload_model(ctx, final, ctx.layout.model(stage.name))
    summary = {
        "stage": stage.name,
        "type": str(stage.type),
        "model": url,
        "new_variants": rollout.new_variants,
        "seeded_variants": seeded,
        "timing": timer.as_dict(),
    }
    status.update(
        phase="Succeeded",
        model=url,
        metrics={f"timing/{k}": v for k, v in timer.as_dict().items()},
        message=f"{timer.steps} steps; {rollout.new_variants} new verified variants",
    )
    write_done(ctx, stage, summary)
    return GRPORun(summary, timer, prompts)
