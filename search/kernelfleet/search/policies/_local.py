"""Policies that run a model in this process: `hf` (transformers) and `vllm` (vLLM's offline engine).

Both load their model on first use, not at construction, so that a run that resumes with
every sample already in the store never pays for loading weights. Both take the same chat
messages as the `openai` policy and read the answers with the same parser. vLLM is an optional
dependency: it is imported only here, only when asked for, with a message that says how to
install it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernelfleet.search.policies._base import PolicyError, Proposal, Request


def _slug(text: str) -> str:
    name = Path(text.rstrip("/")).name or text
    return "".join(char if char.isalnum() or char in "._-" else "-" for char in name)[:60]


class HFPolicy:
    """Generation with a local transformers causal LM, in padded batches."""

    def __init__(
        self,
        path: str,
        *,
        device: str | None = None,
        temperature: float = 0.8,
        top_p: float | None = None,
        max_new_tokens: int = 4096,
        batch_size: int = 4,
        dtype: str = "auto",
    ) -> None:
        if not Path(path).exists():
            raise PolicyError(
                f"the hf policy's model path {path} does not exist; give a directory saved with "
                "save_pretrained (no downloads are made)"
            )
        self.path = path
        self.device = device
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.batch_size = max(1, batch_size)
        self.dtype = dtype
        self._model: Any = None
        self._tokenizer: Any = None

    @property
    def name(self) -> str:
        return f"hf:{_slug(self.path)}"

    @property
    def id(self) -> str:
        return f"hf-{_slug(self.path)}"

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            tokenizer: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(
                self.path, local_files_only=True, dtype=self.dtype
            )
        except (OSError, ValueError) as error:
            raise PolicyError(f"cannot load the model at {self.path}: {error}") from None
        tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._tokenizer = tokenizer
        model.to(device)
        self._model = model.eval()
        self.device = device

    def _prompt(self, request: Request) -> str:
        messages = request.messages()
        if getattr(self._tokenizer, "chat_template", None):
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return str(text)
        return (
            "\n\n".join(f"{message['role']}: {message['content']}" for message in messages) + "\n\nassistant:"
        )

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        if not requests:
            return []
        self._load()
        import torch

        proposals: list[Proposal] = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            prompts = [self._prompt(request) for request in batch]
            encoded = self._tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            encoded = {name: tensor.to(self.device) for name, tensor in encoded.items()}
            sampling: dict[str, Any] = {"do_sample": self.temperature > 0}
            if self.temperature > 0:
                sampling["temperature"] = self.temperature
                if self.top_p is not None:
                    sampling["top_p"] = self.top_p
            torch.manual_seed(batch[0].seed)
            with torch.no_grad():
                output = self._model.generate(
                    **encoded,
                    max_new_tokens=self.max_new_tokens,
                    pad_token_id=self._tokenizer.pad_token_id,
                    **sampling,
                )
            width = encoded["input_ids"].shape[1]
            for row in output:
                new_tokens = row[width:]
                text = self._tokenizer.decode(new_tokens, skip_special_tokens=True)
                ended = bool((new_tokens == self._tokenizer.eos_token_id).any()) if len(new_tokens) else False
                truncated = len(new_tokens) >= self.max_new_tokens and not ended
                proposals.append(Proposal.from_answer(text, truncated=truncated))
        return proposals

    def close(self) -> None:
        self._model = None
        self._tokenizer = None


class VLLMPolicy:
    """Generation with vLLM's offline engine (`vllm.LLM`), all of a round's requests in one call."""

    def __init__(
        self,
        path: str,
        *,
        temperature: float = 0.8,
        top_p: float | None = None,
        max_tokens: int = 4096,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.engine_args = dict(engine_args or {})
        self._vllm: Any = None
        self._llm: Any = None
        try:
            self._vllm = importlib.import_module("vllm")
        except ImportError:
            raise PolicyError(
                "the vllm policy needs vLLM, which is not installed: pip install 'kernelfleet-trainer[vllm]' "
                "(on a GPU machine), or serve the model with `vllm serve` and use openai:MODEL@URL"
            ) from None

    @property
    def name(self) -> str:
        return f"vllm:{_slug(self.path)}"

    @property
    def id(self) -> str:
        return f"vllm-{_slug(self.path)}"

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        if not requests:
            return []
        if self._llm is None:
            self._llm = self._vllm.LLM(model=self.path, **self.engine_args)
        params = []
        for request in requests:
            options: dict[str, Any] = {
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
                "seed": request.seed,
            }
            if self.top_p is not None:
                options["top_p"] = self.top_p
            params.append(self._vllm.SamplingParams(**options))
        outputs = self._llm.chat(
            [request.messages() for request in requests], sampling_params=params, use_tqdm=False
        )
        proposals = []
        for output in outputs:
            completion = output.outputs[0]
            proposals.append(
                Proposal.from_answer(
                    completion.text, truncated=getattr(completion, "finish_reason", "") == "length"
                )
            )
        return proposals

    def close(self) -> None:
        self._llm = None
