"""The store's errors. Callers catch `NotFound` for "not there yet" and `StoreError` for the rest.

`NotFound` is also a `KeyError`, so code written against a mapping keeps working, but its
message prints as written (a bare `KeyError` would print its argument's repr).
"""

from __future__ import annotations

from kernelfleet.core.errors import KernelfleetError, StoreError


class NotFound(KernelfleetError, KeyError):
    """No object at this key (or no complete directory at this prefix)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class ObjectConflict(StoreError):
    """A different object already exists at the key. Objects are immutable: write a new key."""


class IntegrityError(StoreError):
    """Downloaded bytes do not match their recorded sha256: the object or the transfer is corrupt."""


class StoreUnavailable(StoreError):
    """The store could not be reached, and retrying with backoff did not help."""


class ResultConflict(ObjectConflict):
    """A different evaluation result was already stored at a result's key. Neither is silently
    kept: the new one is stored beside it (`kept_at`), and `kernelfleet store verify` lists it."""

    def __init__(self, message: str, key: str, kept_at: str) -> None:
        super().__init__(message)
        self.key = key
        self.kept_at = kept_at
