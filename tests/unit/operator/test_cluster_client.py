"""The cluster commands' pure parts: the status table and detail, what needs attention, where a
resource's results are, which logs `--task` selects, and the error when there is no kubeconfig."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

import pytest

from kernelfleet.core.cli import main
from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import OptimizationJobSpec
from kernelfleet.core.store import open_store
from kernelfleet.operator.client import _logs, _submit, run_location_of
from kernelfleet.operator.client._status import attention, format_detail, format_list

NOW = datetime.datetime(2026, 5, 1, 12, 0, 0, tzinfo=datetime.UTC)


def _job(
    name: str, minutes_old: float, status: dict[str, Any] | None = None, namespace: str = "team"
) -> dict[str, Any]:
    created = NOW - datetime.timedelta(minutes=minutes_old)
    return {
        "kind": "OptimizationJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": created.isoformat().replace("+00:00", "Z"),
        },
        "spec": {"tasks": ["kernelbench-v0:1:1-4"], "gpuClasses": ["h100", "a100"]},
        "status": status or {},
    }


RUNNING = {
    "phase": "Running",
    "observedGeneration": 1,
    "tasksTotal": 8,
    "tasksDone": 3,
    "tasksFailed": 1,
    "variantsEvaluated": 40,
    "bestSpeedup": 2.1,
    "medianSpeedup": 1.4,
    "results": "s3://kernelfleet/optimizationjobs/team/tuned/uid-tuned",
    "perClass": {
        "h100": {"tasksTotal": 4, "tasksDone": 3, "bestSpeedup": 2.1, "medianSpeedup": 1.4, "jobs": 1},
        "a100": {"tasksTotal": 4, "tasksDone": 0, "tasksFailed": 1, "jobs": 1, "activePods": 1},
    },
    "conditions": [
        {"type": "Accepted", "status": "True", "reason": "Planned", "message": "8 tasks on 2 classes"},
        {
            "type": "GpuClassUnavailable",
            "status": "True",
            "reason": "NoNodes",
            "message": "no node has nvidia.com/gpu.product in [NVIDIA-L40]",
        },
    ],
}


def test_the_list_shows_progress_speedups_per_class_attention_and_age() -> None:
    text = format_list(
        [_job("tuned", 5, RUNNING), _job("fresh", 0.2), _job("orphan", 3)], all_namespaces=True, now=NOW
    )
    header, tuned, fresh, orphan = text.splitlines()
    assert header.split()[:4] == ["NAMESPACE", "NAME", "KIND", "PHASE"]
    assert "team" in tuned and "Running" in tuned and "3/8 (1 failed)" in tuned
    assert "a100 -/-, h100 2.10x/1.40x" in tuned
    assert "GpuClassUnavailable: NoNodes" in tuned and tuned.rstrip().endswith("5m")
    # A job seconds old without status is normal; minutes old, the operator is missing.
    assert "no operator" not in fresh and fresh.rstrip().endswith("12s")
    assert "no operator has picked it up in 3m" in orphan


def test_attention_names_failing_and_refused_conditions_only() -> None:
    failed = {
        "phase": "Failed",
        "conditions": [
            {"type": "Accepted", "status": "False", "reason": "UnknownGpuClass"},
            {"type": "Failed", "status": "True", "reason": "Failed"},
            {"type": "Running", "status": "False", "reason": "Stopped"},
            {"type": "Complete", "status": "False"},
        ],
    }
    assert attention(_job("bad", 1, failed), NOW) == ["Accepted: UnknownGpuClass", "Failed"]


def test_the_detail_has_the_class_table_conditions_events_and_where_results_are() -> None:
    events = [
        {
            "type": "Normal",
            "reason": "Accepted",
            "message": "8 tasks",
            "lastTimestamp": "2026-05-01T11:56:00Z",
            "metadata": {},
        },
        {
            "type": "Warning",
            "reason": "NoNodes",
            "message": "class l40",
            "lastTimestamp": "2026-05-01T11:58:00Z",
            "metadata": {},
        },
    ]
    text = format_detail(_job("tuned", 5, RUNNING), events, now=NOW)
    assert text.startswith("OptimizationJob team/tuned: Running, age 5m")
    assert "3 of 8 done, 1 failed; 40 variants evaluated; best 2.10x, median 1.40x" in text
    assert "kernelfleet results tuned -n team" in text
    h100 = next(line for line in text.splitlines() if line.startswith("h100"))
    assert h100.split()[:6] == ["h100", "3/4", "0", "0", "2.10x", "1.40x"]
    assert "GpuClassUnavailable  True" in text and "no node has nvidia.com/gpu.product" in text
    assert (
        "recent events:" in text
        and "4m   Normal   Accepted  8 tasks" in text
        and "2m   Warning  NoNodes" in text
    )


def test_the_detail_of_a_job_no_operator_saw_says_what_to_check() -> None:
    text = format_detail(_job("orphan", 10), now=NOW)
    assert "no status yet" in text and "is the operator running?" in text


def test_results_are_found_in_the_status_or_their_absence_is_explained() -> None:
    location = run_location_of(_job("tuned", 5, RUNNING))
    assert (location.store_url, location.prefix) == (
        "s3://kernelfleet",
        "optimizationjobs/team/tuned/uid-tuned",
    )
    with pytest.raises(UsageError, match=r"team/new has no results yet \(Pending\)"):
        run_location_of(_job("new", 1, {"phase": "Pending"}))


def test_logs_by_task_name_hash_start_and_class(tmp_path: Path) -> None:
    from kernelfleet.core.jobplan import Role, TaskOutcome, chunk_key, chunk_tasks, outcome_key, task_log_key
    from kernelfleet.core.models import Task

    store = open_store(str(tmp_path))
    prefix = "optimizationjobs/team/tuned/uid"
    matmul, conv = Task(name="1_1_matmul", code="# matmul\n"), Task(name="1_2_conv", code="# conv\n")
    (chunk,) = chunk_tasks([matmul, conv])
    store.put_json(chunk_key(prefix, 0), chunk)
    for key, text in [
        (task_log_key(prefix, Role.SEARCH, "h100", matmul.hash), "matmul on h100\n"),
        (task_log_key(prefix, Role.SEARCH, "h100", matmul.hash, attempt=1), "matmul retried\n"),
        (task_log_key(prefix, Role.SEARCH, "a100", conv.hash), "conv failed: CUDA error\n"),
        (f"{prefix}/logs/search/a100/index-0-3-0.log", "pod started\n"),
    ]:
        store.put_bytes(key, text.encode())
    failed = TaskOutcome(
        task_hash=conv.hash, task_name=conv.name, gpu_class="a100", ok=False, error="CUDA error"
    )
    store.put_json(outcome_key(prefix, Role.SEARCH, "a100", conv.hash), failed)
    files = _logs.log_files(store, prefix)
    assert [(f.task or f.stem, f.gpu_class, f.attempt) for f in files] == [
        ("1_1_matmul", "h100", 0),
        ("1_1_matmul", "h100", 1),
        ("1_2_conv", "a100", 0),
        ("index-0-3-0", "a100", 0),
    ]
    assert _logs.outcomes(store, prefix) == {("search", "a100", conv.hash[:16]): "failed: CUDA error"}
    chosen = _logs.select(files, "1_1_matmul", None)
    assert [_logs.read_log(store, f) for f in chosen] == ["matmul on h100\n", "matmul retried\n"]
    assert chosen[1].label == "1_1_matmul on h100 (search, attempt 2)"
    assert [f.task for f in _logs.select(files, "1_2", None)] == ["1_2_conv"]
    assert [f.task for f in _logs.select(files, conv.hash[:6], None)] == ["1_2_conv"]
    assert len(_logs.select(files, None, "a100")) == 2
    with pytest.raises(UsageError, match="matches several tasks: 1_1_matmul, 1_2_conv"):
        _logs.select(files, "1_", None)
    with pytest.raises(UsageError, match="tasks with logs: 1_1_matmul, 1_2_conv"):
        _logs.select(files, "softmax", None)
    with pytest.raises(UsageError, match="classes with logs: a100, h100"):
        _logs.select(files, None, "l40")


def test_cluster_commands_without_a_kubeconfig_say_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for argv in (["status"], ["status", "tuned"], ["logs", "tuned"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "no kubeconfig" in err and "eval $(kernelfleet dev-cluster env)" in err
    assert main(["status", "tuned", "-A"]) == 2
    assert "not both" in capsys.readouterr().err


NOT_KUBECONFIGS = {
    "text": "hello world\n",
    "a-list": "- a\n- b\n",
    "not-yaml": "{{{",
    "empty": "",
    "bad-clusters": "apiVersion: v1\nclusters: 5\n",
    "bad-entry": "apiVersion: v1\nusers:\n- just-a-name\n",
    "missing-context": "apiVersion: v1\ncurrent-context: x\ncontexts: []\n",
    "missing-cluster": "apiVersion: v1\ncurrent-context: x\ncontexts:\n- name: x\n  context: {cluster: c}\n",
    "binary": b"\xff\xfe\x00junk",
}


@pytest.mark.parametrize("content", list(NOT_KUBECONFIGS.values()), ids=list(NOT_KUBECONFIGS))
def test_a_kubeconfig_that_is_not_one_is_named_by_every_cluster_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], content: str | bytes
) -> None:
    path = tmp_path / "kubeconfig"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    commands = (
        ["status"],
        ["status", "tuned"],
        ["logs", "tuned"],
        ["results", "optimizationjob/tuned"],
        ["report", "optimizationjob/tuned"],
        ["submit", str(tmp_path), "--store", "s3://b/p", "--name", "tuned"],
        ["operator", "-A", "--standalone", "--no-metrics"],
    )
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and f"cannot use the kubeconfig {path}" in lines[0], (argv, err)
        assert "Traceback" not in err


# ---------------------------------------------------------------------- submit


def _subparser(command: str) -> argparse.ArgumentParser:
    from kernelfleet.core.cli import build_parser

    root = build_parser()
    action = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = action.choices[command]
    return parser


def _options(parser: argparse.ArgumentParser, group: str) -> set[str]:
    found = next(g for g in parser._action_groups if g.title == group)
    return {name for action in found._group_actions for name in action.option_strings}


def test_submit_takes_the_budget_and_evaluation_flags_of_optimize() -> None:
    optimize, submit = _subparser("optimize"), _subparser("submit")
    for group in ("budget", "evaluation"):
        assert _options(optimize, group) - {"--device"} == _options(submit, group), group
    assert {"--temperature", "--concurrency"} <= _options(
        submit, "language-model policies (openai, hf, vllm)"
    )


def test_policies_become_policy_specs_and_local_files_are_uploaded(tmp_path: Path) -> None:
    uploads = _submit.Uploads(None)
    uploads._store = open_store(str(tmp_path / "store"))
    compile_spec = _submit.policy_spec("compile", uploads)
    assert compile_spec.kind == "compile"
    openai = _submit.policy_spec(
        "openai:qwen@http://vllm:8000/v1", uploads, api_key_secret="key", temperature=0.5
    )
    assert (openai.model, openai.base_url, openai.api_key_secret, openai.temperature) == (
        "qwen",
        "http://vllm:8000/v1",
        "key",
        0.5,
    )
    assert _submit.policy_spec("replay:s3://b/r.jsonl", uploads).path == "s3://b/r.jsonl"
    replay = tmp_path / "candidates.jsonl"
    replay.write_text('{"task": "double", "code": "x"}\n')
    uploaded = _submit.policy_spec(f"replay:{replay}", uploads).path
    assert uploaded.endswith(".jsonl") and "uploads/replay/" in uploaded
    assert _submit.policy_spec(f"replay:{replay}", uploads).path == uploaded  # content-addressed
    for bad, why in [
        ("compile:cudagraph", "every torch.compile variant"),
        ("openai:qwen", "a model and an endpoint"),
        ("gpt", "unknown kind 'gpt'"),
        ("replay:missing.jsonl", "cannot read the replay file"),
    ]:
        with pytest.raises(UsageError, match=why):
            _submit.policy_spec(bad, uploads)


def test_local_tasks_are_uploaded_as_a_folder_the_operator_reads(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    uploads = _submit.Uploads(None)
    uploads._store = open_store(str(tmp_path / "store"))
    selections = _submit.task_selections([str(root / "examples" / "tasks"), "kernelbench-v0:1:1-2"], uploads)
    folder, kernelbench = selections
    assert kernelbench == "kernelbench-v0:1:1-2" and "/uploads/tasks/" in folder and folder.endswith("/")
    key = folder.split("/store/", 1)[1]
    names = sorted(k.rsplit("/", 1)[-1] for k in uploads.store().list(key))
    assert names == sorted(p.name for p in (root / "examples" / "tasks").glob("*.py"))
    with pytest.raises(UsageError, match="level 1 has no task ids"):
        _submit.task_selections(["kernelbench-v0:1:9999"], uploads)


def test_local_files_need_a_store_the_cluster_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELFLEET_STORE", raising=False)
    with pytest.raises(UsageError, match="pass --store s3://bucket/prefix"):
        _submit.Uploads(None).store()
    with pytest.raises(UsageError, match="is not on S3"):
        _submit.Uploads("/tmp/store").store()


def test_manifests_are_checked_before_they_reach_the_cluster(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    documents = _submit.read_manifests(str(root / "examples" / "optimizationjob.yaml"))
    assert [d["kind"] for d in documents] == ["OptimizationJob"]
    assert _submit.read_manifests(str(root / "examples" / "trainingrun.yaml"))[0]["kind"] == "TrainingRun"
    bad = tmp_path / "bad.yaml"
    for text, message in [
        (
            "kind: Pod\napiVersion: v1\nmetadata: {name: p}\n",
            "kind 'Pod' is not OptimizationJob or TrainingRun",
        ),
        (
            "kind: OptimizationJob\napiVersion: kernelfleet.io/v1alpha1\nmetadata: {name: j}\n"
            "spec: {tasks: [kernelbench-v0:1:1], budget: {rounds: 0}}\n",
            r"spec\.budget\.rounds: Input should be greater than or equal to 1",
        ),
        (
            "kind: OptimizationJob\napiVersion: kernelfleet.io/v1alpha1\nmetadata: {name: j}\n"
            "spec: {tasks: [kernelbench-v0:1:1], gpuClasses: [H100]}\n",
            r"spec\.gpuClasses\[0\]",
        ),
        ("kind: OptimizationJob\napiVersion: kernelfleet.io/v1\nmetadata: {name: j}\n", "apiVersion must be"),
        (
            "kind: OptimizationJob\napiVersion: kernelfleet.io/v1alpha1\nspec: {}\n",
            "metadata.name is missing",
        ),
        ("{", "not valid YAML"),
    ]:
        bad.write_text(text)
        with pytest.raises(UsageError, match=message):
            _submit.read_manifests(str(bad))


def test_the_same_command_derives_the_same_name() -> None:
    spec = OptimizationJobSpec(tasks=["kernelbench-v0:1:1-3"], gpu_classes=["h100"])
    again = OptimizationJobSpec(tasks=["kernelbench-v0:1:1-3"], gpu_classes=["h100"])
    other = OptimizationJobSpec(tasks=["kernelbench-v0:1:1-3"], gpu_classes=["a100"])
    name = _submit.derived_name("OptimizationJob", spec)
    assert name.startswith("opt-") and name == _submit.derived_name("OptimizationJob", again)
    assert name != _submit.derived_name("OptimizationJob", other)


def test_following_ends_on_success_or_failure() -> None:
    frames = iter(
        [
            _job("j", 1, {}),
            _job("j", 1, {"phase": "Running", "tasksTotal": 4, "tasksDone": 1}),
            _job("j", 1, {"phase": "Running", "tasksTotal": 4, "tasksDone": 1}),
            _job(
                "j",
                1,
                {
                    "phase": "Succeeded",
                    "tasksTotal": 4,
                    "tasksDone": 4,
                    "perClass": {"h100": {"bestSpeedup": 1.5}},
                },
            ),
        ]
    )
    said: list[str] = []
    final = _submit.follow(lambda: next(frames), said.append, interval_s=0)
    assert _submit.succeeded(final)
    assert len(said) == 3  # an unchanged line is not repeated
    assert said[1].startswith("[######------------------] j: Running, 1/4")
    assert said[2].startswith("[########################] j: Succeeded, 4/4") and "h100 1.50x/-" in said[2]
    failed = _job("j", 1, {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True"}]})
    assert _submit.finished(failed) and not _submit.succeeded(failed)
