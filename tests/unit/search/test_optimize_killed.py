"""`kill -9` of `kernelfleet optimize` mid-build leaves nothing behind: no process of it (sandbox,
zygote, candidate, judge, build, compiler) stays, no lock stays held, and the next run of the
same command finishes the job, the interrupted build included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kernelfleet.evaluator._builddir import flock_holders
from kernelfleet.evaluator._sandbox import alive, descendants
from tests.support import evaluator_cases as C

ROOT = Path(__file__).resolve().parents[3]
COMPILERS = ("cc1plus", "ninja", "c++", "g++", "nvcc")


def _command(tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kernelfleet.core.cli",
        "optimize",
        "tasks",
        "--policy",
        "replay:candidates.jsonl",
        "--rounds",
        "1",
        "--no-baselines",
        "--store",
        "store",
        "--run",
        "killed",
        "--device",
        "cpu",
        "--quiet",
        "--json",
    ]


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return names


def test_a_run_killed_mid_build_leaves_nothing_and_the_next_run_finishes(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "matmul.py").write_text(C.MATMUL_TASK)
    rows = [
        {
            "task": "matmul",
            "name": "cpp",
            "code": C.CPP_KERNEL.replace("kf_test_relu_mm", "kf_test_killed_run"),
        },
        {"task": "matmul", "name": "honest", "code": C.HONEST},
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "KERNELFLEET_CACHE_DIR": str(tmp_path / "cache"),
    }
    process = subprocess.Popen(
        _command(tmp_path), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 600  # a bound for a loaded machine, not a timing
        while time.monotonic() < deadline:
            assert process.poll() is None, "the run ended before a compiler started"
            below = descendants(process.pid)
            seen.update(below)
            if any(name in COMPILERS for name in _names(below)):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no compiler started within the bound")
        time.sleep(1.0)  # let the compile take torch's build lock
        seen.update(descendants(process.pid))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    deadline = time.monotonic() + 60
    while alive(sorted(seen)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(sorted(seen))
    assert not left, f"processes of the killed run remain: {list(zip(left, _names(left), strict=False))}"
    for lease in (tmp_path / "cache").rglob("*.lease"):
        assert not flock_holders(lease), f"{lease} is still held"

    again = subprocess.run(
        _command(tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert again.returncode == 0, again.stderr[-3000:]
    summaries = json.loads(again.stdout)
    assert summaries[0]["best_speedup"] is not None, again.stderr[-3000:]
    results = list((tmp_path / "store").rglob("results/**/*.json"))
    verdicts = sorted(json.loads(path.read_text())["verdict"] for path in results)
    assert verdicts == ["correct", "correct"], verdicts
