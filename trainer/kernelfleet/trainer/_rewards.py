"""Rewards for contrastive RL: where they are measured, and how a measurement becomes a reward.

A reward backend takes a whole group of completions' code and answers later (a future), so the
trainer keeps generating the next group while this one is timed. Two backends:

- `LocalRewardBackend`: the in-process `Evaluator` (its own child processes, so timing runs
  beside generation without holding the GIL), for local runs;
- `ServiceRewardBackend`: `kernelfleet eval serve` at a URL, through the evaluator package's
  client, for the cluster, where rewards run on GPUs of their own.

Both remember results in the run's store, keyed as everywhere else by (task, variant, GPU class,
evaluator version): a variant that several samples of a group share is timed once, and a
resumed stage never times a variant again.

From result to reward (`RewardShaper`), as in the paper: the speedup for correct code (1.0
when the variance gate would not give one: correct, but no faster that we can tell); `incorrect`
(0) for code that is wrong, fails to build or run, or times out; a penalty for a rejected reward
hack and for an answer without usable code; None (unscorable, advantage 0) when the evaluator
itself failed. Then normalised over the generation batch, (r - mean) / std, and clipped at
+-`clip` (1.5), which keeps one lucky 50x from swamping every other signal.
"""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernelfleet.core import reasons as R
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import EvaluationResult, ResultKey, Task, Verdict
from kernelfleet.core.resources import RewardSpec
from kernelfleet.core.store import ResultConflict, Store
from kernelfleet.search._loop import EvaluatorLike

log = logging.getLogger(__name__)


class RewardBackend(Protocol):
    """Measures code; `submit` returns at once, the future holds one result per item, in order."""

    def submit(
        self, items: Sequence[tuple[Task, str]]
    ) -> concurrent.futures.Future[list[EvaluationResult]]: ...

    def close(self) -> None: ...


class StoreResultCache:
    """The evaluator's result cache over the run's store (and memory): every result is kept once."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self._memory: dict[ResultKey, EvaluationResult] = {}
        self._lock = threading.Lock()

    def get(self, key: ResultKey) -> EvaluationResult | None:
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        stored = self.store.get_result(self.prefix, key)
        if stored is not None:
            with self._lock:
                self._memory[key] = stored
        return stored

    def put(self, result: EvaluationResult) -> None:
        try:
            self.store.put_result(self.prefix, result)
        except ResultConflict as conflict:
            # Kept beside the stored one; this process rewards what it measured itself.
            log.warning("%s", conflict)
        with self._lock:
            self._memory[result.key] = result


class LocalRewardBackend:
    """The in-process evaluator, one group at a time on a worker thread (the evaluator's children
    do the work; the thread only waits for them)."""

    def __init__(self, evaluator: EvaluatorLike, cache: StoreResultCache | None = None) -> None:
        self.evaluator = evaluator
        self.cache = cache
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards")

    def submit(self, items: Sequence[tuple[Task, str]]) -> concurrent.futures.Future[list[EvaluationResult]]:
        batch = list(items)
        return self._pool.submit(self.evaluator.evaluate_batch, batch, self.cache, False)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class ServiceRewardBackend:
    """`kernelfleet eval serve` at `url`, through the evaluator package's `EvaluationClient`.

    A group goes to the service as one list (the service spreads it over its GPUs); several
    groups may be in flight at once. Results are cached in the store like the local backend's,
    keyed with the service's own GPU class and evaluator version, learnt from its first answer.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str = "",
        timeout_s: float = 1800.0,
        cache: StoreResultCache | None = None,
        groups_in_flight: int = 4,
    ) -> None:
        from kernelfleet.evaluator import EvaluationClient

        self.client = EvaluationClient(url, token=token or None)
        self.timeout_s = timeout_s
        self.cache = cache
        self._environment: tuple[str, str] | None = None  # (gpu class, evaluator version)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=groups_in_flight, thread_name_prefix="reward-service"
        )

    def _key(self, task: Task, code: str) -> ResultKey | None:
        if self._environment is None:
            return None
        gpu_class, version = self._environment
        return ResultKey(
            task_hash=task.hash,
            variant_hash=source_hash(code),
            gpu_class=gpu_class,
            evaluator_version=version,
        )

    def _run(self, items: list[tuple[Task, str]]) -> list[EvaluationResult]:
        from kernelfleet.evaluator import result_from_json

        results: list[EvaluationResult | None] = [None] * len(items)
        pending: dict[tuple[str, str], list[int]] = {}
        for index, (task, code) in enumerate(items):
            key = self._key(task, code)
            hit = self.cache.get(key) if self.cache is not None and key is not None else None
            if hit is not None:
                results[index] = hit
            else:
                pending.setdefault((task.hash, source_hash(code)), []).append(index)
        if pending:
            firsts = [indices[0] for indices in pending.values()]
            bodies = [
                {"reference": items[i][0].code, "candidate": items[i][1], "name": items[i][0].name}
                for i in firsts
            ]
            ids = self.client.submit_many(bodies)
            answers = self.client.wait(ids, timeout=self.timeout_s)
            for indices, answer in zip(pending.values(), answers, strict=True):
                result = result_from_json(answer)
                self._environment = (result.environment.gpu_class, result.environment.evaluator_version)
                if self.cache is not None and R.REFERENCE_ERROR not in R.codes(result.reasons):
                    self.cache.put(result)
                for index in indices:
                    results[index] = result
        return [result for result in results if result is not None]

    def submit(self, items: Sequence[tuple[Task, str]]) -> concurrent.futures.Future[list[EvaluationResult]]:
        return self._pool.submit(self._run, list(items))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------- result -> reward

UNPARSABLE = "unparsable"
EVALUATOR_FAILED = "evaluator-failed"


@dataclass(frozen=True)
class Outcome:
    """What one completion came to: its raw reward (None: unscorable) and how to count it."""

    raw: float | None
    kind: str  # correct, incorrect, rejected, unparsable, evaluator-failed
    reason: str = ""  # the rejecting or failing reason code
    speedup: float | None = None


@dataclass
class RewardShaper:
    """Maps evaluator results to raw rewards, then normalises and clips a batch of them."""

    spec: RewardSpec = field(default_factory=RewardSpec)

    def outcome(self, result: EvaluationResult | None, parse_error: str = "") -> Outcome:
        if result is None:
            if parse_error:
                return Outcome(self.spec.unparsable_penalty, UNPARSABLE, UNPARSABLE)
            return Outcome(None, EVALUATOR_FAILED, EVALUATOR_FAILED)
        codes = [R.reason_code(text) for text in result.reasons]
        if result.verdict == Verdict.CORRECT:
            speedup = result.speedup if result.speedup is not None else 1.0
            return Outcome(speedup, "correct", speedup=speedup)
        if result.verdict == Verdict.REJECTED:
            rejecting = next((code for code in codes if code in R.REJECTING), "rejected")
            return Outcome(self.spec.rejected_penalty, "rejected", rejecting)
        if R.REFERENCE_ERROR in codes:
            return Outcome(None, EVALUATOR_FAILED, R.REFERENCE_ERROR)
        return Outcome(self.spec.incorrect, "incorrect", codes[0] if codes else str(result.verdict))

    def shape(self, raw: Sequence[float | None]) -> list[float | None]:
        """Normalise over the batch and clip; None stays None (trl leaves such samples out)."""
        values = [value for value in raw if value is not None]
        if not values:
            return list(raw)
        if self.spec.normalize:
            mean = statistics.fmean(values)
            std = statistics.pstdev(values) if len(values) > 1 else 0.0
            scale = std if std > 1e-8 else 1.0
            shaped = [None if value is None else (value - mean) / scale for value in raw]
        else:
            shaped = list(raw)
        clip = self.spec.clip
        return [None if value is None else max(-clip, min(clip, value)) for value in shaped]


def batch_metrics(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Share correct, share by failure kind and by rejecting reason, raw reward mean and spread."""
    total = len(outcomes)
    if total == 0:
        return {}
    kinds = Counter(outcome.kind for outcome in outcomes)
    metrics: dict[str, float] = {f"share/{kind}": count / total for kind, count in sorted(kinds.items())}
    metrics.setdefault("share/correct", 0.0)
    for reason, count in Counter(o.reason for o in outcomes if o.kind == "rejected").items():
        metrics[f"share/rejected/{reason}"] = count / total
    raw = [o.raw for o in outcomes if o.raw is not None]
    if raw:
        metrics["reward/raw_mean"] = statistics.fmean(raw)
        metrics["reward/raw_std"] = statistics.pstdev(raw) if len(raw) > 1 else 0.0
    speedups = [o.speedup for o in outcomes if o.speedup is not None]
    if speedups:
        metrics["reward/speedup_max"] = max(speedups)
    return metrics


def make_backend(spec: RewardSpec, evaluator: EvaluatorLike, cache: StoreResultCache, token: str = "") -> Any:
    if spec.service_url:
        return ServiceRewardBackend(
            spec.service_url, token=token, timeout_s=spec.timeout_seconds, cache=cache
        )
    return LocalRewardBackend(evaluator, cache)
