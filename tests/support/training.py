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
    "correctness": {"trials": 1},
    "timing": {
        "trials": 5,
        "warmup": 1,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
        "max_speedup_cv": None,
        "baseline_modes": ("eager",),
    },
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


def answer_text(code: str) -> str:
    return (
        "## Performance Analysis\nThe reference materialises work it does not need.\n\n"
        "## Algorithm Design\nCompute only what the output depends on.\n\n"
        f"## Code Implementation\n```python\n{code.strip()}\n```\n"
    )


def answer_model(
    path: Path, answers: list[str], boost: float = 8.0, stop: float = 10.0
) -> tuple[Path, list[int]]:
    """A real Llama whose initial weights make it answer with one of `answers`, each a single token.

    Every answer is added to the tokenizer as one token. The layers' output projections start at
    zero and the embeddings are one-hot, so at first the next token depends only on the current
    one (a bigram model written into lm_head): after any token, each answer has logit `boost`;
    after an answer, end-of-text has logit `stop`. So sampling gives one of the answers, then
    stops, with the answers equally likely; training changes all of this freely.
    """
    import math

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny_model(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(answers)
    tokenizer.save_pretrained(str(path))
    ids = [int(str(tokenizer.convert_tokens_to_ids(answer))) for answer in answers]
    vocab = len(tokenizer)
    hidden = vocab + vocab % 2  # a multiple of the head count
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    scale = 1.0 / math.sqrt(hidden)  # RMSNorm turns a one-hot vector into sqrt(hidden) at its index
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        head[ids, :] = boost * scale
        head[:, ids] = 0.0
        head[tokenizer.eos_token_id, ids] = stop * scale
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path))
    return path, ids


def answer_probabilities(path: Path, messages: list[dict[str, str]], ids: list[int]) -> list[float]:
    """The model's probability of each answer token as the first token of its reply to `messages`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    probabilities = torch.softmax(logits.float(), dim=-1)
    return [float(probabilities[i]) for i in ids]
