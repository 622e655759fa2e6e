"""A damaged run on a real MinIO: an object truncated, replaced or deleted behind kernelfleet's
back is never read as a result, `store verify` fails on it, the reports name the task, and the
optimisation loop run again measures or restores what was lost."""

from __future__ import annotations

import io
from typing import Any

import pytest

from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.store import CorruptObject, NotFound, S3Store, open_store, verify_run
from kernelfleet.core.store._s3 import META_SHA256
from kernelfleet.search import Budget, LoopSettings, QuietProgress, ReplayPolicy, ReplayRow, optimize
from kernelfleet.search._report import load_run
from tests.support.search import ScriptedEvaluator, make_task, variant_code

FAST_RETRY = RetrySettings(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=10)
PREFIX = "runs/damage"
TASK = make_task("double")
ROWS = [
    ReplayRow(task="double", code=variant_code("fast", 2.5), name="fast"),
    ReplayRow(task="double", code=variant_code("slow", 0.8), name="slow"),
]


def s3_store(minio: Any) -> S3Store:
    store = open_store(f"s3://{minio.bucket}/kf", StoreConfig.from_env(minio.config(), retry=FAST_RETRY))
    assert isinstance(store, S3Store)
    return store


def run(store: S3Store) -> ScriptedEvaluator:
    evaluator = ScriptedEvaluator()
    optimize(
        [TASK],
        [ReplayPolicy(ROWS)],
        store=store,
        prefix=PREFIX,
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=1, samples_per_round=2),
        settings=LoopSettings(),
        progress=QuietProgress(),
    )
    return evaluator


def raw(minio: Any, key: str) -> tuple[bytes, dict[str, str]]:
    client = minio.client()
    name = f"kf/{key}"
    stat = client.stat_object(bucket_name=minio.bucket, object_name=name)
    response = client.get_object(bucket_name=minio.bucket, object_name=name)
    try:
        return bytes(response.read()), dict(stat.metadata or {})
    finally:
        response.close()
        response.release_conn()


def put_raw(minio: Any, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
    minio.client().put_object(
        bucket_name=minio.bucket,
        object_name=f"kf/{key}",
        data=io.BytesIO(data),
        length=len(data),
        metadata=metadata,
    )


def damage(minio: Any, key: str, how: str, other: str) -> None:
    data, metadata = raw(minio, key)
    if how == "truncate":  # the bytes cut short, the object's recorded sha256 left as it was
        recorded = {META_SHA256: metadata.get(META_SHA256) or metadata.get(META_SHA256.title(), "")}
        put_raw(minio, key, data[: len(data) // 2], recorded)
    elif how == "replace":  # another valid object put there by another tool
        put_raw(minio, key, raw(minio, other)[0])
    else:
        minio.client().remove_object(bucket_name=minio.bucket, object_name=f"kf/{key}")


@pytest.mark.parametrize("how", ["truncate", "replace", "delete"])
def test_a_damaged_result_on_minio_is_caught_reported_and_measured_again(minio: Any, how: str) -> None:
    store = s3_store(minio)
    run(store)
    [outcome] = load_run(store, PREFIX).outcomes
    assert outcome.summary is not None and outcome.best_speedup == pytest.approx(2.5)
    best = outcome.summary.best_variant_hash
    assert best is not None
    results = sorted(k for k in store.list(f"{PREFIX}/results/") if k.endswith(".json"))
    key = next(k for k in results if k.endswith(f"/{best}.json"))
    other = next(k for k in results if k != key)
    damage(minio, key, how, other)

    if how == "delete":
        with pytest.raises(NotFound):
            store.read_result(key)
    else:
        with pytest.raises(CorruptObject):
            store.read_result(key)
    [outcome] = load_run(store, PREFIX).outcomes
    assert outcome.damage and outcome.best_speedup is None and "DAMAGED" in outcome.status
    assert not verify_run(store, PREFIX).ok

    again = run(store)
    assert [variant for _, variant in again.evaluated] == [best]  # only what was damaged
    assert store.read_result(key).variant_hash == best
    assert raw(minio, key)[1]  # written by kernelfleet again: its sha256 is recorded
    [outcome] = load_run(store, PREFIX).outcomes
    assert not outcome.damage and outcome.best_speedup == pytest.approx(2.5)
    check = verify_run(store, PREFIX)
    assert check.ok, check.findings
    if how != "delete":
        assert [k for k in store.list(f"damaged/{key}-")], "the damaged bytes are kept"


@pytest.mark.parametrize("how", ["truncate", "replace", "delete"])
def test_damaged_code_on_minio_is_caught_and_restored(minio: Any, how: str) -> None:
    store = s3_store(minio)
    run(store)
    [outcome] = load_run(store, PREFIX).outcomes
    best = outcome.best_variant_hash
    assert best is not None
    key = f"variants/{best}.py"
    damage(
        minio,
        key,
        how,
        f"variants/{next(v for v in (r.variant_hash for r in outcome.results) if v != best)}.py",
    )

    with pytest.raises(NotFound if how == "delete" else CorruptObject):
        store.get_variant(best)
    [outcome] = load_run(store, PREFIX).outcomes
    assert outcome.damage and outcome.best_code is None
    check = verify_run(store, PREFIX)
    assert not check.ok and any(key in f.detail or best in f.detail for f in check.findings), check.findings

    run(store)
    assert "variant: fast" in store.get_variant(best)
    [outcome] = load_run(store, PREFIX).outcomes
    assert not outcome.damage and outcome.best_code is not None and "variant: fast" in outcome.best_code
    assert verify_run(store, PREFIX).ok
