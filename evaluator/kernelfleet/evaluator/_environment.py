"""Where a result was measured: device name, GPU class, driver and software versions.

Results from different environments are never compared, so the GPU class is derived from the
device name in one place. The CUDA details are probed in a child process: the parent never
creates a CUDA context of its own.
"""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

_CLASSES = (("A100", "a100"), ("H100", "h100"), ("H200", "h200"), ("L40", "l40"), ("3090", "rtx3090"))


def gpu_class(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'cpu' -> 'cpu'; unknown names become a slug of the name."""
    if device_name.lower() == "cpu":
        return "cpu"
    for marker, name in _CLASSES:
        if marker in device_name.upper():
            return name
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().removeprefix("nvidia ")).strip("-")
    return slug or "unknown"


def driver_version() -> str:
    """The NVIDIA driver version, from the kernel module or nvidia-smi; '' when absent."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return ""


def host_name() -> str:
    return platform.node()
