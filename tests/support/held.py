"""What the device's gate holds: an observer of each timed batch's stopped processes, for the
CPU and the GPU tests of 0.8.9's hold (evaluator/_gpugate.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kernelfleet.evaluator._gpugate import GpuGate
from kernelfleet.evaluator._sandbox import descendants


def observe_holds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Patch GpuGate.close so that, as each timed batch begins, every held process of another
    evaluation that is not in a request, and every process below it, is looked at in /proc.
    Returns the list it fills: (how many processes the hold stopped, the state letter seen)."""
    seen: list[tuple[int, str]] = []
    close = GpuGate.close

    def observed_close(gate: GpuGate, owner: object = None) -> None:
        close(gate, owner)
        for key, held in list(gate._held.items()):
            if key is not owner and key not in gate._busy:
                processes = [held.pid, *descendants(held.pid)]
                seen.extend((len(held.stopped), settled_state(pid)) for pid in processes)

    monkeypatch.setattr(GpuGate, "close", observed_close)
    return seen


def state(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped; "gone" once it has ended)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return text[text.rindex(")") + 2]


def settled_state(pid: int) -> str:
    """The process's state letter once a stop sent to it has had time to land ("T": stopped)."""
    deadline = time.monotonic() + 2
    letter = state(pid)
    while letter not in ("T", "gone") and time.monotonic() < deadline:
        time.sleep(0.01)
        letter = state(pid)
    return letter
