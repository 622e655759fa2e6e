"""Pools: the built-in default, the chart's pools.yaml, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kernelfleet.core.errors import UsageError
from kernelfleet.operator._pools import GPU_TOLERATION, default_pools, load_pools, parse_pools


def test_default_pools_map_the_four_classes_to_gfd_products_with_the_gpu_toleration() -> None:
    pools = default_pools()
    assert pools.names() == ["a100", "h100", "l40", "rtx3090"]
    h100 = pools["h100"]
    placement = h100.placement()
    term = placement["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
        {
            "key": "nvidia.com/gpu.product",
            "operator": "In",
            "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"],
        }
    ]
    assert placement["tolerations"] == [GPU_TOLERATION]
    assert "nodeSelector" not in placement
    assert h100.matches({"nvidia.com/gpu.product": "NVIDIA-H100-NVL"})
    assert not h100.matches({"nvidia.com/gpu.product": "NVIDIA-L40"})


def test_unknown_class_lists_the_known_ones() -> None:
    with pytest.raises(
        UsageError, match=r"'b200' is not in the pool configuration.*a100, h100, l40, rtx3090"
    ):
        default_pools()["b200"]


def test_chart_format_with_node_selector_and_own_tolerations(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "classes": {
                    "b200": {
                        "nodeLabel": "cloud.google.com/gke-accelerator",
                        "products": ["nvidia-b200"],
                        "nodeSelector": {"pool": "gpu"},
                        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "b200"}],
                        "gpuResource": "nvidia.com/gpu",
                    },
                    "cpuonly": {"nodeSelector": {"kind": "cpu"}, "tolerations": []},
                },
            }
        )
    )
    pools = load_pools(path)
    b200 = pools["b200"]
    assert b200.placement()["nodeSelector"] == {"pool": "gpu"}
    assert b200.placement()["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "b200"}]
    assert b200.matches({"pool": "gpu", "cloud.google.com/gke-accelerator": "nvidia-b200"})
    assert not b200.matches({"cloud.google.com/gke-accelerator": "nvidia-b200"})
    assert "pool=gpu" in b200.describe_labels() and "nvidia-b200" in b200.describe_labels()
    assert "tolerations" not in pools["cpuonly"].placement()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"version": 2, "classes": {}}, "version"),
        ({"classes": {"x": {"products": []}}}, "classes.x selects no nodes"),
        (
            {"classes": {"x": {"products": ["a"], "colour": "red"}}},
            r"classes.x has unknown keys \['colour'\]",
        ),
        (
            {"classes": {"x": {"products": ["a"], "tolerations": [{"kye": "a"}]}}},
            r"classes.x.tolerations\[0\]",
        ),
        ({"classes": {"x": {"nodeSelector": {"a": 1}}}}, "classes.x.nodeSelector"),
        ({"classes": {}}, "classes must be a non-empty map"),
        (
            {"classes": {"x": {"products": ["a"], "requests": {"gpu": "1"}}}},
            "classes.x.requests must be a map",
        ),
        ({"classes": {"x": {"products": ["a"], "requests": {"cpu": ""}}}}, "classes.x.requests.cpu"),
    ],
)
def test_bad_pool_files_name_the_field(document: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_pools(document, source="pools.yaml")


def test_missing_pool_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--pools FILE"):
        load_pools(tmp_path / "absent.yaml")


def test_pods_request_cpu_and_memory_from_the_pool_with_defaults() -> None:
    pools = parse_pools(
        {"classes": {"big": {"products": ["a"], "requests": {"cpu": "8"}}, "plain": {"products": ["b"]}}}
    )
    assert pools["big"].requests == {"cpu": "8", "memory": "8Gi"}
    assert pools["plain"].requests == {"cpu": "2", "memory": "8Gi"}
    assert default_pools()["h100"].requests == {"cpu": "2", "memory": "8Gi"}


def test_a_pool_file_that_sets_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text("version: 1\nclasses:\n  a: {products: [x]}\n  a: {products: [y]}\n")
    with pytest.raises(UsageError, match="'a' is set twice"):
        load_pools(path)
