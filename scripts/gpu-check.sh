#!/usr/bin/env bash
# All GPU checks and benchmarks in one call, for the GPU machine (an H200 here; any CUDA GPU).
# Writes a dated results file (GPU, driver, torch, commit, numbers) to benchmarks/results/, or
# to $OUT/results when $OUT is set (the device tool's output folder).
#
# Usage: KERNELFLEET_COMMIT=<sha> scripts/gpu-check.sh [--quick]
#   --quick: the GPU tests only. EVAL_SECONDS / OPT_SECONDS bound the two benchmarks; OPT_STORE
#   keeps the optimisation runs (a second call on a still-warm machine resumes them).
#   --reward: only the reward-service benchmark (benchmarks/reward_service.py, at most 9 minutes:
#   REWARD_SECONDS, 540: keep it a minute under the call's limit), on the published kernels in $KERNELFLEET_CUDA_L1_KERNELS (default
#   .data/cuda-l1-h100-kernels.jsonl, carried to the machine; it is not in the repository).
#   REWARD_MODES, REWARD_COUNT, REWARD_PARTS and REWARD_MODE_SECONDS pass through to --modes,
#   --count, --parts and --mode-seconds. Its kernelbench mode runs KernelBench's own harness
#   (benchmarks/kernelbench_harness.py) from .kb/src, an ignored folder carried to the machine
#   (their source is never committed here); make it with
#   `mkdir -p .kb && git -C <KernelBench checkout> archive HEAD src/kernelbench LICENSE | tar -x -C .kb`.
#   Its before-pipeline mode runs the evaluator of commit 777a4df (before the pipeline) from .old,
#   an ignored folder carried along: `mkdir -p .old && git archive 777a4df | tar -x -C .old`.
#   CROSSING_PROBE (task selections) runs benchmarks/input_crossing.py first: correctness time on
#   large inputs, this tree against .old (see the --reward branch below).
#   GPU_TESTS (pytest node ids) runs those GPU tests first, and CLOCKS_PROBE (a list of the
#   evaluator's clocks) benchmarks/idle_clock.py --clocks
#   (with --idle: alone). PLACEMENT_PROBE (a list of tasks, e.g. 2:33,2:22) runs
#   benchmarks/placement_probe.py on them first (kernels or memory placement: why a short call
#   times differently in a fresh process; about 20 s per process and 8 tasks), with PLACEMENT_EXTRA
#   (e.g. "--profile kernelbench-v0 --flushes write,spread,warm", "--epochs 6", or "--chain --epochs 2":
#   a launch chain beside the subjects, and how they follow it, or
#   "--envs default:X=1;conn1:CUDA_DEVICE_MAX_CONNECTIONS=1": processes in turn under driver settings,
#   word-split, so no spaces) passed through.
#   LAUNCH_PROBE (pinnings, e.g. free,local,remote) runs benchmarks/launch_offset.py first (is a
#   process's offset per kernel launch, and does pinning before CUDA starts remove it; about 8 s
#   per process, LAUNCH_PROCESSES of each pinning, 6).
#   --rounds: only benchmarks/round_overhead.py on the GPU: seconds per timed round, this tree
#   against the older commit exported in .old/ (ROUND_OLD names it, default 9d3bb89; make it with
#   `mkdir -p .old && git archive <rev> | tar -x -C .old`, carried along).
#   --idle: only the two timing probes: benchmarks/idle_clock.py (does a call start late after the
#   timing thread waited? IDLE_SKIP_CLOCK=1 skips it) and benchmarks/process_spread.py (do fresh
#   processes time one call differently, and does pinning them to one CPU help?).
#   --rl: only the RL step benchmark (benchmarks/train_rl_step.py: a few GRPO steps of a locally
#   built ~190M model, rewards from the evaluator on GPU 1 when there are two; RL_STEPS, 3).
#   --attacks: only the attack suite (issue 9): tests/gpu/test_gpu_attacks.py and the table of
#   benchmarks/attacks.py at the strongest isolation level the machine reaches (ATTACK_LEVELS=all
#   for every level; each attack is a fresh process, about 20 s on the GPU).
#   Missing Python packages (pydantic, minio; for --rl also trl, peft, datasets, accelerate,
#   transformers, tokenizers and their dependencies) travel as wheels in .whl/ and are installed
#   to /tmp/site. bubblewrap, which the image lacks, travels as Debian packages in .debs/
#   (`apt-get download bubblewrap` on a Debian machine); they are unpacked to /tmp/bw, never
#   onto /, and the isolation level the evaluator reaches is written to the log.
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=0; [[ "${1:-}" == "--quick" ]] && QUICK=1
REWARD=0; [[ "${1:-}" == "--reward" ]] && REWARD=1
RL=0; [[ "${1:-}" == "--rl" ]] && RL=1
ATTACKS=0; [[ "${1:-}" == "--attacks" ]] && ATTACKS=1
ROUNDS=0; [[ "${1:-}" == "--rounds" ]] && ROUNDS=1
IDLE=0; [[ "${1:-}" == "--idle" ]] && IDLE=1
KERNELS=${KERNELFLEET_CUDA_L1_KERNELS:-.data/cuda-l1-h100-kernels.jsonl}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu-check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if ! command -v bwrap >/dev/null 2>&1 && compgen -G ".debs/*.deb" >/dev/null; then
  rm -rf /tmp/bw && mkdir -p /tmp/bw
  for deb in .debs/*.deb; do dpkg -x "$deb" /tmp/bw || echo "gpu-check: cannot unpack $deb" >&2; done
  export PATH="/tmp/bw/usr/bin:$PATH"
fi
export PYTHONPATH="$PWD/core:$PWD/evaluator:$PWD/search:$PWD/trainer:$PWD/operator:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1

STAMP=$(date -u +%Y-%m-%d)
# With $OUT (the device tool's output folder) everything is written straight there: a call
# killed at its limit takes every process with it, an EXIT trap too, and only what is already
# under $OUT comes back. Copy the files into benchmarks/results to commit them.
RESULTS=${OUT:+$OUT/results}; RESULTS=${RESULTS:-benchmarks/results}; mkdir -p "$RESULTS"
# GPU_CHECK_TAG names this call's files apart from another's of the same day (several checks
# in one device call): gpu-check-<date>-<tag>.log, reward_service-<date>-<tag>.json, ...
TAG=${GPU_CHECK_TAG:+-$GPU_CHECK_TAG}
LOG="$RESULTS/gpu-check-$STAMP$TAG.log"
ENVFILE="$RESULTS/gpu-env-$STAMP$TAG.json"
: > "$LOG"

trap 'exit 143' TERM INT

python3 - > "$ENVFILE" <<'PY'
import json, os, subprocess, torch
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "nvidia_smi": smi, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "commit": os.environ.get("KERNELFLEET_COMMIT", "unknown"),
                  "gpus": torch.cuda.device_count()}, indent=2))
PY
cat "$ENVFILE" | tee -a "$LOG"
python3 -c 'from kernelfleet.evaluator._sandbox import detect; print(detect().describe())' 2>&1 | tee -a "$LOG"

step() {  # step NAME COMMAND...: run one stage, keep going when it fails, record the status.
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"; local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
}

# With two or more GPUs the GPU tests and the evaluator benchmark share GPU 0 while the
# optimisation benchmark has GPU 1, so one call of the device's 10-minute limit holds them all.
EVAL_ARGS=(--out "$RESULTS" --max-seconds "${EVAL_SECONDS:-300}")
OPT_ARGS=(--out "$RESULTS" --store "${OPT_STORE:-results/tmp/gpu-optimize-store}" --wall-time "${OPT_SECONDS:-220}")
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
REWARD_ARGS=(--out "$RESULTS" --kernels "$KERNELS" --max-seconds "${REWARD_SECONDS:-540}")
[[ -d .kb/src/kernelbench ]] && REWARD_ARGS+=(--kernelbench-src .kb/src)
[[ -n "${REWARD_MODES:-}" ]] && REWARD_ARGS+=(--modes "$REWARD_MODES")
[[ -n "${REWARD_COUNT:-}" ]] && REWARD_ARGS+=(--count "$REWARD_COUNT")
[[ -n "${REWARD_PARTS:-}" ]] && REWARD_ARGS+=(--parts "$REWARD_PARTS")
[[ -n "${REWARD_MODE_SECONDS:-}" ]] && REWARD_ARGS+=(--mode-seconds "$REWARD_MODE_SECONDS")
[[ -n "${GPU_CHECK_TAG:-}" ]] && REWARD_ARGS+=(--tag "$GPU_CHECK_TAG")
# More benchmark flags, word-split: e.g. REWARD_EXTRA="--variant-tasks 6 --repeat-tasks 24", or
# REWARD_EXTRA="--repeat-config pin_timing=true;pin_timing=false" (two settings side by side).
# shellcheck disable=SC2206
[[ -n "${REWARD_EXTRA:-}" ]] && REWARD_ARGS+=($REWARD_EXTRA)
if [[ $ROUNDS == 1 ]]; then
  step round-overhead python3 benchmarks/round_overhead.py --old "${ROUND_OLD:-9d3bb89}" --old-tree .old \
    --device cuda:0 --out "$RESULTS"
elif [[ $IDLE == 1 && -n "${CLOCKS_PROBE:-}" ]]; then
  step clock-probe python3 benchmarks/idle_clock.py --device cuda:0 --clocks "$CLOCKS_PROBE" --out "$RESULTS"
elif [[ $IDLE == 1 ]]; then
  [[ -z "${IDLE_SKIP_CLOCK:-}" ]] && step idle-clock python3 benchmarks/idle_clock.py --device cuda:0 --out "$RESULTS"
  step process-spread python3 benchmarks/process_spread.py --out "$RESULTS"
elif [[ $ATTACKS == 1 ]]; then
  step gpu-attack-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_attacks.py
  step attack-table python3 benchmarks/attacks.py --levels "${ATTACK_LEVELS:-auto}" --device cuda --out "$RESULTS"
elif [[ $RL == 1 ]]; then
  step train-rl-bench python3 benchmarks/train_rl_step.py --out "$RESULTS" --steps "${RL_STEPS:-3}"
elif [[ $REWARD == 1 ]]; then
  # CLOCKS_PROBE=device,stream,...: first the evaluator's clocks on one process's calls
  # (benchmarks/idle_clock.py --clocks, about half a minute: take it off REWARD_SECONDS).
  # GPU_TESTS=<pytest node ids>: those GPU tests first (e.g. one defence after a timing change).
  # shellcheck disable=SC2086
  [[ -n "${GPU_TESTS:-}" ]] && step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS
  [[ -n "${CLOCKS_PROBE:-}" ]] && step clock-probe python3 benchmarks/idle_clock.py --device cuda:0 \
    --clocks "$CLOCKS_PROBE" --out "$RESULTS"
  [[ -n "${LAUNCH_PROBE:-}" ]] && step launch-offset python3 benchmarks/launch_offset.py \
    --pins "$LAUNCH_PROBE" --processes "${LAUNCH_PROCESSES:-6}" --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
  # shellcheck disable=SC2086
  [[ -n "${PLACEMENT_PROBE:-}" ]] && step placement-probe python3 benchmarks/placement_probe.py \
    --kernels "$KERNELS" --tasks "$PLACEMENT_PROBE" --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"} \
    ${PLACEMENT_EXTRA:-}
  # HOST_LOAD_PROBE (tasks, e.g. 3:28,3:42): benchmarks/host_load_probe.py first (a reference in one
  # process, quiet, with the other CPUs busy, quiet again; about 3 s per task and phase).
  [[ -n "${HOST_LOAD_PROBE:-}" ]] && step host-load-probe python3 benchmarks/host_load_probe.py \
    --tasks "$HOST_LOAD_PROBE" --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
  # CROSSING_PROBE (task selections, e.g. "kernelbench-v0:1:36 kernelbench-v0:1:46"): correctness
  # time on large inputs, this tree against the one exported in CROSSING_BEFORE (default .old;
  # benchmarks/input_crossing.py; make it with `git archive 53f88a5 | tar -x -C .old-crossing` for the
  # tree before 0.8.5's input crossing, so that .old can keep 777a4df for before-pipeline).
  # shellcheck disable=SC2086
  [[ -n "${CROSSING_PROBE:-}" ]] && step input-crossing python3 benchmarks/input_crossing.py \
    --before "${CROSSING_BEFORE:-.old}" --device cuda:0 --tasks $CROSSING_PROBE --repeats "${CROSSING_REPEATS:-2}" --out "$RESULTS" \
    ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
  # REWARD_SKIP=1: the probes above alone.
  [[ -z "${REWARD_SKIP:-}" ]] && step reward-bench python3 benchmarks/reward_service.py "${REWARD_ARGS[@]}"
elif [[ $QUICK == 1 ]]; then
  step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
elif [[ $GPUS -ge 2 ]]; then
  ( export CUDA_VISIBLE_DEVICES=1; step optimize-bench python3 benchmarks/gpu_optimize.py "${OPT_ARGS[@]}" ) &
  ( export CUDA_VISIBLE_DEVICES=0
    step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
    step evaluator-bench python3 benchmarks/gpu_evaluator.py "${EVAL_ARGS[@]}" ) &
  wait
else
  step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
  step evaluator-bench python3 benchmarks/gpu_evaluator.py "${EVAL_ARGS[@]}"
  step optimize-bench python3 benchmarks/gpu_optimize.py "${OPT_ARGS[@]}"
fi

grep -E "^=== .*exit" "$LOG"
