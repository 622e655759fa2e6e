"""The timing protocol's pieces, in process on the CPU (no assertion on any duration)."""

from __future__ import annotations

import os
import random
import threading
import traceback
from typing import Any

import pytest
import torch

from kernelfleet.evaluator import _guards as G
from kernelfleet.evaluator._timing import (
    InputBank,
    Subject,
    TimingRun,
    _Clock,
    bucket_speedups,
    clock_for,
    coefficient_of_variation,
    escaped_work_ms,
    pin_timing_thread,
    run_timing,
    stats,
)


def test_every_call_sees_fresh_values_and_the_order_is_random() -> None:
    bank = InputBank([[torch.randn(64), 3], [torch.randn(64), 3]])
    seen: list[bytes] = []
    order: list[str] = []

    def subject(label: str) -> Subject:
        def call(buffers: list[Any]) -> torch.Tensor:
            order.append(label)
            if label == "a":
                seen.append(buffers[0].numpy().tobytes())
            assert buffers[1] == 3
            return buffers[0] * 2

        return Subject(label, call, [torch.zeros(64), 3])

    flushes: list[int] = []
    checked: list[bool] = []

    def check(outputs: dict[str, Any]) -> None:
        checked.append(torch.equal(outputs["a"], outputs["b"]))

    run = run_timing(
        [subject("a"), subject("b")],
        bank,
        device=torch.device("cpu"),
        warmup=2,
        trials=20,
        flush_bytes=1024,
        rng=random.Random(0),
        check_round=check,
        on_flush=lambda: flushes.append(1),
    )
    assert len(run.samples["a"]) == len(run.samples["b"]) == 20
    assert len(seen) == 22 and len(set(seen)) == 22  # no two calls saw the same values
    assert all(checked)  # both subjects of a round got the same values
    assert len(flushes) == 44  # a flush before every call
    firsts = [order[i] for i in range(0, len(order), 2)]
    assert {"a", "b"} == set(firsts)  # the order within a round changes


def test_stats_and_buckets() -> None:
    s = stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median_ms, s.min_ms, s.max_ms, s.trials) == (3.0, 1.0, 100.0, 5)
    assert s.iqr_ms == pytest.approx(2.0)
    steady = bucket_speedups([2.0] * 21, [1.0] * 21)
    assert steady == [2.0] * 7 and coefficient_of_variation(steady) == 0.0
    drifting = bucket_speedups([2.0] * 21, [1.0] * 10 + [2.0] * 11)
    assert coefficient_of_variation(drifting) > 0.2
    assert bucket_speedups([1.0] * 4, [1.0] * 4) == []


def test_escaped_work_compares_with_the_reference() -> None:
    # A clock without stream figures (the CPU's) records no spill: nothing escaped.
    assert escaped_work_ms(TimingRun({"a": [1.0]}, {"a": []}), "a", "a") == 0.0
    # The stream clock's samples are the caller's-stream figures: the spill says what came after.
    spilled = TimingRun(
        {"candidate": [0.1, 0.1, 0.1], "reference": [0.2, 0.2, 0.2]},
        {"candidate": [0.1, 0.1, 0.1], "reference": [0.2, 0.2, 0.2]},
        {"candidate": [0.5, 0.6, 0.55], "reference": [0.02, 0.01, 0.03]},
    )
    assert escaped_work_ms(spilled, "candidate", "reference") == pytest.approx(0.53)
    # A spill is a difference of two host waits: below zero now and then, and still compared.
    jittery = TimingRun({"c": [0.1], "r": [0.1]}, {"c": [0.1], "r": [0.1]}, {"c": [-0.004], "r": [0.006]})
    assert escaped_work_ms(jittery, "c", "r") == pytest.approx(-0.01)


def test_seeding_resets_the_generator_without_formatting_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed round reseeds both sides. The harness's seeding gives the same stream for the
    same seed and formats no stack trace (torch.manual_seed formats one per backend it cannot
    seed yet, on every call, which costs up to a millisecond a round)."""
    G.manual_seed(7)
    first = torch.rand(8)
    G.manual_seed(7)
    assert torch.equal(torch.rand(8), first)

    def no_stacks(*args: Any, **kwargs: Any) -> list[str]:
        raise AssertionError("a stack trace was formatted")

    monkeypatch.setattr(traceback, "format_stack", no_stacks)
    G.manual_seed(3)
    with pytest.raises(AssertionError, match="stack trace"):
        torch.manual_seed(3)  # what the harness used to call


def test_the_timing_thread_is_pinned_alone_and_a_cpu_it_may_not_use_leaves_it_free() -> None:
    seen: dict[str, set[int]] = {}
    allowed = sorted(os.sched_getaffinity(0))

    def pinned(name: str, cpu: object) -> None:
        pin_timing_thread(cpu)
        seen[name] = os.sched_getaffinity(0)

    for name, cpu in (("last", allowed[-1]), ("none", None), ("absent", 10_000)):
        thread = threading.Thread(target=pinned, args=(name, cpu))
        thread.start()
        thread.join()
    assert seen["last"] == {allowed[-1]}
    assert seen["none"] == seen["absent"] == set(allowed)
    assert os.sched_getaffinity(0) == set(allowed)  # only the calling thread moved


def test_a_timing_request_gives_both_sides_the_same_lead() -> None:
    clock = clock_for({"lead_us": 500, "reps": 6}, torch.device("cpu"), None)
    assert clock.lead_reps == 0  # the CPU has no GPU to lead


def test_the_cpu_clock_reads_the_wall_clock() -> None:
    """On the CPU there are no streams: no stream figure and no spill."""
    ms, naive, spill, out = _Clock(torch.device("cpu"), lead_us=50).measure(lambda: torch.ones(3) * 2)
    assert ms >= 0 and naive is None and spill is None and out.tolist() == [2.0, 2.0, 2.0]
