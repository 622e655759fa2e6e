"""The kopf application: one registry that every custom resource's module adds its handlers to,
the runtime those handlers share, and `run()`, which starts kopf embedded in this process.

A module for a kind (optimizationjob.py, trainingrun.py, ...) has a function
`register(registry, settings)` that adds its handlers to the registry (so that intervals can
come from the settings), and its handlers read what they share from `runtime(memo)`:

    def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
        kopf.timer(GROUP, VERSION, "trainingruns", interval=settings.status_interval_s,
                   registry=registry)(reconcile)

    async def reconcile(body, memo, patch, **_):
        rt = runtime(memo)
        await rt.kube.create(jobs_path(namespace), job)

Using a registry of our own (not kopf's global default) keeps the handlers of a test's
operator apart from any other kopf code in the process, and lets `kernelfleet operator` run
kopf embedded (kopf.run) with our settings instead of through `kopf run -m`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import SecretStr

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.store import Store, open_store
from kernelfleet.operator._jobs import LABEL_MANAGED_BY, MANAGED_BY
from kernelfleet.operator._kube import KubeClient
from kernelfleet.operator._metrics import Metrics, serve
from kernelfleet.operator._settings import OperatorSettings
from kernelfleet.operator._status import PatchLimiter

log = logging.getLogger("kernelfleet.operator")

REGISTRY = kopf.OperatorRegistry()
DEFAULT_PEERING = "kernelfleet"
STORE_THREADS = 32


@dataclass
class Runtime:
    """What every handler shares: settings, the API client, the patch limiter, metrics, stores."""

    settings: OperatorSettings
    kube: KubeClient
    limiter: PatchLimiter
    metrics: Metrics
    peering: str = ""
    namespaces: tuple[str, ...] = ()
    store_config: StoreConfig = field(default_factory=StoreConfig.from_env)
    _stores: dict[str, Store] = field(default_factory=dict)
    _stores_lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self, url: str, credentials: tuple[str, str] | None = None) -> Store:
        """The store at `url` (the job's, else the operator's default), opened once and reused,
        with `credentials` (access key, secret key: a namespace's) instead of the operator's own.

        Store calls block; handlers run them with `asyncio.to_thread`.
        """
        chosen = url or self.settings.default_store
        key = f"{chosen}\0{credentials[0] if credentials else ''}"
        with self._stores_lock:
            if key not in self._stores:
                config = self.store_config
                if credentials is not None:
                    config = config.model_copy(
                        update={
                            "access_key": SecretStr(credentials[0]),
                            "secret_key": SecretStr(credentials[1]),
                            "credentials_dir": None,
                        }
                    )
                self._stores[key] = open_store(chosen, config)
            return self._stores[key]


def runtime(memo: Any) -> Runtime:
    """The shared runtime from a handler's `memo` (kopf passes a shallow copy per resource)."""
    found = getattr(memo, "runtime", None)
    if not isinstance(found, Runtime):
        raise RuntimeError("the operator's runtime is missing from kopf's memo: start it with run()")
    return found


async def _login(**kwargs: Any) -> kopf.ConnectionInfo:
    """In a pod, the service account; elsewhere, KUBECONFIG (or ~/.kube/config)."""
    settings = kwargs.get("settings") or kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: run in a pod with a service account, or set KUBECONFIG"
        )
    return info


@kopf.on.login(registry=REGISTRY)
async def login(**kwargs: Any) -> kopf.ConnectionInfo:
    return await _login(**kwargs)


@kopf.on.startup(registry=REGISTRY)
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    rt = runtime(memo)
    # Only this operator's own records (warnings and errors, and the Events of transitions it
    # posts itself) become Events: handler chatter stays in the log.
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "kernelfleet.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kernelfleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kernelfleet.io", key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    select_on_the_server(settings)
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    if rt.peering:
        settings.peering.name = rt.peering
        await _ensure_peering(rt)
    rt.metrics.describe("reconciles_total", "Reconcile passes, by kind.")
    rt.metrics.describe("errors_total", "Reconcile errors, by kind and reason.")
    rt.metrics.describe("status_patches_total", "Status patches sent, by kind.")
    rt.metrics.describe("api_requests_total", "Requests of the operator's own API client, by verb.")
    rt.metrics.describe("jobs", "Custom resources by kind and phase.")

    def collect(metrics: Metrics) -> None:
        metrics.replace_gauge(
            "api_requests_total", (({"verb": verb}, float(n)) for verb, n in rt.kube.requests.items())
        )

    rt.metrics.collectors.append(collect)


def select_on_the_server(settings: kopf.OperatorSettings) -> None:
    """Watch only the operator's own Jobs: the API server filters by label, so a cluster's other
    Jobs are never sent to (or decoded by) the operator."""
    settings.watching.label_selectors["batch", "v1", "jobs"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"


async def _ensure_peering(rt: Runtime) -> None:
    """The peering object kopf records keep-alives in: a second operator that sees this one
    alive pauses. Without kopf's peering CRDs (crds/kopf-*.yaml) kopf runs alone, with a warning."""
    from kernelfleet.operator._kube import ApiError

    if rt.namespaces:
        kind = "KopfPeering"
        paths = [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings" for ns in rt.namespaces]
    else:
        kind = "ClusterKopfPeering"
        paths = ["/apis/kopf.dev/v1/clusterkopfpeerings"]
    for path in paths:
        try:
            await rt.kube.create(
                path, {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": rt.peering}}
            )
        except ApiError as error:
            if error.status == 404:
                log.warning(
                    "kopf's peering CRDs are not installed (kubectl apply -f crds/): a second operator "
                    "would not see this one"
                )
                return
            if not error.conflict:
                raise


@dataclass(frozen=True)
class RunOptions:
    """How `kernelfleet operator` runs kopf."""

    namespaces: Sequence[str] = ()
    all_namespaces: bool = False
    standalone: bool = False
    peering_name: str | None = None
    priority: int = 0
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9090


_registered: set[str] = set()


def register_kinds(settings: OperatorSettings) -> None:
    """Add each kind's handlers to REGISTRY once: every kind's module has a
    `register(registry, settings)` function (optimizationjob.py, trainingrun.py, ...)."""
    import importlib

    for name in KINDS:
        if name in _registered:
            continue
        try:
            module = importlib.import_module(f"kernelfleet.operator.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"kernelfleet.operator.{name}":
                raise
            continue
        module.register(REGISTRY, settings)
        _registered.add(name)


# The modules of the kinds the operator reconciles; one that is not installed is skipped.
KINDS = ("optimizationjob", "trainingrun")


def run(settings: OperatorSettings, options: RunOptions, stop_flag: threading.Event | None = None) -> None:
    """Run the operator in this thread until it is stopped (SIGINT/SIGTERM, or `stop_flag`)."""
    register_kinds(settings)

    async def login_for_client() -> kopf.ConnectionInfo:
        return await _login()

    rt = Runtime(
        settings=settings,
        kube=KubeClient(login_for_client),
        limiter=PatchLimiter(settings.min_patch_interval_s),
        metrics=Metrics(),
        peering="" if options.standalone else (options.peering_name or DEFAULT_PEERING),
        namespaces=() if options.all_namespaces else tuple(options.namespaces),
    )

    async def main() -> None:
        # Store calls (MinIO/S3) run in threads and mostly wait on the network: many at once,
        # or a hundred jobs' passes queue behind a handful of threads.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="store")
        )
        runner = None
        if options.metrics_port is not None:
            runner = await serve(rt.metrics, options.metrics_host, options.metrics_port)
        try:
            await kopf.operator(
                registry=REGISTRY,
                clusterwide=options.all_namespaces,
                namespaces=list(options.namespaces),
                standalone=options.standalone or None,
                # A name given on the command line makes peering mandatory (kopf pauses without
                # its CRDs); the default name is used when the CRDs are there.
                peering_name=options.peering_name,
                priority=options.priority,
                liveness_endpoint=options.liveness,
                stop_flag=stop_flag,
                memo=kopf.Memo(runtime=rt),
            )
        finally:
            # After kopf has stopped every handler, so no timer opens the session again.
            await rt.kube.close()
            if runner is not None:
                await runner.cleanup()

    log.info(
        "kernelfleet operator: %s, pools %s (%s), default store %s",
        "all namespaces" if options.all_namespaces else "namespaces " + ", ".join(options.namespaces),
        ", ".join(settings.pools),
        settings.pools.source,
        settings.default_store or "(none: each job must name spec.store)",
    )
    asyncio.run(main())
