"""The one interface every policy implements, and the values that cross it.

A policy receives a batch of requests (every sample that one round wants from it, over all
active tasks) and returns one proposal per request. Batches, not single calls, because that is
what makes the expensive policies fast: an endpoint gets them concurrently, a local model
generates them in one padded batch, vLLM schedules them together. Deterministic policies
(`compile`, `replay`) use the batch to hand out distinct variants to the samples of one task.

A proposal is one of three things, and the loop treats them differently:
- code to evaluate (`code` is set);
- an unusable answer (`code` is None, `error` says why): recorded in the store, costs no GPU
  time, and is never asked for again on resume;
- no answer at all: the policy has nothing more for this task (`exhausted`), or the endpoint
  failed after its retries (`transient`). Neither is recorded, so a resumed run asks again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kernelfleet.core.errors import PermanentError
from kernelfleet.core.models import Task
from kernelfleet.search._answers import parse_answer
from kernelfleet.search._prompts import Exemplar, build_messages


class PolicyError(PermanentError):
    """A policy cannot work at all (bad key, unknown model, missing package): the run stops."""


@dataclass(frozen=True)
class Request:
    """One sample wanted from a policy: the task, the device, and the exemplars to show."""

    task: Task
    device: str
    gpu_class: str
    round: int
    index: int
    exemplars: tuple[Exemplar, ...] = ()
    seen: frozenset[str] = field(default_factory=frozenset)  # variant hashes and proposal keys
    seed: int = 0
    # When the loop's wall-time budget ends (time.monotonic()); None: no limit. A policy that
    # waits on an endpoint stops waiting then, and answers `Proposal.failed` (asked again on
    # resume).
    deadline: float | None = None

    def messages(self) -> list[dict[str, str]]:
        return build_messages(self.task, self.exemplars, self.device, self.gpu_class)

    @property
    def on_gpu(self) -> bool:
        return self.gpu_class != "cpu"


@dataclass(frozen=True)
class Proposal:
    """A policy's answer to one request (see the module docstring for the three kinds)."""

    code: str | None
    name: str = ""
    text: str = ""
    analysis: str = ""
    design: str = ""
    error: str = ""
    missing_sections: tuple[str, ...] = ()
    exhausted: bool = False
    transient: bool = False
    # What a deterministic policy proposed, even when unusable: the loop passes these back as
    # `Request.seen`, so the same row is never proposed twice, across resumes too.
    key: str = ""

    @property
    def recorded(self) -> bool:
        return not (self.exhausted or self.transient)

    @classmethod
    def from_answer(cls, text: str, truncated: bool = False) -> Proposal:
        """Parse a language model's answer; `truncated` when generation hit its token limit."""
        parsed = parse_answer(text)
        error = parsed.error
        if error and truncated:
            error = f"{error}; generation stopped at the token limit (raise --max-tokens)"
        return cls(
            code=parsed.code,
            text=text,
            analysis=parsed.analysis,
            design=parsed.design,
            error=error,
            missing_sections=parsed.missing_sections,
        )

    @classmethod
    def failed(cls, error: str) -> Proposal:
        return cls(code=None, error=error, transient=True)

    @classmethod
    def nothing_left(cls) -> Proposal:
        return cls(code=None, error="the policy has no more variants for this task", exhausted=True)


@runtime_checkable
class Policy(Protocol):
    """Proposes variants. `name` labels its variants in reports; `id` names its objects in the store."""

    @property
    def name(self) -> str: ...

    @property
    def id(self) -> str: ...

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        """One proposal per request, in order."""
        ...

    def close(self) -> None:
        """Release what the policy holds (threads, a model in memory)."""
        ...
