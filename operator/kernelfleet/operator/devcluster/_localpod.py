"""A pod's container as a local process: its command, environment and volumes, on this machine.

There is no container runtime in the dev cluster (nor in the tests), so whatever must really
run (the operator from the chart's Deployment, the worker pods of a job) runs as a process of
this machine instead, with what its pod spec says:

- `kernelfleet ...` runs this Python's kernelfleet (the image would run the same command);
- environment values, Secret and ConfigMap key references, and the downward API's fields;
- each volume mount becomes a directory of its own (emptyDir empty; Secret and ConfigMap
  volumes filled from the API server), and every argument and environment value that points
  into a mount point is rewritten to point into that directory;
- a listener on `0.0.0.0:PORT` (probes, metrics), which in a pod has the pod's own network,
  listens on 127.0.0.1 on a free port instead, so that nothing collides on the machine;
- a pod with a stable host name (a JobSet's `hostname` and `subdomain`) listens on the ports it
  declares at the loopback ports `_hostports` assigns to its name, and every `host.<subdomain>:PORT`
  its command or environment names becomes that loopback address (`torchrun` runs this
  Python's torch.distributed.run).

Pod specs are read as plain dicts (the API's JSON), so this works on what `helm template` or
the API server returns alike.
"""

from __future__ import annotations

import base64
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelfleet.operator.devcluster._hostports import HostPorts
from kernelfleet.operator.devcluster._process import free_port

# Reads one object the pod refers to: (kind "Secret" | "ConfigMap", namespace, name) -> its data
# (Secret values base64-encoded, as the API returns them), or None when it does not exist.
ReadObject = Callable[[str, str, str], Mapping[str, str] | None]
_ANY_ADDRESS = re.compile(r"0\.0\.0\.0:(\d+)")
_PORT_FLAG = re.compile(r"^(--[a-z-]*port)=(\d+)$")


@dataclass(frozen=True)
class LocalCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    # Ports the pod listened on, by what they became here (container port -> local port).
    ports: dict[int, int]


def api_reader(core: Any) -> ReadObject:
    """A ReadObject over a CoreV1Api."""
    from kubernetes.client.exceptions import ApiException

    def read(kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
        try:
            if kind == "Secret":
                return dict(core.read_namespaced_secret(name, namespace).data or {})
            return dict(core.read_namespaced_config_map(name, namespace).data or {})
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    return read


def local_command(
    pod: Mapping[str, Any],
    read: ReadObject,
    workdir: Path,
    *,
    base_env: Mapping[str, str],
    container: int = 0,
    python: str = sys.executable,
    hosts: HostPorts | None = None,
) -> LocalCommand:
    """What to run for container `container` of `pod` (a Pod or a pod template, as a dict).

    `hosts`: the shared table of pod host names (see `_hostports`), for pods of a JobSet."""
    meta, spec = pod.get("metadata") or {}, pod["spec"]
    namespace = meta.get("namespace") or "default"
    main = spec["containers"][container]
    workdir.mkdir(parents=True, exist_ok=True)
    mounts = _mounts(spec, main, namespace, read, workdir)
    ports: dict[int, int] = {}
    env = dict(base_env)
    rewrite = hosts.rewrite if hosts is not None else (lambda text: text)
    if hosts is not None and spec.get("hostname") and spec.get("subdomain"):
        hosts.add_subdomain(spec["subdomain"])
        own = f"{spec['hostname']}.{spec['subdomain']}"
        for declared in main.get("ports") or []:
            port = int(declared["containerPort"])
            ports[port] = hosts.port(own, port) or free_port()
    for variable in main.get("env") or []:
        value = _env_value(variable, meta, spec, namespace, read)
        if value is not None:
            env[variable["name"]] = rewrite(_local_address(_remap(value, mounts), ports))
    raw = [*(main.get("command") or []), *(main.get("args") or [])]
    argv = []
    for index, arg in enumerate(raw):
        if index and raw[index - 1].endswith("-port") and arg.isdigit() and int(arg) in ports:
            argv.append(str(ports[int(arg)]))  # `--port 8470`: the port the pod declared
            continue
        argv.append(rewrite(_local_address(_remap(arg, mounts), ports)))
    if argv and argv[0] == "kernelfleet":
        # This machine's interpreter is no path in the pod: substituted after the remapping, so
        # a checkout under a mount point (/tmp) is not taken for one of the pod's volumes.
        argv = [python, "-m", "kernelfleet.core.cli", *argv[1:]]
    elif argv and argv[0] == "torchrun":
        argv = [python, "-m", "torch.distributed.run", *argv[1:]]
    return LocalCommand(argv=argv, env=env, cwd=workdir, ports=ports)


def _local_address(text: str, ports: dict[int, int]) -> str:
    """`0.0.0.0:8080` -> `127.0.0.1:<free>`, `--metrics-port=9090` -> `--metrics-port=<free>`."""

    def port_for(port: int) -> int:
        if port not in ports:
            ports[port] = free_port()
        return ports[port]

    flag = _PORT_FLAG.match(text)
    if flag:
        return f"{flag.group(1)}={port_for(int(flag.group(2)))}"
    return _ANY_ADDRESS.sub(lambda m: f"127.0.0.1:{port_for(int(m.group(1)))}", text)


def _env_value(
    variable: Mapping[str, Any],
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    namespace: str,
    read: ReadObject,
) -> str | None:
    source = variable.get("valueFrom")
    if source is None:
        return str(variable.get("value") or "")
    if "secretKeyRef" in source or "configMapKeyRef" in source:
        kind, ref = (
            ("Secret", source["secretKeyRef"])
            if "secretKeyRef" in source
            else ("ConfigMap", source["configMapKeyRef"])
        )
        data = read(kind, namespace, ref["name"]) or {}
        raw = data.get(ref["key"])
        if raw is None:
            return None
        return base64.b64decode(raw).decode() if kind == "Secret" else str(raw)
    if "fieldRef" in source:
        return _field(meta, spec, namespace, source["fieldRef"]["fieldPath"])
    return None


def _field(meta: Mapping[str, Any], spec: Mapping[str, Any], namespace: str, path: str) -> str | None:
    """The downward API: name, namespace, uid, node name, and one annotation or label."""
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": namespace,
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
    }
    if path in simple:
        value = simple[path]
        return None if value is None else str(value)
    for prefix, values in (
        ("metadata.annotations", meta.get("annotations")),
        ("metadata.labels", meta.get("labels")),
    ):
        if path.startswith(prefix + "['") and path.endswith("']"):
            found = (values or {}).get(path[len(prefix) + 2 : -2])
            return None if found is None else str(found)
    return None


def _mounts(
    spec: Mapping[str, Any], container: Mapping[str, Any], namespace: str, read: ReadObject, workdir: Path
) -> dict[str, Path]:
    """Each mount point of the container -> a local directory with the volume's content."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes") or []}
    mounts: dict[str, Path] = {}
    root = _volumes_root(workdir)
    for mount in container.get("volumeMounts") or []:
        local = root / mount["name"]
        if local.exists():
            shutil.rmtree(local)
        local.mkdir(parents=True)
        volume = volumes.get(mount["name"]) or {}
        for kind, key, name_key in (("Secret", "secret", "secretName"), ("ConfigMap", "configMap", "name")):
            if key not in volume:
                continue
            data = read(kind, namespace, volume[key][name_key]) or {}
            items = volume[key].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] in data:
                    raw = data[item["key"]]
                    target = local / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(raw) if kind == "Secret" else raw.encode())
        mounts[mount["mountPath"]] = local
    return mounts


# A Unix socket's path must stay under 108 bytes, and programs put sockets in TMPDIR (Python's
# multiprocessing forkserver does); TMPDIR is a volume (/scratch in a worker pod), so volume
# directories must have short paths too.
_SHORT_PATH = 48


def _volumes_root(workdir: Path) -> Path:
    """Where the pod's volumes live: `workdir/volumes`, or when that path is long, a short
    temporary directory that `workdir/volumes` links to."""
    link = workdir / "volumes"
    if len(str(link)) <= _SHORT_PATH:
        return link
    if link.is_symlink():
        target = link.resolve()
        shutil.rmtree(target, ignore_errors=True)
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)
    root = Path(tempfile.mkdtemp(prefix="kfpod-"))
    link.symlink_to(root, target_is_directory=True)
    return root


def _remap(value: str, mounts: Mapping[str, Path]) -> str:
    """A path inside a mount point, as the local directory that stands for it (also after `=`)."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        root = mount_path.rstrip("/")
        for prefix in ("", *(value[: i + 1] for i, char in enumerate(value) if char == "=")):
            rest = value[len(prefix) :]
            if rest == root or rest.startswith(root + "/"):
                return prefix + str(mounts[mount_path]) + rest[len(root) :]
    return value
