"""Reaching the cluster from a user's machine, with errors that say what to do.

Every cluster command goes through `connect()` and `api_errors()`: a missing kubeconfig, an API
server that does not answer, credentials it rejects, a role that forbids the request and CRDs
that are not installed each become one `UsageError` naming the fix, never a traceback of the
Kubernetes client.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import GROUP, VERSION

PLURALS = {"OptimizationJob": "optimizationjobs", "TrainingRun": "trainingruns"}
CRDS_HINT = (
    "the kernelfleet CRDs are not installed in this cluster: install them with "
    "`kubectl apply --server-side -f crds/` from a kernelfleet checkout (or `helm install` the chart, "
    "which installs them too)"
)
DEV_CLUSTER_HINT = "for the dev cluster on this machine: eval $(kernelfleet dev-cluster env)"
# A request that waits longer than this on an unreachable API server is reported, not waited out.
REQUEST_TIMEOUT_S = 15.0


def kubeconfig_path(explicit: str | None = None) -> Path | None:
    """The kubeconfig kubectl would use: the flag, else the first file in $KUBECONFIG, else
    ~/.kube/config; None when there is none (then only in-cluster credentials are left)."""
    if explicit:
        return Path(explicit)
    for candidate in (os.environ.get("KUBECONFIG") or "").split(os.pathsep):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    default = Path.home() / ".kube" / "config"
    return default if default.is_file() else None


def kubeconfig_paths() -> list[Path]:
    """Every kubeconfig file kubectl (and kopf) would merge: those in $KUBECONFIG that exist,
    else ~/.kube/config when it does."""
    found = [
        Path(c) for c in (os.environ.get("KUBECONFIG") or "").split(os.pathsep) if c and Path(c).is_file()
    ]
    default = Path.home() / ".kube" / "config"
    return found or ([default] if default.is_file() else [])


def check_kubeconfig(*paths: Path) -> None:
    """Refuse, with the one-line `cannot use the kubeconfig PATH: ...`, files that together are
    not a kubeconfig, before a Kubernetes client reads them: the clients fail on one with a
    TypeError, an AttributeError or a KeyError from deep inside (kopf's login retries it every
    minute). Several files merge as kubectl merges them: the first current-context wins."""
    import yaml

    def refuse(path: Path, reason: str) -> UsageError:
        return UsageError(f"cannot use the kubeconfig {path}: {reason}; fix it or pick another context")

    names: dict[str, dict[str, dict[str, Any]]] = {"clusters": {}, "contexts": {}, "users": {}}
    current: tuple[Path, str] | None = None
    for path in paths:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise refuse(path, f"it cannot be read ({error.strerror or error})") from None
        except UnicodeDecodeError:
            raise refuse(path, "it is not text") from None
        except yaml.YAMLError as error:
            raise refuse(path, f"it is not YAML ({str(error).splitlines()[0]})") from None
        if data is None:
            raise refuse(path, "it is empty")
        if not isinstance(data, dict):
            raise refuse(
                path,
                f"it holds a YAML {type(data).__name__}, not a kubeconfig (a mapping with clusters, "
                "contexts and users; `kubectl config view` shows one)",
            )
        for section, inner in (("clusters", "cluster"), ("contexts", "context"), ("users", "user")):
            entries = data.get(section) or []
            if not isinstance(entries, list) or not all(
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get(inner) or {}, dict)
                for entry in entries
            ):
                raise refuse(
                    path, f"its {section!r} is not a list of entries with a name and a {inner!r} mapping"
                )
            for entry in entries:
                names[section].setdefault(entry["name"], entry.get(inner) or {})
        chosen = data.get("current-context")
        if chosen is not None and not isinstance(chosen, str):
            raise refuse(path, "its 'current-context' is not a name")
        if chosen and current is None:
            current = (path, chosen)
    if current is None:
        return
    path, chosen = current
    context = names["contexts"].get(chosen)
    if context is None:
        raise refuse(path, f"its current-context {chosen!r} is not one of its contexts")
    for section, field in (("clusters", "cluster"), ("users", "user")):
        wanted = context.get(field)
        if wanted is not None and wanted not in names[section]:
            raise refuse(
                path, f"context {chosen!r} names {field} {wanted!r}, which no {section} entry defines"
            )


@dataclass
class Cluster:
    """An API client for the cluster and the namespace commands act in by default."""

    api_client: Any
    namespace: str
    server: str

    @property
    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def close(self) -> None:
        self.api_client.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def crds_installed(self) -> bool:
        """Whether the API server serves kernelfleet.io/v1alpha1 (discovery is open to every user)."""
        from kubernetes import client

        groups = client.ApisApi(self.api_client).get_api_versions(_request_timeout=REQUEST_TIMEOUT_S).groups
        return any(
            group.name == GROUP and any(v.version == VERSION for v in group.versions or [])
            for group in groups or []
        )

    def require_crds(self) -> None:
        with api_errors(self):
            if not self.crds_installed():
                raise UsageError(CRDS_HINT)


def connect(namespace: str | None = None, kubeconfig: str | None = None) -> Cluster:
    """A client for the cluster of the current kubeconfig context (or in-cluster credentials)."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    path = kubeconfig_path(kubeconfig)
    context_namespace = "default"
    try:
        if path is not None:
            if not path.is_file():
                raise UsageError(f"kubeconfig {path} does not exist; check --kubeconfig or $KUBECONFIG")
            check_kubeconfig(path)
            api_client = config.new_client_from_config(config_file=str(path))
            _, active = config.list_kube_config_contexts(config_file=str(path))
            context_namespace = (active or {}).get("context", {}).get("namespace") or "default"
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            api_client = client.ApiClient()
            with contextlib.suppress(OSError):
                context_namespace = (
                    Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
                )
        else:
            raise UsageError(
                "no kubeconfig: set KUBECONFIG or create ~/.kube/config for your cluster "
                f"(`kubectl config view` shows what kubectl uses); {DEV_CLUSTER_HINT}"
            )
    except (ConfigException, TypeError, KeyError, AttributeError, ValueError) as error:
        # What `check_kubeconfig` cannot see (a context naming a missing cluster, a bad field
        # inside an entry): the client's own words, on one line.
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(
            f"cannot use the kubeconfig {path}: {reason}; fix it or pick another context"
        ) from None
    server = str(api_client.configuration.host)
    return Cluster(api_client=api_client, namespace=namespace or context_namespace, server=server)


@contextlib.contextmanager
def api_errors(cluster: Cluster, doing: str = "") -> Iterator[None]:
    """Turn the Kubernetes client's failures into UsageErrors that say what to do."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    what = f" while {doing}" if doing else ""
    try:
        yield
    except ApiException as error:
        if error.status == 401:
            raise UsageError(
                f"the API server {cluster.server} rejected the credentials{what}: they expired or are for "
                "another cluster; refresh them (e.g. your cloud's `get-credentials`) or pick another context"
            ) from None
        if error.status == 403:
            raise UsageError(
                f"forbidden{what}: {_reason(error)}. Ask a cluster admin for the kernelfleet edit role in "
                f"namespace {cluster.namespace} (the chart aggregates it into `admin`/`edit`)"
            ) from None
        if error.status == 404 and _missing_kind(error):
            raise UsageError(CRDS_HINT) from None
        raise
    except (urllib3.exceptions.HTTPError, OSError) as error:
        raise UsageError(
            f"cannot reach the API server {cluster.server}{what} ({type(error).__name__}): is the cluster "
            "running and the kubeconfig's context the right one? `kubectl cluster-info` checks; "
            f"{DEV_CLUSTER_HINT}"
        ) from None


def _reason(error: Any) -> str:
    import json

    try:
        return str(json.loads(error.body).get("message") or error.reason)
    except (TypeError, ValueError, AttributeError):
        return str(error.reason)


def _missing_kind(error: Any) -> bool:
    """A 404 for the resource type itself (no CRD), not for one object of it."""
    import json

    try:
        details = json.loads(error.body).get("details") or {}
    except (TypeError, ValueError, AttributeError):
        return True
    return not details.get("name")
