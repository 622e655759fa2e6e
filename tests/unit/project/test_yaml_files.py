"""Every YAML file a user copies or Helm reads (examples/, the chart's values and CI values,
Chart.yaml) loads with a parser that refuses a key set twice: with a lenient one the second
value wins silently, with a strict one (kubectl, the API server's strict decoding) the file fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfleet.operator import strict_yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kernelfleet"
FILES = sorted(
    [
        *(ROOT / "examples").rglob("*.yaml"),
        *(ROOT / "examples").rglob("*.yml"),
        *CHART.glob("*.yaml"),
        *(CHART / "ci").glob("*.yaml"),
    ]
)


def test_the_files_are_found() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in FILES}
    assert {
        "examples/optimizationjob.yaml",
        "examples/trainingrun.yaml",
        "charts/kernelfleet/values.yaml",
    } <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_key_is_set_twice(path: Path) -> None:
    documents = strict_yaml.load_all(path.read_text())
    assert any(document is not None for document in documents)


def test_a_key_set_twice_is_refused_with_its_name_and_lines() -> None:
    with pytest.raises(strict_yaml.DuplicateKeyError) as caught:
        strict_yaml.load("spec:\n  verifyOn: []\n  parallelism: 2\n  verifyOn: [l40]\n")
    assert "'verifyOn' is set twice" in str(caught.value) and "line 2" in str(caught.value)
    assert "line 4" in str(caught.value)
