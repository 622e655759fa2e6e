"""What runs beside the dev cluster's servers: the operator (from the chart) and the pod runner.

Both are started detached, like the servers, and recorded in the cluster's state so that
`kernelfleet dev-cluster down` stops them too. The pod runner plays the kubelet of one node per
GPU pool (labelled as GPU Feature Discovery labels real nodes): worker pods bound there run
`kernelfleet worker` on this machine, on its CPU or GPU, against the dev cluster's MinIO.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kernelfleet.operator.devcluster._cluster import ClusterState
from kernelfleet.operator.devcluster._kube import GPU_POOLS
from kernelfleet.operator.devcluster._process import ServerProcess

RUNNER_NODE_SUFFIX = "-local"


def runner_nodes() -> list[str]:
    """`POOL=LABEL=VALUE,...` per pool: the nodes the pod runner registers and plays."""
    return [
        f"{pool}{RUNNER_NODE_SUFFIX}=" + ",".join(f"{key}={value}" for key, value in labels.items())
        for pool, labels in GPU_POOLS.items()
    ]


def pod_runner_process(state: ClusterState) -> ServerProcess:
    """`python -m kernelfleet.operator.devcluster.podrunner` for the dev cluster's pools."""
    workdir = Path(state.directory) / "pods"
    health = workdir / "alive"
    health.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "kernelfleet.operator.devcluster.podrunner",
        "--kubeconfig",
        state.kubeconfig,
        "--workdir",
        str(workdir),
        "--alive-file",
        str(health),
    ]
    for node in runner_nodes():
        argv += ["--node", node]
    # Worker pods get only what their pod spec says, plus a PATH and HOME to run Python with:
    # not the user's kubeconfig, store keys or other kernelfleet settings.
    env = {key: value for key, value in os.environ.items() if key in ("PATH", "HOME", "LANG", "TMPDIR")}
    return ServerProcess(
        "pod-runner", argv, workdir, ready=health.exists, env=env, inherit_env=False, ready_timeout=60.0
    )
