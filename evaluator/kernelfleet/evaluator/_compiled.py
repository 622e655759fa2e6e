"""A candidate's torch.compile cache: compiled once in the build pool, sealed, restored into
each of its processes.

Every process that loads a candidate is fresh, and each compiled a `torch.compile` candidate
again in a cache directory of its own (its scratch): on 2 CPUs 30 to 100 s per process, three
or more processes per evaluation. Now the build pool compiles it once (the build process
warms `ModelNew` up on the task's inputs with the evaluation's torch settings, so that the
evaluation finds what it compiles), writing inductor's and Triton's caches into a directory of
its own, keyed by the task and the candidate's source and kept for the evaluator's session.

After the build process has exited, the evaluator seals the directory: it records the SHA-256
of every regular file in it (`seal`), in its own memory. No process writes the directory from
then on: the evaluation's processes may only read it (Landlock), and each copies it into its
own scratch before it reads a line of candidate code, checking every file against the seal as
it copies (`restore`); a file that changed, vanished or is no longer a regular file rejects
the candidate (`compile-cache-changed`) and nothing of it is loaded. So a candidate that
rewrites its cache after its correctness check, for the timing process or the re-check to load,
is caught; what its own process does to its own copy stays in that process, as before.

No other candidate's code can write the directory (keyed by the source, written only by that
source's build, then by nobody), so no candidate ever reads what another wrote. At the
isolation levels without Landlock any process of the user can write it; the seal still catches
the change, but cannot tell who made it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path, PurePosixPath

# The directories of the sealed cache, and the environment variable that points each process's
# own copy at its place (its scratch, set by the zygote).
CACHE_DIRS = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}


def build_env(root: Path) -> dict[str, str]:
    """The build process's environment: its caches in the directory to be sealed."""
    return {variable: str(root / name) for name, variable in CACHE_DIRS.items()}


def seal(root: Path, limit_bytes: int) -> dict[str, str] | None:
    """The SHA-256 of every regular file below `root`, by relative path; None when they hold
    more than `limit_bytes` (each process would copy them into its scratch: it compiles there
    itself instead). Links and other special files are left out: they are never restored."""
    files: dict[str, str] = {}
    total = 0
    for directory, _, names in os.walk(root, followlinks=False):
        for name in names:
            path = Path(directory, name)
            try:
                data = _read_regular(path)
            except OSError:
                continue
            total += len(data)
            if total > limit_bytes:
                return None
            files[path.relative_to(root).as_posix()] = hashlib.sha256(data).hexdigest()
    return files


def restore(root: str, files: dict[str, str]) -> str:
    """Copy the sealed cache at `root` into this process's cache directories, checking each
    file against its seal; '' when all was copied, else what changed (nothing is loaded from a
    cache that changed: the copy is removed)."""
    copied: list[Path] = []
    for relative, digest in sorted(files.items()):
        target = _target(relative)
        if target is None:
            return f"{relative!r} is not a path the seal can hold"
        try:
            data = _read_regular(Path(root, relative))
        except OSError as error:
            problem = f"{relative} can no longer be read as a regular file ({error.strerror or error})"
        else:
            if hashlib.sha256(data).hexdigest() == digest:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                copied.append(target)
                continue
            problem = f"{relative} differs from the file its build left"
        for path in copied:
            path.unlink(missing_ok=True)
        return problem
    return ""


def _target(relative: str) -> Path | None:
    """Where a sealed file goes in this process: below the cache directory its first part names."""
    parts = PurePosixPath(relative).parts
    if len(parts) < 2 or parts[0] not in CACHE_DIRS or any(p in ("", ".", "..") for p in parts):
        return None
    base = os.environ.get(CACHE_DIRS[parts[0]])
    return Path(base, *parts[1:]) if base else None


def _read_regular(path: Path) -> bytes:
    """The bytes of `path`, which must be a regular file and not a link (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
