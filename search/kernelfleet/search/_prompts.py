"""The contrastive prompt: the task, the GPU, earlier variants with their measured speedups.

The recipe is the one from contrastive-RL CUDA optimisation: show the model two earlier
variants of the same task with their speedups, ask it first to explain why the faster one is
faster and where the bottleneck is, then to design an algorithm, and only then to write the
code. Showing measured numbers rather than "make it faster" is what lets the model learn from
its own history. The rules mirror the evaluator's defences, so an honest model does not waste
samples on tricks that will be rejected anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kernelfleet.core.models import Task

SYSTEM_PROMPT = (
    "You are an expert GPU performance engineer. You rewrite PyTorch modules into faster, "
    "numerically equivalent implementations (custom CUDA kernels through "
    "torch.utils.cpp_extension.load_inline, Triton kernels, or better use of PyTorch), and you "
    "explain your reasoning before you write code."
)

RULES = """\
Rules (a variant that breaks one is rejected and scores 0):
- `ModelNew` takes the same constructor arguments as `Model` and its `forward` returns the same \
values for any inputs from `get_inputs()`, within fp32 tolerance 1e-4.
- Keep the numerics: no fp16/bf16/TF32 or autocast when the task is fp32.
- No caching of results across calls, no work on side streams or threads that escapes timing, \
no changes to the problem sizes or to global torch flags, no mutation of the inputs.
- The code is one self-contained Python module: imports, any kernel sources, and `class ModelNew`."""

ANSWER_FORMAT = """\
Answer in exactly three sections:
## Performance Analysis
Why the faster variant above is faster than the slower one, where the bottleneck of the \
reference is, and which techniques have not been tried yet.
## Algorithm Design
The plan for your new variant, step by step.
## Code Implementation
One ```python block with the complete module defining `class ModelNew`."""


@dataclass(frozen=True)
class Exemplar:
    """An earlier variant shown in the prompt with its measured speedup over the reference."""

    code: str
    speedup: float
    variant_hash: str = ""


def build_messages(
    task: Task, exemplars: Sequence[Exemplar], device: str, gpu_class: str
) -> list[dict[str, str]]:
    """Chat messages (OpenAI format) asking for a faster `ModelNew` for `task` on `device`."""
    parts = [
        f"Target device: {device} (class {gpu_class}).",
        f"Task `{task.name}`. The reference module, which `ModelNew` must replace:",
        f"```python\n{task.code.strip()}\n```",
    ]
    # Slowest first: the model reads the faster one last, closest to the question.
    ordered = sorted(exemplars, key=lambda exemplar: exemplar.speedup)
    if ordered:
        parts.append(f"Earlier variants of this task, measured on this device ({len(ordered)}):")
        for index, exemplar in enumerate(ordered, start=1):
            parts.append(
                f"### Variant {index}: {exemplar.speedup:.2f}x the speed of the reference\n"
                f"```python\n{exemplar.code.strip()}\n```"
            )
        parts.append("Write a new variant that is faster than all of these.")
    else:
        parts.append("No variant of this task has been measured yet. Write a first fast variant.")
    parts.append(RULES)
    parts.append(ANSWER_FORMAT)
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
