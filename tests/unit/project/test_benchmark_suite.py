"""The benchmark suite's entry point: every registered benchmark is a script that runs alone, and a
run through `python -m benchmarks` leaves one dated results file with the machine, the commit,
the settings and the script's numbers, replacing the benchmark's earlier file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, Benchmark
from benchmarks import __main__ as entry

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_is_a_script_that_writes_to_out(name: str) -> None:
    script = ROOT / "benchmarks" / BENCHMARKS[name].script
    assert script.is_file(), script
    text = script.read_text()
    assert '"--out"' in text and 'if __name__ == "__main__":' in text
    bound = BENCHMARKS[name].bound
    assert bound is None or f'"{bound}"' in text


def test_a_run_writes_one_dated_file_and_replaces_the_older_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "fake.py"
    script.write_text(
        "import argparse, json, pathlib\n"
        "p = argparse.ArgumentParser(); p.add_argument('--out'); p.add_argument('--size')\n"
        "p.add_argument('--max-seconds')\n"
        "a = p.parse_args()\n"
        "pathlib.Path(a.out, 'fake.json').write_text(json.dumps({'size': a.size, 'bound': a.max_seconds}))\n"
        "pathlib.Path(a.out, 'fake.md').write_text('| a | b |')\n"
    )
    fake = Benchmark(str(script), "a test", ("--size", "1"), "--max-seconds")
    monkeypatch.setitem(BENCHMARKS, "fake", fake)
    out = tmp_path / "results"
    out.mkdir()
    (out / "fake-2000-01-01.json").write_text("{}")
    (out / "other-2000-01-01.json").write_text("{}")
    assert entry.main(["fake", "--out", str(out), "--seconds", "60", "--size", "3"]) == 0
    written = sorted(path.name for path in out.iterdir())
    assert len(written) == 2 and "other-2000-01-01.json" in written
    record = json.loads(next(out.glob("fake-2*.json")).read_text())
    assert record["numbers"]["fake"] == {"size": "3", "bound": "60"}  # the user's flag wins
    assert record["tables"]["fake"] == "| a | b |"
    assert record["exit_status"] == 0 and record["seconds_bound"] == 60
    assert {"commit", "cpus", "gpus", "driver", "torch", "date"} <= set(record["machine"])
    assert str(tmp_path) not in json.dumps(record["settings"])  # no machine paths


def test_the_entry_point_lists_the_benchmarks() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert all(name in listing for name in BENCHMARKS)
