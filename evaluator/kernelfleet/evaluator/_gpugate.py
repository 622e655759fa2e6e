"""The device's quiet while it times: other evaluations' GPU steps wait for the timing.

Several candidates share a device (loading, correctness and traces overlap), but GPU contexts of
different processes are time-sliced: a neighbour's correctness call during a timing stretches
the timed calls and moves the reference by several percent, which makes speedups wander and
defeats a reused reference's drift check. So each device has a gate, closed for each batch of
timed rounds: new GPU steps of the other evaluations (each one request to their judge or
candidate) wait until the batch ends, and the batch first waits for the steps already running.
It closes per batch, not for the whole timing, because an adaptive timing of a large model can
take a minute of batches; the neighbours' steps run between them. The wait for running steps is
bounded (`drain_s`): a step that never ends (a hostile candidate's endless call) cannot hold the
device, it only leaves that batch with a neighbour. Process start, imports and the candidate's
load are not steps: they run beside a timing, mostly on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

DRAIN_S = 2.0  # the longest a timing waits for GPU steps already running (a longer one is compiling)


class GateCancelled(Exception):
    """The evaluation was cancelled while its step waited for a timing to end."""


class GpuGate:
    """One device's gate: many short GPU steps at once, or one timing alone."""

    def __init__(self, drain_s: float = DRAIN_S) -> None:
        self.drain_s = drain_s
        self._cond = threading.Condition()
        self._steps = 0
        self._closed = False  # a timing holds the device, or waits for the steps to finish

    @contextlib.contextmanager
    def step(self, cancel: threading.Event | None = None) -> Iterator[float]:
        """One GPU step outside a timing; yields the seconds it waited for the gate to open.
        Raises GateCancelled when `cancel` is set while it waits."""
        begin = time.monotonic()
        with self._cond:
            while self._closed:
                if cancel is not None and cancel.is_set():
                    raise GateCancelled("cancelled while the device was timing")
                self._cond.wait(0.25)
            self._steps += 1
        try:
            yield time.monotonic() - begin
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Close the gate for a batch of timed rounds (the caller holds the device's timing lane,
        so there is one timing at a time) and wait, at most `drain_s`, for the steps running to
        finish. Baselines close it for their whole run."""
        with self._cond:
            self._closed = True
            deadline = time.monotonic() + self.drain_s
            while self._steps and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(0.05, left))

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The gate closed for the block (one batch of timed rounds)."""
        self.close()
        try:
            yield
        finally:
            self.open()
