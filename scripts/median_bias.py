"""python3 scripts/median_bias.py (needs PyTorch and a GPU): how far the upper middle of 20 sorted times (compare_pytorch's old median) sits above the
mean of the two middle ones (the programs' median), for SDPA flash at FlashAttention's sizes."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
prop = torch.cuda.get_device_properties(0)
flush = torch.empty(2 * prop.L2_cache_size, dtype=torch.uint8, device="cuda")
print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("direction d N causal round upper_ms median_ms upper/median")
worst = 0
for d in (64, 128):
    for n in (4096, 16384):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                o = fwd()
                bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                for name, fn in (("fwd", fwd), ("bwd", bwd)):
                    for rnd in range(3):
                        for _ in range(5):
                            fn()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        t = []
                        for _ in range(20):
                            flush.zero_()
                            s.record(); fn(); e.record(); torch.cuda.synchronize()
                            t.append(s.elapsed_time(e))
                        t.sort()
                        up, med = t[10], 0.5 * (t[9] + t[10])
                        worst = max(worst, up / med - 1)
                        print(name, d, n, int(causal), rnd, f"{up:.4f} {med:.4f} {up / med:.5f}")
print(f"largest upper/median - 1: {100 * worst:.3f}%")
