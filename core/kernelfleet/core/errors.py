"""Errors that users see. Each message says what went wrong and what to do about it."""

from __future__ import annotations


class KernelfleetError(Exception):
    """Base of every error kernelfleet raises on purpose."""


class UsageError(KernelfleetError):
    """Bad input from the user: a missing file, a malformed field. The CLI exits with 2."""


class StoreError(KernelfleetError):
    """The artifact store failed in a way that retrying will not fix."""


class EvaluationCancelled(KernelfleetError):
    """An evaluation was stopped before it finished (a budget ended, the evaluator closed): it
    has no result, nothing of it was stored, and it runs again when asked again. A batch
    stopped early carries what did finish in `results` (input order, None where cancelled)."""

    def __init__(self, message: str = "cancelled", results: list[object] | None = None) -> None:
        super().__init__(message)
        self.results = results
