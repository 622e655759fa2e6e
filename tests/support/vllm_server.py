"""A stand-in for the vLLM server of trl's server mode (`trl vllm-serve`), which cannot run here.

It speaks the routes and payloads trl 1.16's own `VLLMClient` uses (trl/generation/vllm_client.py),
and refuses anything else with a 400 that names what differs, so a client that drifts from the
protocol fails the test instead of passing against a lenient fake:

- GET /health, GET /v1/models, GET /server_info?config_format=json, GET /get_world_size;
- POST /v1/completions with token-id prompts (`return_token_ids`, `return_tokens_as_token_ids`,
  `n`, the sampling parameters), answered prompt-major, n choices per prompt, each with its
  `prompt_token_ids`, `token_ids` and completions-format logprobs of `token_id:<id>` tokens;
- POST /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
  /reset_prefix_cache (vLLM's dev-mode weight transfer), recorded; the NCCL transfer itself needs
  CUDA on both sides and is not played.

What it "generates" is given: each prompt's i-th completion is `answers[i % len(answers)]`
(token ids), cut at `max_tokens`, every token at logprob `LOGPROB`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

LOGPROB = -0.5
SAMPLING = {"n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs"}
COMPLETION_KEYS = {"model", "prompt", "return_token_ids", "return_tokens_as_token_ids", *SAMPLING}
DEV_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
)


@dataclass
class VLLMStandIn:
    """The server; `requests` records (method, path, body) of every request, in order."""

    answers: Sequence[Sequence[int]]
    model: str = "kernelfleet-policy"
    world_size: int = 1
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> VLLMStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                return

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                standin.requests.append(("GET", parsed.path, parse_qs(parsed.query)))
                status, body = standin.get(parsed.path, parse_qs(parsed.query))
                self._reply(status, body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                path = urlparse(self.path).path
                standin.requests.append(("POST", path, body))
                status, answer = standin.post(path, body)
                self._reply(status, answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="vllm-standin", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> VLLMStandIn:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ routes

    def get(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "vllm"}],
            }
        if path == "/server_info":
            if query.get("config_format") != ["json"]:
                return 400, {"error": "server_info: config_format=json expected"}
            config = {
                "weight_transfer_config": {"backend": "nccl"},
                "model_config": {"model": self.model, "logprobs_mode": "processed_logprobs"},
            }
            return 200, {"vllm_config": config}
        if path == "/get_world_size":
            return 200, {"world_size": self.world_size}
        return 404, {"error": f"no GET route {path}"}

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/completions":
            return self.completions(body)
        if path in DEV_ROUTES:
            return 200, {}
        return 404, {"error": f"no POST route {path}"}

    def completions(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):
            return 400, {"error": "a JSON object expected"}
        missing, unknown = COMPLETION_KEYS - body.keys(), body.keys() - COMPLETION_KEYS
        prompts = body.get("prompt")
        problems = [
            *(f"missing {key}" for key in sorted(missing)),
            *(f"unknown {key}" for key in sorted(unknown)),
        ]
        if body.get("model") != self.model:
            problems.append(f"model {body.get('model')!r} is not the served {self.model!r}")
        if not (body.get("return_token_ids") is True and body.get("return_tokens_as_token_ids") is True):
            problems.append("token ids must be asked for (return_token_ids, return_tokens_as_token_ids)")
        if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
            problems.append("prompt must be a list of token-id lists")
        if problems:
            return 400, {"error": "; ".join(problems)}
        n, limit = int(body["n"]), int(body["max_tokens"])
        choices: list[dict[str, Any]] = []
        for prompt in prompts or []:
            for index in range(n):
                tokens = list(self.answers[index % len(self.answers)])[:limit]
                choices.append(
                    {
                        "index": len(choices),
                        "text": "",
                        "prompt_token_ids": list(prompt),
                        "token_ids": tokens,
                        "logprobs": {
                            "tokens": [f"token_id:{token}" for token in tokens],
                            "token_logprobs": [LOGPROB] * len(tokens),
                            "top_logprobs": [{f"token_id:{token}": LOGPROB} for token in tokens],
                            "text_offset": [0] * len(tokens),
                        },
                        "finish_reason": "stop" if len(tokens) < limit else "length",
                    }
                )
        return 200, {
            "id": "cmpl-standin",
            "object": "text_completion",
            "model": self.model,
            "choices": choices,
        }
