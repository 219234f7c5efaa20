/* Stage 08's forward: one warp per 16 or 32 query rows, S, P and O in registers. */
#pragma once

#include <math.h>
#include <type_traits>

#include "attention.h"
#include "gpu.h"
#include "tiles.cuh"

/* A warp's query rows in the forward, in fragments: at d = 128 two, so that each K and V
 * operand loaded feeds two mma.sync; at d <= 64 one, which leaves registers for two blocks of
 * 8 warps an SM (both choices measured: docs/techniques.md). */
__host__ __device__ constexpr int row_frags(int d) { return d > 64 ? 2 : 1; }
/* Query rows per block: 128, so that each K and V tile copied into shared memory serves 128
 * rows (8 warps of 16 rows, or 4 of 32). */
constexpr int Br = 128;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small;
 * 64 keys, 32 scores a lane per 16 rows (faster than 32 at every d: docs/techniques.md). */
#ifndef ATTN_BC
#define ATTN_BC 64
#endif
constexpr int Bc = ATTN_BC;
/* Keys per tile where the device cannot give a block tile_bytes(d, Bc) (102 KiB at d = 128;
 * sm_86 and sm_89 allow 99 KiB): half the keys, half the K and V buffers. */
constexpr int Bc_small = 32;
static_assert(Bc_small % MmaK == 0, "a tile of keys is whole k-steps of P V");
static_assert(tile_bytes<__half>(128, Bc_small, Br) <= 99 * 1024,
              "the forward has a configuration within the 99 KiB of sm_86 and sm_89");

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
  /* A compare and a select per element: at d <= 64 a branch skips them on unmasked tiles; at
   * d = 128 they stay predicated in the max's loop (the branch would cost 60 bytes of spills). */
  int t = threadIdx.x % Quad;
  if (RowFrags == 1 && (diagonal || cols < BC))
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (n * MmaN + 2 * t + e % 2 >= (diagonal ? min(cols, visible + 8 * (e / 2)) : cols))
          s[0][n][e] = -INFINITY;
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_blk[h] = -INFINITY;
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int row_cols = diagonal ? min(cols, visible + 8 * (2 * f + e / 2)) : cols;
        if (RowFrags > 1 && (diagonal || cols < BC) && n * MmaN + 2 * t + e % 2 >= row_cols)
          s[f][n][e] = -INFINITY;
        m_blk[2 * f + e / 2] = fmaxf(m_blk[2 * f + e / 2], s[f][n][e]);
      }
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_blk[h] = max_over_quad(m_blk[h]);
}

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
 * end); acc += P V, two S accumulators per 16 keys an A operand. (Not one FFMA, s c - m c with
 * m c rounded apart: at logits near 1e11 that rounding alone is 4096, and 2^4096 = inf.) */
template <int D, int BC, typename T>
__device__ void compute_block_softmax_and_weighted_v(const float (*s)[BC / MmaN][4], const T *V,
                                                     float scale_log2, const float *m, float *l,
                                                     float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];
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
          p[e] = exp2_approx((s[f][2 * kk + half][e] - m_use[2 * f + e / 2]) * scale_log2);
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

template <int D, int BC, typename T>
__global__ void __launch_bounds__(threads_for(Br, row_frags(D)), 2)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, int nq, int nkv, int heads,
                         float scale, int causal) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  extern __shared__ __align__(32) float4 smem[]; /* cp.async and ldmatrix move 16 bytes */
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
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m[h] = -INFINITY, l[h] = 0.f;
  load_tile<D, Br>(q + (bh * nq + i0) * D, min(Br, nq - i0), Qs);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Br * D; e += blockDim.x) {
      T &x = Qs[e / D * padded<T>(D) + e % D];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  if (kv_end > 0) load_kv_tile<D, BC>(K, V, min(BC, nkv), Ks, Vs);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += BC, buf ^= 1) {
    int cols = min(BC, nkv - j0), next = j0 + BC;
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    if (next < kv_end)
      load_kv_tile<D, BC>(K + (long)next * D, V + (long)next * D, min(BC, nkv - next),
                          Ks + (buf ^ 1) * BC * padded<T>(D), Vs + (buf ^ 1) * BC * padded<T>(D));
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: the whole tile (the first time, Q too) is in shared memory */
    const T *Kt = Ks + buf * BC * padded<T>(D), *Vt = Vs + buf * BC * padded<T>(D);
    float s[RowFrags][BC / MmaN][4] = {};
    compute_qk_scores_and_max<D, BC>(Qw, Kt, cols, diagonal, i + offset + 1 - j0, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, acc);
    compute_block_softmax_and_weighted_v<D, BC>(s, Vt, scale_log2, m, l, acc);
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + (bh * nq + row0) * D, lse + bh * nq + row0,
                      nq - row0);
}

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half, int BC = Bc>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  size_t bytes = tile_bytes<T>(D, BC, Br);
  if (BC > Bc_small && bytes > attn_shared_memory_limit()) return launch<D, T, Bc_small>(p, t);
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_require_shared_memory((const void *)flash_forward_kernel<D, BC, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, BC><<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
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
