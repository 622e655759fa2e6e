"""Runs that share a store (issue 9): one process per run (the lease), results that are not
final kept apart, a result already in the store with other content reported, not kept silently."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kernelfleet.core.models import EvaluationResult, Task
from kernelfleet.core.store import LeaseHeld, RunLease, Store, current_lease, open_store, verify_run
from kernelfleet.search import Budget, LoopSettings, QuietProgress, optimize
from tests.support.search import ScriptedEvaluator, ScriptedPolicy, answer, make_task, variant_code

PREFIX = "runs/shared"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store")


class Messages(QuietProgress):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def message(self, text: str) -> None:
        self.texts.append(text)


def run(
    store: Store, evaluator: ScriptedEvaluator, progress: QuietProgress | None = None, **settings: object
) -> list:
    policy = ScriptedPolicy(lambda r: answer(variant_code(f"{r.task.name}-{r.round}-{r.index}", 2.0)))
    return optimize(
        [make_task("alpha", 2)],
        [policy],
        store=store,
        prefix=PREFIX,
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=1, samples_per_round=2),
        settings=LoopSettings(**settings),
        progress=progress or QuietProgress(),
    )


def test_a_second_process_on_a_run_is_refused_while_the_first_works(store: Store) -> None:
    with (
        RunLease(store, PREFIX, owner="the-first-optimize"),
        pytest.raises(LeaseHeld, match="the-first-optimize"),
    ):
        run(store, ScriptedEvaluator())
    # Once the first lets go, the run is free, and the loop gives its lease back at the end.
    assert run(store, ScriptedEvaluator())
    lease = current_lease(store, PREFIX)
    assert lease is not None and lease.released


def test_a_lease_scope_covers_only_its_part_of_the_run(store: Store) -> None:
    """Worker pods of one job share its run, each on tasks of its own: a scoped lease (the
    worker's is per task) leaves the rest of the run free and still keeps out a second process
    on the same part."""
    policy = ScriptedPolicy(lambda r: answer(variant_code(f"{r.task.name}-{r.round}", 2.0)))
    evaluator = ScriptedEvaluator()

    def scoped(scope: str) -> list:
        return optimize(
            [make_task("alpha", 2)],
            [policy],
            store=store,
            prefix=PREFIX,
            evaluator=evaluator,
            environment=evaluator.environment,
            budget=Budget(rounds=1, samples_per_round=1),
            lease_scope=scope,
        )

    with RunLease(store, f"{PREFIX}/leases/other-task", owner="another-pod"):
        assert scoped("leases/this-task")  # another part of the run is held: this one is free
        with pytest.raises(LeaseHeld, match="another-pod"):
            scoped("leases/other-task")


def test_a_waiting_process_runs_once_the_holder_is_done(store: Store) -> None:
    holder = RunLease(store, PREFIX, owner="holder").acquire()
    threading.Timer(0.3, holder.release).start()
    assert run(store, ScriptedEvaluator(), lease_wait_seconds=60)


def test_a_timing_that_did_not_settle_is_kept_apart_and_measured_again(store: Store) -> None:
    class Noisy(ScriptedEvaluator):
        def judge(self, task: Task, code: str, verification: bool = False) -> EvaluationResult:
            result = super().judge(task, code, verification)
            return result.model_copy(
                update={
                    "speedup": None,
                    "candidate": None,
                    "reasons": ("timing-noisy: another run shared it",),
                }
            )

    first = Noisy()
    run(store, first)
    assert list(store.list_results(PREFIX)) == []  # nothing final stored...
    assert (
        len([k for k in store.list(f"{PREFIX}/provisional/") if k.endswith(".json")]) == 2
    )  # ...nothing lost
    second = ScriptedEvaluator()
    run(store, second)
    assert len(second.evaluated) == 2  # measured again on resume
    assert len(list(store.list_results(PREFIX))) == 2


def test_a_result_forged_into_the_store_during_a_run_is_reported_not_kept_silently(store: Store) -> None:
    """Issue 9's attack, played by the evaluator itself (the sandbox keeps real candidates away
    from the store): while the first variant is judged, a forged 50x result appears at the key
    of every variant of the task. The loop's own result for the second one clashes with it; the
    clash is reported, both results are kept, and `store verify` names it."""

    class Forging(ScriptedEvaluator):
        def judge(self, task: Task, code: str, verification: bool = False) -> EvaluationResult:
            result = super().judge(task, code, verification)
            if len(self.evaluated) == 1:
                for index in range(2):
                    other = variant_code(f"{task.name}-0-{index}", 2.0)
                    forged = super().judge(task, other).model_copy(update={"speedup": 50.0})
                    if forged.variant_hash != result.variant_hash:
                        store.put_result(PREFIX, forged)
            return result

    progress = Messages()
    run(store, Forging(), progress)
    assert any("a different result is already stored" in text for text in progress.texts), progress.texts
    check = verify_run(store, PREFIX)
    assert not check.ok
    assert any("two different results" in f.detail for f in check.findings)
