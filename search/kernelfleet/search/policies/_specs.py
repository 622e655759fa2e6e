"""Policy specs as the command line writes them: `compile`, `replay:FILE`, `openai:MODEL@URL`, ...

One parser for the CLI and for anything else that takes a policy as text, so the forms and the
error message that lists them live in one place. Options that every generating policy shares
(sampling temperature, token limit, concurrency, timeouts) come separately, from flags.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from kernelfleet.core.errors import UsageError
from kernelfleet.search.policies._base import Policy
from kernelfleet.search.policies._compile import CompilePolicy
from kernelfleet.search.policies._local import HFPolicy, VLLMPolicy
from kernelfleet.search.policies._openai import OpenAIPolicy, api_key_from_environment
from kernelfleet.search.policies._replay import ReplayPolicy

SPEC_FORMS = (
    "compile or compile:VARIANT,... (compile-default, cudagraph, ...)",
    "replay:PATH.jsonl",
    "openai:MODEL@BASE_URL (key from $KERNELFLEET_OPENAI_API_KEY or $OPENAI_API_KEY)",
    "hf:MODEL_DIR",
    "vllm:MODEL_DIR",
)


class PolicyOptions(BaseModel):
    """Settings shared by the policies that generate text; the command line's options for
    language-model policies are generated from these fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(
        default=0.8, ge=0, le=2, allow_inf_nan=False, description="Sampling temperature."
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling; None: off.")
    max_tokens: int = Field(default=4096, ge=1, description="Longest answer, in tokens.")
    concurrency: int = Field(default=8, ge=1, le=1024, description="Requests in flight (openai).")
    timeout_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False, description="Seconds one request may take (openai)."
    )
    retries: int = Field(default=3, ge=0, le=100, description="Retries of a failed request (openai).")
    stream: bool = Field(default=False, description="Stream answers (openai).")
    batch_size: int = Field(default=4, ge=1, description="Prompts generated together (hf).")
    device: str | None = Field(default=None, description="Device of a local model (hf); None: its default.")


def _usage(spec: str, why: str) -> UsageError:
    forms = "\n  ".join(SPEC_FORMS)
    return UsageError(f"bad policy {spec!r}: {why}. A policy is one of:\n  {forms}")


def make_policy(spec: str, options: PolicyOptions | None = None) -> Policy:
    """The policy that `spec` names, configured with `options`."""
    options = options or PolicyOptions()
    kind, _, rest = spec.strip().partition(":")
    kind = kind.lower()
    if kind == "compile":
        if rest:
            return CompilePolicy.only([name.strip() for name in rest.split(",") if name.strip()])
        return CompilePolicy()
    if kind == "replay":
        if not rest:
            raise _usage(spec, "replay needs a file")
        return ReplayPolicy.from_file(rest)
    if kind == "openai":
        model, at, base_url = rest.partition("@")
        if not at:
            base_url = os.environ.get("KERNELFLEET_OPENAI_BASE_URL", "") or os.environ.get(
                "OPENAI_BASE_URL", ""
            )
        if not model or not base_url:
            raise _usage(
                spec, "openai needs a model and an endpoint, e.g. openai:qwen@http://localhost:8000/v1"
            )
        return OpenAIPolicy(
            model,
            base_url,
            api_key_from_environment(),
            temperature=options.temperature,
            top_p=options.top_p,
            max_tokens=options.max_tokens,
            concurrency=options.concurrency,
            timeout_s=options.timeout_s,
            retries=options.retries,
            stream=options.stream,
        )
    if kind == "hf":
        if not rest:
            raise _usage(spec, "hf needs a model directory")
        return HFPolicy(
            rest,
            device=options.device,
            temperature=options.temperature,
            top_p=options.top_p,
            max_new_tokens=options.max_tokens,
            batch_size=options.batch_size,
        )
    if kind == "vllm":
        if not rest:
            raise _usage(spec, "vllm needs a model directory")
        return VLLMPolicy(
            rest, temperature=options.temperature, top_p=options.top_p, max_tokens=options.max_tokens
        )
    raise _usage(spec, f"unknown kind {kind!r}")
