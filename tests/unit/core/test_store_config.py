"""Store configuration from the environment and from a mounted Kubernetes Secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.errors import UsageError
from kernelfleet.core.store._s3 import SecretDirCredentials


def test_defaults_need_no_environment() -> None:
    config = StoreConfig.from_env({})
    assert config.url == ".kernelfleet"
    assert config.endpoint is None and config.static_credentials() is None
    assert config.create_bucket is False and config.use_tls is True


def test_every_variable_is_read() -> None:
    config = StoreConfig.from_env(
        {
            "KERNELFLEET_STORE": "s3://bucket/runs",
            "KERNELFLEET_S3_ENDPOINT": "minio.kernelfleet.svc:9000",
            "KERNELFLEET_S3_ACCESS_KEY": "access",
            "KERNELFLEET_S3_SECRET_KEY": "secret",
            "KERNELFLEET_S3_SECURE": "false",
            "KERNELFLEET_S3_REGION": "eu-west-1",
            "KERNELFLEET_S3_CA_FILE": "/etc/ca.pem",
            "KERNELFLEET_S3_CREATE_BUCKET": "yes",
            "KERNELFLEET_S3_RETRY_ATTEMPTS": "4",
            "KERNELFLEET_S3_RETRY_DEADLINE_S": "12.5",
        }
    )
    assert config.url == "s3://bucket/runs"
    assert config.endpoint_host == "minio.kernelfleet.svc:9000" and config.use_tls is False
    assert config.endpoint_url == "http://minio.kernelfleet.svc:9000"
    assert config.static_credentials() == ("access", "secret")
    assert config.region == "eu-west-1" and config.ca_file == Path("/etc/ca.pem") and config.create_bucket
    assert (config.retry.attempts, config.retry.deadline_s) == (4, 12.5)


def test_secrets_never_show_in_reprs() -> None:
    config = StoreConfig.from_env(
        {"KERNELFLEET_S3_ACCESS_KEY": "AKIAEXAMPLE", "KERNELFLEET_S3_SECRET_KEY": "s3cr3t"}
    )
    assert "s3cr3t" not in repr(config) and "s3cr3t" not in str(config) and "AKIAEXAMPLE" not in repr(config)


def test_the_endpoint_scheme_decides_tls() -> None:
    assert StoreConfig(endpoint="https://s3.example.com").use_tls is True
    assert StoreConfig(endpoint="http://127.0.0.1:9000").endpoint_host == "127.0.0.1:9000"
    assert StoreConfig(endpoint="http://127.0.0.1:9000").use_tls is False
    with pytest.raises(UsageError, match="contradicts"):
        StoreConfig(endpoint="https://s3.example.com", secure=False)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KERNELFLEET_S3_SECURE": "maybe"}, "not a boolean"),
        ({"KERNELFLEET_S3_ACCESS_KEY": "a"}, "without its secret"),
        ({"KERNELFLEET_S3_ENDPOINT": "ftp://host"}, "scheme"),
        ({"KERNELFLEET_S3_ENDPOINT": "host:9000/bucket"}, "without a path"),
        ({"KERNELFLEET_S3_RETRY_ATTEMPTS": "many"}, "not a number"),
        ({"KERNELFLEET_S3_RETRY_DEADLINE_S": "-1"}, "positive"),
    ],
)
def test_bad_settings_are_usage_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        StoreConfig.from_env(env)


def test_credentials_from_a_mounted_secret(tmp_path: Path) -> None:
    (tmp_path / "accesskey").write_text("from-secret\n")
    (tmp_path / "secretkey").write_text("hidden\n")
    config = StoreConfig.from_env({"KERNELFLEET_S3_CREDENTIALS_DIR": str(tmp_path)})
    assert config.credentials_dir == tmp_path and config.static_credentials() is None
    assert "KERNELFLEET_S3_CREDENTIALS_DIR" in config.credentials_source()
    credentials = SecretDirCredentials(tmp_path).retrieve()
    assert (credentials.access_key, credentials.secret_key) == ("from-secret", "hidden")


def test_explicit_keys_win_over_the_secret(tmp_path: Path) -> None:
    config = StoreConfig.from_env(
        {
            "KERNELFLEET_S3_CREDENTIALS_DIR": str(tmp_path / "not-mounted"),
            "KERNELFLEET_S3_ACCESS_KEY": "a",
            "KERNELFLEET_S3_SECRET_KEY": "b",
        }
    )
    assert config.static_credentials() == ("a", "b")


def test_a_rotated_secret_is_picked_up(tmp_path: Path) -> None:
    (tmp_path / "accesskey").write_text("old")
    (tmp_path / "secretkey").write_text("old-secret")
    provider = SecretDirCredentials(tmp_path)
    assert provider.retrieve().access_key == "old"
    (tmp_path / "accesskey").write_text("new-key")
    (tmp_path / "secretkey").write_text("new-secret")
    assert provider.retrieve().secret_key == "new-secret"


@pytest.mark.parametrize("missing", ["accesskey", "secretkey"])
def test_an_incomplete_secret_says_which_file_is_missing(tmp_path: Path, missing: str) -> None:
    for name in {"accesskey", "secretkey"} - {missing}:
        (tmp_path / name).write_text("x")
    with pytest.raises(UsageError, match=f"no file '{missing}'"):
        StoreConfig.from_env({"KERNELFLEET_S3_CREDENTIALS_DIR": str(tmp_path)})


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "accesskey").write_text("  \n")
    (tmp_path / "secretkey").write_text("x")
    with pytest.raises(UsageError, match="empty"):
        StoreConfig.from_env({"KERNELFLEET_S3_CREDENTIALS_DIR": str(tmp_path)})
