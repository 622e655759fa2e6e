"""The store's contract: what every backend promises, checked on every backend.

The suite is parametrised over backends. The local directory needs nothing and runs in the
unit tier; the S3 backend runs against the real MinIO server of the test fixtures, so its
parametrisation carries the integration mark instead (hence no module-wide `pytestmark`:
each test gets exactly one tier from its backend parameter).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.errors import KernelfleetError, StoreError, UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Environment, EvaluationResult, Timing, Verdict
from kernelfleet.core.store import (
    MANIFEST_NAME,
    DirManifest,
    IntegrityError,
    LeaseHeld,
    ManifestEntry,
    NotFound,
    ObjectConflict,
    ResultConflict,
    RunLease,
    Store,
    current_lease,
    open_store,
    verify_run,
)
from kernelfleet.core.store._lease import process_started

FAST_RETRY = RetrySettings(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=10)

BACKENDS = [
    pytest.param("local", marks=pytest.mark.unit, id="local"),
    pytest.param("s3", marks=pytest.mark.integration, id="s3"),
]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield open_store(tmp_path / "store", StoreConfig())
        return
    minio = request.getfixturevalue("minio")
    config = StoreConfig.from_env(minio.config(), retry=FAST_RETRY, part_size=5 * 1024 * 1024)
    yield open_store(f"s3://{minio.bucket}/runs/contract", config)


def make_result(variant: str = "v" * 64, speedup: float = 1.5, host: str = "node-a") -> EvaluationResult:
    timing = Timing(median_ms=1.0, mean_ms=1.1, min_ms=0.9, max_ms=1.3, iqr_ms=0.1, trials=10)
    return EvaluationResult(
        task_hash="t" * 64,
        variant_hash=variant,
        verdict=Verdict.CORRECT,
        reference=timing,
        candidate=timing,
        speedup=speedup,
        environment=Environment(device="cpu", gpu_class="cpu", evaluator_version="0.1.0", host=host),
    )


# ---------------------------------------------------------------- bytes


def test_put_then_get_returns_the_bytes(store: Store) -> None:
    assert store.put_bytes("a/b.bin", b"\x00payload\xff") is True
    assert store.get_bytes("a/b.bin") == b"\x00payload\xff"
    assert store.exists("a/b.bin")
    assert store.stat("a/b.bin").size == 9


def test_writing_the_same_object_again_is_a_no_op(store: Store) -> None:
    assert store.put_bytes("k", b"same") is True
    assert store.put_bytes("k", b"same") is False
    assert store.get_bytes("k") == b"same"


def test_a_different_object_at_an_existing_key_is_refused(store: Store) -> None:
    store.put_bytes("k", b"first")
    with pytest.raises(ObjectConflict) as raised:
        store.put_bytes("k", b"second")
    assert isinstance(raised.value, StoreError)
    assert "immutable" in str(raised.value) and store.url_for("k") in str(raised.value)
    assert store.get_bytes("k") == b"first"


def test_empty_objects_are_objects(store: Store) -> None:
    assert store.put_bytes("empty", b"") is True
    assert store.get_bytes("empty") == b""
    assert store.put_bytes("empty", b"") is False


def test_a_missing_key_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as raised:
        store.get_bytes("nothing/here")
    assert isinstance(raised.value, KeyError) and isinstance(raised.value, KernelfleetError)
    assert str(raised.value) == f"no object at {store.url_for('nothing/here')}"
    assert not store.exists("nothing/here")
    with pytest.raises(NotFound):
        store.stat("nothing/here")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a/", "a\\b", "bad\nkey", ".kf-tmp-x"])
def test_invalid_keys_are_usage_errors(store: Store, key: str) -> None:
    with pytest.raises(UsageError):
        store.put_bytes(key, b"x")


def test_list_is_sorted_relative_to_the_root_and_matches_a_string_prefix(store: Store) -> None:
    assert list(store.list()) == []
    for key in ["variants/b.py", "variants/a.py", "results/x/1.json", "results/y.json", "variantsZ"]:
        store.put_bytes(key, key.encode())
    assert list(store.list()) == sorted(
        ["variants/b.py", "variants/a.py", "results/x/1.json", "results/y.json", "variantsZ"]
    )
    assert list(store.list("variants/")) == ["variants/a.py", "variants/b.py"]
    assert list(store.list("variants")) == ["variants/a.py", "variants/b.py", "variantsZ"]
    assert list(store.list("results/x")) == ["results/x/1.json"]
    assert list(store.list("nothing/")) == []


def test_unicode_keys_round_trip(store: Store) -> None:
    store.put_bytes("tasks/ñame with space.json", b"{}")
    assert list(store.list("tasks/")) == ["tasks/ñame with space.json"]
    assert store.get_bytes("tasks/ñame with space.json") == b"{}"


def test_concurrent_writers_of_one_object_converge(store: Store) -> None:
    data = os.urandom(64 * 1024)
    with ThreadPoolExecutor(max_workers=8) as pool:
        written = list(pool.map(lambda _: store.put_bytes("race/obj", data), range(16)))
    assert any(written)
    assert store.get_bytes("race/obj") == data
    assert list(store.list("race/")) == ["race/obj"]


# ---------------------------------------------------------------- JSON, variants, results


def test_json_is_canonical_so_rewrites_are_idempotent(store: Store) -> None:
    assert store.put_json("m.json", {"b": 1, "a": [1, 2]}) is True
    assert store.put_json("m.json", {"a": [1, 2], "b": 1}) is False
    assert store.get_json("m.json") == {"a": [1, 2], "b": 1}


def test_json_accepts_pydantic_models(store: Store) -> None:
    manifest = DirManifest(files=(ManifestEntry(path="x", size=1, sha256="0" * 64),))
    store.put_json("model.json", manifest)
    assert DirManifest.model_validate(store.get_json("model.json")) == manifest


def test_get_json_of_something_else_says_so(store: Store) -> None:
    store.put_bytes("not.json", b"\x00\x01")
    with pytest.raises(StoreError, match="not valid JSON"):
        store.get_json("not.json")


def test_variants_are_content_addressed_by_the_normalised_source(store: Store) -> None:
    code = "class ModelNew:\n    pass\n"
    digest = store.put_variant(code)
    assert digest == source_hash(code)
    assert store.put_variant("class ModelNew:   \r\n    pass\r\n\r\n\r\n") == digest  # same variant
    assert list(store.list("variants/")) == [f"variants/{digest}.py"]
    assert store.get_variant(digest) == code
    with pytest.raises(NotFound):
        store.get_variant("0" * 64)
    with pytest.raises(UsageError):
        store.get_variant("not-a-hash")


def test_results_are_keyed_and_a_different_second_one_is_a_reported_conflict(store: Store) -> None:
    prefix = "optimizationjobs/ns/job/uid-1"
    first = make_result()
    assert store.put_result(prefix, first) is True
    assert store.put_result(prefix, first) is False
    other = make_result(speedup=9.0, host="node-b")
    with pytest.raises(ResultConflict, match="store verify") as raised:
        store.put_result(prefix, other)
    # Neither is dropped: the first stays at the key, the second beside it, and verify says so.
    assert store.get_result(prefix, first.key) == first
    assert EvaluationResult.model_validate(store.get_json(raised.value.kept_at)) == other
    check = verify_run(store, prefix)
    assert not check.ok
    assert any("two different results" in f.detail for f in check.findings)
    assert store.exists(f"{prefix}/{first.key.path()}")
    assert store.get_result(prefix, make_result(variant="w" * 64).key) is None
    second = make_result(variant="w" * 64)
    store.put_result(prefix, second)
    store.put_bytes(f"{prefix}/results/notes.txt", b"ignored: not a result")
    assert list(store.list_results(prefix)) == [first, second]  # in key order: 'vvv...' < 'www...'


def test_a_result_without_its_key_fields_is_refused(store: Store) -> None:
    bad = make_result().model_copy(update={"environment": Environment(device="cpu", gpu_class="cpu")})
    with pytest.raises(UsageError, match="evaluator_version"):
        store.put_result("p", bad)


# ---------------------------------------------------------------- files and directories


def test_put_file_and_get_file_stream_and_verify(store: Store, tmp_path: Path) -> None:
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    sent: list[int] = []
    assert store.put_file("ckpt/weights.bin", source, progress=sent.append) is True
    assert sum(sent) == source.stat().st_size
    assert store.put_file("ckpt/weights.bin", source) is False
    dest = tmp_path / "out" / "weights.bin"
    received: list[int] = []
    store.get_file("ckpt/weights.bin", dest, progress=received.append)
    assert dest.read_bytes() == source.read_bytes()
    assert sum(received) == source.stat().st_size
    assert [p.name for p in dest.parent.iterdir()] == ["weights.bin"]  # no temp file left behind


def test_get_file_refuses_bytes_that_do_not_match_the_expected_checksum(store: Store, tmp_path: Path) -> None:
    store.put_bytes("f.bin", b"real content")
    dest = tmp_path / "f.bin"
    dest.write_bytes(b"old")
    with pytest.raises(IntegrityError):
        store.get_file("f.bin", dest, sha256="0" * 64)
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".kf-tmp-")) == []


def test_get_file_of_a_missing_key_raises_not_found(store: Store, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        store.get_file("missing.bin", tmp_path / "x")


def _checkpoint(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(os.urandom(2 * 1024 * 1024))
    (root / "config.json").write_text('{"layers": 2}')
    (root / "sub" / "optimizer.pt").write_bytes(os.urandom(1000))
    (root / "empty.txt").write_bytes(b"")
    return root


def test_upload_dir_then_download_dir_round_trips(store: Store, tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "checkpoint-4")
    manifest = store.upload_dir(source, "trainingruns/ns/run/uid/checkpoints/step-4")
    assert [e.path for e in manifest.files] == [
        "config.json",
        "empty.txt",
        "model.safetensors",
        "sub/optimizer.pt",
    ]
    assert manifest.files[2].sha256 == hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    keys = list(store.list("trainingruns/ns/run/uid/checkpoints/step-4/"))
    assert keys[-1].endswith("sub/optimizer.pt") and any(k.endswith(MANIFEST_NAME) for k in keys)
    dest = tmp_path / "restored"
    assert store.download_dir("trainingruns/ns/run/uid/checkpoints/step-4", dest) == manifest
    for entry in manifest.files:
        assert (dest / entry.path).read_bytes() == (source / entry.path).read_bytes()
    # Both directions are idempotent: doing them again changes nothing and raises nothing.
    assert store.upload_dir(source, "trainingruns/ns/run/uid/checkpoints/step-4") == manifest
    progress: list[int] = []
    store.download_dir("trainingruns/ns/run/uid/checkpoints/step-4", dest, progress=progress.append)
    assert sum(progress) == manifest.total_bytes


def test_an_unfinished_upload_is_invisible_and_resumes(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _checkpoint(tmp_path / "ckpt")
    real_put_file = store._put_file
    calls = {"n": 0}

    def failing_put_file(key: str, path: Path, progress: object) -> tuple[bool, str, int]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise StoreError("simulated crash in the middle of the upload")
        return real_put_file(key, path, progress)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_put_file", failing_put_file)
    with pytest.raises(StoreError, match="simulated"):
        store.upload_dir(source, "ck")
    with pytest.raises(NotFound, match=MANIFEST_NAME):
        store.download_dir("ck", tmp_path / "early")
    assert not store.dir_complete("ck")
    monkeypatch.setattr(store, "_put_file", real_put_file)
    manifest = store.upload_dir(source, "ck")
    assert store.dir_complete("ck")
    assert store.download_dir("ck", tmp_path / "late") == manifest


def test_a_changed_directory_cannot_overwrite_an_upload(store: Store, tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt")
    store.upload_dir(source, "ck")
    (source / "config.json").write_text('{"layers": 3}')
    with pytest.raises(ObjectConflict):
        store.upload_dir(source, "ck")


def test_download_dir_verifies_checksums(store: Store, tmp_path: Path) -> None:
    store.put_bytes("bad/a.bin", b"content")
    store.put_json(
        f"bad/{MANIFEST_NAME}", DirManifest(files=(ManifestEntry(path="a.bin", size=7, sha256="0" * 64),))
    )
    with pytest.raises(IntegrityError):
        store.download_dir("bad", tmp_path / "out")
    assert not (tmp_path / "out" / "a.bin").exists()


def test_a_manifest_cannot_write_outside_the_target_directory(store: Store, tmp_path: Path) -> None:
    manifest = {"format": "kernelfleet.dir/v1", "files": [{"path": "../evil", "size": 1, "sha256": "0" * 64}]}
    store.put_bytes(f"evil/{MANIFEST_NAME}", json.dumps(manifest).encode())
    with pytest.raises(UsageError):
        store.download_dir("evil", tmp_path / "out")
    assert not (tmp_path / "evil").exists()


# ---------------------------------------------------------------- locations and the check


def test_urls_name_the_store_and_its_objects(store: Store) -> None:
    assert store.url.startswith(("file:///", "s3://"))
    assert store.url_for("a/b.json") == store.url + "/a/b.json"


def test_check_passes_on_a_working_store(store: Store) -> None:
    steps = store.check()
    assert [s.name for s in steps][-4:] == ["list", "write", "read", "delete probe"]
    assert all(step.ok for step in steps), steps
    assert list(store.list()) == []  # the probe was removed


# ---------------------------------------------------------------- run leases


def test_a_second_process_on_a_leased_run_is_refused_by_name(store: Store) -> None:
    first = RunLease(store, "runs/leased", ttl_s=30, owner="first")
    with first:
        second = RunLease(store, "runs/leased", ttl_s=30, owner="second")
        with pytest.raises(LeaseHeld, match=r"in use by first .*--lease-wait"):
            second.acquire()
        held = current_lease(store, "runs/leased")
        assert held is not None and held.owner == "first" and held.live(time.time())
    released = current_lease(store, "runs/leased")
    assert released is not None and released.released
    with RunLease(store, "runs/leased", ttl_s=30, owner="second"):  # free again
        pass


def test_a_waiting_process_gets_the_run_when_the_holder_lets_go(store: Store) -> None:
    first = RunLease(store, "runs/waited", ttl_s=30, owner="first").acquire()
    threading.Timer(0.5, first.release).start()
    with RunLease(store, "runs/waited", ttl_s=30, wait_s=60, owner="second") as second:
        assert second.epoch > first.epoch or first.epoch == -1
        held = current_lease(store, "runs/waited")
        assert held is not None and held.owner == "second"


def test_a_lease_left_by_a_killed_process_expires(store: Store) -> None:
    abandoned = RunLease(store, "runs/abandoned", ttl_s=0.6, owner="killed")
    abandoned.acquire()
    abandoned._stop.set()  # as if the process died: no renewal, no release
    time.sleep(1.0)
    with RunLease(store, "runs/abandoned", ttl_s=30, owner="next") as taken:
        assert taken.epoch >= 1


def test_a_lease_left_by_a_process_killed_on_this_machine_is_taken_at_once(store: Store) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        abandoned = RunLease(store, "runs/killed-here", ttl_s=300, owner="killed")
        abandoned.acquire()
        abandoned._stop.set()
        # the record as the killed holder wrote it: its pid and start time
        record = current_lease(store, "runs/killed-here")
        assert record is not None
        dead = record.model_copy(
            update={"epoch": record.epoch + 1, "pid": holder.pid, "started": process_started(holder.pid)}
        )
        store.put_bytes(f"runs/killed-here/lease/{dead.epoch:010d}.json", dead.model_dump_json().encode())
        with pytest.raises(LeaseHeld):  # alive: the run is its
            RunLease(store, "runs/killed-here", ttl_s=30, owner="next").acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLease(store, "runs/killed-here", ttl_s=30, owner="next") as taken:  # dead: at once
        assert taken.epoch == record.epoch + 2
        next_free = taken.epoch + 2  # its release writes the one after it
    elsewhere = dead.model_copy(update={"host": "another-host", "epoch": next_free})
    store.put_bytes(
        f"runs/killed-here/lease/{elsewhere.epoch:010d}.json", elsewhere.model_dump_json().encode()
    )
    with pytest.raises(LeaseHeld):  # another machine's holder cannot be seen: its lease runs out
        RunLease(store, "runs/killed-here", ttl_s=30, owner="third").acquire()


def test_racing_processes_take_a_free_run_exactly_once(store: Store) -> None:
    def take(index: int) -> RunLease | None:
        lease = RunLease(store, "runs/raced", ttl_s=30, owner=f"p{index}")
        try:
            return lease.acquire()
        except LeaseHeld:
            return None

    with ThreadPoolExecutor(4) as pool:
        won = [lease for lease in pool.map(take, range(4)) if lease is not None]
    assert len(won) == 1
    won[0].release()
