# Final benchmark round: the sweeps of the stages changed this session, and PyTorch's.
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1 && cmake --build build -j16 --target 06_backward 07_tensor_cores > $OUT/build.log 2>&1 || tail -20 $OUT/build.log
save() { mkdir -p $OUT/results; cp docs/results/nvidia-h200/gpu.tsv $OUT/results/; }
python3 scripts/bench.py --bin build/bin --stages 07_tensor_cores pytorch --budget 200 --pytorch-budget 140 2> $OUT/bench07.log | tail -3; tail -2 $OUT/bench07.log; save
python3 scripts/bench.py --bin build/bin --stages 06_backward --no-pytorch --budget 130 2> $OUT/bench06.log | tail -2; tail -2 $OUT/bench06.log; save
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/device.txt
