#!/usr/bin/env bash
# Everything a GPU machine is needed for, in one command: build (warnings as errors, ptxas's
# report kept in build.log), run every GPU test, the compute-sanitizer tests, the benchmark
# sweep and PyTorch's SDPA backends on the same GPU, and leave the logs and the result rows
# in OUT_DIR.
#
#   scripts/gpu_round.sh OUT_DIR                                   # every phase
#   PHASES="tests" scripts/gpu_round.sh OUT_DIR                     # the GPU tests only
#   PHASES="sanitizer" TESTS="-R 08_" scripts/gpu_round.sh OUT_DIR  # one stage's sanitizers
#   PHASES="pytorch sweep" SWEEP="07_tensor_cores 08_mma_sync" scripts/gpu_round.sh OUT_DIR
#   PHASES="build" scripts/gpu_round.sh OUT_DIR  # then, elsewhere: PHASES="tests" ...
#
# PHASES: any of build, tests, steps, sanitizer, sweep, pytorch, variants, python, decode
# (default: build tests steps sanitizer sweep pytorch, in that order);
# build always runs first, the others in the order given.
# Without build, build-gpu must already hold a build of this tree: one made by this script
# with the same CUDA toolkit at the same path (CMake and CTest record absolute paths), for
# instance on a machine without a GPU (configure it with -DATTN_COMPUTE_SANITIZER=PATH when
# compute-sanitizer lives elsewhere there; the tests that run cmake -P use the cmake path of
# that machine, so link it where it is missing).
# tests: every GPU test but the sanitizer and step tests; steps: the technique steps' builds
# and runs (label steps); sanitizer: the compute-sanitizer tests.
# TESTS: extra ctest arguments for the three test phases; TEST_JOBS: tests run at once in the
# tests and steps phases (default: the cores); SANITIZER_JOBS: in the sanitizer phase
# (default 8); SLICE=K/N: the tests phase runs the K-th of N interleaved slices of its tests
# (`-I K,COUNT,N`), so that N commands of a few minutes each run them all (the README's
# times table says how long each part takes on an H200).
# SWEEP: the stages to sweep (default: every GPU stage); SWEEP_BUDGET:
# seconds after which the sweep starts no new point; SWEEP_SEQ, SWEEP_DTYPES: a subset of
# the sweep's sequence lengths and dtypes.
# VARIANTS="STAGE LABEL=FLAGS ...": the variants phase times STAGE built with each LABEL's
# compile flags beside STAGE as it is (scripts/variants.sh, BACKWARD=1; binaries already in
# build-gpu/variants, built elsewhere with VARIANT_BUILD_ONLY=1, are timed as they are), rows
# in OUT_DIR/variants/; VARIANT_SEQ and VARIANT_DIMS pass through.
# PYTORCH_BACKENDS: SDPA backends to time (default: flash cudnn efficient math);
# PYTORCH_SEQ: their sequence lengths (default: the sweep's).
# python: the Python package's pytest suite (CTest label pytorch; the build must have been
# configured with ATTN_PYTHON on, the default where python3 imports torch), whose training
# comparison leaves OUT_DIR/rows/training.tsv, then python/bench.py (PyTorch's timing of the
# stages beside SDPA and the stage programs' own) into OUT_DIR/rows/pytorch_bench.tsv;
# PYBENCH: extra bench.py arguments.
# decode: stage 11's decode benchmark (scripts/decode_bench.py: the stage through its library
# beside SDPA with enable_gqa, against the copy bandwidth), rows in OUT_DIR/rows/decode.tsv;
# DECODE_BUDGET: its seconds (default 240); DECODE_BENCH: extra decode_bench.py arguments
# (--chunk-sweep adds rows/decode_chunks.tsv, the chunk rule's sweep); needs the build
# configured with ATTN_PYTHON on. Stage 11 alone: TESTS="-R ^11_" with the tests and
# sanitizer phases, then decode.
# PACK=1: at the end every file of OUT_DIR but summary.txt goes into OUT_DIR/results.tgz,
# for a transport that brings back only a few files.
# Exit status: 0 when every phase it ran succeeded (every test passed or was skipped, no sweep
# point failed, PyTorch's outputs matched), else 1 (the summary says which). OUT_DIR gets summary.txt, the ctest logs, build.log, sweep.log,
# pytorch.log and rows/gpu.tsv (the sweep's rows and PyTorch's, each appended as it is
# measured), so a run stopped at a time limit still returns everything it finished. The 08
# tests, sanitizers, sweep and SDPA rows on an H100 take about 7 minutes: `PHASES="tests
# sanitizer pytorch sweep"`.
set -uo pipefail
out=${1:?usage: gpu_round.sh OUT_DIR}
mkdir -p "$out"
phases=${PHASES:-build tests steps sanitizer sweep pytorch}
start=$(date +%s)
status=0 # 1 once a phase fails: a test that did not pass, a failed sweep point, ...
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
    > "$out/ctest_$name.log" 2>&1 || status=1
  log "$name: $(grep -E 'tests passed|No tests' "$out/ctest_$name.log")"
  grep -E "^\s+[0-9]+ - .*\((Failed|Timeout|Not Run|Exception)" "$out/ctest_$name.log" |
    head -40 | tee -a "$out/summary.txt"
  log "$name skipped: $(grep -c '(Skipped)' "$out/ctest_$name.log")"
}
# The rows go straight to OUT_DIR/rows/gpu.tsv, a row at a time, so that a run stopped
# at a time limit keeps every row it measured.
results=$out/rows
mkdir -p "$results"
sweep() {
  stages=()
  [ -n "${SWEEP:-}" ] && stages=(--stages ${SWEEP})
  [ -n "${SWEEP_SEQ:-}" ] && stages+=(--seq ${SWEEP_SEQ})
  [ -n "${SWEEP_DTYPES:-}" ] && stages+=(--dtypes ${SWEEP_DTYPES})
  python3 scripts/sweep.py --bin build-gpu/bin --kind gpu --out "$results" "${stages[@]}" \
    --budget "${SWEEP_BUDGET:-0}" 2> "$out/sweep.log" || status=1
  log "sweep: $(tail -1 "$out/sweep.log")"
}
pytorch() {
  python3 scripts/compare_pytorch.py --bin build-gpu/bin --out "$results" \
    --backends ${PYTORCH_BACKENDS:-flash cudnn efficient math} ${PYTORCH_SEQ:+--seq $PYTORCH_SEQ} \
    > "$out/pytorch.log" 2>&1 || status=1
  log "pytorch: $(tail -1 "$out/pytorch.log")"
}
python_package() {
  # -V: pytest's own summary (how many passed, which skipped and why) goes into the log.
  FLASH_STAGES_TRAINING_TSV=$results/training.tsv ctest --test-dir build-gpu -L pytorch -V \
    ${TESTS:-} > "$out/ctest_python.log" 2>&1 || status=1
  log "python: $(grep -E 'tests passed|No tests' "$out/ctest_python.log")"
  grep -E "[0-9]+ (passed|failed|skipped|error)" "$out/ctest_python.log" | tail -3 |
    tee -a "$out/summary.txt"
  local rc=0
  python3 python/bench.py --bin build-gpu/bin --tsv "$results/pytorch_bench.tsv" ${PYBENCH:-} \
    > "$out/python_bench.log" 2>&1 || rc=$?
  [ $rc = 0 ] || status=1
  log "python bench: exit $rc, $(grep -c . "$results/pytorch_bench.tsv" 2>/dev/null) rows"
}
decode() {
  local rc=0
  # shellcheck disable=SC2086 # DECODE_BENCH holds words
  python3 scripts/decode_bench.py --bin build-gpu/bin --lib build-gpu/lib --out "$out/decode" \
    --budget "${DECODE_BUDGET:-240}" ${DECODE_BENCH:-} > "$out/decode.log" 2>&1 || rc=$?
  [ $rc = 0 ] || status=1
  log "decode: exit $rc; $(grep -E '^B = 1|^At least' "$out/decode.log" | tr '\n' ' ')"
  cp "$out/decode/rows/decode.tsv" "$results/decode.tsv" 2>/dev/null
  cp "$out/decode/rows/decode_chunks.tsv" "$results/decode_chunks.tsv" 2>/dev/null
}
variants() {
  local words
  read -r -a words <<< "${VARIANTS:-}"
  if [ ${#words[@]} -lt 1 ]; then
    log "variants: VARIANTS=\"STAGE LABEL=FLAGS ...\" is not set"
    return
  fi
  VARIANT_BINS=build-gpu/variants BACKWARD=1 bash scripts/variants.sh "${words[@]:0:1}" \
    "$out/variants" "${words[@]:1}" > "$out/variants.log" 2>&1 || status=1
  log "variants: $(grep -c 'TFLOP/s' "$out/variants.log") timings (variants.log)"
}

# The phases after the build, in the order PHASES gives them: with little time left, put
# pytorch before sweep so that the SDPA rows exist even if the sweep is cut short.
for phase in $phases; do
  case $phase in
    build) ;;
    tests)
      slice=()
      if [ -n "${SLICE:-}" ]; then
        count=$(ctest --test-dir build-gpu -N | awk '/Total Tests/ { print $3 }')
        slice=(-I "${SLICE%/*},$count,${SLICE#*/}")
      fi
      run_tests gpu "${TEST_JOBS:-$(nproc)}" -L gpu -LE "sanitizer|steps" ${slice[@]+"${slice[@]}"} ;;
    steps) run_tests steps "${TEST_JOBS:-$(nproc)}" -L steps ;;
    sanitizer) run_tests sanitizer "${SANITIZER_JOBS:-8}" -L sanitizer ;;
    sweep) sweep ;;
    pytorch) pytorch ;;
    variants) variants ;;
    python) python_package ;;
    decode) decode ;;
    *) log "unknown phase '$phase' (build, tests, steps, sanitizer, sweep, pytorch, variants, python, decode)" ;;
  esac
done
log "done$([ $status = 0 ] || echo ': a phase failed (exit 1)')"
checkout=$(pwd -P)
if [ -n "${PACK:-}" ] && [[ "$checkout/" == "$(cd "$out" && pwd -P)/"* ]]; then
  log "PACK: OUT_DIR holds the checkout; nothing packed or removed"
elif [ -n "${PACK:-}" ]; then
  pack=$(mktemp -d)/results.tgz
  tar -czf "$pack" -C "$out" --exclude=./summary.txt . &&
    find "$out" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} + &&
    mv "$pack" "$out/results.tgz"
fi
exit $status
