/* The package's operators, flash_stages::forward and flash_stages::backward (and their masked
 * forms, forward_masked and backward_masked: a sliding window, a softcap, varlen), registered
 * from C++. Python's definitions of the same operators (flash_stages/__init__.py) cost a call
 * tens of microseconds of host time: ctypes, the tensors' metadata read one Python call at a
 * time, and a backward that runs Python on autograd's thread. Here a call costs what a
 * built-in operator's does, the dispatcher's and autograd's own work plus the stage's.
 *
 * The kernels are the stage libraries' (common/stage_library.cu), the same ones Python loads:
 * at import, Python hands each library's entry points to flash_stages::register_stage, and
 * the operators call them on PyTorch's tensors, its current stream and its caching allocator
 * (so a call can be captured in a CUDA graph). The package uses these operators where this
 * library was built for the torch it runs with, and its Python ones otherwise.
 */
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "attention.h"

namespace {

/* A stage library's entry points (common/stage_library.cu). */
struct StageLibrary {
  int (*forward_workspace)(const attn_problem *, size_t *);
  int (*backward_workspace)(const attn_problem *, size_t *);
  int (*forward)(const attn_problem *, const attn_buffers *, void *);
  int (*backward)(const attn_problem *, const attn_buffers *, void *, int);
  const char *(*error)(void);
  bool layouts; /* the stage reads [B, N, H, d] in place (attn_stage.has_layouts) */
};

/* Filled at import; a lock, since a stage may be registered while another thread calls. */
std::mutex libraries_lock;
std::unordered_map<std::string, StageLibrary> libraries;

template <typename Fn>
Fn entry_point(int64_t address, const char *name) {
  TORCH_CHECK_VALUE(address != 0, "flash_stages: register_stage got no address for ", name);
  return reinterpret_cast<Fn>(static_cast<std::uintptr_t>(address));
}

void register_stage(c10::string_view name, int64_t forward_workspace, int64_t backward_workspace,
                    int64_t forward, int64_t backward, int64_t error, bool layouts) {
  StageLibrary lib;
  lib.forward_workspace =
      entry_point<decltype(lib.forward_workspace)>(forward_workspace, "forward_workspace");
  lib.backward_workspace =
      entry_point<decltype(lib.backward_workspace)>(backward_workspace, "backward_workspace");
  lib.forward = entry_point<decltype(lib.forward)>(forward, "forward");
  lib.backward = entry_point<decltype(lib.backward)>(backward, "backward");
  lib.error = entry_point<decltype(lib.error)>(error, "error");
  lib.layouts = layouts;
  std::lock_guard<std::mutex> hold(libraries_lock);
  libraries[std::string(name)] = lib;
}

StageLibrary library(c10::string_view name) {
  std::lock_guard<std::mutex> hold(libraries_lock);
  auto found = libraries.find(std::string(name));
  TORCH_CHECK_VALUE(found != libraries.end(), "flash_stages: no stage registered as ",
                    std::string(name));
  return found->second;
}

/* Where the stage program would exit, the library returns its exit code. 2 (what this device
 * cannot run) and 77 (a stage built for another GPU) become ValueError, which the package
 * raises as FlashStagesError; 1 (a CUDA error) RuntimeError. The message is the program's
 * line, as the Python operators give it. */
void check(const StageLibrary &lib, int code, const char *what) {
  if (code == EXIT_OK) return;
  std::string line = std::string(lib.error()) + " (in the " + what + ")";
  TORCH_CHECK_VALUE(code != EXIT_BAD_USAGE && code != EXIT_NO_DEVICE, line);
  TORCH_CHECK(false, line);
}

/* The pointers and shape of the last kernel call, so that a test can see that the kernels
 * read and wrote PyTorch's own tensors (flash_stages.last_call). */
std::mutex last_call_lock;
std::string last_stage, last_direction;
std::vector<int64_t> last_pointers;

void record(c10::string_view stage, const char *direction,
            std::initializer_list<const void *> pointers) {
  std::lock_guard<std::mutex> hold(last_call_lock);
  last_stage.assign(stage.data(), stage.size());
  last_direction = direction;
  last_pointers.clear();
  for (const void *p : pointers)
    last_pointers.push_back(static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(p)));
}

std::tuple<std::string, std::string, std::vector<int64_t>> last_call() {
  std::lock_guard<std::mutex> hold(last_call_lock);
  return {last_stage, last_direction, last_pointers};
}

attn_dtype dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DTYPE_FP32;
    case at::kHalf: return DTYPE_FP16;
    case at::kBFloat16: return DTYPE_BF16;
    default: TORCH_CHECK_VALUE(false, "flash_stages: no stage takes ", type, " inputs");
  }
}

/* seq_major: q and k are given as [B, N, H, d], not [B, H, N, d]. */
attn_problem problem(const at::Tensor &q, const at::Tensor &k, bool causal, double scale,
                     attn_layout layout, bool seq_major = false) {
  const int heads = seq_major ? 2 : 1, rows = seq_major ? 1 : 2;
  attn_problem p{};
  p.batch = static_cast<int>(q.size(0));
  p.heads = static_cast<int>(q.size(heads));
  p.seq_q = static_cast<int>(q.size(rows));
  p.seq_kv = static_cast<int>(k.size(rows));
  p.head_dim = static_cast<int>(q.size(3));
  p.causal = causal;
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_code(q.scalar_type());
  p.heads_kv = static_cast<int>(k.size(heads));
  p.cache_lens = nullptr;
  p.layout = layout;
  return p;
}

/* What the package's Python checks before any call, checked again for a direct call of the
 * operators: a host pointer or a tensor of another dtype must not reach the kernels. */
void check_tensors(std::initializer_list<const at::Tensor *> tensors) {
  const at::Tensor &first = **tensors.begin();
  for (const at::Tensor *t : tensors)
    TORCH_CHECK_VALUE(t->dim() == 4 && t->is_cuda() && t->device() == first.device() &&
                          t->scalar_type() == first.scalar_type(),
                      "flash_stages: the operators take 4-D CUDA tensors of one device and dtype");
}

/* The operators take [B, H, N, d] tensors; in memory each is [B, H, N, d] itself, or
 * [B, N, H, d] seen through transpose(1, 2): flash_attn_func's tensors, and what most models
 * hand SDPA. (Where N or H is 1 a tensor is both, and counts as [B, H, N, d].) */
bool seq_major(const at::Tensor &t) {
  return !t.is_contiguous() && t.transpose(1, 2).is_contiguous();
}

/* The layout the kernels read: [B, N, H, d] where the stage has it and K (the larger tensor
 * in decode) or Q is laid out so, else [B, H, N, d]. Every tensor of the call takes it. */
attn_layout choose_layout(const StageLibrary &lib, const at::Tensor &q, const at::Tensor &k) {
  return lib.layouts && (seq_major(k) || seq_major(q)) ? LAYOUT_BSHD : LAYOUT_BHND;
}

/* t as the kernels read it: in `layout`, dense, from a 16-byte boundary (their 16-byte
 * copies; TMA in stage 10). A tensor already so is read in place; any other is copied, once. */
at::Tensor kernel_layout(const at::Tensor &t, attn_layout layout) {
  at::Tensor c =
      layout == LAYOUT_BSHD ? t.transpose(1, 2).contiguous().transpose(1, 2) : t.contiguous();
  if (reinterpret_cast<std::uintptr_t>(c.data_ptr()) % 16 == 0) return c;
  return layout == LAYOUT_BSHD ? c.transpose(1, 2).clone().transpose(1, 2) : c.clone();
}

/* Read in place as given: dense in the order of its dimensions, from a 16-byte boundary. */
bool dense(const at::Tensor &t) {
  return t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

/* A new dense CUDA tensor on t's device from the caching allocator, as at::empty makes it but
 * without the dispatcher's round trip: a call allocates up to five, and at a small shape
 * each trip is host time the kernels do not hide. */
at::Tensor new_cuda(at::IntArrayRef sizes, const at::Tensor &t, at::ScalarType dtype) {
  return at::detail::empty_cuda(sizes, dtype, t.device(), std::nullopt);
}

/* A new [B, H, N, d] tensor shaped and typed like t, laid out as `layout` says. (Meta tensors,
 * for torch.compile, through at::empty: their sizes may be symbols.) */
at::Tensor empty_in(const at::Tensor &t, attn_layout layout) {
  if (!t.is_meta()) {
    if (layout == LAYOUT_BHND) return new_cuda(t.sizes(), t, t.scalar_type());
    return new_cuda({t.size(0), t.size(2), t.size(1), t.size(3)}, t, t.scalar_type())
        .transpose(1, 2);
  }
  if (layout == LAYOUT_BHND) return at::empty_like(t, at::MemoryFormat::Contiguous);
  return at::empty_symint({t.sym_size(0), t.sym_size(2), t.sym_size(1), t.sym_size(3)}, t.options())
      .transpose(1, 2);
}

/* The buffers both passes read, and the workspace the pass asked for, from PyTorch's caching
 * allocator (none where it asked for none); `holder` keeps it until the call returns. */
attn_buffers pass_buffers(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                          const at::Tensor &o, const at::Tensor &lse, size_t workspace_bytes,
                          at::Tensor &holder) {
  attn_buffers t{};
  t.q = q.data_ptr();
  t.k = k.data_ptr();
  t.v = v.data_ptr();
  t.o = o.data_ptr();
  t.lse = lse.data_ptr<float>();
  if (workspace_bytes) {
    holder = new_cuda({static_cast<int64_t>(workspace_bytes)}, q, at::kByte);
    t.workspace = holder.data_ptr();
  }
  return t;
}

/* What forward_masked and backward_masked add to the problem (13_window_softcap_varlen,
 * docs/conventions.md section 1): a sliding window (a side of -1 unbounded), a logit softcap
 * (0: none) and varlen's packed sequences. The offsets go to the kernels on the device alone
 * (attn_buffers.cu_seqlens_q, _k); the host copies stay NULL and the stage plans its grids
 * from max_seqlen_q and max_seqlen_k, so the call reads nothing back to the host and can be
 * captured in a CUDA graph. */
struct Masks {
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  const int *cu_seqlens_q = nullptr, *cu_seqlens_k = nullptr;
  int seqs = 0;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;

  void apply(attn_problem &p) const {
    p.windowed = window_left >= 0 || window_right >= 0;
    p.window_left = window_left;
    p.window_right = window_right;
    p.softcap = softcap;
    if (!seqs) return;
    p.seqs = seqs;
    /* No sequence is longer than the packed total: a larger bound (a fixed context length
     * given for every batch) would only launch blocks with nothing to do. */
    p.max_seqlen_q = static_cast<int>(std::min<int64_t>(max_seqlen_q, p.seq_q));
    p.max_seqlen_k = static_cast<int>(std::min<int64_t>(max_seqlen_k, p.seq_kv));
  }
  void apply(attn_buffers &t) const {
    t.cu_seqlens_q = cu_seqlens_q;
    t.cu_seqlens_k = cu_seqlens_k;
  }
};

/* The masks of a call, checked as far as can be without reading the offsets (the package's
 * Python reads them back and checks them outside a CUDA graph capture). */
Masks masks(const at::Tensor &q, int64_t window_left, int64_t window_right, double softcap,
            const std::optional<at::Tensor> &cu_seqlens_q,
            const std::optional<at::Tensor> &cu_seqlens_k, int64_t max_seqlen_q,
            int64_t max_seqlen_k) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "flash_stages: window_left and window_right must be -1 (unbounded) or >= 0");
  /* Below fp32's smallest normal number the cap would round towards 0, which means none. */
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= std::numeric_limits<float>::min() &&
                                     softcap <= std::numeric_limits<float>::max()),
                    "flash_stages: softcap must be 0 (none) or a positive fp32 number");
  Masks m;
  /* A side past the programs' largest size (2^24) bounds nothing: clamped, it fits an int. */
  m.window_left = static_cast<int>(std::min<int64_t>(window_left, 1 << 24));
  m.window_right = static_cast<int>(std::min<int64_t>(window_right, 1 << 24));
  m.softcap = static_cast<float>(softcap);
  TORCH_CHECK_VALUE(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                    "flash_stages: cu_seqlens_q and cu_seqlens_k go together");
  if (!cu_seqlens_q) return m;
  const at::Tensor &cu_q = *cu_seqlens_q, &cu_k = *cu_seqlens_k;
  for (const at::Tensor *cu : {&cu_q, &cu_k})
    TORCH_CHECK_VALUE(cu->scalar_type() == at::kInt && cu->dim() == 1 && cu->is_contiguous() &&
                          cu->device() == q.device() && cu->numel() == cu_q.numel() &&
                          cu->numel() >= 2 && cu->numel() - 1 <= (1 << 24),
                      "flash_stages: cu_seqlens_q and cu_seqlens_k must be B + 1 contiguous "
                      "int32 offsets each, on q's device");
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(0) == 1,
                    "flash_stages: varlen packs its sequences into one batch: q must be "
                    "[1, total, H, d]");
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0,
                    "flash_stages: max_seqlen_q and max_seqlen_k must be >= 0");
  m.cu_seqlens_q = cu_q.data_ptr<int>();
  m.cu_seqlens_k = cu_k.data_ptr<int>();
  m.seqs = static_cast<int>(cu_q.numel() - 1);
  m.max_seqlen_q = max_seqlen_q;
  m.max_seqlen_k = max_seqlen_k;
  return m;
}

/* The forward, with the KV cache's lengths where given: B ints on the host (the stage plans
 * its split from them) and the same on the device (its kernels read them). seq_major: the
 * tensors are given as [B, N, H, d] (flash_attn_func's), not [B, H, N, d]; O comes back so
 * too (dense), and LSE as [B, H, N]. Dense ones go to a stage with layouts as they are, with
 * no view made (each costs host time); any other takes the [B, H, N, d] path through views. */
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor &q_in, const at::Tensor &k_in,
                                               const at::Tensor &v_in, c10::string_view stage,
                                               bool causal, double scale, const int *host_lens,
                                               const int *device_lens, bool seq_major,
                                               const Masks *masks = nullptr) {
  StageLibrary lib = library(stage);
  check_tensors({&q_in, &k_in, &v_in});
  if (seq_major && !(lib.layouts && dense(q_in) && dense(k_in) && dense(v_in))) {
    auto [o, lse] = run_forward(q_in.transpose(1, 2), k_in.transpose(1, 2), v_in.transpose(1, 2),
                                stage, causal, scale, host_lens, device_lens, false, masks);
    return {o.transpose(1, 2).contiguous(), lse};
  }
  c10::cuda::CUDAGuard on_device(q_in.device()); /* the stages launch on the current device */
  attn_layout layout = seq_major ? LAYOUT_BSHD : choose_layout(lib, q_in, k_in);
  at::Tensor q = seq_major ? q_in : kernel_layout(q_in, layout),
             k = seq_major ? k_in : kernel_layout(k_in, layout),
             v = seq_major ? v_in : kernel_layout(v_in, layout);
  at::Tensor o = seq_major ? new_cuda(q.sizes(), q, q.scalar_type()) : empty_in(q, layout);
  attn_problem p = problem(q, k, causal, scale, layout, seq_major);
  at::Tensor lse = new_cuda({p.batch, p.heads, p.seq_q}, q, at::kFloat);
  p.cache_lens = host_lens;
  if (masks) masks->apply(p);
  size_t bytes = 0;
  check(lib, lib.forward_workspace(&p, &bytes), "forward workspace");
  at::Tensor held;
  attn_buffers t = pass_buffers(q, k, v, o, lse, bytes, held);
  t.cache_lens = device_lens;
  if (masks) masks->apply(t);
  record(stage, "forward", {t.q, t.k, t.v, t.o, t.lse});
  check(lib, lib.forward(&p, &t, c10::cuda::getCurrentCUDAStream().stream()), "forward");
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor &q, const at::Tensor &k,
                                                const at::Tensor &v, c10::string_view stage,
                                                bool causal, double scale, bool deterministic,
                                                bool seq_major) {
  (void)deterministic; /* the forward has one path; the flag is the backward's */
  return run_forward(q, k, v, stage, causal, scale, nullptr, nullptr, seq_major);
}

/* Decode against a KV cache, on flash_attn_with_kvcache's [B, N, H, d] tensors (O comes back so
 * too, LSE as [B, H, N]): sequence b holds its first cache_lens[b] keys (B int32 on q's
 * device, which the kernels read), or all N where cache_lens is None. host_lens: the same B
 * values on the host, from which stage 11 plans its split of the keys (they must be the
 * same: a device length past its host value would not be read whole), or none: then it plans
 * from the capacity (k's N), and the call reads nothing on the host, so that it can be
 * captured in a CUDA graph. No gradient, as FlashAttention's. */
std::tuple<at::Tensor, at::Tensor> forward_kvcache_cuda(const at::Tensor &q, const at::Tensor &k,
                                                        const at::Tensor &v,
                                                        const std::optional<at::Tensor> &cache_lens,
                                                        at::IntArrayRef host_lens,
                                                        c10::string_view stage, bool causal,
                                                        double scale) {
  TORCH_CHECK_VALUE(q.dim() == 4, "flash_stages: q must be 4-D [B, N, H, d]");
  const int *device_lens = nullptr;
  if (cache_lens) {
    const at::Tensor &lens = *cache_lens;
    TORCH_CHECK_VALUE(
        lens.scalar_type() == at::kInt && lens.is_contiguous() && lens.device() == q.device() &&
            lens.numel() == q.size(0) &&
            (host_lens.empty() || static_cast<int64_t>(host_lens.size()) == q.size(0)),
        "flash_stages: cache_lens must be B contiguous int32 on q's device, and "
        "host_lens the same B values on the host or none");
    device_lens = lens.data_ptr<int>();
  } else {
    TORCH_CHECK_VALUE(host_lens.empty(), "flash_stages: host_lens without cache_lens");
  }
  std::vector<int> lens(host_lens.begin(), host_lens.end());
  return run_forward(q, k, v, stage, causal, scale, lens.empty() ? nullptr : lens.data(),
                     device_lens, true);
}

/* seq_major: as the forward's; dQ, dK and dV come back [B, N, H, d] (dense). masks: as the
 * forward's. */
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor &d_o_in, const at::Tensor &q_in, const at::Tensor &k_in,
    const at::Tensor &v_in, const at::Tensor &o_in, const at::Tensor &lse_in,
    c10::string_view stage, bool causal, double scale, bool deterministic, bool seq_major,
    const Masks *masks) {
  StageLibrary lib = library(stage);
  check_tensors({&q_in, &k_in, &v_in, &d_o_in, &o_in});
  if (seq_major &&
      !(lib.layouts && dense(d_o_in) && dense(q_in) && dense(k_in) && dense(v_in) && dense(o_in))) {
    auto [dq, dk, dv] = run_backward(
        d_o_in.transpose(1, 2), q_in.transpose(1, 2), k_in.transpose(1, 2), v_in.transpose(1, 2),
        o_in.transpose(1, 2), lse_in, stage, causal, scale, deterministic, false, masks);
    return {dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(),
            dv.transpose(1, 2).contiguous()};
  }
  c10::cuda::CUDAGuard on_device(q_in.device());
  attn_layout layout = seq_major ? LAYOUT_BSHD : choose_layout(lib, q_in, k_in);
  auto in_layout = [&](const at::Tensor &t) { return seq_major ? t : kernel_layout(t, layout); };
  auto new_like = [&](const at::Tensor &t) {
    return seq_major ? new_cuda(t.sizes(), t, t.scalar_type()) : empty_in(t, layout);
  };
  at::Tensor d_o = in_layout(d_o_in), q = in_layout(q_in), k = in_layout(k_in), v = in_layout(v_in),
             o = in_layout(o_in), lse = lse_in.contiguous();
  at::Tensor dq = new_like(q), dk = new_like(k), dv = new_like(v);
  attn_problem p = problem(q, k, causal, scale, layout, seq_major);
  if (masks) masks->apply(p);
  size_t bytes = 0;
  check(lib, lib.backward_workspace(&p, &bytes), "backward workspace");
  at::Tensor held;
  attn_buffers t = pass_buffers(q, k, v, o, lse, bytes, held);
  if (masks) masks->apply(t);
  t.d_o = d_o.data_ptr();
  t.dq = dq.data_ptr();
  t.dk = dk.data_ptr();
  t.dv = dv.data_ptr();
  /* The call's deterministic=True or torch's deterministic mode asks the stage for its
   * deterministic dQ path, as ATTN_DETERMINISTIC=1 in the environment does. */
  bool ordered = deterministic || at::globalContext().deterministicAlgorithms();
  record(stage, "backward", {t.q, t.k, t.v, t.d_o, t.dq, t.dk, t.dv});
  check(lib, lib.backward(&p, &t, c10::cuda::getCurrentCUDAStream().stream(), ordered), "backward");
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor &d_o, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &o, const at::Tensor &lse, c10::string_view stage, bool causal, double scale,
    bool deterministic, bool seq_major) {
  return run_backward(d_o, q, k, v, o, lse, stage, causal, scale, deterministic, seq_major,
                      nullptr);
}

/* The forward and backward with a sliding window, a softcap or varlen (Masks): separate
 * operators, so that forward and backward keep their schemas and their planned fast path.
 * Varlen takes q [1, total_q, H, d] and k, v [1, total_k, H, d] with seq_major=True (or their
 * [1, H, total, d] views), cu_seqlens_q and cu_seqlens_k B + 1 int32 offsets on the device. */
std::tuple<at::Tensor, at::Tensor> forward_masked_cuda(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, c10::string_view stage,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor> &cu_seqlens_q, const std::optional<at::Tensor> &cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool deterministic, bool seq_major) {
  (void)deterministic; /* the backward's, as in forward */
  Masks m = masks(q, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k);
  return run_forward(q, k, v, stage, causal, scale, nullptr, nullptr, seq_major, &m);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_masked_cuda(
    const at::Tensor &d_o, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &o, const at::Tensor &lse, c10::string_view stage, bool causal, double scale,
    int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor> &cu_seqlens_q, const std::optional<at::Tensor> &cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool deterministic, bool seq_major) {
  Masks m = masks(q, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k);
  return run_backward(d_o, q, k, v, o, lse, stage, causal, scale, deterministic, seq_major, &m);
}

/* Shapes and strides only, for torch.compile's fake tensors: the layout the CUDA kernel's
 * outputs will have. (sym_size: under dynamic shapes the sizes are symbols.) */
std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor &q, const at::Tensor &k,
                                                const at::Tensor &, c10::string_view stage, bool,
                                                double, bool, bool seq_major) {
  if (seq_major)
    return {at::empty_like(q, at::MemoryFormat::Contiguous),
            at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1)},
                             q.options().dtype(at::kFloat))};
  return {empty_in(q, choose_layout(library(stage), q, k)),
          at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)},
                           q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> forward_kvcache_meta(const at::Tensor &q, const at::Tensor &k,
                                                        const at::Tensor &v,
                                                        const std::optional<at::Tensor> &,
                                                        at::IntArrayRef, c10::string_view stage,
                                                        bool, double) {
  return forward_meta(q, k, v, stage, false, 0.0, false, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor &, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &, const at::Tensor &, c10::string_view stage, bool, double, bool,
    bool seq_major) {
  if (seq_major)
    return {at::empty_like(q, at::MemoryFormat::Contiguous),
            at::empty_like(k, at::MemoryFormat::Contiguous),
            at::empty_like(v, at::MemoryFormat::Contiguous)};
  attn_layout layout = choose_layout(library(stage), q, k);
  return {empty_in(q, layout), empty_in(k, layout), empty_in(v, layout)};
}

std::tuple<at::Tensor, at::Tensor> forward_masked_meta(const at::Tensor &q, const at::Tensor &k,
                                                       const at::Tensor &v, c10::string_view stage,
                                                       bool, double, int64_t, int64_t, double,
                                                       const std::optional<at::Tensor> &,
                                                       const std::optional<at::Tensor> &, int64_t,
                                                       int64_t, bool, bool seq_major) {
  return forward_meta(q, k, v, stage, false, 0.0, false, seq_major);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_masked_meta(
    const at::Tensor &d_o, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &o, const at::Tensor &lse, c10::string_view stage, bool, double, int64_t,
    int64_t, double, const std::optional<at::Tensor> &, const std::optional<at::Tensor> &, int64_t,
    int64_t, bool, bool seq_major) {
  return backward_meta(d_o, q, k, v, o, lse, stage, false, 0.0, false, seq_major);
}

/* The autograd formula: the backward operator, once differentiable (the backward operator's
 * autograd kernel is PyTorch's not-implemented one, so a second derivative raises, as for
 * PyTorch's own attention backwards). LSE is an output only so that the
 * backward can have it: it carries no gradient. */
/* The operators as the dispatcher holds them, looked up once. */
const c10::TypedOperatorHandle<decltype(forward_cuda)> &forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flash_stages::forward", "")
                       .typed<decltype(forward_cuda)>();
  return op;
}

class Attention : public torch::autograd::Function<Attention> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                const at::Tensor &q, const at::Tensor &k,
                                                const at::Tensor &v, const std::string &stage,
                                                bool causal, double scale, bool deterministic,
                                                bool seq_major) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [o, lse] = forward_op().call(q, k, v, stage, causal, scale, deterministic, seq_major);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["stage"] = stage;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["seq_major"] = seq_major;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {o, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flash_stages::backward", "")
                         .typed<decltype(backward_cuda)>();
    const at::Tensor none;
    if (!grads[0].defined()) return {none, none, none, none, none, none, none, none}; /* O unused */
    auto saved = ctx->get_saved_variables();
    /* The backward operator's autograd kernel is the not-implemented fallback, a boxed trip
     * through every argument. It matters only where the gradients would be differentiated
     * again (create_graph=True, grad mode on here): there it makes that raise. Otherwise the
     * CUDA kernel directly. */
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    auto [dq, dk, dv] =
        op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                ctx->saved_data["stage"].toStringRef(), ctx->saved_data["causal"].toBool(),
                ctx->saved_data["scale"].toDouble(), ctx->saved_data["deterministic"].toBool(),
                ctx->saved_data["seq_major"].toBool());
    return {dq, dk, dv, none, none, none, none, none};
  }
};

std::tuple<at::Tensor, at::Tensor> forward_autograd(const at::Tensor &q, const at::Tensor &k,
                                                    const at::Tensor &v, c10::string_view stage,
                                                    bool causal, double scale, bool deterministic,
                                                    bool seq_major) {
  /* Nothing to record (inference, decode): the CUDA kernel directly, without building the
   * autograd Function's node and saving its tensors. */
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(q, k, v, stage, causal, scale, deterministic, seq_major);
  }
  auto out = Attention::apply(q, k, v, std::string(stage), causal, scale, deterministic, seq_major);
  return {out[0], out[1]};
}

/* The same formula for the masked operators: the window, softcap and offsets go to the backward
 * as they came to the forward (the offsets are integers: no gradient). */
const c10::TypedOperatorHandle<decltype(forward_masked_cuda)> &forward_masked_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flash_stages::forward_masked", "")
                       .typed<decltype(forward_masked_cuda)>();
  return op;
}

class MaskedAttention : public torch::autograd::Function<MaskedAttention> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext *ctx, const at::Tensor &q, const at::Tensor &k,
      const at::Tensor &v, const std::string &stage, bool causal, double scale, int64_t window_left,
      int64_t window_right, double softcap, const std::optional<at::Tensor> &cu_seqlens_q,
      const std::optional<at::Tensor> &cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
      bool deterministic, bool seq_major) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [o, lse] = forward_masked_op().call(q, k, v, stage, causal, scale, window_left,
                                             window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, deterministic, seq_major);
    /* The offsets as saved tensors (undefined without varlen), so that autograd refuses a
     * backward after they were changed in place instead of running it on new offsets. */
    ctx->save_for_backward({q, k, v, o, lse, cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor())});
    ctx->saved_data["stage"] = stage;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["seq_major"] = seq_major;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {o, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flash_stages::backward_masked", "")
                         .typed<decltype(backward_masked_cuda)>();
    /* One gradient for each of the forward's 15 arguments: q, k and v's, then none. */
    torch::autograd::variable_list out(15);
    if (!grads[0].defined()) return out; /* O took no part in the loss */
    auto saved = ctx->get_saved_variables();
    auto &data = ctx->saved_data;
    auto offsets = [](const at::Tensor &t) {
      return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
    };
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd; /* as Attention's */
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    auto [dq, dk, dv] = op.call(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], data["stage"].toStringRef(),
        data["causal"].toBool(), data["scale"].toDouble(), data["window_left"].toInt(),
        data["window_right"].toInt(), data["softcap"].toDouble(),
        offsets(saved[5]), offsets(saved[6]), data["max_seqlen_q"].toInt(),
        data["max_seqlen_k"].toInt(), data["deterministic"].toBool(), data["seq_major"].toBool());
    out[0] = dq;
    out[1] = dk;
    out[2] = dv;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> forward_masked_autograd(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, c10::string_view stage,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor> &cu_seqlens_q, const std::optional<at::Tensor> &cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool deterministic, bool seq_major) {
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_masked_op().call(q, k, v, stage, causal, scale, window_left, window_right,
                                    softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    deterministic, seq_major);
  }
  auto out = MaskedAttention::apply(q, k, v, std::string(stage), causal, scale, window_left,
                                    window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, deterministic, seq_major);
  return {out[0], out[1]};
}

/* ---- Planned calls ----------------------------------------------------------------------
 * The package's entry points check a call and choose its stage in Python, tens of
 * microseconds the first time; a model calls the same shapes again and again (its layers, a
 * decode loop). Python hands each choice here (remember_plan), and a repeated call comes
 * straight to planned_forward, which finds it by everything the checks and the choice read
 * and runs the forward operator, with no Python in between. */

struct Plan {
  std::string stage;
  double scale;
};

std::mutex plans_lock;
std::unordered_map<std::string, Plan> plans;
constexpr size_t MaxPlans = 4096; /* a decode loop's growing caches: past it, start over */

/* The call's booleans in one argument. From Python each argument of an operator costs host
 * time (its conversion), and planned_forward is on every layer's path; it serves the calls of
 * the default scale and stage, by far the most common (others keep their plans in Python). */
enum PlannedCall {
  PlanCausal = 1,
  PlanGqa = 2,
  PlanSeqMajor = 4,
  PlanDeterministic = 8,
  PlanNoGrad = 16 /* flash_attn_with_kvcache's: no gradient is recorded, whatever the inputs */
};

/* Whether autograd will want this call's backward. */
bool wants_grad(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t call) {
  return !(call & PlanNoGrad) && at::GradMode::is_enabled() &&
         (q.requires_grad() || k.requires_grad() || v.requires_grad());
}

/* The plan's key: each tensor's sizes, dtype and device, the flags the stage choice reads
 * (not PlanDeterministic: the backward's; PlanNoGrad keeps the two entry points' plans
 * apart), and whether a gradient is wanted. */
std::string plan_key(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t call) {
  std::string key;
  key.reserve(256);
  auto put = [&key](const auto &value) {
    key.append(reinterpret_cast<const char *>(&value), sizeof value);
  };
  for (const at::Tensor *t : {&q, &k, &v}) {
    put(t->dim());
    for (int64_t size : t->sizes()) put(size);
    put(t->scalar_type());
    put(t->device());
  }
  put(call & (PlanCausal | PlanGqa | PlanSeqMajor | PlanNoGrad));
  put(wants_grad(q, k, v, call));
  return key;
}

void remember_plan(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t call,
                   c10::string_view stage, double scale) {
  std::string key = plan_key(q, k, v, call);
  std::lock_guard<std::mutex> hold(plans_lock);
  if (plans.size() >= MaxPlans) plans.clear();
  plans[key] = Plan{std::string(stage), scale};
}

/* [O, LSE] of a planned call (the forward operator's, with autograd's record where a gradient
 * is wanted), or [] where none is planned: the caller then checks and plans it. */
std::vector<at::Tensor> planned_forward(const at::Tensor &q, const at::Tensor &k,
                                        const at::Tensor &v, int64_t call) {
  std::string key = plan_key(q, k, v, call);
  Plan plan;
  {
    std::lock_guard<std::mutex> hold(plans_lock);
    auto found = plans.find(key);
    if (found == plans.end()) return {};
    plan = found->second;
  }
  bool causal = call & PlanCausal, deterministic = call & PlanDeterministic,
       seq_major = call & PlanSeqMajor;
  /* Without a gradient to record, the CUDA kernel itself: the dispatcher would pass through
   * forward_autograd to it, two trips of host time. (A plan is only for plain CUDA tensors:
   * Python checked them, and the key holds their device.) */
  if (!wants_grad(q, k, v, call)) {
    auto [o, lse] = forward_cuda(q, k, v, plan.stage, causal, plan.scale, deterministic, seq_major);
    return {o, lse};
  }
  auto [o, lse] =
      forward_op().call(q, k, v, plan.stage, causal, plan.scale, deterministic, seq_major);
  return {o, lse};
}

}  // namespace

TORCH_LIBRARY(flash_stages, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, str stage, bool causal, float scale, "
      "bool deterministic, bool seq_major=False) -> (Tensor, Tensor)");
  m.def(
      "backward(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, str stage, "
      "bool causal, float scale, bool deterministic, bool seq_major=False) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "forward_kvcache(Tensor q, Tensor k, Tensor v, Tensor? cache_lens, int[] host_lens, "
      "str stage, bool causal, float scale) -> (Tensor, Tensor)");
  m.def(
      "forward_masked(Tensor q, Tensor k, Tensor v, str stage, bool causal, float scale, "
      "int window_left, int window_right, float softcap, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool deterministic, "
      "bool seq_major=False) -> (Tensor, Tensor)");
  m.def(
      "backward_masked(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, str stage, "
      "bool causal, float scale, int window_left, int window_right, float softcap, "
      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "bool deterministic, bool seq_major=False) -> (Tensor, Tensor, Tensor)");
  m.def(
      "register_stage(str name, int forward_workspace, int backward_workspace, int forward, "
      "int backward, int error, bool layouts) -> ()",
      &register_stage);
  m.def("last_call() -> (str, str, int[])", &last_call);
  m.def("planned_forward(Tensor q, Tensor k, Tensor v, int call) -> Tensor[]", &planned_forward);
  m.def("remember_plan(Tensor q, Tensor k, Tensor v, int call, str stage, float scale) -> ()",
        &remember_plan);
}

TORCH_LIBRARY_IMPL(flash_stages, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("forward_kvcache", &forward_kvcache_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("forward_masked", &forward_masked_cuda);
  m.impl("backward_masked", &backward_masked_cuda);
}

TORCH_LIBRARY_IMPL(flash_stages, Meta, m) {
  m.impl("forward", &forward_meta);
  m.impl("forward_kvcache", &forward_kvcache_meta);
  m.impl("backward", &backward_meta);
  m.impl("forward_masked", &forward_masked_meta);
  m.impl("backward_masked", &backward_masked_meta);
}

TORCH_LIBRARY_IMPL(flash_stages, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("forward_kvcache", torch::autograd::autogradNotImplementedFallback());
  m.impl("forward_masked", &forward_masked_autograd);
  m.impl("backward_masked", torch::autograd::autogradNotImplementedFallback());
}
