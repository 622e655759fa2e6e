"""Re-exported from `kernelfleet.operator.devcluster`."""

from kernelfleet.operator.devcluster._pki import Pki

__all__ = ["Pki"]
