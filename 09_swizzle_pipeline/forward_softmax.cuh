/* Stage 09's forward tiles and the online softmax's steps between its two products: merging
 * a tile's row maxima into m and l, P and P V, and O's normalisation. Stage 09's forward
 * includes them, and so does stage 13's, which changes only how S is made and masked. */
#pragma once

#include <math.h>

#include "tiles.cuh"

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
/* Keys per tile where bc_for(d) gives fewer blocks an SM (launch()): half the keys. */
constexpr int Bc_small = 32;
static_assert(Bc_small % MmaK == 0, "a tile of keys is whole k-steps of P V");
#ifndef ATTN_SPLIT_WAITS
#define ATTN_SPLIT_WAITS 1
#endif
static_assert(tile_bytes<__half>(128, Bc_small, Br) <= 99 * 1024,
              "the forward has a configuration within the 99 KiB of sm_86 and sm_89");

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l
 * and the O accumulators) is rescaled by 2^((m - m') scale log2 e), row by row. */
template <int D>
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
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
 * d = 128 (the README's A/B table), so 08's form there (everywhere with -DATTN_FFMA_FOLD=0). */
#ifndef ATTN_FFMA_FOLD
#define ATTN_FFMA_FOLD 1
#endif
constexpr float FoldLimit = 1024.f;
template <int D, int BC, typename T>
__device__ void compute_block_softmax_and_weighted_v(float (*s)[BC / MmaN][4], const T *V,
                                                     float scale_log2, const float *m, float *l,
                                                     float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
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

/* Blocks of the forward that share an SM: the registers of two 4-warp blocks (up to 255 a
 * thread), where the shared memory lets them (launch()). */
constexpr int ForwardBlocksPerSm = 2;
