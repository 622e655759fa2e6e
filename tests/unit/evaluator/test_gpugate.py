"""The device's gate: GPU steps wait while a timing holds the device, a timing waits for the
steps already running (but not for ever), a cancelled step stops waiting, and the other
evaluations' candidate processes are stopped while a batch is timed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kernelfleet.evaluator._gpugate import GateCancelled, GpuGate
from kernelfleet.evaluator._sandbox import descendants
from tests.support.held import state


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


# ---------------------------------------------------------------- held candidate processes

# A process that forks a child, and both wait: a candidate with a process of its own below it.
FORKING = "import os, time\nos.fork()\nwhile True:\n    time.sleep(0.01)\n"


def settles(pid: int, stopped: bool) -> bool:
    """Whether `pid` reaches (or leaves) the stopped state within a few seconds: a signal is
    delivered when the process next runs."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if (state(pid) == "T") == stopped:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def forking() -> Iterator[Callable[[], tuple[int, int]]]:
    """Start FORKING processes; yields a function that starts one and returns (pid, its child)."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[int, int]:
        process = subprocess.Popen([sys.executable, "-c", FORKING])
        started.append(process)
        deadline = time.monotonic() + 10
        while not (children := descendants(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert children, "the test process did not fork"
        return process.pid, children[0]

    yield start
    for process in started:
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def test_a_held_process_and_its_children_stop_while_another_evaluation_times(
    forking: Callable[[], tuple[int, int]],
) -> None:
    gate, neighbour, timing = GpuGate(), object(), object()
    pid, child = forking()
    gate.hold(neighbour, pid)
    assert settles(pid, stopped=False)
    gate.close(timing)
    assert settles(pid, stopped=True) and settles(child, stopped=True)
    gate.open()
    assert settles(pid, stopped=False) and settles(child, stopped=False)
    gate.release(neighbour)


def test_the_timing_evaluation_and_a_step_in_flight_run_on_until_the_step_ends(
    forking: Callable[[], tuple[int, int]],
) -> None:
    gate, neighbour, timing = GpuGate(drain_s=0.1), object(), object()
    (busy, _), (own, _) = forking(), forking()
    gate.hold(neighbour, busy)
    gate.hold(timing, own)
    inside, leave = threading.Event(), threading.Event()

    def step() -> None:
        with gate.step(key=neighbour):
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=step)
    thread.start()
    assert inside.wait(30)
    gate.close(timing)  # the step outlives the drain
    assert state(busy) != "T" and state(own) != "T"
    leave.set()
    thread.join()
    assert settles(busy, stopped=True)  # quiet as soon as its step ended
    assert state(own) != "T"
    gate.open()
    assert settles(busy, stopped=False)


def test_release_lets_a_process_run_and_an_ended_one_is_no_error(
    forking: Callable[[], tuple[int, int]],
) -> None:
    gate, neighbour, gone = GpuGate(), object(), object()
    pid, _ = forking()
    gate.close()
    gate.hold(neighbour, pid)  # held while a batch is timed: stopped at once
    assert settles(pid, stopped=True)
    gate.release(neighbour)
    assert settles(pid, stopped=False)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gate.hold(gone, ended.pid)
    gate.open()
    gate.close()
    gate.open()
    gate.release(gone)


def test_a_step_of_an_evaluation_not_yet_held_ends_while_a_batch_is_timed() -> None:
    gate, loading = GpuGate(drain_s=0.05), object()
    with gate.step(key=loading):  # its process is not held yet: nothing to stop when it ends
        gate.close(object())
    gate.open()
    with gate.step(key=loading):
        pass
