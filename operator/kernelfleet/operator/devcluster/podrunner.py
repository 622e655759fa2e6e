"""A kubelet for worker pods, without containers: it runs each pod's command as a local process.

There is no container runtime on a test machine, and kwok only pretends pods ran. To test the
whole path (an OptimizationJob -> Indexed Jobs -> pods -> `kernelfleet worker` -> the store ->
status), `PodRunner` plays the kubelet of one or more nodes of its own:

- it registers each node (labels, taints and GPU capacity as given) and keeps it Ready, with
  node status heartbeats and a Lease, as a kubelet does, so the node lifecycle controller
  leaves it alone;
- for every pod the scheduler binds to one of its nodes it starts the pod's first container's
  command on this machine with the container's environment and volumes, as `_localpod`
  translates them (`kernelfleet ...` runs this Python's CLI; Secret references and the
  downward API's fields and annotations, JOB_COMPLETION_INDEX among them; volume mounts as
  directories of the runner's, and paths into them rewritten);
- a JobSet's pods reach each other by their stable host names (`<pod>.<subdomain>`): each
  (name, port) gets a loopback port of its own (`_hostports`), which the pods' commands and
  environment are rewritten to, and which their Python processes resolve such names to (a
  `sitecustomize` the runner puts on their PYTHONPATH);
- it reports the pod Running, then Succeeded or Failed with the container's exit code (the
  Jobs' pod failure policy reads it), and it kills the process when the pod is deleted.

Nothing here is pytest-specific: the e2e tests use it, and `kernelfleet dev-cluster up` runs
it as a process of its own (`python -m kernelfleet.operator.devcluster.podrunner`, see `main`).
Only nodes named here are touched: kwok's nodes and their pods are not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kernelfleet.operator.devcluster import _hostports
from kernelfleet.operator.devcluster._hostports import HostPorts
from kernelfleet.operator.devcluster._localpod import api_reader, local_command

log = logging.getLogger("kernelfleet.podrunner")

HEARTBEAT_S = 5.0
POLL_S = 0.5


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class RunnerNode:
    """A node the runner plays the kubelet of."""

    name: str
    labels: Mapping[str, str]
    gpus: int = 8
    gpu_resource: str = "nvidia.com/gpu"
    taints: Sequence[Mapping[str, str]] = (
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    )

    def manifest(self) -> dict[str, Any]:
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", self.gpu_resource: str(self.gpus)}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **self.labels,
                },
            },
            "spec": {"taints": [dict(t) for t in self.taints]},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [_ready_condition()],
                "nodeInfo": _node_info(),
            },
        }


def _ready_condition() -> dict[str, str]:
    now = _now()
    return {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "kernelfleet pod runner is ready",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def _node_info() -> dict[str, str]:
    return {
        "architecture": "amd64",
        "operatingSystem": "linux",
        "kubeletVersion": "v1.37.0-podrunner",
        "containerRuntimeVersion": "podrunner://1",
        "kernelVersion": "",
        "osImage": "",
        "machineID": "",
        "systemUUID": "",
        "bootID": "",
        "kubeProxyVersion": "",
    }


@dataclass
class _Running:
    pod_name: str
    namespace: str
    uid: str
    process: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    deleting: bool = False


@dataclass
class PodRunner:
    """Runs the pods bound to `nodes`; see the module docstring. Use as a context manager."""

    api_client: Any
    nodes: Sequence[RunnerNode]
    workdir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _running: dict[str, _Running] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    exit_codes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kubernetes import client

        # Typed loosely: the runner passes plain dicts, which the client accepts.
        self.core: Any = client.CoreV1Api(self.api_client)
        self.coordination: Any = client.CoordinationV1Api(self.api_client)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = HostPorts(self.workdir / "hosts.json")
        # Loaded by file, not by package: it runs at the start of every Python process of a pod.
        self.site = self.workdir / "site"
        self.site.mkdir(exist_ok=True)
        (self.site / "sitecustomize.py").write_text(
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('_kf_hostports', {_hostports.__file__!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "module.install()\n"
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> PodRunner:
        from kubernetes.client.exceptions import ApiException

        for node in self.nodes:
            try:
                self.core.create_node(node.manifest())
            except ApiException as error:
                if error.status != 409:
                    raise
        self._heartbeat()
        for target in (self._heartbeats, self._loop):
            thread = threading.Thread(target=target, name=f"podrunner-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for running in list(self._running.values()):
            self._kill(running)
        # Volumes that live in short temporary directories (see _localpod) go with the runner.
        for link in self.workdir.glob("*/volumes"):
            if link.is_symlink():
                shutil.rmtree(link.resolve(), ignore_errors=True)
                link.unlink()

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the node

    def _heartbeats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._heartbeat()
            except Exception as error:  # a missed heartbeat is retried; the grace period is long
                log.warning("node heartbeat failed: %s", error)

    def _heartbeat(self) -> None:
        """Every node's Ready condition and Lease, each on its own: one node's failure never
        starves the others (the node lifecycle controller would taint them unreachable)."""
        failures = []
        for node in self.nodes:
            try:
                self._beat(node)
            except Exception as error:
                failures.append(f"{node.name}: {error}")
        if failures:
            raise RuntimeError("; ".join(failures))

    def _beat(self, node: RunnerNode) -> None:
        from kubernetes.client.exceptions import ApiException

        self.core.patch_node_status(node.name, {"status": {"conditions": [_ready_condition()]}})
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": 40, "renewTime": _now_micro()}
        try:
            # A merge patch needs no resourceVersion, unlike a replace.
            self.coordination.patch_namespaced_lease(node.name, "kube-node-lease", {"spec": spec})
        except ApiException as error:
            if error.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": node.name, "namespace": "kube-node-lease"},
                "spec": spec,
            }
            self.coordination.create_namespaced_lease("kube-node-lease", lease)

    # ------------------------------------------------------------------ pods

    def _loop(self) -> None:
        names = {node.name for node in self.nodes}
        while not self._stop.is_set():
            try:
                pods = self.core.list_pod_for_all_namespaces().items
                for pod in pods:
                    if pod.spec.node_name in names:
                        self._handle(pod)
                self._reap()
            except Exception as error:
                log.warning("pod runner pass failed: %s", error)
            self._stop.wait(POLL_S)

    def _handle(self, pod: Any) -> None:
        uid = pod.metadata.uid
        running = self._running.get(uid)
        if pod.metadata.deletion_timestamp is not None:
            if running is not None:
                running.deleting = True
                self._kill(running)
            elif uid not in self._done:
                self._finalize_deleted(pod)
            return
        if running is not None or uid in self._done or pod.status.phase in ("Succeeded", "Failed"):
            return
        self._launch(pod)

    def _launch(self, pod: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        container = pod.spec.containers[0]
        workdir = self.workdir / f"{pod.metadata.namespace}-{pod.metadata.name}"
        path = os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH", "")) if p)
        command = local_command(
            self.api_client.sanitize_for_serialization(pod),
            api_reader(self.core),
            workdir,
            base_env={**os.environ, **self.env, "PYTHONPATH": path, _hostports.ENV: str(self.hosts.path)},
            python=self.python,
            hosts=self.hosts,
        )
        log_path = workdir / "container.log"
        with open(log_path, "ab") as output:
            process = subprocess.Popen(
                command.argv,
                env=command.env,
                cwd=workdir,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._running[pod.metadata.uid] = _Running(
            pod.metadata.name, pod.metadata.namespace, pod.metadata.uid, process, workdir, log_path
        )
        now = _now()
        status = {
            "phase": "Running",
            "startTime": now,
            "podIP": "10.244.0.10",
            "hostIP": "10.0.0.10",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image,
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
        try:
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )
        except ApiException as error:
            log.warning("could not report pod %s running: %s", pod.metadata.name, error)

    def _reap(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for uid, running in list(self._running.items()):
            code = running.process.poll()
            if code is None:
                continue
            if code < 0:
                code = 128 - code  # killed by a signal: the status a container runtime reports
            del self._running[uid]
            self._done.add(uid)
            self.exit_codes[running.pod_name] = code
            try:
                if running.deleting:
                    # As a kubelet does: the killed pod ends Failed (keeping the conditions the
                    # API server gave it, such as an eviction's DisruptionTarget) before it goes,
                    # so that a Job with a pod failure policy sees it end and replaces it.
                    self._report_killed(running)
                    self.core.delete_namespaced_pod(
                        running.pod_name, running.namespace, grace_period_seconds=0
                    )
                    continue
                pod = self.core.read_namespaced_pod(running.pod_name, running.namespace)
                container = pod.spec.containers[0]
                now = _now()
                tail = (
                    running.log_path.read_text(errors="replace")[-2000:] if running.log_path.exists() else ""
                )
                status = {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "False",
                            "reason": "PodCompleted",
                            "lastTransitionTime": now,
                        },
                        {
                            "type": "ContainersReady",
                            "status": "False",
                            "reason": "PodCompleted",
                            "lastTransitionTime": now,
                        },
                    ],
                    "containerStatuses": [
                        {
                            "name": container.name,
                            "image": container.image,
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "started": False,
                            "state": {
                                "terminated": {
                                    "exitCode": code,
                                    "reason": "Completed" if code == 0 else "Error",
                                    "message": tail,
                                    "startedAt": now,
                                    "finishedAt": now,
                                }
                            },
                        }
                    ],
                }
                self.core.patch_namespaced_pod_status(running.pod_name, running.namespace, {"status": status})
            except ApiException as error:
                if error.status != 404:
                    log.warning("could not report pod %s finished: %s", running.pod_name, error)

    def _report_killed(self, running: _Running) -> None:
        from kubernetes.client.exceptions import ApiException

        now = _now()
        try:
            pod = self.core.read_namespaced_pod(running.pod_name, running.namespace)
            container = pod.spec.containers[0]
            terminated = {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}
            status = {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": container.name,
                        "image": container.image,
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "started": False,
                        "state": {"terminated": terminated},
                    }
                ],
            }
            self.core.patch_namespaced_pod_status(running.pod_name, running.namespace, {"status": status})
        except ApiException as error:
            if error.status != 404:
                log.warning("could not report pod %s killed: %s", running.pod_name, error)

    def _finalize_deleted(self, pod: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        self._done.add(pod.metadata.uid)
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise

    def crash(self, pod_name: str, namespace: str) -> bool:
        """SIGKILL the process group of a running pod, as a crashed container (or a lost node's
        process) dies: the pod ends Failed with the signal's exit status. False when not running."""
        for running in list(self._running.values()):
            if running.pod_name == pod_name and running.namespace == namespace:
                self._kill(running)
                return True
        return False

    @staticmethod
    def _kill(running: _Running) -> None:
        """Kill the pod's processes, all of them, as a container's end does: its process group
        and every process below it (torchrun starts its workers in sessions of their own)."""
        if running.process.poll() is None:
            below = _descendants(running.process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.process.pid, signal.SIGKILL)
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            running.process.wait(timeout=30)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (children of children too)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def wait_until(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    """The first truthy value of `check()` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def _node(text: str) -> RunnerNode:
    """`NAME=LABEL=VALUE,LABEL=VALUE`: a node and its labels."""
    name, _, labels = text.partition("=")
    pairs = [item.split("=", 1) for item in labels.split(",") if item]
    if not name or any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--node {text!r}: write NAME=LABEL=VALUE,LABEL=VALUE")
    return RunnerNode(name=name, labels=dict(pairs))


def main(argv: Sequence[str] | None = None) -> int:
    """Run a pod runner until SIGTERM or SIGINT; then kill the pods' processes and exit."""
    import argparse

    from kubernetes import config

    parser = argparse.ArgumentParser(prog="python -m kernelfleet.operator.devcluster.podrunner")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--node", action="append", required=True, type=_node, help="NAME=LABEL=VALUE,...")
    parser.add_argument("--alive-file", type=Path, default=None, help="written once the nodes are registered")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    api_client = config.new_client_from_config(config_file=args.kubeconfig)
    with PodRunner(api_client, args.node, args.workdir):
        log.info("playing the kubelet of %s", ", ".join(node.name for node in args.node))
        if args.alive_file is not None:
            args.alive_file.write_text(str(os.getpid()))
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
