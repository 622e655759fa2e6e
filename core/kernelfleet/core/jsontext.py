"""JSON that every parser reads. Python's `json` writes NaN and infinities as `NaN` and
`Infinity`, which JSON has no literal for: strict parsers (JavaScript's, Go's, jq) refuse the
whole document. Everything kernelfleet prints or stores as JSON goes through `dumps`, which
writes a non-finite number as null; `finite` also says where it did, so that an output can
give the reason beside the null.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any, path: str = "") -> tuple[Any, dict[str, str]]:
    """`value` with every NaN or infinite float replaced by None, and what was replaced:
    {"a.b[2]": "inf"}."""
    replaced: dict[str, str] = {}

    def walk(item: Any, where: str) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            replaced[where or "."] = str(item)
            return None
        if isinstance(item, dict):
            return {key: walk(inner, f"{where}.{key}" if where else str(key)) for key, inner in item.items()}
        if isinstance(item, list | tuple):
            return [walk(inner, f"{where}[{index}]") for index, inner in enumerate(item)]
        return item

    return walk(value, path), replaced


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that always writes valid JSON: a non-finite number becomes null."""
    return json.dumps(finite(value)[0], allow_nan=False, **kwargs)
