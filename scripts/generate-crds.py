#!/usr/bin/env python3
"""Generate crds/*.yaml from the pydantic models in kernelfleet.core.resources.

Usage: scripts/generate-crds.py [--check]
  --check  exit 1 (and say which file) when a CRD on disk differs from what the models give.

The OpenAPI that pydantic writes is JSON Schema 2020-12; Kubernetes wants a structural subset:
no $ref, no anyOf-with-null (nullable instead), exclusive bounds as booleans, no titles.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kernelfleet.core import resources

ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = ROOT / "crds"
CHART_CRD_DIR = ROOT / "charts" / "kernelfleet" / "crds"


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    any_of = node.get("anyOf")
    if any_of is not None:
        options = [option for option in any_of if option.get("type") != "null"]
        if len(options) == 1 and len(options) < len(any_of):
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            merged = _structural({**options[0], **rest}, defs)
            merged["nullable"] = True
            return merged
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
            continue
        if key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
            continue
        if key == "properties":
            out[key] = {name: _structural(schema, defs) for name, schema in value.items()}
            continue
        out[key] = _structural(value, defs)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    return dict(_structural(raw, raw.get("$defs", {})))


def immutability_rules(spec: type[BaseModel], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """A CEL transition rule per spec field outside the model's MUTABLE list: the API server
    refuses an update that changes it (or adds or removes it), naming the field."""
    mutable = getattr(spec, "MUTABLE", None)
    if mutable is None:
        return []
    allowed = ", ".join(f"spec.{name}" for name in mutable)
    # A null default is no default to the API server: such a field may be absent.
    present = set(schema.get("required", [])) | {
        n for n, p in schema["properties"].items() if p.get("default") is not None
    }

    def unchanged(name: str) -> str:
        if name in present:
            return f"self.{name} == oldSelf.{name}"
        # Optional without a default: absent in both, or present in both and equal.
        return (
            f"has(self.{name}) == has(oldSelf.{name}) && (!has(self.{name}) || self.{name} == oldSelf.{name})"
        )

    return [
        resources.rule(
            unchanged(name),
            f"spec.{name} cannot be changed once the resource exists (only {allowed} can): create a new one",
            f".{name}",
            "FieldValueForbidden",
        )
        for name in schema["properties"]
        if name not in mutable
    ]


def key_conditions_by_type(status_schema: dict[str, Any]) -> None:
    """Conditions are a map keyed by type (as metav1.Condition lists are): one entry per type,
    merged by type under server-side apply."""
    conditions = status_schema.get("properties", {}).get("conditions")
    if conditions is not None:
        conditions["x-kubernetes-list-type"] = "map"
        conditions["x-kubernetes-list-map-keys"] = ["type"]


def crd(
    kind: str,
    plural: str,
    short: list[str],
    spec: type[BaseModel],
    status: type[BaseModel],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    spec_schema, status_schema = schema_of(spec), schema_of(status)
    spec_schema.pop("description", None)
    status_schema.pop("description", None)
    rules = [*spec_schema.get("x-kubernetes-validations", []), *immutability_rules(spec, spec_schema)]
    if rules:
        spec_schema["x-kubernetes-validations"] = rules
    key_conditions_by_type(status_schema)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{resources.GROUP}"},
        "spec": {
            "group": resources.GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["kernelfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": resources.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (spec.__doc__ or kind).strip().splitlines()[0],
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def all_crds() -> dict[str, dict[str, Any]]:
    age: dict[str, Any] = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    return {
        "optimizationjobs.yaml": crd(
            "OptimizationJob",
            "optimizationjobs",
            ["kfopt"],
            resources.OptimizationJobSpec,
            resources.OptimizationJobStatus,
            [
                {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                {"name": "Done", "type": "integer", "jsonPath": ".status.tasksDone"},
                {"name": "Total", "type": "integer", "jsonPath": ".status.tasksTotal"},
                {"name": "Best", "type": "number", "jsonPath": ".status.bestSpeedup"},
                age,
            ],
        ),
        "kopf-clusterkopfpeerings.yaml": peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
        "kopf-kopfpeerings.yaml": peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
        "trainingruns.yaml": crd(
            "TrainingRun",
            "trainingruns",
            ["kftrain"],
            resources.TrainingRunSpec,
            resources.TrainingRunStatus,
            [
                {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                {"name": "Stage", "type": "string", "jsonPath": ".status.currentStage"},
                {"name": "Done", "type": "integer", "jsonPath": ".status.stagesDone"},
                {"name": "Checkpoint", "type": "string", "jsonPath": ".status.checkpoint", "priority": 1},
                age,
            ],
        ),
    }


def peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's peering kinds (group kopf.dev): where operators record their keep-alives, so that a
    second `kernelfleet operator` pauses while one runs. The status is kopf's own, kept as is."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()},
            "scope": scope,
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def render(document: dict[str, Any]) -> str:
    header = "# Generated by scripts/generate-crds.py from kernelfleet.core.resources; do not edit.\n"
    return header + yaml.safe_dump(document, sort_keys=False, width=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when crds/ is stale instead of writing")
    args = parser.parse_args()
    stale = []
    for directory in (CRD_DIR, CHART_CRD_DIR):
        for name, document in all_crds().items():
            path, text = directory / name, render(document)
            if args.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path.relative_to(ROOT)))
            else:
                directory.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print(
            f"stale CRDs: {', '.join(stale)}; run scripts/generate-crds.py and commit the result",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
