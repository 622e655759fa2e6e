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
from kernelfleet.evaluator._service import EvaluationService, ServiceServer
from kernelfleet.evaluator._version import EVALUATOR_VERSION

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
    "ServiceServer",
    "TaskError",
    "TimingConfig",
    "gpu_class",
    "kernelbench_dir",
    "load_tasks",
    "reasons",
    "result_from_json",
    "timing_from",
]
