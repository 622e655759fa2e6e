"""GPU pools: which nodes a GPU class names, and how a pod is placed on them.

A class (`h100`, `a100`, ...) is what users write in `spec.gpuClasses`; a pool is the set of
nodes that serve it. The operator reads the pools from the file the chart renders (the ConfigMap
key `pools.yaml`, every field already resolved) or, without one, from the built-in default that
maps the four classes to GPU Feature Discovery's `nvidia.com/gpu.product` values with the
`nvidia.com/gpu` toleration that GPU node pools carry.

The format (version 1):

    version: 1
    classes:
      h100:
        nodeLabel: nvidia.com/gpu.product      # matched with In against products
        products: [NVIDIA-H100-80GB-HBM3, NVIDIA-H100-PCIe, NVIDIA-H100-NVL]
        nodeSelector: {}                       # labels that must match exactly
        tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
        gpuResource: nvidia.com/gpu
        requests: {cpu: "2", memory: 8Gi}      # what each pod requests besides its GPUs

Every pod requests CPU and memory as well as GPUs: a pod without requests runs BestEffort (the
first evicted under pressure), packs blindly, and takes no quota in Kueue, whose ClusterQueues
then cannot bound a class.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernelfleet.core.errors import UsageError
from kernelfleet.operator import strict_yaml

GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION: dict[str, str] = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
FORMAT_VERSION = 1

# GPU Feature Discovery's product names (NVML names, spaces turned into hyphens).
DEFAULT_PRODUCTS: dict[str, tuple[str, ...]] = {
    "a100": (
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-A100-SXM4-40GB",
        "NVIDIA-A100-80GB-PCIe",
        "NVIDIA-A100-PCIE-40GB",
    ),
    "h100": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"),
    "l40": ("NVIDIA-L40", "NVIDIA-L40S"),
    "rtx3090": ("NVIDIA-GeForce-RTX-3090",),
}

_CLASS_KEYS = {"nodeLabel", "products", "nodeSelector", "tolerations", "gpuResource", "requests"}
_REQUEST_KEYS = ("cpu", "memory")
# Per pod, when the pool configuration says nothing (the chart's pools.requests default too).
DEFAULT_REQUESTS: dict[str, str] = {"cpu": "2", "memory": "8Gi"}
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


@dataclass(frozen=True)
class GpuClass:
    """One pool class, fully resolved: how its nodes are recognised and how pods tolerate them."""

    name: str
    node_label: str = GFD_PRODUCT_LABEL
    products: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = (GPU_TOLERATION,)
    gpu_resource: str = GPU_RESOURCE
    requests: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_REQUESTS))

    def placement(self) -> dict[str, Any]:
        """The pod-spec fields that put a pod on this pool: nodeSelector, affinity, tolerations.

        Products are matched with a node-affinity `In` term rather than a nodeSelector, because
        one class spans several product names (SXM and PCIe, 40 and 80 GB).
        """
        spec: dict[str, Any] = {}
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.products:
            spec["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": self.node_label, "operator": "In", "values": list(self.products)}
                                ]
                            }
                        ]
                    }
                }
            }
        if self.tolerations:
            spec["tolerations"] = [dict(t) for t in self.tolerations]
        return spec

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with `labels` belongs to this pool."""
        if any(labels.get(key) != value for key, value in self.node_selector.items()):
            return False
        return not self.products or labels.get(self.node_label) in self.products

    def describe_labels(self) -> str:
        """The labels looked for, as a user would write them in a selector."""
        parts = [f"{key}={value}" for key, value in sorted(self.node_selector.items())]
        if self.products:
            parts.append(f"{self.node_label} in ({', '.join(self.products)})")
        return ", ".join(parts)


@dataclass(frozen=True)
class Pools:
    """The GPU classes the operator knows, by name."""

    classes: Mapping[str, GpuClass]
    source: str = "the built-in default"

    def __contains__(self, name: object) -> bool:
        return name in self.classes

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.classes))

    def __getitem__(self, name: str) -> GpuClass:
        try:
            return self.classes[name]
        except KeyError:
            raise UsageError(
                f"GPU class {name!r} is not in the pool configuration ({self.source}); "
                f"the classes are: {', '.join(self)}"
            ) from None

    def names(self) -> list[str]:
        return list(self)


def default_pools() -> Pools:
    """The four classes on GPU Feature Discovery's product label, with the GPU toleration."""
    return Pools(
        {name: GpuClass(name=name, products=products) for name, products in DEFAULT_PRODUCTS.items()}
    )


def _bad(source: str, where: str, why: str) -> UsageError:
    return UsageError(f"pool configuration {source}: {where} {why}")


def _string_map(source: str, where: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _bad(source, where, "must be a map of label names to string values")
    return dict(value)


def _tolerations(source: str, where: str, value: object) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(source, where, "must be a list of tolerations")
    result = []
    for position, item in enumerate(value):
        if not isinstance(item, dict) or not set(item) <= _TOLERATION_KEYS:
            raise _bad(
                source,
                f"{where}[{position}]",
                f"must be a toleration with only the fields {', '.join(sorted(_TOLERATION_KEYS))}",
            )
        result.append(copy.deepcopy(item))
    return tuple(result)


def _requests(source: str, where: str, value: object) -> dict[str, str]:
    """A pod's CPU and memory requests (Kubernetes quantities as strings); missing ones default."""
    if value is None:
        return dict(DEFAULT_REQUESTS)
    if not isinstance(value, dict) or not set(value) <= set(_REQUEST_KEYS):
        raise _bad(source, where, 'must be a map with cpu and memory, e.g. {cpu: "2", memory: 8Gi}')
    result = dict(DEFAULT_REQUESTS)
    for key, quantity in value.items():
        if not isinstance(quantity, str | int) or isinstance(quantity, bool) or not str(quantity).strip():
            raise _bad(source, f"{where}.{key}", 'must be a Kubernetes quantity such as "2" or 8Gi')
        result[key] = str(quantity)
    return result


def parse_pools(document: object, source: str = "the pool configuration") -> Pools:
    """Pools from a parsed pools.yaml document; errors name the field and what to write."""
    if not isinstance(document, dict):
        raise _bad(source, "the document", "must be a map with `version: 1` and `classes`")
    version = document.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise _bad(source, "version", f"is {version!r}; this operator reads version {FORMAT_VERSION}")
    unknown = set(document) - {"version", "classes"}
    if unknown:
        raise _bad(source, "the document", f"has unknown keys {sorted(unknown)}; only version and classes")
    classes = document.get("classes")
    if not isinstance(classes, dict) or not classes:
        raise _bad(source, "classes", "must be a non-empty map of class names to pools")
    parsed: dict[str, GpuClass] = {}
    for name, body in classes.items():
        where = f"classes.{name}"
        if not isinstance(name, str) or not name:
            raise _bad(source, "classes", f"has a bad class name {name!r}")
        if not isinstance(body, dict):
            raise _bad(source, where, "must be a map with products or nodeSelector")
        unknown = set(body) - _CLASS_KEYS
        if unknown:
            raise _bad(source, where, f"has unknown keys {sorted(unknown)}; known: {sorted(_CLASS_KEYS)}")
        products = body.get("products") or []
        if not isinstance(products, list) or not all(isinstance(p, str) and p for p in products):
            raise _bad(source, f"{where}.products", "must be a list of node label values")
        node_selector = _string_map(source, f"{where}.nodeSelector", body.get("nodeSelector"))
        if not products and not node_selector:
            raise _bad(source, where, "selects no nodes: give it products or a nodeSelector")
        tolerations = (
            _tolerations(source, f"{where}.tolerations", body["tolerations"])
            if "tolerations" in body
            else (GPU_TOLERATION,)
        )
        requests = _requests(source, f"{where}.requests", body.get("requests"))
        node_label = body.get("nodeLabel") or GFD_PRODUCT_LABEL
        gpu_resource = body.get("gpuResource") or GPU_RESOURCE
        if not isinstance(node_label, str) or not isinstance(gpu_resource, str):
            raise _bad(source, where, "nodeLabel and gpuResource must be strings")
        parsed[name] = GpuClass(
            name=name,
            node_label=node_label,
            products=tuple(products),
            node_selector=node_selector,
            tolerations=tolerations,
            gpu_resource=gpu_resource,
            requests=requests,
        )
    return Pools(parsed, source=source)


def load_pools(path: str | Path | None) -> Pools:
    """The pools in `path` (the chart's pools.yaml), or the built-in default when None."""
    if path is None:
        return default_pools()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(
            f"cannot read the pool configuration {path}: {error.strerror}; pass --pools FILE with "
            "the chart's pools.yaml, or leave --pools out for the built-in default"
        ) from None
    try:
        document = strict_yaml.load(text)
    except yaml.YAMLError as error:
        raise UsageError(f"pool configuration {path} is not valid YAML: {error}") from None
    return parse_pools(document, source=str(path))
