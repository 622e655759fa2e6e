"""Handlers of `kernelfleet submit`, `status` and `logs` (their parsers are in cli_cluster)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import GROUP, VERSION, OptimizationJobSpec, TrainingRunSpec
from kernelfleet.core.run_location import store_config
from kernelfleet.core.store import open_store
from kernelfleet.operator.client import _logs
from kernelfleet.operator.client._connect import PLURALS, _reason, api_errors, connect
from kernelfleet.operator.client._resources import (
    find_resource,
    get_resource,
    list_resources,
    run_location_of,
)
from kernelfleet.operator.client._status import events_of, format_detail, format_list, table
from kernelfleet.operator.client._submit import (
    SPEC_MODELS,
    Uploads,
    derived_name,
    follow,
    manifest,
    policy_spec,
    read_manifests,
    spec_errors,
    succeeded,
    task_selections,
)


def status(args: argparse.Namespace) -> int:
    if args.name and args.all_namespaces:
        raise UsageError("give a NAME or -A, not both: -A lists the jobs of every namespace")
    with connect(args.namespace) as cluster:
        cluster.require_crds()
        if args.name:
            resource = find_resource(cluster, args.name)
            with api_errors(cluster, "reading its events"):
                events = events_of(cluster, resource)
            print(format_detail(resource, events))
            return 0
        resources = list_resources(cluster, all_namespaces=args.all_namespaces)
        if not resources:
            where = "any namespace" if args.all_namespaces else f"namespace {cluster.namespace}"
            print(
                f"no OptimizationJobs or TrainingRuns in {where}; submit one with `kernelfleet submit`",
                file=sys.stderr,
            )
            return 0
        print(format_list(resources, all_namespaces=args.all_namespaces))
    return 0


def logs(args: argparse.Namespace) -> int:
    with connect(args.namespace) as cluster:
        cluster.require_crds()
        resource = find_resource(cluster, args.name, kind="OptimizationJob")
    location = run_location_of(resource)
    store = open_store(location.store_url, store_config(args))
    files = _logs.log_files(store, location.prefix)
    if not files:
        print(
            f"no worker logs yet for {location.description} in {store.url_for(location.prefix)}: "
            "workers write them as their tasks run; `kernelfleet status NAME` says whether any pod started",
            file=sys.stderr,
        )
        return 0
    chosen = _logs.select(files, args.task, args.gpu_class)
    if not args.task:
        ended = _logs.outcomes(store, location.prefix)
        rows = [["TASK", "CLASS", "ROLE", "ATTEMPTS", "OUTCOME"]]
        attempts: dict[tuple[str, str, str, str], int] = {}
        for f in chosen:
            key = (f.task or f.stem, f.gpu_class, f.role, f.stem)
            attempts[key] = attempts.get(key, 0) + 1
        # Failed tasks first: they are why one reads logs.
        order = sorted(
            attempts, key=lambda k: (not ended.get((k[2], k[1], k[3]), "").startswith("failed"), k)
        )
        for task, gpu, role, stem in order:
            outcome = ended.get((role, gpu, stem), "-" if stem.startswith("index-") else "running")
            rows.append([task, gpu, role, str(attempts[(task, gpu, role, stem)]), outcome])
        print(table(rows))
        print(f"\nthe lines of one: kernelfleet logs {args.name} --task TASK", file=sys.stderr)
        return 0
    for number, log in enumerate(chosen):
        if len(chosen) > 1:
            print(("\n" if number else "") + f"==> {log.label} <==")
        text = _logs.read_log(store, log)
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


# ---------------------------------------------------------------------- submit


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _pool_classes(cluster: Any) -> list[str] | None:
    """The GPU classes of the installed charts' pools ConfigMaps (all releases together); None
    when none can be read (a user may not list ConfigMaps cluster-wide: then the operator's
    `Accepted=False` condition reports an unknown class instead)."""
    import yaml
    from kubernetes.client.exceptions import ApiException

    try:
        maps = cluster.core.list_config_map_for_all_namespaces(
            label_selector="app.kubernetes.io/part-of=kernelfleet", _request_timeout=10
        ).items
    except ApiException:
        return None
    classes: set[str] = set()
    found = False
    for config_map in maps:
        text = (config_map.data or {}).get("pools.yaml")
        if not text:
            continue
        try:
            classes.update((yaml.safe_load(text) or {}).get("classes") or {})
            found = True
        except yaml.YAMLError:
            continue
    return sorted(classes) if found else None


def _check_classes(cluster: Any, classes: Sequence[str], what: str) -> None:
    known = _pool_classes(cluster)
    if known is None:
        return
    unknown = [name for name in classes if name not in known]
    if unknown:
        raise UsageError(
            f"unknown GPU class {', '.join(repr(n) for n in unknown)} in {what}: the cluster's pools have "
            f"{', '.join(known)} (the chart's `pools.classes`; a platform admin adds classes there)"
        )


def _create(cluster: Any, document: dict[str, Any]) -> tuple[str, bool]:
    """Create the resource; (name, created). An identical one already there is followed instead."""
    from kubernetes.client.exceptions import ApiException

    meta = document["metadata"]
    namespace = meta.get("namespace") or cluster.namespace
    meta["namespace"] = namespace
    plural = PLURALS[document["kind"]]
    with api_errors(cluster, f"creating {document['kind']} {namespace}/{meta['name']}"):
        try:
            # Strict, as kubectl asks: a field the CRD does not know (a typo) is an error that
            # names it, not a warning while the API server drops it.
            cluster.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, document, field_validation="Strict"
            )
            return meta["name"], True
        except ApiException as error:
            if error.status != 409:
                if error.status in (400, 422):
                    raise UsageError(
                        f"the API server refused {document['kind']} {meta['name']}: {_reason(error)}"
                    ) from None
                raise
        existing = cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, meta["name"]
        )
    model = SPEC_MODELS[document["kind"]]
    if model.model_validate(existing.get("spec") or {}) != model.model_validate(document.get("spec") or {}):
        raise UsageError(
            f"{document['kind']} {namespace}/{meta['name']} already exists with another spec; choose another "
            f"--name, or delete it first (`kubectl delete {plural} {meta['name']} -n {namespace}`)"
        )
    return meta["name"], False


def submit(args: argparse.Namespace) -> int:
    from kernelfleet.core.job_options import BUDGET_OPTIONS, EVALUATION_OPTIONS
    from kernelfleet.operator.cli_cluster import POLICY_SPEC_OPTIONS, SPEC_OPTIONS

    if args.file and args.tasks:
        raise UsageError("give TASKS or -f FILE, not both")
    if not args.file and not args.tasks:
        raise UsageError(
            "give the TASKS to optimise (as for `kernelfleet optimize`), or -f FILE with manifests"
        )
    with connect(args.namespace) as cluster:
        cluster.require_crds()
        if args.file:
            documents = read_manifests(args.file)
        else:
            uploads = Uploads(args.store)
            options = POLICY_SPEC_OPTIONS.given(args)
            policies = [
                policy_spec(text, uploads, api_key_secret=args.api_key_secret or "", **options)
                for text in (args.policies or ["compile"])
            ]
            values: dict[str, Any] = {
                "tasks": task_selections(args.tasks, uploads),
                "policies": policies,
                "budget": BUDGET_OPTIONS.build(args),
                "evaluation": EVALUATION_OPTIONS.build(args),
                **SPEC_OPTIONS.given(args),
            }
            if args.gpu_classes:
                values["gpu_classes"] = list(dict.fromkeys(args.gpu_classes))
            if args.store:
                values["store"] = args.store
            if getattr(args, "verify_on", None):
                values["verify_on"] = list(dict.fromkeys(args.verify_on))
            try:
                spec = OptimizationJobSpec.model_validate(values)
            except ValidationError as error:
                raise UsageError(f"bad option: {spec_errors(error)}") from None
            name = args.name or derived_name("OptimizationJob", spec)
            documents = [manifest("OptimizationJob", name, spec, cluster.namespace)]
        for document in documents:
            spec_data = document.get("spec") or {}
            if document["kind"] == "OptimizationJob":
                model = OptimizationJobSpec.model_validate(spec_data)
                _check_classes(
                    cluster, [*model.gpu_classes, *getattr(model, "verify_on", [])], "spec.gpuClasses"
                )
            else:
                run = TrainingRunSpec.model_validate(spec_data)
                _check_classes(
                    cluster, [c for c in (run.gpu_class, run.reward_gpu_class) if c], "spec.gpuClass"
                )
        created = []
        for document in documents:
            name, new = _create(cluster, document)
            namespace = document["metadata"]["namespace"]
            created.append((document["kind"], name, namespace))
            print(name)
            kind_word = document["kind"].lower()
            _say(
                f"{'submitted' if new else 'already submitted (same spec)'}: {kind_word} {namespace}/{name}; "
                f"follow it with `kernelfleet status {name} -n {namespace}`"
            )
        if not args.wait:
            return 0
        status_ok = True
        for kind, name, namespace in created:
            resource = follow(functools.partial(_read, cluster, kind, name, namespace), _say)
            status_ok = status_ok and succeeded(resource)
            if kind == "OptimizationJob" and (resource.get("status") or {}).get("results"):
                from kernelfleet.core.cli import main as kernelfleet

                kernelfleet(["results", f"optimizationjob/{name}", "-n", namespace])
    return 0 if status_ok else 1


def _read(cluster: Any, kind: str, name: str, namespace: str) -> dict[str, Any]:
    resource = get_resource(cluster, kind, name, namespace)
    if resource is None:
        raise UsageError(f"{kind} {namespace}/{name} was deleted while being followed")
    return resource
