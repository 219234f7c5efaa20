# Session 3: the README's test command, as written, from a fresh clone on the GPU machine
# (every GPU test and every compute-sanitizer test included).
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
src=$(pwd)
rm -rf /tmp/fresh
if git -C "$src" rev-parse -q HEAD > /dev/null 2>&1; then
  git clone -q "$src" /tmp/fresh && echo "cloned: $(git -C /tmp/fresh log --oneline -1)"
else
  echo "no .git in the copy: copying the tree" && cp -r "$src" /tmp/fresh && rm -rf /tmp/fresh/build*
fi
cd /tmp/fresh
start=$(date +%s)
timeout ${LIMIT:-570} cmake --workflow --preset test > $OUT/test_preset.log 2>&1
echo "test preset: exit $? after $(($(date +%s) - start)) s"
grep -E "tests passed|Total Test time" $OUT/test_preset.log
grep -E "\*\*\*Failed|\(Failed\)|\*\*\*Timeout|Not Run|\*\*\*Exception" $OUT/test_preset.log | head -20
echo "skipped: $(grep -c 'Skipped' $OUT/test_preset.log)"
git status --short | head
