"""Settings that several parts share, declared once: the budget, the evaluation settings, the profiles.

The same models serve the custom resources (`OptimizationJobSpec.budget`, `.evaluation`), the
runtime (the search loop takes a `Budget`; the evaluator's `EvalConfig` extends
`EvaluationSettings`) and the command line (`kernelfleet.core.options` generates the flags from
the fields). A default, a bound or a help text therefore lives in exactly one place: the field.
Adding an evaluation setting is one field in its group here; the job spec, the CRD (after
`scripts/generate-crds.py`), `kernelfleet optimize` and `kernelfleet eval` all pick it up.

Evaluation settings are grouped by topic, kopf-style (`correctness`, `timing`, `isolation`,
`limits`), and a setting's path is its name everywhere: `timing.processes` in Python,
`evaluation.timing.processes` in a resource, `--timing-processes` on the command line. Field
names are snake_case in Python and camelCase in a resource (`wallTimeSeconds`), as Kubernetes
users expect; both spellings are accepted on input.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel


class Settings(BaseModel):
    """Base of the shared settings: frozen, no unknown fields, camelCase aliases."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


def check_device(value: str) -> str:
    """A device an evaluator can run on: 'cpu', 'cuda' (every local GPU) or 'cuda:N'."""
    if value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {value!r}")


Device = Annotated[str, AfterValidator(check_device)]


class IsolationLevel(enum.StrEnum):
    """How a candidate is walled in, weakest first (docs/sandbox.md).

    - `process`: its own process apart from the judge, no capabilities, rlimits, seccomp, a
      scrubbed environment, a reaper for everything it starts;
    - `landlock`: and a Landlock domain (the filesystem as an allow-list; no signals, ptrace or
      TCP outside);
    - `bubblewrap`: the process in a bubblewrap sandbox (its own mount view, PID and network
      namespaces);
    - `bubblewrap+landlock`: both.
    """

    PROCESS = "process"
    LANDLOCK = "landlock"
    BUBBLEWRAP = "bubblewrap"
    BUBBLEWRAP_LANDLOCK = "bubblewrap+landlock"


ISOLATION_LEVELS: tuple[str, ...] = tuple(level.value for level in IsolationLevel)


def isolation_rank(level: str) -> int:
    """Position of `level` in ISOLATION_LEVELS; -1 for '' (a result from before the sandbox)."""
    return ISOLATION_LEVELS.index(level) if level in ISOLATION_LEVELS else -1


_SIZE_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'8G', '8GB', '512Mi', '1.5g' or a plain number of bytes -> bytes. G is 10^9 and Gi 2^30,
    as in Kubernetes quantities; ValueError names what is accepted."""
    if isinstance(text, int):
        value = text
    else:
        raw = text.strip().lower().removesuffix("b")
        number = raw.rstrip("kmgti")
        unit = raw[len(number) :]
        try:
            value = int(float(number) * _SIZE_UNITS[unit])
        except (KeyError, ValueError):
            raise ValueError(
                f"{text!r} is not a size: use a number of bytes or one with a unit, e.g. 512Mi, 8G, 16Gi"
            ) from None
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive size")
    return value


def _check_size(value: str | None) -> str | None:
    if value:
        parse_bytes(value)
    return value or None


MemorySize = Annotated[str, AfterValidator(_check_size)]


class LocalSettings(Settings):
    """What a command run on this machine adds to the shared settings: where to evaluate."""

    device: Device | None = Field(
        default=None,
        description="Where to evaluate: cpu, cuda (every local GPU) or cuda:N. None: cuda if available, "
        "else cpu.",
    )


class EvaluationProfile(enum.StrEnum):
    """How strictly correctness is judged; timing is the same honest protocol in every profile.

    - `strict`: fp32 tolerance 1e-4, modules in eval mode, TF32 off, no autograd recording;
    - `strict-tf32`: strict, but a candidate may turn TF32 on (then for both sides), and fp32
      compares at 1e-3;
    - `kernelbench-v0`: how the 2025 KernelBench numbers were judged (tolerance 1e-2,
      train-mode modules, grad mode on, torch's default flags).
    """

    STRICT = "strict"
    STRICT_TF32 = "strict-tf32"
    KERNELBENCH_V0 = "kernelbench-v0"


class Budget(Settings):
    """When the search stops. `rounds` and `samples_per_round` shape it; the rest cut it short.

    A budget applies to one call of the loop over its tasks: `kernelfleet optimize` makes one
    call over all the tasks it was given; a cluster worker makes one call per task. The time
    limits are bounds, not hints: at the limit nothing new starts, evaluations in flight are
    cancelled (not recorded, so a resumed call evaluates them), and no baseline or
    re-verification is started.
    """

    rounds: int = Field(default=4, ge=1, le=1000, description="Contrastive rounds, per task.")
    samples_per_round: int = Field(
        default=4, ge=1, le=1024, description="Variants asked of each policy, per task and round."
    )
    wall_time_seconds: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds each task may search, per call, counted from the call's start (the tasks "
        "of one call search side by side, so the call ends within it too); a task stopped by it "
        "continues when the call is repeated. None: no limit.",
    )
    gpu_seconds: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Device seconds of evaluation, per call: every evaluation of the call's tasks on "
        "this GPU class counts, those of earlier calls included, so a resumed run does not start "
        "afresh. None: no limit.",
    )
    target_speedup: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Stop a task once one of its variants is this much faster than eager, per task. "
        "None: search every round.",
    )

    def fingerprint(self) -> str:
        """A short digest of the budget: summaries written under one budget are not read under another."""
        text = repr(
            (
                self.rounds,
                self.samples_per_round,
                self.wall_time_seconds,
                self.gpu_seconds,
                self.target_speedup,
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]


class CorrectnessSettings(Settings):
    """How a candidate is proven correct (`evaluation.correctness`)."""

    profile: EvaluationProfile = Field(
        default=EvaluationProfile.STRICT,
        description="Correctness rules: strict, strict-tf32 or kernelbench-v0 (see docs/evaluator.md).",
    )
    trials: int = Field(
        default=5, ge=1, le=1000, description="Correctness checks, each with a fresh seed and inputs."
    )
    require_kernel: bool = Field(
        default=False, description="Demand a custom CUDA/C++ or Triton kernel; plain PyTorch is rejected."
    )


class TimingSettings(Settings):
    """How a correct candidate is timed against its reference (`evaluation.timing`)."""

    trials: int = Field(
        default=100, ge=3, le=100000, description="Timed calls of each side, per timing batch."
    )
    warmup: int = Field(default=10, ge=1, le=10000, description="Untimed interleaved rounds before timing.")
    processes: int = Field(
        default=2,
        ge=1,
        le=4,
        description="Fresh process pairs (judge and candidate) that time a correct candidate: the speedup is "
        "the geometric mean of the pairs' own, and its interval spans each pair's. Each pair loads the "
        "candidate afresh and checks it again; the pairs after the first are the re-check of a speedup at or "
        "above timing.speedup_recheck. 1: one pair, as KernelBench.",
    )
    processes_max: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description="Time more fresh process pairs, up to this many in all, while the pairs' speedups spread "
        "by more than timing.pair_tolerance (largest over smallest); one more starts only while "
        "limits.timeout_seconds has room for twice what a pair took. At least timing.processes; "
        "`kernelfleet eval serve` sets 4. None: exactly timing.processes pairs.",
    )
    reference_processes: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="Time each task's reference once per evaluator session, as the geometric mean of its "
        "medians in this many fresh processes, and measure every candidate of the task against that figure; "
        "an evaluation whose own reference falls outside the pool's range keeps its paired speedup. "
        "`kernelfleet eval serve` sets 4 (0 turns it off there). None: each evaluation's own pairs, as 0.",
    )

    @field_validator("reference_processes")
    @classmethod
    def _a_pool_of_several(cls, value: int | None) -> int | None:
        if value == 1:
            raise ValueError(
                "timing.reference_processes 1 would pool a single process, which is what each evaluation's "
                "own pairs already give: set 0 (off) or 2 and more"
            )
        return value

    @field_validator("processes_max")
    @classmethod
    def _at_least_processes(cls, value: int | None, info: ValidationInfo) -> int | None:
        pairs = info.data.get("processes")
        if value is not None and pairs is not None and value < pairs:
            raise ValueError(
                f"timing.processes_max ({value}) is below timing.processes ({pairs}): set it to "
                f"{pairs} or more, or leave it unset for exactly timing.processes pairs"
            )
        return value


class IsolationSettings(Settings):
    """How candidates are walled in (`evaluation.isolation`; docs/sandbox.md)."""

    min_level: IsolationLevel | None = Field(
        default=None,
        description="Refuse to evaluate on a machine that cannot wall candidates in at least this well: "
        "process, landlock, bubblewrap or bubblewrap+landlock (docs/sandbox.md). None: any level.",
    )


class LimitSettings(Settings):
    """The bounds one evaluation keeps (`evaluation.limits`)."""

    timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one evaluation may take (load, check, time, in every process pair and the "
        "re-check together; waiting for the device excluded) before its processes are killed and the "
        "verdict is timeout.",
    )
    memory: MemorySize | None = Field(
        default=None,
        description="Host memory a candidate's process may allocate, e.g. 8G or 16Gi. None: half of "
        "the machine's memory.",
    )

    @property
    def memory_bytes(self) -> int | None:
        return parse_bytes(self.memory) if self.memory else None


# The flat names of evaluator 0.8.9 and before, with where each setting now lives: a flat key is
# refused with its new place named, so that an old job spec or command line fails clearly.
FLAT_EVALUATION_KEYS: dict[str, str] = {
    "profile": "correctness.profile",
    "correctness_trials": "correctness.trials",
    "require_kernel": "correctness.require_kernel",
    "timing_trials": "timing.trials",
    "warmup": "timing.warmup",
    "timing_processes": "timing.processes",
    "timing_processes_max": "timing.processes_max",
    "reference_processes": "timing.reference_processes",
    "min_isolation": "isolation.min_level",
    "timeout_seconds": "limits.timeout_seconds",
    "memory_limit": "limits.memory",
}


def refuse_flat_keys(data: Any, moved: dict[str, str]) -> None:
    """Raise ValueError naming the new place of any key of `data` in `moved` (snake_case or
    camelCase), so that `timing_trials: 7` says to write `timing.trials`."""
    if not isinstance(data, dict):
        return
    for key in data:
        name = next((old for old in moved if key in (old, to_camel(old))), None)
        if name is not None:
            where = moved[name]
            camel = ".".join(to_camel(part) for part in where.split("."))
            raise ValueError(
                f"{key} is now {where} ({camel} in a resource): the settings were grouped after 0.8.9"
            )


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` laid over it, group by group: {"timing": {"trials": 7}} over
    {"timing": {"warmup": 2}} keeps both."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


class EvaluationSettings(Settings):
    """What an evaluation measures and how strictly, grouped by topic: the settings a user gives on
    the command line (`--timing-trials`), in a job spec (`evaluation.timing.trials`), or in the
    evaluator's `EvalConfig` (which extends each group with the evaluator's own settings)."""

    correctness: CorrectnessSettings = Field(
        default_factory=CorrectnessSettings, description="How a candidate is proven correct."
    )
    timing: TimingSettings = Field(
        default_factory=TimingSettings, description="How a correct candidate is timed against its reference."
    )
    isolation: IsolationSettings = Field(
        default_factory=IsolationSettings, description="How candidates are walled in."
    )
    limits: LimitSettings = Field(
        default_factory=LimitSettings, description="The bounds one evaluation keeps."
    )

    @model_validator(mode="before")
    @classmethod
    def _grouped(cls, data: Any) -> Any:
        refuse_flat_keys(data, FLAT_EVALUATION_KEYS)
        return data
