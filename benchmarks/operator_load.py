"""Load benchmark of the operator against a real kube-apiserver (etcd) and MinIO on loopback.

Two scenarios, each with a fresh `kernelfleet operator` process, run for this checkout's operator
and, with --baseline ROOT, for another checkout's (old and new side by side, on the same
servers and machine, one after the other):

1. one OptimizationJob of 10,000 tasks over four GPU classes: the time from apply to the Jobs
   that have pods to run (one per class; target: under 10 s), then a minute in which the
   h100 Job's indexes end one by one (the benchmark writes each index's outcome record and the
   Job status the Job controller would write): store requests per reconcile pass, API
   requests, status patches, memory;
2. 100 OptimizationJobs of which 90 end (their Jobs marked Complete): in the minute after, the
   operator's CPU seconds, store requests per minute and API requests (target: finished jobs
   cost nothing), and its memory.

No controller-manager runs, so no pods are made: the benchmark measures the operator, not the
cluster. API requests are the API server's own count (`apiserver_request_total`) minus the
benchmark's own requests, which it counts; store requests are MinIO's count
(`minio_s3_requests_total`) minus the benchmark's own writes (a HEAD and a PUT each).

Usage (servers from $KERNELFLEET_BIN_DIR, the build script's cache by default):

    .venv/bin/python benchmarks/operator_load.py --baseline /path/to/old/checkout
    .venv/bin/python benchmarks/operator_load.py --tasks 2000 --jobs 20   # quicker

Results: operator_load-<date>.json in --out (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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


PACKAGES = ("core", "operator", "search", "evaluator", "trainer")


def start_operator(
    kubeconfig: Path, namespace: str, minio: Any, workdir: Path, interval: float, root: Path = ROOT
) -> tuple[subprocess.Popen[bytes], int]:
    """`kernelfleet operator` of the checkout at `root` (its packages first on the path)."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        **minio.config(),
        "PYTHONPATH": os.pathsep.join(str(root / package) for package in PACKAGES),
    }
    log = open(workdir / f"operator-{namespace}.log", "wb")  # noqa: SIM115 - the child keeps it
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kernelfleet.core.cli", "operator",
            "--namespace", namespace, "--standalone",
            "--liveness", "none", "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
            "--store", f"s3://{minio.bucket}/kf", f"--status-interval={interval}",
        ],
        env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return process, port


def store_requests(minio: Any) -> int:
    """MinIO's count of S3 requests so far, all APIs (its metrics are public on this server)."""
    import urllib.request

    url = f"http://{minio.endpoint}/minio/v2/metrics/cluster"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(float(m.group(1)) for m in re.finditer(r"^minio_s3_requests_total\{[^}]*\} (\S+)$", text, re.M))
    )


def complete_job(api: Api, namespace: str, name: str, indexes: int, done: int, started: str) -> None:
    """What the Job controller writes when indexes 0..done-1 succeeded (all of them: Complete)."""
    status: dict[str, Any] = {
        "startTime": started,
        "succeeded": done,
        "completedIndexes": f"0-{done - 1}" if done > 1 else "0",
    }
    if done == indexes:
        status["completionTime"] = started
        status["conditions"] = [
            {"type": t, "status": "True", "lastProbeTime": started, "lastTransitionTime": started}
            for t in ("SuccessCriteriaMet", "Complete")
        ]
    api.call(api.batch.patch_namespaced_job_status, name, namespace, {"status": status})


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


def apply_crds(api: Api, root: Path = ROOT) -> None:
    """The CRDs of the checkout at `root` (each operator gets its own version's schema),
    replacing those there."""
    import yaml
    from kubernetes.client.exceptions import ApiException

    for name in ("optimizationjobs.yaml", "trainingruns.yaml"):
        body = yaml.safe_load((root / "crds" / name).read_text())
        try:
            current = api.call(api.ext.read_custom_resource_definition, body["metadata"]["name"])
        except ApiException as error:
            if error.status != 404:
                raise
            api.call(api.ext.create_custom_resource_definition, body)
            continue
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        api.call(api.ext.replace_custom_resource_definition, body["metadata"]["name"], body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        crd = api.call(api.ext.read_custom_resource_definition, "optimizationjobs.kernelfleet.io")
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            time.sleep(2)  # the API server's handlers take the new schema
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


def jobs_with_pods(api: Api, ns: str) -> list[dict[str, Any]]:
    # Raw JSON: the client's models would cost the benchmark more CPU than the operator uses.
    raw = api.call(api.batch.list_namespaced_job, ns, _preload_content=False)
    return [j for j in json.loads(raw.data)["items"] if (j["spec"].get("parallelism") or 0) > 0]


def big_job(
    api: Api, plane: Any, minio: Any, workdir: Path, tasks: int, ns: str, root: Path, seconds: float
) -> dict[str, Any]:
    from kernelfleet.core.jobplan import JobPlan, Role, TaskChunk, chunk_key, outcome_key, plan_key

    namespace(api, ns)
    store = open_store(f"s3://{minio.bucket}", StoreConfig.from_env(minio.config()))
    operator, port = start_operator(plane.kubeconfig, ns, minio, workdir, interval=5.0, root=root)
    try:
        time.sleep(8)  # the operator's start (imports, login, first list): not part of the figure
        idle_rss, _ = rss_mb(operator.pid)
        before, own_before = api.server_requests(), api.calls
        api.call(api.custom.create_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs",
                 job("big", [f"s3://{minio.bucket}/load/tasks.jsonl"], CLASSES))  # fmt: skip
        created_s = wait(
            "a Job with pods per class", lambda: len(jobs_with_pods(api, ns)) >= len(CLASSES), timeout=300
        )
        requests_to_jobs = api.server_requests() - before - (api.calls - own_before)
        jobs_created = len(
            json.loads(api.call(api.batch.list_namespaced_job, ns, _preload_content=False).data)["items"]
        )
        resource = api.call(
            api.custom.get_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs", "big"
        )
        prefix = f"optimizationjobs/{ns}/big/{resource['metadata']['uid']}"
        wait("the plan", lambda: store.exists(f"kf/{plan_key(prefix)}"), timeout=120)
        plan = JobPlan.model_validate(store.get_json(f"kf/{plan_key(prefix)}"))
        shard = next(
            s for s in plan.shards if s.gpu_class == "h100" and s.role == Role.SEARCH and s.number == 0
        )
        chunk = TaskChunk.model_validate(store.get_json(f"kf/{chunk_key(plan.prefix, 0)}"))
        hashes = [task.task().hash for task in chunk.tasks]
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        # A minute in which the h100 Job's indexes end one by one, each with its outcome record.
        store_before, api_before, own_api = store_requests(minio), api.server_requests(), api.calls
        reconciles_before = operator_metric(port, "reconciles_total", kind="OptimizationJob")
        patches_before = operator_metric(port, "status_patches_total")
        own_store, done = 0, 0
        rss_samples = []
        minute_start = time.monotonic()
        while time.monotonic() - minute_start < seconds and done < min(len(hashes), shard.completions):
            task_hash = hashes[done]
            outcome = {
                "task_hash": task_hash, "task_name": f"scale{done + 1}", "gpu_class": "h100",
                "role": "search", "ok": True, "best_speedup": 1.0 + done % 7 / 10, "variants": 3,
            }  # fmt: skip
            store.put_json(f"kf/{outcome_key(plan.prefix, Role.SEARCH, 'h100', task_hash)}", outcome)
            own_store += 2  # a HEAD and a PUT
            done += 1
            complete_job(api, ns, shard.job_name, shard.completions, done, started)
            rss_samples.append(rss_mb(operator.pid)[0])
            time.sleep(1.0)
        time.sleep(6)  # one more pass sees the last index
        passes = operator_metric(port, "reconciles_total", kind="OptimizationJob") - reconciles_before
        store_used = store_requests(minio) - store_before - own_store
        api_used = api.server_requests() - api_before - (api.calls - own_api)
        status = api.call(
            api.custom.get_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs", "big"
        )
        rss, peak = rss_mb(operator.pid)
        return {
            "tasks": tasks,
            "classes": len(CLASSES),
            "jobs_created_at_start": jobs_created,
            "apply_to_jobs_with_pods_s": round(created_s, 2),
            "api_requests_apply_to_jobs_with_pods": requests_to_jobs,
            "indexes_ended_in_the_minute": done,
            "tasks_done_in_status": status.get("status", {}).get("tasksDone"),
            "reconcile_passes_in_the_minute": int(passes),
            "store_requests_in_the_minute": store_used,
            "store_requests_per_pass": round(store_used / passes, 2) if passes else None,
            "api_requests_in_the_minute": api_used,
            "status_patches_in_the_minute": int(
                operator_metric(port, "status_patches_total") - patches_before
            ),
            "operator_rss_idle_mb": idle_rss,
            "operator_rss_mb": rss,
            "operator_rss_peak_mb": peak,
            "operator_rss_max_during_minute_mb": max(rss_samples) if rss_samples else None,
        }
    finally:
        operator.terminate()
        operator.wait(timeout=60)


def many_jobs(
    api: Api, plane: Any, minio: Any, workdir: Path, count: int, ns: str, root: Path, seconds: float
) -> dict[str, Any]:
    namespace(api, ns)
    operator, port = start_operator(plane.kubeconfig, ns, minio, workdir, interval=5.0, root=root)
    try:
        time.sleep(8)
        idle_rss, _ = rss_mb(operator.pid)
        names = [f"job-{number:03d}" for number in range(count)]
        for number, name in enumerate(names):
            tasks = [f"kernelbench-v0:1:{1 + number % 90}-{10 + number % 90}"]
            api.call(
                api.custom.create_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs",
                job(name, tasks, ["h100"]),
            )  # fmt: skip

        def owners() -> dict[str, dict[str, Any]]:
            raw = api.call(api.batch.list_namespaced_job, ns, _preload_content=False)
            return {
                j["metadata"]["labels"].get("kernelfleet.io/optimizationjob"): j
                for j in json.loads(raw.data)["items"]
            }

        wait("every resource's Job", lambda: set(names) <= set(owners()), timeout=600, interval=1.0)
        finished = names[: count * 9 // 10]
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        jobs = owners()
        for name in finished:
            indexes = jobs[name]["spec"]["completions"]
            complete_job(api, ns, jobs[name]["metadata"]["name"], indexes, indexes, started)

        def all_ended() -> bool:
            items = api.call(
                api.custom.list_namespaced_custom_object, GROUP, VERSION, ns, "optimizationjobs"
            )["items"]
            ended = {
                i["metadata"]["name"]
                for i in items
                if i.get("status", {}).get("phase") in ("Succeeded", "Failed")
            }
            return set(finished) <= ended

        wait("the finished jobs to end", all_ended, timeout=600, interval=1.0)
        time.sleep(6)  # their last pass
        cpu_before = cpu_seconds(operator.pid)
        store_before, api_before, own_api = store_requests(minio), api.server_requests(), api.calls
        reconciles_before = operator_metric(port, "reconciles_total", kind="OptimizationJob")
        time.sleep(seconds)
        cpu = cpu_seconds(operator.pid) - cpu_before
        store_used = store_requests(minio) - store_before
        api_used = api.server_requests() - api_before - (api.calls - own_api)
        passes = operator_metric(port, "reconciles_total", kind="OptimizationJob") - reconciles_before
        rss, peak = rss_mb(operator.pid)
        per_minute = 60.0 / seconds
        return {
            "resources": count,
            "finished": len(finished),
            "measured_seconds": seconds,
            "operator_cpu_s_per_minute": round(cpu * per_minute, 2),
            "store_requests_per_minute": round(store_used * per_minute, 1),
            "api_requests_per_minute": round(api_used * per_minute, 1),
            "reconcile_passes_per_minute": round(passes * per_minute, 1),
            "operator_rss_idle_mb": idle_rss,
            "operator_rss_mb": rss,
            "operator_rss_peak_mb": peak,
        }
    finally:
        operator.terminate()
        operator.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each measured window")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout whose operator runs the same scenarios"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    parser.add_argument("--keep", action="store_true", help="keep the servers' and operators' logs")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kernelfleet-operator-load-"))
    plane = ControlPlane.start(workdir / "kube")
    server = MinioServer(workdir / "minio", public_metrics=True)
    server.start()
    operators = {**({"baseline": args.baseline.resolve()} if args.baseline else {}), "this": ROOT}
    results: dict[str, Any] = {}
    try:
        minio = fresh_bucket(server)
        api = Api(plane.kubeconfig)
        store = open_store(f"s3://{minio.bucket}", StoreConfig.from_env(minio.config()))
        rows = [
            json.dumps({"level": 1, "task_id": i, "name": f"scale{i}", "code": TASK.format(factor=i)})
            for i in range(1, args.tasks + 1)
        ]
        store.put_bytes("load/tasks.jsonl", ("\n".join(rows) + "\n").encode())
        for label, root in operators.items():
            apply_crds(api, root)
            results[label] = {
                "checkout": str(root),
                "commit": subprocess.run(
                    ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
                ).stdout.strip(),
                "one_big_job": big_job(
                    api, plane, minio, workdir, args.tasks, f"big-{label}", root, args.seconds
                ),
                "many_jobs_90_finished": many_jobs(
                    api, plane, minio, workdir, args.jobs, f"many-{label}", root, args.seconds
                ),
            }
    finally:
        server.stop()
        plane.stop()
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        **results,
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
