"""The policies that need no model: `compile` (rewrites of the reference) and `replay` (a JSONL file)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kernelfleet.core.errors import UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Task
from kernelfleet.search import CompilePolicy, ReplayPolicy, ReplayRow, Request, make_policy
from kernelfleet.search.policies._replay import parse_replay_lines

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def example(name: str) -> Task:
    path = EXAMPLES / "tasks" / f"{name}.py"
    return Task(name=name, code=path.read_text(), source=str(path))


def request(task: Task, index: int = 0, gpu: bool = False, seen: frozenset[str] = frozenset()) -> Request:
    return Request(
        task=task,
        device="gpu" if gpu else "cpu",
        gpu_class="h100" if gpu else "cpu",
        round=0,
        index=index,
        seen=seen,
    )


def load_module(code: str, tmp_path: Path, name: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- compile


def test_compile_variants_depend_on_device_and_task() -> None:
    policy = CompilePolicy()
    plain, conv = example("softmax_rows"), example("conv_block")
    assert [n for n, _ in policy.variants_for(plain, on_gpu=False)] == ["compile-default"]
    assert [n for n, _ in policy.variants_for(conv, on_gpu=False)] == [
        "compile-default",
        "channels-last",
        "channels-last-compile",
    ]
    gpu_names = [n for n, _ in policy.variants_for(conv, on_gpu=True)]
    assert gpu_names[:4] == [
        "compile-default",
        "compile-max-autotune-no-cudagraphs",
        "cudagraph",
        "compile-reduce-overhead",
    ]
    for _, code in policy.variants_for(conv, on_gpu=True):
        tree = ast.parse(code)
        assert any(isinstance(node, ast.ClassDef) and node.name == "ModelNew" for node in tree.body)
        assert code.startswith(conv.code.rstrip())


def test_compile_hands_out_distinct_variants_then_is_exhausted() -> None:
    policy = CompilePolicy()
    conv = example("conv_block")
    proposals = policy.propose([request(conv, i) for i in range(4)])
    assert [p.name for p in proposals[:3]] == ["compile-default", "channels-last", "channels-last-compile"]
    assert proposals[3].exhausted and not proposals[3].recorded
    assert all(p.key == source_hash(p.code or "") for p in proposals[:3])
    seen = frozenset(p.key for p in proposals[:2])
    (next_one,) = policy.propose([request(conv, 0, seen=seen)])
    assert next_one.name == "channels-last-compile"


def test_channels_last_and_cudagraph_keep_the_numerics_on_cpu(tmp_path: Path) -> None:
    import torch

    conv = example("conv_block")
    reference = load_module(conv.code, tmp_path, "kf_ref_conv")
    variants = dict(CompilePolicy().variants_for(conv, on_gpu=True))
    torch.manual_seed(0)
    inputs = [torch.randn(2, 16, 8, 8)]
    torch.manual_seed(42)
    model = reference.Model(*reference.get_init_inputs())
    expected = model(*inputs)
    for name in ("channels-last", "cudagraph"):
        module = load_module(variants[name], tmp_path, f"kf_variant_{name.replace('-', '_')}")
        torch.manual_seed(42)
        candidate = module.ModelNew(*reference.get_init_inputs())
        out = candidate(*inputs)
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert [n for n, _ in candidate.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_compile_default_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # Dynamo traces the wrapper for real; only inductor's code generation (slow on 2 cores)
    # is swapped for the eager backend. The evaluator's tests and the demo run it in full.
    real_compile = torch.compile
    modes: list[str] = []

    def eager_compile(model: Any, *, mode: str = "default", dynamic: bool = False) -> Any:
        modes.append(mode)
        return real_compile(model, backend="eager", dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", eager_compile)

    task = Task(
        name="tiny",
        code="import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
        "    def forward(self, x):\n        return torch.relu(x) * 2 + 1\n\n\n"
        "def get_inputs():\n    return [torch.randn(16)]\n\n\ndef get_init_inputs():\n    return []\n",
    )
    (code,) = [code for name, code in CompilePolicy().variants_for(task, on_gpu=False)]
    module = load_module(code, tmp_path, "kf_variant_compile_tiny")
    x = torch.randn(16)
    torch.testing.assert_close(module.ModelNew()(x), torch.relu(x) * 2 + 1)
    assert modes == ["default"]


# ---------------------------------------------------------------------- replay


def test_replay_matches_tasks_by_name_file_hash_and_kernelbench_id() -> None:
    task = Task(name="1_12_diag", code="x = 1\n", level=1, task_id=12, source="/data/diag_matmul.py")
    assert ReplayRow("1_12_diag", "").matches(task)
    assert ReplayRow("diag_matmul", "").matches(task)
    assert ReplayRow(task.hash[:10], "").matches(task)
    assert ReplayRow(task.hash.upper(), "").matches(task)
    assert ReplayRow("1:12", "").matches(task)
    assert ReplayRow(" 1 : 12 ", "").matches(task)
    assert not ReplayRow("1:13", "").matches(task)
    assert not ReplayRow(task.hash[:6], "").matches(task)  # too short to be a hash
    assert not ReplayRow("other", "").matches(task)


def test_replay_proposes_rows_in_order_and_checks_them() -> None:
    task = Task(name="t", code="x = 1\n")
    good = "class ModelNew:\n    pass\n"
    rows = [
        ReplayRow("t", good, "first"),
        ReplayRow("u", good),
        ReplayRow("t", "class ModelNew(:\n", "broken"),
    ]
    policy = ReplayPolicy(rows, origin="mine.jsonl")
    first, second, third = policy.propose([request(task, i) for i in range(3)])
    assert (first.name, first.code) == ("first", good)
    assert second.code is None and second.name == "broken" and second.error.startswith("code does not parse")
    assert second.recorded  # an unusable row is recorded, so it is not proposed again
    assert third.exhausted
    (again,) = policy.propose([request(task, 0, seen=frozenset({first.key, second.key}))])
    assert again.exhausted


def test_replay_id_follows_the_content() -> None:
    a = ReplayPolicy([ReplayRow("t", "class ModelNew: pass\n")])
    b = ReplayPolicy([ReplayRow("t", "class ModelNew: pass\n\n")])  # same code once normalised
    c = ReplayPolicy([ReplayRow("t", "class ModelNew: x = 1\n")])
    assert a.id == b.id != c.id


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"task": "t", "code": "x"}\nnot json\n', r"f.jsonl:2: not valid JSON"),
        ('{"task": "t"}\n', r"f.jsonl:1: .*\"code\""),
        ("[1, 2]\n", r"f.jsonl:1: "),
        ('{"task": 3, "code": "x"}\n', r"f.jsonl:1: "),
    ],
)
def test_malformed_replay_lines_fail_with_the_line_number(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_replay_lines(text, "f.jsonl")


def test_replay_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the replay file"):
        ReplayPolicy.from_file(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UsageError, match="no candidates"):
        ReplayPolicy.from_file(empty)
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"task": "t", "code": "class ModelNew: pass\n"}) + "\n")
    policy = make_policy(f"replay:{good}")
    assert isinstance(policy, ReplayPolicy) and len(policy.rows) == 1


def test_the_example_candidates_file_matches_its_sources() -> None:
    spec = importlib.util.spec_from_file_location("kf_build_candidates", EXAMPLES / "build_candidates.py")
    assert spec and spec.loader
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert (EXAMPLES / "candidates.jsonl").read_text() == builder.render(), (
        "examples/candidates.jsonl is stale: run python examples/build_candidates.py"
    )
    policy = ReplayPolicy.from_file(EXAMPLES / "candidates.jsonl")
    tasks = {path.stem for path in (EXAMPLES / "tasks").glob("*.py")}
    assert {row.task for row in policy.rows} == tasks


# ---------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "unknown kind"),
        ("compile:fast", "unknown compile variant"),
        ("replay:", "replay needs a file"),
        ("openai:", "openai needs a model and an endpoint"),
        ("openai:model", "openai needs a model and an endpoint"),
        ("hf:", "hf needs a model directory"),
    ],
)
def test_bad_specs_list_the_forms(spec: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("KERNELFLEET_OPENAI_BASE_URL", raising=False)
    with pytest.raises(UsageError, match=message) as caught:
        make_policy(spec)
    assert "openai:MODEL@BASE_URL" in str(caught.value) or "compile variant" in str(caught.value)


def test_a_subset_of_compile_variants() -> None:
    policy = make_policy("compile:cudagraph, compile-default")
    assert isinstance(policy, CompilePolicy)
    assert policy.variant_names == ("compile-default", "cudagraph")
    assert policy.id.startswith("compile-") and policy.id != CompilePolicy().id
    assert CompilePolicy().id == "compile"
    conv = example("conv_block")
    assert [n for n, _ in policy.variants_for(conv, on_gpu=True)] == ["compile-default", "cudagraph"]


def test_openai_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    policy = make_policy("openai:Qwen/Qwen2.5-Coder@http://127.0.0.1:8000")
    assert policy.name == "openai:Qwen/Qwen2.5-Coder"
    assert policy.id == "openai-Qwen-Qwen2.5-Coder"
    monkeypatch.setenv("KERNELFLEET_OPENAI_BASE_URL", "http://h:1/v1")
    assert make_policy("openai:m").name == "openai:m"
