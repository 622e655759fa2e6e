"""The S3 backend, through the `minio` client: MinIO by default, any S3-compatible endpoint.

S3 makes an object visible only when its single PUT, or its whole multipart upload,
completes, so readers never see part of one. Immutability is checked with a HEAD before
each write (last-writer-wins on a race is harmless: racing writers of one key carry the same
content). Each object records its sha256 as user metadata, which makes the identical-object
check a HEAD instead of a download, and lets every download verify what it received.

Calls use keyword arguments only: minio 8 makes every argument keyword-only and renames
some, and the distribution pins `minio<8`.

The HTTP pool retries a connection or a 5xx twice within one request (cheap, and it keeps a
multipart upload going through a blip); everything longer is the store's own retry loop
(`_retry.py`), which re-runs the whole operation. An interrupted download resumes from the
bytes it already has with a ranged GET.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import mimetypes
import os
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import certifi
import urllib3
import urllib3.exceptions
from minio import Minio
from minio.credentials import Credentials, Provider
from minio.error import S3Error

from kernelfleet.core.config import ACCESS_KEY_FILE, SECRET_KEY_FILE, StoreConfig, read_credentials_dir
from kernelfleet.core.errors import KernelfleetError, StoreError, UsageError
from kernelfleet.core.store._base import CHUNK, CheckStep, ObjectInfo, Progress, Store, file_sha256
from kernelfleet.core.store._errors import (
    CorruptObject,
    IntegrityError,
    NotFound,
    ObjectConflict,
    StoreUnavailable,
)
from kernelfleet.core.store._keys import TEMP_MARK, check_key, check_prefix
from kernelfleet.core.store._retry import GaveUp, Retrier, describe
from kernelfleet.core.store._urls import StoreURL

log = logging.getLogger(__name__)

T = TypeVar("T")

META_SHA256 = "x-amz-meta-kernelfleet-sha256"
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
MIB = 1024 * 1024
_BUCKET_EXISTS_CODES = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}


class SecretDirCredentials(Provider):
    """Credentials from a mounted Kubernetes Secret, read again whenever the files change.

    Kubernetes updates a mounted Secret in place when it is rotated; re-reading on change lets
    a long-running pod pick up the new key without a restart.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._stamp: tuple[int, ...] | None = None
        self._credentials: Credentials | None = None

    def _current_stamp(self) -> tuple[int, ...] | None:
        # Kubernetes rotates by swapping a symlink to new files: the inode changes with the content.
        stamp: list[int] = []
        try:
            for name in (ACCESS_KEY_FILE, SECRET_KEY_FILE):
                info = (self._directory / name).stat()
                stamp += [info.st_ino, info.st_size, info.st_mtime_ns]
        except OSError:
            return None
        return tuple(stamp)

    def retrieve(self) -> Credentials:
        stamp = self._current_stamp()
        with self._lock:
            if self._credentials is None or stamp is None or stamp != self._stamp:
                access, secret = read_credentials_dir(self._directory)
                self._credentials = Credentials(access_key=access, secret_key=secret)
                self._stamp = stamp
            return self._credentials


class _CountingReader:
    """A file wrapper that reports bytes read, so a multipart upload can show progress."""

    def __init__(self, handle: BinaryIO, progress: Progress | None) -> None:
        self._handle = handle
        self._progress = progress
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self.count += len(data)
        if self._progress is not None and data:
            self._progress(len(data))
        return data

    def rewind_progress(self) -> None:
        if self._progress is not None and self.count:
            self._progress(-self.count)
        self.count = 0


def _content_type(key: str) -> str:
    guessed, _ = mimetypes.guess_type(key, strict=False)
    return guessed or "application/octet-stream"


class S3Store(Store):
    """A store under `s3://bucket/prefix` on the endpoint from the configuration."""

    def __init__(self, location: StoreURL, config: StoreConfig) -> None:
        if location.scheme != "s3":
            raise UsageError(f"S3Store needs an s3:// URL, got {location}")
        if config.endpoint_host is None:
            raise UsageError(
                f"the store {location} is on S3, but no endpoint is configured: set "
                "KERNELFLEET_S3_ENDPOINT to the server's host:port (e.g. minio.kernelfleet.svc:9000)"
            )
        self._location = location
        self._bucket = location.bucket
        self._prefix = location.prefix
        self._config = config
        self._endpoint = config.endpoint_host
        self._retrier = Retrier(config.retry)
        self._lock = threading.Lock()
        self._client_pid = -1
        self._client_obj: Minio | None = None

    # ------------------------------------------------------------------ plumbing

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def _client(self) -> Minio:
        # A Minio client is thread-safe but must not cross a fork: each process builds its own.
        if self._client_obj is None or self._client_pid != os.getpid():
            with self._lock:
                if self._client_obj is None or self._client_pid != os.getpid():
                    self._client_obj = self._build_client()
                    self._client_pid = os.getpid()
        return self._client_obj

    def _build_client(self) -> Minio:
        config = self._config
        ca_file = (
            str(config.ca_file) if config.ca_file else os.environ.get("SSL_CERT_FILE") or certifi.where()
        )
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s),
            maxsize=config.max_connections,
            cert_reqs="CERT_REQUIRED",
            ca_certs=ca_file,
            retries=urllib3.Retry(
                total=2,
                connect=2,
                read=0,
                status=2,
                other=0,
                backoff_factor=0.2,
                status_forcelist=(500, 502, 503, 504),
                allowed_methods=None,  # every S3 request here is safe to repeat
                raise_on_status=False,  # hand the final 5xx to minio, which reads its S3 error code
            ),
        )
        static = config.static_credentials()
        provider = (
            SecretDirCredentials(config.credentials_dir)
            if static is None and config.credentials_dir
            else None
        )
        return Minio(
            endpoint=self._endpoint,
            access_key=static[0] if static else None,
            secret_key=static[1] if static else None,
            secure=config.use_tls,
            region=config.region,
            http_client=http,
            credentials=provider,
        )

    def _name(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    @property
    def url(self) -> str:
        return str(self._location)

    def url_for(self, key: str) -> str:
        return f"s3://{self._bucket}/{self._name(key)}" if key else self.url

    def _where(self, key: str | None) -> str:
        target = self.url_for(key) if key is not None else f"s3://{self._bucket}"
        return f"{target} at {self._config.endpoint_url}"

    def _run(self, op: str, key: str | None, fn: Callable[[], T], *, write: bool = False) -> T:
        """Run one S3 operation with retries; translate failures into kernelfleet errors."""
        try:
            return self._retrier.call(fn, f"{op} {self._where(key)}")
        except Exception as error:
            if write and self._config.create_bucket and _is_code(error, "NoSuchBucket"):
                self._create_bucket()
                return self._run(op, key, fn)
            if isinstance(error, KernelfleetError):
                raise
            raise self._translate(error, op, key) from error

    def _translate(self, error: BaseException, op: str, key: str | None) -> KernelfleetError:
        if isinstance(error, KernelfleetError):
            return error
        where = self._where(key)
        config = self._config
        if isinstance(error, GaveUp):
            return StoreUnavailable(
                f"{op} {where} failed after {error.attempts} attempts over {error.seconds:.0f}s: "
                f"{describe(error.last)}. Check that the S3 server is running and reachable from here, "
                f"and that KERNELFLEET_S3_ENDPOINT ({config.endpoint}) and KERNELFLEET_S3_SECURE "
                f"({'true' if config.use_tls else 'false'}) match it"
            )
        if isinstance(error, S3Error):
            code = error.code
            if code == "NoSuchKey":
                return NotFound(f"no object at {self.url_for(key or '')}")
            if code == "NoSuchBucket":
                return StoreError(
                    f"{op} {where} failed: bucket {self._bucket!r} does not exist. Create it (for "
                    f"MinIO: `mc mb ALIAS/{self._bucket}`), correct the bucket in the store URL, or set "
                    "KERNELFLEET_S3_CREATE_BUCKET=true to let kernelfleet create it"
                )
            if code == "InvalidAccessKeyId":
                return StoreError(
                    f"{op} {where} failed: the server does not know the access key. Check "
                    f"{config.credentials_source()}"
                )
            if code == "SignatureDoesNotMatch":
                return StoreError(
                    f"{op} {where} failed: the secret key does not match the access key. Check "
                    f"{config.credentials_source()}"
                )
            if code == "AccessDenied":
                if op == "create bucket":
                    return StoreError(
                        f"bucket {self._bucket!r} does not exist at {config.endpoint_url} and these "
                        "credentials may not create it: create it with an administrator account"
                    )
                return StoreError(
                    f"{op} {where} failed: access denied. The credentials ({config.credentials_source()}) "
                    f"are wrong, or their policy does not allow this: kernelfleet needs s3:GetObject, "
                    f"s3:PutObject and s3:ListBucket on arn:aws:s3:::{self._bucket}/{self._prefix}*"
                )
            if code == "RequestTimeTooSkewed":
                return StoreError(
                    f"{op} {where} failed: this machine's clock is too far from the server's; sync it (NTP)"
                )
            return StoreError(f"{op} {where} failed: {code}: {error.message}")
        if _is_tls_error(error):
            return StoreError(
                f"{op} {where} failed: the TLS connection failed ({describe(error)}). If the server "
                "speaks plain HTTP set KERNELFLEET_S3_SECURE=false; if its certificate comes from a "
                "private authority set KERNELFLEET_S3_CA_FILE to that authority's PEM bundle"
            )
        return StoreError(f"{op} {where} failed: {describe(error)}")

    def _refine_denied(self, error: S3Error) -> S3Error:
        """A HEAD answers 403 without a body, so minio says AccessDenied even for a wrong key.
        One listing request returns the server's real error code."""
        try:
            next(
                iter(self._client.list_objects(bucket_name=self._bucket, prefix=self._name(TEMP_MARK))), None
            )
        except S3Error as precise:
            if precise.code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket"):
                return precise
        except Exception:  # the probe only refines a message: keep the original error
            pass
        return error

    def _create_bucket(self) -> None:
        def make() -> None:
            try:
                self._client.make_bucket(bucket_name=self._bucket, location=self._config.region)
                log.info("created bucket %s at %s", self._bucket, self._config.endpoint_url)
            except S3Error as error:
                if error.code not in _BUCKET_EXISTS_CODES:  # another writer created it first
                    raise

        with self._lock:
            self._run("create bucket", None, make)

    # ------------------------------------------------------------------ primitives

    def _head(self, key: str) -> Any | None:
        """The object's stat, or None when it does not exist."""
        name = self._name(check_key(key))

        def head() -> Any | None:
            try:
                return self._client.stat_object(bucket_name=self._bucket, object_name=name)
            except S3Error as error:
                if error.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                    return None
                if error.code == "NoSuchBucket" and self._config.create_bucket:
                    return None  # an empty store whose bucket the first write creates
                if error.code == "AccessDenied":
                    raise self._refine_denied(error) from None
                raise

        return self._run("stat", key, head)

    def _compare(self, key: str, found: Any, digest: str) -> bool:
        recorded = found.metadata.get(META_SHA256) if found.metadata is not None else None
        if recorded is None:  # written by another tool: compare the content itself
            recorded = self._remote_sha256(key)
        if recorded == digest:
            return False
        raise ObjectConflict(
            f"a different object already exists at {self._where(key)}: objects are immutable, so write "
            "the new content under a new key"
        )

    def _remote_sha256(self, key: str) -> str:
        name = self._name(key)

        def fetch() -> str:
            digest = hashlib.sha256()
            response = self._client.get_object(bucket_name=self._bucket, object_name=name)
            try:
                for chunk in response.stream(CHUNK):
                    digest.update(chunk)
            finally:
                response.close()
                response.release_conn()
            return digest.hexdigest()

        return self._run("read", key, fetch)

    def put_bytes(self, key: str, data: bytes) -> bool:
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        found = self._head(key)
        if found is not None:
            return self._compare(key, found, digest)
        self._overwrite(key, data)
        return True

    def _put_file(self, key: str, path: Path, progress: Progress | None) -> tuple[bool, str, int]:
        try:
            if path.is_dir():
                raise UsageError(f"cannot upload {path}: it is a directory (use upload_dir)")
            size = path.stat().st_size
            digest = file_sha256(path)
        except FileNotFoundError:
            raise UsageError(f"cannot upload {path}: no such file") from None
        found = self._head(key)
        if found is not None:
            written = self._compare(key, found, digest)
            if progress is not None:
                progress(size)
            return written, digest, size
        name = self._name(key)
        # Keep within S3's 10,000 parts for very large files.
        part_size = max(self._config.part_size, math.ceil(size / MAX_PARTS / MIB) * MIB)

        def upload() -> None:
            with open(path, "rb") as handle:
                reader = _CountingReader(handle, progress)
                try:
                    self._client.put_object(
                        bucket_name=self._bucket,
                        object_name=name,
                        data=reader,  # type: ignore[arg-type]  # only read() is used
                        length=size,
                        part_size=part_size,
                        num_parallel_uploads=self._config.parallel_parts,
                        content_type=_content_type(key),
                        metadata={META_SHA256: digest},
                    )
                except BaseException:
                    reader.rewind_progress()
                    raise

        self._run("upload", key, upload, write=True)
        return True, digest, size

    def get_bytes(self, key: str) -> bytes:
        return self._checked(key, recorded_required=False)

    def get_record(self, key: str) -> bytes:
        return self._checked(key, recorded_required=True)

    def _checked(self, key: str, *, recorded_required: bool) -> bytes:
        """The object's bytes, matched against their recorded sha256 (when there is one, or
        always with `recorded_required`: an object another tool wrote has none)."""
        data, recorded = self._fetch(key)
        if recorded is None and recorded_required:
            raise CorruptObject(
                f"{self._where(key)} has no recorded sha256: kernelfleet did not write it (it was "
                "replaced or copied by another tool), so it is not trusted",
                key,
            )
        if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
            raise CorruptObject(
                f"{self._where(key)} does not match its recorded sha256: the object or the transfer "
                "is corrupt",
                key,
            )
        return data

    def _raw_bytes(self, key: str) -> bytes:
        return self._fetch(key)[0]

    def _overwrite(self, key: str, data: bytes) -> None:
        name = self._name(check_key(key))
        digest = hashlib.sha256(data).hexdigest()
        self._run(
            "put",
            key,
            lambda: self._client.put_object(
                bucket_name=self._bucket,
                object_name=name,
                data=io.BytesIO(data),
                length=len(data),
                content_type=_content_type(key),
                metadata={META_SHA256: digest},
            ),
            write=True,
        )

    def _fetch(self, key: str) -> tuple[bytes, str | None]:
        """The object's bytes and the sha256 recorded with it, if any."""
        name = self._name(check_key(key))

        def fetch() -> tuple[bytes, str | None]:
            try:
                response = self._client.get_object(bucket_name=self._bucket, object_name=name)
            except S3Error as error:
                if error.code == "NoSuchBucket" and self._config.create_bucket:
                    raise NotFound(
                        f"no object at {self.url_for(key)} (its bucket does not exist yet)"
                    ) from None
                raise
            try:
                return response.read(), response.headers.get(META_SHA256)
            finally:
                response.close()
                response.release_conn()

        data, recorded = self._run("get", key, fetch)
        return data, recorded

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def stat(self, key: str) -> ObjectInfo:
        found = self._head(key)
        if found is None:
            raise NotFound(f"no object at {self.url_for(key)}")
        recorded = found.metadata.get(META_SHA256) if found.metadata is not None else None
        return ObjectInfo(key=key, size=int(found.size or 0), sha256=recorded)

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        full = self._name(prefix) if prefix else (self._prefix + "/" if self._prefix else "")
        strip = len(self._prefix) + 1 if self._prefix else 0
        attempts = self._retrier.start()
        last: str | None = None
        while True:
            try:
                for found in self._client.list_objects(
                    bucket_name=self._bucket, prefix=full or None, recursive=True, start_after=last
                ):
                    name = found.object_name
                    if name is None or found.is_dir:
                        continue
                    last = name
                    attempts.progressed()
                    yield name[strip:]
                return
            except Exception as error:
                if self._config.create_bucket and _is_code(error, "NoSuchBucket"):
                    return
                try:
                    attempts.failed(error, f"list {self._where(prefix)}")
                except KernelfleetError:
                    raise
                except Exception as final:
                    raise self._translate(final, "list", prefix) from final

    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        info = self.stat(key)
        if sha256 is not None and info.sha256 is not None and sha256 != info.sha256:
            raise IntegrityError(
                f"{self._where(key)} records sha256 {info.sha256}, but {sha256} was expected: it is not "
                "the object the manifest describes"
            )
        expected = sha256 or info.sha256
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        temp = dest.parent / f"{TEMP_MARK}{uuid.uuid4().hex}"
        name = self._name(key)
        digest = hashlib.sha256()
        attempts = self._retrier.start()
        written = 0
        try:
            with open(temp, "wb") as handle:
                while True:
                    try:
                        # A ranged GET resumes where a dropped connection left off.
                        response = self._client.get_object(
                            bucket_name=self._bucket, object_name=name, offset=written
                        )
                        try:
                            for chunk in response.stream(CHUNK):
                                handle.write(chunk)
                                digest.update(chunk)
                                written += len(chunk)
                                if progress is not None:
                                    progress(len(chunk))
                                attempts.progressed()
                        finally:
                            response.close()
                            response.release_conn()
                        break
                    except Exception as error:
                        if isinstance(error, OSError) and not isinstance(
                            error, ConnectionError | TimeoutError
                        ):
                            raise StoreError(f"cannot write {dest}: {error.strerror or error}") from None
                        try:
                            attempts.failed(error, f"download {self._where(key)}")
                        except KernelfleetError:
                            raise
                        except Exception as final:
                            raise self._translate(final, "download", key) from final
            if written != info.size or (expected is not None and digest.hexdigest() != expected):
                raise IntegrityError(
                    f"{self._where(key)} arrived with {written} bytes and sha256 {digest.hexdigest()}, "
                    f"expected {info.size} bytes and sha256 {expected}: the object or the transfer is "
                    f"corrupt; {dest} was left as it was"
                )
            os.replace(temp, dest)
        finally:
            temp.unlink(missing_ok=True)

    def _delete(self, key: str) -> None:
        name = self._name(check_key(key))
        self._run(
            "delete", key, lambda: self._client.remove_object(bucket_name=self._bucket, object_name=name)
        )

    def _preflight(self) -> Iterator[CheckStep]:
        def bucket_exists() -> bool:
            try:
                return bool(self._client.bucket_exists(bucket_name=self._bucket))
            except S3Error as error:
                if error.code == "AccessDenied":
                    raise self._refine_denied(error) from None
                raise

        config = self._config
        try:
            exists = self._run("reach bucket", None, bucket_exists)
        except KernelfleetError as error:
            yield CheckStep("connect", False, str(error))
            return
        yield CheckStep(
            "connect",
            True,
            f"reached {config.endpoint_url} with credentials from {config.credentials_source()}",
        )
        if exists:
            yield CheckStep("bucket", True, f"bucket {self._bucket!r} exists")
        elif config.create_bucket:
            yield CheckStep(
                "bucket",
                True,
                f"bucket {self._bucket!r} does not exist; the first write creates it "
                "(KERNELFLEET_S3_CREATE_BUCKET is on)",
            )
        else:
            yield CheckStep(
                "bucket",
                False,
                f"bucket {self._bucket!r} does not exist at {config.endpoint_url}: create it (for MinIO: "
                f"`mc mb ALIAS/{self._bucket}`) or set KERNELFLEET_S3_CREATE_BUCKET=true",
            )


def _is_code(error: BaseException, code: str) -> bool:
    return isinstance(error, S3Error) and error.code == code


def _is_tls_error(error: BaseException) -> bool:
    if isinstance(error, urllib3.exceptions.MaxRetryError) and error.reason is not None:
        return _is_tls_error(error.reason)
    return isinstance(error, urllib3.exceptions.SSLError | ssl.SSLError)
