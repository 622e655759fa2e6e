"""Real servers for the tests: MinIO, etcd, kube-apiserver and the rest of a control plane.

Each is a binary built from its Go module by `scripts/build-test-binaries.sh` (never a mock),
started on 127.0.0.1 on free ports in a temporary directory, waited on until it answers, and
stopped afterwards. The pytest fixtures in `tests/conftest.py` are thin wrappers over these.
"""
