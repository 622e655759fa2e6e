#!/usr/bin/env bash
# Builds the servers the integration and e2e tiers and the dev cluster run (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kwok, helm, MinIO, the JobSet controller) into
# ~/.cache/kernelfleet/bin.
# The script itself ships with the operator package, so that `kernelfleet dev-cluster up` can
# build them on a machine without this checkout; this is the path `make` and CI know.
exec "$(dirname "$0")/../operator/kernelfleet/operator/devcluster/build-binaries.sh" "$@"
