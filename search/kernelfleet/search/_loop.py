"""The contrastive optimisation loop: propose, evaluate, remember, show the policy what worked.

One round, for every task still active:
1. each policy is asked for `samples_per_round` variants; a language-model policy sees the task
   and up to K earlier variants with their measured speedups, drawn from distinct speedup
   buckets (see `_database`);
2. every answer is stored as a sample, usable or not; unusable ones cost no GPU time;
3. new code, deduplicated by hash, is evaluated in batches; every result goes to the store as
   it arrives, and into the task's variant database;
4. a task stops when it reaches the target speedup or its policies have nothing more to offer.
When the search ends, the best variant is re-verified in a fresh evaluation, the baselines
(eager, torch.compile) are measured, and a summary is written last.

Rounds are processed task-parallel ("round-major") rather than task after task, so that an
endpoint receives all of a round's prompts at once and the evaluator can spread a batch over
every local GPU.

Resuming is replay: a sample already in the store is used instead of asking the policy again,
a result already in the store is used instead of evaluating again, and a summary already in
the store means the task is done. A run killed at any point therefore loses at most the
answers and evaluations that were in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelfleet.core.errors import EvaluationCancelled, UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import (
    BUDGET_STOPS,
    Environment,
    EvaluationResult,
    ResultKey,
    Task,
    TaskSummary,
    Timing,
    Verdict,
)
from kernelfleet.core.settings import Budget
from kernelfleet.core.store import (
    CorruptObject,
    NotFound,
    ObjectConflict,
    ResultConflict,
    RunLease,
    Store,
    encode_json,
)
from kernelfleet.search._database import Entry, VariantDatabase
from kernelfleet.search._layout import (
    ANSWER_LIMIT,
    RunLayout,
    SampleRecord,
    read_model,
    summary_damage,
    task_object,
)
from kernelfleet.search._progress import Progress, QuietProgress
from kernelfleet.search._prompts import Exemplar
from kernelfleet.search.policies._base import Policy, Proposal, Request
from kernelfleet.search.policies._compile import COMPILE_DEFAULT

log = logging.getLogger(__name__)


class EvaluatorLike(Protocol):
    """What the loop needs of `kernelfleet.evaluator.Evaluator`."""

    def evaluate(self, task: Task, code: str) -> EvaluationResult: ...

    def evaluate_batch(
        self,
        items: list[tuple[Task, str]],
        cache: Any = None,
        progress: bool = False,
        stop: Callable[[float], bool] | None = None,
        slow: Callable[[Task, str, float, str], None] | None = None,
    ) -> list[EvaluationResult]: ...

    def baselines(self, task: Task, cancel: threading.Event | None = None) -> dict[str, Timing]: ...


class LoopSettings(BaseModel):
    """How the loop searches, as opposed to how long (`Budget`). The command line's search
    options are generated from these fields (`kernelfleet.core.options`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exemplars: int = Field(
        default=2, ge=0, le=8, description="Earlier variants shown in each prompt (K), per request."
    )
    bucket_temperature: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Softmax temperature of the exemplar buckets (lower favours the fastest).",
    )
    bucket_width: float = Field(
        default=0.1,
        gt=0,
        allow_inf_nan=False,
        description="Relative width of a speedup bucket (0.1: variants within 10% share one).",
    )
    verify_attempts: int = Field(
        default=3, ge=1, description="Best variants tried, in turn, until one verifies again."
    )
    verify_best: bool = Field(
        default=True, description="Re-verify the best variant in a fresh evaluation before reporting it."
    )
    measure_baselines: bool = Field(default=True, description="Measure eager and torch.compile per task.")
    seed: int = Field(default=0, description="Seeds the exemplar choice and the policies' sampling.")
    lease_wait_seconds: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="When another process works on the run (it holds the run's lease), wait this long "
        "for it before giving up; two processes on one run would measure each other.",
    )
    lease_ttl_seconds: float = Field(
        default=120.0,
        gt=0,
        allow_inf_nan=False,
        description="How long the run's lease outlives its last renewal (a killed process's lease "
        "expires after this).",
    )


@dataclass
class _TaskState:
    task: Task
    db: VariantDatabase
    exhausted: set[str] = field(default_factory=set)
    proposed: set[str] = field(default_factory=set)
    samples: int = 0
    rounds_run: int = 0
    best_seen: float | None = None
    task_error: str = ""
    summary: TaskSummary | None = None
    not_evaluated: int = 0
    damaged_summaries: list[str] = field(default_factory=list)  # keys of summaries that did not read

    def seen(self) -> frozenset[str]:
        return frozenset(self.proposed) | frozenset(entry.variant_hash for entry in self.db)

    def note(self, record: SampleRecord) -> None:
        self.samples += 1
        if record.key:
            self.proposed.add(record.key)
        if record.variant_hash:
            self.proposed.add(record.variant_hash)


class _Baselines(BaseModel):
    """The stored baselines of a task (the check that a stored copy is intact)."""

    baselines: dict[str, Timing]


class _ResultSink:
    """The evaluator's result cache, backed by the store: each result is kept as it arrives."""

    def __init__(self, loop: OptimizationLoop) -> None:
        self._loop = loop

    def get(self, key: ResultKey) -> EvaluationResult | None:
        return self._loop._known.get(key)

    def put(self, result: EvaluationResult) -> None:
        self._loop._record_result(result)


# The evaluator's reason code for a task whose own reference fails: the task is at fault, not
# the variant, so such a result is neither stored nor counted, and the task stops.
REFERENCE_ERROR = "reference-error"

COMPILE_POLICY = "compile"


def _seed(*parts: object) -> int:
    return int(hashlib.sha256(":".join(str(part) for part in parts).encode()).hexdigest()[:12], 16)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class OptimizationLoop:
    """Runs the loop for a set of tasks on one device; see the module docstring.

    `prefix` is the run's root in the store: `runs/<id>` locally, the job's uid prefix on a
    cluster. `environment` is the evaluator's: its GPU class and version key the results.
    """

    def __init__(
        self,
        *,
        store: Store,
        prefix: str,
        evaluator: EvaluatorLike,
        environment: Environment,
        policies: Sequence[Policy],
        budget: Budget | None = None,
        settings: LoopSettings | None = None,
        progress: Progress | None = None,
        lease_scope: str = "",
        started_at: float | None = None,
    ) -> None:
        if not policies:
            raise UsageError("the loop needs at least one policy")
        ids = [policy.id for policy in policies]
        if len(set(ids)) != len(ids):
            raise UsageError(f"the same policy is given twice ({', '.join(ids)}); give each once")
        self.store = store
        self.layout = RunLayout(prefix)
        self.evaluator = evaluator
        self.environment = environment
        self.gpu_class = environment.gpu_class
        self.evaluator_version = environment.evaluator_version
        self.policies = list(policies)
        self.budget = budget or Budget()
        self.settings = settings or LoopSettings()
        self.progress: Progress = progress or QuietProgress()
        self._known: dict[ResultKey, EvaluationResult] = {}
        self._damaged_tasks: set[str] = set()  # tasks (16 characters of the hash) with a damaged result
        self._states: dict[str, _TaskState] = {}
        self._codes: dict[str, str] = {}
        self._gpu_used = 0.0
        # When the wall-time clock started (time.monotonic()); None: when `run` is called. The
        # command line passes its own start, so that loading tasks and starting the evaluator
        # count against --wall-time too.
        self.started_at = started_at
        self._started = 0.0
        self._stop: str | None = None
        self._lease: RunLease | None = None
        # The lease guards the run as a whole unless the caller owns only a part of it: the
        # worker pods of one job share the job's run, each with tasks of its own.
        self.lease_prefix = (
            f"{self.layout.prefix}/{lease_scope.strip('/')}" if lease_scope else self.layout.prefix
        )

    # ------------------------------------------------------------------ the run

    def run(self, tasks: Iterable[Task]) -> list[TaskSummary]:
        """Optimise `tasks` until the budget ends; one summary per task, in the given order.

        Each call starts from the store alone, so calling it once per task gives every task the
        whole budget. The run's lease is held throughout: a second process on the same run
        waits for it (`LoopSettings.lease_wait_seconds`) or stops with `LeaseHeld`.
        """
        lease = RunLease(
            self.store,
            self.lease_prefix,
            ttl_s=self.settings.lease_ttl_seconds,
            wait_s=self.settings.lease_wait_seconds,
        )
        with lease:
            self._lease = lease
            try:
                return self._run(tasks)
            finally:
                self._lease = None

    def _run(self, tasks: Iterable[Task]) -> list[TaskSummary]:
        self._started = self.started_at if self.started_at is not None else time.monotonic()
        self._stop = None
        self._states = {}
        self._known = {}
        self._damaged_tasks = set()
        self._gpu_used = 0.0
        ordered: list[Task] = []
        for task in tasks:
            if task.hash not in self._states:
                self._states[task.hash] = _TaskState(
                    task, VariantDatabase(task.hash, self.gpu_class, self.settings.bucket_width)
                )
                ordered.append(task)
                # A damaged copy of this task's object is replaced: the task itself is in hand.
                self._put_repairing(self.layout.task(task.hash), task_object(task), Task)
        self._load_results()
        unsettled = self._provisional_tasks()
        for state in self._states.values():
            summary = self._stored_summary(state)
            # A search cut short by a budget continues when the call is repeated, as long as the
            # budget allows more (wall time counts this call only; GPU-seconds count the stored
            # results, and a cancelled evaluation stored none); so does one that left results to
            # measure again (provisional: a timing that did not settle). Every other ending is
            # final for this budget.
            if summary is not None and not self._continues(summary) and state.task.hash[:16] not in unsettled:
                damage = self._damage(state, summary)
                if damage:
                    # Never reported as a result: the search runs again over what is stored,
                    # which measures the damaged results again and restores lost code.
                    self.progress.message(f"{state.task.name}: {damage}; searching it again to repair it")
                    continue
                state.summary = summary
                self.progress.task_finished(summary, resumed=True)
        try:
            for round_ in range(self.budget.rounds):
                active = [state for state in self._states.values() if state.summary is None]
                if not active:
                    break
                self._stop = self._stop or self._budget_stop()
                if self._stop:
                    break
                self.progress.round_started(round_, self.budget.rounds, len(active))
                self._round(round_, active)
                for state in active:
                    state.rounds_run = round_ + 1
                    best = state.db.best()
                    target = self.budget.target_speedup
                    if state.task_error:
                        self._finish(state, "task-error")
                    elif target is not None and best is not None and (best.speedup or 0.0) >= target:
                        self._finish(state, "target")
                    elif self._stop:
                        # A spent budget ends the task with its own reason, even when the policies
                        # have nothing more to offer: what they offered may not be evaluated yet,
                        # and only a budget stop lets a repeated command continue.
                        continue
                    elif len(state.exhausted) == len(self.policies):
                        self._finish(state, "exhausted")
                if self._stop:
                    break
            for state in self._states.values():
                if state.summary is None:
                    self._finish(state, self._stop or "rounds")
        finally:
            self.progress.close()
        return [summary for task in ordered if (summary := self._states[task.hash].summary) is not None]

    def _damage(self, state: _TaskState, summary: TaskSummary) -> str:
        """What of a stored summary's word the store no longer backs ("" when all is intact)."""
        results = {
            key.variant_hash: result
            for key, result in self._known.items()
            if key.task_hash == state.task.hash
        }
        damaged = state.task.hash[:16] in self._damaged_tasks
        return summary_damage(self.store, self.layout, summary, results, damaged, self._corrupt)

    def _put_repairing(self, key: str, obj: BaseModel | dict[str, Any], model: type[BaseModel]) -> None:
        """Store `obj` at `key`; a damaged object in the way (it does not read as `model`) is
        replaced, an intact one stands."""
        try:
            self.store.put_json(key, obj)
        except ObjectConflict:
            try:
                self.store.read_record(key, model)
            except CorruptObject:
                self.store.repair(key, encode_json(obj))

    def _continues(self, summary: TaskSummary) -> bool:
        """Whether a stored summary's search goes on in this call: it was stopped by a budget
        that has something left now."""
        if summary.stop_reason == "wall-time":
            return True
        return summary.stop_reason == "gpu-seconds" and self._budget_stop() is None

    def _budget_stop(self, in_flight_s: float = 0.0) -> str | None:
        """The budget that has run out, if any; `in_flight_s`: seconds that evaluations still
        running have spent so far (they count against the GPU-seconds before they finish)."""
        if (
            self.budget.wall_time_seconds is not None
            and time.monotonic() - self._started >= self.budget.wall_time_seconds
        ):
            return "wall-time"
        if self.budget.gpu_seconds is not None and self._gpu_used + in_flight_s >= self.budget.gpu_seconds:
            return "gpu-seconds"
        return None

    @property
    def _deadline(self) -> float | None:
        """When the wall-time budget ends (time.monotonic()), for policies that wait on an endpoint."""
        limit = self.budget.wall_time_seconds
        return None if limit is None else self._started + limit

    @property
    def _limited(self) -> bool:
        return self.budget.wall_time_seconds is not None or self.budget.gpu_seconds is not None

    @contextlib.contextmanager
    def _budget_watch(self) -> Iterator[threading.Event | None]:
        """An event set when the budget runs out while a measurement that the evaluator cannot
        split runs (the baselines); None without a time budget. GPU-seconds count the
        measurement's own seconds as they pass, like an evaluation in flight."""
        if not self._limited:
            yield None
            return
        cancel, done = threading.Event(), threading.Event()
        begun = time.monotonic()

        def watch() -> None:
            while not done.wait(0.25):
                if self._budget_stop(time.monotonic() - begun) is not None:
                    cancel.set()
                    return

        watcher = threading.Thread(target=watch, name="budget-watch", daemon=True)
        watcher.start()
        try:
            yield cancel
        finally:
            done.set()
            watcher.join()
            self._gpu_used += time.monotonic() - begun

    def _stop_batch(self, in_flight_s: float) -> bool:
        self._stop = self._stop or self._budget_stop(in_flight_s)
        return self._stop is not None

    def _load_results(self) -> None:
        """Every result the run already has for this GPU class and evaluator version."""
        for result in self.store.list_results(self.layout.prefix, on_corrupt=self._corrupt):
            key = result.key
            ours = key.gpu_class == self.gpu_class and key.evaluator_version == self.evaluator_version
            if ours and result.task_hash in self._states and key not in self._known:
                self._known[key] = result
                self._gpu_used += result.seconds

    def _corrupt(self, error: CorruptObject) -> None:
        """A stored object that cannot be read: name it and carry on without it (what it held
        is measured or asked again, and the new object replaces it or goes under a new key)."""
        log.warning("%s", error)
        self.progress.message(f"skipped: {error}")
        marker = f"{self.layout.prefix}/results/"
        if error.key.startswith(marker):
            self._damaged_tasks.add(error.key[len(marker) :].split("/", 1)[0])

    def _provisional_tasks(self) -> set[str]:
        """Tasks (by the 16 characters of their hash in keys) with a provisional result on this GPU
        class and evaluator version that no final result has replaced yet."""
        known = {(k.task_hash[:16], k.variant_hash) for k in self._known}
        found: set[str] = set()
        base = f"{self.layout.prefix}/provisional/results/"
        for key in self.store.list(base):
            parts = key[len(base) :].split("/")
            if len(parts) != 4 or parts[1] != self.gpu_class or parts[2] != self.evaluator_version:
                continue
            variant = parts[3].rsplit("-", 1)[0]
            if (parts[0], variant) not in known:
                found.add(parts[0])
        return found

    def _stored_summary(self, state: _TaskState) -> TaskSummary | None:
        """The newest summary this budget wrote for the task, if any."""
        prefix = self.layout.summary_prefix(state.task.hash, self.gpu_class, self._summary_fingerprint())

        def damaged(error: CorruptObject) -> None:
            self._corrupt(error)
            state.damaged_summaries.append(error.key)

        found = [
            summary
            for key in self.store.list(prefix)
            if (summary := read_model(self.store, key, TaskSummary, damaged)) is not None
        ]
        return max(found, key=lambda summary: summary.finished_at) if found else None

    def _summary_fingerprint(self) -> str:
        text = ":".join([self.budget.fingerprint(), self.evaluator_version, *(p.id for p in self.policies)])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    # ------------------------------------------------------------------ one round

    def _round(self, round_: int, active: list[_TaskState]) -> None:
        slots: list[tuple[int, _TaskState, SampleRecord]] = []
        existing = {state.task.hash: self._existing_samples(state, round_) for state in active}
        for order, policy in enumerate(self.policies):
            requests: list[Request] = []
            places: list[tuple[_TaskState, str, tuple[str, ...]]] = []
            for state in active:
                if policy.id in state.exhausted:
                    continue
                for index in range(self.budget.samples_per_round):
                    key = self.layout.sample(state.task.hash, self.gpu_class, round_, policy.id, index)
                    record = existing[state.task.hash].get(key)
                    if record is not None:
                        slots.append((order, state, record))
                        continue
                    seed = _seed(
                        self.settings.seed, state.task.hash, self.gpu_class, round_, policy.id, index
                    )
                    chosen = state.db.sample_exemplars(
                        self.settings.exemplars, self.settings.bucket_temperature, random.Random(seed)
                    )
                    requests.append(
                        Request(
                            task=state.task,
                            device=self.environment.device,
                            gpu_class=self.gpu_class,
                            round=round_,
                            index=index,
                            exemplars=tuple(
                                Exemplar(e.code, e.speedup or 0.0, e.variant_hash) for e in chosen
                            ),
                            seen=state.seen(),
                            seed=seed % (2**31),
                            deadline=self._deadline,
                        )
                    )
                    places.append((state, key, tuple(e.variant_hash for e in chosen)))
            if not requests:
                continue
            self._stop = self._stop or self._budget_stop()
            if self._stop:
                break
            proposals = policy.propose(requests)
            if len(proposals) != len(requests):
                raise RuntimeError(
                    f"policy {policy.name} returned {len(proposals)} proposals for {len(requests)} requests"
                )
            failures = 0
            for request, (state, key, parents), proposal in zip(requests, places, proposals, strict=True):
                if proposal.exhausted:
                    state.exhausted.add(policy.id)
                    continue
                if proposal.transient:
                    failures += 1
                    if failures == 1:
                        self.progress.message(f"{policy.name}: {proposal.error} (asked again on resume)")
                    continue
                record = self._record_sample(policy, request, key, proposal, parents)
                state.note(record)
                slots.append((order, state, record))
            if failures > 1:
                self.progress.message(f"{policy.name}: {failures} requests failed this round")
        slots.sort(key=lambda slot: (slot[0], slot[2].index))
        self._evaluate(slots)

    def _existing_samples(self, state: _TaskState, round_: int) -> dict[str, SampleRecord]:
        found = {}
        for key in self.store.list(self.layout.samples(state.task.hash, self.gpu_class, round_)):
            if key.endswith(".json"):
                record = read_model(self.store, key, SampleRecord, self._corrupt)
                if record is None:
                    continue
                found[key] = record
                state.note(record)
        return found

    def _record_sample(
        self, policy: Policy, request: Request, key: str, proposal: Proposal, parents: tuple[str, ...]
    ) -> SampleRecord:
        variant_hash = None
        if proposal.code is not None:
            variant_hash = self.store.put_variant(proposal.code)
            self._codes[variant_hash] = proposal.code
        record = SampleRecord(
            task_hash=request.task.hash,
            gpu_class=self.gpu_class,
            round=request.round,
            policy=policy.name,
            policy_id=policy.id,
            index=request.index,
            variant_hash=variant_hash,
            key=proposal.key,
            name=proposal.name,
            error=proposal.error,
            missing_sections=proposal.missing_sections,
            analysis=proposal.analysis,
            design=proposal.design,
            answer=proposal.text[:ANSWER_LIMIT],
            parent_hashes=parents,
        )
        try:
            self.store.put_json(key, record)
        except ObjectConflict:
            # Another worker wrote this sample first: theirs stands, unless it is damaged: then
            # ours replaces it.
            theirs = read_model(self.store, key, SampleRecord, self._corrupt)
            if theirs is not None:
                return theirs
            self.store.repair(key, encode_json(record))
        return record

    def _code(
        self, variant_hash: str, state: _TaskState | None = None, record: SampleRecord | None = None
    ) -> str | None:
        """The variant's code, checked against its hash. When the store lost it (missing or
        damaged, reported), it is restored from `record`, the sample that proposed it, where
        possible (`_restore_code`); None otherwise."""
        code = self._codes.get(variant_hash)
        if code is None:
            try:
                code = self.store.get_variant(variant_hash)
            except (NotFound, CorruptObject) as error:
                if isinstance(error, CorruptObject):
                    self._corrupt(error)
                if state is None or record is None:
                    return None
                return self._restore_code(state, record)
            self._codes[variant_hash] = code
        return code

    def _restore_code(self, state: _TaskState, record: SampleRecord) -> str | None:
        """Code the store lost, found again: parsed from the answer recorded with its sample, or
        proposed again by the same policy for the same request (the deterministic policies,
        compile and replay, give the same code again). Stored again when, and only when, it
        hashes to the variant; otherwise the variant's result cannot be used (reported)."""
        variant = record.variant_hash or ""
        found: str | None = None
        if record.answer:
            parsed = Proposal.from_answer(record.answer).code
            if parsed is not None and source_hash(parsed) == variant:
                found = parsed
        policy = next((p for p in self.policies if p.id == record.policy_id), None)
        if found is None and policy is not None:
            request = Request(
                task=state.task,
                device=self.environment.device,
                gpu_class=self.gpu_class,
                round=record.round,
                index=record.index,
                seen=state.seen() - {variant, record.key},
                seed=_seed(
                    self.settings.seed, state.task.hash, self.gpu_class, record.round, policy.id, record.index
                )
                % (2**31),
            )
            try:
                [proposal] = policy.propose([request])
            except Exception as error:
                log.warning("asking %s again for lost code failed: %s", policy.name, error)
            else:
                if proposal.code is not None and source_hash(proposal.code) == variant:
                    found = proposal.code
        if found is None:
            self.progress.message(
                f"{state.task.name}: the code of variant {variant[:12]} is missing from the store and "
                "could not be restored; its result is not used"
            )
            return None
        self.store.put_variant(found, check=True)  # over a damaged copy too: the key is the content's address
        self._codes[variant] = found
        self.progress.message(f"{state.task.name}: restored the code of variant {variant[:12]} in the store")
        return found

    def _key(self, task_hash: str, variant_hash: str) -> ResultKey:
        return ResultKey(
            task_hash=task_hash,
            variant_hash=variant_hash,
            gpu_class=self.gpu_class,
            evaluator_version=self.evaluator_version,
        )

    def _evaluate(self, slots: list[tuple[int, _TaskState, SampleRecord]]) -> None:
        pending: dict[tuple[str, str], _TaskState] = {}
        records: dict[tuple[str, str], SampleRecord] = {}
        for _, state, record in slots:
            if record.variant_hash and record.variant_hash not in state.db:
                pending.setdefault((state.task.hash, record.variant_hash), state)
                records.setdefault((state.task.hash, record.variant_hash), record)
        todo = [
            (state, variant_hash)
            for (task_hash, variant_hash), state in pending.items()
            if self._key(task_hash, variant_hash) not in self._known and not state.task_error
        ]
        self.progress.evaluations_planned(len(todo))
        sink = _ResultSink(self)
        # The whole round goes to the evaluator at once: its pipeline builds, checks and times
        # side by side, and a slow build or evaluation holds only itself. (Chunks with a barrier
        # between them left the GPU idle while one build in a chunk ran to its limit.)
        self._stop = self._stop or self._budget_stop()
        if self._stop:
            self._collect(slots)
            return
        # A variant whose stored code is lost and cannot be restored (reported) cannot be evaluated.
        coded = [
            (state, variant, code)
            for state, variant in todo
            if not state.task_error
            and (code := self._code(variant, state, records[(state.task.hash, variant)])) is not None
        ]
        if coded:
            items = [(state.task, code) for state, _, code in coded]
            try:
                results: Sequence[EvaluationResult | None] = self.evaluator.evaluate_batch(
                    items,
                    cache=sink,
                    progress=False,
                    stop=self._stop_batch if self._limited else None,
                    slow=self._slow,
                )
            except EvaluationCancelled as cancelled:
                # The budget ended mid-batch: what finished is kept, the rest is not evaluated
                # (nothing of it is stored, so a resumed run evaluates it).
                results = cancelled.results or [None] * len(items)  # type: ignore[assignment]
                self._stop = self._stop or self._budget_stop() or "wall-time"
            for (state, _, _), result in zip(coded, results, strict=True):
                if result is None:
                    state.not_evaluated += 1
                else:
                    self._record_result(result)
        self._collect(slots)

    def _collect(self, slots: list[tuple[int, _TaskState, SampleRecord]]) -> None:
        """Add the round's evaluated variants (this call's and the store's) to their databases."""
        for _, state, record in slots:
            if not record.variant_hash or record.variant_hash in state.db:
                continue
            known = self._known.get(self._key(state.task.hash, record.variant_hash))
            code = self._code(record.variant_hash, state, record) if known is not None else None
            if known is None or code is None:
                continue
            entry = Entry(
                code=code,
                result=known,
                policy=record.policy,
                round=record.round,
                name=record.name,
                parent_hashes=record.parent_hashes,
            )
            if state.db.add(entry) and entry.successful:
                state.best_seen = max(entry.speedup or 0.0, state.best_seen or 0.0)

    def _slow(self, task: Task, variant_hash: str, seconds: float, activity: str) -> None:
        """An evaluation that runs long is named, so a user sees which candidate holds the run,
        and what it does: a long compile reads apart from a stuck evaluation."""
        self.progress.message(
            f"{task.name}: variant {variant_hash[:12]} has been evaluating for {seconds:.0f} s: {activity}"
        )

    def _record_result(self, result: EvaluationResult) -> None:
        """Keep a fresh result: in the store first, then in memory. Called once per key."""
        key = result.key
        if key in self._known:
            return
        state = self._states.get(result.task_hash)
        if any(reason.split(":", 1)[0].strip() == REFERENCE_ERROR for reason in result.reasons):
            if state is not None and not state.task_error:
                state.task_error = next(r for r in result.reasons if r.startswith(REFERENCE_ERROR))
                self.progress.message(f"{state.task.name}: {state.task_error}")
            return
        if key.gpu_class != self.gpu_class or key.evaluator_version != self.evaluator_version:
            raise RuntimeError(
                f"the evaluator measured on {key.gpu_class}/{key.evaluator_version}, but the loop was set up "
                f"for {self.gpu_class}/{self.evaluator_version}: pass the evaluator's own environment"
            )
        if self._lease is not None:
            self._lease.check()
        if not result.final:
            # A timing that never settled (another evaluation may have shared the device) or a
            # failed judge: kept apart, never the run's word on this key; a resumed run measures
            # it again.
            self.store.put_provisional(self.layout.prefix, result)
        else:
            try:
                self.store.put_result(self.layout.prefix, result)
            except ResultConflict as conflict:
                name = state.task.name if state is not None else result.task_hash[:12]
                self.progress.message(f"{name}: {conflict}")
        self._known[key] = result
        self._gpu_used += result.seconds
        if state is not None:
            if result.verdict == Verdict.CORRECT and result.speedup is not None:
                state.best_seen = max(result.speedup, state.best_seen or 0.0)
            self.progress.result(state.task, result, state.best_seen)

    # ------------------------------------------------------------------ the end of a task

    def _finish(self, state: _TaskState, reason: str) -> None:
        # A spent budget starts nothing more: baselines and the re-verification are taken from
        # the store when there, else left to a resumed run.
        spent = reason in BUDGET_STOPS
        baselines = self._baselines(state, measure=not spent) if self.settings.measure_baselines else {}
        chosen, verification = self._verify(state, measure=not spent)
        if not spent and self._stop in BUDGET_STOPS and self._cut_short(state, baselines, verification):
            # The budget ran out while the task was being finished: what was cut short is left
            # to a resumed run, which a budget stop allows.
            reason = self._stop
        speedup = chosen.speedup if chosen is not None else None
        if speedup is not None and verification is not None and verification.speedup is not None:
            # Like the evaluator's own re-check: of two honest measurements, the lower counts.
            speedup = min(speedup, verification.speedup)
        compile_speedup = self._compile_speedup(state, baselines)
        vs_compile = speedup / compile_speedup if speedup is not None and compile_speedup else None
        summary = TaskSummary(
            task_name=state.task.name,
            task_hash=state.task.hash,
            gpu_class=self.gpu_class,
            evaluator_version=self.evaluator_version,
            stop_reason=reason,
            rounds=state.rounds_run,
            samples=state.samples,
            variants=len(state.db),
            verdicts=dict(sorted(state.db.verdict_counts().items())),
            best_variant_hash=chosen.variant_hash if chosen else None,
            best_policy=chosen.policy if chosen else None,
            best_name=chosen.name if chosen else "",
            best_speedup=speedup,
            search_speedup=chosen.speedup if chosen else None,
            speedup_vs_compile=vs_compile,
            compile_speedup=compile_speedup,
            verified=verification is not None,
            baselines=baselines,
            gpu_seconds=round(state.db.gpu_seconds(), 3),
            not_evaluated=state.not_evaluated,
            finished_at=_now(),
        )
        # Named by the samples seen so far: a search continued after a wall-time stop writes a
        # new summary next to the old one; readers take the newest.
        key = self.layout.summary(state.task.hash, self.gpu_class, self._summary_fingerprint(), state.samples)
        for attempt in range(1, 100):
            try:
                self.store.put_json(key, summary)
                break
            except ObjectConflict:
                if key in state.damaged_summaries:
                    break  # replaced with this one below
                # The same samples summed up again (a repeated wall-time stop, or results measured
                # again after a timing that had not settled): a new summary beside the old one;
                # readers take the newest.
                key = key.removesuffix(".json").rsplit("-r", 1)[0] + f"-r{attempt}.json"
        for damaged in state.damaged_summaries:
            # A summary that could not be read says nothing; the task's word now is this one.
            self.store.repair(damaged, encode_json(summary))
        state.damaged_summaries.clear()
        state.summary = summary
        self.progress.task_finished(summary, resumed=False)

    def _cut_short(
        self, state: _TaskState, baselines: dict[str, Timing], verification: EvaluationResult | None
    ) -> bool:
        """Whether a measurement `_finish` wanted is missing: the baselines, or a verification
        of a task that has a correct variant."""
        missing_baselines = self.settings.measure_baselines and not baselines
        unverified = self.settings.verify_best and verification is None and state.db.best() is not None
        return missing_baselines or unverified

    @staticmethod
    def _compile_speedup(state: _TaskState, baselines: dict[str, Timing]) -> float | None:
        """torch.compile of the reference over eager. The compile policy's plain torch.compile
        variant was timed interleaved with eager in one process, the same protocol as every
        other variant, so it is preferred over baselines timed in a session of their own."""
        for entry in state.db.ranked():
            if entry.policy == COMPILE_POLICY and entry.name == COMPILE_DEFAULT:
                return entry.speedup
        eager, compiled = baselines.get("eager"), baselines.get("compile")
        if eager is not None and compiled is not None and compiled.median_ms > 0:
            return eager.median_ms / compiled.median_ms
        return None

    def _baselines(self, state: _TaskState, measure: bool = True) -> dict[str, Timing]:
        key = self.layout.baselines(state.task.hash, self.gpu_class, self.evaluator_version)
        try:
            stored = self.store.get_json(key)
            return {name: Timing.model_validate(value) for name, value in stored.get("baselines", {}).items()}
        except NotFound:
            pass
        except (CorruptObject, ValidationError, AttributeError) as error:
            self._corrupt(
                error
                if isinstance(error, CorruptObject)
                else CorruptObject(
                    f"object {self.store.url_for(key)} holds no valid baselines ({error})", key
                )
            )
        if not measure or self._budget_stop() is not None:
            return {}
        try:
            with self._budget_watch() as cancel:
                measured = self.evaluator.baselines(state.task, cancel=cancel)
        except EvaluationCancelled:
            self._stop = self._stop or self._budget_stop() or "wall-time"
            self.progress.message(f"{state.task.name}: baselines cancelled at the {self._stop} limit")
            return {}
        except Exception as error:  # a baseline is context, not the result: report and go on
            self.progress.message(
                f"{state.task.name}: baselines not measured ({error}); will retry on resume"
            )
            return {}
        self._put_repairing(
            key,
            {"baselines": {name: timing.model_dump(mode="json") for name, timing in measured.items()}},
            _Baselines,
        )
        return dict(measured)

    def _verify(
        self, state: _TaskState, measure: bool = True
    ) -> tuple[Entry | None, EvaluationResult | None]:
        """The best variant that is correct again in a fresh evaluation, and that evaluation.
        Without `measure`, only a verification already in the store counts."""
        ranked = state.db.ranked()
        if not self.settings.verify_best:
            return (ranked[0] if ranked else None), None
        for entry in ranked[: max(1, self.settings.verify_attempts)]:
            key = self.layout.verification(
                state.task.hash, self.gpu_class, self.evaluator_version, entry.variant_hash
            )
            try:
                result = self.store.read_record(key, EvaluationResult)
            except NotFound:
                result = None
            except CorruptObject as error:
                self._corrupt(error)
                result = None
            if result is None:
                if not measure or self._budget_stop() is not None:
                    return (ranked[0] if ranked else None), None
                try:
                    [result] = self.evaluator.evaluate_batch(
                        [(state.task, entry.code)],
                        cache=None,
                        stop=self._stop_batch if self._limited else None,
                    )
                except EvaluationCancelled:
                    # Cancelled at the limit: nothing of it is stored, a resumed run verifies again.
                    self._stop = self._stop or self._budget_stop() or "wall-time"
                    return (ranked[0] if ranked else None), None
                self._put_repairing(key, result, EvaluationResult)
                self._gpu_used += result.seconds
            if result.verdict == Verdict.CORRECT:
                # Correct again; a re-timing too noisy to give a speedup leaves the search's.
                return entry, result
            reasons = "; ".join(result.reasons) or str(result.verdict)
            self.progress.message(
                f"{state.task.name}: {entry.name or entry.variant_hash[:12]} failed to verify ({reasons})"
            )
        return None, None


def optimize(
    tasks: Iterable[Task],
    policies: Sequence[Policy],
    *,
    store: Store,
    prefix: str,
    evaluator: EvaluatorLike,
    environment: Environment,
    budget: Budget | None = None,
    settings: LoopSettings | None = None,
    progress: Progress | None = None,
    lease_scope: str = "",
    started_at: float | None = None,
) -> list[TaskSummary]:
    """Run the contrastive loop over `tasks`; see `OptimizationLoop`. `lease_scope`, a path below
    the run, makes the lease cover only the part of the run this call works on; `started_at`
    (time.monotonic()) starts the wall-time clock earlier than the call."""
    loop = OptimizationLoop(
        store=store,
        prefix=prefix,
        evaluator=evaluator,
        environment=environment,
        policies=policies,
        budget=budget,
        settings=settings,
        progress=progress,
        lease_scope=lease_scope,
        started_at=started_at,
    )
    return loop.run(tasks)
