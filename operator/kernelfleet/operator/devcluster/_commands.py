"""`kernelfleet dev-cluster up|down|env|check|demo`: what each prints and when it fails.

Messages go to stderr; `env` alone writes to stdout, so that `eval $(kernelfleet dev-cluster env)`
takes exactly the exports.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from kernelfleet.core.errors import UsageError
from kernelfleet.operator.devcluster._binaries import build, build_message
from kernelfleet.operator.devcluster._cluster import ClusterState, DevCluster, missing_binaries
from kernelfleet.operator.devcluster._process import bin_dir


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cluster(args: argparse.Namespace) -> DevCluster:
    return DevCluster(Path(args.dir) if args.dir else None)


def _running(cluster: DevCluster) -> ClusterState:
    state = cluster.load()
    if state is None:
        raise UsageError(
            f"no dev cluster runs in {cluster.directory}: start one with `kernelfleet dev-cluster up`"
        )
    dead = state.dead()
    if dead:
        names = ", ".join(f"{record.name} (log: {record.log})" for record in dead)
        raise UsageError(
            f"the dev cluster in {cluster.directory} is only partly running: {names} stopped; restart it "
            "with `kernelfleet dev-cluster down` and `kernelfleet dev-cluster up`"
        )
    return state


def ensure_binaries(allow_build: bool) -> None:
    """Build the missing servers, after saying what that costs; or refuse, with the same words."""
    missing = missing_binaries()
    if not missing:
        return
    message = build_message(missing)
    if not allow_build:
        raise UsageError(message + " Run it without --no-build to build them now, or run `make binaries`.")
    _say(message + " Building now.")
    seconds = build()
    _say(f"built the servers in {seconds / 60:.1f} minutes")


def up(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    ensure_binaries(allow_build=not args.no_build)
    started = time.monotonic()
    _say(f"starting the dev cluster in {cluster.directory} ...")
    state = cluster.up(nodes_per_pool=args.nodes_per_pool)
    _say(
        f"dev cluster up in {time.monotonic() - started:.0f}s: API server {state.api_server}, "
        f"{args.nodes_per_pool * 4} fake GPU nodes (a100, h100, l40, rtx3090), MinIO at {state.s3_endpoint} "
        f"(store {state.store_url}).\nPoint your shell at it:  eval $(kernelfleet dev-cluster env)\n"
        "Stop it:                 kernelfleet dev-cluster down"
    )
    return 0


def down(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    state = cluster.down(purge=args.purge)
    if state is None:
        _say(f"no dev cluster was running in {cluster.directory}")
    else:
        kept = (
            ""
            if args.purge
            else f"; the store's data stays in {cluster.directory / 'minio'} (--purge removes it)"
        )
        _say(f"stopped the dev cluster in {cluster.directory} ({len(state.processes)} processes){kept}")
    return 0


def env(args: argparse.Namespace) -> int:
    state = _running(_cluster(args))
    for name, value in state.env().items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def check(args: argparse.Namespace) -> int:
    """Say what is there and what is not; exit 1 when the cluster cannot be used as it is."""
    cluster = _cluster(args)
    problems = 0
    missing = missing_binaries()
    if missing:
        problems += 1
        _say(f"binaries: missing {', '.join(missing)} in {bin_dir()}; {build_message(missing)}")
    else:
        _say(f"binaries: all present in {bin_dir()}")
    state = cluster.load()
    if state is None:
        _say(f"cluster: none in {cluster.directory} (start one with `kernelfleet dev-cluster up`)")
        return 1
    for record in state.processes:
        alive = record.alive()
        problems += 0 if alive else 1
        _say(f"  {record.name:<24} {'running' if alive else 'STOPPED'}  pid {record.pid}  log {record.log}")
    from kernelfleet.operator.devcluster._health import cluster_health

    for line, ok in cluster_health(state):
        problems += 0 if ok else 1
        _say(f"  {line}")
    _say("ok" if problems == 0 else f"{problems} problem(s)")
    return 0 if problems == 0 else 1
