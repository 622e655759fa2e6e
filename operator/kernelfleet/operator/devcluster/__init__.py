"""kernelfleet.operator.devcluster: a real Kubernetes cluster with fake GPU nodes on one machine.

The same servers the integration and e2e tests run, for users: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, the JobSet controller, kwok playing eight nodes in four
GPU pools (a100, h100, l40, rtx3090, labelled as NVIDIA's GPU Feature Discovery labels real
nodes), and MinIO as the store. Every server is a binary built from its Go module into
kernelfleet's cache (never a mock, never a downloaded binary).
`kernelfleet dev-cluster up|down|env|check|demo` drives it.

No torch here: this is part of the operator distribution.
"""

from kernelfleet.operator.devcluster._cluster import (
    BUCKET,
    ClusterState,
    DevCluster,
    default_directory,
    missing_binaries,
)
from kernelfleet.operator.devcluster._kube import (
    GPU_POOLS,
    GPUS_PER_NODE,
    ControlPlane,
    gpu_node_manifest,
    write_kubeconfig,
)
from kernelfleet.operator.devcluster._minio import MinioServer
from kernelfleet.operator.devcluster._process import (
    BinaryMissing,
    ProcessRecord,
    ServerProcess,
    bin_dir,
    binary,
    cache_dir,
    free_port,
    wait_for,
)

__all__ = [
    "BUCKET",
    "GPUS_PER_NODE",
    "GPU_POOLS",
    "BinaryMissing",
    "ClusterState",
    "ControlPlane",
    "DevCluster",
    "MinioServer",
    "ProcessRecord",
    "ServerProcess",
    "bin_dir",
    "binary",
    "cache_dir",
    "default_directory",
    "free_port",
    "gpu_node_manifest",
    "missing_binaries",
    "wait_for",
    "write_kubeconfig",
]
