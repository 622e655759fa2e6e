"""Store locations are URLs: a plain path or file://..., and s3://bucket/prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import StoreURL, parse_store_url


def test_a_relative_path_is_resolved_against_the_working_directory(tmp_path: Path) -> None:
    assert parse_store_url(".kernelfleet", cwd=tmp_path) == StoreURL(
        "file", path=str(tmp_path / ".kernelfleet")
    )
    assert parse_store_url("a/../b", cwd=tmp_path).path == str(tmp_path / "b")
    assert parse_store_url(tmp_path / "x").path == str(tmp_path / "x")


def test_file_urls(tmp_path: Path) -> None:
    assert parse_store_url("file:///srv/store").path == "/srv/store"
    assert parse_store_url("file://localhost/srv/store").path == "/srv/store"
    assert parse_store_url("file:///srv/with%20space").path == "/srv/with space"
    assert parse_store_url("file:rel", cwd=tmp_path).path == str(tmp_path / "rel")
    assert str(parse_store_url("file:///srv/store/")) == "file:///srv/store"


def test_s3_urls() -> None:
    assert parse_store_url("s3://kernelfleet") == StoreURL("s3", bucket="kernelfleet", prefix="")
    url = parse_store_url("s3://kernelfleet/runs/prod/")
    assert (url.bucket, url.prefix, str(url)) == ("kernelfleet", "runs/prod", "s3://kernelfleet/runs/prod")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "empty"),
        ("gs://bucket/x", "unsupported scheme"),
        ("file://otherhost/x", "file:///absolute"),
        ("s3://Bad_Bucket/x", "not a valid bucket"),
        ("s3://ab", "not a valid bucket"),
        ("s3://user:pw@bucket/x", "KERNELFLEET_S3_ENDPOINT"),
        ("s3://bucket:9000/x", "KERNELFLEET_S3_ENDPOINT"),
        ("s3://bucket/a/../b", "invalid prefix"),
        ("s3://bucket/x?versionId=1", "query"),
    ],
)
def test_bad_urls_say_what_to_write_instead(url: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_store_url(url)
