"""Retrying transient failures with exponential backoff, and telling them from permanent ones.

The line between the two decides whether a worker waits out a MinIO restart or fails at
once with a message a person can act on. Transient: the server is not there right now
(connection refused or reset, timeouts, 5xx, SlowDown and friends). Permanent: retrying
cannot help (bad credentials, access denied, no such bucket, TLS mismatch, a malformed
request); those surface immediately.

Operations are retried whole, which is safe because every write is idempotent: an object
that was written before the connection dropped is simply written again with the same bytes.
"""

from __future__ import annotations

import errno
import http.client
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import TypeVar

import urllib3.exceptions
from minio.error import InvalidResponseError, S3Error, ServerError

from kernelfleet.core.config import RetrySettings

log = logging.getLogger(__name__)

T = TypeVar("T")

# S3 error codes that mean "try again later" whatever the HTTP status says.
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "OperationAborted",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "NoSuchUpload",  # a multipart upload lost in a restart: the whole put starts again
        "XMinioServerNotInitialized",
        "XMinioReadQuorum",
        "XMinioWriteQuorum",
        "XMinioStorageResourcesBusy",
    }
)
# Codes that never get better by waiting, even when a server sends them with a 5xx status.
PERMANENT_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "NoSuchKey",
        "InvalidBucketName",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidRequest",
        "EntityTooLarge",
        "NotImplemented",
    }
)


def _status_of(error: BaseException) -> int | None:
    if isinstance(error, S3Error):
        return getattr(error.response, "status", None)
    if isinstance(error, ServerError):
        return error.status_code
    if isinstance(error, InvalidResponseError):
        code = getattr(error, "_code", None)  # the HTTP status; minio keeps it private
        return code if isinstance(code, int) else None
    return None


def is_transient(error: BaseException) -> bool:
    """True when retrying the same request later may succeed."""
    if isinstance(error, S3Error):
        if error.code in PERMANENT_CODES:
            return False
        if error.code in TRANSIENT_CODES:
            return True
        status = _status_of(error)
        return status is not None and (status >= 500 or status == 429)
    if isinstance(error, ServerError | InvalidResponseError):
        status = _status_of(error)
        return status is not None and (status >= 500 or status == 429)
    if isinstance(error, urllib3.exceptions.MaxRetryError):
        return error.reason is None or is_transient(error.reason)
    if isinstance(error, urllib3.exceptions.SSLError | ssl.SSLError):
        return False  # a TLS mismatch or an untrusted certificate: waiting will not fix it
    if isinstance(error, urllib3.exceptions.LocationValueError):
        return False  # a malformed endpoint
    if isinstance(error, urllib3.exceptions.HTTPError):
        return True  # connection refused/reset, timeouts, truncated responses
    return isinstance(error, ConnectionError | TimeoutError | http.client.HTTPException)


def is_refused(error: BaseException) -> bool:
    """True when the server refused the connection (nothing listens at the endpoint), as
    opposed to a timeout, a reset or a 5xx: the cause chain holds ECONNREFUSED."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError) or (
            isinstance(current, OSError) and current.errno == errno.ECONNREFUSED
        ):
            return True
        reason = getattr(current, "reason", None)
        stack += [
            current.__cause__,
            current.__context__,
            reason if isinstance(reason, BaseException) else None,
        ]
    return False


def describe(error: BaseException) -> str:
    """A one-line account of an error, without urllib3's nested reprs."""
    if isinstance(error, S3Error):
        return f"{error.code}: {error.message}"
    if isinstance(error, urllib3.exceptions.MaxRetryError) and error.reason is not None:
        return describe(error.reason)
    if isinstance(error, urllib3.exceptions.NewConnectionError):
        return "connection refused or unreachable"
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if type(error).__name__ not in text else text


class GaveUp(Exception):
    """Transient errors went on past the retry budget; `last` is the final one."""

    def __init__(self, last: BaseException, attempts: int, seconds: float) -> None:
        super().__init__(f"gave up after {attempts} attempts over {seconds:.1f}s: {describe(last)}")
        self.last = last
        self.attempts = attempts
        self.seconds = seconds


class Retrier:
    """Runs operations, sleeping with jittered exponential backoff between transient failures."""

    def __init__(
        self,
        settings: RetrySettings,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._sleep = sleep
        self._clock = clock

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1-based): doubling, capped, jittered."""
        s = self.settings
        full = min(s.max_backoff_s, s.initial_backoff_s * (2 ** (attempt - 1)))
        return random.uniform(full / 2, full)

    def start(self) -> Attempts:
        return Attempts(self)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` until it succeeds, fails permanently (re-raised) or the budget ends (GaveUp)."""
        attempts = self.start()
        while True:
            try:
                return fn()
            except Exception as error:
                attempts.failed(error, what)


class Attempts:
    """The retry state of one operation; streaming operations call `progressed` to reset it."""

    def __init__(self, retrier: Retrier) -> None:
        self._retrier = retrier
        self._started = retrier._clock()
        self._count = 0
        self._total = 0

    def progressed(self) -> None:
        """The operation moved forward since the last failure, so it gets a fresh budget."""
        self._count = 0
        self._started = self._retrier._clock()

    def failed(self, error: Exception, what: str) -> None:
        """Sleep before the next attempt, or raise: `error` itself if permanent, else GaveUp."""
        if not is_transient(error):
            raise error
        self._count += 1
        self._total += 1
        settings = self._retrier.settings
        elapsed = self._retrier._clock() - self._started
        pause = self._retrier.delay(self._count)
        deadline = settings.deadline_s
        if is_refused(error):
            deadline = min(deadline, settings.refused_deadline_s)
        if self._count >= settings.attempts or elapsed + pause > deadline:
            raise GaveUp(error, self._total, elapsed) from error
        log.warning(
            "%s: %s; retrying in %.1fs (attempt %d of %d)",
            what,
            describe(error),
            pause,
            self._count + 1,
            settings.attempts,
        )
        self._retrier._sleep(pause)
