"""The `Evaluator`: the judge that every other part of kernelfleet trusts.

It owns the child processes. A batch is a pipeline: candidates that build C++/CUDA extensions
compile in a pool of CPU processes (a build cache keyed by source hash makes a rebuild free)
while one lane per device evaluates, one fresh child per candidate, so a GPU never waits for
nvcc and never runs two timings at once. Results are keyed by (task hash, candidate hash, GPU
class, evaluator version) and written to the cache as they finish, so a killed batch resumes
where it stopped. A speedup at or above `speedup_recheck` is timed again in a fresh process,
and the lower of the two is the one that counts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tqdm import tqdm

from kernelfleet.core import reasons as R
from kernelfleet.core.errors import UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Environment, EvaluationResult, ResultKey, Task, Timing, Variant, Verdict
from kernelfleet.evaluator._cache import ResultCache
from kernelfleet.evaluator._child import Job
from kernelfleet.evaluator._config import EvalConfig
from kernelfleet.evaluator._environment import gpu_class, host_name
from kernelfleet.evaluator._ops import needs_native_build
from kernelfleet.evaluator._procs import ChildOutcome, ChildRunner
from kernelfleet.evaluator._timing import stats

_LOG_LIMIT = 4000


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return ""


def timing_from(samples: Sequence[float]) -> Timing:
    s = stats(list(samples))
    return Timing(
        median_ms=s.median_ms,
        mean_ms=s.mean_ms,
        min_ms=s.min_ms,
        max_ms=s.max_ms,
        iqr_ms=s.iqr_ms,
        trials=s.trials,
    )


class TaskError(UsageError):
    """The task's reference does not load or run: fix the task, not the candidate."""


class _Lane:
    """One device: its visible id for children and its environment."""

    def __init__(self, visible: str | None, environment: Environment, arch: str | None) -> None:
        self.visible = visible
        self.environment = environment
        self.arch = arch


class Evaluator:
    """Evaluates candidates against tasks; use it as a context manager (it owns processes)."""

    def __init__(self, config: EvalConfig | None = None) -> None:
        self.config = config or EvalConfig()
        self._runner = ChildRunner()
        self._lanes: list[_Lane] | None = None
        self._lanes_lock = threading.Lock()

    # -- lifecycle

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill any child still running. The evaluator cannot be used afterwards."""
        self._runner.close()

    # -- environment

    def _probe_lanes(self) -> list[_Lane]:
        with self._lanes_lock:
            if self._lanes is not None:
                return self._lanes
            torch_version = _torch_version()
            if self.config.device == "cpu":
                env = Environment(
                    device="cpu",
                    gpu_class="cpu",
                    torch=torch_version,
                    evaluator_version=self.config.result_version,
                    host=host_name(),
                )
                self._lanes = [_Lane(None, env, None)]
                return self._lanes
            outcome = self._runner.run(Job(mode="probe", config=self.config), timeout=120)
            answer = outcome.answer
            if answer is None or answer.get("status") != "ok":
                raise UsageError(
                    f"cannot query the GPUs (the probe {outcome.exit_description}); check the NVIDIA "
                    f"driver, or use --device cpu\n{outcome.log[-1000:]}"
                )
            devices = answer["devices"]
            if not devices:
                raise UsageError(
                    f"device {self.config.device} asked for, but torch sees no CUDA GPU; use cpu"
                )
            parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            physical = (
                [v.strip() for v in parent_visible.split(",") if v.strip()]
                if parent_visible
                else [str(i) for i in range(len(devices))]
            )
            if self.config.device == "cuda":
                indices = list(range(len(devices)))
            else:
                index = int(self.config.device.split(":")[1])
                if index >= len(devices):
                    raise UsageError(
                        f"device {self.config.device} does not exist: this machine has {len(devices)} GPU(s)"
                    )
                indices = [index]
            lanes = []
            for index in indices:
                info = devices[index]
                env = Environment(
                    device=info["name"],
                    gpu_class=gpu_class(info["name"]),
                    driver=answer.get("driver", ""),
                    torch=answer.get("torch", torch_version),
                    cuda=answer.get("cuda", ""),
                    evaluator_version=self.config.result_version,
                    host=host_name(),
                )
                lanes.append(_Lane(physical[index], env, info.get("capability")))
            self._lanes = lanes
            return lanes

    @property
    def environment(self) -> Environment:
        """The environment of the first device (all devices of a batch, when they are alike)."""
        return self._probe_lanes()[0].environment

    def key_for(self, task: Task, code: str | Variant) -> ResultKey:
        """The cache key the result of `code` on `task` will have on this evaluator."""
        text = code.code if isinstance(code, Variant) else code
        env = self.environment
        return ResultKey(
            task_hash=task.hash,
            variant_hash=source_hash(text),
            gpu_class=env.gpu_class,
            evaluator_version=env.evaluator_version,
        )

    # -- one evaluation

    def evaluate(self, task: Task, code: str | Variant) -> EvaluationResult:
        """Judge one candidate. When the task's own reference fails, the verdict is
        runtime_error with a `reference-error` reason (and the result is never cached)."""
        return self.evaluate_batch([(task, code)], cache=None, progress=False)[0]

    def _result(
        self,
        task: Task,
        code: str,
        lane: _Lane,
        verdict: str,
        reasons: Iterable[str],
        *,
        seconds: float,
        log: str = "",
        reference: Timing | None = None,
        candidate: Timing | None = None,
        speedup: float | None = None,
        max_abs_error: float | None = None,
    ) -> EvaluationResult:
        reasons = list(reasons)
        flagged = False
        if speedup is not None and speedup > self.config.review_ceiling:
            flagged = True
            reasons.append(
                R.reason(
                    R.REVIEW, f"speedup {speedup:.2f}x is above the {self.config.review_ceiling:g}x ceiling"
                )
            )
        if any(
            R.reason_code(t) in (R.NOT_REPRODUCIBLE, R.TRACE_UNAVAILABLE, R.DEGENERATE_TASK) for t in reasons
        ):
            flagged = True
        return EvaluationResult(
            task_hash=task.hash,
            variant_hash=source_hash(code),
            verdict=Verdict(verdict),
            reasons=tuple(reasons),
            reference=reference,
            candidate=candidate,
            speedup=speedup,
            flagged_for_review=flagged,
            max_abs_error=max_abs_error,
            environment=lane.environment,
            profile=self.config.profile,
            seconds=round(seconds, 3),
            log=log[-_LOG_LIMIT:] if verdict != "correct" else "",
        )

    def _seed(self) -> int:
        return self.config.seed if self.config.seed is not None else secrets.randbits(31)

    def _job(self, mode: str, task: Task, code: str, lane: _Lane, seed: int) -> Job:
        env: dict[str, str] = {}
        if lane.arch and "TORCH_CUDA_ARCH_LIST" not in os.environ:
            env["TORCH_CUDA_ARCH_LIST"] = lane.arch
        return Job(
            mode=mode,
            config=self.config,
            reference=task.code,
            candidate=code,
            visible_devices=lane.visible,
            build_dir=str(self._build_dir(code)) if needs_native_build(code) else None,
            env=env,
            seed=seed,
        )

    def _build_dir(self, code: str) -> Path:
        torch_tag = _torch_version().replace("+", "_") or "unknown"
        return self.config.build_root / "builds" / f"torch-{torch_tag}" / source_hash(code)[:24]

    def _failure(
        self, outcome: ChildOutcome, task: Task, code: str, lane: _Lane, what: str
    ) -> EvaluationResult:
        if outcome.timed_out:
            limit = self.config.compile_timeout_s if what == "building" else self.config.run_timeout_s
            return self._result(
                task,
                code,
                lane,
                "timeout",
                [
                    R.reason(
                        R.TIMEOUT,
                        f"{what} the candidate took longer than {limit:g} s; the process was killed",
                    )
                ],
                seconds=outcome.seconds,
                log=outcome.log,
            )
        answer = outcome.answer
        if answer is not None and answer.get("status") == "internal-error":
            raise RuntimeError(f"the evaluator failed while {what} a candidate:\n{answer.get('error')}")
        return self._result(
            task,
            code,
            lane,
            "runtime_error",
            [R.reason(R.CRASHED, f"the process {outcome.exit_description} while {what} the candidate")],
            seconds=outcome.seconds,
            log=outcome.log,
        )

    def _run_evaluation(self, task: Task, code: str, lane: _Lane) -> EvaluationResult:
        started = time.monotonic()
        outcome = self._runner.run(
            self._job("evaluate", task, code, lane, self._seed()), self.config.run_timeout_s
        )
        answer = outcome.answer
        if answer is None or answer.get("status") not in ("ok", "reference-error"):
            return self._failure(outcome, task, code, lane, "evaluating")
        if answer["status"] == "reference-error":
            detail = f"the task's own reference fails: {answer['error']}; fix the task, not the candidate"
            return self._result(
                task,
                code,
                lane,
                "runtime_error",
                [R.reason(R.REFERENCE_ERROR, detail)],
                seconds=outcome.seconds,
                log=outcome.log,
            )
        reasons = list(answer["reasons"])
        verdict = answer["verdict"]
        reference = candidate = None
        speedup = answer.get("speedup")
        if answer.get("reference_ms"):
            reference = timing_from(answer["reference_ms"])
            candidate = timing_from(answer["candidate_ms"])
        if verdict == "correct" and speedup is not None and self._needs_recheck(speedup):
            recheck = self._runner.run(
                self._job("evaluate", task, code, lane, self._seed()), self.config.run_timeout_s
            )
            second = recheck.answer
            if second is None or second.get("status") != "ok":
                failed = self._failure(recheck, task, code, lane, "re-timing")
                return failed.model_copy(update={"seconds": round(time.monotonic() - started, 3)})
            if second["verdict"] != "correct" or second.get("speedup") is None:
                reasons += [f"{t} (re-check)" for t in second["reasons"]]
                if second["verdict"] != "correct":
                    verdict = second["verdict"]
                else:
                    reasons.append(R.reason(R.NOT_REPRODUCIBLE, "the re-check could not time the candidate"))
                speedup = None
            else:
                again = float(second["speedup"])
                spread = abs(speedup - again) / max(speedup, again)
                code_name = R.NOT_REPRODUCIBLE if spread > self.config.recheck_tolerance else R.RECHECKED
                reasons.append(
                    R.reason(
                        code_name,
                        f"{speedup:.2f}x, then {again:.2f}x in a fresh process; the lower one counts",
                    )
                )
                if again < speedup:
                    speedup = again
                    reference = timing_from(second["reference_ms"])
                    candidate = timing_from(second["candidate_ms"])
        return self._result(
            task,
            code,
            lane,
            verdict,
            reasons,
            seconds=time.monotonic() - started,
            log=outcome.log,
            reference=reference,
            candidate=candidate,
            speedup=speedup,
            max_abs_error=answer.get("max_abs_error"),
        )

    def _needs_recheck(self, speedup: float) -> bool:
        threshold = self.config.speedup_recheck
        return threshold is not None and speedup >= threshold

    def _build(self, task: Task, code: str, lane: _Lane) -> EvaluationResult | None:
        """Compile a C++/CUDA candidate on the CPU side; a result only when it fails."""
        job = self._job("build", task, code, lane, 0)
        cores = os.cpu_count() or 2
        jobs = max(1, cores // max(1, self._compile_workers()))
        job = dataclasses.replace(job, env={**job.env, "MAX_JOBS": os.environ.get("MAX_JOBS", str(jobs))})
        outcome = self._runner.run(job, self.config.compile_timeout_s)
        answer = outcome.answer
        if answer is None or answer.get("status") != "ok":
            return self._failure(outcome, task, code, lane, "building")
        if answer["verdict"] == "built":
            return None
        return self._result(
            task, code, lane, answer["verdict"], answer["reasons"], seconds=outcome.seconds, log=outcome.log
        )

    def _compile_workers(self) -> int:
        if self.config.compile_workers is not None:
            return max(1, self.config.compile_workers)
        return max(1, (os.cpu_count() or 2) - 1)

    # -- batches

    def evaluate_batch(
        self,
        items: Sequence[tuple[Task, str | Variant]],
        cache: ResultCache | None = None,
        progress: bool = True,
    ) -> list[EvaluationResult]:
        """Judge many candidates over all devices of this evaluator; results in input order.

        Cached results are reused; every new result is put into `cache` as soon as it exists,
        except those whose task reference failed (`reference-error`): the task is at fault.
        """
        lanes = self._probe_lanes()
        pairs = [(task, code.code if isinstance(code, Variant) else code) for task, code in items]
        keys = [self.key_for(task, code) for task, code in pairs]
        unique: dict[ResultKey, tuple[Task, str]] = {}
        for key, pair in zip(keys, pairs, strict=True):
            unique.setdefault(key, pair)
        results: dict[ResultKey, EvaluationResult] = {}
        if cache is not None:
            for key in unique:
                hit = cache.get(key)
                if hit is not None:
                    results[key] = hit
        todo = [key for key in unique if key not in results]
        counts: Counter[str] = Counter(str(r.verdict) for r in results.values())
        bar = tqdm(
            total=len(unique),
            initial=len(results),
            desc="evaluate",
            unit="cand",
            disable=not progress,
            leave=False,
        )
        lock = threading.Lock()
        errors: list[BaseException] = []

        def record(key: ResultKey, result: EvaluationResult) -> None:
            with lock:
                results[key] = result
                counts[str(result.verdict)] += 1
                bar.update(1)
                bar.set_postfix({k: v for k, v in sorted(counts.items())}, refresh=False)
            if cache is not None and R.REFERENCE_ERROR not in R.codes(result.reasons):
                cache.put(result)

        ready: queue.Queue[ResultKey | None] = queue.Queue()
        native: list[ResultKey] = []
        for key in todo:
            task, code = unique[key]
            try:
                compile(code, "<candidate>", "exec")
            except (SyntaxError, ValueError) as error:
                text = f"{error.msg} (line {error.lineno})" if isinstance(error, SyntaxError) else str(error)
                record(
                    key,
                    self._result(
                        task, code, lanes[0], "compile_error", [R.reason(R.SYNTAX_ERROR, text)], seconds=0.0
                    ),
                )
                continue
            if needs_native_build(code):
                native.append(key)
            else:
                ready.put(key)

        def lane_worker(lane: _Lane) -> None:
            while True:
                key = ready.get()
                if key is None or errors:
                    return
                task, code = unique[key]
                try:
                    record(key, self._run_evaluation(task, code, lane))
                except BaseException as error:  # a task error or an evaluator bug: stop the batch
                    errors.append(error)
                    return

        def build_one(key: ResultKey) -> None:
            task, code = unique[key]
            if errors:
                return
            try:
                failed = self._build(task, code, lanes[0])
            except BaseException as error:
                errors.append(error)
                return
            if failed is not None:
                record(key, failed)
            else:
                ready.put(key)

        threads = [threading.Thread(target=lane_worker, args=(lane,), daemon=True) for lane in lanes]
        try:
            for thread in threads:
                thread.start()
            if native:
                with concurrent.futures.ThreadPoolExecutor(max_workers=self._compile_workers()) as pool:
                    list(pool.map(build_one, native))
            for _ in threads:
                ready.put(None)
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        except BaseException:
            # Interrupted: kill every child now. The evaluator is closed afterwards (lanes still
            # finishing must not start new children); results so far are in the cache.
            errors.append(KeyboardInterrupt())
            self._runner.close()
            raise
        finally:
            bar.close()
        if errors:
            raise errors[0]
        return [results[key] for key in keys]

    # -- baselines

    def baselines(self, task: Task) -> dict[str, Timing]:
        """The reference timed eagerly, under torch.compile (default and reduce-overhead) and as
        a CUDA-graph replay, with the same protocol as candidates. A mode that is unavailable
        here (no CUDA, no compiler) is absent from the answer."""
        timings, _ = self.baselines_detail(task)
        return timings

    def baselines_detail(self, task: Task) -> tuple[dict[str, Timing], dict[str, str]]:
        """`baselines` plus why each missing mode is missing."""
        lane = self._probe_lanes()[0]
        job = self._job("baselines", task, "", lane, self._seed())
        timeout = max(self.config.run_timeout_s, 120.0) * 2
        outcome = self._runner.run(job, timeout)
        answer = outcome.answer
        if answer is None or answer.get("status") not in ("ok", "reference-error"):
            why = "timed out" if outcome.timed_out else outcome.exit_description
            raise RuntimeError(
                f"timing the baselines of {task.name!r} failed: the process {why}\n{outcome.log[-2000:]}"
            )
        if answer["status"] == "reference-error":
            raise TaskError(f"the reference of task {task.name!r} fails on its own: {answer['error']}")
        timings = {mode: timing_from(samples) for mode, samples in answer["samples"].items() if samples}
        return timings, dict(answer.get("unavailable", {}))


def median_speedup(results: Iterable[EvaluationResult]) -> float | None:
    """Median speedup over correct results (a convenience for reports)."""
    values = [r.speedup for r in results if r.verdict == Verdict.CORRECT and r.speedup is not None]
    return statistics.median(values) if values else None
