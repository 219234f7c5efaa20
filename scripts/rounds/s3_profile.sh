# Session 3: the fp16/bf16 matrix-product ceiling of this GPU (PyTorch, 8192^3) and Nsight
# Compute on stage 07's new forward (d = 64 and 128) and its dK/dV kernel (d = 128).
#   bash scripts/rounds/s3_profile.sh BIN_DIR
export PATH=$PATH:/usr/local/cuda/bin
bin=${1:-build/bin}
python3 scripts/matmul_peak.py > $OUT/matmul_peak.txt 2>&1
cat $OUT/matmul_peak.txt
BIN=$bin scripts/profile.sh 07_tensor_cores -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_07_fwd_d64.txt 2>&1
BIN=$bin scripts/profile.sh 07_tensor_cores -b 4 -H 16 -n 4096 -d 128 > $OUT/ncu_07_fwd_d128.txt 2>&1
KERNEL=flash_backward_dkdv BIN=$bin scripts/profile.sh 07_tensor_cores --backward -b 4 -H 16 -n 4096 -d 128 > $OUT/ncu_07_dkdv_d128.txt 2>&1
grep -E "^  [a-z_]+|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Registers Per Thread|No Eligible|Block Limit" $OUT/ncu_07_*.txt | head -60
