"""What an evaluation measures and how strictly: `EvalConfig` and the tolerance profiles.

The config is a frozen value that travels to every child process, so a result can always be
traced to the exact settings that produced it. Three profiles exist: `strict` (the default:
fp32 tolerance 1e-4, modules in eval mode, TF32 off, no autograd recording), `strict-tf32`
(the same, but a candidate may turn TF32 on for both sides, and fp32 compares at 1e-3) and
`kernelbench-v0`, which reproduces how the 2025 KernelBench numbers were judged (tolerance
1e-2, train-mode modules, grad mode on, torch's default flags). In every profile a candidate
may set `cudnn.benchmark`: it is a setting any user adopts, so it is applied to both sides.
Timing is the same honest protocol in all: a profile loosens what counts as correct, never
how the clock is read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kernelfleet.core.settings import (
    FLAT_EVALUATION_KEYS,
    CorrectnessSettings,
    Device,
    EvaluationProfile,
    EvaluationSettings,
    IsolationLevel,
    IsolationSettings,
    LimitSettings,
    TimingSettings,
    refuse_flat_keys,
)
from kernelfleet.evaluator._version import EVALUATOR_VERSION

BASELINE_MODES = ("eager", "compile", "compile-reduce-overhead", "cudagraph")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Correctness rules of one profile."""

    name: str
    # (atol, rtol) per floating dtype name; other dtypes compare exactly.
    tolerances: dict[str, tuple[float, float]]
    eval_mode: bool  # call .eval() on both modules (dropout off) before comparing
    no_grad: bool  # run both under torch.no_grad()
    strict_fp32: bool  # force TF32 off and highest fp32 matmul precision for both
    # Global settings a candidate may adopt: applied to the reference as well (they are
    # process-wide), named in the result, never a rejection. Any other flag change rejects.
    allowed_settings: frozenset[str] = frozenset({"cudnn.benchmark"})

    def tolerance(self, dtype_name: str) -> tuple[float, float] | None:
        return self.tolerances.get(dtype_name)

    def allows(self, flag: str, value: object) -> bool:
        """Whether a candidate may set `flag` to `value` (then both sides run with it). A
        precision below TF32 (bf16 matmuls: `medium`, `bf16`) is never a setting."""
        return flag in self.allowed_settings and str(value).lower() not in ("medium", "bf16")


# Keyed by the profile enum, whose members are also their names as strings ("strict", ...);
# a test checks that every profile has rules.
PROFILES: dict[str, Profile] = {
    EvaluationProfile.STRICT: Profile(
        name="strict",
        tolerances={
            "float64": (1e-7, 1e-7),
            "float32": (1e-4, 1e-4),
            "float16": (1e-2, 1e-2),
            "bfloat16": (1e-2, 1e-2),
            "complex64": (1e-4, 1e-4),
            "complex128": (1e-7, 1e-7),
        },
        eval_mode=True,
        no_grad=True,
        strict_fp32=True,
    ),
    # strict, for users who train with TF32: a candidate may turn TF32 on (it then runs on both
    # sides), and fp32 compares at 1e-3, what TF32's 10-bit mantissa leaves of a matmul.
    EvaluationProfile.STRICT_TF32: Profile(
        name="strict-tf32",
        tolerances={
            "float64": (1e-7, 1e-7),
            "float32": (1e-3, 1e-3),
            "float16": (1e-2, 1e-2),
            "bfloat16": (1e-2, 1e-2),
            "complex64": (1e-3, 1e-3),
            "complex128": (1e-7, 1e-7),
        },
        eval_mode=True,
        no_grad=True,
        strict_fp32=True,
        allowed_settings=frozenset(
            {
                "cudnn.benchmark",
                "cuda.matmul.allow_tf32",
                "cudnn.allow_tf32",
                "float32_matmul_precision",
                "cuda.matmul.fp32_precision",
                "cudnn.conv.fp32_precision",
                "cudnn.rnn.fp32_precision",
                "fp32_precision",
            }
        ),
    ),
    EvaluationProfile.KERNELBENCH_V0: Profile(
        name="kernelbench-v0",
        tolerances={
            "float64": (1e-2, 1e-2),
            "float32": (1e-2, 1e-2),
            "float16": (1e-2, 1e-2),
            "bfloat16": (1e-2, 1e-2),
            "complex64": (1e-2, 1e-2),
            "complex128": (1e-2, 1e-2),
        },
        eval_mode=False,
        no_grad=False,
        strict_fp32=False,
    ),
}


# Settings deleted after evaluator 0.8.9, because their own measurements said they did not help
# (docs/measurements.md): a config that still sets one is refused with the reason, not with
# pydantic's bare "extra inputs are not permitted".
# Flat keys of 0.8.9 that are now the names of groups: a dict there is the group.
_GROUPS = ("timing", "isolation")

DELETED_SETTINGS = {
    "launch_tolerance": "no process is replaced for its launch level any more",
    "launch_rerolls": "no process is replaced for its launch level any more",
    "timing_primer_ms": "timed calls have no primer call any more",
    "pin_processes": "processes run on the CPUs the evaluator has; pin_timing keeps the timing CPU",
    "timing_clock": "there is one clock, KernelBench's events on the caller's stream",
}


def default_cache_dir() -> Path:
    """Where compiled extensions are kept: $KERNELFLEET_CACHE_DIR, else ~/.cache/kernelfleet."""
    root = os.environ.get("KERNELFLEET_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kernelfleet"
    return base / "evaluator"


class CorrectnessConfig(CorrectnessSettings):
    """`EvalConfig.correctness`: the shared correctness settings and the evaluator's own."""

    float64_reference: bool = Field(default=False, description="Compare fp32 outputs to an fp64 run.")


class TimingConfig(TimingSettings):
    """`EvalConfig.timing`: the shared timing settings and the evaluator's own."""

    enabled: bool = Field(default=True, description="False: correctness only, no speedup.")
    speedup_recheck: float | None = Field(
        default=3.0,
        description="Speedups at or above this are re-timed in a fresh process pair, and the lower of "
        "the two counts. With timing.processes of 2 or more the pairs after the first are that re-check: "
        "their pooled speedup counts, or the lowest pair's when they disagree by more than "
        "timing.recheck_tolerance. None: no re-check.",
    )
    recheck_tolerance: float = Field(
        default=0.2, ge=0, description="Relative disagreement of the two timings that is reported."
    )
    retime_correctness_trials: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Correctness trials in each process pair after the first: the first pair proved the "
        "candidate with correctness.trials, and a further pair checks the same code again in fresh "
        "processes before timing it. The re-check of a single pair (timing.processes 1) keeps "
        "correctness.trials.",
    )
    review_ceiling: float = Field(default=10.0, gt=0, description="Speedups above are flagged.")
    max_speedup_cv: float | None = Field(
        default=0.1,
        description="A speedup whose 7 time buckets vary by more is unsettled (more samples are taken); "
        "None: never refuse a speedup for noise.",
    )
    retries: int = Field(
        default=7,
        ge=0,
        description="Extra batches of timing.trials rounds taken while the speedup is unsettled.",
    )
    precision: float = Field(
        default=0.02,
        gt=0,
        description="A speedup is settled when its 95% interval is within this fraction of it.",
    )
    budget_s: float = Field(
        default=10.0,
        gt=0,
        description="No new timing batch starts after this many seconds of timing (a batch lasts at most "
        "timing.batch_s once it has 21 rounds).",
    )
    batch_s: float = Field(
        default=2.0,
        gt=0,
        description="A timing batch ends after this many seconds once it has 21 rounds (3 per time bucket), "
        "even short of timing.trials: a slow kernel is checked for a settled speedup every few seconds "
        "rather than after 100 calls of each side.",
    )
    pin_cpu: bool = Field(
        default=True,
        description="While timing, both sides' timing threads run on one CPU kept for the device (the last "
        "CPU this process may use for the first GPU, the one before it for the second, ...), so whatever "
        "disturbs that CPU disturbs both alike; on the CPU device only with cpu_threads=1.",
    )
    pair_tolerance: float = Field(
        default=0.02,
        gt=0,
        description="The spread of the pairs' speedups (largest over smallest, less 1) under which no more "
        "pairs are timed (timing.processes_max).",
    )
    reference_tolerance: float = Field(
        default=0.05,
        gt=0,
        description="How far outside the range of the pool's process medians an evaluation's own reference "
        "median may lie and still be measured against the pool (timing.reference_processes); the most a "
        "pool can move a speedup beyond what its processes showed.",
    )
    keep_samples: bool = Field(
        default=False,
        description="Keep every timed call's milliseconds in the result (Timing.samples_ms), for plots and "
        "for re-analysing a timing; off by default, because results are stored and cached. A result "
        "served from a result cache has them only if it was measured with them.",
    )
    lead_us: float = Field(
        default=1000.0,
        ge=0,
        le=20000,
        description="Microseconds of real GPU work (writes of the cache-flush buffer, the flush last) queued "
        "before each timed call of both sides, so that the call's launches queue behind it as in a loop; CPU "
        "launch time beyond the lead still counts. 0: none (evaluator 0.5.0).",
    )
    exclusive: bool = Field(
        default=True,
        description="While a candidate times a batch of rounds, the other candidates' GPU steps on that "
        "device wait (their loading runs on). False: correctness overlaps timing.",
    )
    reference_reuse: bool = Field(
        default=False,
        description="Time a task's reference once per device and evaluator session, then only on every 4th "
        "round as a drift check (timing.reference_drift). False: every evaluation times both sides on "
        "every round.",
    )
    reference_drift: float = Field(
        default=0.02,
        gt=0,
        description="A reused reference timing stands while the drift check's median is within this "
        "fraction of it; otherwise the evaluation times both sides again and renews it.",
    )
    flush_bytes: int | None = Field(
        default=None, description="Cache flush before each timed call; None: 256 MiB CUDA, 8 MiB CPU."
    )
    baseline_modes: tuple[str, ...] = Field(
        default=BASELINE_MODES,
        description="The baselines `baselines()` times, of " + ", ".join(BASELINE_MODES),
    )
    baseline_trials: int | None = Field(default=None, description="None: timing.trials.")

    @field_validator("baseline_modes")
    @classmethod
    def _check_modes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [mode for mode in value if mode not in BASELINE_MODES]
        if unknown:
            raise ValueError(f"unknown baseline modes {unknown}; choose from {list(BASELINE_MODES)}")
        return value

    def resolved_flush_bytes(self, on_cuda: bool) -> int:
        if self.flush_bytes is not None:
            return self.flush_bytes
        return 256 * 1024 * 1024 if on_cuda else 8 * 1024 * 1024


class IsolationConfig(IsolationSettings):
    """`EvalConfig.isolation`: the shared isolation setting and the evaluator's own."""

    level: Literal["auto"] | IsolationLevel = Field(
        default="auto",
        description="How candidates are walled in (docs/sandbox.md); auto: the strongest this machine "
        "offers (kernelfleet eval isolation says which).",
    )


class LimitConfig(LimitSettings):
    """`EvalConfig.limits`: the shared bounds and the evaluator's own."""

    compile_timeout_s: float = Field(
        default=180.0, gt=0, description="CPU seconds a candidate's build may take."
    )
    scratch_bytes: int = Field(
        default=4 * 1024**3,
        gt=0,
        description="The largest file a candidate may write, and its share of the sandbox's private /tmp "
        "(sized at this for each evaluation and build running at once).",
    )


# Where the evaluator's own flat settings of 0.8.9 and before now live (see FLAT_EVALUATION_KEYS).
FLAT_CONFIG_KEYS: dict[str, str] = {
    **FLAT_EVALUATION_KEYS,
    "float64_reference": "correctness.float64_reference",
    "timing": "timing.enabled",
    "speedup_recheck": "timing.speedup_recheck",
    "recheck_tolerance": "timing.recheck_tolerance",
    "retime_correctness_trials": "timing.retime_correctness_trials",
    "review_ceiling": "timing.review_ceiling",
    "max_speedup_cv": "timing.max_speedup_cv",
    "timing_retries": "timing.retries",
    "timing_precision": "timing.precision",
    "timing_budget_s": "timing.budget_s",
    "timing_batch_s": "timing.batch_s",
    "pin_timing": "timing.pin_cpu",
    "pair_tolerance": "timing.pair_tolerance",
    "reference_tolerance": "timing.reference_tolerance",
    "keep_samples": "timing.keep_samples",
    "timing_lead_us": "timing.lead_us",
    "exclusive_timing": "timing.exclusive",
    "reference_reuse": "timing.reference_reuse",
    "reference_drift": "timing.reference_drift",
    "flush_bytes": "timing.flush_bytes",
    "baseline_modes": "timing.baseline_modes",
    "baseline_trials": "timing.baseline_trials",
    "isolation": "isolation.level",
    "compile_timeout_s": "limits.compile_timeout_s",
    "scratch_bytes": "limits.scratch_bytes",
}


class EvalConfig(EvaluationSettings):
    """Settings of one evaluator, grouped as the shared `EvaluationSettings` are (correctness,
    timing, isolation, limits), each group extended with the evaluator's own settings; what
    concerns the machine (device, seed, caches, workers) is at the top. Every field has a safe
    default; tests shrink the trials.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Device = Field(default="cpu", description="'cpu', 'cuda' (all local GPUs) or 'cuda:N'.")
    correctness: CorrectnessConfig = Field(
        default_factory=CorrectnessConfig, description="How a candidate is proven correct."
    )
    timing: TimingConfig = Field(
        default_factory=TimingConfig, description="How a correct candidate is timed against its reference."
    )
    isolation: IsolationConfig = Field(
        default_factory=IsolationConfig, description="How candidates are walled in."
    )
    limits: LimitConfig = Field(default_factory=LimitConfig, description="The bounds one evaluation keeps.")
    lane_slots: int | None = Field(
        default=None,
        ge=1,
        description="Candidate processes per device at once (loading and correctness overlap; timing is "
        "exclusive). None: 4 on a GPU, 1 on the CPU.",
    )
    seed: int | None = Field(default=None, description="None: a fresh random seed per evaluation.")
    compile_workers: int | None = Field(
        default=None,
        description="CPU build processes, each compiling with cores // compile_workers jobs "
        "(MAX_JOBS in the environment overrides it); None: cores-1.",
    )
    cache_dir: str | None = Field(default=None, description="Build cache; None: default_cache_dir().")
    cpu_threads: int | None = Field(
        default=1,
        ge=1,
        description="torch threads in CPU children, for both sides (one thread times steadily on a shared "
        "machine); None keeps torch's default.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_old_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in data:
            if name in DELETED_SETTINGS:
                raise ValueError(
                    f"{name} was deleted after evaluator 0.8.9: {DELETED_SETTINGS[name]}; remove it "
                    "(docs/evaluator.md, Changelog)"
                )
        # "timing" and "isolation" were flat settings before they were groups.
        old = {
            key: FLAT_CONFIG_KEYS[key]
            for key, kind in (("timing", bool), ("isolation", str))
            if isinstance(data.get(key), kind)
        }
        refuse_flat_keys(data, {**{k: v for k, v in FLAT_CONFIG_KEYS.items() if k not in _GROUPS}, **old})
        return data

    @property
    def profile_rules(self) -> Profile:
        return PROFILES[self.correctness.profile]

    @property
    def result_version(self) -> str:
        """The evaluator version written into results: the profile and kernel demand are part
        of it, because they change verdicts, and so are clock settings other than the defaults,
        because they change what a millisecond means; results are cached by version."""
        timing = self.timing
        suffix = str(self.correctness.profile) + (".kernel" if self.correctness.require_kernel else "")
        defaults = TimingConfig.model_fields
        if timing.lead_us != defaults["lead_us"].default:
            suffix += f".lead{timing.lead_us:g}us"
        if timing.processes != defaults["processes"].default:
            suffix += f".pairs{timing.processes}"
        if timing.processes_max is not None and timing.processes_max > timing.processes:
            suffix += f".pairsmax{timing.processes_max}@{timing.pair_tolerance}"
        if timing.retime_correctness_trials != defaults["retime_correctness_trials"].default:
            suffix += f".retime{timing.retime_correctness_trials}"
        if timing.reference_processes:  # 0 is off, as None
            suffix += f".refpool{timing.reference_processes}@{timing.reference_tolerance}"
        return f"{EVALUATOR_VERSION}+{suffix}"

    @property
    def build_root(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()
