"""kernelfleet.evaluator: the judge that the rest of kernelfleet trusts.

Load KernelBench-format tasks, then prove each candidate (`ModelNew`) correct over fresh
seeded trials and time it honestly against the reference, each candidate in its own process,
with named defences against the reward hacks that have fooled earlier harnesses::

    from kernelfleet.evaluator import EvalConfig, Evaluator, load_tasks

    task = load_tasks("kernelbench-v0:1:12")[0]
    with Evaluator(EvalConfig(device="cuda")) as evaluator:
        result = evaluator.evaluate(task, candidate_source)
        print(result.verdict, result.speedup, result.reasons)

`docs/evaluator.md` describes the protocol and every defence.
"""

from typing import TYPE_CHECKING

from kernelfleet.core import reasons
from kernelfleet.core.tasks import kernelbench_dir, load_tasks
from kernelfleet.evaluator._cache import DirectoryResultCache, ResultCache
from kernelfleet.evaluator._client import EvaluationClient, ServiceError, result_from_json
from kernelfleet.evaluator._config import (
    BASELINE_MODES,
    PROFILES,
    CorrectnessConfig,
    EvalConfig,
    IsolationConfig,
    LimitConfig,
    Profile,
    TimingConfig,
)
from kernelfleet.evaluator._environment import gpu_class
from kernelfleet.evaluator._evaluator import (
    BatchCancelled,
    EvaluationCancelled,
    Evaluator,
    Metrics,
    TaskError,
    timing_from,
)
from kernelfleet.evaluator._service import EvaluationService
from kernelfleet.evaluator._version import EVALUATOR_VERSION

if TYPE_CHECKING:
    from kernelfleet.evaluator._http import ServiceLimits, ServiceServer, create_app


def __getattr__(name: str) -> object:
    """The HTTP front is imported on first use: the evaluator's own processes import this
    package, and never serve."""
    if name in ("ServiceServer", "ServiceLimits", "create_app"):
        from kernelfleet.evaluator import _http

        return getattr(_http, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BASELINE_MODES",
    "EVALUATOR_VERSION",
    "PROFILES",
    "BatchCancelled",
    "CorrectnessConfig",
    "DirectoryResultCache",
    "EvalConfig",
    "EvaluationCancelled",
    "EvaluationClient",
    "EvaluationService",
    "Evaluator",
    "IsolationConfig",
    "LimitConfig",
    "Metrics",
    "Profile",
    "ResultCache",
    "ServiceError",
    "ServiceLimits",
    "ServiceServer",
    "TaskError",
    "TimingConfig",
    "create_app",
    "gpu_class",
    "kernelbench_dir",
    "load_tasks",
    "reasons",
    "result_from_json",
    "timing_from",
]
