# Session 3, round 1: stage 07's forward with S and P in registers (the fragment layout
# checked at start-up), its GPU tests, its speed beside SDPA flash at N = 4096, and two
# variants of the forward (8 warps per block; Bc = 128).
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 &&
  cmake --build build -j16 --target 07_tensor_cores > $OUT/build.log 2>&1 || tail -30 $OUT/build.log
B=build/bin
timeout 300 ctest --test-dir build -R '^07_' -L gpu -LE sanitizer -j 12 --output-on-failure > $OUT/ctest.log 2>&1
grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.log | head -20
grep -B2 -A12 -m3 "Failed\|\*\*\*" $OUT/ctest.log | head -60
bench() { # program, extra args
  for d in 64 128; do for c in "" --causal; do for t in fp16 bf16; do
    $1 --bench $2 --dtype $t -b 4 -H $((2048/d)) -n 4096 -d $d $c --tsv $OUT/gpu.tsv | sed -E "s/ +/ /g"
  done; done; done
}
bench $B/07_tensor_cores --backward
python3 scripts/compare_pytorch.py --bin $B --out $OUT --no-check --backends flash --seq 4096 2>&1 | tail -2
cut -f1-3,6,8,9,11 $OUT/gpu.tsv | grep sdpa
L="build/common/libattn_gpu.a build/common/libattn_common.a -lm"
relax='s/static_assert(Warps \* Frag \* ld_s/static_assert(true || Warps * Frag * ld_s/; s/static_assert(Warps_bwd \* Frag \* ld_s/static_assert(true || Warps_bwd * Frag * ld_s/; s/static_assert($/static_assert(true || /'
sed "s/^constexpr int Warps = 4;/constexpr int Warps = 8;/; $relax" 07_tensor_cores/attention.cu > /tmp/w8.cu
sed "s/^constexpr int Bc = 64;/constexpr int Bc = 128;/; $relax" 07_tensor_cores/attention.cu > /tmp/bc128.cu
for v in w8 bc128; do
  nvcc -O3 -std=c++17 -arch=sm_90 -Icommon -I07_tensor_cores /tmp/$v.cu $L -o /tmp/$v 2>&1 | grep -i error
  echo "== variant $v"; for d in 64 128; do for c in "" --causal; do
    /tmp/$v --bench --dtype fp16 -b 4 -H $((2048/d)) -n 4096 -d $d $c | sed -E "s/ +/ /g"; done; done
done
