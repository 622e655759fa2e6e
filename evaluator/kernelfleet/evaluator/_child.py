"""The child process that judges one candidate, builds one, times baselines, or probes the GPU.

Every candidate runs in a process of its own, forked from a forkserver that has torch (and
this module, with the harness's references to the original timers) already imported, so a
fresh process costs tens of milliseconds and a crash, a hang, a poisoned CUDA context or an
out-of-memory costs that candidate alone. The child reports one plain dictionary through a
pipe; the parent turns it into an `EvaluationResult`.

The order of an evaluation: load the reference and run it once (traced), snapshot the flags,
harness identities and threads, import the candidate (tripwires checked), then correctness
trials with the candidate first on fresh inputs, the reference on clones, the cache probe, the
traced candidate call, and only then timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core import reasons as R
from kernelfleet.evaluator import _guards as G
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._environment import driver_version
from kernelfleet.evaluator._modules import load_module, load_module_at, module_file
from kernelfleet.evaluator._ops import OpTrace, builds_custom_kernel, declared_kernels, fallback_ops
from kernelfleet.evaluator._outputs import (
    check_materialised,
    clone_tree,
    compare,
    has_poison,
    identical,
    inputs_equal,
    leaves,
    poison_,
    poison_free_memory,
    specs,
    to_device,
    to_float64,
)
from kernelfleet.evaluator._timing import (
    InputBank,
    Subject,
    TimingRun,
    adaptive_timing,
    decide,
    escaped_work_ms,
    run_timing,
    stats,
)

for _name in (
    __name__,
    "kernelfleet.evaluator._guards",
    "kernelfleet.evaluator._timing",
    "kernelfleet.evaluator._outputs",
    "kernelfleet.evaluator._ops",
):
    G.register_harness_module(_name)


@dataclass(frozen=True)
class Job:
    """What one child does. `mode`: probe, build, evaluate, baselines."""

    mode: str
    config: EvalConfig
    reference: str = ""
    candidate: str = ""
    visible_devices: str | None = None
    build_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    work_dir: str = ""
    seed: int = 0


# (answer pipe, lane pipe) of a gated evaluation: see `wait_for_lane`.
_LANE: tuple[Any, Any] | None = None


def wait_for_lane() -> None:
    """Loading and correctness run beside other candidates on the same device; timing waits
    here until the parent hands this process the device's timing lane."""
    if _LANE is None:
        return
    answers, lane = _LANE
    answers.send({"status": "ready"})
    lane.recv()


class Stop(Exception):
    """Ends an evaluation early with a verdict."""

    def __init__(self, verdict: str, reasons: list[str]) -> None:
        super().__init__(verdict)
        self.verdict = verdict
        self.reasons = reasons


class ReferenceFailure(Exception):
    """The reference itself does not load or run: a problem with the task, not the candidate."""


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _release_forkserver() -> None:
    """Children inherit the forkserver's keep-alive pipe; holding it would keep an orphaned
    forkserver (and so this child, which dies with it) alive after the evaluator is killed."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _track_semaphores() -> list[str]:
    """Named semaphores this process creates (torch.compile's worker pools make some).

    Children share the parent's multiprocessing resource tracker (through the forkserver) and
    end with `os._exit`, so semaphores they never released stayed registered there, and the
    parent printed "There appear to be N leaked semaphore objects" at its exit (the end of
    `make demo`). The child records what it registers and `_release_semaphores` unlinks and
    unregisters the rest before it exits. A child killed on a timeout cannot: the tracker
    cleans those up at the parent's exit, and its warning then names a real kill."""
    from multiprocessing import resource_tracker

    names: list[str] = []
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def tracked_register(name: str, rtype: str) -> None:
        if rtype == "semaphore":
            names.append(name)
        register(name, rtype)

    def tracked_unregister(name: str, rtype: str) -> None:
        if rtype == "semaphore" and name in names:
            names.remove(name)
        unregister(name, rtype)

    resource_tracker.register = tracked_register  # type: ignore[assignment]
    resource_tracker.unregister = tracked_unregister  # type: ignore[assignment]
    return names


def _release_semaphores(names: list[str]) -> None:
    import _multiprocessing
    from multiprocessing import resource_tracker

    for name in list(names):
        with contextlib.suppress(Exception):
            _multiprocessing.sem_unlink(name)
        with contextlib.suppress(Exception):
            resource_tracker.unregister(name, "semaphore")


def child_main(job: Job, conn: Any, lane: Any = None) -> None:
    """Entry point of every child (run from the forkserver). With `lane`, an evaluation asks
    for the timing lane before it times (`wait_for_lane`)."""
    global _LANE
    entered_at = time.time()
    _LANE = (conn, lane) if lane is not None else None
    semaphores = _track_semaphores()
    _release_forkserver()
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.setpgrp()  # so that a timeout kills the compilers this child started too
    work = Path(job.work_dir)
    log = os.open(work / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if job.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = job.visible_devices
    if job.build_dir:
        os.environ["TORCH_EXTENSIONS_DIR"] = job.build_dir
        Path(job.build_dir).mkdir(parents=True, exist_ok=True)
    os.environ.update(job.env)
    try:
        result = _MODES[job.mode](job)
    except ReferenceFailure as error:
        result = {"status": "reference-error", "error": str(error)}
    except BaseException:
        result = {"status": "internal-error", "error": traceback.format_exc()[-4000:]}
    result["entered_at"] = entered_at
    try:
        conn.send(result)
        conn.close()
    finally:
        _release_semaphores(semaphores)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ---------------------------------------------------------------- helpers


def _first_line(error: BaseException, limit: int = 400) -> str:
    text = str(error).strip()
    if isinstance(error, SyntaxError):
        text = f"{error.msg} (line {error.lineno})"
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    # CUDA errors put the useful part on the first line; compilers at the end.
    if "Error building extension" in text and len(lines) > 1:
        line = lines[0] + " ... " + lines[-1]
    return line[:limit]


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return "out of memory" in text or "can't allocate memory" in text


def runtime_failure(error: BaseException, stage: str) -> Stop:
    if _is_oom(error):
        return Stop("runtime_error", [R.reason(R.OUT_OF_MEMORY, f"{stage}: {_first_line(error)}")])
    return Stop(
        "runtime_error", [R.reason(R.RUNTIME_ERROR, f"{stage}: {type(error).__name__}: {_first_line(error)}")]
    )


def _import_failure(error: BaseException, source: str) -> Stop:
    if isinstance(error, SyntaxError):
        return Stop("compile_error", [R.reason(R.SYNTAX_ERROR, _first_line(error))])
    text = str(error)
    native = "load_inline" in source or "cpp_extension" in source
    if native and ("Error building extension" in text or "ninja" in text.lower() or "nvcc" in text):
        return Stop("compile_error", [R.reason(R.BUILD_ERROR, _first_line(error))])
    if _is_oom(error):
        return Stop(
            "runtime_error", [R.reason(R.OUT_OF_MEMORY, f"importing the candidate: {_first_line(error)}")]
        )
    return Stop("compile_error", [R.reason(R.IMPORT_ERROR, f"{type(error).__name__}: {_first_line(error)}")])


def _device(config: EvalConfig) -> torch.device:
    return torch.device("cuda:0" if config.device.startswith("cuda") else "cpu")


def _storages(*trees: Any) -> set[int]:
    found = set()
    for tree in trees:
        for leaf in leaves(tree):
            if isinstance(leaf, torch.Tensor):
                found.add(leaf.untyped_storage().data_ptr())
    return found


def _model_tensors(model: Any) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return [*model.parameters(), *model.buffers()]
    return []


def _release(value: Any, protected: set[int]) -> None:
    """Poison a reference output before it is freed, unless it shares memory with something
    that must survive (a parameter, an input set)."""
    for leaf in leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in protected:
            poison_(leaf)


def pin_inductor_threads() -> None:
    """Make torch.compile's C++ kernels use this process's thread count, and key them by it.

    Inductor writes the OpenMP team size of the compiling process into each CPU kernel
    (`#pragma omp parallel num_threads(N)`) but leaves the thread count out of its cache key,
    so a child that runs on one thread reused kernels compiled by a process with more threads
    (the parent, a test, a run with `cpu_threads=None`): every compiled call then forced a team
    of N threads that the cores, shared with the other side and other jobs, could not serve,
    and the compile baselines measured 10-20x slower than eager. Pinning `cpp.threads` (part of
    the cache key) gives the compiled code the same threads as the eager reference."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.threads = torch.get_num_threads()


# ---------------------------------------------------------------- the session


class Session:
    """The state of one evaluation inside the child."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.config = job.config
        self.profile = job.config.profile_rules
        self.device = _device(job.config)
        self.cuda = self.device.type == "cuda"
        self.rng = random.Random(job.seed)
        self.work = Path(job.work_dir)
        self.reasons: list[str] = []
        self.max_abs_error: float | None = None
        self.watch = G.ThreadWatch()
        self.ref_model: Any = None
        self.ref64_model: Any = None
        self.cand_model: Any = None
        self.ref_trace: OpTrace | None = None
        self.init_seed = self.rng.getrandbits(31)
        self.trace_error = ""
        self.settings: dict[str, object] = {}  # allowed settings the candidate adopted
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Any:
        """Time one stage of the evaluation (reported per result, summed in the metrics)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - begin

    # -- setup

    def setup_torch(self) -> None:
        if self.cuda:
            with self.stage("cuda_init"):
                torch.cuda.set_device(self.device)
                torch.zeros(1, device=self.device)  # the context now, not inside the reference
                self.sync()
        if self.profile.strict_fp32:
            G.apply_strict_fp32()
        if not self.cuda and self.config.cpu_threads is not None:
            torch.set_num_threads(self.config.cpu_threads)
        pin_inductor_threads()
        torch.set_grad_enabled(not self.profile.no_grad)

    def sync(self) -> None:
        if self.cuda:
            G.cuda_synchronize(self.device)

    def load_reference(self) -> None:
        try:
            self.ref_mod = load_module(self.job.reference, self.work, "kf_reference", hidden=True)
            for name in ("Model", "get_inputs", "get_init_inputs"):
                if not hasattr(self.ref_mod, name):
                    raise ReferenceFailure(f"the reference defines no {name}")
            G.manual_seed(self.init_seed)
            self.init_inputs = list(self.ref_mod.get_init_inputs())
            self.ref_model = self.build(self.ref_mod.Model)
            if self.config.float64_reference:
                self.ref64_model = self.build(self.ref_mod.Model)
                self.ref64_model = self.ref64_model.double()
            inputs = self.inputs(self.rng.getrandbits(31))
            first = self.trace(self.ref_model, clone_tree(inputs))
            if first is None:
                self.ref_trace = None
                out = self.call(self.ref_model, clone_tree(inputs), 0)
            else:
                self.ref_trace, out = first
            self.sync()
            self.ref_globals = G.snapshot_globals(self.ref_mod)  # after the reference ran once
        except ReferenceFailure:
            raise
        except BaseException as error:
            raise ReferenceFailure(f"{type(error).__name__}: {_first_line(error)}") from error
        self.out_specs = specs(out)
        self.ref_dtypes = [s.dtype for s in self.out_specs]
        self.protected = _storages(_model_tensors(self.ref_model))
        del out, inputs

    def build(self, cls: Any) -> Any:
        G.manual_seed(self.init_seed)
        model = cls(*clone_tree(self.init_inputs))
        if hasattr(model, "to"):
            model = model.to(self.device)
        if self.profile.eval_mode and hasattr(model, "eval"):
            model.eval()
        return model

    def inputs(self, seed: int) -> list[Any]:
        G.manual_seed(seed)
        return list(to_device(list(self.ref_mod.get_inputs()), self.device))

    def call(self, model: Any, inputs: list[Any], seed: int) -> Any:
        G.manual_seed(seed)
        out = model(*inputs)
        self.sync()
        return out

    def trace(self, model: Any, inputs: list[Any]) -> tuple[OpTrace, Any] | None:
        tracer = OpTrace(G.snapshot_flags())
        try:
            with tracer:
                out = model(*inputs)
            self.sync()
        except Exception as error:
            self.trace_error = f"{type(error).__name__}: {_first_line(error)}"
            return None
        return tracer, out

    # -- tripwires

    def snapshot(self) -> None:
        self.watch.install()
        self.flags = G.snapshot_flags()
        self.identities = G.snapshot_identities()
        self.os_threads = G.os_thread_ids()

    def check_guards(self, stage: str, *, identities: bool = True) -> None:
        """Compare flags, harness identities (skipped when `identities` is False: it costs a
        walk over torch's namespaces, so per-trial checks leave it to the next full check),
        the reference module and threads with their state before the candidate existed."""
        found: list[str] = []
        changes = []
        for name, before, after in G.diff_flags(self.flags, G.snapshot_flags()):
            if self.profile.allows(name, after):
                self.adopt(name, after)
            else:
                changes.append((name, before, after))
        for name, before, after in changes:
            code = R.PRECISION_DOWNGRADE if name in G.PRECISION_FLAGS else R.GLOBAL_FLAG_CHANGED
            found.append(R.reason(code, f"{name} changed from {before!r} to {after!r} while {stage}"))
        if changes:
            G.restore_flags(self.flags)
        patched = G.diff_identities(self.identities, G.snapshot_identities()) if identities else []
        if patched:
            found.append(R.reason(R.HARNESS_PATCHED, f"{G.describe(patched)} replaced while {stage}"))
        modified = G.diff_globals(self.ref_globals, self.ref_mod)
        if modified:
            found.append(
                R.reason(
                    R.REFERENCE_MODIFIED,
                    f"the reference module's {G.describe(modified)} changed while {stage}",
                )
            )
        if self.watch.candidate_threads:
            found.append(
                R.reason(
                    R.THREADS, f"the candidate started threads ({G.describe(self.watch.candidate_threads)})"
                )
            )
            self.watch.candidate_threads = []
        for text in found:
            if text not in self.reasons:
                self.reasons.append(text)
        if any(R.is_rejecting(text) for text in found):
            raise Stop("rejected", [])

    def adopt(self, name: str, value: object) -> None:
        """A setting any user could make (cudnn.benchmark; TF32 where the profile allows): it
        is process-wide, so the reference runs with it too from now on, and the result names
        it. The flags' baseline moves, so later checks do not see it as a change."""
        if name not in self.settings:
            self.reasons.append(
                R.reason(
                    R.SETTING_APPLIED,
                    f"the candidate sets {name}={value!r}; applied to the reference as well",
                )
            )
        self.settings[name] = value
        G.restore_flags({name: value})
        self.flags[name] = value

    def native_threads(self) -> None:
        new = G.os_thread_ids() - self.os_threads - G.python_native_ids()
        if new:
            self.reasons.append(
                R.reason(R.NATIVE_THREADS, f"{len(new)} native threads appeared while the candidate ran")
            )

    # -- the candidate

    def import_candidate(self) -> None:
        path = module_file(self.work, "kf_candidate")
        self.watch.candidate_files = {str(path), str(path.resolve())}
        try:
            self.cand_mod = load_module_at(self.job.candidate, path)
        except BaseException as error:
            raise _import_failure(error, self.job.candidate) from error
        self.check_guards("importing the candidate")
        if not hasattr(self.cand_mod, "ModelNew"):
            raise Stop(
                "compile_error", [R.reason(R.MISSING_MODELNEW, "the candidate defines no ModelNew class")]
            )
        try:
            self.cand_model = self.build(self.cand_mod.ModelNew)
            self.sync()
        except Stop:
            raise
        except BaseException as error:
            raise runtime_failure(error, "constructing ModelNew") from error
        self.check_guards("constructing ModelNew")

    def correctness(self) -> None:
        trials = self.config.correctness_trials
        first_c: Any = None
        first_r: Any = None
        cand_constant = True
        ref_constant = True
        cand_inputs: list[Any] = []
        for trial in range(trials):
            stage = f"correctness trial {trial + 1}"
            seed_in, seed_call = self.rng.getrandbits(31), self.rng.getrandbits(31)
            inputs = self.inputs(seed_in)
            original = clone_tree(inputs)
            poison_free_memory(self.out_specs, self.device)
            cand_inputs = inputs
            try:
                out_c = self.call(self.cand_model, cand_inputs, seed_call)
            except Stop:
                raise
            except BaseException as error:
                raise runtime_failure(error, f"calling ModelNew in {stage}") from error
            self.check_guards(stage, identities=False)
            problems = check_materialised(out_c, self.device)
            if problems:
                self.reasons.extend(problems)
                raise Stop("rejected" if any(R.is_rejecting(p) for p in problems) else "incorrect", [])
            if has_poison(out_c):
                self.reasons.append(
                    R.reason(R.STALE_MEMORY, f"the output holds freed memory it never wrote ({stage})")
                )
                raise Stop("rejected", [])
            out_c = clone_tree(out_c)  # a view of an internal buffer may change on the next call
            ref_inputs = clone_tree(original)
            if self.ref64_model is not None:
                out_r = self.call(self.ref64_model, to_float64(ref_inputs), seed_call)
                expected_inputs = original
            else:
                out_r = self.call(self.ref_model, ref_inputs, seed_call)
                expected_inputs = ref_inputs  # equals original unless the reference mutates too
            changed = inputs_equal(cand_inputs, expected_inputs)
            if changed:
                self.reasons.append(
                    R.reason(
                        R.INPUT_MUTATED, f"the candidate changed its input(s) {changed} in place ({stage})"
                    )
                )
                raise Stop("rejected", [])
            result = compare(
                out_c, out_r, self.profile, self.ref_dtypes if self.ref64_model is not None else None
            )
            self._note_error(result.max_abs_error)
            if not result.ok:
                if first_r is not None and compare(out_c, first_r, self.profile).ok:
                    self.reasons.append(
                        R.reason(
                            R.CACHED_OUTPUT,
                            f"{stage} returned the result for the inputs of trial 1 (a cache across calls)",
                        )
                    )
                    raise Stop("rejected", [])
                self.reasons.extend(f"{text} ({stage})" for text in result.reasons)
                self.diagnose()
                raise Stop("incorrect", [])
            if first_c is None:
                first_c, first_r = out_c, clone_tree(out_r)
            else:
                cand_constant = cand_constant and identical(out_c, first_c)
                ref_constant = ref_constant and identical(out_r, first_r)
            _release(out_r, self.protected)
            del out_r, out_c, original, ref_inputs
        if trials >= 2 and cand_constant and not ref_constant:
            self.reasons.append(
                R.reason(
                    R.CONSTANT_OUTPUT,
                    f"the candidate returned bit-identical outputs for {trials} different inputs, "
                    "the reference did not",
                )
            )
            raise Stop("rejected", [])
        if trials >= 2 and ref_constant:
            self.reasons.append(
                R.reason(R.DEGENERATE_TASK, "the reference's output does not depend on its inputs")
            )
        self.cache_probe(cand_inputs)

    def cache_probe(self, buffers: list[Any]) -> None:
        """Refill the very tensors of the last call with new values: a result cached by
        pointer or shape comes back stale."""
        fresh = self.inputs(self.rng.getrandbits(31))
        seed = self.rng.getrandbits(31)
        with torch.no_grad():
            for buffer, value in zip(leaves(buffers), leaves(fresh), strict=True):
                if isinstance(buffer, torch.Tensor):
                    buffer.copy_(value)
        try:
            out_c = self.call(self.cand_model, buffers, seed)
        except BaseException as error:
            raise runtime_failure(error, "calling ModelNew on refilled inputs") from error
        self.check_guards("the cache probe")
        out_r = self.reference_output(fresh, seed)
        result = compare(
            out_c, out_r, self.profile, self.ref_dtypes if self.ref64_model is not None else None
        )
        if not result.ok:
            self.reasons.append(
                R.reason(
                    R.CACHED_OUTPUT,
                    "after its input tensors were refilled in place with new values, the candidate "
                    "returned a stale result (a cache keyed by pointer or shape)",
                )
            )
            raise Stop("rejected", [])
        _release(out_r, self.protected)

    def diagnose(self) -> None:
        """After a mismatch, one traced call names a precision downgrade if that is the cause."""
        try:
            inputs = self.inputs(self.rng.getrandbits(31))
            traced = self.trace(self.cand_model, inputs)
        except BaseException:
            return
        if traced is not None:
            self._precision(traced[0])

    def reference_output(self, inputs: list[Any], seed: int) -> Any:
        if self.ref64_model is not None:
            return self.call(self.ref64_model, to_float64(clone_tree(inputs)), seed)
        return self.call(self.ref_model, clone_tree(inputs), seed)

    def _note_error(self, value: float | None) -> None:
        if value is not None:
            self.max_abs_error = value if self.max_abs_error is None else max(self.max_abs_error, value)

    def inspect_candidate(self) -> None:
        """One traced call: dtypes, flags during the call, and (if demanded) kernel evidence."""
        inputs = self.inputs(self.rng.getrandbits(31))
        seed = self.rng.getrandbits(31)
        G.manual_seed(seed)
        traced = self.trace(self.cand_model, clone_tree(inputs))
        self.check_guards("the traced call")
        if traced is None:
            self.reasons.append(
                R.reason(R.TRACE_UNAVAILABLE, f"the operator trace failed: {self.trace_error}")
            )
            cand_trace = None
        else:
            cand_trace, out_c = traced
            out_r = self.reference_output(inputs, seed)
            result = compare(
                out_c, out_r, self.profile, self.ref_dtypes if self.ref64_model is not None else None
            )
            if not result.ok:
                self.reasons.extend(f"{text} (traced call)" for text in result.reasons)
                raise Stop("incorrect", [])
            self._precision(cand_trace)
        if self.config.require_kernel:
            self._require_kernel(cand_trace, inputs)
        if any(R.is_rejecting(text) for text in self.reasons):
            raise Stop("rejected", [])

    def _precision(self, trace: OpTrace) -> None:
        fp32_task = all(d in (torch.float32, torch.float64) for d in self.ref_dtypes if d.is_floating_point)
        reference_low = self.ref_trace.low_precision() if self.ref_trace else {}
        if fp32_task and not reference_low:
            for dtype, ops in sorted(trace.low_precision().items()):
                self.reasons.append(
                    R.reason(
                        R.PRECISION_DOWNGRADE,
                        f"an fp32 task computed in {dtype} ({G.describe(sorted(ops), 4)})",
                    )
                )
        for flag, (value, op) in sorted(trace.flag_changes.items()):
            if self.profile.allows(flag, value):
                self.adopt(flag, value)
                continue
            code = R.PRECISION_DOWNGRADE if flag in G.PRECISION_FLAGS else R.GLOBAL_FLAG_CHANGED
            self.reasons.append(
                R.reason(code, f"{flag} was {value!r} during the call (at {op}), then restored")
            )

    def _require_kernel(self, trace: OpTrace | None, inputs: list[Any]) -> None:
        source = self.job.candidate
        if not builds_custom_kernel(source):
            self.reasons.append(
                R.reason(
                    R.NO_CUSTOM_KERNEL,
                    "a custom kernel is required, but the candidate neither builds a C++/CUDA extension "
                    "nor defines a Triton kernel",
                )
            )
            return
        if trace is not None and self.ref_trace is not None:
            overlap, whole = fallback_ops(self.ref_trace, trace)
            if whole:
                self.reasons.append(
                    R.reason(
                        R.REFERENCE_FALLBACK, "the candidate dispatches every operator the reference does"
                    )
                )
            elif overlap:
                self.reasons.append(
                    R.reason(
                        R.TORCH_FALLBACK,
                        f"the candidate still computes {G.describe(sorted(overlap), 4)} with torch, "
                        "as the reference does",
                    )
                )
        if self.cuda:
            declared = declared_kernels(source)
            ran = self._kernels_run(inputs)
            if declared and ran is not None and not any(d in name for d in declared for name in ran):
                self.reasons.append(
                    R.reason(
                        R.CUSTOM_KERNEL_NOT_RUN,
                        f"none of the kernels it defines ({G.describe(sorted(declared), 4)}) ran on the GPU",
                    )
                )

    def _kernels_run(self, inputs: list[Any]) -> list[str] | None:
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.call(self.cand_model, clone_tree(inputs), 0)
            return [event.key for event in prof.key_averages()]
        except Exception as error:
            self.reasons.append(
                R.reason(R.TRACE_UNAVAILABLE, f"the CUDA profiler failed: {_first_line(error)}")
            )
            return None

    # -- timing

    def bank_sets(self) -> list[list[Any]]:
        first = self.inputs(self.rng.getrandbits(31))
        size = sum(t.numel() * t.element_size() for t in leaves(first) if isinstance(t, torch.Tensor))
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.25 * free
        else:
            budget = 2 * 1024**3
        count = 3 if size * 6 <= budget else 1
        return [first] + [self.inputs(self.rng.getrandbits(31)) for _ in range(count - 1)]

    def time_pair(self) -> dict[str, Any]:
        sets = self.bank_sets()
        bank = InputBank(sets)
        protected = self.protected | _storages(sets)
        subjects = [
            Subject("reference", lambda b: self.ref_model(*b), clone_tree(sets[0])),
            Subject("candidate", lambda b: self.cand_model(*b), clone_tree(sets[0])),
        ]

        def check_round(outputs: dict[str, Any]) -> str | None:
            cand, ref = outputs["candidate"], outputs["reference"]
            if check_materialised(cand, self.device):
                return R.reason(R.LAZY_OUTPUT, "an output during timing was not a plain materialised tensor")
            if has_poison(cand):
                return R.reason(R.STALE_MEMORY, "an output during timing held freed memory it never wrote")
            if not compare(cand, ref, self.profile, measure_error=False).ok:
                return R.reason(
                    R.CACHED_OUTPUT,
                    "during timing the candidate's output differed from the reference's for the same "
                    "inputs (state or a cache across calls)",
                )
            return None

        def release(outputs: dict[str, Any]) -> None:
            _release(outputs["reference"], protected)

        flush_bytes = self.config.resolved_flush_bytes(self.cuda)
        total = TimingRun({"reference": [], "candidate": []}, {"reference": [], "candidate": []})

        def measure(rounds: int, first: bool) -> tuple[list[float], list[float]]:
            try:
                run = run_timing(
                    subjects,
                    bank,
                    device=self.device,
                    warmup=self.config.warmup if first else 2,
                    trials=rounds,
                    flush_bytes=flush_bytes,
                    rng=self.rng,
                    check_round=check_round,
                    release=release,
                )
            except Stop:
                raise
            except BaseException as error:
                raise runtime_failure(error, "timing") from error
            self.check_guards("timing")
            if run.failed_rounds:
                first_round, problem = run.failed_rounds[0]
                self.reasons.append(f"{problem} (round {first_round + 1}, {len(run.failed_rounds)} rounds)")
                raise Stop("rejected", [])
            for label in ("reference", "candidate"):
                total.samples[label] += run.samples[label]
                total.naive[label] += run.naive.get(label, [])
            return run.samples["reference"], run.samples["candidate"]

        config = self.config
        timed = adaptive_timing(
            measure,
            trials=config.timing_trials,
            extra_batches=config.timing_retries,
            precision=config.timing_precision,
            max_cv=config.max_speedup_cv,
            budget_s=config.timing_budget_s,
            seed=self.rng.getrandbits(31),
        )
        escaped = escaped_work_ms(total, "candidate", "reference")
        cand_median = stats(timed.candidate).median_ms
        if escaped > max(0.015, 0.1 * cand_median):
            self.reasons.append(
                R.reason(
                    R.SIDE_STREAM,
                    f"{escaped:.3f} ms of each call ran outside the current stream's order (a side stream "
                    "the caller never waits for)",
                )
            )
            raise Stop("rejected", [])
        estimate = timed.estimate
        speedup, noisy = decide(timed, config.max_speedup_cv)
        if noisy is not None:
            self.reasons.append(R.reason(R.TIMING_NOISY, noisy))
        return {
            "reference_ms": timed.reference,
            "candidate_ms": timed.candidate,
            "speedup": speedup,
            "speedup_ci": [estimate.low, estimate.high] if speedup is not None else None,
            "speedup_cv": estimate.bucket_cv,
            "timing_batches": timed.batches,
        }


# ---------------------------------------------------------------- modes


def _verdict(session: Session) -> str:
    if any(R.is_rejecting(text) for text in session.reasons):
        return "rejected"
    return "correct"


def _reference_session(job: Job) -> Session:
    """A session with torch set up and the reference loaded; ReferenceFailure if it does not
    load, which `child_main` answers as a `reference-error`."""
    session = Session(job)
    session.setup_torch()
    session.load_reference()
    return session


def evaluate(job: Job) -> dict[str, Any]:
    session = Session(job)
    session.setup_torch()
    with session.stage("reference"):
        session.load_reference()
    session.snapshot()
    timing: dict[str, Any] = {}
    try:
        with session.stage("candidate_load"):
            session.import_candidate()
        with session.stage("correctness"):
            session.correctness()
            session.inspect_candidate()
        session.native_threads()
        if job.config.timing:
            with session.stage("lane_wait"):
                wait_for_lane()
            with session.stage("timing"):
                timing = session.time_pair()
        verdict = _verdict(session)
    except Stop as stop:
        session.reasons.extend(stop.reasons)
        verdict = stop.verdict
    if session.cand_model is not None and verdict in ("correct", "incorrect"):
        with contextlib.suppress(Stop):
            session.check_guards("the evaluation")  # a last full look, whatever happened
    if verdict in ("correct", "incorrect") and any(R.is_rejecting(t) for t in session.reasons):
        verdict = "rejected"
    return {
        "status": "ok",
        "verdict": verdict,
        "reasons": session.reasons,
        "max_abs_error": session.max_abs_error,
        "settings": {name: repr(value) for name, value in session.settings.items()},
        "stages": session.stages,
        **timing,
    }


def build(job: Job) -> dict[str, Any]:
    """Import the candidate on the CPU side: C++/CUDA extensions compile into the build cache."""
    try:
        load_module(job.candidate, Path(job.work_dir), "kf_build")
    except BaseException as error:
        stop = _import_failure(error, job.candidate)
        return {"status": "ok", "verdict": stop.verdict, "reasons": stop.reasons}
    return {"status": "ok", "verdict": "built", "reasons": []}


def baselines(job: Job) -> dict[str, Any]:
    """Time the reference as is, under torch.compile in two modes, and as a CUDA graph."""
    session = _reference_session(job)
    sets = session.bank_sets()
    bank = InputBank(sets)
    unavailable: dict[str, str] = {}
    subjects: list[Subject] = []
    for mode in job.config.baseline_modes:
        try:
            subject = _baseline_subject(session, mode, sets[0])
        except Exception as error:
            unavailable[mode] = f"{type(error).__name__}: {_first_line(error)}"
            continue
        if subject is None:
            unavailable[mode] = "not available on this device"
        else:
            subjects.append(subject)
    if not subjects:
        return {"status": "ok", "samples": {}, "unavailable": unavailable}
    trials = job.config.baseline_trials or job.config.timing_trials
    run = run_timing(
        subjects,
        bank,
        device=session.device,
        warmup=job.config.warmup,
        trials=trials,
        flush_bytes=job.config.resolved_flush_bytes(session.cuda),
        rng=session.rng,
    )
    return {"status": "ok", "samples": run.samples, "unavailable": unavailable}


def _baseline_subject(session: Session, mode: str, example: list[Any]) -> Subject | None:
    buffers = clone_tree(example)
    if mode == "eager":
        model = session.ref_model
        return Subject(mode, lambda b: model(*b), buffers)
    if mode in ("compile", "compile-reduce-overhead"):
        fresh = session.build(session.ref_mod.Model)
        compiled: Callable[..., Any] = torch.compile(
            fresh, mode="reduce-overhead" if mode == "compile-reduce-overhead" else None
        )
        for _ in range(3):
            compiled(*buffers)
        session.sync()
        return Subject(mode, lambda b: compiled(*b), buffers)
    if mode == "cudagraph":
        if not session.cuda:
            return None
        model = session.build(session.ref_mod.Model)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(*buffers)

        def replay(_: list[Any]) -> Any:
            graph.replay()
            return static_out

        return Subject(mode, replay, buffers)
    raise ValueError(f"unknown baseline mode {mode}")


def probe(job: Job) -> dict[str, Any]:
    """What GPUs this machine has, asked from a child so the parent holds no CUDA context."""
    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory": props.total_memory,
                    "l2_cache": getattr(props, "L2_cache_size", 0),
                }
            )
    return {
        "status": "ok",
        "devices": devices,
        "cuda": torch.version.cuda or "",
        "driver": driver_version() if devices else "",
        "torch": torch.__version__,
    }


_MODES: dict[str, Callable[[Job], dict[str, Any]]] = {
    "evaluate": evaluate,
    "build": build,
    "baselines": baselines,
    "probe": probe,
}
