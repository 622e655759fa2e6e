"""Reading a run back: the table, the statistics, the best code and the self-contained HTML report."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import Store, open_store
from kernelfleet.search import Budget, QuietProgress, Request, format_table, load_run, optimize, render_html
from kernelfleet.search._report import list_runs, resolve_run, speedup_stats
from tests.support.search import (
    Killed,
    ScriptedEvaluator,
    ScriptedPolicy,
    answer,
    make_task,
    variant_code,
)


def script(request: Request) -> str:
    if request.task.name == "slow":
        return answer(variant_code(f"slow-{request.index}", 0.5 + request.index / 10))
    if request.task.name == "wrong":
        return answer(variant_code(f"wrong-{request.index}", None, verdict="incorrect"))
    return answer(variant_code(f"{request.task.name}-{request.round}-{request.index}", 1.5 + request.round))


def make_run(store: Store, prefix: str = "runs/demo", evaluator: ScriptedEvaluator | None = None) -> None:
    evaluator = evaluator or ScriptedEvaluator()
    tasks = [make_task("fast", 2), make_task("slow", 3), make_task("wrong", 4)]
    optimize(
        tasks,
        [ScriptedPolicy(script)],
        store=store,
        prefix=prefix,
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=2, samples_per_round=2),
        progress=QuietProgress(),
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store")


def test_speedup_stats() -> None:
    stats = speedup_stats([2.0, 0.5, None, 4.0])
    assert stats.count == 4
    assert stats.mean == pytest.approx((2 + 0.5 + 1 + 4) / 4)
    assert stats.median == pytest.approx(1.5)
    assert stats.geomean == pytest.approx(math.exp((math.log(2) + math.log(0.5) + math.log(4)) / 4))
    assert stats.improved == 2
    assert speedup_stats([]).mean is None


def test_table_of_a_finished_run(store: Store) -> None:
    make_run(store)
    report = load_run(store, "runs/demo")
    assert [o.task.name for o in report.outcomes] == ["fast", "slow", "wrong"]
    fast, slow, wrong = report.outcomes
    assert fast.best_speedup == 2.5 and fast.best_policy == "scripted" and fast.done
    assert fast.compile_over_eager == 2.0 and fast.speedup_vs_compile == 1.25
    assert slow.best_speedup == pytest.approx(0.6)
    assert wrong.best_speedup is None and wrong.best_code is None
    assert "class ModelNew" in (fast.best_code or "")
    table = format_table(report.outcomes)
    lines = table.splitlines()
    assert lines[0].split() == [
        "task",
        "gpu",
        "vs",
        "eager",
        "vs",
        "compile",
        "policy",
        "variant",
        "correct",
        "status",
    ]
    assert re.search(r"^fast\s+cpu\s+2\.50x\s+1\.25x\s+scripted", table, re.MULTILINE)
    assert re.search(
        r"^wrong\s+cpu\s+-\s+-\s+-\s+-\s+0/2\s+done \(rounds\), nothing verified", table, re.MULTILINE
    )
    assert "3 task(s): geomean" in table and "1 improved by more than 1%" in table
    assert "*" not in table


def test_an_unfinished_run_is_shown_from_its_results(store: Store) -> None:
    with pytest.raises(Killed):
        make_run(store, evaluator=ScriptedEvaluator(kill_after=1))
    report = load_run(store, "runs/demo")
    running = [o for o in report.outcomes if o.results]
    assert running and all(not o.done for o in report.outcomes)
    fast = next(o for o in report.outcomes if o.task.name == "fast")
    assert fast.status == "running" and fast.best_policy == "scripted" and fast.best_speedup == 1.5
    table = format_table(report.outcomes)
    assert "1.50x*" in table and "not yet re-verified" in table
    assert "pending" in table


def test_html_report_is_self_contained(store: Store) -> None:
    make_run(store)
    html = render_html(load_run(store, "runs/demo"))
    assert html.startswith("<!doctype html>")
    assert html.count("<svg") == 2
    assert "<script" not in html and "<link" not in html and "@import" not in html
    external = [url for url in re.findall(r"(?:src|href)=\"([^\"]+)\"", html)]
    assert external == []
    assert re.findall(r"https?://[^\s\"<]+", html) == ["http://www.w3.org/2000/svg"] * 2
    assert "fast" in html and "2.50x" in html and "class ModelNew" in html
    # The code is escaped, so a hostile variant cannot inject markup.
    assert "<details>" in html and "&lt;" not in html.split("<details>")[0][-10:]


def test_html_escapes_what_it_shows(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    task = make_task("<b>bold</b>")
    optimize(
        [task],
        [ScriptedPolicy(lambda r: answer(variant_code("x", 1.2) + "# </pre><script>alert(1)</script>\n"))],
        store=store,
        prefix="runs/x",
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=1, samples_per_round=1),
    )
    html = render_html(load_run(store, "runs/x"))
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<b>bold</b>" not in html


def test_resolving_runs(store: Store) -> None:
    make_run(store, prefix="runs/one")
    make_run(store, prefix="optimizationjobs/ns/job/uid-1")
    store.put_json("runs/one/run.json", {"run_id": "one", "tasks": [], "policies": ["scripted"]})
    assert list_runs(store) == ["one"]
    assert resolve_run(store, "one") == "runs/one"
    assert resolve_run(store, "optimizationjobs/ns/job/uid-1/") == "optimizationjobs/ns/job/uid-1"
    with pytest.raises(UsageError, match=r"no run .two.*runs in .*: one"):
        resolve_run(store, "two")
    cluster = load_run(store, "optimizationjobs/ns/job/uid-1")
    assert len(cluster.outcomes) == 3 and cluster.manifest is None
