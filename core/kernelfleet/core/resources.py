"""The custom resources' specs and statuses: OptimizationJob and TrainingRun (kernelfleet.io/v1alpha1).

These models are the single source of the CRDs: `scripts/generate-crds.py` turns them into
`crds/*.yaml`, and a test fails when the files are stale. Field names are camelCase, as
Kubernetes users expect, except inside training stages, which reuse trl's `SFTConfig` and
`GRPOConfig` names (`learning_rate`, `num_generations`, ...) so that users can carry a trl
configuration over unchanged.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "kernelfleet.io"
VERSION = "v1alpha1"

GpuClassName = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


class PolicyKind(enum.StrEnum):
    OPENAI = "openai"
    HF = "hf"
    VLLM = "vllm"
    REPLAY = "replay"
    COMPILE = "compile"


class PolicySpec(_Spec):
    """One policy that proposes variants. Several can be combined in one job."""

    kind: PolicyKind = Field(description="openai, hf, vllm, replay or compile.")
    model: str = Field(default="", description="Model name (openai) or path/URL of weights (hf, vllm).")
    base_url: str = Field(default="", description="OpenAI-compatible endpoint, e.g. http://vllm:8000/v1.")
    api_key_secret: str = Field(default="", description="Secret (key 'apiKey') holding the endpoint's key.")
    path: str = Field(default="", description="Replay file (JSONL) as a store URL.")
    concurrency: int = Field(default=8, ge=1, le=1024, description="Requests in flight to the endpoint.")
    temperature: float = Field(default=0.8, ge=0, le=2)


class Budget(_Spec):
    rounds: int = Field(default=4, ge=1, le=1000, description="Contrastive rounds per task.")
    samples_per_round: int = Field(default=8, ge=1, le=1024, description="Variants proposed per round.")
    wall_time_seconds: int | None = Field(default=None, ge=1, description="Stop a task after this long.")
    gpu_seconds: int | None = Field(default=None, ge=1, description="Stop a task after this much GPU time.")
    target_speedup: float | None = Field(default=None, gt=1, description="Stop a task once reached.")


class EvaluationProfile(enum.StrEnum):
    STRICT = "strict"
    KERNELBENCH_V0 = "kernelbench-v0"


class EvaluationSpec(_Spec):
    profile: EvaluationProfile = Field(
        default=EvaluationProfile.STRICT, description="strict or kernelbench-v0."
    )
    correctness_trials: int = Field(default=5, ge=1, le=1000)
    timing_trials: int = Field(default=100, ge=10, le=100000)


class OptimizationJobSpec(_Spec):
    """What to optimise, where, with which policy and budget."""

    tasks: list[str] = Field(
        min_length=1,
        description="Task selections: 'kernelbench-v0:1:1-20', or a store URL prefix holding task files.",
    )
    gpu_classes: list[GpuClassName] = Field(
        default=["h100"], min_length=1, description="Pools to run on: a100, h100, l40, rtx3090, ..."
    )
    policies: list[PolicySpec] = Field(
        default=[PolicySpec(kind=PolicyKind.COMPILE)],
        min_length=1,
        description="Policies that propose variants.",
    )
    budget: Budget = Field(default=Budget())
    evaluation: EvaluationSpec = Field(default=EvaluationSpec())
    parallelism: int = Field(default=1, ge=1, le=1024, description="Worker pods per GPU class.")
    gpus_per_pod: int = Field(default=1, ge=1, le=8)
    store: str = Field(default="", description="Store URL; empty means the operator's configured store.")
    suspend: bool = Field(default=False, description="Pause: no new pods; running ones finish their task.")


class Condition(_Spec):
    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""


class ClassStatus(_Spec):
    tasks_done: int = 0
    best_speedup: float | None = None
    median_speedup: float | None = None


class OptimizationJobStatus(_Spec):
    phase: str = Field(default="", description="Pending, Running, Succeeded, Failed or Suspended.")
    observed_generation: int = 0
    tasks_total: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0
    variants_evaluated: int = 0
    best_speedup: float | None = None
    per_class: dict[str, ClassStatus] = Field(default_factory=dict)
    results: str = Field(default="", description="Store URL where the results are.")
    conditions: list[Condition] = Field(default_factory=list)


class StageType(enum.StrEnum):
    SFT = "sft"
    SELF_TRAIN = "selftrain"
    GRPO = "grpo"


class SFTStageConfig(BaseModel):
    """A subset of trl's SFTConfig, with its names."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    learning_rate: float = Field(default=2e-5, gt=0)
    num_train_epochs: float = Field(default=1.0, gt=0)
    per_device_train_batch_size: int = Field(default=4, ge=1)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    max_length: int = Field(default=4096, ge=16)
    bf16: bool = True


class GRPOStageConfig(BaseModel):
    """A subset of trl's GRPOConfig, with its names."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    learning_rate: float = Field(default=1e-6, gt=0)
    num_generations: int = Field(default=8, ge=2)
    beta: float = Field(default=0.04, ge=0)
    epsilon: float = Field(default=0.2, gt=0)
    max_completion_length: int = Field(default=4096, ge=16)
    per_device_train_batch_size: int = Field(default=8, ge=1)
    max_steps: int = Field(default=-1)
    use_vllm: bool = True


class TrainingStage(_Spec):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    type: StageType
    sft: SFTStageConfig | None = None
    grpo: GRPOStageConfig | None = None


class TrainingRunSpec(_Spec):
    """The three-stage training of a policy: SFT on verified code, self-training, contrastive GRPO."""

    base_model: str = Field(min_length=1, description="Store URL or path of the starting weights.")
    tasks: list[str] = Field(min_length=1, description="Task selections used for data and rewards.")
    stages: list[TrainingStage] = Field(min_length=1)
    gpu_class: GpuClassName = "h100"
    gpus: int = Field(default=1, ge=1, le=64)
    store: str = ""
    suspend: bool = False


class TrainingRunStatus(_Spec):
    phase: str = ""
    observed_generation: int = 0
    current_stage: str = ""
    stages_done: int = 0
    checkpoint: str = Field(default="", description="Store URL of the newest checkpoint.")
    conditions: list[Condition] = Field(default_factory=list)
