"""The custom resources' specs and statuses: OptimizationJob and TrainingRun (kernelfleet.io/v1alpha1).

The budget and the evaluation settings are the runtime's own models (`kernelfleet.core.settings`):
a job and `kernelfleet optimize` share their defaults, bounds and help. These models are the
single source of the CRDs: `scripts/generate-crds.py` turns them into
`crds/*.yaml`, and a test fails when the files are stale. Field names are camelCase, as
Kubernetes users expect, except inside training stages, which reuse trl's `SFTConfig` and
`GRPOConfig` names (`learning_rate`, `num_generations`, ...) so that users can carry a trl
configuration over unchanged.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic.alias_generators import to_camel

from kernelfleet.core.settings import Budget, EvaluationProfile, EvaluationSettings

GROUP = "kernelfleet.io"
VERSION = "v1alpha1"

__all__ = [
    "GROUP",
    "MULTIKUEUE",
    "VERSION",
    "Budget",
    "ClassStatus",
    "Condition",
    "EvaluationProfile",
    "EvaluationSettings",
    "GRPOStageConfig",
    "HeldOutSpec",
    "OptimizationJobSpec",
    "OptimizationJobStatus",
    "PeftFields",
    "PodRequests",
    "PolicyKind",
    "PolicySpec",
    "RewardSpec",
    "SFTStageConfig",
    "SelfTrainStageConfig",
    "StageData",
    "StageType",
    "TrainingRunSpec",
    "TrainingRunStatus",
    "TrainingStage",
    "TrainingStageStatus",
]

GpuClassName = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)]
TaskSelection = Annotated[str, Field(min_length=1, max_length=2048)]
# A controller name as batch/v1 Job's spec.managedBy takes it: a domain-prefixed path.
MANAGED_BY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9._~-]+)?$"
MULTIKUEUE = "kueue.x-k8s.io/multikueue"


def rule(
    expression: str, message: str, field_path: str = "", reason: str = "FieldValueInvalid"
) -> dict[str, JsonValue]:
    """A CEL validation rule of the CRD (x-kubernetes-validations), checked by the API server at
    admission, so a bad spec is refused with a message that names the field."""
    found: dict[str, JsonValue] = {"rule": expression, "message": message, "reason": reason}
    if field_path:
        found["fieldPath"] = field_path
    return found


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

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule(
                    "self.kind != 'openai' || (has(self.model) && self.model != '')",
                    "an openai policy needs model (the model name the endpoint serves)",
                    ".model",
                    "FieldValueRequired",
                ),
                rule(
                    "self.kind != 'openai' || (has(self.baseUrl) && self.baseUrl != '')",
                    "an openai policy needs baseUrl (the endpoint, e.g. http://vllm:8000/v1)",
                    ".baseUrl",
                    "FieldValueRequired",
                ),
                rule(
                    "self.kind != 'replay' || (has(self.path) && self.path != '')",
                    "a replay policy needs path (the store URL of a JSONL file)",
                    ".path",
                    "FieldValueRequired",
                ),
            ]
        }
    )

    kind: PolicyKind = Field(description="openai, hf, vllm, replay or compile.")
    model: str = Field(default="", description="Model name (openai) or path/URL of weights (hf, vllm).")
    base_url: str = Field(default="", description="OpenAI-compatible endpoint, e.g. http://vllm:8000/v1.")
    api_key_secret: str = Field(default="", description="Secret (key 'apiKey') holding the endpoint's key.")
    path: str = Field(default="", description="Replay file (JSONL) as a store URL.")
    concurrency: int = Field(default=8, ge=1, le=1024, description="Requests in flight to the endpoint.")
    temperature: float = Field(default=0.8, ge=0, le=2)


class OptimizationJobSpec(_Spec):
    """What to optimise, where, with which policy and budget.

    The spec is fixed once created, except the fields in MUTABLE: the plan (tasks, classes,
    shards, parallelism) is made once, and Kueue admits each Job for the pod count it was
    created with. The CRD refuses any other change (CEL rules generated from this list).
    """

    MUTABLE: ClassVar[tuple[str, ...]] = ("suspend", "ttlSecondsAfterFinished", "activeDeadlineSeconds")

    tasks: list[TaskSelection] = Field(
        min_length=1,
        max_length=1000,
        description="Task selections: 'kernelbench-v0:1:1-20', or a store URL prefix holding task files.",
    )
    gpu_classes: list[GpuClassName] = Field(
        default=["h100"],
        min_length=1,
        max_length=16,
        description="Pools to run on: a100, h100, l40, rtx3090, ... (each once).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    policies: list[PolicySpec] = Field(
        default=[PolicySpec(kind=PolicyKind.COMPILE)],
        min_length=1,
        max_length=16,
        description="Policies that propose variants.",
    )
    budget: Budget = Field(default_factory=Budget, description="When the search stops; see Budget.")
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="What an evaluation measures and how strictly."
    )
    parallelism: int = Field(
        default=1, ge=1, le=1024, description="Worker pods per GPU class (fixed once created)."
    )
    gpus_per_pod: int = Field(default=1, ge=1, le=8)
    store: str = Field(
        default="", max_length=2048, description="Store URL; empty means the operator's configured store."
    )
    suspend: bool = Field(
        default=False,
        description="Pause: no new pods; running ones stop and resume later from the store. Mutable.",
    )
    verify_on: list[GpuClassName] = Field(
        default_factory=list,
        max_length=16,
        description="After the search, re-verify and re-time each task's best variant on these classes.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    queue_name: str = Field(
        default="",
        max_length=63,
        description="Kueue LocalQueue: the Jobs carry kueue.x-k8s.io/queue-name and start suspended.",
    )
    priority_class_name: str = Field(default="", max_length=253, description="PriorityClass of the pods.")
    tasks_per_index: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Tasks each worker pod runs before it exits: more amortises pod start-up.",
    )
    backoff_limit_per_index: int = Field(
        default=2, ge=0, le=100, description="Retries of a failed pod (per completion index)."
    )
    managed_by: str = Field(
        default="",
        max_length=63,
        pattern=MANAGED_BY_PATTERN,
        description="spec.managedBy of the child Jobs: kueue.x-k8s.io/multikueue lets MultiKueue run them "
        "on a worker cluster; empty: this cluster's Job controller.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Seconds after the job ends (Complete or Failed) when the resource and its Jobs are "
        "deleted; the results stay in the store. Null: kept until deleted. Mutable.",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Seconds from the job's start after which it is failed (reason DeadlineExceeded) and "
        "its pods stop; what was measured stays. Null: no limit. Mutable.",
    )


class Condition(_Spec):
    """A condition in the style of metav1.Condition."""

    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class ClassStatus(_Spec):
    tasks_total: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0
    variants_evaluated: int = 0
    best_speedup: float | None = None
    median_speedup: float | None = None
    jobs: int = Field(default=0, description="Indexed Jobs of this class.")
    active_pods: int = 0


class VerifyStatus(_Spec):
    """How the best variants' speedups carry over to another GPU class."""

    tasks_total: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0
    verified: int = Field(default=0, description="Best variants still correct on this class.")
    median_speedup: float | None = Field(default=None, description="Median speedup measured on this class.")
    median_ratio: float | None = Field(
        default=None, description="Median of (speedup here) / (speedup on the class that found it)."
    )


class OptimizationJobStatus(_Spec):
    phase: str = Field(default="", description="Pending, Running, Suspended, Verifying, Succeeded or Failed.")
    observed_generation: int = 0
    tasks_total: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0
    variants_evaluated: int = 0
    best_speedup: float | None = None
    median_speedup: float | None = None
    per_class: dict[str, ClassStatus] = Field(default_factory=dict)
    verification: dict[str, VerifyStatus] = Field(default_factory=dict)
    results: str = Field(default="", description="Store URL where the results are.")
    start_time: str = ""
    completion_time: str = ""
    conditions: list[Condition] = Field(default_factory=list)


class StageType(enum.StrEnum):
    SFT = "sft"
    SELF_TRAIN = "selftrain"
    GRPO = "grpo"


class _TrlConfig(BaseModel):
    """Base of the stage configs that carry trl's own field names (snake_case, as in trl)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PeftFields(_TrlConfig):
    """LoRA through peft, with the names of trl's `ModelConfig`. Off: full fine-tuning."""

    use_peft: bool = Field(default=False, description="Train a LoRA adapter instead of all weights.")
    lora_r: int = Field(default=16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(default=32, ge=1, description="LoRA scaling numerator (alpha / r).")
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    lora_target_modules: list[str] | None = Field(
        default=None, description="Module names to adapt; None: peft's default for the architecture."
    )


class SFTStageConfig(PeftFields):
    """A subset of trl's SFTConfig, with its names (and LoRA with ModelConfig's)."""

    learning_rate: float = Field(default=2e-5, gt=0)
    num_train_epochs: float = Field(default=1.0, gt=0)
    max_steps: int = Field(default=-1, description="Optimizer steps; -1: num_train_epochs decides.")
    per_device_train_batch_size: int = Field(default=4, ge=1)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    max_length: int = Field(default=4096, ge=16, description="Tokens per example; longer ones are cut.")
    packing: bool = Field(
        default=False, description="Pack examples into max_length blocks (flash attention)."
    )
    bf16: bool = True
    gradient_checkpointing: bool = True
    logging_steps: float = Field(default=10, gt=0, description="Steps between metric records.")
    save_steps: float = Field(default=100, gt=0, description="Steps between checkpoints (kept in the store).")
    seed: int = 42


class GRPOStageConfig(PeftFields):
    """A subset of trl's GRPOConfig, with its names (and LoRA with ModelConfig's)."""

    learning_rate: float = Field(default=1e-6, gt=0)
    num_generations: int = Field(default=8, ge=2, description="Completions per prompt: the GRPO group.")
    beta: float = Field(default=0.04, ge=0, description="KL penalty; 0 loads no reference model.")
    epsilon: float = Field(default=0.2, gt=0, description="PPO ratio clip.")
    epsilon_high: float | None = Field(default=None, gt=0, description="Upper clip (DAPO); None: epsilon.")
    loss_type: str = Field(default="dapo", description="dapo, grpo, dr_grpo, bnpo, ...")
    scale_rewards: str = Field(default="group", description="group, batch or none.")
    max_completion_length: int = Field(default=4096, ge=16)
    mask_truncated_completions: bool = Field(default=False, description="No loss on cut-off completions.")
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    per_device_train_batch_size: int = Field(default=8, ge=1, description="Completions, not prompts.")
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    num_train_epochs: float = Field(default=1.0, gt=0)
    max_steps: int = Field(default=-1)
    use_vllm: bool = Field(default=True, description="Generate with vLLM when it is installed.")
    vllm_server_base_url: str = Field(
        default="",
        description="trl's server mode: generate with the vLLM server at this URL (`trl vllm-serve`; "
        "a TrainingRun with generatorGpus sets it to its generator's); empty: colocated vLLM or "
        "transformers in the trainer.",
    )
    vllm_server_timeout: float = Field(
        default=240.0, gt=0, description="Seconds to wait for the vLLM server to answer at the start."
    )
    bf16: bool = True
    gradient_checkpointing: bool = True
    logging_steps: float = Field(default=1, gt=0)
    save_steps: float = Field(default=50, gt=0)
    seed: int = 42


class SelfTrainStageConfig(_TrlConfig):
    """Self-training rounds: generate, verify, fine-tune on the correct answers only.

    Each round's fine-tuning takes the stage's `sft` config; these fields shape the generation.
    """

    rounds: int = Field(default=2, ge=1, le=100, description="Generate-verify-train rounds.")
    samples_per_task: int = Field(default=8, ge=1, le=1024, description="Answers per task per round.")
    keep_per_task: int = Field(default=4, ge=1, le=1024, description="Correct answers kept, fastest first.")
    temperature: float = Field(default=0.8, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_new_tokens: int = Field(default=4096, ge=16)
    use_vllm: bool = Field(default=True, description="Generate with vLLM when installed, else transformers.")


class StageData(_Spec):
    """Where a supervised stage's examples come from: policies verified by the evaluator, or a file."""

    policies: list[PolicySpec] = Field(
        default_factory=list, description="Policies asked for solutions (replay files, endpoints, compile)."
    )
    samples_per_task: int = Field(default=8, ge=1, le=1024, description="Answers asked of each policy.")
    rounds: int = Field(default=1, ge=1, le=100, description="Contrastive rounds of data collection.")
    keep_per_task: int = Field(default=2, ge=1, le=1024, description="Correct variants kept, fastest first.")
    dataset: str = Field(
        default="", description="A ready JSONL dataset (store URL or path, prompt/completion rows) instead."
    )


class RewardSpec(_Spec):
    """The RL reward: the evaluator's speedup, penalties, normalisation and clipping."""

    clip: float = Field(default=1.5, gt=0, description="Clip after normalisation, as the paper does.")
    normalize: bool = Field(default=True, description="(r - mean) / std over each generation batch.")
    incorrect: float = Field(default=0.0, description="Reward of code that runs but is wrong or fails.")
    rejected_penalty: float = Field(default=-1.0, description="Reward of a rejected reward hack.")
    unparsable_penalty: float = Field(default=-0.5, description="Reward of an answer with no usable code.")
    exemplars: int = Field(default=2, ge=0, le=8, description="Earlier variants shown in each prompt.")
    bucket_temperature: float = Field(default=1.0, description="Softmax temperature of exemplar buckets.")
    service_url: str = Field(default="", description="`kernelfleet eval serve` URL; empty: in-process.")
    token_secret: str = Field(default="", description="Secret (key 'token') with the service's bearer token.")
    timeout_seconds: float = Field(default=1800, gt=0, description="Longest wait for one group's rewards.")


class TrainingStage(_Spec):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    type: StageType
    sft: SFTStageConfig | None = Field(
        default=None, description="Fine-tuning settings of an sft stage and of each self-training round."
    )
    selftrain: SelfTrainStageConfig | None = None
    grpo: GRPOStageConfig | None = None
    data: StageData | None = Field(default=None, description="The sft stage's examples.")
    reward: RewardSpec | None = Field(default=None, description="The grpo stage's reward.")


class HeldOutSpec(_Spec):
    """Tasks no stage trains on; after each stage the model optimises them through the normal loop.

    By default a fixed share of each KernelBench level (ranked by a hash of level, id and seed,
    over the whole level, so the split does not depend on which tasks a run selects).
    """

    fraction: float = Field(default=0.2, ge=0, lt=1, description="Share of each level held out.")
    seed: int = Field(default=0, description="Changes which tasks are held out.")
    tasks: list[str] = Field(
        default_factory=list, description="Extra task selections to hold out (and never train on)."
    )
    evaluate: bool = Field(default=True, description="Optimise the held-out tasks after each stage.")
    rounds: int = Field(default=1, ge=1, le=100)
    samples_per_round: int = Field(default=4, ge=1, le=1024)
    max_new_tokens: int = Field(default=4096, ge=16)


class PodRequests(_Spec):
    """CPU and memory one pod of a role asks for (Kubernetes quantities); empty: none asked.

    Kueue admits a stage against its ClusterQueue's quota of every resource the pods request,
    and a pod that requests nothing takes no quota: set these where the queue covers CPU and
    memory. The GPUs come from `gpusPerNode`, `generatorGpus` and `rewardGpus`.
    """

    cpu: str = Field(default="", max_length=32, description="CPU request, e.g. '96' or '500m'.")
    memory: str = Field(default="", max_length=32, description="Memory request, e.g. '1600Gi'.")


_GPUS_REMOVED = (
    "spec.gpus was replaced by spec.nodes and spec.gpusPerNode: write gpusPerNode: N for N GPUs in "
    "one pod (and nodes: M for M such pods, one torchrun rank group each)"
)


class TrainingRunSpec(_Spec):
    """The three-stage training of a policy: SFT on verified code, self-training, contrastive GRPO.

    Each stage runs as one JobSet: the `trainer` role (`nodes` pods of `gpusPerNode` GPUs, one
    torchrun rank per GPU), and for an RL stage the `generator` role (a vLLM server in trl's
    server mode) and the `reward` role (`kernelfleet eval serve`), created, admitted and ended
    together.

    The spec is fixed once created, except the fields in MUTABLE: the operator records it in the
    store at the first pass and the stages train with that record to the end (their checkpoints
    belong to it). The CRD refuses any other change (CEL rules generated from this list).
    """

    MUTABLE: ClassVar[tuple[str, ...]] = ("suspend", "ttlSecondsAfterFinished", "activeDeadlineSeconds")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.gpus)",
                    "message": _GPUS_REMOVED,
                    "fieldPath": ".gpus",
                    "reason": "FieldValueForbidden",
                }
            ]
        }
    )

    base_model: str = Field(min_length=1, description="Store URL or path of the starting weights.")
    tasks: list[str] = Field(min_length=1, description="Task selections used for data and rewards.")
    stages: list[TrainingStage] = Field(
        min_length=1,
        description="The stages, in order; each name once.",
        # Keyed by name: the API server refuses two stages of one name (Duplicate value).
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    held_out: HeldOutSpec = Field(default_factory=HeldOutSpec)
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="How rewards and held-out results are evaluated."
    )
    gpu_class: GpuClassName = "h100"
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Trainer pods of each stage (one per node); with more than one, torchrun ranks "
        "meet at the first pod's stable host name (c10d rendezvous). Default 1.",
    )
    gpus_per_node: int = Field(
        default=1, ge=1, le=16, description="GPUs of each trainer pod: one torchrun rank each. Default 1."
    )
    gpus: int | None = Field(
        default=None,
        description="Removed: use gpusPerNode (and nodes). A spec that sets it is refused.",
    )
    trainer_requests: PodRequests = Field(
        default_factory=PodRequests, description="CPU and memory of each trainer pod."
    )
    generator_gpus: int = Field(
        default=0,
        ge=0,
        le=16,
        description="GPUs of the RL stage's vLLM generation server (trl's server mode, tensor parallel "
        "over them, on gpuClass); 0: the trainer generates itself. Default 0.",
    )
    generator_requests: PodRequests = Field(
        default_factory=PodRequests, description="CPU and memory of the generation server's pod."
    )
    reward_gpu_class: str = Field(
        default="", description="Pool of the RL stage's evaluation service; empty: gpuClass."
    )
    reward_gpus: int = Field(
        default=1,
        ge=0,
        le=64,
        description="GPUs of the RL stage's evaluation service (kernelfleet eval serve, the stage's "
        "`reward` role); 0: no service, the rewards are evaluated in the trainer pod.",
    )
    reward_requests: PodRequests = Field(
        default_factory=PodRequests, description="CPU and memory of the evaluation service's pod."
    )
    queue_name: str = Field(
        default="",
        max_length=63,
        description="Kueue LocalQueue: each stage's JobSet carries kueue.x-k8s.io/queue-name, starts "
        "suspended and is admitted as one workload (every role's pods, or none). Empty: no Kueue.",
    )
    backoff_limit: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Restarts a stage survives: a failed pod restarts the stage's JobSet (every pod), "
        "which resumes from the newest checkpoint. Default 3.",
    )
    priority_class_name: str = Field(default="", max_length=253, description="PriorityClass of the pods.")
    store: str = Field(default="", description="Store URL; empty means the operator's configured store.")
    suspend: bool = Field(
        default=False,
        description="Pause: the current stage's JobSet stops (every role; it resumes from its newest "
        "checkpoint), freeing every GPU the run holds. Mutable.",
    )
    managed_by: str = Field(
        default="",
        max_length=63,
        pattern=MANAGED_BY_PATTERN,
        description="spec.managedBy of each stage's JobSet: kueue.x-k8s.io/multikueue lets MultiKueue run "
        "it on a worker cluster; empty: this cluster's JobSet controller.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Seconds after the run ends (Complete or Failed) when the resource and its JobSets "
        "are deleted; checkpoints, models and reports stay in the store. Null: kept until deleted. "
        "Mutable.",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Seconds from the run's start after which it is failed (reason DeadlineExceeded) and "
        "its current stage's JobSet is deleted; checkpoints already saved stay in the store. Null: no "
        "limit. Mutable.",
    )

    @model_validator(mode="after")
    def _no_gpus(self) -> TrainingRunSpec:
        if self.gpus is not None:
            raise ValueError(_GPUS_REMOVED)
        return self

    @property
    def trainer_gpus(self) -> int:
        """GPUs of the whole trainer role: one rank each."""
        return self.nodes * self.gpus_per_node


class TrainingStageStatus(_Spec):
    """One stage as the trainer last reported it (written to the store, copied into the status)."""

    name: str = ""
    type: str = ""
    phase: str = Field(default="Pending", description="Pending, Running, Succeeded or Failed.")
    step: int = 0
    max_steps: int = 0
    round: int = Field(default=0, description="Self-training round (from 1), 0 otherwise.")
    checkpoint: str = Field(default="", description="Store URL of the newest complete checkpoint.")
    model: str = Field(default="", description="Store URL of the stage's final weights.")
    metrics: dict[str, float] = Field(default_factory=dict, description="The newest logged metrics.")
    message: str = ""
    updated_at: str = ""


class TrainingRunStatus(_Spec):
    phase: str = ""
    observed_generation: int = 0
    current_stage: str = ""
    stages_done: int = 0
    checkpoint: str = Field(default="", description="Store URL of the newest checkpoint.")
    stages: list[TrainingStageStatus] = Field(default_factory=list)
    report: str = Field(default="", description="Store URL of the held-out report.")
    start_time: str = Field(default="", description="When the operator first reconciled the run.")
    completion_time: str = Field(
        default="", description="When the run ended (Succeeded or Failed); it is not reconciled after."
    )
    conditions: list[Condition] = Field(default_factory=list)
