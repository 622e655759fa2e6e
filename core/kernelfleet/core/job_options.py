"""The options every way of starting a search shares: `kernelfleet optimize` on this machine and
`kernelfleet submit` to a cluster take the same budget and evaluation flags, generated once
from the settings models, so moving a command line from a laptop to a cluster changes only the
command's name."""

from __future__ import annotations

import argparse

from kernelfleet.core.options import Flag, ModelOptions
from kernelfleet.core.settings import Budget, EvaluationSettings


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m` or `2h`, in seconds; whether the value is allowed is the field's to say."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        return float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write 90, 90s, 15m or 2h") from None


BUDGET_OPTIONS = ModelOptions(
    Budget,
    Flag("samples_per_round", "--samples"),
    Flag("wall_time_seconds", "--wall-time", parse=parse_duration, metavar="DURATION"),
    title="budget",
)
EVALUATION_OPTIONS = ModelOptions(
    EvaluationSettings,
    Flag("correctness.profile", ("--correctness-profile", "--profile")),
    Flag(
        "limits.timeout_seconds",
        ("--limits-timeout-seconds", "--timeout"),
        parse=parse_duration,
        metavar="DURATION",
    ),
    Flag("limits.memory", metavar="SIZE"),
    Flag("isolation.min_level", metavar="LEVEL"),
)
