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
                                 float scale_log2, T *O, float *LSE, int rows) {
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
  store_tile<D, RowFrags>(acc, inv_l, O, rows);
}

template <int D, int BC, bool GROUPED, typename T>
__global__ void __launch_bounds__(threads_for(Br, row_frags(D)), 2)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         const int *__restrict__ cache_lens, T *__restrict__ o,
                         float *__restrict__ lse, int nq, int nkv, int heads, int seq_heads,
                         int group, float scale, int causal) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  constexpr int Threads = threads_for(Br, RowFrags);
  extern __shared__ __align__(256) float4 smem[]; /* cp.async and ldmatrix move 16 bytes */
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
  /* Query head bh reads K/V head bh / G (b H / G = b Hkv), whose rows are Nkv apart (the
   * cache's capacity); sequence b = bh / H holds `len` valid keys. Not GROUPED (G = 1, no
   * cache lengths), head bh and Nkv keys, as in 09: held in registers, the quotient and `len`
   * cost the d = 64 tile loop 62 more instructions (IMAD) and 20 bytes of spill. */
  const long kv_head = GROUPED ? bh / group : bh;
  const T *K = k + kv_head * nkv * D, *V = v + kv_head * nkv * D;
  int len = GROUPED && cache_lens ? cache_lens[bh / seq_heads] : nkv;
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4]; /* 16-row warps: Q in registers */
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m[h] = -INFINITY, l[h] = 0.f;
  load_tile<D, Br, Threads>(q + (bh * nq + i0) * D, min(Br, nq - i0), Qs);
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
  if (kv_end > 0) load_tile<D, BC, Threads>(K, min(BC, len), Ks);
  __pipeline_commit();
  if (kv_end > 0) load_tile<D, BC, Threads>(V, min(BC, len), Vs);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += BC, buf ^= 1) {
    int cols = min(BC, len - j0), next = j0 + BC;
    T *Kn = Ks + (buf ^ 1) * BC * padded<T>(D), *Vn = Vs + (buf ^ 1) * BC * padded<T>(D);
    if (next < kv_end) load_tile<D, BC, Threads>(K + (long)next * D, min(BC, len - next), Kn);
    if (!split && next < kv_end)
      load_tile<D, BC, Threads>(V + (long)next * D, min(BC, len - next), Vn);
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
      load_tile<D, BC, Threads>(V + (long)next * D, min(BC, len - next), Vn);
    __pipeline_commit();
    __pipeline_wait_prior(2); /* V(t) has landed; K(t + 1) and V(t + 1) may still be in flight */
    __syncthreads();          /* RAW: V(t) is in shared memory; WAR: every warp is done with
                               * S = Q K(t)^T, so K(t + 2) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, BC>(s, Vt, scale_log2, m, l, acc);
    if (!split) __syncthreads(); /* WAR: every warp is done with V(t) before V(t + 2) */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + (bh * nq + row0) * D, lse + bh * nq + row0,
                      nq - row0);
}

/* ---- the decode path ------------------------------------------------------------------ */

/* Decode: each sequence brings a few new queries (Nq; 1 for a model generating a token at a
 * time) against a cache of L_b keys. The grid above has a block per 128 query rows of one
 * head, B x H blocks in all (32 at B = 1, H = 32 on an H100's 132 SMs), each reading its
 * head's K and V alone, and the work is reading K and V, not multiplying. So the decode path
 * splits the other way (FlashDecoding):
 *   - a block per (sequence, K/V head, chunk of keys): each K/V head's L_b keys are cut into
 *     chunks of chunk_keys, and the chunks of every head run at once;
 *   - a block takes every query row that reads its K/V head: the G = H / Hkv query heads of
 *     the group, Nq rows each, G Nq rows in all (contiguous in Q: heads G kvh .. G kvh + G - 1
 *     of the sequence), padded to one row fragment (16 rows) where they fit it, else to 09's
 *     two (32 rows, d = 128 only). So each element of K and V crosses from memory once,
 *     whatever G is;
 *   - the block's warps share each tile's keys, 16 each (09's share its rows; here there are
 *     too few rows to share), each keeping its own running max, sum and O, which 09's
 *     helpers update, told the block's row fragments; at the end they are merged into the
 *     chunk's partial O (fp32, normalised) and LSE, written to the workspace;
 *   - merge_chunks_kernel combines a row's chunks by their LSE, stage 02's merge of partial
 *     softmaxes, in a fixed order: no atomics, every run of a problem gives the same bits (a
 *     sequence alone and in a batch, only in the batch-invariant mode: see plan_chunks).
 * The rule: a problem takes this path when one block's rows hold its group's G Nq query rows
 * (G Nq <= decode_rows(d): 16 at d <= 64, 32 at d = 128), so that K and V are read once;
 * any other problem takes 09's path above, which has GQA and cache lengths too. */
/* The most rows a decode block takes. A group of up to 16 rows takes one fragment at every d:
 * at d = 128 one instead of two halves the products of the decode benchmark's 4 query rows
 * and takes the kernel from 214 registers to 162, faster at short caches and never slower
 * beyond the spread of repeats (docs/techniques.md). At most one fragment at
 * d <= 64, two at d = 128: 09's rows a warp when this path and its rule were measured. (09's
 * d <= 64 warps have had two since; a 32-row decode block at d <= 64, which would take groups
 * of 17 to 32 rows off 09's path, has not been measured.) */
__host__ __device__ constexpr int decode_frags(int d) { return d > 64 ? 2 : 1; }
__host__ __device__ constexpr int decode_rows(int d) { return decode_frags(d) * MmaM; }
/* Warps per decode block: 4, as a d = 128 block of 09 (two blocks an SM at 255 registers a
 * thread), each taking 16 keys of a tile, one k-step of P V; so a tile has 64 keys (09's at
 * d = 128), and a d = 128 block's K and V tiles move 32 KiB per tile, 8 copies of 16 bytes a
 * thread. */
constexpr int DecodeWarps = 4, DecodeThreads = DecodeWarps * 32, DecodeKeys = DecodeWarps * MmaK;
/* Stages of the decode block's ring of K and V tiles: 2, as 09. A decode block has no
 * arithmetic to hide its loads behind, only more loads, so a deeper ring looked promising, but
 * 3 and 4 stages gained nothing at the decode benchmark's shapes (docs/techniques.md): two
 * tiles of K and V in flight already keep an SM's share of the bandwidth busy.
 * -DATTN_DECODE_STAGES=3 or 4 for the alternatives, which fall back to 2 where their ring does not
 * fit the shared memory. */
#ifndef ATTN_DECODE_STAGES
#define ATTN_DECODE_STAGES 2
#endif
constexpr int DecodeStages = ATTN_DECODE_STAGES;
static_assert(DecodeStages >= 2, "a ring of at least two tiles");
/* A decode block's shared memory: its ring of K and V tiles and its query rows. */
template <typename T>
__host__ __device__ constexpr size_t decode_bytes(int d, int stages) {
  return sizeof(T) * (2 * (size_t)stages * DecodeKeys + decode_rows(d)) * padded<T>(d);
}
/* The chunk rule. A decode grid should give every SM one block (a block streams as fast as
 * an SM pulls bytes: a second one an SM adds no bandwidth, only blocks with fixed costs and
 * partials to merge), in whole waves (a partial wave is a tail), and a chunk should be long
 * enough that a block's fixed costs (loading Q, waiting for its first tiles, merging its
 * warps, writing its partial) stay small beside the tiles it streams: at least MinChunkKeys
 * keys. So
 *   chunks = min(floor(DecodeBlocksPerSm x SMs / (B Hkv)), floor(Lmax / MinChunkKeys)),
 *            at least 1;  chunk_keys = ceil(Lmax / chunks) rounded up to whole tiles,
 * Lmax the longest cache. The README's chunk sweep (chunk lengths forced with
 * ATTN_DECODE_CHUNK_KEYS) finds the rule's pick the fastest or within a few percent of it;
 * two blocks an SM (-DATTN_DECODE_BLOCKS_PER_SM=2) and four waves of chunks of at least 128
 * keys were slower.
 * On an H100: B = 1 gets 128 keys a chunk at L = 1k, 2048 at 32k, 8192 at 128k (16 chunks);
 * B = 8 two chunks; B = 32 one, whose blocks write O and LSE themselves.
 * ATTN_DECODE_CHUNK_KEYS=N (a multiple of 64) sets chunk_keys instead, for the tests and for
 * measuring the rule. */
#ifndef ATTN_DECODE_BLOCKS_PER_SM
#define ATTN_DECODE_BLOCKS_PER_SM 1
#endif
constexpr int DecodeBlocksPerSm = ATTN_DECODE_BLOCKS_PER_SM, MinChunkKeys = 2 * DecodeKeys;

/* Batch invariance (ATTN_DECODE_BATCH_INVARIANT=1). The rule reads the SM count, B Hkv and
 * Lmax, so a sequence's chunks, and with them the order in which its keys' sums are added,
 * depend on the batch it is decoded in: alone and inside a batch, its O and LSE may differ in
 * their last bits (both within the fp16 rule). Serving systems ask for the same bits whatever
 * else shares the batch. In the mode, sequence b's O and LSE are a function of its own Q, K,
 * V and L_b (and of H, Hkv, Nq, d, the dtype, the scale and causal) alone:
 *   - chunks of BatchInvariantChunkKeys keys, whatever the batch and the GPU
 *     (ATTN_DECODE_CHUNK_KEYS, as fixed, still sets another length);
 *   - the merge always runs, also where every sequence has one chunk: a sequence of one
 *     chunk then takes one path (its partial, then the merge) whether the batch's longest
 *     cache has one chunk or many, instead of the decode block writing O itself in one case
 *     and the merge in the other;
 *   - the rest does not depend on the batch already: a decode block's rows are the G Nq query
 *     rows of its K/V head, its keys start at c chunk_keys, the merge takes a row's
 *     ceil(L_b / chunk_keys) chunks in an order set by that count and by d (its Ways), and the
 *     grid's count of chunks, ceil(Lmax / chunk_keys), only places the partials in the
 *     workspace (a chunk past L_b writes nothing, and nothing reads it).
 * 09's path (G Nq past decode_rows) is batch-invariant without the mode: a block for 128 query
 * rows of one head streams that head's cache from key 0 to its end, whatever the grid.
 * The length: 1024 keys, from the chunk sweep (the README). Long enough that a chunk streams
 * efficiently (shorter chunks pay a block's fixed costs over fewer tiles), short enough that
 * B = 1 still gives about every SM of an H100 or H200 (132) a block from L = 16k on
 * (B Hkv L / 1024 = 128 blocks there), where 2048 keys leave at least half of them idle below
 * 32k. The price falls on B = 1 with short caches, which the rule splits finer, and on
 * batches of one chunk a sequence, which gain the merge. */
constexpr int BatchInvariantChunkKeys = 16 * DecodeKeys;
static_assert(BatchInvariantChunkKeys % DecodeKeys == 0, "a chunk is whole tiles");

/* merge: whether merge_chunks_kernel follows, the decode blocks writing partials; without it
 * (one chunk a sequence, outside the batch-invariant mode) they write O and LSE themselves. */
struct decode_plan {
  int chunk_keys, chunks;
  bool merge;
};

/* The chunk rule above on a GPU of `sms` SMs, or the batch-invariant mode's fixed chunks.
 * Plain host arithmetic, so that the workspace and the launch agree and a test can call it. */
static decode_plan plan_chunks(const attn_problem *p, long sms) {
  int lmax = 0;
  for (int b = 0; b < p->batch; b++) lmax = max(lmax, attn_cache_len(p, b));
  long pairs = (long)p->batch * attn_heads_kv(p);
  long chunks = DecodeBlocksPerSm * sms / pairs; /* whole waves: a partial one is a tail */
  chunks = max(1L, min(chunks, (long)(lmax / MinChunkKeys)));
  long keys = (lmax + chunks - 1) / chunks;
  keys = max((long)DecodeKeys, (keys + DecodeKeys - 1) / DecodeKeys * DecodeKeys);
  bool invariant = attn_decode_batch_invariant();
  if (invariant) keys = BatchInvariantChunkKeys;
  if (int forced = attn_decode_chunk_keys()) {
    if (forced % DecodeKeys != 0)
      attn_fail(EXIT_BAD_USAGE,
                "ATTN_DECODE_CHUNK_KEYS must be a multiple of %d (whole tiles), "
                "got %d",
                DecodeKeys, forced);
    keys = forced;
  }
  chunks = max(1L, (lmax + keys - 1) / keys);
  return {(int)keys, (int)chunks, invariant || chunks > 1};
}

/* The block's warps hold a running max m_w, sum l_w and unnormalised O_w for the same rows
 * over different keys; the chunk's partial is their merge (c = scale log2 e):
 *   M = max_w m_w,   L = sum_w l_w 2^((m_w - M) c),   O = sum_w O_w 2^((m_w - M) c) / L,
 * and its LSE in log2 units, M c + log2 L. A row that saw no key of the chunk (M = -inf) gets
 * O = 0 and LSE = -inf. Each warp leaves O_w, m_w and l_w in shared memory (`work`: the
 * tiles' memory, free now), then every thread combines 16-byte groups of the output, so that
 * the partial leaves in coalesced stores. (The fragment-layout stores, rows D floats apart,
 * meet 8-way bank conflicts: once a block, beside the tiles it streamed, they do not show.) */
__host__ __device__ constexpr size_t merge_bytes(int d) {
  return sizeof(float) * DecodeWarps * decode_rows(d) * (d + 2);
}
static_assert(merge_bytes(32) <= decode_bytes<__half>(32, 2) &&
                  merge_bytes(64) <= decode_bytes<__half>(64, 2) &&
                  merge_bytes(128) <= decode_bytes<__half>(128, 2),
              "the warps' merge fits in the shared memory of the tiles it replaces");
static_assert(decode_bytes<__half>(128, 2) <= 99 * 1024,
              "a decode block fits the 99 KiB of sm_86 and sm_89 (72 KiB at d = 128, 2 stages)");
template <int D, int FRAGS, typename T>
__device__ void merge_warps(const float (*acc)[D / MmaN][4], const float *m, float *l,
                            float scale_log2, float *work, float *part_o, float *part_lse, T *o,
                            float *lse, int rows) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  float *o_s = work, *m_s = o_s + DecodeWarps * Rows * D, *l_s = m_s + DecodeWarps * Rows;
  int w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    l[h] = sum_over_quad(l[h]); /* the lanes' partial sums, as in normalize_output */
    if (t == 0) m_s[w * Rows + g + 8 * h] = m[h], l_s[w * Rows + g + 8 * h] = l[h];
  }
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < D / MmaN; n++)
#pragma unroll
      for (int half = 0; half < 2; half++) /* rows g and g + 8 of the fragment */
        *reinterpret_cast<float2 *>(o_s + (w * Rows + f * MmaM + g + 8 * half) * D + n * MmaN +
                                    2 * t) =
            make_float2(acc[f][n][2 * half], acc[f][n][2 * half + 1]);
  __syncthreads(); /* RAW: every warp's O, max and sum are in shared memory */
  for (int e = threadIdx.x * 4; e < rows * D; e += DecodeThreads * 4) {
    int r = e / D;
    float mx = -INFINITY, sum = 0.f;
    float4 out = {0.f, 0.f, 0.f, 0.f};
    for (int x = 0; x < DecodeWarps; x++) mx = fmaxf(mx, m_s[x * Rows + r]);
    for (int x = 0; mx != -INFINITY && x < DecodeWarps; x++) {
      float f = exp2_approx((m_s[x * Rows + r] - mx) * scale_log2); /* 0 for a warp with no key */
      float4 o_w = *reinterpret_cast<const float4 *>(o_s + (x * Rows + r) * D + e % D);
      sum += f * l_s[x * Rows + r];
      out.x += f * o_w.x, out.y += f * o_w.y, out.z += f * o_w.z, out.w += f * o_w.w;
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f, row_lse = mx * scale_log2 + log2f(sum);
    out = make_float4(out.x * inv, out.y * inv, out.z * inv, out.w * inv);
    if (o) { /* the only chunk: the partial is the output */
      *reinterpret_cast<uint2 *>(o + e) =
          make_uint2(pack2(out.x, out.y, T()), pack2(out.z, out.w, T()));
      if (e % D == 0) lse[r] = sum > 0.f ? row_lse * Ln2 : -INFINITY;
    } else {
      *reinterpret_cast<float4 *>(part_o + e) = out;
      if (e % D == 0) part_lse[r] = sum > 0.f ? row_lse : -INFINITY;
    }
  }
}

/* Programmatic dependent launch (compute capability 9.0 on): the merge grid may be launched
 * while the decode grid runs, once every decode block has allowed it; its blocks then wait
 * until the decode grid has finished and its writes are visible. The merge's launch and its
 * first instructions overlap the decode instead of following it. Elsewhere both are no-ops
 * and the merge follows the decode as any kernel of the stream does. */
__device__ void allow_merge_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ void wait_for_decode() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* One block: chunk `blockIdx.x % chunks` of K/V head pair = blockIdx.x / chunks (b Hkv + K/V
 * head), so a head's chunks are adjacent. 09's forward loop, K and V in a ring of STAGES
 * tiles and waited for separately; warp w computes the tile's keys [16 w, 16 w + 16) for all
 * rows. */
template <int D, int FRAGS, int STAGES, typename T>
__global__ void __launch_bounds__(DecodeThreads, 2)
    flash_decode_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                        const int *__restrict__ cache_lens, float *__restrict__ part_o,
                        float *__restrict__ part_lse, T *__restrict__ o, float *__restrict__ lse,
                        int nq, int nkv, int heads_kv, int group, int chunk_keys, int chunks,
                        bool merge, float scale, int causal) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  constexpr int BC = DecodeKeys, ld = padded<T>(D);
  extern __shared__ __align__(256) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + STAGES * BC * ld, *Qs = Vs + STAGES * BC * ld;
  allow_merge_launch(); /* the merge waits for the whole grid anyway: let it launch now */
  long pair = blockIdx.x / chunks;
  int len = cache_lens ? cache_lens[pair / heads_kv] : nkv;
  int j_begin = (int)(blockIdx.x % chunks) * chunk_keys, j_end = min(len, j_begin + chunk_keys);
  if (j_begin >= len && merge) return; /* past the cache: the merge reads nothing of it */
  int rows = group * nq, w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad;
  const T *K = k + pair * nkv * D, *V = v + pair * nkv * D;
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4];
  /* Row g + 8 h of the block is query i = (g + 8 h) % Nq of head (g + 8 h) / Nq of the group:
   * it sees keys j < row_end[h] = len, or, causal, min(len, i + len - Nq + 1) (maybe <= 0). */
  int row_end[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    m[h] = -INFINITY, l[h] = 0.f;
    row_end[h] = causal ? min(len, (g + 8 * h) % nq + len - nq + 1) : len;
  }
  load_tile<D, Rows, DecodeThreads>(q + pair * rows * D, rows, Qs);
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Rows * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Tiles 0 .. STAGES - 2 in flight before the loop, K and V each a group of its own; an
   * empty group past the chunk's end keeps the count of groups that the waits rely on. */
  for (int s = 0; s < STAGES - 1; s++) {
    int j = j_begin + s * BC;
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(K + (long)j * D, min(BC, j_end - j), Ks + s * BC * ld);
    __pipeline_commit();
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(V + (long)j * D, min(BC, j_end - j), Vs + s * BC * ld);
    __pipeline_commit();
  }
  /* Groups committed after K(t) when it is waited for: V(t), K and V of the STAGES - 2 tiles
   * after it, and K(t + STAGES - 1); after V(t): K and V of the STAGES - 1 tiles after it. */
  constexpr int InFlight = 2 * STAGES - 2;
  for (int j0 = j_begin, buf = 0; j0 < j_end; j0 += BC, buf = (buf + 1) % STAGES) {
    int cols = min(BC, j_end - j0), next = j0 + (STAGES - 1) * BC;
    int nbuf = (buf + STAGES - 1) % STAGES; /* the buffer of tile t - 1, done with */
    T *Kn = Ks + nbuf * BC * ld, *Vn = Vs + nbuf * BC * ld;
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(K + (long)next * D, min(BC, j_end - next), Kn);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* K(t) has landed; V(t) and later tiles may be in flight */
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR: every warp is
                      * done with P V(t - 1), so V(t + STAGES - 1) may overwrite its buffer */
    /* The warp's keys start at jw; row h sees row_cols[h] of its 16 (the chunk ends, the cache
     * ends, or the causal limit falls inside them: masked). */
    int jw = j0 + w * MmaK, row_cols[LaneRows];
    bool masked = false;
#pragma unroll
    for (int h = 0; h < LaneRows; h++) {
      row_cols[h] = min(j0 + cols, row_end[h]) - jw;
      masked |= row_cols[h] < MmaK;
    }
    const T *Kt = Ks + (buf * BC + w * MmaK) * ld, *Vt = Vs + (buf * BC + w * MmaK) * ld;
    float s[RowFrags][MmaK / MmaN][4] = {};
    if (RowFrags == 1 && j0 == j_begin) /* Q has landed: its operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) ldmatrix_x4(q_frag[kk], a_operand<D>(Qs, 0, kk * MmaK));
    compute_qk_scores_and_max<D, MmaK, FRAGS>(Qs, q_frag, Kt, masked, row_cols, s, m_blk);
    merge_block_stats<D, FRAGS>(m_blk, scale_log2, m, l, acc);
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(V + (long)next * D, min(BC, j_end - next), Vn);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* V(t) has landed; later tiles may still be in flight */
    __syncthreads();                 /* RAW: V(t) is in shared memory; WAR: every warp is done with
                                      * S = Q K(t)^T, so K(t + STAGES) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, MmaK, FRAGS>(s, Vt, scale_log2, m, l, acc);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight: the tiles' memory is reused below */
  __syncthreads();          /* WAR: every warp is done with the last K and V tiles (and Q) */
  /* Without a merge (one chunk a sequence), the block's rows are the output's rows
   * (b H + h) Nq + i, from (b Hkv + K/V head) G Nq on. */
  long first = (long)blockIdx.x * rows;
  merge_warps<D, FRAGS>(acc, m, l, scale_log2, reinterpret_cast<float *>(smem),
                        merge ? part_o + first * D : nullptr, merge ? part_lse + first : nullptr,
                        merge ? nullptr : o + first * D, lse + first, rows);
}

/* Threads of a merge block, one block per output row: D / 4 groups of 4 columns (16 bytes of
 * each chunk's fp32 O), times MergeThreads / (D / 4) ways of splitting the chunks among them,
 * so that a row's chunks are read by all 128 threads at once. */
constexpr int MergeThreads = 128;
/* Chunks a merge thread loads before it merges them, all in flight at once: on an H100 a row
 * of the decode benchmark has at most 16 chunks, 4 for each of the 4 ways at d = 128, so one
 * batch (and 8 keeps the loads of a GPU with twice the SMs in one). */
constexpr int MergeBatch = 8;

/* A running merge of partials (stage 02's rule), in log2 units: m, the largest lse_c seen;
 * s = sum_c 2^(lse_c - m); a = sum_c 2^(lse_c - m) O_c (4 columns). The merge is a / s and its
 * LSE m + log2 s. */
struct merge_state {
  float m, s;
  float4 a;
};
__device__ void merge_into(merge_state &x, float m, float s, float4 a) {
  float top = fmaxf(x.m, m), base = top == -INFINITY ? 0.f : top; /* -inf: neither saw a key */
  float f = exp2_approx(x.m - base), g = exp2_approx(m - base);
  x.m = top, x.s = x.s * f + s * g;
  x.a = make_float4(x.a.x * f + a.x * g, x.a.y * f + a.y * g, x.a.z * f + a.z * g,
                    x.a.w * f + a.w * g);
}

/* Row (b H + h) Nq + i of the output from its chunks' partials (O_c normalised, lse_c in log2
 * units), stage 02's merge:
 *   LSE = log2 sum_c 2^lse_c,   O = sum_c 2^(lse_c - LSE) O_c,
 * each chunk weighted by its share of the row's whole exp-sum. Only the ceil(L_b / chunk_keys)
 * chunks that hold keys of the sequence were written. A thread merges the chunks c = way,
 * way + Ways, ... of its 4 columns as they arrive, MergeBatch loads in flight at once (a
 * first pass for the max would wait for L2 once more); the Ways merges are then merged in
 * order of way. A fixed order, set by n and D alone: every run gives the same bits, and a row
 * of the same n chunks merges the same way in any batch. */
template <int D, typename T>
__global__ void __launch_bounds__(MergeThreads)
    merge_chunks_kernel(const float *__restrict__ part_o, const float *__restrict__ part_lse,
                        const int *__restrict__ cache_lens, T *__restrict__ o,
                        float *__restrict__ lse, int nq, int nkv, int heads, int group,
                        int chunk_keys, int chunks) {
  constexpr int Groups = D / 4, Ways = MergeThreads / Groups;
  static_assert(MergeThreads % Groups == 0, "every thread has a group of columns");
  __shared__ merge_state merged[MergeThreads];
  long row = blockIdx.x, bh = row / nq;
  int rows = group * nq, r = (int)(bh % group) * nq + (int)(row % nq);
  int len = cache_lens ? cache_lens[bh / heads] : nkv, n = (len + chunk_keys - 1) / chunk_keys;
  /* The partial of chunk c is that of decode block (bh / G) chunks + c: rows apart. */
  const float *lse_c = part_lse + bh / group * chunks * rows + r;
  const float *o_c = part_o + (bh / group * chunks * rows + r) * D;
  int group4 = threadIdx.x % Groups, way = threadIdx.x / Groups;
  merge_state x = {-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
  wait_for_decode();
  for (int c0 = way; c0 < n; c0 += MergeBatch * Ways) {
    float lse_b[MergeBatch];
    float4 o_b[MergeBatch];
#pragma unroll
    for (int u = 0; u < MergeBatch; u++) { /* unpredicated loads, which issue together: */
      long c = min(c0 + u * Ways, n - 1);  /* past the last chunk, the last, weighted 0 */
      lse_b[u] = c0 + u * Ways < n ? lse_c[c * rows] : -INFINITY;
      o_b[u] = reinterpret_cast<const float4 *>(o_c + c * rows * D)[group4];
    }
#pragma unroll
    for (int u = 0; u < MergeBatch; u++) merge_into(x, lse_b[u], 1.f, o_b[u]);
  }
  merged[threadIdx.x] = x;
  __syncthreads(); /* RAW: every way's merge is in shared memory */
  if (way != 0) return;
  for (int w = 1; w < Ways; w++) {
    const merge_state &y = merged[w * Groups + group4];
    merge_into(x, y.m, y.s, y.a);
  }
  float inv = x.s > 0.f ? 1.f / x.s : 0.f; /* s = 0: the row saw no key, O = 0 */
  *reinterpret_cast<uint2 *>(o + row * D + group4 * 4) =
      make_uint2(pack2(x.a.x * inv, x.a.y * inv, T()), pack2(x.a.z * inv, x.a.w * inv, T()));
  if (threadIdx.x == 0) lse[row] = x.s > 0.f ? (x.m + log2f(x.s)) * Ln2 : -INFINITY;
}

/* The decode kernel this GPU runs: DecodeStages of K and V where they fit the shared memory,
 * else 2. */
template <int D, typename T>
static bool decode_deep() {
  return DecodeStages > 2 && decode_bytes<T>(D, DecodeStages) <= attn_shared_memory_limit();
}

/* The chunk plan on this GPU, after checking that the decode block fits its shared memory. */
template <int D, int STAGES, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  attn_require_shared_memory((const void *)flash_decode_kernel<D, decode_frags(D), STAGES, T>,
                             decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  int device, sms;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return plan_chunks(p, sms);
}
template <int D, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  return decode_deep<D, T>() ? plan_decode<D, DecodeStages, T>(p) : plan_decode<D, 2, T>(p);
}

/* The decode path's workspace: each chunk's partial O (G Nq rows of d floats) and LSE; none
 * without a merge. */
static size_t decode_workspace(const attn_problem *p, decode_plan plan) {
  if (!plan.merge) return 0; /* the decode kernel writes O itself */
  return sizeof(float) * (size_t)p->batch * attn_heads_kv(p) * plan.chunks * attn_group(p) *
         p->seq_q * (p->head_dim + 1);
}

template <int D, int STAGES, typename T, int FRAGS = decode_frags(D)>
static void launch_decode(const attn_problem *p, const attn_buffers *t) {
  /* A group of up to 16 rows takes one row fragment, also where 09 gives a warp two (d = 128):
   * half the products and registers (see decode_rows). */
  if (FRAGS > 1 && attn_group(p) * p->seq_q <= MmaM) return launch_decode<D, STAGES, T, 1>(p, t);
  decode_plan plan = plan_decode<D, STAGES, T>(p);
  if (FRAGS != decode_frags(D))
    attn_require_shared_memory((const void *)flash_decode_kernel<D, FRAGS, STAGES, T>,
                               decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  long pairs = (long)p->batch * attn_heads_kv(p), blocks = pairs * plan.chunks;
  int rows = attn_group(p) * p->seq_q;
  if (blocks > INT_MAX || (long)attn_lse_elems(p) > INT_MAX)
    attn_fail(EXIT_BAD_USAGE, "too many (sequence, K/V head, chunk) blocks for one grid: %ld",
              blocks);
  float *part_o = (float *)t->workspace, *part_lse = part_o + (size_t)blocks * rows * D;
  flash_decode_kernel<D, FRAGS, STAGES>
      <<<(unsigned)blocks, DecodeThreads, decode_bytes<T>(D, STAGES), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, part_o, part_lse,
          (T *)t->o, t->lse, p->seq_q, p->seq_kv, attn_heads_kv(p), attn_group(p), plan.chunk_keys,
          plan.chunks, plan.merge, p->scale, p->causal);
  CHECK_LAUNCH("flash_decode_kernel");
  if (!plan.merge) return; /* the decode blocks wrote O and LSE */
  /* The merge as a programmatic dependent launch where the GPU has it (see wait_for_decode). */
  int device, major;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaLaunchAttribute early = {};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)attn_lse_elems(p));
  config.blockDim = dim3(MergeThreads);
  config.stream = attn_stream();
  config.attrs = &early;
  config.numAttrs = major >= 9 ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, merge_chunks_kernel<D, T>, (const float *)part_o,
                                (const float *)part_lse, (const int *)t->cache_lens, (T *)t->o,
                                t->lse, p->seq_q, p->seq_kv, p->heads, attn_group(p),
                                plan.chunk_keys, plan.chunks));
  CHECK_LAUNCH("merge_chunks_kernel");
}

/* The decode path's rule (see its comment above): the group's query rows fill one block. */
static bool decode_shaped(const attn_problem *p, int d) {
  return (long)attn_group(p) * p->seq_q <= decode_rows(d);
}

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
  bool grouped = attn_group(p) > 1 || p->cache_lens;
  auto kernel =
      grouped ? flash_forward_kernel<D, BC, true, T> : flash_forward_kernel<D, BC, false, T>;
  attn_require_shared_memory((const void *)kernel, bytes, "flash_forward_kernel");
  kernel<<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, (T *)t->o, t->lse, p->seq_q,
      p->seq_kv, heads, p->heads, attn_group(p), p->scale, p->causal);
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
