"""What `kernelfleet dev-cluster check` asks a running dev cluster: does the API server answer,
are the GPU nodes Ready, are the CRDs there, is the store's bucket reachable."""

from __future__ import annotations

from typing import Any

from kernelfleet.core.resources import GROUP
from kernelfleet.operator.devcluster._cluster import BUCKET, ClusterState

CRDS = (f"optimizationjobs.{GROUP}", f"trainingruns.{GROUP}")


def cluster_health(state: ClusterState) -> list[tuple[str, bool]]:
    """One (line, ok) per thing checked; never raises for an unhealthy cluster."""
    from kubernetes import client, config

    lines: list[tuple[str, bool]] = []
    try:
        api_client = config.new_client_from_config(config_file=state.kubeconfig)
    except Exception as error:
        return [(f"API server: cannot read {state.kubeconfig}: {error}", False)]
    try:
        core: Any = client.CoreV1Api(api_client)
        try:
            nodes = core.list_node(_request_timeout=5).items
        except Exception as error:
            return [(f"API server {state.api_server}: not answering ({error})", False)]
        lines.append((f"API server {state.api_server}: answering", True))
        ready = [
            node
            for node in nodes
            if any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        ]
        lines.append((f"nodes: {len(ready)} of {len(nodes)} Ready", bool(nodes) and len(ready) == len(nodes)))
        extensions: Any = client.ApiextensionsV1Api(api_client)
        names = {crd.metadata.name for crd in extensions.list_custom_resource_definition().items}
        absent = [name for name in CRDS if name not in names]
        lines.append((f"CRDs: missing {', '.join(absent)}", False) if absent else ("CRDs: installed", True))
    finally:
        api_client.close()
    from minio import Minio

    store = Minio(
        endpoint=state.s3_endpoint,
        access_key=state.s3_access_key,
        secret_key=state.s3_secret_key,
        secure=False,
    )
    try:
        present = store.bucket_exists(bucket_name=BUCKET)
        lines.append(
            (f"store {state.store_url} at {state.s3_endpoint}: {'ok' if present else 'no bucket'}", present)
        )
    except Exception as error:
        lines.append((f"store at {state.s3_endpoint}: not answering ({error})", False))
    return lines
