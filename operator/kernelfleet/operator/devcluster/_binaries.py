"""Building the servers the dev cluster runs, with the cost said before it is paid.

The build script ships inside this package (the checkout's scripts/build-test-binaries.sh
runs the same file), so an installed kernelfleet can build them too. It compiles every server
from its Go module into the cache that `make test` fills, so whichever runs first pays once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from kernelfleet.core.errors import UsageError
from kernelfleet.operator.devcluster._process import bin_dir

BUILD_SCRIPT = Path(__file__).resolve().parent / "build-binaries.sh"
# The figures and how they were measured are in README.md ("Tests"): the seven servers took
# 20 min 16 s on an idle 2-core machine, 28 min 24 s on a shared one; kube-apiserver and the
# controller-manager dominate. A warm cache (Go's module and build caches kept) rebuilds in minutes.
FIRST_BUILD = "about 20 minutes on 2 idle cores and longer on busy ones (README.md, Tests)"
GO_VERSION_HINT = "Go 1.26 or newer with access to the Go module proxy"


def build_message(missing: list[str]) -> str:
    return (
        f"the dev cluster's servers are not built yet (missing: {', '.join(missing)}). kernelfleet builds "
        f"them from their Go modules into {bin_dir()}: the first build takes {FIRST_BUILD}, needs "
        f"{GO_VERSION_HINT}, and is reused by every later `kernelfleet dev-cluster up` and `make test`."
    )


def build(echo: bool = True, components: tuple[str, ...] = ()) -> float:
    """Run the build script for `components` (default: the script's own) with its output on
    stderr; return its wall time in seconds."""
    if shutil.which("go") is None:
        raise UsageError(
            f"building the dev cluster's servers needs {GO_VERSION_HINT}, and `go` is not on PATH: "
            "install Go (https://go.dev/dl/) and run the command again, or point KERNELFLEET_BIN_DIR "
            "at a directory that holds the built servers"
        )
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), *components],
        stdout=sys.stderr if echo else subprocess.DEVNULL,
        stderr=sys.stderr if echo else subprocess.DEVNULL,
        check=False,
    )
    if result.returncode != 0:
        raise UsageError(
            f"building the servers failed (exit {result.returncode}; the messages above say which); "
            f"fix the cause and run again: finished servers are kept in {bin_dir()}"
        )
    return time.monotonic() - started
