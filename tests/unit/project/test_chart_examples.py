"""The example custom resources are valid against the models the CRDs are generated from, use
every spec field by its Kubernetes (camelCase) name, and only GPU classes the chart defines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kernelfleet.core.resources import GROUP, VERSION, OptimizationJobSpec, TrainingRunSpec

ROOT = Path(__file__).resolve().parents[3]


def load(name: str) -> dict[str, Any]:
    document = yaml.safe_load((ROOT / "examples" / name).read_text())
    assert isinstance(document, dict)
    return document


def chart_classes() -> set[str]:
    values = yaml.safe_load((ROOT / "charts" / "kernelfleet" / "values.yaml").read_text())
    return set(values["pools"]["classes"])


def test_example_optimization_job_is_a_valid_spec_with_every_field() -> None:
    document = load("optimizationjob.yaml")
    assert document["apiVersion"] == f"{GROUP}/{VERSION}" and document["kind"] == "OptimizationJob"
    spec = OptimizationJobSpec.model_validate(document["spec"])
    # Nothing in the file is ignored or renamed on the way in.
    assert spec.model_dump(by_alias=True, exclude_unset=True, mode="json") == document["spec"]
    assert set(document["spec"]) == {field.alias for field in OptimizationJobSpec.model_fields.values()}
    assert set(spec.gpu_classes) <= chart_classes()


def test_example_training_run_is_a_valid_spec_with_all_three_stages() -> None:
    document = load("trainingrun.yaml")
    assert document["apiVersion"] == f"{GROUP}/{VERSION}" and document["kind"] == "TrainingRun"
    spec = TrainingRunSpec.model_validate(document["spec"])
    assert spec.model_dump(by_alias=True, exclude_unset=True, mode="json") == document["spec"]
    assert [stage.type.value for stage in spec.stages] == ["sft", "selftrain", "grpo"]
    assert spec.gpu_class in chart_classes()
