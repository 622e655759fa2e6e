"""Store locations as URLs: a plain path or `file://...`, and `s3://bucket/prefix`.

One string names a store everywhere (command line, custom resources, environment), so the
same job spec runs against a laptop directory or a cluster's MinIO. The S3 endpoint is not
part of the URL: it comes from configuration, so a URL stays valid when the endpoint moves.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kernelfleet.core.errors import UsageError
from kernelfleet.core.store._keys import check_key

# S3's bucket naming rules: 3-63 characters, lowercase letters, digits, dots and hyphens.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store location: `scheme` is 'file' (with `path`) or 's3' (with `bucket`, `prefix`)."""

    scheme: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    def __str__(self) -> str:
        if self.scheme == "file":
            return Path(self.path).as_uri()
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_store_url(url: str | os.PathLike[str], cwd: Path | None = None) -> StoreURL:
    """Parse a store URL; relative paths are resolved against `cwd` (default: the working directory)."""
    if isinstance(url, os.PathLike):
        return _local(Path(url), cwd)
    text = str(url).strip()
    if not text:
        raise UsageError("the store URL is empty: give a directory, file:///abs/dir or s3://bucket/prefix")
    match = _SCHEME.match(text)
    if match is None:
        if text.startswith("file:"):  # file:relative/dir
            return _local(Path(unquote(text[len("file:") :])), cwd)
        return _local(Path(text), cwd)
    scheme = match.group(1).lower()
    parts = urlsplit(text)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(
                f"store URL {text!r} names host {parts.netloc!r}: file:// URLs are local; write "
                "file:///absolute/dir (three slashes), or use s3:// for a remote store"
            )
        if parts.query or parts.fragment:
            raise UsageError(f"store URL {text!r} has a query or fragment: remove it")
        return _local(Path(unquote(parts.path)), cwd)
    if scheme == "s3":
        return _s3(text, parts.netloc, unquote(parts.path), bool(parts.query or parts.fragment))
    raise UsageError(
        f"store URL {text!r} has the unsupported scheme {scheme!r}: use a directory, "
        "file:///abs/dir or s3://bucket/prefix (the S3 endpoint comes from KERNELFLEET_S3_ENDPOINT)"
    )


def _local(path: Path, cwd: Path | None) -> StoreURL:
    path = path.expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    return StoreURL(scheme="file", path=os.path.normpath(path))


def _s3(text: str, bucket: str, path: str, extra: bool) -> StoreURL:
    if extra:
        raise UsageError(f"store URL {text!r} has a query or fragment: use s3://bucket/prefix")
    if "@" in bucket or ":" in bucket:
        raise UsageError(
            f"store URL {text!r} carries credentials or a port: put the endpoint in "
            "KERNELFLEET_S3_ENDPOINT and the keys in KERNELFLEET_S3_ACCESS_KEY/SECRET_KEY"
        )
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UsageError(
            f"store URL {text!r}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, "
            "digits, dots or hyphens, starting and ending with a letter or digit)"
        )
    prefix = path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except UsageError as error:
            raise UsageError(f"store URL {text!r} has an invalid prefix: {error}") from None
    return StoreURL(scheme="s3", bucket=bucket, prefix=prefix)
