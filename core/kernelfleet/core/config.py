"""Configuration of the artifact store, read from the environment.

A worker pod, the operator and a laptop all find the store the same way: a URL (a path,
`file://...` or `s3://bucket/prefix`) plus, for S3, an endpoint and credentials from
`KERNELFLEET_S3_*` variables or from a mounted Kubernetes Secret. The Secret's files are read
again whenever they change, so a rotated key takes effect without restarting a pod. Secrets
are held as `SecretStr`, so printing a configuration never shows them.

| variable | meaning |
| --- | --- |
| `KERNELFLEET_STORE` | the default store URL (`.kernelfleet` under the working directory) |
| `KERNELFLEET_S3_ENDPOINT` | `host:port`, or `http://host:port` / `https://host:port` |
| `KERNELFLEET_S3_ACCESS_KEY`, `KERNELFLEET_S3_SECRET_KEY` | credentials |
| `KERNELFLEET_S3_CREDENTIALS_DIR` | a mounted Secret with files `accesskey` and `secretkey` |
| `KERNELFLEET_S3_SECURE` | `true` (TLS, the default) or `false` (plain HTTP) |
| `KERNELFLEET_S3_REGION` | the region; left out, the client asks the server once per bucket |
| `KERNELFLEET_S3_CA_FILE` | a PEM bundle for a server with a private certificate authority |
| `KERNELFLEET_S3_CREATE_BUCKET` | `true` lets kernelfleet create a missing bucket (default `false`) |
| `KERNELFLEET_S3_RETRY_ATTEMPTS`, `KERNELFLEET_S3_RETRY_DEADLINE_S` | how long to ride out an outage |
| `KERNELFLEET_S3_RETRY_REFUSED_S` | how long a refused connection is retried (3 s) |

Explicit keys win over the credentials directory, so a developer can override a mounted
Secret for one command.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kernelfleet.core.errors import UsageError

DEFAULT_STORE_URL = ".kernelfleet"
ACCESS_KEY_FILE = "accesskey"
SECRET_KEY_FILE = "secretkey"
MIN_PART_SIZE = 5 * 1024 * 1024  # S3's smallest multipart part

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise UsageError(f"{name}={value!r} is not a boolean: set it to 'true' or 'false'")


def _parse_number(name: str, value: str, kind: type[int] | type[float]) -> float:
    try:
        number = kind(value.strip())
    except ValueError:
        raise UsageError(f"{name}={value!r} is not a number: set it to e.g. '10'") from None
    if number <= 0:
        raise UsageError(f"{name}={value!r} must be positive")
    return number


class RetrySettings(BaseModel):
    """How long transient failures (connection refused, timeouts, 5xx, SlowDown) are retried.

    The delay doubles from `initial_backoff_s` up to `max_backoff_s`, with jitter so that many
    workers do not hammer a recovering server in step. Whichever of `attempts` and
    `deadline_s` runs out first ends the retrying. The defaults ride out a slow or overloaded
    server (timeouts, 5xx). A refused connection means nothing listens at the endpoint (a wrong
    endpoint, a server not started): it is retried only for `refused_deadline_s`, so that the
    message comes in seconds; raise it to ride out a server's restart.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attempts: int = Field(default=10, ge=1)
    initial_backoff_s: float = Field(default=0.5, ge=0)
    max_backoff_s: float = Field(default=30.0, ge=0)
    deadline_s: float = Field(default=180.0, gt=0)
    refused_deadline_s: float = Field(
        default=3.0, gt=0, description="Seconds a refused connection is retried, within deadline_s."
    )


class StoreConfig(BaseModel):
    """Where the store is and how to reach it. Build it with `StoreConfig.from_env()`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(default=DEFAULT_STORE_URL, description="The store used when no URL is given.")
    endpoint: str | None = Field(default=None, description="S3 endpoint, 'host:port' or with a scheme.")
    access_key: SecretStr | None = None
    secret_key: SecretStr | None = None
    credentials_dir: Path | None = Field(default=None, description="A mounted Secret: accesskey, secretkey.")
    secure: bool | None = Field(default=None, description="TLS; None: from the endpoint's scheme, else on.")
    region: str | None = None
    ca_file: Path | None = Field(default=None, description="PEM bundle of a private certificate authority.")
    create_bucket: bool = Field(default=False, description="Create a missing bucket on the first write.")
    part_size: int = Field(default=32 * 1024 * 1024, ge=MIN_PART_SIZE, description="Multipart part size.")
    parallel_parts: int = Field(default=4, ge=1, description="Parts of one large file uploaded at once.")
    max_connections: int = Field(default=32, ge=1, description="Pooled connections to the endpoint.")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    read_timeout_s: float = Field(default=120.0, gt=0)
    local_fsync: bool = Field(default=True, description="fsync local objects before publishing them.")
    retry: RetrySettings = RetrySettings()

    @model_validator(mode="after")
    def _check(self) -> StoreConfig:
        if (self.access_key is None) != (self.secret_key is None):
            raise UsageError(
                "an S3 access key was given without its secret key (or the reverse): set both "
                "KERNELFLEET_S3_ACCESS_KEY and KERNELFLEET_S3_SECRET_KEY, or neither"
            )
        if self.endpoint is not None:
            scheme, _, rest = self.endpoint.partition("://")
            if rest and scheme not in ("http", "https"):
                raise UsageError(
                    f"S3 endpoint {self.endpoint!r} has scheme {scheme!r}: use 'host:port', "
                    "'http://host:port' or 'https://host:port'"
                )
            if rest and self.secure is not None and self.secure != (scheme == "https"):
                raise UsageError(
                    f"S3 endpoint {self.endpoint!r} contradicts KERNELFLEET_S3_SECURE={self.secure}: "
                    "drop the scheme from the endpoint or make the two agree"
                )
            host = rest if rest else self.endpoint
            if not host or "/" in host.rstrip("/"):
                raise UsageError(
                    f"S3 endpoint {self.endpoint!r} must be a host and port without a path, e.g. "
                    "'minio.kernelfleet.svc:9000'; the bucket goes into the s3:// URL"
                )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> StoreConfig:
        """Read the `KERNELFLEET_STORE` and `KERNELFLEET_S3_*` variables; `overrides` win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value is not None and value.strip() != "" else None

        if (url := get("KERNELFLEET_STORE")) is not None:
            values["url"] = url
        if (endpoint := get("KERNELFLEET_S3_ENDPOINT")) is not None:
            values["endpoint"] = endpoint.strip()
        access, secret = get("KERNELFLEET_S3_ACCESS_KEY"), get("KERNELFLEET_S3_SECRET_KEY")
        if access is not None or secret is not None:
            values["access_key"] = SecretStr(access) if access is not None else None
            values["secret_key"] = SecretStr(secret) if secret is not None else None
        if (directory := get("KERNELFLEET_S3_CREDENTIALS_DIR")) is not None:
            values["credentials_dir"] = Path(directory)
        if (secure := get("KERNELFLEET_S3_SECURE")) is not None:
            values["secure"] = _parse_bool("KERNELFLEET_S3_SECURE", secure)
        if (region := get("KERNELFLEET_S3_REGION")) is not None:
            values["region"] = region.strip()
        if (ca_file := get("KERNELFLEET_S3_CA_FILE")) is not None:
            values["ca_file"] = Path(ca_file)
        if (create := get("KERNELFLEET_S3_CREATE_BUCKET")) is not None:
            values["create_bucket"] = _parse_bool("KERNELFLEET_S3_CREATE_BUCKET", create)
        retry: dict[str, float] = {}
        if (attempts := get("KERNELFLEET_S3_RETRY_ATTEMPTS")) is not None:
            retry["attempts"] = _parse_number("KERNELFLEET_S3_RETRY_ATTEMPTS", attempts, int)
        if (deadline := get("KERNELFLEET_S3_RETRY_DEADLINE_S")) is not None:
            retry["deadline_s"] = _parse_number("KERNELFLEET_S3_RETRY_DEADLINE_S", deadline, float)
        if (refused := get("KERNELFLEET_S3_RETRY_REFUSED_S")) is not None:
            retry["refused_deadline_s"] = _parse_number("KERNELFLEET_S3_RETRY_REFUSED_S", refused, float)
        if retry:
            values["retry"] = RetrySettings(**retry)
        values.update(overrides)
        config = cls.model_validate(values)
        if config.credentials_dir is not None and config.access_key is None:
            read_credentials_dir(config.credentials_dir)  # fail now, not at the first request
        return config

    # ------------------------------------------------------------------ derived values

    @property
    def endpoint_host(self) -> str | None:
        """The endpoint without its scheme, as the minio client wants it."""
        if self.endpoint is None:
            return None
        _, sep, rest = self.endpoint.partition("://")
        return (rest if sep else self.endpoint).rstrip("/")

    @property
    def use_tls(self) -> bool:
        if self.endpoint is not None and "://" in self.endpoint:
            return self.endpoint.startswith("https://")
        return True if self.secure is None else self.secure

    @property
    def endpoint_url(self) -> str:
        """The endpoint with its scheme, for messages."""
        return f"{'https' if self.use_tls else 'http'}://{self.endpoint_host}"

    def static_credentials(self) -> tuple[str, str] | None:
        """The explicit key pair, if one was given (the credentials directory is read separately)."""
        if self.access_key is None or self.secret_key is None:
            return None
        return self.access_key.get_secret_value(), self.secret_key.get_secret_value()

    def credentials_source(self) -> str:
        """Where the credentials come from, for messages that say what to check."""
        if self.access_key is not None:
            return "KERNELFLEET_S3_ACCESS_KEY / KERNELFLEET_S3_SECRET_KEY"
        if self.credentials_dir is not None:
            return (
                f"the files {ACCESS_KEY_FILE}/{SECRET_KEY_FILE} in KERNELFLEET_S3_CREDENTIALS_DIR "
                f"({self.credentials_dir})"
            )
        return "no credentials (anonymous): set KERNELFLEET_S3_ACCESS_KEY and KERNELFLEET_S3_SECRET_KEY"


def read_credentials_dir(directory: Path) -> tuple[str, str]:
    """Read `accesskey` and `secretkey` from a mounted Secret; surrounding whitespace is dropped."""
    values = []
    for name in (ACCESS_KEY_FILE, SECRET_KEY_FILE):
        path = directory / name
        try:
            value = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise UsageError(
                f"KERNELFLEET_S3_CREDENTIALS_DIR={directory} has no file '{name}': mount a Secret "
                f"with the keys '{ACCESS_KEY_FILE}' and '{SECRET_KEY_FILE}' there"
            ) from None
        except OSError as error:
            raise UsageError(f"cannot read S3 credentials from {path}: {error}") from None
        if not value:
            raise UsageError(f"S3 credentials file {path} is empty: check the Secret's '{name}' key")
        values.append(value)
    return values[0], values[1]
