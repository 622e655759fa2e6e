"""`EvaluationClient`: the Python side of `kernelfleet eval serve`.

The RL trainer and the worker pods submit candidates to a shared evaluation service instead of
owning GPUs themselves. Standard library only (urllib): the client runs in processes that need
no torch. A full queue (429) is waited out using the server's Retry-After, up to `patience`
seconds, so producers back off instead of failing.

    client = EvaluationClient("http://evaluator:8470", token=os.environ.get("KERNELFLEET_EVAL_TOKEN"))
    ids = client.submit_many([{"reference": ref, "candidate": cand} for cand in candidates])
    results = client.wait(ids)          # dicts, exactly `kernelfleet eval --json`
    reward = results[0]["speedup"]
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kernelfleet.core.errors import KernelfleetError
from kernelfleet.core.models import EvaluationResult

log = logging.getLogger(__name__)

# Keys `kernelfleet eval --json` adds in front of the result's own fields.
_DERIVED = ("reference_ms", "candidate_ms", "baselines")


class ServiceError(KernelfleetError):
    """The service refused a request or failed it; `status` is the HTTP status (0: unreachable).

    Unreachable, busy (429) and failing (5xx) services may recover, so those errors are
    `transient`; a refused request (4xx) fails again the same way.
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.transient = status == 0 or status == 429 or status >= 500


def result_from_json(data: dict[str, Any]) -> EvaluationResult:
    """An `EvaluationResult` from the JSON the service (or `eval --json`) returns."""
    return EvaluationResult.model_validate({k: v for k, v in data.items() if k not in _DERIVED})


class EvaluationClient:
    """Submit evaluations to a `kernelfleet eval serve` and collect their results."""

    def __init__(
        self, url: str, *, token: str | None = None, timeout: float = 30.0, patience: float = 600.0
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.patience = patience

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
                status, headers = response.status, dict(response.headers)
        except urllib.error.HTTPError as error:
            raw, status, headers = error.read(), error.code, dict(error.headers)
        except (urllib.error.URLError, OSError) as error:
            raise ServiceError(f"cannot reach the evaluation service at {self.url}: {error}") from None
        text = raw.decode("utf-8", "replace")
        try:
            payload: Any = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            payload = text
        return status, payload, headers

    @staticmethod
    def _error(status: int, payload: Any, what: str) -> ServiceError:
        detail = payload.get("error") if isinstance(payload, dict) else payload
        return ServiceError(f"{what}: HTTP {status}: {detail}", status)

    def submit_many(self, requests: Sequence[dict[str, Any]]) -> list[str]:
        """Queue evaluations (each {"reference", "candidate", "profile"?, "options"?}); their ids.
        A full queue is retried after the server's Retry-After until `patience` runs out."""
        deadline = time.monotonic() + self.patience
        while True:
            status, payload, headers = self._request("POST", "/v1/evaluations", list(requests))
            if status == 202:
                return list(payload["ids"])
            if status == 429 and time.monotonic() < deadline:
                wait = float(headers.get("Retry-After", "1") or 1)
                log.info("evaluation queue full; retrying in %.0f s", wait)
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                continue
            raise self._error(status, payload, "submitting evaluations")

    def submit(
        self,
        reference: str,
        candidate: str,
        *,
        profile: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> str:
        """Queue one evaluation; its id."""
        body: dict[str, Any] = {"reference": reference, "candidate": candidate}
        if profile is not None:
            body["profile"] = profile
        if options:
            body["options"] = options
        return self.submit_many([body])[0]

    def get(self, evaluation_id: str) -> dict[str, Any] | None:
        """The result (the `eval --json` object) when done; None while pending or running."""
        status, payload, _ = self._request("GET", f"/v1/evaluations/{evaluation_id}")
        if status == 200:
            return dict(payload)
        if status == 202:
            return None
        raise self._error(status, payload, f"evaluation {evaluation_id}")

    def wait(
        self, ids: Sequence[str], *, timeout: float | None = None, poll: float = 0.5
    ) -> list[dict[str, Any]]:
        """Block until every id is done; results in the order of `ids`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, dict[str, Any]] = {}
        while True:
            for evaluation_id in ids:
                if evaluation_id not in results:
                    found = self.get(evaluation_id)
                    if found is not None:
                        results[evaluation_id] = found
            if len(results) == len(ids):
                return [results[i] for i in ids]
            if deadline is not None and time.monotonic() >= deadline:
                raise ServiceError(
                    f"{len(ids) - len(results)} of {len(ids)} evaluations still open after {timeout} s"
                )
            time.sleep(poll)

    def evaluate(
        self,
        reference: str,
        candidate: str,
        *,
        profile: str | None = None,
        options: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Submit one evaluation and wait for it."""
        return self.wait(
            [self.submit(reference, candidate, profile=profile, options=options)], timeout=timeout
        )[0]

    def health(self) -> dict[str, Any]:
        status, payload, _ = self._request("GET", "/healthz")
        if status != 200:
            raise self._error(status, payload, "health check")
        return dict(payload)

    def metrics(self) -> str:
        status, payload, _ = self._request("GET", "/metrics")
        if status != 200:
            raise self._error(status, payload, "metrics")
        return str(payload)
