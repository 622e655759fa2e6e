"""CPU time of a process and its descendants, read from /proc.

A build's time limit counts the CPU time the build itself used (the child, ninja, nvcc, the
host compiler), not the wall time: on CPUs shared with other builds a compile that needs 60 s
of CPU can take several minutes of wall time, and killing it then blames the candidate for the
machine's load. Descendants still running are read directly; those already reaped are in
their parents' `cutime`/`cstime`. Where /proc is missing the answer is 0 and only the wall-time
limit applies.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    parent = int(fields[1])
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return parent, (utime + stime + cutime + cstime) / _TICKS


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used by `root` and every process descended from it."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0.0
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            parents[pid], seconds[pid] = stat
    total = 0.0
    for pid, cpu in seconds.items():
        current, hops = pid, 0
        while current not in (root, 0, 1) and hops < 64:
            current, hops = parents.get(current, 0), hops + 1
        if current == root:
            total += cpu
    return total
