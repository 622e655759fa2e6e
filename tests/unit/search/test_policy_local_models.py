"""The `hf` policy with a tiny random Llama and a tokenizer trained here (no downloads, ever),
and the `vllm` policy against a stand-in for vLLM's offline engine."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kernelfleet.search import HFPolicy, PolicyError, Request, VLLMPolicy, make_policy
from kernelfleet.search.policies._specs import PolicyOptions
from tests.support.search import answer, make_task, variant_code

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [variant_code(f"v{i}", 1.0 + i / 10) for i in range(50)] + [answer("x = 1\n")] * 5
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(wrapped),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=wrapped.eos_token_id,
        pad_token_id=wrapped.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = wrapped.eos_token_id
    model.generation_config.pad_token_id = wrapped.pad_token_id
    model.save_pretrained(path)
    return path


def requests(count: int) -> list[Request]:
    task = make_task("alpha")
    return [Request(task=task, device="cpu", gpu_class="cpu", round=0, index=i, seed=i) for i in range(count)]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_hf_policy_generates_one_answer_per_request(tiny_model: Path) -> None:
    policy = make_policy(
        f"hf:{tiny_model}", PolicyOptions(max_tokens=12, batch_size=2, temperature=0.9, device="cpu")
    )
    assert isinstance(policy, HFPolicy) and policy.name == f"hf:{tiny_model.name}"
    proposals = policy.propose(requests(3))
    assert len(proposals) == 3
    for proposal in proposals:
        # A random model writes noise: recorded as unusable, with the reason and the text.
        assert proposal.recorded and proposal.code is None and proposal.error
        assert "token limit" in proposal.error or proposal.error == "empty answer"
    policy.close()


def test_hf_policy_greedy_is_deterministic(tiny_model: Path) -> None:
    policy = HFPolicy(str(tiny_model), device="cpu", temperature=0.0, max_new_tokens=8, batch_size=4)
    first = [p.text for p in policy.propose(requests(2))]
    second = [p.text for p in policy.propose(requests(2))]
    assert first == second and first[0] == first[1]


def test_hf_policy_missing_model(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        HFPolicy(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match="cannot load"):
        HFPolicy(str(tmp_path / "empty"), device="cpu").propose(requests(1))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A stand-in for vLLM's `LLM` and `SamplingParams` that records what it is given."""
    seen: dict[str, Any] = {"engines": [], "calls": []}

    class SamplingParams:
        def __init__(self, **options: Any) -> None:
            self.options = options

    class LLM:
        def __init__(self, model: str, **engine: Any) -> None:
            seen["engines"].append((model, engine))

        def chat(self, conversations: list[Any], sampling_params: list[Any], use_tqdm: bool) -> list[Any]:
            seen["calls"].append((conversations, sampling_params))
            outputs = []
            for index, params in enumerate(sampling_params):
                text = answer(variant_code(f"vllm-{params.options['seed']}", 1.5))
                finish = "length" if index == 1 else "stop"
                outputs.append(
                    SimpleNamespace(
                        outputs=[
                            SimpleNamespace(text=text[:40] if index == 1 else text, finish_reason=finish)
                        ]
                    )
                )
            return outputs

    module = ModuleType("vllm")
    module.LLM = LLM  # type: ignore[attr-defined]
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    yield seen


def test_vllm_policy_batches_a_round(fake_vllm: dict[str, Any]) -> None:
    policy = make_policy("vllm:/models/coder-7b", PolicyOptions(temperature=0.6, max_tokens=2048))
    assert isinstance(policy, VLLMPolicy) and policy.id == "vllm-coder-7b"
    assert fake_vllm["engines"] == []  # loaded on first use, not before
    first, second = policy.propose(requests(2))
    assert first.code is not None and "vllm-0" in first.code
    assert second.code is None and "token limit" in second.error
    (conversations, params) = fake_vllm["calls"][0]
    assert len(conversations) == 2 and conversations[0][0]["role"] == "system"
    assert params[1].options == {"temperature": 0.6, "max_tokens": 2048, "seed": 1}
    policy.propose(requests(1))
    assert len(fake_vllm["engines"]) == 1


def test_vllm_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(PolicyError, match=r"kernelfleet-trainer\[vllm\]"):
        make_policy("vllm:/models/x")
