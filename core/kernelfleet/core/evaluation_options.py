"""Command-line options about how a candidate is evaluated, shared by `eval` and `optimize`.

They live in core (not in the evaluator) so that a command can declare them without importing
torch: `kernelfleet results` and `report` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import ISOLATION_LEVELS, parse_bytes


def add_sandbox_options(parser: argparse.ArgumentParser | Any) -> None:
    """--timeout, --memory-limit, --isolation and --min-isolation (eval, eval serve, optimize)."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="longest one evaluation may take, in seconds, before it is killed (300)",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="host memory a candidate may allocate, e.g. 8G or 16Gi (half of this machine's memory)",
    )
    parser.add_argument(
        "--isolation",
        default="auto",
        choices=("auto", *ISOLATION_LEVELS),
        help="how candidates are walled in (auto: the strongest here; see kernelfleet eval isolation)",
    )
    parser.add_argument(
        "--min-isolation",
        default=None,
        choices=ISOLATION_LEVELS,
        help="refuse to evaluate when this machine cannot wall candidates in at least this well",
    )


def sandbox_values(args: argparse.Namespace) -> dict[str, Any]:
    """The EvalConfig fields that `add_sandbox_options` set."""
    values: dict[str, Any] = {"isolation": args.isolation, "min_isolation": args.min_isolation}
    if args.timeout is not None:
        if args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
        values["run_timeout_s"] = args.timeout
        values["compile_timeout_s"] = max(args.timeout, 60.0)
    if args.memory_limit is not None:
        try:
            values["memory_limit_bytes"] = parse_bytes(args.memory_limit)
        except ValueError as error:
            raise UsageError(f"--memory-limit: {error}") from None
    return values
