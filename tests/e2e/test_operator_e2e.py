"""The operator on a whole cluster (scheduler, controller-manager, fake GPU nodes) and MinIO.

- kwok's nodes: pods of each GPU class are bound only to nodes of their pool, and a class that
  no node offers gets its condition (kwok completes these pods without running anything);
- the whole path, for real: a pod runner plays the kubelet of an `h200` node, so the worker pods
  run `kernelfleet worker` on this machine's CPU against MinIO; the job ends Complete with the
  counters and speedups of what the workers stored, `kernelfleet results` reads them back, and
  deleting the resource removes its Jobs and pods while the results stay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.jobplan import Role, job_prefix, plan_key, task_log_key
from kernelfleet.core.store import open_store
from kernelfleet.operator._pools import DEFAULT_PRODUCTS
from kernelfleet.operator.devcluster.podrunner import PodRunner, RunnerNode
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
    store_secret,
    wait_condition,
)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
WHOLE_PATH_S = 780.0  # within the tests' 900 s timeout, with room to report


def _pools(path: Path, **extra: list[str]) -> Path:
    classes: dict[str, Any] = {
        name: {"products": list(products)} for name, products in DEFAULT_PRODUCTS.items()
    }
    classes.update({name: {"products": products} for name, products in extra.items()})
    path.write_text(yaml.safe_dump({"version": 1, "classes": classes}))
    return path


def _operator(cluster: Any, minio: Any, tmp_path: Path, pools: Path) -> OperatorProcess:
    apply_crds(cluster)
    store_secret(cluster, "kernelfleet-store", minio)
    return OperatorProcess(
        cluster.kubeconfig,
        cluster.namespace,
        tmp_path / "operator",
        env=minio.config(),
        args=[
            "--store",
            f"s3://{minio.bucket}/kf",
            "--store-secret",
            "kernelfleet-store",
            "--pools",
            str(pools),
        ],
    )


def test_pods_are_bound_only_to_their_pool_and_a_class_without_nodes_is_reported(
    cluster: Any, minio: Any, tmp_path: Path
) -> None:
    pools = _pools(tmp_path / "pools.yaml", b200=["NVIDIA-B200"])
    with _operator(cluster, minio, tmp_path, pools):
        create(
            cluster,
            optimization_job(
                "placed", tasks=["kernelbench-v0:1:1-4"], gpuClasses=["h100", "l40"], parallelism=2
            ),
        )
        create(cluster, optimization_job("nowhere", tasks=["kernelbench-v0:1:1"], gpuClasses=["b200"]))

        def bound_pods() -> list[Any]:
            pods = cluster.core.list_namespaced_pod(
                cluster.namespace, label_selector="kernelfleet.io/optimizationjob=placed"
            ).items
            bound = [p for p in pods if p.spec.node_name]
            classes = {p.metadata.labels["kernelfleet.io/gpu-class"] for p in bound}
            return bound if classes == {"h100", "l40"} else []

        for pod in wait_for("pods of both classes bound", bound_pods, timeout=WAIT_S):
            gpu_class = pod.metadata.labels["kernelfleet.io/gpu-class"]
            node = cluster.core.read_node(pod.spec.node_name)
            assert node.metadata.labels["nvidia.com/gpu.product"] in DEFAULT_PRODUCTS[gpu_class], (
                pod.metadata.name
            )
        resource = wait_condition(cluster, "nowhere", "GpuClassUnavailable", timeout=WAIT_S)
        message = condition(resource, "GpuClassUnavailable")["message"]  # type: ignore[index]
        assert "b200" in message and "NVIDIA-B200" in message and "nvidia.com/gpu.product" in message
        assert resource["status"]["phase"] == "Pending"
        # kwok completes the placed pods (nothing ran, so no task is done): the Jobs still end.
        wait_for(
            "the placed Jobs to end",
            lambda: all(
                any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or [])
                for j in jobs_of(cluster, "placed")
            ),
            timeout=WAIT_S,
        )


def _upload_examples(minio: Any) -> None:
    store = open_store(f"s3://{minio.bucket}", StoreConfig.from_env(minio.config()))
    for path in sorted((ROOT / "examples" / "tasks").glob("*.py")):
        store.put_bytes(f"suite/{path.name}", path.read_bytes())
    store.put_bytes("candidates.jsonl", (ROOT / "examples" / "candidates.jsonl").read_bytes())


def test_the_whole_path_apply_to_results(cluster: Any, minio: Any, tmp_path: Path) -> None:
    pools = _pools(tmp_path / "pools.yaml", h200=["NVIDIA-H200"])
    _upload_examples(minio)
    node = RunnerNode(name=f"runner-{cluster.namespace}", labels={"nvidia.com/gpu.product": "NVIDIA-H200"})
    runner = PodRunner(cluster.api_client, [node], tmp_path / "pods", env={"KERNELFLEET_LOG": "1"})
    with _operator(cluster, minio, tmp_path, pools) as operator, runner:
        create(
            cluster,
            optimization_job(
                "whole",
                tasks=[f"s3://{minio.bucket}/suite/"],
                gpuClasses=["h200"],
                policies=[{"kind": "replay", "path": f"s3://{minio.bucket}/candidates.jsonl"}],
                budget={"rounds": 1, "samplesPerRound": 2},
                evaluation={"timing": {"trials": 10, "warmup": 1}, "correctness": {"trials": 1}},
                parallelism=2,
                tasksPerIndex=2,
            ),
        )

        def ended() -> dict[str, Any] | None:
            resource = read(cluster, "whole")
            return resource if resource.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

        try:
            resource = wait_for("the job to end", ended, timeout=WHOLE_PATH_S)
        except AssertionError:
            print(operator.log()[-5000:], file=sys.stderr)
            raise
        status = resource["status"]
        logs = {name: (tmp_path / "pods").glob(f"*{name}*/container.log") for name in runner.exit_codes}
        assert status["phase"] == "Succeeded", (
            status,
            {n: [p.read_text()[-3000:] for p in g] for n, g in logs.items()},
        )
        assert condition(resource, "Complete")["status"] == "True"  # type: ignore[index]
        assert (status["tasksTotal"], status["tasksDone"], status["tasksFailed"]) == (4, 4, 0)
        assert runner.exit_codes and set(runner.exit_codes.values()) == {0}
        assert len(runner.exit_codes) == 2  # 4 tasks, 2 per index

        uid = resource["metadata"]["uid"]
        prefix = job_prefix(cluster.namespace, "whole", uid)
        assert status["results"] == f"s3://{minio.bucket}/kf/{prefix}"
        env = {**os.environ, **minio.config()}
        command = ["results", prefix, "--store", f"s3://{minio.bucket}/kf", "--json"]
        shown = subprocess.run(
            [sys.executable, "-m", "kernelfleet.core.cli", *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=True,
        )
        results = json.loads(shown.stdout)
        rows = results["tasks"]
        assert sorted(r["task"] for r in rows) == sorted(
            p.stem for p in (ROOT / "examples" / "tasks").glob("*.py")
        )
        assert all(r["status"] != "pending" for r in rows)
        # The status is the fold of what the workers stored: the same speedups.
        speedups = [r["best_speedup"] for r in rows if r["best_speedup"] is not None]
        assert status["variantsEvaluated"] == sum(sum(r["verdicts"].values()) for r in rows)
        if speedups:
            assert status["bestSpeedup"] == pytest.approx(max(speedups), abs=1e-4)
            assert status["perClass"]["h200"]["bestSpeedup"] == pytest.approx(max(speedups), abs=1e-4)
        store = open_store(f"s3://{minio.bucket}/kf", StoreConfig.from_env(minio.config()))
        for row in rows:
            assert store.exists(task_log_key(prefix, Role.SEARCH, "h200", row["task_hash"]))

        cluster.custom.delete_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "optimizationjobs", "whole"
        )
        wait_for("the Jobs to go", lambda: not jobs_of(cluster, "whole"), timeout=WAIT_S)
        wait_for(
            "the pods to go",
            lambda: (
                not cluster.core.list_namespaced_pod(
                    cluster.namespace, label_selector="kernelfleet.io/optimizationjob=whole"
                ).items
            ),
            timeout=WAIT_S,
        )
        assert store.exists(plan_key(prefix))  # the results stay
        with pytest.raises(Exception):  # noqa: B017 - gone, whatever the client's error type
            read(cluster, "whole")
