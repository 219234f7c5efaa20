/* Stage 07's forward: a warp per 16 query rows, S = Q K^T and O += P V on WMMA. */
#pragma once

#include <math.h>

#include "attention.h"
#include "gpu.h"
#include "tiles.cuh"

/* s[j] = scale q . k_j for the tile's keys; m_blk = their max. Every thread of a warp reads
 * its row's keys j = c * LANES + part of S = Q K^T, which the warp stages in S. */
template <int D, typename T>
__device__ void compute_qk_scores_and_max(const T *Q, const T *K, float *S, int cols, float scale,
                                          float *s, float &m_blk) {
  const float *S_row =
      stage_product<wmma::col_major, Bc, D>(Q, padded<T>(D), K, padded<T>(D), S, padded<float>(Bc));
  m_blk = -INFINITY;
#pragma unroll
  for (int c = 0, j = threadIdx.x % LANES; c < Bc / LANES; c++, j += LANES) {
    if (j < cols) {
      s[c] = scale * S_row[c * LANES];
      m_blk = fmaxf(m_blk, s[c]);
    }
  }
  m_blk = fmaxf(m_blk, __shfl_xor_sync(0xffffffffu, m_blk, 1)); /* the row's other thread */
}

/* m' = max(m, m_blk); what was summed under exp(-m) is rescaled by exp(m - m'). */
template <int D>
__device__ void merge_block_stats(float m_blk, float &m, float &l, float *acc) {
  float m_new = fmaxf(m, m_blk);
  /* While a row has seen no key m' is still -inf, and exp(-inf - -inf) would be NaN; there
   * is nothing to rescale then (l = 0, acc = 0). Otherwise 0 on the first visible tile. */
  float correction = m_new == -INFINITY ? 1.f : expf(m - m_new);
  l *= correction;
#pragma unroll
  for (int c = 0; c < D / LANES; c++) acc[c] *= correction;
  m = m_new;
}

/* p_j = exp(s_j - m); l += sum p_j; acc += sum p_j v_j. */
template <int D, typename T>
__device__ void compute_block_softmax_and_weighted_v(const float *s, const T *V, int cols, float *S,
                                                     T *P, float m, float &l, float *acc) {
#pragma unroll
  for (int c = 0, j = threadIdx.x % LANES; c < Bc / LANES; c++, j += LANES) {
    float prob = j < cols ? expf(s[c] - m) : 0.f;
    l += prob;
    P[threadIdx.x / LANES * padded<T>(Bc) + j] = T(prob); /* in the dtype, for P V */
  }
  __syncwarp(); /* RAW: the warp's rows of P are whole before they load */

  constexpr int W = D < Bc ? D : Bc; /* P V's columns per pass through the staging tile */
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += W) {
    const float *O_row = stage_product<wmma::row_major, W, Bc>(P, padded<T>(Bc), V + c0,
                                                               padded<T>(D), S, padded<float>(Bc));
#pragma unroll
    for (int c = 0; c < W / LANES; c++) acc[c0 / LANES + c] += O_row[c * LANES];
  }
}

/* O = acc / l, LSE = m + log l; a row that saw no key: O = 0, LSE = -inf. */
template <int D, typename T>
__device__ void normalize_output(const float *acc, float m, float l, T *O, float *LSE) {
  float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < D / LANES; c++) O[c * LANES + threadIdx.x % LANES] = T(acc[c] * inv_l);
  *LSE = l > 0.f ? m + logf(l) : -INFINITY;
}

template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br), 2)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, int nq, int nkv, int heads,
                         float scale, int causal) {
  extern __shared__ __align__(32) float4 smem[]; /* float4 copies; WMMA wants 32-byte tiles */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + Bc * padded<T>(D), *Qs = Vs + Bc * padded<T>(D);
  float *Ss = reinterpret_cast<float *>(Qs + Br * padded<T>(D)); /* a staging row per query */
  T *Ps = reinterpret_cast<T *>(Ss + Br * padded<float>(Bc));
  /* Causal blocks have unequal work: row block r does about r + 1 times row block 0's. Ordered by
   * row block across all heads, every head's heaviest block starts first and the light ones
   * fill the tail (ordered per head, the heavy blocks of the last heads would start last).
   * Non-causal blocks are equal, so a head's blocks stay adjacent and share its K and V in
   * L2. (05's README measures both orders.) */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int i = i0 + threadIdx.x / LANES; /* this thread's query row */
  /* A thread past the last row still helps load tiles and meets every barrier. */
  bool has_row = i < nq;
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float acc[D / LANES], s[Bc / LANES];
  float m = -INFINITY, l = 0.f, m_blk;
#pragma unroll
  for (int c = 0; c < D / LANES; c++) acc[c] = 0.f;
  load_tile<D, Br>(q + (bh * nq + i0) * D, min(Br, nq - i0), Qs);
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  for (int j0 = 0; j0 < kv_end; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > i0 + offset;
    int row_cols = diagonal ? max(0, min(cols, i + offset + 1 - j0)) : cols;
    load_kv_tile<D>(K + (long)j0 * D, V + (long)j0 * D, cols, Ks, Vs);
    __syncthreads(); /* RAW: the whole tile (the first time, Q too) is in shared memory */
    compute_qk_scores_and_max<D>(Qs, Ks, Ss, row_cols, scale, s, m_blk);
    merge_block_stats<D>(m_blk, m, l, acc);
    compute_block_softmax_and_weighted_v<D>(s, Vs, row_cols, Ss, Ps, m, l, acc);
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1); /* each thread of the row summed its own keys */
  if (has_row) normalize_output<D>(acc, m, l, o + (bh * nq + i) * D, lse + bh * nq + i);
}

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_require_shared_memory((const void *)flash_forward_kernel<D, T>, tile_bytes<T>(D, Bc, Br),
                             "flash_forward_kernel");
  flash_forward_kernel<D><<<grid, threads_for(Br), tile_bytes<T>(D, Bc, Br), attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (T *)t->o, t->lse, p->seq_q, p->seq_kv,
      heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}
