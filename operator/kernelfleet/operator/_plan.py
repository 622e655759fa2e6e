"""From an OptimizationJob's spec to its plan: the resolved tasks and the Indexed Jobs.

Task selections are resolved here, in the operator, without torch: KernelBench selections from
the copy in core (`kernelbench-v0:1:1-20`), and store URLs: a prefix holding task files
(`s3://bucket/tasks/`), or a JSONL file of task rows (`s3://bucket/suite.jsonl[:LEVEL[:IDS]]`).
Local paths are refused: the operator's filesystem is not the user's.

Sharding: each GPU class gets ceil(tasks / tasksPerIndex) completion indexes, split into
Indexed Jobs of at most `max_indexes_per_job` indexes (a Job's status lists its indexes, and
one Job of 100,000 indexes makes every status read large). The split and the names depend only
on the spec and the uid, so planning twice gives the same plan.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sequence

from kernelfleet.core.errors import KernelfleetError, StoreError, UsageError
from kernelfleet.core.jobplan import JobPlan, Role, Shard, job_prefix
from kernelfleet.core.models import Task
from kernelfleet.core.resources import OptimizationJobSpec
from kernelfleet.core.store import NotFound, Store
from kernelfleet.core.tasks import missing_task_names, parse_ids
from kernelfleet.operator._jobs import job_name

OpenStore = Callable[[str], Store]
_JSONL = re.compile(r"^(?P<file>.+\.jsonl)(?::(?P<level>[^:]*))?(?::(?P<ids>[^:]*))?$")


class SpecError(KernelfleetError):
    """The spec cannot run as written; `field` is its path (`spec.tasks[1]`), shown to the user."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _split_store_url(url: str, is_file: bool) -> tuple[str, str]:
    """A store and a key in it: 's3://bucket/a/b.jsonl' -> ('s3://bucket', 'a/b.jsonl');
    a file:// URL's directory is the store itself ('file:///d/x.jsonl' -> ('file:///d', 'x.jsonl'))."""
    scheme, _, rest = url.partition("://")
    if scheme == "file":
        if is_file:
            directory, _, name = rest.rstrip("/").rpartition("/")
            return f"file://{directory}", name
        return url.rstrip("/"), ""
    bucket, _, key = rest.partition("/")
    return f"{scheme}://{bucket}", key


def _tasks_from_jsonl(
    store: Store, key: str, level_text: str | None, ids_text: str | None, source: str
) -> list[Task]:
    try:
        data = store.get_bytes(key).decode("utf-8")
    except NotFound:
        raise UsageError(f"{source}: there is no object {store.url_for(key)}") from None
    level = None
    if level_text is not None and level_text not in ("", "*", "all"):
        if not level_text.isdigit():
            raise UsageError(f"{source}: bad level {level_text!r}; use a number such as 1")
        level = int(level_text)
    ids = parse_ids(ids_text or "")
    tasks = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            lv, tid, name, code = int(row["level"]), int(row["task_id"]), str(row["name"]), str(row["code"])
        except (ValueError, KeyError, TypeError) as error:
            raise UsageError(f"{source} line {number} is not a task row ({error})") from None
        if (level is None or lv == level) and (ids is None or tid in ids):
            tasks.append(Task(name=f"{lv}_{tid}_{name}", code=code, level=lv, task_id=tid, source=source))
    if not tasks:
        raise UsageError(f"{source} selects no tasks")
    return tasks


def _tasks_from_prefix(store: Store, prefix: str, source: str) -> list[Task]:
    tasks = []
    for key in store.list(prefix.rstrip("/") + "/" if prefix else ""):
        if not key.endswith(".py"):
            continue
        code = store.get_bytes(key).decode("utf-8", errors="replace")
        try:
            if missing_task_names(code):
                continue
        except SyntaxError:
            continue
        tasks.append(Task(name=key.rsplit("/", 1)[-1][:-3], code=code, source=store.url_for(key)))
    if not tasks:
        raise UsageError(
            f"{source} holds no task files (.py files that define Model, get_inputs and get_init_inputs)"
        )
    return tasks


@functools.lru_cache(maxsize=512)
def _kernelbench(selection: str) -> tuple[Task, ...]:
    """A KernelBench selection's tasks. The bundled files never change while the operator runs,
    so each selection is parsed once (a hundred jobs on the same level would otherwise parse
    the same JSONL a hundred times)."""
    from kernelfleet.core.tasks import load_tasks

    return tuple(load_tasks(selection))


def resolve_selection(selection: str, open_store: OpenStore) -> list[Task]:
    """The tasks one entry of `spec.tasks` names."""
    text = selection.strip()
    if text.startswith("kernelbench-"):
        return list(_kernelbench(text))
    if text.startswith("s3://") or text.startswith("file://"):
        match = _JSONL.match(text)
        if match:
            root, key = _split_store_url(match.group("file"), is_file=True)
            return _tasks_from_jsonl(open_store(root), key, match.group("level"), match.group("ids"), text)
        root, key = _split_store_url(text, is_file=False)
        return _tasks_from_prefix(open_store(root), key, text)
    raise UsageError(
        "the operator reads KernelBench selections (kernelbench-v0:1:1-20) and store URLs "
        "(s3://bucket/prefix/ with task files, or s3://bucket/file.jsonl[:LEVEL[:IDS]]); upload local "
        "task files with `kernelfleet store` first"
    )


def resolve_tasks(spec: OptimizationJobSpec, open_store: OpenStore) -> list[Task]:
    """Every task of the spec, in order, without duplicates (by hash); errors name the entry."""
    tasks: dict[str, Task] = {}
    for position, selection in enumerate(spec.tasks):
        try:
            found = resolve_selection(selection, open_store)
        except (UsageError, StoreError) as error:  # a permanent refusal, such as access denied
            raise SpecError(f"spec.tasks[{position}]", str(error)) from None
        for task in found:
            tasks.setdefault(task.hash, task)
    return list(tasks.values())


def make_shards(
    *,
    name: str,
    uid: str,
    role: Role,
    gpu_classes: Sequence[str],
    tasks_total: int,
    tasks_per_index: int,
    max_indexes_per_job: int,
) -> list[Shard]:
    shards: list[Shard] = []
    span = tasks_per_index * max_indexes_per_job
    for gpu_class in gpu_classes:
        for number, start in enumerate(range(0, tasks_total, span)):
            parts = [name, gpu_class] if role == Role.SEARCH else [name, "verify", gpu_class]
            shards.append(
                Shard(
                    role=role,
                    gpu_class=gpu_class,
                    number=number,
                    start=start,
                    stop=min(start + span, tasks_total),
                    tasks_per_index=tasks_per_index,
                    job_name=job_name(*parts, str(number), uid=uid),
                )
            )
    return shards


def make_plan(
    *,
    namespace: str,
    name: str,
    uid: str,
    spec: OptimizationJobSpec,
    tasks_total: int,
    max_indexes_per_job: int,
) -> JobPlan:
    shards = make_shards(
        name=name,
        uid=uid,
        role=Role.SEARCH,
        gpu_classes=spec.gpu_classes,
        tasks_total=tasks_total,
        tasks_per_index=spec.tasks_per_index,
        max_indexes_per_job=max_indexes_per_job,
    )
    if spec.verify_on:
        # One small Job per class: each task is a single evaluation, so a pod takes many.
        per_index = max(spec.tasks_per_index, math.ceil(tasks_total / max(1, spec.parallelism)))
        shards += make_shards(
            name=name,
            uid=uid,
            role=Role.VERIFY,
            gpu_classes=spec.verify_on,
            tasks_total=tasks_total,
            tasks_per_index=per_index,
            max_indexes_per_job=max_indexes_per_job,
        )
    return JobPlan(
        namespace=namespace,
        name=name,
        uid=uid,
        prefix=job_prefix(namespace, name, uid),
        spec=spec,
        tasks_total=tasks_total,
        shards=tuple(shards),
    )
