"""Which torch operators a call dispatches, in which dtypes, under which flags.

One traced call of the reference and one of the candidate run under a `TorchDispatchMode`. It
sees every aten operator, including those that C++ extensions call through the dispatcher, so
it reveals an fp32 task computed in fp16 or bf16 (by hand or by autocast), TF32 or a lower
matmul precision switched on only for the duration of the call, and, when a custom kernel is
demanded, a candidate that still hands the reference's heavy operators to torch. Custom CUDA
and Triton kernels are invisible to it by design; on CUDA a profiler run proves they launch.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernelfleet.evaluator._guards import FLAG_GETTERS

# Allocation, view and copy operators: no arithmetic, never evidence of a fallback.
TRIVIAL_OPS = frozenset(
    f"aten.{name}"
    for name in [
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "fill",
        "fill_",
        "zero_",
        "view",
        "_unsafe_view",
        "view_as",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "as_strided_",
        "expand",
        "expand_as",
        "permute",
        "t",
        "t_",
        "transpose",
        "transpose_",
        "unsqueeze",
        "unsqueeze_",
        "squeeze",
        "squeeze_",
        "contiguous",
        "clone",
        "copy",
        "copy_",
        "_copy_from",
        "_copy_from_and_resize",
        "_to_copy",
        "to",
        "detach",
        "detach_",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "flatten",
        "unflatten",
        "resize_",
        "set_",
        "_local_scalar_dense",
        "item",
        "is_same_size",
        "arange",
        "scalar_tensor",
        "record_stream",
        "_assert_tensor_metadata",
        "movedim",
        "view_as_real",
        "view_as_complex",
        "_pin_memory",
        "is_pinned",
        "result_type",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "_unsafe_view_copy",
        "diagonal",
        "unfold",
    ]
)
# Operators that carry a task's arithmetic intensity.
_HEAVY = re.compile(
    r"^aten\.(mm|bmm|addmm|addmv|mv|baddbmm|addbmm|matmul|dot|vdot|linear|einsum|_scaled_mm|"
    r"convolution|_convolution|conv\w*|cudnn_conv\w*|mkldnn_conv\w*|miopen_conv\w*|_conv_depthwise2d|"
    r"slow_conv\w*|thnn_conv\w*|_scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*|"
    r"lstm|gru|rnn_tanh|rnn_relu|_cudnn_rnn|mkldnn_rnn_layer|_thnn_fused_\w+)$"
)
_LOW_FLOAT = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
# Global flags read at every traced operator: those that change numerics or kernel choice.
_PER_OP_FLAGS = {
    "cuda.matmul.allow_tf32",
    "cuda.matmul.fp32_precision",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cudnn.allow_tf32",
    "cudnn.conv.fp32_precision",
    "cudnn.benchmark",
    "cudnn.deterministic",
    "fp32_precision",
    "float32_matmul_precision",
    "default_dtype",
}
_OP_FLAG_GETTERS: list[tuple[str, Callable[[], object]]] = [
    (n, g) for n, g in FLAG_GETTERS if n in _PER_OP_FLAGS
]


def is_heavy(op: str) -> bool:
    return bool(_HEAVY.match(op))


class OpTrace(TorchDispatchMode):
    """Records operator names, floating dtypes, and per-operator deviations of global flags."""

    def __init__(self, baseline_flags: dict[str, object]) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.dtype_ops: dict[str, set[str]] = {}
        self.flag_changes: dict[str, tuple[object, str]] = {}
        self._baseline = {name: baseline_flags.get(name) for name, _ in _OP_FLAG_GETTERS}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        self.ops[name] += 1
        leaves, _ = tree_flatten((args, kwargs, out))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                self.dtype_ops.setdefault(str(leaf.dtype).removeprefix("torch."), set()).add(name)
        for flag, getter in _OP_FLAG_GETTERS:
            value = getter()
            if value != self._baseline[flag] and flag not in self.flag_changes:
                self.flag_changes[flag] = (value, name)
        return out

    @property
    def compute_ops(self) -> set[str]:
        return {op for op in self.ops if op not in TRIVIAL_OPS}

    def low_precision(self) -> dict[str, set[str]]:
        return {dtype: ops for dtype, ops in self.dtype_ops.items() if dtype in _LOW_FLOAT}


def fallback_ops(reference: OpTrace, candidate: OpTrace) -> tuple[set[str], bool]:
    """The reference's heavy operators (all of its compute operators when it has no heavy one)
    that the candidate dispatches too, and whether the candidate dispatches every compute
    operator of the reference (it is the reference again)."""
    return fallback_sets(reference.compute_ops, candidate.compute_ops)


def fallback_sets(ref_compute: set[str], cand_compute: set[str]) -> tuple[set[str], bool]:
    """`fallback_ops` on the compute operators of each side (as the two processes report them)."""
    heavy = {op for op in ref_compute if is_heavy(op)} or ref_compute
    overlap = heavy & cand_compute
    whole = bool(ref_compute) and ref_compute <= cand_compute
    return overlap, whole


_CUDA_KERNEL = re.compile(r"__global__\s+(?:\w+\s+)*?(\w+)\s*\(")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^)]*\)")
_BUILDS = re.compile(
    r"\bload_inline\b|\bcpp_extension\b|\btriton\.jit\b|@triton\.|from\s+triton\b|import\s+triton\b"
)


def declared_kernels(source: str) -> set[str]:
    """Names of `__global__` functions and Triton-jitted functions in the candidate's source."""
    names = set(_CUDA_KERNEL.findall(_LAUNCH_BOUNDS.sub(" ", source)))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            names.add(node.name)
    return names


def builds_custom_kernel(source: str) -> bool:
    """Whether the source builds a C++/CUDA extension or defines a Triton kernel."""
    return bool(_BUILDS.search(source))


def needs_native_build(source: str) -> bool:
    """C++/CUDA extensions compile at import: such candidates go through the build pool."""
    return "load_inline" in source or "cpp_extension" in source


_COMPILES = re.compile(
    r"\b\w*torch\.compile\b|\btorch\._dynamo\b|\btorch\._inductor\b|from\s+torch\s+import\s+[^\n]*\bcompile\b"
)


def uses_torch_compile(source: str) -> bool:
    """Whether the source calls torch.compile (or Dynamo or inductor directly): such candidates
    compile once in the build pool, into a cache their evaluation's processes restore (see
    `_compiled`). A candidate that hides the call only compiles in each of its processes."""
    return bool(_COMPILES.search(source))
