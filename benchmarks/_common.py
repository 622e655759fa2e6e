"""What every benchmark shares: the commit, the machine, a tree's environment, GPU sampling.

Kept apart from the benchmarks themselves so that each stays runnable alone
(`python benchmarks/NAME.py`) and through the entry point (`python -m benchmarks NAME`).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The commit measured: $KERNELFLEET_COMMIT (the GPU machine gets a tree without .git), else
    `git rev-parse HEAD`, else "unknown"."""
    if os.environ.get("KERNELFLEET_COMMIT"):
        return os.environ["KERNELFLEET_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """The machine a run measured: CPUs, GPUs (nvidia-smi's names, driver, memory), torch and its
    CUDA, the commit and the date. No host names or paths."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "gpus": [],
        "driver": "",
    }
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            rows = [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
            info["gpus"] = [{"name": row[0], "memory": row[2]} for row in rows if len(row) == 3]
            info["driver"] = rows[0][1] if rows and len(rows[0]) == 3 else ""
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import torch

        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda or ""
    except ImportError:
        info["torch"], info["cuda"] = "", ""
    return info


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that runs `tree`'s kernelfleet (an exported older commit, or
    this tree): that tree first on PYTHONPATH in place of this one; other entries (the GPU
    machine's carried wheels) stay."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    others = [p for p in inherited if not Path(p).resolve().is_relative_to(ROOT)]
    paths = [str(tree / part) for part in ("core", "evaluator", "search")] + others
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class UtilizationSampler:
    """Samples nvidia-smi's GPU utilisation and SM clock twice a second while a part runs (a GPU
    idle between timed calls may clock down, which stretches short kernels)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.clocks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=utilization.gpu,clocks.sm",
                        "--format=csv,noheader,nounits",
                        "-i",
                        "0",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                )
                utilization, clock = out.stdout.strip().splitlines()[0].split(",")
                self.samples.append(float(utilization))
                self.clocks.append(float(clock))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return

    def __enter__(self) -> UtilizationSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(10)

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 1) if self.samples else None

    @property
    def clock_mhz(self) -> dict[str, float] | None:
        """The SM clock's 10th percentile, median and largest sample."""
        if not self.clocks:
            return None
        ordered = sorted(self.clocks)
        return {"p10": ordered[len(ordered) // 10], "median": statistics.median(ordered), "max": ordered[-1]}
