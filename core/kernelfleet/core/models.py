"""The API models that the evaluator, the trainer, the operator and the store share.

They are frozen pydantic models: values that travel between processes, pods and the store
as JSON, never engines. A result is keyed by (task hash, variant hash, GPU class, evaluator
version), so the same code is never evaluated twice on the same hardware.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, computed_field

from kernelfleet.core.hashing import source_hash


class Frozen(BaseModel):
    """Base for every shared value: immutable, and strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Task(Frozen):
    """A KernelBench-format workload: a module defining `Model`, `get_inputs`, `get_init_inputs`."""

    name: str = Field(description="Human-readable name, unique within a run, e.g. '1_12_diag_matmul'.")
    code: str = Field(description="Python source of the reference module.")
    level: int | None = Field(default=None, description="KernelBench level, when the task comes from it.")
    task_id: int | None = Field(default=None, description="KernelBench problem id within its level.")
    source: str = Field(default="", description="Where the task was loaded from (path or selection).")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hash(self) -> str:
        return source_hash(self.code)


class Verdict(enum.StrEnum):
    CORRECT = "correct"
    INCORRECT = "incorrect"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"


class Timing(Frozen):
    """Milliseconds per call over `trials` timed runs."""

    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float = Field(description="Interquartile range: the spread that the variance gate reads.")
    trials: int
    samples_ms: list[float] | None = Field(
        default=None,
        description="Every timed call in the order it was made, when the evaluator keeps them "
        "(EvalConfig.keep_samples); None otherwise.",
    )
    stream_samples_ms: list[float] | None = Field(
        default=None,
        description="The same calls timed on the caller's stream alone (KernelBench's clock), in the same "
        "order, when samples_ms is kept and the device is a GPU; None otherwise.",
    )


class Environment(Frozen):
    """Where a result was measured. Results from different environments are never compared."""

    device: str = Field(description="Device name as the runtime reports it, e.g. 'NVIDIA H200' or 'cpu'.")
    gpu_class: str = Field(description="Pool class ('h100', 'a100', ...), 'cpu' on the CPU.")
    driver: str = ""
    torch: str = ""
    cuda: str = ""
    evaluator_version: str = ""
    host: str = ""


class EvaluationResult(Frozen):
    """The judgement of one variant of one task on one kind of device."""

    task_hash: str
    variant_hash: str
    verdict: Verdict
    reasons: tuple[str, ...] = ()
    reference: Timing | None = None
    candidate: Timing | None = None
    speedup: float | None = Field(default=None, description="reference median / candidate median.")
    speedup_ci: tuple[float, float] | None = Field(
        default=None, description="95% bootstrap interval of the speedup (paired rounds)."
    )
    settings: dict[str, str] = Field(
        default_factory=dict,
        description="Global settings the candidate needs (e.g. cudnn.benchmark), applied to both sides.",
    )
    flagged_for_review: bool = Field(default=False, description="Speedup above the review ceiling.")
    max_abs_error: float | None = None
    environment: Environment
    profile: str = "strict"
    seconds: float = Field(default=0.0, description="Wall time the evaluation took.")
    log: str = Field(default="", description="Compiler or runtime output worth keeping (truncated).")
    stages: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds per stage: process_start, cuda_init, build, reference, candidate_load, "
        "correctness, lane_wait, timing, recheck.",
    )
    isolation: str = Field(
        default="",
        description="How the candidate was walled in (an IsolationLevel of core.settings; '' for "
        "results written before the sandbox existed).",
    )

    @property
    def key(self) -> ResultKey:
        return ResultKey(
            task_hash=self.task_hash,
            variant_hash=self.variant_hash,
            gpu_class=self.environment.gpu_class,
            evaluator_version=self.environment.evaluator_version,
        )

    @property
    def final(self) -> bool:
        """Whether this result is the last word on its key. Not final: a correct candidate whose
        timing could not be settled (noisy, perhaps because another evaluation shared the
        device), and a result of a failed judge (the evaluator's fault, not the candidate's).
        Caches and the optimisation loop keep such results apart, and a resumed run measures
        again."""
        codes = {text.split(":", 1)[0].strip() for text in self.reasons}
        if "judge-failed" in codes:
            return False
        return not (self.verdict == Verdict.CORRECT and self.speedup is None and "timing-noisy" in codes)

    @property
    def reference_ms(self) -> float | None:
        return self.reference.median_ms if self.reference else None

    @property
    def candidate_ms(self) -> float | None:
        return self.candidate.median_ms if self.candidate else None


class ResultKey(Frozen):
    task_hash: str
    variant_hash: str
    gpu_class: str
    evaluator_version: str

    def path(self) -> str:
        """The key's place in the store, relative to a run's root."""
        task, variant = self.task_hash[:16], self.variant_hash
        return f"results/{task}/{self.gpu_class}/{self.evaluator_version}/{variant}.json"


# Stop reasons of a spent budget. Such a task is stopped, not finished: nothing more was
# measured for it (no re-verification, no baselines after the limit), and the same call
# continues it while the budget allows.
BUDGET_STOPS = ("wall-time", "gpu-seconds")


class TaskSummary(Frozen):
    """How the optimisation of one task on one GPU class ended. Written last, it marks the task done.

    The operator reads these to fill a job's status, so they live here and not in the trainer.
    """

    task_name: str
    task_hash: str
    gpu_class: str
    evaluator_version: str
    stop_reason: str = Field(description="rounds, target, exhausted, wall-time or gpu-seconds.")
    rounds: int = Field(default=0, description="Rounds the search ran.")
    samples: int = Field(default=0, description="Answers recorded, usable or not.")
    variants: int = Field(default=0, description="Distinct variants evaluated.")
    verdicts: dict[str, int] = Field(default_factory=dict, description="Evaluated variants per verdict.")
    best_variant_hash: str | None = None
    best_policy: str | None = None
    best_name: str = ""
    best_speedup: float | None = Field(
        default=None,
        description="Of the best variant over the eager reference, as re-measured in a fresh process.",
    )
    search_speedup: float | None = Field(
        default=None, description="The same variant's speedup during the search."
    )
    speedup_vs_compile: float | None = Field(default=None, description="Over torch.compile of the reference.")
    compile_speedup: float | None = Field(
        default=None,
        description="torch.compile of the reference over eager: the compile policy's compile-default variant "
        "when the run has it (timed interleaved with eager), else the evaluator's baselines.",
    )
    verified: bool = Field(default=False, description="The best variant passed its re-verification.")
    baselines: dict[str, Timing] = Field(
        default_factory=dict, description="eager, compile, ... of the reference."
    )
    gpu_seconds: float = 0.0
    not_evaluated: int = Field(
        default=0, description="Variants cancelled in flight when the budget ended; evaluated on resume."
    )
    finished_at: str = ""
