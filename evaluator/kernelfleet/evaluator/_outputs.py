"""Checking what a call returned: plain, materialised tensors, compared by dtype tolerance.

Outputs are flattened (tensors, tuples, lists, dicts of them, plain numbers) and compared leaf
by leaf. Freed memory is poisoned with a NaN bit pattern that no arithmetic produces, so a
candidate whose output is memory it never wrote (the reference's freed result, reused by the
allocator) is named as such instead of passing or failing by luck.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from kernelfleet.core import reasons as R
from kernelfleet.evaluator._config import Profile
from kernelfleet.evaluator._guards import allclose, tensor_equal

POISON32 = 0x7FA5A5A5  # an fp32 NaN with a payload that arithmetic never yields
POISON16 = 0x7FA5  # a NaN in both fp16 and bf16
_FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def leaves(value: Any) -> list[Any]:
    flat, _ = tree_flatten(value)
    return flat


def clone_tree(value: Any) -> Any:
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


def to_device(value: Any, device: torch.device) -> Any:
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def to_float64(value: Any) -> Any:
    return tree_map(
        lambda v: v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v, value
    )


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def specs(value: Any) -> list[OutputSpec]:
    return [
        OutputSpec(tuple(t.shape), t.dtype, t.numel() * t.element_size())
        for t in leaves(value)
        if isinstance(t, torch.Tensor)
    ]


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (an input set, an output)."""
    return sum(t.numel() * t.element_size() for t in leaves(value) if isinstance(t, torch.Tensor))


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return int((t.storage_offset() + last + 1) * t.element_size())


def check_materialised(value: Any, device: torch.device) -> list[str]:
    """Reasons why the output is not plain, dense, materialised tensors on `device`."""
    problems: list[str] = []
    for index, leaf in enumerate(leaves(value)):
        where = f"output {index}"
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                problems.append(
                    R.reason(
                        R.LAZY_OUTPUT, f"{where} is a {type(leaf).__qualname__}, not a plain torch.Tensor"
                    )
                )
                continue
            if leaf.device.type == "meta" or leaf.is_meta:
                problems.append(R.reason(R.LAZY_OUTPUT, f"{where} is a meta tensor with no data"))
                continue
            if leaf.layout != torch.strided:
                problems.append(
                    R.reason(R.LAZY_OUTPUT, f"{where} has layout {leaf.layout}, not dense strided")
                )
                continue
            if leaf.numel() > 0:
                storage = leaf.untyped_storage()
                if storage.nbytes() < _span_bytes(leaf) or leaf.data_ptr() == 0:
                    problems.append(
                        R.reason(R.LAZY_OUTPUT, f"{where} has {storage.nbytes()} bytes of storage behind it")
                    )
                    continue
            if leaf.device != device:
                problems.append(R.reason(R.WRONG_DEVICE, f"{where} is on {leaf.device}, expected {device}"))
        elif not isinstance(leaf, int | float | bool | complex | str | type(None)):
            problems.append(
                R.reason(R.LAZY_OUTPUT, f"{where} is a {type(leaf).__qualname__}, not a tensor or number")
            )
    return problems


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    if t.dtype in (torch.bool, torch.uint8, torch.int8) or t.is_complex() or t.numel() == 0:
        return None
    if size in (4, 8):
        return t.view(torch.int32)
    if size == 2:
        return t.view(torch.int16)
    return None


def has_poison(value: Any) -> bool:
    for leaf in leaves(value):
        if isinstance(leaf, torch.Tensor) and type(leaf) is torch.Tensor and leaf.device.type != "meta":
            bits = _bits(leaf)
            if bits is None:
                continue
            pattern = POISON32 if bits.dtype == torch.int32 else POISON16
            if bool((bits == pattern).any()):
                return True
    return False


def poison_(value: Any) -> None:
    """Overwrite tensors in place with the poison pattern before they are freed."""
    for leaf in leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_contiguous() and leaf.numel() > 0:
            bits = _bits(leaf)
            if bits is not None and bits.data_ptr() == leaf.data_ptr():
                with torch.no_grad():
                    bits.fill_(POISON32 if bits.dtype == torch.int32 else POISON16)


def poison_free_memory(output_specs: list[OutputSpec], device: torch.device) -> None:
    """Hand the allocator blocks of the outputs' sizes filled with poison, so that a candidate
    returning memory it never wrote returns poison."""
    for spec in output_specs:
        if spec.nbytes >= 4:
            block = torch.empty(spec.nbytes // 4, dtype=torch.int32, device=device)
            block.fill_(POISON32)
            del block


@dataclass
class Comparison:
    ok: bool
    max_abs_error: float | None
    reasons: list[str]


def _is_lower_precision(candidate: torch.dtype, reference: torch.dtype) -> bool:
    c = _FLOAT_RANK.get(str(candidate).removeprefix("torch."))
    r = _FLOAT_RANK.get(str(reference).removeprefix("torch."))
    return c is not None and r is not None and c < r


def compare(
    candidate: Any,
    reference: Any,
    profile: Profile,
    expected_dtypes: list[torch.dtype] | None = None,
    measure_error: bool = True,
) -> Comparison:
    """Leaf-by-leaf comparison; `expected_dtypes` are the fp32 reference's dtypes when the
    values come from an fp64 run."""
    c_leaves, r_leaves = leaves(candidate), leaves(reference)
    if len(c_leaves) != len(r_leaves):
        return Comparison(
            False,
            None,
            [R.reason(R.OUTPUT_STRUCTURE, f"returned {len(c_leaves)} values, the reference {len(r_leaves)}")],
        )
    worst = 0.0
    reasons: list[str] = []
    tensor_index = 0
    for index, (c, r) in enumerate(zip(c_leaves, r_leaves, strict=True)):
        where = f"output {index}"
        if isinstance(r, torch.Tensor):
            if not isinstance(c, torch.Tensor):
                reasons.append(
                    R.reason(R.OUTPUT_STRUCTURE, f"{where} is a {type(c).__name__}, expected a tensor")
                )
                continue
            want = expected_dtypes[tensor_index] if expected_dtypes else r.dtype
            tensor_index += 1
            if tuple(c.shape) != tuple(r.shape):
                reasons.append(
                    R.reason(
                        R.SHAPE_MISMATCH, f"{where} has shape {tuple(c.shape)}, expected {tuple(r.shape)}"
                    )
                )
                continue
            if c.dtype != want:
                code = R.PRECISION_DOWNGRADE if _is_lower_precision(c.dtype, want) else R.DTYPE_MISMATCH
                reasons.append(R.reason(code, f"{where} is {c.dtype}, expected {want}"))
                continue
            if c.device != r.device:
                reasons.append(R.reason(R.WRONG_DEVICE, f"{where} is on {c.device}, expected {r.device}"))
                continue
            dtype_name = str(want).removeprefix("torch.")
            tolerance = profile.tolerance(dtype_name)
            c_cmp = c.to(r.dtype) if c.dtype != r.dtype else c
            if tolerance is None:
                ok = bool(tensor_equal(c_cmp, r))
                error = 0.0 if ok else float("inf")
            else:
                atol, rtol = tolerance
                ok = bool(allclose(c_cmp, r, atol=atol, rtol=rtol, equal_nan=True))
                error = _max_abs_error(c_cmp, r) if measure_error or not ok else 0.0
            worst = max(worst, error)
            if not ok:
                reasons.append(
                    R.reason(
                        R.OUTPUT_MISMATCH,
                        f"{where} differs from the reference (max abs error {error:.3g}"
                        + (
                            f", tolerance atol={tolerance[0]:g} rtol={tolerance[1]:g})"
                            if tolerance
                            else ", exact)"
                        ),
                    )
                )
        else:
            if isinstance(r, float) or isinstance(c, float):
                try:
                    close = math.isclose(float(c), float(r), rel_tol=1e-4, abs_tol=1e-4)
                except (TypeError, ValueError):
                    close = False
            else:
                close = c == r
            if not close:
                reasons.append(R.reason(R.OUTPUT_MISMATCH, f"{where} is {c!r}, expected {r!r}"))
    return Comparison(not reasons, worst, reasons)


def _max_abs_error(c: torch.Tensor, r: torch.Tensor) -> float:
    if c.numel() == 0:
        return 0.0
    if not (c.is_floating_point() or c.is_complex()):
        return float((c.double() - r.double()).abs().max())
    if bool((torch.isfinite(c) != torch.isfinite(r)).any()):
        return float("inf")
    diff = (c - r).abs()
    # Matching infinities and NaNs give NaN differences: they are equal, not errors.
    diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0)
    return float(diff.max())


def identical(a: Any, b: Any) -> bool:
    """Bitwise-equal outputs (the constant-output check)."""
    a_leaves, b_leaves = leaves(a), leaves(b)
    if len(a_leaves) != len(b_leaves):
        return False
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not bool(tensor_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def inputs_equal(a: Any, b: Any) -> list[int]:
    """Indices of tensor inputs whose contents differ (NaNs in the same places count as equal)."""
    changed = []
    for index, (x, y) in enumerate(zip(leaves(a), leaves(b), strict=True)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                changed.append(index)
            elif x.is_floating_point() or x.is_complex():
                # Bitwise equal is the common case and a plain comparison; only inputs that differ
                # somewhere (or hold NaNs, which never equal themselves) take the NaN-aware check.
                same = bool(tensor_equal(x, y))
                if not same and not bool(allclose(x, y, rtol=0.0, atol=0.0, equal_nan=True)):
                    changed.append(index)
            elif not bool(tensor_equal(x, y)):
                changed.append(index)
    return changed
