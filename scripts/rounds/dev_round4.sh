export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build-gpu -j16 --target 07_tensor_cores > $OUT/build.log 2>&1 || tail -30 $OUT/build.log
B=build-gpu/bin
L="build-gpu/common/libattn_gpu.a build-gpu/common/libattn_common.a -lm"
V=07_tensor_cores/attention.cu
sed 's/^constexpr int Warps = 4;/constexpr int Warps = 8;/' $V > /tmp/fw8.cu && nvcc -O3 -std=c++17 -arch=sm_90 -Icommon /tmp/fw8.cu $L -o /tmp/fw8 &
timeout 200 ctest --test-dir build-gpu -R '^07_' -L gpu -LE sanitizer -j 16 --output-on-failure > $OUT/ctest.log 2>&1; grep -E "tests passed|Failed  |\*\*\*Failed" $OUT/ctest.log | head -20
wait
for d in 64 128; do for c in "" --causal; do for v in $B/07_tensor_cores /tmp/fw8; do for dt in fp16 bf16; do echo "== $v"; $v --bench --backward --dtype $dt -b 4 -H $((2048/d)) -n 4096 -d $d $c | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4; done; done; done; done
for v in $B/07_tensor_cores /tmp/fw8; do $v --bench --dtype fp16 -b 1 -H 16 -n 16384 -d 128 | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4; $v --bench --dtype fp16 -b 1 -H 32 -n 16384 -d 64 | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4; done
