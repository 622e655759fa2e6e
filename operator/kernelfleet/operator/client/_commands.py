"""Handlers of `kernelfleet status` and `kernelfleet logs` (their parsers are in cli_cluster)."""

from __future__ import annotations

import argparse
import sys

from kernelfleet.core.errors import UsageError
from kernelfleet.core.run_location import store_config
from kernelfleet.core.store import open_store
from kernelfleet.operator.client import _logs
from kernelfleet.operator.client._connect import api_errors, connect
from kernelfleet.operator.client._resources import find_resource, list_resources, run_location_of
from kernelfleet.operator.client._status import events_of, format_detail, format_list


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
        rows = sorted({(f.task or f.stem, f.gpu_class, f.role) for f in chosen})
        for task, gpu, role in rows:
            print(f"{task}  {gpu}  {role}")
        print(f"\nthe lines of one: kernelfleet logs {args.name} --task TASK", file=sys.stderr)
        return 0
    for number, log in enumerate(chosen):
        if len(chosen) > 1:
            print(("\n" if number else "") + f"==> {log.label} <==")
        text = _logs.read_log(store, log)
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
