"""Everything kernelfleet writes as JSON is read by strict parsers: no NaN, no Infinity."""

from __future__ import annotations

import json
import math

from kernelfleet.core.jsontext import dumps, finite
from kernelfleet.core.models import Environment, EvaluationResult, Verdict
from kernelfleet.core.store import encode_json


def strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_and_are_named() -> None:
    value = {"a": math.inf, "b": [1.0, -math.inf, {"c": math.nan}], "d": "nan", "e": 2}
    clean, replaced = finite(value)
    assert clean == {"a": None, "b": [1.0, None, {"c": None}], "d": "nan", "e": 2}
    assert replaced == {"a": "inf", "b[1]": "-inf", "b[2].c": "nan"}
    assert strict(dumps(value)) == clean


def test_stored_results_are_strict_json() -> None:
    result = EvaluationResult(
        task_hash="t" * 64,
        variant_hash="v" * 64,
        verdict=Verdict.INCORRECT,
        reasons=("output-mismatch: NaN in the output",),
        max_abs_error=math.inf,
        environment=Environment(device="cpu", gpu_class="cpu", evaluator_version="x", torch="x"),
    )
    stored = strict(encode_json(result).decode())
    assert isinstance(stored, dict) and stored["max_abs_error"] is None
