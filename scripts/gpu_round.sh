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
#   PHASES="build" scripts/gpu_round.sh OUT_DIR  # then, elsewhere: PHASES="tests" ...
#
# PHASES: any of build, tests, sanitizer, sweep, pytorch (default: all five, in that order).
# Without build, build-gpu must already hold a build of this tree: one made by this script
# with the same CUDA toolkit at the same path (CMake and CTest record absolute paths), for
# instance on a machine without a GPU (configure it with -DATTN_COMPUTE_SANITIZER=PATH when
# compute-sanitizer lives elsewhere there).
# TESTS: extra ctest arguments for both test phases; SANITIZER_JOBS: sanitizer tests run at
# once (default 8; on an H100 with 16, the 100 sanitizer tests take about 6 minutes, most of
# it 06's racecheck). SWEEP: the stages to sweep (default: every GPU stage); SWEEP_BUDGET:
# seconds after which the sweep starts no new point; SWEEP_SEQ, SWEEP_DTYPES: a subset of
# the sweep's sequence lengths and dtypes.
# PYTORCH_BACKENDS: SDPA backends to time (default: flash cudnn efficient math);
# PYTORCH_SEQ: their sequence lengths (default: the sweep's).
# OUT_DIR gets summary.txt, the ctest logs, build.log and results.tar.gz (the sweep's
# gpu.tsv and PyTorch's rows); everything is written as soon as its phase ends, so a run
# stopped at a time limit still returns what it finished.
set -uo pipefail
out=${1:?usage: gpu_round.sh OUT_DIR}
mkdir -p "$out"
phases=${PHASES:-build tests sanitizer sweep pytorch}
start=$(date +%s)
log() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$out/summary.txt"; }
has() { [[ " $phases " == *" $1 "* ]]; }

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
log "nvcc: $(nvcc --version | tail -2 | head -1)"
if has build; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_COMPILE_WARNING_AS_ERROR=ON \
    -DATTN_PTXAS_VERBOSE=ON > "$out/configure.log" 2>&1 || { log "configure FAILED"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" > "$out/build.log" 2>&1 ||
    { log "build FAILED"; grep -B2 -A8 "error" "$out/build.log" | head -40; exit 1; }
  log "built; $(grep -c 'bytes spill stores' "$out/build.log") kernels in ptxas's report"
elif [ ! -f build-gpu/CTestTestfile.cmake ]; then
  log "no build in build-gpu: add the build phase"
  exit 1
fi

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
has sanitizer && run_tests sanitizer "${SANITIZER_JOBS:-8}" -L sanitizer

results=$(mktemp -d)
if has sweep; then
  stages=()
  [ -n "${SWEEP:-}" ] && stages=(--stages ${SWEEP})
  [ -n "${SWEEP_SEQ:-}" ] && stages+=(--seq ${SWEEP_SEQ})
  [ -n "${SWEEP_DTYPES:-}" ] && stages+=(--dtypes ${SWEEP_DTYPES})
  python3 scripts/sweep.py --bin build-gpu/bin --kind gpu --out "$results" "${stages[@]}" \
    --budget "${SWEEP_BUDGET:-0}" 2> "$out/sweep.log"
  log "sweep: $(tail -1 "$out/sweep.log")"
  tar -czf "$out/results.tar.gz" -C "$results" .
fi
if has pytorch; then
  python3 scripts/compare_pytorch.py --bin build-gpu/bin --out "$results" \
    --backends ${PYTORCH_BACKENDS:-flash cudnn efficient math} ${PYTORCH_SEQ:+--seq $PYTORCH_SEQ} \
    > "$out/pytorch.log" 2>&1
  log "pytorch: $(tail -1 "$out/pytorch.log")"
  tar -czf "$out/results.tar.gz" -C "$results" .
fi
log "done"
