# Session 3, last round: the README's main command (the tour), as written, on the GPU
# machine from a fresh copy of the tree; then, with the programs it built, the 13 points of
# stage 07's sweep that the previous round's time limit cut (bf16 d = 128 backward, the
# fixed-batch memory points).
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
src=$(pwd)
rm -rf /tmp/fresh && mkdir /tmp/fresh
tar -C "$src" --exclude=./.git --exclude='./build*' -cf - . | tar -C /tmp/fresh -xf -
cd /tmp/fresh
start=$(date +%s)
timeout ${LIMIT:-330} cmake --workflow --preset tour > $OUT/tour.log 2>&1
echo "tour preset: exit $? after $(($(date +%s) - start)) s"
grep -A14 "^stage " $OUT/tour.log | head -16
tail -4 $OUT/tour.log
[ -n "${SKIP_DONE:-}" ] && timeout 100 python3 scripts/sweep.py --bin build/bin --kind gpu \
  --out $OUT/r07 --stages 07_tensor_cores --skip-done "$src/$SKIP_DONE" 2> $OUT/sweep_07_rest.log
tail -1 $OUT/sweep_07_rest.log
