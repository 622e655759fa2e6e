"""The S3 backend's failure paths, without MinIO: a closed port, a plain-HTTP server spoken to
over TLS, and a tiny in-process HTTP server that answers with canned S3 errors."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.sax.saxutils import escape

import pytest

from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.errors import StoreError, UsageError
from kernelfleet.core.store import StoreUnavailable, open_store

FAST_RETRY = RetrySettings(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=10)


def config(endpoint: str, **extra: object) -> StoreConfig:
    settings: dict[str, object] = {
        "endpoint": endpoint,
        "secure": False,
        "region": "us-east-1",
        "retry": FAST_RETRY,
        "connect_timeout_s": 2,
        "read_timeout_s": 5,
    }
    return StoreConfig.model_validate({**settings, **extra})


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CannedS3:
    """An HTTP server that answers every request with one status and S3 error code."""

    def __init__(self, status: int, code: str) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>canned {code}</Message><Resource>{escape(self.path)}</Resource>"
                    "<RequestId>1</RequestId><HostId>h</HostId></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> CannedS3:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def quiet_retries(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="kernelfleet.store")
    yield caplog


def test_an_s3_url_without_an_endpoint_says_what_to_set() -> None:
    with pytest.raises(UsageError, match="KERNELFLEET_S3_ENDPOINT"):
        open_store("s3://bucket/prefix", StoreConfig())


def test_an_unreachable_endpoint_is_retried_then_reported(quiet_retries: pytest.LogCaptureFixture) -> None:
    port = closed_port()
    store = open_store("s3://bucket/runs", config(f"127.0.0.1:{port}"))
    with pytest.raises(StoreUnavailable) as raised:
        store.put_bytes("variants/x.py", b"code")
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and "s3://bucket/runs/variants/x.py" in message
    assert "KERNELFLEET_S3_ENDPOINT" in message and "after 3 attempts" in message
    assert len([r for r in quiet_retries.records if "retrying" in r.getMessage()]) == 2


def test_a_refused_connection_is_reported_in_seconds_with_the_default_budget(
    quiet_retries: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens at the endpoint: the default budget (10 attempts over minutes, for a
    slow server) gives the message after a few seconds of retries, not after the whole budget."""
    port = closed_port()
    store = open_store("s3://bucket/runs", config(f"127.0.0.1:{port}", retry=RetrySettings()))
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as raised:
        store.get_bytes("variants/x.py")
    assert time.monotonic() - began < RetrySettings().refused_deadline_s + 15.0  # a bound, with a margin
    assert "connection refused" in str(raised.value) and "KERNELFLEET_S3_ENDPOINT" in str(raised.value)


def test_tls_to_a_plain_http_server_says_to_turn_tls_off(quiet_retries: pytest.LogCaptureFixture) -> None:
    with CannedS3(404, "NoSuchKey") as server:
        store = open_store("s3://bucket", config(server.endpoint, secure=True))
        with pytest.raises(StoreError, match="KERNELFLEET_S3_SECURE=false"):
            store.exists("k")
    assert not [r for r in quiet_retries.records if "retrying" in r.getMessage()]


def test_5xx_answers_are_retried(quiet_retries: pytest.LogCaptureFixture) -> None:
    with CannedS3(503, "SlowDown") as server:
        store = open_store("s3://bucket", config(server.endpoint))
        with pytest.raises(StoreUnavailable, match="SlowDown"):
            store.get_bytes("k")
    # Three attempts of the store, each with the HTTP pool's own two quick retries.
    assert len(server.requests) == 9
    assert len([r for r in quiet_retries.records if "retrying" in r.getMessage()]) == 2


@pytest.mark.parametrize(
    ("code", "status", "hint"),
    [
        ("InvalidAccessKeyId", 403, "does not know the access key"),
        ("SignatureDoesNotMatch", 403, "secret key does not match"),
        ("AccessDenied", 403, "s3:PutObject"),
        ("NoSuchBucket", 404, "KERNELFLEET_S3_CREATE_BUCKET=true"),
    ],
)
def test_permanent_errors_fail_at_once_with_what_to_check(
    code: str, status: int, hint: str, quiet_retries: pytest.LogCaptureFixture
) -> None:
    with CannedS3(status, code) as server:
        store = open_store(
            "s3://bucket/p",
            config(server.endpoint, access_key="ak", secret_key="sk"),
        )
        with pytest.raises(StoreError) as raised:
            store.get_bytes("k.json")
    message = str(raised.value)
    assert hint in message and server.endpoint in message and "s3://bucket/p/k.json" in message
    assert len(server.requests) == 1
    assert not [r for r in quiet_retries.records if "retrying" in r.getMessage()]


def test_a_forbidden_head_is_explained_by_the_real_error_code() -> None:
    # A HEAD's 403 has no body; the store asks once more with a listing to learn the real code.
    with CannedS3(403, "InvalidAccessKeyId") as server:
        store = open_store("s3://bucket", config(server.endpoint))
        with pytest.raises(StoreError, match="does not know the access key"):
            store.put_bytes("k", b"x")
    assert [r.split()[0] for r in server.requests] == ["HEAD", "GET"]
