"""KernelBench's own evaluation harness on a list of candidates, for a side-by-side benchmark (issue 11).

KernelBench's source is not in this repository and must not be copied into it. It travels to the
GPU machine as an ignored folder holding its `kernelbench` package: pass --kernelbench-src PATH
(default $KERNELBENCH_SRC, else `.kb/src`). Make the folder from a KernelBench checkout with

    mkdir -p .kb && git -C <KernelBench checkout> archive HEAD src/kernelbench LICENSE | tar -x -C .kb

Stubs: `kernelbench/__init__.py` imports `kernelbench.utils`, which imports `dotenv`, `openai` and
`litellm` at module level for its LLM-client helpers. They are absent on the GPU machine and are
not needed to evaluate, so before `kernelbench` is imported, stub modules are put into
`sys.modules` under just those three names, holding only the names `utils` imports from them
(`load_dotenv`, a no-op; `OpenAI` and `completion`, which raise if called). They are stubbed even
where the real packages exist, so that no run pays for importing an LLM client. `requests`
(imported by `kernelbench.eval`, unused when evaluating) is stubbed only where it is not installed;
`tqdm`, `numpy` and `pydantic` are real dependencies here (the GPU image has tqdm and numpy;
pydantic comes with the carried wheels of scripts/gpu-check.sh).

It runs the candidates as KernelBench's `scripts/eval_from_generations.py` does with
`build_cache=True` on one local GPU:

1. compile: `kernelbench.eval.build_compile_cache(code, build_dir=<build>/<id>)` for every candidate
   in parallel, in a `multiprocessing.Pool` (spawn) of one worker per CPU, as their `batch_compile`;
2. evaluate: each candidate in a fresh Python process (`kernelbench_harness.py one ...`; their
   script makes an `mp.Pool(num_gpu_devices)` with spawn per batch, a fresh interpreter per
   candidate), one after another on GPU 0, with `eval_kernel_against_ref(ref, code,
   num_correct_trials=5, num_perf_trials=100, measure_performance=True, timing_method="cuda_event",
   build_dir=<build>/<id>, device=0)`; the process prints one JSON line (compiled, correctness,
   runtime in ms, error).

`--task-timeout` (180 s, their `timeout`) bounds each compile and each evaluation: a hung one is
killed with its child processes and recorded as timed out. `--max-seconds` bounds the whole batch:
nothing new starts after it, what runs is killed, and the results say which candidates finished.
Their harness asserts CUDA; without it `batch` writes a note and exits 3.

    python3 benchmarks/kernelbench_harness.py check        # the stubbed import works
    python3 benchmarks/kernelbench_harness.py batch --manifest cands.jsonl --work-dir /tmp/kb \\
        --results /tmp/kb/results.jsonl                    # manifest rows: {"id", "ref", "code"}
    python3 benchmarks/kernelbench_harness.py one --ref ref.py --code cand.py --build-dir /tmp/kb/b/x

`batch` writes one JSON line per candidate to --results as it finishes ({"id", "compiled",
"correctness", "runtime_ms", "ref_runtime_ms", "error", "timed_out", "compile_ok", "compile_s",
"eval_s"}), then {"summary": {...}} with the seconds of each phase.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "KB_RESULT "
STUBBED = ("dotenv", "openai", "litellm")


def kernelbench_src(given: str | None) -> Path:
    """The folder that holds the `kernelbench` package."""
    return Path(given or os.environ.get("KERNELBENCH_SRC") or ROOT / ".kb" / "src").resolve()


def _stub(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__dict__["__kernelfleet_stub__"] = True
    return module


def _unavailable(*_: Any, **__: Any) -> Any:
    raise RuntimeError("an LLM client stub (kernelbench_harness): not available when evaluating")


def import_kernelbench_eval(src: Path) -> types.ModuleType:
    """`kernelbench.eval`, imported from `src` with the LLM-client modules stubbed (see above)."""
    if not (src / "kernelbench" / "eval.py").is_file():
        raise SystemExit(
            f"kernelbench_harness: no kernelbench package under {src}; pass --kernelbench-src "
            "(see this file's docstring for how to make .kb/src)"
        )
    stubs = {
        "dotenv": _stub("dotenv", load_dotenv=lambda *_, **__: False),
        "openai": _stub("openai", OpenAI=_unavailable),
        "litellm": _stub("litellm", completion=_unavailable),
    }
    if importlib.util.find_spec("requests") is None:
        stubs["requests"] = _stub("requests")
    for name, module in stubs.items():
        sys.modules[name] = module
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    import kernelbench.eval as kb_eval

    return kb_eval


def set_arch(src: Path, arch: str) -> None:
    """Their `set_gpu_arch` (TORCH_CUDA_ARCH_LIST from names such as Hopper); `none` leaves torch's
    default (the visible GPU's own)."""
    if arch and arch.lower() != "none":
        import_kernelbench_eval(src)
        from kernelbench.utils import set_gpu_arch

        set_gpu_arch([a.strip() for a in arch.split(",") if a.strip()])


# ---------------------------------------------------------------- phase 1: compile on the CPUs

_START_QUEUE: Any = None


def _compile_init(src: str, arch: str, queue: Any) -> None:
    global _START_QUEUE
    _START_QUEUE = queue
    try:  # a failing initializer would make the pool start workers again and again
        set_arch(Path(src), arch)
        import_kernelbench_eval(Path(src))
    except BaseException as exc:
        print(f"kernelbench_harness: a compile worker cannot import kernelbench: {exc}", file=sys.stderr)


def _compile_one(index: int, code: str, build_dir: str, src: str) -> tuple[int, bool, str, float]:
    begin = time.monotonic()
    if _START_QUEUE is not None:
        _START_QUEUE.put((index, os.getpid(), time.time()))
    kb_eval = import_kernelbench_eval(Path(src))
    try:
        ok, _stdout, error = kb_eval.build_compile_cache(custom_model_src=code, build_dir=build_dir)
    except Exception as exc:  # as their compile_single_sample: a last-level catch
        ok, error = False, str(exc)
    return index, bool(ok), str(error or "")[:2000], time.monotonic() - begin


def _descendants(pid: int) -> list[int]:
    """Child processes of `pid`, recursively, from /proc (nvcc and ninja under a compile)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    for victim in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            os.kill(victim, signal.SIGKILL)


def compile_all(
    items: list[dict[str, Any]], build_root: Path, args: argparse.Namespace, deadline: float
) -> dict[int, dict[str, Any]]:
    """Phase 1: build every candidate's extension into its build dir, one pool worker per CPU."""
    context = mp.get_context("spawn")  # as theirs: mp.set_start_method("spawn")
    workers = args.workers or os.cpu_count() or 1
    started = context.Queue()
    out: dict[int, dict[str, Any]] = {}
    pool = context.Pool(workers, initializer=_compile_init, initargs=(str(args.src), args.gpu_arch, started))
    running: dict[int, tuple[int, float]] = {}  # index -> (pool worker pid, monotonic start)
    try:
        pending = {
            index: pool.apply_async(
                _compile_one, (index, item["code"], str(build_root / item["id"]), str(args.src))
            )
            for index, item in enumerate(items)
        }
        while pending:
            while not started.empty():
                index, pid, at = started.get()
                running[index] = (pid, time.monotonic() - (time.time() - at))
            now = time.monotonic()
            for index in list(pending):
                result = pending[index]
                if result.ready():
                    try:
                        _, ok, error, seconds = result.get()
                    except Exception as exc:
                        ok, error, seconds = False, str(exc), now - running.get(index, (0, now))[1]
                    out[index] = {"compile_ok": ok, "compile_s": round(seconds, 2), "compile_error": error}
                    del pending[index]
                elif index in running and now - running[index][1] > args.task_timeout:
                    _kill_tree(running[index][0])  # the pool starts a new worker in its place
                    out[index] = {
                        "compile_ok": False,
                        "compile_s": round(now - running[index][1], 2),
                        "compile_error": f"compile timed out after {args.task_timeout:.0f} s",
                        "compile_timed_out": True,
                    }
                    del pending[index]
            if pending and now > deadline:
                for index in pending:
                    out[index] = {"compile_ok": False, "compile_error": "not finished: --max-seconds"}
                break
            time.sleep(0.05)
    finally:
        for index, (pid, _) in running.items():
            if index not in out or out[index].get("compile_ok") is False:
                for child in _descendants(pid):  # nvcc that terminate() would leave running
                    _kill_tree(child)
        pool.terminate()
        pool.join()
    return out


# ---------------------------------------------------------------- phase 2: one process per candidate


def evaluate_one(
    ref_path: Path, code_path: Path, work: Path, args: argparse.Namespace, limit: float
) -> dict[str, Any]:
    """Run `one` for a candidate in a fresh Python process; kill it (and its children) at `limit`."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "one",
        "--kernelbench-src",
        str(args.src),
        "--ref",
        str(ref_path),
        "--code",
        str(code_path),
        "--build-dir",
        str(work),
        "--trials",
        str(args.trials),
        "--correct-trials",
        str(args.correct_trials),
        "--gpu-arch",
        args.gpu_arch,
    ]
    begin = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=max(1.0, limit))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    seconds = time.monotonic() - begin
    answer: dict[str, Any] | None = None
    for line in reversed((output or "").splitlines()):
        if line.startswith(RESULT_PREFIX):
            answer = json.loads(line[len(RESULT_PREFIX) :])
            break
    if answer is None:
        why = f"timed out after {limit:.0f} s" if timed_out else f"exit {process.returncode}, no result"
        answer = {"compiled": None, "correctness": False, "error": f"{why}: {(output or '')[-800:]}"}
    answer.update(timed_out=timed_out, eval_s=round(seconds, 2))
    return answer


def command_batch(args: argparse.Namespace) -> int:
    begin = time.monotonic()
    deadline = begin + args.max_seconds
    results_path = Path(args.results)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text("")

    def emit(row: dict[str, Any]) -> None:
        with results_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    import torch

    if not torch.cuda.is_available():
        emit({"summary": {"skipped": "no CUDA device: KernelBench's harness asserts CUDA"}})
        print("kernelbench_harness: no CUDA device; KernelBench's harness needs one", file=sys.stderr)
        return 3
    items = [json.loads(line) for line in Path(args.manifest).read_text().splitlines() if line.strip()]
    work = Path(args.work_dir)
    sources, builds = work / "src", work / "build"
    sources.mkdir(parents=True, exist_ok=True)
    builds.mkdir(parents=True, exist_ok=True)
    for item in items:
        (sources / f"{item['id']}.ref.py").write_text(item["ref"])
        (sources / f"{item['id']}.py").write_text(item["code"])

    compiled = compile_all(items, builds, args, deadline)
    phase1 = time.monotonic() - begin
    print(f"kernelbench_harness: phase 1 (compile) {phase1:.1f} s", file=sys.stderr)
    phase2_begin = time.monotonic()
    finished = 0
    for index, item in enumerate(items):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        cut = left < args.task_timeout  # this one ends at --max-seconds, not at its own timeout
        row = {"id": item["id"], **compiled.get(index, {})}
        row.update(
            evaluate_one(
                sources / f"{item['id']}.ref.py",
                sources / f"{item['id']}.py",
                builds / item["id"],
                args,
                min(args.task_timeout, left),
            )
        )
        if row["timed_out"] and cut:
            break  # stopped by --max-seconds: not a finished candidate
        finished += 1
        emit(row)
        print(
            f"kernelbench_harness: {item['id']} compiled={row.get('compiled')} "
            f"correct={row.get('correctness')} {row['eval_s']} s",
            file=sys.stderr,
        )
    phase2 = time.monotonic() - phase2_begin
    emit(
        {
            "summary": {
                "candidates": len(items),
                "finished": finished,
                "phase1_compile_s": round(phase1, 1),
                "phase2_evaluate_s": round(phase2, 1),
                "workers": args.workers or os.cpu_count(),
                "stubbed_modules": list(STUBBED),
            }
        }
    )
    return 0


# ---------------------------------------------------------------- one candidate (a fresh process)


def command_one(args: argparse.Namespace) -> int:
    src = kernelbench_src(args.kernelbench_src)
    set_arch(src, args.gpu_arch)
    kb_eval = import_kernelbench_eval(src)
    row: dict[str, Any]
    try:
        result = kb_eval.eval_kernel_against_ref(
            original_model_src=Path(args.ref).read_text(),
            custom_model_src=Path(args.code).read_text(),
            num_correct_trials=args.correct_trials,
            num_perf_trials=args.trials,
            measure_performance=True,
            timing_method="cuda_event",
            build_dir=args.build_dir,
            device=0,
        )
        if result is None:  # their lock-file case: "please retry"
            row = {"compiled": None, "correctness": False, "error": "lock file error during compilation"}
        else:
            metadata = {str(k): str(v)[:500] for k, v in (result.metadata or {}).items()}
            error = next(
                (
                    metadata[k]
                    for k in ("compilation_error", "runtime_error", "correctness_issue")
                    if k in metadata
                ),
                None,
            )
            row = {
                "compiled": result.compiled,
                "correctness": result.correctness,
                "runtime_ms": result.runtime if result.runtime >= 0 else None,
                "ref_runtime_ms": result.ref_runtime if result.ref_runtime >= 0 else None,
                "runtime_error": "runtime_error" in metadata,
                "error": error,
            }
    except Exception as exc:  # as their evaluate_single_sample: counted as not compiled
        row = {"compiled": False, "correctness": False, "error": f"{type(exc).__name__}: {exc}"[:800]}
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(row), flush=True)
    return 0


def command_check(args: argparse.Namespace) -> int:
    kb_eval = import_kernelbench_eval(kernelbench_src(args.kernelbench_src))
    names = ("build_compile_cache", "eval_kernel_against_ref")
    missing = [n for n in names if not hasattr(kb_eval, n)]
    stubbed = [
        n for n in (*STUBBED, "requests") if getattr(sys.modules.get(n), "__kernelfleet_stub__", False)
    ]
    print(json.dumps({"kernelbench.eval": kb_eval.__file__, "missing": missing, "stubbed": stubbed}))
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kernelbench-src", default=None, help="folder holding kernelbench/ (.kb/src)")
    common.add_argument("--trials", type=int, default=100, help="num_perf_trials")
    common.add_argument("--correct-trials", type=int, default=5, help="num_correct_trials")
    common.add_argument("--gpu-arch", default="Hopper", help="their set_gpu_arch names, or none")
    batch = sub.add_parser("batch", parents=[common], help="compile all, then evaluate one by one")
    batch.add_argument("--manifest", required=True, help='JSONL of {"id", "ref", "code"}')
    batch.add_argument("--work-dir", required=True, help="sources and build dirs go here")
    batch.add_argument("--results", required=True, help="JSONL written as candidates finish")
    batch.add_argument("--workers", type=int, default=None, help="compile processes; default: CPUs")
    batch.add_argument("--task-timeout", type=float, default=180.0)
    batch.add_argument("--max-seconds", type=float, default=1e9)
    one = sub.add_parser("one", parents=[common], help="evaluate one candidate (a fresh process)")
    one.add_argument("--ref", required=True)
    one.add_argument("--code", required=True)
    one.add_argument("--build-dir", required=True)
    sub.add_parser("check", parents=[common], help="import kernelbench.eval with the stubs")
    args = parser.parse_args(argv)
    args.src = kernelbench_src(args.kernelbench_src)
    if args.command == "batch":
        return command_batch(args)
    if args.command == "one":
        return command_one(args)
    return command_check(args)


if __name__ == "__main__":
    raise SystemExit(main())
