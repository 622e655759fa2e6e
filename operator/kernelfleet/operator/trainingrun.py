"""The TrainingRun controller: its stages in order, each a JobSet (trainer, generator, reward).

One level-based pass, `reconcile`, runs when a run is created, changed or found at start-up,
and on a timer. It reads what exists (the stage JobSets, the trainer's records in the store),
asks `_training_plan.plan_run` what should exist, makes it so, and folds the status
(`_training_status`). Every step is idempotent and every name deterministic, so a
pass that runs twice, or an operator killed halfway through one, creates nothing twice.

At the first pass the operator records the spec in the store (`run.json` under the run's
prefix): the stage pods read it from there, and the run keeps that spec to its end. A spec
edit is refused by the API server (CEL rules from `TrainingRunSpec.MUTABLE`: its stages'
checkpoints belong to the recorded spec); should the record still differ, the run keeps it and
the `Accepted` condition says so. The mutable fields (`suspend`, `ttlSecondsAfterFinished`,
`activeDeadlineSeconds`) are read from the resource on every pass and never recorded.

A run that ended gets `completionTime` and is not reconciled again (`_lifecycle`); its TTL
deletes it, its deadline fails it and deletes the running stage's JobSet.

The operator reaches the store with the keys of the run's namespace (its store Secret), as for
an OptimizationJob, so a namespace's store policy bounds what its runs read and write.

Deleting a TrainingRun deletes what it owns (JobSets, their Jobs and pods, the evaluation
service's token) through owner references; the store keeps every checkpoint, dataset, metric and model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf
from pydantic import ValidationError

from kernelfleet.core.errors import KernelfleetError
from kernelfleet.core.resources import (
    GROUP,
    VERSION,
    TrainingRunSpec,
    TrainingRunStatus,
    TrainingStage,
    TrainingStageStatus,
)
from kernelfleet.core.store import ObjectConflict, Store
from kernelfleet.core.training import TrainingLayout, read_run_record, run_record
from kernelfleet.operator import _conditions as cond
from kernelfleet.operator._app import Runtime, runtime
from kernelfleet.operator._jobs import LABEL_OWNER_UID, LABEL_ROLE
from kernelfleet.operator._kube import ApiError, core_path, custom_path
from kernelfleet.operator._lifecycle import active, deadline_passed, expiring, ttl_passed
from kernelfleet.operator._plan import SpecError
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._status import status_diff
from kernelfleet.operator._training_plan import (
    ROLE_TRAINER,
    JobState,
    Phase,
    Plan,
    RunRef,
    jobset_view,
    plan_run,
    resolved_spec,
    reward_gpu_class,
    runs_own_evaluator,
)
from kernelfleet.operator._training_pods import (
    LABEL_JOBSET,
    LABEL_REPLICATED_JOB,
    LABEL_STAGE,
    ROLE_STAGE,
    eval_token,
    owner_of,
    ref_of,
    stage_jobset,
)
from kernelfleet.operator._training_status import fold_stages, read_stage, stages_to_read
from kernelfleet.operator.optimizationjob import _missing_classes, namespace_credentials

log = logging.getLogger("kernelfleet.operator.trainingrun")

PLURAL = "trainingruns"
KIND = "TrainingRun"


class InvalidSpec(Exception):
    """What the CRD schema cannot check: the message names the field and the fix."""


JOBSET_GROUP, JOBSET_VERSION, JOBSETS = "jobset.x-k8s.io", "v1alpha2", "jobsets"


class JobSetMissing(KernelfleetError):
    """The cluster serves no JobSet API; the `ReconcileError` condition says what to install."""


def _resource(namespace: str, name: str) -> str:
    return custom_path(GROUP, VERSION, PLURAL, namespace, name)


def _jobsets(namespace: str, name: str = "") -> str:
    return custom_path(JOBSET_GROUP, JOBSET_VERSION, JOBSETS, namespace, name)


async def _children(rt: Runtime, namespace: str, uid: str) -> dict[str, dict[str, Any]]:
    """The run's stage JobSets, by stage."""
    selector = f"{LABEL_OWNER_UID}={uid},{LABEL_ROLE}={ROLE_STAGE}"
    try:
        items = await rt.kube.list_all(_jobsets(namespace), {"labelSelector": selector})
    except ApiError as error:
        if error.not_found:
            raise JobSetMissing(
                f"the JobSet API ({JOBSET_GROUP}/{JOBSET_VERSION}) is not served by this cluster: each "
                "TrainingRun stage runs as a JobSet; install the JobSet controller (v0.12 or newer) "
                "and the run continues"
            ) from None
        raise
    return {item["metadata"]["labels"].get(LABEL_STAGE, ""): item for item in items}


async def _validate(rt: Runtime, spec: TrainingRunSpec, run: RunRef) -> None:
    pools = rt.settings.pools
    known = ", ".join(pools.names())
    if spec.gpu_class not in pools:
        raise InvalidSpec(f"spec.gpuClass: no GPU pool class {spec.gpu_class!r}; the pools are: {known}")
    own = any(runs_own_evaluator(spec, stage, run) for stage in spec.stages)
    reward_class = spec.reward_gpu_class or rt.settings.eval_gpu_class or spec.gpu_class
    if own and reward_class not in pools:
        where = (
            "spec.rewardGpuClass"
            if spec.reward_gpu_class or not rt.settings.eval_gpu_class
            else "the operator's default reward class (the chart's evalService.gpuClass)"
        )
        raise InvalidSpec(f"{where}: no GPU pool class {reward_class!r}; the pools are: {known}")
    if not (spec.store or rt.settings.default_store):
        raise InvalidSpec("spec.store: empty, and the operator has no default store (--store)")
    for index, stage in enumerate(spec.stages):
        secret = stage.reward.token_secret if stage.reward is not None else ""
        if not secret:
            continue
        found = await rt.kube.get_or_none(core_path("secrets", run.namespace, secret))
        if found is None or "token" not in (found.get("data") or {}):
            raise InvalidSpec(
                f"spec.stages[{index}].reward.tokenSecret: no Secret {secret!r} with key 'token' in "
                f"namespace {run.namespace}; create it or clear the field"
            )


def _record(
    store: Store, layout: TrainingLayout, name: str, spec: TrainingRunSpec
) -> tuple[TrainingRunSpec, bool]:
    """Record the spec at the run's start; (the recorded spec, whether it equals `spec`)."""
    try:
        store.put_json(layout.spec, run_record(name, spec))
        return spec, True
    except ObjectConflict:
        _, recorded = read_run_record(store, layout)
        return recorded, False


def _store_work(store: Store, layout: TrainingLayout, names: list[str]) -> tuple[dict[str, Any], str]:
    records = {name: read_stage(store, layout, name) for name in names}
    keys = [key for key in store.list(layout.reports) if key.endswith(".json")]
    report = store.url_for(keys[-1]) if keys else ""
    return records, report


def _conditions(plan: Plan, accepted: cond.Condition) -> list[cond.Condition]:
    phase = plan.phase
    reason = plan.reason or phase.value
    return [
        accepted,
        cond.Condition(
            cond.RUNNING, cond.TRUE if phase == Phase.RUNNING else cond.FALSE, reason, plan.message
        ),
        cond.Condition(
            cond.SUSPENDED, cond.TRUE if phase == Phase.SUSPENDED else cond.FALSE, reason, plan.message
        ),
        cond.Condition(
            cond.COMPLETE, cond.TRUE if phase == Phase.SUCCEEDED else cond.FALSE, reason, plan.message
        ),
        cond.Condition(cond.FAILED, cond.TRUE if phase == Phase.FAILED else cond.FALSE, reason, plan.message),
    ]


async def _ensure(rt: Runtime, path: str, body: Mapping[str, Any]) -> None:
    """Create `body` unless it exists (a pass that ran before, or a racing one, made it)."""
    try:
        await rt.kube.create(path, body)
    except ApiError as error:
        if not error.conflict:
            raise


async def _act(
    rt: Runtime,
    body: Mapping[str, Any],
    spec: TrainingRunSpec,
    plan: Plan,
    jobsets: Mapping[str, dict[str, Any]],
    prefix: str,
    store_url: str,
) -> None:
    owner = owner_of(body)
    namespace = owner.namespace
    stage: TrainingStage | None = plan.stage
    if stage is None:
        return
    jobset = jobsets.get(stage.name)
    if plan.delete_jobset:
        if jobset is not None:
            await rt.kube.delete(_jobsets(namespace, jobset["metadata"]["name"]))
        return
    if plan.create_jobset and jobset is None:
        own_service = runs_own_evaluator(spec, stage, ref_of(owner))
        if own_service and not (stage.reward is not None and stage.reward.token_secret):
            await _ensure(rt, core_path("secrets", namespace), eval_token(stage, owner))
        manifest = stage_jobset(
            spec,
            stage,
            owner,
            prefix=prefix,
            store_url=store_url,
            gpu_class=rt.settings.pools[spec.gpu_class],
            reward_class=rt.settings.pools[reward_gpu_class(spec)] if own_service else None,
            settings=rt.settings,
            suspend=bool(plan.suspend_jobset),
        )
        await _ensure(rt, _jobsets(namespace), manifest)
    elif jobset is not None and plan.suspend_jobset is not None:
        finished = jobset_view(jobset).state in (JobState.SUCCEEDED, JobState.FAILED)
        if not finished and bool((jobset.get("spec") or {}).get("suspend")) != plan.suspend_jobset:
            path = _jobsets(namespace, jobset["metadata"]["name"])
            await rt.kube.patch(path, {"spec": {"suspend": plan.suspend_jobset}})


async def reconcile(body: Mapping[str, Any], rt: Runtime, memo: Any) -> dict[str, Any]:
    """One pass over one TrainingRun; returns the status it should have. `memo` is kopf's memo
    of this resource (it keeps what the store said about the recorded spec)."""
    metadata = body["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    generation = int(metadata.get("generation") or 0)
    run = RunRef(namespace, name, uid)
    old_status = dict(body.get("status") or {})
    conditions = old_status.get("conditions") or []
    if old_status.get("phase") in TERMINAL:
        # Ended before completionTime was recorded: record it, and touch nothing else (its
        # JobSets may be gone, and a plan made now would start its stages again).
        return {**old_status, "completionTime": old_status.get("completionTime") or cond.now()}
    try:
        spec = TrainingRunSpec.model_validate(body.get("spec") or {})
        await _validate(rt, spec, run)
        # The store with the keys of the run's namespace, never the operator's own: the run
        # reaches only what its namespace may (the stage pods mount the same Secret). A missing
        # Secret is reported like a bad spec and looked for again at the next pass.
        credentials = await namespace_credentials(rt, namespace)
    except (ValidationError, InvalidSpec, SpecError) as error:
        message = str(error)
        accepted = cond.Condition(cond.ACCEPTED, cond.FALSE, "InvalidSpec", message)
        return {
            "phase": Phase.PENDING.value,
            "observedGeneration": generation,
            "conditions": cond.set_conditions(conditions, [accepted], observed_generation=generation),
        }
    store_url = spec.store or rt.settings.default_store
    store = rt.store(store_url, credentials)
    prefix = run.prefix
    layout = TrainingLayout(prefix)
    wanted = resolved_spec(spec, run, rt.settings.eval_gpu_class)
    # The record never changes once written: ask the store again only when the spec did.
    cached = getattr(memo, "training_record", None)
    if cached is not None and cached[0] == wanted:
        recorded, same = cached[1], cached[2]
    else:
        recorded, same = await asyncio.to_thread(_record, store, layout, name, wanted)
        memo.training_record = (wanted, recorded, same)
    if same:
        accepted = cond.Condition(
            cond.ACCEPTED, cond.TRUE, "Recorded", f"spec recorded at {store.url_for(layout.spec)}"
        )
    else:
        accepted = cond.Condition(
            cond.ACCEPTED,
            cond.TRUE,
            "SpecChangeIgnored",
            "the spec changed after the run started; it keeps the one recorded at "
            f"{store.url_for(layout.spec)} (only suspend applies); create a new TrainingRun to train "
            "with the new spec",
        )
    jobsets = await _children(rt, namespace, uid)
    views = {stage_name: jobset_view(jobset) for stage_name, jobset in jobsets.items()}
    for stage_name, view in views.items():
        if view.state == JobState.FAILED:
            output = await _last_output(rt, namespace, jobsets[stage_name]["metadata"]["name"])
            if output:
                views[stage_name] = replace(view, message=f"{view.message}; its last output: {output}")
    # `suspend` and the deadline are read from the resource on every pass (they are mutable);
    # the queue is the recorded spec's.
    started = old_status.get("startTime") or cond.now()
    late = deadline_passed(started, spec.active_deadline_seconds)
    plan = plan_run(recorded, views, suspend=spec.suspend, deadline_exceeded=late)
    await _act(rt, body, recorded, plan, jobsets, prefix, store_url)

    previous = _previous_stages(old_status)
    names = stages_to_read(recorded, views, previous)
    records, report = await asyncio.to_thread(_store_work, store, layout, names)
    folded = fold_stages(recorded, plan, views, records, previous)
    ended = plan.phase.value in TERMINAL
    status = TrainingRunStatus(
        phase=plan.phase.value,
        observed_generation=generation,
        current_stage=folded.current_stage,
        stages_done=folded.stages_done,
        checkpoint=folded.checkpoint,
        stages=folded.stages,
        report=report,
        start_time=started,
        completion_time=old_status.get("completionTime") or (cond.now() if ended else ""),
    ).model_dump(mode="json", by_alias=True)
    classes = [recorded.gpu_class]
    if any(runs_own_evaluator(recorded, stage, run) for stage in recorded.stages):
        classes.append(reward_gpu_class(recorded))
    missing = await _missing_classes(rt, sorted(set(classes)))
    updates = _conditions(plan, accepted)
    if missing:
        text = "; ".join(
            f"no node offers GPU class {c} (looked for {labels})" for c, labels in sorted(missing.items())
        )
        updates.append(cond.Condition(cond.GPU_CLASS_UNAVAILABLE, cond.TRUE, "NoMatchingNodes", text))
    else:
        updates.append(cond.Condition(cond.GPU_CLASS_UNAVAILABLE, cond.FALSE, "NodesFound", ""))
    conditions = cond.remove_condition(conditions, cond.RECONCILE_ERROR)
    status["conditions"] = cond.set_conditions(conditions, updates, observed_generation=generation)
    return status


async def _last_output(rt: Runtime, namespace: str, jobset: str) -> str:
    """The end of the newest failed pod's output (its termination message, which the pod takes
    from its log on an error), a trainer's first: what a user needs to see why a stage failed."""
    pods = await rt.kube.list_all(core_path("pods", namespace), {"labelSelector": f"{LABEL_JOBSET}={jobset}"})
    pods.sort(
        key=lambda pod: (
            pod["metadata"].get("labels", {}).get(LABEL_REPLICATED_JOB) == ROLE_TRAINER,
            str(pod["metadata"].get("creationTimestamp") or ""),
        )
    )
    for pod in reversed(pods):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            if terminated.get("exitCode"):
                text = " ".join(str(terminated.get("message") or "").split())
                return text[-600:] or f"exit code {terminated['exitCode']}"
    return ""


def _previous_stages(status: Mapping[str, Any]) -> list[TrainingStageStatus]:
    """The stages as the resource's status holds them (an unreadable entry is read again)."""
    stages = []
    for entry in status.get("stages") or []:
        try:
            stages.append(TrainingStageStatus.model_validate(entry))
        except ValidationError:
            continue
    return stages


async def _patch_status(rt: Runtime, body: kopf.Body, status: dict[str, Any]) -> None:
    metadata = body["metadata"]
    current = dict(body.get("status") or {})
    diff = status_diff(current, status)
    if not diff:
        return
    urgent = current.get("phase") != status.get("phase")
    if not rt.limiter.allow(metadata["uid"], urgent=urgent):
        return
    for changed in cond.transitions(current.get("conditions") or [], status.get("conditions") or []):
        kind, value = changed.get("type"), changed.get("status")
        warning = (value == cond.TRUE and kind in _WARNINGS) or (
            kind == cond.ACCEPTED and value == cond.FALSE
        )
        if value == cond.TRUE or warning:
            kopf.event(
                body,
                type="Warning" if warning else "Normal",
                reason=str(changed.get("reason") or kind),
                message=str(changed.get("message") or ""),
            )
    path = custom_path(GROUP, VERSION, PLURAL, metadata["namespace"], metadata["name"], "status")
    await rt.kube.patch(path, {"status": diff})
    rt.metrics.inc("status_patches_total", kind=KIND)


TERMINAL = (Phase.SUCCEEDED.value, Phase.FAILED.value)
_WARNINGS = frozenset({cond.FAILED, cond.GPU_CLASS_UNAVAILABLE, cond.RECONCILE_ERROR})


async def _pass(body: kopf.Body, rt: Runtime, memo: Any, logger: Any) -> dict[str, Any]:
    """One reconcile and status patch; an error becomes the `ReconcileError` condition.
    Returns the status patched."""
    rt.metrics.inc("reconciles_total", kind=KIND)
    try:
        status = await reconcile(body, rt, memo)
    except (ApiError, KernelfleetError, OSError) as error:
        # An API or store error: the next pass tries again; until then the condition says why.
        reason = type(error).__name__
        rt.metrics.inc("errors_total", kind=KIND, reason=reason)
        logger.warning(f"reconcile failed, retrying at the next pass: {error}")
        status = _error_status(body, reason, str(error))
    await _patch_status(rt, body, status)
    return status


def _error_status(body: Mapping[str, Any], reason: str, message: str) -> dict[str, Any]:
    old = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation") or 0)
    error = cond.Condition(cond.RECONCILE_ERROR, cond.TRUE, reason, message)
    conditions = cond.set_conditions(old.get("conditions") or [], [error], observed_generation=generation)
    return {**old, "conditions": conditions}


async def follow(body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, logger: Any, **_: Any) -> None:
    """Reconcile the run every `status_interval_s` until it ends (or is deleted).

    A daemon rather than a timer: kopf keeps its `body` current from the watch, so a changed
    `suspend` is seen at the next pass, and one run's slow store never delays another's. A
    finished run (`completionTime` in its status) is not reconciled again: nothing of it can
    change any more, so the daemon ends (and its filter keeps it from starting again, at a
    restart too) and what it kept in memory goes.
    """
    rt = runtime(memo)
    while not stopped and active(body.get("status") or {}):
        status = await _pass(body, rt, memo, logger)
        if status.get("completionTime"):
            memo.training_record = None
            rt.limiter.forget(body["metadata"]["uid"])
            return
        await stopped.wait(rt.settings.status_interval_s)


async def forget(body: kopf.Body, memo: Any, **_: Any) -> None:
    """Nothing to clean up by hand: everything the run made is owned by it (garbage collection)."""
    runtime(memo).limiter.forget(body["metadata"]["uid"])


async def expire(
    spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, memo: Any, stopped: Any, **_: Any
) -> None:
    """ttlSecondsAfterFinished: delete the finished resource; its JobSets go with it through
    their owner references, and what it wrote stays in the store."""
    if await ttl_passed(spec, status, stopped):
        with contextlib.suppress(ApiError):  # gone already: someone was quicker
            await runtime(memo).kube.delete(_resource(meta.namespace or "", meta.name or ""))
        log.info("%s/%s: deleted after it finished (ttlSecondsAfterFinished)", meta.namespace, meta.name)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Add the TrainingRun handlers to the operator's registry (see `_app.register_kinds`)."""
    kopf.daemon(
        GROUP, VERSION, PLURAL, when=active, registry=registry, id="follow", cancellation_timeout=10.0
    )(follow)
    kopf.daemon(GROUP, VERSION, PLURAL, when=expiring, registry=registry, id="expire")(expire)
    kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry, id="forget")(forget)
