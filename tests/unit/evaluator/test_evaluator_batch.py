"""Batch evaluation: order, deduplication, the result cache, resume after a kill, and the
verdicts for crashes, hangs, out-of-memory, broken tasks and native builds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.models import EvaluationResult, ResultKey, Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import DirectoryResultCache, EvalConfig, Evaluator
from kernelfleet.evaluator import reasons as R
from kernelfleet.evaluator._evaluator import build_jobs
from kernelfleet.evaluator._protocol import BUILD_NICENESS
from tests.support import evaluator_cases as C

ROOT = Path(__file__).resolve().parents[3]
FAST: dict[str, Any] = {
    "device": "cpu",
    "correctness": {"trials": 2},
    "timing": {
        "trials": 3,
        "warmup": 1,
        "flush_bytes": 0,
        "max_speedup_cv": None,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
    },
}
MATMUL = Task(name="matmul", code=C.MATMUL_TASK)


class CountingCache(DirectoryResultCache):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hits = 0
        self.puts = 0

    def get(self, key: ResultKey) -> EvaluationResult | None:
        found = super().get(key)
        self.hits += found is not None
        return found

    def put(self, result: EvaluationResult) -> None:
        self.puts += 1
        super().put(result)


def test_batch_keeps_order_dedupes_and_caches(tmp_path: Path) -> None:
    items = [
        (MATMUL, C.HONEST),
        (MATMUL, C.INPUT_MUTATION_HACK),
        (MATMUL, C.SYNTAX_ERROR),
        (MATMUL, C.HONEST + "\n\n"),
    ]
    cache = CountingCache(tmp_path / "cache")
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        first = evaluator.evaluate_batch(items, cache=cache, progress=False)
        assert [r.verdict for r in first] == [
            Verdict.CORRECT,
            Verdict.REJECTED,
            Verdict.COMPILE_ERROR,
            Verdict.CORRECT,
        ]
        assert first[0] is first[3]  # the same normalised source is evaluated once
        assert R.SYNTAX_ERROR in R.codes(first[2].reasons)
        assert cache.puts == 3 and len(cache) == 3
        for (task, code), result in zip(items, first, strict=True):
            assert result.key == evaluator.key_for(task, code)
        again = evaluator.evaluate_batch(items, cache=cache, progress=True)
    assert cache.hits == 3 and cache.puts == 3
    assert [r.model_dump() for r in again] == [r.model_dump() for r in first]


def test_result_environment_and_version(tmp_path: Path) -> None:
    with Evaluator(
        EvalConfig.model_validate(merged({"correctness": {"profile": "kernelbench-v0"}}, FAST))
    ) as evaluator:
        result = evaluator.evaluate(MATMUL, C.HONEST)
    env = result.environment
    assert env.device == "cpu" and env.gpu_class == "cpu" and env.torch
    assert env.evaluator_version.endswith("+kernelbench-v0.pairs1")  # FAST times in one process pair
    assert result.profile == "kernelbench-v0"
    assert result.key.path().startswith("results/")


@pytest.mark.parametrize(
    ("candidate", "overrides", "verdict", "code"),
    [
        (C.HANGS, {"limits": {"timeout_seconds": 3.0}}, Verdict.TIMEOUT, R.TIMEOUT),
        (C.SEGFAULT, {}, Verdict.RUNTIME_ERROR, R.CRASHED),
        (C.OUT_OF_MEMORY, {}, Verdict.RUNTIME_ERROR, R.OUT_OF_MEMORY),
        (C.RAISES, {}, Verdict.RUNTIME_ERROR, R.RUNTIME_ERROR),
        (C.IMPORT_ERROR, {}, Verdict.COMPILE_ERROR, R.IMPORT_ERROR),
        (C.NO_MODELNEW, {}, Verdict.COMPILE_ERROR, R.MISSING_MODELNEW),
        (C.WRONG_RESULT, {}, Verdict.INCORRECT, R.OUTPUT_MISMATCH),
        (C.WRONG_DTYPE, {}, Verdict.INCORRECT, R.DTYPE_MISMATCH),
    ],
    ids=["hang", "segfault", "oom", "raises", "import-error", "no-modelnew", "wrong", "dtype"],
)
def test_failures_cost_the_candidate_alone(
    candidate: str, overrides: dict[str, Any], verdict: Verdict, code: str
) -> None:
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        # The failing candidate with its own limits; the honest one after it in the same
        # evaluator (and sandbox), with the defaults: a loaded machine may take more than the
        # hang's few seconds to judge it.
        failing = evaluator.submit(
            MATMUL, candidate, EvalConfig.model_validate(merged(evaluator.config.model_dump(), overrides))
        )
        honest = evaluator.submit(MATMUL, C.HONEST)
        results = [failing.result(), honest.result()]
    assert results[0].verdict == verdict, results[0].reasons
    assert code in R.codes(results[0].reasons)
    assert results[0].speedup is None
    assert results[1].verdict == Verdict.CORRECT, results[1].reasons  # the next one is unaffected


def test_a_broken_task_is_reported_and_never_cached(tmp_path: Path) -> None:
    cache = CountingCache(tmp_path)
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        result = evaluator.evaluate_batch([(Task(name="broken", code=C.BROKEN_TASK), C.HONEST)], cache=cache)[
            0
        ]
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert R.codes(result.reasons) == {R.REFERENCE_ERROR}
    assert cache.puts == 0


def test_a_native_build_that_outlives_its_timeout_is_killed(tmp_path: Path) -> None:
    config = EvalConfig.model_validate(
        merged({"cache_dir": str(tmp_path), "limits": {"compile_timeout_s": 1.0}}, FAST)
    )
    started = time.monotonic()
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, C.CPP_KERNEL.replace("kf_test_relu_mm", "kf_test_timeout"))
    assert result.verdict == Verdict.TIMEOUT
    assert "building" in result.reasons[0]
    assert time.monotonic() - started < 60


def test_a_build_in_the_models_constructor_happens_in_the_build_pool(tmp_path: Path) -> None:
    """The build constructs ModelNew, so a compile in __init__ fails there and the evaluation
    never loads the candidate (the device's slots never wait for nvcc)."""
    config = EvalConfig.model_validate(
        merged({"cache_dir": str(tmp_path), "limits": {"compile_timeout_s": 600.0}}, FAST)
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, C.LAZY_BROKEN_CPP)
    assert result.verdict == Verdict.COMPILE_ERROR, (result.reasons, result.log)
    assert R.codes(result.reasons) == {R.BUILD_ERROR}
    assert "build" in result.stages and "candidate_load" not in result.stages


def test_an_honest_cpp_kernel_builds_in_the_pool_and_passes_require_kernel() -> None:
    """The first run compiles (tens of seconds on 2 cores); the build cache makes reruns fast."""
    config = EvalConfig.model_validate(
        merged(
            {"correctness": {"require_kernel": True}},
            merged(FAST, {"limits": {"compile_timeout_s": 900.0, "timeout_seconds": 300.0}}),
        )
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, C.CPP_KERNEL)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert not R.codes(result.reasons) & R.REJECTING


def test_an_extension_named_after_its_process_is_built_once(tmp_path: Path) -> None:
    """A candidate that names its extension `f"..._{os.getpid()}"` (as 4 published kernels do)
    finds the build pool's build in the evaluation's process and in the re-check's: one build
    directory, not one per process."""
    code = C.CPP_KERNEL.replace("import torch\n", "import os\nimport torch\n", 1).replace(
        'name="kf_test_relu_mm"', 'name=f"kf_test_relu_mm_{os.getpid()}"'
    )
    config = EvalConfig.model_validate(
        merged(
            {"cache_dir": str(tmp_path)},
            merged(
                FAST,
                {
                    "limits": {"compile_timeout_s": 900.0, "timeout_seconds": 300.0},
                    "timing": {"speedup_recheck": 0.0},
                },
            ),
        )
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, code)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert "recheck" in result.stages
    builds = sorted(path.name for path in tmp_path.rglob("kf_test_relu_mm_*") if path.is_dir())
    assert builds == ["kf_test_relu_mm_pid"]


def test_a_failed_build_is_remembered_for_the_evaluation(tmp_path: Path) -> None:
    """A candidate that catches its failed build and falls back is judged on its fallback; the
    compiler's error is recorded in its build directory, and later processes (the build pool's
    and the evaluation's) fail with the record at once instead of compiling again."""
    settings = merged(FAST, {"limits": {"compile_timeout_s": 900.0, "timeout_seconds": 300.0}})
    config = EvalConfig.model_validate(merged({"cache_dir": str(tmp_path)}, settings))
    with Evaluator(config) as evaluator:
        first = evaluator.evaluate(MATMUL, C.FALLBACK_CPP)
        records = list(tmp_path.rglob(".kf-failed-builds/*"))
        assert len(records) == 1
        assert "error" in records[0].read_text()
        # Mark the record: a process that fails from it, not from a compile, says so.
        records[0].write_text("Error building extension 'kf_test_fallback': kf-sentinel error: remembered")
        caught = next(tmp_path.rglob("caught.log"))
        before = caught.read_text().splitlines()
        second = evaluator.evaluate(MATMUL, C.FALLBACK_CPP)  # the build and the evaluation again
    for result in (first, second):
        assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert before[0] == "compiled"
    assert caught.read_text().splitlines()[len(before) :] == ["remembered", "remembered"]


def test_a_build_runs_at_a_low_priority(tmp_path: Path) -> None:
    """The build pool's process (and so its compilers) runs niced, so that it takes no CPU from a
    timing; the evaluation's processes run at the normal priority. The candidate writes the
    priority it sees into its working directory, its build directory, in each process."""
    code = C.HONEST.replace(
        "import torch\n",
        "import os\nimport torch  # no torch.utils.cpp_extension build: it only goes through the pool\n"
        "open(f'niceness-{os.getpriority(os.PRIO_PROCESS, 0)}', 'w').close()\n",
        1,
    )
    config = EvalConfig.model_validate(merged({"cache_dir": str(tmp_path)}, FAST))
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, code)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert "build" in result.stages
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {path.name for path in tmp_path.rglob("niceness-*")}
    assert seen == {f"niceness-{ours}", f"niceness-{max(ours, BUILD_NICENESS)}"}


_RESUMABLE = """
import sys
from pathlib import Path
from kernelfleet.core.models import Task
from kernelfleet.evaluator import DirectoryResultCache, EvalConfig, Evaluator
from tests.support import evaluator_cases as C

cache = DirectoryResultCache(sys.argv[1])
slow = C.HONEST.replace("return torch.relu(torch.mm(A, B))", "import time; time.sleep(60); return A")
items = [(Task(name="m", code=C.MATMUL_TASK), code) for code in (C.HONEST, C.WRONG_RESULT, slow)]
config = EvalConfig.model_validate({
    "device": "cpu",
    "correctness": {"trials": 2},
    "timing": {"trials": 3, "warmup": 1, "flush_bytes": 0, "max_speedup_cv": None, "speedup_recheck": None,
               "processes": 1},
    "limits": {"timeout_seconds": 300},
})
with Evaluator(config) as evaluator:
    evaluator.evaluate_batch(items, cache=cache, progress=False)
"""


def test_a_killed_batch_resumes_from_the_cache(tmp_path: Path) -> None:
    script = tmp_path / "batch.py"
    script.write_text(textwrap.dedent(_RESUMABLE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600  # a bound for a loaded machine, not a timing
        while time.monotonic() < deadline and len(DirectoryResultCache(tmp_path / "cache")) < 2:
            assert process.poll() is None, "the batch ended before it was killed"
            time.sleep(0.2)
        assert len(DirectoryResultCache(tmp_path / "cache")) == 2
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    cache = CountingCache(tmp_path / "cache")
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        results = evaluator.evaluate_batch(
            [(MATMUL, C.HONEST), (MATMUL, C.WRONG_RESULT)], cache=cache, progress=False
        )
    assert cache.hits == 2 and cache.puts == 0
    assert [r.verdict for r in results] == [Verdict.CORRECT, Verdict.INCORRECT]


def test_baselines_on_the_cpu() -> None:
    with Evaluator(
        EvalConfig.model_validate(merged({"timing": {"baseline_modes": ("eager", "cudagraph")}}, FAST))
    ) as evaluator:
        timings, missing = evaluator.baselines_detail(MATMUL)
        assert set(timings) == {"eager"}
        assert timings["eager"].trials == FAST["timing"]["trials"] and timings["eager"].median_ms > 0
        assert "cudagraph" in missing
        assert evaluator.baselines(MATMUL).keys() == {"eager"}


def test_a_full_build_pool_never_starts_more_compilers_than_cpus() -> None:
    for cores in (1, 2, 15, 16, 64):
        for workers in (1, 2, 6, 15, 40):
            assert build_jobs(cores, workers) >= 1
            assert workers * build_jobs(cores, workers) <= max(cores, workers)
    assert build_jobs(16, 1) == 16  # the one build worker of one-at-a-time compiles on every CPU
    assert build_jobs(16, 15) == 1  # the default cores-1 workers: one job each


RECORDS_ITS_BUILD = """
import os
import torch
import torch.nn as nn

# Goes through the build pool (its source names torch.utils.cpp_extension) but compiles nothing.


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        with open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "seen.txt"), "a") as seen:
            seen.write(f"{sorted(os.sched_getaffinity(0))};{os.environ.get('MAX_JOBS')}\\n")

    def forward(self, A, B):
        return torch.relu(torch.mm(A, B))
"""


@pytest.mark.parametrize(("workers", "max_jobs"), [(1, None), (3, None), (3, "7")])
def test_a_build_sees_every_cpu_and_its_share_of_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, max_jobs: str | None
) -> None:
    """What the build process itself sees: every CPU, and MAX_JOBS of its worker's share unless
    the user set MAX_JOBS."""
    if max_jobs is None:
        monkeypatch.delenv("MAX_JOBS", raising=False)
    else:
        monkeypatch.setenv("MAX_JOBS", max_jobs)
    config = EvalConfig.model_validate(merged({"cache_dir": str(tmp_path), "compile_workers": workers}, FAST))
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, RECORDS_ITS_BUILD)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    cpus = sorted(os.sched_getaffinity(0))
    build_line = next(tmp_path.rglob("seen.txt")).read_text().splitlines()[0]
    assert build_line == f"{cpus};{max_jobs or build_jobs(len(cpus), workers)}"


def test_a_loss_a_0_dim_output_is_judged_like_any_other() -> None:
    """KernelBench's loss tasks (1:94-1:100) return a 0-dim tensor; until 0.8.2 its exchange
    file could not be written, and every such candidate came out `harness-broken`."""
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        result = evaluator.evaluate(Task(name="mse", code=C.LOSS_TASK), C.LOSS_CANDIDATE)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)


def test_a_long_evaluation_is_named_with_its_phase_and_whether_it_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The progress line tells a stuck evaluation from a long one: its phase, and the CPU its
    processes used since the last line (a sleep uses none), with the bound that ends it."""
    monkeypatch.setattr("kernelfleet.evaluator._evaluator.SLOW_AFTER_S", 2.0)
    sleeper = C.HONEST.replace("return torch.relu(torch.mm(A, B))", "import time; time.sleep(6); return A")
    seen: list[str] = []
    with Evaluator(EvalConfig(**merged(FAST, {"limits": {"timeout_seconds": 60.0}}))) as evaluator:
        evaluator.evaluate_batch(
            [(MATMUL, sleeper)], progress=False, slow=lambda task, variant, seconds, doing: seen.append(doing)
        )
    assert seen, "no progress line for an evaluation that ran past SLOW_AFTER_S"
    stuck = [line for line in seen if line.startswith("checking correctness")]
    assert stuck and "waiting, or stuck" in stuck[-1] and "60 s evaluation timeout" in stuck[-1]
