"""`kernelfleet train`: the three training stages, locally or as one stage of a TrainingRun.

    kernelfleet train run CONFIG                  every stage of CONFIG in order (TrainingRun spec, YAML/JSON)
    kernelfleet train stage [--run-config CONFIG] --stage NAME --prefix KEY   one stage: a Job's command
    kernelfleet train generator --stage NAME --prefix KEY      the RL stage's vLLM server (trl's server mode)
    kernelfleet train sft --model DIR --policy replay:FILE TASKS...          one stage from flags
    kernelfleet train self-train --model DIR TASKS...
    kernelfleet train rl --model DIR TASKS...
    kernelfleet train status CONFIG               each stage's phase, step, checkpoint and metrics
    kernelfleet train report CONFIG               the held-out numbers, stage by stage

Running the same command again resumes: finished stages are skipped, an unfinished one
continues from its newest checkpoint in the store.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.jsontext import dumps
from kernelfleet.core.resources import (
    GRPOStageConfig,
    PolicyKind,
    PolicySpec,
    RewardSpec,
    SelfTrainStageConfig,
    SFTStageConfig,
    StageData,
    StageType,
    TrainingRunSpec,
    TrainingStage,
)
from kernelfleet.core.store import open_store
from kernelfleet.core.training import TrainingLayout, latest_report, latest_stage_status, read_run_record
from kernelfleet.trainer._spec import STAGE_COMMANDS, RunConfig, default_prefix, load_run_config, slug


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "train",
        help="train a policy: supervised fine-tuning, self-training, contrastive RL",
        description="The three training stages with trl. Every stage keeps checkpoints, datasets and metrics "
        "in the store and resumes after a kill.",
    )
    commands = parser.add_subparsers(dest="train_command", metavar="COMMAND")

    run = commands.add_parser("run", help="every stage of a TrainingRun config, in order")
    run.add_argument("config", metavar="CONFIG", help="TrainingRun manifest or spec (.yaml, .yml, .json)")
    run.add_argument("--stages", default=None, help="comma-separated stage names (default: all)")
    _common(run)
    run.set_defaults(handler=run_command)

    stage = commands.add_parser(
        "stage",
        help="one stage of a TrainingRun config (the Job's command)",
        description="Train one stage. Without --run-config, the spec is the one the run was started "
        "with: <prefix>/run.json in the store (what a TrainingRun's pods do; the operator writes it).",
    )
    stage.add_argument("--run-config", default=None, metavar="CONFIG")
    stage.add_argument("--stage", required=True, metavar="NAME")
    _common(stage)
    stage.set_defaults(handler=stage_command)

    generator = commands.add_parser(
        "generator",
        help="the RL stage's vLLM server in trl's server mode (a TrainingRun's generator pod)",
        description="Fetch the weights the stage starts from (the previous stage's model, else the base "
        "model) from the run started in the store, and serve them with `trl vllm-serve` (vLLM's own server "
        "with the weight-transfer endpoints through which the trainer pushes its weights after each step).",
    )
    generator.add_argument("--stage", required=True, metavar="NAME")
    _locations(generator)
    generator.add_argument("--work-dir", default=None, help="local scratch for the weights")
    generator.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    generator.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    generator.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over (default 1)"
    )
    generator.set_defaults(handler=generator_command)

    for command, stage_type in STAGE_COMMANDS.items():
        single = commands.add_parser(command, help=f"one {stage_type.value} stage from flags")
        single.add_argument("tasks", nargs="+", metavar="TASKS", help="task files, directories or selections")
        single.add_argument("--model", required=True, help="starting weights: a directory or store URL")
        single.add_argument("--name", default=None, help="run name (default: derived from the flags)")
        single.add_argument("--steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
        single.add_argument("--learning-rate", type=float, default=None)
        single.add_argument("--batch-size", type=int, default=None, help="per-device batch size")
        single.add_argument("--lora", action="store_true", help="train a LoRA adapter (merged at the end)")
        single.add_argument("--save-steps", type=float, default=None)
        single.add_argument("--held-out", type=float, default=0.2, help="share of each level held out")
        single.add_argument("--no-held-out-eval", action="store_true", help="skip the held-out evaluation")
        if stage_type == StageType.SFT:
            single.add_argument("--policy", action="append", dest="policies", metavar="SPEC", default=[])
            single.add_argument("--dataset", default="", help="a ready prompt/completion JSONL instead")
            single.add_argument("--keep", type=int, default=2, help="correct variants kept per task")
            single.add_argument(
                "--samples", type=int, default=8, help="answers asked of each policy per task"
            )
        if stage_type == StageType.SELF_TRAIN:
            single.add_argument("--rounds", type=int, default=2)
            single.add_argument("--samples", type=int, default=8)
            single.add_argument("--max-new-tokens", type=int, default=4096)
        if stage_type == StageType.GRPO:
            single.add_argument("--num-generations", type=int, default=8)
            single.add_argument("--max-completion-length", type=int, default=4096)
            single.add_argument("--service-url", default="", help="kernelfleet eval serve URL for rewards")
            single.add_argument("--clip", type=float, default=1.5)
        _common(single)
        single.set_defaults(handler=single_command, stage_type=stage_type)

    status = commands.add_parser("status", help="each stage's phase, step, checkpoint and metrics")
    status.add_argument("config", metavar="CONFIG")
    _locations(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=status_command)

    report = commands.add_parser("report", help="the held-out report, stages side by side")
    report.add_argument("config", metavar="CONFIG")
    _locations(report)
    report.add_argument("--json", action="store_true")
    report.set_defaults(handler=report_command)
    parser.set_defaults(handler=lambda args: _help(parser))


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _locations(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", default=None, metavar="URL", help="artifact store (default: the spec's, else configured)"
    )
    parser.add_argument(
        "--prefix",
        default=None,
        metavar="KEY",
        help="the run's root in the store (default: derived from the config)",
    )


def _common(parser: argparse.ArgumentParser) -> None:
    _locations(parser)
    parser.add_argument("--work-dir", default=None, help="local scratch for weights and checkpoints")
    parser.add_argument("--device", default=None, help="evaluator device: cpu, cuda or cuda:N")
    parser.add_argument("--quiet", action="store_true", help="warnings only")


def _logging(args: argparse.Namespace) -> None:
    level = logging.WARNING if getattr(args, "quiet", False) else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)


def _open(config: RunConfig, args: argparse.Namespace) -> Any:
    from kernelfleet.trainer._runner import open_run

    return open_run(
        config,
        store=args.store,
        prefix=args.prefix,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        device=args.device,
    )


def _print_summary(run: Any, summaries: list[dict[str, Any]]) -> None:
    for summary in summaries:
        print(dumps(summary, sort_keys=True, default=str))
    report = latest_report(run.store, run.layout)
    if report is not None:
        print(f"\nheld-out tasks: {', '.join(report['held_out_tasks'])}")
        print(report["table"])
    print(f"\nrun {run.config.name}: {run.store.url_for(run.layout.prefix)}", file=sys.stderr)


def run_command(args: argparse.Namespace) -> int:
    from kernelfleet.trainer._runner import run_all

    _logging(args)
    config = load_run_config(args.config)
    stages = [name.strip() for name in args.stages.split(",")] if args.stages else None
    with _open(config, args) as run:
        summaries = run_all(run, stages)
        _print_summary(run, summaries)
    return 0


def stage_command(args: argparse.Namespace) -> int:
    from kernelfleet.trainer._runner import run_stage

    _logging(args)
    if args.run_config:
        config = load_run_config(args.run_config)
    else:
        config = _recorded_config(
            open_store(args.store), args.prefix, "train stage needs --run-config CONFIG, or"
        )
    config.stage(args.stage)
    with _open(config, args) as run:
        summary = run_stage(run, args.stage)
        _print_summary(run, [summary])
    return 0


def _recorded_config(store: Any, prefix: str | None, needs: str) -> RunConfig:
    """The run started in the store under `prefix` (what a TrainingRun's pods train)."""
    if not prefix:
        raise UsageError(f"{needs} --prefix KEY of a run started in the store")
    layout = TrainingLayout(prefix)
    name, spec = read_run_record(store, layout)
    return RunConfig(name, spec, store.url_for(layout.spec))


@dataclass(frozen=True)
class _GeneratorPlace:
    config: RunConfig
    store: Any
    layout: TrainingLayout
    work_dir: Path


def generator_command(args: argparse.Namespace) -> int:
    from trl.scripts.vllm_serve import ScriptArguments
    from trl.scripts.vllm_serve import main as vllm_serve

    from kernelfleet.trainer._context import input_model
    from kernelfleet.trainer._runner import default_work_dir

    _logging(args)
    store = open_store(args.store)
    config = _recorded_config(store, args.prefix, "train generator needs")
    stage = config.stage(args.stage)
    if stage.type != StageType.GRPO:
        raise UsageError(f"stage {stage.name} is a {stage.type} stage: only an RL (grpo) stage generates")
    layout = TrainingLayout(args.prefix)
    work_dir = Path(args.work_dir) if args.work_dir else default_work_dir(layout.prefix)
    model = input_model(_GeneratorPlace(config, store, layout, work_dir), stage)
    # trl's own command line (it replaces this process): the server trl's client expects.
    vllm_serve(
        ScriptArguments(
            model=str(model), host=args.host, port=args.port, tensor_parallel_size=args.tensor_parallel_size
        )
    )
    return 0


def single_config(args: argparse.Namespace) -> RunConfig:
    """A one-stage RunConfig from the flags of `train sft|self-train|rl`."""
    stage_type: StageType = args.stage_type
    sft_values: dict[str, Any] = {"max_steps": args.steps, "use_peft": args.lora}
    if args.learning_rate is not None:
        sft_values["learning_rate"] = args.learning_rate
    if args.batch_size is not None:
        sft_values["per_device_train_batch_size"] = args.batch_size
    if args.save_steps is not None:
        sft_values["save_steps"] = args.save_steps
    stage: dict[str, Any] = {"name": stage_type.value, "type": stage_type}
    if stage_type in (StageType.SFT, StageType.SELF_TRAIN):
        stage["sft"] = SFTStageConfig(**sft_values)
    if stage_type == StageType.SFT:
        policies = [_policy_spec(text) for text in args.policies]
        if not policies and not args.dataset:
            raise UsageError("train sft needs --policy SPEC (repeatable) or --dataset FILE")
        stage["data"] = StageData(
            policies=policies, dataset=args.dataset, keep_per_task=args.keep, samples_per_task=args.samples
        )
    if stage_type == StageType.SELF_TRAIN:
        stage["selftrain"] = SelfTrainStageConfig(
            rounds=args.rounds, samples_per_task=args.samples, max_new_tokens=args.max_new_tokens
        )
    if stage_type == StageType.GRPO:
        stage["grpo"] = GRPOStageConfig(
            **sft_values,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
        )
        stage["reward"] = RewardSpec(service_url=args.service_url, clip=args.clip)
    spec = TrainingRunSpec(
        base_model=args.model,
        tasks=args.tasks,
        stages=[TrainingStage(**stage)],
        held_out={"fraction": args.held_out, "evaluate": not args.no_held_out_eval},
    )
    name = args.name or f"{stage_type.value}-{slug(args.model.rstrip('/').rsplit('/', 1)[-1])}"
    return RunConfig(slug(name), spec, "flags")


def _policy_spec(text: str) -> PolicySpec:
    kind, _, rest = text.partition(":")
    try:
        policy_kind = PolicyKind(kind)
    except ValueError:
        raise UsageError(
            f"unknown policy {text!r}: use compile, replay:FILE, openai:MODEL@URL, hf:DIR or vllm:DIR"
        ) from None
    if policy_kind == PolicyKind.REPLAY:
        return PolicySpec(kind=policy_kind, path=rest)
    if policy_kind == PolicyKind.OPENAI:
        model, _, url = rest.partition("@")
        return PolicySpec(kind=policy_kind, model=model, base_url=url)
    return PolicySpec(kind=policy_kind, model=rest)


def single_command(args: argparse.Namespace) -> int:
    from kernelfleet.trainer._runner import run_stage

    _logging(args)
    config = single_config(args)
    with _open(config, args) as run:
        summary = run_stage(run, config.spec.stages[0].name)
        _print_summary(run, [summary])
    return 0


def _layout(config: RunConfig, args: argparse.Namespace) -> tuple[Any, TrainingLayout]:
    store = open_store(args.store or config.spec.store or None)
    return store, TrainingLayout(args.prefix or default_prefix(config))


def status_command(args: argparse.Namespace) -> int:
    config = load_run_config(args.config)
    store, layout = _layout(config, args)
    statuses: list[dict[str, Any]] = []
    for stage in config.spec.stages:
        found = latest_stage_status(store, layout, stage.name)
        statuses.append(found.model_dump(mode="json") if found else {"name": stage.name, "phase": "Pending"})
    if args.json:
        print(dumps(statuses, indent=2))
        return 0
    for status in statuses:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(status.get("metrics", {}).items())[:8])
        step = f"{status.get('step', 0)}/{status.get('max_steps', 0)}"
        checkpoint = status.get("checkpoint", "") or "-"
        print(f"{status['name']:<12} {status['phase']:<10} step {step}  {checkpoint}  {metrics}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    config = load_run_config(args.config)
    store, layout = _layout(config, args)
    report = latest_report(store, layout)
    if report is None:
        print(f"no held-out report yet in {store.url_for(layout.prefix)}", file=sys.stderr)
        return 1
    if args.json:
        print(dumps(report, indent=2))
    else:
        print(f"held-out tasks: {', '.join(report['held_out_tasks'])}")
        print(report["table"])
    return 0
