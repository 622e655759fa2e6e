"""Start a server process, wait until it is ready, stop it; find free ports and binaries; poll
until a condition holds.

A server runs in its own session, so it outlives the command that started it: `kernelfleet
dev-cluster up` returns and the cluster keeps running. `down` is another process, so it
stops servers by the pid and program recorded at start (`ProcessRecord`), and checks that the
pid still runs that program before it signals anything: a recycled pid is never killed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kernelfleet.core.errors import UsageError

BUILD_HINT = (
    "run `kernelfleet dev-cluster up` (it offers to build them) or `make binaries` in a kernelfleet checkout"
)


class BinaryMissing(UsageError, FileNotFoundError):
    """A server binary is not in the cache; the message says how to build it."""


def cache_dir() -> Path:
    """kernelfleet's cache: $KERNELFLEET_CACHE, else $XDG_CACHE_HOME/kernelfleet (~/.cache/kernelfleet)."""
    configured = os.environ.get("KERNELFLEET_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernelfleet"


def bin_dir() -> Path:
    """Where the built servers are: $KERNELFLEET_BIN_DIR, else `bin` in the cache (where the
    build script puts them, so `make test` and the dev cluster share one build)."""
    configured = os.environ.get("KERNELFLEET_BIN_DIR")
    if configured:
        return Path(configured)
    return cache_dir() / "bin"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BinaryMissing(f"server binary '{name}' not found in {bin_dir()}: {BUILD_HINT}")
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
    """A loopback port that nothing listens on, for a server to bind a moment later.

    Drawn at random from below the kernel's ephemeral range: a port the kernel itself hands out
    (binding port 0) is also what it gives the next outgoing connection as its source port, and
    a test run opens many (clients of the API server, of MinIO), so such a port was taken before
    its server bound it often enough to fail a run ('address already in use'). Below the range
    only another listener can take it. Where the range leaves no room below it, the kernel picks."""
    low = _ephemeral_low()
    tries = 64 if low - 1 > _FIRST_PORT else 0
    for _ in range(tries):
        port = _random.randrange(_FIRST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_FIRST_PORT = 10000  # below, the well-known and registered services most machines run
_random = random.SystemRandom()


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class ProcessRecord(BaseModel):
    """A started server as another process can find it again: its pid, program and log."""

    model_config = ConfigDict(frozen=True)

    name: str
    pid: int
    program: str
    log: str

    def alive(self) -> bool:
        """True while the pid exists and still runs `program` (not a recycled pid)."""
        proc = Path(f"/proc/{self.pid}")
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode()
            if not argv0:
                # Empty while the program is still being loaded, and for a zombie: tell them apart.
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                return state != "Z"
        except (OSError, UnicodeDecodeError, IndexError):
            return False
        return argv0 == self.program or Path(argv0).name == Path(self.program).name

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `timeout` seconds."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


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
        inherit_env: bool = True,
        program: str | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        # What the process runs once started, when argv starts with a launcher that execs it.
        self.program = program or self.argv[0]
        self.workdir = workdir
        self.ready = ready
        self.env = {**(os.environ if inherit_env else {}), **(env or {})}
        self.ready_timeout = ready_timeout
        self.log_path = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def record(self) -> ProcessRecord:
        if self._proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return ProcessRecord(name=self.name, pid=self._proc.pid, program=self.program, log=str(self.log_path))

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
        return tail(self.log_path, lines)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
