"""A machine-wide lock per device, held while a device times.

The timing lane keeps one evaluator from timing two candidates on a device at once; this lock
does the same across processes: a second `kernelfleet optimize` or `eval serve` on the same
machine waits for the device instead of timing beside the first, which would slow both sides
of both measurements and leave noisy timings behind. It is an advisory `flock` on a file in
the system's temporary directory, released by the kernel if the holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import threading
import time

from kernelfleet.evaluator._builddir import flock_holders

_DIR = os.path.join(tempfile.gettempdir(), "kernelfleet-device-locks")


class DeviceBusy(RuntimeError):
    """Another process held the device's lock for longer than the wait's bound."""


def _describe(pids: list[int]) -> str:
    if not pids:
        return "a process that could not be named"
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            command = "?"
        names.append(f"pid {pid} ({command})")
    return ", ".join(names)


class DeviceLock:
    """`acquire()` blocks until no other process times on `device`; `release()` lets go."""

    def __init__(self, device: str) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device) or "device"
        self.path = os.path.join(_DIR, f"{slug}.lock")
        self._fd: int | None = None

    def acquire(self, cancel: threading.Event | None = None, timeout_s: float | None = None) -> float:
        """Take the lock; returns the seconds spent waiting for another process. Raises
        InterruptedError when `cancel` is set while waiting, and DeviceBusy after `timeout_s`
        seconds of waiting (naming the process that holds it)."""
        os.makedirs(_DIR, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(_DIR, 0o1777)  # shared by every user of the machine, like /tmp
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        begin = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancel is not None and cancel.is_set():
                    os.close(fd)
                    raise InterruptedError("cancelled while waiting for the device") from None
                if timeout_s is not None and time.monotonic() - begin > timeout_s:
                    holders = [pid for pid in flock_holders(self.path) if pid != os.getpid()]
                    os.close(fd)
                    raise DeviceBusy(
                        f"waited {timeout_s:.0f} s for the device lock {self.path}, held by "
                        f"{_describe(holders)}: another kernelfleet process times on this device; "
                        "let it finish, or stop it"
                    ) from None
                time.sleep(0.05)
        self._fd = fd
        return time.monotonic() - begin

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
