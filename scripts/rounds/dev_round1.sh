export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name --format=csv,noheader
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build-gpu -j16 --target 06_backward 07_tensor_cores > $OUT/build.log 2>&1 || tail -30 $OUT/build.log
B=build-gpu/bin
$B/07_tensor_cores --check --backward -n 1025 -d 128 --causal
$B/07_tensor_cores --check --backward -b 2 -H 3 --seq-q 300 --seq-kv 200 -d 64 --causal --dtype bf16
for d in 64 128; do for c in "" --causal; do $B/06_backward --bench --backward -b 4 -H $((2048/d)) -n 4096 -d $d $c; done; done
for dt in fp16 bf16; do for d in 64 128; do for c in "" --causal; do $B/07_tensor_cores --bench --backward --dtype $dt -b 4 -H $((2048/d)) -n 4096 -d $d $c; done; done; done
timeout 200 ctest --test-dir build-gpu -R '^0[67]_' -L gpu -LE sanitizer -j 16 > $OUT/ctest.log 2>&1; grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.log | head -40
timeout 60 python3 scripts/compare_pytorch.py --bin $B --out $OUT/res --no-bench
