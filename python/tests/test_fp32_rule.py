"""Stage 06's fp32 backward by FlashAttention's rule: its dQ, dK and dV error against float64
is at most 3 times the error of PyTorch's own fp32 attention on the same inputs (the
harness's check is an absolute bound; this test is the relative rule), plus the rounding
floor of docs/conventions.md section 3 taken in fp32. Every (Nq, Nkv) pair of the test
matrix (section 4), at d = 64 and 128, causal and not, with the harness's default inputs'
distribution (unit normal) and scale 1/sqrt(d)."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("no CUDA device of compute capability 8.0 or later", allow_module_level=True)
import flash_stages as fs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from compare_pytorch import reference as same_precision_baseline  # noqa: E402

STAGE = "06_backward"
if STAGE not in fs.stages():
    pytest.skip(f"{STAGE} is not loaded", allow_module_level=True)

# docs/conventions.md section 4: the (Nq, Nkv) pairs of the test matrix.
PAIRS = [(1, 147), (3, 799), (113, 203), (128, 217), (127, 513), (256, 512), (512, 256),
         (239, 1), (799, 3), (1023, 1024), (1024, 1023)]
HEADS = 2  # as the CTest matrix runs the pairs
RULE = 3  # FlashAttention's factor for the gradients (dQ gets 3 here as well: one rule)


@pytest.fixture
def exact_fp32_matmuls():
    """PyTorch's fp32 comparator in true fp32: TF32 would make it look worse than it is."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "{}x{}".format(*p))
def test_fp32_backward_rule(pair, d, causal, exact_fp32_matmuls):
    nq, nkv = pair
    if causal and not fs.stage_info(STAGE).causal:
        pytest.skip(f"{STAGE} has no causal mask")
    g = torch.Generator(device="cuda").manual_seed(nq * 100003 + nkv * 101 + d + causal)
    q = torch.randn(1, HEADS, nq, d, device="cuda", generator=g)
    k = torch.randn(1, HEADS, nkv, d, device="cuda", generator=g)
    v = torch.randn(1, HEADS, nkv, d, device="cuda", generator=g)
    d_o = torch.randn(1, HEADS, nq, d, device="cuda", generator=g)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    o = fs.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, stage=STAGE)
    got = torch.autograd.grad(o, (qg, kg, vg), d_o)
    assert fs.last_call["stage"] == STAGE and fs.last_call["direction"] == "backward"
    # The same attention (bottom-right mask, rows that see no key: zero gradients) in float64
    # and in PyTorch's fp32: its matmuls, softmax and autograd.
    ref = same_precision_baseline(torch, q, k, v, d_o, scale, causal, torch.float64)[2:]
    torch32 = same_precision_baseline(torch, q, k, v, d_o, scale, causal, torch.float32)[2:]
    failures = []
    for name, gs, gt, gr in zip(("dQ", "dK", "dV"), got, torch32, ref):
        assert gs.dtype == torch.float32 and gs.shape == gr.shape, f"{name}: {gs.dtype}"
        assert torch.isfinite(gs).all(), f"{name} has NaN or Inf"
        err = (gs.double() - gr).abs().max().item()
        base = (gt - gr).abs().max().item()
        x = gr.float()
        floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item()
        if not err <= RULE * base + floor:
            failures.append(f"{name} error {err:.3e} > {RULE} x {base:.3e} + {floor:.1e} "
                            f"(ratio {err / max(base, 1e-300):.2f})")
    assert not failures, "; ".join(failures)
