"""GPU check of the RL stage: time per GRPO step, and the share of it spent waiting for rewards.

A causal LM is built here from a config with random weights and a tokenizer trained on the
spot (no downloads; `--size small` is about 190M parameters), and trained for a few GRPO steps
through `kernelfleet.trainer`'s contrastive RL stage on KernelBench v0 tasks. A random model
writes no code, so, to load the evaluator as a real run would, every completion's text is
replaced, after generation, by a published variant of its task (benchmarks/replay-kernelbench-v0.jsonl)
with a unique comment, making each a distinct variant that the evaluator verifies and times in
full. Generation still produces `--max-completion-length` tokens per completion, so both sides
of the pipeline cost what they would.

The rollout hands each prompt group to the evaluator as soon as it is generated and generates
the next group meanwhile; what the step waits for after the last group is `reward_wait_s`. The
target is a wait share below 20% of step time. With two or more GPUs, training uses GPU 0 and
the evaluator GPU 1 (as the cluster puts rewards on GPUs of their own); with one, they share it.

    PYTHONPATH=core:evaluator:search:trainer python benchmarks/train_rl_step.py --out benchmarks/results
    python benchmarks/train_rl_step.py --device cpu --size tiny --steps 2 --out /tmp/rl   # smoke test

Writes `train_rl_step-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPLAY = ROOT / "benchmarks" / "replay-kernelbench-v0.jsonl"
TASKS = ["kernelbench-v0:1:12,38", "kernelbench-v0:2:1,9,12,14,40"]


def shapes() -> dict[str, Any]:
    from kernelfleet.trainer._local_model import ModelShape

    return {
        "tiny": ModelShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2),
        "small": ModelShape(
            vocab_size=8000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=8192,
        ),
    }


def answer(code: str) -> str:
    return (
        "## Performance Analysis\nreplayed\n\n## Algorithm Design\nreplayed\n\n"
        f"## Code Implementation\n```python\n{code.strip()}\n```\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--size", choices=("tiny", "small"), default=None, help="default: small on a GPU")
    parser.add_argument("--steps", type=int, default=None, help="default: 4 GPU, 1 CPU")
    parser.add_argument("--num-generations", type=int, default=None, help="default: 8 GPU, 2 CPU")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="default: 4 GPU, 2 CPU")
    parser.add_argument("--max-completion-length", type=int, default=None, help="default: 512 GPU, 32 CPU")
    parser.add_argument("--timing-trials", type=int, default=None, help="default: 100 GPU, 5 CPU")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    from kernelfleet.core.models import Task
    from kernelfleet.core.resources import TrainingRunSpec
    from kernelfleet.search._prompts import ANSWER_FORMAT, RULES, SYSTEM_PROMPT
    from kernelfleet.search.policies._replay import parse_replay_lines
    from kernelfleet.trainer._grpo import run_grpo
    from kernelfleet.trainer._local_model import build_local_model, parameter_count
    from kernelfleet.trainer._runner import open_run
    from kernelfleet.trainer._spec import RunConfig

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
    size = args.size or ("small" if on_gpu else "tiny")
    args.steps = args.steps or (4 if on_gpu else 1)
    args.num_generations = args.num_generations or (8 if on_gpu else 2)
    args.prompts_per_step = args.prompts_per_step or (4 if on_gpu else 2)
    shape = shapes()[size]
    completion = args.max_completion_length or (512 if on_gpu else 32)
    gpus = torch.cuda.device_count() if on_gpu else 0
    eval_device = "cpu" if not on_gpu else ("cuda:1" if gpus >= 2 else "cuda:0")
    replay_rows = parse_replay_lines(REPLAY.read_text(encoding="utf-8"), str(REPLAY))
    counter = itertools.count()

    def replayed(task: Task, text: str, step: int) -> str:
        rows = [row for row in replay_rows if row.matches(task)]
        if not rows:
            return text
        row = rows[next(counter) % len(rows)]
        return answer(f"{row.code.rstrip()}\n# benchmark sample {step}-{next(counter)}\n")

    work = Path(tempfile.mkdtemp(prefix="kernelfleet-rl-bench-"))
    corpus = [row.code for row in replay_rows] + [SYSTEM_PROMPT, RULES, ANSWER_FORMAT]
    started = time.monotonic()
    model = build_local_model(work / "model", corpus * 20, shape)
    built = time.monotonic() - started
    batch = args.num_generations * args.prompts_per_step
    spec = TrainingRunSpec.model_validate(
        {
            "baseModel": str(model),
            "tasks": TASKS,
            "heldOut": {"fraction": 0.0, "evaluate": False},
            "evaluation": {"timingTrials": max(10, args.timing_trials or (100 if on_gpu else 10))},
            "stages": [
                {
                    "name": "rl",
                    "type": "grpo",
                    "grpo": {
                        "learning_rate": 1e-6,
                        "num_generations": args.num_generations,
                        "beta": 0.0,
                        "max_completion_length": completion,
                        "per_device_train_batch_size": batch,
                        "max_steps": args.steps,
                        "use_vllm": False,
                        "bf16": on_gpu,
                        "gradient_checkpointing": False,
                        "logging_steps": 1,
                        "save_steps": 10_000,
                    },
                }
            ],
        }
    )
    overrides: dict[str, Any] = {} if on_gpu else {"timing_trials": args.timing_trials or 5, "warmup": 1}
    if not on_gpu:
        overrides.update({"correctness_trials": 1, "max_speedup_cv": None, "speedup_recheck": None})
    config = RunConfig("rl-bench", spec, "benchmark")
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    with open_run(
        config,
        store=str(work / "store"),
        work_dir=work / "work",
        device=eval_device,
        eval_overrides=overrides,
    ) as run:
        if on_gpu and gpus >= 2:
            # The evaluator keeps GPU 1 (its lane is fixed); the trainer takes GPU 0.
            torch.cuda.set_device(0)
        outcome = run_grpo(run.ctx, config.stage("rl"), list(run.split.train), answer_filter=replayed)
    if previous is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = previous
    timing = outcome.timer.as_dict()
    steps = max(1, int(timing["steps"]))
    record = {
        "date": dt.date.today().isoformat(),
        "commit": os.environ.get("KERNELFLEET_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "gpus": gpus,
        "evaluator_device": eval_device,
        "model": {"size": size, "parameters": parameter_count(shape), **shape.__dict__},
        "num_generations": args.num_generations,
        "completions_per_step": batch,
        "max_completion_length": completion,
        "model_build_s": round(built, 2),
        "per_step_s": round(timing["step_s"] / steps, 3),
        "generation_per_step_s": round(timing["generation_s"] / steps, 3),
        "reward_wait_per_step_s": round(timing["reward_wait_s"] / steps, 3),
        "reward_wait_share": round(timing["reward_wait_share"], 4),
        "target_share": 0.2,
        "evaluations": timing["evaluations"],
        "new_variants": outcome.summary["new_variants"],
        "timing": timing,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"train_rl_step-{record['date']}" + ("" if on_gpu else "-cpu")
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    verdict = "meets" if record["reward_wait_share"] < 0.2 else "misses"
    lines = [
        f"# RL step timing, {record['date']} ({record['device']}, {gpus} GPU(s), evaluator {eval_device})",
        "",
        f"Model: {size}, {record['model']['parameters'] / 1e6:.1f}M parameters "
        "(random weights, built locally).",
        f"Per step: {batch} completions ({args.prompts_per_step} prompts x {args.num_generations}), "
        f"up to {completion} new tokens each.",
        "",
        "| per step | seconds |",
        "| --- | --- |",
        f"| whole step | {record['per_step_s']} |",
        f"| generation | {record['generation_per_step_s']} |",
        f"| waiting for rewards | {record['reward_wait_per_step_s']} |",
        "",
        f"Share of step time waiting for rewards: **{record['reward_wait_share']:.1%}** "
        f"({verdict} the 20% target); "
        f"{record['evaluations']} evaluations, {record['new_variants']} new verified variants.",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
