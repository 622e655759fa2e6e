"""Re-exported from `kernelfleet.operator.devcluster`, where the control plane lives so that
users can run it too (`kernelfleet dev-cluster up`)."""

from kernelfleet.operator.devcluster._kube import (
    CONTROLLERS,
    GPU_POOLS,
    GPUS_PER_NODE,
    KWOK_ANNOTATION,
    ControlPlane,
    Etcd,
    KubeApiServer,
    gpu_node_manifest,
    kwok_configuration,
    write_kubeconfig,
)

__all__ = [
    "CONTROLLERS",
    "GPUS_PER_NODE",
    "GPU_POOLS",
    "KWOK_ANNOTATION",
    "ControlPlane",
    "Etcd",
    "KubeApiServer",
    "gpu_node_manifest",
    "kwok_configuration",
    "write_kubeconfig",
]
