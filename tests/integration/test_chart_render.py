"""The Helm chart renders what the operator and the cluster need, and refuses bad values.

`helm template` is client-only, but it needs the helm binary built by `make binaries`, so this
module is in the integration tier (it lives beside the other chart tests in tests/unit).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests._servers._process import binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kernelfleet"
RELEASE, NAMESPACE = "kf", "kf-system"
FULLNAME = "kf-kernelfleet"

GFD_PRODUCTS = {
    "a100": [
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-A100-SXM4-40GB",
        "NVIDIA-A100-80GB-PCIe",
        "NVIDIA-A100-PCIE-40GB",
    ],
    "h100": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"],
    "l40": ["NVIDIA-L40", "NVIDIA-L40S"],
    "rtx3090": ["NVIDIA-GeForce-RTX-3090"],
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's caches and configuration in a temporary directory, never in the user's home."""
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


def render(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    result = _helm(env, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(env: dict[str, str], *args: str) -> str:
    result = _helm(env, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode != 0, f"helm accepted {args}"
    return result.stderr


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in {sorted((d['kind'], d['metadata']['name']) for d in docs)}")


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(docs, "Deployment", f"{FULLNAME}-operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def pools(docs: list[dict[str, Any]]) -> dict[str, Any]:
    configmap = find(docs, "ConfigMap", f"{FULLNAME}-pools")
    return dict(yaml.safe_load(configmap["data"]["pools.yaml"]))


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# ---------------------------------------------------------------- the default install


def test_chart_lints_strictly_with_and_without_the_optional_servers(helm_env: dict[str, str]) -> None:
    for extra in ([], ["--set", "minio.enabled=true", "--set", "vllm.enabled=true"]):
        result = _helm(helm_env, "lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, result.stdout + result.stderr


def test_default_render_is_the_operator_its_rbac_and_the_network_policies_only(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ClusterRole", FULLNAME),
        ("ClusterRole", f"{FULLNAME}-edit"),
        ("ClusterRole", f"{FULLNAME}-view"),
        ("ClusterRoleBinding", FULLNAME),
        ("ConfigMap", f"{FULLNAME}-pools"),
        ("Deployment", f"{FULLNAME}-operator"),
        ("NetworkPolicy", f"{FULLNAME}-eval-service"),
        ("NetworkPolicy", f"{FULLNAME}-sandbox"),
        ("NetworkPolicy", f"{FULLNAME}-training-peers"),
        ("ServiceAccount", FULLNAME),
    ]
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kernelfleet", doc["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "kernelfleet-0.1.0"
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_crds_ship_with_the_chart(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "--include-crds")
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert names == {
        "optimizationjobs.kernelfleet.io",
        "trainingruns.kernelfleet.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }


def test_default_render_holds_no_secret_and_no_credential(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    assert not [d for d in docs if d["kind"] == "Secret"]
    env = env_of(operator_container(docs))
    assert not {name for name in env if "ACCESS_KEY" in name or "SECRET_KEY" in name or "PASSWORD" in name}
    # No store is configured by default, so nothing to mount either.
    assert "KERNELFLEET_S3_CREDENTIALS_DIR" not in env and "KERNELFLEET_STORE_SECRET" not in env


# ---------------------------------------------------------------- GPU pools


def test_pools_configmap_maps_each_class_to_gfd_products_and_the_gpu_toleration(
    helm_env: dict[str, str],
) -> None:
    config = pools(render(helm_env))
    assert config["version"] == 1
    assert set(config["classes"]) == set(GFD_PRODUCTS)
    for name, products in GFD_PRODUCTS.items():
        assert config["classes"][name] == {
            "nodeLabel": "nvidia.com/gpu.product",
            "products": products,
            "nodeSelector": {},
            "tolerations": [GPU_TOLERATION],
            "gpuResource": "nvidia.com/gpu",
            "requests": {"cpu": "2", "memory": "8Gi"},
        }, name


def test_users_add_replace_and_remove_pool_classes(helm_env: dict[str, str]) -> None:
    b200 = {
        "nodeSelector": {"kernelfleet.io/gpu-class": "b200"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "b200", "effect": "NoSchedule"}],
    }
    docs = render(
        helm_env,
        "--set-json",
        f"pools.classes.b200={json.dumps(b200)}",
        "--set",
        "pools.classes.rtx3090=null",
        "--set-json",
        'pools.classes.h100.products=["NVIDIA-H100-NVL"]',
        "--set",
        "pools.classes.a100.gpuResource=nvidia.com/mig-3g.40gb",
        "--set",
        "pools.classes.l40.requests.memory=32Gi",
    )
    classes = pools(docs)["classes"]
    assert set(classes) == {"a100", "b200", "h100", "l40"}
    assert classes["b200"]["nodeSelector"] == b200["nodeSelector"]
    assert classes["b200"]["tolerations"] == b200["tolerations"]  # replaces the default, not added to it
    assert classes["b200"]["products"] == []
    assert classes["h100"]["products"] == ["NVIDIA-H100-NVL"]
    assert classes["a100"]["gpuResource"] == "nvidia.com/mig-3g.40gb"
    assert classes["l40"]["tolerations"] == [GPU_TOLERATION]
    assert classes["l40"]["requests"] == {"cpu": "2", "memory": "32Gi"}  # the other stays the default
    assert classes["h100"]["requests"] == {"cpu": "2", "memory": "8Gi"}


def test_a_changed_pool_restarts_the_operator(helm_env: dict[str, str]) -> None:
    def checksum(*args: str) -> str:
        deployment = find(render(helm_env, *args), "Deployment", f"{FULLNAME}-operator")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/pools"])

    assert checksum() == checksum()
    assert checksum() != checksum("--set-json", 'pools.classes.l40.products=["NVIDIA-L40S"]')


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set-json", "pools.classes.b200={}"], "pools.classes.b200 selects no nodes"),
        (["--set", "pools.classes.h100.products=null"], "pools.classes.h100 selects no nodes"),
        (
            ["--set-json", 'pools.classes={"a100":null,"h100":null,"l40":null,"rtx3090":null}'],
            "pools.classes is empty",
        ),
    ],
)
def test_a_pool_class_that_selects_no_nodes_is_refused(
    helm_env: dict[str, str], args: list[str], message: str
) -> None:
    assert message in render_error(helm_env, *args)


# ---------------------------------------------------------------- the operator


def test_operator_is_one_kopf_process_that_never_overlaps_itself(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    deployment = find(docs, "Deployment", f"{FULLNAME}-operator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = operator_container(docs)
    assert container["command"] == [
        "kernelfleet",
        "operator",
        "--pools=/etc/kernelfleet/pools.yaml",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-port=9090",
        "--all-namespaces",
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    env = env_of(container)
    assert env["KERNELFLEET_POOLS_FILE"] == f"{mounts['pools']}/pools.yaml"
    assert env["KERNELFLEET_POOLS_CONFIGMAP"] == f"{FULLNAME}-pools"


def test_operator_command_and_arguments_are_values(helm_env: dict[str, str]) -> None:
    container = operator_container(
        render(
            helm_env,
            "--set-json",
            'operator.command=["kopf","run","--standalone","--namespace=team-a","-m","my.handlers"]',
            "--set-json",
            'operator.extraArgs=["--verbose"]',
        )
    )
    assert container["command"] == [
        "kopf",
        "run",
        "--standalone",
        "--namespace=team-a",
        "-m",
        "my.handlers",
        "--all-namespaces",
        "--verbose",
    ]


def test_images_reach_the_operator_with_the_app_version_as_default_tag(helm_env: dict[str, str]) -> None:
    env = env_of(operator_container(render(helm_env)))
    assert env["KERNELFLEET_WORKER_IMAGE"] == "ghcr.io/kernelfleet/worker:0.1.0"
    assert env["KERNELFLEET_TRAINER_IMAGE"] == "ghcr.io/kernelfleet/trainer:0.1.0"
    assert env["KERNELFLEET_WORKER_IMAGE_PULL_POLICY"] == "IfNotPresent"
    docs = render(
        helm_env,
        "--set",
        "images.worker.repository=registry.local/kf/worker",
        "--set",
        "images.worker.tag=dev-1",
        "--set",
        "images.trainer.pullPolicy=Always",
        "--set",
        "images.operator.tag=abc",
        "--set-json",
        'imagePullSecrets=["regcred","other"]',
    )
    container = operator_container(docs)
    env = env_of(container)
    assert container["image"] == "ghcr.io/kernelfleet/operator:abc"
    assert env["KERNELFLEET_WORKER_IMAGE"] == "registry.local/kf/worker:dev-1"
    assert env["KERNELFLEET_TRAINER_IMAGE_PULL_POLICY"] == "Always"
    assert env["KERNELFLEET_IMAGE_PULL_SECRETS"] == "regcred,other"
    pod = find(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]


def test_store_settings_reach_the_operator_and_credentials_stay_in_the_secret(
    helm_env: dict[str, str],
) -> None:
    docs = render(
        helm_env,
        "--set",
        "store.url=s3://results/kernelfleet",
        "--set",
        "store.endpoint=s3.example.com:443",
        "--set",
        "store.region=eu-west-1",
        "--set",
        "store.existingSecret=s3-credentials",
        # An outside store must be named to the network policy (it cannot name a host).
        "--set",
        "networkPolicy.store.to[0].ipBlock.cidr=198.51.100.0/24",
    )
    assert not [d for d in docs if d["kind"] == "Secret"]
    container = operator_container(docs)
    env = env_of(container)
    assert env["KERNELFLEET_STORE"] == "s3://results/kernelfleet"
    assert env["KERNELFLEET_S3_ENDPOINT"] == "s3.example.com:443"
    assert env["KERNELFLEET_S3_SECURE"] == "true"
    assert env["KERNELFLEET_S3_REGION"] == "eu-west-1"
    assert env["KERNELFLEET_STORE_SECRET"] == "s3-credentials"
    assert "KERNELFLEET_S3_CREATE_BUCKET" not in env
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert env["KERNELFLEET_S3_CREDENTIALS_DIR"] == mounts["store-credentials"]["mountPath"]
    assert mounts["store-credentials"]["readOnly"] is True
    volumes = find(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]["volumes"]
    secret = next(v for v in volumes if v["name"] == "store-credentials")["secret"]
    assert secret["secretName"] == "s3-credentials"
    assert {item["key"] for item in secret["items"]} == {"accesskey", "secretkey"}


def test_an_endpoint_with_a_scheme_decides_tls_alone(helm_env: dict[str, str]) -> None:
    env = env_of(operator_container(render(helm_env, "--set", "store.endpoint=http://minio.storage:9000")))
    assert env["KERNELFLEET_S3_ENDPOINT"] == "http://minio.storage:9000"
    assert "KERNELFLEET_S3_SECURE" not in env


# ---------------------------------------------------------------- RBAC


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                rules.setdefault((group, resource), set()).update(rule["verbs"])
    return rules


def _triples(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(verb, group, resource) for (group, resource), verbs in _rules(role).items() for verb in verbs}


def test_operator_rbac_is_exactly_what_the_code_uses(helm_env: dict[str, str]) -> None:
    """Least privilege: the ClusterRole grants the verbs the operator's code calls (read from
    the code by tests/support/rbac.py) and kopf's handlers need, and nothing else."""
    from tests.support.rbac import code_permissions, kopf_permissions

    calls, unresolved = code_permissions()
    assert unresolved == [], "API calls whose path the test cannot follow"
    # Creating Jobs owned (blockOwnerDeletion) by a resource needs update on its finalizers
    # where the OwnerReferencesPermissionEnforcement admission plugin is on.
    owners = {
        ("update", "kernelfleet.io", f"{plural}/finalizers")
        for plural in ("optimizationjobs", "trainingruns")
    }
    docs = render(helm_env)
    role = find(docs, "ClusterRole", FULLNAME)
    assert "*" not in list(walk(role["rules"]))
    granted = _triples(role)
    needed = calls | kopf_permissions() | owners
    assert needed - granted == set(), "the code needs these and the chart does not grant them"
    assert granted - needed == set(), "the chart grants these and nothing uses them"
    binding = find(docs, "ClusterRoleBinding", FULLNAME)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": FULLNAME,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_watch_namespaces_gives_a_role_per_namespace_and_only_cluster_reads_cluster_wide(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env, "--set-json", 'watchNamespaces=["team-a","team-b"]')
    command = operator_container(docs)["command"]
    assert "--all-namespaces" not in command
    assert command[-2:] == ["--namespace=team-a", "--namespace=team-b"]
    cluster_wide = _rules(find(docs, "ClusterRole", FULLNAME))
    assert cluster_wide == {
        ("", "nodes"): {"list"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    }
    everywhere = _rules(find(render(helm_env), "ClusterRole", FULLNAME))
    for namespace in ("team-a", "team-b"):
        (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == namespace]
        rules = _rules(role)
        assert rules[("batch", "jobs")] == everywhere[("batch", "jobs")]
        assert rules[("kopf.dev", "kopfpeerings")] == everywhere[("kopf.dev", "kopfpeerings")]
        assert ("", "namespaces") not in rules and ("", "nodes") not in rules
        (binding,) = [
            d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == namespace
        ]
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_users_get_job_rights_through_the_default_roles(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    edit, view = find(docs, "ClusterRole", f"{FULLNAME}-edit"), find(docs, "ClusterRole", f"{FULLNAME}-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "create" in _rules(edit)[("kernelfleet.io", "optimizationjobs")]
    assert _rules(view)[("kernelfleet.io", "trainingruns/status")] == {"get", "list", "watch"}
    off = render(helm_env, "--set", "rbac.aggregateToDefaultRoles=false", "--set", "rbac.create=false")
    assert not [d for d in off if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_extra_rules_extend_the_operator_role(helm_env: dict[str, str]) -> None:
    extra = [{"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["create"]}]
    role = find(
        render(helm_env, "--set-json", f"rbac.extraRules={json.dumps(extra)}"), "ClusterRole", FULLNAME
    )
    assert _rules(role)[("", "persistentvolumeclaims")] == {"create"}


# ---------------------------------------------------------------- values.schema.json


@pytest.mark.parametrize(
    ("args", "where", "why"),
    [
        (["--set", "operator.replicas=-1"], "/operator/replicas", "minimum"),
        (["--set", "operator.replicas=2"], "/operator/replicas", "maximum"),
        (["--set", "pools.classes.h100.gpus=8"], "/pools/classes/h100", "'gpus' not allowed"),
        # helm reports a wrong location for propertyNames, so match the name only.
        (
            ["--set", "pools.classes.H100.products={x}"],
            "invalid propertyName 'H100'",
            "does not match pattern",
        ),
        (["--set", "images.worker.pullPolicy=Sometimes"], "/images/worker/pullPolicy", "IfNotPresent"),
        (["--set", "store.url=https://bucket.example.com"], "/store/url", "pattern"),
        (["--set", "store.endpoint=minio:9000/bucket"], "/store/endpoint", "pattern"),
        (["--set", "vllm.gpus=0"], "/vllm/gpus", "minimum"),
        (["--set", "minio.enabeld=true"], "/minio", "'enabeld' not allowed"),
    ],
)
def test_schema_rejects_a_bad_value_with_helms_message(
    helm_env: dict[str, str], args: list[str], where: str, why: str
) -> None:
    error = render_error(helm_env, *args)
    assert "values don't meet the specifications of the schema" in error
    assert where in error and why in error, error


def test_a_missing_service_account_name_is_explained(helm_env: dict[str, str]) -> None:
    error = render_error(helm_env, "--set", "operator.serviceAccount.create=false")
    assert "operator.serviceAccount.name must name an existing ServiceAccount" in error
    docs = render(
        helm_env, "--set", "operator.serviceAccount.create=false", "--set", "operator.serviceAccount.name=ops"
    )
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    assert find(docs, "ClusterRoleBinding", FULLNAME)["subjects"][0]["name"] == "ops"


# ---------------------------------------------------------------- optional MinIO


def test_bundled_minio_is_off_by_default_and_complete_when_on(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "--set", "minio.enabled=true")
    name = f"{FULLNAME}-minio"
    secret = find(docs, "Secret", name)
    access = base64.b64decode(secret["data"]["accesskey"]).decode()
    secret_key = base64.b64decode(secret["data"]["secretkey"]).decode()
    assert len(access) >= 8 and len(secret_key) >= 32  # MinIO wants at least 8 for the password
    assert find(docs, "PersistentVolumeClaim", name)["spec"]["resources"]["requests"]["storage"] == "20Gi"
    service = find(docs, "Service", name)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["s3"] == 9000
    deployment = find(docs, "Deployment", name)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs["MINIO_ROOT_USER"] == {"name": name, "key": "accesskey"}
    assert refs["MINIO_ROOT_PASSWORD"] == {"name": name, "key": "secretkey"}
    env = env_of(operator_container(docs))
    assert env["KERNELFLEET_STORE"] == "s3://kernelfleet"
    assert env["KERNELFLEET_S3_ENDPOINT"] == f"{name}.{NAMESPACE}.svc:9000"
    assert env["KERNELFLEET_S3_SECURE"] == "false"
    assert env["KERNELFLEET_S3_CREATE_BUCKET"] == "true"
    assert env["KERNELFLEET_STORE_SECRET"] == name
    # The credentials are in the Secret only, plain or encoded.
    for doc in docs:
        if doc is not secret:
            text = json.dumps(doc)
            for value in (access, secret_key, secret["data"]["accesskey"], secret["data"]["secretkey"]):
                assert value not in text, (doc["kind"], doc["metadata"]["name"])


def test_bundled_minio_without_persistence_or_with_the_users_secret(helm_env: dict[str, str]) -> None:
    docs = render(
        helm_env,
        "--set",
        "minio.enabled=true",
        "--set",
        "minio.persistence.enabled=false",
        "--set",
        "store.existingSecret=my-minio",
        "--set",
        "minio.bucket=results",
    )
    assert not [d for d in docs if d["kind"] in ("Secret", "PersistentVolumeClaim")]
    pod = find(docs, "Deployment", f"{FULLNAME}-minio")["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "data") == {"name": "data", "emptyDir": {}}
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0]["env"] if "valueFrom" in e}
    assert refs == {"my-minio"}
    env = env_of(operator_container(docs))
    assert env["KERNELFLEET_STORE"] == "s3://results"
    assert env["KERNELFLEET_STORE_SECRET"] == "my-minio"


# ---------------------------------------------------------------- optional vLLM


def test_vllm_server_runs_on_its_pool_class_with_gpu_limits(helm_env: dict[str, str]) -> None:
    assert not [d for d in render(helm_env) if "vllm" in d["metadata"]["name"]]
    docs = render(
        helm_env,
        "--set",
        "vllm.enabled=true",
        "--set",
        "vllm.gpus=2",
        "--set",
        "vllm.gpuClass=l40",
        "--set",
        "vllm.model=org/coder",
        "--set",
        "vllm.apiKeySecret=vllm-key",
        "--set-json",
        'vllm.extraArgs=["--max-model-len","16384"]',
    )
    name = f"{FULLNAME}-vllm"
    pod = find(docs, "Deployment", name)["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": GFD_PRODUCTS["l40"]}
            ]
        }
    ]
    assert pod["tolerations"] == [GPU_TOLERATION]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/kernelfleet/trainer:0.1.0"
    assert container["command"] == ["vllm", "serve"]
    assert container["args"][0] == "org/coder"
    assert "--tensor-parallel-size=2" in container["args"]
    assert container["args"][-2:] == ["--max-model-len", "16384"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["memory"] == "32Gi"
    key = next(e for e in container["env"] if e["name"] == "VLLM_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "vllm-key", "key": "apiKey"}
    service = find(docs, "Service", name)
    assert service["spec"]["ports"][0]["port"] == 8000
    env = env_of(operator_container(docs))
    assert env["KERNELFLEET_VLLM_BASE_URL"] == f"http://{name}.{NAMESPACE}.svc:8000/v1"
    assert env["KERNELFLEET_VLLM_MODEL"] == "org/coder"
    assert env["KERNELFLEET_VLLM_API_KEY_SECRET"] == "vllm-key"


def test_vllm_on_a_class_selected_by_labels_and_its_own_image(helm_env: dict[str, str]) -> None:
    b200 = {"nodeSelector": {"kernelfleet.io/gpu-class": "b200"}, "gpuResource": "example.com/gpu"}
    docs = render(
        helm_env,
        "--set",
        "vllm.enabled=true",
        "--set",
        "vllm.gpuClass=b200",
        "--set-json",
        f"pools.classes.b200={json.dumps(b200)}",
        "--set",
        "vllm.image.repository=vllm/vllm-openai",
        "--set",
        "vllm.image.tag=v0.11.0",
    )
    pod = find(docs, "Deployment", f"{FULLNAME}-vllm")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == b200["nodeSelector"]
    assert "affinity" not in pod
    assert pod["containers"][0]["image"] == "vllm/vllm-openai:v0.11.0"
    assert pod["containers"][0]["resources"]["limits"]["example.com/gpu"] == 1


def test_vllm_on_an_unknown_class_names_the_known_ones(helm_env: dict[str, str]) -> None:
    error = render_error(helm_env, "--set", "vllm.enabled=true", "--set", "vllm.gpuClass=b200")
    assert "pools.classes.b200 is not a pool class" in error
    assert "a100, h100, l40, rtx3090" in error


def test_vllm_with_a_foreign_image_needs_its_tag(helm_env: dict[str, str]) -> None:
    error = render_error(
        helm_env, "--set", "vllm.enabled=true", "--set", "vllm.image.repository=vllm/vllm-openai"
    )
    assert "set vllm.image.tag too" in error
