"""`kernelfleet store check URL`, `store ls URL PREFIX` and `store verify URL RUN` on a local store."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from kernelfleet.core import cli
from kernelfleet.core.cli import main
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Environment, EvaluationResult, TaskSummary, Timing, Verdict
from kernelfleet.core.store import ResultConflict, open_store

STORE_COMMAND = EntryPoint(
    name="store", value="kernelfleet.core.cli_store:register", group="kernelfleet.commands"
)


@pytest.fixture(autouse=True)
def only_the_store_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other components' commands may be half-built; these tests need only this one."""
    monkeypatch.setattr(cli, "entry_points", lambda group: [STORE_COMMAND])


def test_the_command_is_declared_as_an_entry_point() -> None:
    assert STORE_COMMAND in entry_points(group="kernelfleet.commands")


def test_check_on_a_usable_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "check", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    for step in ("directory", "list", "write", "read", "delete probe"):
        assert f"ok    {step}" in out
    assert "is usable" in out


def test_check_on_an_unusable_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["store", "check", str(tmp_path / "file")]) == 1
    captured = capsys.readouterr()
    assert "FAIL  directory" in captured.out and "NOT usable" in captured.err


def test_check_with_a_bad_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "check", "gs://bucket"]) == 2
    assert "unsupported scheme" in capsys.readouterr().err


def test_store_without_an_action_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store"]) == 2
    assert "check" in capsys.readouterr().err


def test_ls_lists_keys_under_a_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(tmp_path)
    for key in ("variants/b.py", "variants/a.py", "results/r.json"):
        store.put_bytes(key, b"x")
    assert main(["store", "ls", str(tmp_path), "variants/"]) == 0
    assert capsys.readouterr().out.splitlines() == ["variants/a.py", "variants/b.py"]


def _result(speedup: float) -> EvaluationResult:
    timing = Timing(median_ms=1.0, mean_ms=1.0, min_ms=1.0, max_ms=1.0, iqr_ms=0.0, trials=10)
    return EvaluationResult(
        task_hash="a" * 64,
        variant_hash=source_hash("class ModelNew: pass\n"),
        verdict=Verdict.CORRECT,
        reference=timing,
        candidate=timing,
        speedup=speedup,
        environment=Environment(device="cpu", gpu_class="cpu", evaluator_version="1"),
    )


def test_verify_a_consistent_run_and_then_a_forged_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(tmp_path / "store")
    store.put_variant("class ModelNew: pass\n")
    store.put_result("runs/demo", _result(1.5))
    assert main(["store", "verify", str(tmp_path / "store"), "demo"]) == 0
    assert "runs/demo is consistent" in capsys.readouterr().out
    with pytest.raises(ResultConflict):
        store.put_result("runs/demo", _result(50.0))
    assert main(["store", "check", str(tmp_path / "store"), "--deep", "demo"]) == 1
    out = capsys.readouterr().out
    assert "two different results for one key" in out and "50" in out
    # A summary that names a speedup its result does not have is caught too.
    summary = TaskSummary(
        task_name="t",
        task_hash="a" * 64,
        gpu_class="cpu",
        evaluator_version="1",
        stop_reason="rounds",
        best_variant_hash=_result(1.5).variant_hash,
        best_speedup=9.0,
        search_speedup=9.0,
        finished_at="2026-12-01T00:00:00Z",
    )
    store.put_json(f"runs/other/tasks/{'a' * 16}/cpu/summary-x-000001.json", summary)
    store.put_result("runs/other", _result(1.5))
    assert main(["store", "verify", str(tmp_path / "store"), "runs/other"]) == 1
    assert "reports 9x" in capsys.readouterr().out


def test_verify_of_a_run_that_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "verify", str(tmp_path / "store"), "nothing"]) == 1
    assert "no run at" in capsys.readouterr().out
