"""Re-exported from `kernelfleet.operator.devcluster.podrunner`, where the pod runner lives so
that the dev cluster (`kernelfleet dev-cluster up`) runs worker pods the way the tests do."""

from kernelfleet.operator.devcluster.podrunner import PodRunner, RunnerNode, wait_until

__all__ = ["PodRunner", "RunnerNode", "wait_until"]
