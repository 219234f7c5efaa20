"""The package against PyTorch: every loaded stage's forward and gradients against SDPA's math
backend in float64 on the same rounded inputs (docs/conventions.md section 3: the
half-precision rule for stages 07-12, the fp32 bound for 03-06), over ragged N, Nq != Nkv,
causal and fully masked rows; torch.compile of a function that calls it; the no-copy claim;
the errors and the fallback."""
import math
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("no CUDA device of compute capability 8.0 or later", allow_module_level=True)
import flash_stages as fs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from compare_pytorch import reference as same_precision_baseline  # noqa: E402

if not fs.stages():
    pytest.skip("no stage library loaded", allow_module_level=True)

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

HALF = [s for s in fs.HALF_STAGES if s in fs.stages()]
FP32 = [s for s in ("03_cuda_forward", "04_shared_memory", "05_causal", "06_backward")
        if s in fs.stages()]
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ATOMIC_DQ = ("09_swizzle_pipeline", "10_hopper_wgmma", "11_split_kv_decode",  # dQ by atomics
             "12_hopper_backward")  # (12: by the copy engine's reduce-add)

# (B, H, Nq, Nkv, d, causal): ragged N, Nq != Nkv both ways, every head dim, and causal
# shapes with Nq > Nkv, whose first Nq - Nkv rows see no key (O = 0, zero gradients).
SHAPES = [
    (1, 2, 1000, 1000, 64, False),
    (2, 3, 777, 1025, 128, True),
    (1, 4, 300, 200, 64, True),
    (2, 2, 17, 17, 32, True),
    (1, 3, 129, 129, 128, False),
    (1, 2, 1, 147, 64, False),
    (3, 2, 239, 1, 32, True),
    (1, 1, 513, 127, 128, True),
]


def bottom_right_mask(nq, nkv, device):
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nkv, device=device)[None, :]
    return j <= i + (nkv - nq)


def float64_reference(q, k, v, d_o, causal, scale):
    """O, dQ, dK, dV from SDPA's math backend in float64, with the stages' bottom-right mask
    (for Nq == Nkv SDPA's own is_causal; rows that see no key give 0, as the stages do)."""
    q, k, v = (x.double().detach().requires_grad_(True) for x in (q, k, v))
    mask = bottom_right_mask(q.shape[2], k.shape[2], q.device) if causal else None
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=scale)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o.double())
    return o.detach(), dq, dk, dv


def inputs(shape, dtype, seed=0):
    b, h, nq, nkv, d, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, h, nkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, h, nkv, d, device="cuda", dtype=dtype, generator=g)
    d_o = torch.randn(b, h, nq, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, d_o


def run_stage(stage, q, k, v, d_o, causal, backward=True):
    q, k, v = (x.detach().requires_grad_(backward) for x in (q, k, v))
    o = fs.scaled_dot_product_attention(q, k, v, is_causal=causal, stage=stage)
    if not backward:
        return (o.detach(),)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), d_o))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}_{}x{}_d{}{}".format(
    *s[:5], "_causal" if s[5] else ""))
@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
@pytest.mark.parametrize("stage", HALF)
def test_half_precision_rule(stage, dtype, shape):
    """FlashAttention's rule: the stage's error against float64 is at most m times the error
    of a plain same-precision attention (S in fp32, P rounded to the dtype) on the same
    inputs, plus a rounding floor; m = 2 for O, 4 for dQ, 3 for dK and dV."""
    tdt = HALF_DTYPES[dtype]
    causal = shape[5]
    q, k, v, d_o = inputs(shape, tdt)
    scale = 1 / math.sqrt(shape[4])
    got = run_stage(stage, q, k, v, d_o, causal)
    ref = float64_reference(q, k, v, d_o, causal, scale)
    o_low, _, *grads_low = same_precision_baseline(torch, q, k, v, d_o, scale, causal, tdt)
    failures = half_precision_failures(got, [o_low, *grads_low], ref, tdt)
    assert not failures, "; ".join(failures)


def half_precision_failures(got, low, ref, tdt):
    """FlashAttention's rule for O, dQ, dK, dV (m = 2, 4, 3, 3): what breaks it, as lines."""
    failures = []
    for name, m, g, lo, rf in zip(("O", "dQ", "dK", "dV"), (2, 4, 3, 3), got, low, ref):
        assert g.dtype == tdt and g.shape == rf.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{name} has NaN or Inf"
        err = (g.double() - rf).abs().max().item()
        base = (lo.double() - rf).abs().max().item()
        x = rf.to(tdt)
        floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item()
        if not err <= m * base + floor:
            failures.append(f"{name} error {err:.3e} > {m} x {base:.3e} + {floor:.1e}")
    return failures


# (B, H, Nq, Nkv, d, causal), with 2 key/value heads: decode (Nq = 1 and 4) and prefill.
GQA_SHAPES = [(2, 8, 1, 300, 128, True), (1, 8, 4, 1000, 64, True), (2, 4, 129, 200, 64, False)]


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "B{}H{}_{}x{}_d{}{}".format(
    *s[:5], "_causal" if s[5] else ""))
def test_grouped_query_forward(shape):
    """Stage 11's enable_gqa forward by the half-precision rule for O, against float64
    attention over the key/value heads repeated for their query heads."""
    if "11_split_kv_decode" not in fs.stages():
        pytest.skip("11_split_kv_decode is not loaded")
    b, h, nq, nkv, d, causal = shape
    heads_kv, scale = 2, 1 / math.sqrt(d)
    q, k, v, d_o = inputs(shape, torch.float16)
    k, v = k[:, :heads_kv].contiguous(), v[:, :heads_kv].contiguous()
    got = fs.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                          stage="11_split_kv_decode")
    k_all, v_all = (x.repeat_interleave(h // heads_kv, dim=1) for x in (k, v))
    ref = float64_reference(q, k_all, v_all, d_o, causal, scale)[0]
    low = same_precision_baseline(torch, q, k_all, v_all, d_o, scale, causal, torch.float16)[0]
    assert torch.isfinite(got).all(), "O has NaN or Inf"
    err = (got.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    x = ref.to(torch.float16)
    floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item()
    assert err <= 2 * base + floor, f"O error {err:.3e} > 2 x {base:.3e} + {floor:.1e}"


@pytest.mark.parametrize("shape", GQA_SHAPES + [(2, 8, 300, 259, 128, True)],
                         ids=lambda s: "B{}H{}_{}x{}_d{}{}".format(*s[:5],
                                                                   "_causal" if s[5] else ""))
@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
def test_grouped_query_backward(shape, dtype):
    """Stage 12's enable_gqa forward and backward by the half-precision rule, against float64
    attention over the key/value heads repeated for their query heads: dK and dV of a
    key/value head are the sums over its group, which autograd forms through the repeat."""
    stage = "12_hopper_backward"
    if stage not in fs.stages() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{stage} is not loaded, or this GPU is not compute capability 9.0")
    b, h, nq, nkv, d, causal = shape
    heads_kv, scale, tdt = 2, 1 / math.sqrt(d), HALF_DTYPES[dtype]
    q, k, v, d_o = inputs(shape, tdt)
    k, v = k[:, :heads_kv].contiguous(), v[:, :heads_kv].contiguous()
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    o = fs.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=True,
                                        stage=stage)
    got = (o.detach(), *torch.autograd.grad(o, (qg, kg, vg), d_o))

    def repeated(k, v):
        return (x.repeat_interleave(h // heads_kv, dim=1) for x in (k, v))

    kr, vr = (x.double().detach().requires_grad_(True) for x in (k, v))
    qr = q.double().detach().requires_grad_(True)
    mask = bottom_right_mask(nq, nkv, q.device) if causal else None
    with sdpa_kernel(SDPBackend.MATH):
        o_ref = torch.nn.functional.scaled_dot_product_attention(qr, *repeated(kr, vr),
                                                                 attn_mask=mask, scale=scale)
    ref = (o_ref.detach(), *torch.autograd.grad(o_ref, (qr, kr, vr), d_o.double()))
    o_low, _, dq_low, dk_all, dv_all = same_precision_baseline(torch, q, *repeated(k, v), d_o,
                                                               scale, causal, tdt)
    group = h // heads_kv
    dk_low = dk_all.unflatten(1, (heads_kv, group)).double().sum(2)
    dv_low = dv_all.unflatten(1, (heads_kv, group)).double().sum(2)
    failures = half_precision_failures(got, (o_low, dq_low, dk_low, dv_low), ref, tdt)
    assert not failures, "; ".join(failures)


FP32_SHAPES = [(1, 2, 129, 129, 64, False), (2, 3, 113, 203, 32, True),
               (1, 2, 300, 200, 128, True)]


@pytest.mark.parametrize("shape", FP32_SHAPES, ids=lambda s: "B{}H{}_{}x{}_d{}{}".format(
    *s[:5], "_causal" if s[5] else ""))
@pytest.mark.parametrize("stage", FP32)
def test_fp32_bound(stage, shape):
    """The fp32 stages' bound (docs/conventions.md section 3): forward 2e-6, backward 2e-5,
    each times max(1, max|S|) and max(1, max|V|) or max(1, max|g_ref|)."""
    info = fs.stage_info(stage)
    causal = shape[5]
    if causal and not info.causal:
        pytest.skip(f"{stage} has no causal mask")
    q, k, v, d_o = inputs(shape, torch.float32)
    scale = 1 / math.sqrt(shape[4])
    got = run_stage(stage, q, k, v, d_o, causal, backward=info.backward)
    ref = float64_reference(q, k, v, d_o, causal, scale)
    s = scale * q.double() @ k.double().transpose(-1, -2)
    if causal:  # max|S| over the logits a row sees, as the harness takes it (reference.c)
        s = s.masked_fill(~bottom_right_mask(s.shape[-2], s.shape[-1], s.device), 0)
    s_max = max(1.0, s.abs().max().item())
    bound_o = 2e-6 * s_max * max(1.0, v.abs().max().item())
    err = (got[0].double() - ref[0]).abs().max().item()
    assert err <= bound_o, f"O error {err:.3e} > {bound_o:.3e}"
    for name, g, rf in zip(("dQ", "dK", "dV"), got[1:], ref[1:]):
        bound = 2e-5 * s_max * max(1.0, rf.abs().max().item())
        err = (g.double() - rf).abs().max().item()
        assert err <= bound, f"{name} error {err:.3e} > {bound:.3e}"


def fastest_half():
    if not HALF:
        pytest.skip("no half-precision stage loaded")
    return [s for s in fs.PREFERENCE if s in HALF][0]


def test_default_is_the_fastest_stage_that_fits():
    stage = fastest_half()
    q, k, v, _ = inputs((1, 2, 64, 64, 64, False), torch.float16)
    fs.scaled_dot_product_attention(q, k, v)
    assert fs.last_call["stage"] == stage
    if "06_backward" in fs.stages():
        q32 = q.float().requires_grad_(True)
        fs.scaled_dot_product_attention(q32, k.float(), v.float(), is_causal=True)
        assert fs.last_call["stage"] == "06_backward"


def test_no_copies():
    """The kernels read PyTorch's tensors and write the tensors PyTorch returns."""
    stage = fastest_half()
    q, k, v, d_o = inputs((2, 3, 200, 200, 64, True), torch.float16)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    o = fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    call = fs.last_call.copy()
    assert (call["q"], call["k"], call["v"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert call["o"] == o.data_ptr()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o)
    call = fs.last_call.copy()
    assert call["direction"] == "backward" and call["d_o"] == d_o.data_ptr()
    assert (call["dq"], call["dk"], call["dv"]) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())


IN_PLACE = [s for s in ("09_swizzle_pipeline", "11_split_kv_decode") if s in fs.stages()]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("stage", IN_PLACE)
def test_flash_attn_func_reads_bshd_in_place(stage, deterministic):
    """Where the stage reads [B, S, H, d] in place, flash_attn_func hands its kernels PyTorch's
    own tensors, forward and backward, and gets the bits the same stage gives on [B, H, S, d]
    (dQ added by atomics, in no fixed order: to its rounding)."""
    if not fs._OPERATORS:
        pytest.skip("the Python operators copy into [B, H, S, d]")
    q, k, v, d_o = inputs((2, 3, 200, 333, 64, True), torch.float16)
    qh, kh, vh = (x.clone().requires_grad_(True) for x in (q, k, v))
    torch.use_deterministic_algorithms(deterministic)
    try:
        want = fs.scaled_dot_product_attention(qh, kh, vh, is_causal=True, stage=stage)
        want_grads = torch.autograd.grad(want, (qh, kh, vh), d_o)
    finally:
        torch.use_deterministic_algorithms(False)
    qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    out = fs.flash_attn_func(qs, ks, vs, causal=True, stage=stage, deterministic=deterministic)
    call = fs.last_call.copy()
    assert (call["q"], call["k"], call["v"], call["o"]) == \
        (qs.data_ptr(), ks.data_ptr(), vs.data_ptr(), out.data_ptr())
    assert torch.equal(out.transpose(1, 2), want)
    dos = d_o.transpose(1, 2).contiguous()
    grads = torch.autograd.grad(out, (qs, ks, vs), dos)
    call = fs.last_call.copy()
    assert call["d_o"] == dos.data_ptr()
    assert (call["dq"], call["dk"], call["dv"]) == tuple(g.data_ptr() for g in grads)
    for name, g, w in zip(("dQ", "dK", "dV"), grads, want_grads):
        if name == "dQ" and not deterministic:
            torch.testing.assert_close(g.transpose(1, 2), w, rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(g.transpose(1, 2), w), f"{name} differs between the layouts"


def test_repeated_calls_take_their_plan():
    """A call repeated on the same shapes (a model's layers, a decode loop) skips the checks
    and the stage choice: through the C++ operators planned_forward finds the first call's
    plan (for the default scale and stage; others keep theirs in Python). It runs the same
    stage to the same bits, for both entries; a plan is by everything the choice read, so the
    same shapes with a gradient wanted, another mask, scale or a stage named are planned
    anew."""
    q, k, v, d_o = inputs((2, 4, 200, 200, 64, True), torch.float16)
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    firsts = []
    for call, args in ((lambda *t: fs.scaled_dot_product_attention(*t, is_causal=True), (q, k, v)),
                       (lambda *t: fs.flash_attn_func(*t, causal=True), (qs, ks, vs))):
        firsts.append(call(*args))
        stage = fs.last_call["stage"]
        again = call(*args)
        assert fs.last_call["stage"] == stage and torch.equal(firsts[-1], again)
    if fs._OPERATORS:  # flags: 1 causal (2 gqa, 4 seq_major, 8 deterministic)
        planned = torch.ops.flash_stages.planned_forward(q, k, v, 1)
        assert len(planned) == 2 and torch.equal(planned[0], firsts[0])
        unplanned = torch.ops.flash_stages.planned_forward(q, k, v, 0)
        assert unplanned == [], "a causal call's plan served a non-causal one"
    scaled = [fs.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
              for _ in range(2)]  # another scale: planned in Python
    assert torch.equal(scaled[0], scaled[1]) and not torch.equal(scaled[0], firsts[0])
    named = [s for s in fs.stages() if fs.stage_info(s).causal and torch.float16 in
             fs.stage_info(s).dtypes and s != stage]
    if named:
        fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=named[0])
        assert fs.last_call["stage"] == named[0]
    if "12_hopper_backward" in fs.stages():  # GQA: 11 without a gradient, 12 with one
        qg, kg, vg, _ = inputs(GQA_SHAPES[2], torch.float16)
        kg, vg = kg[:, :2].contiguous(), vg[:, :2].contiguous()
        for grad in (False, True, True):
            qq, kk, vv = (x.detach().requires_grad_(grad) for x in (qg, kg, vg))
            o = fs.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
            if grad:
                assert fs.last_call["stage"] == "12_hopper_backward"
                torch.autograd.grad(o.sum(), (qq, kk, vv))


def test_second_derivative_raises():
    """The stages have no double backward: the gradients of a create_graph=True backward
    cannot be differentiated again, and saying so beats a silent zero. A plain backward
    (create_graph=False, the training case) gives the same gradients as one that kept the
    graph (to the rounding of dQ's atomic sums)."""
    q, k, v, d_o = inputs((1, 2, 64, 64, 64, True), torch.float16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = fs.scaled_dot_product_attention(q, k, v, is_causal=True)
    plain = torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)
    with pytest.raises(RuntimeError):
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o, create_graph=True)
        for got, want in zip((dq, dk, dv), plain):  # dQ's atomics: not bit for bit
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        torch.autograd.grad(dq.float().sum(), q)


def test_torch_compile_traces_without_graph_breaks():
    stage = fastest_half()
    q, k, v, d_o = inputs((2, 4, 256, 256, 64, True), torch.float16)

    def block(q, k, v):
        return fs.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True, stage=stage) * 2.0

    compiled = torch.compile(block, fullgraph=True)
    torch.use_deterministic_algorithms(True)  # 09 adds dQ by atomics otherwise
    try:
        results = []
        for fn in (block, compiled):
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            o = fn(qq, kk, vv)
            results.append((o.detach(), *torch.autograd.grad(o, (qq, kk, vv), d_o)))
    finally:
        torch.use_deterministic_algorithms(False)
    for name, eager, comp in zip(("O", "dQ", "dK", "dV"), *results):
        assert torch.equal(eager, comp), f"{name} differs between eager and compiled"


def test_flash_attn_func_is_sdpa_on_the_other_layout():
    """flash_attn_func on [B, S, H, d] (GQA too) gives SDPA's entry's bits on the transposed
    tensors, its LSE is the kernel's, and its gradients arrive in [B, S, H, d]."""
    stage = fastest_half()
    q, k, v, d_o = inputs((2, 4, 129, 257, 64, True), torch.float16)
    want = fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    out, lse = fs.flash_attn_func(qs, ks, vs, causal=True, return_lse=True, stage=stage)
    assert out.shape == qs.shape and lse.shape == (2, 4, 129) and lse.dtype == torch.float32
    assert torch.equal(out.transpose(1, 2), want)
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), d_o.transpose(1, 2))
    assert dq.shape == qs.shape and dk.shape == ks.shape and dv.shape == vs.shape
    if "12_hopper_backward" in fs.stages() and stage == "12_hopper_backward":
        qg = torch.randn(1, 64, 8, 64, device="cuda", dtype=torch.float16)
        kg, vg = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
                  for _ in range(2))
        got = fs.flash_attn_func(qg, kg, vg, causal=True)
        ref = fs.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2),
                                              vg.transpose(1, 2), is_causal=True,
                                              enable_gqa=True)
        assert torch.equal(got.transpose(1, 2), ref)


def test_flash_attn_func_deterministic_per_call(monkeypatch):
    """deterministic=True takes the stage's deterministic dQ path in that call alone: the same
    bits as ATTN_DETERMINISTIC=1, call after call."""
    have = torch.cuda.get_device_capability()
    stage = next((s for s in ATOMIC_DQ if s in fs.stages() and
                  fs._NEEDS_CAPABILITY.get(s, have) == have), None)
    if stage is None:
        pytest.skip("no stage with a deterministic dQ path runs on this GPU")
    q, k, v, d_o = inputs((2, 4, 300, 300, 64, True), torch.float16)
    qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))

    def dq(**flag):
        out = fs.flash_attn_func(qs, ks, vs, causal=True, stage=stage, **flag)
        return torch.autograd.grad(out, (qs,), d_o.transpose(1, 2))[0]
    grads = [dq(deterministic=True) for _ in range(3)]
    monkeypatch.setenv("ATTN_DETERMINISTIC", "1")
    want = dq()
    monkeypatch.delenv("ATTN_DETERMINISTIC")
    for g in grads:
        assert torch.equal(g, want), "deterministic=True differs from ATTN_DETERMINISTIC=1"


def test_flash_attn_func_errors_are_clear():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(fs.FlashStagesError, match=r"\[B, S, H, d\]"):
        fs.flash_attn_func(q[0], q, q)
    with pytest.raises(fs.FlashStagesError, match="CUDA tensors"):
        fs.flash_attn_func(q.cpu(), q, q)
    with pytest.raises(fs.FlashStagesError, match="softmax_scale"):
        fs.flash_attn_func(q, q, q, softmax_scale=float("inf"))
    with pytest.raises(fs.FlashStagesError, match="dropout"):
        fs.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(fs.FlashStagesError, match="multiple of the key/value heads"):
        fs.flash_attn_func(torch.randn(1, 16, 3, 64, device="cuda", dtype=torch.float16), q, q)
    with pytest.raises(TypeError):  # keyword-only: FlashAttention's positional dropout_p
        fs.flash_attn_func(q, q, q, 0.0)


def test_cuda_graph_replay_matches_eager():
    """Forward and backward captured in one CUDA graph replay to the eager call's bits (on the
    deterministic path, so that dQ's additions come in one order)."""
    stage = fastest_half()
    q, k, v, d_o = inputs((1, 4, 256, 256, 64, True), torch.float16)
    static = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def step():
        o = fs.scaled_dot_product_attention(*static, is_causal=True, stage=stage)
        return (o, *torch.autograd.grad(o, static, d_o))
    torch.use_deterministic_algorithms(True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
            eager = [t.clone() for t in step()]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), eager, captured):
        assert torch.equal(a, b), f"{name} differs between eager and the replayed graph"


def test_decode_graph_replays_with_new_tokens():
    """A decode step (one query against a grouped-query cache: stage 11's split over the keys,
    its merge and its workspace) captured once replays on new inputs copied into the
    captured tensors, as a serving loop does, giving the eager results bit for bit."""
    if "11_split_kv_decode" not in fs.stages():
        pytest.skip("11_split_kv_decode is not loaded")
    q, k, v, _ = inputs((2, 32, 1, 4096, 128, False), torch.float16)
    k, v = k[:, :8].contiguous(), v[:, :8].contiguous()
    static_q = q.clone()

    def step():
        return fs.scaled_dot_product_attention(static_q, k, v, enable_gqa=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    assert fs.last_call["stage"] == "11_split_kv_decode"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        new_q = inputs((2, 32, 1, 4096, 128, False), torch.float16, seed=seed)[0]
        static_q.copy_(new_q)
        graph.replay()
        torch.cuda.synchronize()
        want = fs.scaled_dot_product_attention(new_q, k, v, enable_gqa=True)
        assert torch.equal(captured, want), f"replay {seed} differs from the eager call"


def test_compile_reduce_overhead_matches_eager():
    """torch.compile's reduce-overhead mode (CUDA graphs of the compiled region) on a small
    block gives the eager results, call after call."""
    stage = fastest_half()
    q, k, v, _ = inputs((2, 4, 128, 128, 64, True), torch.float16)

    def block(q, k, v):
        return fs.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True, stage=stage) + 1.0
    compiled = torch.compile(block, mode="reduce-overhead")
    want = block(q, k, v)
    for _ in range(3):  # the first calls record, the later ones replay
        got = compiled(q, k, v)
        assert torch.equal(got, want), "reduce-overhead differs from eager"


def test_non_contiguous_inputs_give_the_same_result():
    stage = fastest_half()
    b, n, h, d = 2, 130, 3, 64
    x = torch.randn(b, n, 3 * h, d, device="cuda", dtype=torch.float16)
    q, k, v = (t.transpose(1, 2) for t in x.split(h, dim=2))  # [B, H, N, d] views
    assert not q.is_contiguous()
    got = fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    want = fs.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                           is_causal=True, stage=stage)
    assert torch.equal(got, want)


@pytest.mark.parametrize("stage", HALF)
def test_inputs_off_a_16_byte_boundary(stage):
    """Contiguous views that start 2 bytes past a 16-byte boundary (the kernels copy 16 bytes
    at a time; stage 10's TMA needs the boundary too): copied into place, same bits as
    inputs that start on one, forward and gradients (deterministic dQ, so bits compare)."""
    b, h, n, d = 1, 2, 130, 64
    elems = b * h * n * d
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(4 * elems + 1, device="cuda", dtype=torch.float16, generator=g)
    q, k, v, d_o = (flat[1 + i * elems:1 + (i + 1) * elems].view(b, h, n, d) for i in range(4))
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    torch.use_deterministic_algorithms(True)
    try:
        got = run_stage(stage, q, k, v, d_o, True)
        want = run_stage(stage, q.clone(), k.clone(), v.clone(), d_o, True)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert torch.equal(a, w), f"{name} differs from that of aligned inputs"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_that_is_not_current():
    stage = fastest_half()
    q, k, v, _ = inputs((1, 2, 128, 128, 64, True), torch.float16)
    want = fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    with torch.cuda.device(1):
        got = fs.scaled_dot_product_attention(q, k, v, is_causal=True, stage=stage)
    assert got.device == q.device and torch.equal(got, want)
    # and the other way round: tensors on GPU 1 while GPU 0 is current
    on_1 = [x.detach().to("cuda:1") for x in (q, k, v)]
    got = fs.scaled_dot_product_attention(*on_1, is_causal=True, stage=stage)
    assert got.device == on_1[0].device and torch.equal(got.cpu(), want.cpu())


def test_side_stream_is_ordered():
    stage = fastest_half()
    q, k, v, _ = inputs((4, 8, 1024, 1024, 64, False), torch.float16)
    want = fs.scaled_dot_product_attention(q, k, v, stage=stage)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = q * 1  # made on the side stream, read by the kernels right after
        got = fs.scaled_dot_product_attention(q2, k, v, stage=stage)
        got = got * 1  # consumed on the side stream
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


def test_runs_on_the_current_stream():
    """With the default stream held busy by a long spin, a call on a side stream (PyTorch's
    are non-blocking) finishes, and its output reads right on that stream, while the spin
    still runs: the kernels were queued on the side stream, not behind the spin."""
    stage = fastest_half()
    q, k, v, _ = inputs((2, 4, 512, 512, 64, False), torch.float16)
    want = fs.scaled_dot_product_attention(q, k, v, stage=stage)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    torch.cuda._sleep(2_000_000_000)  # on the default stream: about a second on an H100
    with torch.cuda.stream(side):
        got = fs.scaled_dot_product_attention(q, k, v, stage=stage).clone()
    side.synchronize()
    still_spinning = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    assert still_spinning, "the call waited for the default stream"
    assert torch.equal(got, want), "the output was read on the current stream before written"


def test_deterministic_backward_when_asked():
    stage = fastest_half()
    q, k, v, d_o = inputs((2, 4, 512, 512, 64, False), torch.float16)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [run_stage(stage, q, k, v, d_o, False) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def test_deterministic_mode_and_variable_agree(monkeypatch):
    """torch's deterministic mode and the caller's ATTN_DETERMINISTIC=1 take the same path,
    bit for bit (the atomics' sums would differ in their last bits), and the mode leaves the
    environment as the caller set it."""
    stage = fastest_half()
    q, k, v, d_o = inputs((2, 4, 512, 512, 64, False), torch.float16)
    monkeypatch.setenv("ATTN_DETERMINISTIC", "1")
    by_variable = run_stage(stage, q, k, v, d_o, False)
    assert os.environ.get("ATTN_DETERMINISTIC") == "1"
    monkeypatch.delenv("ATTN_DETERMINISTIC")
    torch.use_deterministic_algorithms(True)
    try:
        by_mode = run_stage(stage, q, k, v, d_o, False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert "ATTN_DETERMINISTIC" not in os.environ
    for name, a, b in zip(("O", "dQ", "dK", "dV"), by_variable, by_mode):
        assert torch.equal(a, b), f"{name} differs between the variable and the mode"
    if stage in ATOMIC_DQ:  # the atomics' dQ differs in its last bits: the test can tell
        by_atomics = run_stage(stage, q, k, v, d_o, False)
        assert not torch.equal(by_atomics[1], by_mode[1]), "dQ by atomics matched bit for bit"


@pytest.mark.parametrize("name,value", [("ATTN_DETERMINISTIC", "yes"),
                                        ("ATTN_SHARED_MEMORY_LIMIT", "96k"),
                                        ("ATTN_SHARED_MEMORY_LIMIT", "0"),
                                        ("ATTN_SHARED_MEMORY_LIMIT", " -5"),
                                        ("ATTN_DECODE_CHUNK_KEYS", "-4"),
                                        ("ATTN_DECODE_CHUNK_KEYS", "100")])
def test_bad_environment_is_an_error(monkeypatch, name, value):
    """A value the harness refuses (its programs exit 2) is an exception here, not the end of
    the process, on the fastest stage's backward and on stage 11's decode path (whose
    workspace size already reads the variables); the same calls run once it is gone."""
    stage = fastest_half()
    q, k, v, d_o = inputs((1, 2, 64, 64, 64, False), torch.float16)
    calls = [lambda: run_stage(stage, q, k, v, d_o, False)]
    if "11_split_kv_decode" in fs.stages():
        qd, kd, vd, _ = inputs(GQA_SHAPES[0], torch.float16)  # Nq = 1: the decode path
        kd, vd = kd[:, :2].contiguous(), vd[:, :2].contiguous()
        calls.append(lambda: fs.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, enable_gqa=True, stage="11_split_kv_decode"))
    monkeypatch.setenv(name, value)
    for call in calls:
        with pytest.raises(fs.FlashStagesError, match=name):
            call()
    monkeypatch.delenv(name)
    for call in calls:
        call()


@pytest.mark.parametrize("stage", HALF)
def test_device_refusal_is_an_error(monkeypatch, stage):
    """Where the stage program exits 2 inside a pass (here every tile needs more shared memory
    than ATTN_SHARED_MEMORY_LIMIT allows), the call raises FlashStagesError (in the backward,
    a ValueError) with the program's line and the process goes on: the same calls then run
    and give the same outputs."""
    q, k, v, d_o = inputs((1, 2, 64, 64, 64, False), torch.float16)
    want = run_stage(stage, q, k, v, d_o, False)
    monkeypatch.setenv("ATTN_SHARED_MEMORY_LIMIT", "1024")
    with pytest.raises(fs.FlashStagesError, match=r"bytes of shared memory.*\(in the forward\)"):
        run_stage(stage, q, k, v, d_o, False, backward=False)
    monkeypatch.delenv("ATTN_SHARED_MEMORY_LIMIT")
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o = fs.scaled_dot_product_attention(qg, kg, vg, stage=stage)
    monkeypatch.setenv("ATTN_SHARED_MEMORY_LIMIT", "1024")
    # The backward runs inside autograd, where the C++ operators' refusal is the ValueError
    # of which FlashStagesError is a kind (the Python operators raise FlashStagesError).
    with pytest.raises(ValueError, match=r"bytes of shared memory.*\(in the backward\)"):
        torch.autograd.grad(o, (qg, kg, vg), d_o)
    monkeypatch.delenv("ATTN_SHARED_MEMORY_LIMIT")
    got = run_stage(stage, q, k, v, d_o, False)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), want, got):
        if stage in ATOMIC_DQ and name == "dQ":  # atomics: the last bit may differ
            torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)
        else:
            assert torch.equal(a, b), f"{name} changed after the refusal"


def test_decode_refusal_is_an_error(monkeypatch):
    """Stage 11 plans its decode split (and checks its tiles' shared memory) when asked for
    the workspace size, before the pass: a refusal there is an exception too."""
    if "11_split_kv_decode" not in fs.stages():
        pytest.skip("stage 11 not loaded")
    q, k, v, _ = inputs(GQA_SHAPES[0], torch.float16)  # Nq = 1: the decode path
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()

    def call():
        return fs.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               stage="11_split_kv_decode")
    want = call()
    monkeypatch.setenv("ATTN_SHARED_MEMORY_LIMIT", "1024")
    with pytest.raises(fs.FlashStagesError,
                       match=r"bytes of shared memory.*\(in the forward workspace\)"):
        call()
    monkeypatch.delenv("ATTN_SHARED_MEMORY_LIMIT")
    assert torch.equal(call(), want), "O changed after the refusal"


def test_errors_are_clear():
    stage = fastest_half()
    q, k, v, _ = inputs((1, 2, 64, 64, 64, False), torch.float16)
    with pytest.raises(fs.FlashStagesError, match="CUDA tensors"):
        fs.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), stage=stage)
    with pytest.raises(fs.FlashStagesError, match="takes float16, bfloat16 inputs"):
        fs.scaled_dot_product_attention(q.float(), k.float(), v.float(), stage=stage)
    q40 = torch.randn(1, 2, 64, 40, device="cuda", dtype=torch.float16)
    with pytest.raises(fs.FlashStagesError, match="head dims \\[32, 64, 128\\], not 40"):
        fs.scaled_dot_product_attention(q40, q40, q40, stage=stage)
    with pytest.raises(fs.FlashStagesError, match="must be 4-D"):
        fs.scaled_dot_product_attention(q[0], k[0], v[0], stage=stage)
    with pytest.raises(fs.FlashStagesError, match="must agree in batch and head dim"):
        fs.scaled_dot_product_attention(q, k[..., :32], v[..., :32], stage=stage)
    with pytest.raises(fs.FlashStagesError, match="enable_gqa=True"):
        fs.scaled_dot_product_attention(q, k[:, :1], v[:, :1], stage=stage)
    for other in ("09_swizzle_pipeline", "08_mma_sync"):  # stages without GQA
        if other in fs.stages():
            with pytest.raises(fs.FlashStagesError, match="11_split_kv_decode"):
                fs.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True,
                                                stage=other)
    if "11_split_kv_decode" in fs.stages():  # GQA, but no GQA backward
        with pytest.raises(fs.FlashStagesError, match="comes in 12_hopper_backward"):
            fs.scaled_dot_product_attention(q.requires_grad_(True), k[:, :1], v[:, :1],
                                            enable_gqa=True, stage="11_split_kv_decode")
        q = q.detach()
    with pytest.raises(fs.FlashStagesError, match="no attn_mask"):
        fs.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=bool,
                                                                      device="cuda"))
    with pytest.raises(fs.FlashStagesError, match="no stage named"):
        fs.scaled_dot_product_attention(q, k, v, stage="99_nothing")
    one_row = torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    huge = one_row.expand(1, 1, 1 << 25, 64)  # 2^25 rows, past the programs' 2^24
    with pytest.raises(fs.FlashStagesError, match="too large"):
        fs.scaled_dot_product_attention(huge, huge, huge, stage=stage)
    if "03_cuda_forward" in fs.stages():
        q32, k32, v32 = q.float(), k.float(), v.float()
        with pytest.raises(fs.FlashStagesError, match="comes in 05_causal"):
            fs.scaled_dot_product_attention(q32, k32, v32, is_causal=True,
                                            stage="03_cuda_forward")
        with pytest.raises(fs.FlashStagesError, match="comes in 06_backward"):
            fs.scaled_dot_product_attention(q32.requires_grad_(True), k32, v32,
                                            stage="03_cuda_forward")


def test_fallback_says_so_once_and_keeps_the_alignment():
    stage = fastest_half()
    q = torch.randn(1, 2, 90, 40, device="cuda", dtype=torch.float16)  # d = 40: no stage
    k = torch.randn(1, 2, 60, 40, device="cuda", dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fs.scaled_dot_product_attention(q, k, k, is_causal=True, stage=stage,
                                              fallback=True)
        fs.scaled_dot_product_attention(q, k, k, is_causal=True, stage=stage, fallback=True)
    said = [w for w in caught if "falling back to torch SDPA" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    mask = bottom_right_mask(90, 60, "cuda")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    rows_seeing_keys = mask.any(-1)
    assert torch.allclose(got[:, :, rows_seeing_keys], want[:, :, rows_seeing_keys], atol=2e-3)
    # attn_mask, which no stage takes, goes to SDPA with its own warning, once, and the mask.
    keep = torch.rand(90, 60, device="cuda") < 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fs.scaled_dot_product_attention(q, k, k, attn_mask=keep, fallback=True)
        fs.scaled_dot_product_attention(q, k, k, attn_mask=keep, fallback=True)
    said = [w for w in caught if "no attn_mask" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=keep)
    assert torch.allclose(got, want, atol=2e-3, equal_nan=True)
    # Dropout, which no stage takes, goes to SDPA with the stages' bottom-right alignment:
    # the same bits as SDPA given that mask (the same kernel, seed and drops; SDPA's top-left
    # is_causal would run another kernel with other drops).
    qs, ks = q[:, :, :30], k  # Nq < Nkv: top-left would hide keys bottom-right shows
    torch.manual_seed(7)
    got = fs.scaled_dot_product_attention(qs, ks, ks, is_causal=True, dropout_p=0.3,
                                          fallback=True)
    torch.manual_seed(7)
    want = torch.nn.functional.scaled_dot_product_attention(
        qs, ks, ks, attn_mask=causal_lower_right(30, 60), dropout_p=0.3)
    assert torch.equal(got, want)
    # CPU tensors, which no stage takes, go to SDPA too.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fs.scaled_dot_product_attention(q.float().cpu(), k.float().cpu(),
                                              k.float().cpu(), fallback=True)
    assert any("CUDA tensors" in str(w.message) for w in caught)
    want = torch.nn.functional.scaled_dot_product_attention(q.float().cpu(), k.float().cpu(),
                                                            k.float().cpu())
    assert torch.equal(got, want)
    # ... with the attn_mask they were given.
    qc, kc, keep_c = q.float().cpu(), k.float().cpu(), keep.cpu()
    got = fs.scaled_dot_product_attention(qc, kc, kc, attn_mask=keep_c, fallback=True)
    want = torch.nn.functional.scaled_dot_product_attention(qc, kc, kc, attn_mask=keep_c)
    assert torch.allclose(got, want, equal_nan=True)


def test_cpp_operators_run_where_built():
    """Where the C++ operators were built for this torch (libflash_stages_operators.so and its
    .torch beside the stage libraries), the package runs them, unless
    FLASH_STAGES_PYTHON_OPERATORS=1 asks for the Python ones (CTest runs the suite both ways):
    a build whose operators silently failed to load would otherwise test only the Python
    path."""
    built = os.path.join(fs.LIBRARY_DIR, "libflash_stages_operators.torch")
    python_asked = os.environ.get("FLASH_STAGES_PYTHON_OPERATORS") == "1"
    if python_asked or not os.path.exists(built):
        assert not fs._OPERATORS
        return
    with open(built) as f:
        assert f.read().strip() == torch.__version__, "built for another torch"
    assert fs._OPERATORS
    q, k, v, _ = inputs((1, 2, 64, 64, 64, False), torch.float16)
    fs.scaled_dot_product_attention(q, k, v)
    assert torch.ops.flash_stages.last_call()[1] == "forward"
