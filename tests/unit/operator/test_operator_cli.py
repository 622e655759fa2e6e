"""`kernelfleet operator` is contributed through the entry point, says what it needs, and its
metrics endpoint speaks the Prometheus text format."""

from __future__ import annotations

import pytest

from kernelfleet.core.cli import build_parser, main
from kernelfleet.operator._metrics import Metrics


def test_operator_and_worker_are_subcommands() -> None:
    parser = build_parser()
    args = parser.parse_args(["operator", "-A", "--pools", "p.yaml", "--metrics-port", "9100"])
    assert args.all_namespaces and args.pools == "p.yaml" and args.metrics_port == 9100
    worker = parser.parse_args(["worker", "--store", "s3://b", "--prefix", "p", "--gpu-class", "h100"])
    assert worker.role == "search" and worker.shard == 0


def test_operator_needs_a_scope(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator"]) == 2
    assert "--namespace NS" in capsys.readouterr().err


def test_operator_with_a_bad_pool_file_names_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text("version: 1\nclasses:\n  x: {}\n")
    assert main(["operator", "-A", "--pools", str(pools)]) == 2
    assert "classes.x selects no nodes" in capsys.readouterr().err


def test_metrics_render_counters_and_gauges() -> None:
    metrics = Metrics()
    metrics.describe("reconciles_total", "Reconcile passes, by kind.")
    metrics.inc("reconciles_total", kind="OptimizationJob")
    metrics.inc("reconciles_total", 2, kind="OptimizationJob")
    metrics.replace_gauge("jobs", [({"kind": "OptimizationJob", "phase": "Running"}, 3.0)])
    text = metrics.render()
    assert "# TYPE kernelfleet_operator_reconciles_total counter" in text
    assert 'kernelfleet_operator_reconciles_total{kind="OptimizationJob"} 3' in text
    assert 'kernelfleet_operator_jobs{kind="OptimizationJob",phase="Running"} 3' in text
    assert metrics.value("reconciles_total", kind="OptimizationJob") == 3
