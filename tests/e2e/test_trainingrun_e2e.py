"""A TrainingRun on the whole cluster, for real: the operator creates each stage's JobSet, the
JobSet controller (built from its module) its Jobs and headless Service, the Job controller their
pods, the scheduler binds them to a node of the run's pool, and the pod runner
(tests/support/podrunner.py, a kubelet without containers) runs `kernelfleet train stage` on this
machine's CPU. The trainer trains a tiny model from a config (random weights, a tokenizer trained
here) with trl and keeps its checkpoints in the real MinIO, and the run ends Complete with each
stage's steps, checkpoint and model in its status. Deleting the run deletes its JobSets (the
garbage collector); the store keeps everything.

A two-node stage runs as two real processes that meet through the JobSet's stable host names
(torchrun's c10d rendezvous, then gloo on the CPU); its loss matches a one-process run of the
same data. Killing one rank's pod restarts the JobSet, and training resumes from the checkpoint.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.core.store import open_store
from kernelfleet.core.tasks import load_tasks
from kernelfleet.core.training import TrainingLayout, latest_checkpoint, stage_done
from kernelfleet.operator._training_plan import RunRef
from kernelfleet.operator._training_pods import LABEL_JOBSET
from kernelfleet.search import build_messages
from tests._servers._process import wait_for
from tests.support.operator import OperatorProcess, apply_crds, store_secret
from tests.support.podrunner import PodRunner, RunnerNode
from tests.support.training import EXAMPLE_TASKS, ROOT, TINY_SFT, answer_text, tiny_model

PLURAL = "trainingruns"
RUNNER_LABEL = "kernelfleet.io/pod-runner"
# Two stages of a few CPU steps each, on a shared two-core machine.
WAIT_S = 900.0
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}


@pytest.fixture
def runner(cluster: Any, tmp_path: Path) -> Iterator[PodRunner]:
    node = RunnerNode(f"runner-{cluster.namespace}", {RUNNER_LABEL: "true"}, gpus=8)
    with PodRunner(cluster.api_client, [node], tmp_path / "runner", env=OFFLINE) as running:
        yield running
    cluster.core.delete_node(node.name)


def pools_file(path: Path) -> Path:
    """One pool class, `runner`, whose nodes are the pod runner's."""
    classes = {
        "runner": {
            "nodeLabel": "nvidia.com/gpu.product",
            "products": [],
            "nodeSelector": {RUNNER_LABEL: "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "gpuResource": "nvidia.com/gpu",
        }
    }
    path.write_text(yaml.safe_dump({"version": 1, "classes": classes}))
    return path


def inputs(store: Any, tmp_path: Path) -> tuple[str, str]:
    """The tiny model and a four-example dataset in MinIO, as a user would upload them."""
    model = tiny_model(tmp_path / "model")
    store.upload_dir(model, "inputs/tiny-model")
    task = load_tasks(str(EXAMPLE_TASKS / "diag_matmul.py"))[0]
    fast = (ROOT / "examples" / "candidates" / "diag_matmul__row_scale.py").read_text()
    row = {
        "prompt": build_messages(task, [], "cpu", "cpu"),
        "completion": [{"role": "assistant", "content": answer_text(fast)}],
    }
    store.put_bytes("inputs/sft.jsonl", (json.dumps(row) + "\n").encode() * 4)
    return store.url_for("inputs/tiny-model"), store.url_for("inputs/sft.jsonl")


TINY_GRPO = {
    "learning_rate": 0.01,
    "num_generations": 2,
    "beta": 0.0,
    "max_completion_length": 16,
    "per_device_train_batch_size": 2,
    "max_steps": 2,
    "use_vllm": False,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_steps": 1,
}


class Setup:
    """MinIO with the inputs, the CRDs, the store Secret, and an operator (not started)."""

    def __init__(self, cluster: Any, minio: Any, tmp_path: Path) -> None:
        self.cluster = cluster
        self.store_url = f"s3://{minio.bucket}/kf"
        self.store = open_store(self.store_url, StoreConfig.from_env(minio.config()))
        self.model_url, self.dataset_url = inputs(self.store, tmp_path)
        apply_crds(cluster)
        store_secret(cluster, "kernelfleet-store", minio)
        self.operator = OperatorProcess(
            cluster.kubeconfig,
            cluster.namespace,
            tmp_path / "operator",
            env=minio.config(),
            args=[
                "--store",
                self.store_url,
                "--store-secret",
                "kernelfleet-store",
                "--pools",
                str(pools_file(tmp_path / "pools.yaml")),
            ],
        )

    def create(self, name: str, stages: list[dict[str, Any]], **spec: Any) -> RunRef:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingRun",
            "metadata": {"name": name},
            "spec": {
                "baseModel": self.model_url,
                "tasks": [str(EXAMPLE_TASKS)],
                "heldOut": {"fraction": 0.25, "evaluate": False},
                "stages": stages,
                "gpuClass": "runner",
                "rewardGpus": 0,
                "evaluation": {"correctness": {"trials": 1}, "timing": {"trials": 10}},
                **spec,
            },
        }
        made = self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.cluster.namespace, PLURAL, body
        )
        return RunRef(self.cluster.namespace, name, made["metadata"]["uid"])

    def status(self, run: RunRef) -> dict[str, Any]:
        resource = self.cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.cluster.namespace, PLURAL, run.name
        )
        return resource.get("status") or {}

    def wait_finished(self, run: RunRef) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            current = self.status(run)
            if current.get("phase") == "Failed":
                log = self.operator.log()[-4000:]
                raise AssertionError(f"the run failed: {json.dumps(current, indent=2)}\n{log}")
            return current if current.get("phase") == "Succeeded" else None

        try:
            result: dict[str, Any] = wait_for(f"{run.name} to finish", finished, timeout=WAIT_S)
        except AssertionError as error:
            raise AssertionError(f"{error}; {self.describe(run)}") from None
        return result

    def describe(self, run: RunRef) -> str:
        """What a timed-out wait needs to be understood: the run's status, its Jobs and pods."""
        namespace = self.cluster.namespace
        jobs = [
            (j.metadata.name, j.status.to_dict())
            for j in self.cluster.batch.list_namespaced_job(namespace).items
        ]
        jobsets = [(j["metadata"]["name"], j.get("status")) for j in self.jobsets()]
        pods = [
            (p.metadata.name, p.status.phase, p.metadata.deletion_timestamp, p.spec.node_name)
            for p in self.cluster.core.list_namespaced_pod(namespace).items
        ]
        return (
            f"status {json.dumps(self.status(run), default=str)}; jobsets {jobsets}; jobs {jobs}; pods {pods}"
        )

    def jobsets(self) -> list[dict[str, Any]]:
        listed = self.cluster.custom.list_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", self.cluster.namespace, "jobsets"
        )
        return list(listed["items"])

    def pods_of(self, run: RunRef, stage: str) -> list[Any]:
        selector = f"{LABEL_JOBSET}={run.jobset_name(stage)}"
        return list(
            self.cluster.core.list_namespaced_pod(self.cluster.namespace, label_selector=selector).items
        )

    def sft_stage(self, steps: int) -> dict[str, Any]:
        return {
            "name": "sft",
            "type": "sft",
            "data": {"dataset": self.dataset_url},
            "sft": {**TINY_SFT, "max_steps": steps, "save_steps": 1},
        }


def checkpoint_attempts(store: Any, layout: TrainingLayout, stage: str) -> dict[str, list[int]]:
    """The steps of the stage's checkpoints, by the process attempt that wrote them."""
    attempts: dict[str, list[int]] = {}
    for key in store.list(layout.checkpoints(stage)):
        folder = key[len(layout.checkpoints(stage)) :].split("/", 1)[0]
        _, step, attempt = folder.split("-")
        attempts.setdefault(attempt, []).append(int(step))
    return attempts


def test_a_training_run_goes_through_its_stages_with_checkpoints_in_minio(
    cluster: Any, minio: Any, runner: PodRunner, tmp_path: Path
) -> None:
    setup = Setup(cluster, minio, tmp_path)
    store = setup.store
    with setup.operator:
        run = setup.create("tiny", [setup.sft_stage(2), {"name": "rl", "type": "grpo", "grpo": TINY_GRPO}])
        final = setup.wait_finished(run)

        # Each stage ran as its own JobSet, one trainer pod on the runner's node that exited 0.
        pods = cluster.core.list_namespaced_pod(cluster.namespace).items
        assert {pod.spec.node_name for pod in pods} == {runner.nodes[0].name}
        assert sorted(runner.exit_codes.values()) == [0, 0], runner.exit_codes
        jobsets = {jobset["metadata"]["name"]: jobset for jobset in setup.jobsets()}
        assert set(jobsets) == {run.jobset_name("sft"), run.jobset_name("rl")}
        assert all(jobset["status"]["terminalState"] == "Completed" for jobset in jobsets.values())

        # The status shows each stage's steps, checkpoint and model, and the run is Complete.
        assert final["stagesDone"] == 2 and final["currentStage"] == ""
        for stage in final["stages"]:
            assert stage["phase"] == "Succeeded" and stage["step"] == 2, stage
            assert stage["checkpoint"].startswith(f"{setup.store_url}/{run.prefix}/stages/{stage['name']}/")
            assert stage["model"] == store.url_for(TrainingLayout(run.prefix).model(stage["name"]))
        assert "loss" in final["stages"][0]["metrics"]
        conditions = {c["type"]: c["status"] for c in final["conditions"]}
        assert conditions["Complete"] == "True" and conditions["Failed"] == "False"

        # Checkpoints, models and done markers are in the real MinIO.
        layout = TrainingLayout(run.prefix)
        for name in ("sft", "rl"):
            found = latest_checkpoint(store, layout, name)
            assert found is not None and found[0] == 2, name
            assert stage_done(store, layout, name) and store.dir_complete(layout.model(name))

        # Deleting the run deletes its JobSets, Jobs and pods; the store keeps everything.
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, run.name)
        wait_for(
            "the JobSets and Jobs to be garbage-collected",
            lambda: not setup.jobsets() and not cluster.batch.list_namespaced_job(cluster.namespace).items,
            timeout=120.0,
        )
        assert latest_checkpoint(store, layout, "rl") is not None


def test_an_evicted_stage_resumes_from_its_newest_checkpoint(
    cluster: Any, minio: Any, runner: PodRunner, tmp_path: Path
) -> None:
    """The stage's pod is evicted (the Eviction API, as a node drain does) once a checkpoint is
    in MinIO; the Job controller starts another pod, which resumes from that checkpoint. The
    stage is long against the eviction's reaction (the test's and the pod runner's polls, about
    a second), so the evicted pod cannot finish first."""
    setup = Setup(cluster, minio, tmp_path)
    store = setup.store
    steps = 24
    with setup.operator:
        run = setup.create("evicted", [setup.sft_stage(steps)])
        layout = TrainingLayout(run.prefix)
        first = wait_for(
            "a first checkpoint", lambda: latest_checkpoint(store, layout, "sft"), timeout=WAIT_S
        )
        (pod,) = setup.pods_of(run, "sft")
        cluster.core.create_namespaced_pod_eviction(
            pod.metadata.name,
            cluster.namespace,
            {"metadata": {"name": pod.metadata.name, "namespace": cluster.namespace}},
        )
        final = setup.wait_finished(run)

    # Two pods ran the stage: the evicted one (killed) and its replacement (exit 0).
    codes = sorted(runner.exit_codes.items())
    assert sorted(code for _, code in codes) == [0, 137], codes  # 137: killed (SIGKILL)
    (jobset,) = setup.jobsets()
    # The eviction restarted the JobSet, and did not count against its restarts (backoffLimit).
    assert jobset["status"]["restarts"] == 1, jobset["status"]
    assert not jobset["status"].get("restartsCountTowardsMax"), jobset["status"]
    # The replacement resumed: its checkpoints (a new attempt) start after the evicted pod's.
    attempts = checkpoint_attempts(store, layout, "sft")
    assert len(attempts) == 2, attempts
    before, after = sorted(attempts.values(), key=min)
    assert min(after) > first[0] and min(after) > min(before) and max(after) == steps, attempts
    stage = final["stages"][0]
    assert stage["phase"] == "Succeeded" and stage["step"] == steps


def distinct_dataset(store: Any) -> str:
    """Four different examples (one per example task): each rank of a two-node stage trains on
    other rows than the other, so only gradients averaged across the ranks give the loss of one
    process that sees all four."""
    rows = []
    for path in sorted((ROOT / "examples" / "candidates").glob("*.py"))[:4]:
        task = load_tasks(str(EXAMPLE_TASKS / f"{path.stem.split('__')[0]}.py"))[0]
        rows.append(
            {
                "prompt": build_messages(task, [], "cpu", "cpu"),
                "completion": [{"role": "assistant", "content": answer_text(path.read_text())}],
            }
        )
    store.put_bytes("inputs/distinct.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())
    return str(store.url_for("inputs/distinct.jsonl"))


def losses(store: Any, run: RunRef, stage: str) -> dict[int, float]:
    """Each step's logged loss, the newest record of each step (a step logged by a killed
    attempt and again by the resumed one counts once, as the resumed one logged it)."""
    layout = TrainingLayout(run.prefix)
    found: dict[int, float] = {}
    for key in sorted(store.list(layout.metrics_prefix(stage))):
        record = store.get_json(key)
        if "loss" in record:
            found[int(record["step"])] = float(record["loss"])
    return found


# DDP over gloo sums the two ranks' gradients in another order than one process sums its batch's:
# the losses agree to float32 rounding (about 1e-7 relative here), far inside this bound. Ranks
# that do not form one world (each training alone on its own two rows) log a loss of about twice
# the one process's (trl scales each rank's loss by the world size) and drift apart after it.
LOSS_TOLERANCE = 1e-4


def test_a_two_node_stage_trains_as_two_ranks_that_match_one_process(
    cluster: Any, minio: Any, runner: PodRunner, tmp_path: Path
) -> None:
    setup = Setup(cluster, minio, tmp_path)
    dataset = distinct_dataset(setup.store)
    steps = 3

    def stage(batch: int) -> dict[str, Any]:
        sft = {**TINY_SFT, "max_steps": steps, "save_steps": steps, "per_device_train_batch_size": batch}
        return {"name": "sft", "type": "sft", "data": {"dataset": dataset}, "sft": sft}

    with setup.operator:
        single = setup.create("one-rank", [stage(4)])
        first = setup.wait_finished(single)
        double = setup.create("two-nodes", [stage(2)], nodes=2, gpusPerNode=1)
        second = setup.wait_finished(double)

    # Two trainer pods ran (one per node of the stage), one rank each, and trained as one world.
    pods = setup.pods_of(double, "sft")
    assert sorted(pod.spec.hostname for pod in pods) == [
        f"{double.jobset_name('sft')}-trainer-0-{index}" for index in (0, 1)
    ]
    assert all(runner.exit_codes[pod.metadata.name] == 0 for pod in pods), runner.exit_codes
    assert first["stages"][0]["metrics"].get("ranks") == 1, first["stages"][0]
    assert second["stages"][0]["metrics"].get("ranks") == 2, second["stages"][0]

    one, two = losses(setup.store, single, "sft"), losses(setup.store, double, "sft")
    assert sorted(one) == sorted(two) == list(range(1, steps + 1)), (one, two)
    for step in one:
        assert abs(one[step] - two[step]) <= LOSS_TOLERANCE * abs(one[step]), (step, one, two)
    # The model changed: the steps' losses are not all the first one.
    assert len({round(value, 6) for value in one.values()}) > 1, one


def test_a_killed_rank_restarts_the_jobset_and_training_resumes_from_the_checkpoint(
    cluster: Any, minio: Any, runner: PodRunner, tmp_path: Path
) -> None:
    setup = Setup(cluster, minio, tmp_path)
    store = setup.store
    dataset = distinct_dataset(store)
    steps = 16
    sft = {**TINY_SFT, "max_steps": steps, "save_steps": 1}
    with setup.operator:
        run = setup.create(
            "killed", [{"name": "sft", "type": "sft", "data": {"dataset": dataset}, "sft": sft}], nodes=2
        )
        layout = TrainingLayout(run.prefix)
        first = wait_for(
            "a first checkpoint", lambda: latest_checkpoint(store, layout, "sft"), timeout=WAIT_S
        )
        (rank1,) = [p for p in setup.pods_of(run, "sft") if p.spec.hostname.endswith("-trainer-0-1")]
        assert runner.crash(rank1.metadata.name, cluster.namespace)
        final = setup.wait_finished(run)

    (jobset,) = setup.jobsets()
    assert jobset["status"]["restarts"] == 1, jobset["status"]
    # Two attempts: the first until the kill, the second from its newest checkpoint on.
    attempts = checkpoint_attempts(store, layout, "sft")
    assert len(attempts) == 2, attempts
    before, after = sorted(attempts.values(), key=min)
    assert min(after) > first[0] and min(after) > min(before) and max(after) == steps, attempts
    # Nothing lost, nothing counted twice: every step's loss is logged, the last is the stage's
    # last step, and the trainer never ran past it.
    logged = losses(store, run, "sft")
    assert sorted(logged) == list(range(1, steps + 1)), logged
    stage = final["stages"][0]
    assert stage["phase"] == "Succeeded" and stage["step"] == steps


def test_kueue_admits_a_whole_stage_or_nothing(
    cluster: Any, minio: Any, runner: PodRunner, kueue_controller: Any, tmp_path: Path
) -> None:
    """Gang admission: a ClusterQueue of 6 GPUs of the runner class, two runs whose stage needs
    4 each (2 nodes x 2 GPUs). One stage is admitted whole (both its pods run), the other waits
    with no pod at all (never 2 of its 4 GPUs), and is admitted once the first stage finished."""
    from kernelfleet.operator.devcluster._kueue import create_queue_objects, gpu_queue_manifests

    suffix = secrets.token_hex(3)
    create_queue_objects(
        cluster.api_client,
        gpu_queue_manifests(
            {"runner": 6},
            node_labels={"runner": {RUNNER_LABEL: "true"}},
            cluster_queue=f"training-{suffix}",
            local_queue="training",
            namespaces=(cluster.namespace,),
        ),
    )
    setup = Setup(cluster, minio, tmp_path)
    sft = {
        "name": "sft",
        "type": "sft",
        "data": {"dataset": setup.dataset_url},
        "sft": {**TINY_SFT, "max_steps": 6},
    }
    gang = {"nodes": 2, "gpusPerNode": 2, "queueName": "training"}
    with setup.operator:
        first = setup.create("first", [sft], **gang)
        second = setup.create("second", [sft], **gang)
        runs = (first, second)

        def one_running() -> RunRef | None:
            pods = {run: setup.pods_of(run, "sft") for run in runs}
            started = [run for run in runs if pods[run]]
            return started[0] if len(started) == 1 and len(pods[started[0]]) == 2 else None

        admitted = wait_for("one stage admitted whole", one_running, timeout=WAIT_S)
        waiting = second if admitted == first else first
        # While the admitted stage trains, the other one is queued: its JobSet suspended, its
        # status saying so, and not one of its pods created.
        while setup.status(admitted).get("phase") != "Succeeded":
            assert not setup.pods_of(waiting, "sft"), "a part of the second stage started"
            jobset = next(j for j in setup.jobsets() if j["metadata"]["name"] == waiting.jobset_name("sft"))
            assert jobset["spec"]["suspend"] is True
            if setup.status(admitted).get("phase") == "Failed":
                raise AssertionError(setup.describe(admitted))
            time.sleep(1.0)
        queued = [c for c in setup.status(waiting).get("conditions", []) if c["type"] == "Running"]
        assert queued and "queued in training" in queued[0]["message"], setup.status(waiting)
        setup.wait_finished(waiting)
    for run in runs:
        assert setup.status(run)["stages"][0]["metrics"].get("ranks") == 4
