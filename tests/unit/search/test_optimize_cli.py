"""`kernelfleet optimize`, `results` and `report` from the command line.

Most tests swap the evaluator for the scripted one (the command line is under test, not the
evaluator); one runs the real evaluator end to end on a tiny task.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

import kernelfleet.evaluator as evaluator_module
from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import open_store
from kernelfleet.search import cli
from tests.support.search import REFERENCE, ScriptedEvaluator, variant_code


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kernelfleet")
    commands = root.add_subparsers(dest="command")
    cli.register_optimize(commands)
    cli.register_results(commands)
    cli.register_report(commands)
    return root


def run_cli(*argv: str) -> int:
    args = parser().parse_args(list(argv))
    result: int = args.handler(args)
    return result


class CliEvaluator(ScriptedEvaluator):
    """The scripted evaluator behind the `Evaluator(config)` constructor the CLI uses."""

    instances: ClassVar[list[CliEvaluator]] = []

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        CliEvaluator.instances.append(self)

    def __enter__(self) -> CliEvaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two tasks, a replay file with markers the scripted evaluator reads, and a store."""
    monkeypatch.setattr(evaluator_module, "Evaluator", CliEvaluator)
    CliEvaluator.instances = []
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "double.py").write_text(REFERENCE.format(factor=2))
    (tasks / "triple.py").write_text(REFERENCE.format(factor=3))
    rows = [
        {"task": "double", "code": variant_code("d1", 2.5), "name": "fast-double"},
        {"task": "double", "code": variant_code("d2", 0.8)},
        {"task": "triple", "code": variant_code("t1", None, verdict="incorrect")},
    ]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_optimize_prints_the_table_and_resumes(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "optimize",
        "tasks",
        "--policy",
        "replay:candidates.jsonl",
        "--policy",
        "compile",
        "--rounds",
        "2",
        "--store",
        "store",
        "--quiet",
        "--device",
        "cpu",
    ]
    assert run_cli(*argv) == 0
    out, err = capsys.readouterr()
    assert "run run-" in err and "Run the same command again to resume" in err
    assert "kernelfleet results run-" in err
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["task", "gpu"]
    double = next(line for line in lines if line.startswith("double"))
    assert "2.50x" in double and "replay" in double and "fast-double" in double
    triple = next(line for line in lines if line.startswith("triple"))
    assert "nothing verified" in triple
    first = CliEvaluator.instances[0]
    assert first.config.device == "cpu" and first.config.baseline_modes == ("eager", "compile")
    assert len(first.evaluated) == 5  # three replay rows + compile-default for each task

    assert run_cli(*argv) == 0
    again, _ = capsys.readouterr()
    assert again == out
    second = CliEvaluator.instances[1]
    assert second.evaluated == [] and second.verified == []


def test_optimize_json_and_run_names(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run_cli(
            "optimize",
            "tasks/double.py",
            "--policy",
            "replay:candidates.jsonl",
            "--store",
            "store",
            "--run",
            "mine",
            "--json",
            "--quiet",
            "--device",
            "cpu",
        )
        == 0
    )
    summaries = json.loads(capsys.readouterr().out)
    assert [s["task_name"] for s in summaries] == ["double"]
    assert summaries[0]["best_speedup"] == 2.5 and summaries[0]["best_policy"] == "replay"
    with pytest.raises(UsageError, match=r"already exists .* with other tasks"):
        run_cli(
            "optimize", "tasks/triple.py", "--store", "store", "--run", "mine", "--quiet", "--device", "cpu"
        )
    with pytest.raises(UsageError, match="--run"):
        run_cli("optimize", "tasks", "--store", "store", "--run", "../escape", "--device", "cpu")


def test_results_and_report(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("results", "--store", "store") == 0
    assert "no runs" in capsys.readouterr().err
    run_cli(
        "optimize",
        "tasks",
        "--policy",
        "replay:candidates.jsonl",
        "--store",
        "store",
        "--run",
        "demo",
        "--quiet",
        "--device",
        "cpu",
    )
    capsys.readouterr()

    assert run_cli("results", "--store", "store") == 0
    assert capsys.readouterr().out.split() == ["demo"]

    assert run_cli("results", "demo", "--store", "store", "--code") == 0
    out = capsys.readouterr().out
    assert (
        "double" in out
        and "# ==== double on cpu: 2.50x over eager by replay" in out
        and "# variant: d1" in out
    )

    assert run_cli("results", "demo", "--store", "store", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"] == "demo" and data["stats"]["count"] == 2 and data["stats"]["improved_over_1pct"] == 1
    assert data["tasks"][0]["code"].startswith("import torch")

    assert run_cli("report", "demo", "--store", "store") == 0
    assert "wrote kernelfleet-report-demo.html" in capsys.readouterr().out
    html = (workspace / "kernelfleet-report-demo.html").read_text()
    assert "<svg" in html and "fast-double" in html
    with pytest.raises(UsageError, match="cannot write the report"):
        run_cli("report", "demo", "--store", "store", "-o", "missing-dir/r.html")

    with pytest.raises(UsageError, match="no run 'nope'"):
        run_cli("results", "nope", "--store", "store")


def test_bad_input_is_a_usage_error(workspace: Path) -> None:
    with pytest.raises(UsageError, match="bad policy 'gpt'"):
        run_cli("optimize", "tasks", "--policy", "gpt", "--store", "store")
    with pytest.raises(UsageError, match="cannot read the replay file"):
        run_cli("optimize", "tasks", "--policy", "replay:missing.jsonl", "--store", "store")
    with pytest.raises(SystemExit):
        parser().parse_args(["optimize", "tasks", "--rounds", "0"])


def test_durations() -> None:
    assert cli._seconds("90") == 90.0
    assert cli._seconds("90s") == 90.0
    assert cli._seconds("15m") == 900.0
    assert cli._seconds("2h") == 7200.0
    with pytest.raises(argparse.ArgumentTypeError):
        cli._seconds("soon")


def test_run_ids_follow_the_inputs() -> None:
    from kernelfleet.search import CompilePolicy
    from tests.support.search import make_task

    a, b = make_task("a", 2), make_task("b", 3)
    policies = [CompilePolicy()]
    assert cli.derive_run_id([a, b], policies, "cpu") == cli.derive_run_id([b, a], policies, "cpu")
    assert cli.derive_run_id([a], policies, "cpu") != cli.derive_run_id([a, b], policies, "cpu")
    assert cli.derive_run_id([a], policies, "cpu") != cli.derive_run_id([a], policies, "h100")


def test_the_real_evaluator_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "scale.py").write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
        "    def forward(self, a, b):\n        return torch.diag(a) @ b\n\n\n"
        "def get_inputs():\n    return [torch.randn(64), torch.randn(64, 32)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    candidate = (
        "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
        "    def forward(self, a, b):\n        return a.unsqueeze(1) * b\n"
    )
    (tmp_path / "c.jsonl").write_text(json.dumps({"task": "scale", "code": candidate}) + "\n")
    code = run_cli(
        "optimize",
        "tasks",
        "--policy",
        "replay:c.jsonl",
        "--rounds",
        "1",
        "--store",
        "store",
        "--device",
        "cpu",
        "--timing-trials",
        "5",
        "--correctness-trials",
        "2",
        "--no-baselines",
        "--quiet",
        "--run",
        "real",
    )
    assert code == 0
    results = list(open_store(tmp_path / "store").list_results("runs/real"))
    assert len(results) == 1
    assert results[0].verdict == "correct", results[0].reasons
    assert results[0].environment.gpu_class == "cpu"
    assert "scale" in capsys.readouterr().out
