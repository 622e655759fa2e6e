"""The operator as the tests run it: `kernelfleet operator` in a child process of its own, so a
test can kill it with SIGKILL mid-job and start it again, as a node failure would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests._servers._process import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION = "kernelfleet.io", "v1alpha1"


class OperatorProcess:
    """`kernelfleet operator -n NS --standalone`, its log in `log_path`."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        workdir: Path,
        *,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        standalone: bool = True,
        name: str = "operator",
    ) -> None:
        self._command = [
            sys.executable,
            "-m",
            "kernelfleet.core.cli",
            "operator",
            "--namespace",
            namespace,
            *(["--standalone"] if standalone else []),
            "--metrics-host=127.0.0.1",
            "--status-interval=1",
            *args,
        ]
        self._new_ports()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), **(env or {})}
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _new_ports(self) -> None:
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.argv = [
            *self._command,
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
            f"--metrics-port={self.metrics_port}",
        ]

    def start(self) -> OperatorProcess:
        """Start the operator and wait until it serves its liveness probe (or exits). `free_port`
        cannot hold a port until the operator binds it: when another process took one meanwhile,
        the operator exits with 'address already in use', and it is started again on new ports
        rather than leaving a test to wait out its timeout for an operator that never ran."""
        self.starts += 1
        for attempt in range(3):
            marker = f"---- start {self.starts}" + (f" (again on new ports, {attempt})" if attempt else "")
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open
            log.write(f"{marker}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
            if not self._lost_a_port(marker):
                break
            self._new_ports()
        return self

    def _lost_a_port(self, marker: str, timeout: float = 60.0) -> bool:
        """Wait for the liveness probe to answer; True when the operator exited because a port
        it was given had been taken."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                this_start = self.log().rsplit(f"{marker}\n", 1)[-1]
                return "address already in use" in this_start
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2).close()
                return False
            except urllib.error.HTTPError:
                return False  # it answers: the port is the operator's
            except OSError:
                time.sleep(0.2)
        return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye, like a lost node."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=30)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def apply_crds(kube: Any, names: Sequence[str] = ("optimizationjobs.yaml", "trainingruns.yaml")) -> None:
    """Create the CRDs in crds/ (once per control plane) and wait until they are served."""
    from kubernetes.client.exceptions import ApiException

    for name in names:
        document = yaml.safe_load((ROOT / "crds" / name).read_text())
        try:
            kube.apiextensions.create_custom_resource_definition(document)
        except ApiException as error:
            if error.status != 409:
                raise

        def established(crd_name: str = document["metadata"]["name"]) -> bool:
            crd = kube.apiextensions.read_custom_resource_definition(crd_name)
            return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

        wait_for(f"CRD {name} established", established, timeout=30)


def optimization_job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OptimizationJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def training_run(name: str, **spec: Any) -> dict[str, Any]:
    """A small TrainingRun manifest (two stages: sft, then an RL stage with its own evaluator)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "baseModel": "s3://models/tiny",
            "tasks": ["kernelbench-v0:1"],
            "stages": [{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
            "gpuClass": "h100",
            "rewardGpuClass": "l40",
            "rewardGpus": 2,
            **spec,
        },
    }


def create(kube: Any, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = kube.custom.create_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", body
    )
    return result


def read(kube: Any, name: str) -> dict[str, Any]:
    result: dict[str, Any] = kube.custom.get_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", name
    )
    return result


def condition(resource: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for found in resource.get("status", {}).get("conditions") or []:
        if found.get("type") == type_:
            return found
    return None


def wait_condition(
    kube: Any, name: str, type_: str, status: str = "True", timeout: float = 90.0
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        resource = read(kube, name)
        found = condition(resource, type_)
        return resource if found is not None and found.get("status") == status else None

    result: dict[str, Any] = wait_for(f"{name}: {type_}={status}", check, timeout=timeout)
    return result


def jobs_of(kube: Any, name: str) -> list[Any]:
    return list(
        kube.batch.list_namespaced_job(
            kube.namespace, label_selector=f"kernelfleet.io/optimizationjob={name}"
        ).items
    )


def store_secret(kube: Any, name: str, minio: Any) -> None:
    from kubernetes import client

    kube.core.create_namespaced_secret(
        kube.namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=name),
            string_data={"accesskey": minio.access_key, "secretkey": minio.secret_key},
        ),
    )


def settle(seconds: float) -> None:
    """Give a process that runs on its own time a moment (only where nothing can be polled)."""
    time.sleep(seconds)
