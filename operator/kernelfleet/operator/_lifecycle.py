"""The end of a resource, the same for both kinds: a deadline, a terminal status, a TTL.

A resource that ended carries `status.completionTime`: it is not reconciled again (the `active`
filter of its timer or daemon) and, with `spec.ttlSecondsAfterFinished`, a daemon deletes it
that many seconds later; its children follow through their owner references, and what it wrote
to the store stays. `spec.activeDeadlineSeconds` counts from `status.startTime`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import kopf


def parse_time(text: str) -> float:
    """A status timestamp (RFC 3339, seconds, UTC, as `_conditions.now` writes it) in epoch seconds."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def deadline_passed(start_time: str, deadline_s: int | None, now: float | None = None) -> bool:
    """Whether spec.activeDeadlineSeconds has passed since status.startTime."""
    if deadline_s is None or not start_time:
        return False
    return (time.time() if now is None else now) >= parse_time(start_time) + deadline_s


def active(status: Mapping[str, Any], **_: Any) -> bool:
    """Reconciled until it ends: a resource with completionTime has nothing left to do."""
    return not status.get("completionTime")


def expiring(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    """Ended, with a TTL: the `expire` daemon's filter."""
    return bool(status.get("completionTime")) and spec.get("ttlSecondsAfterFinished") is not None


async def ttl_passed(spec: kopf.Spec, status: kopf.Status, stopped: Any) -> bool:
    """Sleep until `ttlSecondsAfterFinished` after `completionTime`; whether that time came (False:
    the daemon was stopped, or the resource has no TTL or has not ended). The caller, an `expire`
    daemon, then deletes the resource. A finished resource costs no request while it waits, and
    `spec` is live, so a changed TTL is seen."""
    while not stopped:
        ttl = spec.get("ttlSecondsAfterFinished")
        finished = status.get("completionTime")
        if ttl is None or not finished:
            return False
        remaining = parse_time(finished) + int(ttl) - time.time()
        if remaining <= 0:
            return True
        await stopped.wait(min(remaining, 300.0))
    return False
