# Finish the sweeps the last round's budget cut (points already in gpu.tsv are skipped).
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 && cmake --build build -j16 --target 06_backward 07_tensor_cores > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
python3 scripts/sweep.py --bin build/bin --kind gpu --stages 07_tensor_cores 06_backward --skip-done docs/results/nvidia-h200/gpu.tsv --out $OUT/rest --budget 330 2> $OUT/sweep.log; tail -2 $OUT/sweep.log
scripts/profile.sh 07_tensor_cores -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_07_fwd_d64.txt 2>&1; grep -E "Throughput|Achieved Occupancy|Registers Per|Bank" $OUT/ncu_07_fwd_d64.txt | head
