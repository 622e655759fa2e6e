"""The e2e cluster schedules like a real one: kube-scheduler binds GPU Jobs to the right pool,
kwok completes them, and a Job no node can hold stays Pending."""

from __future__ import annotations

from typing import Any

from tests._servers._process import wait_for

# How long the scheduler and kwok get for each step.
WAIT_S = 90.0


def _gpu_job(name: str, product: str | None, gpus: int, completions: int = 1) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "worker",
                "image": "kernelfleet/worker:test",
                "command": ["kernelfleet", "worker"],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if product:
        pod_spec["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completions": completions,
            "parallelism": completions,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {"spec": pod_spec},
        },
    }


def test_h100_job_is_bound_to_an_h100_node_and_completes(cluster) -> None:
    cluster.batch.create_namespaced_job(
        cluster.namespace, _gpu_job("h100-job", "NVIDIA-H100-80GB-HBM3", 1, 3)
    )

    def pods_bound() -> list[Any]:
        pods = cluster.core.list_namespaced_pod(cluster.namespace, label_selector="job-name=h100-job").items
        return pods if len(pods) == 3 and all(p.spec.node_name for p in pods) else []

    pods = wait_for("pods bound to nodes", pods_bound, timeout=WAIT_S)
    for pod in pods:
        node = cluster.core.read_node(pod.spec.node_name)
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3", pod.spec.node_name

    def job_complete() -> bool:
        status = cluster.batch.read_namespaced_job_status("h100-job", cluster.namespace).status
        return bool(
            status.succeeded == 3
            and any(c.type == "Complete" and c.status == "True" for c in (status.conditions or []))
        )

    wait_for("the Job to complete", job_complete, timeout=WAIT_S)


def test_job_asking_for_more_gpus_than_any_node_has_stays_pending(cluster) -> None:
    cluster.batch.create_namespaced_job(cluster.namespace, _gpu_job("too-big", None, 16))

    def unschedulable_pod() -> Any:
        pods = cluster.core.list_namespaced_pod(cluster.namespace, label_selector="job-name=too-big").items
        for pod in pods:
            for condition in pod.status.conditions or []:
                if condition.type == "PodScheduled" and condition.status == "False":
                    return pod
        return None

    pod = wait_for("the scheduler to report the pod unschedulable", unschedulable_pod, timeout=WAIT_S)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    condition = next(c for c in pod.status.conditions if c.type == "PodScheduled")
    assert condition.reason == "Unschedulable"
    assert "nvidia.com/gpu" in condition.message


def test_gpu_nodes_are_ready_with_gfd_labels(cluster) -> None:
    def ready_nodes() -> list[Any]:
        nodes = cluster.core.list_node().items
        ready = [
            n
            for n in nodes
            if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
        ]
        return ready if len(ready) == 8 else []

    nodes = wait_for("8 Ready nodes", ready_nodes, timeout=WAIT_S)
    products = {n.metadata.labels["nvidia.com/gpu.product"] for n in nodes}
    assert products == {
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-H100-80GB-HBM3",
        "NVIDIA-L40",
        "NVIDIA-GeForce-RTX-3090",
    }
    for node in nodes:
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
        assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in node.spec.taints)
