"""Which store and prefix `results` and `report` read: a local run, a store prefix, or the run
of a cluster resource (found through the run locators of `kernelfleet.core.run_location`)."""

from __future__ import annotations

import argparse

from kernelfleet.core import run_location
from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import Store, open_store
from kernelfleet.search._report import resolve_run


def open_run(args: argparse.Namespace) -> tuple[Store, str]:
    """The store and the run prefix that `args.run` names.

    `optimizationjob/NAME` (and kubectl's other names for the kinds) asks the cluster only. A
    bare name is tried as a local run id or store prefix first, then, when it could be a
    resource name, as an OptimizationJob; when neither knows it the local error is the one shown.
    """
    reference: str = args.run
    config = run_location.store_config(args)
    namespace = getattr(args, "namespace", None)
    resource = run_location.resource_reference(reference)
    if resource is None:
        store = open_store(args.store, config)
        try:
            return store, resolve_run(store, reference)
        except UsageError as not_local:
            name = reference.strip()
            if not run_location.is_resource_name(name):
                raise
            try:
                location = run_location.locate_run(name, namespace)
            except UsageError:
                raise not_local from None
            if location is None:
                raise
    else:
        kind, name = resource
        location = run_location.locate_run(name, namespace, kind)
        if location is None and not run_location.run_locators():
            raise UsageError(
                f"{reference}: reading runs of cluster resources needs the kernelfleet-operator package "
                "(it provides the cluster client); install it, or give a run id or store prefix"
            )
        if location is None:
            where = (
                f"namespace {namespace}" if namespace else "the kubeconfig's namespace (-n NS for another)"
            )
            raise UsageError(f"no {kind} {name!r} in {where}; `kernelfleet status -A` lists them")
    return open_store(location.store_url, config), location.prefix
