"""The held-out split: tasks that no stage ever trains on.

The recipe this project follows trained and evaluated on the same 250 tasks. kernelfleet holds
out a fixed share of each KernelBench level by default (`HeldOutSpec.fraction`, 20%): within a
level, tasks are ranked by sha256("heldout:<seed>:<level>:<task id>") and the first
ceil(fraction x level size) are held out. For KernelBench tasks the ranking runs over the whole
level of the bundled set, not over the tasks a run selects, so two runs with the same seed agree
on the split whatever they select, and a task held out once is held out always. Tasks that are
not from KernelBench (files, directories) are ranked the same way by their content hash within
the run's own list, grouped by level. Selections in `HeldOutSpec.tasks` are held out in addition.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kernelfleet.core.models import Task
from kernelfleet.core.resources import HeldOutSpec
from kernelfleet.core.tasks import load_tasks


@dataclass(frozen=True)
class Split:
    train: tuple[Task, ...]
    held_out: tuple[Task, ...]


def _rank(seed: int, level: int | None, key: str) -> str:
    return hashlib.sha256(f"heldout:{seed}:{level}:{key}".encode()).hexdigest()


def _kernelbench_version(task: Task) -> str | None:
    source = task.source
    if not source.startswith("kernelbench-"):
        return None
    return source.split(":", 1)[0].removeprefix("kernelbench-")


def _held_in_level(seed: int, fraction: float, level: int, ids: Sequence[int]) -> set[int]:
    count = math.ceil(fraction * len(ids)) if fraction > 0 else 0
    ranked = sorted(ids, key=lambda task_id: _rank(seed, level, str(task_id)))
    return set(ranked[:count])


def split_tasks(tasks: Sequence[Task], spec: HeldOutSpec) -> Split:
    """Divide `tasks` into the part stages may train on and the held-out part."""
    held: set[str] = set()
    extra: dict[str, Task] = {}
    for selection in spec.tasks:
        for task in load_tasks(selection):
            held.add(task.hash)
            extra.setdefault(task.hash, task)
    level_cache: dict[tuple[str, int], set[int]] = {}
    others: dict[int | None, list[Task]] = defaultdict(list)
    for task in tasks:
        version = _kernelbench_version(task)
        if version is not None and task.level is not None and task.task_id is not None:
            key = (version, task.level)
            if key not in level_cache:
                level_ids = [t.task_id for t in load_tasks(f"kernelbench-{version}:{task.level}")]
                level_cache[key] = _held_in_level(
                    spec.seed, spec.fraction, task.level, [i for i in level_ids if i is not None]
                )
            if task.task_id in level_cache[key]:
                held.add(task.hash)
        else:
            others[task.level].append(task)
    for level, group in others.items():
        count = math.ceil(spec.fraction * len(group)) if spec.fraction > 0 else 0
        ranked = sorted(group, key=lambda task: _rank(spec.seed, level, task.hash))
        held.update(task.hash for task in ranked[:count])
    train = tuple(task for task in tasks if task.hash not in held)
    held_out = [task for task in tasks if task.hash in held]
    listed = {task.hash for task in held_out}
    held_out += [task for task_hash, task in extra.items() if task_hash not in listed]
    return Split(train, tuple(held_out))
