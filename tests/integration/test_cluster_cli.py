"""The cluster commands against a real kube-apiserver: what they create, and what they say when
the cluster cannot be reached, refuses the user, lacks the CRDs, or has no such GPU class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelfleet.core.cli import main as kernelfleet
from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.operator.client import _connect
from kernelfleet.operator.devcluster import free_port, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def as_admin(kube: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from kubernetes.client.exceptions import ApiException

    for name in ("optimizationjobs.yaml", "trainingruns.yaml"):
        try:
            kube.apiextensions.create_custom_resource_definition(
                yaml.safe_load((ROOT / "crds" / name).read_text())
            )
        except ApiException as error:
            if error.status != 409:
                raise
    from tests._servers._process import wait_for

    def served() -> bool:
        try:
            kube.custom.list_namespaced_custom_object(GROUP, VERSION, kube.namespace, "optimizationjobs")
            kube.custom.list_namespaced_custom_object(GROUP, VERSION, kube.namespace, "trainingruns")
        except ApiException:
            return False
        return True

    wait_for("the kernelfleet CRDs to be served", served, timeout=30)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    return kube


def _job(tmp_path: Path, name: str, **spec: Any) -> Path:
    document = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OptimizationJob",
        "metadata": {"name": name},
        "spec": {"tasks": ["kernelbench-v0:1:1-3"], "gpuClasses": ["h100"], **spec},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_submit_creates_once_and_status_shows_what_no_operator_has_seen(
    as_admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = as_admin.namespace
    assert kernelfleet(["submit", "-f", str(_job(tmp_path, "first")), "-n", namespace]) == 0
    captured = capsys.readouterr()
    assert captured.out == "first\n" and "submitted: optimizationjob" in captured.err
    stored = as_admin.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "optimizationjobs", "first"
    )
    assert stored["spec"]["tasks"] == ["kernelbench-v0:1:1-3"]

    # The same manifest again finds the job; another spec under the same name is refused.
    assert kernelfleet(["submit", "-f", str(_job(tmp_path, "first")), "-n", namespace]) == 0
    assert "already submitted (same spec)" in capsys.readouterr().err
    changed = _job(tmp_path, "first", parallelism=3)
    assert kernelfleet(["submit", "-f", str(changed), "-n", namespace]) == 2
    assert "already exists with another spec" in capsys.readouterr().err

    # Flags: a name derived from the spec, so the same command finds the same job.
    argv = ["submit", "kernelbench-v0:1:1-2", "--gpu-class", "a100", "--rounds", "2", "-n", namespace]
    assert kernelfleet(argv) == 0
    name = capsys.readouterr().out.strip()
    assert name.startswith("opt-")
    assert kernelfleet(argv) == 0
    assert capsys.readouterr().out.strip() == name
    spec = as_admin.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "optimizationjobs", name)[
        "spec"
    ]
    assert spec["gpuClasses"] == ["a100"] and spec["budget"]["rounds"] == 2

    assert kernelfleet(["status", "-n", namespace]) == 0
    listing = capsys.readouterr().out
    assert "first" in listing and name in listing and "0/0" in listing
    assert kernelfleet(["status", "first", "-n", namespace]) == 0
    assert "no status yet" in capsys.readouterr().out
    assert kernelfleet(["results", "optimizationjob/first", "-n", namespace]) == 2
    assert "has no results yet" in capsys.readouterr().err
    assert kernelfleet(["status", "nope", "-n", namespace]) == 2
    err = capsys.readouterr().err
    assert "no OptimizationJob or TrainingRun 'nope'" in err and "first" in err


def test_an_unknown_gpu_class_is_refused_with_the_pools_classes(
    as_admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pools = {"version": 1, "classes": {"a100": {}, "h100": {}, "l40": {}}}
    as_admin.core.create_namespaced_config_map(
        as_admin.namespace,
        {
            "metadata": {"name": "kf-pools", "labels": {"app.kubernetes.io/part-of": "kernelfleet"}},
            "data": {"pools.yaml": yaml.safe_dump(pools)},
        },
    )
    try:
        argv = ["submit", "kernelbench-v0:1:1", "--gpu-class", "b200", "-n", as_admin.namespace]
        assert kernelfleet(argv) == 2
        err = capsys.readouterr().err
        assert "unknown GPU class 'b200'" in err and "a100, h100, l40" in err
    finally:
        as_admin.core.delete_namespaced_config_map("kf-pools", as_admin.namespace)


def test_missing_crds_are_named_with_the_command_that_installs_them(
    as_admin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A group this API server does not serve stands for a cluster without kernelfleet's CRDs.
    monkeypatch.setattr(_connect, "GROUP", "absent.kernelfleet.io")
    assert kernelfleet(["status", "-n", as_admin.namespace]) == 2
    assert "kubectl apply --server-side -f crds/" in capsys.readouterr().err


def test_a_user_without_the_role_is_told_which(
    as_admin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plane = as_admin.plane
    cert, key = plane.apiserver.pki.client("intern")
    kubeconfig = tmp_path / "intern.kubeconfig"
    write_kubeconfig(kubeconfig, plane.apiserver.url, plane.apiserver.pki.ca_cert, cert, key, "intern")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert kernelfleet(["status", "-n", as_admin.namespace]) == 2
    err = capsys.readouterr().err
    assert "forbidden" in err and "intern" in err and "edit role" in err


def test_an_unreachable_api_server_is_reported_not_waited_on(
    tmp_path: Path, as_admin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plane = as_admin.plane
    kubeconfig = tmp_path / "gone.kubeconfig"
    write_kubeconfig(
        kubeconfig,
        f"https://127.0.0.1:{free_port()}",
        plane.apiserver.pki.ca_cert,
        plane.apiserver.admin_cert,
        plane.apiserver.admin_key,
        "admin",
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert kernelfleet(["status"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the API server" in err and "kubectl cluster-info" in err
