"""The variant database: every variant of one task on one GPU class, with its result.

It is an in-memory index rebuilt from the store, never the store itself: the store holds
immutable objects (variants, results, the policy's answers), and a resumed run replays them
into a fresh database. So the database can stay a plain mutable engine.

Exemplars are drawn the way contrastive-RL CUDA optimisation does (its "bucket" strategy,
which beat random and island sampling in its ablation): successful variants are grouped into
buckets of similar speedup; two *distinct* buckets are drawn by a softmax over (bucket mean -
overall mean) / temperature; then one variant uniformly from each. Distinct buckets make sure
the two exemplars differ in speed, which is what the model is asked to explain. A low
temperature favours the fastest buckets, a high one spreads over all of them.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from kernelfleet.core.models import EvaluationResult, Verdict


@dataclass(frozen=True)
class Entry:
    """One evaluated variant: its code, who wrote it, when, and what the evaluator said."""

    code: str
    result: EvaluationResult
    policy: str
    round: int = 0
    name: str = ""
    parent_hashes: tuple[str, ...] = ()

    @property
    def variant_hash(self) -> str:
        return self.result.variant_hash

    @property
    def speedup(self) -> float | None:
        return self.result.speedup

    @property
    def successful(self) -> bool:
        return self.result.verdict == Verdict.CORRECT and self.result.speedup is not None


class VariantDatabase:
    """The variants of one task on one GPU class. Adding the same variant twice keeps the first."""

    def __init__(self, task_hash: str, gpu_class: str, bucket_width: float = 0.1) -> None:
        if bucket_width <= 0:
            raise ValueError(f"bucket_width must be positive, got {bucket_width}")
        self.task_hash = task_hash
        self.gpu_class = gpu_class
        self.bucket_width = bucket_width
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> bool:
        """Index `entry`; False if a variant with this hash was already there."""
        if entry.result.task_hash != self.task_hash:
            raise ValueError(
                f"result of task {entry.result.task_hash[:12]} given to the database of {self.task_hash[:12]}"
            )
        if entry.variant_hash in self._entries:
            return False
        self._entries[entry.variant_hash] = entry
        return True

    def __contains__(self, variant_hash: object) -> bool:
        return variant_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def get(self, variant_hash: str) -> Entry | None:
        return self._entries.get(variant_hash)

    @property
    def successful(self) -> list[Entry]:
        return [entry for entry in self._entries.values() if entry.successful]

    def ranked(self) -> list[Entry]:
        """Successful variants, fastest first; ties broken by hash so the order is stable."""
        return sorted(self.successful, key=lambda entry: (-(entry.speedup or 0.0), entry.variant_hash))

    def best(self) -> Entry | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def verdict_counts(self) -> Counter[str]:
        return Counter(str(entry.result.verdict) for entry in self._entries.values())

    def gpu_seconds(self) -> float:
        return sum(entry.result.seconds for entry in self._entries.values())

    def buckets(self) -> dict[int, list[Entry]]:
        """Successful variants grouped by speedup: bucket i holds [(1+w)^i, (1+w)^(i+1))."""
        grouped: dict[int, list[Entry]] = {}
        step = math.log1p(self.bucket_width)
        for entry in self.successful:
            speedup = max(entry.speedup or 0.0, 1e-12)
            grouped.setdefault(math.floor(math.log(speedup) / step), []).append(entry)
        for members in grouped.values():
            members.sort(key=lambda entry: entry.variant_hash)
        return dict(sorted(grouped.items()))

    def sample_exemplars(self, k: int, temperature: float, rng: random.Random) -> list[Entry]:
        """Up to `k` successful variants from distinct speedup buckets (see the module docstring).

        With fewer buckets than `k`, the rest are drawn, distinct, from the buckets already chosen.
        `temperature <= 0` takes the buckets with the highest means, deterministically.
        """
        buckets = self.buckets()
        if k <= 0 or not buckets:
            return []
        speedups = [entry.speedup or 0.0 for members in buckets.values() for entry in members]
        overall = sum(speedups) / len(speedups)
        scores = {
            key: (sum(entry.speedup or 0.0 for entry in members) / len(members)) - overall
            for key, members in buckets.items()
        }
        chosen_buckets = _draw_distinct(scores, min(k, len(scores)), temperature, rng)
        chosen = [rng.choice(buckets[key]) for key in chosen_buckets]
        taken = {entry.variant_hash for entry in chosen}
        leftovers = [
            entry for key in chosen_buckets for entry in buckets[key] if entry.variant_hash not in taken
        ]
        while len(chosen) < k and leftovers:
            chosen.append(leftovers.pop(rng.randrange(len(leftovers))))
        return chosen


def softmax_weights(scores: dict[int, float], temperature: float) -> dict[int, float]:
    """Softmax of score / temperature, shifted by the maximum so that it cannot overflow."""
    top = max(scores.values())
    exps = {key: math.exp((score - top) / temperature) for key, score in scores.items()}
    total = sum(exps.values())
    return {key: value / total for key, value in exps.items()}


def _draw_distinct(scores: dict[int, float], count: int, temperature: float, rng: random.Random) -> list[int]:
    remaining = dict(scores)
    drawn: list[int] = []
    while remaining and len(drawn) < count:
        if temperature <= 0:
            key = max(remaining, key=lambda bucket: (remaining[bucket], bucket))
        else:
            weights = softmax_weights(remaining, temperature)
            keys = sorted(weights)
            key = rng.choices(keys, weights=[weights[bucket] for bucket in keys], k=1)[0]
        drawn.append(key)
        del remaining[key]
    return drawn
