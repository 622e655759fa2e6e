"""Kueue's controller beside a control plane: its CRDs, its admission webhooks, the process.

Built from its Go module like every other server (`build-binaries.sh kueue`), which also copies
the module's CRDs and webhook registrations next to the binary. Here there is no kubelet and no
cluster DNS, so three things differ from an in-cluster install, each as Kueue's own docs and
controller-runtime's envtest do it:

- Certificates: the built-in rotator is off (it waits for a kubelet to mount a Secret and issues
  certificates for a Service name only). The webhook server serves the control plane's own
  serving certificate (valid for 127.0.0.1), and the webhooks are registered by URL with the
  control plane's CA as their caBundle.
- Kueue v0.19 reads its metrics certificate from the fixed path /etc/kueue/metrics/certs whenever
  the rotator is off. The process runs in a mount namespace of its own in which an overlay on /etc
  adds that one directory; the machine's /etc is never written.
- Only the webhooks of the enabled frameworks and of Kueue's own kinds are registered (a pod or
  Deployment webhook with failurePolicy Fail would stop every pod of the cluster while Kueue is
  down), and never for kube-system.
"""

from __future__ import annotations

import copy
import os
import shutil
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kernelfleet.operator.devcluster._pki import Pki
from kernelfleet.operator.devcluster._process import (
    BUILD_HINT,
    BinaryMissing,
    ServerProcess,
    bin_dir,
    binary,
    free_port,
    wait_for,
)

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_NAMESPACE = "kueue-system"
# batch/v1 Jobs (the OptimizationJob's children) and JobSets (TrainingRun's). Kueue starts a
# framework's controller once its CRD is served, so listing JobSet costs nothing without it.
DEFAULT_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset")
_METRICS_CERTS = Path("kueue/metrics/certs")  # under /etc, where cmd/kueue/main.go reads it


def manifests_dir() -> Path:
    path = bin_dir() / "kueue-manifests"
    if not (path / "webhooks.yaml").is_file():
        raise BinaryMissing(
            f"Kueue's manifests not found in {path}: build the `kueue` component; {BUILD_HINT}"
        )
    return path


def kueue_configuration(
    health_port: int, webhook_port: int, cert_dir: Path, frameworks: Iterable[str]
) -> str:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a local process: loopback
    listeners, no leader election, no metrics listener, no certificate rotator."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": list(frameworks)},
    }
    return yaml.safe_dump(config, sort_keys=False)


def framework_groups(frameworks: Iterable[str]) -> set[str]:
    """The API groups of Kueue's kinds and of the enabled frameworks (`batch/job` -> batch)."""
    return {KUEUE_GROUP} | {name.split("/", 1)[0] for name in frameworks if "/" in name}


def local_webhooks(
    documents: Sequence[dict[str, Any]], webhook_port: int, ca_bundle: str, groups: set[str]
) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, pointed at the local process by URL, with only the
    webhooks whose every API group is in `groups`, and none for kube-system."""
    result = []
    for document in documents:
        if not document or document.get("kind") not in (
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ):
            continue
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": "kueue-" + document["metadata"]["name"]}
        kept = []
        for webhook in configuration.get("webhooks", []):
            webhook_groups = {g for rule in webhook.get("rules", []) for g in rule.get("apiGroups", [])}
            if not webhook_groups or not webhook_groups <= groups:
                continue
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{webhook_port}{path}",
                "caBundle": ca_bundle,
            }
            webhook["namespaceSelector"] = {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "NotIn",
                        "values": ["kube-system", KUEUE_NAMESPACE],
                    }
                ]
            }
            kept.append(webhook)
        configuration["webhooks"] = kept
        result.append(configuration)
    return result


class Kueue:
    """Kueue's controller against the API server of `kubeconfig`, run as a local process."""

    def __init__(
        self,
        workdir: Path,
        kubeconfig: Path,
        pki: Pki,
        frameworks: Sequence[str] = DEFAULT_FRAMEWORKS,
    ) -> None:
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.pki = pki
        self.frameworks = tuple(frameworks)
        self.health_port, self.webhook_port = free_port(), free_port()
        program = binary("kueue")
        self.manifests = manifests_dir()
        workdir.mkdir(parents=True, exist_ok=True)
        cert_dir = workdir / "certs"
        self._write_certs(cert_dir)
        self._write_certs(workdir / "etc-overlay" / "upper" / _METRICS_CERTS)
        config = workdir / "config.yaml"
        config.write_text(kueue_configuration(self.health_port, self.webhook_port, cert_dir, self.frameworks))
        argv = [
            str(program),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            # The on-demand visibility API would serve its own aggregated API with certificates
            # from /visibility; nothing here asks for it.
            "--feature-gates=VisibilityOnDemand=false",
        ]
        self.process = ServerProcess(
            "kueue",
            [*_with_metrics_certs(workdir / "etc-overlay"), *argv],
            workdir,
            ready=self._ready,
            program=str(program),
            ready_timeout=120.0,
        )

    def _write_certs(self, directory: Path) -> None:
        """The control plane's serving certificate (SANs 127.0.0.1 and localhost) as tls.crt/tls.key."""
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.pki.dir / "serving.crt", directory / "tls.crt")
        shutil.copyfile(self.pki.dir / "serving.key", directory / "tls.key")
        (directory / "tls.key").chmod(0o600)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as response:
            return bool(response.status == 200)

    def start(self) -> None:
        """Install the CRDs, start the controller, then register its webhooks."""
        from kubernetes import client, config

        api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        try:
            self._install_crds(api_client)
            core: Any = client.CoreV1Api(api_client)
            _create(core.create_namespace, {"metadata": {"name": KUEUE_NAMESPACE}})
            self.process.start()  # ready once its webhook server listens (Kueue's /readyz)
            self._register_webhooks(api_client)
        except BaseException:
            self.process.stop()
            raise
        finally:
            api_client.close()

    def stop(self) -> None:
        self.process.stop()

    def _install_crds(self, api_client: Any) -> None:
        from kubernetes import client

        extensions: Any = client.ApiextensionsV1Api(api_client)
        names = []
        for path in sorted((self.manifests / "crd").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            names.append(crd["metadata"]["name"])
            _create(extensions.create_custom_resource_definition, crd)

        def established() -> bool:
            for name in names:
                status = extensions.read_custom_resource_definition(name).status
                if not any(c.type == "Established" and c.status == "True" for c in status.conditions or []):
                    return False
            return True

        wait_for("Kueue's CRDs to be established", established, timeout=60.0)

    def _register_webhooks(self, api_client: Any) -> None:
        import base64

        from kubernetes import client

        documents = list(yaml.safe_load_all((self.manifests / "webhooks.yaml").read_text()))
        ca_bundle = base64.b64encode(self.pki.ca_cert.read_bytes()).decode()
        admission: Any = client.AdmissionregistrationV1Api(api_client)
        for configuration in local_webhooks(
            documents, self.webhook_port, ca_bundle, framework_groups(self.frameworks)
        ):
            if configuration["kind"] == "MutatingWebhookConfiguration":
                _create(admission.create_mutating_webhook_configuration, configuration)
            else:
                _create(admission.create_validating_webhook_configuration, configuration)


def _with_metrics_certs(overlay: Path) -> list[str]:
    """The command prefix that runs a program with `overlay/upper` laid over /etc, in a mount
    namespace of its own (a user namespace too, for a user who is not root)."""
    upper, work = overlay / "upper", overlay / "work"
    work.mkdir(parents=True, exist_ok=True)
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc"
    return [
        "unshare",
        *user,
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{mount} && exec "$@"',
        "kueue",
    ]


def _create(create: Callable[..., object], *args: object) -> None:
    """Call a client's create method; an object that already exists (409) is fine."""
    from kubernetes.client.exceptions import ApiException

    try:
        create(*args)
    except ApiException as error:
        if error.status != 409:
            raise


def gpu_queue_manifests(
    gpus_per_class: Mapping[str, int],
    *,
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
    cluster_queue: str = "kernelfleet",
    local_queue: str = "kernelfleet",
    namespaces: Sequence[str] = ("default",),
    cpu: str = "256",
    memory: str = "1Ti",
) -> list[dict[str, Any]]:
    """A ResourceFlavor per GPU class (named after it, on the labels of its nodes: by default
    the pool's GPU product label), one ClusterQueue with a GPU quota per class (and CPU and
    memory, which every worker pod requests too), and a LocalQueue in each namespace: what a
    platform engineer writes to queue kernelfleet's Jobs by class."""
    from kernelfleet.operator.devcluster._kube import GPU_POOLS

    api = f"{KUEUE_GROUP}/v1beta2"
    product = "nvidia.com/gpu.product"
    labels = node_labels or {pool: {product: GPU_POOLS[pool][product]} for pool in gpus_per_class}
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": api,
            "kind": "ResourceFlavor",
            "metadata": {"name": pool},
            "spec": {"nodeLabels": dict(labels[pool])},
        }
        for pool in gpus_per_class
    ]
    flavors = [
        {
            "name": pool,
            "resources": [
                {"name": "cpu", "nominalQuota": cpu},
                {"name": "memory", "nominalQuota": memory},
                {"name": "nvidia.com/gpu", "nominalQuota": gpus},
            ],
        }
        for pool, gpus in gpus_per_class.items()
    ]
    objects.append(
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": cluster_queue},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": flavors}
                ],
            },
        }
    )
    objects += [
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": local_queue, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue},
        }
        for namespace in namespaces
    ]
    return objects


def create_queue_objects(api_client: Any, objects: Iterable[dict[str, Any]]) -> None:
    """Create Kueue objects (from `gpu_queue_manifests`); existing ones are left as they are."""
    from kubernetes import client

    custom: Any = client.CustomObjectsApi(api_client)
    plural = {
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
    }
    for body in objects:
        group, version = body["apiVersion"].split("/")
        namespace = body["metadata"].get("namespace")
        if namespace:
            _create(
                custom.create_namespaced_custom_object, group, version, namespace, plural[body["kind"]], body
            )
        else:
            _create(custom.create_cluster_custom_object, group, version, plural[body["kind"]], body)
