"""What the loop tells the person watching: a live line per round, and a line per finished task.

The loop reports events to a `Progress`; the command line shows them with tqdm on stderr, so
that stdout carries only the final table. Tests and the operator's worker pass `QuietProgress`
or their own implementation.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Protocol

from kernelfleet.core.models import BUDGET_STOPS, EvaluationResult, Task, TaskSummary, Verdict

_SHORT = {
    Verdict.CORRECT: "ok",
    Verdict.INCORRECT: "wrong",
    Verdict.COMPILE_ERROR: "compile",
    Verdict.RUNTIME_ERROR: "crash",
    Verdict.TIMEOUT: "timeout",
    Verdict.REJECTED: "rejected",
}


class Progress(Protocol):
    def round_started(self, round_: int, rounds: int, tasks: int) -> None: ...

    def evaluations_planned(self, count: int) -> None: ...

    def result(self, task: Task, result: EvaluationResult, best: float | None) -> None: ...

    def message(self, text: str) -> None: ...

    def task_finished(self, summary: TaskSummary, resumed: bool) -> None: ...

    def close(self) -> None: ...


class QuietProgress:
    """Collects messages instead of printing them (tests read `messages`)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.verdicts: Counter[str] = Counter()

    def round_started(self, round_: int, rounds: int, tasks: int) -> None:
        return None

    def evaluations_planned(self, count: int) -> None:
        return None

    def result(self, task: Task, result: EvaluationResult, best: float | None) -> None:
        self.verdicts[str(result.verdict)] += 1

    def message(self, text: str) -> None:
        self.messages.append(text)

    def task_finished(self, summary: TaskSummary, resumed: bool) -> None:
        return None

    def close(self) -> None:
        return None


def describe_summary(summary: TaskSummary) -> str:
    if summary.best_speedup is None:
        return (
            f"{summary.task_name}: no verified variant "
            f"({summary.variants} evaluated, stopped: {summary.stop_reason})"
        )
    compile_part = (
        f", {summary.speedup_vs_compile:.2f}x over torch.compile"
        if summary.speedup_vs_compile is not None
        else ""
    )
    label = summary.best_name or (summary.best_variant_hash or "")[:12]
    checked = "verified" if summary.verified else "NOT re-verified"
    return (
        f"{summary.task_name}: {summary.best_speedup:.2f}x over eager{compile_part} "
        f"by {summary.best_policy} ({label}, {checked})"
    )


class LiveProgress:
    """A tqdm bar per round on stderr: task, round, best speedup so far, verdict counts."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream or sys.stderr
        self._bar: Any = None
        self._round = ""
        self._verdicts: Counter[str] = Counter()

    def _tqdm(self, total: int) -> Any:
        from tqdm import tqdm

        return tqdm(
            total=total, desc=self._round, file=self._stream, dynamic_ncols=True, leave=False, unit="eval"
        )

    def round_started(self, round_: int, rounds: int, tasks: int) -> None:
        self._close_bar()
        self._round = f"round {round_ + 1}/{rounds}"
        self.message(f"{self._round}: {tasks} task(s) active")

    def evaluations_planned(self, count: int) -> None:
        self._close_bar()
        if count:
            self._bar = self._tqdm(count)

    def result(self, task: Task, result: EvaluationResult, best: float | None) -> None:
        self._verdicts[_SHORT.get(result.verdict, str(result.verdict))] += 1
        if self._bar is None:
            return
        counts = " ".join(f"{name} {count}" for name, count in sorted(self._verdicts.items()))
        best_text = f"{best:.2f}x" if best is not None else "-"
        self._bar.set_postfix_str(f"{task.name[:28]} best {best_text} | {counts}", refresh=False)
        self._bar.update(1)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def task_finished(self, summary: TaskSummary, resumed: bool) -> None:
        prefix = "done (from the store)" if resumed else "done"
        if summary.stop_reason in BUDGET_STOPS:
            prefix = "stopped (run the same command to continue)"
        self.message(f"{prefix}: {describe_summary(summary)}")

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()
