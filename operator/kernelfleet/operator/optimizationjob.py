"""OptimizationJob: reconciled level-based, from what exists, on a kopf timer.

Every pass of the timer does the same, whatever happened before (a restart, a kill -9, a lost
watch event, a handler that ran twice):

1. the plan: read it from the store if it is there; otherwise validate what the CRD schema
   cannot (pool classes, policy Secrets, the store), resolve the tasks and write the plan;
2. the Jobs: create each planned Indexed Job that the index of child Jobs lacks (deterministic
   names: a second create is a harmless 409), the re-verification Jobs once the search Jobs
   have all ended, and bring `suspend` and `parallelism` of the others to what the spec says;
3. the status: fold the Jobs' status (from kopf's index of child Jobs) and the per-task
   outcome records in the store into counters, speedups and conditions, and patch it when it
   changed, at most once per resource every few seconds, with an Event per transition.

Nothing here keeps state that matters across restarts: the plan is in the store, the Jobs are
in the API, and the in-memory caches (outcomes already read, Jobs just created) only save work.
Deleting the resource deletes its Jobs through their owner references; the results stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from kernelfleet.core.errors import KernelfleetError, UsageError
from kernelfleet.core.jobplan import (
    JobPlan,
    Role,
    Shard,
    TaskChunk,
    TaskOutcome,
    chunk_key,
    chunk_tasks,
    job_prefix,
    outcome_dir,
    outcome_key,
    plan_key,
)
from kernelfleet.core.resources import GROUP, VERSION, OptimizationJobSpec, PolicyKind
from kernelfleet.core.store import NotFound, ObjectConflict, Store, StoreUnavailable
from kernelfleet.operator import _conditions as cond
from kernelfleet.operator._app import Runtime, runtime
from kernelfleet.operator._jobs import (
    LABEL_GPU_CLASS,
    LABEL_OWNER_UID,
    LABEL_ROLE,
    LABEL_SHARD,
    WORKER_CONTAINER,
    JobOptions,
    Owner,
    container,
    count_indexes,
    indexed_job,
    job_finished,
    pod_spec,
    store_env,
)
from kernelfleet.operator._kube import ApiError, core_path, custom_path, jobs_path
from kernelfleet.operator._lifecycle import active, deadline_passed, expiring, ttl_passed
from kernelfleet.operator._plan import SpecError, make_plan, resolve_tasks
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._status import best, median, status_diff

log = logging.getLogger("kernelfleet.operator.optimizationjob")

KIND = "OptimizationJob"
PLURAL = "optimizationjobs"
OWNER_LABEL = f"{GROUP}/optimizationjob"
INDEX = "optimizationjob_jobs"
API_KEY_VARIABLE = "KERNELFLEET_OPENAI_API_KEY"
NODES_TTL_S = 30.0
RECHECK_S = 60.0


def spec_generation(spec: OptimizationJobSpec) -> int:
    """A stand-in for metadata.generation that the spec itself carries (its hash)."""
    return hash(spec.model_dump_json())


# ---------------------------------------------------------------------- the index of child Jobs


@dataclass(frozen=True)
class JobView:
    """What the status needs of one child Job; kept in kopf's index, so it stays small."""

    name: str
    role: str
    gpu_class: str
    shard: int
    completions: int
    parallelism: int
    suspend: bool
    active: int
    ready: int
    succeeded: int
    failed_indexes: frozenset[int]
    finished: str | None
    reason: str
    deleting: bool
    # status.completedIndexes as the Job writes it ("0-3,7"): the outcomes to read.
    completed_indexes: str = ""

    def done_indexes(self) -> frozenset[int]:
        """Indexes that ended, succeeded or failed: their tasks' outcomes are in the store."""
        if self.finished and not self.completed_indexes and not self.failed_indexes:
            return frozenset(range(self.completions))  # a record of a Job that is gone
        return _index_set(self.completed_indexes) | self.failed_indexes


def _index_set(ranges: str | None) -> frozenset[int]:
    found: set[int] = set()
    for part in (ranges or "").split(","):
        part = part.strip()
        if part:
            first, _, last = part.partition("-")
            found.update(range(int(first), int(last or first) + 1))
    return frozenset(found)


def index_jobs(body: kopf.Body, **_: Any) -> dict[tuple[str, str], JobView] | None:
    labels = body.metadata.labels
    uid = labels.get(LABEL_OWNER_UID)
    if not uid or OWNER_LABEL not in labels:
        return None
    spec, status = body.get("spec", {}), body.get("status", {})
    finished = job_finished(body)
    reason = ""
    for condition in status.get("conditions") or []:
        if condition.get("type") == finished:
            reason = condition.get("reason", "")
    view = JobView(
        name=body.metadata.name or "",
        role=labels.get(LABEL_ROLE, Role.SEARCH.value),
        gpu_class=labels.get(LABEL_GPU_CLASS, ""),
        shard=int(labels.get(LABEL_SHARD, "0") or 0),
        completions=int(spec.get("completions") or 0),
        parallelism=int(spec.get("parallelism") or 0),
        suspend=bool(spec.get("suspend")),
        active=int(status.get("active") or 0),
        ready=int(status.get("ready") or 0),
        succeeded=count_indexes(status.get("completedIndexes")),
        failed_indexes=_index_set(status.get("failedIndexes")),
        finished=finished,
        reason=reason,
        deleting=bool(body.metadata.get("deletionTimestamp")),
        completed_indexes=str(status.get("completedIndexes") or ""),
    )
    return {(body.metadata.namespace or "", uid): view}


# ---------------------------------------------------------------------- per-resource memory


@dataclass
class _Memory:
    """What saves work between passes (never needed for correctness)."""

    plan: JobPlan | None = None
    # Jobs created by this process that kopf's index does not show yet, with their parallelism.
    created: dict[str, int] = field(default_factory=dict)
    # When each of those was created (time.monotonic()), to ask the API about one that stays away.
    created_at: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, TaskOutcome] = field(default_factory=dict)
    # Incremental outcome reading: whether the outcome folders were listed once (after a start),
    # which indexes' outcomes were read since, and the task hash of each plan position.
    listed: bool = False
    read_indexes: dict[str, frozenset[int]] = field(default_factory=dict)
    task_hashes: dict[int, str] = field(default_factory=dict)
    ended: dict[str, JobView] = field(default_factory=dict)
    # Jobs whose ended record the store was asked for and did not have.
    no_record: set[str] = field(default_factory=set)
    rejected: tuple[int, float, SpecError] | None = None


_memory: dict[str, _Memory] = {}
# The last phase of every resource (for the metrics), kept after its memory is freed.
_phases: dict[str, str] = {}
_nodes: dict[str, Any] = {"at": -1e9, "labels": None}


def _mem(uid: str) -> _Memory:
    return _memory.setdefault(uid, _Memory())


# ---------------------------------------------------------------------- the plan


async def _validate(rt: Runtime, spec: OptimizationJobSpec, namespace: str) -> None:
    """What the CRD schema cannot check; raises SpecError naming the field."""
    pools = rt.settings.pools
    for field_name, classes in (("gpuClasses", spec.gpu_classes), ("verifyOn", spec.verify_on)):
        for position, gpu_class in enumerate(classes):
            if gpu_class not in pools:
                raise SpecError(
                    f"spec.{field_name}[{position}]",
                    f"GPU class {gpu_class!r} is not in the operator's pool configuration "
                    f"({pools.source}); the classes are: {', '.join(pools)}",
                )
    if not (spec.store or rt.settings.default_store):
        raise SpecError(
            "spec.store",
            "no store: set spec.store (s3://bucket/prefix), or install the operator with a default "
            "store (the chart's store.url)",
        )
    for position, policy in enumerate(spec.policies):
        if policy.kind == PolicyKind.REPLAY and not policy.path:
            raise SpecError(f"spec.policies[{position}].path", "a replay policy needs a path (a store URL)")
        if policy.kind == PolicyKind.OPENAI and not (policy.model and policy.base_url):
            raise SpecError(f"spec.policies[{position}]", "an openai policy needs model and baseUrl")
        if policy.api_key_secret:
            secret = await rt.kube.get_or_none(core_path("secrets", namespace, policy.api_key_secret))
            where = f"spec.policies[{position}].apiKeySecret"
            if secret is None:
                raise SpecError(
                    where, f"Secret {policy.api_key_secret!r} does not exist in namespace {namespace}"
                )
            if "apiKey" not in (secret.get("data") or {}):
                raise SpecError(where, f"Secret {policy.api_key_secret!r} has no key 'apiKey'")
    if rt.settings.store_secret:
        secret = await rt.kube.get_or_none(core_path("secrets", namespace, rt.settings.store_secret))
        if secret is None:
            raise SpecError(
                "metadata.namespace",
                f"the store Secret {rt.settings.store_secret!r} (keys accesskey, secretkey) does not exist "
                f"in namespace {namespace}: the worker pods mount it; copy it there",
            )


CREDENTIALS_TTL_S = 60.0
_credentials: dict[str, tuple[float, tuple[str, str] | None]] = {}


async def namespace_credentials(rt: Runtime, namespace: str) -> tuple[str, str] | None:
    """The store keys of a job's namespace (its store Secret, `--store-secret`), which the
    operator uses for that job's store instead of its own: a job reaches only what its namespace
    may (its own prefix, under a per-namespace policy). None without a store Secret. Read at most
    once a minute per namespace."""
    import base64

    if not rt.settings.store_secret:
        return None
    now = time.monotonic()
    cached = _credentials.get(namespace)
    if cached is not None and now - cached[0] < CREDENTIALS_TTL_S:
        return cached[1]
    secret = await rt.kube.get_or_none(core_path("secrets", namespace, rt.settings.store_secret))
    data = (secret or {}).get("data") or {}
    if "accesskey" not in data or "secretkey" not in data:
        raise SpecError(
            "metadata.namespace",
            f"the store Secret {rt.settings.store_secret!r} (keys accesskey, secretkey) does not exist "
            f"in namespace {namespace}, or lacks a key: the operator and the worker pods reach the "
            "store with it; create it there",
        )
    keys = (base64.b64decode(data["accesskey"]).decode(), base64.b64decode(data["secretkey"]).decode())
    _credentials[namespace] = (now, keys)
    return keys


def _write_plan(store: Store, plan: JobPlan, tasks: list[Any]) -> None:
    """Chunks first, the plan last: a plan in the store is a complete one."""
    for number, chunk in enumerate(chunk_tasks(tasks, plan.chunk_size)):
        store.put_json(chunk_key(plan.prefix, number), chunk)
    store.put_json(plan_key(plan.prefix), plan)


async def _ensure_plan(
    rt: Runtime, spec: OptimizationJobSpec, namespace: str, name: str, uid: str
) -> JobPlan:
    memory = _mem(uid)
    if memory.plan is not None:
        return memory.plan
    if memory.rejected is not None:
        generation, when, error = memory.rejected
        # A rejected spec is checked again when it changes, or after a while (a missing Secret
        # may have been created since), not on every pass.
        if generation == spec_generation(spec) and time.monotonic() - when < RECHECK_S:
            raise error
    credentials = await namespace_credentials(rt, namespace)
    try:
        store = rt.store(spec.store, credentials)
    except UsageError as error:
        raise SpecError("spec.store", str(error)) from None
    prefix = job_prefix(namespace, name, uid)
    try:
        raw = await asyncio.to_thread(store.get_json, plan_key(prefix))
        memory.plan = JobPlan.model_validate(raw)
        return memory.plan
    except NotFound:
        pass
    try:
        await _validate(rt, spec, namespace)
    except SpecError as error:
        memory.rejected = (spec_generation(spec), time.monotonic(), error)
        raise

    def resolve_and_write() -> JobPlan:
        tasks = resolve_tasks(spec, lambda url: rt.store(url, credentials))
        plan = make_plan(
            namespace=namespace,
            name=name,
            uid=uid,
            spec=spec,
            tasks_total=len(tasks),
            max_indexes_per_job=rt.settings.max_indexes_per_job,
        )
        _write_plan(store, plan, tasks)
        return plan

    try:
        memory.plan = await asyncio.to_thread(resolve_and_write)
    except SpecError as error:
        memory.rejected = (spec_generation(spec), time.monotonic(), error)
        raise
    log.info(
        "%s/%s: planned %d task(s), %d Job(s)",
        namespace,
        name,
        memory.plan.tasks_total,
        len(memory.plan.shards),
    )
    return memory.plan


# ---------------------------------------------------------------------- the Jobs


def build_job(rt: Runtime, plan: JobPlan, shard: Shard, owner: Owner, parallelism: int) -> dict[str, Any]:
    """The Indexed Job of one shard (unit-tested: the exact Job the operator creates)."""
    spec = plan.spec
    settings = rt.settings
    gpu_class = settings.pools[shard.gpu_class]
    store_url = spec.store or settings.default_store
    secrets = [
        (API_KEY_VARIABLE, policy.api_key_secret, "apiKey")
        for policy in spec.policies
        if policy.api_key_secret
    ][:1]
    worker = container(
        name=WORKER_CONTAINER,
        image=settings.worker_image,
        pull_policy=settings.worker_pull_policy,
        command=[
            *settings.worker_command,
            "--store",
            store_url,
            "--prefix",
            plan.prefix,
            "--gpu-class",
            shard.gpu_class,
            "--shard",
            str(shard.number),
            "--role",
            shard.role.value,
        ],
        env={**store_env(settings, store_url), "KERNELFLEET_GPU_CLASS": shard.gpu_class},
        gpu_resource=gpu_class.gpu_resource,
        gpus=spec.gpus_per_pod,
        requests=gpu_class.requests,
        store_secret=bool(settings.store_secret),
        env_from_secrets=secrets,
    )
    pod = pod_spec(
        [worker], settings=settings, gpu_class=gpu_class, priority_class_name=spec.priority_class_name
    )
    return indexed_job(
        name=shard.job_name,
        owner=owner,
        labels={
            LABEL_GPU_CLASS: shard.gpu_class,
            LABEL_ROLE: shard.role.value,
            LABEL_SHARD: str(shard.number),
        },
        pod=pod,
        completions=shard.completions,
        options=JobOptions(
            parallelism=parallelism,
            suspend=spec.suspend,
            backoff_limit_per_index=spec.backoff_limit_per_index,
            queue_name=spec.queue_name,
            managed_by=spec.managed_by,
        ),
    )


def _creation_shares(
    plan: JobPlan, views: Mapping[str, JobView], created: Mapping[str, int], role: Role
) -> dict[str, int]:
    """The parallelism to create each missing shard's Job with: what its class's `parallelism`
    leaves after the Jobs that exist (earlier shards first). A shard whose share is 0 is created
    later, once earlier shards need fewer pods.

    A Job's parallelism is set once, at creation, and never patched: Kueue admits a Job for its
    pod count, and changing the count of an admitted Job makes Kueue stop it, delete its running
    pods and queue it again. A Job with fewer indexes left than its parallelism needs no patch
    either: the Job controller starts no more pods than indexes remain, and Kueue hands the
    difference back to the queue (the Workload's reclaimablePods).
    """
    result: dict[str, int] = {}
    for gpu_class in sorted({s.gpu_class for s in plan.shards if s.role == role}):
        shards = sorted(
            (s for s in plan.shards if s.role == role and s.gpu_class == gpu_class), key=lambda s: s.number
        )
        left = plan.spec.parallelism
        for shard in shards:
            view = views.get(shard.job_name)
            if view is not None and not view.finished:
                remaining = max(0, shard.completions - view.succeeded - len(view.failed_indexes))
                left -= min(view.parallelism, remaining)
            elif view is None and shard.job_name in created:
                left -= created[shard.job_name]
        for shard in shards:
            if shard.job_name not in views and shard.job_name not in created:
                share = max(0, min(left, shard.completions))
                result[shard.job_name] = share
                left -= share
    return result


def ended_key(prefix: str, job_name: str) -> str:
    return f"{prefix}/jobs/{job_name}.json"


def _record_ended(
    store: Store, plan: JobPlan, views: Mapping[str, JobView], memory: _Memory
) -> dict[str, JobView]:
    """Views of every planned Job, including those that ended and are gone (ttlSecondsAfterFinished).

    The first time the operator sees a Job ended it writes a small record to the store, so a
    Job deleted afterwards is neither created again nor forgotten by the status, even after a
    restart."""
    result = dict(views)
    for shard in plan.shards:
        name = shard.job_name
        view = views.get(name)
        if view is not None and view.finished and name not in memory.ended:
            record = {
                "name": view.name, "role": view.role, "gpu_class": view.gpu_class, "shard": view.shard,
                "completions": view.completions, "succeeded": view.succeeded,
                "failed_indexes": sorted(view.failed_indexes), "finished": view.finished,
                "reason": view.reason,
            }  # fmt: skip
            with contextlib.suppress(ObjectConflict):
                store.put_json(ended_key(plan.prefix, name), record)
            memory.ended[name] = view
        if view is None:
            # Gone: maybe it ended and was deleted while no operator watched (this process sees
            # every Job it watches end, and records it above). So the store is asked once per
            # Job and process; a Job this process created is simply not in the index yet.
            if name not in memory.ended and name not in memory.created and name not in memory.no_record:
                try:
                    raw = store.get_json(ended_key(plan.prefix, name))
                except NotFound:
                    memory.no_record.add(name)
                    continue
                memory.ended[name] = JobView(
                    name=name, role=raw["role"], gpu_class=raw["gpu_class"], shard=raw["shard"],
                    completions=raw["completions"], parallelism=0, suspend=False, active=0, ready=0,
                    succeeded=raw["succeeded"], failed_indexes=frozenset(raw["failed_indexes"]),
                    finished=raw["finished"], reason=raw["reason"], deleting=False,
                )  # fmt: skip
            if name in memory.ended:
                result[name] = memory.ended[name]
    return result


async def _forget_vanished(rt: Runtime, namespace: str, memory: _Memory) -> None:
    """A Job created a pass ago that the index still lacks may have been deleted before the
    index saw it: ask the API, and forget it if it is gone, so that it is created again."""
    now = time.monotonic()
    for name, created_at in list(memory.created_at.items()):
        if (
            now - created_at > rt.settings.status_interval_s
            and await rt.kube.get_or_none(jobs_path(namespace, name)) is None
        ):
            memory.created.pop(name, None)
            memory.created_at.pop(name, None)


async def _converge_jobs(
    rt: Runtime, plan: JobPlan, spec: OptimizationJobSpec, owner: Owner, views: Mapping[str, JobView]
) -> None:
    """Create the planned Jobs that are missing and bring `suspend` of the others to the spec.
    Nothing else of an existing Job is ever changed (see `_creation_shares`)."""
    memory = _mem(owner.uid)
    for name in views:
        memory.created.pop(name, None)  # the index has it now
        memory.created_at.pop(name, None)
    await _forget_vanished(rt, owner.namespace, memory)
    search_shards = [s for s in plan.shards if s.role == Role.SEARCH]
    search_done = all((v := views.get(s.job_name)) is not None and v.finished for s in search_shards)
    wanted = list(search_shards)
    if search_done:
        wanted += [s for s in plan.shards if s.role == Role.VERIFY]
    shares = {
        **_creation_shares(plan, views, memory.created, Role.SEARCH),
        **_creation_shares(plan, views, memory.created, Role.VERIFY),
    }
    missing = [s for s in wanted if shares.get(s.job_name, 0) > 0]

    async def create(shard: Shard) -> None:
        body = build_job(rt, plan, shard, owner, shares[shard.job_name])
        try:
            await rt.kube.create(jobs_path(owner.namespace), body)
        except ApiError as error:
            if not error.conflict:
                raise
        memory.created[shard.job_name] = shares[shard.job_name]
        memory.created_at[shard.job_name] = time.monotonic()

    for start in range(0, len(missing), 8):
        await asyncio.gather(*(create(s) for s in missing[start : start + 8]))
    for shard in wanted:
        view = views.get(shard.job_name)
        if view is None or view.finished or view.deleting:
            continue
        # With a queue, Kueue resumes the Job when it admits it: the operator only suspends.
        desired_suspend = spec.suspend or (bool(spec.queue_name) and view.suspend)
        if view.suspend != desired_suspend:
            await rt.kube.patch(
                jobs_path(owner.namespace, shard.job_name), {"spec": {"suspend": desired_suspend}}
            )


# ---------------------------------------------------------------------- the status


async def _missing_classes(rt: Runtime, classes: list[str]) -> dict[str, str]:
    """Classes no node offers, with the labels looked for. Nodes are listed at most every 30 s;
    without permission to list nodes the check is skipped (an empty answer)."""
    now = time.monotonic()
    if now - _nodes["at"] > NODES_TTL_S:
        try:
            items = await rt.kube.list_all(core_path("nodes"))
            _nodes["labels"] = [(i.get("metadata") or {}).get("labels") or {} for i in items]
        except ApiError as error:
            if error.status not in (401, 403):
                raise
            _nodes["labels"] = None
        _nodes["at"] = now
    labels = _nodes["labels"]
    if labels is None:
        return {}
    pools = rt.settings.pools
    return {
        c: pools[c].describe_labels()
        for c in classes
        if c in pools and not any(pools[c].matches(node) for node in labels)
    }


KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")


def admission_condition(
    queue: str, unfinished: list[str], workloads: Sequence[Mapping[str, Any]]
) -> cond.Condition:
    """Where Kueue stands with the unfinished Jobs, from their Workloads (pure, unit-tested).

    Kueue makes one Workload per Job (owned by it): `QuotaReserved` False with a message such as
    "insufficient unused quota for nvidia.com/gpu in flavor h100, 1 more needed" while it waits,
    `Admitted` True once it runs, `Evicted` True when Kueue took it back (preempted, not ready)."""
    by_job: dict[str, Mapping[str, Any]] = {}
    for workload in workloads:
        for owner in (workload.get("metadata") or {}).get("ownerReferences") or []:
            if owner.get("kind") == "Job" and owner.get("name") in unfinished:
                by_job[owner["name"]] = workload

    def status_of(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
        return cond.find((workload.get("status") or {}).get("conditions") or [], type_) or {}

    waiting = []
    for job in unfinished:
        found = by_job.get(job)
        if found is None:
            waiting.append((job, "Queued", "Kueue has not made its Workload yet"))
            continue
        workload = found
        if status_of(workload, "Admitted").get("status") == cond.TRUE:
            continue
        evicted = status_of(workload, "Evicted")
        if evicted.get("status") == cond.TRUE:
            waiting.append(
                (job, "Evicted", f"evicted ({evicted.get('reason')}): {evicted.get('message', '')}")
            )
        else:
            reserved = status_of(workload, "QuotaReserved")
            waiting.append((job, "Queued", str(reserved.get("message") or "waiting for quota")))
    if not waiting:
        return cond.Condition(
            cond.ADMITTED,
            cond.TRUE,
            "Admitted",
            f"Kueue admitted {len(unfinished)} Job(s) from LocalQueue {queue}",
        )
    reason = "Evicted" if any(r == "Evicted" for _, r, _ in waiting) else "Queued"
    text = "; ".join(f"Job {job}: {why}" for job, _, why in waiting[:5])
    more = f"; and {len(waiting) - 5} more" if len(waiting) > 5 else ""
    return cond.Condition(
        cond.ADMITTED,
        cond.FALSE,
        reason,
        f"{len(waiting)} of {len(unfinished)} Job(s) wait in LocalQueue {queue}: {text}{more}",
    )


async def _admission(
    rt: Runtime, namespace: str, queue: str, views: Mapping[str, JobView]
) -> cond.Condition | None:
    """The `Admitted` condition of a job with a queue; None when no Job waits or runs."""
    unfinished = sorted(v.name for v in views.values() if not v.finished and not v.deleting)
    if not unfinished:
        return None
    try:
        workloads = await rt.kube.list_all(custom_path(*KUEUE_WORKLOADS[:2], KUEUE_WORKLOADS[2], namespace))
    except ApiError as error:
        if error.status != 404:
            raise
        return cond.Condition(
            cond.ADMITTED,
            cond.FALSE,
            "KueueNotInstalled",
            f"spec.queueName is {queue!r} but this cluster serves no Kueue Workloads: install Kueue, "
            "or clear spec.queueName",
        )
    return admission_condition(queue, unfinished, workloads)


def _read_outcome(store: Store, key: str, known: dict[str, TaskOutcome]) -> None:
    try:
        known[key] = TaskOutcome.model_validate(store.get_json(key))
    except NotFound:
        pass  # a failed index whose pod never wrote one
    except (ValidationError, KernelfleetError) as error:
        log.warning("unreadable outcome %s: %s", key, error)


def _task_hash(store: Store, plan: JobPlan, memory: _Memory, position: int) -> str:
    """The hash of the task at a plan position, from its chunk (read once)."""
    if position not in memory.task_hashes:
        number = position // plan.chunk_size
        chunk = TaskChunk.model_validate(store.get_json(chunk_key(plan.prefix, number)))
        for offset, task in enumerate(chunk.tasks):
            memory.task_hashes[chunk.start + offset] = task.task().hash
    return memory.task_hashes[position]


def _read_outcomes(store: Store, plan: JobPlan, views: Mapping[str, JobView], memory: _Memory) -> None:
    """Read the outcome records not read before, incrementally (keys are immutable: a record
    never changes, and a worker writes it before its pod ends).

    After a start, each outcome folder is listed once. From then on only the indexes that ended
    since the last pass are read, each by its tasks' keys: a pass over a job where nothing ended
    costs no store request, and a finished job is not reconciled at all. A pod that runs several
    tasks (tasksPerIndex) has them counted when its index ends."""
    known = memory.outcomes
    if not memory.listed:
        for role, gpu_class in sorted({(s.role, s.gpu_class) for s in plan.shards}):
            for key in store.list(outcome_dir(plan.prefix, role, gpu_class)):
                if key.endswith(".json") and key not in known:
                    _read_outcome(store, key, known)
        memory.listed = True
        for shard in plan.shards:
            view = views.get(shard.job_name)
            memory.read_indexes[shard.job_name] = view.done_indexes() if view is not None else frozenset()
        return
    for shard in plan.shards:
        view = views.get(shard.job_name)
        if view is None:
            continue
        done = view.done_indexes()
        seen = memory.read_indexes.get(shard.job_name, frozenset())
        for index in sorted(done - seen):
            if index >= shard.completions:
                continue
            for position in shard.positions(index):
                key = outcome_key(
                    plan.prefix, shard.role, shard.gpu_class, _task_hash(store, plan, memory, position)
                )
                if key not in known:
                    _read_outcome(store, key, known)
        memory.read_indexes[shard.job_name] = seen | done


@dataclass(frozen=True)
class Fold:
    """The folded status and the conditions to set; pure data, unit-tested."""

    status: dict[str, Any]
    conditions: list[cond.Condition]


def fold_status(
    plan: JobPlan,
    views: Mapping[str, JobView],
    outcomes: Mapping[str, TaskOutcome],
    *,
    suspended: bool,
    missing_classes: Mapping[str, str],
    results_url: str,
    deadline_exceeded: bool = False,
) -> Fold:
    """Counters, speedups, phase and conditions from the Jobs and the outcome records."""
    search = [o for o in outcomes.values() if o.role == Role.SEARCH]
    verify = [o for o in outcomes.values() if o.role == Role.VERIFY]
    per_class: dict[str, Any] = {}
    all_speedups: list[float] = []
    done_total = failed_total = variants_total = 0
    for gpu_class in plan.spec.gpu_classes:
        mine = [o for o in search if o.gpu_class == gpu_class]
        shards = [s for s in plan.shards if s.role == Role.SEARCH and s.gpu_class == gpu_class]
        failed_from_indexes = 0
        active = jobs = 0
        for shard in shards:
            view = views.get(shard.job_name)
            if view is None:
                continue
            jobs += 1
            active += view.active
            failed_from_indexes += sum(
                len(shard.positions(i)) for i in view.failed_indexes if i < shard.completions
            )
        done = sum(1 for o in mine if o.ok)
        failed = min(plan.tasks_total - done, sum(1 for o in mine if not o.ok) + failed_from_indexes)
        speedups = [o.best_speedup for o in mine if o.ok and o.best_speedup is not None]
        all_speedups += speedups
        variants = sum(o.variants for o in mine)
        done_total += done
        failed_total += failed
        variants_total += variants
        per_class[gpu_class] = {
            "tasksTotal": plan.tasks_total,
            "tasksDone": done,
            "tasksFailed": failed,
            "variantsEvaluated": variants,
            "bestSpeedup": best(speedups),
            "medianSpeedup": median(speedups),
            "jobs": jobs,
            "activePods": active,
        }
    verification: dict[str, Any] = {}
    for gpu_class in plan.spec.verify_on:
        mine = [o for o in verify if o.gpu_class == gpu_class]
        measured = [o.best_speedup for o in mine if o.verified and o.best_speedup is not None]
        ratios = [
            o.best_speedup / o.source_speedup
            for o in mine
            if o.verified and o.best_speedup is not None and o.source_speedup
        ]
        verification[gpu_class] = {
            "tasksTotal": plan.tasks_total,
            "tasksDone": sum(1 for o in mine if o.ok),
            "tasksFailed": sum(1 for o in mine if not o.ok),
            "verified": sum(1 for o in mine if o.verified),
            "medianSpeedup": median(measured),
            "medianRatio": median(ratios),
        }

    search_views = [views.get(s.job_name) for s in plan.shards if s.role == Role.SEARCH]
    verify_views = [views.get(s.job_name) for s in plan.shards if s.role == Role.VERIFY]
    search_done = all(v is not None and v.finished for v in search_views)
    verify_done = all(v is not None and v.finished for v in verify_views)
    active_pods = sum(v.active for v in [*search_views, *verify_views] if v is not None)
    # `active` counts pods not yet finished, unscheduled ones too; `ready` those really running.
    running_pods = sum(v.ready for v in [*search_views, *verify_views] if v is not None)
    total_tasks = plan.tasks_total * len(plan.spec.gpu_classes)

    conditions = [
        cond.Condition(
            cond.SUSPENDED,
            cond.TRUE if suspended else cond.FALSE,
            "SuspendedBySpec" if suspended else "NotSuspended",
            "spec.suspend is true: no pods run; set it to false to continue" if suspended else "",
        )
    ]
    if missing_classes:
        text = "; ".join(
            f"no node offers GPU class {c} (looked for {labels})"
            for c, labels in sorted(missing_classes.items())
        )
        conditions.append(cond.Condition(cond.GPU_CLASS_UNAVAILABLE, cond.TRUE, "NoMatchingNodes", text))
    else:
        conditions.append(cond.Condition(cond.GPU_CLASS_UNAVAILABLE, cond.FALSE, "NodesFound", ""))
    summary = f"{done_total} of {total_tasks} task runs done, {failed_total} failed"
    if deadline_exceeded:
        phase = "Failed"
        conditions += [
            cond.Condition(
                cond.FAILED,
                cond.TRUE,
                "DeadlineExceeded",
                f"the job ran past spec.activeDeadlineSeconds; its Jobs were stopped; {summary}",
            ),
            cond.Condition(cond.COMPLETE, cond.FALSE, "DeadlineExceeded", ""),
            cond.Condition(cond.RUNNING, cond.FALSE, "Finished", ""),
        ]
    elif search_done and verify_done:
        all_failed = done_total == 0 and failed_total > 0
        phase = "Failed" if all_failed else "Succeeded"
        conditions += [
            cond.Condition(
                cond.COMPLETE,
                cond.FALSE if all_failed else cond.TRUE,
                "AllTasksFailed" if all_failed else "AllTasksEnded",
                summary,
            ),
            cond.Condition(
                cond.FAILED,
                cond.TRUE if all_failed else cond.FALSE,
                "AllTasksFailed" if all_failed else "NotFailed",
                summary if all_failed else "",
            ),
            cond.Condition(cond.RUNNING, cond.FALSE, "Finished", ""),
        ]
    else:
        verifying = search_done and bool(verify_views)
        if suspended:
            phase = "Suspended"
        elif verifying:
            phase = "Verifying"
        else:
            phase = "Running" if running_pods else "Pending"
        running = bool(running_pods) and not suspended
        if running:
            reason = "Verifying" if verifying else "PodsRunning"
        elif suspended:
            reason = "Suspended"
        else:
            reason = "PodsPending" if active_pods else "NoPods"
        conditions += [
            cond.Condition(
                cond.RUNNING,
                cond.TRUE if running else cond.FALSE,
                reason,
                f"{running_pods} pod(s) running, {active_pods - running_pods} waiting; {summary}",
            ),
            cond.Condition(cond.COMPLETE, cond.FALSE, "InProgress", ""),
            cond.Condition(cond.FAILED, cond.FALSE, "NotFailed", ""),
        ]
    status = {
        "phase": phase,
        "tasksTotal": total_tasks,
        "tasksDone": done_total,
        "tasksFailed": failed_total,
        "variantsEvaluated": variants_total,
        "bestSpeedup": best(all_speedups),
        "medianSpeedup": median(all_speedups),
        "perClass": per_class,
        "verification": verification,
        "results": results_url,
    }
    return Fold(status=status, conditions=conditions)


# ---------------------------------------------------------------------- the timer


def _post_events(body: kopf.Body, changed: list[Mapping[str, Any]]) -> None:
    for condition in changed:
        warning = (
            condition["type"] in (cond.FAILED, cond.GPU_CLASS_UNAVAILABLE, cond.RECONCILE_ERROR)
            and condition["status"] == cond.TRUE
        )
        if (
            condition["status"] != cond.TRUE
            and not warning
            and condition["type"] not in (cond.RUNNING, cond.SUSPENDED)
        ):
            continue
        kopf.event(
            body,
            type="Warning" if warning else "Normal",
            reason=str(condition.get("reason") or condition["type"]),
            message=f"{condition['type']}={condition['status']}: {condition.get('message', '')}"[:1024],
        )


async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    **kwargs: Any,
) -> None:
    rt = runtime(memo)
    namespace, name, uid = meta.namespace or "", meta.name or "", meta.uid or ""
    generation = int(meta.get("generation") or 0)
    rt.metrics.inc("reconciles_total", kind=KIND)
    current_conditions = list(status.get("conditions") or [])
    updates: list[cond.Condition] = []
    desired: dict[str, Any] = {"observedGeneration": generation}
    urgent = False
    try:
        parsed = OptimizationJobSpec.model_validate(dict(spec))
        plan = await _ensure_plan(rt, parsed, namespace, name, uid)
        owner = Owner(kind=KIND, name=name, namespace=namespace, uid=uid)
        index = kwargs.get(INDEX)
        store = rt.store(parsed.store, await namespace_credentials(rt, namespace))
        memory = _mem(uid)
        live = {v.name: v for v in (index.get((namespace, uid), []) if index is not None else [])}
        views = await asyncio.to_thread(_record_ended, store, plan, live, memory)
        started = status.get("startTime") or ""
        late = deadline_passed(started, parsed.active_deadline_seconds)
        if late:
            await _stop_jobs(rt, namespace, views)
        else:
            await _converge_jobs(rt, plan, parsed, owner, views)
        await asyncio.to_thread(_read_outcomes, store, plan, views, memory)
        missing = await _missing_classes(rt, sorted({*parsed.gpu_classes, *parsed.verify_on}))
        fold = fold_status(
            plan,
            views,
            memory.outcomes,
            suspended=parsed.suspend,
            missing_classes=missing,
            results_url=store.url_for(plan.prefix),
            deadline_exceeded=late,
        )
        desired.update(fold.status)
        updates += fold.conditions
        if parsed.queue_name and desired["phase"] not in ("Succeeded", "Failed"):
            admission = await _admission(rt, namespace, parsed.queue_name, views)
            if admission is not None:
                updates.append(admission)
        shards = len(plan.shards)
        updates.append(
            cond.Condition(
                cond.ACCEPTED, cond.TRUE, "Planned", f"{plan.tasks_total} task(s), {shards} Job(s) planned"
            )
        )
        if cond.find(current_conditions, cond.RECONCILE_ERROR):
            updates.append(cond.Condition(cond.RECONCILE_ERROR, cond.FALSE, "Reconciled", ""))
        if not status.get("startTime"):
            desired["startTime"] = cond.now()
        if desired["phase"] in ("Succeeded", "Failed") and not status.get("completionTime"):
            desired["completionTime"] = cond.now()  # the end: the timer stops (see _lifecycle.active)
    except (SpecError, ValidationError, UsageError) as error:
        message = (
            str(error) if not isinstance(error, ValidationError) else f"spec is invalid: {error.errors()[0]}"
        )
        rt.metrics.inc("errors_total", kind=KIND, reason="InvalidSpec")
        desired["phase"] = "Failed"
        updates += [
            cond.Condition(cond.ACCEPTED, cond.FALSE, "InvalidSpec", message),
            cond.Condition(cond.FAILED, cond.TRUE, "InvalidSpec", message),
        ]
        urgent = not cond.find(current_conditions, cond.ACCEPTED)
    except (StoreUnavailable, ApiError, OSError, KernelfleetError) as error:
        # Worth retrying: the next pass does. The error is in a condition, not only in the log.
        reason = "StoreUnreachable" if isinstance(error, StoreUnavailable | KernelfleetError) else "ApiError"
        rt.metrics.inc("errors_total", kind=KIND, reason=reason)
        log.warning("%s/%s: %s", namespace, name, error)
        updates.append(cond.Condition(cond.RECONCILE_ERROR, cond.TRUE, reason, str(error)[:2000]))
        if not status.get("phase"):
            desired["phase"] = "Pending"
    new_conditions = cond.set_conditions(current_conditions, updates, observed_generation=generation)
    desired["conditions"] = new_conditions
    diff = status_diff(dict(status), desired)
    changed = cond.transitions(current_conditions, new_conditions)
    terminal = bool(desired.get("completionTime"))
    if diff and rt.limiter.allow(uid, urgent=urgent or terminal or bool(changed and not current_conditions)):
        for key, value in diff.items():
            patch.status[key] = value
        rt.metrics.inc("status_patches_total", kind=KIND)
        _post_events(body, changed)
        _phases[uid] = str(desired.get("phase", _phases.get(uid, "")))
        if terminal:
            # The last pass: with completionTime in the status the timer stops (its filter), so
            # what this resource kept in memory goes now.
            _memory.pop(uid, None)
            rt.limiter.forget(uid)
    _update_phase_gauge(rt)


def _update_phase_gauge(rt: Runtime) -> None:
    counts: dict[str, int] = {}
    for phase in _phases.values():
        if phase:
            counts[phase] = counts.get(phase, 0) + 1
    rt.metrics.replace_gauge("jobs", (({"kind": KIND, "phase": p}, float(n)) for p, n in counts.items()))


async def forget(meta: kopf.Meta, memo: Any, **_: Any) -> None:
    """The resource is being deleted: its Jobs go with it (owner references); drop the caches."""
    uid = meta.uid or ""
    _memory.pop(uid, None)
    _phases.pop(uid, None)
    runtime(memo).limiter.forget(uid)


async def _stop_jobs(rt: Runtime, namespace: str, views: Mapping[str, JobView]) -> None:
    """Past the deadline: delete the Jobs still running (their pods stop; outcomes stay)."""
    for view in views.values():
        if not view.finished and not view.deleting:
            with contextlib.suppress(ApiError):
                await rt.kube.delete(jobs_path(namespace, view.name))


async def expire(
    spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, memo: Any, stopped: Any, **_: Any
) -> None:
    """ttlSecondsAfterFinished: delete the finished resource; its Jobs go with it through
    their owner references, and what it wrote stays in the store."""
    if await ttl_passed(spec, status, stopped):
        with contextlib.suppress(ApiError):  # gone already: someone was quicker
            await runtime(memo).kube.delete(resource_path(meta.namespace or "", meta.name or ""))
        log.info("%s/%s: deleted after it finished (ttlSecondsAfterFinished)", meta.namespace, meta.name)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Add the OptimizationJob handlers to `registry` (called by `_app.register_kinds`)."""
    interval_s = settings.status_interval_s
    kopf.index("batch", "v1", "jobs", labels={OWNER_LABEL: kopf.PRESENT}, registry=registry, id=INDEX)(
        index_jobs
    )
    kopf.timer(GROUP, VERSION, PLURAL, interval=interval_s, when=active, registry=registry, id="reconcile")(
        reconcile
    )
    kopf.daemon(GROUP, VERSION, PLURAL, when=expiring, registry=registry, id="expire")(expire)
    kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry, id="forget")(forget)


def resource_path(namespace: str, name: str = "") -> str:
    return custom_path(GROUP, VERSION, PLURAL, namespace, name)
