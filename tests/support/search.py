"""Shared fakes for the trainer's tests: a scripted evaluator and a scripted policy.

No tests live here. The evaluator judges code by markers written into it (`# speedup: 2.5`,
`# verdict: incorrect`), so a test states its scenario in the code its policy proposes and
needs no torch, no processes and no timing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Environment, EvaluationResult, ResultKey, Task, Timing, Verdict
from kernelfleet.evaluator import BatchCancelled
from kernelfleet.search import Proposal, Request

REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * {factor}


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
"""


def make_task(name: str, factor: int = 2) -> Task:
    return Task(name=name, code=REFERENCE.format(factor=factor), source=f"tests/{name}.py")


def variant_code(
    tag: str, speedup: float | None = None, verdict: str = "correct", seconds: float = 1.0
) -> str:
    lines = [
        "import torch",
        "",
        f"# variant: {tag}",
        f"# verdict: {verdict}",
        f"# seconds: {seconds}",
    ]
    if speedup is not None:
        lines.append(f"# speedup: {speedup}")
    lines += ["", "class ModelNew(torch.nn.Module):", "    def forward(self, x):", "        return x * 2", ""]
    return "\n".join(lines)


def answer(code: str) -> str:
    return (
        "## Performance Analysis\nThe faster variant avoids a temporary.\n\n"
        "## Algorithm Design\nFuse everything.\n\n"
        f"## Code Implementation\n```python\n{code}```\n"
    )


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, mean_ms=ms, min_ms=ms, max_ms=ms, iqr_ms=0.0, trials=10)


class Killed(BaseException):
    """Stands for the process being killed: not an Exception, so nothing swallows it."""


class ScriptedEvaluator:
    """Judges code by its markers. Counts every evaluation, so tests can prove none is repeated."""

    def __init__(
        self, gpu_class: str = "cpu", version: str = "test-1", kill_after: int | None = None
    ) -> None:
        self.environment = Environment(
            device="cpu", gpu_class=gpu_class, evaluator_version=version, torch="x"
        )
        self.evaluated: list[tuple[str, str]] = []
        self.verified: list[str] = []
        self.baseline_calls: list[str] = []
        self.kill_after = kill_after
        self.fail_verification: set[str] = set()
        self.fail_baselines = False

    def judge(self, task: Task, code: str, verification: bool = False) -> EvaluationResult:
        if "broken" in task.name:
            return EvaluationResult(
                task_hash=task.hash,
                variant_hash=source_hash(code),
                verdict=Verdict.RUNTIME_ERROR,
                reasons=("reference-error: the task's own reference fails: NameError",),
                environment=self.environment,
            )
        verdict = Verdict(_marker(code, "verdict") or "correct")
        speedup_text = _marker(code, "speedup")
        seconds = float(_marker(code, "seconds") or 1.0)
        variant = source_hash(code)
        if verification and variant in self.fail_verification:
            verdict = Verdict.INCORRECT
        correct = verdict == Verdict.CORRECT and speedup_text is not None
        speedup = float(speedup_text) if correct and speedup_text else None
        return EvaluationResult(
            task_hash=task.hash,
            variant_hash=variant,
            verdict=verdict,
            reasons=() if verdict == Verdict.CORRECT else (f"scripted {verdict}",),
            reference=timing(10.0) if correct else None,
            candidate=timing(10.0 / speedup) if speedup else None,
            speedup=speedup,
            environment=self.environment,
            seconds=seconds,
        )

    def evaluate(self, task: Task, code: str) -> EvaluationResult:
        return self.evaluate_batch([(task, code)])[0]

    def evaluate_batch(
        self,
        items: list[tuple[Task, str]],
        cache: Any = None,
        progress: bool = True,
        stop: Any = None,
        slow: Any = None,
    ) -> list[EvaluationResult]:
        if cache is None:
            # The loop evaluates without its result cache only to re-verify a best variant.
            for _, code in items:
                self.verified.append(source_hash(code))
            return [self.judge(task, code, verification=True) for task, code in items]
        results: list[EvaluationResult] = []
        for task, code in items:
            if stop is not None and stop(0.0):
                # as the real evaluator: what finished is kept, the rest is not evaluated
                raise BatchCancelled([*results, *[None] * (len(items) - len(results))])
            key = ResultKey(
                task_hash=task.hash,
                variant_hash=source_hash(code),
                gpu_class=self.environment.gpu_class,
                evaluator_version=self.environment.evaluator_version,
            )
            cached = cache.get(key) if cache is not None else None
            if cached is not None:
                results.append(cached)
                continue
            if self.kill_after is not None and len(self.evaluated) >= self.kill_after:
                raise Killed()
            self.evaluated.append((task.name, source_hash(code)))
            result = self.judge(task, code)
            if cache is not None and not any(r.startswith("reference-error") for r in result.reasons):
                cache.put(result)
            results.append(result)
        return results

    def baselines(self, task: Task, cancel: Any = None) -> dict[str, Timing]:
        self.baseline_calls.append(task.name)
        if self.fail_baselines:
            raise RuntimeError("torch.compile is not available")
        return {"eager": timing(10.0), "compile": timing(5.0)}


def _marker(code: str, name: str) -> str | None:
    match = re.search(rf"^# {name}: (\S+)$", code, re.MULTILINE)
    return match.group(1) if match else None


class ScriptedPolicy:
    """Answers with `script(request)`; None from the script means a transient failure."""

    def __init__(self, script: Callable[[Request], str | None], name: str = "scripted") -> None:
        self.script = script
        self._name = name
        self.requests: list[Request] = []
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def id(self) -> str:
        return self._name

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        self.requests.extend(requests)
        proposals = []
        for request in requests:
            text = self.script(request)
            proposals.append(
                Proposal.failed("scripted outage") if text is None else Proposal.from_answer(text)
            )
        return proposals

    def close(self) -> None:
        self.closed = True
