"""The device's quiet while it times: other evaluations' GPU steps wait for the timing, and their
candidates' processes are stopped.

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

A request is not the only way a candidate reaches the device: a thread of its own can launch
kernels while its process waits for the next request, and that would stretch a neighbour's timed
batch as a correctness call does. So a loaded candidate's process is *held* (`hold`): while
another evaluation's batch is timed, it and every process below it are stopped (SIGSTOP), and
they continue when the batch ends. Between its requests a candidate has nothing to do for its
evaluation, so an honest one loses nothing; a step that outlives the drain is stopped as soon as
it ends. What was already queued on the device before the stop still runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

from kernelfleet.evaluator._sandbox import descendants

DRAIN_S = 2.0  # the longest a timing waits for GPU steps already running (a longer one is compiling)


class GateCancelled(Exception):
    """The evaluation was cancelled while its step waited for a timing to end."""


@dataclasses.dataclass
class _Held:
    """A candidate's process, stopped during other evaluations' timed batches."""

    pid: int
    # A pidfd, so that a signal reaches this process and never a later one given its pid; -1
    # where the kernel has none (then the pid, which we release before the process is ended).
    fd: int
    stopped: list[int] = dataclasses.field(default_factory=list)  # stopped now: it and below


class GpuGate:
    """One device's gate: many short GPU steps at once, or one timing alone."""

    def __init__(self, drain_s: float = DRAIN_S) -> None:
        self.drain_s = drain_s
        self._cond = threading.Condition()
        self._steps = 0
        self._closed = False  # a timing holds the device, or waits for the steps to finish
        self._owner: object | None = None  # the evaluation whose batch closed it
        self._held: dict[object, _Held] = {}
        self._busy: Counter[object] = Counter()  # evaluations' steps running now

    @contextlib.contextmanager
    def step(self, cancel: threading.Event | None = None, key: object | None = None) -> Iterator[float]:
        """One GPU step outside a timing, of the evaluation `key` (whose held process is not
        stopped while the step runs); yields the seconds it waited for the gate to open.
        Raises GateCancelled when `cancel` is set while it waits."""
        begin = time.monotonic()
        with self._cond:
            while self._closed:
                if cancel is not None and cancel.is_set():
                    raise GateCancelled("cancelled while the device was timing")
                self._cond.wait(0.25)
            self._steps += 1
            if key is not None:
                self._busy[key] += 1
        try:
            yield time.monotonic() - begin
        finally:
            with self._cond:
                self._steps -= 1
                if key is not None:
                    self._busy[key] -= 1
                    if self._busy[key] <= 0:
                        del self._busy[key]
                        if self._closed and key is not self._owner and key in self._held:
                            self._stop(key)  # it outlived the drain: quiet from now on
                self._cond.notify_all()

    def hold(self, key: object, pid: int) -> None:
        """Stop process `pid` (evaluation `key`'s candidate, loaded) and the processes below it
        during every timed batch of another evaluation, until `release(key)`."""
        if pid <= 0:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = -1
        with self._cond:
            self._held[key] = _Held(pid, fd)
            if self._closed and key is not self._owner and key not in self._busy:
                self._stop(key)

    def release(self, key: object) -> None:
        """Let evaluation `key`'s process run on for good (before it is told goodbye or killed)."""
        with self._cond:
            held = self._held.pop(key, None)
            if held is None:
                return
            _signal_all(held, signal.SIGCONT)
            if held.fd >= 0:
                os.close(held.fd)

    def close(self, owner: object | None = None) -> None:
        """Close the gate for a batch of timed rounds of evaluation `owner` (which holds the
        device's timing lane, so there is one timing at a time), wait, at most `drain_s`, for the
        steps running to finish, and stop the held processes of the other evaluations that are
        not in a step. Baselines close it for their whole run."""
        with self._cond:
            self._closed = True
            self._owner = owner
            deadline = time.monotonic() + self.drain_s
            while self._steps and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(0.05, left))
            for key in self._held:
                if key is not owner and key not in self._busy:
                    self._stop(key)

    def open(self) -> None:
        with self._cond:
            for held in self._held.values():
                _signal_all(held, signal.SIGCONT)
            self._closed = False
            self._owner = None
            self._cond.notify_all()

    @contextlib.contextmanager
    def quiet(self, owner: object | None = None) -> Iterator[None]:
        """The gate closed for the block (one batch of timed rounds of `owner`)."""
        self.close(owner)
        try:
            yield
        finally:
            self.open()

    def _stop(self, key: object) -> None:
        """Stop a held process and what runs below it (called with the lock held). The process
        first, so that it forks nothing more; then its descendants, again until none is new
        (three passes at most)."""
        held = self._held[key]
        if held.stopped or not _signal(held, signal.SIGSTOP):
            return  # stopped already, or gone (or not ours to signal): nothing of it runs
        held.stopped = [held.pid]
        for _ in range(3):
            fresh = [pid for pid in descendants(held.pid) if pid not in held.stopped]
            if not fresh:
                break
            for pid in fresh:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
                held.stopped.append(pid)


def _signal(held: _Held, signum: int) -> bool:
    try:
        if held.fd >= 0:
            signal.pidfd_send_signal(held.fd, signum)
        else:
            os.kill(held.pid, signum)
    except OSError:
        return False
    return True


def _signal_all(held: _Held, signum: int) -> None:
    """`signum` to a held process and to each process stopped below it."""
    if not held.stopped:
        return
    _signal(held, signum)
    for pid in held.stopped[1:]:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
    held.stopped = []
