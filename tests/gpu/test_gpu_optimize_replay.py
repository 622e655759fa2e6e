"""The user's path on the GPU, guarded against stalls: `kernelfleet optimize` replaying 16
published kernels (8 of them build C++/CUDA), several evaluations sharing the device, first killed
with SIGKILL mid-run and then run again. Every evaluation must finish, no stretch of the stall
bound may pass without a result, and the killed run must leave no process, GPU memory or build
lease behind. The run is benchmarks/optimize_replay.py's, so it also writes its results file
(with the GPU's utilisation, sampled) into $KERNELFLEET_RESULTS, or a temporary folder.

The published kernels are not in the repository: point $KERNELFLEET_CUDA_L1_KERNELS at
cuda-l1-h100-kernels.jsonl (scripts/gpu-check.sh carries it as .data/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
TASKS = [
    "kernelbench-v0:1:1,6,9,12,14,20,23,28,32,44",  # 1:9, 1:12, 1:23, 1:28, 1:32, 1:44 build
    "kernelbench-v0:2:1,3,4,21",  # 2:4 and 2:21 build
    "kernelbench-v0:3:1,4",
]
STALL_S = 240  # no result for this long, while evaluations are still to come, is a stall


def test_optimize_finishes_every_evaluation_and_a_killed_run_leaves_nothing(tmp_path: Path) -> None:
    kernels = os.environ.get(
        "KERNELFLEET_CUDA_L1_KERNELS", str(ROOT / ".data" / "cuda-l1-h100-kernels.jsonl")
    )
    if not Path(kernels).is_file():
        pytest.skip(f"no published kernels at {kernels} (set KERNELFLEET_CUDA_L1_KERNELS)")
    from benchmarks.optimize_replay import main

    out = Path(os.environ.get("KERNELFLEET_RESULTS") or tmp_path / "results")
    code = main(
        [
            "--tasks",
            *TASKS,
            "--kernels",
            kernels,
            "--work",
            str(tmp_path / "work"),
            "--stall-s",
            str(STALL_S),
            "--kill-after",
            "25",
            "--out",
            str(out),
            "--tag",
            "gpu-test",
        ]
    )
    report = json.loads(next(out.glob("optimize_replay-*-gpu-test.json")).read_text())
    killed, run = report["killed"], report["optimize"]
    assert not killed["left_processes"] and not killed["left_gpu_processes"] and not killed["left_leases"], (
        killed
    )
    assert not run["stalled"], run["watchdog_lines"]
    assert run["returncode"] == 0, run["watchdog_lines"]
    assert sum(run["verdicts"].values()) == 16, run["verdicts"]
    assert run["gpu"]["samples"] > 0
    assert code == 0
