"""Errors that users see. Each message says what went wrong and what to do about it.

Errors are sorted by whether retrying can help, as kopf sorts its handlers' errors into
temporary and permanent ones: a `TransientError` (a store that cannot be reached, an
evaluation cancelled before it finished) may succeed when tried again later; a
`PermanentError` (bad input, a corrupt object, a conflicting write) will fail the same way
until someone changes something. `retryable()` says which, for any exception, so the operator
can turn an error into `kopf.TemporaryError` or `kopf.PermanentError` without knowing every
class. The command line treats both alike: it prints the message and exits 1 (2 for a
`UsageError`), never a traceback.
"""

from __future__ import annotations


class KernelfleetError(Exception):
    """Base of every error kernelfleet raises on purpose."""


class PermanentError(KernelfleetError):
    """Retrying will not help: the input, the configuration or the stored data must change."""


class TransientError(KernelfleetError):
    """Retrying later may help: a service was unreachable, or the work was interrupted."""


class UsageError(PermanentError):
    """Bad input from the user: a missing file, a malformed field. The CLI exits with 2."""


class StoreError(PermanentError):
    """The artifact store failed in a way that retrying will not fix."""


class EvaluationCancelled(TransientError):
    """An evaluation was stopped before it finished (a budget ended, the evaluator closed): it
    has no result, nothing of it was stored, and it runs again when asked again. A batch
    stopped early carries what did finish in `results` (input order, None where cancelled)."""

    def __init__(self, message: str = "cancelled", results: list[object] | None = None) -> None:
        super().__init__(message)
        self.results = results


# Exceptions from outside kernelfleet that a retry may cure: the network and the filesystem
# of a remote volume. Anything else unexpected is a bug, and retrying a bug only repeats it.
_TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


def retryable(error: BaseException) -> bool:
    """Whether trying the same thing again later may succeed.

    A `TransientError` is retryable and a `PermanentError` is not (a class that is both, such
    as a store that stayed unreachable through its own retries, counts as transient: a later
    attempt, minutes on, may find it back). An error with a boolean `transient` attribute says
    so itself. Connection errors and timeouts from outside
    kernelfleet are retryable; every other exception is not.
    """
    own = getattr(error, "transient", None)
    if isinstance(own, bool):  # an error that knows case by case (an HTTP status, say)
        return own
    if isinstance(error, TransientError):
        return True
    if isinstance(error, KernelfleetError):
        return False
    return isinstance(error, _TRANSIENT_BUILTINS)
