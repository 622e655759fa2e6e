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
    wants_primer,
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


def test_short_calls_are_primed_on_the_last_rounds_values() -> None:
    """With primer_below_ms set, every call is preceded by an untimed one of the same subject on
    the values its last call saw (filled in after the primer, so the timed call's values are
    never the primer's), warm-up rounds always, timed rounds while the warm-up calls were short."""

    def calls_of(primer_below_ms: float) -> list[bytes]:
        bank = InputBank([[torch.randn(64)], [torch.randn(64)]])
        seen: list[bytes] = []

        def call(buffers: list[Any]) -> torch.Tensor:
            seen.append(buffers[0].numpy().tobytes())
            return buffers[0] * 2

        run_timing(
            [Subject("a", call, [torch.zeros(64)])],
            bank,
            device=torch.device("cpu"),
            warmup=2,
            trials=10,
            flush_bytes=0,
            rng=random.Random(0),
            primer_below_ms=primer_below_ms,
        )
        return seen

    primed = calls_of(1e6)
    assert len(primed) == 24  # a primer before each of the 12 calls
    timed = primed[1::2]
    assert len(set(timed)) == 12  # every timed call saw fresh values ...
    # ... and each primer the values of the timed call before it.
    assert all(primer == last for primer, last in zip(primed[2::2], timed, strict=False))
    assert len(calls_of(0.0)) == 12  # off: no primer at all
    assert len(calls_of(1e-9)) == 2 * 2 + 10  # calls longer than the bound: warm-up primed, timed not


def test_the_primer_rule_times_both_sides_alike() -> None:
    assert wants_primer({"reference": [30.0, 31.0], "candidate": [0.2, 0.3]}, 20.0)
    assert not wants_primer({"reference": [30.0, 31.0], "candidate": [25.0, 26.0]}, 20.0)
    assert wants_primer({"reference": [], "candidate": []}, 20.0)  # no figures yet: primed
    assert not wants_primer({"reference": [0.1]}, 0.0)  # off


def test_an_unknown_clock_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="device, stream"):
        _Clock(torch.device("cpu"), "wall")


def test_a_timing_request_names_the_clock_both_sides_use() -> None:
    clock = clock_for({"clock": "stream", "lead_us": 500, "reps": 6}, torch.device("cpu"), None)
    assert clock.mode == "stream" and clock.lead_reps == 0  # the CPU has no GPU to lead
    assert clock_for({}, torch.device("cpu"), None).mode == "device"  # a request from before the setting


def test_the_cpu_clock_is_the_same_whatever_the_gpu_clock_setting() -> None:
    """On the CPU there are no streams: both settings read the wall clock, with no stream figure
    and no spill."""
    for mode in ("device", "stream"):
        ms, naive, spill, out = _Clock(torch.device("cpu"), mode, lead_us=50).measure(
            lambda: torch.ones(3) * 2
        )
        assert ms >= 0 and naive is None and spill is None and out.tolist() == [2.0, 2.0, 2.0]
