"""The contrastive loop with a scripted policy and a scripted evaluator on a real local store."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelfleet.core.models import Environment
from kernelfleet.core.store import Store, open_store
from kernelfleet.search import (
    Budget,
    CompilePolicy,
    LoopSettings,
    QuietProgress,
    ReplayPolicy,
    ReplayRow,
    Request,
    RunLayout,
    SampleRecord,
    optimize,
)
from tests.support.search import (
    Killed,
    ScriptedEvaluator,
    ScriptedPolicy,
    answer,
    make_task,
    variant_code,
)

PREFIX = "runs/test"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store")


def climbing(request: Request) -> str:
    """Each round is faster than the last; sample i of a round adds i/10."""
    speedup = 1.0 + request.round + request.index / 10
    return answer(variant_code(f"{request.task.name}-r{request.round}-i{request.index}", speedup))


def run(
    store: Store,
    evaluator: ScriptedEvaluator,
    policies: list,
    budget: Budget,
    *,
    tasks: list | None = None,
    progress: QuietProgress | None = None,
    **settings: object,
) -> list:
    """The loop over `tasks` (by default alpha and beta); pass `progress` to read its messages."""
    return optimize(
        tasks or [make_task("alpha", 2), make_task("beta", 3)],
        policies,
        store=store,
        prefix=PREFIX,
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=budget,
        settings=LoopSettings(**settings),
        progress=progress or QuietProgress(),
    )


def test_a_run_keeps_everything_and_reports_the_verified_best(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    policy = ScriptedPolicy(climbing)
    summaries = run(store, evaluator, [policy], Budget(rounds=3, samples_per_round=2))
    assert [s.task_name for s in summaries] == ["alpha", "beta"]
    alpha = summaries[0]
    assert alpha.stop_reason == "rounds" and alpha.rounds == 3
    assert alpha.samples == 6 and alpha.variants == 6
    assert alpha.best_speedup == pytest.approx(3.1)
    assert alpha.search_speedup == pytest.approx(3.1)
    assert alpha.verified and alpha.best_policy == "scripted"
    assert alpha.speedup_vs_compile == pytest.approx(3.1 * 5.0 / 10.0)
    assert alpha.verdicts == {"correct": 6}
    assert set(alpha.baselines) == {"eager", "compile"}
    assert len(evaluator.evaluated) == 12
    assert len(evaluator.verified) == 2
    layout = RunLayout(PREFIX)
    assert len(list(store.list_results(PREFIX))) == 12
    samples = [k for k in store.list(f"{layout.gpu_root(alpha.task_hash, 'cpu')}/samples/")]
    assert len(samples) == 6
    assert store.get_variant(alpha.best_variant_hash or "").startswith("import torch")
    assert any(
        key.split("/")[-1].startswith("summary-") for key in store.list(layout.task_root(alpha.task_hash))
    )


def test_later_rounds_show_earlier_variants_with_their_speedups(store: Store) -> None:
    policy = ScriptedPolicy(climbing)
    run(store, ScriptedEvaluator(), [policy], Budget(rounds=3, samples_per_round=2))
    first = [r for r in policy.requests if r.round == 0]
    later = [r for r in policy.requests if r.round == 2]
    assert all(not r.exemplars for r in first)
    assert all(len(r.exemplars) == 2 for r in later)
    for request in later:
        # Exemplars are earlier variants of the same task, from distinct speedup buckets.
        assert all(f"{request.task.name}-r" in e.code for e in request.exemplars)
        assert len({round(e.speedup, 1) for e in request.exemplars}) == 2
        user = request.messages()[1]["content"]
        assert "the speed of the reference" in user and "## Performance Analysis" in user
    layout = RunLayout(PREFIX)
    request = later[0]
    key = layout.sample(request.task.hash, "cpu", 2, "scripted", request.index)
    record = SampleRecord.model_validate(store.get_json(key))
    assert set(record.parent_hashes) == {e.variant_hash for e in request.exemplars}
    assert record.analysis.startswith("The faster variant")


def test_duplicates_are_evaluated_once_and_unusable_answers_never(store: Store) -> None:
    def script(request: Request) -> str:
        if request.index == 0:
            return answer(variant_code("same", 1.5))
        if request.index == 1:
            return "Sorry, I can't write code today."
        return answer(variant_code("same", 1.5)).replace("## Code", "\n\n## Code")

    evaluator = ScriptedEvaluator()
    summaries = run(store, evaluator, [ScriptedPolicy(script)], Budget(rounds=2, samples_per_round=3))
    assert len(evaluator.evaluated) == 2  # one per task, across both rounds
    alpha = summaries[0]
    assert alpha.samples == 6 and alpha.variants == 1
    records = [
        SampleRecord.model_validate(store.get_json(k))
        for k in store.list(f"{RunLayout(PREFIX).gpu_root(alpha.task_hash, 'cpu')}/samples/")
    ]
    unusable = [r for r in records if r.variant_hash is None]
    assert len(unusable) == 2
    assert all(r.error == "no code in the answer" and r.answer.startswith("Sorry") for r in unusable)


def test_failed_variants_are_kept_and_never_shown_as_exemplars(store: Store) -> None:
    def script(request: Request) -> str:
        verdict = ["incorrect", "compile_error", "correct"][request.index]
        speedup = 2.0 if verdict == "correct" else None
        return answer(variant_code(f"r{request.round}-{request.index}", speedup, verdict=verdict))

    policy = ScriptedPolicy(script)
    summaries = run(store, ScriptedEvaluator(), [policy], Budget(rounds=2, samples_per_round=3))
    assert summaries[0].verdicts == {"compile_error": 2, "correct": 2, "incorrect": 2}
    for request in policy.requests:
        assert all(e.speedup == 2.0 for e in request.exemplars)


def test_target_speedup_stops_a_task_early(store: Store) -> None:
    def script(request: Request) -> str:
        speedup = 5.0 if request.task.name == "alpha" else 1.2
        return answer(variant_code(f"{request.task.name}-{request.round}-{request.index}", speedup))

    evaluator = ScriptedEvaluator()
    summaries = run(
        store, evaluator, [ScriptedPolicy(script)], Budget(rounds=4, samples_per_round=1, target_speedup=3)
    )
    alpha, beta = summaries
    assert (alpha.stop_reason, alpha.rounds) == ("target", 1)
    assert (beta.stop_reason, beta.rounds) == ("rounds", 4)
    assert len(evaluator.evaluated) == 5


def test_gpu_seconds_budget(store: Store) -> None:
    def script(request: Request) -> str:
        return answer(variant_code(f"{request.task.name}-{request.round}-{request.index}", 1.5, seconds=5.0))

    evaluator = ScriptedEvaluator()
    summaries = run(
        store,
        evaluator,
        [ScriptedPolicy(script)],
        Budget(rounds=5, samples_per_round=2, gpu_seconds=12),
    )
    assert len(evaluator.evaluated) == 3  # 5 + 5 + 5 >= 12: the third is the last one started
    assert {s.stop_reason for s in summaries} == {"gpu-seconds"}
    assert summaries[0].best_speedup == 1.5


def test_wall_time_budget(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    policy = ScriptedPolicy(climbing)
    summaries = run(store, evaluator, [policy], Budget(rounds=3, wall_time_seconds=1e-9))
    assert {s.stop_reason for s in summaries} == {"wall-time"}
    assert policy.requests == [] and evaluator.evaluated == []
    assert summaries[0].best_speedup is None and summaries[0].rounds == 0


def test_a_wall_time_stop_continues_when_repeated(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernelfleet.search._loop as loop_module

    clock = [0.0]
    monkeypatch.setattr(loop_module.time, "monotonic", lambda: clock[0])

    class TickingEvaluator(ScriptedEvaluator):
        def evaluate_batch(
            self,
            items: list,
            cache: object = None,
            progress: bool = True,
            stop: object = None,
            slow: object = None,
        ) -> list:
            clock[0] += 10.0  # each batch "takes" ten seconds
            return super().evaluate_batch(items, cache, progress)

    budget = Budget(rounds=4, samples_per_round=1, wall_time_seconds=25)
    first = run(store, TickingEvaluator(), [ScriptedPolicy(climbing)], budget)
    assert {s.stop_reason for s in first} == {"wall-time"} and first[0].rounds == 3
    clock[0] = 0.0
    second = run(store, TickingEvaluator(), [ScriptedPolicy(climbing)], budget)
    assert [s.stop_reason for s in second] == ["rounds", "rounds"] and second[0].rounds == 4
    report_best = second[0].best_speedup
    assert report_best == pytest.approx(4.0)
    clock[0] = 0.0
    idle = TickingEvaluator()
    third = run(store, idle, [ScriptedPolicy(climbing)], budget)
    assert idle.evaluated == [] and third == second


def test_a_killed_run_resumes_without_asking_or_evaluating_again(store: Store) -> None:
    budget = Budget(rounds=3, samples_per_round=2)
    killed = ScriptedEvaluator(kill_after=5)
    first_policy = ScriptedPolicy(climbing)
    with pytest.raises(Killed):
        run(store, killed, [first_policy], budget)
    assert len(killed.evaluated) == 5
    asked_before = {(r.task.name, r.round, r.index) for r in first_policy.requests}

    resumed = ScriptedEvaluator()
    second_policy = ScriptedPolicy(climbing)
    summaries = run(store, resumed, [second_policy], budget)
    asked_again = {(r.task.name, r.round, r.index) for r in second_policy.requests}
    assert not asked_before & asked_again
    assert len(resumed.evaluated) == 12 - 5
    assert not set(killed.evaluated) & set(resumed.evaluated)
    assert [s.best_speedup for s in summaries] == [pytest.approx(3.1), pytest.approx(3.1)]

    # The same call once more finds the summaries and does nothing at all.
    idle = ScriptedEvaluator()
    idle_policy = ScriptedPolicy(climbing)
    again = run(store, idle, [idle_policy], budget)
    assert idle.evaluated == [] and idle.verified == [] and idle.baseline_calls == []
    assert idle_policy.requests == []
    assert again == summaries


def test_a_bigger_budget_continues_the_run(store: Store) -> None:
    run(store, ScriptedEvaluator(), [ScriptedPolicy(climbing)], Budget(rounds=1, samples_per_round=2))
    evaluator = ScriptedEvaluator()
    policy = ScriptedPolicy(climbing)
    summaries = run(store, evaluator, [policy], Budget(rounds=2, samples_per_round=2))
    assert {r.round for r in policy.requests} == {1}
    assert len(evaluator.evaluated) == 4
    assert summaries[0].rounds == 2 and summaries[0].best_speedup == pytest.approx(2.1)


def test_transient_failures_are_not_recorded_and_are_asked_again(store: Store) -> None:
    def flaky(request: Request) -> str | None:
        return None if request.index == 1 else climbing(request)

    progress = QuietProgress()
    evaluator = ScriptedEvaluator()
    run(
        store,
        evaluator,
        [ScriptedPolicy(flaky)],
        Budget(rounds=1, samples_per_round=2),
        tasks=[make_task("alpha")],
        progress=progress,
    )
    assert any("scripted outage" in message for message in progress.messages)
    layout = RunLayout(PREFIX)
    task = make_task("alpha")
    assert store.exists(layout.sample(task.hash, "cpu", 0, "scripted", 0))
    assert not store.exists(layout.sample(task.hash, "cpu", 0, "scripted", 1))


def test_a_variant_that_fails_verification_is_not_reported(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    policy = ScriptedPolicy(climbing)
    best_code = variant_code("alpha-r1-i1", 2.1)
    from kernelfleet.core.hashing import source_hash

    evaluator.fail_verification.add(source_hash(best_code))
    progress = QuietProgress()
    (summary,) = run(
        store,
        evaluator,
        [policy],
        Budget(rounds=2, samples_per_round=2),
        tasks=[make_task("alpha")],
        progress=progress,
    )
    assert summary.best_speedup == pytest.approx(2.0)
    assert summary.best_variant_hash != source_hash(best_code)
    assert len(evaluator.verified) == 2
    assert any("failed to verify" in message for message in progress.messages)


def test_nothing_verified(store: Store) -> None:
    def wrong(request: Request) -> str:
        return answer(variant_code(f"w{request.round}{request.index}", None, verdict="incorrect"))

    (summary, _) = run(
        store, ScriptedEvaluator(), [ScriptedPolicy(wrong)], Budget(rounds=1, samples_per_round=2)
    )
    assert summary.best_speedup is None and not summary.verified
    assert summary.verdicts == {"incorrect": 2}


def test_baseline_failure_is_reported_and_retried(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    evaluator.fail_baselines = True
    summaries = run(store, evaluator, [ScriptedPolicy(climbing)], Budget(rounds=1, samples_per_round=1))
    assert summaries[0].baselines == {} and summaries[0].speedup_vs_compile is None
    assert summaries[0].best_speedup == 1.0


def test_deterministic_policies_run_until_exhausted(store: Store) -> None:
    task = make_task("alpha")
    rows = [
        ReplayRow(task="alpha", code=variant_code("replay-1", 4.0), name="hand-1"),
        ReplayRow(task="alpha", code=variant_code("replay-2", 0.5), name="hand-2"),
        ReplayRow(task="alpha", code="print('no model')", name="broken"),
    ]
    evaluator = ScriptedEvaluator()
    summaries = optimize(
        [task],
        [CompilePolicy(), ReplayPolicy(rows)],
        store=store,
        prefix=PREFIX,
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=5, samples_per_round=2),
    )
    (summary,) = summaries
    # Round 1: compile-default + replay rows 1-2; round 2: replay's broken row (recorded, not
    # evaluated) and then nothing; both policies exhausted after round 2.
    assert summary.stop_reason == "exhausted" and summary.rounds == 2
    assert summary.best_policy == "replay" and summary.best_name == "hand-1"
    assert summary.best_speedup == 4.0
    assert summary.samples == 4
    assert len(evaluator.evaluated) == 3


def test_a_broken_task_stops_without_blaming_its_variants(store: Store) -> None:
    evaluator = ScriptedEvaluator()
    progress = QuietProgress()
    broken, good = run(
        store,
        evaluator,
        [ScriptedPolicy(climbing)],
        Budget(rounds=3, samples_per_round=2),
        tasks=[make_task("broken"), make_task("good", 3)],
        progress=progress,
    )
    assert (broken.stop_reason, broken.rounds, broken.variants) == ("task-error", 1, 0)
    assert good.stop_reason == "rounds" and good.best_speedup == pytest.approx(3.1)
    # Its first round went to the evaluator whole (both samples), and nothing of it after that.
    assert [name for name, _ in evaluator.evaluated].count("broken") == 2
    assert all(r.task_hash != broken.task_hash for r in store.list_results(PREFIX))
    assert any("reference fails" in message for message in progress.messages)


def test_the_loop_refuses_a_foreign_environment(store: Store) -> None:
    evaluator = ScriptedEvaluator(gpu_class="h100")
    with pytest.raises(RuntimeError, match="environment"):
        optimize(
            [make_task("alpha")],
            [ScriptedPolicy(climbing)],
            store=store,
            prefix=PREFIX,
            evaluator=evaluator,
            environment=Environment(device="cpu", gpu_class="cpu", evaluator_version="test-1"),
            budget=Budget(rounds=1, samples_per_round=1),
        )


def test_results_are_kept_per_gpu_class(store: Store) -> None:
    cpu = ScriptedEvaluator(gpu_class="cpu")
    h100 = ScriptedEvaluator(gpu_class="h100")
    run(store, cpu, [ScriptedPolicy(climbing)], Budget(rounds=1, samples_per_round=1))
    run(store, h100, [ScriptedPolicy(climbing)], Budget(rounds=1, samples_per_round=1))
    assert len(cpu.evaluated) == 2 and len(h100.evaluated) == 2
    assert {r.environment.gpu_class for r in store.list_results(PREFIX)} == {"cpu", "h100"}


def test_budget_validation() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="rounds"):
        Budget(rounds=0)
    with pytest.raises(ValidationError, match="gpu_seconds"):
        Budget(gpu_seconds=-1)
    with pytest.raises(ValidationError, match="wall_time_seconds"):
        Budget(wall_time_seconds=float("inf"))
    assert Budget(rounds=2).fingerprint() != Budget(rounds=3).fingerprint()


def test_a_resume_repairs_every_damaged_record_of_a_task(store: Store, tmp_path: Path) -> None:
    """Samples, the task object, the summary, the verification, the baselines and a result,
    each damaged on disk: the same call measures or asks again only what it needs, writes the
    records anew in place (the damaged bytes kept under damaged/), and the run verifies."""
    from kernelfleet.core.store import verify_run

    budget = Budget(rounds=1, samples_per_round=2)
    first = run(store, ScriptedEvaluator(), [ScriptedPolicy(climbing)], budget)
    root = tmp_path / "store"
    alpha = next(s for s in first if s.task_name == "alpha")
    task_dir = next(p for p in (root / PREFIX / "tasks").iterdir() if alpha.task_hash.startswith(p.name))
    damaged = [
        next(task_dir.rglob("samples/*/*.json")),
        task_dir / "task.json",
        next(task_dir.rglob("summary-*.json")),
        next(task_dir.rglob("verified/*/*.json")),
        next(task_dir.rglob("baselines/*.json")),
        next((root / PREFIX / "results" / task_dir.name).rglob("*.json")),
    ]
    for path in damaged:
        path.write_bytes(path.read_bytes()[:20])
    assert not verify_run(store, PREFIX).ok

    again = ScriptedEvaluator()
    policy = ScriptedPolicy(climbing)
    second = run(store, again, [policy], budget)
    assert len(again.evaluated) == 1 and len(policy.requests) == 1  # the damaged result and sample only
    assert {s.task_name: s.best_speedup for s in second} == {s.task_name: s.best_speedup for s in first}
    for path in damaged:  # each readable again
        assert path.read_bytes()[:1] == b"{" and path.read_bytes().rstrip().endswith(b"}")
    check = verify_run(store, PREFIX)
    assert check.ok, check.findings
    assert len(list(store.list(f"damaged/{PREFIX}/"))) == len(damaged)
