"""The cluster path as the two users walk it, on a real control plane with GPU nodes and MinIO.

The platform engineer: `helm install` of the chart; the operator is the chart's own Deployment
(its command, environment, pools file and store credentials) run as a local process under the
chart's ServiceAccount, since there is no container runtime. The ML engineer: the example
OptimizationJob, submitted with `kernelfleet submit -f`, runs through a pod runner that plays
the kubelet of a GPU node, reaches Complete, and `kernelfleet status`, `logs` and `results` show
it from the outside, the results read back from MinIO by the resource's name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelfleet.core.cli import main as kernelfleet
from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.operator.devcluster._install import chart_operator_process
from kernelfleet.operator.devcluster.podrunner import PodRunner, RunnerNode
from tests._servers._process import binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kernelfleet"
# A class of its own, so that no kwok node of the shared cluster (which would complete the pods
# without running them) can take the job's pods: only the pod runner's node offers it.
LOCAL_PRODUCT = "NVIDIA-H200-LOCAL"
WHOLE_PATH_S = 900.0


@pytest.fixture
def installed(cluster: Any, minio: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The chart installed in the test's namespace, pointing at the test's MinIO bucket."""
    release = cluster.namespace
    home = tmp_path / "helm"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    cluster.core.create_namespaced_secret(
        cluster.namespace,
        {
            "metadata": {"name": "kernelfleet-store"},
            "stringData": {"accesskey": minio.access_key, "secretkey": minio.secret_key},
        },
    )
    values = {
        "store": {
            "url": f"s3://{minio.bucket}/kf",
            "endpoint": minio.endpoint,
            "secure": False,
            "existingSecret": "kernelfleet-store",
        },
        "pools": {"classes": {"local": {"products": [LOCAL_PRODUCT]}}},
        "networkPolicy": {
            "store": {"to": [{"ipBlock": {"cidr": "127.0.0.1/32"}}], "ports": [minio.server.port]}
        },
    }
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))

    def helm(*args: str) -> str:
        result = subprocess.run(
            [str(binary("helm")), *args, "--kubeconfig", str(cluster.kubeconfig), "-n", cluster.namespace],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    helm("install", release, str(CHART), "-f", str(values_file))
    try:
        yield {"release": release, "fullname": f"{release}-kernelfleet", "minio": minio}
    finally:
        helm("uninstall", release, "--ignore-not-found")


def _example(minio: Any, name: str) -> dict[str, Any]:
    """examples/optimizationjob.yaml, with what needs a GPU cluster swapped for what runs here:
    the bundled example tasks and candidates (uploaded to the store), the local pool, a small
    budget; every other field as the example has it."""
    from kernelfleet.core.config import StoreConfig
    from kernelfleet.core.store import open_store

    store = open_store(f"s3://{minio.bucket}", StoreConfig.from_env(minio.config()))
    for path in sorted((ROOT / "examples" / "tasks").glob("*.py")):
        store.put_bytes(f"suite/{path.name}", path.read_bytes())
    store.put_bytes("candidates.jsonl", (ROOT / "examples" / "candidates.jsonl").read_bytes())
    document = yaml.safe_load((ROOT / "examples" / "optimizationjob.yaml").read_text())
    document["metadata"] = {"name": name}
    document["spec"].update(
        tasks=[f"s3://{minio.bucket}/suite/"],
        gpuClasses=["local"],
        verifyOn=[],
        policies=[{"kind": "replay", "path": f"s3://{minio.bucket}/candidates.jsonl"}],
        budget={"rounds": 1, "samplesPerRound": 2},
        evaluation={"correctness": {"profile": "strict", "trials": 1}, "timing": {"trials": 10, "warmup": 1}},
        parallelism=2,
        tasksPerIndex=2,
    )
    return document


def test_helm_install_then_the_example_runs_to_complete_and_the_cli_reads_it_back(
    cluster: Any, installed: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    minio = installed["minio"]
    operator = chart_operator_process(
        kubeconfig=cluster.kubeconfig,
        api_server=cluster.plane.apiserver.url,
        ca_file=cluster.plane.apiserver.pki.ca_cert,
        namespace=cluster.namespace,
        deployment=f"{installed['fullname']}-operator",
        workdir=tmp_path / "operator",
    )
    # The chart's command, unchanged: `kernelfleet operator` with the pools file it mounts.
    assert operator.argv[:4] == [sys.executable, "-m", "kernelfleet.core.cli", "operator"]
    assert any(arg.startswith("--pools=") and arg.endswith("/pools.yaml") for arg in operator.argv)
    node = RunnerNode(name=f"local-{cluster.namespace}", labels={"nvidia.com/gpu.product": LOCAL_PRODUCT})
    runner = PodRunner(cluster.api_client, [node], tmp_path / "pods")
    for key, value in minio.config().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_example(minio, "example")))
    operator.start()
    try:
        with runner:
            # kubectl apply's equivalent, which checks the manifest first, then follows the job.
            code = kernelfleet(["submit", "-f", str(manifest), "-n", cluster.namespace, "--wait"])
            assert code == 0, operator.tail(80)
    finally:
        operator.stop()
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "example"
    assert "softmax_rows" in out  # the results table that --wait prints
    resource = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, "optimizationjobs", "example"
    )
    status = resource["status"]
    assert status["phase"] == "Succeeded"
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in status["conditions"])
    assert status["tasksDone"] == status["tasksTotal"] == 4
    assert status["results"].startswith(
        f"s3://{minio.bucket}/kf/optimizationjobs/{cluster.namespace}/example/"
    )

    assert kernelfleet(["status", "-n", cluster.namespace]) == 0
    listing = capsys.readouterr().out
    assert "example" in listing and "Succeeded" in listing and "4/4" in listing
    assert kernelfleet(["status", "example", "-n", cluster.namespace]) == 0
    detail = capsys.readouterr().out
    assert "\nlocal " in detail and "Complete" in detail and "recent events:" in detail

    assert kernelfleet(["logs", "example", "-n", cluster.namespace]) == 0
    assert "softmax_rows" in capsys.readouterr().out.split()
    assert kernelfleet(["logs", "example", "-n", cluster.namespace, "--task", "softmax_rows"]) == 0
    assert capsys.readouterr().out.strip()

    assert kernelfleet(["results", "optimizationjob/example", "-n", cluster.namespace, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {row["task"] for row in report["tasks"]} == {
        p.stem for p in (ROOT / "examples" / "tasks").glob("*.py")
    }
    assert any((row["best_speedup"] or 0) > 1 for row in report["tasks"])


def test_the_dev_cluster_demo_runs_the_whole_path_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`kernelfleet dev-cluster demo`: a control plane of its own, the chart, the operator, the pod
    runner, `kernelfleet submit` of the example tasks (uploaded), the results; then down."""
    directory = tmp_path / "dev"
    assert (
        kernelfleet(["dev-cluster", "demo", "--dir", str(directory), "--no-build", "--gpu-class", "l40"]) == 0
    )
    captured = capsys.readouterr()
    assert "kernelfleet submit" in captured.err and "Succeeded" in captured.err
    assert "softmax_rows" in captured.out  # the results table
    assert not (directory / "cluster.json").exists()  # down again
