#!/usr/bin/env python3
"""The fp16 and bf16 matrix-product ceiling of this GPU: PyTorch's 8192^3 matrix product
(cuBLAS), 5 warm-ups, median of 20, timed with CUDA events. The stage READMEs quote it as
"% of the measured matrix-product peak". Needs PyTorch and a CUDA GPU; says so otherwise."""
import statistics
import sys

N, WARMUP, REPEATS = 8192, 5, 20


def main():
    try:
        import torch
    except ImportError:
        print("matmul_peak: skipped: PyTorch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("matmul_peak: skipped: no CUDA device")
        return 0
    for dt in (torch.float16, torch.bfloat16):
        a = torch.randn(N, N, device="cuda", dtype=dt)
        b = torch.randn(N, N, device="cuda", dtype=dt)
        for _ in range(WARMUP):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(REPEATS):
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"{dt} matmul {N}^3: {ms:.3f} ms, {2 * N**3 / ms / 1e9:.0f} TFLOP/s "
              f"({torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
