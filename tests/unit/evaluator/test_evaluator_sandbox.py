"""The sandbox's parts: what crosses the wire (checked, never unpickled), the environment and
the mount view a candidate gets, the isolation levels and the refusal below a minimum."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from kernelfleet.core.errors import UsageError
from kernelfleet.core.settings import ISOLATION_LEVELS
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator import _sandbox as S
from kernelfleet.evaluator._confine import seccomp_program
from kernelfleet.evaluator._protocol import clock_mismatch
from kernelfleet.evaluator._wire import MalformedTensors, _read_tensors, read_tree, write_tree

LIMIT = 1 << 24


def test_outputs_cross_as_checked_bytes(tmp_path: Path) -> None:
    z = torch.randn(2, dtype=torch.complex64)
    value = (
        torch.randn(3, 4),
        [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)],
        {"z": z, "n": 3, "x": float("nan"), "none": None},
        torch.zeros(0, 5),
        torch.tensor(2.5),  # a loss: a 0-dim output
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    )
    path = tmp_path / "out"
    write_tree(str(path), value)
    back, devices = read_tree(str(path), LIMIT)
    assert devices == ["cpu"] * 7
    assert torch.equal(back[0], value[0]) and torch.equal(back[1][0], value[1][0])
    assert torch.equal(back[1][1], value[1][1]) and back[1][1].dtype == torch.bfloat16
    assert torch.equal(back[2]["z"], z) and back[2]["n"] == 3 and back[2]["none"] is None
    assert back[3].shape == (0, 5)
    assert back[4].shape == () and float(back[4]) == 2.5
    assert torch.equal(back[5], value[5])
    # Each tensor has memory of its own: the file and the other tensors stay as they were.
    back[0].zero_()
    again, _ = read_tree(str(path), LIMIT)
    assert torch.equal(again[0], value[0]) and torch.equal(back[1][0], value[1][0])


def test_a_file_is_written_only_where_nothing_was(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    target = tmp_path / "elsewhere"
    planted.symlink_to(target)
    with pytest.raises(OSError):
        write_tree(str(planted), torch.ones(2))
    assert not target.exists()


@pytest.mark.parametrize(
    "make",
    ["link", "fifo", "lying-size", "bad-dtype", "too-big", "not-json", "truncated"],
)
def test_a_file_that_lies_about_itself_is_refused(tmp_path: Path, make: str) -> None:
    path = tmp_path / "out"
    good = tmp_path / "good"
    write_tree(str(good), torch.ones(4, 4))
    data = good.read_bytes()
    if make == "link":
        path.symlink_to(good)
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "lying-size":
        path.write_bytes(data.replace(b'"shape": [4, 4]', b'"shape": [4, 5]'))
    elif make == "bad-dtype":
        path.write_bytes(data.replace(b'"float32"', b'"object0"'))
    elif make == "too-big":
        path.write_bytes(data + b"\0" * LIMIT)
    elif make == "not-json":
        path.write_bytes(b"KFT1\0\0\0\x05" + b"{{{{{" + b"\0" * 64)
    else:
        path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MalformedTensors):
        read_tree(str(path), LIMIT)


def test_a_file_that_shrinks_while_it_is_read_is_refused(tmp_path: Path) -> None:
    """The other side may cut its file after the header was checked against its size: the
    tensor's read comes up short and is refused, never padded with whatever memory held."""
    path = tmp_path / "out"
    write_tree(str(path), torch.ones(64, 64))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.truncate(path, size // 2)  # after the size was read, before the data
        with pytest.raises(MalformedTensors, match="ended before"):
            _read_tensors(fd, size, None)
    finally:
        os.close(fd)


def test_the_sandbox_environment_holds_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELFLEET_S3_SECRET_KEY", "secret")
    monkeypatch.setenv("KERNELFLEET_STORE", "s3://bucket/runs")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    env = S.sandbox_env()
    assert not [name for name in env if name.startswith(("KERNELFLEET_", "AWS_")) or name == "LD_PRELOAD"]
    assert "secret" not in " ".join(env.values())


def test_the_mount_view_leaves_out_the_working_directory_home_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # a repository root put on the import path
    bound = S._python_paths()
    home = os.path.realpath(os.path.expanduser("~"))
    for path in bound:
        assert not str(tmp_path.resolve()).startswith(path.rstrip("/") + "/") and path != str(
            tmp_path.resolve()
        )
        assert not home.startswith(path.rstrip("/") + "/") and path != home
    report = S.detect()
    if report.bwrap:
        argv = S._bwrap_argv(
            report.bwrap, build_root=str(tmp_path / "builds"), tmp_bytes=1 << 26, control_fd=None
        )
        sources = {argv[i + 1] for i, arg in enumerate(argv) if arg in ("--bind", "--ro-bind")}
        assert str(tmp_path) not in sources and home not in sources
        for flag in ("--unshare-pid", "--unshare-net", "--die-with-parent", "--new-session", "--clearenv"):
            assert flag in argv


def test_levels_are_ordered_and_detection_says_what_is_there() -> None:
    report = S.detect()
    assert report.level in ISOLATION_LEVELS
    text = report.describe()
    assert f"isolation level: {report.level}" in text and "seccomp" in text


def test_a_minimum_the_machine_cannot_meet_is_refused_with_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weak = S.IsolationReport("process", None, "bwrap is not installed", 0, True, None)
    monkeypatch.setattr(S, "detect", lambda: weak)
    with pytest.raises(UsageError, match=r"isolation.min_level is 'landlock'.*apt-get install bubblewrap"):
        S.resolve_level("auto", "landlock")
    assert S.resolve_level("auto", "process") == "process"
    with pytest.raises(UsageError, match="not available here"):
        S.resolve_level("bubblewrap", None)
    with (
        Evaluator(EvalConfig.model_validate({"isolation": {"min_level": "bubblewrap"}})) as evaluator,
        pytest.raises(UsageError),
    ):
        evaluator.isolation  # noqa: B018 - resolving the level is what refuses


def test_the_seccomp_filter_is_a_whole_program() -> None:
    program = seccomp_program([1234])
    assert len(program) % 8 == 0 and 50 < len(program) // 8 < 4096


def test_the_outside_clock_catches_a_forged_timing_but_not_a_busy_machine() -> None:
    rng = random.Random(7)
    rounds = 100

    def noise() -> float:  # scheduling delays: mostly small, sometimes milliseconds
        return rng.expovariate(1 / 0.3) + (rng.random() < 0.1) * rng.uniform(1, 5)

    true_ms = [1.0 + rng.gauss(0, 0.02) for _ in range(rounds)]
    ref_ms = [2.0 + rng.gauss(0, 0.02) for _ in range(rounds)]
    outside_ref = [m + 0.2 + noise() for m in ref_ms]
    outside_cand = [m + 0.2 + noise() for m in true_ms]
    honest = clock_mismatch(
        {"candidate": true_ms, "reference": ref_ms}, {"candidate": outside_cand, "reference": outside_ref}
    )
    assert honest is None
    forged = clock_mismatch(
        {"candidate": [m / 10 for m in true_ms], "reference": ref_ms},
        {"candidate": outside_cand, "reference": outside_ref},
    )
    assert forged is not None and forged.startswith("clock-mismatch")
    # Too few rounds to tell: no verdict from the clock.
    assert (
        clock_mismatch(
            {"candidate": [0.1] * 10, "reference": [1.0] * 10},
            {"candidate": [5.0] * 10, "reference": [1.1] * 10},
        )
        is None
    )


def test_a_closed_sandbox_s_zygote_ends_by_itself(tmp_path: Path) -> None:
    """Closing a sandbox ends its zygote through the control socket, though the sandbox's reader
    thread is blocked receiving on that socket: a plain close left the zygote waiting, and every
    sandbox was then killed after 10 s, one after another, at the end of each run."""
    sandbox = S.Sandbox(S.detect().level, build_root=str(tmp_path))
    child = sandbox.spawn("candidate", S.Walls(), S.sandbox_env())
    child.close()
    process = sandbox._process
    assert process is not None
    sandbox.close()
    assert process.returncode == 0  # it exited; killed, it would be -9
