"""Status patches: only when something changed, and at most one per resource every few seconds.

Status is level-based: a timer recomputes it from what exists (the child Jobs, the records in
the store) and the result replaces what was there. Most passes find nothing new, and a job with
thousands of tasks finishing in bursts must not turn into thousands of patches, so every patch
goes through a `PatchLimiter`: a patch that equals the current status is dropped, and one that
comes too soon after the previous one for the same resource waits for the next pass.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


def status_diff(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level status fields of `desired` that differ from `current` (a merge patch)."""
    return {key: value for key, value in desired.items() if current.get(key) != value}


@dataclass
class _Entry:
    last_patch: float = -math.inf


class PatchLimiter:
    """Per-resource rate limit for status patches. Thread-safe; keyed by the resource's uid."""

    def __init__(self, min_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.patches = 0
        self.deferred = 0

    def allow(self, uid: str, *, urgent: bool = False) -> bool:
        """Whether a patch for `uid` may go out now; if so, it is counted as sent.

        `urgent` (a condition that must appear at once, such as a rejected spec) skips the wait
        but still counts, so a burst of urgent patches is followed by a pause.
        """
        with self._lock:
            entry = self._entries.setdefault(uid, _Entry())
            now = self._clock()
            if not urgent and now - entry.last_patch < self.min_interval_s:
                self.deferred += 1
                return False
            entry.last_patch = now
            self.patches += 1
            return True

    def forget(self, uid: str) -> None:
        with self._lock:
            self._entries.pop(uid, None)


def median(values: Iterable[float]) -> float | None:
    data = [v for v in values if v is not None and math.isfinite(v)]
    return round(statistics.median(data), 4) if data else None


def best(values: Iterable[float]) -> float | None:
    data = [v for v in values if v is not None and math.isfinite(v)]
    return round(max(data), 4) if data else None
