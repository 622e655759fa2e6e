"""The `openai` policy against a real HTTP server, started by the test, that speaks the
OpenAI chat-completions protocol: plain and streamed answers, errors, retries, timeouts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import open_store
from kernelfleet.search import Budget, OpenAIPolicy, PolicyError, QuietProgress, Request, optimize
from kernelfleet.search.policies._openai import chat_completions_url
from tests.support.search import ScriptedEvaluator, answer, make_task, variant_code


@dataclass
class Step:
    """What the server does with one request."""

    status: int = 200
    text: str = ""
    finish: str = "stop"
    stream_done: bool = True
    sleep_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


class ChatServer:
    """Answers with the next scripted step, or echoes the prompt's task name in valid code."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    step = server.steps.pop(0) if server.steps else None
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                step = step or Step(text=server.default_answer(body))
                try:
                    time.sleep(step.sleep_s)  # the server's work on the request
                finally:
                    # In flight until its answer starts: a client that has read the answer may
                    # send its next request before this thread would get past the write.
                    with server.lock:
                        server.in_flight -= 1
                # The client may have given up first (the timeout tests).
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.respond(body, step)

            def respond(self, body: dict[str, Any], step: Step) -> None:
                if self.path != "/v1/chat/completions":
                    step = Step(status=404, text="no such route")
                if step.status != 200:
                    data = json.dumps({"error": {"message": step.text or "failed"}}).encode()
                    self.send_response(step.status)
                    for name, value in step.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    pieces = [step.text[i : i + 7] for i in range(0, len(step.text), 7)]
                    for piece in pieces:
                        chunk = {
                            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]
                        }
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    if step.stream_done:
                        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": step.finish}]}
                        self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
                    self.close_connection = True
                    return
                data = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": step.text},
                                "finish_reason": step.finish,
                            }
                        ],
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def default_answer(self, body: dict[str, Any]) -> str:
        prompt = body["messages"][-1]["content"]
        name = prompt.split("Task `", 1)[1].split("`", 1)[0]
        speedup = 1.0 + prompt.count("the speed of the reference")
        return answer(variant_code(f"{name}-{body.get('seed')}", speedup))

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"


@pytest.fixture
def server() -> Iterator[ChatServer]:
    chat = ChatServer()
    chat.thread.start()
    yield chat
    chat.httpd.shutdown()
    chat.httpd.server_close()


def requests_for(count: int) -> list[Request]:
    task = make_task("alpha")
    return [
        Request(task=task, device="cpu", gpu_class="cpu", round=0, index=i, seed=100 + i)
        for i in range(count)
    ]


def policy(server: ChatServer, **options: Any) -> OpenAIPolicy:
    options.setdefault("backoff_s", 0.01)
    options.setdefault("timeout_s", 10.0)
    return OpenAIPolicy("tiny-coder", server.url, options.pop("api_key", "sk-local"), **options)


@pytest.mark.parametrize("stream", [False, True])
def test_answers_are_parsed(server: ChatServer, stream: bool) -> None:
    code = variant_code("streamed" if stream else "plain", 1.7)
    server.steps.append(Step(text=answer(code)))
    (proposal,) = policy(server, stream=stream, temperature=0.3, max_tokens=512).propose(requests_for(1))
    assert proposal.code == code
    assert proposal.analysis.startswith("The faster variant")
    body = server.requests[0]
    assert body["model"] == "tiny-coder" and body["stream"] is stream
    assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.3, 512, 100)
    assert body["messages"][0]["role"] == "system" and "Task `alpha`" in body["messages"][1]["content"]
    assert server.headers[0]["Authorization"] == "Bearer sk-local"


def test_no_key_sends_no_authorization(server: ChatServer) -> None:
    policy(server, api_key=None).propose(requests_for(1))
    assert "Authorization" not in server.headers[0]


@pytest.mark.parametrize("stream", [False, True])
def test_server_errors_are_retried(server: ChatServer, stream: bool) -> None:
    server.steps += [Step(status=500), Step(status=503), Step(status=429, headers={"Retry-After": "0"})]
    (proposal,) = policy(server, retries=3, stream=stream).propose(requests_for(1))
    assert proposal.code is not None
    assert len(server.requests) == 4


def test_retries_run_out(server: ChatServer) -> None:
    server.steps += [Step(status=502, text="bad gateway")] * 3
    (proposal,) = policy(server, retries=2).propose(requests_for(1))
    assert proposal.transient and not proposal.recorded
    assert "failed after 3 attempts" in proposal.error and "502" in proposal.error


def test_a_bad_request_is_not_retried(server: ChatServer) -> None:
    server.steps.append(Step(status=400, text="prompt longer than the context"))
    (proposal,) = policy(server, retries=3).propose(requests_for(1))
    assert proposal.transient and "HTTP 400" in proposal.error and "context" in proposal.error
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("status", "hint"), [(401, "OPENAI_API_KEY"), (403, "permissions"), (404, "serves the model")]
)
def test_configuration_errors_stop_the_run(server: ChatServer, status: int, hint: str) -> None:
    server.steps += [Step(status=status)] * 4
    with pytest.raises(PolicyError, match=hint):
        policy(server).propose(requests_for(4))


def test_a_wrong_path_is_a_404(server: ChatServer) -> None:
    wrong = OpenAIPolicy("m", server.url.replace("/v1", "/api"), None, retries=0)
    with pytest.raises(PolicyError, match="404"):
        wrong.propose(requests_for(1))


def test_timeouts(server: ChatServer) -> None:
    server.steps += [Step(sleep_s=1.0), Step(sleep_s=1.0)]
    (proposal,) = policy(server, timeout_s=0.2, retries=1).propose(requests_for(1))
    assert proposal.transient and "no answer within 0.2 s" in proposal.error
    # The client gave up on the second request; the server may record it a moment later.
    deadline = time.monotonic() + 10
    while len(server.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.requests) == 2


def test_the_run_budget_ends_a_request_in_flight_and_its_retries(server: ChatServer) -> None:
    """A request carries the run's wall-time deadline: the policy stops waiting then, however
    long --request-timeout is, and does not retry past it; the sample is asked again on resume."""
    server.steps += [Step(sleep_s=5.0), Step(sleep_s=5.0), Step(sleep_s=5.0)]
    request = dataclasses.replace(requests_for(1)[0], deadline=time.monotonic() + 0.5)
    began = time.monotonic()
    (proposal,) = policy(server, timeout_s=600.0, retries=5).propose([request])
    assert time.monotonic() - began < 5.0
    assert proposal.transient and not proposal.recorded
    assert len(server.requests) <= 2


def test_a_stream_cut_short_is_retried(server: ChatServer) -> None:
    server.steps.append(Step(text=answer(variant_code("cut", 1.1)), stream_done=False))
    (proposal,) = policy(server, stream=True, retries=1).propose(requests_for(1))
    assert proposal.code is not None and "alpha-100" in proposal.code  # the retry got the default answer
    assert len(server.requests) == 2


def test_the_token_limit_is_named_when_the_code_is_cut(server: ChatServer) -> None:
    server.steps.append(Step(text="## Code Implementation\n```python\nclass ModelNew(:", finish="length"))
    (proposal,) = policy(server).propose(requests_for(1))
    assert proposal.recorded and proposal.code is None
    assert "token limit" in proposal.error


def test_concurrency_is_bounded(server: ChatServer) -> None:
    server.steps += [Step(text=answer(variant_code(f"c{i}", 1.0)), sleep_s=0.05) for i in range(9)]
    proposals = policy(server, concurrency=3).propose(requests_for(9))
    assert len(proposals) == 9 and all(p.code for p in proposals)
    assert 1 <= server.max_in_flight <= 3


def test_urls() -> None:
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("https://api.x/openai/v1") == "https://api.x/openai/v1/chat/completions"
    assert chat_completions_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"
    with pytest.raises(UsageError, match="not an http"):
        chat_completions_url("localhost:8000")


def test_the_loop_with_an_endpoint(server: ChatServer, tmp_path: Path) -> None:
    evaluator = ScriptedEvaluator()
    summaries = optimize(
        [make_task("alpha"), make_task("beta", 3)],
        [policy(server, stream=True)],
        store=open_store(tmp_path / "store"),
        prefix="runs/endpoint",
        evaluator=evaluator,
        environment=evaluator.environment,
        budget=Budget(rounds=3, samples_per_round=2),
        progress=QuietProgress(),
    )
    assert len(server.requests) == 12
    # The default answer's speedup grows with the number of exemplars shown: 1.0, 2.0, 3.0.
    assert [s.best_speedup for s in summaries] == [3.0, 3.0]
    assert all(s.best_policy == "openai:tiny-coder" for s in summaries)
