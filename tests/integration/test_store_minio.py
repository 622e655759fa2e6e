"""The S3 backend against a real MinIO server: what the contract suite cannot show generically.

Multipart uploads, checksums in object metadata, objects written by other tools, resumed
downloads, pagination, credentials from a mounted Secret, processes racing, and the
`kernelfleet store check` command.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import urllib3.exceptions

from kernelfleet.core import cli
from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.errors import StoreError
from kernelfleet.core.store import IntegrityError, ObjectConflict, S3Store, open_store
from kernelfleet.core.store._s3 import META_SHA256

FAST_RETRY = RetrySettings(attempts=4, initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=20)
MIB = 1024 * 1024


def s3_store(minio: Any, prefix: str = "runs", **overrides: Any) -> S3Store:
    config = StoreConfig.from_env(minio.config(), **{"retry": FAST_RETRY, "part_size": 5 * MIB, **overrides})
    store = open_store(f"s3://{minio.bucket}/{prefix}", config)
    assert isinstance(store, S3Store)
    return store


def raw_get(minio: Any, name: str) -> bytes:
    response = minio.client().get_object(bucket_name=minio.bucket, object_name=name)
    try:
        return bytes(response.read())
    finally:
        response.close()
        response.release_conn()


def test_objects_live_under_the_prefix_with_their_checksum(minio: Any) -> None:
    store = s3_store(minio, "team/runs")
    store.put_bytes("variants/a.py", b"print(1)\n")
    stat = minio.client().stat_object(bucket_name=minio.bucket, object_name="team/runs/variants/a.py")
    assert stat.metadata[META_SHA256] == hashlib.sha256(b"print(1)\n").hexdigest()
    assert stat.content_type == "text/x-python"
    assert store.stat("variants/a.py").sha256 == stat.metadata[META_SHA256]


def test_a_large_file_goes_up_in_parts_and_comes_back_verified(minio: Any, tmp_path: Path) -> None:
    store = s3_store(minio, parallel_parts=3)
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(17 * MIB + 123))  # four parts of 5 MiB
    sent: list[int] = []
    assert store.put_file("ckpt/model.safetensors", source, progress=sent.append) is True
    assert sum(sent) == source.stat().st_size
    etag = (
        minio.client().stat_object(bucket_name=minio.bucket, object_name="runs/ckpt/model.safetensors").etag
    )
    assert etag.endswith("-4")  # a multipart object
    dest = tmp_path / "back.safetensors"
    store.get_file("ckpt/model.safetensors", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()


def test_a_dropped_download_resumes_where_it_stopped(
    minio: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = s3_store(minio)
    payload = os.urandom(6 * MIB)
    store.put_bytes("big.bin", payload)
    client = store._client
    real_get_object = client.get_object
    offsets: list[int] = []

    class Dropping:
        """A response that delivers one chunk, then loses its connection."""

        def __init__(self, response: Any) -> None:
            self._response = response

        def stream(self, amount: int) -> Any:
            for index, chunk in enumerate(self._response.stream(amount)):
                if index == 1:
                    raise urllib3.exceptions.ProtocolError("Connection broken", ConnectionResetError())
                yield chunk

        def __getattr__(self, name: str) -> Any:
            return getattr(self._response, name)

    def get_object(**kwargs: Any) -> Any:
        offsets.append(kwargs.get("offset", 0))
        response = real_get_object(**kwargs)
        return Dropping(response) if len(offsets) == 1 else response

    monkeypatch.setattr(client, "get_object", get_object)
    dest = tmp_path / "big.bin"
    store.get_file("big.bin", dest)
    assert dest.read_bytes() == payload
    assert offsets[0] == 0 and offsets[1] > 0  # the second request asked only for the rest


def test_a_corrupt_object_is_detected_on_download(minio: Any, tmp_path: Path) -> None:
    store = s3_store(minio)
    store.put_bytes("result.json", b'{"speedup": 1.5}')
    recorded = store.stat("result.json").sha256
    forged = b'{"speedup": 9.9}'
    minio.client().put_object(
        bucket_name=minio.bucket,
        object_name="runs/result.json",
        data=io.BytesIO(forged),
        length=len(forged),
        metadata={META_SHA256: recorded},
    )
    with pytest.raises(IntegrityError):
        store.get_bytes("result.json")
    with pytest.raises(IntegrityError):
        store.get_file("result.json", tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_objects_written_by_other_tools_are_compared_by_content(minio: Any) -> None:
    minio.client().put_object(
        bucket_name=minio.bucket, object_name="runs/foreign.txt", data=io.BytesIO(b"hello"), length=5
    )
    store = s3_store(minio)
    assert store.put_bytes("foreign.txt", b"hello") is False
    with pytest.raises(ObjectConflict):
        store.put_bytes("foreign.txt", b"other")
    assert store.get_bytes("foreign.txt") == b"hello"


def test_listing_pages_through_many_objects(minio: Any) -> None:
    client = minio.client()

    def put(index: int) -> None:
        client.put_object(
            bucket_name=minio.bucket, object_name=f"runs/many/{index:05d}", data=io.BytesIO(b"x"), length=1
        )

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(put, range(1100)))  # more than one 1000-key page
    client.put_object(bucket_name=minio.bucket, object_name="elsewhere/x", data=io.BytesIO(b"x"), length=1)
    keys = list(s3_store(minio).list("many/"))
    assert keys == [f"many/{i:05d}" for i in range(1100)]


def test_credentials_from_a_mounted_secret(minio: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "accesskey").write_text(minio.access_key + "\n")
    (secret / "secretkey").write_text(minio.secret_key + "\n")
    env = {k: v for k, v in minio.config().items() if "ACCESS_KEY" not in k and "SECRET_KEY" not in k}
    env["KERNELFLEET_S3_CREDENTIALS_DIR"] = str(secret)
    store = open_store(f"s3://{minio.bucket}/x", StoreConfig.from_env(env, retry=FAST_RETRY))
    assert store.put_bytes("k", b"v") is True
    (secret / "secretkey").write_text("rotated-to-something-wrong")
    with pytest.raises(StoreError, match="KERNELFLEET_S3_CREDENTIALS_DIR"):
        store.get_bytes("k")


WRITER = """
import os, sys
from kernelfleet.core.config import StoreConfig
from kernelfleet.core.store import open_store
store = open_store(sys.argv[1], StoreConfig.from_env())
data = bytes(range(256)) * 400
print(sum(store.put_bytes(f"shared/{i}.bin", data) for i in range(10)))
"""


def test_processes_racing_on_the_same_objects_converge(minio: Any) -> None:
    env = {**os.environ, **minio.config()}
    url = f"s3://{minio.bucket}/race"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert sum(int(o) for o in outputs) >= 10  # S3 is last-writer-wins: a race may write twice
    store = s3_store(minio, "race")
    assert len(list(store.list("shared/"))) == 10
    assert all(store.get_bytes(k) == bytes(range(256)) * 400 for k in store.list("shared/"))


STORE_COMMAND = EntryPoint(
    name="store", value="kernelfleet.core.cli_store:register", group="kernelfleet.commands"
)


@pytest.fixture
def store_cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(cli, "entry_points", lambda group: [STORE_COMMAND])
    return cli.main


def test_store_check_passes_against_minio(
    minio: Any, store_cli: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in minio.config().items():
        monkeypatch.setenv(name, value)
    assert store_cli(["store", "check", f"s3://{minio.bucket}/runs"]) == 0
    out = capsys.readouterr().out
    assert "ok    connect" in out and "ok    bucket" in out and "ok    write" in out
    assert list(minio.client().list_objects(bucket_name=minio.bucket, recursive=True)) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"KERNELFLEET_S3_SECRET_KEY": "wrong-secret"}, "secret key does not match"),
        ({"KERNELFLEET_S3_ACCESS_KEY": "nobody"}, "does not know the access key"),
        ({"KERNELFLEET_S3_SECURE": "true"}, "KERNELFLEET_S3_SECURE=false"),
    ],
)
def test_store_check_says_what_is_wrong(
    minio: Any,
    store_cli: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, str],
    expected: str,
) -> None:
    for name, value in {**minio.config(), **change}.items():
        monkeypatch.setenv(name, value)
    assert store_cli(["store", "check", f"s3://{minio.bucket}/runs"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  connect" in out and expected in out and minio.endpoint in out


def test_store_check_reports_a_missing_bucket(
    minio: Any, store_cli: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in minio.config().items():
        monkeypatch.setenv(name, value)
    assert store_cli(["store", "check", "s3://no-such-bucket-here/runs"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  bucket" in out and "KERNELFLEET_S3_CREATE_BUCKET=true" in out
