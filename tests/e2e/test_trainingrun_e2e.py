"""A TrainingRun on the whole cluster, for real: the operator creates each stage's Job, the
scheduler binds its pod to a node of the run's pool, the pod runner (tests/support/podrunner.py,
a kubelet without containers) runs `kernelfleet train stage` on this machine's CPU, the trainer
trains a tiny model from a config (random weights, a tokenizer trained here) with trl and keeps
its checkpoints in the real MinIO, and the run ends Complete with each stage's steps, checkpoint
and model in its status. Deleting the run deletes its Jobs (the garbage collector); the store
keeps everything.

The RL stage's rewards are evaluated in the training pod (`rewardGpus: 0`): this cluster runs no
Deployment controller, so the evaluation service's lifecycle is checked in the integration tier.
"""

from __future__ import annotations

import json
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


def test_a_training_run_goes_through_its_stages_with_checkpoints_in_minio(
    cluster: Any, minio: Any, runner: PodRunner, tmp_path: Path
) -> None:
    store_url = f"s3://{minio.bucket}/kf"
    store = open_store(store_url, StoreConfig.from_env(minio.config()))
    model_url, dataset_url = inputs(store, tmp_path)
    apply_crds(cluster)
    store_secret(cluster, "kernelfleet-store", minio)
    operator = OperatorProcess(
        cluster.kubeconfig,
        cluster.namespace,
        tmp_path / "operator",
        env=minio.config(),
        args=[
            "--store",
            store_url,
            "--store-secret",
            "kernelfleet-store",
            "--pools",
            str(pools_file(tmp_path / "pools.yaml")),
        ],
    )
    tiny_grpo = {
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
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingRun",
        "metadata": {"name": "tiny"},
        "spec": {
            "baseModel": model_url,
            "tasks": [str(EXAMPLE_TASKS)],
            "heldOut": {"fraction": 0.25, "evaluate": False},
            "stages": [
                {
                    "name": "sft",
                    "type": "sft",
                    "data": {"dataset": dataset_url},
                    "sft": {**TINY_SFT, "max_steps": 2, "save_steps": 1},
                },
                {"name": "rl", "type": "grpo", "grpo": tiny_grpo},
            ],
            "gpuClass": "runner",
            "gpus": 1,
            "rewardGpus": 0,
            "evaluation": {"correctnessTrials": 1, "timingTrials": 10},
        },
    }
    with operator:
        made = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, body)
        run = RunRef(cluster.namespace, "tiny", made["metadata"]["uid"])

        def status() -> dict[str, Any]:
            resource = cluster.custom.get_namespaced_custom_object(
                GROUP, VERSION, cluster.namespace, PLURAL, run.name
            )
            return resource.get("status") or {}

        def finished() -> dict[str, Any] | None:
            current = status()
            if current.get("phase") == "Failed":
                raise AssertionError(
                    f"the run failed: {json.dumps(current, indent=2)}\n{operator.log()[-4000:]}"
                )
            return current if current.get("phase") == "Succeeded" else None

        final = wait_for("the run to finish", finished, timeout=WAIT_S)

        # Each stage ran as its own pod on the runner's node and exited 0.
        pods = cluster.core.list_namespaced_pod(cluster.namespace).items
        assert {pod.spec.node_name for pod in pods} == {runner.nodes[0].name}
        assert sorted(runner.exit_codes.values()) == [0, 0], runner.exit_codes
        jobs = {job.metadata.name for job in cluster.batch.list_namespaced_job(cluster.namespace).items}
        assert jobs == {run.job_name("sft"), run.job_name("rl")}

        # The status shows each stage's steps, checkpoint and model, and the run is Complete.
        assert final["stagesDone"] == 2 and final["currentStage"] == ""
        for stage in final["stages"]:
            assert stage["phase"] == "Succeeded" and stage["step"] == 2, stage
            assert stage["checkpoint"].startswith(
                f"s3://{minio.bucket}/kf/{run.prefix}/stages/{stage['name']}/"
            )
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

        # Deleting the run deletes its Jobs and pods; the store keeps everything.
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, run.name)
        wait_for(
            "the Jobs to be garbage-collected",
            lambda: not cluster.batch.list_namespaced_job(cluster.namespace).items,
            timeout=120.0,
        )
        assert latest_checkpoint(store, layout, "rl") is not None
