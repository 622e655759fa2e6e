"""`kernelfleet eval`: judge one candidate file against one reference file.

    kernelfleet eval --reference REF.py --candidate CAND.py [--device cpu|cuda|cuda:N]
                     [--profile strict|strict-tf32|kernelbench-v0] [--trials N] [--json]
                     [--timeout S] [--limits-memory SIZE] [--isolation-min-level LEVEL]
    kernelfleet eval serve [--host H] [--port P] [--token-file F] [--device D] [--max-queue N]
    kernelfleet eval isolation [--isolation-min-level LEVEL]

Every evaluation setting is a flag named by its path: `timing.processes` is `--timing-processes`
(`--profile`, `--trials` and `--timeout` are short for `--correctness-profile`,
`--timing-trials` and `--limits-timeout-seconds`).

The exit status is 0 whenever an evaluation completed, whatever the verdict, and 2 for bad
usage or an unreadable file (or a reference that fails on its own), with a message that says
which. With --json, stdout carries exactly one JSON object; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kernelfleet.core import reasons as R
from kernelfleet.core.errors import UsageError
from kernelfleet.core.jsontext import dumps, finite
from kernelfleet.core.models import EvaluationResult, Task
from kernelfleet.core.options import Flag, ModelOptions, leaf_fields
from kernelfleet.core.settings import ISOLATION_LEVELS, EvaluationSettings, isolation_rank, merged
from kernelfleet.core.tasks import missing_task_names, read_source
from kernelfleet.evaluator._config import BASELINE_MODES, EvalConfig
from kernelfleet.evaluator._evaluator import Evaluator

# The evaluation options, generated from the config's fields (defaults, bounds and help live
# there); `--trials` is the short name of `--timing-trials`.
_SHARED_FLAGS = (
    Flag("device", default_text="cuda if available, else cpu", metavar="DEVICE"),
    Flag("correctness.profile", ("--correctness-profile", "--profile")),
    Flag("timing.trials", ("--timing-trials", "--trials"), metavar="N"),
    Flag("limits.timeout_seconds", ("--limits-timeout-seconds", "--timeout"), metavar="S"),
    Flag("limits.memory", metavar="SIZE"),
    Flag("isolation.min_level", metavar="LEVEL"),
    Flag("isolation.level", metavar="LEVEL"),
)
EVAL_OPTIONS = ModelOptions(
    EvalConfig,
    *_SHARED_FLAGS,
    only=[
        "device",
        *leaf_fields(EvaluationSettings),
        "isolation.level",
        "correctness.float64_reference",
        "seed",
    ],
)
# `eval serve` is one long session over many candidates of each task (an RL group, optimisation
# rounds): the case that a reference pool and more pairs where pairs disagree pay for (the figures
# are in docs/measurements.md). A flag, a request's options or a job's spec overrides them;
# `--timing-reference-processes 0` turns the pool off.
SERVE_DEFAULTS: dict[str, Any] = {"timing": {"reference_processes": 4, "processes_max": 4}}
SERVE_OPTIONS = ModelOptions(
    EvalConfig,
    *_SHARED_FLAGS,
    Flag("timing.reference_processes", default_text="4 in eval serve"),
    Flag("timing.processes_max", default_text="4 in eval serve"),
    only=["device", *leaf_fields(EvaluationSettings), "isolation.level", "lane_slots"],
)


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "eval",
        help="judge one candidate (ModelNew) against one reference (Model)",
        description=(
            "Prove a candidate correct over fresh seeded trials and time it against the reference, "
            "rejecting reward hacks by name. Exit status 0 whenever the evaluation completed."
        ),
    )
    parser.add_argument("--reference", metavar="REF.py", help="task file: Model, get_inputs, ...")
    parser.add_argument("--candidate", metavar="CAND.py", help="candidate file defining ModelNew")
    EVAL_OPTIONS.add_to(parser)
    parser.add_argument("--baselines", action="store_true", help="also time eager, torch.compile, CUDA graph")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(handler=run)
    actions = parser.add_subparsers(dest="eval_command", metavar="serve|isolation")
    serve = actions.add_parser(
        "serve",
        help="an HTTP evaluation service over the local GPUs",
        description=(
            "Serve evaluations over HTTP: POST /v1/evaluations, GET /v1/evaluations/ID, /healthz, "
            "/metrics. See docs/evaluator.md."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8470, help="port (8470; 0 picks a free one)")
    serve.add_argument(
        "--token-file", metavar="F", help="file holding the bearer token that /v1 calls must send"
    )
    serve.add_argument("--max-queue", type=int, default=64, metavar="N", help="open evaluations (64)")
    SERVE_OPTIONS.add_to(serve)
    serve.set_defaults(handler=run_serve)
    isolation = actions.add_parser(
        "isolation",
        help="how well this machine can wall candidates in",
        description="Detect bubblewrap, Landlock and seccomp, and print the isolation level candidates "
        "will run at (docs/sandbox.md). Exit status 1 when it is below --isolation-min-level.",
    )
    isolation.add_argument(
        "--isolation-min-level", dest="min_isolation", default=None, choices=ISOLATION_LEVELS, metavar="LEVEL"
    )
    isolation.set_defaults(handler=run_isolation)


def run_isolation(args: argparse.Namespace) -> int:
    from kernelfleet.evaluator._sandbox import detect

    report = detect()
    print(report.describe())
    if args.min_isolation and isolation_rank(report.level) < isolation_rank(args.min_isolation):
        print(f"{report.level} is below the required {args.min_isolation}", file=sys.stderr)
        return 1
    return 0


def _read(path_text: str, what: str) -> str:
    path = Path(path_text)
    if what != "token":  # Python source: decoded as Python decodes it (PEP 263)
        try:
            return read_source(path)
        except UsageError as error:
            raise UsageError(f"cannot read the {what} file: {error}") from None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read the {what} file {path}: {error}; check the path") from None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _config(
    args: argparse.Namespace, options: ModelOptions[EvalConfig], defaults: dict[str, Any] | None = None
) -> EvalConfig:
    values: dict[str, Any] = merged(defaults or {}, options.given(args))
    values.setdefault("device", _default_device())
    limits = values.get("limits", {})
    if "timeout_seconds" in limits:  # a build may take as long, and at least a minute
        limits["compile_timeout_s"] = max(float(limits["timeout_seconds"]), 60.0)
    return options.build_from(values)


def result_json(result: EvaluationResult, baselines: dict[str, Any] | None = None) -> dict[str, Any]:
    """The --json object: the contract's keys first, then the full result. Always valid JSON: a
    non-finite number is null, and `non_finite` names it with the reason."""
    data, replaced = finite(result.model_dump(mode="json"))
    out: dict[str, Any] = {
        "verdict": data["verdict"],
        "reasons": data["reasons"],
        "speedup": data["speedup"],
        "reference_ms": result.reference_ms,
        "candidate_ms": result.candidate_ms,
        "environment": data["environment"],
    }
    out.update({key: value for key, value in data.items() if key not in out})
    if baselines is not None:
        out["baselines"] = baselines
    if replaced:
        # JSON has no NaN or infinity: such a number is null, and here is why.
        out["non_finite"] = {
            path: f"{text}: not a JSON number, written as null"
            + (" (the candidate's output has NaN or infinite values)" if path == "max_abs_error" else "")
            for path, text in replaced.items()
        }
    return out


def _table(result: EvaluationResult, reference: str, candidate: str) -> str:
    env = result.environment
    rows = [
        ("reference", reference),
        ("candidate", candidate),
        ("verdict", str(result.verdict)),
        ("speedup", f"{result.speedup:.3f}x" if result.speedup is not None else "-"),
    ]
    if result.speedup_ci is not None:
        rows.append(("95% interval", f"{result.speedup_ci[0]:.3f}x - {result.speedup_ci[1]:.3f}x"))
    if result.settings:
        rows.append(("settings", ", ".join(f"{k}={v}" for k, v in result.settings.items())))
    for label, timing in (("reference time", result.reference), ("candidate time", result.candidate)):
        if timing is not None:
            rows.append(
                (label, f"{timing.median_ms:.4f} ms median (IQR {timing.iqr_ms:.4f}, {timing.trials} trials)")
            )
    if result.max_abs_error is not None:
        rows.append(("max abs error", f"{result.max_abs_error:.3g}"))
    rows.append(("profile", result.profile))
    rows.append(("isolation", result.isolation or "-"))
    rows.append(
        ("device", f"{env.device} ({env.gpu_class}), torch {env.torch}, evaluator {env.evaluator_version}")
    )
    if result.flagged_for_review:
        rows.append(("review", "flagged: look at this result before trusting it"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    for text in result.reasons:
        lines.append(f"{'reason':<{width}}  {text}")
    return "\n".join(lines)


def _token(path: str | None) -> str | None:
    if path is None:
        return os.environ.get("KERNELFLEET_EVAL_TOKEN") or None
    token = _read(path, "token").strip()
    if not token:
        raise UsageError(f"the token file {path} is empty; put the token in it, or leave --token-file out")
    return token


def _interrupt(*_: object) -> None:
    """SIGTERM (a pod being stopped) ends the service like Ctrl-C: open evaluations are cancelled."""
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    from kernelfleet.evaluator._http import ServiceServer
    from kernelfleet.evaluator._service import EvaluationService

    if args.max_queue < 1:
        raise UsageError("--max-queue must be at least 1")
    config = _config(args, SERVE_OPTIONS, SERVE_DEFAULTS)
    token = _token(args.token_file)
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving on {args.host} without a token; anyone who reaches it can run code "
            "on this machine's GPUs (use --token-file)",
            file=sys.stderr,
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with Evaluator(config) as evaluator:
        env = evaluator.environment
        service = EvaluationService(evaluator, max_queue=args.max_queue)
        try:
            server = ServiceServer(service, args.host, args.port, token)
        except OSError as error:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {error.strerror}") from None
        signal.signal(signal.SIGTERM, _interrupt)
        timing = config.timing
        print(
            f"serving evaluations on {server.url} ({env.device}, {env.gpu_class}, "
            f"profile {config.correctness.profile}, reference pool {timing.reference_processes or 'off'}, "
            f"process pairs {timing.processes}-{timing.processes_max or timing.processes}, "
            f"queue {args.max_queue}"
            f"{', token required' if token else ''})",
            file=sys.stderr,
            flush=True,
        )
        try:
            server.serve()
        except KeyboardInterrupt:
            print("stopping: open evaluations are cancelled", file=sys.stderr)
        finally:
            server.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.reference or not args.candidate:
        raise UsageError(
            "kernelfleet eval needs --reference REF.py and --candidate CAND.py (or: kernelfleet eval serve)"
        )
    reference = _read(args.reference, "reference")
    candidate = _read(args.candidate, "candidate")
    try:
        missing = missing_task_names(reference)
    except SyntaxError as error:
        raise UsageError(
            f"the reference {args.reference} is not valid Python ({error.msg}, line {error.lineno})"
        ) from None
    if missing:
        raise UsageError(
            f"the reference {args.reference} does not define {', '.join(missing)}; a task defines "
            "class Model, get_inputs() and get_init_inputs()"
        )
    config = _config(args, EVAL_OPTIONS)
    task = Task(name=Path(args.reference).stem, code=reference, source=args.reference)
    with Evaluator(config) as evaluator:
        if not args.json:
            print(
                f"evaluating {args.candidate} against {args.reference} on {config.device} ...",
                file=sys.stderr,
            )

        def slow(_: Task, __: str, seconds: float, activity: str) -> None:
            print(f"still evaluating {args.candidate} after {seconds:.0f} s: {activity}", file=sys.stderr)

        result = evaluator.evaluate_batch([(task, candidate)], progress=False, slow=slow)[0]
        if R.REFERENCE_ERROR in R.codes(result.reasons):
            raise UsageError(f"the reference {args.reference} fails on its own: {result.reasons[0]}")
        baselines: dict[str, Any] | None = None
        if args.baselines:
            timings, missing_modes = evaluator.baselines_detail(task)
            baselines = {mode: timings[mode].model_dump() for mode in BASELINE_MODES if mode in timings}
            baselines.update({mode: {"unavailable": why} for mode, why in missing_modes.items()})
    if args.json:
        print(dumps(result_json(result, baselines)))
    else:
        print(_table(result, args.reference, args.candidate))
        if baselines:
            for mode, value in baselines.items():
                text = (
                    f"{value['median_ms']:.4f} ms"
                    if "median_ms" in value
                    else f"unavailable ({value['unavailable']})"
                )
                print(f"baseline {mode}: {text}")
    return 0
