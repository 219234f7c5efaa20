#!/usr/bin/env bash
# One round on a GPU machine: build, run every GPU test, the sanitizer tests and the
# benchmark sweep, and pack the logs and result rows into OUT_DIR/round.tar.gz.
#
#   scripts/gpu_round.sh OUT_DIR
#   TESTS='-R 05_' SWEEP='05_causal cublas_baseline' scripts/gpu_round.sh OUT_DIR
#
# TESTS: extra ctest arguments (default: every test; "none" for no tests); SWEEP: stages to
# sweep (default all GPU stages, "none" for no sweep); SWEEP_BUDGET: seconds after which the
# sweep stops starting new points; PYTORCH=1 also runs the PyTorch comparison.
# OUT_DIR gets two files, round.tar.gz (re-packed after every phase, so a run stopped at a
# time limit still returns what it measured) and summary.txt.
set -uo pipefail
out=${1:?usage: gpu_round.sh OUT_DIR}
work=$(mktemp -d)/round
mkdir -p "$work"
start=$(date +%s)
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$work/summary.txt"; }
pack() { tar -czf "$out/round.tar.gz" -C "$(dirname "$work")" round; cp "$work/summary.txt" "$out/"; }

{ nvidia-smi; nvcc --version; cmake --version; } > "$work/device.txt" 2>&1
log "device: $(nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader)"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" 2>&1 ||
  { log "configure FAILED"; tail -20 "$work/configure.log"; }
cmake --build build-gpu -j "$(nproc)" > "$work/build.log" 2>&1 ||
  { log "build FAILED"; grep -E "error" "$work/build.log" | head -20; }
log "built; ptxas: $(grep -c 'spill stores' "$work/build.log") kernels reported"

pack
# Every GPU test (the sanitizer ones separately: they are slow), then the sanitizer tests.
if [ "${TESTS:-}" != "none" ]; then
ctest --test-dir build-gpu -L gpu -LE sanitizer -j 8 --output-on-failure ${TESTS:-} \
  > "$work/ctest_gpu.log" 2>&1
log "gpu tests: $(grep -E 'tests passed|No tests' "$work/ctest_gpu.log")"
grep -E "Failed|\*\*\*" "$work/ctest_gpu.log" | head -20
log "gpu tests skipped: $(grep -c '(Skipped)\|Not Run' "$work/ctest_gpu.log")"
ctest --test-dir build-gpu -L sanitizer -j 8 --output-on-failure ${TESTS:-} \
  > "$work/ctest_sanitizer.log" 2>&1
log "sanitizer tests: $(grep -E 'tests passed|No tests' "$work/ctest_sanitizer.log")"
grep -E "Failed|\*\*\*|ERROR SUMMARY: [1-9]" "$work/ctest_sanitizer.log" | head -20
pack
fi

if [ "${SWEEP:-all}" != "none" ]; then
  stages=()
  [ "${SWEEP:-all}" != "all" ] && stages=(--stages ${SWEEP})
  python3 scripts/sweep.py --bin build-gpu/bin --kind gpu --out "$work/results" "${stages[@]}" \
    --budget "${SWEEP_BUDGET:-0}" 2> "$work/sweep.log"
  log "sweep: $(tail -1 "$work/sweep.log")"
  grep "exit" "$work/sweep.log" | head
fi
if [ "${PYTORCH:-0}" = 1 ] && [ -f scripts/compare_pytorch.py ]; then
  python3 scripts/compare_pytorch.py --bin build-gpu/bin --out "$work/results" \
    > "$work/pytorch.log" 2>&1
  log "pytorch: $(tail -1 "$work/pytorch.log")"
fi
log "done"
pack
