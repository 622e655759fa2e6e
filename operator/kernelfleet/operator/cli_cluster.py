"""The cluster path on the command line: `dev-cluster`, `submit`, `status` and `logs`.

These are commands of the operator distribution (no torch): a user's laptop with only
`kernelfleet-operator` installed can start a dev cluster, submit jobs and follow them. Parsers
are built here; each handler imports what it needs when it runs, so `kernelfleet --help` stays
fast and never loads the Kubernetes client.
"""

from __future__ import annotations

import argparse
from typing import Any


def _lazy(module: str, function: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        import importlib

        result: int = getattr(importlib.import_module(module), function)(args)
        return result

    return handler


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        default=None,
        metavar="DIR",
        help="where the cluster keeps its state and data (default: $KERNELFLEET_DEV_CLUSTER_DIR or "
        "~/.cache/kernelfleet/dev-cluster)",
    )


def register_dev_cluster(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "dev-cluster",
        help="a Kubernetes cluster with fake GPU nodes and a store, on this machine",
        description="Run the cluster path without a cluster: a real control plane (etcd, kube-apiserver, "
        "scheduler, controller-manager), kwok nodes in four GPU pools (a100, h100, l40, rtx3090) and "
        "MinIO, built from their Go modules into kernelfleet's cache on first use.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the cluster (build the servers first if needed)")
    _add_dir(up)
    up.add_argument("--nodes-per-pool", type=int, default=2, help="fake nodes per GPU pool (8 GPUs each)")
    up.add_argument("--no-build", action="store_true", help="fail instead of building missing servers")
    up.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "up"))
    down = actions.add_parser("down", help="stop the cluster")
    _add_dir(down)
    down.add_argument("--purge", action="store_true", help="also delete the store's data")
    down.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "down"))
    env = actions.add_parser("env", help="print the exports that point kubectl and kernelfleet at it")
    _add_dir(env)
    env.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "env"))
    check = actions.add_parser("check", help="say what is built, running and healthy")
    _add_dir(check)
    check.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "check"))
