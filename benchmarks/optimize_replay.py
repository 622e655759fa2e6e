"""The user's path on a GPU: `kernelfleet optimize` replaying published kernels, watched for stalls.

It runs the command a user runs (the CLI, in a process of its own):

    kernelfleet optimize TASKS --policy replay:KERNELS --rounds 1 --samples 1 \\
        --profile kernelbench-v0 --no-baselines --store STORE --json

and meanwhile samples the GPU's utilisation (nvidia-smi, every 2 s) and counts the results in the
store. A *stall* is a stretch of `--stall-s` seconds in which no result is written while
evaluations are still to come: the run is then stopped and reported as failed, with the
evaluator's own watchdog lines (which evaluation waits on what) from the command's log.

`--kill-after S` first runs the same command and kills it with SIGKILL after S seconds (mid-run,
builds in flight), then checks that nothing of it is left (processes below it, GPU memory held by
them, build leases) and runs the command again: the resumed run must finish, at full speed, what
the killed one left. `--kernelbench` then evaluates the same candidates with KernelBench's own
harness (benchmarks/kernelbench_harness.py; its source in .kb/src) for evaluations per GPU-hour
side by side. Writes `optimize_replay-<date>[-TAG].json` and `.md` into --out.

    python3 benchmarks/optimize_replay.py --kernels .data/cuda-l1-h100-kernels.jsonl \\
        --kill-after 60 --kernelbench --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is the first entry, not its parent
    sys.path.insert(0, str(ROOT))

from benchmarks._common import UtilizationSampler, machine  # noqa: E402

# The 64 KernelBench v0 tasks of the earlier H200 replay (26 of level 1, 27 of level 2, 11 of level 3).
TASKS_64 = [
    "kernelbench-v0:1:1,6,9,12,14,20,21,23,28,30,32,44,46,47,61,65,69,70,77,79,81,83,90,95,97,98",
    "kernelbench-v0:2:1,3,4,9,10,17,21,22,27,31,33,34,41,43,45,47,50,51,54,57,60,61,62,64,80,83,96",
    "kernelbench-v0:3:1,4,20,22,31,35,36,39,40,43,44",
]


def gpu_summary(sampler: UtilizationSampler) -> dict[str, Any]:
    """The sampled utilisation of GPU 0 while a side ran."""
    utils = sampler.samples
    if not utils:
        return {"samples": 0}
    return {
        "samples": len(utils),
        "mean_util_pct": sampler.mean,
        "median_util_pct": statistics.median(utils),
        "zero_util_samples": sum(1 for u in utils if u == 0),
    }


def environment() -> dict[str, Any]:
    """The machine (benchmarks._common.machine), the evaluator's version, and the sandbox used."""
    from kernelfleet.evaluator import EVALUATOR_VERSION

    info = machine()
    info["gpu"] = info["gpus"][0]["name"] if info["gpus"] else None
    info["evaluator"] = EVALUATOR_VERSION
    info["bwrap"] = shutil.which("bwrap") or ""
    return info


def _descendants(pid: int) -> list[int]:
    from kernelfleet.evaluator._sandbox import descendants

    return descendants(pid)


def alive(pids: list[int]) -> list[int]:
    from kernelfleet.evaluator._sandbox import alive as running

    return running(pids)


def _gpu_pids() -> list[int]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def count_results(store: Path, run: str) -> int:
    root = store / "runs" / run / "results"
    return sum(1 for path in root.rglob("*.json")) if root.exists() else 0


def optimize_command(args: argparse.Namespace, run: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kernelfleet.core.cli",
        "optimize",
        *args.tasks,
        "--policy",
        f"replay:{args.kernels}",
        "--rounds",
        "1",
        "--samples",
        "1",
        "--profile",
        args.profile,
        "--no-baselines",
        "--store",
        str(args.store),
        "--run",
        run,
        "--json",
    ]


def run_optimize(
    args: argparse.Namespace, run: str, log: Path, *, kill_after: float | None = None, expected: int
) -> dict[str, Any]:
    """One call of the command; returns what it did (and, when killed, what it left behind)."""
    started = time.monotonic()
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as out:
        process = subprocess.Popen(optimize_command(args, run), stdout=out, stderr=err, env=os.environ.copy())
        seen: set[int] = set()
        last_count, last_change = count_results(args.store, run), time.monotonic()
        stalled = False
        while process.poll() is None:
            time.sleep(1.0)
            seen.update(_descendants(process.pid))
            count = count_results(args.store, run)
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            if kill_after is not None and time.monotonic() - started >= kill_after:
                break
            if time.monotonic() - last_change > args.stall_s and count < expected:
                stalled = True
                break
        report: dict[str, Any] = {"seconds": round(time.monotonic() - started, 1)}
        if process.poll() is None:
            seen.update(_descendants(process.pid))
            process.send_signal(signal.SIGKILL)
            process.wait(30)
            report["killed"] = True
            deadline = time.monotonic() + 30
            while alive(sorted(seen)) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = alive(sorted(seen))
            report["left_processes"] = left
            report["left_gpu_processes"] = sorted(set(_gpu_pids()) & seen)
            from kernelfleet.evaluator._builddir import flock_holders

            held = [str(p) for p in Path(args.cache_dir).rglob("*.lease") if set(flock_holders(p)) & seen]
            report["left_leases"] = held
        report["returncode"] = process.returncode
    report["stalled"] = stalled
    report["results_in_store"] = count_results(args.store, run)
    report["watchdog_lines"] = [
        line.strip() for line in log.read_text(errors="replace").splitlines() if ": " in line
    ][-20:]
    return report


def read_run(store: Path, run: str) -> dict[str, Any]:
    from kernelfleet.core.store import open_store

    results = list(open_store(str(store)).list_results(f"runs/{run}/"))
    verdicts = Counter(str(r.verdict) for r in results)
    best: dict[str, float] = {}
    for result in results:
        if str(result.verdict) == "correct" and result.speedup is not None:
            best[result.task_hash] = max(best.get(result.task_hash, 0.0), result.speedup)
    seconds = [r.seconds for r in results if getattr(r, "seconds", None) is not None]
    return {
        "evaluations": len(results),
        "verdicts": dict(sorted(verdicts.items())),
        "best": best,
        "slowest_evaluation_s": round(max(seconds), 1) if seconds else None,
    }


def geomean_best(best: dict[str, float], tasks: int) -> float:
    values = list(best.values()) + [1.0] * (tasks - len(best))
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def kernelbench_side(args: argparse.Namespace, names: list[str], rows: dict[str, str]) -> dict[str, Any]:
    """The same candidates through KernelBench's own harness (compile all, then one by one)."""
    from kernelfleet.core.tasks import load_tasks

    work = Path(args.work) / "kb"
    work.mkdir(parents=True, exist_ok=True)
    manifest = work / "manifest.jsonl"
    tasks = {task.name: task for selection in args.tasks for task in load_tasks(selection)}
    with open(manifest, "w") as handle:
        for name in names:
            handle.write(json.dumps({"id": name, "ref": tasks[name].code, "code": rows[name]}) + "\n")
    results = work / "results.jsonl"
    results.unlink(missing_ok=True)
    started = time.monotonic()
    with UtilizationSampler() as sampler:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "kernelbench_harness.py"),
                "batch",
                "--manifest",
                str(manifest),
                "--work-dir",
                str(work / "builds"),
                "--results",
                str(results),
                "--max-seconds",
                str(args.kernelbench_seconds),
            ],
            check=False,
        )
    seconds = time.monotonic() - started
    rows_out = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    outcome = Counter(
        "correct" if r.get("correctness") else "compile_error" if not r.get("compiled") else "incorrect"
        for r in rows_out
    )
    return {
        "evaluations": len(rows_out),
        "seconds": round(seconds, 1),
        "per_gpu_hour": round(len(rows_out) / (seconds / 3600), 1) if rows_out else 0.0,
        "outcomes": dict(sorted(outcome.items())),
        "gpu": gpu_summary(sampler),
    }


def task_names(selections: list[str]) -> list[str]:
    names = []
    for selection in selections:
        _, level, ids = selection.split(":")
        for part in ids.split(","):
            low, _, high = part.partition("-")
            names += [f"{level}:{i}" for i in range(int(low), int(high or low) + 1)]
    return names


def markdown(report: dict[str, Any]) -> str:
    env, main = report["environment"], report["optimize"]
    lines = [
        f"# optimize replay, {report['date']}",
        "",
        f"{env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, evaluator "
        f"{env.get('evaluator')}, commit {env.get('commit')}, bwrap: {env.get('bwrap') or 'none'}",
        "",
        f"Command: `{' '.join(report['command'])}`",
        "",
        "| run | tasks | evaluations | seconds | per GPU-hour | GPU util mean / median | zero-util samples "
        "| stalled |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    gpu = main["gpu"]
    lines.append(
        f"| kernelfleet optimize | {report['tasks']} | {main['evaluations']} | {main['seconds']} | "
        f"{main['per_gpu_hour']} | {gpu.get('mean_util_pct')} / {gpu.get('median_util_pct')} | "
        f"{gpu.get('zero_util_samples')} of {gpu.get('samples')} | {main['stalled']} |"
    )
    if "kernelbench" in report:
        kb = report["kernelbench"]
        kgpu = kb["gpu"]
        lines.append(
            f"| KernelBench harness | {report['tasks']} | {kb['evaluations']} | {kb['seconds']} | "
            f"{kb['per_gpu_hour']} | {kgpu.get('mean_util_pct')} / {kgpu.get('median_util_pct')} | "
            f"{kgpu.get('zero_util_samples')} of {kgpu.get('samples')} | - |"
        )
    lines += [
        "",
        f"Verdicts: {main['verdicts']}; best-of geomean over {report['tasks']} tasks "
        f"(non-correct as 1.0): {main['geomean_best']:.3f}x",
    ]
    if "kernelbench" in report:
        lines.append(f"KernelBench harness outcomes: {report['kernelbench']['outcomes']}")
    if "killed" in report:
        killed = report["killed"]
        lines += [
            "",
            f"Killed with SIGKILL after {killed['seconds']} s ({killed['results_in_store']} results stored): "
            f"processes left {killed.get('left_processes')}, "
            f"GPU processes left {killed.get('left_gpu_processes')}, "
            f"leases left {killed.get('left_leases')}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS_64, help="task selections (default: the 64)")
    parser.add_argument("--kernels", required=True, help="published kernels (JSONL of task, name, code)")
    parser.add_argument("--profile", default="kernelbench-v0")
    parser.add_argument("--work", default="/tmp/optimize-replay", help="store, build cache and logs")
    parser.add_argument("--stall-s", type=float, default=240.0, help="no result for this long is a stall (s)")
    parser.add_argument("--kill-after", type=float, default=None, help="kill a first run after this long (s)")
    parser.add_argument("--kernelbench", action="store_true", help="also run KernelBench's harness")
    parser.add_argument("--kernelbench-seconds", type=float, default=420.0, help="its bound (s)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.store = work / "store"
    args.cache_dir = os.environ.setdefault("KERNELFLEET_CACHE_DIR", str(work / "cache"))
    names = task_names(args.tasks)
    rows: dict[str, str] = {}
    for line in Path(args.kernels).read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["task"], row["code"])
    missing = [name for name in names if name not in rows]
    if missing:
        raise SystemExit(f"no published kernel for {', '.join(missing)} in {args.kernels}")
    # the replay file the policy reads: the tasks' rows under the names the selection gives them
    replay = work / "replay.jsonl"
    replay.write_text(
        "".join(json.dumps({"task": n, "name": "published", "code": rows[n]}) + "\n" for n in names)
    )
    args.kernels = replay
    run = "replay"
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "environment": environment(),
        "tasks": len(names),
        "command": ["kernelfleet", *optimize_command(args, run)[3:]],
        "settings": {"stall_s": args.stall_s, "kill_after": args.kill_after, "profile": args.profile},
    }
    if args.kill_after is not None:
        report["killed"] = run_optimize(
            args, run, work / "killed.log", kill_after=args.kill_after, expected=len(names)
        )
        print(json.dumps({"killed": report["killed"]}, indent=1), flush=True)
    before = count_results(args.store, run)
    with UtilizationSampler() as sampler:
        main_run = run_optimize(args, run, work / "optimize.log", expected=len(names))
    done = read_run(args.store, run)
    evaluated = done["evaluations"] - before
    main_run.update(
        evaluations=evaluated,
        per_gpu_hour=round(evaluated / (main_run["seconds"] / 3600), 1) if evaluated else 0.0,
        verdicts=done["verdicts"],
        geomean_best=geomean_best(done["best"], len(names)),
        slowest_evaluation_s=done["slowest_evaluation_s"],
        gpu=gpu_summary(sampler),
        utilisation=sampler.samples,
    )
    report["optimize"] = main_run
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after each side, so that a call cut short keeps what it measured
        (out / f"optimize_replay-{stamp}.json").write_text(json.dumps(report, indent=1, default=str))
        (out / f"optimize_replay-{stamp}.md").write_text(markdown(report))

    write()
    if args.kernelbench:
        report["kernelbench"] = kernelbench_side(args, names, rows)
        write()
    print(markdown(report))
    failed = main_run["stalled"] or main_run["returncode"] != 0 or done["evaluations"] < len(names)
    if "killed" in report:
        killed = report["killed"]
        failed = failed or bool(
            killed["left_processes"] or killed["left_gpu_processes"] or killed["left_leases"]
        )
    if failed:
        print(
            "FAILED: a stall, an unfinished run or leftovers of the killed run (see above)", file=sys.stderr
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
