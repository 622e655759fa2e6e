"""crds/ is generated from kernelfleet.core.resources: stale files fail the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_crds_match_the_models() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate-crds.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
