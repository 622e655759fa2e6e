"""A pod spec as a local process: command, environment, volumes and listeners translated."""

from __future__ import annotations

import base64
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from kernelfleet.operator.devcluster._localpod import local_command

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
OBJECTS: dict[tuple[str, str, str], Mapping[str, str]] = {
    ("Secret", "team", "store"): {
        "accesskey": base64.b64encode(b"AK").decode(),
        "secretkey": base64.b64encode(b"SK").decode(),
    },
    ("ConfigMap", "team", "pools"): {"pools.yaml": "version: 1\n"},
}


def read(kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
    return OBJECTS.get((kind, namespace, name))


POD = {
    "metadata": {
        "name": "job-0-abc",
        "namespace": "team",
        "uid": "u-1",
        "annotations": {INDEX_ANNOTATION: "3"},
    },
    "spec": {
        "nodeName": "h100-local",
        "containers": [
            {
                "name": "worker",
                "command": ["kernelfleet", "operator"],
                "args": [
                    "--pools=/etc/kernelfleet/pools.yaml",
                    "--liveness=http://0.0.0.0:8080/healthz",
                    "--metrics-port=9090",
                ],
                "env": [
                    {"name": "PLAIN", "value": "x"},
                    {"name": "EMPTY"},
                    {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {
                        "name": "JOB_COMPLETION_INDEX",
                        "valueFrom": {
                            "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}
                        },
                    },
                    {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "store", "key": "accesskey"}}},
                    {"name": "MISSING", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}},
                    {"name": "CREDS", "value": "/var/run/secrets/kernelfleet/store"},
                    {"name": "HOME", "value": "/scratch/home"},
                ],
                "volumeMounts": [
                    {"name": "pools", "mountPath": "/etc/kernelfleet"},
                    {"name": "store", "mountPath": "/var/run/secrets/kernelfleet/store"},
                    {"name": "scratch", "mountPath": "/scratch"},
                ],
            }
        ],
        "volumes": [
            {"name": "pools", "configMap": {"name": "pools"}},
            {
                "name": "store",
                "secret": {"secretName": "store", "items": [{"key": "accesskey", "path": "accesskey"}]},
            },
            {"name": "scratch", "emptyDir": {}},
        ],
    },
}


def test_a_pod_becomes_a_local_command(tmp_path: Path) -> None:
    command = local_command(POD, read, tmp_path, base_env={"PATH": "/bin"})
    # A long work directory's volumes live at a short path it links to: TMPDIR is a volume, and
    # a Unix socket path there (multiprocessing's forkserver) must stay under 108 bytes.
    volumes = (tmp_path / "volumes").resolve()
    assert len(str(volumes / "scratch")) < 60
    assert command.argv[:4] == [sys.executable, "-m", "kernelfleet.core.cli", "operator"]
    assert command.argv[4] == f"--pools={volumes / 'pools'}/pools.yaml"
    assert (volumes / "pools" / "pools.yaml").read_text() == "version: 1\n"
    health, metrics = command.ports[8080], command.ports[9090]
    assert command.argv[5] == f"--liveness=http://127.0.0.1:{health}/healthz"
    assert command.argv[6] == f"--metrics-port={metrics}" and health != metrics
    env = command.env
    assert env["PATH"] == "/bin" and env["PLAIN"] == "x" and env["EMPTY"] == ""
    assert env["NS"] == "team" and env["JOB_COMPLETION_INDEX"] == "3" and env["KEY"] == "AK"
    assert "MISSING" not in env
    assert env["CREDS"] == str(volumes / "store") and (volumes / "store" / "accesskey").read_text() == "AK"
    assert not (volumes / "store" / "secretkey").exists()  # only the items asked for
    assert env["HOME"] == f"{volumes / 'scratch'}/home" and (volumes / "scratch").is_dir()


def test_this_machines_interpreter_is_never_taken_for_a_pod_path(tmp_path: Path) -> None:
    """A checkout under a directory the pod mounts (/scratch here, /tmp for the chart's operator)
    still runs with its own interpreter: only the pod's own paths are remapped."""
    python = "/scratch/checkout/.venv/bin/python"
    command = local_command(POD, read, tmp_path, base_env={}, python=python)
    assert command.argv[:4] == [python, "-m", "kernelfleet.core.cli", "operator"]


def jobset_pod(hostname: str, command: list[str], ports: list[int]) -> dict[str, object]:
    return {
        "metadata": {"name": f"{hostname}-x", "namespace": "team"},
        "spec": {
            "hostname": hostname,
            "subdomain": "js",
            "containers": [
                {
                    "name": "trainer",
                    "command": command,
                    "ports": [{"containerPort": port} for port in ports],
                    "env": [{"name": "URL", "value": "http://js-reward-0-0.js:8470/v1"}],
                }
            ],
        },
    }


def test_a_jobsets_stable_host_names_become_loopback_ports_every_pod_agrees_on(tmp_path: Path) -> None:
    """The leader listens on the port its peers are sent to; a name of no JobSet subdomain, and
    an address, stay as they are; torchrun runs this Python's torch.distributed.run."""
    from kernelfleet.operator.devcluster import _hostports
    from kernelfleet.operator.devcluster._hostports import HostPorts

    hosts = HostPorts(tmp_path / "hosts.json")
    rendezvous = "--rdzv-endpoint=js-trainer-0-0.js:29500"
    leader = local_command(
        jobset_pod("js-trainer-0-0", ["torchrun", rendezvous, "--store", "minio.storage:9000"], [29500]),
        read,
        tmp_path / "leader",
        base_env={},
        python="/py",
        hosts=hosts,
    )
    follower = local_command(
        jobset_pod("js-trainer-0-1", ["torchrun", rendezvous], []),
        read,
        tmp_path / "follower",
        base_env={},
        python="/py",
        hosts=hosts,
    )
    port = leader.ports[29500]
    assert leader.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert leader.argv[3] == follower.argv[3] == f"--rdzv-endpoint=127.0.0.1:{port}"
    assert leader.argv[-1] == "minio.storage:9000"
    reward = hosts.port("js-reward-0-0.js", 8470)
    assert leader.env["URL"] == f"http://127.0.0.1:{reward}/v1"
    server = local_command(
        jobset_pod("js-reward-0-0", ["kernelfleet", "eval", "serve", "--port", "8470"], [8470]),
        read,
        tmp_path / "reward",
        base_env={},
        python="/py",
        hosts=hosts,
    )
    assert server.argv[-2:] == ["--port", str(reward)]
    # A Python process of a pod resolves the names the same way (what `sitecustomize` installs).
    original = socket.getaddrinfo
    try:
        os.environ[_hostports.ENV] = str(hosts.path)
        _hostports.install()
        (found,) = {info[4] for info in socket.getaddrinfo("js-reward-0-0.js", 8470, type=socket.SOCK_STREAM)}
        assert found == ("127.0.0.1", reward)
    finally:
        socket.getaddrinfo = original
        os.environ.pop(_hostports.ENV, None)
