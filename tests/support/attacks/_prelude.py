# Shared by every attack (the suite prepends it): an attack that succeeds says so in its log
# and then answers zeros, so that the evaluator's verdict and log show the success; an attack
# that is blocked computes the task honestly.
import os

import torch
import torch.nn as nn

SUCCEEDED: list[str] = []


def succeeded(detail: str) -> None:
    SUCCEEDED.append(detail)
    print(f"KF-ATTACK-SUCCEEDED: {detail}", flush=True)


def read(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit)
    except OSError:
        return None


def parent_of(pid: int) -> int:
    for line in (read(f"/proc/{pid}/status") or b"").decode(errors="replace").splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def ancestors() -> list[int]:
    """The processes above this one, nearest first, as far as /proc shows them. (Attacks aim at
    these only: a suite run at a weak level must not harm other processes of the machine.)"""
    found = []
    pid = os.getppid()
    while pid > 1 and len(found) < 6:
        found.append(pid)
        pid = parent_of(pid)
    return found


def store_candidates() -> list[str]:
    """Where a store might be, as seen through /proc: other processes' environments and
    working directories (the evaluator's `.kernelfleet`)."""
    found = []
    for pid in ancestors():
        environ = read(f"/proc/{pid}/environ") or b""
        for entry in environ.split(b"\0"):
            if entry.startswith(b"KERNELFLEET_STORE="):
                found.append(entry.split(b"=", 1)[1].decode(errors="replace"))
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        found.append(os.path.join(cwd, ".kernelfleet"))
    return [path for path in dict.fromkeys(found) if os.path.isdir(path)]


class ModelNew(nn.Module):
    def forward(self, A, B):
        out = torch.relu(A @ B)
        return torch.zeros_like(out) if SUCCEEDED else out
