"""`kernelfleet dev-cluster` without servers: what it says when binaries are missing or no cluster
runs, and how it finds and stops the processes of a cluster it started earlier."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelfleet.core.cli import main
from kernelfleet.core.errors import UsageError
from kernelfleet.operator.devcluster import ClusterState, DevCluster, ProcessRecord, ServerProcess, wait_for


@pytest.fixture
def no_binaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("KERNELFLEET_BIN_DIR", str(empty))
    return tmp_path / "cluster"


def _state(directory: Path, *records: ProcessRecord) -> ClusterState:
    return ClusterState(
        directory=str(directory),
        kubeconfig=str(directory / "admin.kubeconfig"),
        api_server="https://127.0.0.1:6443",
        ca_file=str(directory / "ca.crt"),
        store_url="s3://kernelfleet",
        s3_endpoint="127.0.0.1:9000",
        s3_access_key="kf-key",
        s3_secret_key="kf-secret",
        started_at="2026-01-01T00:00:00+00:00",
        processes=records,
    )


def test_up_without_binaries_says_what_the_first_build_costs(
    no_binaries: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dev-cluster", "up", "--no-build", "--dir", str(no_binaries)]) == 2
    err = capsys.readouterr().err
    assert "missing: etcd, kube-apiserver" in err
    assert "first build takes about 20 minutes on 2 idle cores" in err
    assert "make binaries" in err
    assert not (no_binaries / "cluster.json").exists()


def test_up_with_kueue_also_needs_kueue_built(no_binaries: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev-cluster", "up", "--kueue", "--no-build", "--dir", str(no_binaries)]) == 2
    assert "kueue" in capsys.readouterr().err.split("missing:")[1].split(")")[0]
    assert main(["dev-cluster", "up", "--no-build", "--dir", str(no_binaries)]) == 2
    assert "kueue" not in capsys.readouterr().err.split("missing:")[1].split(")")[0]


def test_check_lists_the_missing_binaries_and_the_missing_cluster(
    no_binaries: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dev-cluster", "check", "--dir", str(no_binaries)]) == 1
    err = capsys.readouterr().err
    assert "binaries: missing" in err and "cluster: none" in err


def test_env_and_down_without_a_cluster(no_binaries: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev-cluster", "env", "--dir", str(no_binaries)]) == 2
    assert "no dev cluster runs" in capsys.readouterr().err
    assert main(["dev-cluster", "down", "--dir", str(no_binaries)]) == 0
    assert "no dev cluster was running" in capsys.readouterr().err


def test_env_prints_exports_that_a_shell_can_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = DevCluster(tmp_path / "with space")
    cluster.directory.mkdir()
    sleeper = _sleeper(tmp_path)
    try:
        cluster.save(_state(cluster.directory, sleeper.record()))
        assert main(["dev-cluster", "env", "--dir", str(cluster.directory)]) == 0
        exports = capsys.readouterr().out
        shell = subprocess.run(
            ["bash", "-c", exports + 'echo "$KUBECONFIG|$KERNELFLEET_STORE|$KERNELFLEET_S3_SECURE"'],
            capture_output=True,
            text=True,
            check=True,
        )
        assert shell.stdout.strip() == f"{cluster.directory}/admin.kubeconfig|s3://kernelfleet|false"
        assert oct(cluster.state_file.stat().st_mode & 0o777) == "0o600"  # it holds credentials
    finally:
        sleeper.stop()


def _sleeper(workdir: Path) -> ServerProcess:
    process = ServerProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], workdir, ready=lambda: True
    )
    process.start()
    return process


def test_down_stops_what_up_recorded_from_another_process(tmp_path: Path) -> None:
    cluster = DevCluster(tmp_path / "cluster")
    cluster.directory.mkdir()
    sleeper = _sleeper(tmp_path)
    record = sleeper.record()
    cluster.save(_state(cluster.directory, record))
    assert record.alive()
    assert cluster.load() is not None and cluster.load().dead() == []  # type: ignore[union-attr]

    stopped = cluster.down()
    assert stopped is not None and stopped.processes == (record,)
    assert not record.alive()
    assert cluster.load() is None


def test_a_recycled_pid_running_another_program_is_never_signalled(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        wait_for("sleep to be running", lambda: Path(f"/proc/{other.pid}/cmdline").read_bytes(), timeout=10)
        impostor = ProcessRecord(name="etcd", pid=other.pid, program="/nonexistent/etcd", log="")
        assert not impostor.alive()
        impostor.stop(timeout=1)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_partly_stopped_cluster_is_reported_with_the_log_to_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = DevCluster(tmp_path / "cluster")
    cluster.directory.mkdir()
    gone = ProcessRecord(name="kube-apiserver", pid=2**22 + 1, program="/x/kube-apiserver", log="/x/api.log")
    cluster.save(_state(cluster.directory, gone))
    assert main(["dev-cluster", "env", "--dir", str(cluster.directory)]) == 2
    err = capsys.readouterr().err
    assert "only partly running: kube-apiserver (log: /x/api.log) stopped" in err
    assert "dev-cluster down" in err


def test_an_unreadable_state_file_names_itself(tmp_path: Path) -> None:
    cluster = DevCluster(tmp_path)
    cluster.state_file.write_text("{not json")
    with pytest.raises(UsageError, match=r"cluster.json is unreadable"):
        cluster.load()


def test_the_build_script_in_the_checkout_is_the_packaged_one() -> None:
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [str(root / "scripts" / "build-test-binaries.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "KERNELFLEET_CACHE": "/somewhere/cache"},
    )
    assert result.stdout.strip() == "/somewhere/cache/bin"


def test_free_ports_come_from_below_the_ephemeral_range_and_are_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port from the ephemeral range can become the source port of any outgoing connection
    before its server binds it; below the range only a listener can take it."""
    from kernelfleet.operator.devcluster import _process

    low = _process._ephemeral_low()
    ports = {_process.free_port() for _ in range(20)}
    for port in ports:
        assert low <= 1 + _process._FIRST_PORT or _process._FIRST_PORT <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # nothing took it
    assert len(ports) > 1  # drawn at random, not one fixed port
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65000\n")
    assert _process._ephemeral_low(ranges) == 1024
    assert _process._ephemeral_low(tmp_path / "missing") == 32768
    # A range that leaves no room below it: the kernel picks, as before.
    monkeypatch.setattr(_process, "_ephemeral_low", lambda: 1024)
    assert _process.free_port() > 0
