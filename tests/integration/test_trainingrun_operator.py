"""The TrainingRun controller against a real kube-apiserver (etcd, no controllers, no nodes) with
JobSet's CRD from its module: the operator runs as `kernelfleet operator` in its own process and
the test plays the JobSet controller and the trainer, setting each JobSet's status and writing
the trainer's records into a local store. What is checked is what the operator does: stage
JobSets created one at a time in order, the RL stage's roles and token, suspend, status from the
store, validation naming the field (the old `gpus` refused at admission), a spec change refused
at admission, the run's end (TTL, deadline), and a SIGKILL with nothing duplicated. The JobSet
controller's own part runs in the e2e tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.resources import GROUP, VERSION, TrainingStageStatus
from kernelfleet.core.store import open_store
from kernelfleet.core.training import TrainingLayout, read_run_record
from kernelfleet.operator._training_plan import RunRef
from kernelfleet.operator.devcluster._jobset import install_crds
from tests._servers._process import wait_for
from tests.support.operator import OperatorProcess, apply_crds
from tests.support.operator import training_run as manifest

PLURAL = "trainingruns"
WAIT_S = 60.0


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """The operator's store (a local one: this test plays the trainer that writes into it)."""
    return tmp_path / "store"


@pytest.fixture
def operator(kube: Any, store_dir: Path, tmp_path: Path) -> Iterator[OperatorProcess]:
    apply_crds(kube)
    install_crds(kube.api_client)
    process = OperatorProcess(
        kube.kubeconfig,
        kube.namespace,
        tmp_path / "operator",
        args=["--store", str(store_dir), "--trainer-image", "kernelfleet/trainer:test"],
    )
    process.start()
    yield process
    process.stop()


def create(kube: Any, body: dict[str, Any]) -> RunRef:
    made = kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, body)
    return RunRef(kube.namespace, made["metadata"]["name"], made["metadata"]["uid"])


def run_object(kube: Any, run: RunRef) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, run.name)


def status(kube: Any, run: RunRef) -> dict[str, Any]:
    return run_object(kube, run).get("status") or {}


def condition(kube: Any, run: RunRef, type_: str) -> dict[str, Any] | None:
    return next((c for c in status(kube, run).get("conditions") or [] if c["type"] == type_), None)


JOBSET = ("jobset.x-k8s.io", "v1alpha2")


def jobsets(kube: Any) -> dict[str, Any]:
    listed = kube.custom.list_namespaced_custom_object(*JOBSET, kube.namespace, "jobsets")
    return {item["metadata"]["name"]: item for item in listed["items"]}


def set_status(kube: Any, name: str, status: dict[str, Any]) -> None:
    """What the JobSet controller writes (the test plays it)."""
    kube.custom.patch_namespaced_custom_object_status(
        *JOBSET, kube.namespace, "jobsets", name, {"status": {"restarts": 0, **status}}
    )


def finish(kube: Any, name: str, outcome: str = "Completed") -> None:
    now = "2026-01-01T00:00:00Z"
    message = (
        "jobset completed successfully"
        if outcome == "Completed"
        else "jobset failed due to reaching max number of restarts"
    )
    reason = "AllJobsCompleted" if outcome == "Completed" else "ReachedMaxRestarts"
    condition = {
        "type": outcome,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    }
    set_status(kube, name, {"terminalState": outcome, "conditions": [condition]})


def run_trainer(kube: Any, name: str, restarts: int = 0) -> None:
    """Every trainer pod runs and is ready."""
    rjob = {"name": "trainer", "ready": 1, "succeeded": 0, "failed": 0, "active": 1, "suspended": 0}
    set_status(kube, name, {"restarts": restarts, "replicatedJobsStatus": [rjob]})


def failed_pod(kube: Any, jobset: str, output: str) -> None:
    """A trainer pod of `jobset` whose container exited 2, with `output` as its termination message."""
    from kubernetes.client.exceptions import ApiException

    try:
        kube.core.create_namespaced_service_account(kube.namespace, {"metadata": {"name": "default"}})
    except ApiException as error:
        if error.status != 409:
            raise
    labels = {"jobset.sigs.k8s.io/jobset-name": jobset, "jobset.sigs.k8s.io/replicatedjob-name": "trainer"}
    pod: dict[str, Any] = {
        "metadata": {"name": f"{jobset}-trainer-0-0-x1", "labels": labels},
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
    kube.core.patch_namespaced_pod_status(pod["metadata"]["name"], kube.namespace, {"status": status})


def roles(jobset: dict[str, Any]) -> list[str]:
    return [job["name"] for job in jobset["spec"]["replicatedJobs"]]


def test_stages_run_in_order_each_one_jobset_suspended_and_resumed(
    kube: Any, operator: Any, store_dir: Path
) -> None:
    run = create(kube, manifest("coder", generatorGpus=2))
    sft, rl = run.jobset_name("sft"), run.jobset_name("rl")

    # The first stage only; the spec is recorded where the pods read it, with the services' URLs.
    found = wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    assert list(jobsets(kube)) == [sft] and found["spec"]["suspend"] is False
    assert roles(found) == ["trainer"]
    command = found["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert command[:3] == ["kernelfleet", "train", "stage"] and run.prefix in command
    store = open_store(store_dir)
    layout = TrainingLayout(run.prefix)
    name, recorded = read_run_record(store, layout)
    assert name == "coder" and recorded.stages[1].reward is not None
    assert recorded.stages[1].reward.service_url == run.eval_url("rl")
    assert recorded.stages[1].grpo is not None
    assert recorded.stages[1].grpo.vllm_server_base_url == run.generator_url("rl")
    accepted = wait_for("Accepted", lambda: condition(kube, run, "Accepted"), timeout=WAIT_S)
    assert accepted["status"] == "True"

    # The trainer reports progress to the store; the status shows it.
    run_trainer(kube, sft)
    store.put_json(
        layout.status("sft", 1, 3),
        TrainingStageStatus(name="sft", phase="Running", step=3, max_steps=8, metrics={"loss": 1.5}),
    )

    def sft_running() -> dict[str, Any] | None:
        current = status(kube, run)
        stages = current.get("stages") or []
        # Both facts: a reconcile pass that listed the JobSets before run_trainer and read the
        # store after put_json reports step 3 of a Pending stage, until its next pass.
        running = stages and stages[0].get("step") == 3 and current.get("phase") == "Running"
        return current if running else None

    current = wait_for("the sft stage's step in the status", sft_running, timeout=WAIT_S)
    assert current["phase"] == "Running" and current["currentStage"] == "sft"
    assert current["stages"][0]["metrics"] == {"loss": 1.5} and current["stages"][1]["phase"] == "Pending"

    # A restart after a failed pod shows in the stage's message.
    run_trainer(kube, sft, restarts=1)
    wait_for(
        "the restart in the status",
        lambda: "restarted 1 time(s)" in (status(kube, run).get("stages") or [{}])[0].get("message", ""),
        timeout=WAIT_S,
    )

    # The operator dies mid-run and comes back: nothing is made twice.
    operator.kill()
    finish(kube, sft)
    operator.start()

    # The RL stage: one JobSet with the evaluator, the generator and the trainer, and a token.
    wait_for("the rl JobSet", lambda: jobsets(kube).get(rl), timeout=WAIT_S)
    assert sorted(jobsets(kube)) == sorted([sft, rl])
    assert roles(jobsets(kube)[rl]) == ["reward", "generator", "trainer"]
    assert jobsets(kube)[rl]["spec"]["suspend"] is False
    secret = kube.core.read_namespaced_secret(run.eval_token_name("rl"), kube.namespace)
    assert "token" in secret.data
    run_trainer(kube, rl)

    # Suspend frees every GPU: the JobSet (every role) is suspended.
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"suspend": True}}
    )
    wait_for("the rl JobSet suspended", lambda: jobsets(kube)[rl]["spec"]["suspend"] is True, timeout=WAIT_S)
    wait_for("phase Suspended", lambda: status(kube, run).get("phase") == "Suspended", timeout=WAIT_S)
    assert (condition(kube, run, "Suspended") or {}).get("status") == "True"

    # Resuming resumes it.
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"suspend": False}}
    )
    wait_for("the rl JobSet resumed", lambda: jobsets(kube)[rl]["spec"]["suspend"] is False, timeout=WAIT_S)

    # The last stage completes: the run is Complete.
    finish(kube, rl)
    wait_for("phase Succeeded", lambda: status(kube, run).get("phase") == "Succeeded", timeout=WAIT_S)
    final = status(kube, run)
    assert final["stagesDone"] == 2 and [s["phase"] for s in final["stages"]] == ["Succeeded", "Succeeded"]
    assert (condition(kube, run, "Complete") or {}).get("status") == "True"
    assert (condition(kube, run, "Running") or {}).get("status") == "False"
    assert sorted(jobsets(kube)) == sorted([sft, rl])

    # Everything the run made is owned by it, so deleting the run deletes it (the garbage
    # collector, which this control plane does not run, does the deleting: see the e2e test).
    for jobset in jobsets(kube).values():
        owners = [(o["kind"], o["uid"]) for o in jobset["metadata"]["ownerReferences"]]
        assert owners == [("TrainingRun", run.uid)]
    token = kube.core.read_namespaced_secret(run.eval_token_name("rl"), kube.namespace)
    assert [(o.kind, o.uid) for o in token.metadata.owner_references] == [("TrainingRun", run.uid)]


def test_a_queued_run_waits_for_kueue_and_a_suspended_one_gives_its_jobset_back(
    kube: Any, operator: Any
) -> None:
    run = create(kube, manifest("queued", rewardGpus=0, queueName="team-a"))
    sft = run.jobset_name("sft")
    found = wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    assert found["spec"]["suspend"] is True
    assert found["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"

    def waiting() -> bool:
        current = status(kube, run)
        return current.get("phase") == "Pending" and "waiting for Kueue" in str(current.get("conditions"))

    wait_for("the run to say it is queued", waiting, timeout=WAIT_S)
    # Kueue admits it by resuming it; the operator leaves `suspend` to Kueue.
    kube.custom.patch_namespaced_custom_object(
        *JOBSET, kube.namespace, "jobsets", sft, {"spec": {"suspend": False}}
    )
    run_trainer(kube, sft)
    wait_for("phase Running", lambda: status(kube, run).get("phase") == "Running", timeout=WAIT_S)
    assert jobsets(kube)[sft]["spec"]["suspend"] is False
    # Suspending a queued run deletes its JobSet (its quota goes back to the queue).
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"suspend": True}}
    )
    wait_for("the JobSet deleted", lambda: sft not in jobsets(kube), timeout=WAIT_S)
    wait_for("phase Suspended", lambda: status(kube, run).get("phase") == "Suspended", timeout=WAIT_S)


def test_the_old_gpus_field_is_refused_at_admission_naming_the_fix(kube: Any, operator: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as refused:
        create(kube, manifest("old", gpus=8))
    assert refused.value.status == 422
    assert "spec.gpus" in str(refused.value.body) and "gpusPerNode" in str(refused.value.body)
    assert not jobsets(kube)


def test_a_failed_stage_fails_the_run_and_the_next_stage_never_starts(kube: Any, operator: Any) -> None:
    run = create(kube, manifest("fails", rewardGpus=0))
    sft = run.jobset_name("sft")
    wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    # The stage's pod failed with a usage error; the kubelet kept the end of its log.
    error = "kernelfleet train: every task of fails is held out; select more tasks or lower heldOut.fraction"
    failed_pod(kube, sft, error)
    finish(kube, sft, "Failed")
    wait_for("phase Failed", lambda: status(kube, run).get("phase") == "Failed", timeout=WAIT_S)
    failed = condition(kube, run, "Failed")
    assert failed is not None and failed["status"] == "True"
    assert "stage 1/2 sft failed: jobset failed due to reaching max number of restarts" in failed["message"]
    assert f"its last output: {error}" in failed["message"]
    assert status(kube, run)["stages"][0]["phase"] == "Failed"
    assert list(jobsets(kube)) == [sft]


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
    assert not jobsets(kube)


def test_a_spec_change_is_refused_at_admission_but_suspend_ttl_and_deadline_apply(
    kube: Any, operator: Any, store_dir: Path
) -> None:
    from kubernetes.client.exceptions import ApiException

    run = create(kube, manifest("frozen", rewardGpus=0))
    sft = run.jobset_name("sft")
    wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    with pytest.raises(ApiException) as refused:
        kube.custom.patch_namespaced_custom_object(
            GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": {"baseModel": "s3://models/other"}}
        )
    assert refused.value.status == 422
    body = str(refused.value.body)
    assert "spec.baseModel cannot be changed" in body and "create a new one" in body
    # The mutable fields change, and the run keeps its recorded spec (they are not part of it).
    change = {"ttlSecondsAfterFinished": 600, "activeDeadlineSeconds": 86400}
    kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, PLURAL, run.name, {"spec": change}
    )
    _, recorded = read_run_record(open_store(store_dir), TrainingLayout(run.prefix))
    assert recorded.base_model == "s3://models/tiny"
    assert (condition(kube, run, "Accepted") or {}).get("reason") == "Recorded"
    assert list(jobsets(kube)) == [sft]


def test_a_finished_run_records_its_end_and_is_deleted_after_its_ttl(kube: Any, operator: Any) -> None:
    one_stage = [{"name": "sft", "type": "sft"}]
    run = create(kube, manifest("short", rewardGpus=0, stages=one_stage, ttlSecondsAfterFinished=2))
    sft = run.jobset_name("sft")
    wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    assert status(kube, run).get("startTime")
    finish(kube, sft)

    def ended() -> dict[str, Any] | None:
        try:
            current = status(kube, run)
        except Exception:  # deleted already: the TTL was quicker than this look
            return {"deleted": True}
        return current if current.get("completionTime") else None

    current = wait_for("completionTime", ended, timeout=WAIT_S)
    if "deleted" not in current:
        assert current["phase"] == "Succeeded" and current["completionTime"] >= current["startTime"]

    def deleted() -> bool:
        listed = kube.custom.list_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL)
        return run.name not in [item["metadata"]["name"] for item in listed["items"]]

    wait_for("the run deleted after its TTL", deleted, timeout=WAIT_S)
    # Its JobSet is owned by it: the garbage collector (not run by this control plane) deletes it.
    assert [o["uid"] for o in jobsets(kube)[sft]["metadata"]["ownerReferences"]] == [run.uid]


def test_past_its_deadline_a_run_fails_and_its_stage_jobset_goes(kube: Any, operator: Any) -> None:
    run = create(kube, manifest("late", rewardGpus=0, activeDeadlineSeconds=3))
    sft = run.jobset_name("sft")
    wait_for("the sft JobSet", lambda: jobsets(kube).get(sft), timeout=WAIT_S)
    run_trainer(kube, sft)
    wait_for("phase Failed", lambda: status(kube, run).get("phase") == "Failed", timeout=WAIT_S)
    failed = condition(kube, run, "Failed") or {}
    assert failed.get("status") == "True" and failed.get("reason") == "DeadlineExceeded"
    assert "activeDeadlineSeconds" in failed["message"]
    assert status(kube, run).get("completionTime")
    wait_for("the JobSet deleted", lambda: sft not in jobsets(kube), timeout=WAIT_S)
    # The next stage never starts.
    assert run.jobset_name("rl") not in jobsets(kube)


def test_a_store_it_cannot_write_is_reported_in_a_condition(kube: Any, tmp_path: Path) -> None:
    apply_crds(kube)
    install_crds(kube.api_client)
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
    assert not jobsets(kube)
