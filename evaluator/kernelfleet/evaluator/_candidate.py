"""The candidate's side: the only process that ever loads candidate code.

Forked from the sandbox's zygote with its walls already raised, it imports the candidate,
builds `ModelNew` and then does what the evaluator asks, one request at a time: call the model
on inputs the judge wrote, write its outputs to a file for the judge to compare, trace one call,
time its own half of each timing round. It never sees the reference: no reference module, no
reference output and no reference timing is in this process, so there is nothing here for a
candidate to patch but itself. (A build process, which only fills the candidate's own build
directory and judges nothing, imports the task's public source for its init inputs and inputs:
see `_build`.)

The tripwires of `_guards` still run here (flags, harness identities, threads, lazy or stale
outputs, input mutation) and report what they see; the verdict is the evaluator's, which
trusts none of it beyond what it checked itself. Anything that goes wrong here, the
evaluator's own code included, is answered as this candidate's failure.
"""

from __future__ import annotations

import contextlib
import random
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core import reasons as R
from kernelfleet.evaluator import _guards as G
from kernelfleet.evaluator._child import (
    Stop,
    _device,
    _import_failure,
    build_failure,
    pin_inductor_threads,
    runtime_failure,
)
from kernelfleet.evaluator._compiled import restore
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._extensions import share_builds_across_processes
from kernelfleet.evaluator._modules import load_module, load_module_at, module_file
from kernelfleet.evaluator._ops import OpTrace, needs_native_build
from kernelfleet.evaluator._outputs import (
    OutputSpec,
    check_materialised,
    clone_tree,
    has_poison,
    inputs_equal,
    leaves,
    poison_free_memory,
    to_device,
)
from kernelfleet.evaluator._timing import InputBank, _Clock, clock_for, pin_timing_thread
from kernelfleet.evaluator._wire import Channel, ChannelClosed, read_tree, write_tree

for _name in (
    __name__,
    "kernelfleet.evaluator._guards",
    "kernelfleet.evaluator._timing",
    "kernelfleet.evaluator._outputs",
    "kernelfleet.evaluator._ops",
    "kernelfleet.evaluator._wire",
    "kernelfleet.evaluator._child",
):
    G.register_harness_module(_name)

_INPUT_LIMIT = 1 << 40  # files the judge wrote: trusted sizes


def prepare_torch(config: EvalConfig, device: torch.device) -> None:
    """The torch settings a candidate runs under: the profile's flags and grad mode, the CPU
    threads. The build's warm-up takes them too, so that what it compiles (keyed by them) is
    what the evaluation's processes look up."""
    profile = config.profile_rules
    if profile.strict_fp32:
        G.apply_strict_fp32()
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    pin_inductor_threads()
    torch.set_grad_enabled(not profile.no_grad)


class CandidateSession:
    """One candidate's state inside its process."""

    def __init__(self, setup: dict[str, Any], scratch: Path) -> None:
        self.config = EvalConfig.model_validate(setup["config"])
        self.profile = self.config.profile_rules
        self.source: str = setup["candidate"]
        self.device = _device(self.config)
        self.cuda = self.device.type == "cuda"
        self.work = scratch
        self.exchange = scratch / "xchg"
        self.init_seed = int(setup["init_seed"])
        self.rng = random.Random(int(setup["seed"]))
        self.specs = [
            OutputSpec(tuple(s[0]), getattr(torch, s[1]), int(s[2])) for s in setup.get("specs", [])
        ]
        self.reasons: list[str] = []
        self.settings: dict[str, object] = {}
        self.watch = G.ThreadWatch()
        self.cand_model: Any = None
        self.last_inputs: list[Any] | None = None
        self.bank: InputBank | None = None
        self.buffers: list[Any] = []
        self.kept: Any = None
        self.flush: torch.Tensor | None = None
        self.clock: _Clock | None = None
        self.stages: dict[str, float] = {}

    # -- plumbing

    def path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad exchange name {name!r}")
        return str(self.exchange / name)

    def read(self, name: str) -> Any:
        value, _ = read_tree(self.path(name), _INPUT_LIMIT, device=self.device)
        return value

    def sync(self) -> None:
        if self.cuda:
            G.cuda_synchronize(self.device)

    def new_reasons(self, start: int) -> list[str]:
        return self.reasons[start:]

    # -- setup

    def setup_torch(self) -> None:
        if self.cuda:
            begin = time.perf_counter()
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)
            self.sync()
            self.stages["cuda_init"] = time.perf_counter() - begin
        prepare_torch(self.config, self.device)

    def snapshot(self) -> None:
        self.watch.install()
        self.flags = G.snapshot_flags()
        self.identities = G.snapshot_identities()
        self.os_threads = G.os_thread_ids()

    def check_guards(self, stage: str, *, identities: bool = True) -> None:
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

    def import_candidate(self, init_inputs: list[Any]) -> None:
        path = module_file(self.work, "kf_candidate")
        self.watch.candidate_files = {str(path), str(path.resolve())}
        try:
            self.cand_mod = load_module_at(self.source, path)
        except BaseException as error:
            raise _import_failure(error, self.source) from error
        self.check_guards("importing the candidate")
        if not hasattr(self.cand_mod, "ModelNew"):
            raise Stop(
                "compile_error", [R.reason(R.MISSING_MODELNEW, "the candidate defines no ModelNew class")]
            )
        try:
            G.manual_seed(self.init_seed)
            model = self.cand_mod.ModelNew(*clone_tree(init_inputs))
            if hasattr(model, "to"):
                model = model.to(self.device)
            if self.profile.eval_mode and hasattr(model, "eval"):
                model.eval()
            self.cand_model = model
            self.sync()
        except Stop:
            raise
        except BaseException as error:
            failed = build_failure(error, self.source)  # a compile in __init__
            raise failed or runtime_failure(error, "constructing ModelNew") from error
        self.check_guards("constructing ModelNew")

    # -- calls

    def call(self, inputs: list[Any], seed: int) -> Any:
        G.manual_seed(seed)
        out = self.cand_model(*inputs)
        self.sync()
        return out

    def checked_call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Call ModelNew on the judge's inputs (or, for the cache probe, on the last call's own
        tensors refilled in place with them) and write the output for the judge."""
        stage = str(request.get("stage", "a call"))
        fresh = self.read(str(request["inputs"]))
        if request.get("refill"):
            if self.last_inputs is None:
                raise ValueError("a refill needs an earlier call")
            inputs = self.last_inputs
            with torch.no_grad():
                for buffer, value in zip(leaves(inputs), leaves(fresh), strict=True):
                    if isinstance(buffer, torch.Tensor):
                        buffer.copy_(value)
        else:
            inputs = fresh
        original = clone_tree(inputs)
        if request.get("poison", True):
            poison_free_memory(self.specs, self.device)
        try:
            out = self.call(inputs, int(request["seed"]))
        except Stop:
            raise
        except BaseException as error:
            raise runtime_failure(error, f"calling ModelNew in {stage}") from error
        self.check_guards(stage, identities=False)
        problems = check_materialised(out, self.device)
        if problems:
            self.reasons.extend(problems)
            raise Stop("rejected" if any(R.is_rejecting(p) for p in problems) else "incorrect", [])
        if has_poison(out):
            self.reasons.append(
                R.reason(R.STALE_MEMORY, f"the output holds freed memory it never wrote ({stage})")
            )
            raise Stop("rejected", [])
        changed = inputs_equal(inputs, original)
        if changed:
            self.reasons.append(
                R.reason(R.INPUT_MUTATED, f"the candidate changed its input(s) {changed} in place ({stage})")
            )
            raise Stop("rejected", [])
        write_tree(self.path(str(request["output"])), out)
        self.last_inputs = inputs
        return {}

    def traced_call(self, request: dict[str, Any]) -> dict[str, Any]:
        inputs = self.read(str(request["inputs"]))
        tracer = OpTrace(G.snapshot_flags())
        G.manual_seed(int(request["seed"]))
        try:
            with tracer:
                out = self.cand_model(*inputs)
            self.sync()
        except Exception as error:
            self.check_guards("the traced call")
            return {"trace": None, "trace_error": f"{type(error).__name__}: {str(error)[:300]}"}
        self.check_guards("the traced call")
        problems = check_materialised(out, self.device)
        if problems:
            self.reasons.extend(problems)
            raise Stop("rejected" if any(R.is_rejecting(p) for p in problems) else "incorrect", [])
        write_tree(self.path(str(request["output"])), out)
        return {
            "trace": {
                "low": {dtype: sorted(ops) for dtype, ops in tracer.low_precision().items()},
                "flags": {name: [repr(value), op] for name, (value, op) in tracer.flag_changes.items()},
                "compute_ops": sorted(tracer.compute_ops),
            }
        }

    def kernels(self, request: dict[str, Any]) -> dict[str, Any]:
        inputs = self.read(str(request["inputs"]))
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.call(inputs, 0)
            return {"kernels": [event.key for event in prof.key_averages()]}
        except Exception as error:
            return {"kernels": None, "error": f"{type(error).__name__}: {str(error)[:300]}"}

    def native_threads(self) -> dict[str, Any]:
        new = G.os_thread_ids() - self.os_threads - G.python_native_ids()
        if new:
            self.reasons.append(
                R.reason(R.NATIVE_THREADS, f"{len(new)} native threads appeared while the candidate ran")
            )
        return {}

    def native_threads_request(self, _: dict[str, Any]) -> dict[str, Any]:
        return self.native_threads()

    # -- timing

    def load_bank(self, request: dict[str, Any]) -> dict[str, Any]:
        sets = [self.read(f"{request['prefix']}-{index}") for index in range(int(request["count"]))]
        self.bank = InputBank(sets)
        self.buffers = clone_tree(sets[0])
        return {}

    def set_clock(self, request: dict[str, Any]) -> dict[str, Any]:
        flush_bytes = int(request["flush_bytes"])
        self.flush = (
            torch.empty(flush_bytes, dtype=torch.uint8, device=self.device) if flush_bytes > 0 else None
        )
        self.clock = clock_for(request, self.device, self.flush)
        pin_timing_thread(request.get("cpu"))
        return {}

    def round(self, request: dict[str, Any]) -> dict[str, Any]:
        """One timed call. The request does not say whether the judge will check this round's
        output: the output is held until the next round, and `ship_round` sends it when asked,
        after the call (a candidate that found the request in its caller's frames could
        otherwise do the work on checked rounds only)."""
        assert self.bank is not None and self.clock is not None
        self.kept = None  # the last round's output, freed before this round's call
        buffers = self.buffers
        model = self.cand_model
        moves = [tuple(m) if m is not None else None for m in request["moves"]]
        self.bank.fill(self.buffers, int(request["index"]), moves)
        if self.flush is not None:
            self.flush.zero_()
        G.manual_seed(int(request["seed"]))
        self.clock.sync()
        elapsed, naive, spill, out = self.clock.measure(lambda: model(*buffers))
        answer: dict[str, Any] = {"ms": elapsed, "naive": naive, "spill": spill}
        problems = check_materialised(out, self.device)
        if problems:
            answer["problem"] = R.reason(
                R.LAZY_OUTPUT, "an output during timing was not a plain materialised tensor"
            )
        else:
            self.kept = out
        del out
        return answer

    def ship_round(self, request: dict[str, Any]) -> dict[str, Any]:
        """The last round's output, for the judge to compare with the reference's."""
        out, self.kept = self.kept, None
        if out is None:
            raise ValueError("ship_round without a timed round to ship")
        if has_poison(out):
            return {
                "problem": R.reason(
                    R.STALE_MEMORY, "an output during timing held freed memory it never wrote"
                )
            }
        write_tree(self.path(str(request["output"])), out)
        return {}

    def guards(self, request: dict[str, Any]) -> dict[str, Any]:
        self.check_guards(
            str(request.get("stage", "the evaluation")), identities=bool(request.get("identities", True))
        )
        return {}


def _build(setup: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Compile the candidate's C++/CUDA extensions into the build cache.

    Most published candidates call `load_inline` in `ModelNew.__init__` or on their first
    forward, not at import: importing alone would leave the compile to the evaluation itself,
    where it holds one of the device's slots for a minute. So, when the task's reference comes
    along, the build also constructs `ModelNew` with the task's init inputs and calls it once
    on the task's inputs, on the evaluation's device. That warm-up only fills the cache: its
    failures (other than a build error) are left for the evaluation to find and report.
    """
    source = str(setup["candidate"])
    try:
        module = load_module(source, scratch, "kf_build")
    except BaseException as error:
        stop = _import_failure(error, source)
        return {"stop": stop.verdict, "reasons": stop.reasons}
    reference = setup.get("reference")
    if reference and hasattr(module, "ModelNew"):
        try:
            config = EvalConfig.model_validate(setup["config"]) if "config" in setup else None
            _warm_up(module, str(reference), scratch, str(setup.get("device", "cpu")), config)
        except BaseException as error:
            failed = build_failure(error, source)
            if failed is not None:
                return {"stop": failed.verdict, "reasons": failed.reasons}
    return {"built": True}


def _warm_up(module: Any, reference: str, scratch: Path, device_name: str, config: EvalConfig | None) -> None:
    """One call of ModelNew on the task's inputs, under the evaluation's torch settings when
    the build was given its config (a torch.compile candidate's cache is keyed by them)."""
    task = load_module(reference, scratch, "kf_build_task", hidden=True)
    device = torch.device("cuda:0" if device_name.startswith("cuda") else "cpu")
    if config is not None:
        prepare_torch(config, device)
    torch.manual_seed(0)
    model = module.ModelNew(*task.get_init_inputs())
    if hasattr(model, "to"):
        model = model.to(device)
    if config is not None and config.profile_rules.eval_mode and hasattr(model, "eval"):
        model.eval()
    inputs = to_device(list(task.get_inputs()), device)
    with torch.set_grad_enabled(config is not None and not config.profile_rules.no_grad):
        model(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(channel: Channel, scratch: Path) -> None:
    """Answer the evaluator's requests until it says goodbye (or goes away)."""
    session: CandidateSession | None = None
    while True:
        try:
            request = channel.receive()
        except (ChannelClosed, OSError):
            return
        op = request.get("op")
        if op == "bye":
            return
        mark = len(session.reasons) if session is not None else 0
        try:
            if op in ("build", "setup") and needs_native_build(str(request.get("candidate", ""))):
                share_builds_across_processes()
            if op == "build":
                answer = _build(request, scratch)
            elif op == "setup":
                _restore_compiled(request.get("compile_cache"))
                session = CandidateSession(request, scratch)
                session.setup_torch()
                init_inputs, _ = read_tree(session.path(str(request["init_inputs"])), _INPUT_LIMIT)
                session.snapshot()
                begin = time.perf_counter()
                session.import_candidate(list(init_inputs))
                session.stages["candidate_load"] = time.perf_counter() - begin
                answer = {"stages": session.stages}
            else:
                if session is None:
                    raise ValueError(f"{op!r} before setup")
                handler = {
                    "call": session.checked_call,
                    "traced": session.traced_call,
                    "kernels": session.kernels,
                    "bank": session.load_bank,
                    "clock": session.set_clock,
                    "round": session.round,
                    "ship_round": session.ship_round,
                    "guards": session.guards,
                    "native_threads": session.native_threads_request,
                }.get(str(op))
                if handler is None:
                    raise ValueError(f"unknown request {op!r}")
                answer = handler(request)
        except Stop as stop:
            answer = {"stop": stop.verdict}
            if session is not None:
                session.reasons.extend(stop.reasons)
            else:
                answer["reasons"] = stop.reasons
        except BaseException as error:  # the evaluator's code here failed: this candidate's fault
            answer = {
                "error": f"{type(error).__name__}: {str(error)[:500]}",
                "trace": traceback.format_exc()[-3000:],
            }
        if session is not None:
            answer.setdefault("reasons", session.reasons[mark:])
            answer["settings"] = {name: repr(value) for name, value in session.settings.items()}
            answer["flag_values"] = {name: _plain(value) for name, value in session.settings.items()}
        with contextlib.suppress(Exception):
            channel.send(answer)
        if op == "build":
            return


def _restore_compiled(cache: Any) -> None:
    """The candidate's sealed torch.compile cache, copied into this process's cache directories
    and checked against its seal before any candidate code runs here (see `_compiled`)."""
    if not isinstance(cache, dict):
        return
    problem = restore(str(cache["root"]), dict(cache["files"]))
    if problem:
        detail = f"its torch.compile cache changed after its build: {problem}"
        raise Stop("rejected", [R.reason(R.COMPILE_CACHE_CHANGED, detail)])


def _plain(value: object) -> Any:
    return value if isinstance(value, bool | int | float | str) or value is None else repr(value)
