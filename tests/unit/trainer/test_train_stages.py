"""Each training stage end to end on the CPU: the real trl trainers, the real evaluator on the
example tasks, a tiny model built here (no downloads), the local store. Kept to a few steps each:
the whole file runs in about two minutes on a shared two-core machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from kernelfleet.core.store import open_store
from kernelfleet.core.tasks import load_tasks
from kernelfleet.core.training import latest_checkpoint, latest_report, latest_stage_status, stage_done
from kernelfleet.search import build_messages
from kernelfleet.trainer._context import load_jsonl
from kernelfleet.trainer._runner import open_run, run_stage
from tests.support.training import (
    EXAMPLE_CANDIDATES,
    EXAMPLE_TASKS,
    FAST_EVAL,
    ROOT,
    TINY_SFT,
    answer_model,
    answer_probabilities,
    answer_text,
    run_config,
    tiny_model,
)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


class Killed(BaseException):
    """Stands for the process being killed: not an Exception, so nothing on the way catches it."""


class KillAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            raise Killed()


FAST = (ROOT / "examples" / "candidates" / "diag_matmul__row_scale.py").read_text()
SLOW = FAST.replace("return a.unsqueeze(1) * b", "return torch.diag(a) @ b")
DIAG = str(EXAMPLE_TASKS / "diag_matmul.py")


def test_sft_collects_verified_data_trains_resumes_after_a_kill_and_reports_held_out(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model")
    sft = {**TINY_SFT, "max_steps": 2, "save_steps": 1}
    data = {"policies": [{"kind": "replay", "path": str(EXAMPLE_CANDIDATES)}], "samplesPerTask": 2}
    config = run_config(
        model,
        [{"name": "sft", "type": "sft", "sft": sft, "data": data}],
        heldOut={"fraction": 0.25, "evaluate": True, "samplesPerRound": 1, "maxNewTokens": 16},
    )
    store_url = str(tmp_path / "store")
    options: dict[str, Any] = {
        "store": store_url,
        "work_dir": tmp_path / "work",
        "device": "cpu",
        "eval_overrides": FAST_EVAL,
    }
    with open_run(config, extra_callbacks=[KillAfter(1)], **options) as run:
        assert [task.name for task in run.split.held_out] == ["conv_block"]
        with pytest.raises(Killed):
            run_stage(run, "sft")
        layout = run.layout
    store = open_store(store_url)
    first = latest_checkpoint(store, layout, "sft")
    assert first is not None and first[0] == 1
    assert not stage_done(store, layout, "sft")
    # The dataset: verified variants of the training tasks only, contrastive chat prompts.
    rows = load_jsonl(store.get_bytes(layout.data("sft", "train")))
    assert rows and {row["task_name"] for row in rows} <= {"diag_matmul", "elementwise_chain", "softmax_rows"}
    assert all(
        row["prompt"][0]["role"] == "system" and "ModelNew" in row["completion"][0]["content"] for row in rows
    )
    assert all(row["speedup"] > 0 for row in rows)

    # A new process (a fresh work directory) resumes from the checkpoint in the store.
    options["work_dir"] = tmp_path / "work2"
    with open_run(config, **options) as run:
        summary = run_stage(run, "sft")
    assert summary["examples"] == len(rows)
    assert stage_done(store, layout, "sft") and store.dir_complete(layout.model("sft"))
    status = latest_stage_status(store, layout, "sft")
    assert status is not None and status.phase == "Succeeded" and status.step == 2
    assert "loss" in status.metrics and status.checkpoint.endswith(latest_checkpoint(store, layout, "sft")[1])  # type: ignore[index]
    steps = sorted(
        {int(key.rsplit("/", 1)[1].split("-")[0]) for key in store.list(layout.metrics_prefix("sft"))}
    )
    assert steps[0] == 1 and steps[-1] == 2
    report = latest_report(store, layout)
    assert report is not None and [row["stage"] for row in report["rows"]] == ["base-model", "sft"]
    assert report["held_out_tasks"] == ["conv_block"]


def test_grpo_rewards_come_from_the_evaluator_and_raise_the_faster_answer(tmp_path: Path) -> None:
    """The learning check: two correct answers to diag(a) @ b, one O(NM), one O(N^2 M). The
    evaluator times each once (43x against about 1x here); after three GRPO steps the model
    prefers the faster one. Seeded; the margin leaves room for noise."""
    model, ids = answer_model(tmp_path / "model", [answer_text(FAST), answer_text(SLOW)])
    grpo = {
        "learning_rate": 0.02,
        "num_generations": 4,
        "beta": 0.0,
        "max_completion_length": 16,
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "use_vllm": False,
        "bf16": False,
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_steps": 3,
    }
    config = run_config(
        model, [{"name": "rl", "type": "grpo", "grpo": grpo}], tasks=[DIAG], heldOut={"fraction": 0.0}
    )
    task = load_tasks(DIAG)[0]
    prompt = build_messages(task, [], "cpu", "cpu")
    before = answer_probabilities(model, prompt, ids)
    with open_run(
        config,
        store=str(tmp_path / "store"),
        work_dir=tmp_path / "work",
        device="cpu",
        eval_overrides=FAST_EVAL,
    ) as run:
        summary = run_stage(run, "rl")
        final = tmp_path / "final"
        run.store.download_dir(run.layout.model("rl"), final)
        status = latest_stage_status(run.store, run.layout, "rl")
        results = list(run.store.list_results(run.layout.stage("rl")))
    after = answer_probabilities(final, prompt, ids)
    fast_share_before = before[0] / (before[0] + before[1])
    fast_share_after = after[0] / (after[0] + after[1])
    assert fast_share_before == pytest.approx(0.5)
    assert fast_share_after > 0.7, (before, after)
    # Both answers were verified by the evaluator, once each, and went into the variant database.
    assert len(results) == 2 and summary["new_variants"] == 2
    assert {str(result.verdict) for result in results} <= {"correct", "rejected"}
    assert status is not None and status.phase == "Succeeded"
    for metric in ("reward", "share/correct", "reward/raw_mean", "timing/reward_wait_share"):
        assert metric in status.metrics, sorted(status.metrics)
    assert 0.0 <= summary["timing"]["reward_wait_share"] <= 1.0


def test_selftrain_keeps_only_verified_answers(tmp_path: Path) -> None:
    """One round: the model answers (transformers generation), the evaluator verifies, the
    correct answers become the fine-tuning set, the round's model is stored."""
    model, _ = answer_model(
        tmp_path / "model", [answer_text(FAST), answer_text(SLOW), answer_text("x = 1\n")]
    )
    stage = {
        "name": "self",
        "type": "selftrain",
        "selftrain": {
            "rounds": 1,
            "samples_per_task": 3,
            "keep_per_task": 2,
            "max_new_tokens": 16,
            "use_vllm": False,
        },
        "sft": {**TINY_SFT, "max_steps": 1, "save_steps": 1},
    }
    config = run_config(model, [stage], tasks=[DIAG], heldOut={"fraction": 0.0})
    with open_run(
        config,
        store=str(tmp_path / "store"),
        work_dir=tmp_path / "work",
        device="cpu",
        eval_overrides=FAST_EVAL,
    ) as run:
        summary = run_stage(run, "self")
        layout = run.layout
        store = run.store
    (round_one,) = summary["rounds"]
    assert 1 <= round_one["examples"] <= 2  # answers without ModelNew never reach training
    assert store.dir_complete(f"{layout.stage('self')}/round-01/model") and store.dir_complete(
        layout.model("self")
    )
    assert stage_done(store, layout, "self")
