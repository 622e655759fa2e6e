"""Load on `kernelfleet eval serve` (issue 43): many clients and a slow-client attack at once,
while real CPU evaluations run. Loopback only (127.0.0.1), bounded in sockets and in time.

In one process: an Evaluator on the CPU, the service (`EvaluationService` + `ServiceServer`,
the same code `eval serve` runs), and three kinds of clients, all started together:

- `--clients` (200) threads, each an `EvaluationClient` that submits one evaluation and polls
  for its result: every `--real-every`-th (10th) one is a real evaluation (an honest matmul
  candidate, each differing by a comment so none is served from a cache), the others a
  candidate with a syntax error (answered without a process), so that the HTTP front, not the
  2 CPUs, is what the crowd tests;
- `--slow-sockets` (50) slowloris connections: each sends a request head a header line at a
  time, one every `--trickle-s` seconds, never ending it; a socket the server closes is
  replaced, never more than `--slow-sockets` open at once, for `--attack-s` seconds;
- a probe asking GET /healthz every 0.25 s with a 5 s timeout, for the whole run.

It reports: the probe's answers, failures and latency (p50, p99, max); evaluations accepted,
finished and their verdicts (every accepted one must finish); 429s waited out; slow sockets
opened and closed by the server (with a 408, after its head deadline); the wall time.

    python benchmarks/service_load.py --out benchmarks/results

Writes `service_load-<date>-cpu.json` and `.md` into --out (with the machine and the commit).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for part in ("core", "evaluator", ""):
    if str(ROOT / part) not in sys.path:
        sys.path.insert(0, str(ROOT / part))

from kernelfleet.evaluator import (  # noqa: E402
    EvalConfig,
    EvaluationClient,
    EvaluationService,
    Evaluator,
    ServiceError,
    ServiceLimits,
    ServiceServer,
)
from tests.support import evaluator_cases as C  # noqa: E402

HOST = "127.0.0.1"


class Probe(threading.Thread):
    """GET /healthz every 0.25 s until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = EvaluationClient(url, timeout=5.0)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            try:
                self.client.health()
                self.latencies.append(time.monotonic() - started)
            except ServiceError as error:
                self.failures.append(str(error)[:200])
            self.halt.wait(0.25)


class Slowloris(threading.Thread):
    """Keeps up to `sockets` connections sending a never-ending request head."""

    def __init__(self, port: int, sockets: int, trickle_s: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.port, self.sockets, self.trickle_s, self.seconds = port, sockets, trickle_s, seconds
        self.opened = 0
        self.closed_by_server = 0
        self.answers: Counter[str] = Counter()
        self.most_open = 0

    def _open(self) -> socket.socket:
        sock = socket.create_connection((HOST, self.port), timeout=5)
        sock.sendall(b"POST /v1/evaluations HTTP/1.1\r\nHost: x\r\n")
        sock.setblocking(False)
        self.opened += 1
        return sock

    def run(self) -> None:
        end = time.monotonic() + self.seconds
        live: list[socket.socket] = []
        try:
            while time.monotonic() < end:
                while len(live) < self.sockets:
                    live.append(self._open())
                self.most_open = max(self.most_open, len(live))
                for sock in list(live):
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        data = None
                    except OSError:
                        data = b""
                    if data is not None:  # an answer or a close: the server let go of it
                        self.closed_by_server += 1
                        status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
                        self.answers[status] += 1
                        sock.close()
                        live.remove(sock)
                        continue
                    with contextlib.suppress(OSError):
                        sock.send(b"X-Slow: 1\r\n")
                time.sleep(self.trickle_s)
        finally:
            for sock in live:
                sock.close()


def one_client(url: str, index: int, real_every: int) -> dict[str, Any]:
    client = EvaluationClient(url, timeout=30.0, patience=600.0)
    real = index % real_every == 0
    candidate = C.HONEST + f"\n# client {index}\n" if real else C.SYNTAX_ERROR + f"\n# client {index}\n"
    started = time.monotonic()
    try:
        evaluation_id = client.submit(C.MATMUL_TASK, candidate)
    except ServiceError as error:
        return {"real": real, "accepted": False, "error": str(error)[:200]}
    try:
        [result] = client.wait([evaluation_id], timeout=900, poll=0.5)
    except ServiceError as error:
        return {"real": real, "accepted": True, "finished": False, "error": str(error)[:200]}
    return {
        "real": real,
        "accepted": True,
        "finished": True,
        "verdict": result["verdict"],
        "seconds": time.monotonic() - started,
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--real-every", type=int, default=10, help="every N-th client evaluates for real")
    parser.add_argument("--slow-sockets", type=int, default=50)
    parser.add_argument("--trickle-s", type=float, default=1.0, help="seconds between a slow socket's lines")
    parser.add_argument("--attack-s", type=float, default=60.0, help="how long the slow sockets run")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    if not (1 <= args.slow_sockets <= 200 and 0 < args.attack_s <= 600 and 1 <= args.clients <= 1000):
        parser.error("bounded: 1-200 slow sockets, at most 600 s of attack, 1-1000 clients")

    config = EvalConfig(
        device="cpu", correctness={"trials": 2}, timing={"trials": 5, "warmup": 1}, lane_slots=2
    )
    limits = ServiceLimits()
    began = time.monotonic()
    with Evaluator(config) as evaluator:
        service = EvaluationService(evaluator, max_queue=args.max_queue)
        server = ServiceServer(service, HOST, 0, limits=limits).start()
        probe = Probe(server.url)
        attack = Slowloris(server.port, args.slow_sockets, args.trickle_s, args.attack_s)
        probe.start()
        attack.start()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            outcomes = list(
                pool.map(lambda i: one_client(server.url, i, args.real_every), range(args.clients))
            )
        clients_s = time.monotonic() - began
        attack.join()
        probe.halt.set()
        probe.join()
        refused = service.refused
        server.stop()
    wall = time.monotonic() - began

    accepted = [o for o in outcomes if o["accepted"]]
    real = [o for o in accepted if o["real"]]
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "commit": commit(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "settings": {**vars(args), "out": str(args.out) if args.out else None, "limits": vars(limits)},
        "wall_s": round(wall, 1),
        "clients_done_s": round(clients_s, 1),
        "clients": {
            "total": len(outcomes),
            "accepted": len(accepted),
            "finished": sum(1 for o in accepted if o.get("finished")),
            "not_accepted": [o["error"] for o in outcomes if not o["accepted"]][:5],
            "unfinished": [o.get("error") for o in accepted if not o.get("finished")][:5],
            "verdicts": dict(Counter(o.get("verdict", "-") for o in accepted)),
            "real_evaluations": len(real),
            "real_finished": sum(1 for o in real if o.get("finished")),
            "real_seconds_p50": percentile([o["seconds"] for o in real if o.get("finished")], 0.5),
            "refused_429": refused,
        },
        "healthz": {
            "answered": len(probe.latencies),
            "failed": len(probe.failures),
            "failures": probe.failures[:5],
            "p50_ms": round(1000 * (percentile(probe.latencies, 0.5) or 0), 1),
            "p99_ms": round(1000 * (percentile(probe.latencies, 0.99) or 0), 1),
            "max_ms": round(1000 * max(probe.latencies, default=0), 1),
            "mean_ms": round(1000 * statistics.fmean(probe.latencies), 1) if probe.latencies else None,
        },
        "slowloris": {
            "sockets_opened": attack.opened,
            "most_open_at_once": attack.most_open,
            "let_go_by_server": attack.closed_by_server,
            "answers": dict(attack.answers),
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"service_load-{report['date']}-{args.tag}"
        stem.with_suffix(".json").write_text(text + "\n")
        stem.with_suffix(".md").write_text(markdown(report))
    ok = (
        report["clients"]["finished"] == report["clients"]["accepted"]
        and report["healthz"]["failed"] == 0
        and report["clients"]["real_finished"] == report["clients"]["real_evaluations"]
    )
    return 0 if ok else 1


def markdown(report: dict[str, Any]) -> str:
    c, h, s = report["clients"], report["healthz"], report["slowloris"]
    settings, machine, limits = report["settings"], report["machine"], report["settings"]["limits"]
    median = c["real_seconds_p50"]
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(s["answers"].items()))
    rows = [
        ("wall time", f"{report['wall_s']} s (clients done after {report['clients_done_s']} s)"),
        ("clients accepted / finished", f"{c['accepted']} / {c['finished']} of {c['total']}"),
        (
            "real CPU evaluations accepted / finished",
            f"{c['real_evaluations']} / {c['real_finished']} (median "
            f"{'-' if median is None else round(median, 1)} s from submit to result)",
        ),
        ("verdicts", ", ".join(f"{k} {v}" for k, v in sorted(c["verdicts"].items()))),
        ("submissions answered 429 (waited out)", str(c["refused_429"])),
        ("/healthz answered / failed", f"{h['answered']} / {h['failed']}"),
        ("/healthz latency p50 / p99 / max", f"{h['p50_ms']} / {h['p99_ms']} / {h['max_ms']} ms"),
        (f"slow sockets opened (at most {s['most_open_at_once']} at once)", str(s["sockets_opened"])),
        ("slow sockets let go by the server", f"{s['let_go_by_server']} ({answers})"),
    ]
    table = "\n".join(f"| {what} | {value} |" for what, value in rows)
    return (
        f"# `eval serve` under load: {settings['clients']} clients and {settings['slow_sockets']} "
        "slow sockets\n\n"
        f"{report['date']}, commit {report['commit']}, {machine['cpus']} CPUs ({machine['platform']}, "
        f"Python {machine['python']}); loopback only; `python benchmarks/service_load.py`.\n\n"
        f"| what | result |\n| --- | --- |\n{table}\n\n"
        f"Limits in force (`ServiceLimits`): head {limits['head_timeout_s']} s, body "
        f"{limits['body_timeout_s']} s, {limits['max_body_bytes']} bytes, {limits['max_connections']} "
        f"connections. A slow socket sends one header line every {settings['trickle_s']} s and never "
        "ends its head; the server answers it 408 at the head deadline and closes it, and the attacker "
        f"opens another, for {settings['attack_s']} s.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
