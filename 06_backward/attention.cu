/* Stage 06: the backward pass, recomputing P from the saved LSE.
 *
 * The forward is stage 05's and already saves LSE = m + log l. The backward never stores
 * P: it recomputes P_ij = exp(S_ij - LSE_i) tile by tile from Q, K and LSE. Three kernels:
 *   compute_delta_kernel         D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i))
 *   flash_backward_dkdv_kernel   one thread per key j, walking the query tiles:
 *                                dV_j += P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - D_i),
 *                                dK_j += scale dS_ij Q_i      (dK, dV in registers)
 *   flash_backward_dq_kernel     one thread per query i, walking the key tiles like the
 *                                forward: dQ_i += scale dS_ij K_j  (dQ in registers)
 * dQ gets its own pass instead of atomics from the dK/dV kernel: it recomputes S and dP
 * once more (7 d instead of 5 d multiply-adds per (i, j)), and in exchange every gradient
 * is written by exactly one thread, so the backward is deterministic.
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
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (blockDim.x, not Br:
 * the backward's dQ kernel reuses this with more threads per block.) */
template <int D>
__device__ void load_kv_tile(const float *K, const float *V, int cols, float *Ks, float *Vs) {
  const float4 *K4 = reinterpret_cast<const float4 *>(K);
  const float4 *V4 = reinterpret_cast<const float4 *>(V);
  for (int e = threadIdx.x; e < cols * D / 4; e += blockDim.x) {
    reinterpret_cast<float4 *>(Ks)[e] = K4[e];
    reinterpret_cast<float4 *>(Vs)[e] = V4[e];
  }
}

/* Threads that share one row of the backward. A backward thread keeps three d-vectors in
 * registers (q, dO, dQ; or k-side dK, dV); at d = 128 that is 384 floats, and ptxas put
 * them in local memory (2.9 KB stack, 1.04 TFLOP/s). Two threads per row at d = 128 keep
 * d = 64's footprint: thread `part` owns the columns c * lanes + part (interleaved, so the
 * pair reads neighbouring shared-memory words: different banks), and the two halves of each
 * dot product meet through one warp shuffle. */
__host__ __device__ constexpr int row_lanes(int d) { return d > 64 ? 2 : 1; }

/* s[j] = scale q . k_j for the tile's keys; m_blk = their max. Every thread of a warp reads
 * the same K row at the same time, so each shared-memory load is one broadcast. The dot
 * product is summed in the backward's order (row_lanes(D) interleaved partial sums, then
 * added) and scale * dot is never fused into a later add (__fmul_rn): the backward then
 * recomputes every logit bit for bit, so a row with one visible key gets P = 1 exactly. */
template <int D>
__device__ void compute_qk_scores_and_max(const float *q, const float *K, int cols, float scale,
                                          float *s, float &m_blk) {
  constexpr int LANES = row_lanes(D);
  static_assert(LANES <= 2, "for more lanes, add the partial sums in the shuffles' order");
  m_blk = -INFINITY;
#pragma unroll
  for (int j = 0; j < Bc; j++) {
    if (j < cols) {
      float dot[LANES] = {};
#pragma unroll
      for (int c = 0; c < D; c++) dot[c % LANES] += q[c] * K[j * D + c];
#pragma unroll
      for (int w = 1; w < LANES; w++) dot[0] += dot[w];
      s[j] = __fmul_rn(scale, dot[0]);
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

/* ---- the backward ------------------------------------------------------------------ */

/* Sum of a dot product's partial sums over the lanes of a row (lanes are adjacent in the
 * warp). Every thread of the warp must call this: the shuffle names the whole warp. */
template <int LANES>
__device__ float sum_over_row_lanes(float x) {
#pragma unroll
  for (int w = 1; w < LANES; w *= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return x;
}

/* Keys per dK/dV block (row_lanes(d) threads each): 4 warps at d <= 64; with dK and dV
 * (2d floats) in registers, about two such blocks fit an SM. */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys, half the K^T and V^T tiles (144 KiB at d = 128; sm_86 and sm_89 allow 99 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query rows per tile of the dK/dV kernel: Q and dO tiles of 16 rows are read as
 * broadcasts by every thread; 16 keeps the block's shared memory (the transposed K and V
 * tiles plus these) at 144 KiB for d = 128, under the 227 KiB opt-in limit of sm_90 and the 163 KiB
 * of sm_80. */
constexpr int Br_bwd = 16;
/* Query tiles summed in registers before the sum is added into dK and dV in global memory (a
 * two-level sum, 128 queries to a register partial). One running register sum over every
 * query gained a rounding error per query on a sum that keeps growing: at Nq ~ 1000 its dK
 * error reached about 2x that of PyTorch's blocked fp32 matmuls. */
constexpr int Tiles_per_partial = 8;

static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) * attn_lse_elems(p);
}

/* Shared memory of the dK/dV kernel: K^T and V^T (d x bc), Q and dO tiles (Br_bwd x d),
 * LSE and D of the tile's rows. */
static size_t dkdv_bytes(int d, int bc) {
  return sizeof(float) * (2 * (size_t)bc * d + 2 * (size_t)Br_bwd * d + 2 * Br_bwd);
}

/* D_i = sum_c dO_ic O_ic, one thread per row. (It equals sum_j dP_ij P_ij: the backward of
 * the softmax needs exactly this dot product, and O = P V makes it a d-term sum.) Summed in
 * the order the backward sums dP_ij = dO_i . V_j (row_lanes(D) interleaved partial sums):
 * on a row with one visible key O_i = V_j exactly, and dS_ij = P_ij (dP_ij - D_i) is then
 * exactly 0, as in exact arithmetic, instead of rounding noise as large as the gradient. */
template <int D>
__global__ void compute_delta_kernel(const float *o, const float *d_o, float *delta, long rows) {
  constexpr int LANES = row_lanes(D);
  long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float sum[LANES] = {};
  for (int c = 0; c < D; c++) sum[c % LANES] += d_o[r * D + c] * o[r * D + c];
#pragma unroll
  for (int w = 1; w < LANES; w++) sum[0] += sum[w];
  delta[r] = sum[0];
}

/* Where column c of key `key` lives in the transposed K and V tiles: [c / lanes][key][lane],
 * so the threads of a warp read consecutive words: no bank conflicts (d <= 64: Kt[c][j]). */
template <int LANES, int BC>
__device__ int transposed_index(int c, int key) {
  return ((c / LANES) * BC + key) * LANES + c % LANES;
}

/* dst += factor * acc over a thread's Dp columns (dst = factor * acc for the first partial,
 * since dst holds nothing yet); acc restarts from zero for the next partial. */
template <int Dp, int LANES>
__device__ void add_partial_sum(float *dst, float *acc, float factor, bool first) {
#pragma unroll
  for (int c = 0; c < Dp; c++) {
    if (first)
      dst[c * LANES] = factor * acc[c];
    else
      dst[c * LANES] += factor * acc[c];
    acc[c] = 0.f;
  }
}

/* row_lanes(D) threads per key j of the block's BC keys (Bc_bwd, or Bc_bwd_small where shared
 * memory is smaller). K and V are stored transposed in shared memory (transposed_index) so
 * that a warp reads consecutive words. Q and dO rows are read by all threads at once:
 * broadcasts. */
template <int D, int BC>
__global__ void __launch_bounds__(row_lanes(D) * BC)
    flash_backward_dkdv_kernel(const float *__restrict__ q, const float *__restrict__ k,
                               const float *__restrict__ v, const float *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               float *__restrict__ dk, float *__restrict__ dv, int nq, int nkv,
                               int heads, float scale, int causal) {
  constexpr int LANES = row_lanes(D), Dp = D / LANES; /* Dp: the columns one thread owns */
  extern __shared__ float4 smem_bwd[];
  float *Kt = reinterpret_cast<float *>(smem_bwd), *Vt = Kt + D * BC;
  float *Qs = Vt + D * BC, *dOs = Qs + Br_bwd * D;
  float *lse_s = dOs + Br_bwd * D, *delta_s = lse_s + Br_bwd;
  int key_blocks = (nkv + BC - 1) / BC;
  long bh = blockIdx.x / key_blocks;
  int key = threadIdx.x / LANES, part = threadIdx.x % LANES;
  int j0 = (int)(blockIdx.x % key_blocks) * BC, j = j0 + key;
  int cols = min(BC, nkv - j0), offset = nkv - nq;
  const float *K = k + (bh * nkv + j0) * D, *V = v + (bh * nkv + j0) * D;
  /* Coalesced reads of the K and V rows, written transposed. */
  for (int e = threadIdx.x; e < BC * D; e += blockDim.x) {
    int row = e / D, c = e % D;
    Kt[transposed_index<LANES, BC>(c, row)] = row < cols ? K[e] : 0.f;
    Vt[transposed_index<LANES, BC>(c, row)] = row < cols ? V[e] : 0.f;
  }
  float dk_acc[Dp], dv_acc[Dp];
#pragma unroll
  for (int c = 0; c < Dp; c++) dk_acc[c] = 0.f, dv_acc[c] = 0.f;
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  float *dk_j = dk + (bh * nkv + j) * D + part, *dv_j = dv + (bh * nkv + j) * D + part;
  bool first = true;
  int tiles = 0; /* tiles in the register partial sums */
  for (int i0 = i_begin; i0 < nq; i0 += Br_bwd) {
    int rows = min(Br_bwd, nq - i0);
    __syncthreads(); /* WAR: every thread is done with the previous Q/dO tile (and, the first
                      * time, the K and V tiles are complete before anyone reads them) */
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
      Qs[e] = q[(bh * nq + i0) * D + e];
      dOs[e] = d_o[(bh * nq + i0) * D + e];
    }
    if (threadIdx.x < rows) {
      lse_s[threadIdx.x] = lse[bh * nq + i0 + threadIdx.x];
      delta_s[threadIdx.x] = delta[bh * nq + i0 + threadIdx.x];
    }
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D are in shared memory before use */
    for (int r = 0; r < rows; r++) {
      bool visible = j < nkv && (!causal || j <= i0 + r + offset);
      const float *Q_r = Qs + r * D + part, *dO_r = dOs + r * D + part;
      const float *K_j = Kt + key * LANES + part, *V_j = Vt + key * LANES + part;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int c = 0; c < Dp; c++) s += Q_r[c * LANES] * K_j[c * BC * LANES];
      s = sum_over_row_lanes<LANES>(s);
      /* P from the saved LSE, the logit rounded as the forward rounded it (__fmul_rn: no fma
       * with the subtraction); a masked entry is 0 (and exp is never asked for it, so a row
       * that sees no key, LSE = -inf, cannot make a NaN). */
      float prob = visible ? expf(__fmul_rn(scale, s) - lse_s[r]) : 0.f;
#pragma unroll
      for (int c = 0; c < Dp; c++) {
        dv_acc[c] += prob * dO_r[c * LANES];
        dp += dO_r[c * LANES] * V_j[c * BC * LANES];
      }
      float ds = prob * (sum_over_row_lanes<LANES>(dp) - delta_s[r]);
#pragma unroll
      for (int c = 0; c < Dp; c++) dk_acc[c] += ds * Q_r[c * LANES];
    }
    /* Every Tiles_per_partial tiles the register partial sums go to dK and dV. */
    if (++tiles == Tiles_per_partial) {
      if (j < nkv) {
        add_partial_sum<Dp, LANES>(dk_j, dk_acc, scale, first);
        add_partial_sum<Dp, LANES>(dv_j, dv_acc, 1.f, first);
      }
      first = false, tiles = 0;
    }
  }
  /* The last partial sums; a key that no query sees writes its zeros here. */
  if (j < nkv && (tiles > 0 || first)) {
    add_partial_sum<Dp, LANES>(dk_j, dk_acc, scale, first);
    add_partial_sum<Dp, LANES>(dv_j, dv_acc, 1.f, first);
  }
}

/* LANES threads per query row, the forward's grid and K/V tiles:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D>
__global__ void __launch_bounds__(row_lanes(D) * Br)
    flash_backward_dq_kernel(const float *__restrict__ q, const float *__restrict__ k,
                             const float *__restrict__ v, const float *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             float *__restrict__ dq, int nq, int nkv, int heads, float scale,
                             int causal) {
  constexpr int LANES = row_lanes(D), Dp = D / LANES;
  extern __shared__ float4 smem[];
  float *Ks = reinterpret_cast<float *>(smem), *Vs = Ks + Bc * D;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int i = i0 + threadIdx.x / LANES, part = threadIdx.x % LANES;
  bool has_row = i < nq;
  const float *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float q_row[Dp], do_row[Dp], dq_acc[Dp];
#pragma unroll
  for (int c = 0; c < Dp; c++) {
    q_row[c] = has_row ? q[(bh * nq + i) * D + c * LANES + part] : 0.f;
    do_row[c] = has_row ? d_o[(bh * nq + i) * D + c * LANES + part] : 0.f;
    dq_acc[c] = 0.f;
  }
  float lse_i = has_row ? lse[bh * nq + i] : 0.f, delta_i = has_row ? delta[bh * nq + i] : 0.f;
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  for (int j0 = 0; j0 < kv_end; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    int row_cols = causal ? max(0, min(cols, i + offset + 1 - j0)) : cols;
    load_kv_tile<D>(K + (long)j0 * D, V + (long)j0 * D, cols, Ks, Vs);
    __syncthreads(); /* RAW: the whole tile is in shared memory before any row reads it */
    /* Every thread runs all cols keys (the shuffles need the whole warp); the keys past
     * its row's row_cols get dS = 0, and exp is never asked for them. */
    for (int j = 0; j < cols; j++) {
      const float *K_j = Ks + j * D + part, *V_j = Vs + j * D + part;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int c = 0; c < Dp; c++) {
        s += q_row[c] * K_j[c * LANES];
        dp += do_row[c] * V_j[c * LANES];
      }
      s = sum_over_row_lanes<LANES>(s);
      dp = sum_over_row_lanes<LANES>(dp);
      float ds = j < row_cols ? expf(__fmul_rn(scale, s) - lse_i) * (dp - delta_i) : 0.f;
#pragma unroll
      for (int c = 0; c < Dp; c++) dq_acc[c] += ds * K_j[c * LANES];
    }
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  if (has_row) {
#pragma unroll
    for (int c = 0; c < Dp; c++) dq[(bh * nq + i) * D + c * LANES + part] = scale * dq_acc[c];
  }
}

template <int D, int BC>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC>, dkdv_bytes(D, BC),
                             "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + BC - 1) / BC * heads);
  flash_backward_dkdv_kernel<D, BC>
      <<<key_blocks, BC * row_lanes(D), dkdv_bytes(D, BC), attn_stream()>>>(
          (const float *)t->q, (const float *)t->k, (const float *)t->v, (const float *)t->d_o,
          t->lse, delta, (float *)t->dk, (float *)t->dv, p->seq_q, p->seq_kv, heads, p->scale,
          p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <int D>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q;
  float *delta = (float *)t->workspace;
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  unsigned delta_blocks = (unsigned)((rows + delta_threads - 1) / delta_threads);
  compute_delta_kernel<D><<<delta_blocks, delta_threads, 0, attn_stream()>>>(
      (const float *)t->o, (const float *)t->d_o, delta, rows);
  CHECK_LAUNCH("compute_delta_kernel");
  if (dkdv_bytes(D, Bc_bwd) <= attn_shared_memory_limit())
    launch_dkdv<D, Bc_bwd>(p, t, delta);
  else
    launch_dkdv<D, Bc_bwd_small>(p, t, delta);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D>, tile_bytes(D),
                             "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Br - 1) / Br * heads);
  flash_backward_dq_kernel<D><<<row_blocks, Br * row_lanes(D), tile_bytes(D), attn_stream()>>>(
      (const float *)t->q, (const float *)t->k, (const float *)t->v, (const float *)t->d_o, t->lse,
      delta, (float *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch_backward<32>(p, t); break;
    case 64: launch_backward<64>(p, t); break;
    case 128: launch_backward<128>(p, t); break;
  }
}

static const attn_stage stage = {
    .name = "06_backward",
    .idea = "the backward: recompute P from LSE tile by tile; dK, dV per key, then dQ per query",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
