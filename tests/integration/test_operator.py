"""The operator against a real kube-apiserver (and MinIO): the CRDs refuse bad specs, the
operator writes the plan and creates exactly the planned Jobs, survives SIGKILL without
duplicating anything, suspends and resumes, and reports what it cannot do in conditions.

There is no controller-manager in this tier, so no pods: Job status is written by the test
where a test needs it, exactly as the Job controller would write it.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.jobplan import JobPlan, Role, TaskOutcome, job_prefix, outcome_key, plan_key
from kernelfleet.core.store import open_store
from kernelfleet.core.tasks import load_tasks
from tests._servers._process import wait_for
from tests.support.operator import (
    GROUP,
    VERSION,
    OperatorProcess,
    apply_crds,
    condition,
    create,
    jobs_of,
    optimization_job,
    read,
    settle,
    store_secret,
    wait_condition,
)

WAIT_S = 90.0


@pytest.fixture
def operator(kube: Any, minio: Any, tmp_path: Path) -> Any:
    apply_crds(kube)
    store_secret(kube, "kernelfleet-store", minio)
    process = OperatorProcess(
        kube.kubeconfig,
        kube.namespace,
        tmp_path / "operator",
        env=minio.config(),
        args=[
            "--store",
            f"s3://{minio.bucket}/kf",
            "--store-secret",
            "kernelfleet-store",
            "--max-indexes-per-job=3",
        ],
    )
    process.start()
    yield process
    process.stop()


def _store(minio: Any) -> Any:
    return open_store(f"s3://{minio.bucket}/kf", StoreConfig.from_env(minio.config()))


def _plan(minio: Any, resource: dict[str, Any]) -> JobPlan:
    meta = resource["metadata"]
    prefix = job_prefix(meta["namespace"], meta["name"], meta["uid"])
    return JobPlan.model_validate(_store(minio).get_json(plan_key(prefix)))


def test_the_schema_refuses_bad_specs_naming_the_field(kube: Any) -> None:
    apply_crds(kube)
    bad = optimization_job(
        "bad",
        tasks=["kernelbench-v0:1:1"],
        gpuClasses=["h100"],
        verifyOn=["L40!"],
        tasksPerIndex=0,
        queueName="q" * 64,
    )
    with pytest.raises(ApiException) as caught:
        create(kube, bad)
    assert caught.value.status == 422
    for field in ("spec.verifyOn[0]", "spec.tasksPerIndex", "spec.queueName"):
        assert field in str(caught.value.body)


def test_operator_plans_and_creates_exactly_the_planned_jobs(operator: Any, kube: Any, minio: Any) -> None:
    create(
        kube,
        optimization_job(
            "five",
            tasks=["kernelbench-v0:1:1-5"],
            gpuClasses=["h100", "a100"],
            parallelism=2,
            priorityClassName="",
            ttlSecondsAfterFinished=3600,
        ),
    )
    resource = wait_condition(kube, "five", "Accepted", timeout=WAIT_S)
    plan = _plan(minio, resource)
    assert plan.tasks_total == 5
    # Five tasks, three indexes per Job at most: two shards per class. The class's two pods all
    # go to its first shard, so only the first shard's Job exists yet: the second is created
    # once the first needs fewer pods (a Job's parallelism is never changed after creation).
    assert len(plan.shards) == 4
    expected = {s.job_name for s in plan.shards if s.number == 0}

    def all_jobs() -> list[Any]:
        jobs = jobs_of(kube, "five")
        return jobs if {j.metadata.name for j in jobs} == expected else []

    jobs = wait_for("the planned Jobs", all_jobs, timeout=WAIT_S)
    uid = resource["metadata"]["uid"]
    for job in jobs:
        (owner,) = job.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid, owner.controller) == ("OptimizationJob", "five", uid, True)
        assert job.spec.completion_mode == "Indexed"
        assert job.spec.parallelism == 2
        # The TTL applies to the resource, which deletes its Jobs with it.
        assert job.spec.ttl_seconds_after_finished is None
        pod = job.spec.template.spec
        assert pod.automount_service_account_token is False
        assert pod.containers[0].security_context.read_only_root_filesystem is True
        assert pod.containers[0].resources.requests == {"cpu": "2", "memory": "8Gi"}
        gpu_class = job.metadata.labels["kernelfleet.io/gpu-class"]
        assert job.spec.template.metadata.labels["kernelfleet.io/gpu-class"] == gpu_class
    assert resource["status"]["results"].endswith(f"kf/{job_prefix(kube.namespace, 'five', uid)}")


def test_a_spec_the_operator_cannot_run_is_reported_in_conditions(operator: Any, kube: Any) -> None:
    create(kube, optimization_job("nopool", tasks=["kernelbench-v0:1:1"], gpuClasses=["h100", "b200"]))
    resource = wait_condition(kube, "nopool", "Accepted", status="False", timeout=WAIT_S)
    accepted = condition(resource, "Accepted")
    assert accepted is not None and accepted["reason"] == "InvalidSpec"
    assert "spec.gpuClasses[1]" in accepted["message"] and "b200" in accepted["message"]
    assert resource["status"]["phase"] == "Failed"
    create(
        kube,
        optimization_job(
            "nokey",
            tasks=["kernelbench-v0:1:1"],
            policies=[{"kind": "openai", "model": "m", "baseUrl": "http://x/v1", "apiKeySecret": "absent"}],
        ),
    )
    resource = wait_condition(kube, "nokey", "Accepted", status="False", timeout=WAIT_S)
    assert "spec.policies[0].apiKeySecret" in condition(resource, "Accepted")["message"]  # type: ignore[index]
    assert jobs_of(kube, "nopool") == [] and jobs_of(kube, "nokey") == []


def test_sigkill_mid_job_and_restart_converges_with_no_duplicate(
    operator: Any, kube: Any, minio: Any
) -> None:
    for name in ("k1", "k2", "k3"):
        create(kube, optimization_job(name, tasks=["kernelbench-v0:1:1-7"], gpuClasses=["h100", "l40"]))
    wait_for(
        "a first Job",
        lambda: jobs_of(kube, "k1") or jobs_of(kube, "k2") or jobs_of(kube, "k3"),
        timeout=WAIT_S,
    )
    operator.kill()
    operator.start()
    for name in ("k1", "k2", "k3"):
        resource = wait_condition(kube, name, "Accepted", timeout=WAIT_S)
        shards = _plan(minio, resource).shards
        assert len(shards) == 6  # 7 tasks, 3 indexes a Job, 2 classes
        # One pod per class: each class's first shard has it, the others wait for it.
        expected = sorted(s.job_name for s in shards if s.number == 0)

        def complete(name: str = name, expected: list[str] = expected) -> bool:
            return sorted(j.metadata.name for j in jobs_of(kube, name)) == expected

        wait_for(f"{name}'s Jobs after the restart", complete, timeout=WAIT_S)
    # Nothing twice: each Job once (names are unique in a namespace, and no other names appear),
    # one plan per resource.
    store = _store(minio)
    plans = [k for k in store.list("optimizationjobs/") if k.endswith("/plan.json")]
    assert len([p for p in plans if f"/{kube.namespace}/" in p]) == 3
    assert len(kube.batch.list_namespaced_job(kube.namespace).items) == 6
    assert operator.starts == 2


def test_suspend_and_resume_reach_the_jobs(operator: Any, kube: Any) -> None:
    create(kube, optimization_job("pausable", tasks=["kernelbench-v0:1:1-2"], gpuClasses=["h100"]))
    wait_for("the Job", lambda: jobs_of(kube, "pausable"), timeout=WAIT_S)
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", "pausable", {"spec": {"suspend": True}}
    )
    wait_for("suspended Jobs", lambda: all(j.spec.suspend for j in jobs_of(kube, "pausable")), timeout=WAIT_S)
    resource = wait_condition(kube, "pausable", "Suspended", timeout=WAIT_S)
    assert resource["status"]["phase"] == "Suspended"
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", "pausable", {"spec": {"suspend": False}}
    )
    wait_for(
        "resumed Jobs", lambda: not any(j.spec.suspend for j in jobs_of(kube, "pausable")), timeout=WAIT_S
    )
    wait_condition(kube, "pausable", "Suspended", status="False", timeout=WAIT_S)


def test_kueue_jobs_are_created_suspended_with_the_queue_label(operator: Any, kube: Any) -> None:
    create(
        kube, optimization_job("queued", tasks=["kernelbench-v0:1:1"], gpuClasses=["h100"], queueName="gpus")
    )
    (job,) = wait_for("the Job", lambda: jobs_of(kube, "queued"), timeout=WAIT_S)
    assert job.spec.suspend is True
    assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "gpus"
    # No Kueue on this API server: the admission condition says so, naming the field.
    resource = wait_condition(kube, "queued", "Admitted", status="False", timeout=WAIT_S)
    admitted = condition(resource, "Admitted") or {}
    assert admitted["reason"] == "KueueNotInstalled" and "spec.queueName" in admitted["message"]


def test_a_child_job_deleted_while_running_is_created_again(operator: Any, kube: Any) -> None:
    create(kube, optimization_job("again", tasks=["kernelbench-v0:1:1-2"], gpuClasses=["h100"]))
    (first,) = wait_for("the Job", lambda: jobs_of(kube, "again"), timeout=WAIT_S)
    # As kubectl deletes (background propagation: no garbage collector runs in this tier to
    # take an orphan finalizer off).
    kube.batch.delete_namespaced_job(first.metadata.name, kube.namespace, propagation_policy="Background")
    (second,) = wait_for(
        "the Job created again",
        lambda: [j for j in jobs_of(kube, "again") if j.metadata.uid != first.metadata.uid],
        timeout=WAIT_S,
    )
    assert second.metadata.name == first.metadata.name


def test_the_deadline_bounds_the_whole_job(operator: Any, kube: Any) -> None:
    create(
        kube,
        optimization_job(
            "late", tasks=["kernelbench-v0:1:1-2"], gpuClasses=["h100"], activeDeadlineSeconds=3
        ),
    )
    wait_for("the Job", lambda: jobs_of(kube, "late"), timeout=WAIT_S)
    resource = wait_condition(kube, "late", "Failed", timeout=WAIT_S)
    failed = condition(resource, "Failed") or {}
    assert failed["reason"] == "DeadlineExceeded" and "spec.activeDeadlineSeconds" in failed["message"]
    assert resource["status"]["phase"] == "Failed" and resource["status"]["completionTime"]
    # Its Jobs are deleted (no garbage collector runs in this tier: their pods would go with them).
    wait_for("the Jobs to be deleted", lambda: not jobs_of(kube, "late"), timeout=WAIT_S)


def test_a_finished_job_is_no_longer_reconciled_and_its_ttl_deletes_it(
    operator: Any, kube: Any, minio: Any
) -> None:
    create(kube, optimization_job("brief", tasks=["kernelbench-v0:1:1"], gpuClasses=["h100"]))
    (job,) = wait_for("the Job", lambda: jobs_of(kube, "brief"), timeout=WAIT_S)
    _complete(kube, job.metadata.name, 1)
    done = wait_condition(kube, "brief", "Complete", timeout=WAIT_S)
    passes = _reconciles(operator)
    settle(4.0)  # four status intervals of this operator: a running job would be reconciled four times
    assert _reconciles(operator) == passes
    assert read(kube, "brief")["metadata"]["resourceVersion"] == done["metadata"]["resourceVersion"]
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", "brief", {"spec": {"ttlSecondsAfterFinished": 1}}
    )

    def gone() -> bool:
        try:
            read(kube, "brief")
        except ApiException as error:
            return error.status == 404
        return False

    wait_for("the resource to be deleted after its TTL", gone, timeout=WAIT_S)


def _reconciles(operator: Any) -> float:
    for line in operator.metrics().splitlines():
        if line.startswith("kernelfleet_operator_reconciles_total") and 'kind="OptimizationJob"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _complete(kube: Any, job_name: str, indexes: int) -> None:
    """What the Job controller writes when every index succeeded."""
    now = "2026-12-01T00:00:00Z"
    kube.batch.patch_namespaced_job_status(
        job_name,
        kube.namespace,
        {
            "status": {
                "startTime": now,
                "completionTime": now,
                "succeeded": indexes,
                "completedIndexes": f"0-{indexes - 1}" if indexes > 1 else "0",
                "conditions": [
                    {
                        "type": "SuccessCriteriaMet",
                        "status": "True",
                        "lastProbeTime": now,
                        "lastTransitionTime": now,
                    },
                    {"type": "Complete", "status": "True", "lastProbeTime": now, "lastTransitionTime": now},
                ],
            }
        },
    )


def test_status_folds_job_status_and_outcomes_into_complete(operator: Any, kube: Any, minio: Any) -> None:
    create(
        kube, optimization_job("fold", tasks=["kernelbench-v0:1:1-2"], gpuClasses=["h100"], verifyOn=["l40"])
    )
    resource = wait_condition(kube, "fold", "Accepted", timeout=WAIT_S)
    plan = _plan(minio, resource)
    (job,) = wait_for("the search Job", lambda: jobs_of(kube, "fold"), timeout=WAIT_S)
    assert job.metadata.labels["kernelfleet.io/role"] == "search"
    store = _store(minio)
    for task, speedup in zip(load_tasks("kernelbench-v0:1:1-2"), (1.5, 3.0), strict=True):
        outcome = TaskOutcome(
            task_hash=task.hash,
            task_name=task.name,
            gpu_class="h100",
            ok=True,
            best_speedup=speedup,
            variants=4,
        )
        store.put_json(outcome_key(plan.prefix, Role.SEARCH, "h100", task.hash), outcome)
    _complete(kube, job.metadata.name, 2)
    # The search ended: one small Job re-verifies the best variants on the verifyOn class.
    verify_job = wait_for(
        "the verification Job",
        lambda: [j for j in jobs_of(kube, "fold") if j.metadata.labels["kernelfleet.io/role"] == "verify"],
        timeout=WAIT_S,
    )[0]
    assert verify_job.metadata.labels["kernelfleet.io/gpu-class"] == "l40"
    assert "--role" in verify_job.spec.template.spec.containers[0].command
    assert wait_for(
        "the phase Verifying", lambda: read(kube, "fold")["status"]["phase"] == "Verifying", WAIT_S
    )
    for task, ratio in zip(load_tasks("kernelbench-v0:1:1-2"), (0.5, 1.0), strict=True):
        searched = 1.5 if task.task_id == 1 else 3.0
        outcome = TaskOutcome(
            task_hash=task.hash, task_name=task.name, gpu_class="l40", role=Role.VERIFY, ok=True,
            best_speedup=searched * ratio, verified=True, source_class="h100", source_speedup=searched,
        )  # fmt: skip
        store.put_json(outcome_key(plan.prefix, Role.VERIFY, "l40", task.hash), outcome)
    _complete(kube, verify_job.metadata.name, verify_job.spec.completions)
    resource = wait_condition(kube, "fold", "Complete", timeout=WAIT_S)
    status = resource["status"]
    assert status["phase"] == "Succeeded"
    assert (
        status["tasksTotal"],
        status["tasksDone"],
        status["tasksFailed"],
        status["variantsEvaluated"],
    ) == (2, 2, 0, 8)
    assert status["perClass"]["h100"]["bestSpeedup"] == 3.0
    assert status["perClass"]["h100"]["medianSpeedup"] == 2.25
    assert status["observedGeneration"] == resource["metadata"]["generation"]
    assert status["verification"]["l40"]["verified"] == 2
    assert status["verification"]["l40"]["medianRatio"] == 0.75
    # kopf posts events from a queue of its own, which may commit after the status patch.
    wait_for(
        "the AllTasksEnded event",
        lambda: any(
            e.reason == "AllTasksEnded"
            for e in kube.core.list_namespaced_event(
                kube.namespace, field_selector="involvedObject.name=fold"
            ).items
        ),
        timeout=WAIT_S,
    )
    assert "kernelfleet_operator_status_patches_total" in operator.metrics()
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=10) as response:
        assert response.status == 200


def test_a_second_operator_pauses_while_the_first_runs(kube: Any, minio: Any, tmp_path: Path) -> None:
    """kopf peering: with its CRDs applied, operators record keep-alives in the peering object
    the first one creates; one of lower priority pauses and leaves every resource alone."""
    apply_crds(kube, ("optimizationjobs.yaml", "kopf-kopfpeerings.yaml", "kopf-clusterkopfpeerings.yaml"))
    store_secret(kube, "kernelfleet-store", minio)
    common = {"env": minio.config(), "standalone": False}
    args = ["--store", f"s3://{minio.bucket}/kf", "--store-secret", "kernelfleet-store"]
    first = OperatorProcess(
        kube.kubeconfig, kube.namespace, tmp_path, name="first", args=[*args, "--priority=100"], **common
    )
    second = OperatorProcess(
        kube.kubeconfig, kube.namespace, tmp_path, name="second", args=[*args, "--priority=1"], **common
    )
    with first:
        peering = wait_for(
            "the peering object",
            lambda: _get_peering(kube),
            timeout=WAIT_S,
        )
        assert peering["metadata"]["name"] == "kernelfleet"
        with second:
            wait_for("the second operator to pause", lambda: "Pausing" in second.log(), timeout=WAIT_S)
            create(kube, optimization_job("peered", tasks=["kernelbench-v0:1:1"], gpuClasses=["h100"]))
            wait_condition(kube, "peered", "Accepted", timeout=WAIT_S)
            assert len(jobs_of(kube, "peered")) == 1
        assert "Pausing" not in first.log()


def _get_peering(kube: Any) -> Any:
    try:
        return kube.custom.get_namespaced_custom_object(
            "kopf.dev", "v1", kube.namespace, "kopfpeerings", "kernelfleet"
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def test_an_operator_whose_port_was_taken_starts_again_on_new_ones(kube: Any, tmp_path: Path) -> None:
    """A port from `free_port` is only free until someone binds it: an operator that lost its
    liveness port to another process exits, and the test harness starts it again on new ports
    instead of leaving a test to wait out its timeout."""
    import socket

    process = OperatorProcess(kube.kubeconfig, kube.namespace, tmp_path / "operator")
    lost = process.health_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", lost))
        squatter.listen()
        process.start()
    try:
        assert process.health_port != lost
        assert "address already in use" in process.log()
        with urllib.request.urlopen(f"http://127.0.0.1:{process.health_port}/healthz", timeout=5) as answer:
            assert answer.status == 200
        assert process.starts == 1  # one start asked for, however many launches it took
    finally:
        process.stop()
