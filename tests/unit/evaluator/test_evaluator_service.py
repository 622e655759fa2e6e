"""`kernelfleet eval serve` on the CPU: concurrent clients, the bounded queue, the token,
health and Prometheus metrics, and the result JSON being exactly `eval --json`'s."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.models import Verdict
from kernelfleet.evaluator import (
    EvalConfig,
    EvaluationClient,
    EvaluationService,
    Evaluator,
    ServiceError,
    ServiceServer,
    result_from_json,
)
from tests.support import evaluator_cases as C

CONFIG = EvalConfig.model_validate(
    {
        "device": "cpu",
        "lane_slots": 2,
        "correctness": {"trials": 2},
        "timing": {
            "trials": 3,
            "warmup": 1,
            "flush_bytes": 0,
            "max_speedup_cv": None,
            "speedup_recheck": None,
            "retries": 0,
        },
    }
)
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceServer]:
    with Evaluator(CONFIG) as evaluator:
        running = ServiceServer(EvaluationService(evaluator, max_queue=6), token=TOKEN).start()
        try:
            yield running
        finally:
            running.stop()


def client(server: ServiceServer, **kwargs: Any) -> EvaluationClient:
    return EvaluationClient(server.url, token=TOKEN, **kwargs)


def test_concurrent_clients_get_their_own_results(server: ServiceServer) -> None:
    jobs = [C.HONEST, C.INPUT_MUTATION_HACK, C.WRONG_RESULT, C.HONEST + "\n# another\n"]

    def one(candidate: str) -> dict[str, Any]:
        return client(server).evaluate(C.MATMUL_TASK, candidate, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    verdicts = [result["verdict"] for result in results]
    assert verdicts == ["correct", "rejected", "incorrect", "correct"], [r["reasons"] for r in results]
    first = results[0]
    # The contract keys of `kernelfleet eval --json` first, then the whole result.
    assert list(first)[:6] == ["verdict", "reasons", "speedup", "reference_ms", "candidate_ms", "environment"]
    assert result_from_json(first).verdict == Verdict.CORRECT
    assert first["stages"]["timing"] > 0


def test_a_list_is_queued_at_once_and_polled_until_done(server: ServiceServer) -> None:
    api = client(server)
    ids = api.submit_many(
        [
            {"reference": C.MATMUL_TASK, "candidate": C.HONEST, "options": {"seed": 7}},
            {"reference": C.MATMUL_TASK, "candidate": C.SYNTAX_ERROR, "profile": "kernelbench-v0"},
        ]
    )
    assert len(set(ids)) == 2
    results = api.wait(ids, timeout=300)
    assert results[0]["verdict"] == "correct"
    assert results[1]["verdict"] == "compile_error"
    assert results[1]["profile"] == "kernelbench-v0"


def test_a_full_queue_answers_429_with_retry_after(server: ServiceServer) -> None:
    request = {"reference": C.MATMUL_TASK, "candidate": C.HONEST}
    impatient = client(server, patience=0.0)
    with pytest.raises(ServiceError) as refused:
        impatient.submit_many([request] * 7)  # more than the queue holds, all or none
    assert refused.value.status == 429
    raw = urllib.request.Request(
        server.url + "/v1/evaluations",
        data=json.dumps([request] * 7).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(raw, timeout=30)
    assert error.value.code == 429 and int(error.value.headers["Retry-After"]) >= 1


def test_the_token_is_required_and_bad_requests_say_why(server: ServiceServer) -> None:
    anonymous = EvaluationClient(server.url)
    with pytest.raises(ServiceError) as denied:
        anonymous.submit(C.MATMUL_TASK, C.HONEST)
    assert denied.value.status == 401
    api = client(server)
    with pytest.raises(ServiceError, match="does not define"):
        api.submit("import torch\n", C.HONEST)
    with pytest.raises(ServiceError, match="cannot be set per request"):
        api.submit(C.MATMUL_TASK, C.HONEST, options={"device": "cuda"})
    with pytest.raises(ServiceError, match="unknown profile"):
        api.submit(C.MATMUL_TASK, C.HONEST, profile="lenient")
    with pytest.raises(ServiceError) as missing:
        api.get("0" * 24)
    assert missing.value.status == 404


def test_health_and_prometheus_metrics(server: ServiceServer) -> None:
    api = EvaluationClient(server.url)  # both are open: probes and scrapers carry no token
    health = api.health()
    assert health["status"] == "ok" and health["gpu_class"] == "cpu"
    client(server).evaluate(C.MATMUL_TASK, C.HONEST + "\n# metrics\n", timeout=300)
    text = api.metrics()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert samples['kernelfleet_evaluations_total{verdict="correct"}'] >= 1
    assert "kernelfleet_eval_queue_depth" in samples
    assert 0 < samples['kernelfleet_eval_gpu_busy_ratio{lane="0"}'] <= 1
    assert samples['kernelfleet_eval_stage_seconds_total{stage="timing"}'] > 0
    assert "# TYPE kernelfleet_evaluations_total counter" in text


def test_eval_serve_command_starts_and_answers(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kernelfleet.core.cli",
            "eval",
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--token-file",
            str(token_file),
            "--max-queue",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        deadline = time.monotonic() + 120
        while "serving evaluations on" not in line and time.monotonic() < deadline:
            line = process.stderr.readline()
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        assert EvaluationClient(url).health()["max_queue"] == 2
        with pytest.raises(ServiceError) as denied:
            EvaluationClient(url, token="wrong").submit(C.MATMUL_TASK, C.HONEST)
        assert denied.value.status == 401
        # Malformed and abandoned requests: each answered 4xx or dropped, none logged as a traceback.
        port = int(url.rsplit(":", 1)[1])
        for head in ("Content-Length: abc\r\n", "Content-Length: -1\r\n", "Content-Length: 1000\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(f"POST /v1/evaluations HTTP/1.1\r\nHost: x\r\n{head}\r\n{{}}".encode())
                if "1000" not in head:
                    assert sock.recv(100).startswith(b"HTTP/1.1 400")
        assert EvaluationClient(url).health()["status"] == "ok"
    finally:
        process.terminate()
        _, log = process.communicate(timeout=60)
    assert "Traceback" not in log, log
    assert process.returncode == 0, log


def test_eval_serve_pools_references_unless_told_otherwise() -> None:
    """A service is one long session over many candidates of each task: it pools each task's
    reference over 4 processes and times up to 4 pairs where pairs disagree, unless a flag says
    otherwise (`--reference-processes 0` turns the pool off); a one-shot `eval` does neither, and a
    pool of one process is refused with the fix."""
    import argparse

    from kernelfleet.evaluator import cli as eval_cli

    parser = argparse.ArgumentParser(prog="kernelfleet")
    eval_cli.register(parser.add_subparsers())

    def served(*flags: str) -> EvalConfig:
        args = parser.parse_args(["eval", "serve", "--device", "cpu", *flags])
        return eval_cli._config(args, eval_cli.SERVE_OPTIONS, eval_cli.SERVE_DEFAULTS)

    default = served()
    assert (default.timing.reference_processes, default.timing.processes_max) == (4, 4)
    assert "refpool4" in default.result_version and "pairsmax4" in default.result_version
    off = served("--timing-reference-processes", "0", "--timing-processes-max", "2")
    assert off.timing.reference_processes == 0 and ".refpool" not in off.result_version
    assert ".pairsmax" not in off.result_version  # exactly timing_processes pairs, as unset
    one_shot = eval_cli._config(parser.parse_args(["eval", "--device", "cpu"]), eval_cli.EVAL_OPTIONS)
    assert (one_shot.timing.reference_processes, one_shot.timing.processes_max) == (None, None)
    with pytest.raises(SystemExit):
        served("--timing-reference-processes", "1")
