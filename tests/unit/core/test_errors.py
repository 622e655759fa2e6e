"""Errors are sorted by whether a retry helps, as the operator needs to know (kopf's temporary
and permanent errors); the command line prints any of them as a message, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfleet.core.cli import main
from kernelfleet.core.errors import (
    EvaluationCancelled,
    KernelfleetError,
    PermanentError,
    StoreError,
    TransientError,
    UsageError,
    retryable,
)
from kernelfleet.core.store import CorruptObject, NotFound, ObjectConflict, StoreUnavailable, open_store
from kernelfleet.evaluator import ServiceError
from kernelfleet.search import PolicyError


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (StoreUnavailable("the endpoint did not answer"), True),
        (EvaluationCancelled(), True),
        (ServiceError("unreachable", status=0), True),
        (ServiceError("busy", status=503), True),
        (ServiceError("bad request", status=400), False),
        (UsageError("bad field"), False),
        (StoreError("denied"), False),
        (ObjectConflict("different object"), False),
        (CorruptObject("not JSON", "runs/x/run.json"), False),
        (PolicyError("bad key"), False),
        (NotFound("no object"), False),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (ValueError("a bug"), False),
    ],
)
def test_retryable(error: BaseException, expected: bool) -> None:
    assert retryable(error) is expected


def test_every_error_is_one_or_the_other() -> None:
    assert issubclass(UsageError, PermanentError) and issubclass(StoreError, PermanentError)
    assert issubclass(StoreUnavailable, TransientError) and issubclass(CorruptObject, StoreError)
    assert issubclass(NotFound, KernelfleetError) and issubclass(NotFound, KeyError)


def test_a_corrupt_object_names_its_key(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(CorruptObject) as raised:
        store.get_json("a.json")
    assert raised.value.key == "a.json" and "a.json" in str(raised.value)


def test_store_ls_says_when_it_finds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "store" / "runs").mkdir(parents=True)
    (tmp_path / "store" / "runs" / "run.json").write_text("{}")
    assert main(["store", "ls", str(tmp_path / "store"), "nothing/"]) == 0
    assert "no objects under 'nothing/'" in capsys.readouterr().err
    assert main(["store", "ls", str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out.split() == ["runs/run.json"]
    assert main(["store", "ls", str(tmp_path / "missing")]) == 2
    assert "no store at" in capsys.readouterr().err
