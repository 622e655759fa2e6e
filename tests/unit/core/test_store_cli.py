"""`kernelfleet store check URL` and `kernelfleet store ls URL PREFIX` on a local store."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from kernelfleet.core import cli
from kernelfleet.core.cli import main
from kernelfleet.core.store import open_store

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
