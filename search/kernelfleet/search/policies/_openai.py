"""The `openai` policy: any OpenAI-compatible chat-completions endpoint, a vLLM server first of all.

Only the standard library speaks HTTP here (urllib), so the worker image needs no client
package. Requests run concurrently in threads, as many as `concurrency`, because an inference
server batches what arrives together. Errors fall into three groups:
- worth retrying (connection refused or reset, timeouts, 408/409/429 and 5xx, a body cut
  short): retried with exponential backoff, honouring Retry-After; after the last attempt the
  sample is given up for this run and asked again on resume;
- the request itself is unacceptable (400, 413, 422: e.g. a prompt over the context length):
  no retry, the sample is given up;
- the configuration is wrong (401, 403, 404: bad key, wrong URL or model name): the run stops
  at once with a message, since every other request would fail the same way.
The key comes from the environment and never reaches the store or a log.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.search.policies._base import PolicyError, Proposal, Request

KEY_VARIABLES = ("KERNELFLEET_OPENAI_API_KEY", "OPENAI_API_KEY")
_RETRY_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}
_CONFIG_STATUSES = {401, 403, 404}
_MAX_RETRY_AFTER_S = 60.0


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _GiveUp(Exception):
    pass


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str


def chat_completions_url(base_url: str) -> str:
    """`.../v1/chat/completions` from a base URL given with or without the `/v1`."""
    parsed = urllib.parse.urlsplit(base_url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(
            f"the endpoint {base_url!r} is not an http(s) URL; give one like http://localhost:8000/v1"
        )
    path = parsed.path.rstrip("/")
    if path.endswith("/chat/completions"):
        path = path[: -len("/chat/completions")]
    if not path:
        path = "/v1"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path + "/chat/completions", "", ""))


def api_key_from_environment() -> str | None:
    for variable in KEY_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value:
            return value
    return None


class OpenAIPolicy:
    """Chat completions from an OpenAI-compatible endpoint; see the module docstring."""

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key: str | None = None,
        *,
        temperature: float = 0.8,
        top_p: float | None = None,
        max_tokens: int = 4096,
        concurrency: int = 8,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        stream: bool = False,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if not model:
            raise UsageError("the openai policy needs a model name: openai:MODEL@BASE_URL")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise UsageError("concurrency must be >= 1, retries >= 0 and the timeout positive")
        self.model = model
        self.url = chat_completions_url(base_url)
        self._key = api_key
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.stream = stream
        self.extra_body = dict(extra_body or {})
        self._config_error: PolicyError | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"openai:{self.model}"

    @property
    def id(self) -> str:
        slug = "".join(char if char.isalnum() or char in "._-" else "-" for char in self.model)
        return f"openai-{slug}"[:80]

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        if not requests:
            return []
        self._config_error = None
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            proposals = list(pool.map(self._propose_one, requests))
        if self._config_error is not None:
            raise self._config_error
        return proposals

    def close(self) -> None:
        return None

    def _propose_one(self, request: Request) -> Proposal:
        if self._config_error is not None:
            return Proposal.failed("not sent: the endpoint refused an earlier request")
        try:
            completion = self.complete(request.messages(), seed=request.seed, deadline=request.deadline)
        except PolicyError as error:
            with self._lock:
                self._config_error = self._config_error or error
            return Proposal.failed(str(error))
        except _GiveUp as error:
            return Proposal.failed(str(error))
        return Proposal.from_answer(completion.text, truncated=completion.finish_reason == "length")

    def complete(
        self, messages: list[dict[str, str]], seed: int | None = None, deadline: float | None = None
    ) -> Completion:
        """One chat completion, with retries; raises PolicyError or _GiveUp when it cannot. No
        request, wait or retry goes past `deadline` (time.monotonic()), the run's budget."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra_body)
        data = json.dumps(body).encode("utf-8")
        last = ""
        for attempt in range(self.retries + 1):
            timeout = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())
            if timeout <= 0:
                raise _GiveUp(f"{self.url}: the run's wall time ended before an answer came")
            try:
                return self._send(data, timeout)
            except _Retryable as error:
                last = str(error)
                if attempt == self.retries:
                    break
                delay = self.backoff_s * (2**attempt) * (0.5 + random.random())
                if error.retry_after is not None:
                    delay = max(delay, min(error.retry_after, _MAX_RETRY_AFTER_S))
                if deadline is not None and time.monotonic() + delay >= deadline:
                    raise _GiveUp(f"{self.url}: the run's wall time ends before a retry ({last})") from None
                time.sleep(delay)
        raise _GiveUp(f"{self.url} failed after {self.retries + 1} attempts: {last}")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.stream:
            headers["Accept"] = "text/event-stream"
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def _send(self, data: bytes, timeout: float) -> Completion:
        request = urllib.request.Request(self.url, data=data, headers=self._headers(), method="POST")
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                if self.stream:
                    return self._read_stream(response, started, timeout)
                payload = response.read()
        except urllib.error.HTTPError as error:
            raise self._http_error(error) from None
        except TimeoutError:
            raise _Retryable(f"no answer within {timeout:g} s") from None
        except urllib.error.URLError as error:
            raise _Retryable(f"cannot connect: {error.reason}") from None
        except (ConnectionError, http.client.HTTPException) as error:
            raise _Retryable(f"connection failed: {error!r}") from None
        try:
            answer = json.loads(payload)
            choice = answer["choices"][0]
            message = choice.get("message") or {}
            return Completion(str(message.get("content") or ""), str(choice.get("finish_reason") or ""))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _Retryable(f"unreadable answer: {payload[:200]!r}") from None

    def _read_stream(self, response: Any, started: float, timeout: float) -> Completion:
        parts: list[str] = []
        finish = ""
        done = False
        try:
            for event in _sse_events(response):
                if time.monotonic() - started > timeout:
                    raise _Retryable(f"the stream did not finish within {timeout:g} s")
                if event == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(event)
                except ValueError:
                    raise _Retryable(f"unreadable stream event: {event[:200]!r}") from None
                if isinstance(chunk, dict) and chunk.get("error"):
                    raise _Retryable(f"the server reported an error mid-stream: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        parts.append(content)
                    if choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
        except TimeoutError:
            raise _Retryable(f"the stream stalled for {timeout:g} s") from None
        except (ConnectionError, http.client.HTTPException) as error:
            raise _Retryable(f"the stream broke: {error!r}") from None
        if not done and not finish:
            raise _Retryable("the stream ended before [DONE]")
        return Completion("".join(parts), finish)

    def _http_error(self, error: urllib.error.HTTPError) -> Exception:
        try:
            detail = error.read(500).decode("utf-8", "replace").strip()
        except Exception:  # the body is only a hint; the status is what matters
            detail = ""
        status = error.code
        if status in _RETRY_STATUSES:
            retry_after = None
            header = error.headers.get("Retry-After") if error.headers else None
            if header:
                try:
                    retry_after = float(header)
                except ValueError:
                    retry_after = None
            return _Retryable(f"HTTP {status}: {detail}", retry_after)
        if status in _CONFIG_STATUSES:
            hint = {
                401: f"set {' or '.join(KEY_VARIABLES)} to a valid key",
                403: "the key is not allowed to use this model; check its permissions",
                404: f"check the base URL and that the server serves the model {self.model!r}",
            }[status]
            return PolicyError(f"{self.url} answered HTTP {status} ({detail[:200]}): {hint}")
        return _GiveUp(f"{self.url} rejected the request with HTTP {status}: {detail[:300]}")


def _sse_events(response: Any) -> Iterator[str]:
    """The `data:` payloads of a server-sent-events stream, multi-line events joined."""
    data: list[str] = []
    for raw in response:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)
