/* Stage 12's tiles and products: the block's shape, the five products of the backward as
 * wgmma (S^T, dP^T and dQ from shared memory, dV and dK with P^T and dS^T from registers), and
 * the element-wise steps between them (P^T, dS^T, dS^T's store for dQ). backward.cuh walks
 * them over the query tiles. */
#pragma once

#include "../10_hopper_wgmma/forward_softmax.cuh"

/* Keys per block: two consumer warpgroups of WgmmaM keys, the M of S^T = K Q^T. */
constexpr int HbConsumers = 2, HbKeys = HbConsumers * WgmmaM;
/* Queries per tile: the N of S^T and dP^T and the K of dV += P^T dO and dK += dS^T Q. At
 * d = 128, 64 (S^T and dP^T take 32 registers each a thread): with dK and dV in registers
 * (128 a thread), that is what 240 registers hold; FlashAttention-3 uses 64 to 80. At d = 64,
 * where dK and dV take 64, 128: twice the products for each tile's exponentials, barriers and
 * dQ addition, and an SS wgmma of N = 128, which needs less of shared memory's bandwidth for
 * its work than one of N = 64 (10's Bc). */
__host__ __device__ constexpr int hb_rows(int d) { return d > 64 ? 64 : 128; }
/* dS^T is stored in boxes of 64 queries, one 128-byte swizzled row a key. */
constexpr int DsBoxRows = 64;
/* A consumer's share of dQ = dS K: one box of 64 queries by dq_cols(d) columns, one SS product
 * of N = 64 a k-step. At d = 128 (a tile is one box) the consumers split d; at d = 64 (two
 * boxes) they split the queries, so that no product is N = 32, which would read as many bytes
 * of A from shared memory for half the work. */
__host__ __device__ constexpr int dq_cols(int d) {
  return d * (hb_rows(d) / DsBoxRows) / HbConsumers;
}
__host__ __device__ constexpr bool dq_split_by_box(int d) {
  return hb_rows(d) / DsBoxRows == HbConsumers;
}
/* Query tiles in flight: the copies of the next tiles run while tile t is multiplied. At
 * d = 128 three stages fit in 227 KiB and hide more of the copies' latency than two; at d = 64,
 * whose dS^T buffers are twice the bytes (128 queries), three would need 1,080 bytes more than
 * a block may have, and two is what fits. */
__host__ __device__ constexpr int hb_stages(int d) { return d > 64 ? 3 : 2; }
/* dS^T buffers: 2, so that a warpgroup writes tile t + 1's while the other still reads tile
 * t's for dQ; the consumers then meet once a tile, not twice. */
constexpr int HbDsBuffers = 2;
/* Causal blocks go by key block across a group of 16 heads, not across every head: a wave of
 * 132 SMs then holds about 8 key blocks of each of its heads, which walk the same query tiles
 * a few tiles apart, so that their Q, dO and fp32 dQ tiles are read and added in L2. Across
 * every head (0), a wave at N = 4096 holds one block a head, and each tile comes from DRAM
 * once a block (command G in docs/techniques.md). */
#ifndef ATTN_HB_CAUSAL_HEADS
#define ATTN_HB_CAUSAL_HEADS 16
#endif
constexpr int CausalHeadGroup = ATTN_HB_CAUSAL_HEADS;
constexpr int HbThreads = (1 + HbConsumers) * WarpgroupThreads;
/* Named barriers: 0 is __syncthreads'; 1 joins the two consumer warpgroups, 2 + c one. */
constexpr int ConsumersBarrier = 1, WarpgroupBarrier = 2;
/* The producer's warps: 0 issues the copies, 1 writes each tile's LSE and D. */
constexpr int CopyWarp = 0, RowStatsWarp = 1;

/* wgmma m64nNk16 with both operands in shared memory and their transpose bits: C (64 x N,
 * fp32) += A (64 x 16) B (16 x N). Used for S^T and dP^T (N = HbRows, K-major operands) and for
 * dQ (N = dq_cols(D), both operands MN-major, read transposed). */
#define HB_SS(TYPE, N, REGS, ACC, TA, TB) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC_N(N) ", 0;\n"                   \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS \
               "}, %" DESC_A(N) ", %" DESC_B(N) ", p, 1, 1, " #TA ", " #TB ";\n}\n"      \
               : ACC                                                                     \
               : "l"(a), "l"(b), "r"(accumulate))
#define ACC_N(N) ACC_N_##N
#define ACC_N_128 "66"
#define ACC_N_64 "34"
#define DESC_A(N) DESC_A_##N
#define DESC_A_128 "64"
#define DESC_A_64 "32"
#define DESC_B(N) DESC_B_##N
#define DESC_B_128 "65"
#define DESC_B_64 "33"
template <int N, int TRANS, typename T>
__device__ void wgmma_ss(float *d, uint64_t a, uint64_t b, int accumulate) {
  constexpr bool half = std::is_same_v<T, __half>;
  if constexpr (N == 128 && !TRANS && half) HB_SS("f16", 128, WG_REGS64, WG_ACC64, 0, 0);
  if constexpr (N == 128 && !TRANS && !half) HB_SS("bf16", 128, WG_REGS64, WG_ACC64, 0, 0);
  if constexpr (N == 64 && !TRANS && half) HB_SS("f16", 64, WG_REGS32, WG_ACC32, 0, 0);
  if constexpr (N == 64 && !TRANS && !half) HB_SS("bf16", 64, WG_REGS32, WG_ACC32, 0, 0);
  if constexpr (N == 64 && TRANS && half) HB_SS("f16", 64, WG_REGS32, WG_ACC32, 1, 1);
  if constexpr (N == 64 && TRANS && !half) HB_SS("bf16", 64, WG_REGS32, WG_ACC32, 1, 1);
  static_assert(N == 128 ? !TRANS : N == 64, "the shapes this backward issues");
}

/* A descriptor moved on by `bytes` in the same shared memory: its start address field (bits
 * 0-13, the address / 16) grows by bytes / 16, and never carries, for the block's shared
 * memory ends below 256 KiB. One descriptor an operand a product, then a constant added per
 * k-step: the issuing warps spend an instruction, not a dozen, between two wgmma. */
__device__ uint64_t advance(uint64_t desc, unsigned bytes) { return desc + (bytes >> 4); }

/* S^T (or dP^T) = A B^T for one query tile: A the warpgroup's 64 keys of K (or V), B the
 * tile's Rows rows of Q (or dO), both K-major (d along the rows), one wgmma a k-step of 16
 * of d. A's rows are rows [64 c, 64 c + 64) of the HbKeys-row tile. */
template <int D, typename T>
__device__ void issue_scores(const T *A, const T *B, float (*s)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T), HbRows = hb_rows(D);
  const uint64_t a0 = operand_descriptor<Cols * sizeof(T)>(A, 16, Atom);
  const uint64_t b0 = operand_descriptor<Cols * sizeof(T)>(B, 16, Atom);
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    const int box = kk * MmaK / Cols, col = kk * MmaK % Cols;
    wgmma_ss<HbRows, 0, T>(&s[0][0], advance(a0, (box * HbKeys * Cols + col) * sizeof(T)),
                           advance(b0, (box * HbRows * Cols + col) * sizeof(T)), kk > 0);
  }
}

/* dV += P^T dO (or dK += dS^T Q): A from registers (the keys' P^T, 16 queries a k-step), B the
 * tile's rows of dO (or Q), MN-major (d along the rows), read transposed as 10's V is. */
template <int D, typename T>
__device__ void issue_update(const unsigned (*a)[4], const T *B, float (*acc)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T), HbRows = hb_rows(D);
  const uint64_t b0 = operand_descriptor<Cols * sizeof(T)>(B, HbRows * Cols * sizeof(T), Atom);
#pragma unroll
  for (int kk = 0; kk < HbRows / MmaK; kk++)
    wgmma_pv<D, T>(&acc[0][0], a[kk], advance(b0, kk * MmaK * Cols * sizeof(T)));
}

/* Consumer c's share of dQ = dS K (see dq_cols): A = dS, its box of 64 queries read transposed
 * from dS^T (keys down, queries along a 128-byte row), B = K's dq_cols(D) columns from c0, read
 * transposed (keys down): HbKeys / 16 k-steps over all the block's keys. */
template <int D, typename T>
__device__ void issue_dq(const T *dSt, const T *K, int c, float (*dq)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T), N = dq_cols(D);
  static_assert(dq_split_by_box(D) || hb_rows(D) == DsBoxRows, "one box a consumer");
  const int box = dq_split_by_box(D) ? c : 0, c0 = dq_split_by_box(D) ? 0 : c * N;
  const uint64_t a0 =
      operand_descriptor<128>(dSt + box * HbKeys * DsBoxRows, HbKeys * 128, 8 * 128);
  const uint64_t b0 = operand_descriptor<Cols * sizeof(T)>(
      K + c0 / Cols * HbKeys * Cols + c0 % Cols, HbKeys * Cols * sizeof(T), Atom);
#pragma unroll
  for (int kk = 0; kk < HbKeys / MmaK; kk++)
    wgmma_ss<N, 1, T>(&dq[0][0], advance(a0, kk * MmaK * DsBoxRows * sizeof(T)),
                      advance(b0, kk * MmaK * Cols * sizeof(T)), kk > 0);
}

/* The lane's elements of a 64 x 64 accumulator tile: row (key) w 16 + g + 8 (e / 2) of the
 * warpgroup, column (query) 8 n + 2 t + e % 2. P^T = 2^(s scale log2 e - LSE_i) in place of
 * S^T, 0 where masked (past the queries or keys, or above the causal diagonal), with LSE in
 * log2 units from the tile's row stats in shared memory; packed as the A operands of
 * dV += P^T dO (two accumulators per 16 queries). */
template <int ROWS, typename T>
__device__ void probabilities_t(float (*s)[4], const float *lse_s, float scale_log2, int i0, int jw,
                                int nq, int nkv, int offset, bool causal, bool masked,
                                unsigned (*p_frag)[4]) {
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  /* Two copies of the loop, chosen once a tile (masked is the same in the whole warp): inside
   * one loop the compiler guards each exponential with its own branch and reconvergence
   * point, a cost the unmasked tiles, nearly all of them, need not pay. */
  if (!masked) {
#pragma unroll
    for (int n = 0; n < ROWS / MmaN; n++) {
      float2 l2 = *reinterpret_cast<const float2 *>(lse_s + n * MmaN + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[n][e] = fminf(1.f, exp2_approx(fmaf(s[n][e], scale_log2, e % 2 ? -l2.y : -l2.x)));
    }
  } else {
#pragma unroll
    for (int n = 0; n < ROWS / MmaN; n++) {
      float2 l2 = *reinterpret_cast<const float2 *>(lse_s + n * MmaN + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int i = i0 + n * MmaN + 2 * tq + e % 2, j = jw + g + 8 * (e / 2);
        bool visible = i < nq && j < nkv && (!causal || j <= i + offset);
        s[n][e] = visible
                      ? fminf(1.f, exp2_approx(fmaf(s[n][e], scale_log2, e % 2 ? -l2.y : -l2.x)))
                      : 0.f;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < ROWS / MmaN; n++) {
    p_frag[n / 2][2 * (n % 2)] = pack2(s[n][0], s[n][1], T());
    p_frag[n / 2][2 * (n % 2) + 1] = pack2(s[n][2], s[n][3], T());
  }
}
/* The product of two packed pairs, element by element, rounded to nearest even. */
__device__ unsigned mul2(unsigned a, unsigned b, __half) {
  __half2 r =
      __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<unsigned *>(&r);
}
__device__ unsigned mul2(unsigned a, unsigned b, __nv_bfloat16) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&a),
                             *reinterpret_cast<const __nv_bfloat162 *>(&b));
  return *reinterpret_cast<unsigned *>(&r);
}

/* dS^T = P^T (dP^T ds_scale - D_i ds_scale), D ds_scale from the row stats, packed as the A
 * operands of dK += dS^T Q (see 09's probabilities_and_ds). P^T stays in its packed operands,
 * so that its fp32 values need no registers while dP^T is computed (at d = 128 the warpgroup
 * holds dK and dV, 128 registers a thread, besides), and the product is taken in pairs there:
 * dP^T ds_scale - D ds_scale is rounded to the dtype and multiplied by the pair of P^T, one
 * packed multiply for two elements in place of unpacking P^T and two fp32 multiplies. dS^T is
 * rounded twice (the difference, then the product): below 1.5 units in the last place of the
 * dtype, against 0.5. The dtype's range holds the difference: ds_scale bounds it as it bounds
 * dS. */
template <int ROWS, typename T>
__device__ void ds_t(const unsigned (*p_frag)[4], const float (*dp)[4], const float *delta_s,
                     float dss, unsigned (*ds_frag)[4]) {
  int tq = threadIdx.x % Quad;
#pragma unroll
  for (int n = 0; n < ROWS / MmaN; n++) {
    float2 dd = *reinterpret_cast<const float2 *>(delta_s + n * MmaN + 2 * tq);
    unsigned d01 = pack2(fmaf(dp[n][0], dss, -dd.x), fmaf(dp[n][1], dss, -dd.y), T());
    unsigned d23 = pack2(fmaf(dp[n][2], dss, -dd.x), fmaf(dp[n][3], dss, -dd.y), T());
    ds_frag[n / 2][2 * (n % 2)] = mul2(p_frag[n / 2][2 * (n % 2)], d01, T());
    ds_frag[n / 2][2 * (n % 2) + 1] = mul2(p_frag[n / 2][2 * (n % 2) + 1], d23, T());
  }
}
/* dS^T into shared memory for dQ = dS K, in boxes of DsBoxRows queries: row (key) r of the
 * block's HbKeys, 128 bytes of queries, chunk c of a row stored at chunk c ^ (r % 8), the
 * swizzle TMA and wgmma use. */
template <int ROWS, typename T>
__device__ void store_ds_t(const unsigned (*ds_frag)[4], T *dSt, int row0) {
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
#pragma unroll
  for (int kk = 0; kk < ROWS / MmaK; kk++)
#pragma unroll
    for (int reg = 0; reg < 4; reg++) { /* a[0]: rows 0-7, cols 0-7; a[1] rows 8-15; a[2..3] +8 */
      int r = row0 + g + 8 * (reg % 2), col = kk * MmaK + 8 * (reg / 2) + 2 * tq;
      char *box = reinterpret_cast<char *>(dSt + col / DsBoxRows * HbKeys * DsBoxRows);
      int byte = col % DsBoxRows * (int)sizeof(T), chunk = byte / 16 ^ r % 8;
      *reinterpret_cast<unsigned *>(box + r * 128 + chunk * 16 + byte % 16) = ds_frag[kk][reg];
    }
}
