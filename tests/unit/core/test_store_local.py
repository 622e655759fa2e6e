"""What only the local-directory backend has to show: temp files, processes racing, defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelfleet.core.config import StoreConfig
from kernelfleet.core.store import LocalStore, ObjectConflict, open_store

WRITER = """
import sys
from kernelfleet.core.store import open_store
store = open_store(sys.argv[1])
data = bytes(range(256)) * 4096
print(sum(store.put_bytes(f"shared/{i}.bin", data) for i in range(20)))
"""


def test_the_default_store_is_dot_kernelfleet_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store(None, StoreConfig())
    assert isinstance(store, LocalStore) and store.root == tmp_path / ".kernelfleet"
    store.put_bytes("x", b"1")
    assert (tmp_path / ".kernelfleet" / "x").read_bytes() == b"1"


def test_the_environment_chooses_the_default_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELFLEET_STORE", f"file://{tmp_path}/elsewhere")
    store = open_store()
    assert store.url == (tmp_path / "elsewhere").as_uri()


def test_processes_racing_on_the_same_objects_converge(tmp_path: Path) -> None:
    root = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    written = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(written) == 20  # every object was published by exactly one process
    store = open_store(root)
    assert len(list(store.list("shared/"))) == 20
    assert all(store.get_bytes(key) == bytes(range(256)) * 4096 for key in store.list("shared/"))
    assert [p for p in (root / "shared").iterdir() if p.name.startswith(".kf-tmp-")] == []


def test_readers_never_see_an_object_before_it_is_complete(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(5 * 1024 * 1024))
    seen: list[bool] = []
    store.put_file("big.bin", source, progress=lambda _: seen.append(store.exists("big.bin")))
    assert len(seen) == 5 and not any(seen)
    assert list(store.list()) == ["big.bin"]  # the in-flight temp file was never listed either


def test_leftover_temp_files_stay_invisible(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    store.put_bytes("a/b", b"x")
    (tmp_path / "store" / "a" / ".kf-tmp-crashed").write_bytes(b"half")
    assert list(store.list()) == ["a/b"]


def test_a_key_cannot_also_be_a_prefix_here(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    store.put_bytes("a", b"x")
    with pytest.raises(ObjectConflict, match="prefix"):
        store.put_bytes("a/b", b"y")
    store.put_bytes("c/d", b"y")
    with pytest.raises(ObjectConflict, match="prefix"):
        store.put_bytes("c", b"x")


def test_objects_are_readable_by_others(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    store.put_bytes("shared.json", b"{}")
    assert (tmp_path / "store" / "shared.json").stat().st_mode & 0o044 == 0o044 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_fsync_can_be_turned_off(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", StoreConfig(local_fsync=False))
    assert store.put_bytes("x", b"1") is True and store.get_bytes("x") == b"1"


def test_check_reports_a_path_that_cannot_be_a_store(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    steps = open_store(tmp_path / "file" / "store").check()
    assert [(s.name, s.ok) for s in steps] == [("directory", False)]
    assert "not writable" in steps[0].detail or "not a directory" in steps[0].detail
    steps = open_store(tmp_path / "file").check()
    assert not steps[0].ok and "not a directory" in steps[0].detail


def test_check_on_a_store_that_does_not_exist_yet(tmp_path: Path) -> None:
    steps = open_store(tmp_path / "new" / "store").check()
    assert all(s.ok for s in steps) and "will be created" in steps[0].detail
