"""How Kueue is set up beside the test and dev control planes, without servers: its
configuration, which of its webhooks are registered and where they point, and the queues."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kernelfleet.operator.devcluster._kueue import (
    DEFAULT_FRAMEWORKS,
    framework_groups,
    gpu_queue_manifests,
    kueue_configuration,
    local_webhooks,
)


def _webhook(name: str, group: str, path: str) -> Any:
    return {
        "name": name,
        "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
        "failurePolicy": "Fail",
        "rules": [
            {"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["x"]}
        ],
    }


def test_only_the_webhooks_of_kueues_kinds_and_the_enabled_frameworks_are_registered_by_url() -> None:
    documents: list[dict[str, Any]] = [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "mutating-webhook-configuration"},
            "webhooks": [
                _webhook("mjob.kb.io", "batch", "/mutate-batch-v1-job"),
                _webhook("mpod.kb.io", "", "/mutate--v1-pod"),
                _webhook("mdeployment.kb.io", "apps", "/mutate-apps-v1-deployment"),
                _webhook("mworkload.kb.io", "kueue.x-k8s.io", "/mutate-kueue-x-k8s-io-v1beta2-workload"),
            ],
        }
    ]
    [configuration] = local_webhooks(documents, 19443, "Q0E=", framework_groups(DEFAULT_FRAMEWORKS))
    assert configuration["metadata"]["name"] == "kueue-mutating-webhook-configuration"
    assert [w["name"] for w in configuration["webhooks"]] == ["mjob.kb.io", "mworkload.kb.io"]
    job = configuration["webhooks"][0]
    assert job["clientConfig"] == {"url": "https://127.0.0.1:19443/mutate-batch-v1-job", "caBundle": "Q0E="}
    excluded = job["namespaceSelector"]["matchExpressions"][0]
    assert excluded["operator"] == "NotIn" and "kube-system" in excluded["values"]
    assert documents[0]["webhooks"][0]["clientConfig"]["service"]  # the input is not changed


def test_configuration_listens_on_loopback_without_leader_election_or_rotator() -> None:
    config = yaml.safe_load(kueue_configuration(18081, 19443, Path("/c"), ["batch/job"]))
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert config["webhook"] == {"host": "127.0.0.1", "port": 19443, "certDir": "/c"}
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:18081"
    assert config["leaderElection"]["leaderElect"] is False
    assert config["internalCertManagement"]["enable"] is False
    assert config["integrations"]["frameworks"] == ["batch/job"]


def test_gpu_queues_give_each_class_its_own_flavor_and_quota() -> None:
    objects = gpu_queue_manifests({"h100": 2, "l40": 1}, namespaces=("team-a",))
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert kinds == [
        ("ResourceFlavor", "h100"),
        ("ResourceFlavor", "l40"),
        ("ClusterQueue", "kernelfleet"),
        ("LocalQueue", "kernelfleet"),
    ]
    assert objects[0]["spec"]["nodeLabels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    [group] = objects[2]["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
    gpus = {
        f["name"]: next(r for r in f["resources"] if r["name"] == "nvidia.com/gpu") for f in group["flavors"]
    }
    assert gpus["h100"]["nominalQuota"] == 2 and gpus["l40"]["nominalQuota"] == 1
    assert objects[3]["metadata"]["namespace"] == "team-a"
