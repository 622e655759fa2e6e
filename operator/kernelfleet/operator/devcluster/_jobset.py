"""The JobSet controller (sigs.k8s.io/jobset) as a local process: a TrainingRun stage is a JobSet.

The binary, its CRD and its webhook registrations come from its Go module (the build script
copies the manifests next to the binary). What a real install does with cert-manager and a
Service, this does the way controller-runtime's envtest does:

- the controller serves its webhooks on 127.0.0.1 with the control plane's serving certificate
  (its built-in certificate rotator, which wants a Secret mounted by a kubelet, is off);
- the webhook registrations point at that address by URL with the control plane's CA, named
  `jobset-...` so that no other controller's default names collide with them, the pod webhooks
  only for pods of a JobSet and nothing in kube-system.
"""

from __future__ import annotations

import base64
import copy
import shutil
import urllib.request
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

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


def manifests_dir() -> Path:
    path = bin_dir() / "jobset-manifests"
    if not (path / "manifests.yaml").is_file():
        raise BinaryMissing(f"JobSet's manifests not found in {path}: {BUILD_HINT}")
    return path


def install_crds(api_client: Any) -> None:
    """Create JobSet's CRDs (once per control plane) and wait until they are served."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    extensions: Any = client.ApiextensionsV1Api(api_client)
    for path in sorted(manifests_dir().glob("*_jobsets.yaml")):
        document = yaml.safe_load(path.read_text())
        try:
            extensions.create_custom_resource_definition(document)
        except ApiException as error:
            if error.status != 409:
                raise
        name = document["metadata"]["name"]

        def established(crd: str = name) -> bool:
            found = extensions.read_custom_resource_definition(crd)
            return any(c.type == "Established" and c.status == "True" for c in found.status.conditions or [])

        wait_for(f"CRD {name} established", established, timeout=30.0)


def webhook_configurations(port: int, ca_bundle: bytes) -> list[dict[str, Any]]:
    """JobSet's webhook registrations, reaching the controller at 127.0.0.1:`port` by URL."""
    documents = [d for d in yaml.safe_load_all((manifests_dir() / "manifests.yaml").read_text()) if d]
    configured = []
    for document in documents:
        document = copy.deepcopy(document)
        document["metadata"] = {"name": f"jobset-{document['metadata']['name']}"}
        for webhook in document["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            webhook["namespaceSelector"] = {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
                ]
            }
            if any("pods" in rule.get("resources", []) for rule in webhook.get("rules", [])):
                webhook["objectSelector"] = {
                    "matchExpressions": [{"key": JOBSET_LABEL, "operator": "Exists"}]
                }
        configured.append(document)
    return configured


def register_webhooks(api_client: Any, configurations: list[dict[str, Any]]) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    admission: Any = client.AdmissionregistrationV1Api(api_client)
    for document in configurations:
        mutating = document["kind"] == "MutatingWebhookConfiguration"
        create = (
            admission.create_mutating_webhook_configuration
            if mutating
            else admission.create_validating_webhook_configuration
        )
        try:
            create(document)
        except ApiException as error:
            if error.status != 409:
                raise


class JobSetController:
    """`jobset` against the control plane whose kubeconfig and PKI are given."""

    def __init__(self, workdir: Path, kubeconfig: Path, pki: Pki) -> None:
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.pki = pki
        self.webhook_port, self.health_port = free_port(), free_port()
        certs = workdir / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pki.dir / "serving.crt", certs / "tls.crt")
        shutil.copyfile(pki.dir / "serving.key", certs / "tls.key")
        (certs / "tls.key").chmod(0o600)
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(certs)},
            "internalCertManagement": {"enable": False},
        }
        config_path = workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.process = ServerProcess(
            "jobset",
            [str(binary("jobset")), f"--config={config_path}", f"--kubeconfig={kubeconfig}"],
            workdir,
            ready=self._ready,
            ready_timeout=120.0,
        )

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as response:
            return bool(response.status == 200)

    def start(self) -> None:
        """CRDs first (the controller watches JobSets), then the controller, then its webhooks
        (registered only once they answer, so that no JobSet is refused meanwhile)."""
        from kubernetes import config

        api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        try:
            install_crds(api_client)
            self.process.start()
            register_webhooks(
                api_client, webhook_configurations(self.webhook_port, self.pki.ca_cert.read_bytes())
            )
        finally:
            api_client.close()
