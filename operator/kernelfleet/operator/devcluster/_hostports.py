"""Stable pod host names (a JobSet's `<pod>.<subdomain>`) for pods that run as local processes.

In a cluster, a JobSet's headless Service makes `<jobset>-<role>-<job>-<pod>.<subdomain>` resolve
to the pod's IP, and each pod has the whole port range to itself. On the pod runner every pod is
a process of this machine, so each (host name, port) gets a loopback port of its own instead,
recorded in one JSON file that every pod's process shares:

- the pod runner rewrites what it starts: a server pod's own listening port (`--port 8470`,
  `0.0.0.0:8470`) and any `host.<subdomain>:port` in a command or environment value becomes
  `127.0.0.1:<its port>` (torchrun's rendezvous endpoint, which C++ resolves);
- Python code that looks such a name up later (an HTTP client given a URL from the store) asks
  `socket.getaddrinfo`, which `install` (run by the pods' `sitecustomize`) answers from the file.

Standard library only: it runs at the start of every pod's Python process.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "KERNELFLEET_PODRUNNER_HOSTS"
_NAME = re.compile(
    r"^(?P<host>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<subdomain>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(\..*)?$"
)
_IN_TEXT = re.compile(
    r"(?P<name>[a-z0-9][-a-z0-9]*\.[a-z0-9][-a-z0-9]*(?:\.[a-z0-9][-a-z0-9.]*)?):(?P<port>\d+)"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class HostPorts:
    """The shared table: subdomains served here, and (host name, port) -> loopback port."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = json.loads(self.path.read_text()) if self.path.exists() else {}
                table.setdefault("subdomains", [])
                table.setdefault("ports", {})
                before = json.dumps(table, sort_keys=True)
                yield table
                if json.dumps(table, sort_keys=True) != before:
                    temporary = self.path.with_suffix(".tmp")
                    temporary.write_text(json.dumps(table, sort_keys=True))
                    temporary.replace(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add_subdomain(self, subdomain: str) -> None:
        with self._locked() as table:
            if subdomain not in table["subdomains"]:
                table["subdomains"].append(subdomain)

    def port(self, name: str, port: int) -> int | None:
        """The loopback port of `name:port`, assigned now if new; None for a name that is no
        pod host name of a subdomain served here."""
        match = _NAME.match(name)
        if match is None:
            return None
        key = f"{match.group('host')}.{match.group('subdomain')}:{port}"
        with self._locked() as table:
            if match.group("subdomain") not in table["subdomains"]:
                return None
            if key not in table["ports"]:
                table["ports"][key] = _free_port()
            return int(table["ports"][key])

    def rewrite(self, text: str) -> str:
        """Every `host.<subdomain>:port` in `text` as `127.0.0.1:<its port>`."""

        def local(match: re.Match[str]) -> str:
            found = self.port(match.group("name"), int(match.group("port")))
            return match.group(0) if found is None else f"127.0.0.1:{found}"

        return _IN_TEXT.sub(local, text)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def install() -> None:
    """Answer `socket.getaddrinfo` for the pod host names of $KERNELFLEET_PODRUNNER_HOSTS."""
    path = os.environ.get(ENV)
    if not path:
        return
    table = HostPorts(Path(path))
    original = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and port is not None and _NAME.match(host) and not _is_address(host):
            try:
                number = int(port)
            except (TypeError, ValueError):
                number = None
            found = table.port(host, number) if number is not None else None
            if found is not None:
                return original("127.0.0.1", found, *args, **kwargs)
        return original(host, port, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
