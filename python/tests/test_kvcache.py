"""flash_stages.flash_attn_with_kvcache: decode against a KV cache in FlashAttention's layout,
each sequence with its own length, against float64 attention over that sequence's keys alone.

    python -m pytest python/tests/test_kvcache.py

Skipped without PyTorch, a CUDA device or stage 11's library.
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
if "11_split_kv_decode" not in fs.stages():
    pytest.skip("11_split_kv_decode is not loaded", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from compare_pytorch import reference as same_precision_baseline  # noqa: E402

# (B, H, Hkv, S_q, S_cache, d, causal, cache_seqlens): an empty cache, a one-key cache and a
# full one in one batch; causal with more queries than keys (rows that see no key); a cache
# length that is not a multiple of any tile; one length for the whole batch (an int).
CASES = [
    (3, 8, 2, 1, 300, 128, True, [0, 1, 300]),
    (2, 8, 8, 1, 1000, 64, False, [517, 64]),
    (2, 4, 1, 4, 257, 64, True, [2, 257]),
    (1, 32, 8, 1, 4096, 128, False, 3001),
    (2, 4, 2, 16, 700, 32, True, [700, 300]),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def case_id(case):
    b, h, hkv, sq, s, d, causal, lens = case
    return f"B{b}H{h}Hkv{hkv}_{sq}x{s}_d{d}{'_causal' if causal else ''}"


def make(case, dtype, seed=0):
    """q [B, S_q, H, d] and caches [B, S_cache, Hkv, d] whose keys past each sequence's length
    are NaN: a kernel that read one would put NaN in that sequence's output."""
    b, h, hkv, sq, s, d, causal, lens = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
    per_seq = lens if isinstance(lens, list) else [lens] * b
    for i, n in enumerate(per_seq):
        k[i, n:] = float("nan")
        v[i, n:] = float("nan")
    return q, k, v, per_seq


def sequence_reference(q, k, v, n, causal, scale, dtype):
    """O [S_q, H, d] and LSE [H, S_q] of one sequence over its first n keys, in float64, and
    O from a plain attention in `dtype` (the rule's baseline); rows that see no key: O = 0,
    LSE = -inf."""
    sq, h, d = q.shape
    hkv = k.shape[1]
    qh = q.transpose(0, 1)[None]                                      # [1, H, S_q, d]
    kh, vh = (x[:n].transpose(0, 1).repeat_interleave(h // hkv, dim=0)[None] for x in (k, v))
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    visible = (j <= i + n - sq) if causal else torch.ones(sq, n, dtype=torch.bool,
                                                           device=q.device)
    s = scale * qh.double() @ kh.double().transpose(-1, -2)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)                                  # [1, H, S_q]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)                 # -inf - -inf: no key
    o = (p @ vh.double())[0].transpose(0, 1)                          # [S_q, H, d]
    low = None
    if n > 0:
        d_o = torch.zeros_like(qh)
        low = same_precision_baseline(torch, qh, kh, vh, d_o, scale, causal, dtype)[0]
        low = low[0].transpose(0, 1)
    return o, lse[0], low


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", ["host", "device"])
def test_kvcache_by_sequence(case, dtype, form):
    """Each sequence's O and LSE as float64 attention over its own keys gives them, O by the
    half-precision rule (error at most 2x that of a plain attention in the same precision,
    plus a rounding floor), rows that see no key exactly 0 and -inf. form: the lengths as
    given (read on the host, split by the longest), or as int32 on the GPU (read there only,
    split as for full caches)."""
    dt = DTYPES[dtype]
    b, h, hkv, sq, s, d, causal, lens = case
    q, k, v, per_seq = make(case, dt)
    scale = 1 / math.sqrt(d)
    if form == "device":
        lens = torch.tensor(per_seq, dtype=torch.int32, device="cuda")
    out, lse = fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=causal,
                                          return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    assert fs.last_call["stage"] == "11_split_kv_decode"
    if fs._OPERATORS:  # the C++ operators hand the kernels the caches as they are
        assert (fs.last_call["k"], fs.last_call["v"]) == (k.data_ptr(), v.data_ptr())
    for i, n in enumerate(per_seq):
        ref_o, ref_lse, low = sequence_reference(q[i], k[i], v[i], n, causal, scale, dt)
        got = out[i]
        assert torch.isfinite(got).all(), f"sequence {i}: NaN or Inf in O (a key past {n} read?)"
        sees_none = torch.isinf(ref_lse).transpose(0, 1)  # [S_q, H]
        assert (got[sees_none] == 0).all(), f"sequence {i}: a row that sees no key is not 0"
        assert torch.isneginf(lse[i][sees_none.transpose(0, 1)]).all()
        if low is None:
            continue
        err = (got.double() - ref_o).abs().max().item()
        base = (low.double() - ref_o).abs().max().item()
        x = ref_o.to(dt)
        floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item()
        assert err <= 2 * base + floor, \
            f"sequence {i} (length {n}): O error {err:.3e} > 2 x {base:.3e} + {floor:.1e}"
        seen = ~torch.isinf(ref_lse)
        lse_err = (lse[i].double()[seen] - ref_lse[seen]).abs().max().item()
        assert lse_err <= 1e-2, f"sequence {i}: LSE error {lse_err:.3e}"


def test_cache_seqlens_forms_agree():
    """An int, a list, a CPU int64 tensor and a CUDA int64 tensor of the same lengths give the
    same output, bit for bit (each is read on the host); so does None where every sequence is
    full. A CUDA int32 tensor, read on the GPU only and split as for full caches, may sum in
    another order: the same output to fp16's rounding."""
    case = (3, 8, 2, 1, 300, 64, False, [120, 120, 120])
    q, k, v, _ = make(case, torch.float16)
    want = fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=120)
    for form in ([120] * 3, torch.full((3,), 120), torch.full((3,), 120, device="cuda")):
        assert torch.equal(fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=form), want)
    full = fs.flash_attn_with_kvcache(q[:, :, :], k[:, :120], v[:, :120])
    assert torch.equal(full, want)
    on_gpu = torch.full((3,), 120, dtype=torch.int32, device="cuda")
    torch.testing.assert_close(fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=on_gpu), want)


def test_kvcache_graph_replays_with_new_lengths():
    """A decode step with the lengths as int32 on the GPU, captured once in a CUDA graph (no
    host read, no synchronisation: a capture would fail on one), replays on new queries, new
    cache contents and new lengths written into the captured tensors, as a serving loop does:
    each replay gives the eager call's output bit for bit, and reads no key past the new
    lengths (NaN there)."""
    b, h, hkv, sq, s, d = 4, 32, 8, 1, 2048, 128
    steps = [[2048, 1, 700, 0], [5, 2000, 64, 1500], [1024, 1024, 2047, 3]]
    q = torch.empty(b, sq, h, d, device="cuda", dtype=torch.float16)
    k = torch.empty(b, s, hkv, d, device="cuda", dtype=torch.float16)
    v = torch.empty_like(k)
    lens = torch.empty(b, dtype=torch.int32, device="cuda")

    def fill(step):
        """The step's inputs, written into the captured tensors."""
        case = (b, h, hkv, sq, s, d, False, steps[step])
        new_q, new_k, new_v, _ = make(case, torch.float16, seed=step)
        q.copy_(new_q), k.copy_(new_k), v.copy_(new_v)
        lens.copy_(torch.tensor(steps[step], dtype=torch.int32))

    def decode():
        return fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode()
    for step in range(len(steps)):
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(captured).all(), f"step {step}: a key past its length was read"
        want = decode()
        assert torch.equal(captured, want), f"step {step}: the replay differs from eager"


def test_kvcache_matches_flash_attn_func_on_full_caches():
    """With every sequence full, the decode call is flash_attn_func's forward on the same
    tensors, by the same rule (different stages may round differently)."""
    case = (2, 8, 2, 1, 512, 128, True, 512)
    q, k, v, _ = make(case, torch.bfloat16)
    got = fs.flash_attn_with_kvcache(q, k, v, causal=True)
    want = fs.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_full_cache_calls_take_their_plan():
    """Without cache_seqlens (full caches) a repeated call takes its plan from C++, as
    flash_attn_func's: the same stage and bits as the first call, no gradient recorded even
    on inputs that want one, and a plan of its own, apart from flash_attn_func's on the same
    tensors (which does record one)."""
    case = (2, 8, 2, 1, 512, 128, True, 512)
    q, k, v, _ = make(case, torch.float16)
    first = fs.flash_attn_with_kvcache(q, k, v, causal=True)
    stage = fs.last_call["stage"]
    again = fs.flash_attn_with_kvcache(q, k, v, causal=True)
    assert fs.last_call["stage"] == stage == "11_split_kv_decode" and torch.equal(first, again)
    if fs._OPERATORS:  # flags: 1 causal, 2 gqa, 4 seq_major, 16 no gradient
        planned = torch.ops.flash_stages.planned_forward(q, k, v, 1 | 2 | 4 | 16)
        assert len(planned) == 2 and torch.equal(planned[0], first)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    for _ in range(2):  # the first call plans, the second takes the plan
        out = fs.flash_attn_with_kvcache(qg, kg, vg, causal=True)
        assert not out.requires_grad and torch.equal(out, first)
    recorded = fs.flash_attn_func(qg, kg, vg, causal=True)
    assert recorded.requires_grad, "flash_attn_func's call took the no-gradient plan"


@pytest.mark.parametrize("lens, match", [
    ([301, 5, 5], r"cache_seqlens 301 is outside 0\.\.300"),
    ([-1, 5, 5], r"cache_seqlens -1 is outside 0\.\.300"),
    ([5, 5], r"2 lengths for a batch of 3"),
    (torch.ones(3), r"must hold integers"),
    ("five", r"must be an int, a list or a tensor of ints"),
])
def test_bad_cache_seqlens_are_clear_errors(lens, match):
    q, k, v, _ = make((3, 8, 2, 1, 300, 64, False, 300), torch.float16)
    with pytest.raises(fs.FlashStagesError, match=match):
        fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)


def test_bad_cache_seqlens_on_the_gpu_are_clear_errors_outside_a_capture():
    """Lengths given as int32 on the GPU are read back and checked in an eager call."""
    q, k, v, _ = make((3, 8, 2, 1, 300, 64, False, 300), torch.float16)
    lens = torch.tensor([5, 301, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(fs.FlashStagesError, match=r"cache_seqlens 301 is outside 0\.\.300"):
        fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)


def test_bad_tensors_are_clear_errors():
    """Mixed devices, mismatched head dims, heads that do not divide, a stage without cache
    lengths: one FlashStagesError each, never a crash."""
    q, k, v, _ = make((2, 8, 2, 1, 64, 64, False, 64), torch.float16)
    with pytest.raises(fs.FlashStagesError, match="cpu"):
        fs.flash_attn_with_kvcache(q, k.cpu(), v.cpu())
    with pytest.raises(fs.FlashStagesError, match="head dim"):
        fs.flash_attn_with_kvcache(q, k[..., :32], v[..., :32])
    with pytest.raises(fs.FlashStagesError, match="multiple of the key/value heads"):
        fs.flash_attn_with_kvcache(q, k[:, :, :1].expand(-1, -1, 3, -1),
                                   v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(fs.FlashStagesError, match="3-D|4-D"):
        fs.flash_attn_with_kvcache(q[0], k, v)
    other = [s for s in fs.stages() if not fs.stage_info(s).cache_lens]
    if other:
        with pytest.raises(fs.FlashStagesError, match="takes no cache lengths"):
            fs.flash_attn_with_kvcache(q, k, v, stage=other[0])


def test_views_are_read_correctly():
    """A cache that is a slice of a larger buffer and a q whose last dimension is strided are
    read as the values they hold."""
    q, k, v, _ = make((2, 8, 2, 1, 128, 64, False, 128), torch.float16)
    big_k = torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.float16)
    big_v = torch.randn_like(big_k)
    big_k[:, 64:192], big_v[:, 64:192] = k, v
    wide_q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.float16)
    wide_q[..., ::2] = q
    want = fs.flash_attn_with_kvcache(q, k, v, cache_seqlens=100)
    got = fs.flash_attn_with_kvcache(wide_q[..., ::2], big_k[:, 64:192], big_v[:, 64:192],
                                     cache_seqlens=100)
    assert torch.equal(got, want)
