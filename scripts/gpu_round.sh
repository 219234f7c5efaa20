#!/usr/bin/env bash
# Everything a GPU machine is needed for, in one command: build (warnings as errors, ptxas's
# report kept in build.log), run every GPU test, the compute-sanitizer tests, the benchmark
# sweep and PyTorch's SDPA backends on the same GPU, and pack the logs and the result rows
# into OUT_DIR.
#
#   scripts/gpu_round.sh OUT_DIR                                   # every phase
#   PHASES="tests" scripts/gpu_round.sh OUT_DIR                     # the GPU tests only
#   PHASES="sanitizer" TESTS="-R 08_" scripts/gpu_round.sh OUT_DIR  # one stage's sanitizers
#   PHASES="sweep pytorch" SWEEP="07_tensor_cores 08_mma_sync" scripts/gpu_round.sh OUT_DIR
#
# PHASES: any of tests, sanitizer, sweep, pytorch (default: all four, in that order).
# TESTS: extra ctest arguments for both test phases. SWEEP: the stages to sweep (default:
# every GPU stage); SWEEP_BUDGET: seconds after which the sweep starts no new point.
# PYTORCH_BACKENDS: SDPA backends to time (default: flash cudnn efficient math).
# OUT_DIR gets summary.txt, the ctest logs, build.log and results.tar.gz (the sweep's
# gpu.tsv and PyTorch's rows); everything is written as soon as its phase ends, so a run
# stopped at a time limit still returns what it finished.
set -uo pipefail
out=${1:?usage: gpu_round.sh OUT_DIR}
mkdir -p "$out"
phases=${PHASES:-tests sanitizer sweep pytorch}
start=$(date +%s)
log() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$out/summary.txt"; }
has() { [[ " $phases " == *" $1 "* ]]; }

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
log "nvcc: $(nvcc --version | tail -2 | head -1)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_COMPILE_WARNING_AS_ERROR=ON \
  -DATTN_PTXAS_VERBOSE=ON > "$out/configure.log" 2>&1 || { log "configure FAILED"; exit 1; }
cmake --build build-gpu -j "$(nproc)" > "$out/build.log" 2>&1 ||
  { log "build FAILED"; grep -B2 -A8 "error" "$out/build.log" | head -40; exit 1; }
log "built; $(grep -c 'bytes spill stores' "$out/build.log") kernels in ptxas's report"

# ctest's summary line, and the name of every test that did not pass.
run_tests() {
  local name=$1 jobs=$2
  shift 2
  ctest --test-dir build-gpu -j "$jobs" --output-on-failure "$@" ${TESTS:-} \
    > "$out/ctest_$name.log" 2>&1
  log "$name: $(grep -E 'tests passed|No tests' "$out/ctest_$name.log")"
  grep -E "^\s+[0-9]+ - .*\((Failed|Timeout|Not Run|Exception)" "$out/ctest_$name.log" |
    head -40 | tee -a "$out/summary.txt"
  log "$name skipped: $(grep -c '(Skipped)' "$out/ctest_$name.log")"
}
has tests && run_tests gpu "$(nproc)" -L gpu -LE sanitizer
has sanitizer && run_tests sanitizer 8 -L sanitizer

results=$(mktemp -d)
if has sweep; then
  stages=()
  [ -n "${SWEEP:-}" ] && stages=(--stages ${SWEEP})
  python3 scripts/sweep.py --bin build-gpu/bin --kind gpu --out "$results" "${stages[@]}" \
    --budget "${SWEEP_BUDGET:-0}" 2> "$out/sweep.log"
  log "sweep: $(tail -1 "$out/sweep.log")"
  tar -czf "$out/results.tar.gz" -C "$results" .
fi
if has pytorch; then
  python3 scripts/compare_pytorch.py --bin build-gpu/bin --out "$results" \
    --backends ${PYTORCH_BACKENDS:-flash cudnn efficient math} > "$out/pytorch.log" 2>&1
  log "pytorch: $(tail -1 "$out/pytorch.log")"
  tar -czf "$out/results.tar.gz" -C "$results" .
fi
log "done"
