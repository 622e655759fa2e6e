"""The store's one interface; what is common to every backend is written here, once.

A backend supplies a handful of primitives (put/get bytes and files, exists, list, stat)
with the two guarantees everything else relies on:

- atomic publication: a reader sees a whole object or none (local: a temp file linked into
  place; S3: a single PUT, or a multipart upload that appears only when completed);
- immutability: `put_*` returns False when an identical object already exists, and raises
  `ObjectConflict` when a different one does, so writers racing with the same content
  converge on one object.

On top of these this class builds JSON, content-addressed variants, evaluation results,
whole directories with a manifest written last (checkpoints), and the connectivity check.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kernelfleet.core.errors import KernelfleetError, UsageError
from kernelfleet.core.hashing import normalize_source, source_hash
from kernelfleet.core.jsontext import dumps
from kernelfleet.core.models import EvaluationResult, ResultKey
from kernelfleet.core.store._errors import (
    CorruptObject,
    IntegrityError,
    NotFound,
    ObjectConflict,
    ResultConflict,
)
from kernelfleet.core.store._keys import check_key, join_key
from kernelfleet.core.store._manifest import MANIFEST_NAME, DirManifest, ManifestEntry

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Receives byte counts as a transfer advances (negative when a retry starts a file again)."""

OnCorrupt = Callable[[CorruptObject], None]
"""Told of each corrupt object a listing skips; without one, the listing raises."""

VARIANTS_PREFIX = "variants"
RESULTS_DIR = "results"
CONFLICTS_DIR = "conflicts"
PROVISIONAL_DIR = "provisional"
DAMAGED_DIR = "damaged"  # at the store's root: copies of objects found damaged, then repaired
CHECK_PREFIX = ".kernelfleet-check"
CHUNK = 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ObjectInfo:
    """What a backend knows about an object without reading it."""

    key: str
    size: int
    sha256: str | None = None  # known when the backend stores it alongside (S3 metadata)


@dataclass(frozen=True)
class CheckStep:
    """One line of `kernelfleet store check`: what was tried and what came of it."""

    name: str
    ok: bool
    detail: str
    required: bool = True


def encode_json(obj: BaseModel | dict[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, non-finite numbers as null): the same value always gives the
    same bytes, so rewriting it is a no-op rather than a conflict."""
    value = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    if not isinstance(value, dict):
        raise UsageError(f"put_json stores a pydantic model or a dict, not {type(obj).__name__}")
    return (dumps(value, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def variant_key(variant_hash: str) -> str:
    return f"{VARIANTS_PREFIX}/{variant_hash}.py"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def walk_files(root: Path) -> Iterator[tuple[str, Path]]:
    """Regular files below `root` (symlinks to files included), as ('a/b.bin', path), sorted.

    Symlinked directories are not followed: a checkpoint is its own files, and a link cycle
    must not turn an upload into an endless one.
    """
    found: list[tuple[str, Path]] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(directory) / name
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    yield from sorted(found)


class Store(abc.ABC):
    """An immutable key-value store of artifacts. Get one with `open_store(url)`."""

    # ------------------------------------------------------------------ backend primitives

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's canonical URL (`file:///...` or `s3://bucket/prefix`)."""

    @abc.abstractmethod
    def url_for(self, key: str) -> str:
        """The URL of one object, for messages and reports."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> bool:
        """Store `data` at `key`: True if written, False if the identical object was there.

        Raises ObjectConflict if a different object is there.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; NotFound if there is none."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with `prefix` (a plain string prefix, as in S3), sorted."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size (and sha256 when known) of an object; NotFound if there is none."""

    @abc.abstractmethod
    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Stream an object into a local file, atomically replacing it, and verify its checksum
        (`sha256` if given, else the one recorded with the object, if any)."""

    @abc.abstractmethod
    def _put_file(self, key: str, path: Path, progress: Progress | None) -> tuple[bool, str, int]:
        """Stream a local file to `key`; return (written, sha256, size)."""

    @abc.abstractmethod
    def _overwrite(self, key: str, data: bytes) -> None:
        """Replace an object whole (atomically, as a first write). Only `repair` uses it, on an
        object a reader found damaged: objects are otherwise immutable."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Remove an object. Only the connectivity check uses it: objects are otherwise immutable."""

    @abc.abstractmethod
    def _preflight(self) -> Iterator[CheckStep]:
        """Backend-specific first steps of `check` (reaching the server, the bucket, ...)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------------ files and JSON

    def put_file(self, key: str, path: str | os.PathLike[str], *, progress: Progress | None = None) -> bool:
        """Stream a local file to `key` (in parts, for large files); same contract as put_bytes."""
        written, _, _ = self._put_file(check_key(key), Path(path), progress)
        return written

    def put_json(self, key: str, obj: BaseModel | dict[str, Any]) -> bool:
        return self.put_bytes(key, encode_json(obj))

    def get_json(self, key: str) -> dict[str, Any]:
        """The JSON object at `key`; NotFound if none, CorruptObject if it is not a JSON object."""
        data = self.get_bytes(key)
        try:
            value = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptObject(
                f"object {self.url_for(key)} is not valid JSON ({error}): it was not written with "
                "put_json, or it is corrupt",
                key,
            ) from None
        if not isinstance(value, dict):
            raise CorruptObject(
                f"object {self.url_for(key)} holds JSON {type(value).__name__}, not an object", key
            )
        return value

    def get_record(self, key: str) -> bytes:
        """The bytes of an object kernelfleet wrote and vouches for (a result, a variant's code),
        checked against the sha256 recorded with it where the backend records one: a mismatch,
        or (S3) an object without kernelfleet's record, is a `CorruptObject`."""
        return self.get_bytes(key)

    def read_record(self, key: str, model: type[M]) -> M:
        """`read_model` through `get_record`."""
        data = self.get_record(key)
        try:
            value = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptObject(
                f"object {self.url_for(key)} is not valid JSON ({error}): it is damaged", key
            ) from None
        if not isinstance(value, dict):
            raise CorruptObject(
                f"object {self.url_for(key)} holds JSON {type(value).__name__}, not an object", key
            )
        return self._model(model, key, value)

    def read_result(self, key: str) -> EvaluationResult:
        """The evaluation result at `key`, checked: its recorded hash (`get_record`), its model,
        and, under a run's results/, that it is the result its key names (task, GPU class,
        evaluator version, variant). NotFound if none, CorruptObject if damaged."""
        result = self.read_record(key, EvaluationResult)
        marker = f"{RESULTS_DIR}/"
        if f"/{marker}" in f"/{key}":
            tail = key[key.rindex(marker) :]
            if tail != result.key.path():
                raise CorruptObject(
                    f"object {self.url_for(key)} holds the result of {result.key.path()}, not of its key: "
                    "it is damaged or was put there by hand",
                    key,
                )
        return result

    def repair(self, key: str, data: bytes) -> str:
        """Write `data` over an object a reader found damaged (the caller has checked it), keeping
        the damaged bytes, when there are any, under damaged/<key>-<time> first. Returns that key
        ("" when the object was missing). Nothing measured is lost: what was there stays readable
        as it was, beside the store's records."""
        kept = ""
        try:
            old = self.get_bytes(key)
        except NotFound:
            old = None
        except IntegrityError:
            old = self._raw_bytes(key)
        if old is not None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            kept = join_key(DAMAGED_DIR, f"{key}-{stamp}")
            self.put_bytes(kept, old)
            log.warning("replacing the damaged object %s; its bytes are kept at %s", key, kept)
        self._overwrite(key, data)
        return kept

    def _raw_bytes(self, key: str) -> bytes:
        """The object's bytes without any check (S3 overrides `get_bytes`'s check away)."""
        return self.get_bytes(key)

    def read_model(self, key: str, model: type[M]) -> M:
        """The object at `key` as `model`; NotFound if none, CorruptObject if it is not one."""
        return self._model(model, key, self.get_json(key))

    def _model(self, model: type[M], key: str, raw: dict[str, Any]) -> M:
        try:
            return model.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise CorruptObject(
                f"object {self.url_for(key)} is not a valid {model.__name__} ({error.error_count()} "
                f"problem(s), first: {where + ': ' if where else ''}{first['msg']}): it was written by an "
                "incompatible kernelfleet version, or it is corrupt",
                key,
            ) from None

    # ------------------------------------------------------------------ variants and results

    def put_variant(self, code: str, *, check: bool = False) -> str:
        """Store the normalised source at variants/<sha256>.py; return the hash. The key is the
        content's address, so another object there is a damaged copy: it is repaired. With
        `check`, a copy the backend takes for this one (S3 compares recorded hashes) is read
        back too, and repaired if damaged: for restoring code a reader found lost."""
        digest = source_hash(code)
        key = variant_key(digest)
        data = normalize_source(code).encode("utf-8")
        try:
            written = self.put_bytes(key, data)
        except ObjectConflict:
            self.repair(key, data)
            return digest
        if check and not written:
            try:
                self.get_variant(digest)
            except CorruptObject:
                self.repair(key, data)
        return digest

    def get_variant(self, variant_hash: str) -> str:
        """The code of a variant, checked against its content address (and recorded hash);
        NotFound if missing, CorruptObject if damaged."""
        if not _HEX64.match(variant_hash):
            raise UsageError(f"{variant_hash!r} is not a variant hash: expected 64 lowercase hex digits")
        key = variant_key(variant_hash)
        try:
            code = self.get_record(key).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptObject(
                f"variant {self.url_for(key)} is not UTF-8 text: the object is corrupt", key
            ) from None
        if source_hash(code) != variant_hash:
            raise CorruptObject(
                f"variant {self.url_for(key)} does not hash to its name: the object is corrupt", key
            )
        return code

    def put_result(self, prefix: str, result: EvaluationResult) -> bool:
        """Store a result at `{prefix}/{result.key.path()}`; False if the identical one is there.

        A result key is measured once by design, so a *different* result already at the key is
        never kept silently: something other than this evaluator wrote one of the two (or a
        run was measured twice). The new result is stored beside it under
        `{prefix}/conflicts/...` (nothing measured is lost) and `ResultConflict` says where;
        `kernelfleet store verify` lists every conflict of a run.
        """
        rkey = result.key
        if not (rkey.task_hash and rkey.variant_hash and rkey.gpu_class and rkey.evaluator_version):
            raise UsageError(
                "an evaluation result needs task_hash, variant_hash, environment.gpu_class and "
                f"environment.evaluator_version to be stored; got {rkey.model_dump()}"
            )
        key = join_key(prefix, rkey.path())
        data = encode_json(result)
        try:
            if self.put_bytes(key, data):
                return True
            # Taken for identical: a key is measured once, so this is a repeat after a reader
            # found the object damaged, and the backend may have compared only a recorded hash.
            try:
                self.read_result(key)
            except CorruptObject:
                self.repair(key, data)
                return True
            return False
        except ObjectConflict:
            try:
                self.read_result(key)
            except CorruptObject:
                # What is there cannot be read as this key's result: it is damaged, not a rival.
                self.repair(key, data)
                return True
            except NotFound:
                pass
            digest = hashlib.sha256(data).hexdigest()[:16]
            kept = join_key(prefix, CONFLICTS_DIR, rkey.path().removesuffix(".json") + f"-{digest}.json")
            self.put_bytes(kept, data)
            log.warning("a different result is already stored at %s; this one is kept at %s", key, kept)
            raise ResultConflict(
                f"a different result is already stored at {self.url_for(key)}; this evaluation's result "
                f"is kept at {self.url_for(kept)}. Neither is trusted until you look: run "
                f"`kernelfleet store verify {self.url} {prefix}`",
                key,
                kept,
            ) from None

    def put_provisional(self, prefix: str, result: EvaluationResult) -> str:
        """Keep a result that is not final (`EvaluationResult.final`) apart from the run's
        results, under a key of its own: nothing measured is lost, and a resumed run, which
        finds no result at the key, measures again."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        key = join_key(prefix, PROVISIONAL_DIR, result.key.path().removesuffix(".json") + f"-{stamp}.json")
        self.put_json(key, result)
        return key

    def get_result(self, prefix: str, key: ResultKey) -> EvaluationResult | None:
        object_key = join_key(prefix, key.path())
        try:
            return self.read_result(object_key)
        except NotFound:
            return None

    def list_results(self, prefix: str, on_corrupt: OnCorrupt | None = None) -> Iterator[EvaluationResult]:
        """Every result stored under `prefix`, in key order. A corrupt one raises CorruptObject,
        or, given `on_corrupt`, is handed to it and skipped: one bad object must not make a
        whole run unreadable."""
        for key in self.list(join_key(prefix, RESULTS_DIR) + "/"):
            if key.endswith(".json"):
                try:
                    yield self.read_result(key)
                except CorruptObject as error:
                    if on_corrupt is None:
                        raise
                    on_corrupt(error)

    # ------------------------------------------------------------------ directories (checkpoints)

    def upload_dir(
        self, local_dir: str | os.PathLike[str], key_prefix: str, *, progress: Progress | None = None
    ) -> DirManifest:
        """Upload every file below `local_dir` to `key_prefix/...`, then the manifest, last.

        Running it again after an interruption uploads only what is missing. A file that
        changed since the earlier attempt raises ObjectConflict: upload to a new prefix.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise UsageError(f"cannot upload {root}: it is not a directory")
        entries = []
        for relative, path in walk_files(root):
            if relative == MANIFEST_NAME:
                raise UsageError(
                    f"{path} is named like the store's manifest ({MANIFEST_NAME}): rename it before uploading"
                )
            key = check_key(join_key(key_prefix, relative))
            _, digest, size = self._put_file(key, path, progress)
            entries.append(ManifestEntry(path=relative, size=size, sha256=digest))
        manifest = DirManifest(files=tuple(entries))
        self.put_json(join_key(key_prefix, MANIFEST_NAME), manifest)
        return manifest

    def dir_complete(self, key_prefix: str) -> bool:
        """True when upload_dir finished at `key_prefix` (its manifest, written last, exists)."""
        return self.exists(join_key(key_prefix, MANIFEST_NAME))

    def download_dir(
        self, key_prefix: str, local_dir: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> DirManifest:
        """Download a directory written by upload_dir, verifying every file's sha256.

        Files already present with the right checksum are kept, so an interrupted download
        resumes. Raises NotFound when the manifest is missing (the upload never finished).
        """
        manifest_key = join_key(key_prefix, MANIFEST_NAME)
        try:
            raw = self.get_json(manifest_key)
        except NotFound:
            raise NotFound(
                f"no complete directory at {self.url_for(key_prefix or '.')}: {MANIFEST_NAME} is "
                "missing, so its upload did not finish or the prefix is wrong"
            ) from None
        manifest = self._model(DirManifest, manifest_key, raw)
        root = Path(local_dir)
        root.mkdir(parents=True, exist_ok=True)
        for entry in manifest.files:
            check_key(entry.path)  # a manifest must not write outside local_dir
            dest = root.joinpath(*entry.path.split("/"))
            if dest.is_file() and dest.stat().st_size == entry.size and file_sha256(dest) == entry.sha256:
                if progress is not None:
                    progress(entry.size)
                continue
            self.get_file(join_key(key_prefix, entry.path), dest, sha256=entry.sha256, progress=progress)
        return manifest

    # ------------------------------------------------------------------ connectivity

    def check(self) -> tuple[CheckStep, ...]:
        """Try what kernelfleet needs (reach, list, write, read back) and report each step.

        The probe object is deleted afterwards when the credentials allow it; kernelfleet
        itself never deletes, so a failed delete is only a warning.
        """
        steps = list(self._preflight())
        if any(step.required and not step.ok for step in steps):
            return tuple(steps)
        probe = join_key(CHECK_PREFIX, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        payload = f"kernelfleet store check probe {probe}\n".encode()

        def run(name: str, action: Callable[[], str], required: bool = True) -> bool:
            try:
                steps.append(CheckStep(name, True, action(), required))
                return True
            except KernelfleetError as error:
                steps.append(CheckStep(name, False, str(error), required))
                return False

        def listing() -> str:
            next(iter(self.list(CHECK_PREFIX + "/")), None)
            return f"listed {self.url_for(CHECK_PREFIX + '/')}"

        def write() -> str:
            self.put_bytes(probe, payload)
            return f"wrote {self.url_for(probe)}"

        def read() -> str:
            if self.get_bytes(probe) != payload:
                raise IntegrityError(f"read back {self.url_for(probe)} but got different bytes")
            return f"read {self.url_for(probe)} back intact"

        def delete() -> str:
            self._delete(probe)
            return f"deleted {self.url_for(probe)}"

        if run("list", listing) and run("write", write) and run("read", read):
            run("delete probe", delete, required=False)
        return tuple(steps)
