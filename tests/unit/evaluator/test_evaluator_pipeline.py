"""The evaluation pipeline: candidates load and check correctness side by side while one at a
time holds the device's timing lane; cancellation; per-stage times and metrics; the CPU clock
that bounds builds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kernelfleet.core.errors import EvaluationCancelled
from kernelfleet.core.models import Task, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator._cputime import tree_cpu_seconds
from kernelfleet.evaluator._gpugate import GpuGate
from kernelfleet.evaluator._sandbox import detect
from tests.support import evaluator_cases as C
from tests.support.held import observe_holds

MATMUL = Task(name="matmul", code=C.MATMUL_TASK)
# One short batch of timed rounds, no re-timing: fast on the CPU.
ONE_BATCH: dict[str, Any] = {
    "device": "cpu",
    "correctness": {"trials": 1},
    "timing": {
        "trials": 4,
        "warmup": 1,
        "flush_bytes": 0,
        "max_speedup_cv": None,
        "speedup_recheck": None,
        "retries": 0,
    },
}


def test_the_timing_lane_is_lent_to_one_candidate_at_a_time() -> None:
    # The lane alone; the gate is test_gpugate's.
    config = EvalConfig.model_validate(merged({"lane_slots": 3, "timing": {"exclusive": False}}, ONE_BATCH))
    candidates = [C.sleeper(0.15) + f"\n# {index}\n" for index in range(3)]
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch([(MATMUL, code) for code in candidates], progress=False)
        snapshot = evaluator.metrics.snapshot()
    assert [r.verdict for r in results] == [Verdict.CORRECT] * 3, [r.reasons for r in results]
    waits = sorted(r.stages["lane_wait"] for r in results)
    timing = min(r.stages["timing"] for r in results)
    # Three processes were ready together; the lane served them one after another.
    assert waits[-1] >= timing, (waits, timing)
    for result in results:
        assert {"process_start", "reference", "candidate_load", "correctness", "lane_wait", "timing"} <= set(
            result.stages
        )
    assert snapshot["verdicts"] == {"correct": 3}
    # The lane is held around each timing stage (the snapshot rounds to the millisecond).
    # both sides are rounded for display (the busy time to the millisecond): compare within that
    assert snapshot["timing_lane_busy_s"]["0"] >= sum(r.stages["timing"] for r in results) - 1e-2
    assert 0 < snapshot["timing_lane_busy_share"]["0"] <= 1
    assert snapshot["running"] == snapshot["waiting"] == 0


def test_the_gate_closes_for_each_timed_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exclusive timing closes the device's gate around each batch of rounds (the batches of
    an adaptive timing may add up to a minute), never for the whole timing or outside it."""
    batches: list[int] = []
    closes: list[int] = []
    quiet, close = GpuGate.quiet, GpuGate.close

    def counted_quiet(gate: GpuGate, owner: object = None) -> Any:
        batches.append(1)
        return quiet(gate, owner)

    def counted_close(gate: GpuGate, owner: object = None) -> None:
        closes.append(1)
        close(gate, owner)

    monkeypatch.setattr(GpuGate, "quiet", counted_quiet)
    monkeypatch.setattr(GpuGate, "close", counted_close)
    config = EvalConfig.model_validate(merged({"timing": {"exclusive": True}}, ONE_BATCH))
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, C.HONEST)
    assert result.verdict == Verdict.CORRECT, result.reasons
    assert batches and len(closes) == len(batches)


def test_no_neighbours_step_runs_during_a_timed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exclusive lane in the pipeline: while one candidate's batch of rounds is timed, no
    other candidate's GPU step (a request to its judge or its candidate) runs. The drain bound
    is raised so that a step slowed by a loaded machine is waited for, not timed beside."""
    steps: list[tuple[float, float]] = []
    batches: list[tuple[float, float]] = []
    init, step, quiet = GpuGate.__init__, GpuGate.step, GpuGate.quiet

    def patient_init(gate: GpuGate, drain_s: float = 60.0) -> None:
        init(gate, drain_s)

    @contextlib.contextmanager
    def recorded_step(gate: GpuGate, cancel: Any = None, key: object = None) -> Iterator[float]:
        with step(gate, cancel, key) as waited:
            begin = time.monotonic()
            try:
                yield waited
            finally:
                steps.append((begin, time.monotonic()))

    @contextlib.contextmanager
    def recorded_quiet(gate: GpuGate, owner: object = None) -> Iterator[None]:
        with quiet(gate, owner):
            begin = time.monotonic()
            try:
                yield
            finally:
                batches.append((begin, time.monotonic()))

    monkeypatch.setattr(GpuGate, "__init__", patient_init)
    monkeypatch.setattr(GpuGate, "step", recorded_step)
    monkeypatch.setattr(GpuGate, "quiet", recorded_quiet)
    config = EvalConfig.model_validate(
        merged(
            {"lane_slots": 3, "timing": {"exclusive": True}},
            merged(ONE_BATCH, {"correctness": {"trials": 3}}),
        )
    )
    candidates = [C.sleeper(0.02) + f"\n# {index}\n" for index in range(3)]
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch([(MATMUL, code) for code in candidates], progress=False)
    assert [r.verdict for r in results] == [Verdict.CORRECT] * 3, [r.reasons for r in results]
    assert len(batches) >= 3 and steps
    overlaps = [(s, b) for s in steps for b in batches if s[0] < b[1] and s[1] > b[0]]
    assert not overlaps, overlaps


def test_the_judge_makes_the_next_inputs_inside_the_candidates_gpu_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The judge makes the next call's inputs (and places them on the device) while the
    candidate calls. That is GPU work: its answer is read before the call's step ends, never
    after, when another evaluation may hold the gate closed for a timed batch."""
    from kernelfleet.evaluator._protocol import Evaluation

    local = threading.local()
    posted: list[str] = []
    outside: list[str] = []
    meanwhile: list[dict[str, Any]] = []
    step, post, settle = GpuGate.step, Evaluation._post_judge, Evaluation._settle_judge
    ahead = Evaluation._inputs_meanwhile

    @contextlib.contextmanager
    def marked_step(gate: GpuGate, cancel: Any = None, key: object = None) -> Iterator[float]:
        with step(gate, cancel, key) as waited:
            local.in_step = True
            try:
                yield waited
            finally:
                local.in_step = False

    def recorded_post(evaluation: Evaluation, message: dict[str, Any]) -> None:
        posted.append(str(message.get("op")))
        post(evaluation, message)

    def checked_settle(evaluation: Evaluation) -> dict[str, Any]:
        in_step = getattr(local, "in_step", False)
        if evaluation.judge_owes and posted and posted[-1] == "inputs" and not in_step:
            outside.append(posted[-1])
        return settle(evaluation)

    def recorded_ahead(evaluation: Evaluation) -> dict[str, Any] | None:
        request = ahead(evaluation)
        if request is not None:
            meanwhile.append(request)
        return request

    monkeypatch.setattr(GpuGate, "step", marked_step)
    monkeypatch.setattr(Evaluation, "_inputs_meanwhile", recorded_ahead)
    monkeypatch.setattr(Evaluation, "_post_judge", recorded_post)
    monkeypatch.setattr(Evaluation, "_settle_judge", checked_settle)
    config = EvalConfig.model_validate(
        merged({"timing": {"exclusive": True}}, merged(ONE_BATCH, {"correctness": {"trials": 3}}))
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(MATMUL, C.HONEST)
    assert result.verdict == Verdict.CORRECT, result.reasons
    assert meanwhile, posted  # later calls' inputs were made while the candidate called
    assert not outside, outside


def test_cancelling_kills_a_running_evaluation() -> None:
    config = EvalConfig.model_validate(
        {
            "device": "cpu",
            "correctness": {"trials": 2},
            "timing": {"trials": 3, "warmup": 1, "flush_bytes": 0},
        }
    )
    with Evaluator(config) as evaluator:
        future = evaluator.submit(MATMUL, C.sleeper(30.0))
        deadline = time.monotonic() + 120
        while evaluator.state(future) != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        begin = time.monotonic()
        evaluator.cancel(future)
        with pytest.raises(EvaluationCancelled):
            future.result(timeout=60)
        assert time.monotonic() - begin < 20
        assert evaluator.metrics.snapshot()["cancelled"] == 1


def test_cpu_time_counts_the_process_tree_not_the_wall_clock() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    busy = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    idle = "import time; time.sleep(1.5)"
    for code, low, high in ((busy, 0.8, 30.0), (idle, 0.0, 0.5)):
        process = subprocess.Popen([sys.executable, "-c", code])
        peak = 0.0
        while process.poll() is None:
            peak = max(peak, tree_cpu_seconds(process.pid))
            time.sleep(0.05)
        if code is busy:
            assert low <= peak <= high, peak  # the grandchild's CPU time is the parent's
        else:
            assert peak <= high, peak


@pytest.mark.skipif(
    not detect().level.startswith("bubblewrap"), reason="scratch slots are tmpfs mounts of bubblewrap's"
)
def test_a_candidate_that_fills_the_disk_fills_only_its_own_scratch_space() -> None:
    """Hostile: file after file, each under the file-size limit, until the space runs out. At
    the bubblewrap levels each process's scratch is a tmpfs of its own, so a neighbour writing
    most of its share at the same time still passes. (With one tmpfs for all, sized for
    everyone, the hog took the neighbour's share and its write failed.)"""
    scratch = 48 * 1024**2
    until = time.time() + 10  # both hold their files until then
    hold = f"while time.time() < {until!r}:\n    time.sleep(0.05)\n"
    hog = (
        "import time\n"
        "try:\n"
        "    for n in range(100_000):\n"
        "        with open(f'hog-{n}', 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20))\n"
        "except OSError:\n"
        "    pass\n"
    ) + hold
    # The neighbour writes once the hog has had seconds to fill what it can.
    fill = (
        "import time\n"
        f"while time.time() < {until - 5!r}:\n"
        "    time.sleep(0.05)\n"
        f"open('fill', 'wb').write(b'x' * {40 * 1024**2})\n"
    ) + hold
    items = [(MATMUL, hog + C.HONEST + "\n# hog\n"), (MATMUL, fill + C.HONEST + "\n# neighbour\n")]
    config = EvalConfig.model_validate(
        merged({"lane_slots": 2, "compile_workers": 1, "limits": {"scratch_bytes": scratch}}, ONE_BATCH)
    )
    with Evaluator(config) as evaluator:
        _, neighbour = evaluator.evaluate_batch(items, progress=False)
    assert neighbour.verdict == Verdict.CORRECT, (neighbour.reasons, neighbour.log)


def test_evaluations_side_by_side_each_have_their_scratch_space() -> None:
    """Every process the sandbox runs at once has `scratch_bytes` of scratch space: two
    candidates that each fill most of theirs at the same time both pass. (With one
    `scratch_bytes` for all, the second one's write failed with "No space left on device", as
    level-1 tasks' inputs did on the H200.)"""
    scratch = 48 * 1024**2
    until = time.time() + 8  # both hold their file until then: the two writes overlap
    fill = (
        "import time\n"
        f"open('fill', 'wb').write(b'x' * {40 * 1024**2})\n"
        f"while time.time() < {until!r}:\n"
        "    time.sleep(0.05)\n"
    )
    items = [(MATMUL, fill + C.HONEST + f"\n# candidate {i}\n") for i in range(2)]
    config = EvalConfig.model_validate(
        merged({"lane_slots": 2, "compile_workers": 1, "limits": {"scratch_bytes": scratch}}, ONE_BATCH)
    )
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch(items, progress=False)
    for result in results:
        assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)


LARGE_INPUTS_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(1 << 20)]  # 4 MiB


def get_init_inputs():
    return []
"""

LARGE_INPUTS_CANDIDATE = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x + x
"""


def test_each_trials_exchange_files_go_once_judged() -> None:
    """Every correctness trial exchanges its inputs and the candidate's output as files in the
    candidate's scratch space; kept, they filled it before timing began on tasks with large
    inputs (KernelBench 1:5, 1:40 and 1:46 on the H200: the judge's bank write failed with "No
    space left on device" in every run). Here 6 trials of 8 MiB each outgrow a 32 MiB scratch;
    with each trial's files removed once judged, the evaluation passes and is timed."""
    config = EvalConfig.model_validate(
        merged(
            {"lane_slots": 1, "compile_workers": 1, "limits": {"scratch_bytes": 32 * 1024**2}},
            merged(ONE_BATCH, {"correctness": {"trials": 6}}),
        )
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(Task(name="large-inputs", code=LARGE_INPUTS_TASK), LARGE_INPUTS_CANDIDATE)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert result.candidate is not None


HOARDING_CANDIDATE = """
import os
import tempfile

import torch.nn as nn

# Hostile to the clean-up: the exchange directory becomes a link to one of the candidate's
# own, and every exchange file it sees is hard-linked into a hoard, so the judge's removal of
# a judged file takes a name and never the data the candidate holds.
_SCRATCH = tempfile.gettempdir()
_REAL = os.path.join(_SCRATCH, "xchg-real")
_HOARD = os.path.join(_SCRATCH, "hoard")
os.rename(os.path.join(_SCRATCH, "xchg"), _REAL)
os.symlink(_REAL, os.path.join(_SCRATCH, "xchg"))
os.makedirs(_HOARD, exist_ok=True)


class ModelNew(nn.Module):
    def forward(self, x):
        for name in os.listdir(_REAL):
            try:
                os.link(os.path.join(_REAL, name), os.path.join(_HOARD, name))
            except OSError:
                pass
        return x + x
"""


def test_a_candidate_that_tampers_with_its_exchange_files_changes_no_verdict() -> None:
    """Hostile: the judge removes judged files from a directory the candidate owns. The candidate
    swaps that directory for a link and hard-links every file into a hoard: the removal still
    takes only names the judge chose, in the directory it already writes, and the honest
    arithmetic is judged correct and timed."""
    config = EvalConfig.model_validate(
        merged({"lane_slots": 1, "compile_workers": 1}, merged(ONE_BATCH, {"correctness": {"trials": 3}}))
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(Task(name="large-inputs", code=LARGE_INPUTS_TASK), HOARDING_CANDIDATE)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert result.candidate is not None


SEES_THE_NEXT_INPUTS = """
import os
import tempfile
import time

import torch.nn as nn

_XCHG = os.path.join(tempfile.gettempdir(), "xchg")


class ModelNew(nn.Module):
    def forward(self, x):
        time.sleep(0.5)  # room for the judge to finish the next set
        sets = [name for name in os.listdir(_XCHG) if name.startswith("in-")]
        raise RuntimeError(f"input sets: {len(sets)}")  # a runtime error's reason says it
"""


def test_the_judge_makes_the_next_inputs_while_the_candidate_calls() -> None:
    """The judge is idle while the candidate calls, and making inputs is a third of a correctness
    call on tasks with large inputs: the next call's set is made meanwhile, so a call sees its
    own set and the next one in the exchange directory. Scratch permitting: with a 32 MiB
    scratch, these 4 MiB sets wait their turn, as before."""
    task = Task(name="large-inputs", code=LARGE_INPUTS_TASK)
    config = EvalConfig.model_validate(
        merged({"lane_slots": 1, "compile_workers": 1, "timing": {"enabled": False}}, ONE_BATCH)
    )
    seen = {}
    for arm, scratch in (("ahead", config.limits.scratch_bytes), ("in turn", 32 * 1024**2)):
        with Evaluator(
            EvalConfig.model_validate(merged(config.model_dump(), {"limits": {"scratch_bytes": scratch}}))
        ) as evaluator:
            result = evaluator.evaluate(task, SEES_THE_NEXT_INPUTS)
        assert result.verdict == Verdict.RUNTIME_ERROR, result.reasons
        seen[arm] = " ".join(result.reasons)
    assert "input sets: 2" in seen["ahead"], seen
    assert "input sets: 1" in seen["in turn"], seen


DIES_ON_ITS_THIRD_CALL = """
import os

import torch.nn as nn

_CALLS = [0]


class ModelNew(nn.Module):
    def forward(self, x):
        _CALLS[0] += 1
        if _CALLS[0] == 3:
            os._exit(3)  # while the judge makes the next call's inputs
        return x + x
"""


def test_a_candidate_dying_while_the_judge_makes_inputs_is_crashed_and_the_next_is_judged() -> None:
    """The judge's answer for inputs made meanwhile is still owed when the candidate dies: the
    verdict is the candidate's (crashed), and the evaluator goes on to judge the next one."""
    task = Task(name="large-inputs", code=LARGE_INPUTS_TASK)
    config = EvalConfig.model_validate(
        merged(
            {"lane_slots": 1, "compile_workers": 1, "timing": {"enabled": False}},
            merged(ONE_BATCH, {"correctness": {"trials": 4}}),
        )
    )
    with Evaluator(config) as evaluator:
        died = evaluator.evaluate(task, DIES_ON_ITS_THIRD_CALL)
        honest = evaluator.evaluate(task, LARGE_INPUTS_CANDIDATE)
    assert died.verdict == Verdict.RUNTIME_ERROR and any("crashed" in r for r in died.reasons), died.reasons
    assert honest.verdict == Verdict.CORRECT, (honest.reasons, honest.log)


PLANTS_EXCHANGE_NAMES = """
import os
import tempfile

import torch.nn as nn

_XCHG = os.path.join(tempfile.gettempdir(), "xchg")


class ModelNew(nn.Module):
    def forward(self, x):
        # Hostile: take first every name the judge might write next (the judge never writes
        # through an existing name), hoping its write fails as the judge's own error.
        for index in range(1, 80):
            for stem in ("in", "out", "traced", "traced-out", "kernels", "bank", "round"):
                for name in (f"{stem}-{index}", f"{stem}-{index - 1}"):
                    try:
                        open(os.path.join(_XCHG, name), "x").close()
                    except OSError:
                        pass
        return x + x
"""


def test_a_candidate_that_plants_exchange_names_changes_no_verdict() -> None:
    """Exchange names carry a random part, so a candidate cannot take the judge's next name first:
    the honest arithmetic is judged correct and timed, not failed as a judge error."""
    config = EvalConfig.model_validate(
        merged({"lane_slots": 1, "compile_workers": 1}, merged(ONE_BATCH, {"correctness": {"trials": 3}}))
    )
    with Evaluator(config) as evaluator:
        result = evaluator.evaluate(Task(name="large-inputs", code=LARGE_INPUTS_TASK), PLANTS_EXCHANGE_NAMES)
    assert result.verdict == Verdict.CORRECT, (result.reasons, result.log)
    assert result.candidate is not None


# An honest candidate, slow in each call, that leaves a process of its own running between calls
# (a thread would be rejected, `threads-started`; a process, or a native thread, is not): on a
# GPU it could launch kernels beside a neighbour's timed batch.
BACKGROUND_PROCESS = (
    C.sleeper(0.3)
    + """
import os

if os.fork() == 0:
    while True:
        time.sleep(0.001)
"""
)


def test_a_candidates_own_process_is_stopped_while_a_neighbour_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """From its load on, a candidate's process and those below it are held: during each of
    another candidate's timed batches they are stopped (unless a request of its own is running),
    so nothing of theirs reaches the device then; they run on afterwards and the evaluations are
    unharmed."""
    seen = observe_holds(monkeypatch)
    config = EvalConfig.model_validate(
        merged(
            {"lane_slots": 3, "timing": {"exclusive": True}},
            merged(ONE_BATCH, {"correctness": {"trials": 3}}),
        )
    )
    candidates = [BACKGROUND_PROCESS, C.sleeper(0.01) + "\n# 1\n", C.sleeper(0.01) + "\n# 2\n"]
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch([(MATMUL, code) for code in candidates], progress=False)
    assert [r.verdict for r in results] == [Verdict.CORRECT] * 3, [r.reasons for r in results]
    assert any(stopped >= 2 for stopped, _ in seen), f"no timed batch held the forking candidate: {seen}"
    assert {letter for _, letter in seen} == {"T"}, seen
