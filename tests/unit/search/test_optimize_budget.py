"""Budgets are bounds: at the wall-time or GPU-seconds limit nothing new starts, the evaluation
in flight is cancelled (not recorded, so a resumed run evaluates it) and the summary is written,
with a deliberately slow candidate and the real evaluator on the CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Task, Verdict
from kernelfleet.core.store import open_store
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.search import Budget, LoopSettings, QuietProgress, ReplayPolicy, ReplayRow, optimize
from tests.support import evaluator_cases as C

CONFIG = EvalConfig.model_validate(
    {
        "device": "cpu",
        "correctness": {"trials": 2},
        "timing": {
            "trials": 3,
            "warmup": 1,
            "flush_bytes": 0,
            "max_speedup_cv": None,
            "speedup_recheck": None,
            "retries": 0,
        },
    }
)


@pytest.mark.parametrize("limit", ["wall-time", "gpu-seconds"])
def test_a_budget_cancels_the_evaluation_in_flight_and_resume_runs_it(tmp_path: Path, limit: str) -> None:
    slow_until = time.time() + 25.0  # slow in the first run, fast once resumed after it
    task = Task(name="matmul", code=C.MATMUL_TASK)
    slow = ReplayRow(task="matmul", code=C.sleeper(20.0, slow_until), name="slow")
    store = open_store(tmp_path / "store")
    settings = LoopSettings(measure_baselines=False)
    budget = Budget(
        rounds=1, samples_per_round=1, **{"wall_time_seconds" if limit == "wall-time" else "gpu_seconds": 8.0}
    )
    with Evaluator(CONFIG) as evaluator:
        environment = evaluator.environment
        begin = time.monotonic()
        [summary] = optimize(
            [task],
            [ReplayPolicy([slow])],
            store=store,
            prefix="runs/budget",
            evaluator=evaluator,
            environment=environment,
            budget=budget,
            settings=settings,
            progress=QuietProgress(),
        )
        elapsed = time.monotonic() - begin
    # Each correctness call alone sleeps 20 s: the candidate could not have finished.
    assert elapsed < 8.0 + 30.0, elapsed
    assert summary.stop_reason == limit
    assert summary.not_evaluated == 1 and summary.variants == 0
    assert list(store.list_results("runs/budget")) == []

    time.sleep(max(0.0, slow_until - time.time()))  # the same code is fast now: the resumed run evaluates it
    with Evaluator(CONFIG) as evaluator:
        [again] = optimize(
            [task],
            [ReplayPolicy([slow])],
            store=store,
            prefix="runs/budget",
            evaluator=evaluator,
            environment=evaluator.environment,
            budget=Budget(rounds=1, samples_per_round=1, wall_time_seconds=600.0),
            settings=settings,
            progress=QuietProgress(),
        )
    results = list(store.list_results("runs/budget"))
    assert len(results) == 1 and results[0].verdict == Verdict.CORRECT
    assert again.not_evaluated == 0 and again.variants == 1


SCALE_TASK = (
    "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
    "    def forward(self, a, b):\n        return torch.diag(a) @ b\n\n\n"
    "def get_inputs():\n    return [torch.randn(64), torch.randn(64, 32)]\n\n\n"
    "def get_init_inputs():\n    return []\n"
)


def scale_sleeper(seconds: float, until: float) -> str:
    return (
        "import time\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n"
        "    def forward(self, a, b):\n"
        f"        if time.time() < {until!r}:\n            time.sleep({seconds})\n"
        "        return a.unsqueeze(1) * b\n"
    )


@pytest.mark.parametrize("flag", ["--wall-time", "--gpu-seconds"])
def test_the_command_keeps_its_budget_and_the_same_command_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """The issue's reproduction: two tasks, a replay file and the compile policy, a budget far
    below what the variants need. The command returns within the limit plus a margin, each task
    says which budget stopped it, nothing is measured after the limit (no baselines), the table
    prints no average over nothing, and the same command, run again, evaluates what was left."""
    from kernelfleet.core.cli import main
    from kernelfleet.search._report import load_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "matmul.py").write_text(C.MATMUL_TASK)
    (tmp_path / "tasks" / "scale.py").write_text(SCALE_TASK)
    limit = 20.0
    slow_until = time.time() + limit + 40.0  # slow in the first call, fast in the second
    rows = [
        {"task": "matmul", "code": C.sleeper(30.0, slow_until), "name": "slow-matmul"},
        {"task": "scale", "code": scale_sleeper(30.0, slow_until), "name": "slow-scale"},
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        "optimize", "tasks", "--policy", "replay:candidates.jsonl", "--policy", "compile:compile-default",
        "--device", "cpu", "--rounds", "2", flag, f"{limit:g}", "--store", "store", "--run", "budget",
        "--timing-trials", "3", "--correctness-trials", "2", "--quiet",
    ]  # fmt: skip
    begin = time.monotonic()
    assert main(command) == 0
    elapsed = time.monotonic() - begin
    out = capsys.readouterr().out
    assert elapsed < limit + 60.0, elapsed  # the documented grace is about 30 s
    store = open_store(tmp_path / "store")
    report = load_run(store, "runs/budget", with_code=False)
    reason = flag.removeprefix("--")
    assert [o.summary.stop_reason for o in report.outcomes if o.summary] == [reason, reason]
    assert all(o.summary and o.summary.not_evaluated >= 1 for o in report.outcomes)
    assert not [key for key in store.list("runs/budget/") if "/baselines/" in key or "/verified/" in key]
    assert "geomean" not in out and "none with a verified variant" in out

    time.sleep(max(0.0, slow_until - time.time()))
    replayed = {rows[0]["code"], rows[1]["code"]}
    wanted = {source_hash(code) for code in replayed}
    for _ in range(5):  # each call is bounded; the same command goes on where the last stopped
        assert main(command) == 0
        # Final results, and provisional ones (a timing the loaded machine did not let settle):
        # either way the variant was evaluated to the end.
        evaluated = {r.variant_hash for r in store.list_results("runs/budget")} | {
            key.rsplit("/", 1)[1].rsplit("-", 1)[0] for key in store.list("runs/budget/provisional/results/")
        }
        if wanted <= evaluated:
            break
    assert wanted <= evaluated
