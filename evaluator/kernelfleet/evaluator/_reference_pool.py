"""A task's reference time, established once per session over several fresh processes.

Why: a process keeps an offset for its life. 2:61's reference (a cuDNN ConvTranspose3d) runs at
one of two modes 15-20% apart depending on the process, on every GPU measured, and no
setting tried moved it. Two evaluations of the same candidate, each timing the reference in its
own two processes, therefore met different modes and disagreed by 5-17%, while the candidate's
own time agreed within 2% (`reward_service-2026-12-06-morepairs.md`). A pool fixes the reference's
figure for the session: the geometric mean of its medians in the first `reference_processes`
fresh processes that timed it, so every later candidate of the task is measured against the same
figure, and a re-timing differs only by what the candidate itself does.

Pairing is kept as the guard: every evaluation still times the reference beside the candidate,
and its reference medians must lie within the pool's range (widened by `reference_tolerance`);
one outside it means the machine has moved since the pool was made (a host-bound reference
under another load), and that evaluation keeps its own paired figure. So a pool can never move a
speedup further than the tolerance beyond what the processes it holds have shown.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class ReferencePool:
    """The reference's medians (ms) in the fresh processes that made the pool."""

    medians_ms: tuple[float, ...]
    tolerance: float

    @property
    def median_ms(self) -> float:
        """The figure a candidate is measured against: the geometric mean over processes, so
        that each process's offset counts once and two modes average rather than snap."""
        return statistics.geometric_mean(self.medians_ms)

    def holds(self, median_ms: float) -> bool:
        """Whether a reference median timed now is one the pool's processes could have shown."""
        low, high = min(self.medians_ms), max(self.medians_ms)
        return low * (1 - self.tolerance) <= median_ms <= high * (1 + self.tolerance)

    def describe(self) -> str:
        low, high = min(self.medians_ms), max(self.medians_ms)
        return (
            f"the reference's {self.median_ms:.4f} ms is this session's for the task: the geometric mean "
            f"of its medians in {len(self.medians_ms)} fresh processes ({low:.4f}-{high:.4f} ms)"
        )


class ReferencePools:
    """The session's pools, by key (task, device, config and settings); safe across the lane
    threads. A pool fills from the first fresh reference medians offered and is frozen once it
    holds `size`: later medians only check it.

    Evaluations in flight promise the processes they will bring, so that a burst of candidates of
    one task (a GRPO group, a round of variants) fills the pool from their ordinary pairs: without
    promises each of them saw the whole pool missing and timed extra pairs for it: with 4
    candidates per task they took 1.9x the timing lane's seconds per candidate
    (docs/measurements.md). An evaluation that has offered its medians waits
    for the promises still out, and times more pairs itself only when they end without a pool."""

    def __init__(self) -> None:
        self._medians: dict[Hashable, list[float]] = {}
        self._promised: dict[Hashable, int] = {}
        self._changed = threading.Condition()

    def missing(self, key: Hashable, size: int) -> int:
        """How many more fresh processes the pool for `key` needs before it is made."""
        with self._changed:
            return max(0, size - len(self._medians.get(key, ())))

    def promise(self, key: Hashable, size: int, most: int) -> int:
        """Reserve for one evaluation up to `most` of the processes the pool still lacks beyond
        those promised by evaluations in flight: how many it is to bring (offer or release them)."""
        with self._changed:
            lacking = size - len(self._medians.get(key, ())) - self._promised.get(key, 0)
            promised = max(0, min(most, lacking))
            self._promised[key] = self._promised.get(key, 0) + promised
            return promised

    def release(self, key: Hashable, promised: int) -> None:
        """Give back a promise that will not be kept (the evaluation failed or ran out of time)."""
        with self._changed:
            self._promised[key] = max(0, self._promised.get(key, 0) - promised)
            self._changed.notify_all()

    def offer(
        self, key: Hashable, medians_ms: Sequence[float], size: int, tolerance: float, promised: int = 0
    ) -> ReferencePool | None:
        """Add an evaluation's fresh reference medians to a pool still filling (as many as it
        lacks), keeping its promise of `promised`; the pool once it holds `size`, else None."""
        with self._changed:
            self._promised[key] = max(0, self._promised.get(key, 0) - promised)
            held = self._medians.setdefault(key, [])
            held += [float(ms) for ms in medians_ms if ms > 0][: max(0, size - len(held))]
            self._changed.notify_all()
            return ReferencePool(tuple(held), tolerance) if len(held) >= size else None

    def wait(self, key: Hashable, size: int, tolerance: float, timeout_s: float) -> ReferencePool | None:
        """The pool once made, waiting at most `timeout_s` while evaluations in flight still owe it
        processes; None when their promises ended without making it, or time ran out."""
        with self._changed:
            held = self._medians.setdefault(key, [])
            self._changed.wait_for(lambda: len(held) >= size or not self._promised.get(key), timeout_s)
            return ReferencePool(tuple(held), tolerance) if len(held) >= size else None
