"""Candidates that attack the machinery rather than the numbers (issue 9), each with what it
did to kernelfleet before the sandbox and what it must get now.

Every attack is a candidate file in this folder. `_prelude.py` is put in front of each: it
defines `ModelNew` for `evaluator_cases.MATMUL_TASK` (relu of a matmul) and `succeeded()`: an
attack that gets through prints `KF-ATTACK-SUCCEEDED: ...` and makes the candidate answer
zeros, so that a success shows in the verdict and the log. An attack that is blocked leaves an
honest candidate, which must come out correct. Some harm can only be seen from outside (a file
written outside the sandbox, a daemon still running, a store changed): the tests look there.

`before` is what the attack got from kernelfleet's evaluator before the sandbox: as reported
in issue 9 where it was tried there, otherwise from running it against that evaluator (see
benchmarks/attacks.py, which prints the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "KF-ATTACK-SUCCEEDED"


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    before: str
    verdicts: tuple[str, ...] = ("correct",)  # what the verdict may be now
    reasons: frozenset[str] = field(default_factory=frozenset)  # one of them must be given
    max_speedup: float | None = None  # a speedup it must stay below (when correct)
    # Whether its own success message is harm: for most attacks, yes (it read, wrote or killed
    # something); an attack on the evaluator's code inside its own process may succeed there,
    # and only the verdict says whether that did any good.
    marker_is_harm: bool = True

    def harm(
        self, verdict: str, reasons: list[str] | tuple[str, ...], speedup: float | None, log: str
    ) -> list[str]:
        """What got through, judged from the result alone ([] when the attack was held)."""
        found: list[str] = []
        if self.marker_is_harm:
            found += [line.split(":", 1)[1].strip() for line in log.splitlines() if MARKER in line][:2]
        if verdict not in self.verdicts:
            found.append(f"verdict {verdict}, expected {' or '.join(self.verdicts)}")
        codes = {text.split(":", 1)[0].strip() for text in reasons}
        if self.reasons and not self.reasons & codes and verdict in self.verdicts:
            found.append(f"none of the reasons {', '.join(sorted(self.reasons))}")
        if self.max_speedup is not None and speedup is not None and speedup >= self.max_speedup:
            found.append(f"{speedup:.2f}x")
        return found

    @property
    def source(self) -> str:
        return (HERE / "_prelude.py").read_text() + "\n\n" + (HERE / f"{self.name}.py").read_text()


ATTACKS: tuple[Attack, ...] = (
    Attack(
        "forge_store_results",
        "finds the store through /proc and writes forged 50x results",
        "torch.zeros reported 50.00x, verified (issue 9)",
    ),
    Attack(
        "patch_reference_subclasses",
        "slows the reference's forward, found through nn.Module.__subclasses__()",
        "8.2-9.6x, correct, re-checked (issue 9)",
        max_speedup=2.0,
    ),
    Attack(
        "patch_reference_gc",
        "slows the reference's forward, found through gc.get_objects()",
        "8.2-9.6x, correct, re-checked (issue 9)",
        max_speedup=2.0,
    ),
    Attack(
        "delete_other_runs", "deletes the other runs in the store", "runs deleted; store check said usable"
    ),
    Attack("write_outside", "writes files into /tmp, the home and the evaluator's directory", "written"),
    Attack("forked_daemon", "forks a setsid daemon that burns CPU for a minute", "outlived the evaluator"),
    Attack(
        "kill_grandparent",
        "kills the process above its parent (the kernelfleet process)",
        "run ended with status 137; every resume died at it (issue 9)",
    ),
    Attack(
        "rebind_verdict",
        "rebinds the evaluator's compare and is_rejecting, then answers zeros",
        "a rejection became correct (issue 9)",
        verdicts=("incorrect", "rejected"),
        marker_is_harm=False,
    ),
    Attack(
        "rebind_crash",
        "rebinds an evaluator function in its process so that it raises",
        "optimize ended with a traceback on every resume (issue 9)",
        verdicts=("rejected", "runtime_error"),
        reasons=frozenset({"harness-broken", "harness-patched", "runtime-error"}),
    ),
    Attack(
        "forge_timing",
        "rebinds its process's channel so that every reported timing is 10x faster",
        "10x faster (the harness trusted its own clock)",
        verdicts=("rejected",),
        reasons=frozenset({"harness-patched", "clock-mismatch"}),
    ),
    Attack(
        "foresee_checked_rounds",
        "reads from its caller's frames whether a timed round's output will be checked, and "
        "returns a stale output on the rounds that are not",
        "correct, 6.28x, no reason given (the round request said which rounds were checked)",
        verdicts=("rejected",),
        reasons=frozenset({"cached-output"}),
        marker_is_harm=False,
    ),
    Attack(
        "allocate_20gb",
        "allocates and touches 20 GB of host memory",
        "stopped by the timeout, after most of the host's memory (issue 9)",
        verdicts=("runtime_error",),
        reasons=frozenset({"out-of-memory"}),
    ),
    Attack(
        "read_parent_environ",
        "reads /proc/<pid>/environ of the processes above it for store credentials",
        "the worker's store credentials were in reach (issue 9)",
    ),
    Attack(
        "write_evaluator_code",
        "opens the evaluator's and torch's code for writing",
        "writable",
    ),
    Attack("ptrace_parent", "ptrace-attaches to and reads the memory of its parent", "allowed (same user)"),
    Attack(
        "ld_preload", "creates /etc/ld.so.preload (every later process loads its library)", "writable as root"
    ),
    Attack("open_socket", "opens a TCP connection", "allowed"),
    Attack(
        "fill_scratch",
        "writes 256 MiB files until the disk refuses, up to 2 GiB",
        "filled the host's disk",
        verdicts=("runtime_error", "compile_error"),
        reasons=frozenset({"runtime-error", "crashed", "import-error"}),
    ),
)

BY_NAME = {attack.name: attack for attack in ATTACKS}
