"""`kernelfleet store verify`: is a run's record consistent, object by object?

A store that answers is not yet a store to trust. This walks a run's objects and checks what
the evaluator and the loop promise about them:

- every result parses, matches the sha256 recorded with it (S3), sits at the key its own content
  names (task, GPU class, evaluator version, variant), and its variant's code is in the store
  and hashes to its name;
- no result key has a conflicting second result (`conflicts/`): a different result for a key
  measured once means something other than the evaluator wrote one of them;
- every task's newest summary names a best variant with a correct result and the speedup the
  summary reports, and one that says "verified" has its verification, intact;
- objects found damaged and replaced (their bytes kept under damaged/) are counted;
- results that are not final (`provisional/`) are counted, and who holds the run's lease.

Errors make the run untrustworthy until a person looks; warnings are worth knowing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from kernelfleet.core.errors import StoreError, UsageError
from kernelfleet.core.models import EvaluationResult, TaskSummary, Verdict
from kernelfleet.core.store._base import CONFLICTS_DIR, DAMAGED_DIR, PROVISIONAL_DIR, RESULTS_DIR, Store
from kernelfleet.core.store._errors import IntegrityError, NotFound
from kernelfleet.core.store._keys import join_key
from kernelfleet.core.store._lease import current_lease


@dataclass(frozen=True)
class Finding:
    level: str  # error, warning, info
    key: str
    detail: str


@dataclass
class RunCheck:
    prefix: str
    results: int = 0
    summaries: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def add(self, level: str, key: str, detail: str) -> None:
        self.findings.append(Finding(level, key, detail))


def verify_run(store: Store, prefix: str) -> RunCheck:
    prefix = prefix.strip("/")
    check = RunCheck(prefix)
    results: dict[str, EvaluationResult] = {}
    variants_checked: dict[str, bool] = {}
    for key in store.list(join_key(prefix, RESULTS_DIR) + "/"):
        if not key.endswith(".json"):
            continue
        try:
            result = store.read_result(key)
        except StoreError as error:
            check.add("error", key, f"not a readable evaluation result: {str(error).splitlines()[0]}")
            continue
        check.results += 1
        results[key] = result
        variant = result.variant_hash
        if variant not in variants_checked:
            try:
                store.get_variant(variant)
                variants_checked[variant] = True
            except NotFound:
                variants_checked[variant] = False
                check.add(
                    "error",
                    key,
                    f"its code (variants/{variant}.py) is not in the store: run the optimize command again "
                    "to restore it",
                )
            except (IntegrityError, UsageError) as error:
                variants_checked[variant] = False
                check.add("error", key, str(error))
    for key in store.list(join_key(prefix, CONFLICTS_DIR) + "/"):
        original = join_key(
            prefix, key[len(join_key(prefix, CONFLICTS_DIR)) + 1 :].rsplit("-", 1)[0] + ".json"
        )
        kept = _read_result(store, key)
        stored = results.get(original)
        check.add(
            "error",
            original,
            f"two different results for one key: the stored one ({_brief(stored)}) and {key} "
            f"({_brief(kept)}); something other than the evaluator wrote one of them, or the run was "
            "measured twice: trust neither until you know which",
        )
    provisional = [k for k in store.list(join_key(prefix, PROVISIONAL_DIR) + "/") if k.endswith(".json")]
    if provisional:
        check.add(
            "info",
            join_key(prefix, PROVISIONAL_DIR),
            f"{len(provisional)} result(s) kept as provisional (a timing that did not settle, a judge that "
            "failed); a resumed run measures them again",
        )
    damaged = [k for k in store.list(join_key(DAMAGED_DIR, prefix) + "/")]
    if damaged:
        check.add(
            "info",
            join_key(DAMAGED_DIR, prefix),
            f"{len(damaged)} object(s) were found damaged and replaced; their bytes are kept there",
        )
    # A task's newest summary is its word; an older one (a search continued after a budget stop,
    # or repaired) was superseded and may name results measured again since.
    newest: dict[str, tuple[str, TaskSummary]] = {}
    for key in store.list(join_key(prefix, "tasks") + "/"):
        directory, name = key.rsplit("/", 1)
        if not (name.startswith("summary-") and name.endswith(".json")):
            continue
        try:
            summary = TaskSummary.model_validate(store.get_json(key))
        except (ValidationError, StoreError) as error:
            check.add("error", key, f"not a readable task summary: {str(error).splitlines()[0]}")
            continue
        check.summaries += 1
        if directory not in newest or newest[directory][1].finished_at <= summary.finished_at:
            newest[directory] = (key, summary)  # per task and GPU class, as the reports read them
    for key, summary in newest.values():
        _check_summary(store, prefix, key, summary, results, check)
    lease = current_lease(store, prefix)
    if lease is not None and not lease.released:
        state = "held by" if lease.live(time.time()) else "left (expired) by"
        check.add("info", join_key(prefix, "lease"), f"the run's lease is {state} {lease.describe()}")
    return check


def _check_summary(
    store: Store,
    prefix: str,
    key: str,
    summary: TaskSummary,
    results: dict[str, EvaluationResult],
    check: RunCheck,
) -> None:
    best = summary.best_variant_hash
    if best is None:
        return
    task16 = summary.task_hash[:16]
    result_key = join_key(
        prefix, RESULTS_DIR, task16, summary.gpu_class, summary.evaluator_version, f"{best}.json"
    )
    result = results.get(result_key)
    if result is None:
        check.add("error", key, f"names best variant {best[:12]}, but the run has no result for it")
        return
    if result.verdict != Verdict.CORRECT:
        check.add("error", key, f"names best variant {best[:12]}, whose result is {result.verdict}")
    if summary.search_speedup is not None and (
        result.speedup is None or not math.isclose(summary.search_speedup, result.speedup, rel_tol=1e-6)
    ):
        check.add(
            "error",
            key,
            f"reports {summary.search_speedup:.4g}x for {best[:12]}, but its result says "
            f"{result.speedup if result.speedup is None else f'{result.speedup:.4g}x'}",
        )
    if summary.verified:
        gpu_root = join_key(prefix, "tasks", task16, summary.gpu_class)
        verification = join_key(gpu_root, "verified", summary.evaluator_version, f"{best}.json")
        try:
            store.read_record(verification, EvaluationResult)
        except NotFound:
            check.add("error", key, f"says verified, but {verification} is missing")
        except StoreError as error:
            check.add("error", key, f"says verified, but its verification is damaged: {error}")


def _read_result(store: Store, key: str) -> EvaluationResult | None:
    try:
        return EvaluationResult.model_validate(store.get_json(key))
    except (ValidationError, StoreError):
        return None


def _brief(result: EvaluationResult | None) -> str:
    if result is None:
        return "missing or unreadable"
    speed = f", {result.speedup:.3g}x" if result.speedup is not None else ""
    host = f", measured on {result.environment.host}" if result.environment.host else ""
    return f"{result.verdict}{speed}{host}"
