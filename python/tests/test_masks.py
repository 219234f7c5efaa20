"""flash_attn_func's window_size and softcap, and flash_attn_varlen_func (stage
13_window_softcap_varlen; a window alone on stage 14_hopper_window where it runs), against
PyTorch: each forward and backward, fp16 and bf16, against
float64 attention built from an explicit mask of section 1's definitions (docs/conventions.md),
by the half-precision rule test_sdpa.py uses (the error at most m times that of a plain
same-precision attention on the same inputs, plus a rounding floor; the gradients are
torch.autograd's on the float64 reference); the reference itself against SDPA's math backend
and finite differences in float64; a varlen forward replayed from a CUDA graph; and the
errors.

    python -m pytest python/tests/test_masks.py

Skipped without PyTorch, a CUDA device or stage 13's library.
"""
import math
import os
import sys

import pytest

try:
    import torch
except ImportError as e:
    pytest.skip(f"PyTorch does not import: {e}", allow_module_level=True)

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("no CUDA device of compute capability 8.0 or later", allow_module_level=True)
try:
    try:
        import flash_stages as fs
    except ImportError:  # not installed: the checkout's own package, python/flash_stages
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import flash_stages as fs
except Exception as e:
    pytest.skip(f"flash_stages does not import: {e}", allow_module_level=True)
STAGE = "13_window_softcap_varlen"
if STAGE not in fs.stages():
    pytest.skip(f"{STAGE} is not loaded", allow_module_level=True)
# The stage a window without softcap or varlen takes: Hopper's, where it loads and runs.
HOPPER_WINDOW = "14_hopper_window"
WINDOW_STAGE = (HOPPER_WINDOW if HOPPER_WINDOW in fs.stages()
                and torch.cuda.get_device_capability() == (9, 0) else STAGE)
MASKED_STAGES = (STAGE, HOPPER_WINDOW)

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ---- the reference -----------------------------------------------------------------------


def visible(nq, nkv, causal, left, right, device="cuda"):
    """[nq, nkv] booleans, key j visible to query i, from section 1's definitions: with
    diag = i + nkv - nq (bottom-right), causal keeps j <= diag, a window (left, right) keeps
    diag - left <= j <= diag + right, a side of -1 unbounded."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nkv, device=device)[None, :]
    diag = i + nkv - nq
    seen = torch.ones(nq, nkv, dtype=torch.bool, device=device)
    if causal:
        seen &= j <= diag
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    return seen


def packed_visible(lens_q, lens_k, causal, left, right, device="cuda"):
    """The varlen mask of packed rows: [total_q, total_k], each sequence's own mask on its
    block of the diagonal, nothing across sequences."""
    seen = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool, device=device)
    iq = ik = 0
    for nq, nk in zip(lens_q, lens_k):
        seen[iq:iq + nq, ik:ik + nk] = visible(nq, nk, causal, left, right, device)
        iq, ik = iq + nq, ik + nk
    return seen


def attention(q, k, v, d_o, scale, seen, softcap, dtype):
    """O, LSE, dQ, dK, dV of attention on [B, S, H, d] tensors with the mask `seen`
    ([S_q, S_k]) and the softcap c (S = c tanh(scale q.k / c) before the mask; 0: none),
    computed in `dtype`: float64 is the reference; fp16 or bf16 the rule's same-precision
    baseline, as scripts/compare_pytorch.py's reference (S in fp32, P rounded to the dtype
    before P V, the backward by autograd). Rows that see no key: O = 0, LSE = -inf, no
    gradient. LSE is [B, H, S_q]."""
    q, k, v = (x.to(dtype).detach().requires_grad_(True) for x in (q, k, v))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    s = (qh.to(acc) @ kh.to(acc).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see no key: exp(-inf - -inf)
    o = (p.to(dtype) @ vh).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o.to(dtype))
    return [x.detach().double() for x in (o, lse, dq, dk, dv)]


def rule_failures(got, low, ref, tdt, names=("O", "dQ", "dK", "dV"), factors=(2, 4, 3, 3)):
    """FlashAttention's rule (test_sdpa.py's half_precision_failures): what breaks it."""
    failures = []
    for name, m, g, lo, rf in zip(names, factors, got, low, ref):
        assert g.dtype == tdt and g.shape == rf.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{name} has NaN or Inf"
        err = (g.double() - rf).abs().max().item() if g.numel() else 0.0
        base = (lo - rf).abs().max().item() if g.numel() else 0.0
        x = rf.to(tdt)
        floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item() if g.numel() else 0.0
        if not err <= m * base + floor:
            failures.append(f"{name} error {err:.3e} > {m} x {base:.3e} + {floor:.1e}")
    return failures


def lse_failures(got, low, ref, scale_bound):
    """LSE: -inf exactly on the rows that see no key; elsewhere within 2x the baseline's error
    plus ten times the harness's fp32 bound (2e-6 max(1, max|S|), section 3)."""
    dead = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(got), dead):
        return ["LSE is not -inf exactly on the rows that see no key"]
    if dead.all():
        return []
    err = (got.double()[~dead] - ref[~dead]).abs().max().item()
    base = (low[~dead] - ref[~dead]).abs().max().item()
    bound = 2 * base + 2e-5 * max(1.0, scale_bound)
    return [] if err <= bound else [f"LSE error {err:.3e} > {bound:.3e}"]


def make(shape_q, shape_k, dtype, seed=0, amplitude=1.0):
    """q, k, v, dO with unit-normal entries (times `amplitude`, a power of two: exact)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*shape_q, device="cuda", dtype=dtype, generator=g) * amplitude
    k = torch.randn(*shape_k, device="cuda", dtype=dtype, generator=g) * amplitude
    v = torch.randn(*shape_k, device="cuda", dtype=dtype, generator=g)
    d_o = torch.randn(*shape_q, device="cuda", dtype=dtype, generator=g)
    return q, k, v, d_o


def max_logit(q, k, scale, seen, softcap):
    """max |S| over the visible pairs, for the LSE bound: flattened over batch and heads."""
    s = (q.transpose(1, 2).double() @ k.transpose(1, 2).double().transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, 0)
    return s.abs().max().item() if s.numel() else 0.0


def check_against_reference(got_o, got_lse, got_grads, q, k, v, d_o, scale, seen, softcap, tdt):
    """The rule for O and the gradients and the LSE bound, against float64 autograd."""
    ref = attention(q, k, v, d_o, scale, seen, softcap, torch.float64)
    low = attention(q, k, v, d_o, scale, seen, softcap, tdt)
    failures = rule_failures((got_o, *got_grads), (low[0], *low[2:]), (ref[0], *ref[2:]), tdt)
    failures += lse_failures(got_lse, low[1], ref[1], max_logit(q, k, scale, seen, softcap))
    dead = torch.isneginf(ref[1]).transpose(1, 2)  # [B, S_q, H]: rows that see no key
    if dead.any():
        assert (got_o[dead] == 0).all(), "a row that sees no key is not 0"
        assert (got_grads[0][dead] == 0).all(), "a row that sees no key has a dQ"
    return failures


# ---- flash_attn_func: window and softcap -------------------------------------------------

# (B, S_q, S_k, H, d, causal, window_size, softcap, amplitude): windows bounded on one side
# or both, with and without causal (which makes the right side 0: (5, 7) is (5, 0)), S_q above
# and below S_k, rows that see no key ((0, 0) and (-1, 3) at S_q > S_k: the first rows' diagonal
# lies left of every key), a decode-shaped row; softcaps with unit logits, with large ones
# (inputs x4: |scale q.k| up to about 100, far past the cap) and with a window.
CASES = [
    (2, 300, 300, 2, 64, False, (32, 16), 0.0, 1),
    (1, 257, 513, 3, 128, True, (64, -1), 0.0, 1),
    (2, 200, 100, 2, 32, False, (0, 0), 0.0, 1),
    (1, 129, 129, 2, 64, True, (5, 7), 0.0, 1),
    (1, 300, 200, 2, 64, False, (-1, 3), 0.0, 1),
    (2, 1, 400, 2, 128, False, (50, -1), 0.0, 1),
    (2, 200, 200, 2, 64, False, (-1, -1), 30.0, 1),
    (1, 300, 250, 2, 128, True, (-1, -1), 5.0, 1),
    (1, 256, 256, 2, 64, False, (-1, -1), 20.0, 4),
    (2, 160, 160, 2, 32, True, (40, 0), 10.0, 2),
]


def case_id(c):
    b, sq, sk, h, d, causal, window, softcap, amp = c
    return (f"B{b}_{sq}x{sk}_H{h}_d{d}{'_causal' if causal else ''}"
            f"{'_window%d,%d' % window if window != (-1, -1) else ''}"
            f"{'_softcap%g' % softcap if softcap else ''}{'_x%d' % amp if amp != 1 else ''}")


def expected_stage(window, softcap):
    return WINDOW_STAGE if softcap == 0 else STAGE


# Each case as the default choice takes it; a window alone also on stage 13 by name where the
# default is 14, so that both stages' windows are checked here.
PICKS = [(c, None) for c in CASES] + [(c, STAGE) for c in CASES
                                      if expected_stage(c[6], c[7]) != STAGE]


@pytest.mark.parametrize("case,stage", PICKS,
                         ids=[case_id(c) + ("" if s is None else "_" + s[:2]) for c, s in PICKS])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_and_softcap_by_the_rule(case, stage, dtype):
    """flash_attn_func with window_size and softcap runs on stage 13 (a window alone on 14 where
    it runs) and its O, LSE, dQ, dK and dV keep the half-precision rule against float64
    autograd over the explicit mask."""
    b, sq, sk, h, d, causal, window, softcap, amp = case
    tdt = DTYPES[dtype]
    q, k, v, d_o = make((b, sq, h, d), (b, sk, h, d), tdt, amplitude=amp)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    out, lse = fs.flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=softcap,
                                  return_lse=True, stage=stage)
    assert fs.last_call["stage"] == (stage or expected_stage(window, softcap))
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (qg, kg, vg), d_o)
    right = 0 if causal else window[1]  # FlashAttention's rule, which the stage keeps too
    seen = visible(sq, sk, causal, window[0], right)
    failures = check_against_reference(out.detach(), lse, grads, q, k, v, d_o, scale, seen,
                                       softcap, tdt)
    assert not failures, "; ".join(failures)


def test_causal_window_rules():
    """FlashAttention's rules: causal sets the window's right side to 0 ((5, 7) and (5, 0)
    give the same bits), a window of (-1, 0) is the causal mask (the same bits as causal=True,
    on the plain stage that call takes), and (-1, -1) with softcap 0 is the plain call."""
    q, k, v, _ = make((1, 130, 2, 64), (1, 150, 2, 64), torch.float16)
    a = fs.flash_attn_func(q, k, v, causal=True, window_size=(5, 7))
    assert fs.last_call["stage"] == WINDOW_STAGE
    assert torch.equal(a, fs.flash_attn_func(q, k, v, causal=True, window_size=(5, 0)))
    causal = fs.flash_attn_func(q, k, v, causal=True)
    plain_stage = fs.last_call["stage"]
    assert plain_stage not in MASKED_STAGES, "a plain causal call took a masked stage"
    assert torch.equal(fs.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert fs.last_call["stage"] == plain_stage
    plain = fs.flash_attn_func(q, k, v)
    assert torch.equal(fs.flash_attn_func(q, k, v, window_size=[-1, -1], softcap=0), plain)
    assert fs.last_call["stage"] not in MASKED_STAGES


def test_window_with_grouped_query_heads():
    """Stage 14 takes a window with fewer key/value heads than query heads (13 has none): the
    same bits as the call with k and v repeated to every query head, forward, and dQ with the
    deterministic path. (Its dK and dV sums over each group are checked against float64 by the
    stage's own CTest cases.)"""
    if WINDOW_STAGE != HOPPER_WINDOW:
        pytest.skip(f"{HOPPER_WINDOW} is not loaded or this GPU is not compute capability 9.0")
    q, k, v, d_o = make((2, 300, 8, 64), (2, 280, 2, 64), torch.float16)
    rep = [x.repeat_interleave(4, dim=2) for x in (k, v)]
    grads = []
    for keys, values in ((k, v), rep):
        qg = q.detach().requires_grad_(True)
        out = fs.flash_attn_func(qg, keys, values, causal=True, window_size=(100, 0),
                                 deterministic=True)
        assert fs.last_call["stage"] == HOPPER_WINDOW
        grads.append((out, torch.autograd.grad(out, qg, d_o)[0]))
    assert torch.equal(grads[0][0], grads[1][0]), "O differs from the repeated heads'"
    assert torch.equal(grads[0][1], grads[1][1]), "dQ differs from the repeated heads'"


def test_masked_calls_read_in_place():
    """Through the C++ operators, stage 13 reads flash_attn_func's [B, S, H, d] tensors and
    writes out, dq, dk and dv where PyTorch gets them, as the plain path's stages 09-12 do."""
    if not fs._OPERATORS:
        pytest.skip("the Python operators copy into [B, H, S, d]")
    q, k, v, d_o = make((2, 200, 3, 64), (2, 230, 3, 64), torch.bfloat16)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = fs.flash_attn_func(q, k, v, causal=True, window_size=(64, 0), softcap=15.0)
    call = fs.last_call.copy()
    assert (call["q"], call["k"], call["v"], call["o"]) == \
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    call = fs.last_call.copy()
    assert call["direction"] == "backward" and call["d_o"] == d_o.data_ptr()
    assert (call["dq"], call["dk"], call["dv"]) == tuple(g.data_ptr() for g in grads)


def test_torch_compile_masked_matches_eager():
    """torch.compile(fullgraph=True) traces a masked flash_attn_func (forward_masked's fake
    implementation and autograd) to the eager bits, forward and backward (deterministic dQ)."""
    q, k, v, d_o = make((2, 256, 4, 64), (2, 256, 4, 64), torch.float16)

    def block(q, k, v):
        return fs.flash_attn_func(q * 1.0, k, v, causal=True, window_size=(48, 0),
                                  softcap=20.0) * 2.0
    compiled = torch.compile(block, fullgraph=True)
    torch.use_deterministic_algorithms(True)  # 13 adds dQ by atomics otherwise
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


# ---- flash_attn_varlen_func --------------------------------------------------------------

# (query lengths, key lengths, H, d, causal, window_size, softcap): sequences of 0 and 1
# tokens among long ones; different query and key lengths, with a sequence of keys and no
# queries (its keys get no gradient) and one of a query and no keys (it sees nothing); causal
# with a window where a sequence has more queries than keys; a window with a softcap.
VARLEN = [
    ([0, 1, 300, 17, 128], [0, 1, 300, 17, 128], 2, 64, True, (-1, -1), 0.0),
    ([5, 0, 200, 1], [40, 3, 100, 0], 2, 128, False, (-1, -1), 0.0),
    ([100, 1, 63], [64, 200, 63], 2, 32, True, (16, -1), 0.0),
    ([70, 130], [70, 130], 3, 64, False, (8, 8), 5.0),
]


def varlen_id(c):
    lq, lk, h, d, causal, window, softcap = c
    return (f"q{'-'.join(map(str, lq))}_k{'-'.join(map(str, lk))}_H{h}_d{d}"
            f"{'_causal' if causal else ''}"
            f"{'_window%d,%d' % window if window != (-1, -1) else ''}"
            f"{'_softcap%g' % softcap if softcap else ''}")


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("case", VARLEN, ids=varlen_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_by_the_rule(case, dtype):
    """flash_attn_varlen_func's O [total_q, H, d], LSE [H, total_q] and gradients keep the
    half-precision rule against float64 autograd over the packed (block-diagonal) mask; rows
    that see no key are 0 with LSE -inf, and keys no query sees get dK = dV = 0."""
    lens_q, lens_k, h, d, causal, window, softcap = case
    tdt = DTYPES[dtype]
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v, d_o = make((tq, h, d), (tk, h, d), tdt)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    scale = 1 / math.sqrt(d)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    out, lse = fs.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, window_size=window, softcap=softcap,
                                         return_lse=True)
    assert fs.last_call["stage"] == STAGE
    assert out.shape == q.shape and lse.shape == (h, tq) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (qg, kg, vg), d_o)
    right = 0 if causal else window[1]
    seen = packed_visible(lens_q, lens_k, causal, window[0], right)
    failures = check_against_reference(out.detach()[None], lse[None], [g[None] for g in grads],
                                       q[None], k[None], v[None], d_o[None], scale, seen,
                                       softcap, tdt)
    assert not failures, "; ".join(failures)
    unseen = ~seen.any(dim=0)  # keys no query sees
    if unseen.any():
        assert (grads[1][unseen] == 0).all() and (grads[2][unseen] == 0).all(), \
            "a key no query sees has a gradient"


def test_varlen_reads_in_place_and_without_keys():
    """Through the C++ operators the packed tensors reach the kernels as they are; with no keys
    at all (every sequence empty on the key side) every row is 0, LSE -inf, gradients 0."""
    lens = [30, 0, 70]
    q, k, v, d_o = make((100, 2, 64), (100, 2, 64), torch.float16)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    cu = offsets(lens)
    out = fs.flash_attn_varlen_func(q, k, v, cu, cu, 70, 70, causal=True)
    if fs._OPERATORS:
        call = fs.last_call.copy()
        assert (call["q"], call["k"], call["v"], call["o"]) == \
            (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    torch.autograd.grad(out, (q, k, v), d_o)
    empty = torch.zeros(0, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out, lse = fs.flash_attn_varlen_func(q, empty, empty, cu, offsets([0, 0, 0]), 70, 0,
                                         return_lse=True)
    assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    dq, = torch.autograd.grad(out, (q,), d_o)
    assert (dq == 0).all()


def test_varlen_offsets_changed_before_the_backward_raise():
    """The offsets are saved for the backward as tensors: changed in place after the forward
    (a reused buffer), the backward raises autograd's error instead of running on them."""
    lens = [30, 70]
    q, k, v, d_o = make((100, 2, 64), (100, 2, 64), torch.float16)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    cu = offsets(lens)
    out = fs.flash_attn_varlen_func(q, k, v, cu, cu, 70, 70, causal=True)
    cu.add_(0)  # the same values, a new version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (q, k, v), d_o)


def test_varlen_graph_replays_with_new_offsets():
    """A varlen forward captured in a CUDA graph (the offsets read on the device only: a host
    read would fail the capture) replays on new tokens and new offsets written into the
    captured tensors (same totals and sequence count, each within max_seqlen) to the eager
    call's bits."""
    h, d, total = 4, 64, 256
    steps = [([100, 0, 156], [80, 50, 126]), ([1, 255, 0], [256, 0, 0]),
             ([128, 64, 64], [100, 100, 56])]
    q = torch.empty(total, h, d, device="cuda", dtype=torch.float16)
    k, v = torch.empty_like(q), torch.empty_like(q)
    cu_q = torch.empty(4, dtype=torch.int32, device="cuda")
    cu_k = torch.empty_like(cu_q)

    def fill(step):
        new_q, new_k, new_v, _ = make((total, h, d), (total, h, d), torch.float16, seed=step)
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        cu_q.copy_(offsets(steps[step][0])), cu_k.copy_(offsets(steps[step][1]))

    def call():
        return fs.flash_attn_varlen_func(q, k, v, cu_q, cu_k, total, total, causal=True,
                                         window_size=(48, -1), softcap=30.0)
    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for step in range(len(steps)):
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(captured).all(), f"step {step}: NaN or Inf"
        want = call()
        assert torch.equal(captured, want), f"step {step}: the replay differs from eager"


# ---- the reference against PyTorch in float64 ---------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if not c[7]][:4], ids=case_id)
def test_reference_is_sdpa_in_float64(case):
    """The explicit-mask reference the rule compares against is PyTorch's own attention in
    float64: SDPA's math backend with the same boolean mask gives its O and, by autograd, its
    gradients, on every row that sees a key (SDPA's rows that see none are not the stages')."""
    b, sq, sk, h, d, causal, window, _, _ = case
    q, k, v, d_o = (x.double() for x in make((b, sq, h, d), (b, sk, h, d), torch.float32))
    scale = 1 / math.sqrt(d)
    seen = visible(sq, sk, causal, window[0], 0 if causal else window[1])
    ref = attention(q, k, v, d_o, scale, seen, 0.0, torch.float64)
    qh, kh, vh = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen,
                                                             scale=scale)
    live = seen.any(dim=1)  # query rows that see a key
    d_oh = d_o.transpose(1, 2) * live[:, None]  # no gradient through SDPA's other rows
    grads = torch.autograd.grad(o, (qh, kh, vh), d_oh)
    want = [o.detach()] + list(grads)
    got = [ref[0].transpose(1, 2)] + [g.transpose(1, 2) for g in ref[2:]]
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        if name in ("O", "dQ"):
            g, w = g[:, :, live], w[:, :, live]
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


def test_softcap_reference_gradcheck():
    """The softcap's backward in the reference (autograd through c tanh(x / c)) against finite
    differences in float64, with a window and causal rows that see no key."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, device="cuda", generator=g)
               for n in (5, 4, 4))
    seen = visible(5, 4, True, 1, 0)

    def o_and_lse(q, k, v):
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        s = 0.5 * torch.tanh(qh @ kh.transpose(-1, -2) / 0.5)
        s = s.masked_fill(~seen, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        return p @ vh, lse.masked_fill(~seen.any(dim=1), 0)  # a finite LSE to differentiate
    inputs = tuple(x.requires_grad_(True) for x in (q, k, v))
    assert torch.autograd.gradcheck(o_and_lse, inputs)


# ---- errors ------------------------------------------------------------------------------


def test_bad_masks_are_clear_errors(monkeypatch):
    """A window_size that is not two ints of -1 or more, a softcap that is negative, NaN or
    outside fp32's normal range (below it the cap would round to 0: none), GQA with a window
    where no stage with a window has it (stage 13 has none), a named stage without the option, and no loaded stage with it: one
    FlashStagesError each."""
    q, k, v, _ = make((1, 64, 4, 64), (1, 64, 4, 64), torch.float16)
    for window in ((-2, 0), (3,), "ab", (1.5, 2), (True, 0), (0, -7)):
        with pytest.raises(fs.FlashStagesError, match="window_size must be two ints"):
            fs.flash_attn_func(q, k, v, window_size=window)
    for cap in (-1.0, -1e-9, 1e-40, float("nan"), float("inf"), "x", "5", "0", True):
        with pytest.raises(fs.FlashStagesError, match="softcap must be 0"):
            fs.flash_attn_func(q, k, v, softcap=cap)
    if WINDOW_STAGE == STAGE:  # 14, which has grouped-query heads, is not loaded or not run
        with pytest.raises(fs.FlashStagesError, match="grouped-query attention with a sliding"):
            fs.flash_attn_func(q, k[:, :, :2], v[:, :, :2], window_size=(8, 8))
    with pytest.raises(fs.FlashStagesError, match="grouped-query attention with a sliding"):
        fs.flash_attn_func(q, k[:, :, :1], v[:, :, :1], softcap=5.0, stage=STAGE)
    with pytest.raises(fs.FlashStagesError, match="dropout"):
        fs.flash_attn_func(q, k, v, window_size=(8, 8), dropout_p=0.1)
    other = [s for s in fs.stages() if not fs.stage_info(s).window]
    if other:
        with pytest.raises(fs.FlashStagesError, match=f"{other[0]} has no sliding window"):
            fs.flash_attn_func(q, k, v, window_size=(8, 8), stage=other[0])
    monkeypatch.setattr(fs, "_MASKED_ORDER",
                        tuple(s for s in fs._MASKED_ORDER if s != STAGE))
    with pytest.raises(fs.FlashStagesError, match="no loaded stage has a logit softcap"):
        fs.flash_attn_func(q, k, v, softcap=5.0)


def test_bad_cu_seqlens_are_clear_errors():
    """Offsets of another dtype, on another device, of another count, not starting at 0,
    decreasing, not ending at the total, a sequence past max_seqlen, a negative max_seqlen,
    q not packed: one FlashStagesError each (the values read back outside a capture)."""
    q, k, v, _ = make((100, 2, 64), (100, 2, 64), torch.float16)
    good = offsets([30, 0, 70])

    def call(cu_q=good, cu_k=good, max_q=70, max_k=70, q=q):
        return fs.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    call()
    cases = [
        (dict(cu_q=good.long()), "cu_seqlens_q must be int32"),
        (dict(cu_k=good.cpu()), "cu_seqlens_k is on cpu"),
        (dict(cu_q=good[None]), "cu_seqlens_q must be 1-D"),
        (dict(cu_q=good[:1]), "cu_seqlens_q must be 1-D"),
        (dict(cu_k=offsets([30, 70])), "cu_seqlens_q has 4 offsets and cu_seqlens_k 3"),
        (dict(cu_q=good + 1), "cu_seqlens_q must start at 0"),
        (dict(cu_k=torch.tensor([0, 60, 30, 100], dtype=torch.int32, device="cuda")),
         "cu_seqlens_k must not decrease: offset 2 \\(30\\) is below offset 1 \\(60\\)"),
        (dict(cu_q=offsets([30, 0, 60])), "cu_seqlens_q ends at 90, but q holds 100 rows"),
        (dict(max_q=69), "max_seqlen_q is 69, but sequence 2 has 70 query rows"),
        (dict(max_k=-1), "max_seqlen_k must be an int >= 0"),
        (dict(max_q=7.5), "max_seqlen_q must be an int >= 0"),
        (dict(q=q[None]), r"3-D tensor \[total, H, d\]"),
        (dict(cu_q=[0, 30, 30, 100]), "cu_seqlens_q must be a tensor"),
    ]
    for kwargs, match in cases:
        with pytest.raises(fs.FlashStagesError, match=match):
            call(**kwargs)
    with pytest.raises(fs.FlashStagesError, match="grouped-query attention with a sliding"):
        fs.flash_attn_varlen_func(q, k[:, :1], v[:, :1], good, good, 70, 70)
