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
from kernelfleet.operator.devcluster._cluster import (
    KUEUE_GPUS_PER_CLASS,
    KUEUE_QUEUE,
    ClusterState,
    DevCluster,
    missing_binaries,
)
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


def ensure_binaries(allow_build: bool, kueue: bool = False) -> None:
    """Build the missing servers, after saying what that costs; or refuse, with the same words."""
    missing = missing_binaries(kueue=kueue)
    if not missing:
        return
    message = build_message(missing)
    if not allow_build:
        raise UsageError(message + " Run it without --no-build to build them now, or run `make binaries`.")
    _say(message + " Building now.")
    seconds = build(components=tuple(dict.fromkeys(_COMPONENTS.get(name, name) for name in missing)))
    _say(f"built the servers in {seconds / 60:.1f} minutes")


# The build script's component of each binary that has another name.
_COMPONENTS = {"kube-apiserver": "kube", "kube-controller-manager": "kube", "kube-scheduler": "kube"}


def start(
    cluster: DevCluster, kwok_nodes_per_pool: int = 0, with_operator: bool = True, kueue: bool = False
) -> ClusterState:
    """Servers, MinIO, the chart, and (unless told not to) the operator and the pod runner."""
    from kernelfleet.operator.devcluster._install import install, operator_process
    from kernelfleet.operator.devcluster._services import pod_runner_process

    started = time.monotonic()
    _say(f"starting the dev cluster in {cluster.directory} ...")
    state = cluster.up(kwok_nodes_per_pool=kwok_nodes_per_pool, kueue=kueue)
    try:
        elapsed = time.monotonic() - started
        _say(f"control plane and MinIO up ({elapsed:.0f}s); installing the chart with helm ...")
        install(state)
        if with_operator:
            operator = operator_process(state)
            operator.start()
            state = cluster.add_processes(operator.record())
            runner = pod_runner_process(state)
            runner.start()
            state = cluster.add_processes(runner.record())
    except BaseException:
        cluster.down()
        raise
    _say(f"dev cluster up in {time.monotonic() - started:.0f}s")
    return state


def up(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    ensure_binaries(allow_build=not args.no_build, kueue=args.kueue)
    state = start(cluster, args.kwok_nodes_per_pool, with_operator=not args.no_operator, kueue=args.kueue)
    running = (
        ""
        if args.no_operator
        else "; the operator (from the chart) and a pod runner playing one node per pool"
    )
    _say(
        f"API server {state.api_server}, MinIO at {state.s3_endpoint} (store {state.store_url}), "
        f"the chart installed in namespace kernelfleet-system{running}.\n"
        "Point your shell at it:  eval $(kernelfleet dev-cluster env)\n"
        + (
            f"Kueue admits the Jobs of queue '{KUEUE_QUEUE}' (namespace default), "
            f"{KUEUE_GPUS_PER_CLASS} GPUs per class: add --queue-name {KUEUE_QUEUE} to submit.\n"
            if args.kueue
            else ""
        )
        + "Submit a job:            kernelfleet submit examples/tasks --gpu-class h100 --wait\n"
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


def demo(args: argparse.Namespace) -> int:
    """The cluster path end to end on this machine: up, submit, follow, results, down."""
    import os

    from kernelfleet.core.cli import main as kernelfleet
    from kernelfleet.operator.devcluster._install import find_chart

    examples = find_chart().parent.parent / "examples"
    cluster = _cluster(args)
    ensure_binaries(allow_build=not args.no_build)
    current = cluster.load()
    fresh = current is None or bool(current.dead())
    if current is not None and fresh:
        cluster.down()
    state = start(cluster) if fresh else _running(cluster)
    saved = dict(os.environ)
    try:
        os.environ.update(state.env())
        argv = [
            "submit",
            str(examples / "tasks"),
            "--gpu-class",
            args.gpu_class,
            # The hand-written candidates: a replay costs only its evaluations, where the compile
            # policy's torch.compile builds take minutes on a CPU.
            "--policy",
            f"replay:{examples / 'candidates.jsonl'}",
            "--rounds",
            "1",
            "--samples",
            "2",
            "--timing-trials",
            "10",
            "--correctness-trials",
            "1",
            "--timing-warmup",
            "1",
            # Two worker pods side by side, two tasks each.
            "--parallelism",
            "2",
            "--tasks-per-index",
            "2",
            "--wait",
        ]
        _say("$ kernelfleet " + " ".join(argv))
        status = kernelfleet(argv)
        if status == 0:
            _say("\n$ kernelfleet status")
            kernelfleet(["status"])
        return status
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if fresh and not args.keep:
            cluster.down()
            _say("dev cluster stopped (--keep leaves it running)")
