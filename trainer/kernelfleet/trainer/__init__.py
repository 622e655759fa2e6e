"""kernelfleet.trainer: policies, the contrastive optimisation loop, and reading its results.

    from kernelfleet.trainer import Budget, make_policy, optimize

    summaries = optimize(tasks, [make_policy("compile"), make_policy("replay:candidates.jsonl")],
                         store=store, prefix="runs/demo", evaluator=evaluator,
                         environment=evaluator.environment, budget=Budget(rounds=2))

A policy proposes variants (`compile`, `replay`, `openai`, `hf`, `vllm`, or anything that
implements `Policy`); the loop evaluates them, keeps every result in the store, shows the
policy its earlier variants with their speedups, and re-verifies the best. See docs/optimize.md.
"""

from kernelfleet.trainer._answers import ParsedAnswer, check_code, parse_answer
from kernelfleet.trainer._compile_policy import CompilePolicy, CompileVariant
from kernelfleet.trainer._database import Entry, VariantDatabase
from kernelfleet.trainer._layout import RunLayout, RunManifest, SampleRecord
from kernelfleet.trainer._local_policies import HFPolicy, VLLMPolicy
from kernelfleet.trainer._loop import Budget, LoopSettings, OptimizationLoop, optimize
from kernelfleet.trainer._openai_policy import OpenAIPolicy
from kernelfleet.trainer._policy import Policy, PolicyError, Proposal, Request
from kernelfleet.trainer._progress import LiveProgress, Progress, QuietProgress
from kernelfleet.trainer._prompts import Exemplar, build_messages
from kernelfleet.trainer._replay_policy import ReplayPolicy, ReplayRow
from kernelfleet.trainer._report import (
    RunReport,
    SpeedupStats,
    TaskOutcome,
    format_table,
    load_run,
    render_html,
    speedup_stats,
)
from kernelfleet.trainer._specs import PolicyOptions, make_policy

__all__ = [
    "Budget",
    "CompilePolicy",
    "CompileVariant",
    "Entry",
    "Exemplar",
    "HFPolicy",
    "LiveProgress",
    "LoopSettings",
    "OpenAIPolicy",
    "OptimizationLoop",
    "ParsedAnswer",
    "Policy",
    "PolicyError",
    "PolicyOptions",
    "Progress",
    "Proposal",
    "QuietProgress",
    "ReplayPolicy",
    "ReplayRow",
    "Request",
    "RunLayout",
    "RunManifest",
    "RunReport",
    "SampleRecord",
    "SpeedupStats",
    "TaskOutcome",
    "VLLMPolicy",
    "VariantDatabase",
    "build_messages",
    "check_code",
    "format_table",
    "load_run",
    "make_policy",
    "optimize",
    "parse_answer",
    "render_html",
    "speedup_stats",
]
