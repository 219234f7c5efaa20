/* Stage 03: the stage-02 algorithm on the GPU.
 *
 * One block per query block of a head, numbered along x; a block holds Br threads, each owning
 * one query row: its q, its running max m, sum l and accumulator acc live in registers,
 * and it walks the keys in tiles of Bc, reading K and V straight from global memory. The
 * four steps are stage 02's, now for one row each. Head dims are compile-time (D), so
 * that q and acc can be register arrays.
 */
#include <math.h>

#include "attention.h"
#include "gpu.h"

/* Query rows (threads) per block: 128 threads = 4 warps, enough blocks per SM to hide the
 * latency of the global loads at every N of the sweep. */
constexpr int Br = 128;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small;
 * 32 scores plus q and acc fit the register file at d = 64. */
constexpr int Bc = 32;

/* s[j] = scale q . k_j for the tile's keys; m_blk = their max. Every thread of a warp reads
 * the same K row at the same time, so each load is one broadcast. */
template <int D>
__device__ void compute_qk_scores_and_max(const float *q, const float *K, int cols, float scale,
                                          float *s, float &m_blk) {
  m_blk = -INFINITY;
#pragma unroll
  for (int j = 0; j < Bc; j++) {
    if (j < cols) {
      float dot = 0.f;
#pragma unroll
      for (int c = 0; c < D; c++) dot += q[c] * K[j * D + c];
      s[j] = scale * dot;
      m_blk = fmaxf(m_blk, s[j]);
    }
  }
}

/* m' = max(m, m_blk); what was summed under exp(-m) is rescaled by exp(m - m'). */
template <int D>
__device__ void merge_block_stats(float m_blk, float &m, float &l, float *acc) {
  float m_new = fmaxf(m, m_blk);
  float correction = expf(m - m_new); /* 0 on the first tile, where m = -inf */
  l *= correction;
#pragma unroll
  for (int c = 0; c < D; c++) acc[c] *= correction;
  m = m_new;
}

/* p_j = exp(s_j - m); l += sum p_j; acc += sum p_j v_j. */
template <int D>
__device__ void compute_block_softmax_and_weighted_v(const float *s, const float *V, int cols,
                                                     float m, float &l, float *acc) {
#pragma unroll
  for (int j = 0; j < Bc; j++) {
    if (j < cols) {
      float prob = expf(s[j] - m);
      l += prob;
#pragma unroll
      for (int c = 0; c < D; c++) acc[c] += prob * V[j * D + c];
    }
  }
}

/* O = acc / l, LSE = m + log l. */
template <int D>
__device__ void normalize_output(const float *acc, float m, float l, float *O, float *LSE) {
#pragma unroll
  for (int c = 0; c < D; c++) O[c] = acc[c] / l;
  *LSE = m + logf(l);
}

template <int D>
__global__ void __launch_bounds__(Br)
    flash_forward_kernel(const float *__restrict__ q, const float *__restrict__ k,
                         const float *__restrict__ v, float *__restrict__ o,
                         float *__restrict__ lse, int nq, int nkv, float scale) {
  /* Blocks are numbered along x only (the grid's y and z stop at 65535, x at 2^31 - 1):
   * a head's row blocks are adjacent. */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = blockIdx.x / row_blocks;
  int i = (int)(blockIdx.x % row_blocks) * Br + threadIdx.x; /* this thread's query row */
  if (i >= nq) return;
  const float *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float q_row[D], acc[D], s[Bc];
  float m = -INFINITY, l = 0.f, m_blk;
#pragma unroll
  for (int c = 0; c < D; c++) q_row[c] = q[(bh * nq + i) * D + c], acc[c] = 0.f;
  for (int j0 = 0; j0 < nkv; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    compute_qk_scores_and_max<D>(q_row, K + (long)j0 * D, cols, scale, s, m_blk);
    merge_block_stats<D>(m_blk, m, l, acc);
    compute_block_softmax_and_weighted_v<D>(s, V + (long)j0 * D, cols, m, l, acc);
  }
  normalize_output<D>(acc, m, l, o + (bh * nq + i) * D, lse + bh * nq + i);
}

template <int D>
static void launch(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  flash_forward_kernel<D><<<grid, Br, 0, attn_stream()>>>((const float *)t->q, (const float *)t->k,
                                                          (const float *)t->v, (float *)t->o,
                                                          t->lse, p->seq_q, p->seq_kv, p->scale);
  CHECK_LAUNCH("flash_forward_kernel");
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}

static const attn_stage stage = {
    .name = "03_cuda_forward",
    .idea = "the online softmax on the GPU: one thread per query row, K and V from global memory",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .saves_lse = 1,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
