"""Every GPU stage of the repository, called from PyTorch like
torch.nn.functional.scaled_dot_product_attention.

    import flash_stages
    o = flash_stages.scaled_dot_product_attention(q, k, v, is_causal=True)       # fastest stage
    o = flash_stages.scaled_dot_product_attention(q, k, v, stage="08_mma_sync")  # one stage

q is [B, H, Nq, d], k and v [B, H, Nkv, d] (or [B, Hkv, Nkv, d] with enable_gqa=True: stages
10 and 11 forward only, 12 forward and backward), CUDA tensors. The kernels are the stage
programs' own (each stage's .cu file built as a library, common/stage_library.cu), run on
PyTorch's tensors: the output is allocated by PyTorch and written by the kernel. Inputs in a
layout the stage reads (dense row-major [B, H, N, d], docs/conventions.md section 1, starting
on a 16-byte boundary; from stage 09 on, through the C++ operators, also a dense [B, N, H, d]
seen through transpose(1, 2)) are read in place; any other is first copied into one. Two
custom operators, flash_stages::forward and
flash_stages::backward, carry the autograd formula and a fake-tensor implementation, so
torch.compile traces a call without a graph break.

What differs from SDPA, on purpose:
  - is_causal is aligned bottom-right (key j is visible to query i when j <= i + Nkv - Nq),
    FlashAttention's convention and the repository's; for Nq == Nkv it is SDPA's mask. A row
    that sees no key gets O = 0 and zero gradients.
  - no attn_mask and no dropout: a stage computes plain or causal attention only.
What a stage does not support (dtype, head dim, causal, backward, grouped-query attention) is
a FlashStagesError that says which stage supports it; with fallback=True the call goes to
PyTorch's SDPA instead, with one warning per reason.

FlashAttention's sliding window and logit softcap (flash_attn_func's window_size and softcap)
and its packed variable-length batches (flash_attn_varlen_func) run on a stage that has them
(13_window_softcap_varlen; a window alone on 14_hopper_window on Hopper), through two more
operators, flash_stages::forward_masked and
flash_stages::backward_masked.

Streams: the kernels run on PyTorch's current stream (the harness's attn_stream(), which the
library sets around each call; the stage programs leave it at the legacy default stream).
CUDA graphs: a call can be captured (torch.cuda.graph, torch.compile's reduce-overhead mode).
Its host code makes no allocation outside PyTorch's caching allocator (the workspace is a
torch tensor), no synchronisation, and only asynchronous memsets on the current stream. A
replay repeats the captured launches: the harness's variables (ATTN_DETERMINISTIC, ...) as
they were at capture, and last_call is not updated.
"""
import collections.abc
import ctypes
import math
import numbers
import operator
import os
import re
import warnings
from typing import Optional

try:
    import torch
except ImportError as e:  # not a dependency pip installs: the user picks a CPU or CUDA build
    raise ImportError("flash_stages needs PyTorch (2.5 or later), which is not installed for "
                      "this Python: install the build you want first (CPU or CUDA, see "
                      "https://pytorch.org/get-started/locally/)") from e

from . import _library

__all__ = ["scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "stages", "stage_info",
           "FlashStagesError", "HALF_STAGES", "PREFERENCE"]

# The order the default choice tries: the fastest stage first (docs/results), each only where
# it supports the inputs. 12 is 10's forward with the Hopper backward (and the only
# grouped-query backward). 11 is 09 with grouped-query attention and a decode path: it takes
# what 09 cannot (key/value heads fewer than query heads).
PREFERENCE = ("12_hopper_backward", "10_hopper_wgmma", "09_swizzle_pipeline",
              "11_split_kv_decode", "08_mma_sync", "07_tensor_cores", "06_backward", "05_causal",
              "04_shared_memory", "03_cuda_forward")
HALF_STAGES = ("07_tensor_cores", "08_mma_sync", "09_swizzle_pipeline", "10_hopper_wgmma",
               "11_split_kv_decode", "12_hopper_backward")
# Stages built for one architecture only (sm_90a): the compute capability they need. The
# program would exit on any other GPU; here the call is refused (or falls back) instead.
_NEEDS_CAPABILITY = {"10_hopper_wgmma": (9, 0), "12_hopper_backward": (9, 0),
                     "14_hopper_window": (9, 0)}
# Every stage is built for compute capability 8.0 and later (docs/conventions.md section 6).
_MIN_CAPABILITY = (8, 0)
# The largest sizes the stage programs accept (common/runner.c): each dimension, and the
# elements of one head's rows (the kernels index a head's N x d elements in 32 bits).
_MAX_DIM, _MAX_HEAD_ELEMS = 1 << 24, 1 << 31

_TORCH_DTYPE = {_library.DTYPE_FP32: torch.float32, _library.DTYPE_FP16: torch.float16,
                _library.DTYPE_BF16: torch.bfloat16}
_DTYPE_CODE = {v: k for k, v in _TORCH_DTYPE.items()}
# Where each missing feature arrives in the ladder, for the error messages.
_COMES_IN = {"causal": "05_causal", "backward": "06_backward", "half": "07_tensor_cores",
             "gqa": "11_split_kv_decode", "gqa_backward": "12_hopper_backward",
             "masks": "13_window_softcap_varlen"}
# The options of a masked call (flash_attn_func's window_size and softcap,
# flash_attn_varlen_func), by their StageInfo attribute: what a stage without one lacks.
_MASK_OPTIONS = {"window": "sliding window", "softcap": "logit softcap",
                 "varlen": "varlen (packed variable-length sequences)"}


class FlashStagesError(ValueError):
    """The inputs are not something the chosen stage computes, on this device."""


class StageInfo:
    """What a stage supports, read from its descriptor (the stage program's own)."""

    def __init__(self, lib):
        self.name, self.idea = lib.name, lib.idea
        self.head_dims = lib.head_dims
        self.dtypes = tuple(_TORCH_DTYPE[c] for c in lib.dtype_codes)
        self.causal, self.backward, self.gqa = lib.causal, lib.backward, lib.gqa
        self.gqa_backward = lib.gqa_backward
        self.cache_lens = lib.cache_lens
        self.layouts = lib.layouts
        self.window, self.softcap, self.varlen = lib.window, lib.softcap, lib.varlen

    def __repr__(self):
        dt = ", ".join(str(t).replace("torch.", "") for t in self.dtypes)
        masks = "".join(f", {name}=True" for name in _MASK_OPTIONS if getattr(self, name))
        return (f"StageInfo({self.name}: d in {self.head_dims or 'any'}, {dt}, "
                f"causal={self.causal}, backward={self.backward}, gqa={self.gqa}{masks})")


_LIBS, LIBRARY_DIR = _library.load_all()
_INFO = {name: StageInfo(lib) for name, lib in _LIBS.items()}
if not _LIBS:
    # Once, at import: without it stages() is silently [] and every call falls back or fails.
    warnings.warn("flash_stages: no stage library loaded (looked in: " +
                  ", ".join(_library.library_dirs()) + "); build them with `cmake -S . -B build "
                  "-DATTN_PYTHON=ON && cmake --build build` in the repository, or set "
                  "FLASH_STAGES_LIB_DIR to the folder that holds libattn_<stage>.so",
                  stacklevel=2)


def _load_operators():
    """The operators registered from C++ (python/csrc/operators.cpp, libflash_stages_operators.so
    beside the stage libraries), where they were built for this torch: True once loaded and
    every stage registered with them. FLASH_STAGES_PYTHON_OPERATORS=1 keeps the Python ones."""
    if LIBRARY_DIR is None or os.environ.get("FLASH_STAGES_PYTHON_OPERATORS") == "1":
        return False
    path = os.path.join(LIBRARY_DIR, "libflash_stages_operators.so")
    try:
        with open(path[:-len(".so")] + ".torch") as f:
            built_for = f.read().strip()
    except OSError:  # not built (no torch where the libraries were built)
        return False
    if built_for != torch.__version__:
        warnings.warn(f"flash_stages: {path} was built for torch {built_for}, this is "
                      f"{torch.__version__}: the Python operators run instead (rebuild: cmake "
                      "--build build --target python_package)", stacklevel=3)
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:  # built against another build of this version
        warnings.warn(f"flash_stages: {path} does not load into this torch ({e}): the Python "
                      "operators run instead", stacklevel=3)
        return False
    for lib in _LIBS.values():
        torch.ops.flash_stages.register_stage(lib.name, *lib.entry_points(), lib.layouts)
    return True


_OPERATORS = _load_operators()


class _LastCall(collections.abc.Mapping):
    """The stage, direction and buffer pointers of the last kernel call, so that a test can see
    that the kernels read and wrote PyTorch's own tensors: kept by the C++ operators where
    they run, by the Python ones otherwise."""
    _NAMES = {"forward": ("q", "k", "v", "o", "lse"),
              "backward": ("q", "k", "v", "d_o", "dq", "dk", "dv")}

    def __init__(self):
        self._python = {}

    def _call(self):
        if not _OPERATORS:
            return self._python
        stage, direction, pointers = torch.ops.flash_stages.last_call()
        if not direction:
            return {}
        return dict(stage=stage, direction=direction,
                    **dict(zip(self._NAMES[direction], pointers)))

    def _record(self, **call):
        self._python = call

    def __getitem__(self, key):
        return self._call()[key]

    def __iter__(self):
        return iter(self._call())

    def __len__(self):
        return len(self._call())

    def copy(self):
        return dict(self._call())

    def __repr__(self):
        return repr(self._call())


last_call = _LastCall()


def stages():
    """The stages whose libraries loaded, in ladder order."""
    return sorted(_LIBS)


def stage_info(name):
    if name not in _INFO:
        raise FlashStagesError(_unknown_stage(name))
    return _INFO[name]


def _unknown_stage(name):
    if not _LIBS:
        return ("no stage library found (looked in: " + ", ".join(_library.library_dirs()) +
                "); build them with `cmake -B build -DATTN_PYTHON=ON && cmake --build build`")
    return f"no stage named {name!r}; loaded: {', '.join(stages())}"


_CAPABILITY = {}  # device index: (major, minor), asked once


def _capability(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _unsupported(info, q, k, v, is_causal, enable_gqa, needs_grad):
    """Why `info`'s stage cannot compute this call, or None."""
    have = _capability(q.device)
    if have < _MIN_CAPABILITY:
        return (f"{info.name} needs compute capability {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} "
                f"or later; this GPU is {have[0]}.{have[1]}")
    needs = _NEEDS_CAPABILITY.get(info.name)
    if needs and have != needs:
        return (f"{info.name} needs compute capability {needs[0]}.{needs[1]} (Hopper); "
                f"this GPU is {have[0]}.{have[1]}")
    if q.dtype not in info.dtypes:
        wanted = ", ".join(str(t).replace("torch.", "") for t in info.dtypes)
        hint = (f" (half precision comes in {_COMES_IN['half']})"
                if q.dtype in (torch.float16, torch.bfloat16) and
                torch.float32 in info.dtypes else "")
        return f"{info.name} takes {wanted} inputs, not {str(q.dtype).replace('torch.', '')}{hint}"
    d = q.shape[-1]
    if info.head_dims and d not in info.head_dims:
        return f"{info.name} supports head dims {list(info.head_dims)}, not {d}"
    if is_causal and not info.causal:
        return f"{info.name} has no causal mask (it comes in {_COMES_IN['causal']})"
    if needs_grad and not info.backward:
        return f"{info.name} has no backward (it comes in {_COMES_IN['backward']})"
    if k.shape[1] != q.shape[1] and not info.gqa:
        return (f"{info.name} has no grouped-query attention ({q.shape[1]} query heads, "
                f"{k.shape[1]} key/value heads; it comes in {_COMES_IN['gqa']})")
    if k.shape[1] != q.shape[1] and needs_grad and not info.gqa_backward:
        return (f"{info.name} has no backward for grouped-query attention ({q.shape[1]} query "
                f"heads, {k.shape[1]} key/value heads; it comes in {_COMES_IN['gqa_backward']})")
    return None


def _check_inputs(q, k, v, enable_gqa):
    """Inputs no stage computes, whatever the stage: why, or None. With fallback=True they go
    to SDPA, which computes some of them (CPU tensors, other ranks) and refuses the rest."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be 4-D [B, H, N, d], got shape {tuple(t.shape)}"
        if t.device.type != "cuda":
            return f"{name} is on {t.device}; the stages run on CUDA tensors"
    if not (q.device == k.device == v.device):
        return (f"query, key and value are on {q.device}, {k.device}, "
                f"{v.device}: they must share one device")
    if not (q.dtype == k.dtype == v.dtype):
        return (f"query, key and value have dtypes {q.dtype}, {k.dtype}, "
                f"{v.dtype}: they must match")
    (b, h, nq, d), (bk, hk, nkv, dk) = q.shape, k.shape
    if k.shape != v.shape:
        return (f"key {tuple(k.shape)} and value {tuple(v.shape)} must have one "
                "shape")
    if bk != b or dk != d:
        return (f"query {tuple(q.shape)} and key {tuple(k.shape)} must agree in "
                "batch and head dim")
    if hk != h and not (enable_gqa and hk > 0 and h % hk == 0):
        return (f"query has {h} heads and key {hk}: set enable_gqa=True for "
                "grouped-query attention (query heads a multiple of key heads)")
    if max(b, h, nq, nkv, d) > _MAX_DIM or max(nq, nkv) * d >= _MAX_HEAD_ELEMS:
        return (f"{tuple(q.shape)} / {tuple(k.shape)} is too large: each size at most 2^24, "
                "and N x d under 2^31 (the stage programs' limits)")
    return None


_warned = set()


def _warn_once(why, stacklevel):
    """stacklevel: the caller's frame as warnings.warn counts it from here."""
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"flash_stages: falling back to torch SDPA: {why}", stacklevel=stacklevel)


def _sdpa(q, k, v, is_causal, scale, enable_gqa, attn_mask=None, dropout_p=0.0):
    """torch SDPA with the stages' causal alignment: for Nq != Nkv, is_causal means the
    bottom-right mask, which SDPA's is_causal (top-left) is not. What SDPA refuses (is_causal
    with an attn_mask, tensors under 2-D) it refuses with its own message."""
    F = torch.nn.functional
    if is_causal and attn_mask is None and min(q.dim(), k.dim()) >= 2 and \
            q.shape[-2] != k.shape[-2]:
        from torch.nn.attention.bias import causal_lower_right
        attn_mask, is_causal = causal_lower_right(q.shape[-2], k.shape[-2]), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def _fallback(q, k, v, is_causal, scale, enable_gqa, why, attn_mask=None, dropout_p=0.0):
    _warn_once(why, 4)
    return _sdpa(q, k, v, is_causal, scale, enable_gqa, attn_mask, dropout_p)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, stage=None,
                                 fallback=False):
    """SDPA's signature and semantics (see the module's docstring for the causal alignment).
    stage: a name from stages(), or None for the fastest stage that supports the inputs.
    fallback: True sends what the stage cannot compute to torch SDPA (with a warning) instead
    of raising FlashStagesError."""
    q, k, v = query, key, value
    planned, in_cpp = None, False
    if attn_mask is None and not dropout_p and type(q) is type(k) is type(v) is torch.Tensor \
            and not torch.compiler.is_compiling():  # traced shapes may be symbols: no key
        flags = (_PLAN_CAUSAL if is_causal else 0) | (_PLAN_GQA if enable_gqa else 0)
        in_cpp = _planned_forward is not None and scale is None and stage is None
        if in_cpp:
            try:  # a call already checked and planned: the C++ operator finds it
                out = _planned_forward(q, k, v, flags)
            except ValueError as e:  # the library's 2 or 77: what this device cannot run
                raise FlashStagesError(str(e)) from None
            if out:
                return out[0]
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or
                                                  v.requires_grad)
        planned = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                   v.device, is_causal, scale, enable_gqa, stage, needs_grad)
        plan = _PLANNED.get(planned)
        if plan is not None:
            return _attention(q, k, v, plan[1], bool(is_causal), plan[0], False, needs_grad)[0]
    why = _check_inputs(q, k, v, enable_gqa)
    if why is not None:
        if fallback and all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return _fallback(q, k, v, is_causal, scale, enable_gqa, why, attn_mask, dropout_p)
        raise FlashStagesError(why)
    if attn_mask is not None or dropout_p != 0.0:
        why = "the stages take no attn_mask and no dropout (use is_causal for the causal mask)"
        if fallback:
            return _fallback(q, k, v, is_causal, scale, enable_gqa, why, attn_mask, dropout_p)
        raise FlashStagesError(why)
    named = stage is not None
    scale, needs_grad, stage, why = _plan(q, k, v, scale, "scale", is_causal, enable_gqa, stage)
    if why is not None:
        if fallback:
            return _fallback(q, k, v, is_causal, scale, enable_gqa, why)
        raise FlashStagesError(why if named else f"no loaded stage computes this call: {why}")
    if q.numel() == 0 or k.numel() == 0:
        # Nothing for a kernel to do; SDPA's answer for empty keys is an empty sum: zeros.
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())
    if planned is not None:
        _remember_plan(planned, scale, stage)
    if in_cpp:
        torch.ops.flash_stages.remember_plan(q, k, v, flags, stage, scale)
    o, _ = _attention(q, k, v, stage, bool(is_causal), scale, False, needs_grad)
    return o


# The scale and stage of calls already checked and planned, by everything the checks and the
# stage choice read (shapes, dtypes, devices and the arguments), so that a repeated call (a
# model's layers, a decode loop) skips them: 6 us of a call of 20 on a small problem. Where
# the C++ operators run, the calls of the default scale and stage keep theirs in C++ instead
# (flash_stages::remember_plan, found by planned_forward with no Python in between).
_PLANNED, _PLANNED_ENTRIES = {}, 4096


def _remember_plan(key, scale, stage):
    if len(_PLANNED) >= _PLANNED_ENTRIES:  # a decode loop's growing caches: start over
        _PLANNED.clear()
    _PLANNED[key] = (scale, stage)


def _plan(q, k, v, scale, scale_name, is_causal, enable_gqa, stage):
    """What both entries settle before running: the softmax scale (1/sqrt(d) unless given),
    whether autograd will want the backward, and the stage (None and why, where none fits)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise FlashStagesError(f"{scale_name} must be a finite number, got {scale}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    stage, why = _choose_stage(q, k, v, is_causal, enable_gqa, needs_grad, stage)
    return scale, needs_grad, stage, why


# Stage 11's decode path takes a forward whose group of query rows fills one block (G Nq <= 16
# at d <= 64, 32 at d = 128: decode_shaped in its decode.cuh). There 11 comes first: it splits
# the keys over the SMs, where the other stages give a block to each 64 or more query rows
# of a head and leave most SMs idle.
_DECODE_STAGE = "11_split_kv_decode"
_DECODE_ORDER = (_DECODE_STAGE,) + tuple(s for s in PREFERENCE if s != _DECODE_STAGE)


def _decode_shaped(q, k):
    return q.shape[1] // k.shape[1] * q.shape[2] <= (32 if q.shape[3] > 64 else 16)


def _choose_stage(q, k, v, is_causal, enable_gqa, needs_grad, stage):
    """(the stage to run, None), or (None, why): why the named stage, or every stage of
    PREFERENCE that loaded, cannot compute the call."""
    if stage is None:
        reasons = []
        order = _DECODE_ORDER if not needs_grad and _decode_shaped(q, k) else PREFERENCE
        for name in order:
            if name in _INFO:
                why = _unsupported(_INFO[name], q, k, v, is_causal, enable_gqa, needs_grad)
                if why is None:
                    stage = name
                    break
                reasons.append(why)
        if stage is None:
            return None, "; ".join(reasons) if reasons else _unknown_stage("(any)")
        return stage, None
    if stage not in _INFO:
        raise FlashStagesError(_unknown_stage(stage))
    why = _unsupported(_INFO[stage], q, k, v, is_causal, enable_gqa, needs_grad)
    return (None, why) if why is not None else (stage, None)


def _attention(q, k, v, stage, causal, scale, deterministic, needs_grad):
    """O and LSE from the stage, through the C++ operator where it loaded (its autograd
    formula is C++ too: a refusal in the backward is the library's ValueError, of which
    FlashStagesError is a kind). Otherwise torch.compile traces the Python operator, and eager
    calls skip its dispatch: without a gradient to record they call the forward itself, with
    one they take the autograd.Function."""
    if _OPERATORS:  # the library checks the harness's variables itself, on every call
        if torch.compiler.is_compiling():
            return _cpp_forward(q, k, v, stage, causal, scale, deterministic)
        try:
            return _cpp_forward(q, k, v, stage, causal, scale, deterministic)
        except ValueError as e:  # the library's 2 or 77: what this device cannot run
            raise FlashStagesError(str(e)) from None
    if torch.compiler.is_compiling():
        return _forward_op(q, k, v, stage, causal, scale, deterministic)
    if not needs_grad:
        return _run_forward(q, k, v, stage, causal, scale)
    return _Attention.apply(q, k, v, stage, causal, scale, deterministic)


def _heads_major(q, k, v, dropout_p, shape):
    """q, k and v given as [B, S, H, d] (`shape` names how, for the errors), checked and viewed
    as the stages' [B, H, S, d], without a copy."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise FlashStagesError(f"{name} must be a 4-D tensor {shape}, got "
                                   f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    if dropout_p != 0.0:
        raise FlashStagesError("the stages have no dropout: dropout_p must be 0")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise FlashStagesError(f"q has {q.shape[2]} heads and k {k.shape[2]}: the query heads "
                               "must be a multiple of the key/value heads")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    why = _check_inputs(qh, kh, vh, True)
    if why is not None:
        raise FlashStagesError(f"{why} (q, k, v given as {shape}, read as [B, H, S, d])")
    return qh, kh, vh


def flash_attn_func(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, return_lse=False, deterministic=False,
                    stage=None):
    """FlashAttention's call and argument names (keyword-only after v, so that a positional
    dropout_p in FlashAttention's order cannot land in softmax_scale): q [B, S, H, d], k and
    v [B, S_k, Hkv, d] (Hkv dividing H: grouped-query and multi-query attention as
    FlashAttention takes them), CUDA tensors. Returns out [B, S, H, d], contiguous, and with
    return_lse=True also softmax_lse [B, H, S] (float32, natural log, -inf on rows that see
    no key; it carries no gradient). causal is bottom-right aligned, as in FlashAttention 2.1
    and later. deterministic=True takes the stage's deterministic dQ path in this call's
    backward. dropout_p must be 0. stage: as in scaled_dot_product_attention. A stage that
    reads [B, S, H, d] in place (09-12, through the C++ operators) gets the tensors as they
    are and writes out, dq, dk and dv in that layout; for any other (08 and earlier, or the
    Python operators) they are copied into [B, H, S, d], in the forward and again in the
    backward, and the output out of it.

    window_size=(left, right): FlashAttention's sliding window, bottom-right aligned as causal
    is: query i sees key j iff i + S_k - S - left <= j <= i + S_k - S + right, a side of -1
    unbounded; with causal=True the right side is 0 (FlashAttention's rule), and a window that
    is only that bound ((-1, 0)) is the causal call. softcap=c > 0: each logit becomes
    c tanh(softmax_scale q.k / c) before the mask (Gemma 2's); 0 is none. Either runs on a
    stage that has it (13_window_softcap_varlen: fp16 and bf16, d = 32, 64, 128, no
    grouped-query attention; a window alone on 14_hopper_window where the GPU is compute
    capability 9.0, with grouped-query attention), forward and backward; without one loaded,
    or with k and v of fewer heads than q and no stage for that, the call raises
    FlashStagesError."""
    if type(window_size) is not tuple or window_size != (-1, -1) or softcap != 0.0:
        left, right, softcap, causal = _window_and_softcap(window_size, softcap, causal)
        if left != -1 or right != -1 or softcap > 0:  # else the plain call below
            out, lse = _masked_call(q, k, v, dropout_p, softmax_scale, causal, left, right,
                                    softcap, None, deterministic, stage, "[B, S, H, d]")
            return (out, lse) if return_lse else out
    # A repeated call of the default scale and stage: its plan is in C++ (as in
    # scaled_dot_product_attention; through the Python operators every call is checked).
    in_cpp = _planned_forward is not None and softmax_scale is None and stage is None and \
        type(q) is type(k) is type(v) is torch.Tensor and not dropout_p and \
        not torch.compiler.is_compiling()
    if in_cpp:
        flags = (_PLAN_CAUSAL if causal else 0) | _PLAN_GQA | _PLAN_SEQ_MAJOR | \
            (_PLAN_DETERMINISTIC if deterministic else 0)
        try:
            out = _planned_forward(q, k, v, flags)
        except ValueError as e:  # the library's 2 or 77: what this device cannot run
            raise FlashStagesError(str(e)) from None
        if out:
            return (out[0], out[1]) if return_lse else out[0]
    qh, kh, vh = _heads_major(q, k, v, dropout_p, "[B, S, H, d]")
    named = stage is not None
    scale, needs_grad, stage, why = _plan(qh, kh, vh, softmax_scale, "softmax_scale", causal, True,
                                          stage)
    if why is not None:
        raise FlashStagesError(why if named else f"no loaded stage computes this call: {why}")
    if q.numel() == 0 or k.numel() == 0:  # as scaled_dot_product_attention: an empty sum
        out = torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())
        lse = torch.full(qh.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    if in_cpp:
        torch.ops.flash_stages.remember_plan(q, k, v, flags, stage, scale)
    if _OPERATORS:
        try:
            out, lse = _cpp_forward(q, k, v, stage, bool(causal), scale, bool(deterministic),
                                    True)
        except ValueError as e:
            raise FlashStagesError(str(e)) from None
        return (out, lse) if return_lse else out
    o, lse = _attention(qh, kh, vh, stage, bool(causal), scale, bool(deterministic),
                        needs_grad)
    out = o.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


# The softcap goes to the library as a float: one below fp32's smallest normal number would
# round towards 0, which means no cap at all, and one past its largest to infinity.
_FP32_MIN_NORMAL, _FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e+38


def _window_and_softcap(window_size, softcap, causal):
    """(left, right, softcap, causal) as the stages take them, from FlashAttention's arguments:
    causal makes the right side 0 (FlashAttention's rule), and a window that bounds only that
    side by 0 is the causal mask, which every stage has (FlashAttention's rule too)."""
    try:
        left, right = window_size
        bad = isinstance(left, bool) or isinstance(right, bool)
        if not (type(left) is int and type(right) is int):  # a numpy or torch int: its value
            left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        bad = True
    if bad or min(left, right) < -1:
        raise FlashStagesError(f"window_size must be two ints (left, right), each -1 "
                               f"(unbounded) or >= 0, got {window_size!r}")
    # A side past the stages' largest size (2^24 rows) bounds nothing: clamped, it fits an int.
    left, right = min(left, _MAX_DIM), min(right, _MAX_DIM)
    # A real number only: float() would take True, and "5" or "0" (silently no cap).
    cap = math.nan
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool):
        cap = float(softcap)
    if not (cap == 0.0 or _FP32_MIN_NORMAL <= cap <= _FP32_MAX):  # NaN fails too
        raise FlashStagesError(f"softcap must be 0 (none) or a positive number within fp32's "
                               f"range, got {softcap!r}")
    if causal:
        right = 0
    if left == -1 and right == 0:
        causal, right = True, -1
    return left, right, cap, bool(causal)


# The stages that may run a masked call, in the order the default choice tries them: the
# preferred ones first, then the rest from the latest in the ladder.
_MASKED_ORDER = tuple(s for s in PREFERENCE if s in _INFO) + tuple(
    sorted((s for s in _INFO if s not in PREFERENCE), reverse=True))


def _masked_stage(qh, kh, vh, causal, needs_grad, stage, needs):
    """The stage for a masked call on [B, H, S, d] views, or FlashStagesError: needs, the
    options of _MASK_OPTIONS the call asks for."""
    def lacks(name):
        return [_MASK_OPTIONS[n] for n in needs if not getattr(_INFO[name], n)]
    if stage is not None:
        if stage not in _INFO:
            raise FlashStagesError(_unknown_stage(stage))
        missing = lacks(stage)
        if missing:
            raise FlashStagesError(f"{stage} has no {' and no '.join(missing)} (it comes in "
                                   f"{_COMES_IN['masks']})")
        able = [stage]
    else:
        able = [s for s in _MASKED_ORDER if not lacks(s)]
    if not able:
        wanted = " and ".join(_MASK_OPTIONS[n] for n in needs)
        raise FlashStagesError(f"no loaded stage has a {wanted} (it comes in "
                               f"{_COMES_IN['masks']}); loaded: {', '.join(stages()) or 'none'}")
    # Before _unsupported, whose message would name the stage where GQA comes in: the masked
    # stage comes later in the ladder and has none.
    h, hkv = qh.shape[1], kh.shape[1]
    if hkv != h and not any(_INFO[s].gqa for s in able):
        raise FlashStagesError(f"no loaded stage computes grouped-query attention with a sliding "
                               f"window, a softcap or varlen ({', '.join(able)} has none): q has "
                               f"{h} heads and k {hkv}; repeat k and v to {h} heads")
    if stage is not None:
        why = _unsupported(_INFO[stage], qh, kh, vh, causal, True, needs_grad)
        if why is not None:
            raise FlashStagesError(why)
        return stage
    reasons = []
    for name in able:
        why = _unsupported(_INFO[name], qh, kh, vh, causal, True, needs_grad)
        if why is None:
            return name
        reasons.append(why)
    raise FlashStagesError("no loaded stage computes this call: " + "; ".join(reasons))


def _masked_call(q, k, v, dropout_p, softmax_scale, causal, left, right, softcap, varlen,
                 deterministic, stage, shape):
    """O [B, S, H, d] and LSE [B, H, S] of flash_attn_func with a window or a softcap, or of
    flash_attn_varlen_func (varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    already checked; q, k and v then the packed [1, total, H, d]). shape: how the caller's
    tensors were given, for the errors."""
    qh, kh, vh = _heads_major(q, k, v, dropout_p, shape)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise FlashStagesError(f"softmax_scale must be a finite number, got {scale}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    needs = [name for name, wanted in (("window", left != -1 or right != -1),
                                       ("softcap", softcap > 0), ("varlen", varlen is not None))
             if wanted]
    stage = _masked_stage(qh, kh, vh, causal, needs_grad, stage, needs)
    if q.numel() == 0 or k.numel() == 0:  # as flash_attn_func: an empty sum, rows see no key
        out = torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())
        lse = torch.full(qh.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        return out, lse
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    if _OPERATORS and torch.compiler.is_compiling():  # as _attention: no try around a trace
        return torch.ops.flash_stages.forward_masked(
            q, k, v, stage, causal, scale, left, right, softcap, cu_q, cu_k, max_q, max_k,
            bool(deterministic), True)
    if _OPERATORS:
        try:
            return torch.ops.flash_stages.forward_masked(
                q, k, v, stage, causal, scale, left, right, softcap, cu_q, cu_k, max_q, max_k,
                bool(deterministic), True)
        except ValueError as e:  # the library's 2 or 77: what this device cannot run
            raise FlashStagesError(str(e)) from None
    o, lse = _attention_masked(qh, kh, vh, stage, causal, scale, bool(deterministic), needs_grad,
                               (left, right, softcap, cu_q, cu_k, max_q, max_k))
    return o.transpose(1, 2).contiguous(), lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, *, return_lse=False, deterministic=False, stage=None):
    """FlashAttention's call on variable-length sequences packed end to end without padding:
    q [total_q, H, d], k and v [total_k, H, d], sequence s holding query rows
    cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and key rows likewise (cu_seqlens_q and _k:
    B + 1 int32 offsets from 0 on q's device; a sequence may be empty on either side).
    max_seqlen_q and max_seqlen_k: the longest sequence's rows (the kernels' grids are planned
    from them; larger is allowed). Each query sees only its own sequence's keys, causal and
    window_size bottom-right aligned in that sequence (as flash_attn_func's); softcap as there.
    Returns out [total_q, H, d] and with return_lse=True also the LSE [H, total_q]
    (FlashAttention 2's layout; float32, -inf on rows that see no key, no gradient);
    differentiable in q, k and v. Runs on a stage with varlen (13_window_softcap_varlen: fp16
    and bf16, d = 32, 64, 128, no grouped-query attention): the packed tensors are its
    [1, total, H, d] problem with the offsets, read in place.

    The kernels read the offsets on the device and the call reads nothing back to the host
    during a CUDA graph capture, so it can be captured and replayed with new offsets in the
    same tensors (the same number of sequences and totals, each no longer than max_seqlen_q,
    max_seqlen_k). Outside a capture (and outside torch.compile's tracing) the offsets are read
    back and checked first (a synchronisation): start 0, never decreasing, the last the total,
    no sequence longer than its max_seqlen; inside one they cannot be, and offsets that break
    those rules give undefined results."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise FlashStagesError(f"{name} must be a 3-D tensor [total, H, d] (the sequences "
                                   "packed), got "
                                   f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    left, right, softcap, causal = _window_and_softcap(window_size, softcap, causal)
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0],
                           k.shape[0], v.shape[0], q.device)
    out, lse = _masked_call(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dropout_p,
                            softmax_scale, causal, left, right, softcap, varlen, deterministic,
                            stage, "[total, H, d]")
    return (out[0], lse[0]) if return_lse else out[0]


def _check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k,
                  total_v, device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) as the operators take them, or
    FlashStagesError: the offsets' dtype, device and shape always; their values outside a CUDA
    graph capture and torch.compile's tracing only, where reading them back is allowed (as
    flash_attn_with_kvcache's lengths on the GPU)."""
    if total_v != total_k:
        raise FlashStagesError(f"k has {total_k} rows and v {total_v}: they must match")
    offsets = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise FlashStagesError(f"{name} must be a tensor of B + 1 int32 offsets, got "
                                   f"{type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise FlashStagesError(f"{name} must be int32 (FlashAttention's), got {cu.dtype}")
        if cu.device != device:
            raise FlashStagesError(f"{name} is on {cu.device}, q on {device}: the offsets must "
                                   "be on q's device (the kernels read them there)")
        if cu.dim() != 1 or not 2 <= cu.numel() <= _MAX_DIM + 1:
            raise FlashStagesError(f"{name} must be 1-D, B + 1 offsets for B >= 1 sequences, got "
                                   f"shape {tuple(cu.shape)}")
        offsets.append(cu.contiguous())  # a strided view: copied on the device, no host read
    if offsets[0].numel() != offsets[1].numel():
        raise FlashStagesError(f"cu_seqlens_q has {offsets[0].numel()} offsets and cu_seqlens_k "
                               f"{offsets[1].numel()}: B + 1 each, one sequence per pair")
    longest = []
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        try:
            m = -1 if isinstance(given, bool) else operator.index(given)
        except TypeError:
            m = -1
        if m < 0:
            raise FlashStagesError(f"{name} must be an int >= 0, got {given!r}")
        longest.append(m)
    # is_compiling first: torch.compile folds it to True and never traces the capture query.
    if not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
        values = torch.cat(offsets).tolist()  # one read back, both tensors
        b = offsets[0].numel()
        for side, cu, total, rows in (("q", values[:b], total_q, "query"),
                                      ("k", values[b:], total_k, "key")):
            name = f"cu_seqlens_{side}"
            if cu[0] != 0:
                raise FlashStagesError(f"{name} must start at 0, got {cu[0]}")
            lengths = [cu[s + 1] - cu[s] for s in range(b - 1)]
            bad = next((s for s, n in enumerate(lengths) if n < 0), None)
            if bad is not None:
                raise FlashStagesError(f"{name} must not decrease: offset {bad + 1} "
                                       f"({cu[bad + 1]}) is below offset {bad} ({cu[bad]})")
            if cu[-1] != total:
                raise FlashStagesError(f"{name} ends at {cu[-1]}, but {side} holds {total} rows: "
                                       "the last offset is the total")
            most = max(lengths)
            limit = longest[0 if side == "q" else 1]
            if most > limit:
                raise FlashStagesError(f"max_seqlen_{side} is {limit}, but sequence "
                                       f"{lengths.index(most)} has {most} {rows} rows")
    return offsets[0], offsets[1], longest[0], longest[1]


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None,
                            causal=False, return_softmax_lse=False, stage=None):
    """FlashAttention's decode call: q [B, S_q, H, d] against caches k_cache and v_cache
    [B, S_cache, Hkv, d] (Hkv dividing H), of which sequence b holds its first
    cache_seqlens[b] keys: an int (every sequence), a list or a tensor of B ints (any device;
    int32 on q's device is used as it is), or None (every sequence holds S_cache). Keys past a
    sequence's length are never read. causal is bottom-right against each sequence's length
    (query i sees keys j <= i + cache_seqlens[b] - S_q), and a row that sees no key gets 0.
    Returns out [B, S_q, H, d] and with return_softmax_lse=True also the LSE [B, H, S_q]
    (float32; -inf on rows that see no key). No gradient is recorded (as FlashAttention's) and
    the cache is not appended to: write the new keys into k_cache and v_cache first. Stage 11
    (the KV-cache stage) runs it, or `stage` if it takes cache lengths. With cache_seqlens an
    int32 tensor on q's device, the kernels read the lengths there, and stage 11 splits the
    keys as for full caches (S_cache each): the call reads nothing back to the host, so it can
    be captured in a CUDA graph and replayed with new lengths in that tensor. Outside a
    capture the lengths are still checked to be in 0..S_cache (a synchronisation); during one
    they cannot be, and a length outside is clamped into it. Any other form (an int, a list, a
    CPU tensor) is read on the host, split by the longest length, and copied to the device
    on each call: not capturable. Stage 11 reads q and the caches in place (through the C++
    operators; the Python ones copy them)."""
    planned, in_cpp = None, False
    if _OPERATORS and type(q) is type(k_cache) is type(v_cache) is torch.Tensor and \
            not torch.compiler.is_compiling():  # as in scaled_dot_product_attention
        # Full caches, the default scale and stage: the plan is in C++, as flash_attn_func's
        # (the forward of the same call; no lengths to read).
        in_cpp = cache_seqlens is None and softmax_scale is None and stage is None
        if in_cpp:
            flags = (_PLAN_CAUSAL if causal else 0) | _PLAN_GQA | _PLAN_SEQ_MAJOR | _PLAN_NO_GRAD
            try:
                out = _planned_forward(q, k_cache, v_cache, flags)
            except ValueError as e:  # the library's 2 or 77: what this device cannot run
                raise FlashStagesError(str(e)) from None
            if out:
                return (out[0], out[1]) if return_softmax_lse else out[0]
        planned = ("flash_attn_with_kvcache", q.shape, k_cache.shape, v_cache.shape, q.dtype,
                   k_cache.dtype, v_cache.dtype, q.device, k_cache.device, v_cache.device,
                   causal, softmax_scale, stage)
        plan = _PLANNED.get(planned)
        if plan is not None:  # checked and planned before: only the lengths are new
            lens = _cache_lengths(cache_seqlens, q.shape[0], k_cache.shape[1], q.device)
            return _kvcache_operator(q, k_cache, v_cache, lens, plan[1], causal, plan[0],
                                     return_softmax_lse)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise FlashStagesError(f"{name} must be a 4-D tensor [B, S, H, d], got "
                                   f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    if k_cache.shape[2] == 0 or q.shape[2] % k_cache.shape[2] != 0:
        raise FlashStagesError(f"q has {q.shape[2]} heads and k_cache {k_cache.shape[2]}: the "
                               "query heads must be a multiple of the key/value heads")
    qh, kh, vh = (t.detach().transpose(1, 2) for t in (q, k_cache, v_cache))
    why = _check_inputs(qh, kh, vh, True)
    if why is not None:
        raise FlashStagesError(f"{why} (q, k_cache, v_cache given as [B, S, H, d], read as "
                               "[B, H, S, d])")
    host_lens, device_lens = _cache_lengths(cache_seqlens, q.shape[0], k_cache.shape[1],
                                            q.device)
    if stage is None:
        stage = _DECODE_STAGE
    if stage not in _INFO:
        raise FlashStagesError(_unknown_stage(stage))
    if not _INFO[stage].cache_lens:
        raise FlashStagesError(f"{stage} takes no cache lengths (they come in {_DECODE_STAGE})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise FlashStagesError(f"softmax_scale must be a finite number, got {scale}")
    why = _unsupported(_INFO[stage], qh, kh, vh, causal, True, False)
    if why is not None:
        raise FlashStagesError(why)
    if q.numel() == 0 or k_cache.numel() == 0:  # an empty sum, as flash_attn_func
        out = torch.zeros_like(q)
        lse = torch.full(qh.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse) if return_softmax_lse else out
    if _OPERATORS:
        if planned is not None:
            _remember_plan(planned, scale, stage)
        if in_cpp:
            torch.ops.flash_stages.remember_plan(q, k_cache, v_cache, flags, stage, scale)
        return _kvcache_operator(q, k_cache, v_cache, (host_lens, device_lens), stage, causal,
                                 scale, return_softmax_lse)
    _check_environment()
    o, lse = _run_forward(qh, kh, vh, stage, bool(causal), scale, (host_lens, device_lens))
    out = o.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


def _kvcache_operator(q, k_cache, v_cache, lens, stage, causal, scale, return_lse):
    """flash_attn_with_kvcache through the C++ operator, on the tensors as they are ([B, S, H,
    d]); lens as _cache_lengths gives them. Detached only where autograd would record them:
    no gradient, as FlashAttention's."""
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or
                                    v_cache.requires_grad):
        q, k_cache, v_cache = q.detach(), k_cache.detach(), v_cache.detach()
    host_lens, device_lens = lens
    try:
        out, lse = torch.ops.flash_stages.forward_kvcache(
            q, k_cache, v_cache, device_lens, list(host_lens) if host_lens is not None else [],
            stage, bool(causal), scale)
    except ValueError as e:  # the library's 2 or 77: what this device cannot run
        raise FlashStagesError(str(e)) from None
    return (out, lse) if return_lse else out


def _cache_lengths(cache_seqlens, batch, capacity, device):
    """flash_attn_with_kvcache's cache_seqlens as (B host ints as a tuple, or None; the same as
    contiguous int32 on `device`, or None), each checked to be in 0..capacity. (None, None):
    no lengths, every sequence full. None on the host alone: the lengths were given as int32
    on `device`, and are used there as they are (no host copy: the split is planned for full
    caches), and read back for the check only outside a CUDA graph capture."""
    if cache_seqlens is None:  # every sequence full: no lengths at all, the plain forward
        return None, None
    on_device = isinstance(cache_seqlens, torch.Tensor) and \
        cache_seqlens.dtype == torch.int32 and cache_seqlens.device == device and \
        cache_seqlens.is_contiguous()
    if on_device and torch.cuda.is_current_stream_capturing():
        if cache_seqlens.numel() != batch:
            raise FlashStagesError(f"cache_seqlens has {cache_seqlens.numel()} lengths for a "
                                   f"batch of {batch}")
        return None, cache_seqlens.reshape(-1)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        host = (cache_seqlens,) * batch
    else:
        if isinstance(cache_seqlens, torch.Tensor):
            if cache_seqlens.is_floating_point() or cache_seqlens.is_complex() or \
                    cache_seqlens.dtype == torch.bool:
                raise FlashStagesError(f"cache_seqlens must hold integers, got "
                                       f"{cache_seqlens.dtype}")
            values = cache_seqlens.reshape(-1).tolist()
        else:
            try:
                values = [int(x) if int(x) == x else None for x in cache_seqlens]
            except (TypeError, ValueError, OverflowError):  # OverflowError: inf
                values = [None]
            if None in values:
                raise FlashStagesError("cache_seqlens must be an int, a list or a tensor of "
                                       f"ints, got {cache_seqlens!r}")
        if len(values) != batch:
            raise FlashStagesError(f"cache_seqlens has {len(values)} lengths for a batch of "
                                   f"{batch}")
        host = tuple(values)
    bad = [x for x in host if not 0 <= x <= capacity]
    if bad:
        raise FlashStagesError(f"cache_seqlens {bad[0]} is outside 0..{capacity} (the caches' "
                               "capacity, S_cache)")
    if on_device:
        return None, cache_seqlens.reshape(-1)
    return host, torch.tensor(host, dtype=torch.int32, device=device)


# ---- the operators ---------------------------------------------------------------------


def _problem(q, k, causal, scale, mask=None):
    """The attn_problem of [B, H, N, d] tensors; mask: a masked call's (window_left,
    window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), or None.
    The host offsets stay NULL: the library reads the device ones (Buffers) and plans its
    grids from the longest sequences."""
    b, h, nq, d = q.shape
    p = _library.Problem(b, h, nq, k.shape[2], d, int(causal), scale, _DTYPE_CODE[q.dtype],
                         k.shape[1], None)
    if mask is not None:
        left, right, softcap, cu_q, _, max_q, max_k = mask
        p.windowed = int(left >= 0 or right >= 0)
        p.window_left, p.window_right, p.softcap = left, right, softcap
        if cu_q is not None:
            # No sequence is longer than the packed total: a larger bound would only launch
            # blocks with nothing to do.
            p.seqs = cu_q.numel() - 1
            p.max_seqlen_q, p.max_seqlen_k = min(max_q, nq), min(max_k, k.shape[2])
    return p


def _in_kernel_layout(t):
    """t as the kernels read it: contiguous row-major, from a 16-byte boundary (their
    16-byte copies; TMA in stage 10). A view that is neither is copied, once."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# PyTorch's current stream of a device as a cudaStream_t: the private call that torch.compile's
# generated code uses (0.1 us; torch.cuda.current_stream builds a Stream object, 4-5 us).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index):
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


class _OnDevice:
    """Library calls with the tensor's device current (the stages launch on the current
    device, and stage 11 plans its decode split from it), their failures as exceptions:
    where the stage program would exit, the library returns its exit code and line. 2 (what
    this device cannot run: tiles past its shared memory) and 77 (a stage built for another
    GPU) raise FlashStagesError, 1 (a CUDA error) RuntimeError. `with` gives the device's
    index and its current stream. A class, not a generator-based context manager: it is on
    every call's path, and costs a third as much."""
    __slots__ = ("index", "guard")

    def __init__(self, tensor):
        self.index = tensor.get_device()
        self.guard = None

    def __enter__(self):
        if self.index != torch.cuda.current_device():
            self.guard = torch.cuda.device(self.index)
            self.guard.__enter__()
        return self.index, _current_stream(self.index)

    def __exit__(self, kind, error, trace):
        if self.guard is not None:
            self.guard.__exit__(kind, error, trace)
        if isinstance(error, _library.StageLibraryError):
            raise (FlashStagesError if error.code in (2, 77) else RuntimeError)(
                str(error)) from None
        return False


# Stage 11's decode tile (DecodeKeys in its attention.cu): a forced chunk is whole tiles.
_DECODE_TILE_KEYS = 64


_ENVIRONMENT = ("ATTN_DETERMINISTIC", "ATTN_SHARED_MEMORY_LIMIT", "ATTN_SHARED_MEMORY_PER_SM",
                "ATTN_DECODE_BATCH_INVARIANT", "ATTN_DECODE_CHUNK_KEYS")
_checked_environment = None  # the values last found good


# os.environ's own table (bytes on POSIX), read directly: five os.environ.get calls, each
# encoding its key, cost 4 us a call.
_ENVIRONMENT_KEYS = tuple(os.environ.encodekey(name) for name in _ENVIRONMENT) \
    if hasattr(os.environ, "encodekey") and hasattr(os.environ, "_data") else None


def _environment():
    if _ENVIRONMENT_KEYS is not None:
        return tuple(map(os.environ._data.get, _ENVIRONMENT_KEYS))
    return tuple(os.environ.get(name) for name in _ENVIRONMENT)


def _check_environment():
    """The harness's variables (docs/conventions.md section 6), before any library call, by
    the rules the programs apply where they read them: a bad value is FlashStagesError naming
    the variable, whichever stage is called (the library would say so only for a stage
    that reads it). Values already found good are not parsed again."""
    global _checked_environment
    values = _environment()
    if values == _checked_environment:
        return
    def whole(name, low, high, step=1):  # strtoull/strtol's decimal forms: spaces, a + sign
        text = os.environ.get(name, "")
        digits = text.lstrip(" \t\n\v\f\r").removeprefix("+")
        if text and not (re.fullmatch("[0-9]+", digits) and low <= int(digits) <= high and
                         int(digits) % step == 0):
            steps = f", a multiple of {step}" if step > 1 else ""
            raise FlashStagesError(f"{name} must be an integer in {low}..{high}{steps}, "
                                   f"got {text!r}")
    det = os.environ.get("ATTN_DETERMINISTIC", "")
    if det not in ("", "0", "1"):
        raise FlashStagesError(f"ATTN_DETERMINISTIC must be 0 or 1, got {det!r}")
    whole("ATTN_SHARED_MEMORY_LIMIT", 1, 2**64 - 1)
    whole("ATTN_SHARED_MEMORY_PER_SM", 1, 2**64 - 1)
    inv = os.environ.get("ATTN_DECODE_BATCH_INVARIANT", "")
    if inv not in ("", "0", "1"):
        raise FlashStagesError(f"ATTN_DECODE_BATCH_INVARIANT must be 0 or 1, got {inv!r}")
    whole("ATTN_DECODE_CHUNK_KEYS", 1, _MAX_DIM, _DECODE_TILE_KEYS)
    _checked_environment = values


# What a repeated call needs from the library once, by (stage, direction, shapes, causal,
# scale, dtype, device, environment): the attn_problem (the library only reads it) and the
# workspace bytes, which the libraries compute from the problem, the device and the variables
# above (stage 11's decode plan).
_PLANS, _PLAN_ENTRIES = {}, 4096


def _plan_call(lib, direction, q, k, causal, scale, index, host_lens=None, mask=None):
    """(attn_problem, workspace bytes) for this call; the device must be current. host_lens:
    the KV cache's B lengths (a tuple of ints), or None; mask: as _problem's."""
    masks = None if mask is None else (
        mask[:3] + (mask[3].numel() if mask[3] is not None else 0,) + mask[5:])
    key = (lib.name, direction, q.shape, k.shape, causal, scale, q.dtype, index,
           _checked_environment, host_lens, masks)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLAN_ENTRIES:  # a decode loop's growing caches: start over
            _PLANS.clear()
        p = _problem(q, k, causal, scale, mask)
        lens = None
        if host_lens is not None:  # kept with the problem, which points at it
            lens = (ctypes.c_int * len(host_lens))(*host_lens)
            p.cache_lens = ctypes.cast(lens, ctypes.c_void_p)
        fn = lib.forward_workspace if direction == "forward" else lib.backward_workspace
        plan = _PLANS[key] = (p, fn(p), lens)
    return plan[0], plan[1]


def _workspace(q, size):
    """The workspace as a torch tensor (PyTorch's caching allocator, so a call can be
    captured in a CUDA graph), or None for a stage that needs none."""
    return torch.empty(size, dtype=torch.uint8, device=q.device) if size else None


_OP_OPTIONS = {}
# The Python operators are flash_stages::forward and ::backward where the C++ ones did not
# load; beside the C++ ones (which own those names) they are registered under another name,
# unused, so that FLASH_STAGES_PYTHON_OPERATORS=1 and the C++ build run the same code above.
_PYTHON_NAMESPACE = "flash_stages_python" if _OPERATORS else "flash_stages"
_cpp_forward = torch.ops.flash_stages.forward.default if _OPERATORS else None
# planned_forward as the callable the operator object wraps: its Python __call__ is a frame
# more on every call. Its flags (PlannedCall in operators.cpp):
_PLAN_CAUSAL, _PLAN_GQA, _PLAN_SEQ_MAJOR, _PLAN_DETERMINISTIC, _PLAN_NO_GRAD = 1, 2, 4, 8, 16
_planned_forward = getattr(torch.ops.flash_stages.planned_forward.default, "_op",
                           torch.ops.flash_stages.planned_forward.default) \
    if _OPERATORS else None


def _run_forward(q, k, v, stage, causal, scale, lens=None, mask=None):
    """O and LSE of one call: the body of the forward operator and of _Attention. lens: the KV
    cache's lengths, (B host ints as a tuple, the same as a device int32 tensor), or None.
    mask: as _problem's, or None."""
    _check_environment()  # before forward_workspace, which reads them at stage 11's decode
    lib = _LIBS[stage]
    q, k, v = _in_kernel_layout(q), _in_kernel_layout(k), _in_kernel_layout(v)
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    with _OnDevice(q) as (index, stream):
        p, size = _plan_call(lib, "forward", q, k, causal, scale, index,
                             lens[0] if lens is not None else None, mask)
        ws = _workspace(q, size)
        bufs = _library.Buffers(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                lse.data_ptr(), None, None, None, None,
                                ws.data_ptr() if ws is not None else None,
                                lens[1].data_ptr() if lens is not None and lens[1] is not None
                                else None)
        _mask_buffers(bufs, mask)
        last_call._record(stage=stage, direction="forward", q=bufs.q, k=bufs.k, v=bufs.v,
                         o=bufs.o, lse=bufs.lse)
        lib.forward(p, bufs, stream)
    return o, lse


@torch.library.custom_op(f"{_PYTHON_NAMESPACE}::forward", mutates_args=(), device_types="cuda",
                         **_OP_OPTIONS)
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stage: str, causal: bool,
                scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_forward(q, k, v, stage, causal, scale)


@_forward_op.register_fake
def _(q, k, v, stage, causal, scale, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        q.shape[:3], dtype=torch.float32)


def _mask_buffers(bufs, mask):
    """The device offsets of a varlen call into its Buffers."""
    if mask is not None and mask[3] is not None:
        bufs.cu_seqlens_q, bufs.cu_seqlens_k = mask[3].data_ptr(), mask[4].data_ptr()


def _run_backward(d_o, q, k, v, o, lse, stage, causal, scale, deterministic, mask=None):
    """dQ, dK and dV of one call: the body of the backward operator and of _Attention. mask:
    as _problem's, or None."""
    _check_environment()
    lib = _LIBS[stage]
    d_o, q, k, v, o = (_in_kernel_layout(t) for t in (d_o, q, k, v, o))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # The call's deterministic=True or torch's deterministic mode asks the stage for its
    # deterministic dQ path (09-12), as ATTN_DETERMINISTIC=1 in the environment does, which
    # is left as the caller set it.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    with _OnDevice(q) as (index, stream):
        p, size = _plan_call(lib, "backward", q, k, causal, scale, index, None, mask)
        ws = _workspace(q, size)
        bufs = _library.Buffers(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                lse.data_ptr(), d_o.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                dv.data_ptr(), ws.data_ptr() if ws is not None else None)
        _mask_buffers(bufs, mask)
        last_call._record(stage=stage, direction="backward", q=bufs.q, k=bufs.k, v=bufs.v,
                         d_o=bufs.d_o, dq=bufs.dq, dk=bufs.dk, dv=bufs.dv)
        lib.run_backward(p, bufs, stream, deterministic)
    return dq, dk, dv


@torch.library.custom_op(f"{_PYTHON_NAMESPACE}::backward", mutates_args=(), device_types="cuda",
                         **_OP_OPTIONS)
def _backward_op(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, stage: str, causal: bool, scale: float,
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(d_o, q, k, v, o, lse, stage, causal, scale, deterministic)


@_backward_op.register_fake
def _(d_o, q, k, v, o, lse, stage, causal, scale, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, stage, causal, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.stage, ctx.causal, ctx.scale, ctx.deterministic = stage, causal, scale, deterministic
    ctx.mark_non_differentiable(lse)  # the backward has no term for a gradient of LSE
    ctx.set_materialize_grads(False)


def _backward(ctx, d_o, d_lse):
    if d_o is None:  # O took no part in the loss
        return None, None, None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors
    # LSE is an output only so that the backward can have it; SDPA returns no LSE, so
    # nothing downstream differentiates it (d_lse is None or zeros).
    dq, dk, dv = _backward_op(d_o, q, k, v, o, lse, ctx.stage, ctx.causal, ctx.scale,
                              ctx.deterministic)
    return dq, dk, dv, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The eager path: the same forward and backward as the operators, without their
    dispatch (torch.compile traces the operators instead). Once differentiable, as the
    operators are: a second derivative raises rather than comes out wrong. The forward takes
    ctx itself: with a separate setup_context, every apply binds its arguments through
    inspect.signature, which a profile of small calls showed among their largest costs."""

    @staticmethod
    def forward(ctx, q, k, v, stage, causal, scale, deterministic):
        o, lse = _run_forward(q, k, v, stage, causal, scale)
        _setup_context(ctx, (q, k, v, stage, causal, scale, deterministic), (o, lse))
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_lse):
        if d_o is None:  # O took no part in the loss
            return None, None, None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(d_o, q, k, v, o, lse, ctx.stage, ctx.causal, ctx.scale,
                                   ctx.deterministic)
        return dq, dk, dv, None, None, None, None


# ---- the masked operators: a sliding window, a softcap, varlen --------------------------
# forward_masked and backward_masked, as the C++ library registers them (without seq_major:
# the Python operators take [B, H, N, d] and copy into it), for flash_attn_func's window_size
# and softcap and for flash_attn_varlen_func. Separate operators, so that forward and backward
# keep their schemas.


def _operator_mask(q, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k):
    """The mask tuple of _problem from an operator's arguments, checked as the C++ operators
    check them (a direct call of the operator has no package checks before it)."""
    if window_left < -1 or window_right < -1:
        raise FlashStagesError("window_left and window_right must be -1 (unbounded) or >= 0")
    if not (softcap == 0.0 or _FP32_MIN_NORMAL <= softcap <= _FP32_MAX):
        raise FlashStagesError("softcap must be 0 (none) or a positive fp32 number")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise FlashStagesError("cu_seqlens_q and cu_seqlens_k go together")
    if cu_seqlens_q is not None:
        for cu in (cu_seqlens_q, cu_seqlens_k):
            if not (cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and
                    cu.device == q.device and cu.numel() == cu_seqlens_q.numel() and
                    2 <= cu.numel() <= _MAX_DIM + 1):
                raise FlashStagesError("cu_seqlens_q and cu_seqlens_k must be B + 1 contiguous "
                                       "int32 offsets each, on q's device")
        if q.shape[0] != 1:
            raise FlashStagesError("varlen packs its sequences into one batch: q must be "
                                   "[1, H, total, d]")
        if max_seqlen_q < 0 or max_seqlen_k < 0:
            raise FlashStagesError("max_seqlen_q and max_seqlen_k must be >= 0")
    return (min(window_left, _MAX_DIM), min(window_right, _MAX_DIM), float(softcap),
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@torch.library.custom_op(f"{_PYTHON_NAMESPACE}::forward_masked", mutates_args=(),
                         device_types="cuda", **_OP_OPTIONS)
def _forward_masked_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stage: str,
                       causal: bool, scale: float, window_left: int, window_right: int,
                       softcap: float, cu_seqlens_q: Optional[torch.Tensor],
                       cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
                       max_seqlen_k: int, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask = _operator_mask(q, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k)
    return _run_forward(q, k, v, stage, causal, scale, mask=mask)


@_forward_masked_op.register_fake
def _(q, k, v, stage, causal, scale, window_left, window_right, softcap, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(f"{_PYTHON_NAMESPACE}::backward_masked", mutates_args=(),
                         device_types="cuda", **_OP_OPTIONS)
def _backward_masked_op(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, stage: str, causal: bool,
                        scale: float, window_left: int, window_right: int, softcap: float,
                        cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                        max_seqlen_q: int, max_seqlen_k: int,
                        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = _operator_mask(q, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k)
    return _run_backward(d_o, q, k, v, o, lse, stage, causal, scale, deterministic, mask)


@_backward_masked_op.register_fake
def _(d_o, q, k, v, o, lse, stage, causal, scale, window_left, window_right, softcap,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_masked_context(ctx, inputs, output):
    (q, k, v, stage, causal, scale, left, right, softcap, cu_q, cu_k, max_q, max_k,
     deterministic) = inputs
    o, lse = output
    # The offsets (None without varlen) as saved tensors: see _MaskedAttention.forward.
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.stage, ctx.causal, ctx.scale, ctx.deterministic = stage, causal, scale, deterministic
    ctx.masks = (left, right, softcap, max_q, max_k)
    ctx.mark_non_differentiable(lse)  # as _setup_context
    ctx.set_materialize_grads(False)


def _masked_backward(ctx, d_o, d_lse):
    if d_o is None:  # O took no part in the loss
        return (None,) * 14
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    left, right, softcap, max_q, max_k = ctx.masks
    dq, dk, dv = _backward_masked_op(d_o, q, k, v, o, lse, ctx.stage, ctx.causal, ctx.scale,
                                     left, right, softcap, cu_q, cu_k, max_q, max_k,
                                     ctx.deterministic)
    return (dq, dk, dv) + (None,) * 11


_forward_masked_op.register_autograd(_masked_backward, setup_context=_setup_masked_context)


class _MaskedAttention(torch.autograd.Function):
    """_Attention for masked calls: mask as _problem takes it (its offsets need no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, stage, causal, scale, deterministic, mask):
        o, lse = _run_forward(q, k, v, stage, causal, scale, mask=mask)
        left, right, softcap, cu_q, cu_k, max_q, max_k = mask
        # The offsets are saved as tensors, so that autograd refuses a backward after they
        # were changed in place (a reused graph buffer) instead of running it on new offsets.
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.stage, ctx.causal, ctx.scale, ctx.deterministic = stage, causal, scale, deterministic
        ctx.masks = (left, right, softcap, max_q, max_k)
        ctx.mark_non_differentiable(lse)  # as _setup_context
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_lse):
        if d_o is None:  # O took no part in the loss
            return (None,) * 8
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        left, right, softcap, max_q, max_k = ctx.masks
        dq, dk, dv = _run_backward(d_o, q, k, v, o, lse, ctx.stage, ctx.causal, ctx.scale,
                                   ctx.deterministic,
                                   (left, right, softcap, cu_q, cu_k, max_q, max_k))
        return (dq, dk, dv) + (None,) * 5


def _attention_masked(q, k, v, stage, causal, scale, deterministic, needs_grad, mask):
    """_attention for a masked call through the Python operators (the C++ ones are called
    directly): mask as _problem takes it."""
    if torch.compiler.is_compiling():
        return _forward_masked_op(q, k, v, stage, causal, scale, *mask, deterministic)
    if not needs_grad:
        return _run_forward(q, k, v, stage, causal, scale, mask=mask)
    return _MaskedAttention.apply(q, k, v, stage, causal, scale, deterministic, mask)
