"""The evaluator's CUDA-only defences, on a real GPU: side streams, load_inline kernels (honest,
stale memory, an illegal access), Triton, the L2 flush, CUDA-graph baselines, a batch over the
GPUs. One load_inline extension holds every CUDA function the checks need, so the whole file
pays for a single nvcc build (cached by source hash for reruns).

Run on the GPU machine: `python -m pytest -m gpu tests/gpu/test_gpu_evaluator.py`.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kernelfleet.core.settings import merged

torch = pytest.importorskip("torch")

from kernelfleet.core.models import EvaluationResult, Task, Verdict  # noqa: E402
from kernelfleet.evaluator import EvalConfig, Evaluator  # noqa: E402
from kernelfleet.evaluator import reasons as R  # noqa: E402
from tests.support import evaluator_cases as C  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = {
    "device": "cuda:0",
    "correctness": {"trials": 3},
    "timing": {
        "trials": 20,
        "warmup": 3,
        "max_speedup_cv": None,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
    },
    "limits": {"timeout_seconds": 300.0, "compile_timeout_s": 600.0},
}

BIG_MATMUL_TASK = C.MATMUL_TASK.replace("N = 128", "N = 2048")

ELEMENTWISE_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return x * 2.0 + y


def get_inputs():
    return [torch.randn(4096, 1024), torch.randn(4096, 1024)]


def get_init_inputs():
    return []
"""

# One extension, three entry points: an honest kernel, a "kernel" that never writes its
# output (stale memory), and one that writes through a null pointer.
CUDA_EXTENSION = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = """
__global__ void scale_add_kernel(const float* x, const float* y, float* out, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) out[i] = 2.0f * x[i] + y[i];
}
// A write far outside any allocation. Through a runtime offset, so that the compiler cannot
// prove the access undefined and drop it (a literal null store may be removed as UB).
__global__ void wild_write_kernel(float* out, long long offset) { out[offset + threadIdx.x] = 1.0f; }

torch::Tensor scale_add(torch::Tensor x, torch::Tensor y) {
  auto out = torch::empty_like(x);
  long n = x.numel();
  scale_add_kernel<<<(n + 255) / 256, 256>>>(
      x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), n);
  return out;
}
torch::Tensor stale(torch::Tensor x, torch::Tensor y) { return torch::empty_like(x); }
torch::Tensor null_write(torch::Tensor x, torch::Tensor y) {
  auto out = torch::empty_like(x);
  wild_write_kernel<<<1, 32>>>(out.data_ptr<float>(), 1LL << 40);
  return out;
}
"""
_CPP = """
torch::Tensor scale_add(torch::Tensor x, torch::Tensor y);
torch::Tensor stale(torch::Tensor x, torch::Tensor y);
torch::Tensor null_write(torch::Tensor x, torch::Tensor y);
"""
_ext = load_inline(name="kf_gpu_checks", cpp_sources=_CPP, cuda_sources=_CUDA,
                   functions=["scale_add", "stale", "null_write"])


class ModelNew(nn.Module):
    def forward(self, x, y):
        return _ext.ENTRY(x.contiguous(), y.contiguous())
'''

TRITON_KERNEL = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, 2.0 * x + y, mask=mask)


class ModelNew(nn.Module):
    def forward(self, x, y):
        x, y = x.contiguous(), y.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        scale_add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
        return out
"""

TRITON_NEVER_LAUNCHED = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_add_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


class ModelNew(nn.Module):
    def forward(self, x, y):
        return x * 2.0 + y
"""

SIDE_STREAM_HACK = """
import torch
import torch.nn as nn

_stream = None


class ModelNew(nn.Module):
    def forward(self, A, B):
        global _stream
        if _stream is None:
            _stream = torch.cuda.Stream()
        out = torch.empty(A.shape[0], B.shape[1], device=A.device)
        _stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(_stream):
            torch.mm(A, B, out=out)
            out.relu_()
        return out
"""

SIDE_STREAM_HONEST = SIDE_STREAM_HACK.replace(
    "        return out\n", "        torch.cuda.current_stream().wait_stream(_stream)\n        return out\n"
)

TF32_DURING_CALL = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        torch.backends.cuda.matmul.allow_tf32 = True
        out = torch.relu(A @ B)
        torch.backends.cuda.matmul.allow_tf32 = False
        return out
"""

# Finds the harness's clock in its caller's frames while timed and rebinds the instance's measure
# so that its answers lose the caller's-stream figure and the spill: the figures the side-stream
# check compares. The harness's own classes stay untouched, so identity checks see nothing.
STREAM_FIGURES_DROPPED = """
import sys
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        frame = sys._getframe(1)
        while frame is not None:
            clock = getattr(frame.f_locals.get("self"), "clock", None)
            if clock is not None and "measure" not in vars(clock):
                real = clock.measure

                def measure(call, _real=real):
                    sample, _, _, out = _real(call)
                    return sample, None, None, out

                clock.measure = measure
                break
            frame = frame.f_back
        return torch.relu(A @ B)
"""

CUDA_OOM = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x, y):
        return torch.empty(1 << 46, dtype=torch.uint8, device=x.device)
"""


def judge(task_code: str, candidate: str, **overrides: Any) -> EvaluationResult:
    with Evaluator(EvalConfig.model_validate(merged(GPU, overrides))) as evaluator:
        return evaluator.evaluate(Task(name="gpu", code=task_code), candidate)


def extension(entry: str) -> str:
    return CUDA_EXTENSION.replace("ENTRY", entry)


def test_side_stream_work_is_rejected_and_its_honest_twin_passes() -> None:
    hack = judge(BIG_MATMUL_TASK, SIDE_STREAM_HACK)
    assert hack.verdict == Verdict.REJECTED, hack.reasons
    assert R.SIDE_STREAM in R.codes(hack.reasons)
    honest = judge(BIG_MATMUL_TASK, SIDE_STREAM_HONEST)
    assert honest.verdict == Verdict.CORRECT, honest.reasons
    assert honest.speedup is not None


def test_a_gpu_timing_without_its_stream_figures_is_rejected() -> None:
    """Without the caller's-stream figure and the spill the side-stream check has nothing to
    compare: a candidate's process that answers a GPU timing without them is broken."""
    result = judge(C.MATMUL_TASK, STREAM_FIGURES_DROPPED)
    assert result.verdict == Verdict.REJECTED, result.reasons
    assert R.codes(result.reasons) & {R.HARNESS_BROKEN, R.HARNESS_PATCHED}, result.reasons


def test_load_inline_kernel_honest_stale_and_illegal_access() -> None:
    task = Task(name="elementwise", code=ELEMENTWISE_TASK)
    with Evaluator(
        EvalConfig.model_validate(merged({"correctness": {"require_kernel": True}}, GPU))
    ) as evaluator:
        honest, stale, crash, after = evaluator.evaluate_batch(
            [
                (task, extension("scale_add")),
                (task, extension("stale")),
                (task, extension("null_write")),
                (task, C.HONEST.replace("torch.relu(torch.mm(A, B))", "x * 2.0 + y").replace("A, B", "x, y")),
            ],
            progress=False,
        )
    assert honest.verdict == Verdict.CORRECT, (honest.reasons, honest.log)
    assert stale.verdict == Verdict.REJECTED and R.STALE_MEMORY in R.codes(stale.reasons), stale.reasons
    assert crash.verdict == Verdict.RUNTIME_ERROR, crash.reasons
    # The poisoned CUDA context died with its process: the next candidate is judged normally
    # (and, being plain torch under require_kernel, rejected for that reason alone).
    assert after.verdict == Verdict.REJECTED and R.codes(after.reasons) & {R.NO_CUSTOM_KERNEL}


def test_triton_kernel_passes_and_one_never_launched_is_caught() -> None:
    honest = judge(ELEMENTWISE_TASK, TRITON_KERNEL, correctness={"require_kernel": True})
    assert honest.verdict == Verdict.CORRECT, (honest.reasons, honest.log)
    idle = judge(ELEMENTWISE_TASK, TRITON_NEVER_LAUNCHED, correctness={"require_kernel": True})
    assert idle.verdict == Verdict.REJECTED, idle.reasons
    assert R.codes(idle.reasons) & {R.CUSTOM_KERNEL_NOT_RUN, R.REFERENCE_FALLBACK, R.TORCH_FALLBACK}


def test_tf32_for_the_duration_of_a_call_is_a_precision_downgrade() -> None:
    result = judge(C.MATMUL_TASK, TF32_DURING_CALL)
    assert result.verdict == Verdict.REJECTED
    assert R.PRECISION_DOWNGRADE in R.codes(result.reasons)


def test_cuda_out_of_memory_is_a_clear_verdict() -> None:
    result = judge(ELEMENTWISE_TASK, CUDA_OOM)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert R.OUT_OF_MEMORY in R.codes(result.reasons)


def test_the_l2_flush_is_larger_than_the_cache_and_runs_before_every_call() -> None:
    from kernelfleet.evaluator._timing import InputBank, Subject, run_timing

    config = EvalConfig.model_validate(GPU)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert config.timing.resolved_flush_bytes(on_cuda=True) >= 4 * l2
    device = torch.device("cuda:0")
    bank = InputBank([[torch.randn(1024, device=device)]])
    flushes: list[int] = []
    subjects = [
        Subject(label, lambda b: b[0] * 2, [torch.empty(1024, device=device)]) for label in ("a", "b")
    ]
    run = run_timing(
        subjects,
        bank,
        device=device,
        warmup=1,
        trials=10,
        flush_bytes=config.timing.resolved_flush_bytes(on_cuda=True),
        rng=random.Random(0),
        on_flush=lambda: flushes.append(1),
    )
    assert len(flushes) == 2 * 11
    assert len(run.samples["a"]) == 10 and len(run.naive["a"]) == 10


def test_baselines_on_the_gpu() -> None:
    with Evaluator(EvalConfig.model_validate(merged({"timing": {"baseline_trials": 10}}, GPU))) as evaluator:
        timings, missing = evaluator.baselines_detail(Task(name="elementwise", code=ELEMENTWISE_TASK))
    assert {"eager", "cudagraph"} <= set(timings), missing
    assert set(timings) | set(missing) == {"eager", "compile", "compile-reduce-overhead", "cudagraph"}
    assert all(t.median_ms > 0 for t in timings.values())


def test_a_batch_over_all_gpus() -> None:
    task = Task(name="matmul", code=C.MATMUL_TASK)
    items = [(task, C.HONEST + f"\n# variant {i}\n") for i in range(2 * torch.cuda.device_count())]
    with Evaluator(EvalConfig.model_validate({**GPU, "device": "cuda"})) as evaluator:
        results = evaluator.evaluate_batch(items, progress=False)
    assert all(r.verdict == Verdict.CORRECT for r in results), [r.reasons for r in results]
    assert all(r.environment.gpu_class not in ("cpu", "") for r in results)


def test_device_tensors_cross_the_exchange_files_bit_for_bit(tmp_path: Any) -> None:
    """Exchange files from and to the GPU go through pinned host memory: the same bytes come back,
    for a non-contiguous view, a 0-dim loss, bfloat16 and an empty tensor, twice in a row (the
    second through blocks the caching host allocator hands back)."""
    from kernelfleet.evaluator._wire import read_tree, write_tree

    base = torch.randn(64, 48, device="cuda:0")
    value = [base.t(), base.sum(), base.to(torch.bfloat16), torch.empty(0, 3, device="cuda:0")]
    for round_ in range(2):
        path = tmp_path / f"tensors-{round_}"
        write_tree(str(path), value)
        back, devices = read_tree(str(path), 1 << 24, device=torch.device("cuda:0"))
        assert devices == ["cuda"] * 4
        for sent, got in zip(value, back, strict=True):
            assert got.device.type == "cuda" and got.dtype == sent.dtype and got.shape == sent.shape
            assert torch.equal(got, sent)


def test_the_judge_draws_inputs_on_the_gpu(tmp_path: Any) -> None:
    from kernelfleet.evaluator import _child

    config = EvalConfig(device="cuda:0")
    job = _child.Job(
        mode="evaluate", config=config, reference=ELEMENTWISE_TASK, work_dir=str(tmp_path), seed=1
    )
    session = _child.Session(job)
    session.setup_torch()
    session.load_reference()
    assert session.inputs_device == torch.device("cuda:0")
    assert [t.device.type for t in session.made_inputs(7)] == ["cuda", "cuda"]


# An honest candidate, slow in each call, that starts a process of its own launching kernels
# on the GPU without end: the hold must stop it during every neighbour's timed batch.
GPU_NEIGHBOUR = (
    C.sleeper(0.3)
    + """
import subprocess
import sys

SPIN = "import torch\\nx = torch.ones(1 << 20, device='cuda')\\nwhile True:\\n    x.mul_(1.0)\\n"
_spinner = subprocess.Popen([sys.executable, "-c", SPIN])
"""
)


def test_a_candidates_gpu_process_is_stopped_while_a_neighbour_times(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.held import observe_holds

    seen = observe_holds(monkeypatch)
    config = EvalConfig.model_validate(merged({"lane_slots": 3, "timing": {"exclusive": True}}, GPU))
    task = Task(name="matmul", code=C.MATMUL_TASK)
    candidates = [GPU_NEIGHBOUR, C.HONEST + "\n# 1\n", C.HONEST + "\n# 2\n"]
    with Evaluator(config) as evaluator:
        results = evaluator.evaluate_batch([(task, code) for code in candidates], progress=False)
    assert [r.verdict for r in results[1:]] == [Verdict.CORRECT] * 2, [r.reasons for r in results]
    assert any(stopped >= 2 for stopped, _ in seen), f"no timed batch held the spinning candidate: {seen}"
    assert {letter for _, letter in seen} == {"T"}, seen
