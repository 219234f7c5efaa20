# The fp16/bf16 matrix-product ceiling of this GPU (PyTorch, 8192^3) and the profiles.
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 && cmake --build build -j16 --target 07_tensor_cores > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
python3 scripts/matmul_peak.py > $OUT/matmul_peak.txt 2>&1
cat $OUT/matmul_peak.txt
scripts/profile.sh 07_tensor_cores -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_07_fwd_d64.txt 2>&1
KERNEL=flash_backward_dkdv scripts/profile.sh 07_tensor_cores --backward -b 4 -H 16 -n 4096 -d 128 > $OUT/ncu_07_dkdv_d128.txt 2>&1
grep -E "^  [a-z_]+|Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per Thread|Shared Memory" $OUT/ncu_07_*.txt | head -40
