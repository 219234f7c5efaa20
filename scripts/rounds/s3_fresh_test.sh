# Session 3: the README's test command, as written, from a fresh clone on the GPU machine
# (every GPU test and every compute-sanitizer test included).
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
src=$(pwd)
rm -rf /tmp/fresh
# The copy the device receives is the working tree (clean, so the same files as a clone of
# HEAD); its .git may be older than the tree, so the files are copied, not cloned.
echo "tree of: $(git -C "$src" log --oneline -1 2>/dev/null); status: $(git -C "$src" status --short 2>/dev/null | wc -l) lines"
mkdir /tmp/fresh && tar -C "$src" --exclude=./.git --exclude='./build*' -cf - . | tar -C /tmp/fresh -xf -
cd /tmp/fresh
start=$(date +%s)
timeout ${LIMIT:-570} cmake --workflow --preset test > $OUT/test_preset.log 2>&1
echo "test preset: exit $? after $(($(date +%s) - start)) s"
grep -E "tests passed|Total Test time" $OUT/test_preset.log
grep -E "\*\*\*Failed|\(Failed\)|\*\*\*Timeout|Not Run|\*\*\*Exception" $OUT/test_preset.log | head -20
echo "skipped: $(grep -c 'Skipped' $OUT/test_preset.log)"
