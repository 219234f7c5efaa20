#!/usr/bin/env bash
# Stage 11 on a GPU machine, in one command: build what it needs (warnings as errors, ptxas's
# report kept in build.log), run its GPU tests and its compute-sanitizer tests, then the
# decode benchmark (scripts/decode_bench.py) with its chunk-length sweep; logs, rows and
# plots in OUT_DIR. About 5-7 minutes on an H100 with 16 cores.
#
#   scripts/decode_round.sh OUT_DIR
#   PHASES="bench" scripts/decode_round.sh OUT_DIR     # the benchmark alone (after a build)
#
# PHASES: any of build, tests, sanitizer, bench (default: all four, in that order; build
# always first). The build goes to build-decode (configured with ATTN_PYTHON=ON, so that the
# benchmark can call stage 11's kernels through libattn_11_split_kv_decode.so). JOBS: build
# and test jobs (default 16). BENCH_BUDGET: seconds after which the benchmark starts no new
# shape (default 240). DECODE_BENCH: extra decode_bench.py arguments.
# OUT_DIR gets summary.txt, configure.log, build.log, ctest_gpu.log, ctest_sanitizer.log,
# decode_bench.log, decode_program.log, decode_summary.md, rows/decode.tsv,
# rows/decode_chunks.tsv and plots/.
set -uo pipefail
out=${1:?usage: decode_round.sh OUT_DIR}
mkdir -p "$out"
phases=${PHASES:-build tests sanitizer bench}
jobs=${JOBS:-16}
build=build-decode
start=$(date +%s)
log() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$out/summary.txt"; }
has() { [[ " $phases " == *" $1 "* ]]; }

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
log "nvcc: $(nvcc --version | tail -2 | head -1)"
if has build; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_COMPILE_WARNING_AS_ERROR=ON \
    -DATTN_PTXAS_VERBOSE=ON -DATTN_PYTHON=ON > "$out/configure.log" 2>&1 ||
    { log "configure FAILED"; tail -20 "$out/configure.log"; exit 1; }
  # Stage 11, its library, its CPU test of the chunk rule, and the .npy fixtures its tests load.
  cmake --build "$build" -j "$jobs" --target 11_split_kv_decode attn_11_split_kv_decode \
    11_split_kv_decode_chunk_rule npy_fixtures > "$out/build.log" 2>&1 ||
    { log "build FAILED"; grep -B2 -A8 "error" "$out/build.log" | head -40; exit 1; }
  log "built; $(grep -c 'bytes spill stores' "$out/build.log") kernels in ptxas's report"
  "$build/11_split_kv_decode/11_split_kv_decode_chunk_rule" > "$out/chunk_rule.log" 2>&1
  log "chunk rule test: exit $? ($(tail -1 "$out/chunk_rule.log"))"
elif [ ! -f "$build/CTestTestfile.cmake" ]; then
  log "no build in $build: add the build phase"
  exit 1
fi

# ctest's summary line, and the name of every test that did not pass.
run_tests() {
  local name=$1
  shift
  ctest --test-dir "$build" -j "$jobs" --output-on-failure "$@" > "$out/ctest_$name.log" 2>&1
  log "$name: $(grep -E 'tests passed|No tests' "$out/ctest_$name.log")"
  grep -E "^\s+[0-9]+ - .*\((Failed|Timeout|Not Run|Exception)" "$out/ctest_$name.log" |
    head -40 | tee -a "$out/summary.txt"
  log "$name skipped: $(grep -c '(Skipped)' "$out/ctest_$name.log")"
}

for phase in $phases; do
  case $phase in
    build) ;;
    tests) run_tests gpu -R '^11_' -L gpu -LE sanitizer ;;
    sanitizer) run_tests sanitizer -R '^11_' -L sanitizer ;;
    bench)
      # shellcheck disable=SC2086 # DECODE_BENCH holds words
      python3 scripts/decode_bench.py --bin "$build/bin" --lib "$build/lib" --out "$out" \
        --chunk-sweep --budget "${BENCH_BUDGET:-240}" ${DECODE_BENCH:-} \
        > "$out/decode_bench.log" 2>&1
      log "bench: exit $?; $(grep -E 'copy bandwidth .* before' "$out/decode_bench.log")"
      grep -E "^B = 1|^At least|skipped" "$out/decode_bench.log" | tee -a "$out/summary.txt"
      ;;
    *) log "unknown phase '$phase' (build, tests, sanitizer, bench)" ;;
  esac
done
log "done"
