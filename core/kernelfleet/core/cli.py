"""The `kernelfleet` command line root.

Core owns only the root; each installed component adds its own subcommands through the
`kernelfleet.commands` entry-point group, so the operator image has no `eval` and the worker
image has no operator commands. An entry point names a function
`register(subcommands) -> None` that adds one parser and sets `handler`, a function of the
parsed arguments that returns the exit status.

Exit statuses: 0 when the command did its work, 1 when it failed (any `KernelfleetError`:
its message, never a traceback), 2 for bad usage or unreadable input (a `UsageError`, or an
option argparse refuses), each with a message that says which and what to do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from kernelfleet.core import __version__
from kernelfleet.core.errors import KernelfleetError, UsageError

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelfleet",
        description="Make GPU code faster, verifiably: evaluate, optimize and report on kernels.",
    )
    parser.add_argument("--version", action="version", version=f"kernelfleet {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in sorted(entry_points(group="kernelfleet.commands"), key=lambda e: e.name):
        register = entry.load()
        register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, or a bad option (argparse printed why)
        return stop.code if isinstance(stop.code, int) else 2
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except UsageError as error:
        print(f"kernelfleet {args.command}: {error}", file=sys.stderr)
        return 2
    except KernelfleetError as error:
        # Every error kernelfleet raises on purpose carries a message that says what to do;
        # a traceback would only bury it. Anything else is a bug, and keeps its traceback.
        print(f"kernelfleet {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kernelfleet {args.command}: interrupted; run it again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
