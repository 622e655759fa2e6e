"""Faults against a real MinIO: the server dies mid-upload and comes back, wrong credentials,
a missing bucket, a server that stays down."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from minio.error import S3Error

from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.errors import StoreError
from kernelfleet.core.store import NotFound, S3Store, StoreUnavailable, open_store

MIB = 1024 * 1024
# Patient enough to outlast a restart of the server, quick enough to keep the test short.
RESTART_RETRY = RetrySettings(
    attempts=40, initial_backoff_s=0.1, max_backoff_s=0.5, deadline_s=60, refused_deadline_s=60
)
FAST_RETRY = RetrySettings(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=10)


def s3_store(
    minio: Any, url: str | None = None, env: dict[str, str] | None = None, **overrides: Any
) -> S3Store:
    config = StoreConfig.from_env({**minio.config(), **(env or {})}, **{"retry": FAST_RETRY, **overrides})
    store = open_store(url or f"s3://{minio.bucket}/runs", config)
    assert isinstance(store, S3Store)
    return store


def retry_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]


def object_names(minio: Any, bucket: str | None = None) -> list[str]:
    client = minio.client()
    return [o.object_name for o in client.list_objects(bucket_name=bucket or minio.bucket, recursive=True)]


def test_an_upload_survives_a_server_restart_and_nothing_partial_is_visible(
    minio_private: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kernelfleet.store")
    minio = minio_private
    # A short read timeout turns a request stuck on a server that is going away into a retry.
    store = s3_store(minio, retry=RESTART_RETRY, part_size=5 * MIB, parallel_parts=1, read_timeout_s=10)
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(40 * MIB))
    halfway, stopped, restarted = threading.Event(), threading.Event(), threading.Event()
    seen_during_outage: list[int | None] = []
    read_so_far = [0]

    def on_progress(count: int) -> None:
        # Hold the upload two parts in until the server is down, so the outage hits mid-upload.
        read_so_far[0] += count
        if read_so_far[0] >= 12 * MIB and not halfway.is_set():
            halfway.set()
            stopped.wait(timeout=60)

    def restart_server() -> None:
        halfway.wait(timeout=60)
        minio.server.stop()
        stopped.set()
        time.sleep(1.5)  # longer than the HTTP pool's own quick retries: the store must retry
        minio.server.start()
        # The interrupted upload must not have left a visible object behind.
        try:
            stat = minio.client().stat_object(
                bucket_name=minio.bucket, object_name="runs/ckpt/model.safetensors"
            )
            seen_during_outage.append(stat.size)
        except S3Error as error:
            assert error.code == "NoSuchKey"
            seen_during_outage.append(None)
        restarted.set()

    restarter = threading.Thread(target=restart_server, daemon=True)
    restarter.start()
    assert store.put_file("ckpt/model.safetensors", source, progress=on_progress) is True
    restarter.join(timeout=120)
    assert restarted.is_set()
    assert seen_during_outage in ([None], [source.stat().st_size])
    assert retry_warnings(caplog), "the upload should have met the outage and retried"
    assert object_names(minio) == ["runs/ckpt/model.safetensors"]
    dest = tmp_path / "back.safetensors"
    store.get_file("ckpt/model.safetensors", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()


def test_a_server_that_stays_down_is_reported_with_its_endpoint(minio_private: Any) -> None:
    minio = minio_private
    store = s3_store(minio)
    minio.server.stop()
    try:
        with pytest.raises(StoreUnavailable) as raised:
            store.put_bytes("variants/x.py", b"code")
    finally:
        minio.server.start()
    message = str(raised.value)
    assert minio.endpoint in message and f"s3://{minio.bucket}/runs/variants/x.py" in message
    assert "KERNELFLEET_S3_ENDPOINT" in message
    assert object_names(minio) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"KERNELFLEET_S3_SECRET_KEY": "not-the-secret"}, "KERNELFLEET_S3_SECRET_KEY"),
        ({"KERNELFLEET_S3_ACCESS_KEY": "not-a-user"}, "does not know the access key"),
    ],
)
def test_wrong_credentials_fail_at_once_and_write_nothing(
    minio: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict[str, str], expected: str
) -> None:
    caplog.set_level(logging.WARNING, logger="kernelfleet.store")
    store = s3_store(minio, env=change)
    source = tmp_path / "f.bin"
    source.write_bytes(b"x" * 1000)
    for attempt in (lambda: store.put_bytes("k", b"v"), lambda: store.put_file("f.bin", source)):
        with pytest.raises(StoreError) as raised:
            attempt()
        message = str(raised.value)
        assert expected in message and minio.endpoint in message and minio.bucket in message
    assert retry_warnings(caplog) == []
    assert object_names(minio) == []


def test_wrong_credentials_with_a_known_region_are_still_explained(minio: Any) -> None:
    # With a region configured there is no location request: the first answer is a HEAD's
    # bare 403, which the store refines with one listing request.
    store = s3_store(minio, env={"KERNELFLEET_S3_SECRET_KEY": "nope", "KERNELFLEET_S3_REGION": "us-east-1"})
    with pytest.raises(StoreError, match="secret key does not match"):
        store.put_bytes("k", b"v")
    assert object_names(minio) == []


def test_a_missing_bucket_is_a_clear_error_when_creating_is_not_allowed(minio: Any) -> None:
    bucket = minio.bucket + "-missing"
    store = s3_store(minio, url=f"s3://{bucket}/runs")
    with pytest.raises(StoreError) as raised:
        store.put_bytes("k", b"v")
    message = str(raised.value)
    assert f"bucket {bucket!r} does not exist" in message and "KERNELFLEET_S3_CREATE_BUCKET=true" in message
    assert minio.endpoint in message
    with pytest.raises(StoreError, match="does not exist"):
        list(store.list())
    assert not minio.client().bucket_exists(bucket_name=bucket)


def test_a_missing_bucket_is_created_when_allowed(minio: Any, tmp_path: Path) -> None:
    bucket = minio.bucket + "-made"
    store = s3_store(minio, url=f"s3://{bucket}/runs", env={"KERNELFLEET_S3_CREATE_BUCKET": "true"})
    # Until the first write, the store reads as empty.
    assert not store.exists("k") and list(store.list()) == []
    with pytest.raises(NotFound):
        store.get_bytes("k")
    assert store.put_bytes("k", b"v") is True
    assert minio.client().bucket_exists(bucket_name=bucket)
    assert store.get_bytes("k") == b"v"
    other = s3_store(minio, url=f"s3://{bucket}-2/runs", env={"KERNELFLEET_S3_CREATE_BUCKET": "true"})
    source = tmp_path / "f.bin"
    source.write_bytes(b"y" * 100)
    assert other.put_file("f.bin", source) is True
    assert object_names(minio, bucket + "-2") == ["runs/f.bin"]
