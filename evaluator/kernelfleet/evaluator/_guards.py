"""Tripwires in the evaluation child: global torch flags, harness functions, threads, and the
reference module's globals.

A candidate runs in the same process as the measurement, so everything it could change to win
unfairly is snapshotted before its import and compared after its import and after its calls:
the torch flags that decide numerics and speed (TF32, cuDNN benchmark, matmul precision,
default dtype, autocast, thread counts), the identity of every callable in the namespaces the
harness and the reference rely on (`time`, `torch`, `torch.Tensor`, `torch.nn.functional`,
`torch.cuda`, ...), the threads alive, and the reference module's globals (problem sizes). This
module is imported in the forkserver before any candidate exists, so the references it keeps
are the originals.
"""

from __future__ import annotations

import _thread
import contextlib
import inspect
import os
import sys
import sysconfig
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional

# The harness's own references, taken before any candidate code runs.
perf_counter = time.perf_counter
cuda_synchronize = torch.cuda.synchronize
CudaEvent = torch.cuda.Event
allclose = torch.allclose
tensor_equal = torch.equal
_seed_cpu = torch.default_generator.manual_seed
_seed_cuda_all = torch.cuda.manual_seed_all
_cuda_initialized = torch.cuda.is_initialized
_thread_start = threading.Thread.start
_start_new_thread = _thread.start_new_thread


def manual_seed(seed: int) -> None:
    """`torch.manual_seed` for the generators an evaluation uses: the CPU's and CUDA's.

    `torch.manual_seed` also records a lazy seeding call for each backend not initialised (XPU,
    MTIA, and CUDA before its first use), each with a formatted stack trace of the caller: a
    fraction of a millisecond to more than one, on every timed round of both sides, while the
    GPU waits. CUDA is seeded once it is up: an evaluation on a GPU moves the model there
    before any seeded call."""
    _seed_cpu(seed)
    if _cuda_initialized():
        _seed_cuda_all(seed)


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_STDLIB_DIR = str(Path(sysconfig.get_paths()["stdlib"]).resolve())
_TRUSTED_PACKAGES = ("torch", "triton", "tqdm", "numpy", "sympy", "filelock", "jinja2", "functorch")


def _site_package_dirs() -> list[str]:
    parent = Path(_TORCH_DIR).parent
    return [str(parent / name) for name in _TRUSTED_PACKAGES]


_TRUSTED_DIRS = [_STDLIB_DIR, *_site_package_dirs()]


# ---------------------------------------------------------------- torch flags


def _flag_getters() -> list[tuple[str, Callable[[], object]]]:
    b = torch.backends
    getters: list[tuple[str, Callable[[], object]]] = [
        ("cuda.matmul.allow_tf32", lambda: b.cuda.matmul.allow_tf32),
        ("cuda.matmul.fp32_precision", lambda: b.cuda.matmul.fp32_precision),
        (
            "cuda.matmul.allow_fp16_reduced_precision_reduction",
            lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        ),
        (
            "cuda.matmul.allow_bf16_reduced_precision_reduction",
            lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        ),
        ("cudnn.enabled", lambda: b.cudnn.enabled),
        ("cudnn.allow_tf32", lambda: b.cudnn.allow_tf32),
        ("cudnn.benchmark", lambda: b.cudnn.benchmark),
        ("cudnn.deterministic", lambda: b.cudnn.deterministic),
        ("cudnn.conv.fp32_precision", lambda: b.cudnn.conv.fp32_precision),  # type: ignore[attr-defined]
        ("cudnn.rnn.fp32_precision", lambda: b.cudnn.rnn.fp32_precision),  # type: ignore[attr-defined]
        ("mkldnn.enabled", lambda: b.mkldnn.enabled),
        ("fp32_precision", lambda: b.fp32_precision),  # type: ignore[attr-defined]
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("default_dtype", torch.get_default_dtype),
        ("deterministic_algorithms", torch.are_deterministic_algorithms_enabled),
        ("grad_enabled", torch.is_grad_enabled),
        ("autocast.cpu", lambda: torch.is_autocast_enabled("cpu")),
        ("autocast.cuda", lambda: torch.is_autocast_enabled("cuda")),
        ("num_threads", torch.get_num_threads),
        ("sdp.flash", b.cuda.flash_sdp_enabled),
        ("sdp.mem_efficient", b.cuda.mem_efficient_sdp_enabled),
        ("sdp.math", b.cuda.math_sdp_enabled),
        ("sdp.cudnn", b.cuda.cudnn_sdp_enabled),
        (
            "cpu.allow_fp16_reduced_precision_reduction",
            lambda: torch._C._get_cpu_allow_fp16_reduced_precision_reduction(),  # type: ignore[attr-defined]
        ),
    ]
    usable = []
    for name, getter in getters:
        try:
            getter()
        except Exception:  # a flag this torch build does not have
            continue
        usable.append((name, getter))
    return usable


FLAG_GETTERS = _flag_getters()
# Flags whose change lowers precision: named as a precision downgrade rather than a flag change.
PRECISION_FLAGS = frozenset(
    {
        "cuda.matmul.allow_tf32",
        "cuda.matmul.fp32_precision",
        "cuda.matmul.allow_fp16_reduced_precision_reduction",
        "cuda.matmul.allow_bf16_reduced_precision_reduction",
        "cudnn.allow_tf32",
        "cudnn.conv.fp32_precision",
        "cudnn.rnn.fp32_precision",
        "fp32_precision",
        "float32_matmul_precision",
        "default_dtype",
        "autocast.cpu",
        "autocast.cuda",
        "cpu.allow_fp16_reduced_precision_reduction",
    }
)


def snapshot_flags() -> dict[str, object]:
    values: dict[str, object] = {}
    for name, getter in FLAG_GETTERS:
        try:
            values[name] = getter()
        except Exception as error:  # a patched getter: record it, the identity check names it
            values[name] = f"<unreadable: {type(error).__name__}>"
    return values


def diff_flags(before: dict[str, object], after: dict[str, object]) -> list[tuple[str, object, object]]:
    return [(name, before[name], after.get(name)) for name in before if after.get(name) != before[name]]


def apply_strict_fp32() -> None:
    """True fp32 for reference and candidate alike: no TF32 in cuBLAS or cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def restore_flags(values: dict[str, object]) -> None:
    """Put the flags back after a detected change, so that later reference runs are fair."""
    b = torch.backends
    setters: dict[str, Callable[[Any], object]] = {
        "cuda.matmul.allow_tf32": lambda v: setattr(b.cuda.matmul, "allow_tf32", v),
        "cudnn.allow_tf32": lambda v: setattr(b.cudnn, "allow_tf32", v),
        "cudnn.benchmark": lambda v: setattr(b.cudnn, "benchmark", v),
        "cudnn.deterministic": lambda v: setattr(b.cudnn, "deterministic", v),
        "cudnn.enabled": lambda v: setattr(b.cudnn, "enabled", v),
        "float32_matmul_precision": torch.set_float32_matmul_precision,
        "default_dtype": torch.set_default_dtype,
        "num_threads": torch.set_num_threads,
        "grad_enabled": lambda v: torch.set_grad_enabled(bool(v)),
    }
    for name, setter in setters.items():
        if name in values:
            with contextlib.suppress(Exception):
                setter(values[name])


# ---------------------------------------------------------------- harness identities


def _namespaces() -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("time", lambda: time),
        ("threading", lambda: threading),
        ("_thread", lambda: _thread),
        ("threading.Thread", lambda: threading.Thread),
        ("torch", lambda: torch),
        ("torch.Tensor", lambda: torch.Tensor),
        ("torch._C.TensorBase", lambda: torch._C.TensorBase),
        ("torch.nn.functional", lambda: torch.nn.functional),
        ("torch.nn.Module", lambda: torch.nn.Module),
        ("torch.cuda", lambda: torch.cuda),
        ("torch.cuda.Event", lambda: torch.cuda.Event),
        ("torch.cuda.Stream", lambda: torch.cuda.Stream),
        ("torch._C", lambda: torch._C),
        ("torch.testing", lambda: torch.testing),
        ("torch.random", lambda: torch.random),
        ("torch.backends.cuda", lambda: torch.backends.cuda),
        ("torch.backends.cudnn", lambda: torch.backends.cudnn),
    ]


def _module_layer_classes() -> list[tuple[str, type]]:
    classes = []
    for name in dir(torch.nn):
        value = getattr(torch.nn, name, None)
        if isinstance(value, type) and issubclass(value, torch.nn.Module):
            classes.append((f"torch.nn.{name}", value))
    return classes


_LAYERS = _module_layer_classes()
_HARNESS_MODULES: list[str] = []


def register_harness_module(name: str) -> None:
    """The evaluator's own modules: a candidate that rebinds their globals is caught too."""
    _HARNESS_MODULES.append(name)


Identity = dict[str, tuple[int, Any]]


def snapshot_identities() -> Identity:
    """id and object of every callable in the watched namespaces (objects kept so that ids
    cannot be recycled)."""
    found: Identity = {}

    def take(label: str, namespace: Any) -> None:
        if isinstance(namespace, type):
            # Inherited attributes too: `Tensor.__matmul__ = f` shadows the base class's.
            items = []
            for key in dir(namespace):
                with contextlib.suppress(AttributeError):
                    items.append((key, inspect.getattr_static(namespace, key)))
        else:
            try:
                items = list(vars(namespace).items())
            except TypeError:
                return
        for key, value in items:
            if callable(value) or isinstance(value, staticmethod | classmethod | property):
                found[f"{label}.{key}"] = (id(value), value)

    for label, get in _namespaces():
        take(label, get())
    for label, cls in _LAYERS:
        value = vars(cls).get("forward")
        if value is not None:
            found[f"{label}.forward"] = (id(value), value)
    for name in _HARNESS_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            take(name, module)
            # And the classes it defines: `Channel.send = forged` rebinds no module global.
            for key, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == name:
                    take(f"{name}.{key}", value)
    return found


def _code_file(value: Any) -> str | None:
    target = value
    for attribute in ("__func__", "fget"):
        target = getattr(target, attribute, target)
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        return code.co_filename
    return None


def _is_torch_internal(value: Any) -> bool:
    """A replacement that torch made of itself (dynamo wraps a few functions on first use)."""
    file = _code_file(value)
    if file is None:
        module = getattr(value, "__module__", "") or ""
        return isinstance(value, type) and module.startswith("torch.")
    try:
        resolved = str(Path(file).resolve())
    except OSError:
        return False
    return resolved.startswith(_TORCH_DIR + os.sep)


_ALWAYS_STRICT = ("time.", "threading.", "_thread.", "torch.cuda.", "kernelfleet.")


def diff_identities(before: Identity, after: Identity) -> list[str]:
    """Names whose object was replaced or removed, except torch's own lazy rewrapping."""
    changed = []
    for name, (ident, _) in before.items():
        now = after.get(name)
        if now is None:
            changed.append(name)
            continue
        if now[0] == ident:
            continue
        if not name.startswith(_ALWAYS_STRICT) and _is_torch_internal(now[1]):
            continue
        changed.append(name)
    return sorted(changed)


# ---------------------------------------------------------------- threads


class ThreadWatch:
    """Records who starts threads. A thread is the candidate's when the innermost frame that
    started it, outside the standard library and trusted packages, is in the candidate's file;
    threads that torch starts for itself (the compile workers, progress monitors) are not."""

    def __init__(self) -> None:
        self.candidate_files: set[str] = set()
        self.candidate_threads: list[str] = []
        self.installed = False

    def _creator_is_candidate(self) -> bool:
        for frame in reversed(traceback.extract_stack()[:-2]):
            file = frame.filename
            if file in self.candidate_files:
                return True
            if file == __file__:
                continue
            try:
                resolved = str(Path(file).resolve())
            except OSError:
                resolved = file
            if resolved in self.candidate_files:
                return True
            if resolved.startswith(_STDLIB_DIR + os.sep):
                continue  # threading, concurrent.futures: the creator is further out
            if any(resolved.startswith(d + os.sep) for d in _TRUSTED_DIRS):
                return False  # torch, triton, tqdm start threads of their own
        return False

    def install(self) -> None:
        watch = self

        def start(thread: threading.Thread) -> None:
            if watch._creator_is_candidate():
                watch.candidate_threads.append(thread.name)
            _thread_start(thread)

        def start_new_thread(function: Callable[..., Any], args: Any, kwargs: Any = None) -> int:
            if watch._creator_is_candidate():
                watch.candidate_threads.append(getattr(function, "__name__", "thread"))
            if kwargs is None:
                return _start_new_thread(function, args)
            return _start_new_thread(function, args, kwargs)

        threading.Thread.start = start  # type: ignore[method-assign,assignment]
        _thread.start_new_thread = start_new_thread
        self.installed = True


def os_thread_ids() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def python_native_ids() -> set[str]:
    return {str(t.native_id) for t in threading.enumerate() if t.native_id is not None}


# ---------------------------------------------------------------- reference globals


def snapshot_globals(module: types.ModuleType) -> dict[str, tuple[int, object]]:
    """Every global of the reference module by identity, plus the value of simple ones (sizes)."""
    found: dict[str, tuple[int, object]] = {}
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        simple = value if isinstance(value, int | float | str | bool | tuple | type(None)) else None
        found[name] = (id(value), simple)
    return found


def diff_globals(before: dict[str, tuple[int, object]], module: types.ModuleType) -> list[str]:
    now = snapshot_globals(module)
    changed = [name for name, entry in before.items() if now.get(name) != entry]
    changed += [name for name in now if name not in before]
    return sorted(changed)


def describe(names: Iterable[str], limit: int = 6) -> str:
    items = list(names)
    text = ", ".join(items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")
