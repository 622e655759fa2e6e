"""The store's errors. Callers catch `NotFound` for "not there yet" and `StoreError` for the rest.

`NotFound` is also a `KeyError`, so code written against a mapping keeps working, but its
message prints as written (a bare `KeyError` would print its argument's repr).
"""

from __future__ import annotations

from kernelfleet.core.errors import KernelfleetError, StoreError, TransientError


class NotFound(KernelfleetError, KeyError):
    """No object at this key (or no complete directory at this prefix).

    Neither transient nor permanent: whether the object may still appear is the caller's to
    know (a summary not written yet, or a key that is wrong).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class ObjectConflict(StoreError):
    """A different object already exists at the key. Objects are immutable: write a new key."""


class IntegrityError(StoreError):
    """Downloaded bytes do not match their recorded sha256: the object or the transfer is corrupt."""


class CorruptObject(IntegrityError):
    """An object that cannot be read as what its key says it is (not JSON, not the model, not
    UTF-8, not its hash). `key` names it, so a reader can report it and carry on without it."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class StoreUnavailable(StoreError, TransientError):
    """The store could not be reached, and retrying with backoff did not help (for now: a
    later attempt may find it back, so this error is transient)."""


class ResultConflict(ObjectConflict):
    """A different evaluation result was already stored at a result's key. Neither is silently
    kept: the new one is stored beside it (`kept_at`), and `kernelfleet store verify` lists it."""

    def __init__(self, message: str, key: str, kept_at: str) -> None:
        super().__init__(message)
        self.key = key
        self.kept_at = kept_at
