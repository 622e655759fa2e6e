"""Adaptive timing: a real speedup is never lost to noise, and every speedup has an interval.

The statistics are checked on synthetic slow/fast pairs (seeded, so they are exact), the whole
protocol on a real CPU pair whose reference does the same work four times."""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kernelfleet.core.models import EvaluationResult, Task, Timing, Verdict
from kernelfleet.core.settings import merged
from kernelfleet.evaluator import EvalConfig, Evaluator
from kernelfleet.evaluator import _evaluator as evaluator_module
from kernelfleet.evaluator import reasons as R
from kernelfleet.evaluator._evaluator import (
    PooledTiming,
    against_pool,
    another_pair,
    fresh_reference_medians,
    pool_pairs,
    recheck_of_pairs,
    uneven_spread,
)
from kernelfleet.evaluator._protocol import Outcome
from kernelfleet.evaluator._reference_pool import ReferencePool, ReferencePools
from kernelfleet.evaluator._timing import AdaptiveTiming, adaptive_timing, decide, speedup_interval
from tests.support import evaluator_cases as C

Measure = Callable[[int, bool], tuple[list[float], list[float]]]


def pair(ratio: float, noise: float, seed: int, drift: float = 0.0) -> tuple[Measure, list[int]]:
    """Reference `ratio` times slower than the candidate, lognormal noise; `drift` slows the
    reference over time (an LSTM whose clocks wander), the case the old bucket gate threw away."""
    rng = random.Random(seed)
    calls: list[int] = []
    clock = [0]

    def measure(rounds: int, first: bool) -> tuple[list[float], list[float]]:
        calls.append(rounds)
        ref, cand = [], []
        for _ in range(rounds):
            clock[0] += 1
            slow = 1.0 + drift * clock[0] / 100
            ref.append(10 * ratio * slow * rng.lognormvariate(0, noise))
            cand.append(10 * rng.lognormvariate(0, noise))
        return ref, cand

    return measure, calls


def run(measure: Measure, extra: int = 7) -> AdaptiveTiming:
    return adaptive_timing(
        measure, trials=100, extra_batches=extra, precision=0.02, max_cv=0.1, budget_s=1e9, seed=3
    )


def test_far_apart_medians_settle_at_once() -> None:
    measure, calls = pair(2.0, 0.03, seed=1)
    timed = run(measure)
    assert timed.settled and len(calls) == 1
    speedup, noisy = decide(timed, 0.1)
    assert noisy is None and speedup is not None and speedup == pytest.approx(2.0, rel=0.02)
    assert timed.estimate.low < speedup < timed.estimate.high


def test_close_medians_take_more_samples_and_keep_the_speedup() -> None:
    measure, calls = pair(1.05, 0.15, seed=2)
    timed = run(measure)
    assert len(calls) > 1, "a 5% difference under 15% noise needs more than one batch"
    speedup, _ = decide(timed, 0.1)
    assert speedup is not None and timed.estimate.separated
    assert timed.estimate.low <= 1.05 <= timed.estimate.high


def test_a_real_speedup_under_drift_is_reported_with_its_interval() -> None:
    # The old gate refused this: the buckets disagree because the reference wandered.
    measure, _ = pair(4.0, 0.05, seed=3, drift=0.3)
    timed = run(measure, extra=1)
    assert not timed.settled and timed.estimate.bucket_cv > 0.1
    speedup, noisy = decide(timed, 0.1)
    assert speedup is not None and timed.estimate.low > 3.5
    assert noisy is not None and "reported with its interval" in noisy


def test_inseparable_timings_report_no_speedup_with_the_figures() -> None:
    measure, calls = pair(1.0, 0.4, seed=4)
    timed = run(measure, extra=2)
    assert len(calls) == 3 and not timed.settled
    speedup, noisy = decide(timed, 0.1)
    assert speedup is None
    assert noisy is not None and "could not separate" in noisy and "95% interval" in noisy
    # Without a gate the figures stand: no refusal.
    assert decide(timed, None)[0] is not None


def test_the_interval_covers_the_truth() -> None:
    rng = random.Random(5)
    covered = 0
    for trial in range(40):
        ref = [10.3 * rng.lognormvariate(0, 0.1) for _ in range(200)]
        cand = [10.0 * rng.lognormvariate(0, 0.1) for _ in range(200)]
        estimate = speedup_interval(ref, cand, seed=trial, resamples=500)
        covered += estimate.low <= 1.03 <= estimate.high
    assert covered >= 34  # 95% nominal; 34 of 40 leaves room for chance


def slow_pair(candidate: str = C.SLOW_TASK_FAST, **settings: Any) -> EvaluationResult:
    """The slow task against its fast candidate (a real speedup of about 4x) on the CPU."""
    config = EvalConfig.model_validate(
        merged(
            {
                "device": "cpu",
                "timing": {"warmup": 2, "flush_bytes": 0, "speedup_recheck": None, "processes": 1},
            },
            settings,
        )
    )
    with Evaluator(config) as evaluator:
        return evaluator.evaluate(Task(name="slow", code=C.SLOW_TASK), candidate)


def test_a_real_cpu_speedup_has_an_interval_above_one() -> None:
    result = slow_pair(correctness={"trials": 2}, timing={"trials": 20, "budget_s": 20.0})
    assert result.verdict == Verdict.CORRECT, result.reasons
    assert result.speedup is not None and result.speedup_ci is not None, result.reasons
    low, high = result.speedup_ci
    assert 1.0 < low <= result.speedup <= high
    assert R.TIMING_NOISY not in R.codes(result.reasons) or "reported with its interval" in " ".join(
        result.reasons
    )
    # The timing's input sets are made before the lane is taken, in a stage of their own.
    assert {"reference", "candidate_load", "correctness", "timing_inputs", "timing"} <= set(result.stages)
    # Correctness in parts: this side's waits, and the judge's own work on the crossing.
    parts = {"correctness_inputs", "correctness_calls", "correctness_compare"}
    parts |= {"judge_inputs_make", "judge_inputs_write", "judge_reference", "judge_compare"}
    assert parts <= set(result.stages)


def test_a_batch_ends_on_time_once_it_has_three_rounds_per_bucket() -> None:
    """A slow kernel's batch stops at `timing_batch_s` (here at once) after 21 rounds, not at
    `timing_trials`: the settle check comes every few seconds. Without the time bound the same
    evaluation times all 60 rounds."""

    def timed_rounds(batch_s: float) -> tuple[int, int]:
        result = slow_pair(correctness={"trials": 1}, timing={"trials": 60, "retries": 0, "batch_s": batch_s})
        assert result.verdict == Verdict.CORRECT, result.reasons
        assert result.reference is not None and result.candidate is not None
        return result.reference.trials, result.candidate.trials

    assert timed_rounds(1e-6) == (21, 21)
    assert timed_rounds(1e6) == (60, 60)


# ---------------------------------------------------------------- a reused reference timing


def light_pair(
    ratio: float, noise: float, seed: int, reference_scale: float = 1.0
) -> tuple[Measure, list[int]]:
    """As `pair`, but the reference runs on every 4th round only (the drift check), and
    `reference_scale` moves it away from where the bank saw it."""
    rng = random.Random(seed)
    checks: list[int] = []

    def measure(rounds: int, first: bool) -> tuple[list[float], list[float]]:
        ref = [10 * ratio * reference_scale * rng.lognormvariate(0, noise) for _ in range(0, rounds, 4)]
        checks.append(len(ref))
        return ref, [10 * rng.lognormvariate(0, noise) for _ in range(rounds)]

    return measure, checks


def bank(ratio: float, noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [10 * ratio * rng.lognormvariate(0, noise) for _ in range(100)]


def run_with_bank(measure: Measure, known: list[float]) -> AdaptiveTiming:
    return adaptive_timing(
        measure,
        trials=100,
        extra_batches=7,
        precision=0.02,
        max_cv=0.1,
        budget_s=1e9,
        seed=3,
        reference_bank=known,
        drift_tolerance=0.02,
    )


def test_a_reused_reference_gives_the_speedup_with_its_interval() -> None:
    measure, checks = light_pair(2.0, 0.03, seed=6)
    timed = run_with_bank(measure, bank(2.0, 0.03, seed=7))
    assert not timed.drifted and checks == [25]
    assert timed.drift is not None and abs(timed.drift) <= 0.02
    assert len(timed.reference) == 125 and len(timed.checks) == 25  # the bank and the checks
    speedup, noisy = decide(timed, 0.1)
    assert noisy is None and speedup == pytest.approx(2.0, rel=0.02)
    assert timed.estimate.low <= 2.0 <= timed.estimate.high


def test_a_reference_that_moved_since_its_bank_is_timed_again() -> None:
    measure, checks = light_pair(2.0, 0.03, seed=8, reference_scale=1.1)
    timed = run_with_bank(measure, bank(2.0, 0.03, seed=9))
    assert timed.drifted and checks == [25]  # one batch, then the caller times both sides
    assert timed.drift is not None and timed.drift > 0.05


def test_an_evaluator_times_a_tasks_reference_once_per_session() -> None:
    config = EvalConfig.model_validate(
        {
            "device": "cpu",
            "correctness": {"trials": 2},
            "timing": {
                "trials": 8,
                "warmup": 1,
                "flush_bytes": 0,
                "speedup_recheck": None,
                "max_speedup_cv": None,
                "retries": 0,
                "reference_reuse": True,
                "reference_drift": 100.0,  # a loaded test machine must not make the drift check decide
            },
        }
    )
    task = Task(name="matmul", code=C.MATMUL_TASK)
    variants = [C.HONEST + f"\n# variant {n}\n" for n in range(2)]
    with Evaluator(config) as evaluator:
        first, second = (evaluator.evaluate(task, code) for code in variants)
    with Evaluator(
        EvalConfig.model_validate(merged(config.model_dump(), {"timing": {"reference_reuse": False}}))
    ) as evaluator:
        fresh = [evaluator.evaluate(task, code) for code in variants]
    assert first.verdict == second.verdict == Verdict.CORRECT, (first.reasons, second.reasons)
    assert R.REFERENCE_REUSED not in R.codes(first.reasons)
    assert R.REFERENCE_REUSED in R.codes(second.reasons), second.reasons
    assert second.speedup is not None and second.speedup_ci is not None
    assert all(R.REFERENCE_REUSED not in R.codes(r.reasons) for r in fresh)


def test_sides_left_unpinned_time_as_pinned_ones() -> None:
    """pin_timing=False: the sides' timing threads run wherever the scheduler puts them; the
    verdict and the speedup stand."""
    result = slow_pair(
        correctness={"trials": 1}, timing={"trials": 5, "max_speedup_cv": None, "pin_cpu": False}
    )
    assert result.verdict == Verdict.CORRECT, result.reasons
    assert result.speedup is not None


# The fast candidate, wrong only where pin_timing puts its timed calls: on a single CPU.
WRONG_WHEN_PINNED = C.SLOW_TASK_FAST.replace(
    "        return torch.tanh(x @ w)",
    "        out = torch.tanh(x @ w)\n"
    "        import os\n"
    "        return torch.zeros_like(out) if len(os.sched_getaffinity(0)) == 1 else out",
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="on one CPU pinned and free look alike")
def test_timed_calls_run_on_one_cpu_and_correctness_calls_do_not() -> None:
    quick: dict[str, Any] = {"correctness": {"trials": 1}, "timing": {"trials": 5, "max_speedup_cv": None}}
    pinned = slow_pair(WRONG_WHEN_PINNED, **quick)
    assert pinned.verdict == Verdict.REJECTED, pinned.reasons
    assert R.CACHED_OUTPUT in R.codes(pinned.reasons), pinned.reasons
    free = slow_pair(WRONG_WHEN_PINNED, **merged({"timing": {"pin_cpu": False}}, quick))
    assert free.verdict == Verdict.CORRECT, free.reasons


def test_a_result_keeps_its_samples_when_asked() -> None:
    result = slow_pair(correctness={"trials": 1}, timing={"trials": 7, "retries": 0, "keep_samples": True})
    assert result.reference is not None and result.candidate is not None, result.reasons
    for timing in (result.reference, result.candidate):
        assert timing.samples_ms is not None and len(timing.samples_ms) == timing.trials == 7
        assert sorted(timing.samples_ms)[3] == pytest.approx(timing.median_ms)
        assert timing.stream_samples_ms is None  # the CPU has no streams
    plain = slow_pair(correctness={"trials": 1}, timing={"trials": 7, "retries": 0})
    assert plain.reference is not None and plain.reference.samples_ms is None


# ---------------------------------------------------------------- several process pairs


def test_two_process_pairs_time_one_candidate_and_their_calls_are_pooled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """timing_processes=2: a second fresh pair times the candidate again; the result holds both
    pairs' calls, names the pairs' own speedups, and its interval spans them. The speedup (about
    4x) reaches speedup_recheck, and the second pair is its re-check: no third pair is timed.
    timeout_seconds bounds the pairs together: the second has what the first left of it. The
    second times a candidate the first proved: it runs one correctness trial, not all."""
    timeouts: list[float] = []
    counted: list[float] = []
    trials: list[int] = []

    class Recorded(evaluator_module.Evaluation):
        def __init__(self, *args: Any, timeout: float, **kwargs: Any) -> None:
            timeouts.append(timeout)
            trials.append(args[2].correctness.trials)
            super().__init__(*args, timeout=timeout, **kwargs)

        def run(self) -> Outcome:
            outcome = super().run()
            counted.append(outcome.counted_s)
            return outcome

    monkeypatch.setattr(evaluator_module, "Evaluation", Recorded)
    result = slow_pair(
        correctness={"trials": 2},
        timing={
            "trials": 7,
            "retries": 0,
            "max_speedup_cv": None,
            "keep_samples": True,
            "processes": 2,
            "speedup_recheck": 1.5,
        },
        limits={"timeout_seconds": 120},
    )
    assert len(timeouts) == 2 and timeouts[0] == 120 and 0 < counted[0] < 120
    assert trials == [2, 1]
    assert timeouts[1] == pytest.approx(120 - counted[0])
    assert result.verdict == Verdict.CORRECT, result.reasons
    codes = set(R.codes(result.reasons))
    assert {R.RECHECKED, R.NOT_REPRODUCIBLE} & codes, result.reasons
    # Pairs that agree keep both pairs' calls; pairs a loaded CPU pulled apart keep the lowest's.
    assert result.candidate is not None and result.candidate.trials == (14 if R.RECHECKED in codes else 7)
    assert "pairs" not in result.environment.evaluator_version  # two pairs are the default
    pooled = [r for r in result.reasons if R.reason_code(r) == R.POOLED]
    assert len(pooled) == 1 and "2 fresh process pairs" in pooled[0], result.reasons
    assert result.speedup is not None and result.speedup_ci is not None
    assert result.speedup_ci[0] <= result.speedup <= result.speedup_ci[1]
    assert result.stages.get("more_pairs", 0.0) > 0 and "recheck" not in result.stages


def test_inputs_too_large_to_bank_ahead_are_banked_with_the_lane_held() -> None:
    """A timing bank is made before the lane is taken only while eight input sets fit the
    candidate's scratch (here they do not: 74 KB of inputs, 512 KiB of scratch); otherwise it
    is made with the lane held, as before 0.8.6, and the timing is the same."""
    result = slow_pair(
        correctness={"trials": 1},
        timing={"trials": 7, "retries": 0, "max_speedup_cv": None},
        limits={"scratch_bytes": 512 * 1024},
    )
    assert result.verdict == Verdict.CORRECT and result.speedup is not None, result.reasons
    assert "timing" in result.stages and "timing_inputs" not in result.stages


def test_a_candidate_that_turns_wrong_in_its_second_process_pair_is_incorrect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second pair runs one correctness trial, not all: a candidate that behaves otherwise
    in a fresh process (here: the second pair is handed wrong code, which a hostile candidate
    could do by keeping state outside its process) is still caught there, not timed."""
    built: list[int] = []

    class Turned(evaluator_module.Evaluation):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(args[2].correctness.trials)
            if len(built) == 2:
                args = (
                    *args[:4],
                    C.SLOW_TASK_FAST.replace("return torch.tanh(x @ w)", "return x @ w"),
                    *args[5:],
                )
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "Evaluation", Turned)
    result = slow_pair(
        correctness={"trials": 3}, timing={"trials": 7, "retries": 0, "max_speedup_cv": None, "processes": 2}
    )
    assert built == [3, 1]
    assert result.verdict == Verdict.INCORRECT and result.speedup is None, result.reasons
    assert any("process pair 2" in text for text in result.reasons), result.reasons


def test_a_second_pair_that_runs_out_of_the_evaluations_timeout_is_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first pair passes; the second is killed at what the first left of timeout_seconds (here
    its outcome says so): the verdict is timeout, and the reason says the limit is the whole
    evaluation's, so that a user raises timeout_seconds rather than hunting a hang."""
    runs: list[int] = []

    class SecondTimesOut(evaluator_module.Evaluation):
        def run(self) -> Outcome:
            runs.append(1)
            if len(runs) == 2:
                return Outcome(None, timed_out=True, seconds=1.0, counted_s=1.0)
            return super().run()

    monkeypatch.setattr(evaluator_module, "Evaluation", SecondTimesOut)
    # max_speedup_cv=None: a loaded CPU's noise must not withhold the speedup that starts pair two.
    result = slow_pair(
        correctness={"trials": 1}, timing={"trials": 7, "retries": 0, "max_speedup_cv": None, "processes": 2}
    )
    assert len(runs) == 2 and result.verdict == Verdict.TIMEOUT, result.reasons
    [reason] = [r for r in result.reasons if R.reason_code(r) == R.TIMEOUT]
    assert "timeout_seconds bounds the whole evaluation; earlier process pairs used" in reason


def pair_answer(reference: list[float], candidate: list[float], stream: bool = True) -> dict[str, Any]:
    answer: dict[str, Any] = {"reference_ms": reference, "candidate_ms": candidate}
    if stream:
        answer |= {"reference_stream_ms": reference, "candidate_stream_ms": candidate}
    return answer


def test_pooled_pairs_give_one_speedup_whose_interval_holds_each_pairs_own() -> None:
    """Two pairs whose processes kept different offsets (2.0x and 2.4x, each tight): the pooled
    speedup is their geometric mean, the sides' medians keep reference over candidate equal to
    it, and the interval, which rounds inside one pair could never widen that far, holds both."""
    rng = random.Random(3)
    first = pair_answer(
        [2.0 + rng.gauss(0, 0.002) for _ in range(30)], [1.0 + rng.gauss(0, 0.001) for _ in range(30)]
    )
    second = pair_answer(
        [2.4 + rng.gauss(0, 0.002) for _ in range(30)], [1.0 + rng.gauss(0, 0.001) for _ in range(30)]
    )
    pooled = pool_pairs([first, second], keep=True)
    assert [round(s, 1) for s in pooled.pair_speedups] == [2.0, 2.4]
    assert pooled.speedup == pytest.approx((pooled.pair_speedups[0] * pooled.pair_speedups[1]) ** 0.5)
    assert pooled.timings[0].median_ms / pooled.timings[1].median_ms == pytest.approx(pooled.speedup)
    assert pooled.interval[0] <= min(pooled.pair_speedups) and pooled.interval[1] >= max(pooled.pair_speedups)
    reference, candidate = pooled.timings
    assert reference.trials == candidate.trials == 60
    assert candidate.samples_ms is not None and candidate.stream_samples_ms is not None
    # A pair without stream figures (the CPU) leaves the pooled timing without them too.
    plain = pool_pairs([first, pair_answer([2.0] * 30, [1.0] * 30, stream=False)], keep=True)
    assert plain.timings[1].stream_samples_ms is None
    assert pooled.describe().startswith("timed in 2 fresh process pairs (2.0")


def pairs_at(*ratios: float) -> PooledTiming:
    """Pairs whose own speedups are `ratios` (tight calls around them), pooled."""
    rng = random.Random(5)
    return pool_pairs(
        [
            pair_answer(
                [r + rng.gauss(0, 0.001) for _ in range(30)], [1.0 + rng.gauss(0, 0.0005) for _ in range(30)]
            )
            for r in ratios
        ],
        keep=False,
    )


def test_several_pairs_are_the_recheck_of_a_large_speedup() -> None:
    """A pair at or above speedup_recheck makes the pairs the re-check (no further pair is timed):
    pairs that agree keep the pooled speedup; pairs that disagree beyond recheck_tolerance are
    not reproducible and the lowest pair counts, as the lower of a timing and its re-check does."""
    config = EvalConfig.model_validate({"timing": {"processes": 2}})
    assert recheck_of_pairs(pairs_at(2.0, 2.1), config) is None
    agree = recheck_of_pairs(pairs_at(4.0, 3.9), config)
    assert agree is not None and agree[1] is None and R.reason_code(agree[0]) == R.RECHECKED
    # One pair fast enough to be re-checked is enough, though the pooled speedup is not.
    apart = recheck_of_pairs(pairs_at(1.2, 5.0), config)
    assert apart is not None and apart[1] == 0 and R.reason_code(apart[0]) == R.NOT_REPRODUCIBLE
    assert "1.20x, then 5.00x" in apart[0]
    assert (
        recheck_of_pairs(
            pairs_at(1.2, 5.0),
            EvalConfig.model_validate({"timing": {"processes": 2, "speedup_recheck": None}}),
        )
        is None
    )


def answer_at(ratio: float) -> dict[str, Any]:
    """One process pair's answer whose ratio of medians is `ratio`."""
    return {"reference_ms": [ratio, ratio, ratio], "candidate_ms": [1.0, 1.0, 1.0]}


def test_pairs_that_disagree_are_timed_again_up_to_the_most() -> None:
    """Below timing_processes a pair always follows; past it, only with timing_processes_max set,
    while the pairs' speedups spread by more than pair_tolerance, never past the most, and never
    without room for it in timeout_seconds."""
    plain = EvalConfig.model_validate({"timing": {"processes": 2}})
    assert another_pair([answer_at(1.0)], plain, 1.0)
    assert not another_pair([answer_at(1.0), answer_at(1.5)], plain, 2.0)  # no most: exactly two
    adaptive = EvalConfig.model_validate(
        {"timing": {"processes": 2, "processes_max": 4, "pair_tolerance": 0.02}}
    )
    assert not another_pair([answer_at(1.00), answer_at(1.015)], adaptive, 2.0)  # they agree
    assert another_pair([answer_at(1.00), answer_at(1.05)], adaptive, 2.0)
    assert another_pair([answer_at(1.00), answer_at(1.05), answer_at(1.02)], adaptive, 3.0)
    four = [answer_at(1.00), answer_at(1.05), answer_at(1.02), answer_at(1.0)]
    assert not another_pair(four, adaptive, 4.0)  # the most
    assert "pairsmax4@0.02" in adaptive.result_version
    # Two pairs took 100 of the 180 s timeout: 80 s left is less than twice a pair's 50 s.
    timed = EvalConfig.model_validate(
        {"timing": {"processes": 2, "processes_max": 4}, "limits": {"timeout_seconds": 180}}
    )
    assert another_pair([answer_at(1.00), answer_at(1.05)], timed, 60.0)
    assert not another_pair([answer_at(1.00), answer_at(1.05)], timed, 100.0)


def test_a_most_below_the_pairs_always_timed_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"timing.processes_max \(2\) is below timing.processes \(3\)"):
        EvalConfig.model_validate({"timing": {"processes": 3, "processes_max": 2}})


def timing(median_ms: float, iqr_share: float) -> Timing:
    return Timing(
        median_ms=median_ms,
        mean_ms=median_ms,
        min_ms=median_ms,
        max_ms=median_ms,
        iqr_ms=median_ms * iqr_share,
        trials=100,
    )


def test_a_side_that_spreads_far_more_than_the_other_is_named() -> None:
    """3:28 on the H200: a reference bound by the host spread 19.7% round to round against its
    candidate's 0.2%, and its speedup moved with the machine's load by more than its interval."""
    note = uneven_spread(timing(1.47, 0.197), timing(1.144, 0.002))
    assert note is not None and R.reason_code(note) == R.UNEVEN_SPREAD
    assert "the reference's calls spread by 19.7%" in note and "the candidate's by 0.2%" in note
    flipped = uneven_spread(timing(0.052, 0.026), timing(0.05, 0.135))  # 2:82's noisy candidate
    assert flipped is not None and "the candidate's calls spread by 13.5%" in flipped
    assert uneven_spread(timing(0.02, 0.037), timing(0.014, 0.057)) is None  # both small, alike
    assert uneven_spread(timing(90.0, 0.2), timing(22.0, 0.05)) is None  # wide, but not 5x the other's
    assert uneven_spread(timing(1.0, 0.08), timing(1.0, 0.001)) is None  # 5x, but under 10%


def test_a_candidate_whose_pairs_disagree_is_timed_in_more_pairs() -> None:
    """End to end on the CPU: a tolerance no two processes meet times the most pairs, and the
    pooled result names them all."""
    result = slow_pair(
        correctness={"trials": 1},
        timing={
            "trials": 5,
            "retries": 0,
            "max_speedup_cv": None,
            "processes": 2,
            "processes_max": 3,
            "pair_tolerance": 1e-9,
        },
    )
    assert result.verdict == Verdict.CORRECT, result.reasons
    pooled = [r for r in result.reasons if R.reason_code(r) == R.POOLED]
    assert len(pooled) == 1 and "3 fresh process pairs" in pooled[0], result.reasons


# ---------------------------------------------------------------- the session's reference pool


def test_a_pool_fills_from_fresh_processes_and_then_only_checks() -> None:
    """The first `size` medians offered make the pool, whatever evaluations they come from; it is
    frozen then, its figure the geometric mean, and a median checks against its range widened by
    the tolerance (2:61's two modes, 0.306 and 0.368 ms on an H100)."""
    pools = ReferencePools()
    assert pools.missing("2:61", 4) == 4
    assert pools.offer("2:61", [0.306, 0.368], 4, 0.05) is None
    assert pools.missing("2:61", 4) == 2
    pool = pools.offer("2:61", [0.307, 0.367, 0.9], 4, 0.05)  # the fifth is not taken
    assert pool is not None and pool.medians_ms == (0.306, 0.368, 0.307, 0.367)
    assert pool.median_ms == pytest.approx((0.306 * 0.368 * 0.307 * 0.367) ** 0.25)
    assert pools.offer("2:61", [0.5], 4, 0.05) == pool and pools.missing("2:61", 4) == 0
    assert pool.holds(0.30) and pool.holds(0.38) and not pool.holds(0.28) and not pool.holds(0.40)
    assert pools.missing("3:18", 4) == 4  # each task (device, config, settings) has its own


def test_pairs_against_a_pooled_reference_keep_their_candidates_and_their_intervals() -> None:
    """Against the pool, each pair's speedup is the pool's time over its candidate's median, its
    interval moves with it, and the reference's median is the pool's, so that reference over
    candidate is still the speedup: two pairs whose reference ran in two modes now agree."""
    rng = random.Random(4)
    answers = [
        pair_answer(
            [mode + rng.gauss(0, 0.001) for _ in range(30)], [0.2 + rng.gauss(0, 0.0005) for _ in range(30)]
        )
        for mode in (0.306, 0.368)
    ]
    own = pool_pairs(answers, keep=False)
    against = pool_pairs(answers, keep=False, reference_ms=0.335)
    assert max(own.pair_speedups) / min(own.pair_speedups) > 1.15
    assert max(against.pair_speedups) / min(against.pair_speedups) < 1.01
    for mine, theirs, answer in zip(own.pair_intervals, against.pair_intervals, answers, strict=True):
        factor = 0.335 / statistics.median(answer["reference_ms"])
        assert theirs == pytest.approx((mine[0] * factor, mine[1] * factor))
    assert against.timings[0].median_ms == against.reference_ms == 0.335 and own.reference_ms is None
    assert against.timings[0].median_ms / against.timings[1].median_ms == pytest.approx(against.speedup)


def test_pairs_are_timed_until_the_pool_is_full_while_the_timeout_has_room() -> None:
    config = EvalConfig.model_validate(
        {"timing": {"processes": 2, "reference_processes": 4}, "limits": {"timeout_seconds": 180}}
    )
    assert another_pair([answer_at(1.0), answer_at(1.0)], config, 2.0, pool_owed=4)
    assert another_pair([answer_at(1.0)] * 3, config, 3.0, pool_owed=4)
    assert not another_pair([answer_at(1.0)] * 4, config, 4.0, pool_owed=4)  # full
    assert not another_pair([answer_at(1.0)] * 2, config, 2.0, pool_owed=0)  # made earlier
    assert not another_pair([answer_at(1.0)] * 2, config, 100.0, pool_owed=4)  # no room left
    assert "refpool4@0.05" in config.result_version
    # Against the pool's one reference figure, more pairs follow the candidate's own spread: a
    # reference that moved between two processes no longer asks for a third.
    most = EvalConfig.model_validate(
        {"timing": {"processes": 2, "processes_max": 4, "reference_processes": 2}}
    )
    moved = [pair_answer([1.0] * 3, [1.0] * 3), pair_answer([1.2] * 3, [1.0] * 3)]
    assert not another_pair(moved, most, 2.0)
    assert another_pair([pair_answer([1.0] * 3, [1.0] * 3), pair_answer([1.0] * 3, [1.05] * 3)], most, 2.0)
    assert another_pair(
        moved,
        EvalConfig.model_validate(merged(most.model_dump(), {"timing": {"reference_processes": None}})),
        2.0,
    )
    assert another_pair(
        moved,
        EvalConfig.model_validate(merged(most.model_dump(), {"timing": {"reference_processes": 0}})),
        2.0,
    )  # 0: off


def pooled_on_the_cpu(reference_processes: int) -> EvalConfig:
    """A quick CPU evaluator with a session reference pool of this many processes."""
    return EvalConfig.model_validate(
        {
            "device": "cpu",
            "timing": {
                "warmup": 2,
                "flush_bytes": 0,
                "speedup_recheck": None,
                "trials": 5,
                "retries": 0,
                "max_speedup_cv": None,
                "reference_processes": reference_processes,
                "reference_tolerance": 100.0,  # a loaded machine must not make the range check decide
            },
            "correctness": {"trials": 1},
        }
    )


def test_candidates_of_a_task_are_measured_against_one_reference_time_per_session() -> None:
    """End to end on the CPU: the first evaluation times pairs until the pool has three
    processes; the next times its two and is measured against the same reference figure, so the
    reference's median is identical in both, and each says so."""
    config = pooled_on_the_cpu(reference_processes=3)
    task = Task(name="slow", code=C.SLOW_TASK)
    with Evaluator(config) as evaluator:
        first, second = (evaluator.evaluate(task, C.SLOW_TASK_FAST + f"\n# {n}\n") for n in range(2))
    for result, pairs in ((first, 3), (second, 2)):
        assert result.verdict == Verdict.CORRECT, result.reasons
        assert R.REFERENCE_POOLED in R.codes(result.reasons), result.reasons
        assert any(f"timed in {pairs} fresh process pairs" in r for r in result.reasons), result.reasons
    assert first.reference is not None and second.reference is not None
    assert first.reference.median_ms == second.reference.median_ms


def test_a_candidate_that_is_not_correct_puts_nothing_in_the_pool() -> None:
    """A hostile candidate evaluated first in a session must not set the reference time the
    task's later candidates are measured against: one that patched torch to slow the reference is
    rejected, and only the honest candidate after it fills the pool, from its own pairs."""
    config = EvalConfig.model_validate(
        {
            "device": "cpu",
            "correctness": {"trials": 2},
            "timing": {
                "trials": 5,
                "warmup": 1,
                "flush_bytes": 0,
                "speedup_recheck": None,
                "max_speedup_cv": None,
                "retries": 0,
                "reference_processes": 2,
                "reference_tolerance": 100.0,  # a loaded machine must not make the range check decide
            },
        }
    )
    task = Task(name="matmul", code=C.MATMUL_TASK)
    with Evaluator(config) as evaluator:
        hack = evaluator.evaluate(task, C.SLOWER_REFERENCE_HACK)
        assert hack.verdict == Verdict.REJECTED, hack.reasons
        assert all(not medians for medians in evaluator._pools._medians.values())
        honest = evaluator.evaluate(task, C.HONEST)
        assert honest.verdict == Verdict.CORRECT, honest.reasons
        assert R.REFERENCE_POOLED in R.codes(honest.reasons), honest.reasons
        assert [len(medians) for medians in evaluator._pools._medians.values() if medians] == [2]


def test_an_evaluation_whose_reference_left_the_pools_range_keeps_its_own_figures() -> None:
    config = EvalConfig.model_validate({"timing": {"processes": 2, "reference_processes": 2}})
    answers = [answer_at(1.0), answer_at(1.02)]
    pool = ReferencePools().offer("t", fresh_reference_medians(answers), 2, config.timing.reference_tolerance)
    assert pool is not None
    made, note = against_pool(pool, answers, pool_pairs(answers, keep=False), config)
    assert R.reason_code(note) == R.REFERENCE_POOLED
    assert made.pair_speedups == pytest.approx((made.speedup, made.speedup))
    moved = [answer_at(1.3), answer_at(1.31)]  # a host-bound reference under another load
    own = pool_pairs(moved, keep=False)
    kept, note = against_pool(pool, moved, own, config)
    assert kept == own and R.reason_code(note) == R.REFERENCE_DRIFTED
    assert "1.3000, 1.3100 ms" in note and "outside its session pool's range by more than 5%" in note


def test_evaluations_in_flight_promise_the_pool_their_own_pairs() -> None:
    """A burst of a task's candidates fills the pool from their ordinary pairs: the first two
    promise two processes each, the third none; one that has offered waits for the promises
    out and gets the pool once they are kept."""
    pools = ReferencePools()
    assert [pools.promise("2:61", 4, 2) for _ in range(3)] == [2, 2, 0]
    assert pools.offer("2:61", [0.306, 0.368], 4, 0.05, promised=2) is None
    waited: list[ReferencePool | None] = []
    waiter = threading.Thread(target=lambda: waited.append(pools.wait("2:61", 4, 0.05, timeout_s=30)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # the second evaluation still owes two processes
    made = pools.offer("2:61", [0.307, 0.367], 4, 0.05, promised=2)
    waiter.join(timeout=5)
    assert made is not None and waited == [made] and pools.promise("2:61", 4, 2) == 0


def test_a_promise_released_unkept_leaves_the_rest_to_the_evaluation_that_waits() -> None:
    """An evaluation that promised processes and then failed releases them: the one waiting
    wakes with no pool and promises what is missing itself."""
    pools = ReferencePools()
    assert pools.promise("3:18", 4, 2) == 2 and pools.promise("3:18", 4, 2) == 2
    assert pools.offer("3:18", [1.0, 1.01], 4, 0.05, promised=2) is None
    waited: list[ReferencePool | None] = []
    waiter = threading.Thread(target=lambda: waited.append(pools.wait("3:18", 4, 0.05, timeout_s=30)))
    waiter.start()
    pools.release("3:18", 2)  # the second evaluation turned out incorrect
    waiter.join(timeout=5)
    assert waited == [None] and pools.promise("3:18", 4, pools.missing("3:18", 4)) == 2
    assert pools.wait("3:18", 4, 0.05, timeout_s=0.01) is None  # its own promise is out: time runs out


def test_a_burst_of_a_tasks_candidates_times_no_more_pairs_than_one_after_another() -> None:
    """End to end on the CPU, three candidates of one task in flight together: all are measured
    against the one pooled reference figure, and together they time at most the pool's four
    processes plus two pairs each for the others (without promises each timed the whole pool)."""
    config = pooled_on_the_cpu(reference_processes=4)
    task = Task(name="slow", code=C.SLOW_TASK)
    with Evaluator(config) as evaluator:
        futures = [evaluator.submit(task, C.SLOW_TASK_FAST + f"\n# {n}\n") for n in range(3)]
        results = [future.result(timeout=600) for future in futures]
    pairs = []
    for result in results:
        assert result.verdict == Verdict.CORRECT, result.reasons
        assert R.REFERENCE_POOLED in R.codes(result.reasons), result.reasons
        assert result.reference is not None
        timed = [r for r in result.reasons if "fresh process pairs" in r]
        pairs += [int(r.split("timed in ")[1].split()[0]) for r in timed]
    assert len({result.reference.median_ms for result in results if result.reference}) == 1
    assert len(pairs) == 3 and sum(pairs) <= 4 + 2 + 2, pairs


# ---------------------------------------------------------------- the outside clock


def test_a_slower_candidate_is_not_taken_for_a_forged_clock() -> None:
    """The outside clock sees each side's whole round: a candidate slower than its reference
    (here by 2 ms a call) is no `clock-mismatch`."""
    slower = C.SLOW_TASK_FAST.replace(
        "        return torch.tanh(x @ w)",
        "        import time\n        time.sleep(0.002)\n        return torch.tanh(x @ w)",
    )
    quick: dict[str, Any] = {"correctness": {"trials": 1}, "timing": {"trials": 40, "retries": 0}}
    result = slow_pair(slower, **merged({"timing": {"max_speedup_cv": None}}, quick))
    assert result.verdict == Verdict.CORRECT, result.reasons
    assert R.CLOCK_MISMATCH not in R.codes(result.reasons)
    assert result.speedup is not None and result.speedup < 1
