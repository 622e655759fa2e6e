"""Policies: what proposes a variant of a task.

A policy is anything that implements `Policy`. The built-in ones are `compile` (torch.compile
configurations, no model), `replay` (variants read from a JSONL file), `openai` (any
OpenAI-compatible endpoint, such as a vLLM server), `hf` (a local transformers model; the `hf`
extra) and `vllm` (vLLM offline; the `vllm` extra). `make_policy` builds one from its spec.
"""

from kernelfleet.search.policies._base import Policy, PolicyError, Proposal, Request
from kernelfleet.search.policies._compile import COMPILE_DEFAULT, CompilePolicy, CompileVariant
from kernelfleet.search.policies._local import HFPolicy, VLLMPolicy
from kernelfleet.search.policies._openai import OpenAIPolicy
from kernelfleet.search.policies._replay import ReplayPolicy, ReplayRow
from kernelfleet.search.policies._specs import SPEC_FORMS, PolicyOptions, make_policy

__all__ = [
    "COMPILE_DEFAULT",
    "SPEC_FORMS",
    "CompilePolicy",
    "CompileVariant",
    "HFPolicy",
    "OpenAIPolicy",
    "Policy",
    "PolicyError",
    "PolicyOptions",
    "Proposal",
    "ReplayPolicy",
    "ReplayRow",
    "Request",
    "VLLMPolicy",
    "make_policy",
]
