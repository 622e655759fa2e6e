"""Where a run keeps its objects in the store, and the records it keeps there.

The run is a set of immutable objects under one prefix (`runs/<run-id>` for a local run,
`optimizationjobs/<ns>/<name>/<uid>` for a cluster job), so a killed run is resumed by listing
them and nothing is ever rewritten:

    <prefix>/run.json                                     what the run is: tasks, policies, device
    <prefix>/tasks/<task16>/task.json                     the task
    <prefix>/tasks/<task16>/<gpu>/samples/r000/<policy>-000.json   one policy answer (a sample)
    <prefix>/results/<task16>/<gpu>/<evaluator>/<variant>.json      one evaluation (store.put_result)
    <prefix>/tasks/<task16>/<gpu>/baselines/<evaluator>.json        eager, torch.compile, ...
    <prefix>/tasks/<task16>/<gpu>/verified/<evaluator>/<variant>.json  the best, re-measured
    <prefix>/tasks/<task16>/<gpu>/summary-<budget>-<samples>.json   written last: the task is done
    variants/<sha256>.py                                  the code, shared by every run

A summary's name carries a fingerprint of the budget and the number of samples seen, so a run
continued with more rounds, or after a wall-time stop, writes a new summary instead of
colliding with the old one; readers take the newest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelfleet.core.models import EvaluationResult, Task, TaskSummary, Verdict
from kernelfleet.core.store import CorruptObject, NotFound, OnCorrupt, Store

M = TypeVar("M", bound=BaseModel)

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
ANSWER_LIMIT = 64_000


class SampleRecord(BaseModel):
    """One answer of one policy for one task, usable or not."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    task_hash: str
    gpu_class: str
    round: int
    policy: str
    policy_id: str
    index: int
    variant_hash: str | None = Field(default=None, description="The code to evaluate; None if unusable.")
    key: str = Field(default="", description="The policy's own identity for what it proposed.")
    name: str = ""
    error: str = ""
    missing_sections: tuple[str, ...] = ()
    analysis: str = ""
    design: str = ""
    answer: str = Field(default="", description=f"The raw answer, cut to {ANSWER_LIMIT} characters.")
    parent_hashes: tuple[str, ...] = ()


class RunManifest(BaseModel):
    """What a run is: enough for `kernelfleet results` to find its tasks and label its policies."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    run_id: str
    tasks: tuple[str, ...] = Field(description="Task hashes, in the order given.")
    task_names: tuple[str, ...] = ()
    policies: tuple[str, ...] = Field(description="Policy labels, in the order given.")
    policy_ids: tuple[str, ...] = ()
    gpu_class: str = ""


@dataclass(frozen=True)
class RunLayout:
    """Keys of one run's objects; `prefix` is the run's root in the store."""

    prefix: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", self.prefix.strip("/"))

    @property
    def manifest(self) -> str:
        return f"{self.prefix}/run.json"

    def task_root(self, task_hash: str) -> str:
        return f"{self.prefix}/tasks/{task_hash[:16]}"

    def task(self, task_hash: str) -> str:
        return f"{self.task_root(task_hash)}/task.json"

    def gpu_root(self, task_hash: str, gpu_class: str) -> str:
        return f"{self.task_root(task_hash)}/{gpu_class}"

    def samples(self, task_hash: str, gpu_class: str, round_: int) -> str:
        return f"{self.gpu_root(task_hash, gpu_class)}/samples/r{round_:03d}/"

    def sample(self, task_hash: str, gpu_class: str, round_: int, policy_id: str, index: int) -> str:
        return f"{self.samples(task_hash, gpu_class, round_)}{policy_id}-{index:03d}.json"

    def baselines(self, task_hash: str, gpu_class: str, evaluator_version: str) -> str:
        return f"{self.gpu_root(task_hash, gpu_class)}/baselines/{evaluator_version}.json"

    def verification(self, task_hash: str, gpu_class: str, evaluator_version: str, variant_hash: str) -> str:
        return f"{self.gpu_root(task_hash, gpu_class)}/verified/{evaluator_version}/{variant_hash}.json"

    def summary_prefix(self, task_hash: str, gpu_class: str, fingerprint: str) -> str:
        return f"{self.gpu_root(task_hash, gpu_class)}/summary-{fingerprint}-"

    def summary(self, task_hash: str, gpu_class: str, fingerprint: str, samples: int) -> str:
        return f"{self.summary_prefix(task_hash, gpu_class, fingerprint)}{samples:06d}.json"


def task_object(task: Task) -> dict[str, object]:
    """A task as stored: without its hash, which is computed from the code on reading."""
    return task.model_dump(mode="json", exclude={"hash"})


def read_task(data: dict[str, object]) -> Task:
    return Task.model_validate({key: value for key, value in data.items() if key != "hash"})


def _skip(on_corrupt: OnCorrupt | None, error: CorruptObject) -> None:
    if on_corrupt is None:
        raise error
    on_corrupt(error)


def read_model(store: Store, key: str, model: type[M], on_corrupt: OnCorrupt | None = None) -> M | None:
    """The object at `key`, or None when there is none (or it is corrupt and `on_corrupt`,
    told of it, lets the reader carry on without it)."""
    try:
        return store.read_model(key, model)
    except NotFound:
        return None
    except CorruptObject as error:
        _skip(on_corrupt, error)
        return None


def load_tasks_of_run(store: Store, layout: RunLayout, on_corrupt: OnCorrupt | None = None) -> list[Task]:
    """Every task stored under the run, in the manifest's order when there is one."""
    tasks: dict[str, Task] = {}
    for key in store.list(f"{layout.prefix}/tasks/"):
        if key.endswith("/task.json") and key.count("/") == layout.prefix.count("/") + 3:
            try:
                task = read_task(store.get_json(key))
            except CorruptObject as error:
                _skip(on_corrupt, error)
                continue
            except ValidationError as error:
                _skip(
                    on_corrupt,
                    CorruptObject(f"object {store.url_for(key)} is not a valid task: {error}", key),
                )
                continue
            tasks[task.hash] = task
    manifest = read_model(store, layout.manifest, RunManifest, on_corrupt)
    if manifest is not None:
        order = {task_hash: position for position, task_hash in enumerate(manifest.tasks)}
        return sorted(tasks.values(), key=lambda task: (order.get(task.hash, len(order)), task.name))
    return sorted(tasks.values(), key=lambda task: task.name)


def latest_summaries(
    store: Store, layout: RunLayout, task_hash: str, on_corrupt: OnCorrupt | None = None
) -> dict[str, TaskSummary]:
    """The newest summary of the task per GPU class."""
    found: dict[str, TaskSummary] = {}
    for key in store.list(f"{layout.task_root(task_hash)}/"):
        name = key.rsplit("/", 1)[-1]
        if not (name.startswith("summary-") and name.endswith(".json")):
            continue
        summary = read_model(store, key, TaskSummary, on_corrupt)
        if summary is None:
            continue
        current = found.get(summary.gpu_class)
        if current is None or summary.finished_at > current.finished_at:
            found[summary.gpu_class] = summary
    return found


def iter_samples(
    store: Store, layout: RunLayout, task_hash: str, gpu_class: str, on_corrupt: OnCorrupt | None = None
) -> Iterator[SampleRecord]:
    for key in store.list(f"{layout.gpu_root(task_hash, gpu_class)}/samples/"):
        if key.endswith(".json"):
            record = read_model(store, key, SampleRecord, on_corrupt)
            if record is not None:
                yield record


def summary_damage(
    store: Store,
    layout: RunLayout,
    summary: TaskSummary,
    results: Mapping[str, EvaluationResult],
    damaged_result: bool,
    on_corrupt: OnCorrupt | None = None,
) -> str:
    """What of a task summary's word the store no longer backs, "" when all is intact: a result
    of the task that is damaged (`damaged_result`, found by the caller's listing), the best
    variant's result (`results`, by variant hash, read and checked by the caller), its code,
    its verification. A summary with damage is never shown as a result; the optimize command
    that made the run, run again, repairs it."""
    if damaged_result:
        return "a result of it is damaged"
    best = summary.best_variant_hash
    if best is None:
        return ""
    result = results.get(best)
    if result is None:
        return f"the result of its best variant {best[:12]} is missing or damaged"
    if result.verdict != Verdict.CORRECT or (
        summary.search_speedup is not None
        and (result.speedup is None or not math.isclose(result.speedup, summary.search_speedup, rel_tol=1e-6))
    ):
        return f"the result of its best variant {best[:12]} is not the one its summary reports"
    damage = code_damage(store, best, on_corrupt)
    if damage:
        return damage
    if summary.verified:
        key = layout.verification(summary.task_hash, summary.gpu_class, summary.evaluator_version, best)
        try:
            store.read_record(key, EvaluationResult)
        except NotFound:
            return f"the verification of its best variant {best[:12]} is missing"
        except CorruptObject as error:
            _skip(on_corrupt, error)
            return f"the verification of its best variant {best[:12]} is damaged"
    return ""


def code_damage(store: Store, variant_hash: str, on_corrupt: OnCorrupt | None = None) -> str:
    """Why a variant's code cannot be shown ("" when it is in the store and hashes to its name)."""
    try:
        store.get_variant(variant_hash)
    except NotFound:
        return f"the code of its best variant {variant_hash[:12]} is missing"
    except CorruptObject as error:
        _skip(on_corrupt, error)
        return f"the code of its best variant {variant_hash[:12]} is damaged"
    return ""
