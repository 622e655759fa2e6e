"""Shared helpers for the trainer's tests: a tiny local model, run configs over the example tasks,
and evaluator settings small enough for a shared CPU. No tests live here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernelfleet.core.resources import TrainingRunSpec
from kernelfleet.search._prompts import ANSWER_FORMAT, RULES, SYSTEM_PROMPT
from kernelfleet.trainer._local_model import ModelShape, build_local_model
from kernelfleet.trainer._spec import RunConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TASKS = ROOT / "examples" / "tasks"
EXAMPLE_CANDIDATES = ROOT / "examples" / "candidates.jsonl"

# The evaluator with the fewest trials that still runs the whole protocol in a child process.
FAST_EVAL: dict[str, Any] = {
    "correctness_trials": 1,
    "timing_trials": 5,
    "warmup": 1,
    "speedup_recheck": None,
    "max_speedup_cv": None,
    "baseline_modes": ("eager",),
}


def corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: the example tasks and candidates, and the prompt's prose."""
    texts = [path.read_text() for path in sorted(EXAMPLE_TASKS.glob("*.py"))]
    texts += [path.read_text() for path in sorted((ROOT / "examples" / "candidates").glob("*.py"))]
    texts += [SYSTEM_PROMPT, RULES, ANSWER_FORMAT]
    return texts * 3


def tiny_model(path: Path, shape: ModelShape | None = None) -> Path:
    return build_local_model(path, corpus(), shape or ModelShape(vocab_size=400))


def run_config(base_model: Path, stages: list[dict[str, Any]], **spec: Any) -> RunConfig:
    data = {
        "baseModel": str(base_model),
        "tasks": [str(EXAMPLE_TASKS)],
        "stages": stages,
        "heldOut": {"fraction": 0.25, "evaluate": False},
        **spec,
    }
    return RunConfig("test-run", TrainingRunSpec.model_validate(data), "test")


TINY_SFT = {
    "learning_rate": 5e-3,
    "max_steps": 4,
    "per_device_train_batch_size": 2,
    "max_length": 4096,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_steps": 2,
}
