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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernelfleet.evaluator._child import Job, child_main

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

    def run(self, job: Job, timeout: float) -> ChildOutcome:
        if self._closed:
            raise RuntimeError("the evaluator is closed; create a new Evaluator")
        context = _context()
        work = Path(tempfile.mkdtemp(prefix="kernelfleet-eval-"))
        job = replace(job, work_dir=str(work))
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=child_main, args=(job, sender), daemon=False)
        started = time.monotonic()
        answer: dict[str, Any] | None = None
        timed_out = False
        try:
            with _without_main():
                process.start()
            sender.close()
            assert process.pid is not None
            with self._lock:
                self._live[process.pid] = process
            if receiver.poll(timeout):
                with contextlib.suppress(EOFError, OSError):
                    answer = receiver.recv()
            else:
                timed_out = True
            if timed_out:
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
            if process.pid is not None:
                with self._lock:
                    self._live.pop(process.pid, None)
            seconds = time.monotonic() - started
            log = _tail(work / "log.txt")
            shutil.rmtree(work, ignore_errors=True)
        return ChildOutcome(answer, timed_out, _signal_name(process.exitcode), log, seconds)

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
