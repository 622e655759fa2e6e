"""Folding a TrainingRun's status: the trainer's records in the store (a real local store) and
the stage JobSets' state give each stage's phase, step, checkpoint and metrics."""

from __future__ import annotations

from pathlib import Path

from kernelfleet.core.resources import TrainingRunSpec, TrainingStageStatus
from kernelfleet.core.store import open_store
from kernelfleet.core.training import TrainingLayout
from kernelfleet.operator._training_plan import JobState, JobView, plan_run
from kernelfleet.operator._training_status import fold_stages, read_stage, stages_to_read

SPEC = TrainingRunSpec.model_validate(
    {
        "baseModel": "s3://models/tiny",
        "tasks": ["kernelbench-v0:1"],
        "stages": [{"name": "sft", "type": "sft"}, {"name": "rl", "type": "grpo"}],
        "rewardGpus": 0,
    }
)
DONE = JobView(JobState.SUCCEEDED)
RUNNING = JobView(JobState.ACTIVE, running=True)


def write_status(store, layout: TrainingLayout, stage: str, step: int, **fields) -> None:
    status = TrainingStageStatus(name=stage, step=step, updated_at=f"t{step}", **fields)
    store.put_json(layout.status(stage, 1000 + step, step), status)


def write_checkpoint(store, layout: TrainingLayout, stage: str, step: int, tmp_path: Path) -> str:
    folder = tmp_path / f"ckpt-{step}"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    key = layout.checkpoint(stage, step, "a1")
    store.upload_dir(folder, key)
    return store.url_for(key)


def test_a_running_stage_shows_the_trainers_step_metrics_and_newest_checkpoint(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    layout = TrainingLayout("trainingruns/ns/run/uid")
    write_status(store, layout, "sft", 2, phase="Running", max_steps=8, metrics={"loss": 2.5})
    write_status(store, layout, "sft", 4, phase="Running", max_steps=8, metrics={"loss": 1.25})
    write_checkpoint(store, layout, "sft", 2, tmp_path)
    newest = write_checkpoint(store, layout, "sft", 4, tmp_path)
    jobs = {"sft": RUNNING}
    assert stages_to_read(SPEC, jobs, []) == ["sft"]
    records = {"sft": read_stage(store, layout, "sft")}
    folded = fold_stages(SPEC, plan_run(SPEC, jobs), jobs, records, [])
    sft, rl = folded.stages
    assert (sft.name, sft.type, sft.phase, sft.step, sft.max_steps) == ("sft", "sft", "Running", 4, 8)
    assert sft.metrics == {"loss": 1.25}
    assert sft.checkpoint == newest == folded.checkpoint
    assert (rl.name, rl.type, rl.phase) == ("rl", "grpo", "Pending")
    assert folded.current_stage == "sft" and folded.stages_done == 0


def test_an_evicted_pods_replacement_shows_as_pending_with_the_restart_count(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    layout = TrainingLayout("p")
    write_status(store, layout, "sft", 3, phase="Running", max_steps=8)
    jobs = {"sft": JobView(JobState.ACTIVE, running=False, restarts=1)}
    records = {"sft": read_stage(store, layout, "sft")}
    sft = fold_stages(SPEC, plan_run(SPEC, jobs), jobs, records, []).stages[0]
    assert sft.phase == "Pending" and sft.step == 3
    assert (
        "restarted 1 time(s) after a failed or evicted pod" in sft.message
        and "newest checkpoint" in sft.message
    )


def test_finished_stages_are_not_read_again_and_keep_their_status(tmp_path: Path) -> None:
    previous = [
        TrainingStageStatus(
            name="sft", type="sft", phase="Succeeded", step=8, checkpoint="s3://b/c", model="m"
        ),
        TrainingStageStatus(name="rl", type="grpo", phase="Running", step=1),
    ]
    jobs = {"sft": DONE, "rl": RUNNING}
    assert stages_to_read(SPEC, jobs, previous) == ["rl"]
    store = open_store(tmp_path / "store")
    layout = TrainingLayout("p")
    write_status(store, layout, "rl", 5, phase="Running", max_steps=10, metrics={"reward/mean": 0.5})
    records = {"rl": read_stage(store, layout, "rl")}
    folded = fold_stages(SPEC, plan_run(SPEC, jobs), jobs, records, previous)
    assert folded.stages[0] == previous[0]
    assert folded.stages[1].step == 5 and folded.stages[1].metrics == {"reward/mean": 0.5}
    assert folded.current_stage == "rl" and folded.stages_done == 1
    assert folded.checkpoint == "s3://b/c"  # the rl stage has none yet


def test_a_failed_job_shows_its_reason_and_a_suspended_run_says_so() -> None:
    jobs = {"sft": JobView(JobState.FAILED, "BackoffLimitExceeded")}
    folded = fold_stages(SPEC, plan_run(SPEC, jobs), jobs, {}, [])
    assert folded.stages[0].phase == "Failed" and folded.stages[0].message == "BackoffLimitExceeded"
    suspended = SPEC.model_copy(update={"suspend": True})
    jobs = {"sft": JobView(JobState.SUSPENDED)}
    folded = fold_stages(suspended, plan_run(suspended, jobs), jobs, {}, [])
    assert folded.stages[0].phase == "Suspended" and "suspended at stage 1/2 sft" in folded.stages[0].message
