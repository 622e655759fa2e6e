"""The chart installs on a real control plane: `helm install` creates the CRDs, the operator's
Deployment, RBAC and pool ConfigMap; the API server enforces the RBAC and accepts the example
resources unchanged; the scheduler places a GPU pod with nothing but the pool configuration; and
the optional MinIO and vLLM servers install, and MinIO keeps its generated credentials across
upgrades.

There is no kubelet and no deployment controller here, so the tests never wait for pods of the
Deployments: they check what the API server holds."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kernelfleet.core.resources import GROUP, VERSION
from tests._servers._process import binary, wait_for
from tests._servers.kube import GPU_POOLS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kernelfleet"
CRDS = ("optimizationjobs.kernelfleet.io", "trainingruns.kernelfleet.io")


class Helm:
    """helm against the test cluster, in the test's namespace, with its state in a temporary directory."""

    def __init__(self, kube: Any, home: Path) -> None:
        self.kube = kube
        self.release = kube.namespace  # unique per test, so cluster-scoped names never collide
        self.fullname = f"{self.release}-kernelfleet"
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def __call__(self, *args: str) -> str:
        result = subprocess.run(
            [
                str(binary("helm")),
                *args,
                "--kubeconfig",
                str(self.kube.kubeconfig),
                "--namespace",
                self.kube.namespace,
            ],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=180,
            check=False,
        )
        assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def install(self, *values: str) -> str:
        return self("install", self.release, str(CHART), *values)


@pytest.fixture
def helm(cluster: Any, tmp_path: Path) -> Iterator[Helm]:
    installed = Helm(cluster, tmp_path / "helm")
    yield installed
    # Leave no cluster-scoped objects behind for the next test, whatever happened in this one.
    subprocess.run(
        [
            str(binary("helm")),
            "uninstall",
            installed.release,
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--namespace",
            cluster.namespace,
            "--ignore-not-found",
        ],
        capture_output=True,
        env=installed.env,
        timeout=120,
        check=False,
    )


def _established(kube: Any, name: str) -> bool:
    crd = kube.apiextensions.read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])


def _missing(wanted: Any, stored: Any, path: str = "spec") -> list[str]:
    """The paths in `wanted` that `stored` lacks or holds with another value."""
    if isinstance(wanted, dict):
        if not isinstance(stored, dict):
            return [path]
        return [m for key, value in wanted.items() for m in _missing(value, stored.get(key), f"{path}.{key}")]
    if isinstance(wanted, list):
        if not isinstance(stored, list) or len(stored) != len(wanted):
            return [path]
        return [
            m
            for i, (w, s) in enumerate(zip(wanted, stored, strict=True))
            for m in _missing(w, s, f"{path}[{i}]")
        ]
    return [] if wanted == stored else [f"{path}: {wanted!r} became {stored!r}"]


def _pools(kube: Any, helm: Helm) -> dict[str, Any]:
    configmap = kube.core.read_namespaced_config_map(f"{helm.fullname}-pools", kube.namespace)
    return dict(yaml.safe_load(configmap.data["pools.yaml"]))


def _can(
    kube: Any,
    service_account: str,
    verb: str,
    group: str,
    resource: str,
    namespace: str | None = None,
    subresource: str | None = None,
) -> bool:
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{kube.namespace}:{service_account}",
            groups=[
                "system:serviceaccounts",
                f"system:serviceaccounts:{kube.namespace}",
                "system:authenticated",
            ],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, group=group, resource=resource, subresource=subresource, namespace=namespace
            ),
        )
    )
    authorization: Any = client.AuthorizationV1Api(kube.api_client)
    return bool(authorization.create_subject_access_review(review).status.allowed)


def test_install_creates_crds_operator_rbac_and_pools_then_uninstall_keeps_the_crds(
    cluster: Any, helm: Helm
) -> None:
    notes = helm.install()
    assert "GPU classes" in notes and "no store is configured" in notes
    for name in CRDS:
        wait_for(f"CRD {name} to be established", partial(_established, cluster, name), timeout=60.0)

    apps: Any = client.AppsV1Api(cluster.api_client)
    deployment = apps.read_namespaced_deployment(f"{helm.fullname}-operator", cluster.namespace)
    assert deployment.spec.replicas == 1 and deployment.spec.strategy.type == "Recreate"
    (container,) = deployment.spec.template.spec.containers
    assert container.command[:2] == ["kernelfleet", "operator"] and "--all-namespaces" in container.command
    assert deployment.spec.template.spec.service_account_name == helm.fullname
    cluster.core.read_namespaced_service_account(helm.fullname, cluster.namespace)

    # The pools select exactly the fake GPU nodes of each class (labelled as GPU Feature Discovery does).
    classes = _pools(cluster, helm)["classes"]
    for pool, labels in GPU_POOLS.items():
        assert labels["nvidia.com/gpu.product"] in classes[pool]["products"], pool

    # The API server grants what the operator needs, everywhere, and nothing more.
    sa, elsewhere = helm.fullname, "another-namespace"
    for verb, group, resource, namespace, sub in [
        ("watch", GROUP, "optimizationjobs", None, None),
        ("patch", GROUP, "trainingruns", elsewhere, None),
        ("delete", GROUP, "trainingruns", elsewhere, None),  # a finished run past its TTL
        ("patch", GROUP, "optimizationjobs", elsewhere, "status"),
        ("create", "batch", "jobs", elsewhere, None),
        ("delete", "batch", "jobs", elsewhere, None),
        ("list", "", "pods", None, None),
        ("create", "", "events", elsewhere, None),
        ("get", "", "secrets", elsewhere, None),
        ("create", "", "secrets", elsewhere, None),
        ("create", "jobset.x-k8s.io", "jobsets", elsewhere, None),
        ("patch", "jobset.x-k8s.io", "jobsets", elsewhere, None),
        ("delete", "jobset.x-k8s.io", "jobsets", elsewhere, None),
        ("watch", "apiextensions.k8s.io", "customresourcedefinitions", None, None),
        ("list", "", "namespaces", None, None),
    ]:
        assert _can(cluster, sa, verb, group, resource, namespace, sub), (verb, group, resource, sub)
    for verb, group, resource, namespace in [
        ("list", "", "secrets", None),
        ("watch", "", "secrets", elsewhere),
        ("create", "", "pods", elsewhere),
        ("delete", "", "pods", elsewhere),
        ("create", GROUP, "optimizationjobs", elsewhere),
        ("create", GROUP, "trainingruns", elsewhere),
        ("create", "apps", "deployments", elsewhere),
        ("create", "", "services", elsewhere),
        ("update", "jobset.x-k8s.io", "jobsets", elsewhere),
        ("create", "apps", "statefulsets", elsewhere),
        ("create", "apiextensions.k8s.io", "customresourcedefinitions", None),
    ]:
        assert not _can(cluster, sa, verb, group, resource, namespace), (verb, group, resource)

    helm("uninstall", helm.release)
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    with pytest.raises(ApiException) as gone:
        rbac.read_cluster_role(helm.fullname)
    assert gone.value.status == 404
    for name in CRDS:  # Helm never deletes CRDs, so the users' jobs survive an uninstall
        assert _established(cluster, name)


@pytest.mark.parametrize(
    ("example", "plural"),
    [("optimizationjob.yaml", "optimizationjobs"), ("trainingrun.yaml", "trainingruns")],
)
def test_api_server_accepts_the_example_unchanged(
    cluster: Any, helm: Helm, example: str, plural: str
) -> None:
    helm.install()
    for name in CRDS:
        wait_for(f"CRD {name} to be established", partial(_established, cluster, name), timeout=60.0)
    document = yaml.safe_load((ROOT / "examples" / example).read_text())
    assert document["apiVersion"] == f"{GROUP}/{VERSION}"
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace, plural, document)
    stored = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, cluster.namespace, plural, document["metadata"]["name"]
    )
    # A structural schema prunes unknown fields silently, and fills in defaults: everything the
    # example says must still be there, with the same value.
    assert _missing(document["spec"], stored["spec"]) == []


def test_pool_configuration_alone_places_a_gpu_pod_on_its_class(cluster: Any, helm: Helm) -> None:
    helm.install()
    classes = _pools(cluster, helm)["classes"]
    for gpu_class in ("l40", "a100"):
        pool = classes[gpu_class]
        pod_spec = {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "worker",
                    "image": "kernelfleet/worker:test",
                    "command": ["kernelfleet"],
                    "resources": {"limits": {pool["gpuResource"]: "1"}},
                }
            ],
            "tolerations": pool["tolerations"],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": pool["nodeLabel"], "operator": "In", "values": pool["products"]}
                                ]
                            }
                        ]
                    }
                }
            },
        }
        if pool["nodeSelector"]:
            pod_spec["nodeSelector"] = pool["nodeSelector"]
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"on-{gpu_class}"},
            "spec": {"backoffLimit": 0, "template": {"spec": pod_spec}},
        }
        cluster.batch.create_namespaced_job(cluster.namespace, job)

    for gpu_class in ("l40", "a100"):

        def bound(gpu_class: str = gpu_class) -> Any:
            pods = cluster.core.list_namespaced_pod(
                cluster.namespace, label_selector=f"job-name=on-{gpu_class}"
            ).items
            return pods[0] if pods and pods[0].spec.node_name else None

        try:
            pod = wait_for(f"the {gpu_class} pod to be bound", bound, timeout=90.0)
        except AssertionError as error:
            pods = cluster.core.list_namespaced_pod(
                cluster.namespace, label_selector=f"job-name=on-{gpu_class}"
            )
            states = [
                (p.status.phase, [(c.type, c.status, c.message) for c in p.status.conditions or []])
                for p in pods.items
            ]
            raise AssertionError(f"{error}; its pods: {states}") from None
        node = cluster.core.read_node(pod.spec.node_name)
        assert node.metadata.labels["nvidia.com/gpu.product"] in classes[gpu_class]["products"], (
            pod.spec.node_name
        )


def test_optional_servers_install_and_minio_keeps_its_credentials_across_upgrades(
    cluster: Any, helm: Helm
) -> None:
    values = ("--set", "minio.enabled=true", "--set", "vllm.enabled=true", "--set", "vllm.gpus=2")
    helm.install(*values)
    name = f"{helm.fullname}-minio"
    first = cluster.core.read_namespaced_secret(name, cluster.namespace).data
    assert set(first) == {"accesskey", "secretkey"}
    helm("upgrade", helm.release, str(CHART), *values, "--set", "operator.replicas=0")
    assert cluster.core.read_namespaced_secret(name, cluster.namespace).data == first

    apps: Any = client.AppsV1Api(cluster.api_client)
    operator = apps.read_namespaced_deployment(f"{helm.fullname}-operator", cluster.namespace)
    assert operator.spec.replicas == 0
    env = {e.name: e.value for e in operator.spec.template.spec.containers[0].env}
    assert env["KERNELFLEET_S3_ENDPOINT"] == f"{name}.{cluster.namespace}.svc:9000"
    assert env["KERNELFLEET_STORE_SECRET"] == name
    assert env["KERNELFLEET_VLLM_BASE_URL"] == f"http://{helm.fullname}-vllm.{cluster.namespace}.svc:8000/v1"
    cluster.core.read_namespaced_service(name, cluster.namespace)
    cluster.core.read_namespaced_persistent_volume_claim(name, cluster.namespace)
    assert apps.read_namespaced_deployment(name, cluster.namespace).spec.strategy.type == "Recreate"

    vllm = apps.read_namespaced_deployment(f"{helm.fullname}-vllm", cluster.namespace)
    (container,) = vllm.spec.template.spec.containers
    assert container.resources.limits["nvidia.com/gpu"] == "2"
    cluster.core.read_namespaced_service(f"{helm.fullname}-vllm", cluster.namespace)
