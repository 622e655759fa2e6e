"""`kernelfleet optimize`, `kernelfleet results` and `kernelfleet report`.

`optimize` is the command a user runs first: tasks in, faster verified code out. It derives
the run's id from what defines the run (the tasks, the policies, the device class), so running
the same command again resumes the run instead of starting over; `--run` names it explicitly.
Progress goes to stderr, the final table to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.job_options import BUDGET_OPTIONS, EVALUATION_OPTIONS, parse_duration
from kernelfleet.core.jsontext import dumps
from kernelfleet.core.models import Environment, Task
from kernelfleet.core.options import Flag, ModelOptions
from kernelfleet.core.run_location import add_location_flags, store_config
from kernelfleet.core.settings import LocalSettings, merged
from kernelfleet.core.store import CorruptObject, ObjectConflict, Store, open_store
from kernelfleet.search._layout import RUN_ID, RunLayout, RunManifest
from kernelfleet.search._locate import open_run
from kernelfleet.search._loop import LoopSettings, optimize
from kernelfleet.search._progress import LiveProgress, QuietProgress
from kernelfleet.search._report import (
    RunReport,
    format_best_code,
    format_table,
    list_runs,
    load_run,
    render_html,
)
from kernelfleet.search.policies._base import Policy, PolicyError
from kernelfleet.search.policies._replay import ReplayPolicy
from kernelfleet.search.policies._specs import SPEC_FORMS, PolicyOptions, make_policy

# The options of `optimize`, generated from the settings models: their defaults, bounds and
# help are the fields'. Budget and evaluation flags are shared with `kernelfleet submit`.
_seconds = parse_duration
DEVICE_OPTIONS = ModelOptions(LocalSettings)
SEARCH_OPTIONS = ModelOptions(
    LoopSettings,
    Flag("verify_best", "--no-verify", help="skip re-verifying the best variant"),
    Flag("measure_baselines", "--no-baselines", help="skip measuring eager and torch.compile"),
    Flag("lease_wait_seconds", "--lease-wait", parse=_seconds, metavar="DURATION"),
    only=[
        "exemplars",
        "bucket_temperature",
        "seed",
        "verify_best",
        "measure_baselines",
        "lease_wait_seconds",
    ],
    title="search",
)
POLICY_OPTIONS = ModelOptions(
    PolicyOptions,
    Flag("timeout_s", "--request-timeout", metavar="SECONDS"),
    skip=["batch_size", "device"],
    title="language-model policies (openai, hf, vllm)",
)


def _add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="artifact store: a directory, file:///..., or s3://bucket/prefix (default: $KERNELFLEET_STORE "
        "or .kernelfleet)",
    )


def register_optimize(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "optimize",
        help="make PyTorch workloads faster, verifiably: propose, evaluate, keep the best",
        description="Run the contrastive optimisation loop over TASKS and print the best verified variant "
        "per task. Running the same command again resumes the run from the store.",
    )
    parser.add_argument(
        "tasks",
        nargs="+",
        metavar="TASKS",
        help="task files (.py), directories of them, or KernelBench selections like kernelbench-v0:1:12",
    )
    parser.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="repeatable; one of: " + "; ".join(SPEC_FORMS) + " (default: compile)",
    )
    BUDGET_OPTIONS.add_to(parser)
    _add_store(parser)
    parser.add_argument(
        "--run", default=None, help="run id (default: derived from tasks, policies and device)"
    )
    evaluation = parser.add_argument_group("evaluation")
    DEVICE_OPTIONS.add_to(evaluation)
    EVALUATION_OPTIONS.add_to(evaluation)
    SEARCH_OPTIONS.add_to(parser)
    POLICY_OPTIONS.add_to(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the task summaries as JSON")
    output.add_argument("--quiet", action="store_true", help="no live progress on stderr")
    parser.set_defaults(handler=run_optimize)


def register_results(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "results",
        help="the results table of a run, and its best code",
        description="Print the per-task table of RUN: an id from `kernelfleet optimize`, a store prefix such "
        "as optimizationjobs/NS/NAME/UID, or a cluster resource (optimizationjob/NAME, or just NAME), whose "
        "status says where its results are. Without RUN, list the runs in the store.",
    )
    parser.add_argument("run", nargs="?", metavar="RUN")
    _add_store(parser)
    add_location_flags(parser)
    parser.add_argument("--code", action="store_true", help="also print the best code of every task")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run_results)


def register_report(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "report",
        help="a self-contained HTML report of a run, with plots",
        description="Write an HTML report of RUN: table, speedup distribution, per-task bars against the "
        "baselines, and the best code per task. One file, no external resources.",
    )
    parser.add_argument("run", metavar="RUN", help="a run id, a store prefix or a cluster resource (NAME)")
    _add_store(parser)
    add_location_flags(parser)
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="where to write it (default: kernelfleet-report-RUN.html)",
    )
    parser.set_defaults(handler=run_report)


# ---------------------------------------------------------------------- optimize


def _default_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_tasks(selections: list[str]) -> list[Task]:
    from kernelfleet.evaluator import load_tasks

    tasks: dict[str, Task] = {}
    for selection in selections:
        for task in load_tasks(selection):
            tasks.setdefault(task.hash, task)
    if not tasks:
        raise UsageError(
            f"no tasks found in {' '.join(selections)}; give .py files defining Model, get_inputs and "
            "get_init_inputs, directories of them, or a selection like kernelbench-v0:1:1-5"
        )
    return list(tasks.values())


def _check_replay_rows(policies: Sequence[Policy], tasks: Sequence[Task]) -> None:
    """Replay rows must name tasks of the run: a typo would otherwise end in "0 variants",
    with nothing said."""
    for policy in policies:
        if not isinstance(policy, ReplayPolicy):
            continue
        stray = sorted({row.task for row in policy.rows if not any(row.matches(task) for task in tasks)})
        if not stray:
            continue
        names = ", ".join(task.name for task in tasks[:10]) + (", ..." if len(tasks) > 10 else "")
        if len(stray) == len({row.task for row in policy.rows}):
            raise UsageError(
                f"no row of the replay file names a task of this run: the rows name {', '.join(stray[:10])}; "
                f"the tasks are {names}. Check the task names in the file"
            )
        _warn(f"replay rows for {', '.join(stray[:10])} name no task of this run (the tasks are {names})")


def evaluator_environment(evaluator: Any) -> Environment:
    """The environment the evaluator measures in: its GPU class and version key the results."""
    environment = getattr(evaluator, "environment", None)
    if callable(environment):
        environment = environment()
    if not isinstance(environment, Environment):
        raise RuntimeError("the evaluator does not report its environment (Evaluator.environment)")
    return environment


def derive_run_id(tasks: Sequence[Task], policies: Sequence[Policy], gpu_class: str) -> str:
    text = "\n".join(
        [*sorted(task.hash for task in tasks), *sorted(policy.id for policy in policies), gpu_class]
    )
    return f"run-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def write_manifest(store: Store, layout: RunLayout, manifest: RunManifest) -> None:
    try:
        store.put_json(layout.manifest, manifest)
    except ObjectConflict:
        try:
            store.read_model(layout.manifest, RunManifest)
        except CorruptObject as error:
            # The run's other objects are intact and keyed by content: carry on without it.
            _warn(f"{error}; carrying on without it")
            return
        raise UsageError(
            f"run {manifest.run_id} already exists in {store.url} with other tasks, policies or device; "
            "choose another --run, or leave --run out to get an id derived from the inputs"
        ) from None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _warn_skipped(report: RunReport, store_flag: str = "") -> None:
    for message in report.skipped:
        _warn(f"left out: {message}")
    for outcome in report.outcomes:
        if outcome.damage:
            _warn(
                f"task {outcome.task.name} on {outcome.gpu_class}: {outcome.damage}, so no result is shown "
                f"for it. Run the `kernelfleet optimize` command that made run {report.name} again (for a "
                "cluster job: submit it again): it measures what is damaged again and restores lost code. "
                f"`kernelfleet store verify{store_flag} {report.prefix}` lists every problem"
            )


def run_optimize(args: argparse.Namespace) -> int:
    started_at = time.monotonic()  # --wall-time counts the whole command, set-up included
    if args.run is not None and not RUN_ID.match(args.run):
        raise UsageError(f"--run {args.run!r}: use letters, digits, '.', '_' and '-' (up to 100)")
    options = POLICY_OPTIONS.build(args)
    budget = BUDGET_OPTIONS.build(args)
    settings = SEARCH_OPTIONS.build(args)
    evaluation = EVALUATION_OPTIONS.build(args)
    local = DEVICE_OPTIONS.build(args)
    specs = args.policies or ["compile"]
    policies: list[Policy] = []
    try:
        for spec in specs:
            policies.append(make_policy(spec, options))
        tasks = _load_tasks(args.tasks)
        _check_replay_rows(policies, tasks)
        store = open_store(args.store)

        from kernelfleet.evaluator import BASELINE_MODES, EvalConfig, Evaluator

        device = local.device or _default_device()
        # The table compares with eager and torch.compile; on a CPU the other modes
        # (reduce-overhead, CUDA graphs) add compile time and nothing to compare.
        modes = BASELINE_MODES if device != "cpu" else ("eager", "compile")
        config = EvalConfig.model_validate(
            merged(evaluation.model_dump(), {"device": device, "timing": {"baseline_modes": modes}})
        )
        progress = QuietProgress() if args.quiet else LiveProgress()
        with Evaluator(config) as evaluator:
            environment = evaluator_environment(evaluator)
            run_id = args.run or derive_run_id(tasks, policies, environment.gpu_class)
            layout = RunLayout(f"runs/{run_id}")
            write_manifest(
                store,
                layout,
                RunManifest(
                    run_id=run_id,
                    tasks=tuple(task.hash for task in tasks),
                    task_names=tuple(task.name for task in tasks),
                    policies=tuple(policy.name for policy in policies),
                    policy_ids=tuple(policy.id for policy in policies),
                    gpu_class=environment.gpu_class,
                ),
            )
            print(
                f"run {run_id}: {len(tasks)} task(s) on {environment.device} ({environment.gpu_class}), "
                f"policies {', '.join(policy.name for policy in policies)}; store {store.url}. "
                "Run the same command again to resume.",
                file=sys.stderr,
            )
            summaries = optimize(
                tasks,
                policies,
                store=store,
                prefix=layout.prefix,
                evaluator=evaluator,
                environment=environment,
                budget=budget,
                settings=settings,
                progress=progress,
                started_at=started_at,
            )
    except PolicyError as error:
        raise UsageError(str(error)) from None
    finally:
        for policy in policies:
            policy.close()
    if args.json:
        print(dumps([summary.model_dump(mode="json") for summary in summaries], indent=2))
        return 0
    report = load_run(store, layout.prefix, with_code=False)
    _warn_skipped(report)
    wanted = {task.hash for task in tasks}
    outcomes = [o for o in report.outcomes if o.task.hash in wanted and o.gpu_class == environment.gpu_class]
    print(format_table(outcomes))
    store_flag = f" --store {args.store}" if args.store else ""
    print(
        f"\nbest code: kernelfleet results {run_id}{store_flag} --code   "
        f"report: kernelfleet report {run_id}{store_flag}",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------- results and report


def run_results(args: argparse.Namespace) -> int:
    if args.run is None:
        store = open_store(args.store, store_config(args))
        runs = list_runs(store)
        if args.json:
            print(dumps(runs))
        elif runs:
            print("\n".join(runs))
        else:
            print(f"no runs in {store.url}; start one with `kernelfleet optimize TASKS`", file=sys.stderr)
        return 0
    store, prefix = open_run(args)
    report = load_run(store, prefix, with_code=args.code or args.json)
    _warn_skipped(report, f" {store.url}")
    if args.json:
        rows = []
        for outcome in report.outcomes:
            rows.append(
                {
                    "task": outcome.task.name,
                    "task_hash": outcome.task.hash,
                    "gpu_class": outcome.gpu_class,
                    "status": outcome.status,
                    "best_speedup": outcome.best_speedup,
                    "speedup_vs_compile": outcome.speedup_vs_compile,
                    "policy": outcome.best_policy or None,
                    "variant_hash": outcome.best_variant_hash,
                    "verdicts": dict(outcome.verdicts),
                    "damage": outcome.damage or None,
                    "summary": outcome.summary.model_dump(mode="json") if outcome.summary else None,
                    "code": outcome.best_code,
                }
            )
        print(dumps({"run": report.name, "stats": report.stats().as_dict(), "tasks": rows}, indent=2))
        return 0
    print(format_table(report.outcomes))
    if args.code:
        print()
        print(format_best_code(report.outcomes))
    return 0


def run_report(args: argparse.Namespace) -> int:
    store, prefix = open_run(args)
    report = load_run(store, prefix)
    _warn_skipped(report, f" {store.url}")
    slug = "".join(char if char.isalnum() or char in "._-" else "-" for char in report.name)
    output = Path(args.output or f"kernelfleet-report-{slug}.html")
    try:
        output.write_text(render_html(report), encoding="utf-8")
    except OSError as error:
        raise UsageError(
            f"cannot write the report to {output}: {error.strerror}; choose another --output"
        ) from None
    print(f"wrote {output} ({len(report.outcomes)} task(s))")
    return 0
