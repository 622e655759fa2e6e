"""kernelfleet.search: policies, the contrastive optimisation loop, and reading its results.

    from kernelfleet.search import Budget, make_policy, optimize

    summaries = optimize(tasks, [make_policy("compile"), make_policy("replay:candidates.jsonl")],
                         store=store, prefix="runs/demo", evaluator=evaluator,
                         environment=evaluator.environment, budget=Budget(rounds=2))

A policy proposes variants (`compile`, `replay`, `openai`, `hf`, `vllm`, or anything that
implements `Policy`); the loop evaluates them, keeps every result in the store, shows the
policy its earlier variants with their speedups, and re-verifies the best. See docs/optimize.md.
"""

from kernelfleet.search._answers import ParsedAnswer, check_code, parse_answer
from kernelfleet.search._database import Entry, VariantDatabase
from kernelfleet.search._layout import RunLayout, RunManifest, SampleRecord
from kernelfleet.search._loop import Budget, LoopSettings, OptimizationLoop, optimize
from kernelfleet.search._progress import LiveProgress, Progress, QuietProgress
from kernelfleet.search._prompts import Exemplar, build_messages
from kernelfleet.search._report import (
    RunReport,
    SpeedupStats,
    TaskOutcome,
    format_table,
    load_run,
    render_html,
    speedup_stats,
)
from kernelfleet.search.policies import (
    CompilePolicy,
    CompileVariant,
    HFPolicy,
    OpenAIPolicy,
    Policy,
    PolicyError,
    PolicyOptions,
    Proposal,
    ReplayPolicy,
    ReplayRow,
    Request,
    VLLMPolicy,
    make_policy,
)

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
