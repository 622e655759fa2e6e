"""Errors that users see. Each message says what went wrong and what to do about it."""

from __future__ import annotations


class KernelfleetError(Exception):
    """Base of every error kernelfleet raises on purpose."""


class UsageError(KernelfleetError):
    """Bad input from the user: a missing file, a malformed field. The CLI exits with 2."""


class StoreError(KernelfleetError):
    """The artifact store failed in a way that retrying will not fix."""
