"""Planning and status folding of an OptimizationJob, without a cluster: task resolution,
sharding, the exact Job of a shard, validation messages, and the status from Jobs and outcomes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.jobplan import Role, TaskOutcome, outcome_key
from kernelfleet.core.resources import OptimizationJobSpec
from kernelfleet.core.store import open_store
from kernelfleet.operator._app import Runtime
from kernelfleet.operator._jobs import Owner
from kernelfleet.operator._kube import KubeClient
from kernelfleet.operator._metrics import Metrics
from kernelfleet.operator._plan import (
    SpecError,
    make_plan,
    resolve_tasks,
)
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._status import PatchLimiter
from kernelfleet.operator.optimizationjob import (
    JobView,
    _creation_shares,
    _Memory,
    _read_outcomes,
    _write_plan,
    admission_condition,
    build_job,
    deadline_passed,
    fold_status,
    index_jobs,
)

UID = "11111111-2222-3333-4444-555555555555"
TASK = (
    "import torch\nclass Model(torch.nn.Module):\n    pass\n"
    "def get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n"
)


def _spec(**fields: object) -> OptimizationJobSpec:
    return OptimizationJobSpec.model_validate({"tasks": ["kernelbench-v0:1:1-5"], **fields})


def test_kernelbench_selection_resolves_without_torch_and_deduplicates() -> None:
    tasks = resolve_tasks(_spec(tasks=["kernelbench-v0:1:1-3", "kernelbench-v0:1:2-4"]), open_store)
    assert [t.task_id for t in tasks] == [1, 2, 3, 4]


def test_store_prefix_and_jsonl_selections(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put_bytes("suite/a.py", TASK.encode())
    store.put_bytes("suite/b.py", (TASK + "# b\n").encode())
    store.put_bytes("suite/notes.py", b"print('not a task')\n")
    rows = [{"level": 1, "task_id": i, "name": f"t{i}", "code": TASK + f"# {i}\n"} for i in range(1, 6)]
    store.put_bytes("big.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    url = tmp_path.as_uri()
    spec = _spec(tasks=[f"{url}/suite/", f"{url}/big.jsonl:1:2-3"])
    tasks = resolve_tasks(spec, open_store)
    assert [t.name for t in tasks] == ["a", "b", "1_2_t2", "1_3_t3"]


@pytest.mark.parametrize(
    ("selection", "field", "words"),
    [
        ("examples/tasks", "spec.tasks[1]", "upload local task files"),
        ("kernelbench-v9:1:1", "spec.tasks[1]", "no KernelBench version"),
    ],
)
def test_unreadable_selection_names_its_entry(selection: str, field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        resolve_tasks(_spec(tasks=["kernelbench-v0:1:1", selection]), open_store)
    assert caught.value.field == field
    assert words in caught.value.message


def test_shards_split_large_classes_and_names_are_stable() -> None:
    spec = _spec(gpuClasses=["h100", "a100"], tasksPerIndex=2, verifyOn=["l40"], parallelism=4)
    plan = make_plan(
        namespace="ns", name="big", uid=UID, spec=spec, tasks_total=2500, max_indexes_per_job=1000
    )
    search = [s for s in plan.shards if s.role == Role.SEARCH]
    assert [(s.gpu_class, s.number, s.start, s.stop, s.completions) for s in search] == [
        ("h100", 0, 0, 2000, 1000),
        ("h100", 1, 2000, 2500, 250),
        ("a100", 0, 0, 2000, 1000),
        ("a100", 1, 2000, 2500, 250),
    ]
    assert search[1].positions(249) == range(2498, 2500)
    (verify,) = [s for s in plan.shards if s.role == Role.VERIFY]
    assert verify.gpu_class == "l40" and verify.completions == 4  # parallelism pods, many tasks each
    again = make_plan(
        namespace="ns", name="big", uid=UID, spec=spec, tasks_total=2500, max_indexes_per_job=1000
    )
    assert again == plan
    assert len({s.job_name for s in plan.shards}) == len(plan.shards)
    assert plan.chunks_for(range(95, 205)) == [0, 1, 2]


def _running(
    name: str, completions: int, parallelism: int, succeeded: int, finished: str | None = None
) -> JobView:
    return JobView(
        name=name, role="search", gpu_class="h100", shard=0, completions=completions,
        parallelism=parallelism, suspend=False, active=0, ready=0, succeeded=succeeded,
        failed_indexes=frozenset(), finished=finished, reason="", deleting=False,
    )  # fmt: skip


def test_parallelism_goes_to_earlier_shards_first_and_an_existing_job_keeps_its_own() -> None:
    spec = _spec(gpuClasses=["h100"], parallelism=4)
    plan = make_plan(
        namespace="ns", name="big", uid=UID, spec=spec, tasks_total=1250, max_indexes_per_job=1000
    )
    first, second = (s.job_name for s in plan.shards)
    assert _creation_shares(plan, {}, {}, Role.SEARCH) == {first: 4, second: 0}
    # The first Job runs with 4 pods: nothing is left for the second.
    busy = {first: _running(first, 1000, 4, succeeded=10)}
    assert _creation_shares(plan, busy, {}, Role.SEARCH) == {second: 0}
    # Two indexes left: the Job starts no more than 2 pods, so the second gets the other 2.
    tail = {first: _running(first, 1000, 4, succeeded=998)}
    assert _creation_shares(plan, tail, {}, Role.SEARCH) == {second: 2}
    done = {first: _running(first, 1000, 4, succeeded=1000, finished="Complete")}
    assert _creation_shares(plan, done, {}, Role.SEARCH) == {second: 4}
    # A Job just created and not in the index yet still holds its share.
    assert _creation_shares(plan, {}, {first: 4}, Role.SEARCH) == {second: 0}


def _runtime(**settings: object) -> Runtime:
    async def login() -> object:
        raise AssertionError("no API calls in unit tests")

    return Runtime(
        settings=OperatorSettings(default_store="s3://results/runs", **settings),  # type: ignore[arg-type]
        kube=KubeClient(login),  # type: ignore[arg-type]
        limiter=PatchLimiter(5.0),
        metrics=Metrics(),
    )


def test_build_job_is_the_exact_worker_job() -> None:
    rt = _runtime(store_secret="s3-creds", worker_image="reg/worker:1")
    spec = _spec(
        gpuClasses=["h100"],
        parallelism=3,
        gpusPerPod=2,
        queueName="gpus",
        priorityClassName="low",
        policies=[{"kind": "openai", "model": "m", "baseUrl": "http://vllm/v1", "apiKeySecret": "key"}],
    )
    plan = make_plan(namespace="ns", name="demo", uid=UID, spec=spec, tasks_total=5, max_indexes_per_job=2000)
    (shard,) = plan.shards
    job = build_job(rt, plan, shard, Owner("OptimizationJob", "demo", "ns", UID), parallelism=3)
    assert job["metadata"]["name"] == shard.job_name
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
    assert job["spec"]["suspend"] is True
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (5, 3)
    pod = job["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "low"
    (worker,) = pod["containers"]
    assert worker["image"] == "reg/worker:1"
    assert worker["command"] == [
        "kernelfleet", "worker", "--store", "s3://results/runs",
        "--prefix", f"optimizationjobs/ns/demo/{UID}",
        "--gpu-class", "h100", "--shard", "0", "--role", "search",
    ]  # fmt: skip
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    key = next(e for e in worker["env"] if e["name"] == "KERNELFLEET_OPENAI_API_KEY")
    assert key["valueFrom"] == {"secretKeyRef": {"name": "key", "key": "apiKey"}}


def _view(name: str, **fields: object) -> JobView:
    values: dict[str, object] = dict(
        name=name, role="search", gpu_class="h100", shard=0, completions=4, parallelism=2, suspend=False,
        active=0, ready=0, succeeded=0, failed_indexes=frozenset(), finished=None, reason="", deleting=False,
    )  # fmt: skip
    values.update(fields)
    return JobView(**values)  # type: ignore[arg-type]


def _outcome(
    index: int, speedup: float | None, ok: bool = True, role: Role = Role.SEARCH, **fields: object
) -> TaskOutcome:
    return TaskOutcome(
        task_hash=f"{index:064x}", task_name=f"t{index}", gpu_class=fields.pop("gpu_class", "h100"),
        role=role, ok=ok, best_speedup=speedup, variants=3, **fields,
    )  # fmt: skip


def test_fold_running_then_complete_with_counters_and_speedups() -> None:
    spec = _spec(gpuClasses=["h100"])
    plan = make_plan(namespace="ns", name="demo", uid=UID, spec=spec, tasks_total=4, max_indexes_per_job=2000)
    name = plan.shards[0].job_name
    outcomes = {f"k{i}": _outcome(i, s) for i, s in enumerate([1.5, 2.5])}
    running = fold_status(
        plan,
        {name: _view(name, active=2, ready=2, succeeded=2)},
        outcomes,
        suspended=False,
        missing_classes={},
        results_url="u",
    )
    assert running.status["phase"] == "Running"
    assert running.status["tasksDone"] == 2 and running.status["tasksTotal"] == 4
    assert running.status["perClass"]["h100"]["medianSpeedup"] == 2.0
    assert running.status["perClass"]["h100"]["activePods"] == 2
    assert "tasks" not in running.status["perClass"]["h100"]  # never a per-task list
    by_type = {c.type: c for c in running.conditions}
    assert by_type["Running"].status == "True" and by_type["Complete"].status == "False"

    outcomes["k2"] = _outcome(2, None)
    outcomes["k3"] = _outcome(3, None, ok=False, error="reference failed")
    done = fold_status(
        plan,
        {name: _view(name, succeeded=4, finished="Complete")},
        outcomes,
        suspended=False,
        missing_classes={},
        results_url="s3://b/x",
    )
    assert done.status["phase"] == "Succeeded"
    assert (done.status["tasksDone"], done.status["tasksFailed"], done.status["variantsEvaluated"]) == (
        3,
        1,
        12,
    )
    assert done.status["bestSpeedup"] == 2.5 and done.status["results"] == "s3://b/x"
    assert {c.type: c.status for c in done.conditions}["Complete"] == "True"


def test_fold_failed_indexes_suspension_missing_class_and_deadline() -> None:
    spec = _spec(gpuClasses=["h100"])
    plan = make_plan(namespace="ns", name="demo", uid=UID, spec=spec, tasks_total=4, max_indexes_per_job=2000)
    name = plan.shards[0].job_name
    failed = fold_status(
        plan,
        {name: _view(name, failed_indexes=frozenset({0, 1, 2, 3}), finished="Complete")},
        {},
        suspended=False,
        missing_classes={},
        results_url="u",
    )
    assert failed.status["phase"] == "Failed" and failed.status["tasksFailed"] == 4
    suspended = fold_status(
        plan,
        {name: _view(name, suspend=True)},
        {},
        suspended=True,
        missing_classes={"h100": "nvidia.com/gpu.product in (X)"},
        results_url="u",
    )
    by_type = {c.type: c for c in suspended.conditions}
    assert suspended.status["phase"] == "Suspended"
    assert by_type["Suspended"].status == "True"
    assert by_type["GpuClassUnavailable"].status == "True"
    assert (
        "h100" in by_type["GpuClassUnavailable"].message
        and "nvidia.com/gpu.product" in by_type["GpuClassUnavailable"].message
    )
    late = fold_status(
        plan,
        {name: _view(name, active=2, ready=2)},
        {},
        suspended=False,
        missing_classes={},
        results_url="u",
        deadline_exceeded=True,
    )
    assert late.status["phase"] == "Failed"
    assert {c.type: c.reason for c in late.conditions}["Failed"] == "DeadlineExceeded"


def test_the_deadline_counts_from_the_start_time() -> None:
    assert not deadline_passed("", 60)
    assert not deadline_passed("2026-01-01T00:00:00Z", None)
    start = 1767225600.0  # 2026-01-01T00:00:00Z
    assert not deadline_passed("2026-01-01T00:00:00Z", 60, now=start + 59)
    assert deadline_passed("2026-01-01T00:00:00Z", 60, now=start + 60)


def test_fold_verification_shows_how_speedups_carry_over() -> None:
    spec = _spec(gpuClasses=["h100"], verifyOn=["l40"])
    plan = make_plan(namespace="ns", name="demo", uid=UID, spec=spec, tasks_total=2, max_indexes_per_job=2000)
    search, verify = plan.shards
    outcomes = {
        "s0": _outcome(0, 2.0),
        "s1": _outcome(1, 4.0),
        "v0": _outcome(0, 1.0, role=Role.VERIFY, gpu_class="l40", verified=True, source_speedup=2.0),
    }
    views = {
        search.job_name: _view(search.job_name, finished="Complete"),
        verify.job_name: _view(verify.job_name, role="verify", gpu_class="l40", active=1, ready=1),
    }
    fold = fold_status(plan, views, outcomes, suspended=False, missing_classes={}, results_url="u")
    assert fold.status["phase"] == "Verifying"
    assert fold.status["verification"]["l40"]["medianRatio"] == 0.5
    assert fold.status["verification"]["l40"]["verified"] == 1


def test_index_reads_only_kernelfleet_jobs() -> None:
    body = {
        "metadata": {
            "name": "j", "namespace": "ns",
            "labels": {
                "kernelfleet.io/optimizationjob": "demo",
                "kernelfleet.io/owner-uid": UID,
                "kernelfleet.io/gpu-class": "h100",
            },
        },
        "spec": {"completions": 4, "parallelism": 2},
        "status": {"active": 1, "completedIndexes": "0,2-3", "failedIndexes": "1"},
    }  # fmt: skip
    import kopf

    found = index_jobs(kopf.Body(body))  # type: ignore[arg-type]
    assert found is not None
    ((key, view),) = found.items()
    assert key == ("ns", UID)
    assert (view.succeeded, view.failed_indexes, view.active) == (3, frozenset({1}), 1)
    assert index_jobs(kopf.Body({"metadata": {"name": "other", "labels": {}}})) is None


def test_an_ended_job_removed_by_its_ttl_is_neither_recreated_nor_forgotten(tmp_path: Path) -> None:
    from kernelfleet.operator.optimizationjob import _Memory, _record_ended

    store = open_store(tmp_path)
    plan = make_plan(
        namespace="ns", name="demo", uid=UID, spec=_spec(), tasks_total=5, max_indexes_per_job=2000
    )
    name = plan.shards[0].job_name
    ended = _view(name, succeeded=4, failed_indexes=frozenset({4}), completions=5, finished="Complete")
    first = _Memory(created={name: 1})
    assert _record_ended(store, plan, {name: ended}, first)[name] == ended
    # The Job is deleted (TTL) while the operator runs: the status keeps its counts.
    assert _record_ended(store, plan, {}, first)[name].succeeded == 4
    # After a restart, the record in the store stands for it.
    again = _record_ended(store, plan, {}, _Memory())[name]
    assert (again.finished, again.succeeded, again.failed_indexes) == ("Complete", 4, frozenset({4}))
    # A Job never seen ended is not invented.
    other = make_plan(
        namespace="ns", name="other", uid=UID, spec=_spec(), tasks_total=5, max_indexes_per_job=2000
    )
    assert _record_ended(store, other, {}, _Memory()) == {}


def _workload(job: str, *conditions: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"ownerReferences": [{"kind": "Job", "name": job}]},
        "status": {"conditions": list(conditions)},
    }


def test_admission_says_which_jobs_wait_and_why() -> None:
    pending = _workload(
        "a",
        {"type": "QuotaReserved", "status": "False", "reason": "Pending",
         "message": "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu"},
    )  # fmt: skip
    admitted = _workload("b", {"type": "Admitted", "status": "True", "reason": "Admitted"})
    waiting = admission_condition("gpus", ["a", "b", "c"], [pending, admitted, _workload("other")])
    assert (waiting.status, waiting.reason) == ("False", "Queued")
    assert "2 of 3 Job(s) wait in LocalQueue gpus" in waiting.message
    assert "Job a: couldn't assign flavors" in waiting.message and "nvidia.com/gpu" in waiting.message
    assert "Job c: Kueue has not made its Workload yet" in waiting.message
    evicted = _workload("a", {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by x"})
    assert admission_condition("gpus", ["a"], [evicted]).reason == "Evicted"
    running = admission_condition("gpus", ["b"], [admitted])
    assert (running.status, running.reason) == ("True", "Admitted")


def test_outcomes_are_read_incrementally_by_the_indexes_that_ended(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    spec = _spec(gpuClasses=["h100"], tasks=["kernelbench-v0:1:1-4"])
    tasks = resolve_tasks(spec, open_store)
    plan = make_plan(namespace="ns", name="inc", uid=UID, spec=spec, tasks_total=4, max_indexes_per_job=2000)
    _write_plan(store, plan, tasks)
    (shard,) = plan.shards
    for task in tasks[:2]:
        store.put_json(outcome_key(plan.prefix, Role.SEARCH, "h100", task.hash), _outcome_of(task))
    memory = _Memory()
    _read_outcomes(store, plan, {shard.job_name: _view(shard.job_name, completed_indexes="0-1")}, memory)
    assert len(memory.outcomes) == 2  # the first pass lists the folder once
    for task in tasks[2:]:
        store.put_json(outcome_key(plan.prefix, Role.SEARCH, "h100", task.hash), _outcome_of(task))
    listed: list[str] = []
    original = store.list

    def listing(prefix: str = "") -> Any:
        listed.append(prefix)
        return original(prefix)

    store.list = listing  # type: ignore[method-assign]
    _read_outcomes(store, plan, {shard.job_name: _view(shard.job_name, completed_indexes="0-1")}, memory)
    assert len(memory.outcomes) == 2  # nothing ended since: nothing read
    _read_outcomes(store, plan, {shard.job_name: _view(shard.job_name, completed_indexes="0-2")}, memory)
    assert len(memory.outcomes) == 3  # index 2 ended: its task's record, by key
    _read_outcomes(
        store,
        plan,
        {shard.job_name: _view(shard.job_name, completed_indexes="0-2", failed_indexes=frozenset({3}))},
        memory,
    )
    assert len(memory.outcomes) == 4 and listed == []


def _outcome_of(task: Any) -> TaskOutcome:
    return TaskOutcome(task_hash=task.hash, task_name=task.name, gpu_class="h100", ok=True, variants=1)
