export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build-gpu -j16 --target 07_tensor_cores > $OUT/build.log 2>&1 || tail -30 $OUT/build.log
B=build-gpu/bin
ctest --test-dir build-gpu -R '07_.*(overflow|magnitude)' -j 16 --output-on-failure > $OUT/ctest.log 2>&1; grep -E "tests passed|Failed|\*\*\*|tol" $OUT/ctest.log | head -20
python3 scripts/compare_pytorch.py --bin $B --out $OUT/res --no-check --backends flash --seq 4096 2>/dev/null
cut -f1-3,6,8,9,11 $OUT/res/gpu.tsv
obj=$(find build-gpu -name 'attention.cu.o' -path '*07_*')
cuobjdump -sass $obj | awk '/Function : /{f=$3} /HMMA|LDSM|LDS|STS|F2FP/{split($2,a,"."); n[f" "a[1]]++} END{for(k in n) print n[k], k}' | grep forward | grep Li64 | sort -k2
L="build-gpu/common/libattn_gpu.a build-gpu/common/libattn_common.a -lm"
nvcc -O3 -std=c++17 -arch=sm_90 -Icommon -DATTN_SKEW=0 07_tensor_cores/attention.cu $L -o /tmp/skew0
sed 's/^constexpr int Warps = 4;/constexpr int Warps = 8;/; s/static_assert(Br <= Bc/static_assert(true/' 07_tensor_cores/attention.cu > 07_tensor_cores/w8.cu
nvcc -O3 -std=c++17 -arch=sm_90 -Icommon 07_tensor_cores/w8.cu $L -o /tmp/w8 2>&1 | grep -i error
for d in 64 128; do for v in $B/07_tensor_cores /tmp/skew0 /tmp/w8; do for dt in fp16 bf16; do echo -n "$v "; $v --bench --backward --dtype $dt -b 4 -H $((2048/d)) -n 4096 -d $d | cut -c1-20,50-70,104-140 | tr '\n' ' '; echo; done; done; done
ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -k regex:flash_forward -c 1 $B/07_tensor_cores --dtype fp16 -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_fwd64.txt 2>&1
ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -k regex:flash_forward -c 1 $B/07_tensor_cores --dtype bf16 -b 4 -H 32 -n 4096 -d 64 > $OUT/ncu_fwd64_bf16.txt 2>&1
grep -E "Throughput|Pipe|Bank|Warp Cycles|Issue" $OUT/ncu_fwd64.txt | head -30
