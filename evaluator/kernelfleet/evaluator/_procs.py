"""Running children: one fresh process per job, forked from a torch-preloaded forkserver.

The forkserver imports torch, torch.compile's machinery and the harness once; every job then
forks from it in tens of milliseconds with the harness's original references intact and no
CUDA context inherited (the forkserver never touches CUDA). A job that outlives its timeout is
killed with its whole process group (compilers included); one that dies without answering is
reported with its signal. `close()` kills whatever still runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernelfleet.evaluator._child import Job, child_main
from kernelfleet.evaluator._cputime import tree_cpu_seconds

_PRELOAD = ["torch", "torch._dynamo", "kernelfleet.evaluator._child"]
_CONTEXT: multiprocessing.context.ForkServerContext | None = None
_CONTEXT_LOCK = threading.Lock()
_START_LOCK = threading.Lock()


def _context() -> multiprocessing.context.ForkServerContext:
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            _CONTEXT = context
        return _CONTEXT


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start children without re-importing the caller's main script in them: multiprocessing
    would run an unguarded script again in every child, and a guarded one costs its imports."""
    with _START_LOCK:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is not None:
                sys.modules["__main__"] = main


@dataclass(frozen=True)
class ChildOutcome:
    """What came back from one child: its answer (None if it died or hung) and why not."""

    answer: dict[str, Any] | None
    timed_out: bool
    exit_description: str
    log: str
    seconds: float
    cancelled: bool = False
    lane_wait_s: float = 0.0  # time the child waited for the timing lane (not part of its timeout)


def _signal_name(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ChildRunner:
    """Starts children and keeps track of them so that they can all be stopped."""

    def __init__(self) -> None:
        self._live: dict[int, multiprocessing.process.BaseProcess] = {}
        self._lock = threading.Lock()
        self._closed = False

    def run(
        self,
        job: Job,
        timeout: float,
        *,
        on_ready: Callable[[], None] | None = None,
        cpu_limit_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> ChildOutcome:
        """Run `job` in a fresh child. `timeout` is wall time, excluding time the child waits
        for the timing lane; with `on_ready` the child asks for the lane before it times, and
        `on_ready()` returns when it has it. `cpu_limit_s` also ends the child once it and its
        descendants (compilers) used that much CPU time: CPUs shared with other jobs slow a
        build down without making it exceed its limit. `cancel` set: the child is killed."""
        if self._closed:
            raise RuntimeError("the evaluator is closed; create a new Evaluator")
        context = _context()
        work = Path(tempfile.mkdtemp(prefix="kernelfleet-eval-"))
        job = replace(job, work_dir=str(work))
        receiver, sender = context.Pipe(duplex=False)
        lane_receiver, lane_sender = context.Pipe(duplex=False) if on_ready is not None else (None, None)
        process = context.Process(target=child_main, args=(job, sender, lane_receiver), daemon=False)
        started = time.monotonic()
        answer: dict[str, Any] | None = None
        timed_out = cancelled = False
        waited = 0.0
        try:
            with _without_main():
                process.start()
            sender.close()
            if lane_receiver is not None:
                lane_receiver.close()
            assert process.pid is not None
            with self._lock:
                self._live[process.pid] = process
            deadline = started + timeout
            while True:
                now = time.monotonic()
                if now >= deadline or (
                    cpu_limit_s is not None and tree_cpu_seconds(process.pid) > cpu_limit_s
                ):
                    timed_out = True
                    break
                if cancel is not None and cancel.is_set():
                    cancelled = True
                    break
                if not receiver.poll(min(0.25, deadline - now)):
                    continue
                message: dict[str, Any] | None = None
                with contextlib.suppress(EOFError, OSError):
                    message = receiver.recv()
                if message is not None and message.get("status") == "ready" and lane_sender is not None:
                    begin = time.monotonic()
                    assert on_ready is not None
                    on_ready()
                    waited += time.monotonic() - begin
                    deadline += time.monotonic() - begin
                    with contextlib.suppress(OSError):
                        lane_sender.send("go")
                    continue
                answer = message
                break
            if timed_out or cancelled:
                self._kill(process)
            process.join(30)
            if process.is_alive():
                self._kill(process)
                process.join(10)
        except BaseException:
            self._kill(process)
            raise
        finally:
            receiver.close()
            if lane_sender is not None:
                lane_sender.close()
            if process.pid is not None:
                with self._lock:
                    self._live.pop(process.pid, None)
            seconds = time.monotonic() - started
            log = _tail(work / "log.txt")
            shutil.rmtree(work, ignore_errors=True)
        return ChildOutcome(
            answer, timed_out, _signal_name(process.exitcode), log, seconds, cancelled, waited
        )

    @staticmethod
    def _kill(process: multiprocessing.process.BaseProcess) -> None:
        pid = process.pid
        if pid is None:
            return
        # The child leads its own process group (compilers, ninja); kill the group, then it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            live = list(self._live.values())
        for process in live:
            self._kill(process)
