/* Stage 07: the matrix products on tensor cores, through nvcuda::wmma, in fp16 or bf16.
 *
 * The forward is stage 06's with S = Q K^T and O += P V on WMMA. The backward never stores
 * P: it recomputes P_ij = exp(S_ij - LSE_i) tile by tile from Q, K and LSE. Three kernels:
 *   compute_delta_kernel         D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i))
 *   flash_backward_dkdv_kernel   a warp per 16 keys j, walking the query tiles:
 *                                dV_j += P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - D_i),
 *                                dK_j += scale dS_ij Q_i      (dK, dV in registers)
 *   flash_backward_dq_kernel     a warp per 16 queries i, walking the key tiles like the
 *                                forward: dQ_i += scale dS_ij K_j  (dQ in registers)
 * A warp multiplies its rows on tensor cores (fp16 or bf16 in, fp32 accumulation). WMMA
 * does not say which lane holds which element of a fragment, so each thread reads its row of
 * a product from shared memory, and P and dS go back there as operands (not so in stage 08).
 * dQ gets its own pass instead of atomics from the dK/dV kernel: it recomputes S and dP
 * once more (7 d instead of 5 d multiply-adds per (i, j)), and in exchange every gradient
 * is written by exactly one thread, so the backward is deterministic.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <mma.h>
#include <type_traits>

#include "attention.h"
#include "gpu.h"

using namespace nvcuda;
/* WMMA's m16n16k16: 16 rows a warp, LANES threads a row; thread `part`: columns c * LANES + part */
constexpr int Frag = 16, LANES = 32 / Frag;
__host__ __device__ constexpr int threads_for(int rows) { return rows * LANES; }
using FragAcc = wmma::fragment<wmma::accumulator, Frag, Frag, Frag, float>;
/* Query rows per block: 4 warps share a K/V tile (forward: 2 blocks an SM, else d >= 64 spills) */
constexpr int Br = 4 * Frag;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small;
 * 64 keys are 4 fragments, 32 scores a thread, and a warp's S is staged in 4 KiB. */
constexpr int Bc = 64;
/* Padding of every shared-memory row, in bytes: unpadded rows of 64 to 256 bytes start on one
 * or two banks, where the rows of a fragment load would queue; 16 bytes shift a row 4 banks.
 * padded<E>(cols) is the leading dimension of a tile of `cols` elements of E per row. */
constexpr int Skew = 16;
static_assert(Skew % 16 == 0, "rows stay 16-byte aligned for 16-byte copies and fragment loads");
template <typename E>
__host__ __device__ constexpr int padded(int cols) {
  return cols + Skew / (int)sizeof(E);
}

/* Shared memory: K, V (bc rows), `rows` rows of Q (or Q, dO); per query an fp32 S/O and a P row */
template <typename T>
static constexpr size_t tile_bytes(int d, int bc, int rows) {
  return sizeof(T) * (2 * (size_t)bc + rows) * padded<T>(d) +
         Br * (sizeof(float) * padded<float>(bc) + sizeof(T) * padded<T>(bc));
}

/* Rows [0, rows) of a [*, D] tensor into a tile of ROWS padded rows; the rows past `rows` are
 * zeroed, since they enter the products (where 0 times a stale NaN is NaN). */
template <int D, int ROWS, typename T>
__device__ void load_tile(const T *src, int rows, T *dst) {
  constexpr int W = D * sizeof(T) / 16; /* float4s per row */
  for (int e = threadIdx.x; e < ROWS * W; e += blockDim.x) {
    int r = e / W;
    reinterpret_cast<float4 *>(dst + r * padded<T>(D))[e % W] =
        r < rows ? reinterpret_cast<const float4 *>(src)[e] : float4{};
  }
}

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (blockDim.x, not Br:
 * the dK/dV kernel reuses this with more threads per block, and for Q and dO: ROWS.) */
template <int D, int ROWS = Bc, typename T>
__device__ void load_kv_tile(const T *K, const T *V, int cols, T *Ks, T *Vs) {
  load_tile<D, ROWS>(K, cols, Ks), load_tile<D, ROWS>(V, cols, Vs);
}

/* acc (16 x N) += A B, A the warp's 16 rows; a col_major B is the rows of an N x K tile (K's) */
template <typename Layout, int N, int K, typename T>
__device__ void mma_tile(FragAcc *acc, const T *A, int lda, const T *B, int ldb) {
  static_assert(N % Frag == 0 && K % Frag == 0, "whole fragments");
  constexpr bool transposed = std::is_same_v<Layout, wmma::col_major>;
  A += threadIdx.x / LANES / Frag * Frag * lda; /* the warp's first row */
#pragma unroll
  for (int kk = 0; kk < K; kk += Frag) {
    wmma::fragment<wmma::matrix_a, Frag, Frag, Frag, T, wmma::row_major> a;
    wmma::load_matrix_sync(a, A + kk, lda);
#pragma unroll
    for (int n = 0; n < N; n += Frag) {
      wmma::fragment<wmma::matrix_b, Frag, Frag, Frag, T, Layout> b;
      wmma::load_matrix_sync(b, B + (transposed ? n * ldb + kk : kk * ldb + n), ldb);
      wmma::mma_sync(acc[n / Frag], a, b, acc[n / Frag]);
    }
  }
}

/* The warp's accumulators (16 x N) go to its rows of the staging tile S; returns the thread's
 * row there, its columns at [c * LANES], valid until the warp stages again. */
template <int N>
__device__ const float *stage_rows(const FragAcc *acc, float *S, int lds) {
  int w = threadIdx.x / LANES / Frag * Frag; /* the warp's first row */
  __syncwarp(); /* WAR: the warp's threads have read what it staged before */
#pragma unroll
  for (int n = 0; n < N / Frag; n++)
    wmma::store_matrix_sync(S + w * lds + n * Frag, acc[n], lds, wmma::mem_row_major);
  __syncwarp(); /* RAW: the warp's rows are staged before its threads read them */
  return S + threadIdx.x / LANES * lds + threadIdx.x % LANES;
}

/* The thread's row of A B (as mma_tile), through the staging tile S (as stage_rows). */
template <typename Layout, int N, int K, typename T>
__device__ const float *stage_product(const T *A, int lda, const T *B, int ldb, float *S, int lds) {
  FragAcc acc[N / Frag];
#pragma unroll
  for (int n = 0; n < N / Frag; n++) wmma::fill_fragment(acc[n], 0.f);
  mma_tile<Layout, N, K>(acc, A, lda, B, ldb);
  return stage_rows<N>(acc, S, lds);
}

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
   * fill the tail (measured at N = 4096, d = 64: ordered per head, the heavy blocks of the
   * last heads started last and causal was only 1.57x faster than non-causal; ordered
   * across heads, 1.88x). Non-causal blocks are equal, so a head's blocks stay adjacent and
   * share its K and V in L2 (ordered across heads instead: 6.5% slower). */
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

/* ---- the backward ------------------------------------------------------------------ */

/* Keys per dK/dV block, 16 a warp: 8 warps, so that each Q and dO tile serves 128 keys
 * (stage 08 on an H100, fp16, N = 4096 and 16384: 8 warps 35% faster than 4 at d = 128). */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys, half the K and V tiles (123 KiB at d = 128; sm_86 and sm_89 allow 99 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query rows per tile of the dK/dV kernel: 2 fragments (64: 104 KiB at d = 128, small). */
constexpr int Br_bwd = 32;
static_assert(Bc_bwd_small % Frag == 0 && Br_bwd <= threads_for(Bc_bwd_small),
              "whole warps of keys; a thread per query row loads LSE and D");

/* D of every row, then the bound on |dS| (DsStats floats). */
static size_t delta_floats(size_t rows) { return (rows + 3) / 4 * 4; }
constexpr int DsStats = 4; /* max |dO_i|^2 and max |V_j|^2, padded to 16 bytes */
static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) * (delta_floats(attn_lse_elems(p)) + DsStats);
}

/* Shared memory of the dK/dV kernel: K and V (bc x d), Q and dO tiles (Br_bwd x d), LSE and D
 * of their rows, and per key a staging row (fp32: S^T, then dP^T), a P^T and a dS^T row. */
template <typename T>
static constexpr size_t dkdv_bytes(int d, int bc) {
  return sizeof(T) * 2 * ((size_t)bc + Br_bwd) * padded<T>(d) +
         bc * (sizeof(float) * padded<float>(Br_bwd) + 2 * sizeof(T) * padded<T>(Br_bwd)) +
         sizeof(float) * 2 * Br_bwd;
}
static_assert(tile_bytes<__half>(128, Bc, 2 * Br) <= 99 * 1024 &&
                  dkdv_bytes<__half>(128, Bc_bwd_small) <= 99 * 1024,
              "every kernel has a configuration within the 99 KiB of sm_86 and sm_89");

/* dS = P (dP - D) is rounded to the dtype for the dK and dQ products, and fp16 ends at 65504:
 * with large V and dO and a small softmax scale |dS| passes that while the gradients stay
 * small. D_i is a P-weighted mean of row i's dP, so |dP_ij - D_i| <= 2 max_j |dO_i . V_j|, and
 * with P <= 1, |dS| <= 2 max|dO_i| max|V_j| (Euclidean norms of rows). In fp16 the kernels
 * multiply dS by 2^-k before rounding it, k the least that brings this bound under 2^DsLimitLog2,
 * and dK and dQ by 2^k after their fp32 sums: powers of two, so both steps are exact (bar
 * elements that fall below fp16's normal range, 2^-14 of the bound and less). bf16 has fp32's
 * range and needs none of it. */
constexpr int DsLimitLog2 = 15; /* 2^15: half of fp16's range, leaving room for rounding */
constexpr int DsMaxShift = 64;  /* norms of finite fp16 rows need far less */
__device__ float ds_scale(const float *stats) {
  if (!stats) return 1.f;
  int e;
  frexpf(2.f * sqrtf(stats[0]) * sqrtf(stats[1]), &e); /* the bound is below 2^e */
  return ldexpf(1.f, -min(max(e - DsLimitLog2, 0), DsMaxShift));
}

/* The largest of x over the block into *out (x >= 0, so its bits order as unsigned integers;
 * *out starts at 0): one atomic a block, not a thread. */
__device__ void block_max_into(float x, float *out) {
  __shared__ unsigned warp_max[32];
  unsigned bits = __reduce_max_sync(0xffffffffu, __float_as_uint(x));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads(); /* RAW: every warp's maximum is in shared memory */
  if (threadIdx.x < 32) {
    bits = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0u;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned *>(out), bits);
  }
}

/* D_i = sum_c dO_ic O_ic. (It equals sum_j dP_ij P_ij: the backward of the softmax needs
 * exactly this dot product, and O = P V makes it a d-term sum.) D / 8 adjacent threads share a
 * row, each reading 16 bytes of it, so that a warp reads whole rows, 512 contiguous bytes of
 * each tensor (a thread walking a row alone reads 32 rows d elements apart). With `stats`
 * (fp16), also max |dO_i|^2 and max |V_j|^2 into stats[0], stats[1] for ds_scale. */
template <int D, typename T>
__global__ void compute_delta_kernel(const T *o, const T *d_o, const T *v, float *delta,
                                     float *stats, long rows, long kv_rows) {
  constexpr int Chunk = 16 / sizeof(T), Lanes = D / Chunk; /* threads a row */
  static_assert(32 % Lanes == 0, "a row's threads are within one warp");
  long r = (blockIdx.x * (long)blockDim.x + threadIdx.x) / Lanes;
  long at = r * D + threadIdx.x % Lanes * Chunk;
  float sum = 0.f, do_norm2 = 0.f, v_norm2 = 0.f;
  if (r < rows) {
    float4 dov = *reinterpret_cast<const float4 *>(d_o + at);
    float4 ov = *reinterpret_cast<const float4 *>(o + at);
    const T *dos = reinterpret_cast<const T *>(&dov), *os = reinterpret_cast<const T *>(&ov);
#pragma unroll
    for (int c = 0; c < Chunk; c++) {
      float x = float(dos[c]);
      sum += x * float(os[c]), do_norm2 += x * x;
    }
  }
  if (stats && r < kv_rows) {
    float4 vv = *reinterpret_cast<const float4 *>(v + at);
    const T *vs = reinterpret_cast<const T *>(&vv);
#pragma unroll
    for (int c = 0; c < Chunk; c++) v_norm2 += float(vs[c]) * float(vs[c]);
  }
#pragma unroll
  for (int lane = Lanes / 2; lane > 0; lane /= 2) /* over the row's threads, adjacent lanes */
    sum += __shfl_xor_sync(0xffffffffu, sum, lane),
        do_norm2 += __shfl_xor_sync(0xffffffffu, do_norm2, lane),
        v_norm2 += __shfl_xor_sync(0xffffffffu, v_norm2, lane);
  if (r < rows && threadIdx.x % Lanes == 0) delta[r] = sum;
  if (!stats) return;
  block_max_into(do_norm2, stats);
  __syncthreads(); /* WAR: block_max_into's shared memory is read before it is reused */
  block_max_into(v_norm2, stats + 1);
}

/* A warp per 16 keys j of the block's BC keys (Bc_bwd, or Bc_bwd_small where shared memory
 * is smaller), keeping their dK and dV in accumulators while it walks the query tiles: per
 * tile it stages S^T = K Q^T and dP^T = V dO^T, makes P^T and dS^T: dV += P^T dO, dK += dS^T Q. */
template <int D, int BC, typename T>
__global__ void __launch_bounds__(threads_for(BC))
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               const float *__restrict__ ds_stats, T *__restrict__ dk,
                               T *__restrict__ dv, int nq, int nkv, int heads, float scale,
                               int causal) {
  constexpr int ld = padded<T>(D), ld_s = padded<float>(Br_bwd), ld_p = padded<T>(Br_bwd);
  extern __shared__ __align__(32) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + BC * ld;
  T *Qs = Vs + BC * ld, *dOs = Qs + Br_bwd * ld;
  float *St = reinterpret_cast<float *>(dOs + Br_bwd * ld); /* a staging row per key */
  T *Pt = reinterpret_cast<T *>(St + BC * ld_s), *dSt = Pt + BC * ld_p;
  float *lse_s = reinterpret_cast<float *>(dSt + BC * ld_p), *delta_s = lse_s + Br_bwd;
  int key_blocks = (nkv + BC - 1) / BC;
  long bh = blockIdx.x / key_blocks;
  int key = threadIdx.x / LANES, part = threadIdx.x % LANES;
  int j0 = (int)(blockIdx.x % key_blocks) * BC, j = j0 + key;
  int cols = min(BC, nkv - j0), offset = nkv - nq;
  const float dss = ds_scale(ds_stats);
  load_kv_tile<D, BC>(k + (bh * nkv + j0) * D, v + (bh * nkv + j0) * D, cols, Ks, Vs);
  FragAcc dk_acc[D / Frag], dv_acc[D / Frag];
#pragma unroll
  for (int c = 0; c < D / Frag; c++)
    wmma::fill_fragment(dk_acc[c], 0.f), wmma::fill_fragment(dv_acc[c], 0.f);
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  for (int i0 = i_begin; i0 < nq; i0 += Br_bwd) {
    int rows = min(Br_bwd, nq - i0);
    __syncthreads(); /* WAR: every thread is done with the previous Q/dO tile (and, the first
                      * time, the K and V tiles are complete before anyone reads them) */
    load_kv_tile<D, Br_bwd>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, rows, Qs, dOs);
    if (threadIdx.x < rows) {
      lse_s[threadIdx.x] = lse[bh * nq + i0 + threadIdx.x];
      delta_s[threadIdx.x] = delta[bh * nq + i0 + threadIdx.x];
    }
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D are in shared memory before use */
    const float *S_j = stage_product<wmma::col_major, Br_bwd, D>(Ks, ld, Qs, ld, St, ld_s);
    float prob[Br_bwd / LANES];
#pragma unroll
    for (int c = 0, r = part; c < Br_bwd / LANES; c++, r += LANES) {
      bool visible = r < rows && j < nkv && (!causal || j <= i0 + r + offset);
      /* P from the saved LSE; a masked entry is 0 (and exp is never asked for it, so a row
       * that sees no key, LSE = -inf, cannot make a NaN). */
      /* P <= 1, but an fp32 LSE of logits near 1e11 is off by up to 4096: exp(4096) = inf */
      prob[c] = visible ? fminf(1.f, expf(scale * S_j[c * LANES] - lse_s[r])) : 0.f;
      Pt[key * ld_p + r] = T(prob[c]);
    }
    const float *dP_j = stage_product<wmma::col_major, Br_bwd, D>(Vs, ld, dOs, ld, St, ld_s);
#pragma unroll
    for (int c = 0, r = part; c < Br_bwd / LANES; c++, r += LANES) /* no LSE or D past `rows` */
      dSt[key * ld_p + r] = T(r < rows ? prob[c] * (dP_j[c * LANES] - delta_s[r]) * dss : 0.f);
    __syncwarp(); /* RAW: the warp's rows of P^T and dS^T are whole before they load */
    mma_tile<wmma::row_major, D, Br_bwd>(dv_acc, Pt, ld_p, dOs, ld);
    mma_tile<wmma::row_major, D, Br_bwd>(dk_acc, dSt, ld_p, Qs, ld);
  }
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += Br_bwd) { /* through St, Br_bwd columns at a time */
    const float *dK_j = stage_rows<Br_bwd>(dk_acc + c0 / Frag, St, ld_s);
#pragma unroll
    for (int c = 0; c < Br_bwd / LANES; c++)
      if (j < nkv)
        dk[(bh * nkv + j) * D + c0 + c * LANES + part] = T(scale / dss * dK_j[c * LANES]);
    const float *dV_j = stage_rows<Br_bwd>(dv_acc + c0 / Frag, St, ld_s);
#pragma unroll
    for (int c = 0; c < Br_bwd / LANES; c++)
      if (j < nkv) dv[(bh * nkv + j) * D + c0 + c * LANES + part] = T(dV_j[c * LANES]);
  }
}

/* LANES threads per query row, the forward's grid and K/V tiles:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br))
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             const float *__restrict__ ds_stats, T *__restrict__ dq, int nq,
                             int nkv, int heads, float scale, int causal) {
  constexpr int ld = padded<T>(D), ld_s = padded<float>(Bc), ld_p = padded<T>(Bc);
  extern __shared__ __align__(32) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + Bc * ld, *Qs = Vs + Bc * ld;
  float *Ss = reinterpret_cast<float *>(Qs + Br * ld); /* a staging row per query row */
  T *dSs = reinterpret_cast<T *>(Ss + Br * ld_s), *dOs = dSs + Br * ld_p;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int i = i0 + threadIdx.x / LANES, part = threadIdx.x % LANES;
  bool has_row = i < nq;
  const float dss = ds_scale(ds_stats);
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  load_kv_tile<D, Br>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, min(Br, nq - i0), Qs, dOs);
  FragAcc dq_acc[D / Frag];
#pragma unroll
  for (int c = 0; c < D / Frag; c++) wmma::fill_fragment(dq_acc[c], 0.f);
  float lse_i = has_row ? lse[bh * nq + i] : 0.f, delta_i = has_row ? delta[bh * nq + i] : 0.f;
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  for (int j0 = 0; j0 < kv_end; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    int row_cols = causal ? max(0, min(cols, i + offset + 1 - j0)) : cols;
    load_kv_tile<D>(K + (long)j0 * D, V + (long)j0 * D, cols, Ks, Vs);
    __syncthreads(); /* RAW: the whole tile (the first time, Q and dO too) is in shared memory */
    /* The clamp P <= 1 is the dK/dV kernel's; the keys past
     * its row's row_cols get dS = 0, and exp is never asked for them. */
    const float *S_i = stage_product<wmma::col_major, Bc, D>(Qs, ld, Ks, ld, Ss, ld_s);
    float prob[Bc / LANES];
#pragma unroll
    for (int c = 0, j = part; c < Bc / LANES; c++, j += LANES)
      prob[c] = j < row_cols ? fminf(1.f, expf(scale * S_i[c * LANES] - lse_i)) : 0.f;
    const float *dP_i = stage_product<wmma::col_major, Bc, D>(dOs, ld, Vs, ld, Ss, ld_s);
#pragma unroll
    for (int c = 0, j = part; c < Bc / LANES; c++, j += LANES)
      dSs[threadIdx.x / LANES * ld_p + j] = T(prob[c] * (dP_i[c * LANES] - delta_i) * dss);
    __syncwarp(); /* RAW: the warp's rows of dS are whole before they load */
    mma_tile<wmma::row_major, D, Bc>(dq_acc, dSs, ld_p, Ks, ld);
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += Frag) { /* through Ss, a fragment's columns at a time */
    const float *dQ_i = stage_rows<Frag>(dq_acc + c0 / Frag, Ss, ld_s);
#pragma unroll
    for (int c = 0; c < Frag / LANES; c++)
      if (has_row) dq[(bh * nq + i) * D + c0 + c * LANES + part] = T(scale / dss * dQ_i[c * LANES]);
  }
}

template <int D, int BC, typename T>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta,
                        const float *ds_stats) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC, T>,
                             dkdv_bytes<T>(D, BC), "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + BC - 1) / BC * heads);
  flash_backward_dkdv_kernel<D, BC>
      <<<key_blocks, threads_for(BC), dkdv_bytes<T>(D, BC), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          ds_stats, (T *)t->dk, (T *)t->dv, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <int D, typename T = __half>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch_backward<D, __nv_bfloat16>(p, t);
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q, kv_rows = (long)heads * p->seq_kv;
  float *delta = (float *)t->workspace;
  /* The bound on |dS| in fp16 only (ds_scale); bf16 passes none. */
  float *ds_stats = std::is_same_v<T, __half> ? delta + delta_floats(rows) : nullptr;
  if (ds_stats) CUDA_CHECK(cudaMemsetAsync(ds_stats, 0, sizeof(float) * DsStats, attn_stream()));
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  long delta_rows = ds_stats ? max(rows, kv_rows) : rows, lanes = D * sizeof(T) / 16;
  long delta_grid = (delta_rows * lanes + delta_threads - 1) / delta_threads;
  compute_delta_kernel<D><<<(unsigned)delta_grid, delta_threads, 0, attn_stream()>>>(
      (const T *)t->o, (const T *)t->d_o, (const T *)t->v, delta, ds_stats, rows, kv_rows);
  CHECK_LAUNCH("compute_delta_kernel");
  if (dkdv_bytes<T>(D, Bc_bwd) <= attn_shared_memory_limit())
    launch_dkdv<D, Bc_bwd, T>(p, t, delta, ds_stats);
  else
    launch_dkdv<D, Bc_bwd_small, T>(p, t, delta, ds_stats);
  size_t dq_bytes = tile_bytes<T>(D, Bc, 2 * Br);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D, T>, dq_bytes,
                             "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Br - 1) / Br * heads);
  flash_backward_dq_kernel<D><<<row_blocks, threads_for(Br), dq_bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta, ds_stats,
      (T *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
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
    .name = "07_tensor_cores",
    .idea = "the matrix products on tensor cores through WMMA: fp16/bf16 in, fp32 accumulation",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
