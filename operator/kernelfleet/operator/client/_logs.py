"""`kernelfleet logs NAME [--task T]`: the worker's log lines of a task, read from the store.

Workers write each task's lines to `<run>/logs/<role>/<class>/<task16>[.<attempt>].log` (the
key layout of `kernelfleet.core.jobplan`), and lines outside any task to `index-*.log` beside
them. Reading them from the store instead of from pods means they are there after the pod is
gone, the Job deleted, or the node reclaimed: where users look when a task failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import NotFound, Store

_LOG_KEY = re.compile(r"/logs/(?P<role>[^/]+)/(?P<gpu>[^/]+)/(?P<stem>[^/]+?)(?:\.(?P<attempt>\d+))?\.log$")


@dataclass(frozen=True)
class LogFile:
    key: str
    role: str
    gpu_class: str
    stem: str  # the task hash's first 16 characters, or index-<shard>-<index>-<attempt>
    attempt: int
    task: str  # the task's name, when the plan knows the stem

    @property
    def label(self) -> str:
        attempt = f", attempt {self.attempt + 1}" if self.attempt else ""
        return f"{self.task or self.stem} on {self.gpu_class} ({self.role}{attempt})"


def task_names(store: Store, prefix: str) -> dict[str, str]:
    """Task hash (first 16 characters) -> task name, from the plan's task chunks."""
    from kernelfleet.core.jobplan import TaskChunk

    names: dict[str, str] = {}
    for key in store.list(f"{prefix}/plan/"):
        if not key.endswith(".json"):
            continue
        try:
            chunk = TaskChunk.model_validate(store.get_json(key))
        except (NotFound, ValueError):
            continue
        for planned in chunk.tasks:
            names[planned.task().hash[:16]] = planned.name
    return names


def outcomes(store: Store, prefix: str) -> dict[tuple[str, str, str], str]:
    """(role, class, task16) -> how the task ended ("ok", or "failed: <error>"), for finished tasks."""
    from kernelfleet.core.jobplan import TaskOutcome

    ended: dict[tuple[str, str, str], str] = {}
    for key in store.list(f"{prefix}/outcomes/"):
        parts = key.rsplit("/", 3)
        if len(parts) != 4 or not key.endswith(".json"):
            continue
        try:
            outcome = TaskOutcome.model_validate(store.get_json(key))
        except (NotFound, ValueError):
            continue
        ended[(parts[1], parts[2], parts[3][:-5])] = "ok" if outcome.ok else f"failed: {outcome.error}"
    return ended


def log_files(store: Store, prefix: str) -> list[LogFile]:
    names = task_names(store, prefix)
    found = []
    for key in store.list(f"{prefix}/logs/"):
        match = _LOG_KEY.search(key)
        if match is None:
            continue
        stem = match["stem"]
        found.append(
            LogFile(
                key=key,
                role=match["role"],
                gpu_class=match["gpu"],
                stem=stem,
                attempt=int(match["attempt"] or 0),
                task=names.get(stem, ""),
            )
        )
    return sorted(found, key=lambda f: (f.task or "~" + f.stem, f.gpu_class, f.role, f.attempt))


def select(files: list[LogFile], task: str | None, gpu_class: str | None) -> list[LogFile]:
    """The logs of `task` (a name, a unique start of one, or a start of its hash) on `gpu_class`."""
    if gpu_class:
        classes = sorted({f.gpu_class for f in files})
        files = [f for f in files if f.gpu_class == gpu_class]
        if not files:
            raise UsageError(
                f"no logs of GPU class {gpu_class!r}; classes with logs: {', '.join(classes) or 'none'}"
            )
    if not task:
        return files
    exact = [f for f in files if f.task == task]
    if exact:
        return exact
    by_hash = [f for f in files if len(task) >= 4 and f.stem.startswith(task)]
    by_start = [f for f in files if f.task.startswith(task)]
    matches = by_hash or by_start
    tasks = sorted({f.task or f.stem for f in matches})
    if len(tasks) > 1:
        raise UsageError(f"--task {task!r} matches several tasks: {', '.join(tasks)}; give more of the name")
    if not matches:
        known = sorted({f.task for f in files if f.task})
        shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
        raise UsageError(f"no logs of a task {task!r}; tasks with logs: {shown or 'none yet'}")
    return matches


def read_log(store: Store, log: LogFile) -> str:
    return store.get_bytes(log.key).decode("utf-8", errors="replace")
