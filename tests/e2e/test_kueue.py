"""Kueue's controller, built from its module, beside the e2e cluster: its webhook takes a Job
that names a LocalQueue, Kueue admits it within the ClusterQueue's GPU quota of its class, and
the Job runs and finishes (kwok completes the pods); a Job that names no queue is left alone."""

from __future__ import annotations

import secrets
from typing import Any

from kernelfleet.operator.devcluster._kueue import create_queue_objects, gpu_queue_manifests
from tests._servers._process import wait_for

WAIT_S = 120.0
KUEUE = ("kueue.x-k8s.io", "v1beta2")


def _job(name: str, queue: str | None) -> dict[str, Any]:
    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    pod = {
        "restartPolicy": "Never",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": "c",
                "image": "busybox",
                "resources": {
                    "requests": {"cpu": "1", "memory": "1Gi"},
                    "limits": {"nvidia.com/gpu": "1"},
                },
            }
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {"completions": 2, "parallelism": 2, "template": {"spec": pod}},
    }


def _workloads(cluster: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.custom.list_namespaced_custom_object(
        *KUEUE, cluster.namespace, "workloads"
    )["items"]
    return items


def _true(workload: dict[str, Any], type_: str) -> bool:
    return any(
        c["type"] == type_ and c["status"] == "True" for c in workload.get("status", {}).get("conditions", [])
    )


def _complete(cluster: Any, name: str) -> bool:
    job = cluster.batch.read_namespaced_job(name, cluster.namespace)
    return any(c.type == "Complete" and c.status == "True" for c in job.status.conditions or [])


def test_kueue_admits_a_queued_job_within_its_class_quota_and_leaves_others_alone(
    cluster: Any, kueue_controller: Any
) -> None:
    suffix = secrets.token_hex(3)
    create_queue_objects(
        cluster.api_client,
        gpu_queue_manifests(
            {"h100": 2},
            node_labels={"h100": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            cluster_queue=f"cq-{suffix}",
            local_queue="lq",
            namespaces=(cluster.namespace,),
        ),
    )
    cluster.batch.create_namespaced_job(cluster.namespace, _job("queued", "lq"))
    cluster.batch.create_namespaced_job(cluster.namespace, _job("plain", None))

    def admitted() -> dict[str, Any] | None:
        return next((w for w in _workloads(cluster) if _true(w, "Admitted")), None)

    workload = wait_for("Kueue to admit the queued Job", admitted, timeout=WAIT_S)
    assert workload["metadata"]["ownerReferences"][0]["name"] == "queued"
    [pod_set] = workload["spec"]["podSets"]
    assert pod_set["count"] == 2
    [assignment] = workload["status"]["admission"]["podSetAssignments"]
    assert assignment["flavors"]["nvidia.com/gpu"] == "h100"
    wait_for("the queued Job to complete", lambda: _complete(cluster, "queued"), timeout=WAIT_S)
    wait_for("the plain Job to complete", lambda: _complete(cluster, "plain"), timeout=WAIT_S)
    # Kueue made a Workload for the Job of its queue only.
    owners = {w["metadata"]["ownerReferences"][0]["name"] for w in _workloads(cluster)}
    assert owners == {"queued"}
