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

#include <float.h>
#include <limits.h>

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
  /* The query rows that see some key of [j0, j1) lie in [first_row, end_row): first_row is at
   * least 0, end_row at most nq (first_row >= end_row: none). */
  __device__ int first_row(int j0) const {
    return right < 0 ? 0 : (int)max(0L, (long)j0 - offset - right);
  }
  __device__ int end_row(int j1, int nq) const {
    return left < 0 ? nq : (int)min((long)nq, max(0L, (long)j1 - 1 - offset + left + 1));
  }
};

/* The element test of a masked tile from j - i alone: for 0 <= i < nq and 0 <= j < nkv, key
 * j lies in [begin(i), end(i)) iff j - i lies in [lo, hi], the window's two diagonals
 * relative to the sequence's (clamped into int: past it, that side bounds nothing). A
 * subtraction and two compares an element, where begin and end each clamp in 64 bits. */
struct key_band {
  int lo, hi;
  __device__ bool sees(int i, int j) const { return j - i >= lo && j - i <= hi; }
};
__device__ inline key_band band_of(const visible_keys &v) {
  long lo = v.left < 0 ? (long)INT_MIN : (long)v.offset - v.left;
  long hi = v.right < 0 ? (long)INT_MAX : (long)v.offset + v.right;
  return {(int)max((long)INT_MIN, lo), (int)min((long)INT_MAX, hi)};
}

/* Where a sequence's rows are: the packed problem's row of its first query and key, and its
 * lengths. Without varlen every (batch, head) pair is a sequence of all Nq and Nkv rows. */
struct sequence_rows {
  int q_first, k_first, nq, nkv;
};
__device__ inline sequence_rows sequence_of(const int *cu_q, const int *cu_k, int s, int nq,
                                            int nkv) {
  if (!cu_q) return {0, 0, nq, nkv};
  /* Offsets from a library caller are device memory no host check has seen: clamped into
   * the packed rows, as stage 11 clamps its cache lengths, a bad one reads nothing outside. */
  int q0 = min(max(cu_q[s], 0), nq), q1 = min(max(cu_q[s + 1], q0), nq);
  int k0 = min(max(cu_k[s], 0), nkv), k1 = min(max(cu_k[s + 1], k0), nkv);
  return {q0, k0, q1 - q0, k1 - k0};
}

/* The longest sequence's rows, which size the grid: from the host offsets where they are
 * given; otherwise the problem's field where it lies in 1..total, else the total (the grid
 * then covers every row, and the blocks past a sequence's end return at once). */
static inline int longest_sequence(const int *cu, int seqs, int given, int total) {
  if (cu) {
    int most = 0;
    for (int s = 0; s < seqs; s++) most = cu[s + 1] - cu[s] > most ? cu[s + 1] - cu[s] : most;
    return most;
  }
  return given > 0 && given <= total ? given : total;
}

/* Blocks of a grid of `pairs` (sequence, head) pairs of `tiles` tiles each, refused past
 * what one launch takes (a long sequence packed with many short ones multiplies the two). */
static inline unsigned grid_blocks(long tiles, long pairs, const char *kernel) {
  long blocks = tiles * pairs;
  if (blocks > INT_MAX)
    attn_fail(EXIT_BAD_USAGE,
              "%s would need %ld blocks (%ld tiles of the longest sequence for each of %ld "
              "sequence and head pairs), past a launch's %d",
              kernel, blocks, tiles, pairs, INT_MAX);
  return (unsigned)blocks;
}

/* The window as the kernels take it (visible_keys.left, right): causal is the window's right
 * side at 0 (FlashAttention's rule for causal with a window). */
static inline int window_left(const attn_problem *p) { return p->windowed ? p->window_left : -1; }
static inline int window_right(const attn_problem *p) {
  return p->causal ? 0 : p->windowed ? p->window_right : -1;
}

/* 1 / x in one MUFU.RCP, within an ulp; 1 / inf = 0. __frcp_rn's correctly rounded result
 * costs refinement instructions and a branch to a slow path on every call, and in the
 * forward's softcap, which runs on every score, that was half the kernel's time (README). */
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
/* The softcap's tanh from one exp2 and one reciprocal, where tanhf takes tens of
 * instructions. k is 2 log2(e) scale / c (softcap_exponent), so that tanh(x scale / c) =
 * 1 - 2 / (2^(k x) + 1) with one multiply a score; an infinite 2^(k x) gives 1 and 0 gives
 * -1. k is kept finite, so that a tiny cap cannot make inf * 0 of a zero score (padded rows
 * are zeros). The absolute error, near 1e-7, is a logit error near 1e-7 c: inside fp16's
 * rounding of P for caps up to about 1e3 (Gemma's are 30 and 50). tanh.approx would be one
 * instruction, but its relative error of 2^-11 is a logit error of 0.025 at c = 50. */
__host__ __device__ inline float softcap_exponent(float scale, float cap) {
  float k = cap > 0.f ? 2.f * Log2e * scale / cap : 0.f;
  return isfinite(k) ? k : copysignf(FLT_MAX, k);
}
__device__ __forceinline__ float softcap_tanh(float x, float k) {
  return 1.f - 2.f * rcp_approx(exp2_approx(k * x) + 1.f);
}
/* The backward's tanh and its slope 1 - tanh^2 (the derivative of the capped logit by the raw
 * one, times the scale, which the passes apply after), from e = 2^(-|k x|) in [0, 1]:
 * tanh = sign(x k) (1 - e) / (1 + e) and 1 - tanh^2 = 4 e / (1 + e)^2, which does not cancel
 * where |x k| is large (1 - t*t would: at tanh's argument 8 it is 6% off, at 9 twice the
 * value, past 9.01 zero) and is never NaN, so that a masked element's 0 stays 0. */
struct softcap_t {
  float t, slope;
};
__device__ __forceinline__ softcap_t softcap_tanh_and_slope(float x, float k) {
  float y = k * x, e = exp2_approx(-fabsf(y)), r = rcp_approx(1.f + e);
  return {copysignf((1.f - e) * r, y), 4.f * e * r * r};
}
