#!/usr/bin/env python3
"""How far the upper middle of 20 sorted times (compare_pytorch.timed_median before commit
c8bf43c) sits above their median, the mean of the two middle ones (the stage programs'), for
one SDPA backend (flash, the default, cudnn or efficient) at FlashAttention's sizes: fp16,
N = 4096 and 16384, d = 64 and 128, causal and not, forward and backward, three rounds of 20
after 5 warm-ups, the L2 flushed before each repeat. Prints TSV rows, then the largest
excess. Needs PyTorch and a CUDA GPU.

    python3 scripts/median_bias.py [flash|cudnn|efficient] > bias.tsv
"""
import sys

ROUNDS, WARMUPS, REPEATS = 3, 5, 20


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "flash"
    if len(sys.argv) > 2 or backend not in ("flash", "cudnn", "efficient"):
        sys.exit("usage: median_bias.py [flash|cudnn|efficient]")
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        sys.exit("median_bias: needs PyTorch")
    if not torch.cuda.is_available():
        sys.exit("median_bias: needs a CUDA GPU")
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    prop = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * prop.L2_cache_size, dtype=torch.uint8, device="cuda")
    print(f"# device {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"cuda {torch.version.cuda} backend {backend}")
    print("direction\td\tN\tcausal\tround\tupper_middle_ms\tmedian_ms\tupper_over_median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    worst = 0.0
    for d in (64, 128):
        for n in (4096, 16384):
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            for causal in (False, True):
                with sdpa_kernel(backends[backend]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    calls = (("fwd", lambda: F.scaled_dot_product_attention(
                                 q, k, v, is_causal=causal)),
                             ("bwd", lambda: torch.autograd.grad(o, (q, k, v), do,
                                                                 retain_graph=True)))
                    for name, fn in calls:
                        for rnd in range(ROUNDS):
                            for _ in range(WARMUPS):
                                fn()
                            times = []
                            for _ in range(REPEATS):
                                flush.zero_()
                                start.record()
                                fn()
                                end.record()
                                torch.cuda.synchronize()
                                times.append(start.elapsed_time(end))
                            times.sort()
                            upper = times[REPEATS // 2]
                            median = 0.5 * (times[REPEATS // 2 - 1] + times[REPEATS // 2])
                            worst = max(worst, upper / median - 1)
                            print(f"{name}\t{d}\t{n}\t{int(causal)}\t{rnd}\t{upper:.4f}\t"
                                  f"{median:.4f}\t{upper / median:.5f}", flush=True)
    print(f"# largest upper/median - 1: {100 * worst:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
