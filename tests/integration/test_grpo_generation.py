"""The RL stage's generation path on the CPU: a whole GRPO step in trl's server mode against a
stand-in for the vLLM server (tests/support/vllm_server.py: trl's `vllm-serve` routes and
payloads, which vLLM itself cannot serve here), with rewards from a real evaluation service
(`kernelfleet eval serve`'s server, on a port of its own) through the service reward backend.

What a CPU cannot do is the NCCL weight push from the trainer into the server (vLLM's
weight-transfer engine needs CUDA on both sides): trl's `init_communicator` and `sync_weights`
are replaced by recorders, so the test checks that trl asks for them at the right times, and
docs/training.md lists the push as what a first GPU run must check. Everything else is trl's and
kernelfleet's own code: trl's VLLMClient and VLLMGeneration, the GRPOTrainer, the rollout, the
service backend, the evaluator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.tasks import load_tasks
from kernelfleet.core.training import latest_stage_status
from kernelfleet.trainer._runner import open_run, run_stage
from tests.support.training import EXAMPLE_TASKS, FAST_EVAL, ROOT, answer_model, answer_text, run_config
from tests.support.vllm_server import LOGPROB, VLLMStandIn

FAST = (ROOT / "examples" / "candidates" / "diag_matmul__row_scale.py").read_text()
WRONG = FAST.replace("a.unsqueeze(1) * b", "a.unsqueeze(0) * b[:1]")
DIAG = str(EXAMPLE_TASKS / "diag_matmul.py")
TOKEN = "t0ken"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TRL_EXPERIMENTAL_SILENCE"):
        monkeypatch.setenv(name, "1")


class Calls:
    def __init__(self) -> None:
        self.init_communicator = 0
        self.sync_weights = 0


@pytest.fixture
def nccl_recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """trl with vLLM "installed" and the NCCL weight transfer recorded instead of run."""
    from trl.generation import vllm_client, vllm_generation

    calls = Calls()

    def init_communicator(self: Any, device: Any = 0) -> None:
        calls.init_communicator += 1

    def sync_weights(self: Any) -> None:
        calls.sync_weights += 1

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *_, **__: True)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *_, **__: True)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", init_communicator)
    monkeypatch.setattr(vllm_generation.VLLMGeneration, "sync_weights", sync_weights)
    yield calls


@pytest.fixture
def eval_service(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[int]]]:
    """A real evaluation service on the CPU behind a bearer token; yields it and a list that
    grows by the number of evaluations of each request it accepted."""
    from kernelfleet.evaluator import EvalConfig, EvaluationService, Evaluator, ServiceServer

    config = EvalConfig(device="cpu", **FAST_EVAL)
    accepted: list[int] = []
    with Evaluator(config) as evaluator:
        service = EvaluationService(evaluator, max_queue=8)
        submit = service.submit

        def counted(body: Any) -> list[str]:
            ids = submit(body)
            accepted.append(len(ids))
            return ids

        service.submit = counted  # type: ignore[method-assign]
        server = ServiceServer(service, token=TOKEN).start()
        monkeypatch.setenv("KERNELFLEET_EVAL_TOKEN", TOKEN)
        try:
            yield server, accepted
        finally:
            server.stop()


def test_a_grpo_step_generates_through_trls_server_mode_and_is_rewarded_by_eval_serve(
    tmp_path: Path, nccl_recorded: Calls, eval_service: tuple[Any, list[int]]
) -> None:
    from transformers import AutoTokenizer

    server, accepted = eval_service
    model, ids = answer_model(tmp_path / "model", [answer_text(FAST), answer_text(WRONG)])
    eos = AutoTokenizer.from_pretrained(str(model)).eos_token_id
    answers = [[ids[0], eos], [ids[1], eos]]  # each answer is one token of this model's, then end
    grpo: dict[str, Any] = {
        "learning_rate": 0.02,
        "num_generations": 2,
        "beta": 0.0,
        "max_completion_length": 16,
        "per_device_train_batch_size": 2,
        "max_steps": 1,
        "use_vllm": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_steps": 1,
    }
    with VLLMStandIn(answers) as vllm:
        grpo["vllm_server_base_url"] = vllm.url
        stage = {"name": "rl", "type": "grpo", "grpo": grpo, "reward": {"serviceUrl": server.url}}
        config = run_config(model, [stage], tasks=[DIAG], heldOut={"fraction": 0.0})
        with open_run(
            config,
            store=str(tmp_path / "store"),
            work_dir=tmp_path / "work",
            device="cpu",
            eval_overrides=FAST_EVAL,
        ) as run:
            summary = run_stage(run, "rl")
            status = latest_stage_status(run.store, run.layout, "rl")
            results = list(run.store.list_results(run.layout.stage("rl")))

    # trl's client found the server, asked which logprobs it returns (the importance-sampling
    # correction), joined the weight transfer once and synced the weights before the step's
    # generation, then sent the group's prompt once with n = num_generations.
    paths = [(method, path) for method, path, _ in vllm.requests]
    assert paths[:2] == [("GET", "/health"), ("GET", "/v1/models")], paths
    assert ("GET", "/server_info") in paths
    assert nccl_recorded.init_communicator == 1 and nccl_recorded.sync_weights == 1
    (request,) = [body for method, path, body in vllm.requests if path == "/v1/completions"]
    assert request["n"] == 2 and request["max_tokens"] == 16 and request["logprobs"] == 0
    (prompt,) = request["prompt"]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert load_tasks(DIAG)[0].name in tokenizer.decode(prompt)

    # Both completions were evaluated by the service, not in the trainer: one request per group.
    assert accepted == [2], accepted
    verdicts = sorted(str(result.verdict) for result in results)
    assert len(results) == 2 and "correct" in verdicts, verdicts
    assert summary["timing"]["evaluations"] == 2 and summary["timing"]["steps"] == 1
    assert status is not None and status.phase == "Succeeded" and status.step == 1
    for metric in ("reward", "share/correct", "timing/reward_wait_share"):
        assert metric in status.metrics, sorted(status.metrics)
    assert LOGPROB < 0  # the sampling logprobs trl received were the server's
