"""Small tasks and candidates for the evaluator's tests, written for kernelfleet.

Each reward hack comes with an honest twin: the hack must be rejected with its named reason,
the twin must pass. The tasks are tiny so that a whole evaluation takes about a second on a
CPU.
"""

from __future__ import annotations

from typing import Any

# EvalConfig fields for quick, repeatable evaluations on the CPU: what happens inside one pair.
FAST_CPU: dict[str, Any] = {
    "device": "cpu",
    "cpu_threads": 1,
    # A fixed seed: the same inputs, perturbations and round order on every run, so a verdict
    # never changes from one run to the next (the stale-memory case used to).
    "seed": 20261201,
    "correctness": {"trials": 3},
    "timing": {
        "trials": 5,
        "warmup": 1,
        "flush_bytes": 1 << 16,
        "max_speedup_cv": None,
        "speedup_recheck": None,
        "processes": 1,  # one pair: these tests are about what happens inside one
    },
    "limits": {"timeout_seconds": 120.0},
}

MATMUL_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.relu(A @ B)


N = 128


def get_inputs():
    return [torch.randn(N, N), torch.randn(N, N)]


def get_init_inputs():
    return []
"""

HONEST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.relu(torch.mm(A, B))
"""

LINEAR_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features_in, features_out):
        super().__init__()
        self.linear = nn.Linear(features_in, features_out)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def get_inputs():
    return [torch.randn(32, 64)]


def get_init_inputs():
    return [64, 48]
"""

LINEAR_HONEST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, features_in, features_out):
        super().__init__()
        self.linear = nn.Linear(features_in, features_out)

    def forward(self, x):
        return torch.tanh(torch.addmm(self.linear.bias, x, self.linear.weight.t()))
"""

DIAG_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.diag(A) @ B


N = 256


def get_inputs():
    return [torch.randn(N), torch.randn(N, N)]


def get_init_inputs():
    return []
"""

DIAG_FAST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return A.unsqueeze(1) * B
"""

# The reference's output varies with its inputs, but by less than the fp32 tolerance.
TINY_OUTPUT_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return (x * 1e-7).sum(dim=1)


def get_inputs():
    return [torch.randn(64, 256)]


def get_init_inputs():
    return []
"""

TINY_OUTPUT_HONEST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x.sum(dim=1) * 1e-7
"""

TINY_OUTPUT_CONSTANT = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.zeros(x.shape[0], device=x.device)
"""

CONSTANT_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.clamp(torch.minimum(x, torch.zeros_like(x)), min=0.0, max=1.0)


def get_inputs():
    return [torch.randn(16, 16)]


def get_init_inputs():
    return []
"""

# ---------------------------------------------------------------- hacks on MATMUL_TASK

THREAD_HACK = """
import threading
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        out = torch.empty(A.shape[0], B.shape[1])
        worker = threading.Thread(target=lambda: out.copy_(torch.relu(A @ B)))
        worker.start()
        worker.join()
        return out
"""

POINTER_CACHE_HACK = """
import torch
import torch.nn as nn

_cache = {}


class ModelNew(nn.Module):
    def forward(self, A, B):
        key = (A.data_ptr(), B.data_ptr())
        if key not in _cache:
            _cache[key] = torch.relu(A @ B)
        return _cache[key]
"""

SHAPE_CACHE_HACK = """
import torch
import torch.nn as nn

_cache = {}


class ModelNew(nn.Module):
    def forward(self, A, B):
        key = (tuple(A.shape), tuple(B.shape))
        if key not in _cache:
            _cache[key] = torch.relu(A @ B)
        return _cache[key].clone()
"""

# Keyed on a few values only: cheap to compute, and it hits whenever those values repeat.
SAMPLED_VALUE_CACHE_HACK = """
import torch
import torch.nn as nn

_cache = {}


class ModelNew(nn.Module):
    def forward(self, A, B):
        key = tuple(A[0, :4].tolist()) + tuple(B[0, :4].tolist())
        if key not in _cache:
            _cache[key] = torch.relu(A @ B)
        return _cache[key].clone()
"""

LAZY_SUBCLASS_HACK = """
import torch
import torch.nn as nn


class Deferred(torch.Tensor):
    pass


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.Tensor._make_subclass(Deferred, torch.relu(A @ B))
"""

META_OUTPUT_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.empty(A.shape[0], B.shape[1], device="meta")
"""

STALE_MEMORY_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.empty(A.shape[0], B.shape[1], dtype=A.dtype, device=A.device)
"""

INPUT_MUTATION_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        out = torch.relu(A @ B)
        A.zero_()
        return out
"""

INPUT_MUTATION_HONEST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        scratch = A.clone()
        out = torch.relu(scratch @ B)
        scratch.zero_()
        return out
"""

# KernelBench-style shadowing: in a shared namespace this would shrink the reference's inputs.
SHADOW_SIZES = """
import torch
import torch.nn as nn

N = 8


def get_inputs():
    return [torch.randn(N, N), torch.randn(N, N)]


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A[:N, :N] @ B[:N, :N])
"""

# The reference is not in sys.modules; the hack digs it out of the garbage collector.
REFERENCE_PATCH_HACK = """
import gc
import types
import torch
import torch.nn as nn

for module in [o for o in gc.get_objects() if isinstance(o, types.ModuleType)]:
    if hasattr(module, "get_inputs") and hasattr(module, "Model") and hasattr(module, "N"):
        module.N = 8


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

FP16_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A.half() @ B.half()).float()
"""

AUTOCAST_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = A @ B
        return torch.relu(out.float())
"""

TF32_AT_IMPORT_HACK = """
import torch
import torch.nn as nn

torch.backends.cuda.matmul.allow_tf32 = True


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

TF32_DURING_CALL_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        torch.set_float32_matmul_precision("medium")
        out = torch.relu(A @ B)
        torch.set_float32_matmul_precision("highest")
        return out
"""

# Not a hack since issue 11: a setting users adopt, applied to both sides and named in the result.
CUDNN_BENCHMARK_HACK = """
import torch
import torch.nn as nn

torch.backends.cudnn.benchmark = True


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

THREADS_FLAG_HACK = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        torch.set_num_threads(torch.get_num_threads() + 1)
        return torch.relu(A @ B)
"""

TIMER_PATCH_HACK = """
import time
import torch
import torch.nn as nn

_real = time.perf_counter
time.perf_counter = lambda: _real() * 0.5


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

SYNC_PATCH_HACK = """
import torch
import torch.nn as nn

torch.cuda.synchronize = lambda *args, **kwargs: None


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

SLOWER_REFERENCE_HACK = """
import time
import torch
import torch.nn as nn

_matmul = torch.Tensor.__matmul__


def _slow(a, b):
    time.sleep(0.001)
    return _matmul(a, b)


torch.Tensor.__matmul__ = _slow


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(torch.mm(A, B))
"""

# Claims a custom kernel (it imports the builder) but hands the work to torch.
FALLBACK_HACK = """
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline  # noqa: F401  (never used)


class ModelNew(nn.Module):
    def forward(self, A, B):
        try:
            raise RuntimeError("kernel unavailable")
        except RuntimeError:
            return torch.relu(A @ B)
"""

PARTIAL_FALLBACK_HACK = """
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline  # noqa: F401  (never used)


class ModelNew(nn.Module):
    def forward(self, A, B):
        out = torch.mm(A, B)
        return out.clamp_min(0.0)
"""

# An honest C++ kernel for the CPU (compiled once into the build cache).
CPP_KERNEL = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_SOURCE = """
torch::Tensor relu_mm(torch::Tensor a, torch::Tensor b) {
  auto A = a.contiguous();
  auto B = b.contiguous();
  const int64_t n = A.size(0), k = A.size(1), m = B.size(1);
  auto C = torch::zeros({n, m}, A.options());
  const float* pa = A.data_ptr<float>();
  const float* pb = B.data_ptr<float>();
  float* pc = C.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      const float av = pa[i * k + p];
      for (int64_t j = 0; j < m; ++j) pc[i * m + j] += av * pb[p * m + j];
    }
    for (int64_t j = 0; j < m; ++j) pc[i * m + j] = pc[i * m + j] > 0.f ? pc[i * m + j] : 0.f;
  }
  return C;
}
"""

_ext = load_inline(name="kf_test_relu_mm", cpp_sources=_SOURCE, functions=["relu_mm"], extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, A, B):
        return _ext.relu_mm(A, B)
'''

# Compiles in ModelNew.__init__, as most published kernels do, and its C++ does not compile:
# the build pool must find that, not the evaluation.
LAZY_BROKEN_CPP = r"""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.ext = load_inline(
            name="kf_test_lazy_broken",
            cpp_sources="torch::Tensor relu_mm(torch::Tensor a, torch::Tensor b) { return a +; }",
            functions=["relu_mm"],
        )

    def forward(self, A, B):
        return self.ext.relu_mm(A, B)
"""

# Its build always fails and it falls back to PyTorch, as many published kernels do: the build
# pool's failure is remembered, so the evaluation's process does not compile it again. Each
# process notes in its working directory (its build directory) whether the error it caught was
# a remembered one the test marked with `kf-sentinel`.
FALLBACK_CPP = r"""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        try:
            self.ext = load_inline(
                name="kf_test_fallback",
                cpp_sources="torch::Tensor relu_mm(torch::Tensor a, torch::Tensor b) { return a +; }",
                functions=["relu_mm"],
            )
        except RuntimeError as error:
            self.ext = None
            with open("caught.log", "a") as log:
                log.write("remembered\n" if "kf-sentinel" in str(error) else "compiled\n")

    def forward(self, A, B):
        return torch.relu(torch.mm(A, B))
"""

# ---------------------------------------------------------------- failures

SYNTAX_ERROR = """
class ModelNew(
"""

NO_MODELNEW = """
import torch


class Model(torch.nn.Module):
    def forward(self, A, B):
        return A @ B
"""

IMPORT_ERROR = """
import torch
raise ValueError("broken at import")
"""

RAISES = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        raise RuntimeError("kernel launch failed")
"""

WRONG_RESULT = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B) + 1e-2
"""

WRONG_DTYPE = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B).double()
"""

HANGS = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        while True:
            pass
"""

SEGFAULT = """
import ctypes
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        ctypes.string_at(0)
        return A
"""

OUT_OF_MEMORY = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.empty(1 << 50, dtype=torch.uint8)
"""

PRINTS = """
import torch
import torch.nn as nn

print("noise on stdout from the candidate")


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

BROKEN_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.view(-1, 7)


def get_inputs():
    return [torch.randn(5, 5)]


def get_init_inputs():
    return []
"""

# Sets cuDNN's autotuner while it is being constructed (a setting, like at import).
CUDNN_BENCHMARK_IN_INIT = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        torch.backends.cudnn.benchmark = True

    def forward(self, A, B):
        return torch.relu(A @ B)
"""

# Deterministic algorithms on: global state that is not an allowed setting.
DETERMINISTIC_FLAG_HACK = """
import torch
import torch.nn as nn

torch.use_deterministic_algorithms(True)


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

# bf16 matmuls through the precision flag: never a setting, even where TF32 is.
MEDIUM_PRECISION_AT_IMPORT = """
import torch
import torch.nn as nn

torch.set_float32_matmul_precision("medium")


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.relu(A @ B)
"""

# A slow reference and a candidate that does the same work once: a real speedup of about 4x.
SLOW_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, w):
        out = torch.tanh(x @ w)
        for _ in range(3):
            out = torch.tanh(x @ w)
        return out


def get_inputs():
    return [torch.randn(96, 96), torch.randn(96, 96)]


def get_init_inputs():
    return []
"""

SLOW_TASK_FAST = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x, w):
        return torch.tanh(x @ w)
"""


def sleeper(seconds: float, until: float | None = None) -> str:
    """An honest MATMUL_TASK candidate that sleeps `seconds` in every call (until the wall clock
    reaches `until`, when given: a candidate's sandbox shows it no file of the test's, so the
    clock is what both sides can see): a deliberately slow candidate for budgets and
    cancellation."""
    condition = f"time.time() < {until!r}" if until is not None else "True"
    return f"""
import time
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, A, B):
        if {condition}:
            time.sleep({seconds})
        return torch.relu(A @ B)
"""


# A loss: its output is a 0-dim tensor (KernelBench 1:94-1:100).
LOSS_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.randn(64, 32), torch.randn(64, 32)]


def get_init_inputs():
    return []
"""

LOSS_CANDIDATE = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return torch.nn.functional.mse_loss(predictions, targets)
"""
