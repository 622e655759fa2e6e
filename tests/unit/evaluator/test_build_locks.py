"""Build directories never stay locked: torch's lock file, left by a process killed mid-build,
is cleared before the next process uses the directory, and never while another evaluation may
hold it; an evaluation that builds or waits long is named with what it waits on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelfleet.core.models import Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator._builddir import BuildDirectory, flock_holders
from kernelfleet.evaluator._devicelock import DeviceBusy, DeviceLock
from tests.support import evaluator_cases as C
from tests.unit.evaluator.test_evaluator_batch import FAST

SLOW_BUILDS = {"limits": {"compile_timeout_s": 900.0, "timeout_seconds": 300.0}}  # a loaded machine

MATMUL = Task(name="matmul", code=C.MATMUL_TASK)


def _plant(directory: Path, name: str = "ext") -> Path:
    (directory / name).mkdir(parents=True, exist_ok=True)
    lock = directory / name / "lock"
    lock.write_text("")
    return lock


def test_a_stale_lock_is_cleared_when_no_one_uses_the_directory(tmp_path: Path) -> None:
    build = tmp_path / "builds" / "abc"
    lock = _plant(build)
    with BuildDirectory(build) as lease:
        assert not lock.exists()
        assert lease.cleared == [lock]
        assert os.getpid() in flock_holders(lease.lease)  # held (shared) for the block


def test_a_lock_is_kept_while_another_evaluation_uses_the_directory(tmp_path: Path) -> None:
    build = tmp_path / "abc"
    with BuildDirectory(build) as first:
        lock = _plant(build)  # first's process builds now: its lock is live
        with BuildDirectory(build) as second:
            assert lock.exists() and second.cleared == []
        assert lock.exists()
        lock.unlink()  # first's build ended; then it was killed mid-way in its next process:
        lock = _plant(build)
        assert first.clear_stale() == [lock]  # between its processes, with no one else there


def test_a_lease_held_by_another_process_keeps_its_locks(tmp_path: Path) -> None:
    build = tmp_path / "abc"
    lock = _plant(build)
    BuildDirectory(build).__enter__().__exit__()  # creates the lease file, clears
    lock = _plant(build)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(build) + '.lease'!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with BuildDirectory(build) as lease:
            assert lock.exists() and lease.cleared == []
            assert holder.pid in flock_holders(lease.lease)
    finally:
        holder.kill()
        holder.wait()
    with BuildDirectory(build) as lease:  # the holder died: the kernel dropped its lease
        assert lease.cleared == [lock]


def test_clearing_never_follows_a_link_out_of_the_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    victim = _plant(outside, "victim")
    build = tmp_path / "abc"
    build.mkdir()
    (build / "ext").symlink_to(outside / "victim")
    (build / "lockdir").mkdir()
    (build / "lockdir" / "lock").symlink_to(victim)
    with BuildDirectory(build):
        pass
    assert victim.exists()


def test_the_device_lock_wait_is_bounded_and_names_the_holder(tmp_path: Path) -> None:
    lock = DeviceLock(f"test-device-{os.getpid()}")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, time\n"
            f"fd = os.open({lock.path!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        os.makedirs(os.path.dirname(lock.path), exist_ok=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DeviceBusy, match=rf"pid {holder.pid}"):
            lock.acquire(timeout_s=0.3)
    finally:
        holder.kill()
        holder.wait()
    lock.acquire(timeout_s=5.0)
    lock.release()


def test_a_candidate_whose_build_left_a_stale_lock_is_evaluated(tmp_path: Path) -> None:
    """What a process killed mid-build leaves (torch's lock file) made every later evaluation of
    the candidate wait until its limit and end as `timeout`, on every later run on the machine.
    Here the build is killed at its limit, a lock is planted besides, and the next evaluation
    builds and judges it as if nothing had happened."""
    code = C.CPP_KERNEL.replace("kf_test_relu_mm", "kf_test_stale_lock")
    killed = EvalConfig(**merged(FAST, {"limits": {"compile_timeout_s": 1.0}}), cache_dir=str(tmp_path))
    with Evaluator(killed) as evaluator:
        assert evaluator.evaluate(MATMUL, code).verdict == Verdict.TIMEOUT
    builds = [path for path in tmp_path.rglob("kf_test_stale_lock") if path.is_dir()]
    assert len(builds) == 1
    lock = builds[0] / "lock"
    if not lock.exists():  # the compile limit struck before torch took its lock: plant one
        lock.write_text("")
    config = EvalConfig(**merged(FAST, SLOW_BUILDS), cache_dir=str(tmp_path))
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, code)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)


def test_a_long_build_is_reported_with_what_it_does(tmp_path: Path) -> None:
    """The watchdog names a building evaluation (it was silent: only running ones were named)."""
    import kernelfleet.evaluator._evaluator as evaluator_module

    code = C.CPP_KERNEL.replace("kf_test_relu_mm", "kf_test_watchdog")
    reports: list[str] = []
    config = EvalConfig(**merged(FAST, SLOW_BUILDS), cache_dir=str(tmp_path))
    original = evaluator_module.SLOW_AFTER_S
    evaluator_module.SLOW_AFTER_S = 1.0
    try:
        with Evaluator(config) as evaluator:
            results = evaluator.evaluate_batch(
                [(MATMUL, code)], slow=lambda task, variant, seconds, activity: reports.append(activity)
            )
    finally:
        evaluator_module.SLOW_AFTER_S = original
    assert results[0].verdict == Verdict.CORRECT, (results[0].reasons, results[0].log)
    assert any(report.startswith("building") for report in reports), reports
