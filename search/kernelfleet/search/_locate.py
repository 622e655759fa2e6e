"""Which store and prefix `results` and `report` read: a local run, a store prefix, or the run
of a cluster resource (found through the run locators of `kernelfleet.core.run_location`)."""

from __future__ import annotations

import argparse

from kernelfleet.core import run_location
from kernelfleet.core.config import StoreConfig
from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import Store, open_store
from kernelfleet.search._report import resolve_run


def add_location_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for a run that lives on a cluster: its namespace, and how this machine reaches its store."""
    cluster = parser.add_argument_group("runs of cluster resources (optimizationjob/NAME, or NAME)")
    cluster.add_argument(
        "-n", "--namespace", default=None, help="the resource's namespace (default: the kubeconfig's)"
    )
    cluster.add_argument(
        "--s3-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="reach the store here instead of $KERNELFLEET_S3_ENDPOINT (e.g. through a port-forward)",
    )
    cluster.add_argument(
        "--s3-credentials-dir",
        default=None,
        metavar="DIR",
        help="files accesskey and secretkey (as in the store Secret) instead of $KERNELFLEET_S3_* keys",
    )


def _config(args: argparse.Namespace) -> StoreConfig:
    overrides: dict[str, object] = {}
    if getattr(args, "s3_endpoint", None):
        overrides["endpoint"] = args.s3_endpoint
    if getattr(args, "s3_credentials_dir", None):
        from pathlib import Path

        overrides["credentials_dir"] = Path(args.s3_credentials_dir)
        overrides["access_key"] = overrides["secret_key"] = None
    return StoreConfig.from_env(None, **overrides)


def open_run(args: argparse.Namespace) -> tuple[Store, str]:
    """The store and the run prefix that `args.run` names.

    `optimizationjob/NAME` (and kubectl's other names for the kinds) asks the cluster only. A
    bare name is tried as a local run id or store prefix first, then, when it could be a
    resource name, as an OptimizationJob; when neither knows it the local error is the one shown.
    """
    reference: str = args.run
    config = _config(args)
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
