"""`kernelfleet eval serve` under malformed, slow and oversized requests, over raw sockets: each
one is answered 4xx with a one-line reason, nothing is logged with a traceback, and the service
goes on answering. Also the OpenAPI schema and the routes' JSON errors."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Iterator

import pytest

from kernelfleet.evaluator import (
    EvalConfig,
    EvaluationClient,
    EvaluationService,
    Evaluator,
    ServiceError,
    ServiceLimits,
    ServiceServer,
)
from tests.support import evaluator_cases as C

TOKEN = "http-token"
LIMITS = ServiceLimits(max_body_bytes=1 << 20, head_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1)


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceServer]:
    with Evaluator(
        EvalConfig(device="cpu", correctness={"trials": 1}, timing={"trials": 3, "warmup": 1})
    ) as evaluator:
        running = ServiceServer(EvaluationService(evaluator, max_queue=4), token=TOKEN, limits=LIMITS).start()
        try:
            yield running
        finally:
            running.stop()


def connect(server: ServiceServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one response; the socket's other end closes or sends it all."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", str(1 << 30)))  # none: until the server closes
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def raw(server: ServiceServer, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    with connect(server) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        return read_answer(sock)


def closed(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed the connection within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


POST = (
    f"POST /v1/evaluations HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\nContent-Type: application/json\n"
)


def one_line(body: bytes) -> str:
    text = body.decode()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        text = json.loads(text)["error"]
    assert text.strip() and "\n" not in text.strip(), text
    assert "Traceback" not in text
    return text


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "12, 13"])
def test_a_malformed_content_length_is_a_400(
    server: ServiceServer, caplog: pytest.LogCaptureFixture, length: str
) -> None:
    with caplog.at_level(logging.INFO):
        status, _, body = raw(server, POST + f"Content-Length: {length}\n", b"{}")
    assert status == 400
    one_line(body)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert EvaluationClient(server.url).health()["status"] == "ok"


def test_a_body_shorter_than_declared_is_a_408_and_the_connection_closes(
    server: ServiceServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO), connect(server) as sock:
        sock.sendall((POST + "Content-Length: 1000\n\n").replace("\n", "\r\n").encode() + b"{}")
        status, _, body = read_answer(sock)
        assert status == 408 and "did not arrive" in one_line(body)
        assert closed(sock, 10)
    assert not [r for r in caplog.records if r.exc_info]


def test_a_client_that_goes_away_mid_body_leaves_no_traceback(
    server: ServiceServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        with connect(server) as sock:
            sock.sendall((POST + "Content-Length: 1000\n\n").replace("\n", "\r\n").encode() + b"{}")
        time.sleep(0.5)
        assert EvaluationClient(server.url).health()["status"] == "ok"
    assert not [r for r in caplog.records if r.exc_info]


def test_a_slow_request_head_is_a_408(server: ServiceServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        started = time.monotonic()
        while time.monotonic() - started < LIMITS.head_timeout_s * 0.5:
            sock.sendall(b"X-Slow: 1\r\n")  # a byte now and then does not extend the deadline
            time.sleep(0.1)
        status, _, body = read_answer(sock)
        assert status == 408 and "request head" in one_line(body)
        assert closed(sock, 10)


def test_an_idle_connection_is_closed(server: ServiceServer) -> None:
    with connect(server) as sock:
        assert closed(sock, 30)


def send_until_answered(sock: socket.socket, chunks: Iterator[bytes]) -> None:
    """Send until the server answers (or closes): it refuses before the body ends."""
    for chunk in chunks:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            return
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return


def test_an_oversized_chunked_body_is_a_413(server: ServiceServer) -> None:
    piece = b"x" * 65536

    def chunks() -> Iterator[bytes]:
        for _ in range(50 * 16):  # 50 MB in all
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    with connect(server) as sock:
        sock.sendall((POST + "Transfer-Encoding: chunked\n\n").replace("\n", "\r\n").encode())
        send_until_answered(sock, chunks())
        status, _, body = read_answer(sock)
        assert status == 413 and str(LIMITS.max_body_bytes) in one_line(body)
        assert closed(sock, 10)


def test_an_oversized_declared_body_is_a_413_before_it_is_read(server: ServiceServer) -> None:
    with connect(server) as sock:
        sock.sendall((POST + f"Content-Length: {50 << 20}\n\n").replace("\n", "\r\n").encode())
        status, _, body = read_answer(sock)
        assert status == 413 and "at most" in one_line(body)


def test_a_small_chunked_body_is_evaluated(server: ServiceServer) -> None:
    payload = json.dumps({"reference": C.MATMUL_TASK, "candidate": C.SYNTAX_ERROR}).encode()
    middle = len(payload) // 2
    body = (
        b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:middle], payload[middle:])) + b"0\r\n\r\n"
    )
    status, headers, answer = raw(server, POST + "Transfer-Encoding: chunked\n", body)
    assert status == 202, answer
    assert headers["location"] == f"/v1/evaluations/{json.loads(answer)['id']}"
    [result] = EvaluationClient(server.url, token=TOKEN).wait([json.loads(answer)["id"]], timeout=120)
    assert result["verdict"] == "compile_error"


def test_no_body_is_a_411_and_bad_json_a_400(server: ServiceServer) -> None:
    status, _, body = raw(server, POST)
    assert status == 411 and "Content-Length" in one_line(body)
    status, _, body = raw(server, POST + "Content-Length: 5\n", b"{nope")
    assert status == 400 and "not JSON" in one_line(body)
    status, _, body = raw(server, POST + "Content-Length: 2\n", b"\xff\xfe")
    assert status == 400


def test_routes_answer_json_errors_and_the_token_comes_first(server: ServiceServer) -> None:
    status, _, body = raw(server, "GET /nowhere HTTP/1.1\nHost: x\n")
    assert status == 404 and "no such path" in one_line(body)
    status, _, _ = raw(server, "GET /v1/nowhere HTTP/1.1\nHost: x\n")
    assert status == 401
    status, _, body = raw(server, f"GET /v1/nowhere HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n")
    assert status == 404
    status, _, body = raw(
        server, f"DELETE /v1/evaluations HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n"
    )
    assert status == 405 and "not served" in one_line(body)
    status, _, body = raw(server, "GET /healthz/ HTTP/1.1\nHost: x\n")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = raw(server, "GET /v1/evaluations/abc HTTP/1.1\nHost: x\n")
    assert status == 401


def test_the_openapi_schema_describes_the_routes(server: ServiceServer) -> None:
    status, headers, body = raw(server, "GET /openapi.json HTTP/1.1\nHost: x\n")
    assert status == 200 and headers["content-type"].startswith("application/json")
    schema = json.loads(body)
    paths = schema["paths"]
    assert {"/v1/evaluations", "/v1/evaluations/{evaluation_id}", "/healthz", "/metrics"} <= set(paths)
    post = paths["/v1/evaluations"]["post"]
    options = post["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert {"reference", "candidate"} <= set(options[0]["properties"])
    assert {"202", "400", "401", "413", "429"} <= set(post["responses"])


def test_json_and_code_that_nest_too_deeply_are_a_400_or_a_compile_error(
    server: ServiceServer, caplog: pytest.LogCaptureFixture
) -> None:
    deep_json = b"[" * 100_000 + b"]" * 100_000
    with caplog.at_level(logging.INFO):
        status, _, body = raw(server, POST + f"Content-Length: {len(deep_json)}\n", deep_json)
        assert status == 400 and "nests too deeply" in one_line(body)
        deep_code = "x = " + "-" * 500_000 + "1\n"
        api = EvaluationClient(server.url, token=TOKEN)
        with pytest.raises(ServiceError) as refused:
            api.submit(deep_code, C.HONEST)
        assert refused.value.status == 400 and "cannot be parsed" in str(refused.value)
        [result] = api.wait([api.submit(C.MATMUL_TASK, deep_code)], timeout=120)
        assert result["verdict"] == "compile_error"
    assert not [r for r in caplog.records if r.exc_info]
