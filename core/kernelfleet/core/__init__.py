"""kernelfleet.core: the models, the artifact store and the command-line root.

Everything that several components share lives here, and nothing here imports another
component: the operator image installs core without torch, and the worker image installs it
without kopf.
"""

__version__ = "0.1.0"
