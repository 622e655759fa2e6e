"""The `Evaluator`: the judge that every other part of kernelfleet trusts.

It owns the child processes. Evaluation is a pipeline over a queue: candidates that build
C++/CUDA extensions compile in a pool of CPU processes (a build cache keyed by source and
toolchain makes a rebuild free; the limit counts the build's own CPU time), while each device
runs several candidate processes at once, one fresh child per candidate: loading, CUDA start-up
and correctness overlap, and the device's timing lane goes to one of them at a time, so a GPU
never waits for nvcc, never runs two timings at once, and always has the next candidate ready.
Every result carries the seconds of each stage; `Evaluator.metrics` sums them. Results are
keyed by (task hash, candidate hash, GPU class, evaluator version) and written to the cache as
they finish, so a killed batch resumes where it stopped. A speedup at or above
`speedup_recheck` is timed again in a fresh process, and the lower of the two is the one that
counts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kernelfleet.core import reasons as R
from kernelfleet.core.errors import EvaluationCancelled, UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Environment, EvaluationResult, ResultKey, Task, Timing, Verdict
from kernelfleet.evaluator._builddir import BuildDirectory, flock_holders
from kernelfleet.evaluator._cache import ResultCache
from kernelfleet.evaluator._compiled import build_env, seal
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._devicelock import DeviceLock
from kernelfleet.evaluator._environment import gpu_class, host_name
from kernelfleet.evaluator._gpugate import GpuGate
from kernelfleet.evaluator._ops import needs_native_build, uses_torch_compile
from kernelfleet.evaluator._protocol import Evaluation, Outcome, Sides
from kernelfleet.evaluator._reference_pool import ReferencePool, ReferencePools
from kernelfleet.evaluator._sandbox import Sandbox, Walls, detect, resolve_level, sandbox_for
from kernelfleet.evaluator._timing import speedup_interval, stats

_LOG_LIMIT = 4000
# A wait for the machine-wide device lock (another process times on the device) ends with an error
# after this many times the evaluation's timeout (at least a minute): that process is not ours.
DEVICE_WAIT_FACTOR = 3.0
SLOW_AFTER_S = 60.0  # an evaluation running this long is named in the progress (and again after as long)


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return ""


def timing_from(
    samples: Sequence[float], keep: bool = False, stream: Sequence[float] | None = None
) -> Timing:
    """A timing's summary; with `keep`, the samples themselves too (in the order timed), and
    `stream`, the same calls on the caller's stream alone, when they line up with them."""
    s = stats(list(samples))
    aligned = keep and stream is not None and len(stream) == len(samples)
    return Timing(
        median_ms=s.median_ms,
        mean_ms=s.mean_ms,
        min_ms=s.min_ms,
        max_ms=s.max_ms,
        iqr_ms=s.iqr_ms,
        trials=s.trials,
        samples_ms=[float(v) for v in samples] if keep else None,
        stream_samples_ms=[float(v) for v in stream or []] if aligned else None,
    )


def answer_timings(answer: dict[str, Any], keep: bool) -> tuple[Timing, Timing]:
    """The reference's and the candidate's timing from one process pair's answer."""
    reference, candidate = (
        timing_from(answer[f"{side}_ms"], keep, answer.get(f"{side}_stream_ms"))
        for side in ("reference", "candidate")
    )
    return reference, candidate


@dataclasses.dataclass(frozen=True)
class PooledTiming:
    """Several process pairs' timings of one candidate as one: `pool_pairs`."""

    speedup: float
    interval: tuple[float, float]
    timings: tuple[Timing, Timing]  # reference, candidate: every pair's calls
    pair_speedups: tuple[float, ...]
    pair_intervals: tuple[tuple[float, float], ...]  # each pair's own bootstrap interval
    reference_ms: float | None = None  # the session's pooled reference time they are measured against

    def describe(self) -> str:
        each = ", ".join(f"{s:.3f}x" for s in self.pair_speedups)
        return (
            f"timed in {len(self.pair_speedups)} fresh process pairs ({each}): {self.speedup:.3f}x, "
            f"interval {self.interval[0]:.3f}-{self.interval[1]:.3f}"
        )


def pool_pairs(
    answers: Sequence[dict[str, Any]], keep: bool, reference_ms: float | None = None
) -> PooledTiming:
    """One speedup from several fresh process pairs (`timing_processes`): the geometric mean of the
    pairs' own speedups (ratio of medians), so that each process's offset counts once. Pooling
    the calls and taking one median instead snaps to one mode when a call has two (2:61's cuDNN
    convolution: 0.284 or 0.338 ms by process), where the mean in log space averages
    them. The interval is the geometric mean of the pairs' own bootstrap intervals, widened to
    hold every pair's speedup: rounds inside one pair never show its process's offset, the pairs'
    spread does. Each side's timing holds all its calls, its median being the geometric mean of
    the pairs' medians, so that reference over candidate is the speedup.

    `reference_ms`: the session's pooled reference time (`reference_processes`), against which
    each pair's speedup and interval are scaled in place of its own reference median."""
    estimates = []
    sides: dict[str, list[float]] = {"reference": [], "candidate": []}
    streams: dict[str, list[float] | None] = {"reference": [], "candidate": []}
    medians: dict[str, list[float]] = {"reference": [], "candidate": []}
    for answer in answers:
        reference, candidate = (
            [float(v) for v in answer[f"{side}_ms"]] for side in ("reference", "candidate")
        )
        estimate = speedup_interval(reference, candidate, paired=len(reference) == len(candidate))
        if reference_ms is not None:
            estimate = estimate.scaled(reference_ms / statistics.median(reference))
        estimates.append(estimate)
        for side, calls in (("reference", reference), ("candidate", candidate)):
            sides[side] += calls
            medians[side].append(statistics.median(calls))
            stream, kept = answer.get(f"{side}_stream_ms"), streams[side]
            streams[side] = kept + [float(v) for v in stream] if kept is not None and stream else None
    if reference_ms is not None:
        medians["reference"] = [reference_ms]
    ratios = tuple(e.speedup for e in estimates)
    timings = tuple(
        timing_from(sides[side], keep, streams[side]).model_copy(
            update={"median_ms": statistics.geometric_mean(medians[side])}
        )
        for side in ("reference", "candidate")
    )
    return PooledTiming(
        speedup=statistics.geometric_mean(ratios),
        interval=(
            min(statistics.geometric_mean([max(e.low, 1e-12) for e in estimates]), *ratios),
            max(statistics.geometric_mean([e.high for e in estimates]), *ratios),
        ),
        timings=(timings[0], timings[1]),
        pair_speedups=ratios,
        pair_intervals=tuple((e.low, e.high) for e in estimates),
        reference_ms=reference_ms,
    )


def recheck_of_pairs(pooled: PooledTiming, config: EvalConfig) -> tuple[str, int | None] | None:
    """The re-check that several process pairs already are, so that none is timed after them:
    every pair after the first is a fresh, paired measurement, which is all a re-check is. None
    when no pair's speedup reaches `speedup_recheck`; else the reason to report and, when the
    pairs disagree by more than `recheck_tolerance`, the pair with the lowest speedup, whose
    figures then count (as the lower of a first timing and its re-check does), else None: the
    pooled speedup counts."""
    ratios = pooled.pair_speedups
    if config.timing.speedup_recheck is None or max(ratios) < config.timing.speedup_recheck:
        return None
    low = min(range(len(ratios)), key=ratios.__getitem__)
    each = ", then ".join(f"{ratio:.2f}x" for ratio in ratios)
    if 1 - ratios[low] / max(ratios) > config.timing.recheck_tolerance:
        return R.reason(R.NOT_REPRODUCIBLE, f"{each} in fresh process pairs; the lowest counts"), low
    return R.reason(R.RECHECKED, f"{each} in fresh process pairs; their pooled speedup counts"), None


UNEVEN_SPREAD = 0.10  # a side whose IQR is this share of its median or more ...
UNEVEN_FACTOR = 5.0  # ... and this many times the other side's share


def uneven_spread(reference: Timing, candidate: Timing) -> str | None:
    """A note when one side's calls spread round to round far more than the other's: what
    moves that side (the host and its kernel launches, the machine's load; kernelbench-v0 keeps
    autograd on in the reference) does not move the other, so pairing cannot cancel it, and the
    same candidate can be faster or slower against it under another load by more than its
    interval says. On a GPU, 3:28's reference spread 17-20% round to round (its candidate
    0.2%) and timed 1.47 ms in the pipeline, 2.90 ms one evaluation at a time."""
    shares = {
        side: timing.iqr_ms / timing.median_ms
        for side, timing in (("reference", reference), ("candidate", candidate))
        if timing.median_ms > 0
    }
    if len(shares) < 2:
        return None
    wide = max(shares, key=shares.__getitem__)
    narrow = "candidate" if wide == "reference" else "reference"
    if shares[wide] < UNEVEN_SPREAD or shares[wide] < UNEVEN_FACTOR * shares[narrow]:
        return None
    return R.reason(
        R.UNEVEN_SPREAD,
        f"the {wide}'s calls spread by {shares[wide]:.1%} of their median round to round, the "
        f"{narrow}'s by {shares[narrow]:.1%}: what moves the {wide} (the host, kernel launches, the "
        f"machine's load) does not move the {narrow}, so the speedup can differ under another load "
        "by more than its interval",
    )


def fresh_reference_medians(answers: Sequence[dict[str, Any]]) -> list[float]:
    """The reference's median in each process pair that timed it afresh (not from the bank)."""
    return [
        statistics.median(float(ms) for ms in answer["reference_ms"])
        for answer in answers
        if (answer.get("reference_timing") or {}).get("paired") is not False
    ]


def against_pool(
    pool: ReferencePool, answers: Sequence[dict[str, Any]], pooled: PooledTiming, config: EvalConfig
) -> tuple[PooledTiming, str]:
    """The pairs measured against the session's reference pool (`reference_processes`), with the
    note that says so; the pairs' own figures, with a note, when one of their references ran
    outside the pool's range (the machine has moved since the pool was made)."""
    outside = [ms for ms in fresh_reference_medians(answers) if not pool.holds(ms)]
    if outside:
        shown = ", ".join(f"{ms:.4f}" for ms in outside)
        return pooled, R.reason(
            R.REFERENCE_DRIFTED,
            f"the reference ran {shown} ms here, outside its session pool's range by more than "
            f"{config.timing.reference_tolerance:.0%} ({pool.describe()}): the machine has moved since, so "
            "this evaluation's own paired figures count",
        )
    note = R.reason(R.REFERENCE_POOLED, pool.describe())
    return pool_pairs(answers, config.timing.keep_samples, pool.median_ms), note


def another_pair(
    answers: Sequence[dict[str, Any]], config: EvalConfig, spent_s: float, pool_owed: int = 0
) -> bool:
    """Whether a candidate timed in `answers` (its process pairs so far, which used `spent_s` of
    timeout_seconds) needs one more pair: always below timing_processes; then below `pool_owed`,
    the pairs in all that this evaluation promised the session's reference pool;
    then, up to timing_processes_max, while the pairs' own speedups (ratio of medians) spread by
    more than pair_tolerance; with a session's reference pool (`reference_processes`), whose one
    figure every pair is measured against, while the candidate's medians do. A process keeps its
    offset for its life, so pairs that disagree are told apart only by more processes, not more
    rounds. Such an optional pair starts only with room for twice what a pair took so far: one
    that ran out of the timeout would turn a measured speedup into a timeout."""
    if len(answers) < config.timing.processes:
        return True
    if config.limits.timeout_seconds - spent_s < 2 * spent_s / len(answers):
        return False
    if len(answers) < pool_owed:
        return True
    if config.timing.processes_max is None or len(answers) >= config.timing.processes_max:
        return False
    pooled = bool(config.timing.reference_processes)
    ratios = [
        (1.0 if pooled else reference.median_ms) / candidate.median_ms
        for reference, candidate in (answer_timings(answer, keep=False) for answer in answers)
    ]
    return max(ratios) / min(ratios) - 1 > config.timing.pair_tolerance


def build_jobs(cores: int, workers: int) -> int:
    """Compile jobs (MAX_JOBS, ninja's -j) for each of `workers` build processes: the build CPUs
    split evenly among them, so that a full pool never runs more compilers than there are CPUs.
    Shares taken from the builds compiling at the moment (a build alone got every CPU, so a
    load_inline extension's two sources compiled side by side) made the pipeline take at least
    1.6x as long on the same 16 published kernels (2026-12-05, docs/evaluator.md). MAX_JOBS in
    the environment overrides it."""
    return max(1, cores // max(1, workers))


class TaskError(UsageError):
    """The task's reference does not load or run: fix the task, not the candidate."""


class BatchCancelled(EvaluationCancelled):
    """`evaluate_batch` stopped early; `results` has, in input order, what did finish."""

    def __init__(self, results: list[EvaluationResult | None]) -> None:
        done = sum(1 for result in results if result is not None)
        super().__init__(
            f"the batch was stopped with {done} of {len(results)} evaluations finished", list(results)
        )


class _Lane:
    """One device: its visible id for children, its environment, and its timing lane (a lock:
    one timing at a time per device) with its gate (while one times, the other candidates'
    GPU steps wait; their loading runs on)."""

    def __init__(
        self,
        index: int,
        visible: str | None,
        environment: Environment,
        arch: str | None,
    ) -> None:
        self.index = index
        self.visible = visible
        self.environment = environment
        self.arch = arch
        self.timing = threading.Lock()
        self.gate = GpuGate()  # other evaluations' GPU steps wait while one times

    @property
    def device_id(self) -> str:
        """The device's name across processes of this machine (its machine-wide lock)."""
        return "cpu" if self.visible is None else f"cuda-{self.visible}"

    def timing_cpu(self, config: EvalConfig) -> int:
        """The CPU this device's timings run on under EvalConfig.pin_timing: counting down from
        the last CPU its processes may use, one per device, so that every evaluator process of
        the machine picks the same one for the same device."""
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        return cpus[-1 - self.index % len(cpus)]


@dataclasses.dataclass(eq=False)
class _Item:
    task: Task
    code: str
    config: EvalConfig
    future: concurrent.futures.Future[EvaluationResult]
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    state: str = "pending"  # pending, building, running
    stages: dict[str, float] = dataclasses.field(default_factory=dict)
    evaluation: Evaluation | None = None  # the build or process pair working on it now
    cpu_seen: tuple[float, float] = (0.0, 0.0)  # (monotonic time, its processes' CPU seconds) last asked
    waiting: str = ""  # what it waits for outside an evaluation (the device's lock), in words
    build_dir: Path | None = None  # its extensions' build directory, if it builds any
    device_lock: str = ""  # the machine-wide device lock's file, once it waited for it

    def working_on(self, evaluation: Evaluation) -> None:
        self.evaluation, self.cpu_seen = evaluation, (time.monotonic(), 0.0)


class Metrics:
    """What the evaluator did since it started: verdicts, seconds per stage, how busy each
    device's timing lane was. `snapshot()` is what `/metrics` and the benchmarks report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.verdicts: Counter[str] = Counter()
        self.stage_seconds: defaultdict[str, float] = defaultdict(float)
        self.stage_counts: Counter[str] = Counter()
        self.timing_busy: defaultdict[int, float] = defaultdict(float)  # lane -> seconds the lane was held
        self.active_busy: defaultdict[int, float] = defaultdict(float)  # lane -> seconds with a child on it
        self._active: Counter[int] = Counter()
        self._active_since: dict[int, float] = {}
        self._holding: dict[int, float] = {}
        self.waiting = 0  # submitted, not yet in a process
        self.building = 0
        self.running = 0
        self.cancelled = 0

    def add(self, **changes: int) -> None:
        with self._lock:
            for name, delta in changes.items():
                setattr(self, name, getattr(self, name) + delta)

    def finished(self, result: EvaluationResult) -> None:
        with self._lock:
            self.verdicts[str(result.verdict)] += 1
            for stage, seconds in result.stages.items():
                self.stage_seconds[stage] += seconds
                self.stage_counts[stage] += 1

    def lane_active(self, lane: int, delta: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self._active[lane] == 0 and delta > 0:
                self._active_since[lane] = now
            self._active[lane] += delta
            if self._active[lane] == 0:
                self.active_busy[lane] += now - self._active_since.pop(lane, now)

    def lane_held(self, lane: int, held: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if held:
                self._holding[lane] = now
            else:
                self.timing_busy[lane] += now - self._holding.pop(lane, now)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            elapsed = max(now - self.started, 1e-9)
            lanes = sorted(
                set(self.timing_busy) | set(self._holding) | set(self.active_busy) | set(self._active)
            )
            timing = {
                lane: self.timing_busy[lane] + (now - self._holding[lane] if lane in self._holding else 0.0)
                for lane in lanes
            }
            active = {
                lane: self.active_busy[lane]
                + (now - self._active_since[lane] if lane in self._active_since else 0.0)
                for lane in lanes
            }
            return {
                "uptime_s": round(elapsed, 3),
                "waiting": self.waiting,
                "building": self.building,
                "running": self.running,
                "cancelled": self.cancelled,
                "verdicts": dict(self.verdicts),
                "evaluations": sum(self.verdicts.values()),
                "stage_seconds": {k: round(v, 3) for k, v in sorted(self.stage_seconds.items())},
                "stage_counts": dict(sorted(self.stage_counts.items())),
                "timing_lane_busy_s": {str(k): round(v, 3) for k, v in timing.items()},
                "timing_lane_busy_share": {str(k): round(v / elapsed, 4) for k, v in timing.items()},
                "lane_active_share": {str(k): round(v / elapsed, 4) for k, v in active.items()},
            }


@functools.cache
def toolchain_tag() -> str:
    """A short hash of what a C++/CUDA build depends on besides its source: torch, Python, nvcc
    and the host compiler. Part of the build cache's key, so a changed toolchain never loads an
    extension built by another."""
    parts = [_torch_version(), sys.version.split()[0]]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or str(Path(cuda_home) / "bin" / "nvcc")
    for command in ([nvcc, "--version"], [os.environ.get("CXX", "c++"), "--version"]):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
            lines = [line for line in out.stdout.splitlines() if line.strip()]
            parts.append(lines[-1] if command[0] == nvcc and lines else (lines[0] if lines else ""))
        except (OSError, subprocess.SubprocessError):
            parts.append("")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


class Evaluator:
    """Evaluates candidates against tasks; use it as a context manager (it owns processes).

    Evaluation is a pipeline: `submit` returns a future at once. Candidates with C++/CUDA
    extensions build in a pool of CPU processes; then each device runs `lane_slots` candidate
    processes at once (loading, CUDA start-up and correctness overlap) and lends its timing lane
    to one of them at a time, so the next candidate is always loaded and checked when the
    device becomes free. Every candidate still runs in a process of its own.
    """

    def __init__(self, config: EvalConfig | None = None) -> None:
        self.config = config or EvalConfig()
        self._level: str | None = None
        self._lanes: list[_Lane] | None = None
        self._lanes_lock = threading.Lock()
        self._ready: queue.Queue[_Item | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._builds: concurrent.futures.ThreadPoolExecutor | None = None
        self._pipeline_lock = threading.Lock()
        self._items: set[_Item] = set()
        self._closed = False
        self._banks: dict[tuple[str, ...], list[float]] = {}
        self._banks_lock = threading.Lock()
        self._pools = ReferencePools()
        # torch.compile candidates' caches, compiled once per (task, source) in this session and
        # sealed (see _compiled): the directory, and each key's seal (None: not usable).
        self._compiled = self.config.build_root / "compiled" / f"{os.getpid()}-{secrets.token_hex(4)}"
        self._seals: dict[str, dict[str, str] | None] = {}
        self._seal_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self.metrics = Metrics()

    # -- lifecycle

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel what is queued, kill any child still running. The evaluator cannot be used
        afterwards."""
        with self._pipeline_lock:
            self._closed = True
            items = list(self._items)
        for item in items:
            item.cancel.set()  # each evaluation sees it within a quarter second and kills its children
        for _ in self._threads:
            self._ready.put(None)
        if self._builds is not None:
            self._builds.shutdown(wait=False, cancel_futures=True)
        for item in items:
            self._cancelled(item)
        shutil.rmtree(self._compiled, ignore_errors=True)

    # -- environment

    def _probe_lanes(self) -> list[_Lane]:
        with self._lanes_lock:
            if self._lanes is None:
                self._lanes = self._make_lanes()
            return self._lanes

    def _make_lanes(self) -> list[_Lane]:
        """One lane per device this evaluator uses: the CPU, or the GPUs a probe child sees."""
        torch_version = _torch_version()
        if self.config.device == "cpu":
            env = Environment(
                device="cpu",
                gpu_class="cpu",
                torch=torch_version,
                evaluator_version=self.config.result_version,
                host=host_name(),
            )
            return [_Lane(0, None, env, None)]
        outcome = self._judge_job(
            {"op": "probe", "config": self.config.model_dump(mode="json")}, None, timeout=120
        )
        answer = outcome.answer
        if answer is None or answer.get("status") != "ok":
            why = "timed out" if outcome.timed_out else outcome.exit_description or str(answer)
            raise UsageError(
                f"cannot query the GPUs (the probe {why}); check the NVIDIA "
                f"driver, or use --device cpu\n{outcome.log[-1000:]}"
            )
        devices = answer["devices"]
        if not devices:
            raise UsageError(f"device {self.config.device} asked for, but torch sees no CUDA GPU; use cpu")
        parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = (
            [v.strip() for v in parent_visible.split(",") if v.strip()]
            if parent_visible
            else [str(i) for i in range(len(devices))]
        )
        if self.config.device == "cuda":
            indices = list(range(len(devices)))
        else:
            index = int(self.config.device.split(":")[1])
            if index >= len(devices):
                raise UsageError(
                    f"device {self.config.device} does not exist: this machine has {len(devices)} GPU(s)"
                )
            indices = [index]
        lanes = []
        for position, index in enumerate(indices):
            info = devices[index]
            env = Environment(
                device=info["name"],
                gpu_class=gpu_class(info["name"]),
                driver=answer.get("driver", ""),
                torch=answer.get("torch", torch_version),
                cuda=answer.get("cuda", ""),
                evaluator_version=self.config.result_version,
                host=host_name(),
            )
            lanes.append(_Lane(position, physical[index], env, info.get("capability")))
        return lanes

    # -- the sandbox

    @property
    def isolation(self) -> str:
        """The isolation level candidates run at (resolved on first use; UsageError when it is
        below `isolation.min_level`)."""
        if self._level is None:
            self._level = resolve_level(self.config.isolation.level, self.config.isolation.min_level)
        return self._level

    def _sandbox(self) -> Sandbox:
        scratch = min(self.config.limits.scratch_bytes, 2 * _half_memory())
        return sandbox_for(self.isolation, str(self.config.build_root), scratch, self._sandbox_slots)

    @functools.cached_property
    def _sandbox_slots(self) -> int:
        """Scratch slots in the sandbox, each a tmpfs of `scratch_bytes` of its own: one for each
        judge and candidate the devices run at once, each build, and a judge-only job (baselines,
        the GPU probe). With one shared tmpfs, four slots of level-1 tasks filled it on a GPU
        (judges and harnesses failed with "No space left on device" and candidates were
        blamed), and a hostile candidate could fill it on purpose to break its neighbours. A
        tmpfs takes memory only for what is written."""
        at_once = self._lane_slots() * _device_count(self.config.device)
        return 2 * at_once + self._compile_workers() + 2

    def _sides(
        self,
        config: EvalConfig,
        lane: _Lane | None,
        env: dict[str, str],
        *,
        compiles: bool = False,
        read: tuple[str, ...] = (),
    ) -> Sides:
        level = self.isolation
        report = detect()
        memory = config.limits.memory_bytes or _half_memory()
        candidate = Walls(
            landlock=level.endswith("landlock"),
            seccomp=report.seccomp,
            memory_bytes=memory,
            file_bytes=config.limits.scratch_bytes,
            processes=None if report.cgroup else _PROCESSES,
            # A C++/CUDA candidate loads its extension from its own build directory (keyed by its
            # source: no other code's build is there), and may touch it there.
            write=(env["TORCH_EXTENSIONS_DIR"],) if "TORCH_EXTENSIONS_DIR" in env else (),
            read=read,
        )
        judge = Walls(seccomp=report.seccomp)
        child_env = dict(env)
        if lane is not None and lane.visible is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = lane.visible
        if lane is not None and lane.arch and "TORCH_CUDA_ARCH_LIST" not in os.environ:
            child_env["TORCH_CUDA_ARCH_LIST"] = lane.arch
        return Sides(level, candidate, judge, child_env, compiles)

    def _judge_job(
        self,
        message: dict[str, Any],
        lane: _Lane | None,
        timeout: float,
        cancel: threading.Event | None = None,
        *,
        compiles: bool = False,
    ) -> Outcome:
        sides = self._sides(self.config, lane, {}, compiles=compiles)
        evaluation = Evaluation(
            self._sandbox(), sides, self.config, "", "", 0, timeout=timeout, cancel=cancel
        )
        return evaluation.judge_only(message)

    @property
    def environment(self) -> Environment:
        """The environment of the first device (all devices of a batch, when they are alike)."""
        return self._probe_lanes()[0].environment

    def key_for(self, task: Task, code: str, config: EvalConfig | None = None) -> ResultKey:
        """The cache key the result of `code` on `task` will have on this evaluator."""
        return ResultKey(
            task_hash=task.hash,
            variant_hash=source_hash(code),
            gpu_class=self.environment.gpu_class,
            evaluator_version=(config or self.config).result_version,
        )

    # -- one evaluation

    def evaluate(self, task: Task, code: str) -> EvaluationResult:
        """Judge one candidate. When the task's own reference fails, the verdict is
        runtime_error with a `reference-error` reason (and the result is never cached)."""
        return self.evaluate_batch([(task, code)], cache=None, progress=False)[0]

    def _result(
        self,
        item: _Item,
        lane: _Lane,
        verdict: str,
        reasons: Iterable[str],
        *,
        seconds: float,
        log: str = "",
        reference: Timing | None = None,
        candidate: Timing | None = None,
        speedup: float | None = None,
        speedup_ci: tuple[float, float] | None = None,
        max_abs_error: float | None = None,
        settings: dict[str, str] | None = None,
        isolation: str = "",
    ) -> EvaluationResult:
        config = item.config
        reasons = list(reasons)
        flagged = False
        if speedup is not None and speedup > config.timing.review_ceiling:
            flagged = True
            reasons.append(
                R.reason(
                    R.REVIEW, f"speedup {speedup:.2f}x is above the {config.timing.review_ceiling:g}x ceiling"
                )
            )
        if any(
            R.reason_code(t) in (R.NOT_REPRODUCIBLE, R.TRACE_UNAVAILABLE, R.DEGENERATE_TASK, R.JUDGE_FAILED)
            for t in reasons
        ):
            flagged = True
        environment = lane.environment
        if environment.evaluator_version != config.result_version:
            environment = environment.model_copy(update={"evaluator_version": config.result_version})
        return EvaluationResult(
            task_hash=item.task.hash,
            variant_hash=source_hash(item.code),
            verdict=Verdict(verdict),
            reasons=tuple(reasons),
            reference=reference,
            candidate=candidate,
            speedup=speedup,
            speedup_ci=speedup_ci if speedup is not None else None,
            settings=settings or {},
            flagged_for_review=flagged,
            max_abs_error=max_abs_error,
            environment=environment,
            profile=str(config.correctness.profile),
            seconds=round(seconds, 3),
            log=log[-_LOG_LIMIT:] if verdict != "correct" else "",
            stages={name: round(value, 4) for name, value in item.stages.items()},
            isolation=isolation or (self._level or ""),
        )

    def _seed(self, config: EvalConfig) -> int:
        return config.seed if config.seed is not None else secrets.randbits(31)

    def _env(self, code: str, lane: _Lane) -> dict[str, str]:
        env: dict[str, str] = {}
        if needs_native_build(code):
            env["TORCH_EXTENSIONS_DIR"] = str(self._build_dir(code, lane))
        return env

    def _build_dir(self, code: str, lane: _Lane) -> Path:
        """The build cache: keyed by torch, the toolchain, the GPU architecture and the source."""
        torch_tag = _torch_version().replace("+", "_") or "unknown"
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or lane.arch or "cpu"
        toolchain = f"{toolchain_tag()}-sm{arch.replace('.', '').replace(' ', '_').replace(';', '_')}"
        return self.config.build_root / "builds" / f"torch-{torch_tag}" / toolchain / source_hash(code)[:24]

    def _build_lease(self, item: _Item, lane: _Lane) -> contextlib.AbstractContextManager[Any]:
        """The lease on the candidate's build directory for one process pair (see _builddir):
        entering it clears the lock files that a process killed mid-build left behind."""
        if not needs_native_build(item.code):
            return contextlib.nullcontext()
        item.build_dir = self._build_dir(item.code, lane)
        return BuildDirectory(item.build_dir)

    def _failure(
        self, outcome: Outcome, item: _Item, lane: _Lane, what: str, spent: float = 0.0
    ) -> EvaluationResult:
        """The result of a child that gave no answer, or the judge's error; `spent`: seconds of
        the timeout that earlier process pairs of this evaluation used."""
        if outcome.cancelled:
            raise EvaluationCancelled(f"{what} the candidate was cancelled")
        if outcome.timed_out:
            if what == "building":
                limit = f"{item.config.limits.compile_timeout_s:g} s of CPU time"
            else:
                limit = f"{item.config.limits.timeout_seconds:g} s"
                if spent > 0:
                    limit += (
                        " (timeout_seconds bounds the whole evaluation;"
                        f" earlier process pairs used {spent:.1f} s)"
                    )
            return self._result(
                item,
                lane,
                "timeout",
                [
                    R.reason(
                        R.TIMEOUT, f"{what} the candidate took longer than {limit}; the process was killed"
                    )
                ],
                seconds=outcome.seconds,
                log=outcome.log,
                isolation=outcome.isolation,
            )
        answer = outcome.answer
        if answer is not None and answer.get("status") == "judge-error":
            # The judge never runs candidate code: its failure is the evaluator's, so the result
            # is reported (the run goes on) but never cached; a resume evaluates again.
            return self._result(
                item,
                lane,
                "runtime_error",
                [R.reason(R.JUDGE_FAILED, f"while {what} the candidate: {str(answer.get('error'))[:1500]}")],
                seconds=outcome.seconds,
                log=outcome.log,
                isolation=outcome.isolation,
            )
        return self._result(
            item,
            lane,
            "runtime_error",
            [R.reason(R.CRASHED, f"the candidate's process {outcome.exit_description} while {what} it")],
            seconds=outcome.seconds,
            log=outcome.log,
            isolation=outcome.isolation,
        )

    # -- reference timings, once per task, device and session

    def _bank_key(self, item: _Item, lane: _Lane, settings: dict[str, str]) -> tuple[str, ...]:
        config = item.config.model_dump_json(
            exclude={"seed": True, "timing": {"speedup_recheck", "review_ceiling"}}
        )
        return (item.task.hash, str(lane.index), source_hash(config), repr(sorted(settings.items())))

    def _reference_bank(self, item: _Item, lane: _Lane) -> Callable[[dict[str, str]], list[float] | None]:
        """What an evaluation asks for its reference timing: the reference's samples from the
        last paired timing of the same task on this device, with the same config and settings."""

        def lookup(settings: dict[str, str]) -> list[float] | None:
            with self._banks_lock:
                bank = self._banks.get(self._bank_key(item, lane, settings))
            return list(bank) if bank else None

        return lookup

    def _keep_reference(self, item: _Item, lane: _Lane) -> Callable[[dict[str, str], list[float]], None]:
        """Where an evaluation puts its reference's samples after a paired timing that passed
        its checks. A later candidate's drift check guards against a bank that a neighbour's
        load (or a hostile candidate) disturbed: it re-times paired when the bank is off."""

        def keep(settings: dict[str, str], samples: list[float]) -> None:
            with self._banks_lock:
                self._banks[self._bank_key(item, lane, settings)] = [float(ms) for ms in samples]

        return keep

    def _child(
        self, item: _Item, lane: _Lane, *, reuse: bool = True, spent: float = 0.0, further: bool = False
    ) -> Outcome:
        """One evaluation (a judge and a candidate process) on `lane`; it holds the lane's
        timing lock, and the machine-wide lock of the device, while it times. `reuse`: the
        reference's timing may come from the session's bank (never for a re-check, which is an
        independent, paired measurement). `spent`: seconds of `timeout_seconds` that earlier
        process pairs of the same evaluation used; this one has what is left of it, since the
        timeout bounds the whole evaluation, however many pairs it takes. `further`: a process
        pair after the first, which times a candidate the first proved and so runs
        `retime_correctness_trials` correctness trials."""
        held = False

        device = DeviceLock(lane.device_id)

        def take_lane() -> None:
            nonlocal held
            while not lane.timing.acquire(timeout=0.25):
                if item.cancel.is_set():
                    raise EvaluationCancelled("cancelled while waiting for the timing lane")
            item.waiting = f"waiting for the machine-wide lock of {lane.device_id} ({device.path})"
            item.device_lock = device.path
            try:
                # ... and no other process times on this device; bounded, since that process is
                # not ours to bound (a stuck or stopped evaluator elsewhere on this machine).
                device.acquire(
                    item.cancel, timeout_s=DEVICE_WAIT_FACTOR * max(item.config.limits.timeout_seconds, 60.0)
                )
            except InterruptedError:
                lane.timing.release()
                raise EvaluationCancelled("cancelled while waiting for the device") from None
            except BaseException:
                lane.timing.release()
                raise
            finally:
                item.waiting = ""
            held = True
            self.metrics.lane_held(lane.index, True)

        def release_lane() -> None:
            nonlocal held
            if held:
                held = False
                self.metrics.lane_held(lane.index, False)
                device.release()
                lane.timing.release()

        config = item.config
        if further:
            trials = min(config.correctness.trials, config.timing.retime_correctness_trials)
            config = config.model_copy(
                update={"correctness": config.correctness.model_copy(update={"trials": trials})}
            )
        self.metrics.lane_active(lane.index, 1)
        compiled = self._seals.get(self._compile_key(item)) if uses_torch_compile(item.code) else None
        root = str(self._compiled / self._compile_key(item))
        try:
            lease = self._build_lease(item, lane)
            evaluation = Evaluation(
                self._sandbox(),
                self._sides(
                    config,
                    lane,
                    self._env(item.code, lane),
                    compiles=uses_torch_compile(item.code),
                    read=(root,) if compiled is not None else (),
                ),
                config,
                item.task.code,
                item.code,
                self._seed(config),
                timeout=max(0.001, config.limits.timeout_seconds - spent),
                cancel=item.cancel,
                take_lane=take_lane,
                release_lane=release_lane,
                reference_bank=self._reference_bank(item, lane)
                if reuse and config.timing.reference_reuse
                else None,
                keep_reference=self._keep_reference(item, lane) if config.timing.reference_reuse else None,
                gpu_gate=lane.gate if config.timing.exclusive else None,
                timing_cpu=lane.timing_cpu(config) if self._pins_timing(config, lane) else None,
                compile_cache={"root": root, "files": compiled} if compiled is not None else None,
            )
            item.working_on(evaluation)
            with lease:
                outcome = evaluation.run()
        finally:
            item.evaluation = None
            release_lane()
            self.metrics.lane_active(lane.index, -1)
        answer = outcome.answer
        if answer is not None:
            for stage, seconds in answer.get("stages", {}).items():
                item.stages[stage] = item.stages.get(stage, 0.0) + float(seconds)
        return outcome

    def _run_evaluation(self, item: _Item, lane: _Lane) -> EvaluationResult:
        started = time.monotonic()
        config = item.config
        outcome = self._child(item, lane)
        answer = outcome.answer
        if answer is None or answer.get("status") not in ("ok", "reference-error"):
            return self._failure(outcome, item, lane, "evaluating")
        if answer["status"] == "reference-error":
            detail = f"the task's own reference fails: {answer['error']}; fix the task, not the candidate"
            return self._result(
                item,
                lane,
                "runtime_error",
                [R.reason(R.REFERENCE_ERROR, detail)],
                seconds=outcome.seconds,
                log=outcome.log,
                isolation=outcome.isolation,
            )
        reasons = list(answer["reasons"])
        reused = answer.get("reference_timing") or {}
        if reused.get("paired") is False:
            reasons.append(
                R.reason(
                    R.REFERENCE_REUSED,
                    f"the reference's timing ({reused.get('bank_rounds')} rounds) is this session's for the "
                    f"task; {reused.get('checks')} drift-check rounds agreed within "
                    f"{abs(float(reused.get('drift') or 0.0)):.1%}",
                )
            )
        verdict = answer["verdict"]
        reference = candidate = None
        speedup = answer.get("speedup")
        interval = answer.get("speedup_ci")
        if answer.get("reference_ms"):
            reference, candidate = answer_timings(answer, config.timing.keep_samples)
        rechecked, spent = False, outcome.counted_s
        pairs_wanted = config.timing.processes > 1 or bool(config.timing.reference_processes)
        if verdict == "correct" and speedup is not None and pairs_wanted:
            answers = [answer]
            size = config.timing.reference_processes or 0
            pool_key = self._bank_key(item, lane, answer.get("settings") or {}) if size else ()
            # The fresh processes this evaluation brings to the task's pool, and those it offered.
            promised = self._pools.promise(pool_key, size, config.timing.processes) if size else 0
            offered, pool = 0, None
            try:
                while True:
                    while another_pair(answers, config, spent, offered + promised):
                        begin = time.monotonic()
                        more = self._child(item, lane, reuse=False, spent=spent, further=True)
                        stage = time.monotonic() - begin
                        item.stages["more_pairs"] = item.stages.get("more_pairs", 0.0) + stage
                        extra = more.answer
                        if extra is None or extra.get("status") != "ok":
                            failed = self._failure(more, item, lane, "re-timing", spent)
                            return failed.model_copy(update={"seconds": round(time.monotonic() - started, 3)})
                        spent += more.counted_s
                        if extra["verdict"] != "correct" or not extra.get("reference_ms"):
                            reasons += [f"{t} (process pair {len(answers) + 1})" for t in extra["reasons"]]
                            verdict, speedup = extra["verdict"], None
                            break
                        answers.append(extra)
                    if verdict != "correct" or not size:
                        break
                    fresh = fresh_reference_medians(answers[offered:])
                    tolerance = config.timing.reference_tolerance
                    pool = self._pools.offer(pool_key, fresh, size, tolerance, promised)
                    promised, offered = 0, len(answers)
                    room = max(0.0, config.limits.timeout_seconds - spent)
                    pool = pool or self._pools.wait(pool_key, size, tolerance, room)
                    if pool is not None:
                        break
                    # The promises out ended without a pool (an evaluation failed): bring the rest.
                    promised = self._pools.promise(pool_key, size, self._pools.missing(pool_key, size))
                    if not promised or not another_pair(answers, config, spent, offered + promised):
                        break
            finally:
                if promised:
                    self._pools.release(pool_key, promised)
            if verdict == "correct":
                pooled = pool_pairs(answers, config.timing.keep_samples)
                if pool is not None:
                    pooled, note = against_pool(pool, answers, pooled, config)
                    reasons.append(note)
                speedup, interval, reference, candidate = pooled.speedup, pooled.interval, *pooled.timings
                reasons.append(R.reason(R.POOLED, pooled.describe()))
                check = recheck_of_pairs(pooled, config)
                if check is not None:
                    rechecked, (reason, low) = True, check
                    reasons.append(reason)
                    if low is not None:
                        speedup, interval = pooled.pair_speedups[low], pooled.pair_intervals[low]
                        reference, candidate = answer_timings(answers[low], config.timing.keep_samples)
                        if pooled.reference_ms is not None:  # measured against the pool, not its own
                            reference = reference.model_copy(update={"median_ms": pooled.reference_ms})
        if (
            verdict == "correct"
            and speedup is not None
            and not rechecked
            and self._needs_recheck(speedup, config)
        ):
            begin = time.monotonic()
            recheck = self._child(item, lane, reuse=False, spent=spent)
            item.stages["recheck"] = time.monotonic() - begin
            second = recheck.answer
            if second is None or second.get("status") != "ok":
                failed = self._failure(recheck, item, lane, "re-timing", spent)
                return failed.model_copy(update={"seconds": round(time.monotonic() - started, 3)})
            if second["verdict"] != "correct":
                reasons += [f"{t} (re-check)" for t in second["reasons"]]
                verdict = second["verdict"]
                speedup = None
            elif second.get("speedup") is None:
                # The re-check could not settle its own timing: the first measurement, with its
                # interval, stands; the review flag asks a person to look.
                reasons += [f"{t} (re-check)" for t in second["reasons"]]
                reasons.append(
                    R.reason(
                        R.NOT_REPRODUCIBLE, "the re-check could not time the candidate; the first stands"
                    )
                )
            else:
                again = float(second["speedup"])
                spread = abs(speedup - again) / max(speedup, again)
                code_name = R.NOT_REPRODUCIBLE if spread > config.timing.recheck_tolerance else R.RECHECKED
                reasons.append(
                    R.reason(
                        code_name,
                        f"{speedup:.2f}x, then {again:.2f}x in a fresh process; the lower one counts",
                    )
                )
                if again < speedup:
                    speedup = again
                    interval = second.get("speedup_ci")
                    reference, candidate = answer_timings(second, config.timing.keep_samples)
        if verdict == "correct" and reference and candidate:
            uneven = uneven_spread(reference, candidate)
            reasons += [uneven] if uneven else []
        return self._result(
            item,
            lane,
            verdict,
            reasons,
            seconds=time.monotonic() - started,
            log=outcome.log,
            reference=reference,
            candidate=candidate,
            speedup=speedup,
            speedup_ci=(float(interval[0]), float(interval[1])) if interval else None,
            max_abs_error=answer.get("max_abs_error"),
            settings=answer.get("settings") or {},
            isolation=outcome.isolation,
        )

    @staticmethod
    def _needs_recheck(speedup: float, config: EvalConfig) -> bool:
        threshold = config.timing.speedup_recheck
        return threshold is not None and speedup >= threshold

    def _compile_key(self, item: _Item) -> str:
        """The directory of a torch.compile candidate's sealed cache: its task and its source."""
        return f"{item.task.hash[:16]}-{source_hash(item.code)[:24]}"

    def _build(self, item: _Item, lane: _Lane) -> EvaluationResult | None:
        """Compile a C++/CUDA candidate on the CPU side, walled in like any candidate but able to
        write its own build directory; a result only when it fails. The limit is CPU time (the
        build's own, compilers included), with a wall-time ceiling of three times that for a
        build that waits on something other than the CPU. Each build worker compiles with its
        fixed share of the CPUs (build_jobs).

        A torch.compile candidate compiles here too, once per task and source in this session,
        into a directory that is sealed when the build has exited (see _compiled); its build
        gives no result: whatever fails there, its evaluation finds and reports itself."""
        key = self._compile_key(item)
        native = needs_native_build(item.code)
        with self._seal_locks[key]:
            compiles = uses_torch_compile(item.code) and key not in self._seals
            if native or compiles:
                return self._build_now(item, lane, native=native, compiles=compiles)
        return None

    def _build_now(
        self, item: _Item, lane: _Lane, *, native: bool, compiles: bool
    ) -> EvaluationResult | None:
        config = item.config
        env = self._env(item.code, lane)
        write = []
        build_dir: Path | None = None
        if native:
            build_dir = self._build_dir(item.code, lane)
            build_dir.mkdir(parents=True, exist_ok=True)
            item.build_dir = build_dir
            write.append(str(build_dir))
        compiled = self._compiled / self._compile_key(item)
        if compiles:
            shutil.rmtree(compiled, ignore_errors=True)
            compiled.mkdir(parents=True)
            write.append(str(compiled))
            env.update(build_env(compiled))
        sides = self._sides(config, lane, env, compiles=uses_torch_compile(item.code))
        jobs = build_jobs(len(os.sched_getaffinity(0)), self._compile_workers())
        env = {**sides.env, "MAX_JOBS": os.environ.get("MAX_JOBS", str(jobs))}
        sides = dataclasses.replace(sides, env=env)
        walls = dataclasses.replace(sides.candidate, write=tuple(write))
        evaluation = Evaluation(
            self._sandbox(),
            sides,
            config,
            item.task.code,
            item.code,
            0,
            timeout=3 * config.limits.compile_timeout_s,
            cancel=item.cancel,
        )
        item.working_on(evaluation)
        try:
            with BuildDirectory(build_dir) if build_dir is not None else contextlib.nullcontext():
                outcome = evaluation.build(walls, config.limits.compile_timeout_s)
        finally:
            item.evaluation = None
        item.stages["build"] = outcome.seconds
        answer = outcome.answer
        if compiles:  # its process has exited: nothing writes the directory from now on
            built = answer is not None and answer.get("built") is True
            sealed = seal(compiled, config.limits.scratch_bytes // 4) if built else None
            self._seals[self._compile_key(item)] = sealed
        if not native:
            return None
        if answer is None:
            return self._failure(outcome, item, lane, "building")
        if answer.get("built"):
            return None
        verdict = str(answer.get("stop", "compile_error"))
        if verdict not in ("compile_error", "runtime_error", "rejected"):
            verdict = "rejected"
        reasons = (
            [str(r) for r in answer.get("reasons", [])] if isinstance(answer.get("reasons"), list) else []
        )
        return self._result(
            item,
            lane,
            verdict,
            reasons,
            seconds=outcome.seconds,
            log=outcome.log,
            isolation=outcome.isolation,
        )

    def _compile_workers(self) -> int:
        if self.config.compile_workers is not None:
            return max(1, self.config.compile_workers)
        return max(1, (os.cpu_count() or 2) - 1)

    @staticmethod
    def _pins_timing(config: EvalConfig, lane: _Lane) -> bool:
        """On the CPU the timed call's own threads do the work: one CPU holds them only when
        there is one (pinning the timing thread pins the threads it starts too)."""
        return config.timing.pin_cpu and (lane.visible is not None or config.cpu_threads == 1)

    def _lane_slots(self) -> int:
        if self.config.lane_slots is not None:
            return self.config.lane_slots
        return 1 if self.config.device == "cpu" else 4

    # -- the pipeline

    def _start(self) -> list[_Lane]:
        lanes = self._probe_lanes()
        with self._pipeline_lock:
            if self._closed:
                raise RuntimeError("the evaluator is closed; create a new Evaluator")
            if not self._threads:
                for lane in lanes:
                    for slot in range(self._lane_slots()):
                        thread = threading.Thread(
                            target=self._lane_worker,
                            args=(lane,),
                            name=f"lane{lane.index}-{slot}",
                            daemon=True,
                        )
                        thread.start()
                        self._threads.append(thread)
                self._builds = concurrent.futures.ThreadPoolExecutor(
                    self._compile_workers(), thread_name_prefix="build"
                )
        return lanes

    def submit(
        self, task: Task, code: str, config: EvalConfig | None = None
    ) -> concurrent.futures.Future[EvaluationResult]:
        """Queue one evaluation; the future gives its result, or raises `EvaluationCancelled`
        (cancelled or the evaluator closed) or the evaluator's own failure."""
        lanes = self._start()
        text = code
        item = _Item(task, text, config or self.config, concurrent.futures.Future())
        item.future.set_running_or_notify_cancel()
        try:
            compile(text, "<candidate>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
            # Nesting deep enough to exhaust the compiler is as much a compile error as a typo.
            detail = (
                f"{error.msg} (line {error.lineno})"
                if isinstance(error, SyntaxError)
                else str(error) or f"{type(error).__name__}: the code nests too deeply"
            )
            result = self._result(
                item, lanes[0], "compile_error", [R.reason(R.SYNTAX_ERROR, detail)], seconds=0.0
            )
            self.metrics.finished(result)
            item.future.set_result(result)
            return item.future
        with self._pipeline_lock:
            if self._closed:
                raise RuntimeError("the evaluator is closed; create a new Evaluator")
            self._items.add(item)
        if needs_native_build(text) or (
            uses_torch_compile(text) and self._compile_key(item) not in self._seals
        ):
            assert self._builds is not None
            self.metrics.add(building=1)
            item.state = "building"
            self._builds.submit(self._build_worker, item, lanes[0])
        else:
            self.metrics.add(waiting=1)
            self._ready.put(item)
        return item.future

    def cancel(self, future: concurrent.futures.Future[EvaluationResult]) -> None:
        """Stop one submitted evaluation: dropped if queued, its process killed if running."""
        with self._pipeline_lock:
            items = [item for item in self._items if item.future is future]
        for item in items:
            item.cancel.set()

    def state(self, future: concurrent.futures.Future[EvaluationResult]) -> str:
        """Where a submitted evaluation is: pending (queued), building, running or done."""
        if future.done():
            return "done"
        with self._pipeline_lock:
            for item in self._items:
                if item.future is future:
                    return item.state
        return "pending"

    def _item(self, future: concurrent.futures.Future[EvaluationResult]) -> _Item | None:
        with self._pipeline_lock:
            return next((i for i in self._items if i.future is future), None)

    def activity(self, future: concurrent.futures.Future[EvaluationResult]) -> str:
        """What a submitted evaluation is doing, for a progress line and the watchdog: its phase
        (with the lock, gate or lane it waits on), and whether its processes are working (the CPU
        they used since the last time asked) or waiting, so that a long compile reads apart from
        a stuck candidate; with the bound that ends it."""
        item = self._item(future)
        if item is not None and item.waiting:
            others = [pid for pid in flock_holders(item.device_lock) if pid != os.getpid()]
            return item.waiting + (f", held by pid {', '.join(map(str, others))}" if others else "")
        evaluation = item.evaluation if item is not None else None
        if item is None or evaluation is None:
            return "queued" if item is not None else "done"
        phase, cpu, runnable = evaluation.activity()
        now = time.monotonic()
        (then, before), item.cpu_seen = item.cpu_seen, (now, cpu)
        window, used = now - then, max(0.0, cpu - before)
        if item.state == "building":
            bound = f"a build is stopped after {item.config.limits.compile_timeout_s:g} s of CPU"
            locks = BuildDirectory(item.build_dir).lock_files() if item.build_dir is not None else []
            if locks:
                phase += f"; torch's build lock {locks[0]} is taken (by this build, or another process of it)"
        else:
            bound = (
                f"it is killed at the {item.config.limits.timeout_seconds:g} s evaluation timeout (--timeout)"
            )
        if window <= 0 or used >= 0.05 * window:
            doing = f"working: {used:.0f} s of CPU in the last {window:.0f} s"
        elif runnable:
            doing = (
                f"waiting for a CPU: {used:.1f} s of CPU in the last {window:.0f} s, its processes runnable "
                "(a busy machine)"
            )
        else:
            doing = f"its processes used {used:.1f} s of CPU in the last {window:.0f} s: waiting, or stuck"
        return f"{phase}, {doing}; {bound}"

    def _done(
        self, item: _Item, result: EvaluationResult | None = None, error: BaseException | None = None
    ) -> None:
        with self._pipeline_lock:
            self._items.discard(item)
        if item.future.done():
            return
        if result is not None:
            self.metrics.finished(result)
            item.future.set_result(result)
        else:
            if isinstance(error, EvaluationCancelled):
                self.metrics.add(cancelled=1)
            item.future.set_exception(error or EvaluationCancelled("cancelled"))

    def _cancelled(self, item: _Item) -> None:
        self._done(item, error=EvaluationCancelled("the evaluation was cancelled before it finished"))

    def _build_worker(self, item: _Item, lane: _Lane) -> None:
        try:
            if item.cancel.is_set():
                raise EvaluationCancelled("cancelled before its build")
            failed = self._build(item, lane)
        except BaseException as error:
            self.metrics.add(building=-1)
            self._done(item, error=error)
            return
        self.metrics.add(building=-1)
        if failed is not None:
            self._done(item, failed)
        else:
            item.state = "pending"
            self.metrics.add(waiting=1)
            self._ready.put(item)

    def _lane_worker(self, lane: _Lane) -> None:
        while True:
            item = self._ready.get()
            if item is None:
                return
            self.metrics.add(waiting=-1)
            if item.cancel.is_set() or self._closed:
                self._cancelled(item)
                continue
            self.metrics.add(running=1)
            item.state = "running"
            # `running` drops before the future resolves: a caller that has its result reads
            # metrics that no longer count it.
            try:
                result = self._run_evaluation(item, lane)
            except BaseException as error:  # cancelled, a task error or an evaluator bug
                self.metrics.add(running=-1)
                self._done(item, error=error)
            else:
                self.metrics.add(running=-1)
                self._done(item, result)

    # -- batches

    def evaluate_batch(
        self,
        items: Sequence[tuple[Task, str]],
        cache: ResultCache | None = None,
        progress: bool = False,
        stop: Callable[[float], bool] | None = None,
        slow: Callable[[Task, str, float, str], None] | None = None,
    ) -> list[EvaluationResult]:
        """Judge many candidates over all devices of this evaluator; results in input order.

        Cached results are reused; every new result is put into `cache` as soon as it exists,
        except those whose task reference failed (`reference-error`) and those that are not
        final (`EvaluationResult.final`: a timing another evaluation disturbed, a failed judge).
        `stop(seconds)`, asked a few times a second with the seconds the evaluations now running
        have spent so far, ends the batch when it answers True: nothing new starts, what runs
        is killed, and `BatchCancelled` carries the results that did finish (the cancelled ones
        are not cached, so they run again next time). `slow(task, variant_hash, seconds, activity)`
        names an evaluation that has been building or running for `SLOW_AFTER_S`, and again every
        `SLOW_AFTER_S` after, with what it does or waits on (`activity`); the progress bar names
        it too.
        """
        self._start()
        pairs = list(items)
        keys = [self.key_for(task, code) for task, code in pairs]
        unique: dict[ResultKey, tuple[Task, str]] = {}
        for key, pair in zip(keys, pairs, strict=True):
            unique.setdefault(key, pair)
        results: dict[ResultKey, EvaluationResult] = {}
        if cache is not None:
            for key in unique:
                hit = cache.get(key)
                if hit is not None:
                    results[key] = hit
        counts: Counter[str] = Counter(str(r.verdict) for r in results.values())
        bar = tqdm(
            total=len(unique),
            initial=len(results),
            desc="evaluate",
            unit="cand",
            disable=not progress,
            leave=False,
        )
        futures: dict[concurrent.futures.Future[EvaluationResult], ResultKey] = {}
        started_at: dict[concurrent.futures.Future[EvaluationResult], float] = {}
        running_since: dict[concurrent.futures.Future[EvaluationResult], float] = {}
        reported: dict[concurrent.futures.Future[EvaluationResult], float] = {}
        error: BaseException | None = None
        stopped = False
        try:
            for key, (task, code) in unique.items():
                if key not in results:
                    future = self.submit(task, code)
                    futures[future] = key
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(
                    pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in done:
                    key = futures[future]
                    try:
                        result = future.result()
                    except BaseException as failure:
                        error = error or failure
                        continue
                    results[key] = result
                    counts[str(result.verdict)] += 1
                    bar.update(1)
                    bar.set_postfix({k: v for k, v in sorted(counts.items())}, refresh=False)
                    if (
                        cache is not None
                        and result.final
                        and R.REFERENCE_ERROR not in R.codes(result.reasons)
                    ):
                        cache.put(result)
                if error is not None and not isinstance(error, EvaluationCancelled):
                    break
                now = time.monotonic()
                for future in pending:
                    # The watchdog: an evaluation that builds or runs this long is named with
                    # what it does or waits on (a lock, the gate, a process), never silent.
                    item = self._item(future)
                    if item is None or item.evaluation is None:
                        continue  # queued: its time starts with its build or its first process pair
                    since = running_since.setdefault(future, now)
                    if now - since >= reported.get(future, 0.0) + SLOW_AFTER_S:
                        reported[future] = now - since
                        task, code = unique[futures[future]]
                        doing = self.activity(future)
                        bar.set_postfix_str(
                            f"{task.name} {source_hash(code)[:12]} {now - since:.0f} s: {doing}"
                        )
                        if slow is not None:
                            slow(task, source_hash(code), now - since, doing)
                if stop is not None and pending:
                    running = [f for f in pending if f.running()]
                    for future in running:
                        started_at.setdefault(future, now)
                    if stop(sum(now - started_at[f] for f in running)):
                        stopped = True
                        break
        except BaseException:
            # Interrupted: kill every child now. The evaluator is closed afterwards (lanes still
            # finishing must not start new children); results so far are in the cache.
            self.close()
            raise
        finally:
            bar.close()
            for future in futures:
                if not future.done():
                    self.cancel(future)
        if error is not None and not isinstance(error, EvaluationCancelled):
            raise error
        if stopped or error is not None:
            raise BatchCancelled([results.get(key) for key in keys])
        return [results[key] for key in keys]

    # -- baselines

    def baselines(self, task: Task, cancel: threading.Event | None = None) -> dict[str, Timing]:
        """The reference timed eagerly, under torch.compile (default and reduce-overhead) and as
        a CUDA-graph replay, with the same protocol as candidates. A mode that is unavailable
        here (no CUDA, no compiler) is absent from the answer. Setting `cancel` kills the job
        within a quarter second and raises `EvaluationCancelled` (a caller's budget ran out)."""
        timings, _ = self.baselines_detail(task, cancel)
        return timings

    def baselines_detail(
        self, task: Task, cancel: threading.Event | None = None
    ) -> tuple[dict[str, Timing], dict[str, str]]:
        """`baselines` plus why each missing mode is missing."""
        lane = self._probe_lanes()[0]
        timeout = max(self.config.limits.timeout_seconds, 120.0) * 2
        message = {
            "op": "baselines",
            "config": self.config.model_dump(mode="json"),
            "reference": task.code,
            "seed": self._seed(self.config),
        }
        device = DeviceLock(lane.device_id)
        with lane.timing:  # baselines time on the device too: never beside a candidate's timing
            device.acquire(timeout_s=DEVICE_WAIT_FACTOR * max(timeout, 60.0))
            lane.gate.close()
            self.metrics.lane_held(lane.index, True)
            try:
                compiles = any(mode.startswith("compile") for mode in self.config.timing.baseline_modes)
                outcome = self._judge_job(message, lane, timeout, cancel, compiles=compiles)
            finally:
                self.metrics.lane_held(lane.index, False)
                lane.gate.open()
                device.release()
        if outcome.cancelled:
            raise EvaluationCancelled(f"timing the baselines of {task.name!r} was cancelled")
        answer = outcome.answer
        if answer is not None and "reference_error" in answer:
            answer = {"status": "reference-error", "error": answer["reference_error"]}
        if answer is None or answer.get("status") not in ("ok", "reference-error"):
            why = "timed out" if outcome.timed_out else outcome.exit_description or str(answer)[:2000]
            raise RuntimeError(
                f"timing the baselines of {task.name!r} failed: the process {why}\n{outcome.log[-2000:]}"
            )
        if answer["status"] == "reference-error":
            raise TaskError(f"the reference of task {task.name!r} fails on its own: {answer['error']}")
        timings = {mode: timing_from(samples) for mode, samples in answer["samples"].items() if samples}
        return timings, dict(answer.get("unavailable", {}))


_PROCESSES = 512  # tasks (threads count) a candidate may add, where RLIMIT_NPROC is the process limit


def _device_count(device: str) -> int:
    """How many GPUs `device` names, without importing torch: `cuda` counts the NVIDIA device
    files (an upper bound when CUDA_VISIBLE_DEVICES hides some)."""
    if device != "cuda":
        return 1
    return max(1, len([p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit()]))


def _half_memory() -> int:
    """Half of the machine's memory: the default memory limit of a candidate."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return max(1 << 30, pages * size // 2)
    except (ValueError, OSError):
        return 16 << 30


def median_speedup(results: Iterable[EvaluationResult]) -> float | None:
    """Median speedup over correct results (a convenience for reports)."""
    values = [r.speedup for r in results if r.verdict == Verdict.CORRECT and r.speedup is not None]
    return statistics.median(values) if values else None
