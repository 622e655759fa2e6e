"""A real Kubernetes control plane on loopback: etcd and kube-apiserver, and for a whole cluster
kube-scheduler, kube-controller-manager, the JobSet controller and kwok with fake GPU nodes.

There is no container runtime here, so no kubelet: kwok plays the nodes. It marks them Ready,
renews their leases, moves scheduled pods to Running and completes the pods of Jobs, which
is what a kubelet would report for a pod that ran and exited 0.
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernelfleet.operator.devcluster._jobset import JobSetController
from kernelfleet.operator.devcluster._kueue import DEFAULT_FRAMEWORKS, Kueue
from kernelfleet.operator.devcluster._pki import Pki
from kernelfleet.operator.devcluster._process import (
    BUILD_HINT,
    BinaryMissing,
    ProcessRecord,
    ServerProcess,
    bin_dir,
    binary,
    free_port,
)

# NVIDIA GPU Feature Discovery's labels for the four pools (nvidia.com/gpu.memory in MiB).
GPU_POOLS: dict[str, dict[str, str]] = {
    "a100": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"},
    "h100": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"},
    "l40": {"nvidia.com/gpu.product": "NVIDIA-L40", "nvidia.com/gpu.memory": "46068"},
    "rtx3090": {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-3090", "nvidia.com/gpu.memory": "24576"},
}
GPUS_PER_NODE = 8
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
CONTROLLERS = (
    "job-controller",
    # Removes the not-ready taint that admission puts on every new node once kwok reports it Ready.
    "node-lifecycle-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "ttl-after-finished-controller",
    "root-ca-certificate-publisher-controller",
)


class Etcd:
    def __init__(self, workdir: Path) -> None:
        self.port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.url = client_url
        self.process = ServerProcess(
            "etcd",
            [
                str(binary("etcd")),
                "--data-dir",
                str(workdir / "data"),
                "--name",
                "default",
                "--listen-client-urls",
                client_url,
                "--advertise-client-urls",
                client_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"default={peer_url}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
            workdir,
            ready=self._healthy,
        )

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
            return b'"health":"true"' in response.read()


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))


def write_token_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> None:
    """A kubeconfig that authenticates with a bearer token (a ServiceAccount's)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": user}}],
        "current-context": "dev",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


class KubeApiServer:
    """kube-apiserver with RBAC, client-certificate auth and service-account tokens."""

    def __init__(self, workdir: Path, etcd_url: str, pki: Pki) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.pki = pki
        self.admin_cert, self.admin_key = pki.client("kernelfleet-admin", ("system:masters",))
        workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = workdir / "admin.kubeconfig"
        write_kubeconfig(self.kubeconfig, self.url, pki.ca_cert, self.admin_cert, self.admin_key, "admin")
        self.process = ServerProcess(
            "kube-apiserver",
            [
                str(binary("kube-apiserver")),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki.dir / 'serving.crt'}",
                f"--tls-private-key-file={pki.dir / 'serving.key'}",
                f"--client-ca-file={pki.ca_cert}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={self.url}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--endpoint-reconciler-type=none",
                "--v=1",
            ],
            workdir,
            ready=self._ready,
            ready_timeout=120.0,
        )

    def _ssl(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        context.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return context

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/readyz", timeout=3, context=self._ssl()) as response:
            return bool(response.status == 200)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver, and once `add_cluster_components` ran, the rest of a cluster."""

    workdir: Path
    etcd: Etcd
    apiserver: KubeApiServer
    extra: list[ServerProcess]

    @classmethod
    def start(cls, workdir: Path) -> ControlPlane:
        pki = Pki(workdir / "pki")
        etcd = Etcd(workdir / "etcd")
        etcd.process.start()
        try:
            apiserver = KubeApiServer(workdir / "apiserver", etcd.url, pki)
            apiserver.process.start()
        except BaseException:
            etcd.process.stop()
            raise
        return cls(workdir=workdir, etcd=etcd, apiserver=apiserver, extra=[])

    @property
    def kubeconfig(self) -> Path:
        return self.apiserver.kubeconfig

    def records(self) -> list[ProcessRecord]:
        """Every server of this plane, in start order, for stopping it from another process."""
        return [p.record() for p in (self.etcd.process, self.apiserver.process, *self.extra) if p.running]

    def stop(self) -> None:
        for process in reversed(self.extra):
            process.stop()
        self.apiserver.process.stop()
        self.etcd.process.stop()

    def add_kueue(self, frameworks: Sequence[str] = DEFAULT_FRAMEWORKS) -> Kueue:
        """Start Kueue's controller against this API server (its CRDs and webhooks installed)."""
        kueue = Kueue(self.workdir / "kueue", self.kubeconfig, self.apiserver.pki, frameworks)
        kueue.start()
        self.extra.append(kueue.process)
        return kueue

    def add_cluster_components(self) -> None:
        """Start kube-controller-manager, kube-scheduler, kwok and the JobSet controller against
        this API server."""
        kubeconfig = str(self.kubeconfig)
        common = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        pki = self.apiserver.pki
        kcm_port, scheduler_port, kwok_port = free_port(), free_port(), free_port()
        kcm = ServerProcess(
            "kube-controller-manager",
            [
                str(binary("kube-controller-manager")),
                *common,
                f"--secure-port={kcm_port}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_cert}",
                "--use-service-account-credentials=false",
                "--v=1",
            ],
            self.workdir / "kcm",
            ready=_https_ok(kcm_port),
        )
        scheduler = ServerProcess(
            "kube-scheduler",
            [str(binary("kube-scheduler")), *common, f"--secure-port={scheduler_port}", "--v=1"],
            self.workdir / "scheduler",
            ready=_https_ok(scheduler_port),
        )
        kwok_dir = self.workdir / "kwok"
        kwok_dir.mkdir(parents=True, exist_ok=True)
        kwok_config = kwok_dir / "kwok.yaml"
        kwok_config.write_text(kwok_configuration())
        kwok = ServerProcess(
            "kwok",
            [
                str(binary("kwok")),
                f"--kubeconfig={kubeconfig}",
                f"--config={kwok_config}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{kwok_port}",
            ],
            kwok_dir,
            ready=_http_ok(kwok_port, "/healthz"),
        )
        for process in (kcm, scheduler, kwok):
            process.start()
            self.extra.append(process)
        jobset = JobSetController(self.workdir / "jobset", self.kubeconfig, pki)
        jobset.start()
        self.extra.append(jobset.process)


def kwok_configuration() -> str:
    """kwok's configuration: its Stage objects, which ship inside the kwok module and which the
    build script copies next to the binary (node initialize and heartbeat, pod ready, complete, delete)."""
    stages = sorted((bin_dir() / "kwok-stages").glob("*.yaml"))
    if not stages:
        raise BinaryMissing(f"kwok's stages not found in {bin_dir() / 'kwok-stages'}: {BUILD_HINT}")
    return "\n---\n".join(path.read_text().strip().removeprefix("---").strip() for path in stages) + "\n"


def _https_ok(port: int) -> Callable[[], bool]:
    def check() -> bool:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", timeout=2, context=context
        ) as response:
            return bool(response.status == 200)

    return check


def _http_ok(port: int, path: str) -> Callable[[], bool]:
    def check() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return bool(response.status == 200)

    return check


def gpu_node_manifest(pool: str, index: int) -> dict[str, object]:
    """A fake node of `pool`, labelled and tainted the way GPU Feature Discovery and GPU pools are."""
    labels = {
        "kubernetes.io/hostname": f"{pool}-{index}",
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": str(GPUS_PER_NODE),
        **GPU_POOLS[pool],
    }
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_NODE)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": f"{pool}-{index}", "labels": labels, "annotations": dict([KWOK_ANNOTATION])},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": resources, "allocatable": resources},
    }
