"""`kernelfleet results NAME` and `report NAME` read the run of a cluster resource: a run locator
(the operator distribution's, in real use) says where the resource's results are, and the
commands read that store as they read a local one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernelfleet.evaluator as evaluator_module
from kernelfleet.core import run_location
from kernelfleet.core.errors import UsageError
from kernelfleet.core.run_location import RunLocation, resource_reference, split_results_url
from tests.support.search import REFERENCE, variant_code
from tests.unit.search.test_optimize_cli import CliEvaluator, run_cli


@pytest.fixture
def cluster_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A finished run in a store of its own ("the cluster's store"), and an empty local store."""
    monkeypatch.setattr(evaluator_module, "Evaluator", CliEvaluator)
    CliEvaluator.instances = []
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "double.py").write_text(REFERENCE.format(factor=2))
    row = {"task": "double", "code": variant_code("d1", 2.5), "name": "fast-double"}
    (tmp_path / "candidates.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.chdir(tmp_path)
    argv = ["optimize", "tasks", "--policy", "replay:candidates.jsonl", "--store", "cluster-store"]
    assert run_cli(*argv, "--run", "job-uid", "--quiet", "--device", "cpu") == 0
    return tmp_path


class FakeLocator:
    """Knows one OptimizationJob, `tuned` in namespace `team`; records what it was asked."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.asked: list[tuple[str, str | None, str]] = []

    def __call__(self, name: str, namespace: str | None, kind: str) -> RunLocation | None:
        self.asked.append((name, namespace, kind))
        if (name, namespace or "team", kind) == ("tuned", "team", "OptimizationJob"):
            return RunLocation(store_url=str(self.store), prefix="runs/job-uid", description="team/tuned")
        return None


def test_resource_names_are_read_from_the_store_the_cluster_names(
    cluster_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    locator = FakeLocator(cluster_run / "cluster-store")
    monkeypatch.setattr(run_location, "run_locators", lambda: [locator])
    capsys.readouterr()

    # A bare name that is no local run is asked of the cluster.
    assert run_cli("results", "tuned", "--store", "local-store") == 0
    assert "2.50x" in capsys.readouterr().out
    # kubectl's form asks the cluster only, in the namespace given.
    assert run_cli("results", "optimizationjob/tuned", "-n", "team", "--json") == 0
    assert json.loads(capsys.readouterr().out)["tasks"][0]["best_speedup"] == 2.5
    assert locator.asked[-1] == ("tuned", "team", "OptimizationJob")
    assert run_cli("report", "kfopt/tuned", "-o", "tuned.html") == 0
    assert "fast-double" in (cluster_run / "tuned.html").read_text()

    with pytest.raises(UsageError, match=r"no OptimizationJob 'gone' in namespace team"):
        run_cli("results", "optimizationjob/gone", "-n", "team")
    # A bare name neither place knows: the local message, which lists the local runs.
    with pytest.raises(UsageError, match="no run 'gone' in the store"):
        run_cli("results", "gone", "--store", "cluster-store")
    # A run id that cannot be a resource name never reaches the cluster.
    asked = len(locator.asked)
    with pytest.raises(UsageError, match="no run 'Run_1'"):
        run_cli("results", "Run_1", "--store", "cluster-store")
    assert len(locator.asked) == asked


def test_without_a_locator_or_a_kubeconfig_the_user_is_told_what_is_missing(
    cluster_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_location, "run_locators", lambda: [])
    with pytest.raises(UsageError, match="needs the kernelfleet-operator package"):
        run_cli("results", "optimizationjob/tuned")

    def no_kubeconfig(name: str, namespace: str | None, kind: str) -> RunLocation | None:
        raise UsageError("no kubeconfig")

    monkeypatch.setattr(run_location, "run_locators", lambda: [no_kubeconfig])
    with pytest.raises(UsageError, match="no kubeconfig"):
        run_cli("results", "optimizationjob/tuned")
    # For a bare name the cluster was only a guess: the local error is the one that helps.
    with pytest.raises(UsageError, match="no run 'tuned' in the store"):
        run_cli("results", "tuned", "--store", "cluster-store")


def test_local_runs_win_over_resources_of_the_same_name(
    cluster_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    locator = FakeLocator(cluster_run / "elsewhere")
    monkeypatch.setattr(run_location, "run_locators", lambda: [locator])
    capsys.readouterr()
    assert run_cli("results", "job-uid", "--store", "cluster-store") == 0
    assert "2.50x" in capsys.readouterr().out and locator.asked == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("optimizationjob/tuned", ("OptimizationJob", "tuned")),
        ("OptimizationJobs/tuned", ("OptimizationJob", "tuned")),
        ("kfopt/a.b-1", ("OptimizationJob", "a.b-1")),
        ("trainingrun/r1", ("TrainingRun", "r1")),
        ("kftrain/r1", ("TrainingRun", "r1")),
        ("tuned", None),
        ("optimizationjobs/ns/name/uid", None),  # a store prefix
        ("runs/run-1", None),
        ("optimizationjob/Not_A_Name", None),
    ],
)
def test_resource_references(text: str, expected: tuple[str, str] | None) -> None:
    assert resource_reference(text) == expected


def test_results_urls_split_into_the_store_root_and_the_run_prefix() -> None:
    marker = "optimizationjobs"
    assert split_results_url("s3://bucket/optimizationjobs/ns/job/uid", marker) == RunLocation(
        "s3://bucket", "optimizationjobs/ns/job/uid"
    )
    assert split_results_url("s3://bucket/team/kf/optimizationjobs/ns/job/uid/", marker) == RunLocation(
        "s3://bucket/team/kf", "optimizationjobs/ns/job/uid"
    )
    assert split_results_url("/data/store/optimizationjobs/ns/job/uid", marker) == RunLocation(
        "/data/store", "optimizationjobs/ns/job/uid"
    )
    # A bucket named like the marker is the bucket, not the prefix.
    assert split_results_url("s3://optimizationjobs/optimizationjobs/ns/j/u", marker) == RunLocation(
        "s3://optimizationjobs", "optimizationjobs/ns/j/u"
    )
    assert split_results_url("s3://bucket/elsewhere/run", marker) is None
