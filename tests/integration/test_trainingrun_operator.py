"""The TrainingRun controller against a real kube-apiserver (etcd, no controllers, no nodes): the
operator runs as `kernelfleet operator` in its own process and the test plays the Job controller
and the trainer, setting each Job's and Deployment's status and writing the trainer's records
into a local store. What is checked is what the operator does: stage Jobs created one at a time
in order, the RL stage's evaluation service and its gating, suspend, status from the store,
validation naming the field, a spec change refused, and a SIGKILL with nothing duplicated."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.resources import GROUP, VERSION, TrainingStageStatus
from kernelfleet.core.store import open_store
from kernelfleet.core.training import TrainingLayout, read_run_record
from kernelfleet.operator._training_plan import RunRef
from tests._servers._process import wait_for
from tests.support.operator import OperatorProcess, apply_crds

PLURAL = "trainingruns"
WAIT_S = 60.0


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """The operator's store (a local one: this test plays the trainer that writes into it)."""
    return tmp_path / "store"


@pytest.fixture
def operator(kube: Any, store_dir: Path, tmp_path: Path) -> Iterator[OperatorProcess]:
    apply_crds(kube)
    process = OperatorProcess(
        kube.kubeconfig,
        kube.namespace,
        tmp_path / "operator",
        args=["--store", str(store_dir), "--trainer-image", "kernelfleet/trainer:test"],
    )
    process.start()
    yield process
    process.stop()


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "baseModel": "s3://models/tiny",
            "tasks": ["kernelbench-v0:1"],
            "stages": [{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
            "gpuClass": "h100",
            "rewardGpuClass": "l40",
            "rewardGpus": 2,
            **spec,
        },
    }


def create(kube: Any, body: dict[str, Any]) -> RunRef:
    made = kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, body)
    return RunRef(kube.namespace, made["metadata"]["name"], made["metadata"]["uid"])


def run_object(kube: Any, run: RunRef) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, run.name)


def status(kube: Any, run: RunRef) -> dict[str, Any]:
    return run_object(kube, run).get("status") or {}


def condition(kube: Any, run: RunRef, type_: str) -> dict[str, Any] | None:
    return next((c for c in status(kube, run).get("conditions") or [] if c["type"] == type_), None)


def jobs(kube: Any) -> dict[str, Any]:
    return {job.metadata.name: job for job in kube.batch.list_namespaced_job(kube.namespace).items}


def deployments(kube: Any) -> list[str]:
    from kubernetes import client

    items: list[Any] = client.AppsV1Api(kube.api_client).list_namespaced_deployment(kube.namespace).items
    return [d.metadata.name for d in items]


def services(kube: Any) -> list[str]:
    return [s.metadata.name for s in kube.core.list_namespaced_service(kube.namespace).items]


def finish_job(kube: Any, name: str, outcome: str = "Complete") -> None:
    """What the Job controller writes when the Job's pod succeeded (or its retries ran out)."""
    now = "2026-01-01T00:00:00Z"

    def condition(type_: str, reason: str, message: str = "") -> dict[str, str]:
        return {
            "type": type_,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastProbeTime": now,
            "lastTransitionTime": now,
        }

    status: dict[str, Any] = {"startTime": now, "active": 0, "ready": 0}
    if outcome == "Complete":
        status["completionTime"] = now
        status["succeeded"] = 1
        status["conditions"] = [
            condition("SuccessCriteriaMet", "CompletionsReached"),
            condition("Complete", "CompletionsReached"),
        ]
    else:
        status["failed"] = 4
        message = "Job has reached the specified backoff limit"
        status["conditions"] = [
            condition("FailureTarget", "BackoffLimitExceeded", message),
            condition("Failed", "BackoffLimitExceeded", message),
        ]
    kube.batch.patch_namespaced_job_status(name, kube.namespace, {"status": status})


def failed_pod(kube: Any, job: str, output: str) -> None:
    """A pod of `job` whose container exited 2, with `output` as its termination message."""
    from kubernetes.client.exceptions import ApiException

    try:
        kube.core.create_namespaced_service_account(kube.namespace, {"metadata": {"name": "default"}})
    except ApiException as error:
        if error.status != 409:
            raise
    pod = {
        "metadata": {"name": f"{job}-x1", "labels": {"job-name": job}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [{"name": "trainer", "image": "kernelfleet/trainer:test"}],
        },
    }
    kube.core.create_namespaced_pod(kube.namespace, pod)
    terminated = {"exitCode": 2, "reason": "Error", "message": output}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "trainer",
                "image": "kernelfleet/trainer:test",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": terminated},
            }
        ],
    }
    kube.core.patch_namespaced_pod_status(f"{job}-x1", kube.namespace, {"status": status})


def run_job(kube: Any, name: str) -> None:
    """The Job's pod is running and ready."""
    kube.batch.patch_namespaced_job_status(
        name, kube.namespace, {"status": {"startTime": "2026-01-01T00:00:00Z", "active": 1, "ready": 1}}
    )


def evaluator_ready(kube: Any, name: str) -> None:
    from kubernetes import client

    apps = client.AppsV1Api(kube.api_client)
    apps.patch_namespaced_deployment_status(
        name, kube.namespace, {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}}
    )


def test_stages_run_in_order_with_the_evaluator_gated_suspended_and_removed(
    kube: Any, operator: Any, store_dir: Path
) -> None:
    run = create(kube, manifest("coder"))
    sft, rl, evaluator = run.job_name("sft"), run.job_name("rl"), run.eval_name("rl")

    # The first stage only; the spec is recorded where the pods read it, with the service URL.
    found = wait_for("the sft Job", lambda: jobs(kube).get(sft), timeout=WAIT_S)
    assert list(jobs(kube)) == [sft] and found.spec.suspend is False
    command = found.spec.template.spec.containers[0].command
    assert command[:3] == ["kernelfleet", "train", "stage"] and run.prefix in command
    store = open_store(store_dir)
    layout = TrainingLayout(run.prefix)
    name, recorded = read_run_record(store, layout)
    assert name == "coder" and recorded.stages[1].reward is not None
    assert recorded.stages[1].reward.service_url == run.eval_url("rl")
    accepted = wait_for("Accepted", lambda: condition(kube, run, "Accepted"), timeout=WAIT_S)
    assert accepted["status"] == "True"

    # The trainer reports progress to the store; the status shows it.
    run_job(kube, sft)
    store.put_json(
        layout.status("sft", 1, 3),
        TrainingStageStatus(name="sft", phase="Running", step=3, max_steps=8, metrics={"loss": 1.5}),
    )

    def sft_running() -> dict[str, Any] | None:
        current = status(kube, run)
        stages = current.get("stages") or []
        # Both facts: a reconcile pass that listed the Jobs before run_job and read the store
        # after put_json reports step 3 of a Pending stage, until its next pass.
        running = stages and stages[0].get("step") == 3 and current.get("phase") == "Running"
        return current if running else None

    current = wait_for("the sft stage's step in the status", sft_running, timeout=WAIT_S)
    assert current["phase"] == "Running" and current["currentStage"] == "sft"
    assert current["stages"][0]["metrics"] == {"loss": 1.5} and current["stages"][1]["phase"] == "Pending"

    # The operator dies mid-run and comes back: nothing is made twice.
    operator.kill()
    finish_job(kube, sft)
    operator.start()

    # The RL stage: its evaluator first, its Job suspended until the evaluator is ready.
    wait_for("the rl Job", lambda: jobs(kube).get(rl), timeout=WAIT_S)
    assert sorted(jobs(kube)) == sorted([sft, rl])
    assert jobs(kube)[rl].spec.suspend is True
    assert deployments(kube) == [evaluator] and services(kube) == [evaluator]
    secret = kube.core.read_namespaced_secret(run.eval_token_name("rl"), kube.namespace)
    assert "token" in secret.data
    evaluator_ready(kube, evaluator)
    wait_for("the rl Job released", lambda: jobs(kube)[rl].spec.suspend is False, timeout=WAIT_S)
    run_job(kube, rl)

    # Suspend frees every GPU: the Job is suspended and the evaluator removed.
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"suspend": True}}
    )
    wait_for("the rl Job suspended", lambda: jobs(kube)[rl].spec.suspend is True, timeout=WAIT_S)
    wait_for("the evaluator removed", lambda: not deployments(kube) and not services(kube), timeout=WAIT_S)
    wait_for("phase Suspended", lambda: status(kube, run).get("phase") == "Suspended", timeout=WAIT_S)
    assert (condition(kube, run, "Suspended") or {}).get("status") == "True"

    # Resuming brings the evaluator back and holds the Job until it is ready.
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"suspend": False}}
    )
    wait_for("the evaluator back", lambda: deployments(kube) == [evaluator], timeout=WAIT_S)
    assert jobs(kube)[rl].spec.suspend is True
    evaluator_ready(kube, evaluator)
    wait_for("the rl Job resumed", lambda: jobs(kube)[rl].spec.suspend is False, timeout=WAIT_S)

    # The last stage completes: the evaluator goes, the run is Complete.
    finish_job(kube, rl)
    wait_for("phase Succeeded", lambda: status(kube, run).get("phase") == "Succeeded", timeout=WAIT_S)
    assert not deployments(kube) and not services(kube)
    final = status(kube, run)
    assert final["stagesDone"] == 2 and [s["phase"] for s in final["stages"]] == ["Succeeded", "Succeeded"]
    assert (condition(kube, run, "Complete") or {}).get("status") == "True"
    assert (condition(kube, run, "Running") or {}).get("status") == "False"
    assert sorted(jobs(kube)) == sorted([sft, rl])

    # Everything the run made is owned by it, so deleting the run deletes it (the garbage
    # collector, which this control plane does not run, does the deleting: see the e2e test).
    for job in jobs(kube).values():
        assert [(o.kind, o.uid) for o in job.metadata.owner_references] == [("TrainingRun", run.uid)]
    token = kube.core.read_namespaced_secret(run.eval_token_name("rl"), kube.namespace)
    assert [(o.kind, o.uid) for o in token.metadata.owner_references] == [("TrainingRun", run.uid)]


def test_a_failed_stage_fails_the_run_and_the_next_stage_never_starts(kube: Any, operator: Any) -> None:
    run = create(kube, manifest("fails", rewardGpus=0))
    sft = run.job_name("sft")
    wait_for("the sft Job", lambda: jobs(kube).get(sft), timeout=WAIT_S)
    # The stage's pod failed with a usage error; the kubelet kept the end of its log.
    error = "kernelfleet train: every task of fails is held out; select more tasks or lower heldOut.fraction"
    failed_pod(kube, sft, error)
    finish_job(kube, sft, "Failed")
    wait_for("phase Failed", lambda: status(kube, run).get("phase") == "Failed", timeout=WAIT_S)
    failed = condition(kube, run, "Failed")
    assert failed is not None and failed["status"] == "True"
    assert "stage 1/2 sft failed: Job has reached the specified backoff limit" in failed["message"]
    assert f"its last output: {error}" in failed["message"]
    assert status(kube, run)["stages"][0]["phase"] == "Failed"
    assert list(jobs(kube)) == [sft]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"gpuClass": "b200"}, "spec.gpuClass: no GPU pool class 'b200'"),
        ({"rewardGpuClass": "tpu"}, "spec.rewardGpuClass: no GPU pool class 'tpu'"),
        (
            {"stages": [{"name": "rl", "type": "grpo", "reward": {"tokenSecret": "missing"}}]},
            "spec.stages[0].reward.tokenSecret: no Secret 'missing'",
        ),
    ],
)
def test_what_the_schema_cannot_check_is_refused_naming_the_field(
    kube: Any, operator: Any, spec: dict[str, Any], field: str
) -> None:
    run = create(kube, manifest("invalid", **spec))
    accepted = wait_for("Accepted", lambda: condition(kube, run, "Accepted"), timeout=WAIT_S)
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert field in accepted["message"]
    assert not jobs(kube)


def test_a_spec_changed_after_the_start_is_not_applied(kube: Any, operator: Any, store_dir: Path) -> None:
    run = create(kube, manifest("frozen", rewardGpus=0))
    sft = run.job_name("sft")
    wait_for("the sft Job", lambda: jobs(kube).get(sft), timeout=WAIT_S)
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"baseModel": "s3://models/other"}}
    )

    def ignored() -> bool:
        accepted = condition(kube, run, "Accepted") or {}
        return accepted.get("reason") == "SpecChangeIgnored"

    wait_for("the change to be refused", ignored, timeout=WAIT_S)
    accepted = condition(kube, run, "Accepted") or {}
    assert accepted["status"] == "True" and "create a new TrainingRun" in accepted["message"]
    _, recorded = read_run_record(open_store(store_dir), TrainingLayout(run.prefix))
    assert recorded.base_model == "s3://models/tiny"
    assert list(jobs(kube)) == [sft]


def test_a_store_it_cannot_write_is_reported_in_a_condition(kube: Any, tmp_path: Path) -> None:
    apply_crds(kube)
    not_a_directory = tmp_path / "store-file"
    not_a_directory.write_text("this is a file, not a store")
    process = OperatorProcess(
        kube.kubeconfig, kube.namespace, tmp_path / "operator", args=["--store", str(not_a_directory)]
    )
    with process:
        run = create(kube, manifest("nostore", rewardGpus=0))
        error = wait_for("ReconcileError", lambda: condition(kube, run, "ReconcileError"), timeout=WAIT_S)
    assert error["status"] == "True"
    assert f"the store {not_a_directory} is a file, not a directory" in error["message"]
    assert not jobs(kube)
