# What the deterministic dQ pass costs: the backward timed with and without the dQ kernel.
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 && cmake --build build -j16 --target 06_backward 07_tensor_cores attn_gpu > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
L="build/common/libattn_gpu.a build/common/libattn_common.a -lm"
for s in 06_backward 07_tensor_cores; do
python3 - $s <<'PY'
import sys
s = sys.argv[1]
src = open(f"{s}/attention.cu").read()
a = src.index("  attn_require_shared_memory((const void *)flash_backward_dq_kernel")
b = src.index('CHECK_LAUNCH("flash_backward_dq_kernel");') + len('CHECK_LAUNCH("flash_backward_dq_kernel");')
open(f"/tmp/{s}_nodq.cu", "w").write(src[:a] + src[b:])
PY
nvcc -O3 -std=c++17 -arch=sm_90 -Icommon /tmp/${s}_nodq.cu $L -o /tmp/${s}_nodq &
done; wait
for d in 64 128; do for c in "" --causal; do
  for v in build/bin/06_backward /tmp/06_backward_nodq; do $v --bench --backward -b 4 -H $((2048/d)) -n 4096 -d $d $c | grep bwd | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4 | sed "s|^|$v |"; done
  for v in build/bin/07_tensor_cores /tmp/07_tensor_cores_nodq; do $v --bench --backward -b 4 -H $((2048/d)) -n 4096 -d $d $c | grep bwd | sed -E "s/ +/ /g" | cut -d"|" -f1,3,4 | sed "s|^|$v |"; done
done; done
