"""`kernelfleet eval`: the command-line contract (JSON keys, exit statuses, messages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelfleet.core.cli import main
from tests.support import evaluator_cases as C

QUICK = ["--device", "cpu", "--trials", "5", "--correctness-trials", "2", "--timing-warmup", "1"]


def _files(tmp_path: Path, reference: str, candidate: str) -> tuple[str, str]:
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(reference)
    cand.write_text(candidate)
    return str(ref), str(cand)


@pytest.mark.parametrize(
    ("candidate", "verdict"),
    [(C.HONEST, "correct"), (C.INPUT_MUTATION_HACK, "rejected"), (C.SYNTAX_ERROR, "compile_error")],
)
def test_json_output_and_status_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], candidate: str, verdict: str
) -> None:
    ref, cand = _files(tmp_path, C.MATMUL_TASK, candidate)
    assert main(["eval", "--reference", ref, "--candidate", cand, *QUICK, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == verdict
    assert isinstance(out["reasons"], list)
    for key in ("speedup", "reference_ms", "candidate_ms"):
        assert key in out
    assert {"device", "torch", "evaluator_version"} <= set(out["environment"])
    if verdict == "correct":
        assert out["reference_ms"] > 0 and out["candidate_ms"] > 0
        # A loaded machine can make the variance gate refuse the speedup: then it is null, and the
        # reasons say so. Either way the contract holds, and the test does not depend on the load.
        if out["speedup"] is None:
            assert any(reason.startswith("timing-noisy") for reason in out["reasons"]), out["reasons"]
        else:
            assert out["speedup"] > 0
    else:
        assert out["speedup"] is None and out["reasons"]


def test_human_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, cand = _files(tmp_path, C.MATMUL_TASK, C.HONEST)
    assert main(["eval", "--reference", ref, "--candidate", cand, *QUICK, "--profile", "kernelbench-v0"]) == 0
    out = capsys.readouterr().out
    assert "verdict" in out and "correct" in out and "kernelbench-v0" in out


@pytest.mark.parametrize(
    ("reference", "candidate", "args", "words"),
    [
        (None, C.HONEST, [], "cannot read the reference file"),
        (C.MATMUL_TASK, None, [], "cannot read the candidate file"),
        (C.HONEST, C.HONEST, [], "does not define Model"),
        (C.BROKEN_TASK, C.HONEST, [], "fails on its own"),
        (C.MATMUL_TASK, C.HONEST, ["--trials", "1"], "argument --timing-trials/--trials: 1: input should be"),
    ],
    ids=["no-reference", "no-candidate", "not-a-task", "broken-task", "bad-trials"],
)
def test_bad_usage_exits_2_with_a_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reference: str | None,
    candidate: str | None,
    args: list[str],
    words: str,
) -> None:
    ref, cand = _files(tmp_path, reference or "", candidate or "")
    if reference is None:
        ref = str(tmp_path / "missing-ref.py")
    if candidate is None:
        cand = str(tmp_path / "missing-cand.py")
    assert main(["eval", "--reference", ref, "--candidate", cand, *QUICK, *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and captured.out == ""


NAN_OUTPUT = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.full_like(A @ B, float("nan"))
"""


def strict_json(text: str) -> object:
    """What a strict parser (JavaScript's, Go's) reads: NaN and Infinity are no JSON."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_valid_json_when_the_output_is_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref, cand = _files(tmp_path, C.MATMUL_TASK, NAN_OUTPUT)
    assert main(["eval", "--reference", ref, "--candidate", cand, *QUICK, "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert isinstance(out, dict) and out["verdict"] == "incorrect"
    # The error is not a number: null, and the reason beside it.
    assert out["max_abs_error"] is None
    assert "not a JSON number" in out["non_finite"]["max_abs_error"]
