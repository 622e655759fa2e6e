"""`kernelfleet worker`: what each pod of an OptimizationJob's Indexed Jobs runs.

The operator writes the job's plan to the store (kernelfleet.core.jobplan) and creates one
Indexed Job per GPU class (and shard); each pod reads the plan, takes the tasks of its
completion index (`JOB_COMPLETION_INDEX`) and runs the contrastive loop on each with the job's
policies, budget and evaluation profile, on the pod's GPUs. Everything goes to the store as it
is made: samples, variants and results by the loop itself, then per task its log lines and a
small outcome record, written last, that the operator folds into the resource's status.

Resuming is free: a task with an outcome is skipped, and the loop replays what a killed pod had
already stored, so a restarted pod evaluates nothing twice.

With `--role verify` the pod re-verifies and re-times, on its own GPU class, the best variant
that the search found for each task (`spec.verifyOn`).

Exit statuses (the Jobs' podFailurePolicy reads them): 0 when every task of the slice ended
(found a faster variant or not, or failed for a reason of its own); EXIT_DETERMINISTIC (3) when
retrying cannot help (no plan, a plan without this slice, a task whose code does not match the
plan); anything else (a store outage, a crashed GPU) is retried by Kubernetes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kernelfleet.core.errors import KernelfleetError, StoreError, UsageError
from kernelfleet.core.jobplan import (
    EXIT_DETERMINISTIC,
    JobPlan,
    Role,
    TaskChunk,
    TaskOutcome,
    chunk_key,
    outcome_dir,
    outcome_key,
    plan_key,
    task_log_key,
)
from kernelfleet.core.models import EvaluationResult, Task, TaskSummary, Verdict
from kernelfleet.core.resources import PolicyKind, PolicySpec
from kernelfleet.core.settings import merged
from kernelfleet.core.store import NotFound, ObjectConflict, Store, StoreUnavailable, open_store
from kernelfleet.search._layout import RunLayout, task_object
from kernelfleet.search._loop import optimize
from kernelfleet.search.policies._base import Policy
from kernelfleet.search.policies._specs import PolicyOptions, make_policy

log = logging.getLogger("kernelfleet.worker")
# The worker's lines are what `kernelfleet logs` shows: kept whatever the root logger's level.
log.setLevel(logging.INFO)


class DeterministicError(KernelfleetError):
    """Retrying the pod would fail the same way: the index fails at once (exit code 3)."""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "worker",
        help="run one worker pod's slice of an OptimizationJob (the operator starts these)",
        description="Read an OptimizationJob's plan from the store, take the tasks of this pod's "
        "completion index and optimise them, writing everything to the store.",
    )
    parser.add_argument("--store", required=True, metavar="URL", help="the job's store")
    parser.add_argument("--prefix", required=True, help="the job's prefix in the store")
    parser.add_argument("--gpu-class", required=True, help="the pool class this pod runs on")
    parser.add_argument("--shard", type=int, default=0, help="the Indexed Job's shard number")
    parser.add_argument(
        "--index",
        type=int,
        default=None,
        help="completion index (default: $JOB_COMPLETION_INDEX, which Kubernetes sets)",
    )
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.SEARCH.value)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.set_defaults(handler=run_worker)


def _completion_index(value: int | None) -> int:
    if value is not None:
        return value
    text = os.environ.get("JOB_COMPLETION_INDEX", "")
    if not text.isdigit():
        raise DeterministicError(
            "no completion index: JOB_COMPLETION_INDEX is not set (the pod is not part of an Indexed "
            "Job); pass --index N to run a slice by hand"
        )
    return int(text)


def run_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        index = _completion_index(args.index)
        store = open_store(args.store)
        plan = load_plan(store, args.prefix)
        try:
            positions = plan.shard(args.role, args.gpu_class, args.shard).positions(index)
        except (KeyError, ValueError) as error:
            raise DeterministicError(f"{error}: the pod does not belong to this plan") from None
        planned = load_slice(store, plan, positions)
        worker = Worker(store, plan, args.gpu_class, Role(args.role), device=args.device)
        log.info(
            "%s %s/%s shard %d index %d: %d task(s) on %s",
            args.role,
            plan.namespace,
            plan.name,
            args.shard,
            index,
            len(planned),
            args.gpu_class,
        )
        worker.run(planned)
    except (DeterministicError, UsageError) as error:
        print(f"kernelfleet worker: {error}", file=sys.stderr)
        return EXIT_DETERMINISTIC
    return 0


def load_plan(store: Store, prefix: str) -> JobPlan:
    try:
        raw = store.get_json(plan_key(prefix))
    except NotFound:
        raise DeterministicError(
            f"no plan at {store.url_for(plan_key(prefix))}: the operator writes it before it creates "
            "the Jobs, so the prefix or the store is wrong"
        ) from None
    try:
        return JobPlan.model_validate(raw)
    except ValueError as error:
        raise DeterministicError(
            f"the plan at {store.url_for(plan_key(prefix))} is not valid: {error}"
        ) from None


def load_slice(store: Store, plan: JobPlan, positions: range) -> list[Task]:
    """The tasks at `positions` of the plan, from the chunks that hold them."""
    found: dict[int, Task] = {}
    for number in plan.chunks_for(positions):
        key = chunk_key(plan.prefix, number)
        try:
            chunk = TaskChunk.model_validate(store.get_json(key))
        except NotFound:
            raise DeterministicError(f"the plan's task chunk {store.url_for(key)} is missing") from None
        for offset, planned in enumerate(chunk.tasks):
            found[chunk.start + offset] = planned.task()
    missing = [p for p in positions if p not in found]
    if missing:
        raise DeterministicError(f"the plan's chunks lack task positions {missing[:10]}")
    return [found[p] for p in positions]


def policy_spec_text(spec: PolicySpec, scratch: Path, store: Store) -> str:
    """A policy of the job's spec in the command line's form (see policies/_specs.py)."""
    if spec.kind == PolicyKind.COMPILE:
        return "compile"
    if spec.kind == PolicyKind.REPLAY:
        path = spec.path
        if path.startswith("s3://") or path.startswith("file:"):
            location, _, key = path.rpartition("/")
            local = scratch / "replay" / key
            open_store(location).get_file(key, local)
            path = str(local)
        return f"replay:{path}"
    if spec.kind == PolicyKind.OPENAI:
        return f"openai:{spec.model}@{spec.base_url}"
    return f"{spec.kind.value}:{spec.model}"


class _TaskLog(logging.Handler):
    """Collects the log lines of one task, to be written to the store next to its results."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class _Progress:
    """The loop's progress as log lines (which the task log collects)."""

    def round_started(self, round_: int, rounds: int, tasks: int) -> None:
        log.info("round %d/%d", round_ + 1, rounds)

    def evaluations_planned(self, count: int) -> None:
        log.info("%d evaluation(s) planned", count)

    def result(self, task: Task, result: EvaluationResult, best: float | None) -> None:
        speed = f" speedup {result.speedup:.3f}" if result.speedup is not None else ""
        log.info("%s: %s %s%s", task.name, result.variant_hash[:12], result.verdict, speed)

    def message(self, text: str) -> None:
        log.info("%s", text)

    def task_finished(self, summary: TaskSummary, resumed: bool) -> None:
        log.info(
            "%s: done (%s), best %s%s",
            summary.task_name,
            summary.stop_reason,
            summary.best_speedup,
            " (resumed)" if resumed else "",
        )

    def close(self) -> None:
        return None


class Worker:
    """Runs the tasks of one slice; see the module docstring."""

    def __init__(
        self,
        store: Store,
        plan: JobPlan,
        gpu_class: str,
        role: Role,
        device: str | None = None,
        *,
        evaluator: object | None = None,
        policies: Sequence[Policy] | None = None,
    ) -> None:
        """`evaluator` and `policies` replace the ones the plan describes (tests pass scripted ones)."""
        self.store = store
        self.plan = plan
        self.gpu_class = gpu_class
        self.role = role
        self.device = device
        self._given_evaluator = evaluator
        self._given_policies = list(policies) if policies is not None else None

    def run(self, planned: Sequence[Task]) -> None:
        tasks = [
            task
            for task in planned
            if not self.store.exists(outcome_key(self.plan.prefix, self.role, self.gpu_class, task.hash))
        ]
        if len(tasks) < len(planned):
            log.info("%d task(s) already done; resuming with %d", len(planned) - len(tasks), len(tasks))
        if not tasks:
            return
        with (
            tempfile.TemporaryDirectory(prefix="kernelfleet-worker-") as scratch,
            self._evaluator() as evaluator,
        ):
            policies = self._policies(Path(scratch)) if self.role == Role.SEARCH else []
            try:
                for task in tasks:
                    with self._task_log(task):
                        started = time.monotonic()
                        outcome = (
                            self._search(task, evaluator, policies)
                            if self.role == Role.SEARCH
                            else self._verify(task, evaluator)
                        )
                        log.info("%s: finished in %.1f s", task.name, time.monotonic() - started)
                    self._put_outcome(outcome)
            finally:
                for policy in policies:
                    policy.close()

    # ------------------------------------------------------------------ pieces

    @contextlib.contextmanager
    def _evaluator(self) -> Iterator[object]:
        if self._given_evaluator is not None:
            yield self._given_evaluator
            return
        from kernelfleet.evaluator import BASELINE_MODES, EvalConfig, Evaluator

        device = self.device or _default_device()
        modes = BASELINE_MODES if device != "cpu" else ("eager", "compile")
        config = EvalConfig.model_validate(
            merged(
                self.plan.spec.evaluation.model_dump(),
                {"device": device, "timing": {"baseline_modes": modes}},
            )
        )
        with Evaluator(config) as evaluator:
            yield evaluator

    def _policies(self, scratch: Path) -> list[Policy]:
        if self._given_policies is not None:
            return self._given_policies
        policies = []
        for spec in self.plan.spec.policies:
            options = PolicyOptions(temperature=spec.temperature, concurrency=spec.concurrency)
            policies.append(make_policy(policy_spec_text(spec, scratch, self.store), options))
        return policies

    @contextlib.contextmanager
    def _task_log(self, task: Task) -> Iterator[None]:
        handler = _TaskLog()
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)
            self._put_log(task, handler.lines)

    def _put_log(self, task: Task, lines: list[str]) -> None:
        data = ("\n".join(lines) + "\n").encode("utf-8")
        for attempt in range(100):
            key = task_log_key(self.plan.prefix, self.role, self.gpu_class, task.hash, attempt)
            try:
                self.store.put_bytes(key, data)
                return
            except ObjectConflict:
                continue  # an earlier pod's log of this task: keep it, write the next attempt

    def _put_outcome(self, outcome: TaskOutcome) -> None:
        key = outcome_key(self.plan.prefix, self.role, self.gpu_class, outcome.task_hash)
        with contextlib.suppress(ObjectConflict):  # another pod of a racing retry wrote it first
            self.store.put_json(key, outcome)

    def _search(self, task: Task, evaluator: object, policies: list[Policy]) -> TaskOutcome:
        from kernelfleet.search.cli import evaluator_environment

        try:
            (summary,) = optimize(
                [task],
                policies,
                store=self.store,
                prefix=self.plan.prefix,
                evaluator=evaluator,  # type: ignore[arg-type]
                environment=evaluator_environment(evaluator),
                budget=self.plan.spec.budget,
                progress=_Progress(),
                # Pods of one job work on one run, each on tasks of its own: a task's lease keeps
                # a replacement pod off a task that a pod being killed still works on.
                lease_scope=f"leases/{task.hash[:16]}",
            )
        except (StoreUnavailable, StoreError):
            raise  # the pod fails and is retried; the loop resumes from the store
        except (UsageError, ValueError) as error:
            log.error("%s: the search failed: %s", task.name, error)
            return TaskOutcome(
                task_hash=task.hash, task_name=task.name, gpu_class=self.gpu_class, ok=False, error=str(error)
            )
        return TaskOutcome(
            task_hash=task.hash,
            task_name=task.name,
            gpu_class=self.gpu_class,
            ok=summary.stop_reason != "task-error",
            error="the task's own reference failed" if summary.stop_reason == "task-error" else "",
            stop_reason=summary.stop_reason,
            variants=summary.variants,
            best_speedup=summary.best_speedup,
            verified=summary.verified,
            variant_hash=summary.best_variant_hash,
        )

    def _best_found(self, task: Task) -> TaskOutcome | None:
        """The search's best variant of `task` over every class that searched it."""
        found = []
        for gpu_class in self.plan.spec.gpu_classes:
            key = outcome_key(self.plan.prefix, Role.SEARCH, gpu_class, task.hash)
            with contextlib.suppress(NotFound):
                outcome = TaskOutcome.model_validate(self.store.get_json(key))
                if outcome.variant_hash and outcome.best_speedup is not None:
                    found.append(outcome)
        return max(found, key=lambda o: o.best_speedup or 0.0) if found else None

    def _verify(self, task: Task, evaluator: object) -> TaskOutcome:
        from kernelfleet.search.cli import evaluator_environment

        best = self._best_found(task)
        if best is None or best.variant_hash is None:
            log.info("%s: the search found no correct variant to verify", task.name)
            return TaskOutcome(
                task_hash=task.hash,
                task_name=task.name,
                gpu_class=self.gpu_class,
                role=Role.VERIFY,
                ok=True,
                stop_reason="nothing-to-verify",
            )
        environment = evaluator_environment(evaluator)
        layout = RunLayout(self.plan.prefix)
        key = layout.verification(
            task.hash, environment.gpu_class, environment.evaluator_version, best.variant_hash
        )
        try:
            result = EvaluationResult.model_validate(self.store.get_json(key))
        except NotFound:
            code = self.store.get_variant(best.variant_hash)
            result = evaluator.evaluate(task, code)  # type: ignore[attr-defined]
            self.store.put_json(key, result)
        self.store.put_json(layout.task(task.hash), task_object(task))
        correct = result.verdict == Verdict.CORRECT
        summary = TaskSummary(
            task_name=task.name,
            task_hash=task.hash,
            gpu_class=environment.gpu_class,
            evaluator_version=environment.evaluator_version,
            stop_reason="verify",
            variants=1,
            verdicts={str(result.verdict): 1},
            best_variant_hash=best.variant_hash if correct else None,
            best_speedup=result.speedup if correct else None,
            verified=correct,
            gpu_seconds=round(result.seconds, 3),
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
        )
        summary_key = layout.summary(task.hash, environment.gpu_class, f"verify-{best.variant_hash[:12]}", 1)
        with contextlib.suppress(ObjectConflict):
            self.store.put_json(summary_key, summary)
        log.info(
            "%s: %s from %s re-timed here: %s, speedup %s (was %s)",
            task.name,
            best.variant_hash[:12],
            best.gpu_class,
            result.verdict,
            result.speedup,
            best.best_speedup,
        )
        return TaskOutcome(
            task_hash=task.hash,
            task_name=task.name,
            gpu_class=self.gpu_class,
            role=Role.VERIFY,
            ok=True,
            stop_reason="verify",
            variants=1,
            best_speedup=result.speedup if correct else None,
            verified=correct,
            source_class=best.gpu_class,
            source_speedup=best.best_speedup,
            variant_hash=best.variant_hash,
        )


def _default_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def outcomes(store: Store, prefix: str, role: Role, gpu_class: str) -> list[TaskOutcome]:
    """Every outcome of one class and role (for tests and `kernelfleet logs`)."""
    return [
        TaskOutcome.model_validate(store.get_json(key))
        for key in store.list(outcome_dir(prefix, role, gpu_class))
        if key.endswith(".json")
    ]
