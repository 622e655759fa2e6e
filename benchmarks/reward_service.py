"""Benchmark of the evaluation pipeline on published kernels (issue 11), for the GPU machine.

The workload is CUDA-L1's published H100 kernels replayed on their KernelBench v0 tasks (a
JSONL file of {"task": "LEVEL:ID", "name", "code"}; 1.6 MB, so it is not in the repository:
pass --kernels or set $KERNELFLEET_CUDA_L1_KERNELS). Three parts, each saved as soon as it ends:

- throughput: a list of modes (`--modes`, table MODES below), each over the SAME --count
  candidates to completion, each with a cold build cache (a temp dir of its own), one after
  another in this process:
    kernelbench        KernelBench's own harness (benchmarks/kernelbench_harness.py: compile all
                       in a CPU pool, then one fresh process per candidate on the GPU); its
                       source travels in --kernelbench-src (.kb/src) and is skipped without CUDA;
    one-at-a-time      the Evaluator with lane_slots=1, compile_workers=1, one candidate at a time;
    before-pipeline    the evaluator as it was before the pipeline (commit 777a4df, exported to
                       --old-tree, .old), one candidate at a time in a process of its own
                       (benchmarks/old_evaluator.py): the issue's "today's";
    pipeline           one `evaluate_batch` with the defaults (lane_slots --lane-slots);
    pipeline-shared-lane  as pipeline with timing.exclusive=false;
    pipeline-more-pairs  as pipeline with timing.processes_max=4;
    pipeline-reference-pool  as pipeline with timing.reference_processes=4.
  Per mode: candidates finished, wall seconds, evaluations per GPU-hour, per-stage seconds,
  timing-lane busy share (over the whole mode and while a candidate waits for a slot),
  nvidia-smi utilisation and verdict counts; then the ratios between modes. A mode runs to
  completion unless it reaches its bound: min(--mode-seconds, an equal share of what is left of
  --max-seconds among the modes still to run); then it stops, is marked "incomplete: K of N",
  and its rate is over what finished. The report is saved after every mode.
- variants: many candidates per task, as an RL step or an optimisation round makes them:
  --variant-tasks tasks (pure-Python ones, so that builds do not hide the timing lane), each
  with --variants copies that differ by a comment (so each is evaluated afresh), through the
  pipeline under each --variant-config setting, one after the other (by default the defaults,
  then timing.reference_processes=4). Per mode: rate, timing-lane seconds per candidate, lane busy
  share, the reference notes, and how far each task's variants' speedups spread (the same
  candidate re-timed in one session: p50 and p90, and over candidates of 50 us and more).
- repeat: the published kernels in file order are screened until --repeat-tasks of them are
  correct and timed, and each of those is timed again in a fresh process; the disagreement of
  the two speedups |s1/s2 - 1| at the 50th and 90th percentile, over candidates of 50 us and
  more. A speedup here is the ratio of the two medians, reported or not (one as fast as its
  reference is reported as no speedup, but it is timed all the same). Reference reuse is off
  here: each timing stands on its own paired measurement. --repeat-config takes EvalConfig
  settings by path (lane_slots=1,compile_workers=1 takes the neighbours away: the machine's own
  repeatability); several settings separated by ';' (`"timing.pin_cpu=true;timing.pin_cpu=false"`)
  time each screened candidate twice under every setting, interleaved in one pipeline: side
  by side under the same load. --repeat-min-ms 0.05 times again only the candidates the goal
  counts (50 us and more), so that a run with several settings fits a device call.

Workload rule (throughput): the JSONL rows whose task exists in --tasks, sorted by (level, task
id); with M of them and N = --count, row floor((i + 0.5) * M / N) for i in 0..N-1 (every
M/N-th row, from the middle of the first stride), so the choice is deterministic and spread over
levels 1, 2 and 3 (a level missing from the choice is reported). The repeat part takes the first
matching rows in file order until --repeat-tasks are correct.

    python benchmarks/reward_service.py --kernels cuda-l1-h100-kernels.jsonl --device cuda:0
    python benchmarks/reward_service.py --kernels ... --device cpu --count 3 --repeat-tasks 2 \\
        --modes one-at-a-time,pipeline --trials 5                                   # smoke

Writes `reward_service-<date>[-<tag>].json` and `.md` into --out, and with the repeat part every
timed call it kept in `-samples.json.gz`, for re-analysis (run alone: `python -m benchmarks`
keeps the JSON and the table in its results file, not the calls). Through the entry point:
`python -m benchmarks throughput ...` (--parts throughput) or `retiming` (--parts repeat).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as dt
import faulthandler
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for part in ("core", "evaluator"):
    if str(ROOT / part) not in sys.path:
        sys.path.insert(0, str(ROOT / part))

from _common import UtilizationSampler, commit, tree_env  # noqa: E402

from kernelfleet.core import reasons as R  # noqa: E402
from kernelfleet.core.errors import EvaluationCancelled  # noqa: E402
from kernelfleet.core.models import EvaluationResult, Task  # noqa: E402
from kernelfleet.core.options import leaf_fields, lookup, nest  # noqa: E402
from kernelfleet.core.settings import merged  # noqa: E402
from kernelfleet.evaluator import EVALUATOR_VERSION, EvalConfig, Evaluator, load_tasks  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "kernelbench_harness.py"
OLD_RUNNER = Path(__file__).resolve().parent / "old_evaluator.py"
STAGES = (
    "process_start",
    "cuda_init",
    "build",
    "reference",
    "candidate_load",
    "correctness",
    "timing_inputs",
    "lane_wait",
    "timing",
    "recheck",
)
DEFAULT_MODES = "kernelbench,one-at-a-time,pipeline"
BASES = ("before-pipeline", "one-at-a-time", "kernelbench")  # what the other modes' rates are set against


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of evaluating the candidates: a name, how it runs, and its EvalConfig settings."""

    name: str
    runner: str  # "kernelbench": their harness; "old": the evaluator before the pipeline;
    # "each": one evaluation at a time; "batch": evaluate_batch
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    needs_field: str | None = None  # an EvalConfig field the mode needs; skipped with a note without it
    about: str = ""


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("kernelbench", "kernelbench", about="KernelBench's own harness (eval_from_generations)"),
        Mode(
            "one-at-a-time",
            "each",
            {"lane_slots": 1, "compile_workers": 1},
            about="one candidate at a time, one process, one build worker",
        ),
        Mode(
            "before-pipeline",
            "old",
            about="the evaluator before the pipeline (777a4df), one candidate at a time",
        ),
        Mode("pipeline", "batch", about="evaluate_batch with the defaults"),
        Mode(
            "pipeline-shared-lane",
            "batch",
            {"timing.exclusive": False},
            needs_field="timing.exclusive",
            about="evaluate_batch, correctness of the other slots running beside each timing",
        ),
        Mode(
            "pipeline-one-pair",
            "batch",
            {"timing.processes": 1},
            needs_field="timing.processes",
            about="evaluate_batch, each candidate timed in one process pair (evaluator 0.7.0's default)",
        ),
        Mode(
            "pipeline-more-pairs",
            "batch",
            {"timing.processes_max": 4},
            needs_field="timing.processes_max",
            about="evaluate_batch, up to 4 process pairs while the pairs' speedups spread by more than 2%",
        ),
        Mode(
            "pipeline-reference-pool",
            "batch",
            {"timing.reference_processes": 4},
            needs_field="timing.reference_processes",
            about="evaluate_batch, each task's reference time pooled over 4 fresh processes per session",
        ),
        Mode(
            "pipeline-pool-pairs",
            "batch",
            {"timing.reference_processes": 4, "timing.processes_max": 4},
            needs_field="timing.reference_processes",
            about="evaluate_batch with the setting that met 2% at p90: a reference pool of 4 processes "
            "and up to 4 pairs while the pairs disagree",
        ),
        Mode(
            "pipeline-full-retime",
            "batch",
            {"timing.retime_correctness_trials": 5},
            needs_field="timing.retime_correctness_trials",
            about="evaluate_batch, every further process pair repeating all 5 correctness trials (0.8.5)",
        ),
        Mode(
            "pipeline-six-slots",
            "batch",
            {"lane_slots": 6},
            about="evaluate_batch with 6 evaluations per device at once (the default is 4)",
        ),
        Mode(
            "pipeline-eight-slots",
            "batch",
            {"lane_slots": 8},
            about="evaluate_batch with 8 evaluations per device at once (the default is 4)",
        ),
        Mode(
            "pipeline-no-reuse",
            "batch",
            {"timing.reference_reuse": False},
            needs_field="timing.reference_reuse",
            about="evaluate_batch, the reference run afresh for every candidate",
        ),
    )
}


def is_native(code: str) -> bool:
    """Builds a C++/CUDA extension (the same test as the evaluator's build pool)."""
    return "load_inline" in code or "cpp_extension" in code


def load_workload(kernels: Path, tasks_spec: str) -> list[tuple[Task, str, str]]:
    """(task, candidate code, "LEVEL:ID") for every kernel whose task exists, in file order."""
    tasks = {f"{t.level}:{t.task_id}": t for t in load_tasks(tasks_spec)}
    rows = []
    for line in kernels.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        name = str(row.get("task", "")).replace(" ", "")
        task = tasks.get(name)
        if task is None or not row.get("code"):
            continue
        rows.append((task, row["code"], name))
    return rows


def spread(rows: list[tuple[Task, str, str]], count: int) -> list[tuple[Task, str, str]]:
    """The throughput workload: every M/N-th row by (level, task id), from the middle of the first
    stride (see the module docstring)."""
    ordered = sorted(rows, key=lambda r: (r[0].level or 0, r[0].task_id or 0))
    if count >= len(ordered):
        return ordered
    return [ordered[int((i + 0.5) * len(ordered) / count)] for i in range(count)]


def describe_workload(chosen: list[tuple[Task, str, str]], matching: int) -> dict[str, Any]:
    levels = Counter(str(task.level) for task, _, _ in chosen)
    return {
        "rule": "rows whose task exists, sorted by (level, task id); row floor((i + 0.5) * M / N), "
        "i = 0..N-1",
        "matching_rows": matching,
        "task_ids": [name for _, _, name in chosen],
        "levels": dict(sorted(levels.items())),
        "missing_levels": [level for level in ("1", "2", "3") if level not in levels],
        "native_builds": sum(1 for _, code, _ in chosen if is_native(code)),
    }


def runnable_now() -> int | None:
    """Threads runnable on the machine right now (/proc/stat's procs_running; None off Linux)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class LaneSampler:
    """Every 50 ms: is the queue full (a candidate ready and waiting for a slot: metrics.waiting
    > 0), and does some lane hold the timing lock? Time-weighted shares of both. While a lane
    times, also the machine's runnable threads: more than its cores means a timing process
    waits for a CPU, which moves a reference bound by kernel launches."""

    def __init__(self, metrics: Any, period: float = 0.05) -> None:
        self.metrics = metrics
        self.period = period
        self.total = self.busy = self.full = self.busy_full = 0.0
        self.samples = 0
        self.runnable_while_timing: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lane-sampler", daemon=True)

    def _held_and_waiting(self) -> tuple[bool, int]:
        # Metrics has no public "a lane is timing now": snapshot() gives cumulative busy seconds
        # only, which a 50 ms sampler would have to difference (and a hold shorter than the period
        # would vanish). Its private `_holding` (lane -> held since) is exactly that; it is read
        # under Metrics' own lock and nothing is changed, so evaluator/ needs no new API for a
        # benchmark.
        metrics = self.metrics
        with metrics._lock:
            return bool(metrics._holding), int(metrics.waiting)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            step, last = now - last, now
            held, waiting = self._held_and_waiting()
            self.samples += 1
            self.total += step
            self.busy += step if held else 0.0
            if held and (runnable := runnable_now()) is not None:
                self.runnable_while_timing.append(runnable)
            if waiting > 0:
                self.full += step
                self.busy_full += step if held else 0.0

    def __enter__(self) -> LaneSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict[str, Any]:
        return {
            "busy_share_whole": round(self.busy / self.total, 4) if self.total else None,
            "busy_share_queue_full": round(self.busy_full / self.full, 4) if self.full else None,
            "queue_full_s": round(self.full, 1),
            "samples": self.samples,
            "cores": os.cpu_count(),
            "runnable_while_timing": quantiles(self.runnable_while_timing),
        }


def quantiles(values: list[int]) -> dict[str, float | None] | None:
    """Median, 90th percentile (nearest rank, as `quantile`) and largest of `values`."""
    if not values:
        return None
    ordered = sorted(float(value) for value in values)
    return {"median": statistics.median(ordered), "p90": quantile(ordered, 0.9), "max": ordered[-1]}


def stage_table(results: list[EvaluationResult]) -> dict[str, dict[str, float]]:
    names = list(STAGES) + sorted({s for r in results for s in r.stages} - set(STAGES))
    stages: dict[str, dict[str, float]] = {}
    for stage in names:
        values = [r.stages[stage] for r in results if stage in r.stages]
        if values:
            stages[stage] = {
                "n": len(values),
                "median_s": round(statistics.median(values), 3),
                "total_s": round(sum(values), 1),
            }
    return stages


def finish(row: dict[str, Any], finished: int, total: int, wall: float, per_candidate: list[float]) -> None:
    """The common columns of a mode's row: completion, rate over what finished, median seconds."""
    row.update(
        finished=finished,
        candidates=total,
        status="complete" if finished == total else f"incomplete: {finished} of {total}",
        wall_s=round(wall, 1),
        evaluations_per_gpu_hour=round(finished / wall * 3600, 1) if wall > 0 and finished else None,
        median_seconds_per_candidate=round(statistics.median(per_candidate), 2) if per_candidate else None,
    )


def run_evaluator_mode(
    mode: Mode,
    items: list[tuple[Task, str]],
    args: argparse.Namespace,
    bound: float,
    keep: dict[int, EvaluationResult] | None = None,
) -> dict[str, Any]:
    """Run one evaluator mode over `items`; `keep` receives the results by item index."""
    settings = dict(mode.settings)
    if mode.runner == "batch":
        settings.setdefault("lane_slots", args.lane_slots)
    build_root = tempfile.mkdtemp(prefix=f"kf-reward-{mode.name}-")
    base = {
        "device": args.device,
        "correctness.profile": args.profile,
        "timing.trials": args.trials,
        "limits.timeout_seconds": args.task_timeout,
        "limits.compile_timeout_s": args.task_timeout,
        "cache_dir": build_root,
    }
    config = EvalConfig.model_validate(grouped({**base, **settings}))
    deadline = time.monotonic() + bound

    def past_deadline(_: float) -> bool:
        return time.monotonic() > deadline

    results: list[EvaluationResult] = []
    begin = time.monotonic()
    with (
        UtilizationSampler() as util,
        Evaluator(config) as evaluator,
        LaneSampler(evaluator.metrics) as lanes,
    ):
        if mode.runner == "batch":
            try:
                ordered: list[EvaluationResult | None] = list(
                    evaluator.evaluate_batch(items, progress=False, stop=past_deadline)
                )
            except EvaluationCancelled as cancelled:
                ordered = [r if isinstance(r, EvaluationResult) else None for r in cancelled.results or []]
            results = [r for r in ordered if r is not None]
            if keep is not None:
                keep.update({i: r for i, r in enumerate(ordered) if r is not None})
        else:
            # evaluate(task, code) is evaluate_batch([(task, code)]): the same call, with the
            # mode's bound as `stop` so that one long candidate cannot overrun it.
            for task, code in items:
                if time.monotonic() > deadline:
                    break
                try:
                    results += evaluator.evaluate_batch([(task, code)], progress=False, stop=past_deadline)
                except EvaluationCancelled:
                    break
        metrics = evaluator.metrics.snapshot()
    wall = time.monotonic() - begin
    shutil.rmtree(build_root, ignore_errors=True)
    task_of = {task.hash: f"{task.level}:{task.task_id}" for task, _ in items}
    row: dict[str, Any] = {"settings": settings, "bound_s": round(bound, 1)}
    finish(row, len(results), len(items), wall, [r.seconds for r in results])
    row.update(
        verdicts=dict(Counter(str(r.verdict) for r in results)),
        stages=stage_table(results),
        lane=lanes.summary(),
        timing_lane_busy_share=metrics.get("timing_lane_busy_share"),
        lane_active_share=metrics.get("lane_active_share"),
        nvidia_smi_mean_utilization_pct=util.mean,
        nvidia_smi_sm_clock_mhz=util.clock_mhz,
        # Each candidate's own seconds per stage: where a batch's tail comes from.
        per_candidate=[
            {
                "task": f"{task_of[r.task_hash]}",
                "verdict": str(r.verdict),
                "seconds": r.seconds,
                "speedup": r.speedup,
                "speedup_ci": r.speedup_ci,
                # Medians, spreads and trial counts say why a timing ran long or moved.
                "reference": r.reference.model_dump() if r.reference else None,
                "candidate": r.candidate.model_dump() if r.candidate else None,
                "reasons": list(r.reasons),
                "stages": r.stages,
            }
            for r in results
        ],
    )
    return row


def kernelbench_verdict(row: dict[str, Any]) -> str:
    if row.get("timed_out"):
        return "timeout"
    if row.get("compiled") is None:
        return "no_result"
    if not row.get("compiled"):
        return "compile_error"
    if row.get("correctness"):
        return "correct"
    return "runtime_error" if row.get("runtime_error") else "incorrect"


def run_kernelbench_mode(
    workload: list[tuple[Task, str, str]], args: argparse.Namespace, bound: float
) -> dict[str, Any]:
    """KernelBench's harness as its user runs it: one `batch` process (both phases, every process
    start included in the wall time)."""
    work = Path(tempfile.mkdtemp(prefix="kf-reward-kernelbench-"))
    manifest, results_path = work / "manifest.jsonl", work / "results.jsonl"
    ids = [f"{i:02d}_L{task.level}_{task.task_id}" for i, (task, _, _) in enumerate(workload)]
    manifest.write_text(
        "".join(
            json.dumps({"id": ident, "ref": task.code, "code": code}) + "\n"
            for ident, (task, code, _) in zip(ids, workload, strict=True)
        )
    )
    command = [
        sys.executable,
        str(HARNESS),
        "batch",
        "--kernelbench-src",
        str(args.kernelbench_src),
        "--manifest",
        str(manifest),
        "--work-dir",
        str(work / "run"),
        "--results",
        str(results_path),
        "--task-timeout",
        str(args.task_timeout),
        "--max-seconds",
        str(bound),
        "--trials",
        str(args.trials),
    ]
    note = None
    begin = time.monotonic()
    with UtilizationSampler() as util:
        try:
            done = subprocess.run(command, timeout=bound + 60, check=False)
            if done.returncode != 0:
                note = f"the harness exited {done.returncode}"
        except subprocess.TimeoutExpired:
            note = "the harness overran its bound by 60 s and was killed"
    wall = time.monotonic() - begin
    rows, summary = [], {}
    if results_path.is_file():
        for line in results_path.read_text().splitlines():
            if line.strip():
                parsed = json.loads(line)
                if "summary" in parsed:
                    summary = parsed["summary"]
                else:
                    rows.append(parsed)
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"settings": {"num_correct_trials": 5, "num_perf_trials": args.trials}}
    out["bound_s"] = round(bound, 1)
    per_candidate = [float(r.get("compile_s") or 0.0) + float(r.get("eval_s") or 0.0) for r in rows]
    finish(out, len(rows), len(workload), wall, per_candidate)
    out.update(
        verdicts=dict(Counter(kernelbench_verdict(r) for r in rows)),
        compiled=sum(1 for r in rows if r.get("compiled")),
        correct=sum(1 for r in rows if r.get("correctness")),
        phase1_compile_s=summary.get("phase1_compile_s"),
        phase2_evaluate_s=summary.get("phase2_evaluate_s"),
        compile_workers=summary.get("workers"),
        nvidia_smi_mean_utilization_pct=util.mean,
        nvidia_smi_sm_clock_mhz=util.clock_mhz,
        rows=[
            {
                k: r.get(k)
                for k in (
                    "id",
                    "compiled",
                    "correctness",
                    "runtime_ms",
                    "ref_runtime_ms",
                    "compile_s",
                    "eval_s",
                )
            }
            | {"verdict": kernelbench_verdict(r), "error": (r.get("error") or "")[:300] or None}
            for r in rows
        ],
    )
    if note or summary.get("skipped"):
        out["note"] = note or summary.get("skipped")
    return out


def run_old_mode(
    workload: list[tuple[Task, str, str]], args: argparse.Namespace, bound: float
) -> dict[str, Any]:
    """The evaluator before the pipeline, from --old-tree, in a process of its own (its start, the
    probe of the device and every build included in the wall time)."""
    work = Path(tempfile.mkdtemp(prefix="kf-reward-old-"))
    manifest, results_path = work / "manifest.jsonl", work / "results.jsonl"
    manifest.write_text("".join(json.dumps({"task": n, "code": code}) + "\n" for _, code, n in workload))
    env = tree_env(Path(args.old_tree).resolve())
    device = "cuda" if args.device.startswith("cuda") else args.device
    command = [sys.executable, str(OLD_RUNNER), "--manifest", str(manifest), "--results", str(results_path)]
    command += ["--device", device, "--trials", str(args.trials), "--max-seconds", str(bound)]
    note = None
    begin = time.monotonic()
    with UtilizationSampler() as util:
        try:
            done = subprocess.run(command, env=env, timeout=bound + args.task_timeout, check=False)
            if done.returncode != 0:
                note = f"the old evaluator exited {done.returncode}"
        except subprocess.TimeoutExpired:
            note = f"the old evaluator overran its bound by {args.task_timeout:.0f} s and was killed"
    wall = time.monotonic() - begin
    text = results_path.read_text() if results_path.is_file() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"settings": {"tree": "777a4df", "timing_trials": args.trials}}
    out["bound_s"] = round(bound, 1)
    finish(out, len(rows), len(workload), wall, [float(r["seconds"]) for r in rows])
    out.update(
        verdicts=dict(Counter(str(r["verdict"]) for r in rows)),
        nvidia_smi_mean_utilization_pct=util.mean,
        nvidia_smi_sm_clock_mhz=util.clock_mhz,
        rows=rows,
    )
    if note:
        out["note"] = note
    return out


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> float | None:
    """The two modes' evaluations per GPU-hour, one over the other."""
    rate = "evaluations_per_gpu_hour"
    return ratio_of((numerator or {}).get(rate), (denominator or {}).get(rate))


def ratio_of(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 2) if top and bottom else None


def part_throughput(
    rows: list[tuple[Task, str, str]],
    args: argparse.Namespace,
    budget: float,
    cuda: bool,
    saved: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    workload = spread(rows, args.count)
    if args.throughput_slice:
        # A part of the --count candidates: a mode too slow for all of them in one call (the
        # evaluator before the pipeline on 40) runs over consecutive slices in several calls.
        first, last = args.throughput_slice
        workload = workload[first:last]
    items = [(task, code) for task, code, _ in workload]
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    out: dict[str, Any] = {
        "candidates": len(items),
        "slice": list(args.throughput_slice) if args.throughput_slice else None,
        "trials": args.trials,
        "workload": describe_workload(workload, len(rows)),
        "modes": {},
        "notes": [],
    }
    end = time.monotonic() + budget
    for position, name in enumerate(names):
        mode = MODES.get(name.split("#")[0])  # "pipeline#2": the same mode again, a row of its own
        skip = None
        if mode is None:
            skip = f"unknown mode {name!r}; modes: {', '.join(MODES)}"
        elif mode.needs_field and mode.needs_field not in leaf_fields(EvalConfig):
            skip = f"{name} skipped: this evaluator's EvalConfig has no {mode.needs_field!r} field"
        elif mode.runner == "kernelbench" and not cuda:
            skip = f"{name} skipped: no CUDA device (KernelBench's harness asserts CUDA)"
        elif mode.runner == "kernelbench" and not (Path(args.kernelbench_src) / "kernelbench").is_dir():
            skip = f"{name} skipped: no kernelbench package in --kernelbench-src (see kernelbench_harness.py)"
        elif mode.runner == "old" and not (Path(args.old_tree) / "evaluator" / "kernelfleet").is_dir():
            skip = f"{name} skipped: no old tree in --old-tree (see benchmarks/old_evaluator.py)"
        if skip or mode is None:
            out["notes"].append(skip)
            print(f"throughput: {skip}", file=sys.stderr)
            continue
        bound = min(args.mode_seconds, max(0.0, end - time.monotonic()) / (len(names) - position))
        print(f"throughput {name}: {len(items)} candidates, bound {bound:.0f} s", file=sys.stderr)
        if mode.runner == "kernelbench":
            row = run_kernelbench_mode(workload, args, bound)
        elif mode.runner == "old":
            row = run_old_mode(workload, args, bound)
        else:
            row = run_evaluator_mode(mode, items, args, bound)
        out["modes"][name] = row
        print(
            f"throughput {name}: {row['status']}, {row['wall_s']} s, "
            f"{row['evaluations_per_gpu_hour']} per GPU-hour, {row['verdicts']}",
            file=sys.stderr,
        )
        modes = out["modes"]
        out["ratios"] = {
            f"{m} over {base}": ratio(modes.get(m), modes.get(base))
            for m in modes
            if m not in BASES
            for base in BASES
            if base in modes
        }
        saved(out)
    return out


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted `values` (nearest rank), None when empty."""
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def part_variants(
    rows: list[tuple[Task, str, str]], args: argparse.Namespace, budget: float
) -> dict[str, Any]:
    """Many candidates per task through the pipeline, under each --variant-config setting one
    after the other (the first is the baseline). The variants of a task are one candidate that
    differs by a comment, so within a setting their speedups should be equal: how far they spread
    (largest over smallest, less 1, per task) is a repeatability figure inside one session, with
    --variants re-timings each."""
    if args.variant_rows:
        chosen = [rows[index] for index in args.variant_rows]
    else:
        pure = [row for row in spread(rows, len(rows)) if not is_native(row[1])]
        chosen = spread(pure, args.variant_tasks)
    items = [(task, f"{code}\n# variant {v}\n") for task, code, _ in chosen for v in range(args.variants)]
    out: dict[str, Any] = {
        "tasks": [name for _, _, name in chosen],
        "variants_per_task": args.variants,
        "candidates": len(items),
        "modes": {},
    }
    end = time.monotonic() + budget
    arms = list(args.variant_config)
    for position, overrides in enumerate(arms):
        missing = sorted(set(overrides) - set(leaf_fields(EvalConfig)))
        name = "pipeline" + "".join(f" {key}={value}" for key, value in overrides.items())
        if missing:
            out["modes"][name] = {"note": f"this evaluator has no field(s) {missing}"}
            continue
        bound = max(0.0, end - time.monotonic()) / (len(arms) - position)
        kept: dict[int, EvaluationResult] = {}
        row = run_evaluator_mode(Mode(name, "batch", dict(overrides)), items, args, bound, keep=kept)
        timing = row["stages"].get("timing", {})
        row["timing_s_per_candidate"] = (
            round(timing["total_s"] / row["finished"], 3) if timing and row["finished"] else None
        )
        notes = Counter(code for r in kept.values() for code in R.codes(r.reasons))
        row["notes"] = {
            code: notes[code] for code in ("reference-pooled", "reference-drifted", "reference-reused")
        }
        row["variant_spread"] = variant_spread(kept, args.variants)
        out["modes"][name] = row
        print(f"variants {name}: {row['status']}, {row['wall_s']} s, {row['verdicts']}", file=sys.stderr)
    measured = [m for m in out["modes"].values() if "note" not in m]
    out["rate_ratios"] = [ratio(m, measured[0]) for m in measured[1:]]
    return out


def variant_spread(results: dict[int, EvaluationResult], per_task: int) -> dict[str, Any]:
    """Per task (consecutive blocks of `per_task` items), the timed variants' speedups, largest over
    smallest less 1; p50 and p90 over tasks, and over those whose candidate takes 50 us and more."""
    spreads, big = [], []
    for first in range(0, max(results, default=-1) + 1, per_task):
        timed = [results[i] for i in range(first, first + per_task) if i in results and results[i].speedup]
        if len(timed) < 2:
            continue
        speedups = [float(r.speedup or 0.0) for r in timed]
        gap = max(speedups) / min(speedups) - 1
        spreads.append(gap)
        if all(r.candidate is not None and r.candidate.median_ms >= 0.05 for r in timed):
            big.append(gap)
    return {
        "tasks": len(spreads),
        "tasks_50us_and_up": len(big),
        "p50": quantile(sorted(spreads), 0.5),
        "p90": quantile(sorted(spreads), 0.9),
        "p50_50us_and_up": quantile(sorted(big), 0.5),
        "p90_50us_and_up": quantile(sorted(big), 0.9),
    }


FIRST, SECOND = "\n# first process\n", "\n# second process\n"


def repeat_settings(args: argparse.Namespace) -> list[EvalConfig]:
    base: dict[str, Any] = {
        "device": args.device,
        "correctness.profile": args.profile,
        "timing.trials": args.trials,
        "timing.speedup_recheck": None,
        "limits.timeout_seconds": args.task_timeout,
        "limits.compile_timeout_s": args.task_timeout,
        "lane_slots": args.lane_slots,
        "timing.keep_samples": True,  # every timed call, for re-analysis (-samples.json.gz)
        "timing.reference_reuse": False,
    }
    return [EvalConfig.model_validate(grouped({**base, **overrides})) for overrides in args.repeat_config]


def part_repeat(
    workload: list[tuple[Task, str, str]], args: argparse.Namespace, budget: float
) -> list[dict[str, Any]]:
    """The published kernels in file order are screened (evaluated once, under the first
    setting) until --repeat-tasks of them are correct and timed; each of those is then timed
    again in fresh processes: a second time under the first setting, twice under every other.

    Interleaved (the default), all of it goes through one Evaluator, the settings interleaved
    candidate by candidate, so they compare side by side under the same load. With
    --repeat-separate each setting has an Evaluator and a cold build cache of its own, one after
    another, each screening the rows the first one screened: for settings that shape the whole
    machine's load (as keeping a CPU for timing did), which interleaving would mix. One report per setting."""
    settings = repeat_settings(args)
    if not args.repeat_separate:
        return repeat_run(workload, args, settings, list(args.repeat_config), budget, args.repeat_rows)
    deadline = time.monotonic() + budget
    runs: list[dict[str, Any]] = []
    rows: list[int] | None = args.repeat_rows
    for number, setting in enumerate(settings):
        share = (deadline - time.monotonic()) / (len(settings) - number)
        with tempfile.TemporaryDirectory(prefix="kernelfleet-repeat-cache-") as cache:
            cold = setting.model_copy(update={"cache_dir": cache})
            run = repeat_run(workload, args, [cold], [args.repeat_config[number]], share, rows)[0]
        rows = rows or sorted(int(row) for row in run["screened"]["by_row"])
        runs.append(run)
    return runs


def repeat_run(
    workload: list[tuple[Task, str, str]],
    args: argparse.Namespace,
    settings: list[EvalConfig],
    overrides: list[dict[str, str | None]],
    budget: float,
    rows_given: list[int] | None,
) -> list[dict[str, Any]]:
    """One Evaluator screens rows (those of `rows_given`, else from --repeat-from until
    --repeat-tasks are correct) under settings[0] and re-times the correct ones under every
    setting, interleaved; one report per setting."""
    deadline = time.monotonic() + budget
    queued = 2 * args.lane_slots + 2  # screenings in flight: enough to keep the pipeline fed
    screens: dict[int, EvaluationResult | None] = {}
    timed: set[int] = set()  # screened correct and timed: what --repeat-tasks counts
    retimes: dict[int, list[concurrent.futures.Future[EvaluationResult]]] = {}
    chosen = rows_given if rows_given is not None else range(args.repeat_from, len(workload))
    wanted = len(workload) if rows_given is not None else args.repeat_tasks
    first_row = chosen[0] if chosen else args.repeat_from
    with UtilizationSampler() as util, Evaluator(settings[0]) as evaluator:
        rows = ((index, workload[index]) for index in chosen)
        screening: dict[concurrent.futures.Future[EvaluationResult], int] = {}

        def screen_more() -> None:
            while len(screening) < queued and len(timed) + len(screening) < wanted:
                index, (task, code, _) = next(rows, (-1, (None, "", "")))
                if task is None:
                    return
                screening[evaluator.submit(task, code + FIRST, settings[0])] = index

        screen_more()
        while screening and time.monotonic() < deadline:
            done, _ = concurrent.futures.wait(screening, timeout=1.0, return_when="FIRST_COMPLETED")
            for future in done:
                index = screening.pop(future)
                screens[index] = finished(future)
                if median_ratio(screens[index]) is not None:
                    timed.add(index)
                if index in timed and candidate_ms(screens[index]) >= args.repeat_min_ms:
                    task, code, _ = workload[index]
                    retimes[index] = [evaluator.submit(task, code + SECOND, settings[0])]
                    for setting in settings[1:]:
                        retimes[index] += [
                            evaluator.submit(task, code + tail, setting) for tail in (FIRST, SECOND)
                        ]
            screen_more()
        pending = [future for futures in retimes.values() for future in futures]
        concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        results = {
            index: [finished(f) if f.done() else None for f in futures] for index, futures in retimes.items()
        }
    runs = []
    for number, setting in enumerate(settings):
        pairs = []
        for index, later in results.items():
            pair = [screens[index], later[0]] if number == 0 else later[2 * number - 1 : 2 * number + 1]
            pairs.append({"row": index, **repeat_row(workload[index][2], pair[0], pair[1])})
        screened = Counter(str(r.verdict) if r else "not evaluated" for r in screens.values())
        runs.append(
            summarise_repeat(
                pairs,
                settings=named_settings(setting, overrides[number]),
                screened={
                    "candidates": len(screens),
                    # correct and timed, but shorter than --repeat-min-ms: not timed again
                    "below_min_ms": len(timed) - len(results),
                    "verdicts": dict(screened),
                    "rows": [first_row, max(screens, default=first_row - 1) + 1],
                    "by_row": {str(i): str(r.verdict) if r else "not evaluated" for i, r in screens.items()},
                },
            )
        )
    for run in runs:
        run["nvidia_smi_mean_utilization_pct"] = util.mean
        run["nvidia_smi_sm_clock_mhz"] = util.clock_mhz
    return runs


def finished(future: concurrent.futures.Future[EvaluationResult]) -> EvaluationResult | None:
    try:
        return future.result(timeout=0)
    except Exception:  # cancelled with the evaluator, or failed: not evaluated
        return None


def repeat_row(name: str, first: EvaluationResult | None, second: EvaluationResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"task": name}
    ratios = [median_ratio(r) for r in (first, second)]
    if ratios[0] and ratios[1] and first is not None and first.candidate is not None:
        # The ratio of the two medians, whether or not the evaluator reported it as a speedup:
        # a candidate as fast as its reference is timed all the same, and how well two
        # processes agree on it is the figure wanted.
        row.update(
            first=round(ratios[0], 4),
            second=round(ratios[1], 4),
            reported=[r.speedup is not None for r in (first, second) if r is not None],
            first_ci=first.speedup_ci,
            candidate_ms=round(first.candidate.median_ms, 4),
            reference_iqr=[iqr_share(r.reference) for r in (first, second) if r is not None],
            candidate_iqr=[iqr_share(r.candidate) for r in (first, second) if r is not None],
            disagreement=round(abs(ratios[0] / ratios[1] - 1), 4),
            # The candidate's own time, re-timed in fresh processes: the reference's modes stay out.
            candidate_disagreement=round(abs(candidate_ms(first) / candidate_ms(second) - 1), 4)
            if candidate_ms(second)
            else None,
            timing_s=[round(r.stages.get("timing", 0.0), 2) for r in (first, second) if r is not None],
            samples=[samples_of(r) for r in (first, second) if r is not None],
        )
    else:
        row["verdicts"] = [str(r.verdict) if r else "not evaluated" for r in (first, second)]
    # Why a side has no speedup: its reasons, and the end of its log when it failed.
    row["why"] = [
        {"reasons": list(r.reasons)[:4], "log": (r.log or "")[-600:] if r.verdict != "correct" else ""}
        for r in (first, second)
        if r is not None and not r.speedup
    ]
    return row


def named_settings(setting: EvalConfig, overrides: dict[str, str | None]) -> dict[str, Any]:
    return {"lane_slots": setting.lane_slots, **{k: lookup(setting, k) for k in overrides}}


def samples_of(result: EvaluationResult) -> dict[str, list[float]]:
    """Both sides' timed calls in order (ms, 4 decimals), when the evaluator kept them; on a GPU
    also the same calls on the caller's stream alone (`<side>_stream`)."""
    calls: dict[str, list[float]] = {}
    for side, timing in (("reference", result.reference), ("candidate", result.candidate)):
        if timing is None:
            continue
        calls[side] = [round(v, 4) for v in (timing.samples_ms or [])]
        if timing.stream_samples_ms is not None:
            calls[f"{side}_stream"] = [round(v, 4) for v in timing.stream_samples_ms]
    return calls


def summarise_repeat(rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    big = sorted(r["disagreement"] for r in rows if "disagreement" in r and r["candidate_ms"] >= 0.05)
    every = sorted(r["disagreement"] for r in rows if "disagreement" in r)
    own = sorted(
        r["candidate_disagreement"]
        for r in rows
        if r.get("candidate_disagreement") is not None and r["candidate_ms"] >= 0.05
    )
    return {
        **extra,
        "tasks": len(rows),
        "timed_pairs": len(every),
        "pairs_50us_and_up": len(big),
        "p50_disagreement_50us_and_up": quantile(big, 0.5),
        "p90_disagreement_50us_and_up": quantile(big, 0.9),
        "p90_disagreement_all": quantile(every, 0.9),
        "p50_candidate_time_disagreement_50us_and_up": quantile(own, 0.5),
        "p90_candidate_time_disagreement_50us_and_up": quantile(own, 0.9),
        "timing_seconds_per_evaluation": quantile(
            [t for r in rows if "disagreement" in r for t in r.get("timing_s", [])], 0.5
        ),
        "rows": rows,
    }


def candidate_ms(result: EvaluationResult | None) -> float:
    """The candidate's median call (ms), 0 when it was not timed."""
    return result.candidate.median_ms if result is not None and result.candidate is not None else 0.0


def median_ratio(result: EvaluationResult | None) -> float | None:
    """Reference median over candidate median for a correct candidate timed on both sides."""
    if result is None or result.verdict != "correct" or not result.reference or not result.candidate:
        return None
    return result.reference.median_ms / result.candidate.median_ms if result.candidate.median_ms else None


def iqr_share(timing: Any) -> float | None:
    return round(timing.iqr_ms / timing.median_ms, 4) if timing and timing.median_ms else None


def environment(device: str) -> dict[str, Any]:
    # Probing the device starts the sandbox's zygote (torch imported once per benchmark
    # process) before either mode runs, so that neither pays for it.
    with Evaluator(EvalConfig(device=device)) as evaluator:
        env = evaluator.environment
    return {
        "gpu": env.device,
        "gpu_class": env.gpu_class,
        "driver": env.driver,
        "torch": env.torch,
        "cuda": env.cuda,
        "cpus": os.cpu_count(),
        "evaluator_version": EVALUATOR_VERSION,
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def throughput_markdown(t: dict[str, Any]) -> list[str]:
    w = t["workload"]
    modes: dict[str, dict[str, Any]] = t["modes"]
    lines = [
        f"## Throughput ({t['candidates']} candidates, the same in every mode, {t['trials']} timed rounds, "
        "cold build caches)",
        "",
        f"Workload: of {w['matching_rows']} published kernels whose task exists, sorted by (level, task id), "
        f"row floor((i + 0.5) * M / N) for i < N: levels {cell(w['levels'])}"
        + (f" (missing: {', '.join(w['missing_levels'])})" if w["missing_levels"] else "")
        + f"; {w['native_builds']} of {t['candidates']} build C++/CUDA. Tasks: {', '.join(w['task_ids'])}."
        + (
            f" Candidates {t['slice'][0]}-{t['slice'][1] - 1} of N only (--throughput-slice)."
            if t.get("slice")
            else ""
        ),
        "",
        "| mode | finished / N | wall s | evaluations per GPU-hour | median s per candidate "
        "| timing lane busy: whole / while queue full (queue-full s) | nvidia-smi mean % | verdicts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in modes.items():
        lane = m.get("lane")
        busy = "-"
        if lane:
            busy = f"{cell(lane['busy_share_whole'])} / {cell(lane['busy_share_queue_full'])}"
            busy += f" ({lane['queue_full_s']})"
        status = "" if m["status"] == "complete" else f" ({m['status']})"
        lines.append(
            f"| {name} | {m['finished']} / {m['candidates']}{status} | {m['wall_s']} | "
            f"{cell(m['evaluations_per_gpu_hour'])} | {cell(m['median_seconds_per_candidate'])} | {busy} | "
            f"{cell(m['nvidia_smi_mean_utilization_pct'])}{clock_note(m.get('nvidia_smi_sm_clock_mhz'))} | "
            f"{cell(m['verdicts'])} |"
        )
    lines.append("")
    for name, value in t.get("ratios", {}).items():
        lines.append(f"- {name}: {cell(value)}x")
    for note in t.get("notes", []):
        lines.append(f"- note: {note}")
    lines.append("")
    evaluator_modes = [n for n, m in modes.items() if "stages" in m]
    if evaluator_modes:
        names = list(STAGES) + sorted({s for n in evaluator_modes for s in modes[n]["stages"]} - set(STAGES))
        lines += [
            "Seconds per stage (median per evaluation / total):",
            "",
            "| stage | " + " | ".join(evaluator_modes) + " |",
            "| --- |" + " --- |" * len(evaluator_modes),
        ]
        for stage in names:
            cells = []
            for name in evaluator_modes:
                s = modes[name]["stages"].get(stage)
                cells.append(f"{s['median_s']} / {s['total_s']}" if s else "-")
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        lines.append("")
    for name in evaluator_modes:
        lines += candidate_table(name, modes[name].get("per_candidate", []))
    if "kernelbench" in modes:
        k = modes["kernelbench"]
        lines += [
            f"KernelBench's harness: {k['compiled']} compiled, {k['correct']} correct of {k['finished']} "
            f"finished; phase 1 (compile, {cell(k.get('compile_workers'))} processes) "
            f"{cell(k.get('phase1_compile_s'))} s, phase 2 (one process per candidate) "
            f"{cell(k.get('phase2_evaluate_s'))} s" + (f"; {k['note']}" if k.get("note") else "") + ".",
            "",
        ]
    return lines


def clock_note(clock: dict[str, float] | None) -> str:
    return f" (SM clock p10 {clock['p10']:.0f}, median {clock['median']:.0f} MHz)" if clock else ""


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def candidate_table(mode: str, rows: list[dict[str, Any]]) -> list[str]:
    """Each timed candidate of a mode: its speedup and interval, both medians with their spread
    (IQR over median), rounds, and its timing and re-check seconds; a wide spread or a long
    timing shows at a glance."""
    timed = [r for r in rows if r.get("reference") and r.get("candidate")]
    if not timed:
        return []
    lines = [
        f"Timed candidates, {mode}:",
        "",
        "| task | speedup (95% interval) | reference ms (IQR / median) | candidate ms (IQR / median) "
        "| rounds | timing s | re-check s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in timed:
        ref, cand, stages = r["reference"], r["candidate"], r.get("stages", {})
        interval = r.get("speedup_ci")
        speedup = "none" if r.get("speedup") is None else f"{r['speedup']:.3f}"
        if interval:
            speedup += f" ({interval[0]:.3f}-{interval[1]:.3f})"

        def side(t: dict[str, Any]) -> str:
            return f"{t['median_ms']:.4g} ({t['iqr_ms'] / t['median_ms']:.1%})" if t["median_ms"] else "-"

        lines.append(
            f"| {r['task']} | {speedup} | {side(ref)} | {side(cand)} | {ref['trials']} | "
            f"{seconds(stages.get('timing'))} | {seconds(stages.get('recheck'))} |"
        )
    return [*lines, ""]


def variants_markdown(v: dict[str, Any]) -> list[str]:
    lines = [
        f"## Many candidates per task ({len(v['tasks'])} tasks x {v['variants_per_task']} variants, "
        "the same candidate in each task's variants)",
        "",
        "| mode | finished / N | wall s | evaluations per GPU-hour | timing-lane s per candidate "
        "| lane busy: whole / while queue full | notes | variants' speedups apart: p50 / p90 "
        "(50 us and more: p50 / p90, tasks) | verdicts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in v["modes"].items():
        if "note" in m:
            lines.append(f"| {name} | not run: {m['note']} | | | | | | | |")
            continue
        lane, apart = m.get("lane") or {}, m.get("variant_spread") or {}
        lines.append(
            f"| {name} | {m['finished']} / {m['candidates']} | {m['wall_s']} | "
            f"{cell(m['evaluations_per_gpu_hour'])} | {cell(m.get('timing_s_per_candidate'))} | "
            f"{cell(lane.get('busy_share_whole'))} / {cell(lane.get('busy_share_queue_full'))} | "
            f"{cell(m.get('notes'))} | {cell(apart.get('p50'))} / {cell(apart.get('p90'))} "
            f"({cell(apart.get('p50_50us_and_up'))} / {cell(apart.get('p90_50us_and_up'))}, "
            f"{apart.get('tasks_50us_and_up')}) | {cell(m['verdicts'])} |"
        )
    lines += [
        "",
        f"Rate of each later mode over the first: {cell(v.get('rate_ratios'))}. "
        f"Tasks: {', '.join(v['tasks'])}.",
        "",
    ]
    return lines


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Reward-service benchmark, {env['date'][:10]}",
        "",
        f"{env['gpu']} (driver {env['driver']}), {env['cpus']} CPUs, torch {env['torch']}, "
        f"CUDA {env['cuda']}, "
        f"evaluator {env['evaluator_version']}, commit `{env['commit']}`. Workload: CUDA-L1's published H100 "
        "kernels on their KernelBench v0 tasks.",
        "",
    ]
    if "throughput" in report:
        lines += throughput_markdown(report["throughput"])
    if "variants" in report:
        lines += variants_markdown(report["variants"])
    for r in report.get("repeat", []):
        lines += [
            f"## Repeatability ({r['tasks']} tasks, each candidate timed in two fresh processes, "
            f"{r.get('settings', {})})",
            "",
            f"Screened: {r.get('screened', {}).get('candidates', '-')} published kernels in file order "
            f"(rows {r.get('screened', {}).get('rows', '-')}), "
            f"verdicts {r.get('screened', {}).get('verdicts', {})}; the correct ones were timed again"
            + (
                f", except {r['screened']['below_min_ms']} shorter than --repeat-min-ms"
                if r.get("screened", {}).get("below_min_ms")
                else ""
            )
            + ".",
            "",
            f"|s1/s2 - 1| over {r['pairs_50us_and_up']} candidates of 50 us and more: p50 "
            f"{r['p50_disagreement_50us_and_up']}, p90 {r['p90_disagreement_50us_and_up']} "
            f"(all {r['timed_pairs']} "
            f"timed: p90 {r['p90_disagreement_all']}); the candidate's own time |c1/c2 - 1| over the same: "
            f"p50 {r.get('p50_candidate_time_disagreement_50us_and_up', '-')}, "
            f"p90 {r.get('p90_candidate_time_disagreement_50us_and_up', '-')}; nvidia-smi mean "
            f"{cell(r.get('nvidia_smi_mean_utilization_pct'))}%"
            f"{clock_note(r.get('nvidia_smi_sm_clock_mhz'))}; "
            f"timing seconds per evaluation (median) {cell(r.get('timing_seconds_per_evaluation'))}" + ".",
            "",
            "| task | first | second | disagreement | candidate time disagreement | candidate ms "
            "| reference IQR/median | candidate IQR/median |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            if "disagreement" in row:
                sides = ("reference_iqr", "candidate_iqr")
                iqrs = [" / ".join(cell(v) for v in row.get(side, [])) for side in sides]
                lines.append(
                    f"| {row['task']} | {row['first']} | {row['second']} | {row['disagreement']} "
                    f"| {cell(row.get('candidate_disagreement'))} | {row['candidate_ms']} "
                    f"| {iqrs[0]} | {iqrs[1]} |"
                )
        lines.append("")
    return "\n".join(lines)


def split_samples(report: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The report without the repeat rows' timed calls, and those calls per run: [{settings,
    rows: [{task, row, candidate_ms, samples: [first, second]}]}]."""
    plain = {**report}
    runs: list[dict[str, Any]] = []
    if "repeat" in report:
        plain["repeat"] = []
        for run in report["repeat"]:
            rows = [{k: v for k, v in row.items() if k != "samples"} for row in run["rows"]]
            plain["repeat"].append({**run, "rows": rows})
            timed = [
                {k: row[k] for k in ("task", "row", "candidate_ms", "samples") if k in row}
                for row in run["rows"]
                if row.get("samples")
            ]
            runs.append({"settings": run.get("settings", {}), "rows": timed})
    return plain, [run for run in runs if run["rows"]]


def grouped(paths: dict[str, Any]) -> dict[str, Any]:
    """Settings by path (`timing.processes`) as EvalConfig's groups: {"timing": {"processes": ...}}."""
    out: dict[str, Any] = {}
    for path, value in paths.items():
        out = merged(out, nest(path, value))
    return out


def config_overrides(text: str) -> dict[str, str | None]:
    """`timing.processes=1,lane_slots=2,timing.processes_max=none` -> {"timing.processes": "1", ...}:
    EvalConfig settings by path; EvalConfig checks and converts the values."""
    if not text.strip():
        return {}
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    bad = [item for item in pairs if len(item) != 2 or item[0].strip() not in leaf_fields(EvalConfig)]
    if bad:
        raise argparse.ArgumentTypeError(f"expected PATH=VALUE pairs of EvalConfig settings, got {bad}")
    return {key.strip(): None if value.strip().lower() == "none" else value.strip() for key, value in pairs}


def config_settings(text: str) -> list[dict[str, str | None]]:
    """`a=1;b=2,c=3` -> one EvalConfig override dict per ';'-separated setting."""
    return [config_overrides(part) for part in text.split(";")]


def index_slice(text: str) -> tuple[int, int]:
    """`0:14` -> (0, 14)."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END, e.g. 0:14") from None
    if not 0 <= first < last:
        raise argparse.ArgumentTypeError(f"{text!r}: START must be at least 0 and below END")
    return first, last


def row_list(text: str) -> list[int]:
    """`3,5,8` -> workload rows."""
    return [int(row) for row in text.split(",") if row.strip()]


def main() -> int:
    started = time.monotonic()  # --max-seconds counts the probe of the device and the loading too
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kernels", default=os.environ.get("KERNELFLEET_CUDA_L1_KERNELS"), help="published-kernel JSONL"
    )
    parser.add_argument("--tasks", default="kernelbench-v0")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--profile", default="kernelbench-v0")
    parser.add_argument("--count", type=int, default=24, help="candidates in the throughput part")
    parser.add_argument(
        "--throughput-slice",
        type=index_slice,
        default=None,
        help="START:END: only these of the --count candidates (the same rows as in a full run), for "
        "a mode that cannot finish them all in one call; the report names the slice",
    )
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma list of: {', '.join(MODES)}; NAME#2 runs a mode again (its spread in the same run)",
    )
    parser.add_argument("--mode-seconds", type=float, default=240.0, help="the most one mode may take")
    parser.add_argument(
        "--kernelbench-src",
        default=os.environ.get("KERNELBENCH_SRC") or str(ROOT / ".kb" / "src"),
        help="folder holding KernelBench's kernelbench package (not in the repository)",
    )
    parser.add_argument(
        "--old-tree",
        default=str(ROOT / ".old"),
        help="the tree of commit 777a4df for the before-pipeline mode (not in the repository)",
    )
    parser.add_argument("--repeat-tasks", type=int, default=40)
    parser.add_argument(
        "--repeat-from",
        type=int,
        default=0,
        help="the repeat part screens from this row of the workload on: a second call carries on "
        "where the first one's screening ended (its report gives the rows screened)",
    )
    parser.add_argument(
        "--repeat-config",
        type=config_settings,
        default=[{}],
        help="EvalConfig settings by path for the repeat part, e.g. lane_slots=1,timing.processes=1; several "
        "settings separated by ';' run side by side",
    )
    parser.add_argument(
        "--repeat-min-ms",
        type=float,
        default=0.0,
        help="time again only candidates whose screening median is at least this (0.05: those the "
        "repeatability goal counts, about a third of v0's); the rest count towards --repeat-tasks "
        "as screened",
    )
    parser.add_argument(
        "--repeat-rows",
        type=row_list,
        default=None,
        help="the repeat part screens exactly these rows of the workload (comma list; a report's "
        "by_row names them), instead of --repeat-from on until --repeat-tasks are correct: to "
        "compare settings on candidates already known to matter, e.g. those of 50 us and up",
    )
    parser.add_argument(
        "--repeat-separate",
        action="store_true",
        help="each --repeat-config setting in an Evaluator (and cold build cache) of its own, one after "
        "another over the same rows, instead of interleaved in one",
    )
    parser.add_argument("--variant-tasks", type=int, default=8, help="tasks in the variants part")
    parser.add_argument("--variants", type=int, default=4, help="candidates per task in the variants part")
    parser.add_argument(
        "--variant-config",
        type=config_settings,
        default=[{}, {"timing.reference_processes": "4"}],
        help="EvalConfig fields of each setting the variants part runs, one after the other, separated "
        "by ';' (the first is the baseline); default: the defaults, then timing.reference_processes=4",
    )
    parser.add_argument(
        "--variant-rows",
        type=row_list,
        default=None,
        help="the variants part takes exactly these rows of the workload (comma list) instead of "
        "--variant-tasks pure-Python ones spread over it: e.g. rows of 50 us and more",
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--lane-slots", type=int, default=4)
    parser.add_argument("--task-timeout", type=float, default=180.0)
    parser.add_argument("--parts", default="throughput,repeat")
    parser.add_argument(
        "--max-seconds", type=float, default=540.0, help="the whole run; parts and modes share it"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="", help="added to the file names: several runs of one day")
    args = parser.parse_args()
    # --max-seconds is a bound: a run still alive a minute past it (a thread that does not let the
    # interpreter exit, as one call on the H200 showed after its last save) prints every
    # thread's stack, so that the cause is on record, and ends.
    faulthandler.dump_traceback_later(args.max_seconds + 60, exit=True)
    if not args.kernels or not Path(args.kernels).is_file():
        parser.error("give --kernels FILE (or $KERNELFLEET_CUDA_L1_KERNELS): the published-kernel JSONL")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    suffix = "" if args.device.startswith("cuda") else f"-{args.device}"
    suffix += f"-{args.tag}" if args.tag else ""
    json_path = out_dir / f"reward_service-{stamp}{suffix}.json"
    md_path = out_dir / f"reward_service-{stamp}{suffix}.md"
    # No machine paths in the report.
    paths = ("out", "kernels", "kernelbench_src", "old_tree")
    arguments = {k: v for k, v in vars(args).items() if k not in paths}
    arguments["old_tree_found"] = (Path(args.old_tree) / "evaluator" / "kernelfleet").is_dir()
    arguments["kernelbench_src_found"] = (Path(args.kernelbench_src) / "kernelbench").is_dir()
    report: dict[str, Any] = {"environment": environment(args.device), "arguments": arguments}
    cuda = args.device.startswith("cuda") and report["environment"]["gpu_class"] != "cpu"

    samples_path = out_dir / f"reward_service-{stamp}{suffix}-samples.json.gz"

    def save() -> None:
        # Timed calls go to a compact file of their own; the report keeps the figures.
        plain, samples = split_samples(report)
        json_path.write_text(json.dumps(plain, indent=1) + "\n")
        md_path.write_text(markdown(report) + "\n")
        if samples:
            calls = {"environment": report["environment"], "runs": samples}
            samples_path.write_bytes(gzip.compress(json.dumps(calls).encode(), mtime=0))

    def saved_throughput(part: dict[str, Any]) -> None:
        report["throughput"] = part
        save()

    save()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    workload = load_workload(Path(args.kernels), args.tasks)
    print(f"{len(workload)} published kernels matched to {args.tasks} tasks", file=sys.stderr)
    beyond = [row for row in args.repeat_rows or [] if not 0 <= row < len(workload)]
    if beyond:
        parser.error(
            f"--repeat-rows {beyond}: the workload has rows 0-{len(workload) - 1}; take rows a report listed"
        )
    weights = {"throughput": 0.5, "variants": 0.25, "repeat": 0.35}
    shares = {part: weights.get(part, 0.3) / sum(weights.get(p, 0.3) for p in parts) for part in parts}
    for part in parts:
        begin = time.monotonic()
        left = args.max_seconds - (begin - started)
        budget = left if part == parts[-1] else args.max_seconds * shares.get(part, 0.5)
        if part == "throughput":
            report["throughput"] = part_throughput(workload, args, budget, cuda, saved_throughput)
        elif part == "variants":
            report["variants"] = part_variants(workload, args, budget)
        elif part == "repeat":
            report["repeat"] = part_repeat(workload, args, budget)
        else:
            print(f"unknown part {part!r}; choose from throughput, variants, repeat", file=sys.stderr)
            return 2
        report.setdefault("seconds", {})[part] = round(time.monotonic() - begin, 1)
        save()
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
