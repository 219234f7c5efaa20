# Final test round: every GPU test and every sanitizer test of every stage, then profiles.
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > $OUT/configure.log 2>&1 && cmake --build build -j16 > $OUT/build.log 2>&1 || { echo BUILD FAILED; tail -30 $OUT/build.log; }
grep -c "spill stores" $OUT/build.log
timeout 330 ctest --test-dir build -L gpu -LE sanitizer -j 16 > $OUT/ctest_gpu.log 2>&1; grep -E "tests passed|\*\*\*" $OUT/ctest_gpu.log | head -20
grep -c "(Skipped)\|Not Run" $OUT/ctest_gpu.log
timeout 150 ctest --test-dir build -L sanitizer -j 16 > $OUT/ctest_sanitizer.log 2>&1; grep -E "tests passed|\*\*\*" $OUT/ctest_sanitizer.log | head
scripts/profile.sh 07_tensor_cores -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_07_fwd_d64.txt 2>&1; tail -5 $OUT/ncu_07_fwd_d64.txt
scripts/profile.sh 07_tensor_cores -b 4 -H 16 -n 4096 -d 128 > $OUT/ncu_07_fwd_d128.txt 2>&1
KERNEL=flash_backward_dkdv scripts/profile.sh 07_tensor_cores --backward -b 4 -H 16 -n 4096 -d 128 > $OUT/ncu_07_dkdv_d128.txt 2>&1
scripts/profile.sh 05_causal -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_05_fwd_d64.txt 2>&1
cp build/profile/*.ncu-rep $OUT/ 2>/dev/null; ls $OUT
