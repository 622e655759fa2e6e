"""The reference's session and what the judge's and the candidate's processes share.

`Session` is the reference side of an evaluation (it runs in the judge's process, which never
loads candidate code): the reference loaded as its own module, run once under an operator
trace, inputs made from its `get_inputs` with a given seed, its outputs (in fp64 when asked),
and the baselines (eager, torch.compile, CUDA graphs) timed with the candidates' protocol. The
helpers that turn an exception into a verdict (`Stop`, `runtime_failure`, `_import_failure`)
serve the candidate's process too. See `_protocol` for how an evaluation runs.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core import reasons as R
from kernelfleet.evaluator import _guards as G
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._environment import driver_version
from kernelfleet.evaluator._modules import load_module
from kernelfleet.evaluator._ops import OpTrace
from kernelfleet.evaluator._outputs import (
    clone_tree,
    leaves,
    poison_,
    specs,
    tensor_bytes,
    to_device,
    to_float64,
)
from kernelfleet.evaluator._timing import (
    InputBank,
    Subject,
    run_timing,
)


@dataclass(frozen=True)
class Job:
    """What the judge's session works on. `mode`: evaluate, baselines or probe."""

    mode: str
    config: EvalConfig
    reference: str = ""
    candidate: str = ""
    visible_devices: str | None = None
    build_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    work_dir: str = ""
    seed: int = 0


class Stop(Exception):
    """Ends an evaluation early with a verdict."""

    def __init__(self, verdict: str, reasons: list[str]) -> None:
        super().__init__(verdict)
        self.verdict = verdict
        self.reasons = reasons


class ReferenceFailure(Exception):
    """The reference itself does not load or run: a problem with the task, not the candidate."""


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


def build_failure(error: BaseException, source: str) -> Stop | None:
    """A compile_error when `error` is a C++/CUDA extension's failed build, else None."""
    text = str(error)
    native = "load_inline" in source or "cpp_extension" in source
    if native and ("Error building extension" in text or "ninja" in text.lower() or "nvcc" in text):
        return Stop("compile_error", [R.reason(R.BUILD_ERROR, _first_line(error))])
    return None


def _import_failure(error: BaseException, source: str) -> Stop:
    if isinstance(error, SyntaxError):
        return Stop("compile_error", [R.reason(R.SYNTAX_ERROR, _first_line(error))])
    failed = build_failure(error, source)
    if failed is not None:
        return failed
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
        self.inputs_device: torch.device | None = self.device  # None: `get_inputs` needs the host
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
            if self.config.correctness.float64_reference:
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

    def made_inputs(self, seed: int) -> list[Any]:
        """The task's inputs for `seed`, drawn on the evaluation's device.

        Why the device: `get_inputs` makes its tensors with torch's factories, and on the host
        they draw every value on one CPU: 1:36's 67M values took 0.45 s a call, five calls and a
        timing bank per evaluation, the largest part of its correctness and more while the
        pipeline's builds hold the CPUs (`input_crossing-2026-12-07-retime12.md`). A GPU draws
        them in about a millisecond. The values differ from the host's for the same seed (another
        generator); the distribution does not, and both sides are compared on the same draw. A
        task whose `get_inputs` cannot run under the device (it passes a host generator, or mixes
        in host tensors) is drawn on the host from then on."""
        G.manual_seed(seed)
        if self.inputs_device is not None:
            try:
                with self.inputs_device:
                    return list(self.ref_mod.get_inputs())
            except Exception:
                self.inputs_device = None
                G.manual_seed(seed)
        return list(self.ref_mod.get_inputs())

    def inputs(self, seed: int) -> list[Any]:
        return list(to_device(self.made_inputs(seed), self.device))

    def call(self, model: Any, inputs: list[Any], seed: int) -> Any:
        G.manual_seed(seed)
        out = model(*inputs)
        self.sync()
        return out

    def reference_output(self, inputs: list[Any], seed: int) -> Any:
        """The reference's output on a copy of `inputs` (in fp64 when the config asks)."""
        if self.ref64_model is not None:
            return self.call(self.ref64_model, to_float64(clone_tree(inputs)), seed)
        return self.call(self.ref_model, clone_tree(inputs), seed)

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

    # -- timing

    def bank_count(self, first: list[Any]) -> int:
        """How many input sets a timing bank holds: 3 while both sides' copies of them take at
        most a quarter of the device's free memory (2 GB on the CPU), else 1."""
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.25 * free
        else:
            budget = 2 * 1024**3
        return 3 if tensor_bytes(first) * 6 <= budget else 1

    def bank_sets(self) -> list[list[Any]]:
        first = self.inputs(self.rng.getrandbits(31))
        count = self.bank_count(first)
        return [first] + [self.inputs(self.rng.getrandbits(31)) for _ in range(count - 1)]


# ---------------------------------------------------------------- modes


def _reference_session(job: Job) -> Session:
    """A session with torch set up and the reference loaded; ReferenceFailure if it does not
    load, which `child_main` answers as a `reference-error`."""
    session = Session(job)
    session.setup_torch()
    session.load_reference()
    return session


def baselines(job: Job) -> dict[str, Any]:
    """Time the reference as is, under torch.compile in two modes, and as a CUDA graph."""
    session = _reference_session(job)
    sets = session.bank_sets()
    bank = InputBank(sets)
    unavailable: dict[str, str] = {}
    subjects: list[Subject] = []
    for mode in job.config.timing.baseline_modes:
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
    trials = job.config.timing.baseline_trials or job.config.timing.trials
    run = run_timing(
        subjects,
        bank,
        device=session.device,
        warmup=job.config.timing.warmup,
        trials=trials,
        flush_bytes=job.config.timing.resolved_flush_bytes(session.cuda),
        rng=session.rng,
        lead_us=job.config.timing.lead_us,
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
