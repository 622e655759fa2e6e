"""The integration tier's servers are real: MinIO stores bytes, kube-apiserver enforces a CRD's schema."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.core.settings import Budget

ROOT = Path(__file__).resolve().parents[2]


def test_minio_round_trip(minio) -> None:
    client = minio.client()
    payload = b"kernelfleet " * 1000
    client.put_object(
        bucket_name=minio.bucket, object_name="a/b.txt", data=io.BytesIO(payload), length=len(payload)
    )
    response = client.get_object(bucket_name=minio.bucket, object_name="a/b.txt")
    try:
        assert response.read() == payload
    finally:
        response.close()
        response.release_conn()
    assert [o.object_name for o in client.list_objects(bucket_name=minio.bucket, prefix="a/")] == ["a/b.txt"]


def _apply_crd(kube, name: str) -> None:
    document = yaml.safe_load((ROOT / "crds" / name).read_text())
    try:
        kube.apiextensions.create_custom_resource_definition(document)
    except ApiException as error:
        if error.status != 409:  # already there from an earlier test on this control plane
            raise
    # Wait until the API server serves the new kind.
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        crd = kube.apiextensions.read_custom_resource_definition(document["metadata"]["name"])
        conditions = {c.type: c.status for c in (crd.status.conditions or [])}
        if conditions.get("Established") == "True":
            return
        time.sleep(0.2)
    raise AssertionError("CRD never became Established")


def test_crd_schema_rejects_a_bad_optimization_job(kube) -> None:
    _apply_crd(kube, "optimizationjobs.yaml")
    good = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OptimizationJob",
        "metadata": {"name": "good"},
        "spec": {"tasks": ["kernelbench-v0:1:1-3"], "gpuClasses": ["h100"], "budget": {}},
    }
    created = kube.custom.create_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", good
    )
    # the schema's defaults, the runtime's own (core.settings.Budget), were applied by the server
    assert created["spec"]["budget"]["rounds"] == Budget().rounds

    bad = {
        **good,
        "metadata": {"name": "bad"},
        "spec": {"tasks": [], "gpuClasses": ["H100!"], "budget": {"rounds": 0}},
    }
    with pytest.raises(ApiException) as caught:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.namespace, "optimizationjobs", bad)
    assert caught.value.status == 422
    message = str(caught.value.body)
    assert "spec.tasks" in message
    assert "spec.budget.rounds" in message
    assert "spec.gpuClasses[0]" in message


def test_api_server_reports_its_real_version(kube) -> None:
    from kubernetes import client

    version = client.VersionApi(kube.api_client).get_code()
    assert version.git_version.startswith("v1.37.")
    assert (version.major, version.minor) == ("1", "37")


def test_rbac_is_enforced(kube, kube_plane) -> None:
    """A user without bindings is denied: RBAC is on, not AlwaysAllow."""
    from kubernetes import client, config

    from tests._servers.kube import write_kubeconfig

    cert, key = kube_plane.apiserver.pki.client("nobody")
    path = kube_plane.workdir / "nobody.kubeconfig"
    write_kubeconfig(path, kube_plane.apiserver.url, kube_plane.apiserver.pki.ca_cert, cert, key, "nobody")
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(path)))
    with pytest.raises(ApiException) as caught:
        core.list_namespaced_pod(kube.namespace)
    assert caught.value.status == 403
