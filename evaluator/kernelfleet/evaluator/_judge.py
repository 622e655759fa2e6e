"""The judge's side: the reference, its inputs, its outputs, its timing, and the comparisons.

The judge is a process of its own that never loads candidate code. It makes every input (from
the reference's `get_inputs` and a seed the evaluator chose), writes a copy for the candidate,
computes the reference's output on its own copy, reads back what the candidate wrote, and
compares; it times the reference's half of each timing round. What the candidate's process
sends is read as data (`_wire.read_tree`): a file that lies about itself is the candidate's
failure (`malformed`), never the judge's. A candidate cannot reach the reference's class, its
module or its timing: they live here.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from kernelfleet.core import reasons as R
from kernelfleet.evaluator import _guards as G
from kernelfleet.evaluator._child import Job, ReferenceFailure, Session, baselines, probe
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._outputs import (
    check_materialised,
    clone_tree,
    compare,
    has_poison,
    identical,
    tensor_bytes,
    to_device,
)
from kernelfleet.evaluator._timing import InputBank, _Clock, clock_for, pin_timing_thread
from kernelfleet.evaluator._wire import Channel, ChannelClosed, MalformedTensors, read_tree, write_tree

_SLACK = 1 << 20


class JudgeSession:
    """The reference side of one evaluation."""

    def __init__(self, request: dict[str, Any], scratch: Path) -> None:
        config = EvalConfig.model_validate(request["config"])
        self.job = Job(
            mode="evaluate",
            config=config,
            reference=request["reference"],
            work_dir=str(scratch),
            seed=int(request["seed"]),
        )
        self.session = Session(self.job)
        self.exchange = Path(request["exchange"])
        self.inputs: dict[str, list[Any]] = {}
        self.first_c: Any = None
        self.first_r: Any = None
        self.cand_constant = True
        self.ref_constant = True
        self.trials = 0
        self.bank: InputBank | None = None
        self.buffers: list[Any] = []
        self.kept: Any = None
        self.flush: torch.Tensor | None = None
        self.clock: _Clock | None = None
        self.output_limit = 0

    def path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad exchange name {name!r}")
        return str(self.exchange / name)

    def setup(self) -> dict[str, Any]:
        s = self.session
        s.setup_torch()
        with s.stage("reference"):
            s.load_reference()
        self.output_limit = 4 * sum(spec.nbytes for spec in s.out_specs) + _SLACK
        write_tree(self.path("init"), s.init_inputs)
        trace = s.ref_trace
        return {
            "init": "init",
            "init_seed": s.init_seed,
            "specs": [
                [list(spec.shape), str(spec.dtype).removeprefix("torch."), spec.nbytes]
                for spec in s.out_specs
            ],
            "ref_low": {d: sorted(o) for d, o in trace.low_precision().items()} if trace else {},
            "ref_compute_ops": sorted(trace.compute_ops) if trace else None,
            "dtypes": [str(d).removeprefix("torch.") for d in s.ref_dtypes],
            "stages": dict(s.stages),
        }

    def make_inputs(self, request: dict[str, Any]) -> dict[str, Any]:
        """Fresh inputs for one call, drawn on the device (`Session.made_inputs`) and written to a
        file for the candidate, which never shares the judge's memory. Answers their size, by
        which the evaluation decides whether the next set may be made while the candidate calls."""
        name, s = str(request["name"]), self.session
        with s.stage("judge_inputs_make"):
            made = s.made_inputs(int(request["seed"]))
        with s.stage("judge_inputs_write"):
            write_tree(self.path(name), made)
        with s.stage("judge_inputs_device"):
            self.inputs[name] = list(to_device(made, s.device))
            s.sync()
        return {"bytes": tensor_bytes(made), **self.crossing()}

    def crossing(self) -> dict[str, Any]:
        """The judge's own seconds so far on each part of the correctness calls (making,
        writing and placing inputs; reading the candidate's output, the reference's call, the
        comparison): where a large-input task's correctness time goes."""
        return {"judge_stages": {k: v for k, v in self.session.stages.items() if k.startswith("judge_")}}

    def read_candidate(self, name: str) -> Any:
        """The candidate's output, or a Stop-like answer when the file lies or is misplaced."""
        value, devices = read_tree(self.path(name), self.output_limit, device=self.session.device)
        expected = self.session.device.type
        wrong = [index for index, device in enumerate(devices) if device != expected]
        return value, wrong

    def compare(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            with self.session.stage("judge_compare"):  # judge_reference and judge_output_read too
                answer = self._compare(request)
            return {**answer, **self.crossing()}
        finally:
            self.discard(str(request["inputs"]), str(request["output"]))

    def discard(self, *names: str) -> None:
        """Exchange files that were read: kept, a call's inputs and output filled the
        candidate's scratch on tasks with large inputs (0.27-0.54 GB each) before the timing
        bank was written there, and a sound candidate came out as an evaluator fault."""
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(self.path(name))

    def _compare(self, request: dict[str, Any]) -> dict[str, Any]:
        s = self.session
        inputs = self.inputs.pop(str(request["inputs"]))
        seed = int(request["seed"])
        stage = str(request.get("stage", "a call"))
        with s.stage("judge_reference"):
            out_r = s.reference_output(inputs, seed)
        with s.stage("judge_output_read"):
            out_c, wrong = self.read_candidate(str(request["output"]))
            s.sync()
        if wrong:
            return {
                "ok": False,
                "reasons": [R.reason(R.WRONG_DEVICE, f"output {wrong[0]} was not on {s.device} ({stage})")],
            }
        if has_poison(out_c):
            return {
                "stop": "rejected",
                "reasons": [
                    R.reason(R.STALE_MEMORY, f"the output holds freed memory it never wrote ({stage})")
                ],
            }
        expected = s.ref_dtypes if s.ref64_model is not None else None
        result = compare(out_c, out_r, s.profile, expected)
        if not result.ok:
            if self.first_r is not None and compare(out_c, self.first_r, s.profile).ok:
                return {"cached": True}
            return {
                "ok": False,
                "reasons": [f"{text} ({stage})" for text in result.reasons],
                "max_abs_error": result.max_abs_error,
            }
        if request.get("kind") == "trial":
            self.trials += 1
            if self.first_c is None:
                self.first_c, self.first_r = clone_tree(out_c), clone_tree(out_r)
            else:
                self.cand_constant = self.cand_constant and identical(out_c, self.first_c)
                self.ref_constant = self.ref_constant and identical(out_r, self.first_r)
        return {"ok": True, "max_abs_error": result.max_abs_error}

    def summary(self, _: dict[str, Any]) -> dict[str, Any]:
        return {"cand_constant": self.cand_constant, "ref_constant": self.ref_constant, "trials": self.trials}

    def settings(self, request: dict[str, Any]) -> dict[str, Any]:
        flags = {
            str(k): v
            for k, v in dict(request.get("flags") or {}).items()
            if self.session.profile.allows(str(k), v)
        }
        G.restore_flags(flags)
        return {"applied": sorted(flags)}

    def make_bank(self, request: dict[str, Any]) -> dict[str, Any]:
        s = self.session
        seeds = [int(x) for x in request["seeds"]]
        first = s.inputs(seeds[0])
        count = min(len(seeds), s.bank_count(first))
        sets = [first] + [s.inputs(seed) for seed in seeds[1:count]]
        prefix = str(request["prefix"])
        for index, inputs in enumerate(sets):
            write_tree(self.path(f"{prefix}-{index}"), inputs)
        self.bank = InputBank(sets)
        self.buffers = clone_tree(sets[0])
        return {"count": count, "numels": self.bank.numels}

    def make_clock(self, request: dict[str, Any]) -> dict[str, Any]:
        """The timing's clock, once the evaluation holds the device's timing lane: the lead's
        writes are calibrated on a quiet device (the candidate's side is given the same count)."""
        flush_bytes = int(request["flush_bytes"])
        device = self.session.device
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes > 0 else None
        self.clock = clock_for(request, device, self.flush)
        pin_timing_thread(request.get("cpu"))
        return {"reps": self.clock.lead_reps}

    def round(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.bank is not None and self.clock is not None
        buffers, model = self.buffers, self.session.ref_model
        moves = [tuple(m) if m is not None else None for m in request["moves"]]
        self.bank.fill(self.buffers, int(request["index"]), moves)
        if self.flush is not None:
            self.flush.zero_()
        G.manual_seed(int(request["seed"]))
        self.clock.sync()
        elapsed, naive, spill, out = self.clock.measure(lambda: model(*buffers))
        check_materialised(out, self.session.device)  # the candidate's side does it too: same cost
        if request.get("keep"):
            self.kept = clone_tree(out)
        del out
        return {"ms": elapsed, "naive": naive, "spill": spill}

    def check_round(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            out_c, wrong = self.read_candidate(str(request["output"]))
        finally:
            self.discard(str(request["output"]))
        kept, self.kept = self.kept, None
        ok = not wrong and compare(out_c, kept, self.session.profile, measure_error=False).ok
        return {"ok": ok}


def serve(channel: Channel, scratch: Path) -> None:
    """Answer the evaluator's requests until it says goodbye (or goes away)."""
    judge: JudgeSession | None = None
    while True:
        try:
            request = channel.receive()
        except (ChannelClosed, OSError):
            return
        op = request.get("op")
        if op == "bye":
            return
        try:
            if op == "setup":
                judge = JudgeSession(request, scratch)
                answer = judge.setup()
            elif op in ("baselines", "probe"):
                config = EvalConfig.model_validate(request["config"])
                job = Job(
                    mode=str(op),
                    config=config,
                    reference=request.get("reference", ""),
                    work_dir=str(scratch),
                    seed=int(request.get("seed", 0)),
                )
                answer = baselines(job) if op == "baselines" else probe(job)
            else:
                if judge is None:
                    raise ValueError(f"{op!r} before setup")
                handler = {
                    "inputs": judge.make_inputs,
                    "compare": judge.compare,
                    "summary": judge.summary,
                    "settings": judge.settings,
                    "bank": judge.make_bank,
                    "clock": judge.make_clock,
                    "round": judge.round,
                    "check_round": judge.check_round,
                }.get(str(op))
                if handler is None:
                    raise ValueError(f"unknown request {op!r}")
                answer = handler(request)
        except ReferenceFailure as error:
            answer = {"reference_error": str(error)}
        except MalformedTensors as error:
            answer = {"malformed": str(error)}
        except BaseException as error:
            answer = {
                "error": f"{type(error).__name__}: {str(error)[:500]}",
                "trace": traceback.format_exc()[-3000:],
            }
        with contextlib.suppress(Exception):
            channel.send(_jsonable(answer))
        if op in ("baselines", "probe"):
            return


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return repr(value)
