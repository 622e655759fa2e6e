"""Transient failures are retried with backoff; permanent ones surface at once."""

from __future__ import annotations

import http.client
import ssl
from typing import Any

import pytest
import urllib3.exceptions
from minio.error import InvalidResponseError, S3Error, ServerError

from kernelfleet.core.config import RetrySettings
from kernelfleet.core.store._retry import GaveUp, Retrier, describe, is_transient


class FakeResponse:
    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: dict[str, str] = {}


def s3_error(code: str, status: int) -> S3Error:
    return S3Error(
        response=FakeResponse(status),  # type: ignore[arg-type]
        code=code,
        message=f"{code} happened",
        resource="/bucket/key",
        request_id="req",
        host_id="host",
        bucket_name="bucket",
        object_name="key",
    )


def refused() -> urllib3.exceptions.MaxRetryError:
    reason = urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection: refused")  # type: ignore[arg-type]
    return urllib3.exceptions.MaxRetryError(None, "/bucket/key", reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        s3_error("SlowDown", 503),
        s3_error("InternalError", 500),
        s3_error("XMinioServerNotInitialized", 503),
        s3_error("SomethingNew", 502),
        s3_error("TooManyRequests", 429),
        ServerError("server failed with HTTP status code 503", 503),
        InvalidResponseError(502, "text/html", "<html>bad gateway</html>"),
        refused(),
        urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError()),
        urllib3.exceptions.ReadTimeoutError(None, "/x", "read timed out"),  # type: ignore[arg-type]
        ConnectionRefusedError(),
        TimeoutError(),
        http.client.RemoteDisconnected("closed"),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(getattr(e, "code", "")),
)
def test_transient_errors(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        s3_error("AccessDenied", 403),
        s3_error("InvalidAccessKeyId", 403),
        s3_error("SignatureDoesNotMatch", 403),
        s3_error("NoSuchBucket", 404),
        s3_error("NoSuchKey", 404),
        s3_error("AccessDenied", 503),  # a permanent code wins over the status
        s3_error("InvalidArgument", 400),
        ServerError("server failed with HTTP status code 304", 304),
        InvalidResponseError(403, "text/html", "forbidden"),
        urllib3.exceptions.MaxRetryError(None, "/x", urllib3.exceptions.SSLError("wrong version number")),  # type: ignore[arg-type]
        ssl.SSLCertVerificationError("certificate verify failed"),
        urllib3.exceptions.LocationValueError("bad host"),
        ValueError("bad argument"),
        PermissionError("local disk"),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(getattr(e, "code", "")),
)
def test_permanent_errors(error: BaseException) -> None:
    assert not is_transient(error)


def test_describe_is_one_readable_line() -> None:
    assert describe(refused()) == "connection refused or unreachable"
    assert describe(s3_error("SlowDown", 503)) == "SlowDown: SlowDown happened"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def retrier(clock: Clock, **settings: Any) -> Retrier:
    defaults: dict[str, Any] = {
        "attempts": 5,
        "initial_backoff_s": 1.0,
        "max_backoff_s": 4.0,
        "deadline_s": 100.0,
    }
    return Retrier(RetrySettings(**{**defaults, **settings}), sleep=clock.sleep, clock=clock)


def failing(times: int, error: BaseException, result: str = "done") -> Any:
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error
        return result

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_transient_failures_back_off_exponentially_then_succeed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    fn = failing(3, ConnectionResetError("reset"))
    assert retrier(clock).call(fn, "put s3://b/k") == "done"
    assert fn.calls["n"] == 4
    # Jittered in [d/2, d] around 1, 2, 4 seconds.
    for pause, full in zip(clock.sleeps, [1.0, 2.0, 4.0], strict=True):
        assert full / 2 <= pause <= full
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 3
    assert "put s3://b/k" in caplog.records[0].getMessage()


def test_backoff_is_capped() -> None:
    clock = Clock()
    retrier(clock, attempts=10).call(failing(8, TimeoutError()), "op")
    assert max(clock.sleeps) <= 4.0


def test_permanent_failures_are_raised_at_once() -> None:
    clock = Clock()
    error = s3_error("AccessDenied", 403)
    with pytest.raises(S3Error) as raised:
        retrier(clock).call(failing(1, error), "op")
    assert raised.value is error and clock.sleeps == []


def test_the_attempt_budget_ends_in_gave_up() -> None:
    clock = Clock()
    fn = failing(100, ConnectionResetError("reset"))
    with pytest.raises(GaveUp) as raised:
        retrier(clock, attempts=4).call(fn, "op")
    assert raised.value.attempts == 4 and fn.calls["n"] == 4
    assert isinstance(raised.value.last, ConnectionResetError)
    assert "gave up after 4 attempts" in str(raised.value)


def test_the_deadline_ends_in_gave_up() -> None:
    clock = Clock()
    with pytest.raises(GaveUp):
        retrier(clock, attempts=1000, initial_backoff_s=1.0, max_backoff_s=1.0, deadline_s=5.0).call(
            failing(1000, TimeoutError()), "op"
        )
    assert sum(clock.sleeps) <= 5.0


def test_progress_resets_the_budget() -> None:
    clock = Clock()
    attempts = retrier(clock, attempts=2).start()
    for _ in range(5):  # five failures, but progress in between each: never gives up
        attempts.failed(ConnectionResetError(), "stream")
        attempts.progressed()
    with pytest.raises(GaveUp):
        attempts.failed(ConnectionResetError(), "stream")
        attempts.failed(ConnectionResetError(), "stream")


def refused_by_the_pool() -> urllib3.exceptions.MaxRetryError:
    """What the HTTP pool raises when nothing listens: the refusal is the cause of its reason."""
    reason = urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection")  # type: ignore[arg-type]
    reason.__cause__ = ConnectionRefusedError(111, "Connection refused")
    return urllib3.exceptions.MaxRetryError(None, "/bucket/key", reason)  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [ConnectionRefusedError(111, "refused"), refused_by_the_pool()])
def test_a_refused_connection_gives_up_within_its_own_short_deadline(error: BaseException) -> None:
    clock = Clock()
    with pytest.raises(GaveUp):
        retrier(clock, attempts=10, deadline_s=180.0, refused_deadline_s=3.0).call(failing(100, error), "op")
    assert sum(clock.sleeps) <= 3.0


@pytest.mark.parametrize(
    "error", [TimeoutError(), ConnectionResetError("reset"), s3_error("SlowDown", 503), refused()]
)
def test_timeouts_resets_and_5xx_keep_the_whole_budget(error: BaseException) -> None:
    clock = Clock()
    fn = failing(6, error)
    assert retrier(clock, attempts=10, deadline_s=180.0, refused_deadline_s=3.0).call(fn, "op") == "done"
    assert sum(clock.sleeps) > 3.0
