"""The table of attacks (issue 9): each attack candidate, its verdict and whether it got through,
at every isolation level this machine offers, and (with --before) on an older kernelfleet.

Every attack runs in a fresh process of its own (an attack that kills the kernelfleet process
kills only that one), started in a scratch directory that holds a store with one run in it,
with a canary store secret in its environment. Afterwards this script looks from outside for
what the candidate could not see: the store changed, files written outside the sandbox, a
daemon still running, the kernelfleet process killed. It cleans all of it up.

    python benchmarks/attacks.py                       # every level here, CPU
    python benchmarks/attacks.py --levels bubblewrap+landlock --device cuda
    python benchmarks/attacks.py --before /path/to/old/checkout   # the "before" column
    python benchmarks/attacks.py --overhead            # seconds bwrap adds per process

Writes a markdown table to stdout and, with --out DIR, `attacks-<date>.md` and `.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CANARY = "kf-canary-secret-0d6c"
# Attacks that would harm this shared machine when nothing stops them (memory for everyone):
# on an evaluator without limits they are not run, and the issue's own report stands in.
UNSAFE_UNLIMITED = {"allocate_20gb"}


def _one(args: argparse.Namespace) -> int:
    """Child mode: evaluate one attack, print one JSON line."""
    sys.path.insert(0, str(ROOT))
    from kernelfleet.core.models import Task
    from kernelfleet.evaluator import EvalConfig, Evaluator
    from tests.support import evaluator_cases as C
    from tests.support.attacks import BY_NAME

    attack = BY_NAME[args.one]
    values: dict[str, Any] = {
        "device": args.device,
        "correctness_trials": 2,
        "timing_trials": 20,
        "warmup": 2,
        "max_speedup_cv": None,
        "timing_retries": 1,
        "speedup_recheck": None,
        "timeout_seconds": 120.0,
    }
    fields = EvalConfig.model_fields
    if "timeout_seconds" not in fields and "limits" not in fields:  # an evaluator from before the sandbox
        values["run_timeout_s"] = values.pop("timeout_seconds")
    if "isolation" in fields:
        values.update(isolation=args.level, memory_limit="2Gi", scratch_bytes=256 * 1024**2)
    if "limits" in fields:  # settings grouped (after evaluator 0.8.9)
        values = {
            "device": args.device,
            "correctness": {"trials": 2},
            "timing": {
                "trials": 20,
                "warmup": 2,
                "max_speedup_cv": None,
                "retries": 1,
                "speedup_recheck": None,
            },
            "isolation": {"level": args.level},
            "limits": {"timeout_seconds": 120.0, "memory": "2Gi", "scratch_bytes": 256 * 1024**2},
        }
    with Evaluator(EvalConfig.model_validate(values)) as evaluator:
        result = evaluator.evaluate(Task(name="matmul", code=C.MATMUL_TASK), attack.source)
    print(
        json.dumps(
            {
                "verdict": str(result.verdict),
                "reasons": list(result.reasons),
                "speedup": result.speedup,
                "isolation": getattr(result, "isolation", "") or "none (before the sandbox)",
                "log": result.log[-3000:],
            }
        ),
        flush=True,
    )
    return 0


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _daemons() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == "kf-attack-daemon":
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _store(root: Path, python_path: str) -> None:
    """A store with one run in it, written by the kernelfleet under test."""
    code = (
        "from kernelfleet.core.store import open_store\n"
        "from kernelfleet.core.models import Environment, EvaluationResult, Verdict\n"
        "store = open_store('.kernelfleet')\n"
        "store.put_result('runs/victim', EvaluationResult(task_hash='a' * 64, variant_hash='b' * 64, "
        "verdict=Verdict.CORRECT, speedup=1.0, environment=Environment(device='cpu', gpu_class='cpu', "
        "evaluator_version='0')))\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": python_path}, check=True
    )


def run_attack(name: str, level: str, device: str, source_root: Path) -> dict[str, Any]:
    from tests.support.attacks import BY_NAME

    python_path = (
        os.pathsep.join(str(source_root / part) for part in ("core", "evaluator")) + os.pathsep + str(ROOT)
    )
    if os.environ.get("PYTHONPATH"):  # packages carried beside the image's (the GPU machine's pydantic)
        python_path += os.pathsep + os.environ["PYTHONPATH"]
    work = Path(tempfile.mkdtemp(prefix="kf-attack-run-"))
    try:
        _store(work, python_path)
        before = _snapshot(work / ".kernelfleet")
        outside = [Path("/tmp"), Path.home(), work]
        stale = {p for d in outside for p in glob.glob(str(d / "kf-attack-outside-*"))}
        env = {
            **os.environ,
            "PYTHONPATH": python_path,
            "KERNELFLEET_S3_SECRET_KEY": CANARY,
        }
        begin = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--one",
                name,
                "--level",
                level,
                "--device",
                device,
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        seconds = time.monotonic() - begin
        harm: list[str] = []
        answer: dict[str, Any] = {}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            answer = json.loads(lines[-1])
        else:
            why = (
                f"killed by {signal.Signals(-done.returncode).name}"
                if done.returncode < 0
                else f"status {done.returncode}"
            )
            harm.append(f"the kernelfleet process died ({why})")
        if answer:
            harm += BY_NAME[name].harm(answer["verdict"], answer["reasons"], answer["speedup"], answer["log"])
        if CANARY in done.stdout + done.stderr:
            harm.append("the canary secret reached the candidate")
        if _snapshot(work / ".kernelfleet") != before:
            harm.append("the store changed")
        written = {p for d in outside for p in glob.glob(str(d / "kf-attack-outside-*"))} - stale
        if written:
            harm.append(f"wrote {', '.join(sorted(written))}")
        for path in written:
            Path(path).unlink(missing_ok=True)
        time.sleep(1.0)
        daemons = _daemons()
        if daemons:
            harm.append(f"a daemon outlived the evaluator ({len(daemons)} process(es))")
        for pid in daemons:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return {
            "attack": name,
            "level": level,
            "verdict": answer.get("verdict", "-"),
            "reasons": answer.get("reasons", []),
            "speedup": answer.get("speedup"),
            "isolation": answer.get("isolation", ""),
            "harm": harm,
            "seconds": round(seconds, 1),
            "stderr": done.stderr[-1500:] if not lines else "",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cell(row: dict[str, Any]) -> str:
    verdict = row["verdict"]
    if row["speedup"] is not None and verdict == "correct":
        verdict += f" {row['speedup']:.2f}x"
    codes = sorted({r.split(":", 1)[0] for r in row["reasons"]} - {"setting-applied"})
    if codes and row["verdict"] != "correct":
        verdict += f" ({', '.join(codes[:2])})"
    if row["harm"]:
        return f"**got through**: {'; '.join(row['harm'])[:160]} [{verdict}]"
    return f"held: {verdict}"


def _nothing() -> None:
    pass


def overhead(samples: int) -> dict[str, float]:
    """Seconds bwrap adds to starting one process (the zygote pays it once per evaluator; a
    candidate is a fork inside it), and the time to fork one confined candidate."""
    sys.path[:0] = [str(ROOT / "core"), str(ROOT / "evaluator")]
    from kernelfleet.evaluator._sandbox import _bwrap_argv, detect

    report = detect()
    plain, wrapped = [], []
    for _ in range(samples):
        begin = time.perf_counter()
        subprocess.run([sys.executable, "-S", "-c", "pass"], check=True)
        plain.append(time.perf_counter() - begin)
        if report.bwrap:
            argv = _bwrap_argv(report.bwrap, build_root=None, tmp_bytes=1 << 26, control_fd=None)
            begin = time.perf_counter()
            subprocess.run([*argv, sys.executable, "-S", "-c", "pass"], check=True)
            wrapped.append(time.perf_counter() - begin)
    result = {"python_start_s": statistics.median(plain)}
    if wrapped:
        result["bwrap_python_start_s"] = statistics.median(wrapped)
        result["bwrap_overhead_s"] = result["bwrap_python_start_s"] - result["python_start_s"]
    # Before the sandbox: a process forked from a torch-preloaded multiprocessing forkserver.
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    warm = context.Process(target=_nothing)
    warm.start()
    warm.join()
    forked = []
    for _ in range(samples):
        begin = time.perf_counter()
        process = context.Process(target=_nothing)
        process.start()
        process.join()
        forked.append(time.perf_counter() - begin)
    result["forkserver_process_s"] = statistics.median(forked)
    # A candidate is a fork of the zygote that raises its walls and exits: what each evaluation
    # pays per process, at each level (the zygote itself started once, beforehand).
    from kernelfleet.core.settings import ISOLATION_LEVELS, isolation_rank
    from kernelfleet.evaluator._sandbox import Sandbox, Walls

    for level in ISOLATION_LEVELS:
        if isolation_rank(level) > isolation_rank(report.level):
            continue
        if ("landlock" in level and not report.landlock_abi) or ("bubblewrap" in level and not report.bwrap):
            continue
        sandbox = Sandbox(level, build_root=tempfile.mkdtemp(prefix="kf-overhead-"))
        walls = Walls(landlock="landlock" in level, seccomp=report.seccomp, memory_bytes=1 << 31)
        try:
            sandbox.spawn("candidate", walls, {}).close()  # starts the zygote
            times = []
            for _ in range(samples):
                begin = time.perf_counter()
                child = sandbox.spawn("candidate", walls, {})
                child.channel.send({"op": "bye"})
                child.wait(30)
                times.append(time.perf_counter() - begin)
                child.close()
            result[f"candidate_process_{level}_s"] = statistics.median(times)
        finally:
            sandbox.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--level", default="auto", help=argparse.SUPPRESS)
    parser.add_argument(
        "--levels", default="all", help="comma-separated levels, 'all' (available ones) or auto"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attacks", default="", help="comma-separated attack names (default: all)")
    parser.add_argument(
        "--before", metavar="CHECKOUT", help="also run against the kernelfleet in this checkout"
    )
    parser.add_argument("--overhead", action="store_true", help="measure bwrap's start-up overhead only")
    parser.add_argument("--out", metavar="DIR")
    args = parser.parse_args()
    if args.one:
        return _one(args)
    if args.overhead:
        print(json.dumps(overhead(20), indent=2))
        return 0
    sys.path[:0] = [str(ROOT / "core"), str(ROOT / "evaluator"), str(ROOT)]
    from kernelfleet.core.settings import ISOLATION_LEVELS, isolation_rank
    from kernelfleet.evaluator._sandbox import detect
    from tests.support.attacks import ATTACKS

    report = detect()
    if args.levels == "all":
        levels = [
            level
            for level in ISOLATION_LEVELS
            if isolation_rank(level) <= isolation_rank(report.level)
            and ("landlock" not in level or report.landlock_abi)
            and ("bubblewrap" not in level or report.bwrap)
        ]
    else:
        levels = [report.level if x == "auto" else x for x in args.levels.split(",")]
    names = [a.name for a in ATTACKS if not args.attacks or a.name in args.attacks.split(",")]
    columns: list[tuple[str, Path, str]] = []
    if args.before:
        columns.append(("before", Path(args.before).resolve(), "auto"))
    columns += [(level, ROOT, level) for level in levels]
    rows: list[dict[str, Any]] = []
    for name in names:
        for label, source, level in columns:
            if label == "before" and name in UNSAFE_UNLIMITED:
                rows.append({"attack": name, "level": label, "skipped": True})
                continue
            row = run_attack(name, level, args.device, source)
            row["level"] = label
            rows.append(row)
            print(f"{name:<28} {label:<22} {cell(row)}", file=sys.stderr, flush=True)
    by = {(r["attack"], r["level"]): r for r in rows}
    lines = [
        f"Attacks on {args.device}; this machine: {report.level} "
        f"(bwrap {'yes' if report.bwrap else 'no'}, Landlock ABI {report.landlock_abi}, "
        f"seccomp {'yes' if report.seccomp else 'no'})",
        "",
        "| attack | " + " | ".join(label for label, _, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for attack in ATTACKS:
        if attack.name not in names:
            continue
        cells = []
        for label, _, _ in columns:
            row = by[(attack.name, label)]
            cells.append(f"not run (issue 9: {attack.before})" if row.get("skipped") else cell(row))
        lines.append(f"| {attack.name}: {attack.what} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = dt.date.today().isoformat()
        (out / f"attacks-{stamp}.md").write_text(table + "\n")
        (out / f"attacks-{stamp}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
