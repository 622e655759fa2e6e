"""A Kubernetes cluster with fake GPU nodes and an S3 store on one machine, that outlives the
command which started it.

`DevCluster.up` starts the same servers the e2e tier uses (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, the JobSet controller, kwok, optionally with nodes in
the four GPU pools)
plus MinIO with a `kernelfleet` bucket, each in its own session, and writes what another process
needs to find and stop them into `cluster.json` in the cluster's directory. `DevCluster.load`
reads it back; `down` stops every recorded process. The directory is private (mode 700): it
holds the admin client key and MinIO's credentials.

MinIO's data and credentials survive `down`, so results of one session can be read in the
next; `down(purge=True)` removes them too. Everything Kubernetes is started fresh each time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kernelfleet.core.errors import UsageError
from kernelfleet.operator.devcluster._kube import GPU_POOLS, ControlPlane, gpu_node_manifest
from kernelfleet.operator.devcluster._kueue import create_queue_objects, gpu_queue_manifests
from kernelfleet.operator.devcluster._minio import MinioServer
from kernelfleet.operator.devcluster._process import (
    ProcessRecord,
    ServerProcess,
    binary,
    cache_dir,
    remove_tree,
    wait_for,
)

BUCKET = "kernelfleet"
STATE_FILE = "cluster.json"
# Every binary `up` starts, so that a missing one is reported before anything starts.
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "minio",
    "helm",
    "jobset",
)
# Started only with `up --kueue`, and then checked too.
KUEUE_BINARIES = ("kueue",)
# With --kueue: the GPU quota of the dev cluster's ClusterQueue per class (one pod-runner node each).
KUEUE_GPUS_PER_CLASS = 8
KUEUE_QUEUE = "kernelfleet"
# kwok nodes complete pods without running them: none by default, so that every pod of a job
# lands on the pod runner's nodes and really runs.
KWOK_NODES_PER_POOL = 0


def default_directory() -> Path:
    """$KERNELFLEET_DEV_CLUSTER_DIR, else `dev-cluster` in kernelfleet's cache."""
    configured = os.environ.get("KERNELFLEET_DEV_CLUSTER_DIR")
    return Path(configured) if configured else cache_dir() / "dev-cluster"


def missing_binaries(kueue: bool = False) -> list[str]:
    missing = []
    for name in (*BINARIES, *(KUEUE_BINARIES if kueue else ())):
        try:
            binary(name)
        except FileNotFoundError:
            missing.append(name)
    return missing


class ClusterState(BaseModel):
    """What `up` started, as `cluster.json` records it."""

    model_config = ConfigDict(frozen=True)

    directory: str
    kubeconfig: str
    api_server: str
    ca_file: str
    store_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    started_at: str
    processes: tuple[ProcessRecord, ...] = ()

    def env(self) -> dict[str, str]:
        """The environment that points kubectl, helm and every kernelfleet command at this cluster."""
        return {
            "KUBECONFIG": self.kubeconfig,
            "KERNELFLEET_STORE": self.store_url,
            "KERNELFLEET_S3_ENDPOINT": self.s3_endpoint,
            "KERNELFLEET_S3_ACCESS_KEY": self.s3_access_key,
            "KERNELFLEET_S3_SECRET_KEY": self.s3_secret_key,
            "KERNELFLEET_S3_SECURE": "false",
        }

    def dead(self) -> list[ProcessRecord]:
        return [record for record in self.processes if not record.alive()]


class DevCluster:
    """The cluster in `directory` (see the module's docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = (directory or default_directory()).resolve()

    @property
    def state_file(self) -> Path:
        return self.directory / STATE_FILE

    def load(self) -> ClusterState | None:
        """The recorded state, or None when no cluster was started here."""
        try:
            return ClusterState.model_validate_json(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise UsageError(
                f"{self.state_file} is unreadable ({error}); run `kernelfleet dev-cluster down` to clear it"
            ) from None

    def save(self, state: ClusterState) -> None:
        path = self.state_file
        temporary = path.with_suffix(".tmp")
        temporary.write_text(state.model_dump_json(indent=2))
        temporary.chmod(0o600)
        temporary.replace(path)

    def add_processes(self, *records: ProcessRecord) -> ClusterState:
        """Record more processes (the operator, the pod runner) so that `down` stops them too."""
        state = self.load()
        if state is None:
            raise UsageError(f"no dev cluster in {self.directory}: run `kernelfleet dev-cluster up`")
        state = state.model_copy(update={"processes": (*state.processes, *records)})
        self.save(state)
        return state

    # ------------------------------------------------------------------ up

    def up(self, kwok_nodes_per_pool: int = KWOK_NODES_PER_POOL, kueue: bool = False) -> ClusterState:
        """Start the control plane, the GPU nodes and MinIO; return their state.

        With `kueue`, Kueue's controller too, and a ClusterQueue `kernelfleet` with a GPU quota
        per pool and a LocalQueue `kernelfleet` in namespace default (`queueName: kernelfleet`).

        Raises UsageError when a cluster already runs here (its processes are alive), and
        BinaryMissing (a UsageError) naming the first binary not built yet.
        """
        current = self.load()
        if current is not None:
            if not current.dead():
                raise UsageError(
                    f"a dev cluster already runs in {self.directory}: use it "
                    "(`eval $(kernelfleet dev-cluster env)`), or stop it with `kernelfleet dev-cluster down`"
                )
            self._stop_records(current.processes)  # a half-dead cluster from before: clear it
        for name in (*BINARIES, *(KUEUE_BINARIES if kueue else ())):
            binary(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        remove_tree(self.directory / "kube")
        started: list[ServerProcess] = []
        plane: ControlPlane | None = None
        try:
            plane = ControlPlane.start(self.directory / "kube")
            plane.add_cluster_components()
            if kueue:
                _add_kueue(plane)
            if kwok_nodes_per_pool:
                _create_nodes(plane.kubeconfig, kwok_nodes_per_pool)
            minio = self._minio()
            minio.start()
            started.append(minio.process)
            with contextlib.suppress(Exception):  # it exists when the data survived an earlier `down`
                minio.client().make_bucket(bucket_name=BUCKET)
            state = ClusterState(
                directory=str(self.directory),
                kubeconfig=str(plane.kubeconfig),
                api_server=plane.apiserver.url,
                ca_file=str(plane.apiserver.pki.ca_cert),
                store_url=f"s3://{BUCKET}",
                s3_endpoint=minio.endpoint,
                s3_access_key=minio.access_key,
                s3_secret_key=minio.secret_key,
                started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                processes=(*plane.records(), minio.process.record()),
            )
            self.save(state)
            return state
        except BaseException:
            for process in reversed(started):
                process.stop()
            if plane is not None:
                plane.stop()
            raise

    def _minio(self) -> MinioServer:
        """MinIO on the data and credentials of an earlier session, when there was one."""
        workdir = self.directory / "minio"
        workdir.mkdir(parents=True, exist_ok=True)
        credentials_file = workdir / "credentials.json"
        credentials: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            credentials = json.loads(credentials_file.read_text())
        server = MinioServer(
            workdir, access_key=credentials.get("access_key"), secret_key=credentials.get("secret_key")
        )
        credentials_file.write_text(
            json.dumps({"access_key": server.access_key, "secret_key": server.secret_key})
        )
        credentials_file.chmod(0o600)
        return server

    # ------------------------------------------------------------------ down

    def down(self, purge: bool = False) -> ClusterState | None:
        """Stop every recorded process, newest first; with `purge`, remove the directory too."""
        state = self.load()
        if state is not None:
            self._stop_records(state.processes)
            self.state_file.unlink(missing_ok=True)
        remove_tree(self.directory / "kube")
        # Pods' volumes may live in short temporary directories that `volumes` links to.
        for link in [*self.directory.glob("pods/*/volumes"), *self.directory.glob("operator/volumes")]:
            if link.is_symlink():
                remove_tree(link.resolve())
                link.unlink()
        if purge:
            remove_tree(self.directory)
        return state

    @staticmethod
    def _stop_records(records: tuple[ProcessRecord, ...]) -> None:
        for record in reversed(records):
            record.stop()


def _create_nodes(kubeconfig: Path, per_pool: int) -> None:
    """kwok nodes in each pool (GPU Feature Discovery labels, 8 GPUs each), waited on until Ready."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        core: Any = client.CoreV1Api(api_client)
        for pool in GPU_POOLS:
            for index in range(per_pool):
                core.create_node(gpu_node_manifest(pool, index))

        def all_ready() -> bool:
            nodes = core.list_node().items
            ready = [
                node
                for node in nodes
                if any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
                and not any(t.key == "node.kubernetes.io/not-ready" for t in node.spec.taints or [])
            ]
            return len(ready) == per_pool * len(GPU_POOLS)

        wait_for("the fake GPU nodes to be Ready", all_ready, timeout=90.0)
    finally:
        api_client.close()


def _add_kueue(plane: ControlPlane) -> None:
    """Kueue, and the queues that take kernelfleet's Jobs: KUEUE_GPUS_PER_CLASS GPUs per pool."""
    from kubernetes import config

    plane.add_kueue()
    api_client = config.new_client_from_config(config_file=str(plane.kubeconfig))
    try:
        create_queue_objects(
            api_client,
            gpu_queue_manifests(
                dict.fromkeys(GPU_POOLS, KUEUE_GPUS_PER_CLASS),
                cluster_queue=KUEUE_QUEUE,
                local_queue=KUEUE_QUEUE,
            ),
        )
    finally:
        api_client.close()
