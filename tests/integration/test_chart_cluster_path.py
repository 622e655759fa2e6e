"""The chart's locks and lenses: the NetworkPolicies around the pods the operator creates, the
optional ServiceMonitor, the evaluation service's class; and every value file in
charts/kernelfleet/ci/ rendered and then validated by a real API server (a server-side dry run:
schemas, defaults and admission, nothing stored)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import dynamic
from kubernetes.client.exceptions import ApiException

from tests._servers._process import binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kernelfleet"
VALUE_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE, FULLNAME = "kf", "kf-system", "kf-kernelfleet"
MANAGED = {"app.kubernetes.io/managed-by": "kernelfleet-operator"}
EVALUATOR = {**MANAGED, "kernelfleet.io/role": "reward-evaluator"}


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("helm")
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def _helm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary("helm")), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def render(env: dict[str, str], *args: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    result = _helm(env, "template", RELEASE, str(CHART), "--namespace", namespace, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == kind}


def _egress_peers(policy: dict[str, Any]) -> list[tuple[tuple[tuple[str, Any], ...], tuple[int, ...]]]:
    """Each egress rule as (its peers, its ports), comparable."""
    rules = []
    for rule in policy["spec"]["egress"]:
        peers = tuple(
            sorted((key, yaml.safe_dump(value)) for peer in rule["to"] for key, value in peer.items())
        )
        rules.append((peers, tuple(sorted(p["port"] for p in rule["ports"]))))
    return rules


# ---------------------------------------------------------------- network policies


def test_operator_pods_get_no_ingress_and_only_dns_store_policy_and_evaluator_egress(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env, "--set", "minio.enabled=true", "--set", "vllm.enabled=true")
    policies = of_kind(docs, "NetworkPolicy")
    sandbox = policies[(NAMESPACE, f"{FULLNAME}-sandbox")]["spec"]
    assert sandbox["podSelector"] == {"matchLabels": MANAGED}
    assert sandbox["policyTypes"] == ["Ingress", "Egress"] and sandbox["ingress"] == []
    dns, store, policy, evaluator = sandbox["egress"]
    assert {p["port"] for p in dns["ports"]} == {53} and {p["protocol"] for p in dns["ports"]} == {
        "UDP",
        "TCP",
    }
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    (minio,) = store["to"]
    assert minio["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "minio"
    assert minio["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert store["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert policy["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
    assert policy["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert evaluator == {
        "to": [{"podSelector": {"matchLabels": EVALUATOR}}],
        "ports": [{"protocol": "TCP", "port": 8470}],
    }
    # The evaluation service answers the operator's other pods of its namespace, and no one else.
    service = policies[(NAMESPACE, f"{FULLNAME}-eval-service")]["spec"]
    assert service["podSelector"] == {"matchLabels": EVALUATOR}
    assert service["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": MANAGED}}], "ports": [{"protocol": "TCP", "port": 8470}]}
    ]
    # A training stage's trainer ranks and its vLLM generator reach each other (rendezvous, NCCL).
    peers = policies[(NAMESPACE, f"{FULLNAME}-training-peers")]["spec"]
    selector = {
        "matchLabels": MANAGED,
        "matchExpressions": [
            {"key": "kernelfleet.io/role", "operator": "In", "values": ["training-stage", "generator"]}
        ],
    }
    assert peers["podSelector"] == selector
    assert peers["ingress"] == [{"from": [{"podSelector": selector}]}]
    assert peers["egress"] == [{"to": [{"podSelector": selector}]}]


def test_policies_go_to_every_job_namespace_with_the_outside_store_and_endpoints_given(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env, "-f", str(CHART / "ci" / "production-values.yaml"))
    policies = of_kind(docs, "NetworkPolicy")
    assert sorted(policies) == [
        ("team-kernels", f"{FULLNAME}-eval-service"),
        ("team-kernels", f"{FULLNAME}-sandbox"),
        ("team-kernels", f"{FULLNAME}-training-peers"),
        ("team-training", f"{FULLNAME}-eval-service"),
        ("team-training", f"{FULLNAME}-sandbox"),
        ("team-training", f"{FULLNAME}-training-peers"),
    ]
    egress = policies[("team-kernels", f"{FULLNAME}-sandbox")]["spec"]["egress"]
    assert egress[1] == {
        "to": [{"ipBlock": {"cidr": "52.95.0.0/16"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }
    assert egress[2]["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert egress[2]["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "model-serving"
    }


def test_an_outside_store_the_policy_cannot_reach_is_refused_with_the_fix(helm_env: dict[str, str]) -> None:
    result = _helm(
        helm_env,
        "template",
        RELEASE,
        str(CHART),
        "--set",
        "store.url=s3://results",
        "--set",
        "store.endpoint=s3.example.com",
    )
    assert result.returncode != 0
    assert "set networkPolicy.store.to" in result.stderr and "networkPolicy.enabled=false" in result.stderr
    # Without a network policy there is nothing to name.
    docs = render(
        helm_env,
        "--set",
        "store.url=s3://results",
        "--set",
        "store.endpoint=s3.example.com",
        "--set",
        "networkPolicy.enabled=false",
    )
    assert not of_kind(docs, "NetworkPolicy")


def test_extra_egress_is_added_to_every_operator_pod(helm_env: dict[str, str]) -> None:
    docs = render(
        helm_env,
        "--set-json",
        'networkPolicy.extraEgress=[{"to":[{"ipBlock":{"cidr":"10.9.0.0/16"}}],"ports":[{"port":5000}]}]',
    )
    egress = of_kind(docs, "NetworkPolicy")[(NAMESPACE, f"{FULLNAME}-sandbox")]["spec"]["egress"]
    assert egress[-1] == {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"port": 5000}]}


# ---------------------------------------------------------------- metrics and the evaluation service


def test_service_monitor_is_off_by_default_and_scrapes_the_operator_when_on(helm_env: dict[str, str]) -> None:
    assert not of_kind(render(helm_env), "ServiceMonitor")
    docs = render(
        helm_env,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.labels.release=prometheus",
        "--set",
        "operator.metricsPort=9191",
    )
    service = of_kind(docs, "Service")[(NAMESPACE, f"{FULLNAME}-metrics")]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9191, "targetPort": "metrics", "protocol": "TCP"}
    ]
    deployment = of_kind(docs, "Deployment")[(NAMESPACE, f"{FULLNAME}-operator")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9191, "protocol": "TCP"} in container["ports"]
    deployment = of_kind(docs, "Deployment")[(NAMESPACE, f"{FULLNAME}-operator")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = of_kind(docs, "ServiceMonitor")[(NAMESPACE, f"{FULLNAME}-metrics")]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


def test_the_evaluation_service_class_reaches_the_operator_and_must_be_a_pool(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env, "--set", "evalService.gpuClass=l40")
    (container,) = of_kind(docs, "Deployment")[(NAMESPACE, f"{FULLNAME}-operator")]["spec"]["template"][
        "spec"
    ]["containers"]
    assert {"name": "KERNELFLEET_EVAL_GPU_CLASS", "value": "l40"} in container["env"]
    result = _helm(helm_env, "template", RELEASE, str(CHART), "--set", "evalService.gpuClass=tpu")
    assert result.returncode != 0
    assert (
        "pools.classes.tpu is not a pool class" in result.stderr
        and "a100, h100, l40, rtx3090" in result.stderr
    )


def test_the_operator_is_one_replica_replaced_not_rolled(helm_env: dict[str, str]) -> None:
    deployment = of_kind(render(helm_env), "Deployment")[(NAMESPACE, f"{FULLNAME}-operator")]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not [d for d in render(helm_env) if d["kind"] == "PodDisruptionBudget"]
    result = _helm(helm_env, "template", RELEASE, str(CHART), "--set", "operator.replicas=2")
    assert result.returncode != 0 and "/operator/replicas" in result.stderr


# ---------------------------------------------------------------- every value file, checked by the API server


@pytest.mark.parametrize("values", VALUE_FILES, ids=lambda path: path.name)
def test_value_file_lints_strictly(helm_env: dict[str, str], values: Path) -> None:
    result = _helm(helm_env, "lint", "--strict", str(CHART), "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def _ensure(api: Any, document: dict[str, Any]) -> None:
    try:
        api.resources.get(api_version=document["apiVersion"], kind=document["kind"]).create(body=document)
    except ApiException as error:
        if error.status != 409:
            raise


@pytest.mark.parametrize("values", VALUE_FILES, ids=lambda path: path.name)
def test_value_file_renders_objects_the_api_server_accepts(
    helm_env: dict[str, str], kube: Any, values: Path
) -> None:
    """`helm template -f FILE`, then a server-side dry run of every object: the API server checks
    each against its real schema and admission, and stores nothing."""
    import time

    api = dynamic.DynamicClient(kube.api_client)
    _ensure(api, SERVICE_MONITOR_CRD)
    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        _ensure(api, yaml.safe_load(crd.read_text()))
    docs = render(helm_env, "-f", str(values), namespace=kube.namespace)
    for namespace in {d["metadata"].get("namespace") for d in docs} - {None, kube.namespace}:
        _ensure(api, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    deadline = time.monotonic() + 30
    for doc in docs:
        resource = None
        while resource is None:
            try:
                resource = api.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            except dynamic.exceptions.ResourceNotFoundError:
                if time.monotonic() > deadline:
                    raise
                api.resources.invalidate_cache()
                time.sleep(0.5)
        namespace = doc["metadata"].get("namespace") if resource.namespaced else None
        try:
            accepted = resource.create(body=doc, namespace=namespace, dry_run="All")
        except ApiException as error:
            pytest.fail(
                f"{values.name}: the API server refused {doc['kind']} {doc['metadata']['name']}: {error.body}"
            )
        assert accepted.metadata.name == doc["metadata"]["name"]
        if doc["kind"] == "NetworkPolicy":  # nothing pruned: the server read every rule
            assert len(accepted.spec.egress or []) == len(doc["spec"].get("egress") or [])
