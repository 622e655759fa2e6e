"""Conditions in the style of `metav1.Condition`: a state per type, with reason and message.

A condition describes a state (`Accepted`, `Running`, `Suspended`, `Complete`, `Failed`, ...),
not an event: the operator recomputes the whole set on every pass, and `set_condition` keeps
`lastTransitionTime` unless the status really changed, so a reconcile that finds nothing new
produces the same list and therefore no patch. Reconcile errors go into a condition too (users
of batch operators ask for exactly this: the error where they look, not only in a log).

Conditions are kept as plain dicts in the API's camelCase, the form they have in a patch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# Condition types shared by OptimizationJob and TrainingRun.
ACCEPTED = "Accepted"
RUNNING = "Running"
SUSPENDED = "Suspended"
COMPLETE = "Complete"
FAILED = "Failed"
RECONCILE_ERROR = "ReconcileError"
GPU_CLASS_UNAVAILABLE = "GpuClassUnavailable"
# With a Kueue queue (spec.queueName): whether Kueue admitted the unfinished Jobs, and if not, why.
ADMITTED = "Admitted"

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_MESSAGE = 32768  # metav1.Condition allows 32768 characters


def now() -> str:
    """RFC 3339 in seconds, as the API server writes times."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Condition:
    """What the operator concluded; `as_dict` turns it into the status entry."""

    type: str
    status: str
    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in (TRUE, FALSE, UNKNOWN):
            raise ValueError(f"condition status must be True, False or Unknown, not {self.status!r}")
        if not _REASON.match(self.reason):
            raise ValueError(f"condition reason must be CamelCase (metav1.Condition), not {self.reason!r}")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    condition: Condition,
    *,
    observed_generation: int,
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    """`conditions` with `condition` set: its transition time moves only when its status changes."""
    result: list[dict[str, Any]] = []
    found = False
    for existing in conditions:
        if existing.get("type") != condition.type:
            result.append(dict(existing))
            continue
        found = True
        changed = existing.get("status") != condition.status
        result.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message[:MAX_MESSAGE],
                "observedGeneration": observed_generation,
                "lastTransitionTime": (timestamp or now())
                if changed or not existing.get("lastTransitionTime")
                else existing["lastTransitionTime"],
            }
        )
    if not found:
        result.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message[:MAX_MESSAGE],
                "observedGeneration": observed_generation,
                "lastTransitionTime": timestamp or now(),
            }
        )
    return result


def set_conditions(
    conditions: Sequence[Mapping[str, Any]],
    updates: Iterable[Condition],
    *,
    observed_generation: int,
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    result = [dict(c) for c in conditions]
    for condition in updates:
        result = set_condition(
            result, condition, observed_generation=observed_generation, timestamp=timestamp
        )
    return result


def remove_condition(conditions: Sequence[Mapping[str, Any]], type_: str) -> list[dict[str, Any]]:
    return [dict(c) for c in conditions if c.get("type") != type_]


def find(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: Sequence[Mapping[str, Any]], type_: str) -> bool:
    found = find(conditions, type_)
    return found is not None and found.get("status") == TRUE


def transitions(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Conditions whose status or reason changed: the ones worth an Event."""
    old = {c.get("type"): (c.get("status"), c.get("reason")) for c in before}
    return [c for c in after if old.get(c.get("type")) != (c.get("status"), c.get("reason"))]
