"""The artifact store: every result that costs GPU time is kept, found again, and never lost.

One interface, `Store`, and two backends chosen by URL:

- a directory (a plain path or `file:///...`), the embedded default: `.kernelfleet/` under
  the working directory unless `KERNELFLEET_STORE` says otherwise;
- S3-compatible object storage (`s3://bucket/prefix`) through the `minio` client, with the
  endpoint and credentials from `KERNELFLEET_S3_*` or a mounted Kubernetes Secret.

Objects are immutable and writes idempotent, so retries, resumed jobs and racing writers
all converge on one object; a manifest or summary written last marks a group complete.
Transient failures are retried with backoff; permanent ones fail at once with a message that
names the endpoint, bucket and key and says what to check. See docs/store.md.

    store = open_store("s3://kernelfleet/runs")
    digest = store.put_variant(code)
    store.put_result("optimizationjobs/ns/name/uid", result)
"""

from __future__ import annotations

import os

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.errors import StoreError
from kernelfleet.core.store._base import (
    CheckStep,
    ObjectInfo,
    OnCorrupt,
    Progress,
    Store,
    encode_json,
    variant_key,
)
from kernelfleet.core.store._errors import (
    CorruptObject,
    IntegrityError,
    NotFound,
    ObjectConflict,
    ResultConflict,
    StoreUnavailable,
)
from kernelfleet.core.store._keys import check_key, join_key
from kernelfleet.core.store._lease import LeaseHeld, LeaseLost, LeaseRecord, RunLease, current_lease
from kernelfleet.core.store._local import LocalStore
from kernelfleet.core.store._manifest import MANIFEST_NAME, DirManifest, ManifestEntry
from kernelfleet.core.store._s3 import S3Store
from kernelfleet.core.store._urls import StoreURL, parse_store_url
from kernelfleet.core.store._verify import Finding, RunCheck, verify_run

__all__ = [
    "MANIFEST_NAME",
    "CheckStep",
    "CorruptObject",
    "DirManifest",
    "Finding",
    "IntegrityError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecord",
    "LocalStore",
    "ManifestEntry",
    "NotFound",
    "ObjectConflict",
    "ObjectInfo",
    "OnCorrupt",
    "Progress",
    "ResultConflict",
    "RunCheck",
    "RunLease",
    "S3Store",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreURL",
    "StoreUnavailable",
    "check_key",
    "current_lease",
    "encode_json",
    "join_key",
    "open_store",
    "parse_store_url",
    "variant_key",
    "verify_run",
]


def open_store(url: str | os.PathLike[str] | None = None, config: StoreConfig | None = None) -> Store:
    """Open the store at `url` (default: the configured one, `.kernelfleet/` unless set).

    Opening does no I/O: a wrong endpoint or bad credentials show up at the first operation,
    or at once with `kernelfleet store check URL`.
    """
    config = config if config is not None else StoreConfig.from_env()
    location = parse_store_url(url if url is not None else config.url)
    if location.scheme == "s3":
        return S3Store(location, config)
    return LocalStore(location.path, fsync=config.local_fsync)
