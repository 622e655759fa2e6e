"""OptimizationJobs under Kueue, built from its module: a ClusterQueue with a GPU quota for the
class, two jobs that together need more than it.

The worker pods run on a pod runner's node (so they stay running until the test lets them go):
the worker command is a gate that waits for a file per job and index, then exits 0. The test
watches every Workload in its namespace and checks that the first job runs to Complete with one
Workload per Job, never evicted and never re-queued, even as its Job's last index runs alone
(the tail, where the operator used to lower the Job's parallelism), while the second job says it
is queued and why, and then is admitted and completes.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from kernelfleet.operator._pools import DEFAULT_PRODUCTS
from kernelfleet.operator.devcluster._kueue import create_queue_objects, gpu_queue_manifests
from kernelfleet.operator.devcluster.podrunner import PodRunner, RunnerNode
from tests._servers._process import wait_for
from tests.support.operator import (
    OperatorProcess,
    apply_crds,
    condition,
    create,
    jobs_of,
    optimization_job,
    read,
    store_secret,
)

WAIT_S = 180.0
PRODUCT = "NVIDIA-H200-KUEUE"
GATE = """\
import os, pathlib, sys, time
prefix = sys.argv[sys.argv.index("--prefix") + 1]
name = prefix.split("/")[2]
gate = pathlib.Path({gates!r}) / f"{{name}}-{{os.environ['JOB_COMPLETION_INDEX']}}"
pathlib.Path({gates!r}, f"{{name}}-{{os.environ['JOB_COMPLETION_INDEX']}}.started").touch()
while not gate.exists():
    time.sleep(0.2)
"""


class WorkloadWatch:
    """Every version of every Workload in a namespace, as a watch delivers them."""

    def __init__(self, cluster: Any) -> None:
        from kubernetes import watch

        self.uids: dict[str, set[str]] = defaultdict(set)  # Job name -> Workload uids
        self.evictions: list[tuple[str, dict[str, Any]]] = []
        self._watch = watch.Watch()
        self._cluster = cluster
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Watch until stopped, resuming from the last version seen when a stream ends."""
        version = ""
        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(
                    self._cluster.custom.list_namespaced_custom_object,
                    "kueue.x-k8s.io",
                    "v1beta2",
                    self._cluster.namespace,
                    "workloads",
                    resource_version=version,
                    timeout_seconds=60,
                ):
                    workload = event["object"]
                    version = workload["metadata"]["resourceVersion"]
                    self._record(workload)
            except Exception:
                if self._stopped.is_set():
                    return
                time.sleep(0.5)

    def _record(self, workload: dict[str, Any]) -> None:
        owners = [o["name"] for o in workload["metadata"].get("ownerReferences", []) if o["kind"] == "Job"]
        for job in owners:
            self.uids[job].add(workload["metadata"]["uid"])
            for found in workload.get("status", {}).get("conditions", []):
                if found["type"] in ("Evicted", "Requeued", "Preempted") and found["status"] == "True":
                    self.evictions.append((job, found))

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


def _pools(path: Path) -> Path:
    classes: dict[str, Any] = {
        name: {"products": list(products)} for name, products in DEFAULT_PRODUCTS.items()
    }
    classes["h200"] = {"products": [PRODUCT], "requests": {"cpu": "1", "memory": "1Gi"}}
    path.write_text(yaml.safe_dump({"version": 1, "classes": classes}))
    return path


def _release(gates: Path, name: str, *indexes: int) -> None:
    for index in indexes:
        (gates / f"{name}-{index}").touch()


def _started(gates: Path, name: str) -> int:
    return len(list(gates.glob(f"{name}-*.started")))


def test_a_job_over_the_quota_waits_and_the_running_one_is_never_evicted(
    cluster: Any, kueue_controller: Any, minio: Any, tmp_path: Path
) -> None:
    suffix = secrets.token_hex(3)
    create_queue_objects(
        cluster.api_client,
        gpu_queue_manifests(
            {f"h200-{suffix}": 2},
            node_labels={f"h200-{suffix}": {"nvidia.com/gpu.product": PRODUCT}},
            cluster_queue=f"cq-{suffix}",
            local_queue="gpus",
            namespaces=(cluster.namespace,),
        ),
    )
    gates = tmp_path / "gates"
    gates.mkdir()
    gate = tmp_path / "gate.py"
    gate.write_text(GATE.format(gates=str(gates)))
    apply_crds(cluster)
    store_secret(cluster, "kernelfleet-store", minio)
    operator = OperatorProcess(
        cluster.kubeconfig,
        cluster.namespace,
        tmp_path / "operator",
        env={**minio.config(), "KERNELFLEET_WORKER_COMMAND": f"{sys.executable} {gate}"},
        args=[
            "--store",
            f"s3://{minio.bucket}/kf",
            "--store-secret",
            "kernelfleet-store",
            "--pools",
            str(_pools(tmp_path / "pools.yaml")),
        ],
    )
    node = RunnerNode(name=f"kueue-{cluster.namespace}", labels={"nvidia.com/gpu.product": PRODUCT})
    runner = PodRunner(cluster.api_client, [node], tmp_path / "pods")
    watch = WorkloadWatch(cluster)
    job = {"gpuClasses": ["h200"], "queueName": "gpus", "gpusPerPod": 1}
    try:
        with operator, runner:
            # The first job: 3 tasks on 2 pods, all of the class's 2 GPUs.
            create(cluster, optimization_job("first", tasks=["kernelbench-v0:1:1-3"], parallelism=2, **job))
            wait_for("first's two pods to run", lambda: _started(gates, "first") == 2, timeout=WAIT_S)
            wait_for(
                "first to say it is admitted",
                lambda: (condition(read(cluster, "first"), "Admitted") or {}).get("status") == "True",
                timeout=WAIT_S,
            )
            # The second job needs 1 GPU more than the quota has.
            create(cluster, optimization_job("second", tasks=["kernelbench-v0:1:4"], parallelism=1, **job))

            def queued() -> dict[str, Any] | None:
                found = condition(read(cluster, "second"), "Admitted") or {}
                return (
                    dict(found)
                    if found.get("reason") == "Queued" and "quota" in found.get("message", "")
                    else None
                )

            waiting = wait_for("second to say it is queued, and why", queued, timeout=WAIT_S)
            assert waiting["status"] == "False" and "gpus" in waiting["message"]
            assert "nvidia.com/gpu" in waiting["message"], waiting
            assert _started(gates, "second") == 0
            # Two of first's three indexes end: its last runs alone on a Job of parallelism 2.
            _release(gates, "first", 0, 1)
            wait_for("first's last index to run", lambda: _started(gates, "first") == 3, timeout=WAIT_S)
            wait_for(
                "the operator to see first's tail",
                lambda: (
                    read(cluster, "first")
                    .get("status", {})
                    .get("perClass", {})
                    .get("h200", {})
                    .get("activePods")
                    == 1
                ),
                timeout=WAIT_S,
            )
            [first_job] = jobs_of(cluster, "first")
            assert first_job.spec.parallelism == 2  # never lowered: Kueue admitted 2 pods
            _release(gates, "first", 2)
            _release(gates, "second", 0)

            def phase(name: str) -> str:
                return str(read(cluster, name).get("status", {}).get("phase", ""))

            wait_for("first to succeed", lambda: phase("first") == "Succeeded", timeout=WAIT_S)
            wait_for("second to succeed", lambda: phase("second") == "Succeeded", timeout=WAIT_S)
            assert (condition(read(cluster, "first"), "Complete") or {}).get("status") == "True"
            assert (condition(read(cluster, "second"), "Complete") or {}).get("status") == "True"
    finally:
        watch.stop()
    assert not watch.evictions, watch.evictions
    jobs = {j.metadata.name for j in jobs_of(cluster, "first")} | {
        j.metadata.name for j in jobs_of(cluster, "second")
    }
    assert set(watch.uids) == jobs
    assert all(len(uids) == 1 for uids in watch.uids.values()), dict(watch.uids)
