"""The timing protocol: interleaved, flushed, fully synchronised, with fresh input values.

Each round draws one input set from a small bank, perturbs one element of every tensor (so no
two calls ever see the same values: a cache keyed by value misses), copies it into every
subject's own buffers, then times the subjects in a random order. Before each timed call the
last-level cache is flushed by writing a buffer larger than it, and the device is idle. On CUDA
the call is then queued behind about a millisecond of GPU work (the lead) and timed between
events on the caller's stream; afterwards the host waits for the whole device, and a candidate
that leaves more work than the reference on other streams (its spill) is caught (`_Clock` says
why). On the CPU the same protocol runs with a wall clock.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kernelfleet.evaluator._guards import CudaEvent, cuda_synchronize, manual_seed, perf_counter
from kernelfleet.evaluator._outputs import leaves


@dataclass
class Subject:
    """One thing to time: a callable over its own input buffers."""

    label: str
    call: Callable[[list[Any]], Any]
    buffers: list[Any]


@dataclass
class TimingRun:
    samples: dict[str, list[float]] = field(default_factory=dict)
    naive: dict[str, list[float]] = field(default_factory=dict)
    # The device's work after the caller's stream was done, per call (see _Clock.measure).
    spill: dict[str, list[float]] = field(default_factory=dict)
    failed_rounds: list[tuple[int, str]] = field(default_factory=list)


class InputBank:
    """A few pre-generated input sets on the device, and the per-round perturbation."""

    def __init__(self, sets: list[list[Any]]) -> None:
        self.sets = [leaves(s) for s in sets]
        self.numels = [leaf.numel() if isinstance(leaf, torch.Tensor) else 0 for leaf in self.sets[0]]

    def draw(self, rng: random.Random) -> tuple[int, list[tuple[int, int] | None]]:
        index = rng.randrange(len(self.sets))
        moves = [(rng.randrange(n), rng.randrange(n)) if n > 1 else None for n in self.numels]
        return index, moves

    def fill(self, buffers: list[Any], index: int, moves: list[tuple[int, int] | None]) -> None:
        for buffer, source, move in zip(leaves(buffers), self.sets[index], moves, strict=True):
            if not isinstance(buffer, torch.Tensor):
                continue
            with torch.no_grad():
                buffer.copy_(source)
                if move is not None and buffer.is_contiguous():
                    flat = buffer.view(-1)
                    flat[move[0] : move[0] + 1].copy_(flat[move[1] : move[1] + 1])


def pin_timing_thread(cpu: object) -> None:
    """Run the calling thread (the one that times) on `cpu` alone; None leaves it where it is.
    A CPU this process may not use leaves it unpinned: the timing holds, only less steady."""
    if cpu is None:
        return
    with contextlib.suppress(OSError, ValueError, TypeError):
        os.sched_setaffinity(0, {int(cpu)})  # type: ignore[call-overload]


class _Clock:
    """Times one call: CUDA events, or the CPU's clock on the CPU.

    The sample is what KernelBench measures, the time between start and end events on the
    caller's stream. The host then waits for the whole device; how long that took beyond an empty
    wait is the call's spill (work it left on other streams), which the side-stream check compares
    with the reference's. The host's wait is not in the sample: it differs from process to process
    (evaluator 0.5.0 to 0.8.9 offered a clock that held it, `timing_clock='device'`).

    `lead_us` queues at least that many microseconds of real GPU work (writes of the cache-flush
    buffer, the last of them the flush itself) in front of the start event, with no wait on the
    host between them and the call, so that the call's launches queue behind it, as when the CPU
    runs ahead of the GPU in a loop. A call made after the host had idled a few milliseconds (as
    every timed call is, between two rounds' exchanges) reached the idle GPU late, by an amount
    that changed from process to process; neither a one-thread GPU
    spin nor 3 ms of real work waited for on the host before the call helped. Behind the lead the
    same call timed alike after any wait. Launch time beyond the lead still counts. The judge
    measures how many writes make the lead (`reps`) and the candidate's side makes as many."""

    def __init__(
        self,
        device: torch.device,
        lead_us: float = 0.0,
        flush: torch.Tensor | None = None,
        reps: int | None = None,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.lead_reps = 0
        if self.cuda:
            self.start = CudaEvent(enable_timing=True)
            self.end = CudaEvent(enable_timing=True)
            if lead_us > 0:
                self.lead = (
                    flush if flush is not None else torch.empty(LEAD_BYTES, dtype=torch.uint8, device=device)
                )
                self.lead_reps = reps or self._reps_for(lead_us)

    def _reps_for(self, us: float) -> int:
        """How many writes of the lead buffer last `us`, from four timed writes."""
        self.lead.zero_()  # the first write loads the kernel
        cuda_synchronize(self.device)
        self.start.record()
        for _ in range(4):
            self.lead.zero_()
        self.end.record()
        self.end.synchronize()
        per_write_us = max(self.start.elapsed_time(self.end) * 1e3 / 4, 1e-3)
        return max(1, min(MAX_LEAD_REPS, math.ceil(us / per_write_us)))

    def sync(self) -> None:
        if self.cuda:
            cuda_synchronize(self.device)

    def measure(self, call: Callable[[], Any]) -> tuple[float, float | None, float | None, Any]:
        """(sample ms, caller's-stream ms, spill ms, the call's output). The spill is how long
        the rest of the device took after the caller's stream was done (the host's wait less an
        empty wait's); None on the CPU, as the caller's-stream figure is."""
        if not self.cuda:
            begin = perf_counter()
            out = call()
            finish = perf_counter()
            return (finish - begin) * 1e3, None, None, out
        for _ in range(self.lead_reps):
            self.lead.zero_()
        self.start.record()
        out = call()
        self.end.record()
        self.end.synchronize()
        # The wait for the rest of the device, less what a wait costs when nothing is left
        # (a second one right after), as unsteady as the host.
        first = perf_counter()
        cuda_synchronize(self.device)
        second = perf_counter()
        cuda_synchronize(self.device)
        rest_ms = ((second - first) - (perf_counter() - second)) * 1e3
        naive = self.start.elapsed_time(self.end)
        return naive, naive, rest_ms, out


LEAD_BYTES = 64 * 1024 * 1024  # the lead's buffer when there is no flush buffer to write
MAX_LEAD_REPS = 1000


def clock_for(request: dict[str, Any], device: torch.device, flush: torch.Tensor | None) -> _Clock:
    """The clock a timing request asks for (both sides get the same request; the candidate's
    also carries the judge's `reps`)."""
    return _Clock(
        device,
        float(request.get("lead_us") or 0.0),
        flush,
        int(request["reps"]) if request.get("reps") else None,
    )


def run_timing(
    subjects: list[Subject],
    bank: InputBank,
    *,
    device: torch.device,
    warmup: int,
    trials: int,
    flush_bytes: int,
    rng: random.Random,
    check_round: Callable[[dict[str, Any]], str | None] | None = None,
    release: Callable[[dict[str, Any]], None] | None = None,
    on_flush: Callable[[], None] | None = None,
    lead_us: float = 0.0,
) -> TimingRun:
    """Time every subject `trials` times after `warmup` rounds; `check_round` sees each round's
    outputs and returns a problem or None; `release` disposes of them."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes > 0 else None
    clock = _Clock(device, lead_us, flush)
    run = TimingRun({s.label: [] for s in subjects}, {s.label: [] for s in subjects})
    order = list(subjects)
    for round_index in range(warmup + trials):
        index, moves = bank.draw(rng)
        seed = rng.getrandbits(31)
        rng.shuffle(order)
        outputs: dict[str, Any] = {}
        for subject in order:
            call: Callable[[], Any] = functools.partial(subject.call, subject.buffers)
            bank.fill(subject.buffers, index, moves)
            if flush is not None:
                flush.zero_()
                if on_flush is not None:
                    on_flush()
            manual_seed(seed)
            clock.sync()
            elapsed, naive, spill, out = clock.measure(call)
            if round_index >= warmup:
                run.samples[subject.label].append(elapsed)
                if naive is not None and spill is not None:
                    run.naive[subject.label].append(naive)
                    run.spill.setdefault(subject.label, []).append(spill)
            outputs[subject.label] = out
        if check_round is not None:
            problem = check_round(outputs)
            if problem is not None:
                run.failed_rounds.append((round_index, problem))
        if release is not None:
            release(outputs)
        del outputs
    return run


@dataclass(frozen=True)
class Stats:
    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    trials: int


def stats(samples: list[float]) -> Stats:
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q = statistics.quantiles(ordered, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return Stats(
        median_ms=statistics.median(ordered),
        mean_ms=statistics.fmean(ordered),
        min_ms=ordered[0],
        max_ms=ordered[-1],
        iqr_ms=iqr,
        trials=len(ordered),
    )


def bucket_speedups(reference: list[float], candidate: list[float], buckets: int = 7) -> list[float]:
    """Speedup (median over median) in consecutive time buckets: their spread is how much the
    speedup moved while it was measured."""
    count = min(buckets, len(reference) // 3, len(candidate) // 3)
    if count < 2:
        return []
    size = len(reference) // count
    out = []
    for b in range(count):
        part = slice(b * size, (b + 1) * size if b < count - 1 else None)
        c = statistics.median(candidate[part])
        out.append(statistics.median(reference[part]) / c if c > 0 else float("inf"))
    return out


def coefficient_of_variation(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean > 0 else float("inf")


def escaped_work_ms(run: TimingRun, candidate: str, reference: str) -> float:
    """How much more of the candidate's time than of the reference's happens off the current
    stream: the median spill of the candidate minus that of the reference. A clock without
    stream figures (the CPU's) records no spills, and then nothing can have escaped."""
    if not run.spill.get(candidate) or not run.spill.get(reference):
        return 0.0
    return statistics.median(run.spill[candidate]) - statistics.median(run.spill[reference])


# ---------------------------------------------------------------- the speedup and its interval


@dataclass(frozen=True)
class SpeedupEstimate:
    """The ratio of medians with a 95% bootstrap interval, over `rounds` paired rounds."""

    speedup: float
    low: float
    high: float
    rounds: int
    bucket_cv: float

    @property
    def half_width(self) -> float:
        """Half the interval's width as a fraction of the speedup."""
        return (self.high - self.low) / 2 / self.speedup if self.speedup > 0 else float("inf")

    @property
    def separated(self) -> bool:
        """The interval lies wholly above or below 1: candidate and reference differ."""
        return self.low > 1.0 or self.high < 1.0

    def describe(self) -> str:
        return f"{self.speedup:.3f}x (95% interval {self.low:.3f}-{self.high:.3f}, {self.rounds} rounds)"

    def scaled(self, factor: float) -> SpeedupEstimate:
        """The same estimate with the reference's time multiplied by `factor` (a pooled reference
        time in place of the pair's own median): speedup and interval move together."""
        return replace(self, speedup=self.speedup * factor, low=self.low * factor, high=self.high * factor)


def speedup_interval(
    reference: list[float],
    candidate: list[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    paired: bool = True,
) -> SpeedupEstimate:
    """Median over median, with a bootstrap interval.

    Paired (the default), rounds are resampled as pairs (reference and candidate of the same
    round together): the two were timed back to back on the same inputs, so a slow spell of the
    machine moves both and the pairing keeps it out of the ratio's interval, where independent
    resampling would widen it. Unpaired (a reference timed in an earlier evaluation), the two
    sides are resampled independently and the time buckets are the candidate's alone. Percentile
    interval; the number of resamples keeps its ends stable to ~0.1%.
    """
    import numpy as np

    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    n = min(len(ref), len(cand))
    if paired:
        ref, cand = ref[:n], cand[:n]
    point = float(np.median(ref) / np.median(cand)) if n and np.median(cand) > 0 else float("inf")
    if paired:
        cv = coefficient_of_variation(bucket_speedups(list(ref), list(cand)))
    else:
        cv = coefficient_of_variation(bucket_speedups([float(np.median(ref))] * len(cand), list(cand)))
    if n < 3 or not np.isfinite(point):
        return SpeedupEstimate(point, 0.0, float("inf"), len(cand), cv)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(cand), size=(resamples, len(cand)))
    ref_picks = picks if paired else rng.integers(0, len(ref), size=(resamples, len(ref)))
    ratios = np.median(ref[ref_picks], axis=1) / np.maximum(np.median(cand[picks], axis=1), 1e-12)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return SpeedupEstimate(point, float(min(low, point)), float(max(high, point)), len(cand), cv)


def settled(estimate: SpeedupEstimate, precision: float, max_cv: float | None) -> bool:
    """Enough samples: the interval is narrow and (with a gate) the buckets agree."""
    if estimate.half_width > precision:
        return False
    return max_cv is None or estimate.bucket_cv <= max_cv


@dataclass
class AdaptiveTiming:
    """The outcome of `adaptive_timing`: all samples, the estimate, and how it ended.

    With a reference bank, `reference` holds the bank and the drift-check samples together and
    `checks` the drift-check samples alone; `drift` is their median over the bank's, minus 1.
    `drifted` means the check disagreed: nothing was estimated, the caller times paired."""

    reference: list[float]
    candidate: list[float]
    estimate: SpeedupEstimate
    batches: int
    settled: bool
    checks: list[float] = field(default_factory=list)
    drift: float | None = None
    drifted: bool = False


def adaptive_timing(
    measure: Callable[[int, bool], tuple[list[float], list[float]]],
    *,
    trials: int,
    extra_batches: int,
    precision: float,
    max_cv: float | None,
    budget_s: float,
    clock: Callable[[], float] = perf_counter,
    seed: int = 0,
    reference_bank: list[float] | None = None,
    drift_tolerance: float = 0.02,
) -> AdaptiveTiming:
    """Time in batches of `trials` rounds until the speedup is settled.

    `measure(rounds, first)` times both sides for `rounds` interleaved rounds and returns their
    samples (the first batch carries the warm-up). After each batch the speedup and its interval
    are computed over everything so far; when the interval is within `precision` of the
    speedup (and the time buckets agree), or `extra_batches` more batches have run, or the
    timing has used `budget_s`, it stops. Far-apart medians settle in one batch; close ones get
    more samples, so a real difference is not lost to a noisy first batch.

    With `reference_bank` (the reference's samples from an earlier evaluation of the same task
    on the same device), `measure` times the reference on a few rounds only: those are the
    drift check. When their median is within `drift_tolerance` of the bank's, the speedup is
    estimated over the bank and the checks together, unpaired; otherwise the timing returns at
    once with `drifted` set, and the caller times both sides paired.
    """
    begin = clock()
    reference: list[float] = []
    candidate: list[float] = []
    batches = 0
    while True:
        ref, cand = measure(trials, batches == 0)
        reference += ref
        candidate += cand
        batches += 1
        drift = None
        if reference_bank:
            if reference:
                drift = statistics.median(reference) / statistics.median(reference_bank) - 1
            if drift is None or abs(drift) > drift_tolerance:
                estimate = SpeedupEstimate(float("nan"), 0.0, float("inf"), len(candidate), 0.0)
                return AdaptiveTiming(reference, candidate, estimate, batches, False, reference, drift, True)
            pooled = list(reference_bank) + reference
            estimate = speedup_interval(pooled, candidate, seed=seed + batches, paired=False)
        else:
            estimate = speedup_interval(reference, candidate, seed=seed + batches)
        done = settled(estimate, precision, max_cv)
        if done or batches > extra_batches or clock() - begin >= budget_s:
            if reference_bank:
                pooled = list(reference_bank) + reference
                return AdaptiveTiming(pooled, candidate, estimate, batches, done, reference, drift)
            return AdaptiveTiming(reference, candidate, estimate, batches, done)


def decide(timed: AdaptiveTiming, max_cv: float | None) -> tuple[float | None, str | None]:
    """The speedup to report and, when the timing did not settle, the `timing-noisy` detail.

    Settled: the speedup stands. Unsettled but the interval lies wholly on one side of 1: the
    difference is real, so the speedup stands with its (wide) interval and a note. Unsettled and
    the interval straddles 1: even the extra batches could not separate candidate and reference,
    so no speedup is reported and the detail gives the figures. `max_cv` None never refuses.
    """
    estimate = timed.estimate
    reference = statistics.median(timed.reference) if timed.reference else 0.0
    candidate = statistics.median(timed.candidate) if timed.candidate else 0.0
    if candidate <= 0:
        return None, None
    if timed.settled or max_cv is None:
        return estimate.speedup, None
    figures = (
        f"reference {reference:.4g} ms, candidate {candidate:.4g} ms: {estimate.describe()}, "
        f"time buckets varying by {estimate.bucket_cv:.1%}"
    )
    if estimate.separated:
        return estimate.speedup, f"{figures}; reported with its interval"
    return None, (
        f"{figures}; {timed.batches} batch(es) could not separate candidate and reference, "
        "no speedup is reported"
    )
