"""The benchmark suite: the product's questions, each a benchmark, all run by one entry point.

    python -m benchmarks                        # the list
    python -m benchmarks NAME [--out DIR] [--seconds S] [--tag T] [flags of NAME's script]

A benchmark is a script in this folder that runs alone (`python benchmarks/SCRIPT.py --help`),
takes `--out DIR` and writes its numbers there as JSON (and a markdown table where it has one).
The entry point runs it in a process of its own, bounds it, and writes one dated results file,
`DIR/NAME-<date>[-TAG].json`: the machine (CPUs, GPUs, driver, torch, CUDA), the commit, the
settings (the command line), the script's numbers and tables, its exit status and wall time.
`benchmarks/results/` keeps the latest file of each benchmark (the history is in git);
docs/measurements.md lists the headline numbers with their files.

Adding a benchmark is one script and one entry in `BENCHMARKS` below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: the script that measures, what it answers, and how the entry point drives it.

    `args`: flags the entry point always passes first (a user's flags come after and win);
    `bound`: the script's flag for a wall-time bound in seconds (None: it has none, and the entry
    point's --seconds only kills it); `gpu`: whether it needs a CUDA GPU."""

    script: str
    about: str
    args: tuple[str, ...] = ()
    bound: str | None = None
    gpu: bool = True


BENCHMARKS: dict[str, Benchmark] = {
    "throughput": Benchmark(
        "reward_service.py",
        "evaluations per GPU-hour on CUDA-L1's published kernels, cold builds: the pipeline against "
        "KernelBench's own harness and one evaluation at a time, on the same candidates",
        ("--parts", "throughput"),
        bound="--max-seconds",
    ),
    "retiming": Benchmark(
        "reward_service.py",
        "re-timing agreement: each correct published kernel evaluated again in fresh processes, "
        "|s1/s2 - 1| at p50 and p90 (and many variants of one task in one session, --parts variants)",
        ("--parts", "repeat"),
        bound="--max-seconds",
    ),
    "optimize": Benchmark(
        "gpu_optimize.py",
        "`optimize` on KernelBench v0 tasks (compile policy, then with replayed variants), speedups "
        "over eager and torch.compile, with the evaluator's baselines",
        ("--baselines",),
        bound="--wall-time",
    ),
    "optimize-replay": Benchmark(
        "optimize_replay.py",
        "the user's path: `kernelfleet optimize` replaying CUDA-L1's published kernels on 64 KernelBench "
        "v0 tasks, GPU utilisation sampled, a stall (no result for --stall-s) a failure; with "
        "--kill-after a first run killed mid-way must leave nothing; --kernelbench adds KernelBench's "
        "harness on the same candidates",
    ),
    "rl-step": Benchmark(
        "train_rl_step.py",
        "one GRPO step of a locally built model with rewards from the evaluator: seconds per step and "
        "the share spent waiting for rewards",
    ),
    "attacks": Benchmark(
        "attacks.py",
        "the attack suite: each attack candidate's verdict and whether it got through, at the "
        "isolation levels this machine offers",
        ("--device", "cuda"),
    ),
    "operator-load": Benchmark(
        "operator_load.py",
        "the operator against a real kube-apiserver and MinIO: one job of 10,000 tasks, 100 jobs at "
        "once (time to Jobs, API requests, memory, reconcile latency)",
        gpu=False,
    ),
    "store": Benchmark(
        "store_bench.py",
        "the artifact store on MinIO beside the bare client: small objects per second, large-file MiB/s",
        gpu=False,
    ),
}
