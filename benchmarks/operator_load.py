"""Load benchmark of the operator against a real kube-apiserver (etcd) and MinIO on loopback.

Two scenarios, each with a fresh `kernelfleet operator` process:

1. one OptimizationJob of 10,000 tasks over four GPU classes: the time from apply to every Job
   created (target: under 10 s), the API requests that took, the status patches per minute
   while outcome records keep arriving in the store, and the operator's memory;
2. 100 OptimizationJobs applied at once: the operator's memory (target: under 300 MB RSS) and
   the reconcile latency, from each create to its `Accepted` condition and to its Jobs.

No controller-manager runs, so no pods are made: the benchmark measures the operator, not the
cluster. API requests are the API server's own count (`apiserver_request_total`) minus the
benchmark's own requests, which it counts.

Usage (servers from $KERNELFLEET_BIN_DIR, the build script's cache by default):

    .venv/bin/python benchmarks/operator_load.py                  # both scenarios, writes results
    .venv/bin/python benchmarks/operator_load.py --tasks 2000 --jobs 20   # quicker

Results: operator_load-<date>.json in --out (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelfleet.core.config import StoreConfig  # noqa: E402
from kernelfleet.core.store import open_store  # noqa: E402
from tests._servers._process import free_port, remove_tree  # noqa: E402
from tests._servers.kube import ControlPlane  # noqa: E402
from tests._servers.minio import MinioServer, fresh_bucket  # noqa: E402

GROUP, VERSION = "kernelfleet.io", "v1alpha1"
CLASSES = ["a100", "h100", "l40", "rtx3090"]
TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * {factor}


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""


class Api:
    """The benchmark's own API calls, counted so they can be subtracted from the server's count."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.client = config.new_client_from_config(config_file=str(kubeconfig))
        self.server = self.client.configuration.host
        self.core = client.CoreV1Api(self.client)
        self.batch = client.BatchV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.ext = client.ApiextensionsV1Api(self.client)
        self.calls = 0
        self.lock = threading.Lock()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.calls += 1
        return fn(*args, **kwargs)

    def server_requests(self) -> int:
        """Sum of apiserver_request_total (this scrape counts as one of ours)."""
        response = self.call(self.client.rest_client.pool_manager.request, "GET", f"{self.server}/metrics")
        text = response.data.decode()
        return int(
            sum(
                float(m.group(1))
                for m in re.finditer(r"^apiserver_request_total\{[^}]*\} (\S+)$", text, re.M)
            )
        )


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MB, from /proc."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return round(values.get("VmRSS", 0.0), 1), round(values.get("VmHWM", 0.0), 1)


def start_operator(
    kubeconfig: Path, namespace: str, minio: Any, workdir: Path, interval: float
) -> tuple[subprocess.Popen[bytes], int]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), **minio.config()}
    log = open(workdir / f"operator-{namespace}.log", "wb")  # noqa: SIM115 - the child keeps it
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kernelfleet.core.cli", "operator",
            "--namespace", namespace, "--standalone",
            "--liveness", "none", "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
            "--store", f"s3://{minio.bucket}/kf", f"--status-interval={interval}",
        ],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return process, port


def operator_metric(port: int, name: str, **labels: str) -> float:
    """A series of the operator's /metrics endpoint, summed over the labels not given."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^kernelfleet_operator_{name}(?:{{(?P<labels>[^}}]*)}})? (?P<value>\S+)$", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match.group("value"))
    return total


def namespace(api: Api, name: str) -> None:
    api.call(api.core.create_namespace, {"metadata": {"name": name}})


def apply_crds(api: Api) -> None:
    import yaml

    for name in ("optimizationjobs.yaml", "trainingruns.yaml"):
        api.call(
            api.ext.create_custom_resource_definition, yaml.safe_load((ROOT / "crds" / name).read_text())
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        crd = api.call(api.ext.read_custom_resource_definition, "optimizationjobs.kernelfleet.io")
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            return
        time.sleep(0.2)
    raise RuntimeError("the CRD was never established")


def job(name: str, tasks: list[str], classes: list[str], parallelism: int = 8) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OptimizationJob",
        "metadata": {"name": name},
        "spec": {"tasks": tasks, "gpuClasses": classes, "parallelism": parallelism},
    }


def wait(what: str, check: Any, timeout: float, interval: float = 0.2) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout} s")


def big_job(api: Api, plane: Any, minio: Any, workdir: Path, tasks: int) -> dict[str, Any]:
    ns = "load-big"
    namespace(api, ns)
    store = open_store(f"s3://{minio.bucket}", StoreConfig.from_env(minio.config()))
    rows = [
        json.dumps({"level": 1, "task_id": i, "name": f"scale{i}", "code": TASK.format(factor=i)})
        for i in range(1, tasks + 1)
    ]
    store.put_bytes("load/tasks.jsonl", ("\n".join(rows) + "\n").encode())
    operator, port = start_operator(plane.kubeconfig, ns, minio, workdir, interval=5.0)
    try:
        time.sleep(8)  # the operator's start (imports, login, first list): not part of the figure
        idle_rss, _ = rss_mb(operator.pid)
        before = api.server_requests()
        own_before = api.calls
        api.call(api.custom.create_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs",
                 job("big", [f"s3://{minio.bucket}/load/tasks.jsonl"], CLASSES))  # fmt: skip
        expected = len(CLASSES) * -(-tasks // 2000)

        def all_jobs() -> bool:
            raw = api.call(api.batch.list_namespaced_job, ns, _preload_content=False)
            return len(json.loads(raw.data)["items"]) >= expected

        created_s = wait("all Jobs", all_jobs, timeout=300)
        after = api.server_requests()
        requests_to_jobs = after - before - (api.calls - own_before)
        # Outcome records keep arriving for a minute; count the status patches that follow.
        resource = api.call(
            api.custom.get_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs", "big"
        )
        prefix = f"kf/optimizationjobs/{ns}/big/{resource['metadata']['uid']}"
        stop = threading.Event()

        def produce() -> None:
            number = 0
            while not stop.is_set() and number < tasks:
                outcome = {
                    "task_hash": f"{number:064x}", "task_name": f"t{number}", "gpu_class": "h100",
                    "role": "search", "ok": True, "best_speedup": 1.0 + number % 7 / 10, "variants": 3,
                }  # fmt: skip
                store.put_json(f"{prefix}/outcomes/search/h100/{number:016x}.json", outcome)
                number += 1
                time.sleep(0.02)

        producer = threading.Thread(target=produce, daemon=True)
        patches_before = operator_metric(port, "status_patches_total")
        minute_start = time.monotonic()
        producer.start()
        rss_samples = []
        while time.monotonic() - minute_start < 60:
            rss_samples.append(rss_mb(operator.pid)[0])
            time.sleep(2)
        stop.set()
        producer.join()
        patches = operator_metric(port, "status_patches_total") - patches_before
        rss, peak = rss_mb(operator.pid)
        total_requests = api.server_requests() - before - (api.calls - own_before)
        return {
            "tasks": tasks,
            "classes": len(CLASSES),
            "jobs_created": expected,
            "apply_to_all_jobs_s": round(created_s, 2),
            "api_requests_apply_to_all_jobs": requests_to_jobs,
            "api_requests_including_the_minute_after": total_requests,
            "status_patches_per_minute": int(patches),
            "operator_api_requests_by_verb": {
                verb: int(operator_metric(port, "api_requests_total", verb=verb))
                for verb in ("GET", "POST", "PATCH", "DELETE")
            },
            "operator_rss_idle_mb": idle_rss,
            "operator_rss_mb": rss,
            "operator_rss_peak_mb": peak,
            "operator_rss_max_during_minute_mb": max(rss_samples),
        }
    finally:
        operator.terminate()
        operator.wait(timeout=60)


def many_jobs(api: Api, plane: Any, minio: Any, workdir: Path, count: int) -> dict[str, Any]:
    ns = "load-many"
    namespace(api, ns)
    operator, _ = start_operator(plane.kubeconfig, ns, minio, workdir, interval=5.0)
    try:
        time.sleep(8)
        idle_rss, _ = rss_mb(operator.pid)
        cpu_before = cpu_seconds(operator.pid)
        started = time.monotonic()
        created: dict[str, float] = {}
        for number in range(count):
            name = f"job-{number:03d}"
            created[name] = time.monotonic()
            api.call(api.custom.create_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs",
                     job(name, [f"kernelbench-v0:1:{1 + number % 90}-{10 + number % 90}"],
                         ["h100"]))  # fmt: skip
        accepted: dict[str, float] = {}
        with_jobs: dict[str, float] = {}
        deadline = time.monotonic() + 600
        rss_samples = []
        while (len(accepted) < count or len(with_jobs) < count) and time.monotonic() < deadline:
            items = api.call(
                api.custom.list_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs"
            )["items"]
            now = time.monotonic()
            for item in items:
                name = item["metadata"]["name"]
                conditions = {c["type"]: c["status"] for c in item.get("status", {}).get("conditions") or []}
                if conditions.get("Accepted") == "True":
                    accepted.setdefault(name, now - created[name])
            # Raw JSON: the client's models would cost the benchmark more CPU than the operator uses.
            raw = api.call(api.batch.list_namespaced_job, ns, _preload_content=False)
            for j in json.loads(raw.data)["items"]:
                owner = j["metadata"]["labels"].get("kernelfleet.io/optimizationjob")
                if owner in created:
                    with_jobs.setdefault(owner, now - created[owner])
            rss_samples.append(rss_mb(operator.pid)[0])
            time.sleep(0.5)
        creating_s = max(created.values()) - started
        all_done_s = time.monotonic() - started
        cpu_reconciling = cpu_seconds(operator.pid) - cpu_before
        time.sleep(30)  # steady state: every resource's timer running
        cpu_steady = cpu_seconds(operator.pid) - cpu_before - cpu_reconciling
        rss, peak = rss_mb(operator.pid)
        latencies = sorted(accepted.values())
        job_latencies = sorted(with_jobs.values())
        return {
            "resources": count,
            "accepted": len(accepted),
            "with_jobs": len(with_jobs),
            "seconds_to_create_them": round(creating_s, 2),
            "seconds_until_all_accepted_with_jobs": round(all_done_s, 2),
            "operator_cpu_s_until_then": round(cpu_reconciling, 2),
            "operator_cpu_s_per_30s_steady": round(cpu_steady, 2),
            "accepted_latency_s": _stats(latencies),
            "jobs_latency_s": _stats(job_latencies),
            "operator_rss_idle_mb": idle_rss,
            "operator_rss_steady_mb": rss,
            "operator_rss_peak_mb": peak,
            "operator_rss_max_while_reconciling_mb": max(rss_samples) if rss_samples else None,
        }
    finally:
        operator.terminate()
        operator.wait(timeout=60)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p95": None, "max": None}
    return {
        "median": round(statistics.median(values), 2),
        "p95": round(values[min(len(values) - 1, int(0.95 * len(values)))], 2),
        "max": round(values[-1], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    parser.add_argument("--keep", action="store_true", help="keep the servers' and operators' logs")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kernelfleet-operator-load-"))
    plane = ControlPlane.start(workdir / "kube")
    server = MinioServer(workdir / "minio")
    server.start()
    try:
        minio = fresh_bucket(server)
        api = Api(plane.kubeconfig)
        apply_crds(api)
        big = big_job(api, plane, minio, workdir, args.tasks)
        many = many_jobs(api, plane, minio, workdir, args.jobs)
    finally:
        server.stop()
        plane.stop()
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        "one_big_job": big,
        "many_jobs": many,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"operator_load-{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.keep:
        print(f"logs kept in {workdir}", file=sys.stderr)
    else:
        remove_tree(workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
