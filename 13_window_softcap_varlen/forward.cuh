/* Stage 13's forward: 09's, with each row's keys an interval (a sliding window, causal, a
 * packed sequence's own keys), tiles skipped at both ends, and the logits softcapped. */
#pragma once

#include <math.h>
#include <type_traits>

#include "../09_swizzle_pipeline/forward_softmax.cuh"
#include "../09_swizzle_pipeline/tiles.cuh"
#include "attention.h"
#include "gpu.h"
#include "visible.cuh"

/* Element e of fragment f's accumulators is the lane's row h = 2 f + e / 2, the warp's row
 * g + 8 h. s, zeroed, accumulates S = Q K^T, then, with a softcap c > 0, c tanh(S |scale| / c)
 * (cap_k: see softcap_exponent). Only a tile crossing an edge of some row's keys is masked: row h
 * (the sequence's query `row` + 8 h) keeps the keys it sees, the rest become -inf; the tile
 * starts at key j0. m_blk[h] is row h's max over the tile and the quad. */
template <int D, int BC, typename T>
__device__ void compute_qk_scores_and_max(const T *Q, const T *K, bool masked,
                                          const visible_keys &vis, int row, int j0, float cap,
                                          float cap_k, float (*s)[BC / MmaN][4], float *m_blk) {
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
  if (cap > 0.f) /* before the mask, which sets -inf whatever the logit */
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[f][n][e] = cap * softcap_tanh(s[f][n][e], cap_k);
  if (masked) {
    /* Row h's keys as the tile's columns [first[h], stop[h]): computed here, on masked tiles
     * only, so that nothing of them stays live across the key loop. */
    int first[LaneRows], stop[LaneRows];
#pragma unroll
    for (int h = 0; h < LaneRows; h++)
      first[h] = vis.begin(row + 8 * h) - j0, stop[h] = vis.end(row + 8 * h) - j0;
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          int c = n * MmaN + 2 * t + e % 2, h = 2 * f + e / 2;
          if (c < first[h] || c >= stop[h]) s[f][n][e] = -INFINITY;
        }
  }
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
                         attn_strides kvs, int nq, int nkv, int pairs, float scale, int left,
                         int right, float softcap, const int *__restrict__ cu_q,
                         const int *__restrict__ cu_k, int seq_heads, int max_nq) {
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
   * L2. (05's README measures both orders.) A window bounded on the left is as even. The
   * grid covers `pairs` (sequence, head) pairs of max_nq rows; a block past its sequence's
   * rows (varlen: a shorter one) has nothing to do. */
  bool triangle = right >= 0 && left < 0;
  int row_blocks = (max_nq + Br - 1) / Br;
  long pair = triangle ? blockIdx.x % pairs : blockIdx.x / row_blocks;
  int i0 =
      (triangle ? row_blocks - 1 - (int)(blockIdx.x / pairs) : (int)(blockIdx.x % row_blocks)) * Br;
  /* Varlen: sequence pair / H, in batch 0 of the packed tensors; otherwise pair is b H + h. */
  sequence_rows seq = sequence_of(cu_q, cu_k, (int)(pair / seq_heads), nq, nkv);
  long bh = cu_q ? pair % seq_heads : pair;
  if (i0 >= seq.nq) return; /* the whole block, before any barrier */
  const visible_keys vis = {seq.nkv - seq.nq, left, right, seq.nkv};
  /* A thread past the last row still helps load tiles and meets every barrier. */
  /* The warp's rows start at row0; this lane holds rows i + 8 h. */
  int row0 = i0 + threadIdx.x / 32 * RowFrags * MmaM, i = row0 + threadIdx.x % 32 / Quad;
  const T *K = k + row_start(kvs, bh, seq.k_first), *V = v + row_start(kvs, bh, seq.k_first);
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m[h] = -INFINITY, l[h] = 0.f;
  load_tile<D, Br, Threads>(q + row_start(qs, bh, seq.q_first + i0), min(Br, seq.nq - i0), Qs,
                            qs.row);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  /* Capped logits carry the scale already: the softmax takes them as they are. */
  const float cap_k = softcap_exponent(fabsf(scale), softcap);
  if (softcap > 0.f) scale_log2 = Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Br * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Keys [kv_begin, kv_end) are visible to some row of the block, from the first row's first
   * to the last row's last; the tiles run from the one holding kv_begin. */
  int last_row = min(i0 + Br, seq.nq) - 1, kv_begin = vis.begin(i0), kv_end = vis.end(last_row);
  int j_first = kv_begin / BC * BC;
  if (kv_end <= kv_begin) kv_end = j_first; /* no row of the block sees a key: no tile */
  /* The warp's edges: a tile between them needs no mask. */
  int warp_begin = vis.begin(min(row0 + RowFrags * MmaM, seq.nq) - 1), warp_end = vis.end(row0);
  /* K(t) and V(t) in copy groups of their own (Q joins K(0)'s), so that each product waits
   * only for its operand. -DATTN_SPLIT_WAITS=0 waits for both at a tile's top, as 08 does. */
  constexpr bool split = ATTN_SPLIT_WAITS || !Double;
  if (j_first < kv_end)
    load_tile<D, BC, Threads>(K + j_first * kvs.row, min(BC, seq.nkv - j_first), Ks, kvs.row);
  __pipeline_commit();
  if (j_first < kv_end)
    load_tile<D, BC, Threads>(V + j_first * kvs.row, min(BC, seq.nkv - j_first), Vs, kvs.row);
  __pipeline_commit();
  for (int j0 = j_first, buf = 0; j0 < kv_end; j0 += BC, buf ^= Double) {
    int next = j0 + BC;
    T *Kn = Ks + (buf ^ Double) * BC * padded<T>(D), *Vn = Vs + (buf ^ Double) * BC * padded<T>(D);
    if (Double && next < kv_end)
      load_tile<D, BC, Threads>(K + next * kvs.row, min(BC, seq.nkv - next), Kn, kvs.row);
    if (!split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, seq.nkv - next), Vn, kvs.row);
    if (Double) __pipeline_commit();
    /* K(t) has landed (and, not split, V(t)); V(t) and, double-buffered, K(t + 1) may still be
     * in flight */
    __pipeline_wait_prior(!Double ? 1 : split ? 2 : 1);
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR, split and
                      * double-buffered: every warp is done with P V(t - 1), so V(t + 1) may
                      * overwrite its buffer */
    /* A tile reaching before the warp's last row's first key or past its first row's last is
     * masked: each row keeps the columns it sees, which may be none. */
    bool masked = j0 < warp_begin || j0 + BC > warp_end;
    const T *Kt = Ks + buf * BC * padded<T>(D), *Vt = Vs + buf * BC * padded<T>(D);
    float s[RowFrags][BC / MmaN][4] = {};
    compute_qk_scores_and_max<D, BC>(Qw, Kt, masked, vis, i, j0, softcap, cap_k, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, acc);
    if (!Double) __syncthreads(); /* WAR: every warp is done with S = Q K(t)^T before K(t + 1) */
    if (!Double && next < kv_end)
      load_tile<D, BC, Threads>(K + next * kvs.row, min(BC, seq.nkv - next), Kn, kvs.row);
    if (Double && split && next < kv_end)
      load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, seq.nkv - next), Vn, kvs.row);
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
        load_tile<D, BC, Threads>(V + next * kvs.row, min(BC, seq.nkv - next), Vn, kvs.row);
      __pipeline_commit();
    }
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + row_start(qs, bh, seq.q_first + row0),
                      lse + bh * nq + seq.q_first + row0, seq.nq - row0, qs.row);
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
  /* Every (sequence, head) pair's blocks for the longest sequence's rows. */
  int pairs = (p->seqs ? p->seqs : p->batch) * p->heads;
  int max_nq =
      p->seqs ? longest_sequence(p->cu_seqlens_q, p->seqs, p->max_seqlen_q, p->seq_q) : p->seq_q;
  dim3 grid(grid_blocks((max_nq + Br - 1) / Br, pairs, "flash_forward_kernel"));
  if (grid.x == 0) return; /* no rows at all: nothing to launch */
  attn_require_shared_memory((const void *)flash_forward_kernel<D, BC, BUFFERS, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, BC, BUFFERS>
      <<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (T *)t->o, t->lse, attn_q_strides(p),
          attn_kv_strides(p), p->seq_q, p->seq_kv, pairs, p->scale, window_left(p), window_right(p),
          p->softcap, t->cu_seqlens_q, t->cu_seqlens_k, p->heads, max_nq);
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
