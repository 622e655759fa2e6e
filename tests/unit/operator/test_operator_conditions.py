"""Conditions keep their transition time unless the status changes; the rate limiter holds."""

from __future__ import annotations

import pytest

from kernelfleet.operator._conditions import (
    FALSE,
    TRUE,
    Condition,
    is_true,
    set_condition,
    set_conditions,
    transitions,
)
from kernelfleet.operator._status import PatchLimiter, best, median, status_diff


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = set_condition(
        [], Condition("Running", TRUE, "PodsActive", "2 pods"), observed_generation=1, timestamp="t1"
    )
    assert first == [
        {
            "type": "Running",
            "status": "True",
            "reason": "PodsActive",
            "message": "2 pods",
            "observedGeneration": 1,
            "lastTransitionTime": "t1",
        }
    ]
    same = set_condition(
        first, Condition("Running", TRUE, "PodsActive", "3 pods"), observed_generation=2, timestamp="t2"
    )
    assert same[0]["lastTransitionTime"] == "t1"
    assert same[0]["message"] == "3 pods" and same[0]["observedGeneration"] == 2
    flipped = set_condition(
        same, Condition("Running", FALSE, "Suspended"), observed_generation=2, timestamp="t3"
    )
    assert flipped[0]["lastTransitionTime"] == "t3"
    assert not is_true(flipped, "Running")
    assert transitions(same, flipped) == flipped
    assert transitions(first, same) == []


def test_set_conditions_keeps_other_types_in_order() -> None:
    conditions = set_conditions(
        [],
        [Condition("Accepted", TRUE, "Valid"), Condition("Running", FALSE, "NotStarted")],
        observed_generation=1,
        timestamp="t",
    )
    assert [c["type"] for c in conditions] == ["Accepted", "Running"]


def test_condition_reason_must_be_camel_case() -> None:
    with pytest.raises(ValueError, match="CamelCase"):
        Condition("Accepted", TRUE, "not valid")
    with pytest.raises(ValueError, match="True, False or Unknown"):
        Condition("Accepted", "yes", "Valid")


def test_patch_limiter_allows_one_patch_per_interval_per_resource() -> None:
    now = [100.0]
    limiter = PatchLimiter(5.0, clock=lambda: now[0])
    assert limiter.allow("a")
    assert not limiter.allow("a")
    assert limiter.allow("b")
    now[0] += 4.9
    assert not limiter.allow("a")
    assert limiter.allow("a", urgent=True)
    now[0] += 5.0
    assert limiter.allow("a")
    assert (limiter.patches, limiter.deferred) == (4, 2)


def test_status_diff_and_statistics() -> None:
    assert status_diff({"phase": "Running", "tasksDone": 1}, {"phase": "Running", "tasksDone": 2}) == {
        "tasksDone": 2
    }
    assert median([1.0, 3.0, 2.0]) == 2.0
    assert median([]) is None
    assert best([1.0, float("nan"), 1.5]) == 1.5
