"""Fixtures for every tier. Servers are real (see tests/_servers) and start only when a test
asks for them, so the unit tier needs no binaries at all."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e", "gpu")


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's tier is the folder it lives in (tests/unit/..., tests/e2e/...): one place
    says it, so a test cannot sit in one tier and be marked for another. Marked as each item
    is collected, before `-m` selects by marker."""
    parts = Path(str(item.path)).resolve().relative_to(ROOT / "tests").parts
    if parts and parts[0] in TIERS and not any(item.get_closest_marker(t) for t in TIERS):
        item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def server_root() -> Iterator[Path]:
    # Imported here: the servers' package needs what the GPU machine lacks (cryptography), and
    # the GPU tier never starts a server.
    from tests._servers._process import remove_tree

    path = Path(tempfile.mkdtemp(prefix="kernelfleet-servers-"))
    yield path
    remove_tree(path)


# ---------------------------------------------------------------- MinIO


@pytest.fixture(scope="session")
def minio_server(server_root: Path) -> Iterator[object]:
    from tests._servers.minio import MinioServer

    server = MinioServer(server_root / "minio")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def minio(minio_server: object) -> object:
    """A running MinIO server and a fresh, empty bucket for this test."""
    from tests._servers.minio import fresh_bucket

    return fresh_bucket(minio_server)  # type: ignore[arg-type]


@pytest.fixture
def minio_private(tmp_path: Path) -> Iterator[object]:
    """A MinIO server of this test's own, which the test may stop and start again."""
    from tests._servers.minio import MinioServer, fresh_bucket

    server = MinioServer(tmp_path / "minio")
    server.start()
    yield fresh_bucket(server)
    server.stop()


# ---------------------------------------------------------------- Kubernetes


class Kube:
    """What a test gets from `kube` or `cluster`: a kubeconfig, clients, and its own namespace."""

    def __init__(self, plane: object, namespace: str) -> None:
        from kubernetes import client, config

        self.plane = plane
        self.kubeconfig: Path = plane.kubeconfig  # type: ignore[attr-defined]
        self.namespace = namespace
        self.api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self.apiextensions = client.ApiextensionsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)


@pytest.fixture(scope="session")
def kube_plane(server_root: Path) -> Iterator[object]:
    from tests._servers.kube import ControlPlane

    plane = ControlPlane.start(server_root / "kube")
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def cluster_plane(server_root: Path) -> Iterator[object]:
    """A whole cluster with fake GPU nodes. Separate from `kube_plane` so that the integration
    tier never pays for the scheduler, the controllers and kwok."""
    from kubernetes import client, config

    from tests._servers.kube import GPU_POOLS, ControlPlane, gpu_node_manifest

    plane = ControlPlane.start(server_root / "cluster")
    try:
        plane.add_cluster_components()
        core = client.CoreV1Api(config.new_client_from_config(config_file=str(plane.kubeconfig)))
        for pool in GPU_POOLS:
            for index in range(2):
                core.create_node(gpu_node_manifest(pool, index))  # type: ignore[arg-type]  # dicts are accepted
    except BaseException:
        plane.stop()
        raise
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def kueue_controller(cluster_plane: object) -> object:
    """Kueue's controller (built from its module, `build-test-binaries.sh kueue`) on the e2e
    cluster, for the rest of the session once a test asks. It admits only Jobs (and JobSets) that
    name a LocalQueue, so the tests that do not use it see no difference."""
    return cluster_plane.add_kueue()  # type: ignore[attr-defined]


def _namespaced(plane: object) -> Iterator[Kube]:
    from kubernetes import client

    kube = Kube(plane, "t-" + secrets.token_hex(4))
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=kube.namespace)))
    yield kube
    kube.core.delete_namespace(kube.namespace)
    kube.api_client.close()


@pytest.fixture
def kube(kube_plane: object) -> Iterator[Kube]:
    """etcd + kube-apiserver (RBAC on, client-certificate admin) and a clean namespace."""
    yield from _namespaced(kube_plane)


@pytest.fixture
def cluster(cluster_plane: object) -> Iterator[Kube]:
    """The e2e cluster: scheduler, controller-manager, kwok GPU nodes, and a clean namespace."""
    yield from _namespaced(cluster_plane)
