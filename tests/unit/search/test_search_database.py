"""The variant database and its exemplar sampling: distinct buckets, and what temperature does."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kernelfleet.core.models import Environment, EvaluationResult, Verdict
from kernelfleet.search import Entry, VariantDatabase
from kernelfleet.search._database import softmax_weights

TASK = "t" * 64
ENV = Environment(device="cpu", gpu_class="cpu", evaluator_version="v")


def entry(tag: str, speedup: float | None, verdict: Verdict = Verdict.CORRECT) -> Entry:
    variant = f"{tag:0>64}"[-64:]
    result = EvaluationResult(
        task_hash=TASK, variant_hash=variant, verdict=verdict, speedup=speedup, environment=ENV, seconds=2.0
    )
    return Entry(code=f"# {tag}", result=result, policy="p")


def database(speedups: dict[str, float], width: float = 0.1) -> VariantDatabase:
    db = VariantDatabase(TASK, "cpu", bucket_width=width)
    for tag, speedup in speedups.items():
        db.add(entry(tag, speedup))
    return db


def test_add_is_idempotent_and_checks_the_task() -> None:
    db = VariantDatabase(TASK, "cpu")
    assert db.add(entry("a", 1.5))
    assert not db.add(entry("a", 9.0))
    assert db.get(f"{'a':0>64}").speedup == 1.5  # type: ignore[union-attr]
    other = EvaluationResult(
        task_hash="x" * 64, variant_hash="b" * 64, verdict=Verdict.CORRECT, speedup=1.0, environment=ENV
    )
    with pytest.raises(ValueError, match="database"):
        db.add(Entry(code="", result=other, policy="p"))


def test_best_ranking_counts_and_seconds() -> None:
    db = database({"a": 1.2, "b": 3.0, "c": 0.8})
    db.add(entry("d", None, Verdict.INCORRECT))
    db.add(entry("e", None, Verdict.COMPILE_ERROR))
    assert db.best().variant_hash.endswith("b")  # type: ignore[union-attr]
    assert [e.speedup for e in db.ranked()] == [3.0, 1.2, 0.8]
    assert db.verdict_counts() == Counter({"correct": 3, "incorrect": 1, "compile_error": 1})
    assert db.gpu_seconds() == 10.0
    assert len(db) == 5


def test_buckets_group_similar_speedups() -> None:
    db = database({"a": 1.00, "b": 1.05, "c": 2.0, "d": 2.05, "e": 4.0})
    sizes = sorted(len(members) for members in db.buckets().values())
    assert sizes == [1, 2, 2]


def test_two_exemplars_come_from_distinct_buckets() -> None:
    db = database({"a": 1.00, "b": 1.01, "c": 1.02, "d": 2.0, "e": 2.01, "f": 3.5})
    bucket_of = {e.variant_hash: key for key, members in db.buckets().items() for e in members}
    rng = random.Random(0)
    for _ in range(300):
        chosen = db.sample_exemplars(2, 1.0, rng)
        assert len(chosen) == 2
        assert bucket_of[chosen[0].variant_hash] != bucket_of[chosen[1].variant_hash]


def test_low_temperature_prefers_the_fastest_buckets() -> None:
    db = database({"a": 1.0, "b": 1.5, "c": 2.5, "d": 4.0})
    rng = random.Random(1)
    picks = Counter(e.speedup for _ in range(400) for e in db.sample_exemplars(2, 0.05, rng))
    assert picks[4.0] == 400 and picks[2.5] == 400
    # Zero temperature is the deterministic limit.
    assert {e.speedup for e in db.sample_exemplars(2, 0.0, rng)} == {4.0, 2.5}


def test_high_temperature_spreads_over_all_buckets() -> None:
    db = database({"a": 1.0, "b": 1.5, "c": 2.5, "d": 4.0})
    rng = random.Random(2)
    picks = Counter(e.speedup for _ in range(2000) for e in db.sample_exemplars(1, 100.0, rng))
    assert set(picks) == {1.0, 1.5, 2.5, 4.0}
    assert min(picks.values()) > 400  # close to uniform (500 each)


def test_moderate_temperature_orders_the_buckets_by_mean() -> None:
    db = database({"a": 1.0, "b": 1.5, "c": 2.5, "d": 4.0})
    rng = random.Random(3)
    picks = Counter(e.speedup for _ in range(3000) for e in db.sample_exemplars(1, 1.0, rng))
    assert picks[4.0] > picks[2.5] > picks[1.5] > picks[1.0]


def test_softmax_matches_the_formula() -> None:
    weights = softmax_weights({0: -1.0, 1: 1.0}, 1.0)
    assert weights[1] == pytest.approx(1 / (1 + pow(2.718281828459045, -2)))
    # Shifting by the maximum keeps huge scores finite.
    assert softmax_weights({0: 1e6, 1: 0.0}, 1e-3)[0] == pytest.approx(1.0)


def test_fewer_buckets_than_exemplars_fills_from_the_chosen_buckets() -> None:
    db = database({"a": 1.50, "b": 1.51, "c": 1.52})
    assert len(db.buckets()) == 1
    chosen = db.sample_exemplars(2, 1.0, random.Random(0))
    assert len(chosen) == 2 and chosen[0].variant_hash != chosen[1].variant_hash


def test_nothing_to_show() -> None:
    db = VariantDatabase(TASK, "cpu")
    assert db.sample_exemplars(2, 1.0, random.Random(0)) == []
    db.add(entry("a", None, Verdict.RUNTIME_ERROR))
    assert db.sample_exemplars(2, 1.0, random.Random(0)) == []
    db.add(entry("b", 1.3))
    assert [e.speedup for e in db.sample_exemplars(2, 1.0, random.Random(0))] == [1.3]
    assert db.sample_exemplars(0, 1.0, random.Random(0)) == []


def test_sampling_is_reproducible_with_a_seed() -> None:
    db = database({str(i): 1.0 + i / 3 for i in range(12)})
    first = [e.variant_hash for e in db.sample_exemplars(2, 1.0, random.Random(42))]
    again = [e.variant_hash for e in db.sample_exemplars(2, 1.0, random.Random(42))]
    assert first == again
