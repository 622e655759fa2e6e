"""`kernelfleet submit`: an `optimize` command line turned into an OptimizationJob, or manifests.

What a laptop run reads from local files a cluster reads from the store: local task files and
replay files are uploaded first, under content-addressed keys (`uploads/tasks/<digest>/`,
`uploads/replay/<digest>.jsonl`), so uploading twice writes nothing new and a job never sees
its inputs change. The job's name, unless given, is derived from its spec the way `optimize`
derives a run id, so submitting the same command twice finds the first job instead of
starting a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import (
    GROUP,
    VERSION,
    OptimizationJobSpec,
    PolicyKind,
    PolicySpec,
    TrainingRunSpec,
)
from kernelfleet.core.store import Store, open_store
from kernelfleet.core.tasks import load_tasks
from kernelfleet.operator import strict_yaml

POLICY_FORMS = (
    "compile",
    "replay:PATH.jsonl (a local file is uploaded to the store) or replay:s3://.../FILE.jsonl",
    "openai:MODEL@BASE_URL (an endpoint the pods can reach; its key: --api-key-secret)",
    "hf:MODEL (a store URL or a path in the worker image)",
    "vllm:MODEL (a store URL or a path in the worker image)",
)
SPEC_MODELS: dict[str, type[BaseModel]] = {
    "OptimizationJob": OptimizationJobSpec,
    "TrainingRun": TrainingRunSpec,
}


@dataclass
class Uploads:
    """Puts local inputs into the store the cluster reads; opened only when a local file needs it."""

    store_url: str | None
    _store: Store | None = field(default=None, init=False)

    def store(self) -> Store:
        if self._store is None:
            url = self.store_url or os.environ.get("KERNELFLEET_STORE") or ""
            if not url.startswith("s3://"):
                raise UsageError(
                    "local task and replay files must go to the store the cluster reads: pass --store "
                    "s3://bucket/prefix (the chart's store.url) or set KERNELFLEET_STORE, with "
                    "KERNELFLEET_S3_ENDPOINT and credentials to reach it; or name KernelBench tasks "
                    "(kernelbench-v0:1:1-20), which need no upload"
                    + (f" ({url!r} is not on S3: the cluster cannot read it)" if url else "")
                )
            self._store = open_store(url)
        return self._store

    def tasks(self, selection: str) -> str:
        """Upload the tasks of a local file or directory; the store URL of their folder."""
        tasks = load_tasks(selection)
        digest = hashlib.sha256("\n".join(sorted(f"{t.name}:{t.hash}" for t in tasks)).encode()).hexdigest()
        folder = f"uploads/tasks/{digest[:16]}"
        names = [task.name for task in tasks]
        if len(set(names)) != len(names):
            raise UsageError(f"{selection}: two tasks share a name; the cluster names tasks by their files")
        store = self.store()
        for task in tasks:
            store.put_bytes(f"{folder}/{task.name}.py", task.code.encode())
        return store.url_for(folder) + "/"

    def file(self, path: str, kind: str) -> str:
        local = Path(path)
        try:
            data = local.read_bytes()
        except OSError as error:
            raise UsageError(
                f"cannot read the {kind} file {path}: {error.strerror}; check the path"
            ) from None
        key = f"uploads/{kind}/{hashlib.sha256(data).hexdigest()[:16]}{local.suffix}"
        store = self.store()
        store.put_bytes(key, data)
        return store.url_for(key)


def is_remote(selection: str) -> bool:
    return selection.startswith(("kernelbench-", "s3://"))


def task_selections(selections: Sequence[str], uploads: Uploads) -> list[str]:
    resolved = []
    for selection in selections:
        if selection.startswith("kernelbench-"):
            load_tasks(selection)  # a bad level or id fails here, not in the operator
            resolved.append(selection)
        elif is_remote(selection):
            resolved.append(selection)
        else:
            resolved.append(uploads.tasks(selection))
    return resolved


def policy_spec(text: str, uploads: Uploads, *, api_key_secret: str = "", **options: Any) -> PolicySpec:
    """The PolicySpec of an `optimize`-style policy (`compile`, `replay:FILE`, `openai:M@URL`, ...)."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.lower()

    def bad(why: str) -> UsageError:
        return UsageError(
            f"bad policy {text!r}: {why}. On a cluster a policy is one of:\n  " + "\n  ".join(POLICY_FORMS)
        )

    if kind == "compile":
        if rest:
            raise bad("a cluster job runs every torch.compile variant; give plain `compile`")
        return PolicySpec(kind=PolicyKind.COMPILE)
    if kind == "replay":
        if not rest:
            raise bad("replay needs a file")
        path = rest if rest.startswith("s3://") else uploads.file(rest, "replay")
        return PolicySpec(kind=PolicyKind.REPLAY, path=path)
    if kind == "openai":
        model, at, base_url = rest.partition("@")
        if not at:
            base_url = os.environ.get("KERNELFLEET_OPENAI_BASE_URL", "") or os.environ.get(
                "OPENAI_BASE_URL", ""
            )
        if not model or not base_url:
            raise bad(
                "openai needs a model and an endpoint the pods can reach, e.g. openai:qwen@http://vllm:8000/v1"
            )
        return PolicySpec(
            kind=PolicyKind.OPENAI, model=model, base_url=base_url, api_key_secret=api_key_secret, **options
        )
    if kind in ("hf", "vllm"):
        if not rest:
            raise bad(f"{kind} needs a model")
        return PolicySpec(kind=PolicyKind(kind), model=rest, **options)
    raise bad(f"unknown kind {kind!r}")


def derived_name(kind: str, spec: BaseModel) -> str:
    """`opt-<12 hex>` from the spec: the same command submits the same job."""
    text = json.dumps(spec.model_dump(mode="json", by_alias=True, exclude_defaults=True), sort_keys=True)
    stem = "opt" if kind == "OptimizationJob" else "train"
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def manifest(kind: str, name: str, spec: BaseModel, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/created-by": "kernelfleet-submit"},
        },
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_defaults=True),
    }


def read_manifests(path: str) -> list[dict[str, Any]]:
    """The OptimizationJobs and TrainingRuns of a YAML file ('-' reads stdin), each spec validated
    by its model so that a wrong field is named before anything reaches the cluster."""
    import sys

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}; check the path") from None
    try:
        documents = [doc for doc in strict_yaml.load_all(text) if doc]
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {error}") from None
    if not documents:
        raise UsageError(f"{path} holds no resources")
    for number, doc in enumerate(documents, start=1):
        where = f"{path} (document {number})" if len(documents) > 1 else path
        if not isinstance(doc, dict) or doc.get("kind") not in SPEC_MODELS:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise UsageError(
                f"{where}: kind {kind!r} is not OptimizationJob or TrainingRun; submit takes only those"
            )
        if doc.get("apiVersion") != f"{GROUP}/{VERSION}":
            raise UsageError(f"{where}: apiVersion must be {GROUP}/{VERSION}, not {doc.get('apiVersion')!r}")
        meta = doc.get("metadata") or {}
        if not meta.get("name"):
            raise UsageError(f"{where}: metadata.name is missing; give the {doc['kind']} a name")
        try:
            SPEC_MODELS[doc["kind"]].model_validate(doc.get("spec") or {})
        except ValidationError as error:
            raise UsageError(f"{where}: {spec_errors(error)}") from None
    return documents


def spec_errors(error: ValidationError) -> str:
    """A spec's validation errors with the paths a manifest uses (spec.budget.rounds: ...)."""
    problems = []
    for item in error.errors():
        path = "spec" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"])
        problems.append(f"{path}: {str(item['msg']).removeprefix('Value error, ')}")
    return "; ".join(problems)


# ---------------------------------------------------------------------- following a job

DONE_PHASES = ("Succeeded", "Failed", "Complete")


def finished(resource: dict[str, Any]) -> bool:
    status = resource.get("status") or {}
    if status.get("phase") in DONE_PHASES:
        return True
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def succeeded(resource: dict[str, Any]) -> bool:
    status = resource.get("status") or {}
    failed = any(
        c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return not failed and status.get("phase") != "Failed"


def progress_line(resource: dict[str, Any]) -> str:
    from kernelfleet.operator.client._status import attention, per_class_speedups, progress

    status = resource.get("status") or {}
    notes = attention(resource)
    phase = status.get("phase") or "waiting for the operator"
    line = f"{resource['metadata']['name']}: {phase}, {progress(resource)}"
    speedups = per_class_speedups(resource)
    if speedups != "-":
        line += f", best/median {speedups}"
    return line + (f"  [{'; '.join(notes)}]" if notes else "")


def bar(done: int, total: int, width: int = 24) -> str:
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def follow(
    read: Callable[[], dict[str, Any]], say: Callable[[str], None], interval_s: float = 2.0
) -> dict[str, Any]:
    """Poll `read` until the resource is finished, saying each change of its progress line."""
    import time

    last = ""
    while True:
        resource = read()
        status = resource.get("status") or {}
        if resource["kind"] == "OptimizationJob":
            ended = status.get("tasksDone", 0) + status.get("tasksFailed", 0)
            line = f"{bar(ended, status.get('tasksTotal', 0))} "
        else:
            line = ""
        line += progress_line(resource)
        if line != last:
            say(line)
            last = line
        if finished(resource):
            return resource
        time.sleep(interval_s)
