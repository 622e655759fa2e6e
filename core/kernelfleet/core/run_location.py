"""Finding a run by the name a user knows: a local run id, a store prefix, or a cluster resource.

`kernelfleet results NAME` and `kernelfleet report NAME` read a run from the store. On a laptop
NAME is the run id `optimize` printed; on a cluster the user knows the OptimizationJob's name,
and the resource's status holds the URL of its results. Core talks to no cluster (it imports
neither kopf nor the Kubernetes client), so a distribution that can registers a *run locator*
in the `kernelfleet.run_locators` entry-point group: a function
`locate(name, namespace, kind) -> RunLocation | None` that returns None when it knows no such
resource and raises `UsageError` when it cannot look (no kubeconfig, CRDs missing). The
operator distribution registers one; without it, resource names are simply not understood.

The reference forms are kubectl's: `optimizationjob/NAME` (or `kfopt/NAME`, `trainingrun/NAME`,
`kftrain/NAME`) always means the cluster; a bare NAME is tried as a local run first.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from kernelfleet.core.config import StoreConfig

ENTRY_POINT_GROUP = "kernelfleet.run_locators"
# kubectl's names for the two kinds (singular, plural, short name), as the CRDs declare them.
RESOURCE_KINDS: dict[str, str] = {
    "optimizationjob": "OptimizationJob",
    "optimizationjobs": "OptimizationJob",
    "kfopt": "OptimizationJob",
    "trainingrun": "TrainingRun",
    "trainingruns": "TrainingRun",
    "kftrain": "TrainingRun",
}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def is_resource_name(text: str) -> bool:
    """Whether `text` can name a Kubernetes resource (lowercase DNS subdomain)."""
    return len(text) <= 253 and _NAME.match(text) is not None


@dataclass(frozen=True)
class RunLocation:
    """Where a run is: the store's root URL (variants are shared at its top) and the run's prefix."""

    store_url: str
    prefix: str
    description: str = ""


def resource_reference(text: str) -> tuple[str, str] | None:
    """`('OptimizationJob', 'name')` for `optimizationjob/name` and its aliases, else None.

    A store prefix such as `optimizationjobs/ns/name/uid` has more than one slash and is not a
    reference; neither is a bare name.
    """
    kind, slash, name = text.strip().partition("/")
    if not slash or "/" in name or kind.lower() not in RESOURCE_KINDS or not _NAME.match(name):
        return None
    return RESOURCE_KINDS[kind.lower()], name


def split_results_url(url: str, marker: str) -> RunLocation | None:
    """Split a results URL such as `s3://bucket/pre/optimizationjobs/ns/name/uid` into the store's
    root (`s3://bucket/pre`) and the run's prefix (`optimizationjobs/ns/name/uid`), at the path
    segment `marker`. None when the URL has no such segment."""
    scheme, sep, rest = url.rstrip("/").partition("://")
    if not sep:
        scheme, rest = "", url.rstrip("/")
    parts = rest.split("/")
    # For s3:// the first part is the bucket: the root keeps at least that much.
    first = 1 if scheme == "s3" else 0
    for index in range(first, len(parts)):
        if parts[index] == marker:
            root = "/".join(parts[:index]) or "/"
            return RunLocation(
                store_url=f"{scheme}{sep}{root}" if sep else root, prefix="/".join(parts[index:])
            )
    return None


def run_locators() -> list[Any]:
    return [entry.load() for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)]


def locate_run(name: str, namespace: str | None = None, kind: str = "OptimizationJob") -> RunLocation | None:
    """Ask every installed locator for the resource `name` of `kind`; the first answer wins.

    None when no locator is installed or none knows the name. A locator's UsageError (it could
    not look) propagates: the caller decides whether the user asked for the cluster.
    """
    for locate in run_locators():
        location = locate(name, namespace, kind)
        if location is not None:
            return location
    return None


def add_location_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for a run that lives on a cluster: its namespace, and how this machine reaches its
    store (whose endpoint inside the cluster may not be reachable from outside)."""
    cluster = parser.add_argument_group("runs of cluster resources")
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


def store_config(args: argparse.Namespace) -> StoreConfig:
    """The store configuration of the environment, with the flags of `add_location_flags` applied."""
    overrides: dict[str, object] = {}
    if getattr(args, "s3_endpoint", None):
        overrides["endpoint"] = args.s3_endpoint
    if getattr(args, "s3_credentials_dir", None):
        overrides["credentials_dir"] = Path(args.s3_credentials_dir)
        overrides["access_key"] = overrides["secret_key"] = None
    return StoreConfig.from_env(None, **overrides)
