"""`kernelfleet worker`: a pod's slice of the plan, run, logged and resumed from the store."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kernelfleet.core.jobplan import (
    EXIT_DETERMINISTIC,
    JobPlan,
    Role,
    TaskOutcome,
    chunk_key,
    chunk_tasks,
    outcome_key,
    plan_key,
    task_log_key,
)
from kernelfleet.core.models import Task
from kernelfleet.core.resources import OptimizationJobSpec
from kernelfleet.core.store import Store, open_store
from kernelfleet.operator._plan import make_plan
from kernelfleet.search.worker import Worker, load_slice, outcomes, run_worker
from tests.support.search import Killed, ScriptedEvaluator, ScriptedPolicy, answer, make_task, variant_code

UID = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def _setup(
    tmp_path: Path, tasks_per_index: int = 2, verify_on: tuple[str, ...] = ()
) -> tuple[Store, JobPlan, list[Task]]:
    store = open_store(tmp_path / "store")
    tasks = [make_task(f"t{i}", factor=i + 2) for i in range(3)]
    spec = OptimizationJobSpec.model_validate(
        {
            "tasks": ["kernelbench-v0:1:1"],
            "gpuClasses": ["h100"],
            "tasksPerIndex": tasks_per_index,
            "verifyOn": list(verify_on),
            "budget": {"rounds": 2, "samplesPerRound": 1},
        }
    )
    plan = make_plan(
        namespace="ns", name="job", uid=UID, spec=spec, tasks_total=len(tasks), max_indexes_per_job=10
    )
    for number, chunk in enumerate(chunk_tasks(tasks, plan.chunk_size)):
        store.put_json(chunk_key(plan.prefix, number), chunk)
    store.put_json(plan_key(plan.prefix), plan)
    return store, plan, tasks


def _policy() -> ScriptedPolicy:
    return ScriptedPolicy(
        lambda request: answer(
            variant_code(f"{request.task.name}-{request.round}", speedup=1.5 + request.round)
        )
    )


def test_a_slice_runs_and_writes_outcomes_and_logs_last(tmp_path: Path) -> None:
    store, plan, tasks = _setup(tmp_path)
    shard = plan.shard(Role.SEARCH, "h100", 0)
    assert [t.hash for t in load_slice(store, plan, shard.positions(0))] == [t.hash for t in tasks[:2]]
    evaluator = ScriptedEvaluator()
    Worker(store, plan, "h100", Role.SEARCH, evaluator=evaluator, policies=[_policy()]).run(tasks[:2])
    found = {o.task_name: o for o in outcomes(store, plan.prefix, Role.SEARCH, "h100")}
    assert set(found) == {"t0", "t1"}
    assert all(o.ok and o.best_speedup == 2.5 and o.variants == 2 for o in found.values())
    log = store.get_bytes(task_log_key(plan.prefix, Role.SEARCH, "h100", tasks[0].hash)).decode()
    assert "t0: done (rounds)" in log
    assert "t1" not in log  # each task's lines in its own log


def test_a_killed_pod_resumes_without_evaluating_anything_twice(tmp_path: Path) -> None:
    store, plan, tasks = _setup(tmp_path)
    first = ScriptedEvaluator(kill_after=3)
    with pytest.raises(Killed):
        Worker(store, plan, "h100", Role.SEARCH, evaluator=first, policies=[_policy()]).run(tasks[:2])
    assert len(outcomes(store, plan.prefix, Role.SEARCH, "h100")) == 1
    second = ScriptedEvaluator()
    Worker(store, plan, "h100", Role.SEARCH, evaluator=second, policies=[_policy()]).run(tasks[:2])
    assert set(second.evaluated).isdisjoint(first.evaluated)
    assert len(first.evaluated) + len(second.evaluated) == 4
    assert len(outcomes(store, plan.prefix, Role.SEARCH, "h100")) == 2
    # The killed pod's log of the interrupted task is kept; the retry writes the next attempt.
    assert store.exists(task_log_key(plan.prefix, Role.SEARCH, "h100", tasks[1].hash, 0))
    assert store.exists(task_log_key(plan.prefix, Role.SEARCH, "h100", tasks[1].hash, 1))
    third = ScriptedEvaluator()
    Worker(store, plan, "h100", Role.SEARCH, evaluator=third, policies=[_policy()]).run(tasks[:2])
    assert third.evaluated == [] and third.verified == []


def test_verify_role_re_times_the_best_variant_on_its_class(tmp_path: Path) -> None:
    store, plan, tasks = _setup(tmp_path, verify_on=("l40",))
    Worker(store, plan, "h100", Role.SEARCH, evaluator=ScriptedEvaluator(), policies=[_policy()]).run(tasks)
    l40 = ScriptedEvaluator(gpu_class="l40")
    Worker(store, plan, "l40", Role.VERIFY, evaluator=l40).run(tasks)
    verified = outcomes(store, plan.prefix, Role.VERIFY, "l40")
    assert len(verified) == 3 and len(l40.verified) == 3 and l40.evaluated == []
    outcome = verified[0]
    assert outcome.verified and outcome.source_class == "h100" and outcome.source_speedup == 2.5
    assert isinstance(outcome, TaskOutcome)


def test_deterministic_errors_exit_with_the_failing_index_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, plan, _ = _setup(tmp_path)
    args = argparse.Namespace(
        store=str(tmp_path / "store"),
        prefix=plan.prefix,
        gpu_class="h100",
        shard=0,
        index=None,
        role="search",
        device="cpu",
    )
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert run_worker(args) == EXIT_DETERMINISTIC  # not in an Indexed Job
    args.index = 7
    assert run_worker(args) == EXIT_DETERMINISTIC  # no such index
    args.index, args.prefix = 0, "optimizationjobs/ns/other/uid"
    assert run_worker(args) == EXIT_DETERMINISTIC  # no plan
    assert not store.exists(outcome_key(plan.prefix, Role.SEARCH, "h100", "0" * 64))
