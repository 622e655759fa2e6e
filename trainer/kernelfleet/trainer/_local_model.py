"""A causal LM built here, from a config, with random weights and a tokenizer trained on the spot.

No downloads: the tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus of
code and the prompts' own text, the model a Llama built from `LlamaConfig`. The tests use a tiny
one (about 100k parameters) to run every stage through the real trl trainers on a CPU; the GPU
benchmark builds a few hundred million parameters the same way, to time RL steps without
shipping weights. A Llama (not Qwen2) config keeps transformers' AutoTokenizer on the fast
tokenizer we trained, with identical token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the Llama to build. The defaults are the tests' tiny model."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 4096


def build_local_model(
    path: str | Path, corpus: Iterable[str], shape: ModelShape | None = None, seed: int = 0
) -> Path:
    """Train a tokenizer on `corpus`, build a random Llama of `shape`, save both to `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = shape or ModelShape()
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(target)
    config = LlamaConfig(
        vocab_size=len(wrapped),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=wrapped.eos_token_id,
        pad_token_id=wrapped.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = wrapped.eos_token_id
    model.generation_config.pad_token_id = wrapped.pad_token_id
    model.save_pretrained(target)
    return target


def parameter_count(shape: ModelShape) -> int:
    """Parameters of a Llama of `shape` (tied embeddings), without building it."""
    h, i, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    kv = shape.num_key_value_heads * shape.head_dim
    q = shape.num_attention_heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h
    mlp = 3 * h * i
    return shape.vocab_size * h + layers * (attention + mlp + 2 * h) + h
