"""kernelfleet.operator.client: the cluster as a user's command line sees it.

`kernelfleet submit`, `status`, `logs`, and the run locator through which `kernelfleet results
NAME` and `report NAME` find the store of a cluster resource. It talks to the API server as the
user (their kubeconfig), never as the operator, and reads results from the store directly.
"""

from kernelfleet.operator.client._connect import Cluster, api_errors, connect, kubeconfig_path
from kernelfleet.operator.client._resources import find_resource, list_resources, locate_run, run_location_of

__all__ = [
    "Cluster",
    "api_errors",
    "connect",
    "find_resource",
    "kubeconfig_path",
    "list_resources",
    "locate_run",
    "run_location_of",
]
