"""Loading tasks, the config, GPU classes, reasons and the directory result cache: pure logic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Environment, EvaluationResult, Verdict
from kernelfleet.core.tasks import parse_ids
from kernelfleet.evaluator import (
    EVALUATOR_VERSION,
    DirectoryResultCache,
    EvalConfig,
    Evaluator,
    gpu_class,
    load_tasks,
)
from kernelfleet.evaluator import reasons as R
from kernelfleet.evaluator._ops import builds_custom_kernel, declared_kernels, needs_native_build
from tests.support import evaluator_cases as C

FAST = {"device": "cpu", "correctness": {"trials": 2}, "timing": {"enabled": False, "warmup": 1}}


def _jsonl(path: Path) -> Path:
    rows = [
        {"level": level, "task_id": task_id, "name": f"task_{level}_{task_id}", "code": C.MATMUL_TASK}
        for level in (1, 2)
        for task_id in range(1, 6)
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_a_file_and_a_directory(tmp_path: Path) -> None:
    (tmp_path / "b_matmul.py").write_text(C.MATMUL_TASK)
    (tmp_path / "a_linear.py").write_text(C.LINEAR_TASK)
    (tmp_path / "helper.py").write_text("X = 1\n")
    tasks = load_tasks(tmp_path)
    assert [t.name for t in tasks] == ["a_linear", "b_matmul"]
    single = load_tasks(str(tmp_path / "b_matmul.py"))
    assert single[0].code == C.MATMUL_TASK and single[0].source.endswith("b_matmul.py")
    assert single[0].hash == tasks[1].hash


def test_jsonl_selections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _jsonl(tmp_path / "kernelbench-v9.jsonl")
    assert len(load_tasks(path)) == 10
    assert [t.task_id for t in load_tasks(f"{path}:2:2-4")] == [2, 3, 4]
    assert [t.level for t in load_tasks(f"{path}:1")] == [1] * 5
    monkeypatch.setenv("KERNELFLEET_KERNELBENCH_DIR", str(tmp_path))
    (task,) = load_tasks("kernelbench-v9:2:5")
    assert (task.level, task.task_id, task.name, task.source) == (2, 5, "2_5_task_2_5", "kernelbench-v9:2:5")
    assert [t.task_id for t in load_tasks("kernelbench-v9:1:1,3,5")] == [1, 3, 5]


def test_kernelbench_selections_read_the_bundled_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELFLEET_KERNELBENCH_DIR", raising=False)
    tasks = load_tasks("kernelbench-v0:1:12")
    assert tasks[0].level == 1 and tasks[0].task_id == 12 and "get_inputs" in tasks[0].code
    assert len(load_tasks("kernelbench-v0")) == 250
    assert len(load_tasks("kernelbench-latest:3")) == 50


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("missing.py", "does not exist"),
        ("kernelbench-v9:1:99", "no task ids"),
        ("kernelbench-v9:7", "selects no tasks"),
        ("kernelbench-v8:1:1", "no KernelBench version"),
        ("kernelbench-v9:x:1", "bad level"),
        ("kernelbench-v9:1:3-1", "bad task id range"),
        ("whatever", "cannot read tasks"),
    ],
)
def test_errors_say_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, words: str
) -> None:
    _jsonl(tmp_path / "kernelbench-v9.jsonl")
    monkeypatch.setenv("KERNELFLEET_KERNELBENCH_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=words):
        load_tasks(spec)


def test_a_file_that_is_not_a_task(tmp_path: Path) -> None:
    path = tmp_path / "cand.py"
    path.write_text(C.HONEST)
    with pytest.raises(UsageError, match="does not define Model, get_inputs, get_init_inputs"):
        load_tasks(path)
    (tmp_path / "bad.py").write_text("def (\n")
    with pytest.raises(UsageError, match="not valid Python"):
        load_tasks(tmp_path / "bad.py")
    # In a directory, a module that is not a task is passed over, but a file that is not valid
    # Python is most likely a task with a typo: it is named, not skipped without a word.
    with pytest.raises(UsageError, match=r"bad.py is not valid Python .* move it out of the task directory"):
        load_tasks(tmp_path)
    (tmp_path / "bad.py").unlink()
    with pytest.raises(UsageError, match="no task files"):
        load_tasks(tmp_path)


def test_a_latin1_task_with_a_coding_line_is_valid(tmp_path: Path) -> None:
    source = "# -*- coding: latin-1 -*-\n# Gr\u00fc\u00dfe\n" + C.MATMUL_TASK.replace(
        "class Model", 'LABEL = "caf\u00e9"\n\n\nclass Model', 1
    )
    path = tmp_path / "latin.py"
    path.write_bytes(source.encode("latin-1"))
    [task] = load_tasks(path)
    assert 'LABEL = "caf\u00e9"' in task.code
    # The evaluator writes it back in its declared encoding, so it imports as it was read.
    with Evaluator(EvalConfig.model_validate(FAST)) as evaluator:
        result = evaluator.evaluate(task, C.HONEST)
    assert result.verdict == "correct", result.reasons
    # Without the coding line, the same bytes are not UTF-8: the message says what to do.
    path.write_bytes(source.split("\n", 1)[1].encode("latin-1"))
    with pytest.raises(UsageError, match="save it as UTF-8, or declare its encoding"):
        load_tasks(path)


def test_parse_ids() -> None:
    assert parse_ids("12") == [12]
    assert parse_ids("1-3,7") == [1, 2, 3, 7]
    assert parse_ids("") is None and parse_ids("*") is None
    with pytest.raises(UsageError):
        parse_ids("one")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA L40S", "l40"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("NVIDIA B200", "b200"),
        ("Tesla T4", "tesla-t4"),
        ("cpu", "cpu"),
    ],
)
def test_gpu_class(name: str, expected: str) -> None:
    assert gpu_class(name) == expected


def test_config_defaults_and_validation() -> None:
    config = EvalConfig()
    assert config.correctness.trials >= 5 and config.timing.trials >= 100
    assert (
        config.correctness.profile == "strict"
        and config.timing.speedup_recheck == 3.0
        and config.timing.review_ceiling == 10.0
    )
    assert config.result_version == f"{EVALUATOR_VERSION}+strict"
    assert EvalConfig.model_validate(
        {"correctness": {"require_kernel": True, "profile": "kernelbench-v0"}}
    ).result_version.endswith("+kernelbench-v0.kernel")
    # Other clock settings change what a millisecond means: their results are cached apart.
    assert (
        EvalConfig.model_validate({"timing": {"lead_us": 0}}).result_version
        == f"{EVALUATOR_VERSION}+strict.lead0us"
    )
    assert (
        EvalConfig.model_validate({"timing": {"processes": 1}}).result_version
        == f"{EVALUATOR_VERSION}+strict.pairs1"
    )
    assert config.profile_rules.tolerance("float32") == (1e-4, 1e-4)
    assert EvalConfig.model_validate({"correctness": {"profile": "kernelbench-v0"}}).profile_rules.tolerance(
        "float32"
    ) == (1e-2, 1e-2)
    assert config.timing.resolved_flush_bytes(on_cuda=True) == 256 * 1024 * 1024
    for bad in (
        {"device": "gpu"},
        {"correctness": {"profile": "loose"}},
        {"timing": {"trials": 1}},
        {"timing": {"baseline_modes": ("fast",)}},
        {"timing": {"lead_us": -1}},
        {"timing": {"lead_us": 50000}},
        {"timing": {"processes": 0}},
        {"timing": {"processes": 5}},
    ):
        with pytest.raises(ValidationError):
            EvalConfig.model_validate(bad)
    with pytest.raises(ValidationError):
        config.device = "cuda"  # type: ignore[misc]
    # Settings deleted after 0.8.9 are refused with the reason, naming the setting.
    for deleted in ({"timing_clock": "device"}, {"launch_tolerance": 0.04}, {"pin_processes": True}):
        with pytest.raises(ValidationError, match=f"{next(iter(deleted))} was deleted after evaluator 0.8.9"):
            EvalConfig.model_validate(deleted)


def test_reasons() -> None:
    text = R.reason(R.CACHED_OUTPUT, "a detail: with a colon")
    assert R.reason_code(text) == R.CACHED_OUTPUT and R.is_rejecting(text)
    assert not R.is_rejecting(R.reason(R.OUTPUT_MISMATCH, "x"))
    assert R.codes([text, "timeout: slow"]) == {R.CACHED_OUTPUT, R.TIMEOUT}


def test_kernel_detection_in_sources() -> None:
    assert not builds_custom_kernel(C.HONEST)
    assert builds_custom_kernel(C.CPP_KERNEL) and needs_native_build(C.CPP_KERNEL)
    triton = "import triton\nimport triton.language as tl\n\n@triton.jit\ndef add_kernel(x):\n    pass\n"
    assert builds_custom_kernel(triton) and not needs_native_build(triton)
    assert declared_kernels(triton) == {"add_kernel"}
    cuda = 'src = """__global__ void __launch_bounds__(256) scale_kernel(float* x) {}"""'
    assert declared_kernels(cuda) == {"scale_kernel"}


def _result(variant: str) -> EvaluationResult:
    env = Environment(device="cpu", gpu_class="cpu", evaluator_version="0.1.0+strict")
    return EvaluationResult(
        task_hash="t" * 64, variant_hash=variant * 64, verdict=Verdict.CORRECT, environment=env
    )


def test_directory_cache_roundtrip(tmp_path: Path) -> None:
    cache = DirectoryResultCache(tmp_path)
    result = _result("a")
    assert cache.get(result.key) is None
    cache.put(result)
    cache.put(result)  # idempotent
    assert cache.get(result.key) == result
    assert len(cache) == 1
    assert not list(tmp_path.rglob(".tmp-*"))
    # A result being written (or left half-written by a killed run) is not a result.
    (tmp_path / result.key.path()).with_name(".tmp-partial.json").write_text("{")
    assert len(cache) == 1
    path = tmp_path / result.key.path()
    path.write_text("{not json")
    assert cache.get(result.key) is None
