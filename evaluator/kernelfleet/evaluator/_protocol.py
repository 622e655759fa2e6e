"""One evaluation, driven from the evaluator's process: the judge on one side, the candidate on
the other, and every verdict derived here from facts checked here.

The evaluator forks two children from the sandbox: the judge (`_judge`: the reference, the
inputs, the comparisons, the reference's timing) and the candidate (`_candidate`: the only
process that loads candidate code, walled in). Neither drives the evaluation; this module
does, one request at a time:

1. the judge loads the reference and writes the init inputs; the candidate imports ModelNew;
2. each correctness trial: the judge writes fresh inputs, the candidate calls ModelNew on a
   copy and writes its output, the judge compares it with the reference's output on its own
   copy (then the cache probe, then one traced call); the judge makes the next call's inputs
   while the candidate calls, where scratch permits;
3. timing, with the device's timing lane held: both sides load the same input bank; each round
   this process draws the inputs, the perturbation, the seed and the order, and asks each side
   in turn to time its call; some rounds, chosen after the fact, the candidate's output is
   shipped to the judge and compared with the reference's for the same inputs. Every round is
   also timed from here, outside both processes, and a candidate whose own numbers fall short
   of that outside clock by more than the judge's do is rejected (`clock-mismatch`).

What the candidate's process says is evidence against it only: a rejection it reports stands,
but nothing it reports can make a result correct or fast. If it dies, the verdict says how
(`crashed`); if its answers are not what the protocol asks (the evaluator's own code there
failed or was rebound), the candidate is `rejected` with `harness-broken`. The run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kernelfleet.core import reasons as R
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._cputime import tree_cpu_seconds
from kernelfleet.evaluator._gpugate import GateCancelled, GpuGate
from kernelfleet.evaluator._guards import PRECISION_FLAGS
from kernelfleet.evaluator._ops import builds_custom_kernel, declared_kernels, fallback_sets
from kernelfleet.evaluator._sandbox import Sandbox, SandboxChild, SandboxError, Walls, descendants, host_pid
from kernelfleet.evaluator._timing import (
    AdaptiveTiming,
    TimingRun,
    adaptive_timing,
    decide,
    escaped_work_ms,
    stats,
)
from kernelfleet.evaluator._wire import ChannelClosed, ProtocolError

_FLOATING = {"float16", "bfloat16", "float32", "float64"}
_UNGATED = frozenset({"setup", "build", "bye"})  # requests that are no GPU step (see _gpu_step)
_SPOT_RATE = 0.1  # share of timed rounds whose candidate output the judge checks
_CHECK_EVERY = 4  # with a reference bank, the reference is timed on every 4th round: the drift check
BUILD_NICENESS = 10  # the build pool's processes and compilers; timing and correctness run at 0
_MIN_BATCH_ROUNDS = 21  # a batch cut short by timing_batch_s still has 3 rounds per time bucket


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What came of one evaluation: the answer (as the old single child gave it), or why not."""

    answer: dict[str, Any] | None
    timed_out: bool = False
    cancelled: bool = False
    exit_description: str = ""
    log: str = ""
    seconds: float = 0.0
    counted_s: float = 0.0  # of `seconds`, what counts against the timeout: waits for the device excluded
    isolation: str = ""


class _Stop(Exception):
    def __init__(self, verdict: str, reasons: list[str] | None = None) -> None:
        super().__init__(verdict)
        self.verdict = verdict
        self.reasons = reasons or []


class _Timeout(Exception):
    pass


class _Cancelled(Exception):
    pass


class _CandidateDied(Exception):
    pass


class _JudgeFailed(Exception):
    pass


@dataclasses.dataclass
class Sides:
    """How the two children are walled in (the sandbox and level decide)."""

    level: str
    candidate: Walls
    judge: Walls
    env: dict[str, str]
    # The children run torch.compile: the zygote readies inductor once before it forks them.
    compiles: bool = False


class Evaluation:
    """Drives one evaluation (or one build, or one baseline/probe job) over the sandbox."""

    def __init__(
        self,
        sandbox: Sandbox,
        sides: Sides,
        config: EvalConfig,
        reference: str,
        candidate: str,
        seed: int,
        *,
        timeout: float,
        cancel: threading.Event | None = None,
        take_lane: Callable[[], None] | None = None,
        release_lane: Callable[[], None] | None = None,
        reference_bank: Callable[[dict[str, str]], list[float] | None] | None = None,
        keep_reference: Callable[[dict[str, str], list[float]], None] | None = None,
        gpu_gate: GpuGate | None = None,
        timing_cpu: int | None = None,
        compile_cache: dict[str, Any] | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.sides = sides
        self.config = config
        self.profile = config.profile_rules
        self.reference = reference
        self.code = candidate
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.cancel = cancel
        self.take_lane = take_lane
        self.release_lane = release_lane
        # The reference's timing samples from an earlier evaluation of this task on this device
        # with these settings (see `Evaluator._reference_bank`); None: time both sides paired.
        self.reference_bank = reference_bank
        # Told the reference's samples as soon as a paired timing has passed its checks (before
        # the lane is released), so that the next candidate of the task can already reuse them.
        self.keep_reference = keep_reference
        # The device's gate: GPU steps wait while another evaluation times (see _gpugate).
        self.gpu_gate = gpu_gate
        # Both sides' timing threads run on this CPU (EvalConfig.pin_timing); None: anywhere.
        self.timing_cpu = timing_cpu
        # The candidate's sealed torch.compile cache ({"root", "files"}, see _compiled): each
        # candidate process restores it before it loads the candidate.
        self.compile_cache = compile_cache
        self.timing_now = False  # this evaluation holds the timing lane: its steps pass
        # What it does or waits for now, in words: the progress line and the watchdog name it
        # (`activity`).
        self.phase = "starting its processes"
        self.reasons: list[str] = []
        self.settings: dict[str, str] = {}
        self.flag_values: dict[str, Any] = {}
        self.forwarded: set[str] = set()
        self.stages: dict[str, float] = {}
        self.judge_stages: dict[str, float] = {}  # the judge's parts of correctness (_note_crossing)
        self.max_abs_error: float | None = None
        self.judge: SandboxChild | None = None
        self.cand: SandboxChild | None = None
        self.deadline = 0.0
        self.dtypes: list[str] = []
        self.ref_low: dict[str, list[str]] = {}
        self.ref_compute: set[str] | None = None
        self.names = 0
        # Input sets: the judge may make the next call's inputs while the candidate runs this
        # one (see `_inputs`); `judge_owes` counts its answers not yet read.
        self.ahead: str | None = None
        self.input_bytes: int | None = None
        self.output_bytes = 0
        self.judge_owes = 0

    # ------------------------------------------------------------ plumbing

    def _spawn(self, role: str, walls: Walls, env: dict[str, str]) -> SandboxChild:
        self._note_start()
        try:
            return self.sandbox.spawn(role, walls, env, compiles=self.sides.compiles)
        except SandboxError as error:
            raise _JudgeFailed(f"the sandbox could not start the {role}: {error}") from None

    def _note_start(self) -> None:
        """The phase while a process starts: what the sandbox may make it wait for."""
        waits = self.sandbox.waits_on(self.sides.compiles)
        self.phase = "starting its processes" + (f" ({waits})" if waits else "")

    @contextlib.contextmanager
    def _lane_held(self) -> Iterator[float]:
        """This device's timing lane, held for the block (this evaluation's own GPU steps pass the
        gate meanwhile); yields the seconds waited for it, which are not the candidate's time."""
        begin = time.monotonic()
        if self.take_lane is not None:
            self.phase = "waiting for the device's timing lane"
            self.take_lane()
        waited = time.monotonic() - begin
        self.deadline += waited
        self.timing_now = True
        self.phase = "timing"
        try:
            yield waited
        finally:
            self.timing_now = False
            if self.release_lane is not None:
                self.release_lane()

    def _device_quiet(self) -> contextlib.AbstractContextManager[None]:
        """The device's gate closed for the block: other evaluations' GPU steps wait, and their
        candidates' processes are stopped."""
        return self.gpu_gate.quiet(self) if self.gpu_gate is not None else contextlib.nullcontext()

    def _hold_candidate(self) -> None:
        """From its load on, the candidate's process is stopped while another evaluation times a
        batch (see _gpugate): no process or thread of its own may reach the device then. Its load is
        not held: imports and the model's construction run beside timings, as set-up."""
        if self.gpu_gate is not None and self.cand is not None:
            self.gpu_gate.hold(self, host_pid(self.sandbox, self.cand))

    def activity(self) -> tuple[str, float, bool]:
        """What the evaluation does now, the CPU seconds its processes have used so far (the
        build's, or the judge's and the candidate's, compilers included), and whether one of
        them is running or waiting for a CPU."""
        cpu, runnable = 0.0, False
        for child in (self.judge, self.cand):
            pid = host_pid(self.sandbox, child) if child is not None else 0
            if pid:
                cpu += tree_cpu_seconds(pid)
                runnable = runnable or _runnable(pid)
        return self.phase, cpu, runnable

    def _receive(self, child: SandboxChild) -> dict[str, Any]:
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise _Cancelled()
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout()
            try:
                return child.channel.receive(timeout=min(0.25, remaining))
            except TimeoutError:
                continue

    @contextlib.contextmanager
    def _gpu_step(self, message: dict[str, Any]) -> Iterator[None]:
        """A request that runs GPU work waits while another evaluation times on the device;
        that wait is not the candidate's time. Set-up requests (imports, the candidate's load)
        and this evaluation's own timing pass at once."""
        if self.gpu_gate is None or self.timing_now or message.get("op") in _UNGATED:
            yield
            return
        try:
            phase, self.phase = self.phase, "waiting for the device's gate (another evaluation is timing)"
            with self.gpu_gate.step(self.cancel, self) as waited:
                self.phase = phase
                self.deadline += waited
                self.stages["gpu_wait"] = self.stages.get("gpu_wait", 0.0) + waited
                yield
        except GateCancelled:
            raise _Cancelled() from None

    def ask_judge(self, message: dict[str, Any]) -> dict[str, Any]:
        self._settle_judge()
        with self._gpu_step(message):
            self._post_judge(message)
            return self._settle_judge()

    def _post_judge(self, message: dict[str, Any]) -> None:
        """Send the judge a request whose answer `_settle_judge` reads (later, for a request
        made while the candidate works)."""
        assert self.judge is not None
        try:
            self.judge.channel.send(message)
        except (ChannelClosed, OSError):
            self.judge.wait(2)
            raise _JudgeFailed(f"the judge's process {self.judge.exit_description}") from None
        self.judge_owes += 1

    def _settle_judge(self) -> dict[str, Any]:
        """Read every answer the judge owes, in order; the last one (empty when none was owed)."""
        assert self.judge is not None
        answer: dict[str, Any] = {}
        while self.judge_owes:
            try:
                raw = self._receive(self.judge)
            except (ChannelClosed, OSError):
                self.judge.wait(2)
                raise _JudgeFailed(f"the judge's process {self.judge.exit_description}") from None
            except ProtocolError as error:
                raise _JudgeFailed(f"the judge answered with an invalid message: {error}") from None
            self.judge_owes -= 1
            answer = self._judge_answer(raw)
            self._note_crossing(answer)
        return answer

    def _note_crossing(self, answer: dict[str, Any]) -> None:
        """The judge's running totals of its parts of the correctness calls (`JudgeSession.crossing`),
        kept to report beside this side's own (`_call`)."""
        stages = answer.get("judge_stages")
        if isinstance(stages, dict):
            self.judge_stages = {
                k: float(v) for k, v in stages.items() if isinstance(k, str) and isinstance(v, int | float)
            }

    def _judge_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        if "error" in answer:
            raise _JudgeFailed(f"the judge failed: {answer['error']}\n{answer.get('trace', '')}")
        if "malformed" in answer:
            raise _Stop(
                "rejected",
                [
                    R.reason(
                        R.MALFORMED_OUTPUT, f"the candidate's output file was refused: {answer['malformed']}"
                    )
                ],
            )
        return answer

    def ask(
        self, message: dict[str, Any], *, judge_meanwhile: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One request to the candidate's process; its reasons and settings are collected, a
        `stop` it reports ends the evaluation with that verdict. `judge_meanwhile` goes to the
        judge at the same time, and the step lasts until both have answered: the judge's work
        places tensors on the device too, and a step that ended with the candidate's answer let
        that run on while another evaluation timed (0.8.5)."""
        assert self.cand is not None
        try:
            with self._gpu_step(message):
                if judge_meanwhile is not None:
                    self._post_judge(judge_meanwhile)
                self.cand.channel.send(message)
                answer = self._receive(self.cand)
                self._settle_judge()
        except (ChannelClosed, OSError):
            self.cand.wait(2)
            raise _CandidateDied() from None
        except ProtocolError as error:
            raise _Stop(
                "rejected", [_broken(f"its process answered with an invalid message ({error})")]
            ) from None
        return self._candidate_answer(answer)

    def _candidate_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        reasons = answer.get("reasons", [])
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            raise _Stop("rejected", [_broken("its process answered reasons that are not a list of strings")])
        for text in reasons:
            if text not in self.reasons:
                self.reasons.append(text[:2000])
        self._note_settings(answer)
        if "error" in answer:
            raise _Stop(
                "rejected",
                [
                    _broken(
                        "the evaluator's code in the candidate's process failed: "
                        f"{str(answer['error'])[:600]}"
                    )
                ],
            )
        if "stop" in answer:
            verdict = answer["stop"]
            if verdict not in ("rejected", "incorrect", "compile_error", "runtime_error"):
                raise _Stop("rejected", [_broken(f"its process answered the verdict {str(verdict)[:80]!r}")])
            raise _Stop(str(verdict))
        return answer

    def _note_settings(self, answer: dict[str, Any]) -> None:
        values = answer.get("flag_values")
        if not isinstance(values, dict):
            return
        for name, value in values.items():
            if not isinstance(name, str) or not self.profile.allows(name, value):
                continue
            self.flag_values[name] = value
            self.settings[name] = repr(value)

    def _forward_settings(self) -> None:
        """Settings the candidate adopted (cudnn.benchmark, TF32 where allowed) apply to the
        reference too: they are settings any user makes, so both sides run with them."""
        new = {k: v for k, v in self.flag_values.items() if k not in self.forwarded}
        if new and self.judge is not None:
            self.ask_judge({"op": "settings", "flags": new})
            self.forwarded.update(new)

    def name(self, stem: str) -> str:
        """A fresh exchange-file name. The candidate owns the exchange directory: a name it could
        guess, it could take first, and the judge's write (never through an existing name) would
        fail as the judge's own error; a random part leaves it nothing to plant."""
        self.names += 1
        return f"{stem}-{self.names}-{secrets.token_hex(6)}"

    @contextlib.contextmanager
    def stage(self, name: str) -> Any:
        begin = time.monotonic()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.monotonic() - begin

    def _merge_stages(self, answer: dict[str, Any]) -> None:
        stages = answer.get("stages")
        if isinstance(stages, dict):
            for key, value in stages.items():
                if (
                    isinstance(key, str)
                    and isinstance(value, int | float)
                    and key in ("cuda_init", "reference")
                ):
                    self.stages[key] = self.stages.get(key, 0.0) + float(value)

    def _close(self, orderly: bool) -> str:
        """End both children (a goodbye when all went well, a kill otherwise); the candidate's log."""
        if self.gpu_gate is not None:
            self.gpu_gate.release(self)  # running, so that it can hear the goodbye
        log = ""
        for child in (self.judge, self.cand):
            if child is None:
                continue
            if orderly:
                with contextlib.suppress(ChannelClosed, OSError):
                    child.channel.send({"op": "bye"})
            else:
                child.kill()
        for child in (self.cand, self.judge):
            if child is None:
                continue
            if not child.wait(5):
                child.kill()
            if child is self.cand:
                log = child.log_tail()
            child.close()
        return log

    # ------------------------------------------------------------ the evaluation

    def run(self) -> Outcome:
        started = time.monotonic()
        self.deadline = started + self.timeout
        answer: dict[str, Any] | None = None
        timed_out = cancelled = False
        description = ""
        try:
            answer = self._evaluate()
        except _Timeout:
            timed_out = True
        except _Cancelled:
            cancelled = True
        except _CandidateDied:
            assert self.cand is not None
            description = self.cand.exit_description
        except _JudgeFailed as error:
            answer = {"status": "judge-error", "error": str(error)[-3000:]}
        finally:
            log = self._close(orderly=answer is not None and answer.get("status") == "ok")
            if self.judge is not None and answer is not None and answer.get("status") == "judge-error":
                answer["error"] += "\n" + self.judge.log_tail(2000)
        return Outcome(
            answer,
            timed_out=timed_out,
            cancelled=cancelled,
            exit_description=description,
            log=log,
            seconds=time.monotonic() - started,
            counted_s=max(0.0, self.timeout - (self.deadline - time.monotonic())),
            isolation=self.sides.level,
        )

    def _evaluate(self) -> dict[str, Any]:
        config = self.config
        with self.stage("process_start"):
            self.judge = self._spawn("judge", self.sides.judge, self.sides.env)
            self.cand = self._spawn("candidate", self.sides.candidate, self.sides.env)
        self.phase = "loading the reference"
        setup = self.ask_judge(
            {
                "op": "setup",
                "config": config.model_dump(mode="json"),
                "reference": self.reference,
                "seed": self.rng.getrandbits(31),
                "exchange": f"{self.cand.scratch}/xchg",
            }
        )
        if "reference_error" in setup:
            return {"status": "reference-error", "error": str(setup["reference_error"])}
        self._merge_stages(setup)
        self.output_bytes = sum(int(spec[2]) for spec in setup.get("specs", []))
        self.dtypes = [str(d) for d in setup.get("dtypes", [])]
        self.ref_low = dict(setup.get("ref_low") or {})
        ops = setup.get("ref_compute_ops")
        self.ref_compute = set(ops) if isinstance(ops, list) else None
        verdict = "correct"
        timing: dict[str, Any] = {}
        loaded = False
        try:
            self.phase = "loading the candidate"
            with self.stage("candidate_load"):
                answer = self.ask(
                    {
                        "op": "setup",
                        "config": config.model_dump(mode="json"),
                        "candidate": self.code,
                        "seed": self.rng.getrandbits(31),
                        "init_seed": setup["init_seed"],
                        "specs": setup["specs"],
                        "init_inputs": setup["init"],
                        **({"compile_cache": self.compile_cache} if self.compile_cache is not None else {}),
                    }
                )
            self._merge_stages(answer)
            loaded = True
            self._hold_candidate()
            self.phase = "checking correctness" + (
                "" if self.compile_cache is None else " (torch.compile restored from its build)"
            )
            with self.stage("correctness"):
                self._correctness()
                self._inspect()
            self.ask({"op": "native_threads"})
            if config.timing.enabled:
                timing = self._timed()
            if any(R.is_rejecting(text) for text in self.reasons):
                verdict = "rejected"
        except _Stop as stop:
            for text in stop.reasons:
                if text not in self.reasons:
                    self.reasons.append(text)
            verdict = stop.verdict
        if loaded and verdict in ("correct", "incorrect"):
            with contextlib.suppress(_Stop):
                self.ask({"op": "guards", "stage": "the evaluation"})  # a last full look
        if verdict in ("correct", "incorrect") and any(R.is_rejecting(t) for t in self.reasons):
            verdict = "rejected"
            timing = {k: v for k, v in timing.items() if k in ("reference_ms", "candidate_ms")}
        return {
            "status": "ok",
            "verdict": verdict,
            "reasons": self.reasons,
            "max_abs_error": self.max_abs_error,
            "settings": dict(self.settings),
            "stages": {**self.stages, **self.judge_stages},
            **timing,
        }

    # ------------------------------------------------------------ correctness

    def _inputs(self, stem: str) -> str:
        """A fresh input set for the candidate's next call: the one the judge made during its
        last call, or one made now."""
        self._settle_judge()
        if self.ahead is not None:
            name, self.ahead = self.ahead, None
            return name
        name = self.name(stem)
        made = self.ask_judge({"op": "inputs", "seed": self.rng.getrandbits(31), "name": name})
        self.input_bytes = made.get("bytes") if isinstance(made.get("bytes"), int) else None
        return name

    def _inputs_meanwhile(self) -> dict[str, Any] | None:
        """The judge's request for the next call's inputs, to be made while the candidate runs
        this call, or None when two sets and an output might not fit the candidate's scratch
        (there they wait their turn, as before). The judge is otherwise idle while the candidate
        calls, and for large inputs (40 of the 248 v0 tasks make more than 50 MB) making them
        is a third of a correctness call."""
        sets = None if self.input_bytes is None else 2 * self.input_bytes + self.output_bytes
        if sets is None or sets > self.config.limits.scratch_bytes // 4:
            return None
        self.ahead = self.name("in")
        return {"op": "inputs", "seed": self.rng.getrandbits(31), "name": self.ahead}

    def _call(self, stage: str, *, refill: bool = False, kind: str = "trial") -> dict[str, Any]:
        """Fresh inputs from the judge, a call in the candidate, the judge's comparison; the
        judge makes the next call's inputs while the candidate calls (`_inputs_meanwhile`)."""
        with self.stage("correctness_inputs"):  # what the candidate waits for them
            inputs, output = self._inputs("in"), self.name("out")
        seed_call = self.rng.getrandbits(31)
        with self.stage("correctness_calls"):  # and the next inputs, made meanwhile
            self.ask(
                {
                    "op": "call",
                    "inputs": inputs,
                    "seed": seed_call,
                    "output": output,
                    "stage": stage,
                    "refill": refill,
                },
                judge_meanwhile=self._inputs_meanwhile(),
            )
        self._forward_settings()
        with self.stage("correctness_compare"):
            return self.ask_judge(
                {
                    "op": "compare",
                    "inputs": inputs,
                    "output": output,
                    "seed": seed_call,
                    "stage": stage,
                    "kind": kind,
                }
            )

    def _note_error(self, value: Any) -> None:
        if isinstance(value, int | float):
            self.max_abs_error = (
                float(value) if self.max_abs_error is None else max(self.max_abs_error, float(value))
            )

    def _judged(self, answer: dict[str, Any], stage: str) -> None:
        if "stop" in answer:
            raise _Stop(str(answer["stop"]), list(answer.get("reasons", [])))
        if answer.get("cached"):
            raise _Stop(
                "rejected",
                [
                    R.reason(
                        R.CACHED_OUTPUT,
                        f"{stage} returned the result for the inputs of trial 1 (a cache across calls)",
                    )
                ],
            )
        self._note_error(answer.get("max_abs_error"))
        if not answer.get("ok"):
            self.reasons.extend(str(t) for t in answer.get("reasons", []))
            self._diagnose()
            raise _Stop("rejected" if any(R.is_rejecting(t) for t in self.reasons) else "incorrect")

    def _correctness(self) -> None:
        trials = self.config.correctness.trials
        for trial in range(trials):
            stage = f"correctness trial {trial + 1}"
            self._judged(self._call(stage), stage)
        summary = self.ask_judge({"op": "summary"})
        if trials >= 2 and summary.get("cand_constant") and not summary.get("ref_constant"):
            raise _Stop(
                "rejected",
                [
                    R.reason(
                        R.CONSTANT_OUTPUT,
                        f"the candidate returned bit-identical outputs for {trials} different inputs, "
                        "the reference did not",
                    )
                ],
            )
        if trials >= 2 and summary.get("ref_constant"):
            self.reasons.append(
                R.reason(R.DEGENERATE_TASK, "the reference's output does not depend on its inputs")
            )
        # The cache probe: the very tensors of the last call, refilled in place with new values.
        answer = self._call("the cache probe", refill=True, kind="probe")
        if "stop" in answer or not answer.get("ok") or answer.get("cached"):
            if "stop" in answer:
                raise _Stop(str(answer["stop"]), list(answer.get("reasons", [])))
            raise _Stop(
                "rejected",
                [
                    R.reason(
                        R.CACHED_OUTPUT,
                        "after its input tensors were refilled in place with new values, the candidate "
                        "returned a stale result (a cache keyed by pointer or shape)",
                    )
                ],
            )

    def _traced(self, stem: str) -> tuple[dict[str, Any] | None, str, str, str, int]:
        inputs, output = self._inputs(stem), self.name(f"{stem}-out")
        seed_call = self.rng.getrandbits(31)
        answer = self.ask({"op": "traced", "inputs": inputs, "seed": seed_call, "output": output})
        trace = answer.get("trace")
        if trace is not None and not isinstance(trace, dict):
            raise _Stop("rejected", [_broken("its process answered a trace that is not a mapping")])
        return trace, str(answer.get("trace_error", "")), inputs, output, seed_call

    def _diagnose(self) -> None:
        """After a mismatch, one traced call names a precision downgrade if that is the cause."""
        with contextlib.suppress(_Stop):
            trace, _, _, _, _ = self._traced("diag")
            if trace is not None:
                self._precision(trace)

    def _inspect(self) -> None:
        trace, error, inputs, output, seed = self._traced("traced")
        if trace is None:
            self.reasons.append(R.reason(R.TRACE_UNAVAILABLE, f"the operator trace failed: {error}"))
        else:
            answer = self.ask_judge(
                {
                    "op": "compare",
                    "inputs": inputs,
                    "output": output,
                    "seed": seed,
                    "stage": "the traced call",
                    "kind": "traced",
                }
            )
            if "stop" in answer:
                raise _Stop(str(answer["stop"]), list(answer.get("reasons", [])))
            self._precision(trace)  # a downgrade is named even when it also broke the output
            if not answer.get("ok"):
                self.reasons.extend(str(t) for t in answer.get("reasons", []))
                raise _Stop("rejected" if any(R.is_rejecting(t) for t in self.reasons) else "incorrect")
        if self.config.correctness.require_kernel:
            self._require_kernel(trace)
        if any(R.is_rejecting(text) for text in self.reasons):
            raise _Stop("rejected")

    def _precision(self, trace: dict[str, Any]) -> None:
        floating = [d for d in self.dtypes if d in _FLOATING]
        fp32_task = all(d in ("float32", "float64") for d in floating)
        low = trace.get("low") or {}
        if fp32_task and not self.ref_low and isinstance(low, dict):
            for dtype, ops in sorted(low.items()):
                names = ", ".join(str(o) for o in list(ops)[:4])
                self.reasons.append(
                    R.reason(R.PRECISION_DOWNGRADE, f"an fp32 task computed in {dtype} ({names})")
                )
        flags = trace.get("flags") or {}
        if not isinstance(flags, dict):
            return
        for flag, entry in sorted(flags.items()):
            value, op = (entry[0], entry[1]) if isinstance(entry, list) and len(entry) == 2 else (entry, "?")
            if self.profile.allows(str(flag), value):
                self.flag_values[str(flag)] = value
                self.settings[str(flag)] = repr(value)
                self.reasons.append(
                    R.reason(
                        R.SETTING_APPLIED,
                        f"the candidate sets {flag}={value!r}; applied to the reference as well",
                    )
                )
                continue
            code = R.PRECISION_DOWNGRADE if _is_precision_flag(str(flag)) else R.GLOBAL_FLAG_CHANGED
            self.reasons.append(
                R.reason(code, f"{flag} was {value!r} during the call (at {op}), then restored")
            )

    def _require_kernel(self, trace: dict[str, Any] | None) -> None:
        if not builds_custom_kernel(self.code):
            self.reasons.append(
                R.reason(
                    R.NO_CUSTOM_KERNEL,
                    "a custom kernel is required, but the candidate neither builds a C++/CUDA extension "
                    "nor defines a Triton kernel",
                )
            )
            return
        if trace is not None and self.ref_compute is not None:
            overlap, whole = fallback_sets(self.ref_compute, set(trace.get("compute_ops") or []))
            if whole:
                self.reasons.append(
                    R.reason(
                        R.REFERENCE_FALLBACK, "the candidate dispatches every operator the reference does"
                    )
                )
            elif overlap:
                names = ", ".join(sorted(overlap)[:4])
                self.reasons.append(
                    R.reason(
                        R.TORCH_FALLBACK,
                        f"the candidate still computes {names} with torch, as the reference does",
                    )
                )
        if self.config.device != "cpu":
            declared = declared_kernels(self.code)
            answer = self.ask({"op": "kernels", "inputs": self._inputs("kernels")})
            ran = answer.get("kernels")
            if ran is None:
                self.reasons.append(
                    R.reason(R.TRACE_UNAVAILABLE, f"the CUDA profiler failed: {answer.get('error', '')}")
                )
            elif declared and not any(d in str(name) for d in declared for name in ran):
                names = ", ".join(sorted(declared)[:4])
                self.reasons.append(
                    R.reason(
                        R.CUSTOM_KERNEL_NOT_RUN, f"none of the kernels it defines ({names}) ran on the GPU"
                    )
                )

    # ------------------------------------------------------------ timing

    def _timed(self) -> dict[str, Any]:
        # The timing's input sets are made, written and read before the lane is taken, as GPU
        # steps like correctness: on a task with large inputs that is seconds of CPU work, during
        # which every other evaluation's timing waited (0.8.5). Not for the largest inputs
        # (1:11's 2.1 GB): several evaluations holding such banks while they wait for the lane
        # could fill the device, and an out-of-memory in the candidate's process would read as
        # its fault; those are made with the lane held, one at a time, as before.
        early = self.input_bytes is not None and 8 * self.input_bytes <= self.config.limits.scratch_bytes
        bank = None
        if early:
            with self.stage("timing_inputs"):
                bank = self._timing_inputs()
        with self._lane_held() as waited:
            if self.take_lane is not None:
                self.stages["lane_wait"] = self.stages.get("lane_wait", 0.0) + waited
            self.phase = "timing"
            with self.stage("timing"):
                return self._time_pair(*(bank or self._timing_inputs()))

    def _timing_inputs(self) -> tuple[int, list[int]]:
        """The bank of input sets both sides time on: (how many sets, each input's numel)."""
        prefix = self.name("bank")  # unguessable, as every exchange name (see `name`)
        seeds = [self.rng.getrandbits(31) for _ in range(3)]
        bank = self.ask_judge({"op": "bank", "prefix": prefix, "seeds": seeds})
        count = int(bank["count"])
        self.ask({"op": "bank", "prefix": prefix, "count": count})
        return count, [int(n) for n in bank.get("numels", [])]

    def _time_pair(self, count: int, numels: list[int]) -> dict[str, Any]:
        config = self.config
        self._forward_settings()
        # Both sides time with the same flush and, when pinned, on the same CPU.
        timing = {
            "op": "clock",
            "flush_bytes": config.timing.resolved_flush_bytes(config.device != "cpu"),
            "cpu": self.timing_cpu,
            "lead_us": config.timing.lead_us,
        }
        # The judge measured how many writes make the lead: the candidate's side makes as many.
        self.ask({**timing, "reps": self.ask_judge(timing).get("reps")})
        total = TimingRun({"reference": [], "candidate": []}, {"reference": [], "candidate": []})
        outside: dict[str, list[float]] = {"reference": [], "candidate": []}
        inside: dict[str, list[float]] = {"reference": [], "candidate": []}
        failed: list[tuple[int, str]] = []
        counter = [0]

        def side(
            label: str, message: dict[str, Any]
        ) -> tuple[float, float | None, float | None, float, float, str | None]:
            child = self.judge if label == "reference" else self.cand
            assert child is not None
            # The outside clock reads the exchange alone (send, the side's round, its answer):
            # what this process then does with each answer differs between the two sides.
            begin = time.perf_counter()
            try:
                child.channel.send(message)
                raw = self._receive(child)
            except (ChannelClosed, OSError):
                child.wait(2)
                if label == "candidate":
                    raise _CandidateDied() from None
                raise _JudgeFailed(f"the judge's process {child.exit_description}") from None
            except ProtocolError as error:
                if label == "candidate":
                    raise _Stop(
                        "rejected", [_broken(f"its process answered with an invalid message ({error})")]
                    ) from None
                raise _JudgeFailed(f"the judge answered with an invalid message: {error}") from None
            span = (time.perf_counter() - begin) * 1e3
            answer = self._judge_answer(raw) if label == "reference" else self._candidate_answer(raw)
            ms, naive = answer.get("ms"), answer.get("naive")
            spill = answer.get("spill")
            if (
                not isinstance(ms, int | float)
                or ms < 0
                or (naive is not None and not isinstance(naive, int | float))
                or (spill is not None and not isinstance(spill, int | float))
            ):
                raise _Stop("rejected", [_broken("its process answered a timing that is not a number")])
            if label == "candidate" and self.config.device != "cpu" and (naive is None or spill is None):
                # On a GPU the harness always reports both: without them the side-stream check
                # would have nothing to compare.
                raise _Stop(
                    "rejected", [_broken("its process answered a GPU timing without its stream figures")]
                )
            busy = float(ms)  # what the side's process says it did, for the outside clock
            if label == "candidate" and busy > span + 1.0:
                raise _Stop(
                    "rejected",
                    [
                        R.reason(
                            R.CLOCK_MISMATCH,
                            f"a call it timed at {ms:.3f} ms took {span:.3f} ms from outside",
                        )
                    ],
                )
            problem = answer.get("problem")
            return (
                float(ms),
                float(naive) if naive is not None else None,
                float(spill) if spill is not None else None,
                span,
                busy,
                str(problem) if problem else None,
            )

        light = [False]  # True: the reference runs only on drift-check rounds (and spot checks)

        def measure(rounds: int, first: bool) -> tuple[list[float], list[float]]:
            with self._device_quiet():
                return measure_quietly(rounds, first)

        def measure_quietly(rounds: int, first: bool) -> tuple[list[float], list[float]]:
            warmup = config.timing.warmup if first else 2
            batch: dict[str, list[float]] = {"reference": [], "candidate": []}
            order = ["reference", "candidate"]
            timed_since = 0.0
            for round_index in range(warmup + rounds):
                if round_index == warmup:
                    timed_since = time.monotonic()
                # Slow kernels end a batch on time, so that the settle check (and the exclusive
                # gate's neighbours) come every few seconds, not after `rounds` calls of 100 ms.
                last = round_index == warmup + rounds - 1 or (
                    round_index + 1 - warmup >= _MIN_BATCH_ROUNDS
                    and time.monotonic() - timed_since >= config.timing.batch_s
                )
                counter[0] += 1
                index = self.rng.randrange(count)
                moves = [[self.rng.randrange(n), self.rng.randrange(n)] if n > 1 else None for n in numels]
                seed = self.rng.getrandbits(31)
                self.rng.shuffle(order)
                timed = round_index >= warmup
                keep = timed and (last or self.rng.random() < _SPOT_RATE)
                # Only the judge is told which rounds are checked; the candidate ships its output
                # when asked, after its call.
                message = {"op": "round", "index": index, "moves": moves, "seed": seed}
                messages = {"reference": {**message, "keep": keep}, "candidate": message}
                both = not light[0] or keep or not timed or (round_index - warmup) % _CHECK_EVERY == 0
                results = {}
                for label in order:
                    if both or label == "candidate":
                        results[label] = side(label, messages[label])
                problem = results["candidate"][5]
                if problem is None and keep:
                    output = self.name("round")
                    shipped = self.ask({"op": "ship_round", "output": output}).get("problem")
                    if shipped:
                        problem = str(shipped)
                    elif not self.ask_judge({"op": "check_round", "output": output}).get("ok"):
                        problem = R.reason(
                            R.CACHED_OUTPUT,
                            "during timing the candidate's output differed from the reference's for the same "
                            "inputs (state or a cache across calls)",
                        )
                if problem is not None:
                    failed.append((counter[0], problem))
                if timed:
                    for label in results:
                        ms, naive, spill, span, busy, _ = results[label]
                        batch[label].append(ms)
                        total.samples[label].append(ms)
                        if naive is not None and spill is not None:
                            total.naive[label].append(naive)
                            total.spill.setdefault(label, []).append(spill)
                        if not keep:
                            inside[label].append(busy)
                            outside[label].append(span)
                if last:
                    break
            self.ask({"op": "guards", "stage": "timing"})
            if failed:
                first_round, problem = failed[0]
                raise _Stop("rejected", [f"{problem} (round {first_round}, {len(failed)} rounds)"])
            return batch["reference"], batch["candidate"]

        def timed_rounds(bank: list[float] | None) -> AdaptiveTiming:
            light[0] = bank is not None
            return adaptive_timing(
                measure,
                trials=config.timing.trials,
                extra_batches=config.timing.retries,
                precision=config.timing.precision,
                max_cv=config.timing.max_speedup_cv,
                budget_s=config.timing.budget_s,
                seed=self.rng.getrandbits(31),
                reference_bank=bank,
                drift_tolerance=config.timing.reference_drift,
            )

        known = self.reference_bank(dict(self.settings)) if self.reference_bank is not None else None
        timed = timed_rounds(known)
        reuse: dict[str, Any] = {"paired": True}
        if timed.drifted:
            reuse = {"paired": True, "drift": timed.drift, "bank_rounds": len(known or [])}
            timed = timed_rounds(None)  # the reference moved since the bank was timed: both sides again
        elif known is not None:
            reuse = {"paired": False, "drift": timed.drift, "bank_rounds": len(known)}
            reuse["checks"] = len(timed.checks)
        escaped = escaped_work_ms(total, "candidate", "reference")
        cand_median = stats(timed.candidate).median_ms
        if escaped > max(0.015, 0.1 * cand_median):
            raise _Stop(
                "rejected",
                [
                    R.reason(
                        R.SIDE_STREAM,
                        f"{escaped:.3f} ms of each call ran outside the current stream's order "
                        "(a side stream the caller never waits for)",
                    )
                ],
            )
        mismatch = clock_mismatch(inside, outside)
        if mismatch is not None:
            raise _Stop("rejected", [mismatch])
        estimate = timed.estimate
        speedup, noisy = decide(timed, config.timing.max_speedup_cv)
        if noisy is not None:
            self.reasons.append(R.reason(R.TIMING_NOISY, noisy))
        if reuse["paired"] and self.keep_reference is not None and timed.reference:
            self.keep_reference(dict(self.settings), list(timed.reference))
        return {
            "reference_ms": timed.reference,
            "candidate_ms": timed.candidate,
            # The caller's-stream figure of every timed call, in the same order, for re-analysis
            # (kept in results only with keep_samples).
            "reference_stream_ms": total.naive["reference"],
            "candidate_stream_ms": total.naive["candidate"],
            "speedup": speedup,
            "speedup_ci": [estimate.low, estimate.high] if speedup is not None else None,
            "speedup_cv": estimate.bucket_cv,
            "timing_batches": timed.batches,
            "reference_timing": reuse,
        }

    # ------------------------------------------------------------ other jobs

    def build(self, build_walls: Walls, cpu_limit_s: float) -> Outcome:
        """Import the candidate, build its model and call it once, so that its extensions
        compile (walled in, writing only its build directory). The limit is the build's CPU
        time, compilers included."""
        started = time.monotonic()
        self.deadline = started + self.timeout
        answer: dict[str, Any] | None = None
        timed_out = cancelled = False
        description = ""
        self.cand = self._spawn_build(build_walls)
        self.phase = "building in the build pool" + (" (torch.compile)" if self.sides.compiles else "")
        try:
            pid = host_pid(self.sandbox, self.cand)
            if pid:
                # Compilers are throughput work: at a low priority (inherited by ninja and nvcc)
                # they take no CPU from a timing whose reference is bound by kernel launches.
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, BUILD_NICENESS)
            self.cand.channel.send(
                {
                    "op": "build",
                    "candidate": self.code,
                    "reference": self.reference,
                    "device": self.config.device,
                    "config": self.config.model_dump(mode="json"),
                }
            )
            while True:
                if pid and tree_cpu_seconds(pid) > cpu_limit_s:
                    raise _Timeout()
                try:
                    answer = self._receive_within(self.cand, 0.5)
                    break
                except TimeoutError:
                    continue
        except _Timeout:
            timed_out = True
        except _Cancelled:
            cancelled = True
        except (ChannelClosed, OSError):
            self.cand.wait(2)
            description = self.cand.exit_description
        except ProtocolError as error:
            answer = {
                "stop": "rejected",
                "reasons": [_broken(f"its process answered with an invalid message ({error})")],
            }
        log = self.cand.log_tail()
        if not self.cand.wait(5):
            self.cand.kill()
        self.cand.close()
        return Outcome(
            answer, timed_out, cancelled, description, log, time.monotonic() - started, 0.0, self.sides.level
        )

    def _spawn_build(self, walls: Walls) -> SandboxChild:
        self._note_start()
        try:
            return self.sandbox.spawn("candidate", walls, self.sides.env, compiles=self.sides.compiles)
        except SandboxError as error:
            raise RuntimeError(f"the sandbox could not start a build: {error}") from None

    def _receive_within(self, child: SandboxChild, seconds: float) -> dict[str, Any]:
        if self.cancel is not None and self.cancel.is_set():
            raise _Cancelled()
        if time.monotonic() >= self.deadline:
            raise _Timeout()
        return child.channel.receive(timeout=seconds)

    def judge_only(self, message: dict[str, Any]) -> Outcome:
        """A job of the judge alone (baselines, the GPU probe): no candidate code at all."""
        started = time.monotonic()
        self.deadline = started + self.timeout
        answer: dict[str, Any] | None = None
        timed_out = cancelled = False
        description = ""
        try:
            self.judge = self._spawn("judge", self.sides.judge, self.sides.env)
            self.judge.channel.send(message)
            answer = self._receive(self.judge)
        except _Timeout:
            timed_out = True
        except _Cancelled:
            cancelled = True
        except _JudgeFailed as error:
            answer = {"status": "judge-error", "error": str(error)}
        except (ChannelClosed, OSError, ProtocolError):
            assert self.judge is not None
            self.judge.wait(2)
            description = self.judge.exit_description
        log = ""
        if self.judge is not None:
            log = self.judge.log_tail()
            if cancelled or not self.judge.wait(5):
                self.judge.kill()
            self.judge.close()
        return Outcome(
            answer, timed_out, cancelled, description, log, time.monotonic() - started, 0.0, self.sides.level
        )


def clock_mismatch(inside: dict[str, list[float]], outside: dict[str, list[float]]) -> str | None:
    """A `clock-mismatch` reason when the candidate's rounds, seen from this process, took
    longer beyond what its process reported than the judge's rounds did beyond theirs: its own
    timings then understate its calls (a timer rebound in its process, a forged number).

    Both sides do the same work around the timed call, and the two halves of a round run back to
    back, so a round's overheads (outside time minus reported time) differ only by scheduling
    noise, as often one way as the other. A forged timing shifts every round the same way: the
    candidate is rejected when, over at least 30 rounds, three rounds in four show it more than a
    quarter of its time, and at least 0.25 ms, behind. An honest candidate on a busy machine
    passes (it would need three quarters of coin tosses to fall one way); a forger whose claim
    hides less than the machine's noise is not caught here (the identity checks are the first
    line)."""
    count = min(len(inside["candidate"]), len(inside["reference"]))
    if count < 30:
        return None
    excess = [
        (outside["candidate"][i] - inside["candidate"][i])
        - (outside["reference"][i] - inside["reference"][i])
        for i in range(count)
    ]
    cand = statistics.median(inside["candidate"])
    margin = max(0.25, 0.25 * cand)
    lower_quartile = statistics.quantiles(excess, n=4)[0]
    if lower_quartile > margin:
        return R.reason(
            R.CLOCK_MISMATCH,
            f"its process reported {cand:.3f} ms per call, but in three rounds of four its round took at "
            f"least {lower_quartile:.3f} ms longer from outside than the judge's did beyond theirs",
        )
    return None


def _runnable(root: int) -> bool:
    """Whether `root` or a process below it is running or waiting for a CPU (state R): one
    starved of CPU on a busy machine is not stuck; one that sleeps or waits on a lock may be."""
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[:1] == ["R"]:
            return True
    return False


def _broken(detail: str) -> str:
    return R.reason(R.HARNESS_BROKEN, detail)


def _is_precision_flag(name: str) -> bool:
    return name in PRECISION_FLAGS
