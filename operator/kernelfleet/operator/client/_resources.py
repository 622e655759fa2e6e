"""Reading OptimizationJobs and TrainingRuns, and where their results are in the store."""

from __future__ import annotations

from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.core.run_location import RunLocation, split_results_url
from kernelfleet.operator.client._connect import PLURALS, Cluster, api_errors, connect

KINDS = tuple(PLURALS)


def get_resource(
    cluster: Cluster, kind: str, name: str, namespace: str | None = None
) -> dict[str, Any] | None:
    """The resource as the API server holds it, or None when there is no such one."""
    from kubernetes.client.exceptions import ApiException

    namespace = namespace or cluster.namespace
    with api_errors(cluster, f"reading {kind} {namespace}/{name}"):
        try:
            found: dict[str, Any] = cluster.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURALS[kind], name
            )
        except ApiException as error:
            if error.status == 404 and cluster.crds_installed():
                return None
            raise
    return found


def find_resource(cluster: Cluster, name: str, kind: str | None = None) -> dict[str, Any]:
    """The OptimizationJob or TrainingRun called `name` in the cluster's namespace; an error that
    lists what is there when there is none."""
    for candidate in (kind,) if kind else KINDS:
        found = get_resource(cluster, candidate, name)
        if found is not None:
            return found
    names = sorted(r["metadata"]["name"] for r in list_resources(cluster, all_namespaces=False))
    there = f"; there are: {', '.join(names)}" if names else "; it has none"
    what = kind or "OptimizationJob or TrainingRun"
    raise UsageError(
        f"no {what} {name!r} in namespace {cluster.namespace}{there} (-n NS for another namespace, "
        "`kernelfleet status -A` for all)"
    )


def list_resources(cluster: Cluster, all_namespaces: bool) -> list[dict[str, Any]]:
    """Every OptimizationJob and TrainingRun of the namespace (or of all), oldest first."""
    found: list[dict[str, Any]] = []
    with api_errors(cluster, "listing jobs"):
        for plural in PLURALS.values():
            if all_namespaces:
                answer = cluster.custom.list_cluster_custom_object(GROUP, VERSION, plural)
            else:
                answer = cluster.custom.list_namespaced_custom_object(
                    GROUP, VERSION, cluster.namespace, plural
                )
            found.extend(answer.get("items", []))
    return sorted(found, key=lambda r: (r["metadata"].get("creationTimestamp", ""), r["metadata"]["name"]))


def run_location_of(resource: dict[str, Any]) -> RunLocation:
    """Where the results of `resource` are in the store (from its status)."""
    kind, meta = resource["kind"], resource["metadata"]
    status = resource.get("status") or {}
    url = status.get("results") if kind == "OptimizationJob" else status.get("report")
    where = f"{kind} {meta['namespace']}/{meta['name']}"
    if not url:
        phase = status.get("phase") or "not picked up by the operator yet"
        raise UsageError(
            f"{where} has no results yet ({phase}): the operator writes their location into the status "
            f"once the job is accepted; `kernelfleet status {meta['name']}` says where it stands"
        )
    location = split_results_url(url, PLURALS[kind])
    if location is None:
        raise UsageError(
            f"{where}: its results URL {url!r} has no '{PLURALS[kind]}/' part; read it with --store"
        )
    return RunLocation(store_url=location.store_url, prefix=location.prefix, description=where)


def locate_run(name: str, namespace: str | None, kind: str) -> RunLocation | None:
    """The run locator for `kernelfleet results NAME` (entry point `kernelfleet.run_locators`)."""
    with connect(namespace) as cluster:
        cluster.require_crds()
        resource = get_resource(cluster, kind, name)
        return None if resource is None else run_location_of(resource)
