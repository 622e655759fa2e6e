"""`python -m benchmarks NAME [flags]`: run one benchmark and write its dated results file.

See `benchmarks/__init__.py` for the suite and how to add a benchmark.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import BENCHMARKS, Benchmark
from benchmarks._common import ROOT, machine

RESULTS = ROOT / "benchmarks" / "results"
# After --seconds a benchmark that has not ended is asked to stop (SIGTERM), and killed this much
# later: a bound is a bound, and what it saved before is kept.
GRACE_S = 30.0


def parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<14} {b.about}" for name, b in BENCHMARKS.items())
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run one benchmark of the suite and write one dated results file.",
        epilog=f"benchmarks:\n{listing}\n\nFlags not listed here go to the benchmark's script "
        "(python benchmarks/SCRIPT.py --help lists them).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="?", choices=list(BENCHMARKS), metavar="NAME", help="the benchmark")
    default_out = Path(os.environ["OUT"]) / "results" if os.environ.get("OUT") else RESULTS
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help="folder for the results file (default: $OUT/results when $OUT is set, else benchmarks/results)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="wall-time bound in seconds: given to the benchmark where it takes one, and kept here "
        f"(stopped after it, killed {GRACE_S:g} s later). Default: the benchmark's own",
    )
    parser.add_argument("--tag", default="", help="added to the file name, to keep two runs of one day apart")
    parser.add_argument(
        "--keep-older",
        action="store_true",
        help="keep the benchmark's earlier files in --out (by default the new file replaces them: the "
        "history is in git)",
    )
    return parser


def command(benchmark: Benchmark, extra: list[str], parts: Path, seconds: float | None) -> list[str]:
    words = [sys.executable, str(ROOT / "benchmarks" / benchmark.script), *benchmark.args]
    if seconds is not None and benchmark.bound is not None:
        words += [benchmark.bound, f"{seconds:g}"]
    return [*words, *extra, "--out", str(parts)]


def run(benchmark: Benchmark, words: list[str], seconds: float | None) -> tuple[int, float]:
    """Run the script with this tree on PYTHONPATH; (exit status, wall seconds)."""
    paths = [str(ROOT / part) for part in ("core", "evaluator", "search", "trainer", "operator")]
    paths += [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    child = subprocess.Popen(words, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = child.wait(timeout=seconds + GRACE_S if seconds is not None else None)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            code = child.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            code = child.wait()
    return code, round(time.monotonic() - began, 1)


def collect(parts: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The numbers (every JSON file the script wrote, by its name) and its tables (markdown)."""
    numbers: dict[str, Any] = {}
    tables: dict[str, str] = {}
    for path in sorted(parts.iterdir()):
        if path.suffix == ".json":
            try:
                numbers[path.stem] = json.loads(path.read_text())
            except ValueError as error:
                numbers[path.stem] = {"unreadable": str(error)}
        elif path.suffix == ".md":
            tables[path.stem] = path.read_text()
    return numbers, tables


def _no_path(word: str) -> str:
    """A machine's path on the command line, as its file name alone (no machine paths in results)."""
    return Path(word).name if word.startswith("/") else word


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    if args.name is None:
        parser().print_help()
        return 0
    benchmark = BENCHMARKS[args.name]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    target = args.out / f"{args.name}-{stamp}{'-' + args.tag if args.tag else ''}.json"
    with tempfile.TemporaryDirectory(prefix=f"kernelfleet-bench-{args.name}-") as scratch:
        parts = Path(scratch)
        words = command(benchmark, extra, parts, args.seconds)
        print("benchmark:", " ".join(words[1:]), file=sys.stderr)
        code, wall = run(benchmark, words, args.seconds)
        numbers, tables = collect(parts)
    record = {
        "benchmark": args.name,
        "about": benchmark.about,
        "machine": machine(),
        # The command line, less this machine's paths: the script's path is relative, --out dropped.
        "settings": [f"benchmarks/{Path(benchmark.script).name}", *(_no_path(word) for word in words[2:-2])],
        "seconds_bound": args.seconds,
        "exit_status": code,
        "wall_seconds": wall,
        "numbers": numbers,
        "tables": tables,
    }
    if not args.keep_older:
        for older in args.out.glob(f"{args.name}-*.json"):
            older.unlink()
    target.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {target} (exit {code}, {wall} s)", file=sys.stderr)
    for text in tables.values():
        print(text)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
