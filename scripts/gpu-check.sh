#!/usr/bin/env bash
# The GPU machine's check: the GPU test tier (tests/gpu, the attack suite's GPU tests included),
# then at most one benchmark through the suite's entry point (`python -m benchmarks`).
#
# Usage: KERNELFLEET_COMMIT=<sha> scripts/gpu-check.sh [--no-tests] [NAME [FLAGS...]]
#   scripts/gpu-check.sh                                   # the GPU tests
#   scripts/gpu-check.sh throughput --seconds 480 --count 40 --kernels .data/cuda-l1-h100-kernels.jsonl
#   scripts/gpu-check.sh --no-tests retiming --seconds 540
# NAME and FLAGS are `python -m benchmarks`'s (it lists the benchmarks); results go to $OUT/results
# when $OUT is set (the device tool's output folder), else benchmarks/results. The test log is
# $OUT/gpu-tests-<date>.log (or /tmp/...).
#
# What the GPU image lacks travels with the tree, in ignored folders: Python wheels in .whl/
# (installed to /tmp/site), bubblewrap as Debian packages in .debs/ (unpacked to /tmp/bw, never
# onto /); KernelBench's source in .kb/src and the evaluator before the pipeline in .old for the
# throughput benchmark (see benchmarks/kernelbench_harness.py and benchmarks/old_evaluator.py).
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=1; [[ "${1:-}" == "--no-tests" ]] && { TESTS=0; shift; }

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
trap 'exit 143' TERM INT

python3 -c 'from kernelfleet.evaluator._sandbox import detect; print(detect().describe())'
status=0
if [[ $TESTS == 1 ]]; then
  LOG="${OUT:-/tmp}/gpu-tests-$(date -u +%Y-%m-%d).log"
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$LOG"
  status=${PIPESTATUS[0]}
  echo "=== gpu tests: exit $status (log: $LOG)"
fi
if [[ $# -gt 0 ]]; then
  python3 -m benchmarks "$@"
  bench=$?
  echo "=== benchmark $1: exit $bench"
  [[ $status == 0 ]] && status=$bench
fi
exit "$status"
