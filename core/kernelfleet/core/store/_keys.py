"""Keys: the names of objects, relative to a store's root, the same on every backend.

A key is a `/`-separated path of non-empty segments without `.` or `..`, so it maps onto a
file below the local root and can never escape it, and onto one S3 object name. Segments
that start with `.kf-tmp-` are reserved for the local backend's in-flight files.
"""

from __future__ import annotations

from kernelfleet.core.errors import UsageError

TEMP_MARK = ".kf-tmp-"
MAX_KEY_BYTES = 900  # S3 allows 1024 bytes; leave room for the store's prefix


def _bad(kind: str, value: str, why: str) -> UsageError:
    return UsageError(f"invalid store {kind} {value!r}: {why}")


def _check_segments(kind: str, value: str, segments: list[str]) -> None:
    for segment in segments:
        if segment in ("", ".", ".."):
            raise _bad(kind, value, "use '/'-separated names without empty, '.' or '..' parts")
        if segment.startswith(TEMP_MARK):
            raise _bad(kind, value, f"names starting with {TEMP_MARK!r} are reserved for in-flight files")


def check_key(key: str) -> str:
    """Return `key` if it is a valid object key, else raise UsageError saying why."""
    if not isinstance(key, str) or not key:
        raise _bad("key", str(key), "a key is a non-empty string such as 'variants/abc.py'")
    if "\\" in key or any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise _bad("key", key, "backslashes and control characters are not allowed")
    if key.startswith("/"):
        raise _bad("key", key, "keys are relative to the store's root: drop the leading '/'")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise _bad("key", key, f"longer than {MAX_KEY_BYTES} bytes")
    _check_segments("key", key, key.split("/"))
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, a key, or a key followed by '/'."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def join_key(*parts: str) -> str:
    """Join key parts with '/', ignoring empty parts and surplus slashes at their ends."""
    return "/".join(stripped for part in parts if (stripped := part.strip("/")))
