/* Stage 05: the causal mask.
 *
 * Key j is visible to query i when j <= i + (Nkv - Nq): bottom-right alignment, as in
 * FlashAttention (for Nq = Nkv the usual lower triangle). A block of rows [i0, i0 + Br)
 * needs no key past the last row's limit, so the tiles above the diagonal are never
 * loaded; a tile that crosses the diagonal is masked by giving each row only the columns
 * it sees. The same four steps serve both kinds of tile. A row that sees no key (possible
 * when Nq > Nkv) keeps m = -inf and l = 0, and gets O = 0 and LSE = -inf, never NaN.
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
  /* While a row has seen no key m' is still -inf, and exp(-inf - -inf) would be NaN; there
   * is nothing to rescale then (l = 0, acc = 0). Otherwise 0 on the first visible tile. */
  float correction = m_new == -INFINITY ? 1.f : expf(m - m_new);
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

/* O = acc / l, LSE = m + log l; a row that saw no key: O = 0, LSE = -inf. */
template <int D>
__device__ void normalize_output(const float *acc, float m, float l, float *O, float *LSE) {
  float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < D; c++) O[c] = acc[c] * inv_l;
  *LSE = l > 0.f ? m + logf(l) : -INFINITY;
}

template <int D>
__global__ void __launch_bounds__(Br)
    flash_forward_kernel(const float *__restrict__ q, const float *__restrict__ k,
                         const float *__restrict__ v, float *__restrict__ o,
                         float *__restrict__ lse, int nq, int nkv, int heads, float scale,
                         int causal) {
  extern __shared__ float4 smem[]; /* float4: the tiles are read and written as float4 */
  float *Ks = reinterpret_cast<float *>(smem), *Vs = Ks + Bc * D;
  /* Causal blocks have unequal work: row block r does about r + 1 times row block 0's. Ordered by
   * row block across all heads, every head's heaviest block starts first and the light ones
   * fill the tail (measured at N = 4096, d = 64: ordered per head, the heavy blocks of the
   * last heads started last and causal was only 1.57x faster than non-causal; ordered
   * across heads, 1.88x). Non-causal blocks are equal, so a head's blocks stay adjacent and
   * share its K and V in L2 (ordered across heads instead: 6.5% slower). */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int i = i0 + threadIdx.x; /* this thread's query row */
  /* A thread past the last row still helps load tiles and meets every barrier. */
  bool has_row = i < nq;
  const float *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float q_row[D], acc[D], s[Bc];
  float m = -INFINITY, l = 0.f, m_blk;
#pragma unroll
  for (int c = 0; c < D; c++) q_row[c] = has_row ? q[(bh * nq + i) * D + c] : 0.f, acc[c] = 0.f;
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
    __syncthreads(); /* RAW: the whole tile is in shared memory before any row reads it */
    compute_qk_scores_and_max<D>(q_row, Ks, row_cols, scale, s, m_blk);
    merge_block_stats<D>(m_blk, m, l, acc);
    compute_block_softmax_and_weighted_v<D>(s, Vs, row_cols, m, l, acc);
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
      p->seq_q, p->seq_kv, heads, p->scale, p->causal);
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
    .name = "05_causal",
    .idea = "the causal mask: skip tiles above the diagonal, mask only the diagonal tiles",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
