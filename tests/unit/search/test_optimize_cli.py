"""`kernelfleet optimize`, `results` and `report` from the command line.

Most tests swap the evaluator for the scripted one (the command line is under test, not the
evaluator); one runs the real evaluator end to end on a tiny task.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

import kernelfleet.evaluator as evaluator_module
from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import TaskSummary
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
    assert first.config.device == "cpu" and first.config.timing.baseline_modes == ("eager", "compile")
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


# ---------------------------------------------------------------------- bad input, as a new user meets it


def kernelfleet(*argv: str) -> int:
    """The whole command line, root included: exit statuses and messages, never tracebacks."""
    from kernelfleet.core.cli import main

    return main(list(argv))


OPTIMIZE = ("optimize", "tasks", "--policy", "replay:candidates.jsonl", "--quiet", "--device", "cpu")


def test_a_store_that_is_a_regular_file_is_named(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workspace / "afile").write_text("not a store\n")
    assert kernelfleet(*OPTIMIZE, "--store", "afile") == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "already exists" not in err
    assert kernelfleet("store", "ls", "afile") == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert kernelfleet("store", "ls", "missing-dir") == 2
    assert "no store at" in capsys.readouterr().err


def _read_only_store(workspace: Path) -> Path | None:
    """A directory this process cannot write: its own, made read-only, unless it runs as root
    (whom permissions do not stop); then a sysfs directory, which refuses everyone."""
    if os.geteuid() != 0:
        store = workspace / "ro-store"
        store.mkdir()
        store.chmod(0o555)
        return store
    candidate = Path("/sys/kernel")
    try:
        (candidate / "kernelfleet-probe").mkdir()
    except OSError:
        return candidate if candidate.is_dir() else None
    return None


def test_a_read_only_store_is_an_error_with_a_message(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _read_only_store(workspace)
    if store is None:
        pytest.skip("no read-only directory available")
    assert kernelfleet(*OPTIMIZE, "--store", str(store)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "writable" in err and str(store) in err


@pytest.mark.skipif(os.geteuid() == 0, reason="permissions do not stop root")
def test_resuming_on_a_read_only_store(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "ro", "--rounds", "1") == 0
    capsys.readouterr()
    for path in [workspace / "store", *(workspace / "store").rglob("*")]:
        if path.is_dir():
            path.chmod(0o555)
    # A finished run needs no writes: it is read back and printed.
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "ro", "--rounds", "1") == 0
    # Asking for more rounds needs writes: a message, not a traceback.
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "ro", "--rounds", "2") == 1
    assert "writable" in capsys.readouterr().err


def test_corrupt_objects_are_named_and_the_rest_is_read(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    capsys.readouterr()
    root = workspace / "store"
    run = root / "runs" / "demo"
    results = sorted((run / "results").rglob("*.json"))
    summaries = sorted(run.rglob("summary-*.json"))
    variants = sorted((root / "variants").glob("*.py"))
    damaged = {
        results[0]: b"{not json",
        summaries[0]: b'{"task_name": 3}\n',
        run / "run.json": b"\xff\xfe garbage",
        variants[0]: b"print('tampered')\n",
    }
    for path, data in damaged.items():
        path.write_bytes(data)
    for argv in (("results", "demo"), ("results", "demo", "--code"), ("report", "demo")):
        assert kernelfleet(*argv, "--store", "store") == 0, argv
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        # Every damaged file that the command reads is named; the rest of the run is shown.
        assert str(results[0].relative_to(root)) in err and "run.json" in err
        assert str(summaries[0].relative_to(root)) in err
        if argv[0] == "results":
            assert "double" in out and "triple" in out
    # Resuming names what it cannot mend (run.json) and repairs the rest: the damaged result is
    # measured again in place (its bytes kept under damaged/), and the task's summary written anew.
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    err = capsys.readouterr().err
    assert "run.json" in err
    store = open_store(root)
    key = str(results[0].relative_to(root))
    assert store.read_result(key).key.path() in key
    assert any(k.startswith(f"damaged/{key}-") for k in store.list("damaged/"))
    summary_key = str(summaries[0].relative_to(root))
    assert store.read_model(summary_key, TaskSummary).task_name in ("double", "triple")
    assert kernelfleet("results", "demo", "--store", "store") == 0
    out, err = capsys.readouterr()
    assert key not in err and "double" in out and "triple" in out


def test_a_replay_file_that_is_not_utf8_or_names_no_task(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workspace / "latin.jsonl").write_bytes('{"task": "double", "code": "# caf\u00e9"}\n'.encode("latin-1"))
    assert kernelfleet("optimize", "tasks", "--policy", "replay:latin.jsonl", "--store", "store") == 2
    assert "is not UTF-8" in capsys.readouterr().err
    typo = {"task": "dobule", "code": variant_code("x", 2.0)}
    (workspace / "typo.jsonl").write_text(json.dumps(typo) + "\n")
    assert kernelfleet("optimize", "tasks", "--policy", "replay:typo.jsonl", "--store", "store") == 2
    err = capsys.readouterr().err
    assert "no row of the replay file names a task of this run" in err and "dobule" in err
    assert not (workspace / "store").exists()


def test_bad_numbers_are_refused_by_flag(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (("--timing-trials", "2"), "--timing-trials"),
        (("--device", "tpu"), "--device"),
        (("--target-speedup", "nan"), "--target-speedup"),
        (("--wall-time", "inf"), "--wall-time"),
        (("--exemplars", "-1"), "--exemplars"),
    ):
        assert kernelfleet(*OPTIMIZE, "--store", "store", *argv) == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and "Traceback" not in err


# ---------------------------------------------------------------------- a damaged store


def best_of_double(root: Path) -> tuple[str, str]:
    """The double task's summary's best variant, and its result's key."""
    from kernelfleet.search._report import load_run

    store = open_store(root)
    [double] = [o for o in load_run(store, "runs/demo").outcomes if o.task.name == "double"]
    assert double.summary is not None and double.summary.best_variant_hash is not None
    best = double.summary.best_variant_hash
    [key] = [k for k in store.list("runs/demo/results/") if k.endswith(f"/{best}.json")]
    return best, key


@pytest.mark.parametrize("damage", ["truncate", "replace", "delete"])
def test_a_damaged_result_is_never_shown_and_a_resume_measures_it_again(
    workspace: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    root = workspace / "store"
    best, key = best_of_double(root)
    path = root / key
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:50])
    elif damage == "replace":  # another variant's (valid) result put at this key
        other = next(p for p in path.parent.glob("*.json") if p != path)
        path.write_bytes(other.read_bytes())
    else:
        path.unlink()
    capsys.readouterr()
    assert kernelfleet("results", "demo", "--store", "store") == 0
    out, err = capsys.readouterr()
    double = next(line for line in out.splitlines() if line.startswith("double"))
    assert "2.50x" not in double and "DAMAGED" in double
    assert "task double" in err and "kernelfleet optimize" in err and "store verify" in err
    assert "Traceback" not in err
    assert kernelfleet("results", "demo", "--store", "store", "--json") == 0
    rows = {row["task"]: row for row in json.loads(capsys.readouterr().out)["tasks"]}
    assert rows["double"]["best_speedup"] is None and rows["double"]["damage"]
    assert rows["double"]["code"] is None and rows["triple"]["damage"] is None
    assert kernelfleet("report", "demo", "--store", "store", "-o", "r.html") == 0
    html = (workspace / "r.html").read_text()
    assert "Damaged in the store" in html and "2.50x" not in html
    assert kernelfleet("store", "verify", "store", "demo") == 1

    # The same command again measures the damaged result again, in place, and reports it.
    evaluated_before = sum(len(e.evaluated) for e in CliEvaluator.instances)
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    assert sum(len(e.evaluated) for e in CliEvaluator.instances) > evaluated_before
    capsys.readouterr()
    assert open_store(root).read_result(key).variant_hash == best
    assert kernelfleet("results", "demo", "--store", "store") == 0
    out, err = capsys.readouterr()
    assert "2.50x" in next(line for line in out.splitlines() if line.startswith("double"))
    assert "DAMAGED" not in out and "left out" not in err
    assert kernelfleet("store", "verify", "store", "demo") == 0


@pytest.mark.parametrize("damage", ["delete", "tamper"])
def test_lost_code_is_named_fails_verify_and_a_resume_restores_it(
    workspace: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    root = workspace / "store"
    best, _ = best_of_double(root)
    code_path = root / "variants" / f"{best}.py"
    original = code_path.read_bytes()
    if damage == "delete":
        code_path.unlink()
    else:
        code_path.write_bytes(b"print('tampered')\n")
    capsys.readouterr()
    assert kernelfleet("results", "demo", "--store", "store", "--code") == 0
    out, err = capsys.readouterr()
    assert f"no code shown: the code of its best variant {best[:12]}" in out
    assert "2.50x" not in out.split("# ====")[0].split("double", 1)[1].splitlines()[0]
    assert "task double" in err
    assert kernelfleet("store", "verify", "store", "demo") == 1
    out, _ = capsys.readouterr()
    assert f"variants/{best}.py" in out

    assert kernelfleet(*OPTIMIZE, "--store", "store", "--run", "demo") == 0
    assert code_path.read_bytes() == original  # proposed again by the replay policy, and stored
    capsys.readouterr()
    assert kernelfleet("store", "verify", "store", "demo") == 0
    assert kernelfleet("results", "demo", "--store", "store", "--code") == 0
    out, _ = capsys.readouterr()
    assert "no code shown" not in out and "variant: d1" in out
