"""The CRDs' contract, as the real kube-apiserver enforces it (no operator runs here):

- every example in examples/ is accepted with strict field validation (as kubectl applies it);
- `kernelfleet submit` asks for strict validation, so a field the CRD does not know fails with
  its name instead of being dropped;
- the spec is immutable except the fields the docs call mutable, and an edit of another is
  refused naming the field;
- cross-field rules (an openai policy needs model and baseUrl; a replay policy a path) and
  unique GPU classes are checked at admission, naming the field;
- conditions are a list keyed by type: two conditions of one type are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kernelfleet.core.errors import UsageError
from kernelfleet.operator import strict_yaml
from kernelfleet.operator.client._commands import _create
from tests.support.operator import GROUP, VERSION, apply_crds, create, optimization_job

ROOT = Path(__file__).resolve().parents[2]
PLURALS = {"OptimizationJob": "optimizationjobs", "TrainingRun": "trainingruns"}
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml"))


def _refused(call: Any) -> str:
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status in (400, 422), caught.value.body
    return str(caught.value.body)


def _patch(kube: Any, name: str, spec: dict[str, Any]) -> Any:
    return kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "optimizationjobs", name, {"spec": spec}
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_is_accepted_with_strict_field_validation(kube: Any, path: Path) -> None:
    apply_crds(kube)
    for document in strict_yaml.load_all(path.read_text()):
        if not document:
            continue
        body = copy.deepcopy(document)
        kube.custom.create_namespaced_custom_object(
            GROUP, VERSION, kube.namespace, PLURALS[body["kind"]], body, field_validation="Strict"
        )


def test_submit_asks_for_strict_validation_so_a_typo_is_named(kube: Any) -> None:
    apply_crds(kube)
    document = optimization_job("typo", tasks=["kernelbench-v0:1:1"], paralelism=2)
    document["metadata"]["namespace"] = kube.namespace
    with pytest.raises(UsageError) as caught:
        _create(kube, document)
    assert "paralelism" in str(caught.value) and "unknown field" in str(caught.value)


def test_only_the_mutable_fields_change_and_an_edit_of_another_is_refused_naming_it(kube: Any) -> None:
    apply_crds(kube)
    create(kube, optimization_job("fixed", tasks=["kernelbench-v0:1:1-4"], parallelism=2))
    for field, value in (("parallelism", 3), ("tasks", ["kernelbench-v0:1:5"]), ("queueName", "q")):
        message = _refused(lambda f=field, v=value: _patch(kube, "fixed", {f: v}))
        assert f"spec.{field} cannot be changed" in message, message
    changed = _patch(
        kube, "fixed", {"suspend": True, "ttlSecondsAfterFinished": 60, "activeDeadlineSeconds": 600}
    )
    assert changed["spec"]["suspend"] is True and changed["spec"]["ttlSecondsAfterFinished"] == 60


@pytest.mark.parametrize(
    ("policy", "field", "words"),
    [
        ({"kind": "openai", "model": "m"}, "spec.policies[0].baseUrl", "needs baseUrl"),
        ({"kind": "openai", "baseUrl": "http://x/v1"}, "spec.policies[0].model", "needs model"),
        ({"kind": "replay"}, "spec.policies[0].path", "needs path"),
    ],
)
def test_cross_field_rules_are_checked_at_admission_naming_the_field(
    kube: Any, policy: dict[str, Any], field: str, words: str
) -> None:
    apply_crds(kube)
    message = _refused(
        lambda: create(kube, optimization_job("bad", tasks=["kernelbench-v0:1:1"], policies=[policy]))
    )
    assert field in message and words in message, message


def test_gpu_classes_are_unique(kube: Any) -> None:
    apply_crds(kube)
    message = _refused(
        lambda: create(
            kube, optimization_job("twice", tasks=["kernelbench-v0:1:1"], gpuClasses=["h100", "h100"])
        )
    )
    assert "spec.gpuClasses[1]" in message and "Duplicate value" in message, message


def test_conditions_are_keyed_by_type(kube: Any) -> None:
    apply_crds(kube)
    create(kube, optimization_job("keyed", tasks=["kernelbench-v0:1:1"]))
    running = {
        "type": "Running",
        "status": "False",
        "reason": "NoPods",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    message = _refused(
        lambda: kube.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            kube.namespace,
            "optimizationjobs",
            "keyed",
            {"status": {"conditions": [running, running]}},
        )
    )
    assert "Duplicate value" in message, message


def test_stage_names_are_unique(kube: Any) -> None:
    apply_crds(kube)
    run = strict_yaml.load((ROOT / "examples" / "trainingrun.yaml").read_text())
    run["spec"]["stages"].append(copy.deepcopy(run["spec"]["stages"][0]))
    message = _refused(
        lambda: kube.custom.create_namespaced_custom_object(
            GROUP, VERSION, kube.namespace, "trainingruns", run
        )
    )
    assert "spec.stages[3]" in message and "Duplicate value" in message, message
