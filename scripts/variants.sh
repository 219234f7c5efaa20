#!/usr/bin/env bash
# Times a GPU stage built with extra compile definitions beside the stage as it is: the A/B
# measurements behind a stage's tile choices and its technique tables.
#
#   scripts/variants.sh STAGE OUT_DIR [LABEL=FLAGS ...]
#   scripts/variants.sh 09_swizzle_pipeline out bc32=-DATTN_BC=32 rows32=-DATTN_ROW_FRAGS=2
#
# FLAGS of the form step:NN build the stage as its technique step NN leaves it
# (scripts/steps.py; 08, 09 and 10 have steps): `tma=step:05 wgmma=step:07`.
# Each variant (and `base`, no extra flags) is compiled with nvcc for this GPU against the
# libraries of VARIANT_BUILD (default build-gpu, which the build phase of gpu_round.sh makes;
# VARIANT_BUILD=build after the README's `cmake --workflow --preset tour`) and timed with --bench at
# FlashAttention's convention (B = 16384/N, H = 2048/d), non-causal and causal; its rows go to
# OUT_DIR/LABEL.tsv, the stage column renamed STAGE:LABEL. VARIANT_SEQ (default "4096
# 16384"), VARIANT_DIMS ("64 128"), VARIANT_DTYPE (fp16); BACKWARD=1 times the backward too.
# VARIANT_BINS: a folder that keeps the binaries (named STAGE-LABEL, each with a STAGE-LABEL.key
# of the sources, flags and arch it was built from); one whose key still matches is timed as
# it is, not rebuilt. VARIANT_BUILD_ONLY=1 only builds them, for VARIANT_ARCH (e.g. 90), so
# that a machine without a GPU can compile what a GPU machine then only times.
# VARIANT_ALTERNATE=1 times the variants point by point (every variant at one shape, then the
# next shape), so that a drift of the GPU over the command falls on all of them alike; without
# it each variant's points run together. VARIANT_INPUTS=DIR writes each shape's inputs once
# (the base program, --check-finite --save DIR/dD_nN) and times every run on them (--load):
# the same inputs as generating them, without each run spending seconds on the generator.
set -euo pipefail
stage=${1:?usage: variants.sh STAGE OUT_DIR [LABEL=FLAGS ...]}
out=${2:?usage: variants.sh STAGE OUT_DIR [LABEL=FLAGS ...]}
shift 2
lib=${VARIANT_BUILD:-build-gpu}/common
[ -f "$lib/libattn_gpu.a" ] || {
  echo "variants.sh: no $lib/libattn_gpu.a; build first (or set VARIANT_BUILD)" >&2
  exit 1
}
mkdir -p "$out"
bins=${VARIANT_BINS:-$(mktemp -d)}
mkdir -p "$bins"
[ -n "${VARIANT_BINS:-}" ] || trap 'rm -rf "$bins"' EXIT # also when a variant fails
if [ -n "${VARIANT_ARCH:-}" ]; then
  arch=$VARIANT_ARCH
else
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
fi
labels=()
for variant in "base=" "$@"; do
  label=${variant%%=*} flags=${variant#*=}
  labels+=("$label")
  bin="$bins/$stage-$label"
  # A kept binary is reused only if built from these very sources, flags and arch.
  # attention.cu includes the stage's pass files, and earlier stages'; the stage folders only
  # (NN_name), not a build folder's steps/, whose binaries differ from machine to machine.
  key="$(export LC_ALL=C; cat "$stage/attention.cu" ./[0-9][0-9]_*/*.cuh common/*.h common/*.c \
    common/*.cu ./[0-9][0-9]_*/steps/* 2> /dev/null | sha256sum | cut -c1-16)"
  key="$key sm_$arch $flags"
  if [ ! -x "$bin" ] || [ "$(cat "$bin.key" 2>/dev/null)" != "$key" ]; then
    echo "variants.sh: building $stage-$label ($flags)" >&2
    # A stage built for an architecture-specific target (10: sm_90a) names it in its
    # CMakeLists.txt; the others are built for this GPU's.
    target=-arch="sm_$arch"
    grep -q "compute_90a" "$stage/CMakeLists.txt" && target=-gencode=arch=compute_90a,code=sm_90a
    # shellcheck disable=SC2086 # the flags are words
    if [[ "$flags" == step:* ]]; then # the stage as its technique step NN leaves it
      python3 scripts/steps.py build "$stage" "${flags#step:}" "$bin" -- nvcc -O3 -std=c++20 \
        "$target" -I"$PWD/common" "$PWD/$lib/libattn_gpu.a" "$PWD/$lib/libattn_common.a" -lm
    else
      nvcc -O3 -std=c++20 "$target" -Icommon $flags "$stage/attention.cu" \
        "$lib/libattn_gpu.a" "$lib/libattn_common.a" -lm -o "$bin"
    fi || { echo "variants.sh: $stage-$label ($flags) did not build; stopped" >&2; exit 1; }
    echo "$key" > "$bin.key"
  fi
done
[ -n "${VARIANT_BUILD_ONLY:-}" ] && exit 0

inputs=${VARIANT_INPUTS:-}
if [ -n "$inputs" ]; then
  mkdir -p "$inputs" # --save makes the shape's folder, not its parents
  for d in ${VARIANT_DIMS:-64 128}; do
    for n in ${VARIANT_SEQ:-4096 16384}; do
      dir="$inputs/d${d}_n$n"
      [ -f "$dir/q.npy" ] && continue
      rm -rf "$dir"
      "$bins/$stage-base" -b $((16384 / n)) -H $((2048 / d)) -n "$n" -d "$d" \
        --dtype "${VARIANT_DTYPE:-fp16}" ${BACKWARD:+--backward} --check-finite --save "$dir" \
        > /dev/null || {
        echo "variants.sh: writing the inputs at d = $d, N = $n failed; stopped" >&2
        exit 1
      }
    done
  done
fi
for label in "${labels[@]}"; do rm -f "$out/$label.raw.tsv"; done
# One timed run: its row goes to OUT_DIR/LABEL.raw.tsv, written row by row, so that a command
# stopped early keeps its rows.
time_point() {
  local label=$1 d=$2 n=$3 causal=$4 rows="$out/$1.raw.tsv"
  local source=(-b $((16384 / n)) -H $((2048 / d)) -n "$n" -d "$d")
  [ -n "$inputs" ] && source+=(--load "$inputs/d${d}_n$n")
  [ -n "$causal" ] && source+=("$causal")
  "$bins/$stage-$label" "${source[@]}" --dtype "${VARIANT_DTYPE:-fp16}" --bench \
    ${BACKWARD:+--backward} --tsv "$rows" | awk -v label="$label: " '{ print label $0 }' || {
    echo "variants.sh: $stage-$label failed at d = $d, N = $n ${causal:-non-causal};" \
      "its rows so far are in $rows; stopped" >&2
    exit 1
  }
}
if [ -n "${VARIANT_ALTERNATE:-}" ]; then
  for d in ${VARIANT_DIMS:-64 128}; do
    for n in ${VARIANT_SEQ:-4096 16384}; do
      for causal in "" --causal; do
        for label in "${labels[@]}"; do time_point "$label" "$d" "$n" "$causal"; done
      done
    done
  done
else
  for label in "${labels[@]}"; do
    for d in ${VARIANT_DIMS:-64 128}; do
      for n in ${VARIANT_SEQ:-4096 16384}; do
        for causal in "" --causal; do time_point "$label" "$d" "$n" "$causal"; done
      done
    done
  done
fi
for label in "${labels[@]}"; do
  awk -v name="$stage:$label" 'BEGIN { FS = OFS = "\t" } NR > 1 { $1 = name } { print }' \
    "$out/$label.raw.tsv" > "$out/$label.tsv"
  rm -f "$out/$label.raw.tsv"
done
