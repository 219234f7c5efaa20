/* Stage 11's forward: 09's with grouped-query attention and cache lengths, and the decode path
 * (split keys, merged by LSE) for problems with few query rows per K/V head. */
#pragma once

#include <limits.h>
#include <math.h>
#include <type_traits>

#include "../09_swizzle_pipeline/tiles.cuh"
#include "attention.h"
#include "gpu.h"

/* A warp's query rows in the forward, in fragments: two at every d (08: one at d <= 64), so
 * that each K and V operand loaded feeds two mma.sync (the README's A/B table). */
#ifndef ATTN_ROW_FRAGS
#define ATTN_ROW_FRAGS 2 /* at d <= 64; 1: 16 rows */
#endif
__host__ __device__ constexpr int row_frags(int d) { return d > 64 ? 2 : ATTN_ROW_FRAGS; }
/* Query rows per block: 128, so that each K and V tile copied into shared memory serves 128
 * rows (8 warps of 16 rows, or 4 of 32). */
constexpr int Br = 128;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small: 64
 * keys at d = 128, where O takes 128 registers and 128 keys spill 928 bytes; at d <= 64, 128
 * (FlashAttention-2's 128 x 128 tile, no spill; the README's A/B table). */
#ifndef ATTN_BC
#define ATTN_BC 128 /* at d <= 64; 64: 64 keys */
#endif
__host__ __device__ constexpr int bc_for(int d) { return d > 64 ? 64 : ATTN_BC; }
/* Keys per tile where the device cannot give a block tile_bytes(d, bc_for(d)) (96 KiB at d = 128,
 * which every GPU since sm_80 allows; 102 KiB with -DATTN_SWIZZLE=0): half the keys. */
constexpr int Bc_small = 32;
static_assert(Bc_small % MmaK == 0, "a tile of keys is whole k-steps of P V");
#ifndef ATTN_SPLIT_WAITS
#define ATTN_SPLIT_WAITS 1
#endif
static_assert(tile_bytes<__half>(128, Bc_small, Br) <= 99 * 1024,
              "the forward has a configuration within the 99 KiB of sm_86 and sm_89");

/* Element e of fragment f's accumulators is the lane's row h = 2 f + e / 2, the warp's row
 * g + 8 h. s, zeroed, accumulates S = Q K^T. Only a tile crossing the diagonal or the end of
 * the keys is masked (`masked`): past row h's first row_cols[h] keys, -inf.
 * m_blk[h] is row h's max over the tile and the quad. */
template <int D, int BC, int FRAGS = row_frags(D), typename T>
__device__ void compute_qk_scores_and_max(const T *Q, const unsigned (*q_frag)[4], const T *K,
                                          bool masked, const int *row_cols,
                                          float (*s)[BC / MmaN][4], float *m_blk) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    unsigned a[RowFrags][4];
    if (RowFrags > 1) /* a warp of one fragment (16 rows) keeps Q's operands in registers */
#pragma unroll
      for (int f = 0; f < RowFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Q, f * MmaM, kk * MmaK));
    mma_tile<D, false, BC, RowFrags>(s, RowFrags == 1 ? q_frag + kk : a, K, 0, kk * MmaK);
  }
  /* A compare and a select per element, which a branch skips on unmasked tiles at every d (08
   * predicates them at d = 128; in 09 that spills 16 bytes, and the branch is faster). */
  int t = threadIdx.x % Quad;
  if (masked)
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (n * MmaN + 2 * t + e % 2 >= row_cols[2 * f + e / 2]) s[f][n][e] = -INFINITY;
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_blk[h] = -INFINITY;
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) m_blk[2 * f + e / 2] = fmaxf(m_blk[2 * f + e / 2], s[f][n][e]);
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_blk[h] = max_over_quad(m_blk[h]);
}

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l
 * and the O accumulators) is rescaled by 2^((m - m') scale log2 e), row by row. */
template <int D, int FRAGS = row_frags(D)>
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
  float correction[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    float m_new = fmaxf(m[h], m_blk[h]);
    /* While a row has seen no key m' is still -inf, and 2^(-inf - -inf) would be NaN; there
     * is nothing to rescale then (l = 0, acc = 0). Otherwise 0 on the first visible tile. */
    correction[h] = m_new == -INFINITY ? 1.f : exp2_approx((m[h] - m_new) * scale_log2);
    l[h] *= correction[h];
    m[h] = m_new;
  }
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < D / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[f][n][e] *= correction[2 * f + e / 2];
}

/* p = 2^((s - m) scale log2(e)); l += p (the lane's columns: the quad's sums are added at the
 * end); acc += P V, two S accumulators per 16 keys an A operand. At d <= 64 the exponent is
 * one FFMA, s c - m c (c = scale log2 e) with m c rounded apart: the exponent moves by at most
 * 2^-14 while every row of the warp has |m c| < FoldLimit; past that (logits near 1e11, where
 * that rounding is 4096) the warp subtracts m first, exactly. Faster at d = 64 and slower at
 * d = 128 (09's A/B table), so 08's form there (everywhere with -DATTN_FFMA_FOLD=0). */
#ifndef ATTN_FFMA_FOLD
#define ATTN_FFMA_FOLD 1
#endif
constexpr float FoldLimit = 1024.f;
template <int D, int BC, int FRAGS = row_frags(D), typename T>
__device__ void compute_block_softmax_and_weighted_v(float (*s)[BC / MmaN][4], const T *V,
                                                     float scale_log2, const float *m, float *l,
                                                     float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
  constexpr bool Fold = ATTN_FFMA_FOLD && D <= 64;
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[LaneRows], mc[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];
  if constexpr (Fold) {
    bool near = true;
#pragma unroll
    for (int h = 0; h < LaneRows; h++) near = near && fabsf(m_use[h] * scale_log2) < FoldLimit;
    bool fold = __all_sync(0xffffffffu, near);
#pragma unroll
    for (int h = 0; h < LaneRows; h++) mc[h] = fold ? m_use[h] * scale_log2 : 0.f;
    if (!fold)
#pragma unroll
      for (int f = 0; f < RowFrags; f++)
#pragma unroll
        for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) s[f][n][e] -= m_use[2 * f + e / 2];
  }
#pragma unroll
  for (int kk = 0; kk < BC / MmaK; kk++) {
    unsigned p_frag[RowFrags][4];
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int half = 0; half < 2; half++) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = s[f][2 * kk + half][e];
          p[e] = exp2_approx(Fold ? fmaf(x, scale_log2, -mc[2 * f + e / 2])
                                  : (x - m_use[2 * f + e / 2]) * scale_log2);
          l[2 * f + e / 2] += p[e];
        }
        p_frag[f][2 * half] = pack2(p[0], p[1], T());     /* rows 0-7 */
        p_frag[f][2 * half + 1] = pack2(p[2], p[3], T()); /* rows 8-15 */
      }
    mma_tile<D, true, D, RowFrags>(acc, p_frag, V, kk * MmaK, 0);
  }
}

/* O = acc / l, LSE = m scale + ln l for the lane's rows (a row that saw no key: O = 0,
 * LSE = -inf), after adding up the quad's partial sums of l. */
template <int D, typename T>
__device__ void normalize_output(const float (*acc)[D / MmaN][4], const float *m, float *l,
                                 float scale_log2, T *O, float *LSE, int rows, long ld) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  float inv_l[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    l[h] = sum_over_quad(l[h]);
    inv_l[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    int r = threadIdx.x % 32 / Quad + 8 * h;
    if (threadIdx.x % Quad == 0 && r < rows)
      LSE[r] = l[h] > 0.f ? (m[h] * scale_log2 + log2f(l[h])) * Ln2 : -INFINITY;
  }
  store_tile<D, RowFrags>(acc, inv_l, O, rows, ld);
}

template <int D, int BC, bool GROUPED, typename T>
__global__ void __launch_bounds__(threads_for(Br, row_frags(D)), 2)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         const int *__restrict__ cache_lens, T *__restrict__ o,
                         float *__restrict__ lse, attn_strides qs, attn_strides kvs, int nq,
                         int nkv, int heads, int seq_heads, int group, float scale, int causal) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  constexpr int Threads = threads_for(Br, RowFrags);
  /* K and V buffers of BC rows each, then Q: every tile starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * BC * padded<T>(D)), "tile alignment");
  extern __shared__ __align__(SharedAlignment) float4 smem[]; /* cp.async, ldmatrix: 16 bytes */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * BC * padded<T>(D);
  T *Qs = Vs + 2 * BC * padded<T>(D); /* K and V double-buffered, then the Q tile */
  /* Causal blocks have unequal work: row block r does about r + 1 times row block 0's. Ordered by
   * row block across all heads, every head's heaviest block starts first and the light ones
   * fill the tail (ordered per head, the heavy blocks of the last heads would start last).
   * Non-causal blocks are equal, so a head's blocks stay adjacent and share its K and V in
   * L2. (05's README measures both orders.) */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* A thread past the last row still helps load tiles and meets every barrier. */
  /* The warp's rows start at row0; this lane holds rows i + 8 h. */
  int row0 = i0 + threadIdx.x / 32 * RowFrags * MmaM, i = row0 + threadIdx.x % 32 / Quad;
  /* Query head bh reads K/V head bh / G (b H / G = b Hkv), of Nkv rows (the cache's
   * capacity); sequence b = bh / H holds `len` valid keys. Not GROUPED (G = 1, no
   * cache lengths), head bh and Nkv keys, as in 09: held in registers, the quotient and `len`
   * cost the d = 64 tile loop 62 more instructions (IMAD) and 20 bytes of spill. */
  const long kv_head = GROUPED ? bh / group : bh;
  const T *K = k + row_start(kvs, kv_head, 0), *V = v + row_start(kvs, kv_head, 0);
  int len = GROUPED ? cache_len(cache_lens, bh / seq_heads, nkv) : nkv;
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4]; /* 16-row warps: Q in registers */
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m[h] = -INFINITY, l[h] = 0.f;
  load_tile<D, Br, Threads>(q + row_start(qs, bh, i0), min(Br, nq - i0), Qs, qs.row);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Br * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = len - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(len, last_row + offset + 1)) : len;
  /* K(t) and V(t) in copy groups of their own (Q joins K(0)'s), so that each product waits
   * only for its operand. -DATTN_SPLIT_WAITS=0 waits for both at a tile's top, as 08 does. */
  constexpr bool split = ATTN_SPLIT_WAITS;
  if (kv_end > 0) load_tile<D, BC, Threads>(K, min(BC, len), Ks, kvs.row);
  __pipeline_commit();
  if (kv_end > 0) load_tile<D, BC, Threads>(V, min(BC, len), Vs, kvs.row);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += BC, buf ^= 1) {
    int cols = min(BC, len - j0), next = j0 + BC;
    T *Kn = Ks + (buf ^ 1) * BC * padded<T>(D), *Vn = Vs + (buf ^ 1) * BC * padded<T>(D);
    if (next < kv_end)
      load_tile<D, BC, Threads>(K + next * kvs.row, min(BC, len - next), Kn, kvs.row);
    if (!split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, len - next), Vn, kvs.row);
    __pipeline_commit();
    /* K(t) has landed (and, not split, V(t)); V(t) and K(t + 1) may still be in flight */
    __pipeline_wait_prior(split ? 2 : 1);
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR, split: every
                      * warp is done with P V(t - 1), so V(t + 1) may overwrite its buffer */
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    int row_cols[LaneRows]; /* on a diagonal tile, row i + 8 h sees 8 h keys more than row i */
#pragma unroll
    for (int h = 0; h < LaneRows; h++)
      row_cols[h] = diagonal ? min(cols, i + offset + 1 - j0 + 8 * h) : cols;
    const T *Kt = Ks + buf * BC * padded<T>(D), *Vt = Vs + buf * BC * padded<T>(D);
    float s[RowFrags][BC / MmaN][4] = {};
    if (RowFrags == 1 && j0 == 0) /* Q has landed: its operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++)
        ldmatrix_x4(q_frag[kk], a_operand<D>(Qs, row0 - i0, kk * MmaK));
    compute_qk_scores_and_max<D, BC>(Qw, q_frag, Kt, diagonal || cols < BC, row_cols, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, acc);
    if (split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, len - next), Vn, kvs.row);
    __pipeline_commit();
    __pipeline_wait_prior(2); /* V(t) has landed; K(t + 1) and V(t + 1) may still be in flight */
    __syncthreads();          /* RAW: V(t) is in shared memory; WAR: every warp is done with
                               * S = Q K(t)^T, so K(t + 2) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, BC>(s, Vt, scale_log2, m, l, acc);
    if (!split) __syncthreads(); /* WAR: every warp is done with V(t) before V(t + 2) */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + row_start(qs, bh, row0), lse + bh * nq + row0,
                      nq - row0, qs.row);
}

#include "decode.cuh"

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half, int BC = bc_for(D)>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  if (decode_shaped(p, D))
    return decode_deep<D, T>() ? launch_decode<D, DecodeStages, T>(p, t)
                               : launch_decode<D, 2, T>(p, t);
  size_t bytes = tile_bytes<T>(D, BC, Br);
  if (BC > Bc_small && bytes > attn_shared_memory_limit()) return launch<D, T, Bc_small>(p, t);
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  bool grouped = attn_group(p) > 1 || t->cache_lens;
  auto kernel =
      grouped ? flash_forward_kernel<D, BC, true, T> : flash_forward_kernel<D, BC, false, T>;
  attn_require_shared_memory((const void *)kernel, bytes, "flash_forward_kernel");
  kernel<<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, (T *)t->o, t->lse,
      attn_q_strides(p), attn_kv_strides(p), p->seq_q, p->seq_kv, heads, p->heads, attn_group(p),
      p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}

/* The decode path's partials; 09's path needs none. */
template <int D, typename T = __half>
static size_t workspace(const attn_problem *p) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return workspace<D, __nv_bfloat16>(p);
  return decode_shaped(p, D) ? decode_workspace(p, plan_decode<D, T>(p)) : 0;
}

static size_t forward_workspace(const attn_problem *p) {
  switch (p->head_dim) {
    case 32: return workspace<32>(p);
    case 64: return workspace<64>(p);
    case 128: return workspace<128>(p);
  }
  return 0;
}
