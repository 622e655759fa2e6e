"""Re-exported from `kernelfleet.operator.devcluster`, where the servers live so that users can
run them too (`kernelfleet dev-cluster up`)."""

from kernelfleet.operator.devcluster._process import (
    BUILD_HINT,
    BinaryMissing,
    ProcessRecord,
    ServerProcess,
    bin_dir,
    binary,
    free_port,
    remove_tree,
    wait_for,
)

__all__ = [
    "BUILD_HINT",
    "BinaryMissing",
    "ProcessRecord",
    "ServerProcess",
    "bin_dir",
    "binary",
    "free_port",
    "remove_tree",
    "wait_for",
]
