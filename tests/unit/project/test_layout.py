"""The package layout keeps its promises: one `kernelfleet` namespace over four distributions,
no shadowing of the standard library's `operator`, and light images stay light."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_operator_from_the_repository_root_is_the_standard_library() -> None:
    out = _python(
        "import operator, sys; print(operator.__name__, operator.add(2, 3), hasattr(operator, 'itemgetter'))"
    )
    assert out == "operator 5 True"
    # The same holds when the repository root is explicitly first on the path.
    out = _python(
        "import sys; sys.path.insert(0, '.'); sys.modules.pop('operator', None); import operator;"
        "print(getattr(operator, '__file__', 'builtin'))"
    )
    assert "kernelfleet" not in out and not out.startswith(str(ROOT / "operator"))


def test_kernelfleet_is_one_namespace_over_the_components() -> None:
    out = _python(
        "import kernelfleet, kernelfleet.core, kernelfleet.operator;"
        "print(getattr(kernelfleet, '__file__', None), len(list(kernelfleet.__path__)))"
    )
    file, portions = out.split()
    assert file == "None"  # PEP 420: no kernelfleet/__init__.py anywhere
    assert int(portions) >= 5


def test_importing_the_operator_loads_no_torch() -> None:
    out = _python(
        "import sys, kernelfleet.operator, kernelfleet.core.resources, kernelfleet.core.models;"
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'vllm', 'kernelfleet.evaluator',"
        " 'kernelfleet.search', 'kernelfleet.trainer') if m in sys.modules))"
    )
    assert out == "[]"


def _closure(distribution: str) -> set[str]:
    """Every distribution that installing `distribution` pulls in (no extras)."""
    seen: set[str] = set()
    todo = [distribution]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


@pytest.mark.parametrize(
    ("distribution", "forbidden"),
    [
        ("kernelfleet-operator", {"torch", "transformers", "trl", "vllm", "kernelfleet-evaluator"}),
        ("kernelfleet-core", {"torch", "kopf", "kubernetes", "transformers"}),
        ("kernelfleet-evaluator", {"kopf", "kubernetes", "trl", "vllm"}),
        # The worker image installs search without extras: no transformers, trl or vLLM.
        ("kernelfleet-search", {"kopf", "kubernetes", "trl", "transformers", "vllm", "kernelfleet-trainer"}),
    ],
)
def test_installing_a_component_pulls_nothing_it_must_not(distribution: str, forbidden: set[str]) -> None:
    assert _closure(distribution) & forbidden == set()
