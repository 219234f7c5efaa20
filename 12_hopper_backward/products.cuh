/* Stage 12's tiles and products: the block's shape and shared memory, the five products of
 * the backward as wgmma (S^T, dP^T and dQ from shared memory, dV and dK with P^T and dS^T from
 * registers), the element-wise steps between them (P^T, dS^T, dS^T's store for dQ), the
 * producer warpgroup's copies, and the dQ reduction's parts (the fp32 part's layout, the copy
 * engine's add, the deterministic path's turns, the conversion to the dtype) with the
 * workspace. backward.cuh walks them over the query tiles. */
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

/* The block's shared memory, each tile on an atom boundary: K and V (HbKeys rows), the ring of
 * Q and dO tiles (Rows rows) and of their rows' LSE and D, dS^T (HbKeys rows of Rows queries,
 * in boxes of DsBoxRows) in HbDsBuffers, each consumer's fp32 part of dQ, and the
 * mbarriers. */
template <int D, typename T>
struct HbLayout {
  static constexpr int Rows = hb_rows(D), Stages = hb_stages(D);
  static constexpr size_t key_tile = (size_t)HbKeys * D * sizeof(T);
  static constexpr size_t row_tile = (size_t)Rows * D * sizeof(T);
  static constexpr size_t ds_tile = (size_t)HbKeys * Rows * sizeof(T);
  static constexpr size_t dq_part = (size_t)Rows * D / HbConsumers * sizeof(float);
  static constexpr size_t k = 0, v = k + key_tile, q = v + key_tile;
  static constexpr size_t d_o = q + Stages * row_tile, ds = d_o + Stages * row_tile;
  static constexpr size_t dq = ds + HbDsBuffers * ds_tile;
  static constexpr size_t stats = dq + HbConsumers * dq_part; /* LSE, D: Rows floats each */
  static constexpr size_t barriers = stats + Stages * 2 * Rows * sizeof(float);
  static constexpr size_t bytes = barriers + (1 + 2 * Stages) * sizeof(uint64_t) + AtomAlignment;
  static_assert(DsBoxRows * sizeof(T) == 128 && Rows % DsBoxRows == 0,
                "a key's row of dS^T is whole 128-byte swizzled boxes");
  static_assert(key_tile % AtomAlignment == 0 && row_tile % AtomAlignment == 0 &&
                    ds_tile % AtomAlignment == 0 && dq_part % AtomAlignment == 0,
                "every tile starts on an atom boundary");
  static_assert(bytes <= 227 * 1024, "within the 227 KiB a block of an H100 or H200 may opt into");
};

/* The fp32 dQ of a query tile lives in global memory in the consumers' register order, not
 * row by row: element e of accumulator n of thread x (of WarpgroupThreads) of consumer c is
 * float c Rows D / 2 + n 4 WarpgroupThreads + 4 x + e of the tile's Rows D floats. A warp's float4
 * stores into shared memory are then whole lines, with no bank conflict, and the tile is one
 * contiguous block that one bulk copy adds into global memory. convert_dq_tiles puts the rows back
 * in order. */
template <int N_ACCS>
__device__ void store_dq_part(const float (*dq)[4], float *part) {
  int x = threadIdx.x % WarpgroupThreads;
#pragma unroll
  for (int n = 0; n < N_ACCS; n++)
    *reinterpret_cast<float4 *>(part + n * 4 * WarpgroupThreads + 4 * x) =
        make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]);
}

/* The copy engine's reduction: bytes of fp32 in shared memory added element by element into
 * global memory (PTX ISA: cp.reduce.async.bulk), one bulk group a call; wait_read<N> returns
 * when all but N groups have read their shared memory, wait_done<N> when they are complete. */
__device__ void bulk_add_f32(float *dst, const float *src, unsigned bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;" ::"l"(dst),
      "r"(shared_address(src)), "r"(bytes)
      : "memory");
}
__device__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
/* Orders this thread's shared-memory writes before the copy engine's and tensor cores' reads
 * of them (they read through the async proxy). */
__device__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* The deterministic path: a query tile's dQ sums its key blocks in their order. Key block kb
 * adds its part once the counter of (query head, tile, consumer) says kb blocks have added,
 * and moves it on when its addition is complete. Lower key blocks have lower block indices
 * for the same head, so they are running or done: the wait ends. */
__device__ void wait_turn(const int *counter, int turn) {
  int seen;
  do asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  while (seen != turn);
  asm volatile("fence.proxy.async.global;" ::: "memory"); /* before the copy engine's adds */
}
__device__ void pass_turn(int *counter, int next) {
  asm volatile("fence.proxy.async.global;" ::: "memory"); /* the adds, before the release */
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(counter), "r"(next) : "memory");
}

/* dQ = scale / ds_scale times the fp32 sums, in the dtype and in row order: a thread takes the
 * four floats of one accumulator (store_dq_part's order), two columns of two rows. The tiles
 * are [B, H, N, d]; dQ is laid out as `qs` says. */
template <int D, typename T>
__global__ void convert_dq_tiles(const float *dq_accum, const float *ds_stats, T *dq, long tiles,
                                 attn_strides qs, int nq, float scale) {
  constexpr int HbRows = hb_rows(D), PartFloats = HbRows * D / HbConsumers;
  long at = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 4;
  if (at >= tiles * HbRows * D) return;
  long tile = at / (HbRows * D);
  int in_tile = (int)(at % (HbRows * D)), c = in_tile / PartFloats;
  int n = in_tile % PartFloats / (4 * WarpgroupThreads), x = in_tile % (4 * WarpgroupThreads) / 4;
  int box = dq_split_by_box(D) ? c : 0, c0 = dq_split_by_box(D) ? 0 : c * dq_cols(D);
  int m_tiles = (nq + HbRows - 1) / HbRows;
  long head = tile / m_tiles;
  int r = (int)(tile % m_tiles) * HbRows + box * DsBoxRows + x / 32 * MmaM + x % 32 / Quad;
  int col = c0 + n * MmaN + 2 * (x % Quad);
  float4 v = *reinterpret_cast<const float4 *>(dq_accum + at);
  float f = scale / ds_scale(ds_stats);
  if (r < nq)
    *reinterpret_cast<unsigned *>(dq + row_start(qs, head, r) + col) = pack2(v.x * f, v.y * f, T());
  if (r + 8 < nq)
    *reinterpret_cast<unsigned *>(dq + row_start(qs, head, r + 8) + col) =
        pack2(v.z * f, v.w * f, T());
}

/* The workspace: D of every row, then from a 128-byte boundary the fp32 dQ tiles, the bound on
 * |dS| (DsStats floats) and the deterministic path's counters; at least 09's, for the shapes
 * that run 09's backward. */
static size_t hb_tile_floats(const attn_problem *p) {
  int rows = hb_rows(p->head_dim);
  return (size_t)p->batch * p->heads * ((p->seq_q + rows - 1) / rows) * rows * p->head_dim;
}
static size_t hb_turns(const attn_problem *p) {
  int rows = hb_rows(p->head_dim);
  return (size_t)p->batch * p->heads * ((p->seq_q + rows - 1) / rows) * HbConsumers;
}
static size_t hopper_backward_workspace(const attn_problem *p) {
  size_t ours = sizeof(float) * (delta_floats(attn_lse_elems(p)) + hb_tile_floats(p) + DsStats) +
                sizeof(int) * hb_turns(p);
  return ours > backward_workspace(p) ? ours : backward_workspace(p);
}

/* The producer warpgroup's work, after it has handed its registers over: one thread copies the
 * block's K and V (keys from j0 of K/V head bh_kv) once, then each query tile's Q and dO by
 * TMA into ring stage t % Stages, once every consumer thread has let go of that stage; one warp
 * writes the tile's rows of LSE and D. Tile t is query head bh_kv group + t / head_tiles (the
 * group's heads read this K and V), rows from (first + t % head_tiles) Rows. The other
 * producer threads have nothing to do. */
template <int D, typename T>
__device__ __forceinline__ void produce_query_tiles(
    const CUtensorMap *q_map, const CUtensorMap *k_map, const CUtensorMap *v_map,
    const CUtensorMap *do_map, const float *lse, const float *delta, const float *ds_stats, T *Ks,
    T *Vs, T *Qs, T *dOs, float *stats_s, uint64_t *kv_full, uint64_t *full, uint64_t *empty,
    attn_strides kvs, int nq, int group, long bh_kv, int j0, int first, int head_tiles, int tiles) {
  using L = HbLayout<D, T>;
  constexpr int HbRows = L::Rows, HbStages = L::Stages, RowTile = HbRows * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == CopyWarp && lane == 0) {
    load_tile_async<D, HbKeys, T>(k_map, j0, bh_kv, kvs.heads, Ks, kv_full);
    load_tile_async<D, HbKeys, T>(v_map, j0, bh_kv, kvs.heads, Vs, kv_full);
  }
  if ((warp != CopyWarp || lane != 0) && warp != RowStatsWarp) return;
  const float dss = ds_scale(ds_stats);
  for (int t = 0; t < tiles; t++) {
    int s = t % HbStages, i0 = (first + t % head_tiles) * HbRows;
    long head = bh_kv * group + t / head_tiles;
    /* WAR: every consumer thread is done with the stage's last tile before it is refilled */
    if (t >= HbStages) mbarrier_wait(&empty[s], (t / HbStages - 1) % 2);
    if (warp == CopyWarp) {
      load_tile_async<D, HbRows, T>(q_map, i0, head, kvs.heads * group, Qs + s * RowTile, &full[s]);
      load_tile_async<D, HbRows, T>(do_map, i0, head, kvs.heads * group, dOs + s * RowTile,
                                    &full[s]);
      continue;
    }
    /* LSE in log2 units and D ds_scale (see probabilities_and_ds); 0 past the queries,
     * whose elements are masked */
    float *lse_t = stats_s + s * 2 * HbRows, *delta_t = lse_t + HbRows;
    for (int r = lane; r < HbRows; r += 32) {
      int i = i0 + r;
      lse_t[r] = i < nq ? lse[head * nq + i] * Log2e : 0.f;
      delta_t[r] = i < nq ? delta[head * nq + i] * dss : 0.f;
    }
    mbarrier_arrive(&full[s]); /* releases this lane's stores */
  }
}
