"""ruff and mypy are part of the tests: a lint or type error fails `make test` like any bug."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_tree_is_clean(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
