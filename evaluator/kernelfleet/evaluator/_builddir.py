"""A candidate's build directory: shared by its processes and by every evaluator on the machine,
and never left locked by a process that died.

torch's extension loader guards a build with a lock *file* (`<dir>/<name>/lock`, created with
O_EXCL and removed when the build ends) and waits for it without any bound. A process killed
mid-build (the compile limit, an evaluation's timeout, a killed run) leaves that file behind,
and every later process that loads the same extension then waits until it is killed: the build
cache outlives the run and the store, so one such file stalls that candidate on this machine for
good (and, in a batch, whatever waits for it).

So the evaluator (trusted; never the candidate) holds a *lease* on a build directory while any
process of an evaluation may use it: a shared `flock` on `<dir>.lease`, beside the directory,
where the candidate cannot write. Before it starts a process that uses the directory it tries to
take the lease exclusively; when it can, no process of any evaluator on this machine uses the
directory, so every lock file in it is stale and is removed. The kernel drops a flock when its
holder dies, so a killed evaluator never leaves a lease behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in each extension's build directory
_SHARED_WAIT_S = 30.0  # an exclusive lease is held only while stale locks are removed (milliseconds)


class BuildLeaseError(RuntimeError):
    """The lease on a build directory could not be had within its bound."""


class BuildDirectory:
    """`with BuildDirectory(path) as build:` holds a shared lease on `path` for the block; each
    `build.clear_stale()` between the block's processes removes the lock files that no live
    process can hold. Entering clears them too."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lease = self.path.with_name(self.path.name + ".lease")
        self._fd: int | None = None
        self.cleared: list[Path] = []  # every stale lock file this lease removed

    def __enter__(self) -> BuildDirectory:
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self.clear_stale()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def clear_stale(self) -> list[Path]:
        """Remove the lock files left in the directory, when no other evaluator process uses it
        (call it only while no process of this lease's holder uses it either); then hold the
        shared lease again. Returns the files removed."""
        assert self._fd is not None, "BuildDirectory is used outside its `with` block"
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        removed: list[Path] = []
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another evaluation uses the directory: its lock files may be live
        else:
            removed = _remove_locks(self.path)
            self.cleared.extend(removed)
        self._share()
        return removed

    def lock_files(self) -> list[Path]:
        """torch's lock files in the directory now (for saying what a build waits on)."""
        return [
            self.path / name / LOCK_NAME for name in _subdirectories(self.path) if _is_lock(self.path / name)
        ]

    def _share(self) -> None:
        assert self._fd is not None
        deadline = time.monotonic() + _SHARED_WAIT_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holders = ", ".join(str(pid) for pid in flock_holders(self.lease)) or "unknown"
                    raise BuildLeaseError(
                        f"the build directory {self.path} stayed locked for {_SHARED_WAIT_S:.0f} s "
                        f"(lease {self.lease}, held by pid {holders})"
                    ) from None
                time.sleep(0.02)


def _subdirectories(path: Path) -> list[str]:
    try:
        return [entry.name for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _is_lock(directory: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.isfile(directory / LOCK_NAME) and not os.path.islink(directory / LOCK_NAME)
    return False


def _remove_locks(root: Path) -> list[Path]:
    """Unlink `<root>/*/lock` through directory descriptors opened without following links, so a
    candidate that swaps a directory for a link cannot make this remove a file elsewhere."""
    removed: list[Path] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for name in _subdirectories(root):
            try:
                fd = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd
                )
            except OSError:
                continue
            try:
                os.unlink(LOCK_NAME, dir_fd=fd)
                removed.append(root / name / LOCK_NAME)
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return removed


def flock_holders(path: str | os.PathLike[str]) -> list[int]:
    """The pids that hold a flock on `path`, from /proc/locks (empty where it cannot be read)."""
    try:
        inode = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids: list[int] = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" (a waiter's line has "->" after the number)
        if "->" in fields:
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            with contextlib.suppress(ValueError):
                pids.append(int(fields[4]))
    return pids
