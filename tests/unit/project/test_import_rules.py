"""DESIGN.md's import rules, checked on the source: a broken rule fails the tests.

| component | may import (besides the standard library and itself) |
| core      | pydantic, minio |
| evaluator | core, torch and what the evaluator's distribution depends on |
| search    | core, evaluator; transformers and vllm as extras |
| trainer   | core, evaluator, search, transformers, trl, vllm, ... |
| operator  | core, kopf, kubernetes — never torch, evaluator, search or trainer |
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Top-level names each component must never import. Core is the strictest: it is a dependency
# of everything, so it may only use the standard library, pydantic and minio.
FORBIDDEN: dict[str, set[str]] = {
    "core": {
        "kernelfleet.evaluator",
        "kernelfleet.search",
        "kernelfleet.trainer",
        "kernelfleet.operator",
        "torch",
        "kopf",
        "kubernetes",
        "transformers",
        "trl",
        "vllm",
        "triton",
        "numpy",
    },
    "evaluator": {
        "kernelfleet.search",
        "kernelfleet.trainer",
        "kernelfleet.operator",
        "kopf",
        "kubernetes",
        "transformers",
        "trl",
        "vllm",
    },
    # Search runs in the worker image: no trl, and no training code (that depends on search).
    "search": {"kernelfleet.trainer", "kernelfleet.operator", "kopf", "kubernetes", "trl"},
    "trainer": {"kernelfleet.operator", "kopf", "kubernetes"},
    "operator": {
        "kernelfleet.evaluator",
        "kernelfleet.search",
        "kernelfleet.trainer",
        "torch",
        "transformers",
        "trl",
        "vllm",
        "triton",
        "numpy",
    },
}
CORE_ALLOWED_THIRD_PARTY = {"pydantic", "minio", "urllib3", "certifi"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(component: str) -> list[str]:
    found = []
    for path in sorted((ROOT / component / "kernelfleet").rglob("*.py")):
        for module in imported_modules(path):
            for banned in FORBIDDEN[component]:
                if module == banned or module.startswith(banned + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {module}")
            top = module.split(".")[0]
            if (
                component == "core"
                and top not in sys.stdlib_module_names
                and top != "kernelfleet"
                and top not in CORE_ALLOWED_THIRD_PARTY
            ):
                found.append(
                    f"{path.relative_to(ROOT)} imports {module} (core may use only stdlib, pydantic, minio)"
                )
    return found


@pytest.mark.parametrize("component", sorted(FORBIDDEN))
def test_component_respects_the_import_rules(component: str) -> None:
    assert violations(component) == []


def test_the_check_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom kernelfleet.evaluator import x\n")
    assert {"torch", "kernelfleet.evaluator"} <= imported_modules(bad)


def test_no_component_ships_a_namespace_init() -> None:
    assert [p for p in ROOT.glob("*/kernelfleet/__init__.py")] == []
