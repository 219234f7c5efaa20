/* Stage 04: K and V tiles staged in shared memory.
 *
 * In stage 03 every thread read every K and V element from global memory (through L1/L2),
 * Br times per block. Here the block loads each Bc x d tile of K and V once, with coalesced
 * float4 loads spread over all its threads, into shared memory, and all Br rows read it
 * from there. Each thread still owns one query row: q, m, l and acc in registers.
 */
#include <math.h>

#include "attention.h"
#include "gpu.h"

/* Query rows (threads) per block: 128 threads = 4 warps, enough blocks per SM to hide the
 * latency of the global loads at every N of the sweep. */
constexpr int Br = 128;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small;
 * 32 scores plus q and acc fit the register file at d = 64. The K and V tiles take
 * 2 x 32 x d floats of shared memory: 32 KiB at d = 128, under the 48 KiB default. */
constexpr int Bc = 32;

/* Shared memory for one K tile and one V tile. */
static size_t tile_bytes(int d) { return 2 * sizeof(float) * Bc * (size_t)d; }

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. */
template <int D>
__device__ void load_kv_tile(const float *K, const float *V, int cols, float *Ks, float *Vs) {
  const float4 *K4 = reinterpret_cast<const float4 *>(K);
  const float4 *V4 = reinterpret_cast<const float4 *>(V);
  for (int e = threadIdx.x; e < cols * D / 4; e += Br) {
    reinterpret_cast<float4 *>(Ks)[e] = K4[e];
    reinterpret_cast<float4 *>(Vs)[e] = V4[e];
  }
}

/* s[j] = scale q . k_j for the tile's keys; m_blk = their max. Every thread of a warp reads
 * the same K row at the same time, so each shared-memory load is one broadcast. */
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
  extern __shared__ float4 smem[]; /* float4: the tiles are read and written as float4 */
  float *Ks = reinterpret_cast<float *>(smem), *Vs = Ks + Bc * D;
  /* Blocks are numbered along x only (the grid's y and z stop at 65535, x at 2^31 - 1):
   * a head's row blocks are adjacent. */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = blockIdx.x / row_blocks;
  int i = (int)(blockIdx.x % row_blocks) * Br + threadIdx.x; /* this thread's query row */
  /* A thread past the last row still helps load tiles and meets every barrier. */
  bool has_row = i < nq;
  const float *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float q_row[D], acc[D], s[Bc];
  float m = -INFINITY, l = 0.f, m_blk;
#pragma unroll
  for (int c = 0; c < D; c++) q_row[c] = has_row ? q[(bh * nq + i) * D + c] : 0.f, acc[c] = 0.f;
  for (int j0 = 0; j0 < nkv; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    load_kv_tile<D>(K + (long)j0 * D, V + (long)j0 * D, cols, Ks, Vs);
    __syncthreads(); /* RAW: the whole tile is in shared memory before any row reads it */
    compute_qk_scores_and_max<D>(q_row, Ks, cols, scale, s, m_blk);
    merge_block_stats<D>(m_blk, m, l, acc);
    compute_block_softmax_and_weighted_v<D>(s, Vs, cols, m, l, acc);
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  if (has_row) normalize_output<D>(acc, m, l, o + (bh * nq + i) * D, lse + bh * nq + i);
}

template <int D>
static void launch(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_require_shared_memory((const void *)flash_forward_kernel<D>, tile_bytes(D),
                             "flash_forward_kernel");
  flash_forward_kernel<D><<<grid, Br, tile_bytes(D), attn_stream()>>>(
      (const float *)t->q, (const float *)t->k, (const float *)t->v, (float *)t->o, t->lse,
      p->seq_q, p->seq_kv, p->scale);
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
    .name = "04_shared_memory",
    .idea = "K/V tiles in shared memory, loaded once per block and reused by every row",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .saves_lse = 1,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
