"""`kernelfleet eval serve`: the evaluator as an HTTP reward service over the local GPUs.

Many producers (RL trainer ranks, worker pods, people) share one machine's GPUs through it:

    POST /v1/evaluations        one request or a list: {"reference", "candidate", "profile",
                                "options"}; answers 202 with the ids at once, 429 with
                                Retry-After when the queue is full, 400 naming what is wrong
    GET  /v1/evaluations/{id}   202 {"id", "status": "pending"|"running"} until done, then 200
                                with exactly what `kernelfleet eval --json` prints
    GET  /healthz               200 {"status": "ok", ...}
    GET  /metrics               Prometheus text: queue depth, evaluations by verdict, timing-lane
                                busy share, seconds per stage

    GET  /openapi.json          the OpenAPI schema of these routes

With a token configured every /v1 call needs `Authorization: Bearer TOKEN` (/healthz, /metrics
and the schema stay open for probes and scrapers; they carry no code and no results).

This module is the queue and its records; `_http` is the HTTP front (FastAPI on uvicorn),
imported only by a process that serves. The pipeline behind it (`Evaluator.submit`) does the
scheduling.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kernelfleet.core.models import EvaluationResult, Task
from kernelfleet.core.settings import merged
from kernelfleet.core.tasks import missing_task_names
from kernelfleet.evaluator._config import PROFILES, EvalConfig
from kernelfleet.evaluator._evaluator import EvaluationCancelled, Evaluator

log = logging.getLogger(__name__)

# Options a request may set, by path (grouped as EvalConfig is: {"timing": {"trials": 7}}); the
# device, caches and worker counts are the server's.
REQUEST_OPTIONS = frozenset(
    {
        "correctness.trials",
        "correctness.require_kernel",
        "correctness.float64_reference",
        "timing.trials",
        "timing.warmup",
        "timing.enabled",
        "timing.speedup_recheck",
        "timing.precision",
        "timing.processes",
        "timing.keep_samples",
        "limits.timeout_seconds",
        "seed",
    }
)


def option_paths(options: dict[str, Any], prefix: str = "") -> list[str]:
    """The paths a request's options set: {"timing": {"trials": 7}} -> ["timing.trials"]."""
    paths: list[str] = []
    for key, value in options.items():
        path = f"{prefix}{key}"
        paths += option_paths(value, path + ".") if isinstance(value, dict) else [path]
    return paths


MAX_BODY = 8 * 1024 * 1024
MAX_BATCH = 256


class RequestError(Exception):
    """A request the service refuses; `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


@dataclass
class _Entry:
    id: str
    submitted: float
    future: Any
    result: dict[str, Any] | None = None
    error: str = ""
    finished: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class EvaluationService:
    """The queue and the records behind the HTTP front; usable without HTTP (tests, embedding).

    `max_queue` bounds the evaluations not yet finished; `keep` bounds the finished ones held
    for GET (oldest dropped first).
    """

    def __init__(self, evaluator: Evaluator, *, max_queue: int = 64, keep: int = 10000) -> None:
        self.evaluator = evaluator
        self.max_queue = max_queue
        self.keep = keep
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._open = 0
        self.refused = 0
        self.started = time.monotonic()

    # -- requests

    def _parse(self, body: Any) -> tuple[Task, str, EvalConfig]:
        if not isinstance(body, dict):
            raise RequestError(400, "each evaluation is an object with 'reference' and 'candidate'")
        unknown = sorted(set(body) - {"reference", "candidate", "profile", "options", "name"})
        if unknown:
            raise RequestError(400, f"unknown field(s) {unknown}; use reference, candidate, profile, options")
        reference, candidate = body.get("reference"), body.get("candidate")
        if not isinstance(reference, str) or not isinstance(candidate, str):
            raise RequestError(400, "'reference' and 'candidate' must be Python source strings")
        try:
            missing = missing_task_names(reference)
        except SyntaxError as error:
            raise RequestError(
                400, f"the reference is not valid Python ({error.msg}, line {error.lineno})"
            ) from None
        except (ValueError, RecursionError, MemoryError) as error:
            raise RequestError(400, f"the reference cannot be parsed ({type(error).__name__})") from None
        if missing:
            raise RequestError(
                400,
                f"the reference does not define {', '.join(missing)}; a task defines Model, get_inputs "
                "and get_init_inputs",
            )
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "'options' must be an object")
        bad = sorted(set(option_paths(options)) - REQUEST_OPTIONS)
        if bad:
            raise RequestError(
                400, f"option(s) {bad} cannot be set per request; allowed: {sorted(REQUEST_OPTIONS)}"
            )
        profile = body.get("profile")
        if profile is not None:
            if profile not in PROFILES:
                raise RequestError(400, f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
            options = merged(options, {"correctness": {"profile": profile}})
        try:
            config = EvalConfig.model_validate(merged(self.evaluator.config.model_dump(), options))
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise RequestError(400, f"bad option: {problems}") from None
        name = body.get("name") if isinstance(body.get("name"), str) else "task"
        return Task(name=name, code=reference, source="service"), candidate, config

    def submit(self, body: Any) -> list[str]:
        """Queue one request or a list (all or none); the ids, in order."""
        many = body if isinstance(body, list) else [body]
        if not many:
            raise RequestError(400, "an empty list: send one evaluation or a list of them")
        if len(many) > MAX_BATCH:
            raise RequestError(413, f"{len(many)} evaluations in one request; send at most {MAX_BATCH}")
        parsed = [self._parse(item) for item in many]
        with self._lock:
            if self._open + len(parsed) > self.max_queue:
                self.refused += 1
                wait = self._retry_after()
                raise RequestError(
                    429,
                    f"the queue is full ({self._open} of {self.max_queue} evaluations open); "
                    f"retry in {wait} s",
                    {"Retry-After": str(wait)},
                )
            self._open += len(parsed)
        ids = []
        for task, candidate, config in parsed:
            entry = _Entry(id=secrets.token_hex(12), submitted=time.monotonic(), future=None)
            with self._lock:
                self._entries[entry.id] = entry
            entry.future = self.evaluator.submit(task, candidate, config)
            entry.future.add_done_callback(lambda future, entry=entry: self._finished(entry, future))
            ids.append(entry.id)
        return ids

    def _retry_after(self) -> int:
        """About how long until a slot frees: the recent time per evaluation, at least 1 s."""
        recent = [e.finished - e.submitted for e in list(self._entries.values())[-20:] if e.finished]
        per = sum(recent) / len(recent) if recent else 5.0
        return max(1, min(60, round(per)))

    def _finished(self, entry: _Entry, future: Any) -> None:
        from kernelfleet.evaluator.cli import result_json

        try:
            result: EvaluationResult = future.result()
            entry.result = result_json(result)
        except EvaluationCancelled as error:
            entry.error = f"cancelled: {error}"
        except BaseException as error:  # an evaluator failure: the request learns why
            log.exception("evaluation %s failed", entry.id)
            entry.error = f"{type(error).__name__}: {error}"
        entry.finished = time.monotonic()
        with self._lock:
            self._open -= 1
            finished = [key for key, e in self._entries.items() if e.finished is not None]
            for key in finished[: max(0, len(finished) - self.keep)]:
                del self._entries[key]

    def get(self, evaluation_id: str) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for one id: 202 while open, 200 with the result when done."""
        with self._lock:
            entry = self._entries.get(evaluation_id)
        if entry is None:
            raise RequestError(404, f"no evaluation {evaluation_id!r} (unknown, or finished long ago)")
        if entry.result is not None:
            return 200, entry.result
        if entry.error:
            return 500, {"id": entry.id, "status": "failed", "error": entry.error}
        return 202, {"id": entry.id, "status": self.evaluator.state(entry.future)}

    # -- health and metrics

    def health(self) -> dict[str, Any]:
        env = self.evaluator.environment
        return {
            "status": "ok",
            "device": env.device,
            "gpu_class": env.gpu_class,
            "evaluator_version": env.evaluator_version,
            "open": self._open,
            "max_queue": self.max_queue,
        }

    def prometheus(self) -> str:
        """The metrics in Prometheus text format (version 0.0.4)."""
        snap = self.evaluator.metrics.snapshot()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, values: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in values:
                lines.append(f"{name}{labels} {value:g}")

        metric(
            "kernelfleet_eval_queue_depth",
            "gauge",
            "Evaluations accepted and not finished (waiting, building or running).",
            [("", float(self._open))],
        )
        metric(
            "kernelfleet_eval_stage_evaluations",
            "gauge",
            "Evaluations now in each pipeline stage.",
            [(f'{{stage="{k}"}}', float(snap[k])) for k in ("waiting", "building", "running")],
        )
        metric(
            "kernelfleet_eval_queue_capacity", "gauge", "The queue's bound.", [("", float(self.max_queue))]
        )
        metric(
            "kernelfleet_evaluations_total",
            "counter",
            "Finished evaluations by verdict.",
            [(f'{{verdict="{k}"}}', float(v)) for k, v in sorted(snap["verdicts"].items())],
        )
        metric(
            "kernelfleet_eval_cancelled_total",
            "counter",
            "Evaluations cancelled.",
            [("", float(snap["cancelled"]))],
        )
        metric(
            "kernelfleet_eval_refused_total",
            "counter",
            "Requests answered 429 because the queue was full.",
            [("", float(self.refused))],
        )
        metric(
            "kernelfleet_eval_gpu_busy_ratio",
            "gauge",
            "Share of the uptime each device's timing lane was in use.",
            [(f'{{lane="{k}"}}', v) for k, v in snap["timing_lane_busy_share"].items()],
        )
        metric(
            "kernelfleet_eval_lane_active_ratio",
            "gauge",
            "Share of the uptime each device had at least one candidate process.",
            [(f'{{lane="{k}"}}', v) for k, v in snap["lane_active_share"].items()],
        )
        metric(
            "kernelfleet_eval_stage_seconds_total",
            "counter",
            "Seconds spent per evaluation stage, summed over evaluations.",
            [(f'{{stage="{k}"}}', v) for k, v in snap["stage_seconds"].items()],
        )
        metric(
            "kernelfleet_eval_uptime_seconds",
            "gauge",
            "Seconds since the service started.",
            [("", snap["uptime_s"])],
        )
        return "\n".join(lines) + "\n"
