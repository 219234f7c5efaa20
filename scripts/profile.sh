#!/usr/bin/env bash
# Nsight Compute on one stage and one shape: the few sections that explain a stage's
# numbers (docs/profiling.md says how to read them), one kernel, a report to open later.
#
#   scripts/profile.sh STAGE [stage options]          e.g.
#   scripts/profile.sh 07_tensor_cores -b 4 -H 32 -n 4096 -d 64
#   KERNEL=flash_backward_dkdv scripts/profile.sh 07_tensor_cores --backward --bench -n 4096 -b 4 -H 16 -d 128
#
# KERNEL: a regular expression of the kernel's name (default: the forward kernel);
# BIN: the folder of the stage programs (default build/bin). The report goes to
# build/profile/STAGE.ncu-rep (open it with ncu-ui, or ncu --import ... --page details).
set -euo pipefail
stage=${1:?usage: scripts/profile.sh STAGE [stage options]}
shift
bin=${BIN:-build/bin}
kernel=${KERNEL:-flash_forward|attention_forward|naive|softmax}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$ncu" ] || { echo "profile: Nsight Compute (ncu) not found; it comes with the CUDA toolkit" >&2; exit 2; }
[ -x "$bin/$stage" ] || { echo "profile: $bin/$stage not built (cmake --workflow --preset test builds it)" >&2; exit 2; }
mkdir -p build/profile
# --bench is not added: the default run already launches the kernel a few times (a large
# backward needs --bench, or the check's float64 reference refuses the size); -c 1
# profiles the first launch that matches (ncu replays it, flushing caches between passes).
"$ncu" --kernel-name "regex:$kernel" --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --export "build/profile/$stage" --force-overwrite "$bin/$stage" "$@"
# The numbers themselves, from the report just written.
"$ncu" --import "build/profile/$stage.ncu-rep" --page details
