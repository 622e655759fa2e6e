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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The root parser with every installed subcommand, or with `only` that one when it exists.

    Loading one entry point instead of all keeps a command from importing what it never uses:
    `kernelfleet operator` in a development install would otherwise pull in torch through the
    search component's commands (hundreds of megabytes the operator's memory target cannot spare).
    """
    parser = argparse.ArgumentParser(
        prog="kernelfleet",
        description="Make GPU code faster, verifiably: evaluate, optimize and report on kernels.",
    )
    parser.add_argument("--version", action="version", version=f"kernelfleet {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    entries = sorted(entry_points(group="kernelfleet.commands"), key=lambda e: e.name)
    if only is not None and any(entry.name == only for entry in entries):
        entries = [entry for entry in entries if entry.name == only]
    for entry in entries:
        register = entry.load()
        register(subcommands)
    return parser


def _command(argv: Sequence[str] | None) -> str | None:
    """The subcommand named on the command line, if it comes first (as it always does)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return words[0] if words and not words[0].startswith("-") else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(only=_command(argv))
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
