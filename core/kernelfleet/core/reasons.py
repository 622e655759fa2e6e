"""Named reasons that a result carries.

A reason is a string `"<code>: <detail>"`. The code is stable and machine-readable (tests,
the trainer and reports match on it); the detail says, for a person, what was seen and where.
Codes in `REJECTING` make the verdict `rejected` whatever the numbers say: they are reward
hacks or contract breaches. The others explain a failure or annotate a correct result.
"""

from __future__ import annotations

# Reward-hack defences: each one rejects the candidate.
THREADS = "threads-started"
SIDE_STREAM = "side-stream-work"
CACHED_OUTPUT = "cached-output"
LAZY_OUTPUT = "lazy-output"
STALE_MEMORY = "stale-memory"
INPUT_MUTATED = "input-mutated"
REFERENCE_MODIFIED = "reference-modified"
PRECISION_DOWNGRADE = "precision-downgrade"
GLOBAL_FLAG_CHANGED = "global-flag-changed"
HARNESS_PATCHED = "harness-patched"
NO_CUSTOM_KERNEL = "no-custom-kernel"
CUSTOM_KERNEL_NOT_RUN = "custom-kernel-not-run"
TORCH_FALLBACK = "torch-fallback"
REFERENCE_FALLBACK = "reference-fallback"
CONSTANT_OUTPUT = "constant-output"
HARNESS_BROKEN = "harness-broken"  # the evaluator's code in the candidate's process failed or lied
MALFORMED_OUTPUT = "malformed-output"  # an output file that does not describe itself truthfully
CLOCK_MISMATCH = "clock-mismatch"  # the candidate's own timings disagree with the clock outside it
COMPILE_CACHE_CHANGED = "compile-cache-changed"  # its sealed torch.compile cache changed after its build

# Plain failures.
OUTPUT_MISMATCH = "output-mismatch"
SHAPE_MISMATCH = "shape-mismatch"
DTYPE_MISMATCH = "dtype-mismatch"
WRONG_DEVICE = "wrong-device"
OUTPUT_STRUCTURE = "output-structure"
SYNTAX_ERROR = "syntax-error"
IMPORT_ERROR = "import-error"
BUILD_ERROR = "build-error"
MISSING_MODELNEW = "missing-modelnew"
RUNTIME_ERROR = "runtime-error"
OUT_OF_MEMORY = "out-of-memory"
CRASHED = "crashed"
TIMEOUT = "timeout"
REFERENCE_ERROR = "reference-error"
JUDGE_FAILED = "judge-failed"  # the judge's process failed: the evaluator's fault, never cached

# Annotations on a result that stands (they never change the verdict on their own).
REVIEW = "review"
RECHECKED = "speedup-rechecked"
NOT_REPRODUCIBLE = "speedup-not-reproducible"
TIMING_NOISY = "timing-noisy"
DEGENERATE_TASK = "degenerate-task"
NATIVE_THREADS = "native-threads"
TRACE_UNAVAILABLE = "trace-unavailable"
SETTING_APPLIED = "setting-applied"
REFERENCE_REUSED = "reference-reused"  # the reference's timing came from earlier in the session
POOLED = "timing-pooled"  # timed in several fresh process pairs (EvalConfig.timing_processes)
REFERENCE_POOLED = "reference-pooled"  # measured against the session's pooled reference time
REFERENCE_DRIFTED = "reference-drifted"  # the reference ran outside its session pool: paired figure kept
UNEVEN_SPREAD = "timing-uneven"  # one side varies round to round far more than the other
NOT_EVALUATED = "not-evaluated"

REJECTING = frozenset(
    {
        THREADS,
        SIDE_STREAM,
        CACHED_OUTPUT,
        LAZY_OUTPUT,
        STALE_MEMORY,
        INPUT_MUTATED,
        REFERENCE_MODIFIED,
        PRECISION_DOWNGRADE,
        GLOBAL_FLAG_CHANGED,
        HARNESS_PATCHED,
        NO_CUSTOM_KERNEL,
        CUSTOM_KERNEL_NOT_RUN,
        TORCH_FALLBACK,
        REFERENCE_FALLBACK,
        CONSTANT_OUTPUT,
        HARNESS_BROKEN,
        MALFORMED_OUTPUT,
        CLOCK_MISMATCH,
        COMPILE_CACHE_CHANGED,
    }
)


def reason(code: str, detail: str) -> str:
    """Format one reason."""
    return f"{code}: {detail}"


def reason_code(text: str) -> str:
    """The code of a formatted reason (the text before the first colon)."""
    return text.split(":", 1)[0].strip()


def codes(reasons: tuple[str, ...] | list[str]) -> set[str]:
    """The set of codes in a list of reasons."""
    return {reason_code(text) for text in reasons}


def is_rejecting(text: str) -> bool:
    return reason_code(text) in REJECTING
