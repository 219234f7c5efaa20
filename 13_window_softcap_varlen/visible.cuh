/* Which keys a query row sees, in one place for both passes (docs/conventions.md section 1).
 * Within its sequence, row i sees keys [begin(i), end(i)): causal, a sliding window or both
 * are the two bounds of that interval, and both bounds are non-decreasing in i. So a block of
 * consecutive rows sees keys from its first row's begin to its last row's end, and a tile
 * inside [begin(its last row), end(its first row)) needs no mask at all: 05's classification
 * of tiles, with a second edge. */
#pragma once

#include "../09_swizzle_pipeline/tiles.cuh"
#include "attention.h"
#include "gpu.h"

struct visible_keys {
  int offset;      /* Nkv - Nq of the sequence: query i's diagonal key is i + offset */
  int left, right; /* keys a row sees before and after its diagonal key; -1: no bound (causal
                    * is right = 0) */
  int nkv;         /* the sequence's keys */
  /* In 64 bits: i + offset - left may pass int's range on the way to its clamp. */
  __device__ int begin(int i) const {
    return left < 0 ? 0 : (int)min((long)nkv, max(0L, (long)i + offset - left));
  }
  __device__ int end(int i) const {
    return right < 0 ? nkv : (int)min((long)nkv, max(0L, (long)i + offset + right + 1));
  }
  /* The query rows that see some key of [j0, j1): [first_row, end_row), clamped to [0, nq). */
  __device__ int first_row(int j0) const {
    return right < 0 ? 0 : (int)max(0L, (long)j0 - offset - right);
  }
  __device__ int end_row(int j1, int nq) const {
    return left < 0 ? nq : (int)min((long)nq, max(0L, (long)j1 - 1 - offset + left + 1));
  }
};

/* Where a sequence's rows are: the packed problem's row of its first query and key, and its
 * lengths. Without varlen every (batch, head) pair is a sequence of all Nq and Nkv rows. */
struct sequence_rows {
  int q_first, k_first, nq, nkv;
};
__device__ inline sequence_rows sequence_of(const int *cu_q, const int *cu_k, int s, int nq,
                                            int nkv) {
  if (!cu_q) return {0, 0, nq, nkv};
  return {cu_q[s], cu_k[s], cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]};
}

/* The window as the kernels take it (visible_keys.left, right): causal is the window's right
 * side at 0 (FlashAttention's rule for causal with a window). */
static inline int window_left(const attn_problem *p) { return p->windowed ? p->window_left : -1; }
static inline int window_right(const attn_problem *p) {
  return p->causal ? 0 : p->windowed ? p->window_right : -1;
}

/* tanh(x inv_cap) as 1 - 2 / (e^{2 x inv_cap} + 1): an exp2 and a reciprocal, where tanhf
 * takes tens of instructions; e^{..} = inf gives 1 and 0 gives -1, so no input makes NaN.
 * Absolute error near 1e-7, well inside the fp32 logits' own rounding. The capped logit is
 * cap times this; its derivative by the raw logit, 1 - tanh^2 (times the scale, which the
 * passes apply after). */
__device__ __forceinline__ float softcap_tanh(float x, float inv_cap) {
  float e = exp2_approx(2.f * Log2e * inv_cap * x);
  return 1.f - 2.f * __frcp_rn(e + 1.f);
}
