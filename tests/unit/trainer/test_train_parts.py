"""The trainer's parts that need no training: the held-out split, reward shaping, configs, the
store layout of checkpoints and status, and the command line's one-stage configs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Environment, EvaluationResult, Verdict
from kernelfleet.core.resources import (
    HeldOutSpec,
    RewardSpec,
    StageType,
    TrainingRunSpec,
    TrainingStageStatus,
)
from kernelfleet.core.store import open_store
from kernelfleet.core.tasks import load_tasks
from kernelfleet.core.training import (
    TrainingLayout,
    latest_checkpoint,
    latest_stage_status,
    read_run_record,
    run_record,
)
from kernelfleet.trainer._rewards import RewardShaper, batch_metrics
from kernelfleet.trainer._spec import load_run_config, parse_spec
from kernelfleet.trainer._split import split_tasks
from kernelfleet.trainer.cli import register, single_config
from tests.support.training import EXAMPLE_TASKS, ROOT

ENV = Environment(device="cpu", gpu_class="cpu", evaluator_version="t")


def result(verdict: str, speedup: float | None = None, reasons: tuple[str, ...] = ()) -> EvaluationResult:
    return EvaluationResult(
        task_hash="t",
        variant_hash="v",
        verdict=Verdict(verdict),
        speedup=speedup,
        reasons=reasons,
        environment=ENV,
    )


# ---------------------------------------------------------------- held-out split


def test_held_out_is_a_fixed_share_of_each_kernelbench_level_whatever_is_selected() -> None:
    level1 = load_tasks("kernelbench-v0:1")
    split = split_tasks(level1, HeldOutSpec())
    assert len(split.held_out) == 20 and len(split.train) == 80
    held = {task.task_id for task in split.held_out}
    # A narrower selection holds out exactly the same tasks within it: the split is over the level.
    part = load_tasks("kernelbench-v0:1:1-30")
    narrow = split_tasks(part, HeldOutSpec())
    assert {task.task_id for task in narrow.held_out} == {i for i in held if i is not None and i <= 30}
    assert not {t.hash for t in narrow.train} & {t.hash for t in narrow.held_out}
    # Another seed, another split; the same seed, the same split.
    assert {t.task_id for t in split_tasks(level1, HeldOutSpec(seed=1)).held_out} != held
    assert {t.task_id for t in split_tasks(level1, HeldOutSpec()).held_out} == held


def test_held_out_of_task_files_and_explicit_selections() -> None:
    tasks = load_tasks(str(EXAMPLE_TASKS))
    split = split_tasks(tasks, HeldOutSpec(fraction=0.25, tasks=["kernelbench-v0:1:3"]))
    assert len(split.held_out) == 2 and len(split.train) == 3
    assert "1_3_Batched_matrix_multiplication" in {task.name for task in split.held_out}
    assert split_tasks(tasks, HeldOutSpec(fraction=0.0)).held_out == ()


# ---------------------------------------------------------------- rewards


def test_outcomes_map_verdicts_to_raw_rewards() -> None:
    shaper = RewardShaper(RewardSpec(rejected_penalty=-2.0, unparsable_penalty=-0.5, incorrect=0.0))
    assert shaper.outcome(result("correct", 2.5)).raw == 2.5
    assert shaper.outcome(result("correct", None)).raw == 1.0  # correct, speedup refused as noisy
    assert shaper.outcome(result("incorrect", None, ("output-mismatch: x",))).raw == 0.0
    rejected = shaper.outcome(result("rejected", None, ("side-stream-work: found",)))
    assert rejected.raw == -2.0 and rejected.reason == "side-stream-work"
    assert shaper.outcome(None, parse_error="no code").raw == -0.5
    assert shaper.outcome(None).raw is None  # the evaluator failed: unscorable
    assert shaper.outcome(result("runtime_error", None, ("reference-error: broken",))).raw is None


def test_shaping_normalises_over_the_batch_and_clips() -> None:
    shaper = RewardShaper(RewardSpec(clip=1.5))
    shaped = shaper.shape([1.0, 1.0, 1.0, 50.0, None])
    assert shaped[4] is None
    assert max(v for v in shaped if v is not None) == 1.5  # the 50x outlier is clipped
    assert shaped[0] is not None and shaped[0] < 0 and shaped[0] == shaped[1] == shaped[2]
    assert shaper.shape([2.0, 2.0]) == [0.0, 0.0]
    raw = RewardShaper(RewardSpec(normalize=False, clip=3.0)).shape([1.0, 10.0])
    assert raw == [1.0, 3.0]


def test_batch_metrics_count_shares_by_kind_and_reason() -> None:
    shaper = RewardShaper()
    outcomes = [
        shaper.outcome(result("correct", 2.0)),
        shaper.outcome(result("rejected", None, ("cached-output: memo",))),
        shaper.outcome(None, parse_error="empty"),
        shaper.outcome(result("incorrect", None, ("output-mismatch: x",))),
    ]
    metrics = batch_metrics(outcomes)
    assert metrics["share/correct"] == 0.25 and metrics["share/rejected/cached-output"] == 0.25
    assert metrics["share/unparsable"] == 0.25 and metrics["reward/speedup_max"] == 2.0


# ---------------------------------------------------------------- configs


def test_the_example_trainingrun_is_a_valid_config() -> None:
    config = load_run_config(ROOT / "examples" / "trainingrun.yaml")
    assert config.name == "coder-contrastive"
    assert [stage.type for stage in config.spec.stages] == [
        StageType.SFT,
        StageType.SELF_TRAIN,
        StageType.GRPO,
    ]
    assert config.spec.held_out.fraction == pytest.approx(0.2)


def test_a_bare_spec_in_json_and_errors_that_say_what(tmp_path: Path) -> None:
    spec = {"baseModel": "m", "tasks": ["kernelbench-v0:1:1"], "stages": [{"name": "a", "type": "sft"}]}
    path = tmp_path / "my run.json"
    path.write_text(json.dumps(spec))
    config = load_run_config(path)
    assert config.name == "my-run" and config.stage("a").type == StageType.SFT
    with pytest.raises(UsageError, match="no stage 'b'"):
        config.stage("b")
    with pytest.raises(UsageError, match="stage names must be unique"):
        parse_spec({**spec, "stages": [spec["stages"][0]] * 2}, "x", "x")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"kind": "TrainingRun", "spec": {**spec, "stages": []}}))
    with pytest.raises(UsageError, match="not a valid TrainingRun spec"):
        load_run_config(bad)


def test_train_rl_flags_become_a_one_stage_run() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "train",
            "rl",
            "kernelbench-v0:1:1-3",
            "--model",
            "/m/coder",
            "--steps",
            "5",
            "--lora",
            "--clip",
            "2",
        ]
    )
    config = single_config(args)
    (stage,) = config.spec.stages
    assert stage.type == StageType.GRPO and stage.grpo is not None and stage.reward is not None
    assert stage.grpo.max_steps == 5 and stage.grpo.use_peft and stage.reward.clip == 2.0
    with pytest.raises(UsageError, match="--policy"):
        single_config(parser.parse_args(["train", "sft", "kernelbench-v0:1:1", "--model", "m"]))


# ---------------------------------------------------------------- store layout


def test_newest_complete_checkpoint_and_status(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    layout = TrainingLayout("trainingruns/ns/run/uid")
    for step, attempt in ((2, "aa"), (4, "bb")):
        folder = tmp_path / f"c{step}"
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"x" * step)
        store.upload_dir(folder, layout.checkpoint("sft", step, attempt))
    # A checkpoint whose upload was cut short (no manifest) never counts.
    store.put_bytes(layout.checkpoint("sft", 6, "cc") + "/weights.bin", b"partial")
    found = latest_checkpoint(store, layout, "sft")
    assert found == (4, layout.checkpoint("sft", 4, "bb"))
    assert latest_stage_status(store, layout, "sft") is None
    store.put_json(layout.status("sft", 1, 0), TrainingStageStatus(name="sft", phase="Running"))
    store.put_json(layout.status("sft", 2, 4), TrainingStageStatus(name="sft", phase="Succeeded", step=4))
    status = latest_stage_status(store, layout, "sft")
    assert status is not None and status.phase == "Succeeded" and status.step == 4


def test_train_status_reads_the_stages_from_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelfleet.core.cli import main

    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "kind": "TrainingRun",
                "metadata": {"name": "demo"},
                "spec": {
                    "baseModel": "m",
                    "tasks": [str(EXAMPLE_TASKS)],
                    "stages": [{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
                },
            }
        )
    )
    store = open_store(tmp_path / "store")
    layout = TrainingLayout("trainingruns/ns/demo/uid")
    status = TrainingStageStatus(name="sft", phase="Running", step=3, max_steps=10, metrics={"loss": 1.5})
    store.put_json(layout.status("sft", 5, 3), status)
    argv = [
        "train",
        "status",
        str(config_path),
        "--store",
        str(tmp_path / "store"),
        "--prefix",
        layout.prefix,
    ]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["name"], row["phase"]) for row in rows] == [("sft", "Running"), ("rl", "Pending")]
    assert rows[0]["step"] == 3 and rows[0]["metrics"] == {"loss": 1.5}
    assert main(argv) == 0
    assert "step 3/10" in capsys.readouterr().out
    assert main(["train", "report", str(config_path), "--store", str(tmp_path / "store")]) == 1


def test_train_stage_without_a_config_reads_the_spec_recorded_in_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TrainingRun's pod gets no config file: the operator records the spec under the run's
    prefix, and `train stage --prefix` trains exactly that."""
    from kernelfleet.core.cli import main

    store = open_store(tmp_path / "store")
    layout = TrainingLayout("trainingruns/ns/demo/uid")
    argv = ["train", "stage", "--store", str(tmp_path / "store"), "--prefix", layout.prefix]
    assert main([*argv, "--stage", "sft"]) == 2
    assert f"{store.url_for(layout.spec)} does not exist" in capsys.readouterr().err
    spec = TrainingRunSpec.model_validate(
        {"baseModel": "m", "tasks": [str(EXAMPLE_TASKS)], "stages": [{"name": "sft", "type": "sft"}]}
    )
    store.put_json(layout.spec, run_record("demo", spec))
    assert read_run_record(store, layout) == ("demo", spec)
    assert main([*argv, "--stage", "rl"]) == 2
    assert "the run demo has no stage 'rl'; its stages are: sft" in capsys.readouterr().err
    assert main(["train", "stage", "--stage", "sft"]) == 2
    assert "--run-config CONFIG, or --prefix KEY" in capsys.readouterr().err


def test_rewards_from_the_evaluation_service_are_cached_in_the_store(tmp_path: Path) -> None:
    """The service backend against a real `eval serve` on the CPU: a group with a repeated
    variant is sent once per distinct variant, and a second group is answered from the store."""
    from kernelfleet.evaluator import EvalConfig, EvaluationService, Evaluator, ServiceServer
    from kernelfleet.trainer._rewards import ServiceRewardBackend, StoreResultCache

    task = load_tasks(str(EXAMPLE_TASKS / "diag_matmul.py"))[0]
    fast = (ROOT / "examples" / "candidates" / "diag_matmul__row_scale.py").read_text()
    wrong = fast.replace("a.unsqueeze(1) * b", "a.unsqueeze(0) * b[:1]")
    config = EvalConfig.model_validate(
        {
            "device": "cpu",
            "correctness": {"trials": 1},
            "timing": {"trials": 3, "warmup": 1, "max_speedup_cv": None, "speedup_recheck": None},
        }
    )
    store = open_store(tmp_path / "store")
    with Evaluator(config) as evaluator:
        server = ServiceServer(EvaluationService(evaluator, max_queue=8), token="t0ken").start()
        try:
            cache = StoreResultCache(store, "trainingruns/ns/run/uid/stages/rl")
            backend = ServiceRewardBackend(server.url, token="t0ken", cache=cache)
            results = backend.submit([(task, fast), (task, wrong), (task, fast)]).result(timeout=300)
            again = backend.submit([(task, fast)]).result(timeout=60)
            backend.close()
        finally:
            server.stop()
    assert [str(r.verdict) == "correct" for r in results] == [True, False, True]
    assert results[0] is results[2] and again[0].variant_hash == results[0].variant_hash
    assert len(list(store.list_results("trainingruns/ns/run/uid/stages/rl"))) == 2
