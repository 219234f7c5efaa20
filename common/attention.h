/* The one harness every stage plugs into.
 *
 * A stage file defines one `attn_stage` descriptor (its name, its idea, the head dims and
 * dtypes it supports, its forward and backward) and calls attention_main(). Everything
 * else a stage program does (command line, inputs, the float64 reference, the checks,
 * timing, .npy files, result rows) lives here, once, so that a stage file holds only its
 * algorithm and `diff` between two stages shows only the idea that was added.
 *
 * Layout (docs/conventions.md section 1): row-major [B, H, N, d], LSE [B, H, Nq]; K and V have
 * Hkv heads, [B, Hkv, Nkv, d] (grouped-query attention; Hkv = H unless a stage has GQA). A stage
 * with layouts also reads and writes [B, N, H, d] (FlashAttention's [batch, seqlen, heads, d]) in
 * place: every tensor of the problem in the one order p->layout names.
 */
#ifndef ATTENTION_H
#define ATTENTION_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Exit codes of every stage program (docs/conventions.md section 2). */
enum { EXIT_OK = 0, EXIT_CHECK_FAILED = 1, EXIT_BAD_USAGE = 2, EXIT_NO_DEVICE = 77 };

typedef enum { DTYPE_FP32 = 0, DTYPE_FP16 = 1, DTYPE_BF16 = 2 } attn_dtype;
#define DTYPE_BIT(t) (1u << (t))

/* The order of a tensor's dims in memory; LSE is [B, H, Nq] in both. */
typedef enum { LAYOUT_BHND = 0, LAYOUT_BSHD = 1 } attn_layout;

typedef struct {
  int batch;    /* B */
  int heads;    /* H */
  int seq_q;    /* Nq */
  int seq_kv;   /* Nkv */
  int head_dim; /* d */
  int causal;   /* bottom-right aligned: key j visible to query i iff j <= i + Nkv - Nq */
  float scale;  /* softmax scale, 1/sqrt(d) unless given */
  attn_dtype dtype;
  /* The fields below were added for grouped-query attention and decode (stage 11); their zero
   * values mean "as before", so an initialiser that ends at dtype still says what it did. */
  int heads_kv;          /* Hkv, H % Hkv == 0: query head h reads K/V head h / (H / Hkv); 0 = H */
  const int *cache_lens; /* NULL, or B host ints: sequence b holds L_b <= Nkv valid keys (its
                          * KV cache); NULL means every L_b = Nkv. The device copy a GPU stage
                          * reads is attn_buffers.cache_lens. A library caller may give the
                          * device copy alone (NULL here): the stage then plans as for L_b =
                          * Nkv, and its kernels read the lengths */
  attn_layout layout;    /* of Q, K, V, O and the gradients (LAYOUT_BHND = 0: as before) */
  /* Added in 13_window_softcap_varlen; zero values: as before. */
  int windowed;                  /* 1: window_left and window_right bound the visible keys */
  int window_left, window_right; /* see attn_key_range; -1: unbounded on that side */
  float softcap;                 /* c > 0: S = c tanh(scale q.k / c), before masking; 0: none */
  /* Varlen: the sequences packed end to end in one batch (B = 1), seq_q and seq_kv the total
   * rows; sequence s holds query rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and key rows
   * likewise, offsets from 0 (equal ones: a sequence of length 0). */
  int seqs;                       /* varlen: the packed sequences (batch is then 1); 0: none */
  int max_seqlen_q, max_seqlen_k; /* varlen: the longest sequence's rows, to plan grids from */
  const int *cu_seqlens_q, *cu_seqlens_k; /* varlen: seqs + 1 host offsets, or NULL for a
                                           * library caller that gives only the device copies */
} attn_problem;

/* The buffers a stage reads and writes, all owned by the harness. On a GPU stage they are
 * device pointers; q, k, v, o, d_o, dq, dk, dv hold elements of p->dtype; lse and delta are
 * always float. The harness fills every output with NaN before the stage runs. */
typedef struct {
  const void *q, *k, *v; /* [B,H,Nq,d], [B,Hkv,Nkv,d], [B,Hkv,Nkv,d] */
  void *o;               /* [B,H,Nq,d] */
  float *lse;            /* [B,H,Nq], natural log; written from stage 02 on */
  const void *d_o;       /* [B,H,Nq,d], the backward's incoming gradient */
  void *dq, *dk, *dv;    /* [B,H,Nq,d], [B,Hkv,Nkv,d], [B,Hkv,Nkv,d] */
  void *workspace;       /* the bytes the stage asked for through *_workspace() */
  /* p->cache_lens where the stage runs (B ints, uploaded before any pass is timed), or NULL
   * when p->cache_lens is NULL (the harness; a library caller may set this alone, see
   * attn_problem.cache_lens). Keys past L_b hold NaN: a stage that reads one into a result
   * fails the check. */
  const int *cache_lens;
  /* p->cu_seqlens_q and p->cu_seqlens_k where the stage runs (seqs + 1 ints each, uploaded
   * before any pass is timed, like cache_lens), or NULL without varlen. */
  const int *cu_seqlens_q, *cu_seqlens_k;
} attn_buffers;

typedef size_t (*attn_workspace_fn)(const attn_problem *p);
typedef void (*attn_pass_fn)(const attn_problem *p, const attn_buffers *t);

/* Where a stage runs: the host (common/host_device.c) or a CUDA GPU (common/gpu.cu). */
typedef struct attn_device attn_device;

typedef struct {
  const char *name; /* "02_online_softmax" */
  const char *idea; /* the idea it adds, in a phrase */
  const attn_device *device;
  int head_dims[8]; /* supported head dims, 0-terminated; all zero means any d >= 1 */
  unsigned dtypes;  /* DTYPE_BIT mask; 0 means fp32 only */
  int has_causal;   /* 0: --causal is rejected and names the stage that adds it */
  int saves_lse;    /* 1 from stage 02 on */
  attn_workspace_fn forward_workspace;
  attn_pass_fn forward;
  attn_workspace_fn backward_workspace; /* NULL before stage 06 */
  attn_pass_fn backward;
  int has_gqa;        /* 0: --heads-kv other than H is rejected (GQA comes in 11_split_kv_decode) */
  int has_cache_lens; /* 0: --cache-lens is rejected (the KV cache comes in 11_split_kv_decode) */
  int has_gqa_backward; /* 0: --backward with GQA is rejected (it comes in 12_hopper_backward) */
  int has_layouts;      /* 0: --layout bshd is rejected (it comes in 09_swizzle_pipeline) */
  /* 0: --window, --softcap, --seqlens are rejected (they come in 13_window_softcap_varlen) */
  int has_window, has_softcap, has_varlen;
} attn_stage;

int attention_main(const attn_stage *stage, int argc, char **argv);

extern const attn_device attn_host_device; /* common/host_device.c */
extern const attn_device attn_cuda_device; /* common/gpu.cu (GPU stages only) */

/* ---- shapes and indexing ------------------------------------------------------------ */

/* Hkv: p->heads_kv, or H where it is 0 (an initialiser written before GQA existed). */
static inline int attn_heads_kv(const attn_problem *p) {
  return p->heads_kv > 0 ? p->heads_kv : p->heads;
}
/* Query heads per K/V head: G = H / Hkv. */
static inline int attn_group(const attn_problem *p) { return p->heads / attn_heads_kv(p); }
static inline size_t attn_q_elems(const attn_problem *p) {
  return (size_t)p->batch * p->heads * p->seq_q * p->head_dim;
}
static inline size_t attn_kv_elems(const attn_problem *p) {
  return (size_t)p->batch * attn_heads_kv(p) * p->seq_kv * p->head_dim;
}
static inline size_t attn_lse_elems(const attn_problem *p) {
  return (size_t)p->batch * p->heads * p->seq_q;
}
/* Where query head bh (= b * H + h) starts in a query-side tensor, in elements. */
static inline size_t attn_q_head(const attn_problem *p, long bh) {
  return (size_t)bh * p->seq_q * p->head_dim;
}
/* Where the K/V head that query head bh reads starts in a key-side tensor: head
 * b * Hkv + h / G, which is bh / G (b * H / G = b * Hkv). */
static inline size_t attn_kv_head(const attn_problem *p, long bh) {
  return (size_t)(bh / attn_group(p)) * p->seq_kv * p->head_dim;
}
/* Where a tensor's rows lie in memory: row i of head h of sequence b starts at element
 * b * batch + h * head + i * row, where head h is one of `heads` (H on the query side, Hkv on
 * the key side). The kernels take this, so that one kernel reads either layout in place. */
typedef struct {
  long batch, head, row;
  int heads;
} attn_strides;
static inline attn_strides attn_layout_strides(const attn_problem *p, int heads, int rows) {
  long d = p->head_dim;
  attn_strides s = {(long)heads * rows * d, (long)rows * d, d, heads}; /* [B, H, N, d] */
  if (p->layout == LAYOUT_BSHD) s.head = d, s.row = (long)heads * d;   /* [B, N, H, d] */
  return s;
}
/* Q, O, dO, dQ: H heads of Nq rows; K, V, dK, dV: Hkv heads of Nkv rows. */
static inline attn_strides attn_q_strides(const attn_problem *p) {
  return attn_layout_strides(p, p->heads, p->seq_q);
}
static inline attn_strides attn_kv_strides(const attn_problem *p) {
  return attn_layout_strides(p, attn_heads_kv(p), p->seq_kv);
}
/* The valid keys of sequence b: L_b, or Nkv without cache lengths. */
static inline int attn_cache_len(const attn_problem *p, long b) {
  return p->cache_lens ? p->cache_lens[b] : p->seq_kv;
}
/* The sequence of a varlen problem that packed query row i belongs to: the s with
 * cu_seqlens_q[s] <= i < cu_seqlens_q[s + 1] (host offsets). Binary search for the last
 * offset <= i, so that zero-length sequences (equal offsets) are stepped over. */
static inline int attn_varlen_sequence(const attn_problem *p, int i) {
  int lo = 0, hi = p->seqs; /* cu_seqlens_q[lo] <= i < cu_seqlens_q[hi] */
  while (hi - lo > 1) {
    int mid = lo + (hi - lo) / 2;
    if (p->cu_seqlens_q[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}
/* Keys [*lo, *hi) visible to query row i (0-based in the problem's rows: for varlen the packed
 * row) of batch b; *lo == *hi when the row sees none. Every mask is bottom-right aligned in
 * the query's own sequence of Nq queries and Nkv keys (Nkv: L_b with cache lengths; the
 * sequence's own lengths with varlen, its keys returned as packed indices), diag = i + Nkv - Nq:
 * key j is visible iff 0 <= j < Nkv and, causal, j <= diag and, windowed, diag - left <= j <=
 * diag + right (a side of -1 unbounded). Varlen reads the host offsets p->cu_seqlens_q and _k. */
static inline void attn_key_range(const attn_problem *p, long b, int i, int *lo, int *hi) {
  long base = 0, nq = p->seq_q, nkv = attn_cache_len(p, b), row = i;
  if (p->seqs > 0) {
    int s = attn_varlen_sequence(p, i);
    row = i - p->cu_seqlens_q[s];
    nq = p->cu_seqlens_q[s + 1] - p->cu_seqlens_q[s];
    base = p->cu_seqlens_k[s];
    nkv = p->cu_seqlens_k[s + 1] - base;
  }
  /* In long: diag - left and diag + right + 1 of int operands can leave int's range. */
  long diag = row + nkv - nq, first = 0, end = nkv;
  if (p->causal && diag + 1 < end) end = diag + 1;
  if (p->windowed && p->window_left >= 0 && diag - p->window_left > first)
    first = diag - p->window_left;
  if (p->windowed && p->window_right >= 0 && diag + p->window_right + 1 < end)
    end = diag + p->window_right + 1;
  if (end < first) end = first; /* first <= diag < Nkv, as row < Nq: the range stays in [0, Nkv] */
  *lo = (int)(base + first);
  *hi = (int)(base + end);
}
double attn_forward_flops(const attn_problem *p);
double attn_backward_flops(const attn_problem *p);
size_t attn_dtype_size(attn_dtype t);
const char *attn_dtype_name(attn_dtype t);
const char *attn_layout_name(attn_layout l); /* "bhnd" or "bshd" */

/* ---- the seeded generator (common/problem.c) ----------------------------------------- */

/* SplitMix64 (Steele, Lea, Flood 2014): a 64-bit counter through a fixed mixing function;
 * normal samples by Box-Muller. The same seed gives the same inputs on every machine. */
typedef struct {
  uint64_t state;
} attn_rng;
void attn_rng_seed(attn_rng *r, uint64_t seed);
double attn_rng_uniform(attn_rng *r); /* in (0, 1) */
double attn_rng_normal(attn_rng *r);  /* standard normal */

/* ---- half precision (common/half.c) --------------------------------------------------- */

/* Round-to-nearest-even conversions, NaN and infinity kept, so that the reference can see
 * exactly the inputs a half-precision stage sees. */
uint16_t attn_float_to_half_bits(float x, attn_dtype t);
float attn_half_bits_to_float(uint16_t h, attn_dtype t);
float attn_round_to_dtype(float x, attn_dtype t);

/* ---- small utilities ------------------------------------------------------------------ */

/* Print "stage: message" and attn_failure_note to stderr and exit with `code`; or, on a
 * thread that set a return point (attn_fail_return_to), keep the line for attn_last_failure
 * and longjmp there with `code`: a stage library's caller gets an error, not the end of its
 * process. */
#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 2, 3)))
#endif
void attn_fail(int code, const char *fmt, ...);
void attn_fail_return_to(jmp_buf *target);             /* NULL: exit again */
const char *attn_last_failure(void);                   /* this thread's last line kept, or "" */
int attn_last_failure_code(void);                      /* and its exit code (0 if none) */
void *attn_host_alloc(size_t bytes, const char *what); /* exits 2 when the host has no room */
/* Ends every failure line once the inputs exist: " (seed S)" for generated inputs, so that
 * any failing run, a CUDA error included, says how to repeat it; empty before, and for --load. */
enum { ATTN_FAILURE_NOTE_BYTES = 32 };
extern char attn_failure_note[ATTN_FAILURE_NOTE_BYTES];
/* Begins every failure line: the stage's name (runner.c and the stage libraries set it). */
extern const char *attn_program_name;

#ifdef __cplusplus
}
#endif

#endif /* ATTENTION_H */
