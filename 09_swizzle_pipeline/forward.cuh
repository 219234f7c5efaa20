/* Stage 09's forward: 08's, with K and V waited for separately and 32-row warps at d <= 64. */
#pragma once

#include <math.h>
#include <type_traits>

#include "attention.h"
#include "forward_softmax.cuh"
#include "gpu.h"
#include "tiles.cuh"

/* Element e of fragment f's accumulators is the lane's row h = 2 f + e / 2, the warp's row
 * g + 8 h. s, zeroed, accumulates S = Q K^T. Only a tile crossing the diagonal or the end of
 * the keys is masked: past row h's first `cols` (diagonal: `visible + 8 h`) keys, -inf.
 * m_blk[h] is row h's max over the tile and the quad. */
template <int D, int BC, typename T>
__device__ void compute_qk_scores_and_max(const T *Q, const T *K, int cols, bool diagonal,
                                          int visible, float (*s)[BC / MmaN][4], float *m_blk) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    unsigned a[RowFrags][4];
#pragma unroll
    for (int f = 0; f < RowFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Q, f * MmaM, kk * MmaK));
    mma_tile<D, false, BC, RowFrags>(s, a, K, 0, kk * MmaK);
  }
  /* A compare and a select per element, which a branch skips on unmasked tiles at every d (08
   * predicates them at d = 128; in 09 that spills 16 bytes, and the branch is faster). */
  int t = threadIdx.x % Quad;
  if (diagonal || cols < BC)
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (n * MmaN + 2 * t + e % 2 >=
              (diagonal ? min(cols, visible + 8 * (2 * f + e / 2)) : cols))
            s[f][n][e] = -INFINITY;
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

/* BUFFERS = 2: K and V double-buffered, each tile's copy issued a whole tile ahead. Where that
 * leaves room for one block an SM but one buffer each leaves room for two (A100 at d = 128,
 * RTX 30 and 40 at every d: launch()), BUFFERS = 1, FlashAttention-2's placement: K(t + 1)'s
 * copy goes out once every warp is done with S = Q K(t)^T and overlaps the softmax and P V(t),
 * V(t + 1)'s once every warp is done with P V(t) and overlaps S = Q K(t + 1)^T. */
template <int D, int BC, int BUFFERS, typename T>
__global__ void __launch_bounds__(threads_for(Br, row_frags(D)), ForwardBlocksPerSm)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, attn_strides qs,
                         attn_strides kvs, int nq, int nkv, int heads, float scale, int causal) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  constexpr int Threads = threads_for(Br, RowFrags);
  constexpr bool Double = BUFFERS == 2;
  static_assert(BUFFERS == 1 || BUFFERS == 2, "K and V single- or double-buffered");
  /* K and V buffers of BC rows each, then Q: every tile starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * BC * padded<T>(D)), "tile alignment");
  extern __shared__ __align__(SharedAlignment) float4 smem[]; /* cp.async, ldmatrix: 16 bytes */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + BUFFERS * BC * padded<T>(D);
  T *Qs = Vs + BUFFERS * BC * padded<T>(D); /* K and V buffers, then the Q tile */
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
  const T *K = k + row_start(kvs, bh, 0), *V = v + row_start(kvs, bh, 0);
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
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
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  /* K(t) and V(t) in copy groups of their own (Q joins K(0)'s), so that each product waits
   * only for its operand. -DATTN_SPLIT_WAITS=0 waits for both at a tile's top, as 08 does. */
  constexpr bool split = ATTN_SPLIT_WAITS || !Double;
  if (kv_end > 0) load_tile<D, BC, Threads>(K, min(BC, nkv), Ks, kvs.row);
  __pipeline_commit();
  if (kv_end > 0) load_tile<D, BC, Threads>(V, min(BC, nkv), Vs, kvs.row);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += BC, buf ^= Double) {
    int cols = min(BC, nkv - j0), next = j0 + BC;
    T *Kn = Ks + (buf ^ Double) * BC * padded<T>(D), *Vn = Vs + (buf ^ Double) * BC * padded<T>(D);
    if (Double && next < kv_end)
      load_tile<D, BC, Threads>(K + next * kvs.row, min(BC, nkv - next), Kn, kvs.row);
    if (!split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, nkv - next), Vn, kvs.row);
    if (Double) __pipeline_commit();
    /* K(t) has landed (and, not split, V(t)); V(t) and, double-buffered, K(t + 1) may still be
     * in flight */
    __pipeline_wait_prior(!Double ? 1 : split ? 2 : 1);
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR, split and
                      * double-buffered: every warp is done with P V(t - 1), so V(t + 1) may
                      * overwrite its buffer */
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    const T *Kt = Ks + buf * BC * padded<T>(D), *Vt = Vs + buf * BC * padded<T>(D);
    float s[RowFrags][BC / MmaN][4] = {};
    compute_qk_scores_and_max<D, BC>(Qw, Kt, cols, diagonal, i + offset + 1 - j0, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, acc);
    if (!Double) __syncthreads(); /* WAR: every warp is done with S = Q K(t)^T before K(t + 1) */
    if (!Double && next < kv_end)
      load_tile<D, BC, Threads>(K + next * kvs.row, min(BC, nkv - next), Kn, kvs.row);
    if (Double && split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, nkv - next), Vn, kvs.row);
    __pipeline_commit();
    /* V(t) has landed; K(t + 1) (and, double-buffered, V(t + 1)) may still be in flight */
    __pipeline_wait_prior(Double ? 2 : 1);
    __syncthreads(); /* RAW: V(t) is in shared memory; WAR, double-buffered: every warp is done
                      * with S = Q K(t)^T, so K(t + 2) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, BC>(s, Vt, scale_log2, m, l, acc);
    if (!split || !Double)
      __syncthreads(); /* WAR: every warp is done with V(t) before V(t + 2),
                        * single-buffered V(t + 1) */
    if (!Double) {
      if (next < kv_end)
        load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, nkv - next), Vn, kvs.row);
      __pipeline_commit();
    }
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + row_start(qs, bh, row0), lse + bh * nq + row0,
                      nq - row0, qs.row);
}

/* The forward's tiles for this GPU: of bc_for(d) keys or Bc_small, K and V double- or
 * single-buffered, the configuration that fits the most blocks an SM (ForwardBlocksPerSm at
 * most), the first of this order on a tie. So the H100 keeps double-buffered 64- and 128-key
 * tiles (two blocks of 80 or 96 KiB share its 228 KiB); an A100 (164 KiB) single-buffers at
 * d = 128; RTX 30 and 40 (100 KiB) single-buffer at every d, 32 keys at d = 128. With
 * -DATTN_TILES_PER_SM=0, the choice by what fits one block alone (the README's A/B table). */
#ifndef ATTN_TILES_PER_SM
#define ATTN_TILES_PER_SM 1
#endif
struct forward_tiles {
  int bc, buffers;
};
template <int D, typename T>
static forward_tiles choose_forward_tiles() {
  const forward_tiles candidates[] = {{bc_for(D), 2}, {bc_for(D), 1}, {Bc_small, 2}, {Bc_small, 1}};
  forward_tiles best = candidates[0];
  int best_blocks = -1;
  for (forward_tiles c : candidates) {
    size_t bytes = tile_bytes<T>(D, c.bc, Br, c.buffers);
    if (!ATTN_TILES_PER_SM && c.buffers == 1) continue;
    int blocks = bytes > attn_shared_memory_limit() ? 0
                 : !ATTN_TILES_PER_SM               ? 1
                                                    : attn_blocks_per_sm(bytes, ForwardBlocksPerSm);
    if (blocks > best_blocks) best = c, best_blocks = blocks;
  }
  return best;
}

template <int D, int BC, int BUFFERS, typename T>
static void launch_tiles(const attn_problem *p, const attn_buffers *t) {
  size_t bytes = tile_bytes<T>(D, BC, Br, BUFFERS);
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_require_shared_memory((const void *)flash_forward_kernel<D, BC, BUFFERS, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, BC, BUFFERS>
      <<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (T *)t->o, t->lse, attn_q_strides(p),
          attn_kv_strides(p), p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  forward_tiles tiles = choose_forward_tiles<D, T>();
  if (tiles.bc == Bc_small)
    tiles.buffers == 2 ? launch_tiles<D, Bc_small, 2, T>(p, t)
                       : launch_tiles<D, Bc_small, 1, T>(p, t);
  else
    tiles.buffers == 2 ? launch_tiles<D, bc_for(D), 2, T>(p, t)
                       : launch_tiles<D, bc_for(D), 1, T>(p, t);
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}
