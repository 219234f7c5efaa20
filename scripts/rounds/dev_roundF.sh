# An H100 spot check at N = 4096: stages 06 and 07 beside PyTorch's flash and efficient.
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 && cmake --build build -j16 --target 06_backward 07_tensor_cores > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
for d in 64 128; do for c in "" --causal; do
  build/bin/06_backward --bench --backward -b 4 -H $((2048/d)) -n 4096 -d $d $c --tsv $OUT/gpu.tsv | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4
  for t in fp16 bf16; do build/bin/07_tensor_cores --bench --backward --dtype $t -b 4 -H $((2048/d)) -n 4096 -d $d $c --tsv $OUT/gpu.tsv | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4; done
done; done
python3 scripts/compare_pytorch.py --bin build/bin --out $OUT --no-check --backends flash efficient --seq 4096 2>/dev/null
cut -f1-3,6,8,9,11 $OUT/gpu.tsv | grep sdpa
