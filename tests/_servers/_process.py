"""Start a server process, wait until it is ready, stop it; find free ports and binaries; poll
until a condition holds."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BUILD_HINT = "run `make binaries` (scripts/build-test-binaries.sh) to build it"


def bin_dir() -> Path:
    """Where the built servers are: $KERNELFLEET_BIN_DIR, else the build script's cache."""
    configured = os.environ.get("KERNELFLEET_BIN_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("KERNELFLEET_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernelfleet"
    )
    return Path(cache) / "bin"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"test server binary '{name}' not found in {bin_dir()}: {BUILD_HINT}")
    return path


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    """The first truthy value of `check()`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One long-running server, its log in a file next to its data."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        ready: Callable[[], bool],
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.workdir = workdir
        self.ready = ready
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.log_path = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        self._proc = subprocess.Popen(
            self.argv,
            cwd=self.workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                status = self._proc.returncode
                raise RuntimeError(f"{self.name} exited ({status}) before it was ready:\n{self.tail()}")
            try:
                if self.ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} was not ready after {self.ready_timeout:.0f}s:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
