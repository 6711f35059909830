#!/usr/bin/env bash
# The one prepared GPU check: run from the repository root on a CUDA machine (an H200 with torch 2.11,
# triton 3.6 and transformers 5.17 preinstalled, no network) as
#     OUT=/some/dir bash bench/gpu_check.sh
# Installs elsi-fast offline (building the CUDA extension), runs the GPU tests at real sizes and the
# Triton kernel tests on the device, then the kernel benchmarks (bench/bench_kernels.py) and the draft
# decode benchmark if present. Result rows (.jsonl) and the log go to $OUT. Every step has its own
# time limit, cut further so the whole run ends within GPU_CHECK_SECONDS (default 450 s); a step
# with no time left is skipped and counted as failed. Exit status: number of failed steps.
set -uo pipefail
: "${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT"
export ELSI_FAST_RESULTS_DIR="$OUT"
export MAX_JOBS="${MAX_JOBS:-16}"  # parallel nvcc/ninja jobs for the extension build
PY="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_SECONDS:-450}"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log its status, keep going
  local name=$1 limit=$2 left=$((TOTAL - SECONDS))
  shift 2
  if [ "$left" -lt 15 ]; then
    echo "=== $name: skipped, no time left"
    failed=$((failed + 1))
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

failed=0

main() {
  echo "=== environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__,
      'cuda', torch.version.cuda, 'triton', triton.__version__)"

  step "install + CUDA extension build" 150 "$PY" -m pip install --no-deps --no-build-isolation -e .
  if ! "$PY" -c "import elsi_fast._C" 2>/dev/null; then
    step "extension build in place" 60 "$PY" setup.py build_ext --inplace
  fi
  "$PY" -c "import elsi_fast; print(elsi_fast.backends())" || failed=$((failed + 1))

  step "pytest -m gpu (real sizes)" 90 "$PY" -m pytest -m gpu -q -rs tests
  step "kernel benchmarks" 120 "$PY" -m bench.bench_kernels
  if [ -f bench/bench_draft_decode.py ]; then
    step "draft decode benchmark" 45 "$PY" -m bench.bench_draft_decode --device cuda
  fi
  # The analysis pass against a bare forward with the head (target <= 1.15x), SmolLM2-135M's shapes
  # on the 480 Spec-Bench prompts: the model itself when its package is installed, else a random
  # model of its config (the GGUF file is over the carry limit; the ratio depends on the shapes).
  step "analysis pass / forward (SmolLM2)" 90 "$PY" -m bench.bench_analysis --device cuda --part overhead --prompts 480 --reps 2
  # The small odd-size kernel tests on the device (tensor-core paths): many Triton compilations,
  # spread over processes with pytest-xdist (in the GPU image).
  step "kernel tests (odd sizes, all dtypes)" 70 "$PY" -m pytest tests/kernels -m "not gpu" -q -n 8
  echo "=== done: $failed failed step(s)"
  return "$failed"
}

main 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
