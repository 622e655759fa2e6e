"""The HTTP front of `kernelfleet eval serve` (routes: see `_service`): FastAPI on uvicorn.

An HTTP stack built to face clients that are slow, malformed or many: every request has a
deadline for its head and for its body and a bound on its size (`ServiceLimits`), a malformed
one is answered 4xx with one line of reason and no traceback, and an idle or slow connection
costs a socket, not a thread. The schema is served at /openapi.json. Imported only where the
service runs: the evaluator's sandboxed processes never load a web framework.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kernelfleet.core.jsontext import dumps
from kernelfleet.evaluator._config import PROFILES
from kernelfleet.evaluator._service import (
    MAX_BATCH,
    MAX_BODY,
    REQUEST_OPTIONS,
    EvaluationService,
    RequestError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds of the HTTP front, so that no client, slow or malformed, can hold the service: a
    connection that does not send a complete request head in time, or a body in time, is
    answered 408 and closed; a body over the size is answered 413 and not read further."""

    max_body_bytes: int = MAX_BODY  # one request's body
    head_timeout_s: float = 10.0  # the request line and headers of each request
    body_timeout_s: float = 60.0  # the whole body of a POST
    keep_alive_s: int = 5  # an idle connection between two requests
    max_header_bytes: int = 64 * 1024  # the request line and headers together
    max_connections: int = 512  # open connections and requests in progress; beyond: 503
    shutdown_s: int = 5  # how long stopping waits for requests in progress


class EvaluationRequest(BaseModel):
    """One evaluation, as POSTed (alone or in a list). Documents the wire format in the OpenAPI
    schema; the service checks bodies itself, to answer 400 with one plain reason."""

    reference: str = Field(
        description="The task: Python source defining Model, get_inputs and get_init_inputs."
    )
    candidate: str = Field(description="The candidate: Python source defining ModelNew.")
    profile: str | None = Field(
        default=None, description=f"One of {sorted(PROFILES)}; default: the server's."
    )
    options: dict[str, Any] | None = Field(
        default=None, description=f"Evaluation settings for this request only: {sorted(REQUEST_OPTIONS)}."
    )
    name: str | None = Field(default=None, description="A label for the task in logs.")


class Accepted(BaseModel):
    ids: list[str] = Field(description="The evaluations' ids, in the order sent.")
    id: str | None = Field(default=None, description="The id, when one evaluation (not a list) was sent.")
    status: str = "pending"


class Open(BaseModel):
    id: str
    status: str = Field(description="pending, building or running; failed (with `error`) on HTTP 500.")
    error: str | None = None


class Health(BaseModel):
    status: str
    device: str
    gpu_class: str
    evaluator_version: str
    open: int
    max_queue: int


class ErrorAnswer(BaseModel):
    error: str = Field(description="What is wrong, in one line.")


def _json(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response((dumps(body) + "\n").encode(), status, dict(headers or {}), "application/json")


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _json(status, {"error": message}, headers)


async def _read_body(request: Request, limits: ServiceLimits) -> bytes:
    """The whole body, within the size and the time limits (chunked bodies too)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        # The HTTP parser has refused a malformed length already (400): this is a number.
        if int(declared) > limits.max_body_bytes:
            raise RequestError(413, f"the body has {declared} bytes; at most {limits.max_body_bytes}")
    elif "chunked" not in request.headers.get("transfer-encoding", "").lower():
        raise RequestError(
            411, "send the evaluations as a JSON body, with Content-Length or chunked encoding"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise RequestError(413, f"the body is over {limits.max_body_bytes} bytes; send less")
                chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to read the answer; a 400 keeps the log to one line.
        raise RequestError(400, f"the client went away before the body ended ({size} bytes came)") from None
    except TimeoutError:
        raise RequestError(
            408, f"the body did not arrive within {limits.body_timeout_s:g} s ({size} bytes came)"
        ) from None
    return b"".join(chunks)


def create_app(
    service: EvaluationService, token: str | None = None, limits: ServiceLimits | None = None
) -> Any:
    """The ASGI application: the routes of the module docstring, and /openapi.json."""
    limits = limits or ServiceLimits()
    app = FastAPI(
        title="kernelfleet evaluation service",
        version="1",
        description="Evaluates candidate kernels against a reference: correctness, timing and the "
        "evaluator's defences. With a token configured, /v1 needs `Authorization: Bearer TOKEN`.",
        docs_url=None,  # the interactive pages load scripts from the internet
        redoc_url=None,
        redirect_slashes=False,
    )
    expected = f"Bearer {token}".encode() if token is not None else None

    def authorise(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):
            raise RequestError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> Response:
        return _error(error.status, str(error), error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, error: StarletteHTTPException) -> Response:
        path = request.url.path
        if path.startswith("/v1/"):
            try:
                authorise(request)
            except RequestError as denied:
                return _error(denied.status, str(denied), denied.headers)
        if error.status_code == 405:
            return _error(405, f"{request.method} {path} is not served")
        if error.status_code == 404:
            return _error(404, f"no such path {path!r}; see /v1/evaluations, /healthz, /metrics")
        return _error(error.status_code, str(error.detail))

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorAnswer, "description": text}
        for code, text in {
            400: "a malformed request, with the reason",
            401: "missing or wrong bearer token",
            408: "the body did not arrive in time",
            411: "no body",
            413: "the body or the batch is too large",
            429: "the queue is full; see Retry-After",
        }.items()
    }
    one = EvaluationRequest.model_json_schema()

    @app.post(
        "/v1/evaluations",
        status_code=202,
        response_model=Accepted,
        responses=errors,
        summary="Queue one evaluation or a list of them (all or none)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "oneOf": [
                                one,
                                {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_BATCH},
                            ]
                        }
                    }
                },
            }
        },
    )
    async def submit(request: Request) -> Response:
        authorise(request)
        raw = await _read_body(request, limits)
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the body is not JSON: {error}") from None
        except RecursionError:
            raise RequestError(400, "the body's JSON nests too deeply; send evaluation objects") from None
        ids = await run_in_threadpool(service.submit, body)
        answer: dict[str, Any] = {"ids": ids, "status": "pending"}
        if not isinstance(body, list):
            answer["id"] = ids[0]
        return _json(202, answer, {"Location": f"/v1/evaluations/{ids[0]}"})

    @app.get(
        "/v1/evaluations/{evaluation_id}",
        response_model=None,
        responses={
            200: {
                "description": "Done: exactly what `kernelfleet eval --json` prints",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            202: {"model": Open, "description": "Still open"},
            404: {"model": ErrorAnswer, "description": "Unknown, or finished long ago"},
            500: {"model": Open, "description": "The evaluator failed (status failed, with the error)"},
            401: errors[401],
        },
        summary="One evaluation: its result when done",
    )
    async def result(evaluation_id: str, request: Request) -> Response:
        authorise(request)
        status, answer = await run_in_threadpool(service.get, evaluation_id)
        return _json(status, answer)

    @app.get("/healthz", response_model=Health, summary="Liveness and the device served")
    async def health() -> Response:
        return _json(200, await run_in_threadpool(service.health))

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus metrics (text format 0.0.4)",
    )
    async def metrics() -> Response:
        text = await run_in_threadpool(service.prometheus)
        return Response(text.encode(), 200, media_type="text/plain; version=0.0.4")

    async def normalised(scope: Any, receive: Any, send: Any) -> None:
        """A trailing slash names the same route (`/healthz/` is `/healthz`)."""
        if scope["type"] == "http" and len(scope["path"]) > 1 and scope["path"].endswith("/"):
            scope = {**scope, "path": scope["path"].rstrip("/") or "/"}
        await app(scope, receive, send)

    return normalised


def _protocol(head_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head (uvicorn has none: a
    client sending its headers a byte at a time would hold its connection for ever), and no
    reading of a body nobody wants once the answer is sent."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                # Answered before the body ended (413, 408, a refusal): the rest is not read.
                self.transport.close()
                return
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to what the HTTP parser refuses, with a reason and its length."""
            reason = "malformed HTTP request: check the request line, the headers and Content-Length"
            self._answer_and_close("400 Bad Request", reason)

        def _answer_and_close(self, status: str, reason: str) -> None:
            self.transport.write(
                f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                f"content-length: {len(reason)}\r\n\r\n{reason}".encode()
            )
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            reason = f"the request head did not arrive within {head_timeout_s:g} s"
            log.info("%s: %s; closing", self.client, reason)
            self._answer_and_close("408 Request Timeout", reason)

    return HeadDeadline


class ServiceServer:
    """The HTTP server around an `EvaluationService` (FastAPI on uvicorn); `start()` serves in a
    thread, `serve()` in the caller's (there SIGINT and SIGTERM stop it, and are raised again
    once it has stopped). `port` 0 picks a free port (see `.port` afterwards)."""

    def __init__(
        self,
        service: EvaluationService,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: ServiceLimits | None = None,
    ) -> None:
        import uvicorn

        self.service = service
        self.limits = limits or ServiceLimits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=2048)
        config = uvicorn.Config(
            create_app(service, token, self.limits),
            http=_protocol(self.limits.head_timeout_s),
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=self.limits.keep_alive_s,
            timeout_graceful_shutdown=self.limits.shutdown_s,
            limit_concurrency=self.limits.max_connections,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = str(self._socket.getsockname()[0])
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> ServiceServer:
        self._thread = threading.Thread(target=self.serve, name="eval-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError("the evaluation service did not start")
        return self

    def serve(self) -> None:
        self._server.run(sockets=[self._socket])

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.limits.shutdown_s + 10)
        self._socket.close()
