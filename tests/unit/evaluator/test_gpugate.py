"""The device's gate: GPU steps wait while a timing holds the device, a timing waits for the
steps already running (but not for ever), and a cancelled step stops waiting."""

from __future__ import annotations

import threading

import pytest

from kernelfleet.evaluator._gpugate import GateCancelled, GpuGate


def test_a_step_waits_while_the_device_times() -> None:
    gate = GpuGate()
    gate.close()
    entered = threading.Event()

    def step() -> None:
        with gate.step():
            entered.set()

    thread = threading.Thread(target=step)
    thread.start()
    assert not entered.wait(0.5)  # the timing still holds the device
    gate.open()
    assert entered.wait(30)
    thread.join()


def test_a_timing_waits_for_the_steps_already_running() -> None:
    gate = GpuGate()
    order: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def step() -> None:
        with gate.step():
            inside.set()
            leave.wait(30)
            order.append("step done")

    def timing() -> None:
        gate.close()
        order.append("timing")
        gate.open()

    first = threading.Thread(target=step)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=timing)
    second.start()
    leave.set()
    first.join()
    second.join()
    assert order == ["step done", "timing"]


def test_a_step_that_never_ends_cannot_hold_the_device() -> None:
    gate = GpuGate(drain_s=0.2)
    with gate.step():
        gate.close()  # returns after drain_s although the step still runs
        gate.open()


def test_a_cancelled_step_stops_waiting() -> None:
    gate = GpuGate()
    gate.close()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GateCancelled), gate.step(cancel):
        pass


def test_quiet_closes_for_the_block_and_opens_after_it_even_when_it_fails() -> None:
    gate = GpuGate()
    with pytest.raises(RuntimeError), gate.quiet():
        assert gate._closed
        raise RuntimeError("the batch failed")
    assert not gate._closed
