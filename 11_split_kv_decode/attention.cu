/* Stage 11: decoding against a KV cache, with grouped-query attention.
 *
 * The kernels are stage 09's. What is added:
 *   - grouped-query attention (GQA/MQA): K and V have Hkv heads, and query head h reads K/V
 *     head h / G, G = H / Hkv;
 *   - cache lengths: sequence b attends to its first L_b <= Nkv keys (bottom-right causal
 *     against L_b), and nothing past them is read;
 *   - a decode path (FlashDecoding) for problems with few query rows per K/V head: the keys
 *     of each (sequence, K/V head) are split into chunks across blocks, each block takes all
 *     G x Nq query rows of its K/V head so that K and V are read once, writes a partial O and
 *     LSE, and a second kernel merges a row's chunks by their LSE (stage 02's merge).
 * The backward is 09's, for the problems 09 computes (Hkv = H, no cache lengths).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <limits.h>
#include <math.h>
#include <type_traits>

#include "attention.h"
#include "gpu.h"

/* mma.sync.aligned.m16n8k16: D (16 x 8, fp32) = A (16 x 16) B (16 x 8) + C, one warp.
 * A lane l belongs to quad g = l / 4 and is lane t = l % 4 of it. Each operand is a set of
 * 8 x 8 blocks; in every block lane l holds row g and the two columns 2t, 2t + 1 (two 16-bit
 * values in one 32-bit register, the lower column in the lower half):
 *
 *   A (rows x k), 4 registers      B (k x cols), 2 registers     C, D (rows x cols), 4 floats
 *           k 0-7   k 8-15                 cols 0-7                        cols 0-7
 *   rows 0-7   a[0]   a[2]           k 0-7    b[0]  (transposed:   rows 0-7    c[0] c[1]
 *   rows 8-15  a[1]   a[3]           k 8-15   b[1]   lane l holds  rows 8-15   c[2] c[3]
 *                                                    column g, k 2t and 2t + 1)
 *
 * So lane l holds rows g and g + 8 of every accumulator, columns 2t and 2t + 1 of each
 * 8-column block. Two accumulators side by side (16 columns) hold exactly the elements of one
 * A operand with k = those 16 columns: c[0..1] of the first are a[0], c[2..3] are a[1], and
 * the second gives a[2] and a[3]. That is how S becomes P without leaving the registers.
 *
 * ldmatrix.x4 loads four 8 x 8 blocks of 16-bit values from shared memory, each lane giving
 * the address of one row (lanes 0-7 the rows of block 0, 8-15 of block 1, ...), and leaves
 * them in this layout; with .trans each block arrives transposed.
 */
constexpr int MmaM = 16, MmaN = 8, MmaK = 16;
constexpr int Quad = 4; /* lanes that share a row */
/* A warp's query rows in the forward, in fragments: two at every d (08: one at d <= 64), so
 * that each K and V operand loaded feeds two mma.sync. Measured (H100, fp16, N = 4096 to 16384,
 * forward TFLOP/s): at d = 128, 32 rows a warp 251-267 against 16 rows 202-213 (08); at d = 64
 * 287-310 over 64-key tiles, 324-360 over 128, against 273-291 for 16 rows over 64 keys (one
 * command, 02f781e). */
#ifndef ATTN_ROW_FRAGS
#define ATTN_ROW_FRAGS 2 /* at d <= 64; 1: 16 rows */
#endif
__host__ __device__ constexpr int row_frags(int d) { return d > 64 ? 2 : ATTN_ROW_FRAGS; }
__host__ __device__ constexpr int threads_for(int rows, int f = 1) { return rows / f / MmaM * 32; }
/* Query rows per block: 128, so that each K and V tile copied into shared memory serves 128
 * rows (8 warps of 16 rows, or 4 of 32). */
constexpr int Br = 128;
/* Keys per tile: a tile's Bc scores are a register array per thread, so Bc is small;
 * 64 keys, 32 scores a lane per 16 rows, ran 2-4% faster than 32 at d = 64, 4% at d = 128.
 * At d <= 64, 128 (FlashAttention-2's 128 x 128 tile, no spill): with 32-row warps 13-17%
 * faster than 64 keys; at d = 128, where O takes 128 registers, 128 keys spill 928 bytes. */
#ifndef ATTN_BC
#define ATTN_BC 128 /* at d <= 64; 64: 64 keys */
#endif
__host__ __device__ constexpr int bc_for(int d) { return d > 64 ? 64 : ATTN_BC; }
/* Keys per tile where the device cannot give a block tile_bytes(d, bc_for(d)) (96 KiB at d = 128,
 * which every GPU since sm_80 allows; 102 KiB with -DATTN_SWIZZLE=0): half the keys. */
constexpr int Bc_small = 32;
static_assert(Bc_small % MmaK == 0, "a tile of keys is whole k-steps of P V");
/* Shared-memory tiles are stored without padding, the 16-byte chunks of each row permuted:
 * logical chunk c of row r at chunk c ^ (r % 8), or c ^ (r / 2 % 4) in rows of 64 bytes (two
 * to a 128-byte line). One ldmatrix phase reads 8 rows at one logical chunk: unpermuted rows of
 * 128 or 256 bytes queue those reads on 4 banks, permuted they cover all 32 (08 padded every
 * row by 16 bytes instead, 6-12% more shared memory). At d = 64, where each chunk is stored:
 *
 *   logical chunk   0 1 2 3 4 5 6 7
 *   row 0           0 1 2 3 4 5 6 7
 *   row 1           1 0 3 2 5 4 7 6
 *   row 2           2 3 0 1 6 7 4 5
 *   row 3           3 2 1 0 7 6 5 4      ... row 7: 7 6 5 4 3 2 1 0, row 8 as row 0
 *
 * -DATTN_SWIZZLE=0 builds 08's padded rows (09's A/B table). */
#ifndef ATTN_SWIZZLE
#define ATTN_SWIZZLE 1
#endif
#ifndef ATTN_SPLIT_WAITS
#define ATTN_SPLIT_WAITS 1
#endif
constexpr int Skew = ATTN_SWIZZLE ? 0 : 16; /* bytes of padding per row */
static_assert(Skew % 16 == 0, "rows stay 16-byte aligned for 16-byte copies and fragment loads");
template <typename E>
__host__ __device__ constexpr int padded(int cols) {
  return cols + Skew / (int)sizeof(E);
}
/* The offset of element (row, col) in a tile of D-element rows, from a row a multiple of 8
 * (where the pattern starts), which every warp's first row in a tile is. */
template <int D, typename T>
__host__ __device__ constexpr int swizzle(int row, int col) {
  constexpr int chunk = 16 / sizeof(T), chunks = D / chunk;  /* elements, chunks a row */
  constexpr int rows_per_line = chunks < 8 ? 8 / chunks : 1; /* rows sharing 128 bytes */
  constexpr int patterns = chunks < 8 ? chunks : 8;
  int c = ATTN_SWIZZLE ? (col / chunk ^ row / rows_per_line % patterns) * chunk + col % chunk : col;
  return row * padded<T>(D) + c;
}
/* operand_address XORs the chunk bits of the absolute shared-memory address, which lands where
 * swizzle() says only if the tile starts where those bits are 0: on a multiple of its swizzle
 * period, the bytes of a row and at least 128 (a 128-byte line, which 64-byte rows share in
 * pairs). Every kernel asserts this of each tile's offset; the block's shared memory starts on
 * 256 bytes, the largest period. (Padded rows, -DATTN_SWIZZLE=0, add instead of XOR.) */
template <int D, typename T>
__host__ __device__ constexpr bool starts_swizzle_period(size_t bytes) {
  constexpr size_t row = D * sizeof(T), period = row > 128 ? row : 128;
  return !ATTN_SWIZZLE || bytes % period == 0;
}
constexpr int SharedAlignment = 256; /* the largest swizzle period: rows of 128 fp16 */

/* Shared memory: K and V (bc rows, double-buffered), `rows` rows of Q (or Q, dO); none staged */
template <typename T>
static constexpr size_t tile_bytes(int d, int bc, int rows) {
  return sizeof(T) * (4 * (size_t)bc + rows) * padded<T>(d);
}

#ifndef ATTN_WHOLE_TILES
#define ATTN_WHOLE_TILES 1
#endif
/* Rows [0, rows) of a [*, D] tensor into a tile of ROWS swizzled rows; the rows past `rows` are
 * zeroed, since they enter the products (where 0 times a stale NaN is NaN). */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_tile(const T *src, int rows, T *dst) {
  /* THREADS known at compile time: the loop unrolls, and each thread swizzles its offset once,
   * as a pass moves whole swizzle periods (8 rows). (A runtime index cost ~30 instructions.) */
  constexpr int Chunk = 16 / sizeof(T), W = D / Chunk, Step = THREADS / W; /* rows a pass */
  static_assert(THREADS % W == 0 && Step % 8 == 0, "a pass moves whole swizzle periods");
  const int tid = threadIdx.x, r = tid / W;
  const T *from = src + tid * Chunk;
  T *to = dst + swizzle<D, T>(r, tid % W * Chunk);
  constexpr int Passes = (ROWS * W + THREADS - 1) / THREADS;
  /* A whole tile (all but a sequence's last) copies without testing rows: in 09's forward 9
   * instructions less per K or V tile at d = 64, ~55 at d = 128 (=0: tests every copy). */
  if (ATTN_WHOLE_TILES && rows >= ROWS && (ROWS * W) % THREADS == 0) {
#pragma unroll
    for (int k = 0; k < Passes; k++)
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from + k * THREADS * Chunk, 16);
    return;
  }
#pragma unroll
  for (int k = 0; k < Passes; k++) {
    if ((ROWS * W) % THREADS != 0 && k * THREADS + tid >= ROWS * W) break;
    if (r + k * Step < rows) /* cp.async: no waiting here, see __pipeline_wait_prior */
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from + k * THREADS * Chunk, 16);
    else
      *reinterpret_cast<float4 *>(to + k * Step * padded<T>(D)) = float4{};
  }
}

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (THREADS, not Br:
 * the dK/dV kernel reuses this with more threads per block, and for Q and dO: ROWS.) */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_kv_tile(const T *K, const T *V, int cols, T *Ks, T *Vs) {
  load_tile<D, ROWS, THREADS>(K, cols, Ks), load_tile<D, ROWS, THREADS>(V, cols, Vs);
}

__device__ void mma_m16n8k16(float *c, const unsigned *a, const unsigned *b, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ void mma_m16n8k16(float *c, const unsigned *a, const unsigned *b, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* volatile: a load from shared memory must stay between the barriers that guard it. The
 * address is a shared-memory address (the operand helpers below make it). */
__device__ void ldmatrix_x4(unsigned *r, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ void ldmatrix_x4_trans(unsigned *r, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/* The shared-memory address of element (row + lane_row, col + lane_col) of a swizzled tile
 * that starts on its swizzle period, row a multiple of 8, col of 16: the lane's address is computed
 * once, a column step (chunk bits only, which the swizzle XORs) is one XOR, and the row an
 * immediate the loads fold in. */
template <int D, typename T>
__device__ unsigned operand_address(const T *tile, int lane_row, int lane_col, int row, int col) {
  unsigned lane = (unsigned)__cvta_generic_to_shared(tile + swizzle<D, T>(lane_row, lane_col));
  unsigned moved = ATTN_SWIZZLE ? lane ^ (col * sizeof(T)) : lane + col * sizeof(T);
  return moved + row * padded<T>(D) * sizeof(T);
}

/* The row of the 16 x 16 tile at (row, col) of a larger tile this lane points ldmatrix.x4 at,
 * so that its four 8 x 8 blocks arrive in the registers' order of the picture above: a[0..3]
 * for a_operand (the tile is A, rows x k); b[0..1] of columns 0-7, then of columns 8-15, for
 * b_operand (the tile is B transposed, a row per column: K in S = Q K^T) and b_operand_trans
 * (the tile is B, k down: V in O = P V, read with .trans). */
template <int D, typename T>
__device__ unsigned a_operand(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane % 16, lane / 16 * 8, row, col);
}
template <int D, typename T>
__device__ unsigned b_operand(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane / 16 * 8 + lane % 8, lane / 8 % 2 * 8, row, col);
}
template <int D, typename T>
__device__ unsigned b_operand_trans(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane / 8 % 2 * 8 + lane % 8, lane / 16 * 8, row, col);
}

/* acc (FRAGS x 16 rows, N columns) += A B for one k-step of 16: a[f] is the A operand of the
 * rows of fragment f, and each B operand, loaded from shared memory once, feeds every fragment.
 * B is read from the rows of an N x 16 tile (K in S = Q K^T), or with TRANS from a 16 x N tile
 * (V in O = P V), at (row, col) of a tile of D-element rows. */
template <int D, bool TRANS, int N, int FRAGS = 1, typename T>
__device__ void mma_tile(float (*acc)[N / MmaN][4], const unsigned (*a)[4], const T *B, int row,
                         int col) {
#pragma unroll
  for (int n2 = 0; n2 < N / 16; n2++) { /* 16 columns: two accumulators per fragment */
    unsigned b[4];
    if constexpr (TRANS)
      ldmatrix_x4_trans(b, b_operand_trans<D>(B, row, col + n2 * 16));
    else
      ldmatrix_x4(b, b_operand<D>(B, row + n2 * 16, col));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(acc[f][2 * n2], a[f], b, T()),
          mma_m16n8k16(acc[f][2 * n2 + 1], a[f], b + 2, T());
  }
}

/* exp(x) = 2^(x log2 e) and log x = ln 2 log2 x: 2^x is one instruction (MUFU.EX2), 2^-inf = +0;
 * its relative error (about 2^-22) is far below the dtype's rounding of P. */
constexpr float Log2e = 1.4426950408889634f, Ln2 = 0.6931471805599453f;
__device__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Two dtype values in one operand register, `lo` in the lower half, rounded to nearest even. */
__device__ unsigned pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}
__device__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}

/* The largest of x over the quad that holds a row (its 4 lanes are xor 1 and 2 apart). */
__device__ float max_over_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ float sum_over_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* Element e of fragment f's accumulators is the lane's row h = 2 f + e / 2, the warp's row
 * g + 8 h. s, zeroed, accumulates S = Q K^T. Only a tile crossing the diagonal or the end of
 * the keys is masked (`masked`): past row h's first row_cols[h] keys, -inf.
 * m_blk[h] is row h's max over the tile and the quad. */
template <int D, int BC, int FRAGS = row_frags(D), typename T>
__device__ void compute_qk_scores_and_max(const T *Q, const unsigned (*q_frag)[4], const T *K,
                                          bool masked, const int *row_cols,
                                          float (*s)[BC / MmaN][4], float *m_blk) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    unsigned a[RowFrags][4];
    if (RowFrags > 1) /* a warp of one fragment (16 rows) keeps Q's operands in registers */
#pragma unroll
      for (int f = 0; f < RowFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Q, f * MmaM, kk * MmaK));
    mma_tile<D, false, BC, RowFrags>(s, RowFrags == 1 ? q_frag + kk : a, K, 0, kk * MmaK);
  }
  /* A compare and a select per element, which a branch skips on unmasked tiles at every d (08
   * predicates them at d = 128; in 09 that spills 16 bytes, and the branch is 5-8% faster). */
  int t = threadIdx.x % Quad;
  if (masked)
#pragma unroll
    for (int f = 0; f < RowFrags; f++)
#pragma unroll
      for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (n * MmaN + 2 * t + e % 2 >= row_cols[2 * f + e / 2]) s[f][n][e] = -INFINITY;
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

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l
 * and the O accumulators) is rescaled by 2^((m - m') scale log2 e), row by row. */
template <int D, int FRAGS = row_frags(D)>
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
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
 * end); acc += P V, two S accumulators per 16 keys an A operand. At d <= 64 the exponent is
 * one FFMA, s c - m c (c = scale log2 e) with m c rounded apart: the exponent moves by at most
 * 2^-14 while every row of the warp has |m c| < FoldLimit; past that (logits near 1e11, where
 * that rounding is 4096) the warp subtracts m first, exactly. Forward +4.6 to +9% at d = 64 (09's
 * A/B table); at d = 128 3-5% slower, so 08's form there (everywhere with -DATTN_FFMA_FOLD=0). */
#ifndef ATTN_FFMA_FOLD
#define ATTN_FFMA_FOLD 1
#endif
constexpr float FoldLimit = 1024.f;
template <int D, int BC, int FRAGS = row_frags(D), typename T>
__device__ void compute_block_softmax_and_weighted_v(float (*s)[BC / MmaN][4], const T *V,
                                                     float scale_log2, const float *m, float *l,
                                                     float (*acc)[D / MmaN][4]) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags;
  constexpr bool Fold = ATTN_FFMA_FOLD && D <= 64;
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[LaneRows], mc[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];
  if constexpr (Fold) {
    bool near = true;
#pragma unroll
    for (int h = 0; h < LaneRows; h++) near = near && fabsf(m_use[h] * scale_log2) < FoldLimit;
    bool fold = __all_sync(0xffffffffu, near);
#pragma unroll
    for (int h = 0; h < LaneRows; h++) mc[h] = fold ? m_use[h] * scale_log2 : 0.f;
    if (!fold)
#pragma unroll
      for (int f = 0; f < RowFrags; f++)
#pragma unroll
        for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) s[f][n][e] -= m_use[2 * f + e / 2];
  }
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
          float x = s[f][2 * kk + half][e];
          p[e] = exp2_approx(Fold ? fmaf(x, scale_log2, -mc[2 * f + e / 2])
                                  : (x - m_use[2 * f + e / 2]) * scale_log2);
          l[2 * f + e / 2] += p[e];
        }
        p_frag[f][2 * half] = pack2(p[0], p[1], T());     /* rows 0-7 */
        p_frag[f][2 * half + 1] = pack2(p[2], p[3], T()); /* rows 8-15 */
      }
    mma_tile<D, true, D, RowFrags>(acc, p_frag, V, kk * MmaK, 0);
  }
}

/* Writes a warp's FRAGS x 16 rows of fp32 accumulators times factor[h] (h the lane's row) in
 * the dtype, rows [0, rows) only: each lane stores its two adjacent columns as one word. */
template <int D, int FRAGS, typename T>
__device__ void store_tile(const float (*acc)[D / MmaN][4], const float *factor, T *out, int rows,
                           int ld = D) {
  int g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < 2 * FRAGS; h++) {
    int r = g + 8 * h, e = 2 * (h % 2);
    if (r < rows)
#pragma unroll
      for (int n = 0; n < D / MmaN; n++)
        *reinterpret_cast<unsigned *>(out + (long)r * ld + n * MmaN + 2 * t) =
            pack2(acc[h / 2][n][e] * factor[h], acc[h / 2][n][e + 1] * factor[h], T());
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

template <int D, int BC, bool GROUPED, typename T>
__global__ void __launch_bounds__(threads_for(Br, row_frags(D)), 2)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         const int *__restrict__ cache_lens, T *__restrict__ o,
                         float *__restrict__ lse, int nq, int nkv, int heads, int seq_heads,
                         int group, float scale, int causal) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  constexpr int Threads = threads_for(Br, RowFrags);
  extern __shared__ __align__(256) float4 smem[]; /* cp.async and ldmatrix move 16 bytes */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * BC * padded<T>(D);
  T *Qs = Vs + 2 * BC * padded<T>(D); /* K and V double-buffered, then the Q tile */
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
  /* A thread past the last row still helps load tiles and meets every barrier. */
  /* The warp's rows start at row0; this lane holds rows i + 8 h. */
  int row0 = i0 + threadIdx.x / 32 * RowFrags * MmaM, i = row0 + threadIdx.x % 32 / Quad;
  /* Query head bh reads K/V head bh / G (b H / G = b Hkv), whose rows are Nkv apart (the
   * cache's capacity); sequence b = bh / H holds `len` valid keys. Not GROUPED (G = 1, no
   * cache lengths), head bh and Nkv keys, as in 09: held in registers, the quotient and `len`
   * cost the d = 64 tile loop 62 more instructions (IMAD) and 20 bytes of spill. */
  const long kv_head = GROUPED ? bh / group : bh;
  const T *K = k + kv_head * nkv * D, *V = v + kv_head * nkv * D;
  int len = GROUPED && cache_lens ? cache_lens[bh / seq_heads] : nkv;
  const T *Qw = Qs + (row0 - i0) * padded<T>(D); /* the warp's rows */
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4]; /* 16-row warps: Q in registers */
#pragma unroll
  for (int h = 0; h < LaneRows; h++) m[h] = -INFINITY, l[h] = 0.f;
  load_tile<D, Br, Threads>(q + (bh * nq + i0) * D, min(Br, nq - i0), Qs);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Br * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = len - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(len, last_row + offset + 1)) : len;
  /* K(t) and V(t) in copy groups of their own (Q joins K(0)'s), so that each product waits
   * only for its operand. -DATTN_SPLIT_WAITS=0 waits for both at a tile's top, as 08 does. */
  constexpr bool split = ATTN_SPLIT_WAITS;
  if (kv_end > 0) load_tile<D, BC, Threads>(K, min(BC, len), Ks);
  __pipeline_commit();
  if (kv_end > 0) load_tile<D, BC, Threads>(V, min(BC, len), Vs);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += BC, buf ^= 1) {
    int cols = min(BC, len - j0), next = j0 + BC;
    T *Kn = Ks + (buf ^ 1) * BC * padded<T>(D), *Vn = Vs + (buf ^ 1) * BC * padded<T>(D);
    if (next < kv_end) load_tile<D, BC, Threads>(K + (long)next * D, min(BC, len - next), Kn);
    if (!split && next < kv_end)
      load_tile<D, BC, Threads>(V + (long)next * D, min(BC, len - next), Vn);
    __pipeline_commit();
    /* K(t) has landed (and, not split, V(t)); V(t) and K(t + 1) may still be in flight */
    __pipeline_wait_prior(split ? 2 : 1);
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR, split: every
                      * warp is done with P V(t - 1), so V(t + 1) may overwrite its buffer */
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    int row_cols[LaneRows]; /* on a diagonal tile, row i + 8 h sees 8 h keys more than row i */
#pragma unroll
    for (int h = 0; h < LaneRows; h++)
      row_cols[h] = diagonal ? min(cols, i + offset + 1 - j0 + 8 * h) : cols;
    const T *Kt = Ks + buf * BC * padded<T>(D), *Vt = Vs + buf * BC * padded<T>(D);
    float s[RowFrags][BC / MmaN][4] = {};
    if (RowFrags == 1 && j0 == 0) /* Q has landed: its operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++)
        ldmatrix_x4(q_frag[kk], a_operand<D>(Qs, row0 - i0, kk * MmaK));
    compute_qk_scores_and_max<D, BC>(Qw, q_frag, Kt, diagonal || cols < BC, row_cols, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, acc);
    if (split && next < kv_end)
      load_tile<D, BC, Threads>(V + (long)next * D, min(BC, len - next), Vn);
    __pipeline_commit();
    __pipeline_wait_prior(2); /* V(t) has landed; K(t + 1) and V(t + 1) may still be in flight */
    __syncthreads();          /* RAW: V(t) is in shared memory; WAR: every warp is done with
                               * S = Q K(t)^T, so K(t + 2) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, BC>(s, Vt, scale_log2, m, l, acc);
    if (!split) __syncthreads(); /* WAR: every warp is done with V(t) before V(t + 2) */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  normalize_output<D>(acc, m, l, scale_log2, o + (bh * nq + row0) * D, lse + bh * nq + row0,
                      nq - row0);
}

/* ---- the decode path ------------------------------------------------------------------ */

/* Decode: each sequence brings a few new queries (Nq; 1 for a model generating a token at a
 * time) against a cache of L_b keys. The grid above has a block per 128 query rows of one
 * head, B x H blocks in all (32 at B = 1, H = 32 on an H100's 132 SMs), each reading its
 * head's K and V alone, and the work is reading K and V, not multiplying. So the decode path
 * splits the other way (FlashDecoding):
 *   - a block per (sequence, K/V head, chunk of keys): each K/V head's L_b keys are cut into
 *     chunks of chunk_keys, and the chunks of every head run at once;
 *   - a block takes every query row that reads its K/V head: the G = H / Hkv query heads of
 *     the group, Nq rows each, G Nq rows in all (contiguous in Q: heads G kvh .. G kvh + G - 1
 *     of the sequence), padded to one row fragment (16 rows) where they fit it, else to 09's
 *     two (32 rows, d = 128 only). So each element of K and V crosses from memory once,
 *     whatever G is;
 *   - the block's warps share each tile's keys, 16 each (09's share its rows; here there are
 *     too few rows to share), each keeping its own running max, sum and O, which 09's
 *     helpers update, told the block's row fragments; at the end they are merged into the
 *     chunk's partial O (fp32, normalised) and LSE, written to the workspace;
 *   - merge_chunks_kernel combines a row's chunks by their LSE, stage 02's merge of partial
 *     softmaxes, in a fixed order: no atomics, every run of a problem gives the same bits (a
 *     sequence alone and in a batch, only in the batch-invariant mode: see plan_chunks).
 * The rule: a problem takes this path when one block's rows hold its group's G Nq query rows
 * (G Nq <= decode_rows(d): 16 at d <= 64, 32 at d = 128), so that K and V are read once;
 * any other problem takes 09's path above, which has GQA and cache lengths too. */
/* The most rows a decode block takes. A group of up to 16 rows takes one fragment at every d:
 * at d = 128 one instead of two halves the products of the decode benchmark's 4 query rows
 * and takes the kernel from 214 registers to 162. Measured on an H100 (fp16, the benchmark's
 * B = 1 and 32 at 1k, 8k, 32k and 128k, each build timed twice in turn, one command): B = 1
 * 9% faster at 1k, 5% at 8k, 2.5% at 32k, and B = 32 3.4% faster at 1k and 0.3-1% at 8k to
 * 128k; B = 1 at 128k moved less than the spread of its repeats. At most one fragment at
 * d <= 64, two at d = 128: 09's rows a warp when this path and its rule were measured. (09's
 * d <= 64 warps have had two since; a 32-row decode block at d <= 64, which would take groups
 * of 17 to 32 rows off 09's path, has not been measured.) */
__host__ __device__ constexpr int decode_frags(int d) { return d > 64 ? 2 : 1; }
__host__ __device__ constexpr int decode_rows(int d) { return decode_frags(d) * MmaM; }
/* Warps per decode block: 4, as a d = 128 block of 09 (two blocks an SM at 255 registers a
 * thread), each taking 16 keys of a tile, one k-step of P V; so a tile has 64 keys (09's at
 * d = 128), and a d = 128 block's K and V tiles move 32 KiB per tile, 8 copies of 16 bytes a
 * thread. */
constexpr int DecodeWarps = 4, DecodeThreads = DecodeWarps * 32, DecodeKeys = DecodeWarps * MmaK;
/* Stages of the decode block's ring of K and V tiles: 2, as 09. A decode block has no
 * arithmetic to hide its loads behind, only more loads, so a deeper ring looked promising;
 * measured on an H100 (d = 128, the 24 shapes of the decode benchmark, one block an SM), 3
 * stages ran from 0.4% faster to 2% slower, 4 stages up to 3% slower: two tiles of K and V in
 * flight already keep an SM's share of the bandwidth busy. -DATTN_DECODE_STAGES=3 or 4 for
 * the alternatives, which fall back to 2 where their ring does not fit the shared memory. */
#ifndef ATTN_DECODE_STAGES
#define ATTN_DECODE_STAGES 2
#endif
constexpr int DecodeStages = ATTN_DECODE_STAGES;
static_assert(DecodeStages >= 2, "a ring of at least two tiles");
/* A decode block's shared memory: its ring of K and V tiles and its query rows. */
template <typename T>
__host__ __device__ constexpr size_t decode_bytes(int d, int stages) {
  return sizeof(T) * (2 * (size_t)stages * DecodeKeys + decode_rows(d)) * padded<T>(d);
}
/* The chunk rule. A decode grid should give every SM one block (a block streams as fast as
 * an SM pulls bytes: a second one an SM adds no bandwidth, only blocks with fixed costs and
 * partials to merge), in whole waves (a partial wave is a tail), and a chunk should be long
 * enough that a block's fixed costs (loading Q, waiting for its first tiles, merging its
 * warps, writing its partial) stay small beside the tiles it streams: at least MinChunkKeys
 * keys. So
 *   chunks = min(floor(DecodeBlocksPerSm x SMs / (B Hkv)), floor(Lmax / MinChunkKeys)),
 *            at least 1;  chunk_keys = ceil(Lmax / chunks) rounded up to whole tiles,
 * Lmax the longest cache. Measured on an H100 (d = 128, Hkv = 8, fp16, chunk lengths forced
 * with ATTN_DECODE_CHUNK_KEYS, ms; the rule's pick marked *): B = 1, L = 1k: 64 keys 0.0121,
 * 128* 0.0114, 256 0.0128; L = 4k: 128 0.0183, 256* 0.0174, 512 0.0199; L = 8k: 256 0.0256,
 * 512* 0.0253, 1024 0.0304; L = 32k: 1024 0.0642, 2048* 0.0632, 4096 0.0867; B = 8, L = 2k:
 * 512 0.0412, 1024* 0.0393, 2048 0.0471. Two blocks an SM (the 2 x 132 an H100 holds at
 * d = 128; -DATTN_DECODE_BLOCKS_PER_SM=2) picked 256, 256, 256, 1024 and 512 keys there;
 * four waves of them with chunks of at least 128 keys (the first rule) was up to 20% slower.
 * On an H100: B = 1 gets 128 keys a chunk at L = 1k, 2048 at 32k, 8192 at 128k (16 chunks);
 * B = 8 two chunks; B = 32 one, whose blocks write O and LSE themselves.
 * ATTN_DECODE_CHUNK_KEYS=N (a multiple of 64) sets chunk_keys instead, for the tests and for
 * measuring the rule. */
#ifndef ATTN_DECODE_BLOCKS_PER_SM
#define ATTN_DECODE_BLOCKS_PER_SM 1
#endif
constexpr int DecodeBlocksPerSm = ATTN_DECODE_BLOCKS_PER_SM, MinChunkKeys = 2 * DecodeKeys;

/* Batch invariance (ATTN_DECODE_BATCH_INVARIANT=1). The rule reads the SM count, B Hkv and
 * Lmax, so a sequence's chunks, and with them the order in which its keys' sums are added,
 * depend on the batch it is decoded in: alone and inside a batch, its O and LSE may differ in
 * their last bits (both within the fp16 rule). Serving systems ask for the same bits whatever
 * else shares the batch. In the mode, sequence b's O and LSE are a function of its own Q, K,
 * V and L_b (and of H, Hkv, Nq, d, the dtype, the scale and causal) alone:
 *   - chunks of BatchInvariantChunkKeys keys, whatever the batch and the GPU
 *     (ATTN_DECODE_CHUNK_KEYS, as fixed, still sets another length);
 *   - the merge always runs, also where every sequence has one chunk: a sequence of one
 *     chunk then takes one path (its partial, then the merge) whether the batch's longest
 *     cache has one chunk or many, instead of the decode block writing O itself in one case
 *     and the merge in the other;
 *   - the rest does not depend on the batch already: a decode block's rows are the G Nq query
 *     rows of its K/V head, its keys start at c chunk_keys, the merge takes a row's
 *     ceil(L_b / chunk_keys) chunks in an order set by that count and by d (its Ways), and the
 *     grid's count of chunks, ceil(Lmax / chunk_keys), only places the partials in the
 *     workspace (a chunk past L_b writes nothing, and nothing reads it).
 * 09's path (G Nq past decode_rows) is batch-invariant without the mode: a block for 128 query
 * rows of one head streams that head's cache from key 0 to its end, whatever the grid.
 * The length: 1024 keys, from the H100's chunk sweep (above; decode_chunks.tsv, the benchmark's
 * shapes, Hkv = 8). Long enough that a chunk streams efficiently: within 5% of the best forced
 * length wherever B >= 8 or L >= 32k, where 512 keys cost 7-10% (B = 1 at 32k and 128k, B = 32
 * at 1k and 2k: a block's fixed costs over 8 tiles). Short enough that B = 1 still gives about
 * every SM of an H100 or H200 (132) a block from L = 16k on (B Hkv L / 1024 = 128 blocks there),
 * where 2048 keys leave at least half of them idle below 32k (80% slower at 8k). The price falls
 * on B = 1 with short caches, which the rule splits finer (1k, one chunk: 0.024 ms against
 * 0.011; 4k: 0.027 against 0.017), and on batches of one chunk a sequence, which gain the
 * merge. */
constexpr int BatchInvariantChunkKeys = 16 * DecodeKeys;
static_assert(BatchInvariantChunkKeys % DecodeKeys == 0, "a chunk is whole tiles");

/* merge: whether merge_chunks_kernel follows, the decode blocks writing partials; without it
 * (one chunk a sequence, outside the batch-invariant mode) they write O and LSE themselves. */
struct decode_plan {
  int chunk_keys, chunks;
  bool merge;
};

/* The chunk rule above on a GPU of `sms` SMs, or the batch-invariant mode's fixed chunks.
 * Plain host arithmetic, so that the workspace and the launch agree and a test can call it. */
static decode_plan plan_chunks(const attn_problem *p, long sms) {
  int lmax = 0;
  for (int b = 0; b < p->batch; b++) lmax = max(lmax, attn_cache_len(p, b));
  long pairs = (long)p->batch * attn_heads_kv(p);
  long chunks = DecodeBlocksPerSm * sms / pairs; /* whole waves: a partial one is a tail */
  chunks = max(1L, min(chunks, (long)(lmax / MinChunkKeys)));
  long keys = (lmax + chunks - 1) / chunks;
  keys = max((long)DecodeKeys, (keys + DecodeKeys - 1) / DecodeKeys * DecodeKeys);
  bool invariant = attn_decode_batch_invariant();
  if (invariant) keys = BatchInvariantChunkKeys;
  if (int forced = attn_decode_chunk_keys()) {
    if (forced % DecodeKeys != 0)
      attn_fail(EXIT_BAD_USAGE,
                "ATTN_DECODE_CHUNK_KEYS must be a multiple of %d (whole tiles), "
                "got %d",
                DecodeKeys, forced);
    keys = forced;
  }
  chunks = max(1L, (lmax + keys - 1) / keys);
  return {(int)keys, (int)chunks, invariant || chunks > 1};
}

/* The block's warps hold a running max m_w, sum l_w and unnormalised O_w for the same rows
 * over different keys; the chunk's partial is their merge (c = scale log2 e):
 *   M = max_w m_w,   L = sum_w l_w 2^((m_w - M) c),   O = sum_w O_w 2^((m_w - M) c) / L,
 * and its LSE in log2 units, M c + log2 L. A row that saw no key of the chunk (M = -inf) gets
 * O = 0 and LSE = -inf. Each warp leaves O_w, m_w and l_w in shared memory (`work`: the
 * tiles' memory, free now), then every thread combines 16-byte groups of the output, so that
 * the partial leaves in coalesced stores. (The fragment-layout stores, rows D floats apart,
 * meet 8-way bank conflicts: once a block, beside the tiles it streamed, they do not show.) */
__host__ __device__ constexpr size_t merge_bytes(int d) {
  return sizeof(float) * DecodeWarps * decode_rows(d) * (d + 2);
}
static_assert(merge_bytes(32) <= decode_bytes<__half>(32, 2) &&
                  merge_bytes(64) <= decode_bytes<__half>(64, 2) &&
                  merge_bytes(128) <= decode_bytes<__half>(128, 2),
              "the warps' merge fits in the shared memory of the tiles it replaces");
static_assert(decode_bytes<__half>(128, 2) <= 99 * 1024,
              "a decode block fits the 99 KiB of sm_86 and sm_89 (72 KiB at d = 128, 2 stages)");
template <int D, int FRAGS, typename T>
__device__ void merge_warps(const float (*acc)[D / MmaN][4], const float *m, float *l,
                            float scale_log2, float *work, float *part_o, float *part_lse, T *o,
                            float *lse, int rows) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  float *o_s = work, *m_s = o_s + DecodeWarps * Rows * D, *l_s = m_s + DecodeWarps * Rows;
  int w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    l[h] = sum_over_quad(l[h]); /* the lanes' partial sums, as in normalize_output */
    if (t == 0) m_s[w * Rows + g + 8 * h] = m[h], l_s[w * Rows + g + 8 * h] = l[h];
  }
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < D / MmaN; n++)
#pragma unroll
      for (int half = 0; half < 2; half++) /* rows g and g + 8 of the fragment */
        *reinterpret_cast<float2 *>(o_s + (w * Rows + f * MmaM + g + 8 * half) * D + n * MmaN +
                                    2 * t) =
            make_float2(acc[f][n][2 * half], acc[f][n][2 * half + 1]);
  __syncthreads(); /* RAW: every warp's O, max and sum are in shared memory */
  for (int e = threadIdx.x * 4; e < rows * D; e += DecodeThreads * 4) {
    int r = e / D;
    float mx = -INFINITY, sum = 0.f;
    float4 out = {0.f, 0.f, 0.f, 0.f};
    for (int x = 0; x < DecodeWarps; x++) mx = fmaxf(mx, m_s[x * Rows + r]);
    for (int x = 0; mx != -INFINITY && x < DecodeWarps; x++) {
      float f = exp2_approx((m_s[x * Rows + r] - mx) * scale_log2); /* 0 for a warp with no key */
      float4 o_w = *reinterpret_cast<const float4 *>(o_s + (x * Rows + r) * D + e % D);
      sum += f * l_s[x * Rows + r];
      out.x += f * o_w.x, out.y += f * o_w.y, out.z += f * o_w.z, out.w += f * o_w.w;
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f, row_lse = mx * scale_log2 + log2f(sum);
    out = make_float4(out.x * inv, out.y * inv, out.z * inv, out.w * inv);
    if (o) { /* the only chunk: the partial is the output */
      *reinterpret_cast<uint2 *>(o + e) =
          make_uint2(pack2(out.x, out.y, T()), pack2(out.z, out.w, T()));
      if (e % D == 0) lse[r] = sum > 0.f ? row_lse * Ln2 : -INFINITY;
    } else {
      *reinterpret_cast<float4 *>(part_o + e) = out;
      if (e % D == 0) part_lse[r] = sum > 0.f ? row_lse : -INFINITY;
    }
  }
}

/* Programmatic dependent launch (compute capability 9.0 on): the merge grid may be launched
 * while the decode grid runs, once every decode block has allowed it; its blocks then wait
 * until the decode grid has finished and its writes are visible. The merge's launch and its
 * first instructions overlap the decode instead of following it. Elsewhere both are no-ops
 * and the merge follows the decode as any kernel of the stream does. */
__device__ void allow_merge_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ void wait_for_decode() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* One block: chunk `blockIdx.x % chunks` of K/V head pair = blockIdx.x / chunks (b Hkv + K/V
 * head), so a head's chunks are adjacent. 09's forward loop, K and V in a ring of STAGES
 * tiles and waited for separately; warp w computes the tile's keys [16 w, 16 w + 16) for all
 * rows. */
template <int D, int FRAGS, int STAGES, typename T>
__global__ void __launch_bounds__(DecodeThreads, 2)
    flash_decode_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                        const int *__restrict__ cache_lens, float *__restrict__ part_o,
                        float *__restrict__ part_lse, T *__restrict__ o, float *__restrict__ lse,
                        int nq, int nkv, int heads_kv, int group, int chunk_keys, int chunks,
                        bool merge, float scale, int causal) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  constexpr int BC = DecodeKeys, ld = padded<T>(D);
  extern __shared__ __align__(256) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + STAGES * BC * ld, *Qs = Vs + STAGES * BC * ld;
  allow_merge_launch(); /* the merge waits for the whole grid anyway: let it launch now */
  long pair = blockIdx.x / chunks;
  int len = cache_lens ? cache_lens[pair / heads_kv] : nkv;
  int j_begin = (int)(blockIdx.x % chunks) * chunk_keys, j_end = min(len, j_begin + chunk_keys);
  if (j_begin >= len && merge) return; /* past the cache: the merge reads nothing of it */
  int rows = group * nq, w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad;
  const T *K = k + pair * nkv * D, *V = v + pair * nkv * D;
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4];
  /* Row g + 8 h of the block is query i = (g + 8 h) % Nq of head (g + 8 h) / Nq of the group:
   * it sees keys j < row_end[h] = len, or, causal, min(len, i + len - Nq + 1) (maybe <= 0). */
  int row_end[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    m[h] = -INFINITY, l[h] = 0.f;
    row_end[h] = causal ? min(len, (g + 8 * h) % nq + len - nq + 1) : len;
  }
  load_tile<D, Rows, DecodeThreads>(q + pair * rows * D, rows, Qs);
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Rows * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Tiles 0 .. STAGES - 2 in flight before the loop, K and V each a group of its own; an
   * empty group past the chunk's end keeps the count of groups that the waits rely on. */
  for (int s = 0; s < STAGES - 1; s++) {
    int j = j_begin + s * BC;
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(K + (long)j * D, min(BC, j_end - j), Ks + s * BC * ld);
    __pipeline_commit();
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(V + (long)j * D, min(BC, j_end - j), Vs + s * BC * ld);
    __pipeline_commit();
  }
  /* Groups committed after K(t) when it is waited for: V(t), K and V of the STAGES - 2 tiles
   * after it, and K(t + STAGES - 1); after V(t): K and V of the STAGES - 1 tiles after it. */
  constexpr int InFlight = 2 * STAGES - 2;
  for (int j0 = j_begin, buf = 0; j0 < j_end; j0 += BC, buf = (buf + 1) % STAGES) {
    int cols = min(BC, j_end - j0), next = j0 + (STAGES - 1) * BC;
    int nbuf = (buf + STAGES - 1) % STAGES; /* the buffer of tile t - 1, done with */
    T *Kn = Ks + nbuf * BC * ld, *Vn = Vs + nbuf * BC * ld;
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(K + (long)next * D, min(BC, j_end - next), Kn);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* K(t) has landed; V(t) and later tiles may be in flight */
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR: every warp is
                      * done with P V(t - 1), so V(t + STAGES - 1) may overwrite its buffer */
    /* The warp's keys start at jw; row h sees row_cols[h] of its 16 (the chunk ends, the cache
     * ends, or the causal limit falls inside them: masked). */
    int jw = j0 + w * MmaK, row_cols[LaneRows];
    bool masked = false;
#pragma unroll
    for (int h = 0; h < LaneRows; h++) {
      row_cols[h] = min(j0 + cols, row_end[h]) - jw;
      masked |= row_cols[h] < MmaK;
    }
    const T *Kt = Ks + (buf * BC + w * MmaK) * ld, *Vt = Vs + (buf * BC + w * MmaK) * ld;
    float s[RowFrags][MmaK / MmaN][4] = {};
    if (RowFrags == 1 && j0 == j_begin) /* Q has landed: its operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) ldmatrix_x4(q_frag[kk], a_operand<D>(Qs, 0, kk * MmaK));
    compute_qk_scores_and_max<D, MmaK, FRAGS>(Qs, q_frag, Kt, masked, row_cols, s, m_blk);
    merge_block_stats<D, FRAGS>(m_blk, scale_log2, m, l, acc);
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(V + (long)next * D, min(BC, j_end - next), Vn);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* V(t) has landed; later tiles may still be in flight */
    __syncthreads();                 /* RAW: V(t) is in shared memory; WAR: every warp is done with
                                      * S = Q K(t)^T, so K(t + STAGES) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, MmaK, FRAGS>(s, Vt, scale_log2, m, l, acc);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight: the tiles' memory is reused below */
  __syncthreads();          /* WAR: every warp is done with the last K and V tiles (and Q) */
  /* Without a merge (one chunk a sequence), the block's rows are the output's rows
   * (b H + h) Nq + i, from (b Hkv + K/V head) G Nq on. */
  long first = (long)blockIdx.x * rows;
  merge_warps<D, FRAGS>(acc, m, l, scale_log2, reinterpret_cast<float *>(smem),
                        merge ? part_o + first * D : nullptr, merge ? part_lse + first : nullptr,
                        merge ? nullptr : o + first * D, lse + first, rows);
}

/* Threads of a merge block, one block per output row: D / 4 groups of 4 columns (16 bytes of
 * each chunk's fp32 O), times MergeThreads / (D / 4) ways of splitting the chunks among them,
 * so that a row's chunks are read by all 128 threads at once. */
constexpr int MergeThreads = 128;
/* Chunks a merge thread loads before it merges them, all in flight at once: on an H100 a row
 * of the decode benchmark has at most 16 chunks, 4 for each of the 4 ways at d = 128, so one
 * batch (and 8 keeps the loads of a GPU with twice the SMs in one). */
constexpr int MergeBatch = 8;

/* A running merge of partials (stage 02's rule), in log2 units: m, the largest lse_c seen;
 * s = sum_c 2^(lse_c - m); a = sum_c 2^(lse_c - m) O_c (4 columns). The merge is a / s and its
 * LSE m + log2 s. */
struct merge_state {
  float m, s;
  float4 a;
};
__device__ void merge_into(merge_state &x, float m, float s, float4 a) {
  float top = fmaxf(x.m, m), base = top == -INFINITY ? 0.f : top; /* -inf: neither saw a key */
  float f = exp2_approx(x.m - base), g = exp2_approx(m - base);
  x.m = top, x.s = x.s * f + s * g;
  x.a = make_float4(x.a.x * f + a.x * g, x.a.y * f + a.y * g, x.a.z * f + a.z * g,
                    x.a.w * f + a.w * g);
}

/* Row (b H + h) Nq + i of the output from its chunks' partials (O_c normalised, lse_c in log2
 * units), stage 02's merge:
 *   LSE = log2 sum_c 2^lse_c,   O = sum_c 2^(lse_c - LSE) O_c,
 * each chunk weighted by its share of the row's whole exp-sum. Only the ceil(L_b / chunk_keys)
 * chunks that hold keys of the sequence were written. A thread merges the chunks c = way,
 * way + Ways, ... of its 4 columns as they arrive, MergeBatch loads in flight at once (a
 * first pass for the max would wait for L2 once more); the Ways merges are then merged in
 * order of way. A fixed order, set by n and D alone: every run gives the same bits, and a row
 * of the same n chunks merges the same way in any batch. */
template <int D, typename T>
__global__ void __launch_bounds__(MergeThreads)
    merge_chunks_kernel(const float *__restrict__ part_o, const float *__restrict__ part_lse,
                        const int *__restrict__ cache_lens, T *__restrict__ o,
                        float *__restrict__ lse, int nq, int nkv, int heads, int group,
                        int chunk_keys, int chunks) {
  constexpr int Groups = D / 4, Ways = MergeThreads / Groups;
  static_assert(MergeThreads % Groups == 0, "every thread has a group of columns");
  __shared__ merge_state merged[MergeThreads];
  long row = blockIdx.x, bh = row / nq;
  int rows = group * nq, r = (int)(bh % group) * nq + (int)(row % nq);
  int len = cache_lens ? cache_lens[bh / heads] : nkv, n = (len + chunk_keys - 1) / chunk_keys;
  /* The partial of chunk c is that of decode block (bh / G) chunks + c: rows apart. */
  const float *lse_c = part_lse + bh / group * chunks * rows + r;
  const float *o_c = part_o + (bh / group * chunks * rows + r) * D;
  int group4 = threadIdx.x % Groups, way = threadIdx.x / Groups;
  merge_state x = {-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
  wait_for_decode();
  for (int c0 = way; c0 < n; c0 += MergeBatch * Ways) {
    float lse_b[MergeBatch];
    float4 o_b[MergeBatch];
#pragma unroll
    for (int u = 0; u < MergeBatch; u++) { /* unpredicated loads, which issue together: */
      long c = min(c0 + u * Ways, n - 1);  /* past the last chunk, the last, weighted 0 */
      lse_b[u] = c0 + u * Ways < n ? lse_c[c * rows] : -INFINITY;
      o_b[u] = reinterpret_cast<const float4 *>(o_c + c * rows * D)[group4];
    }
#pragma unroll
    for (int u = 0; u < MergeBatch; u++) merge_into(x, lse_b[u], 1.f, o_b[u]);
  }
  merged[threadIdx.x] = x;
  __syncthreads(); /* RAW: every way's merge is in shared memory */
  if (way != 0) return;
  for (int w = 1; w < Ways; w++) {
    const merge_state &y = merged[w * Groups + group4];
    merge_into(x, y.m, y.s, y.a);
  }
  float inv = x.s > 0.f ? 1.f / x.s : 0.f; /* s = 0: the row saw no key, O = 0 */
  *reinterpret_cast<uint2 *>(o + row * D + group4 * 4) =
      make_uint2(pack2(x.a.x * inv, x.a.y * inv, T()), pack2(x.a.z * inv, x.a.w * inv, T()));
  if (threadIdx.x == 0) lse[row] = x.s > 0.f ? (x.m + log2f(x.s)) * Ln2 : -INFINITY;
}

/* The decode kernel this GPU runs: DecodeStages of K and V where they fit the shared memory,
 * else 2. */
template <int D, typename T>
static bool decode_deep() {
  return DecodeStages > 2 && decode_bytes<T>(D, DecodeStages) <= attn_shared_memory_limit();
}

/* The chunk plan on this GPU, after checking that the decode block fits its shared memory. */
template <int D, int STAGES, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  attn_require_shared_memory((const void *)flash_decode_kernel<D, decode_frags(D), STAGES, T>,
                             decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  int device, sms;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return plan_chunks(p, sms);
}
template <int D, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  return decode_deep<D, T>() ? plan_decode<D, DecodeStages, T>(p) : plan_decode<D, 2, T>(p);
}

/* The decode path's workspace: each chunk's partial O (G Nq rows of d floats) and LSE; none
 * without a merge. */
static size_t decode_workspace(const attn_problem *p, decode_plan plan) {
  if (!plan.merge) return 0; /* the decode kernel writes O itself */
  return sizeof(float) * (size_t)p->batch * attn_heads_kv(p) * plan.chunks * attn_group(p) *
         p->seq_q * (p->head_dim + 1);
}

template <int D, int STAGES, typename T, int FRAGS = decode_frags(D)>
static void launch_decode(const attn_problem *p, const attn_buffers *t) {
  /* A group of up to 16 rows takes one row fragment, also where 09 gives a warp two (d = 128):
   * half the products and registers (see decode_rows). */
  if (FRAGS > 1 && attn_group(p) * p->seq_q <= MmaM) return launch_decode<D, STAGES, T, 1>(p, t);
  decode_plan plan = plan_decode<D, STAGES, T>(p);
  if (FRAGS != decode_frags(D))
    attn_require_shared_memory((const void *)flash_decode_kernel<D, FRAGS, STAGES, T>,
                               decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  long pairs = (long)p->batch * attn_heads_kv(p), blocks = pairs * plan.chunks;
  int rows = attn_group(p) * p->seq_q;
  if (blocks > INT_MAX || (long)attn_lse_elems(p) > INT_MAX)
    attn_fail(EXIT_BAD_USAGE, "too many (sequence, K/V head, chunk) blocks for one grid: %ld",
              blocks);
  float *part_o = (float *)t->workspace, *part_lse = part_o + (size_t)blocks * rows * D;
  flash_decode_kernel<D, FRAGS, STAGES>
      <<<(unsigned)blocks, DecodeThreads, decode_bytes<T>(D, STAGES), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, part_o, part_lse,
          (T *)t->o, t->lse, p->seq_q, p->seq_kv, attn_heads_kv(p), attn_group(p), plan.chunk_keys,
          plan.chunks, plan.merge, p->scale, p->causal);
  CHECK_LAUNCH("flash_decode_kernel");
  if (!plan.merge) return; /* the decode blocks wrote O and LSE */
  /* The merge as a programmatic dependent launch where the GPU has it (see wait_for_decode). */
  int device, major;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaLaunchAttribute early = {};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)attn_lse_elems(p));
  config.blockDim = dim3(MergeThreads);
  config.stream = attn_stream();
  config.attrs = &early;
  config.numAttrs = major >= 9 ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, merge_chunks_kernel<D, T>, (const float *)part_o,
                                (const float *)part_lse, (const int *)t->cache_lens, (T *)t->o,
                                t->lse, p->seq_q, p->seq_kv, p->heads, attn_group(p),
                                plan.chunk_keys, plan.chunks));
  CHECK_LAUNCH("merge_chunks_kernel");
}

/* The decode path's rule (see its comment above): the group's query rows fill one block. */
static bool decode_shaped(const attn_problem *p, int d) {
  return (long)attn_group(p) * p->seq_q <= decode_rows(d);
}

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half, int BC = bc_for(D)>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  if (decode_shaped(p, D))
    return decode_deep<D, T>() ? launch_decode<D, DecodeStages, T>(p, t)
                               : launch_decode<D, 2, T>(p, t);
  size_t bytes = tile_bytes<T>(D, BC, Br);
  if (BC > Bc_small && bytes > attn_shared_memory_limit()) return launch<D, T, Bc_small>(p, t);
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  bool grouped = attn_group(p) > 1 || p->cache_lens;
  auto kernel =
      grouped ? flash_forward_kernel<D, BC, true, T> : flash_forward_kernel<D, BC, false, T>;
  attn_require_shared_memory((const void *)kernel, bytes, "flash_forward_kernel");
  kernel<<<grid, threads_for(Br, row_frags(D)), bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, (T *)t->o, t->lse, p->seq_q,
      p->seq_kv, heads, p->heads, attn_group(p), p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}

/* The decode path's partials; 09's path needs none. */
template <int D, typename T = __half>
static size_t workspace(const attn_problem *p) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return workspace<D, __nv_bfloat16>(p);
  return decode_shaped(p, D) ? decode_workspace(p, plan_decode<D, T>(p)) : 0;
}

static size_t forward_workspace(const attn_problem *p) {
  switch (p->head_dim) {
    case 32: return workspace<32>(p);
    case 64: return workspace<64>(p);
    case 128: return workspace<128>(p);
  }
  return 0;
}

/* ---- the backward ------------------------------------------------------------------ */

/* Keys per dK/dV block, 16 a warp: 8 warps, so that each Q and dO tile serves 128 keys
 * (stage 08 on an H100, fp16, N = 4096 and 16384: 8 warps 35% faster than 4 at d = 128). */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys and query rows (161 KiB at d = 128; sm_86 and sm_89 allow 99 KiB, sm_80 163 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query steps (16 queries) per load of a dK/dV warp's K and V operands, each feeding QSteps
 * products. Backward TFLOP/s (N = 4096 and 16384, one command): d = 128, 4 steps 164-204,
 * 1 146-180, 2 157-196; d = 64, 2 steps 160-196, 1 159-191, 4 151-183 (spills). */
#ifndef ATTN_BWD_QSTEPS
#define ATTN_BWD_QSTEPS 0 /* N: N steps at every d */
#endif
__host__ __device__ constexpr int query_steps(int d) {
  return ATTN_BWD_QSTEPS ? ATTN_BWD_QSTEPS : d > 64 ? 4 : 2;
}
/* A dK/dV warp's keys: 32, so that each Q and dO operand it loads feeds two mma.sync; against
 * 16 (-DATTN_BWD_WARP_KEYS=16), backward +8 to +12% at d = 64, +2 to +4% at d = 128. */
#ifndef ATTN_BWD_WARP_KEYS
#define ATTN_BWD_WARP_KEYS 32
#endif
constexpr int WarpKeys = ATTN_BWD_WARP_KEYS;
static_assert(WarpKeys % MmaM == 0, "whole fragments of keys");
/* Warps that share a group of WarpKeys keys: at d <= 64 one, with dK, dV, P^T, dS^T in
 * registers; at d = 128, where dK and dV of 32 keys would take 256 registers, two, which
 * split the work through shared memory (FlashAttention-2's split; see the dK/dV kernel). */
__host__ __device__ constexpr int key_group_warps(int d) {
  return WarpKeys > MmaM && d > 64 ? 2 : 1;
}
__host__ __device__ constexpr int dkdv_threads(int d, int bc) {
  return bc / WarpKeys * key_group_warps(d) * 32;
}
/* Query rows per tile of the dK/dV kernel: half its keys (64 rows, like Bc in the forward). */
__host__ __device__ constexpr int rows_bwd(int bc) { return bc / 2; }
/* The dQ kernel: 4 warps of 16 query rows, tiles of 32 keys, so that 3 blocks (68 KiB each at
 * d = 128) share an SM: backward +3 to +7% at d = 128, +2 to +3% at d = 64, against 64 keys. */
constexpr int Br_dq = 4 * MmaM, Bc_dq = 32;
static_assert(rows_bwd(Bc_bwd_small) % MmaK == 0 && Bc_dq % MmaK == 0, "whole k-steps");

/* Blocks of the dK/dV kernel that must fit an SM, which caps its registers: at d <= 64, 2
 * blocks of 4 warps (up to 255 registers: dK and dV of 32 keys take 128); at d = 128, 1 of 8. */
__host__ __device__ constexpr int dkdv_blocks_per_sm(int d) { return d <= 64 ? 2 : 1; }
/* Blocks of the dQ kernel that must fit an H100's SM, with its Q and dO operands in registers: 4 at
 * d <= 64 (128 registers, an 8-byte spill; at d = 64 uncapped 132, 3 blocks) and 3 at d = 128
 * (168, a 108-byte spill; uncapped 178, 2 blocks). A cap that makes room for more blocks than the
 * SM's shared memory holds spills for nothing, so the architecture being compiled caps the count
 * too: an A100 fits 2 blocks at d = 128, RTX 30 and 40 one (3 at d = 64), and there the registers
 * are not capped below what those need. */
__host__ __device__ constexpr int sm_shared_kib() { /* one SM's shared memory */
#if defined(__CUDA_ARCH__) && \
    (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
  return 100; /* sm_86, sm_89: RTX 30, 40; sm_120: RTX 50 */
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return 164; /* sm_80: A100; sm_87 */
#else
  return 228; /* sm_90: H100, H200 (and the host's pass, which needs none) */
#endif
}
constexpr int ReservedKib = 1; /* the shared memory an SM keeps for each block (sm_80 on) */
__host__ __device__ constexpr int dq_blocks_per_sm(int d) {
  int tile_kib = (int)((4 * Bc_dq + 2 * Br_dq) * padded<__half>(d) * sizeof(__half) + 1023) / 1024;
  int fit = sm_shared_kib() / (tile_kib + ReservedKib), most = d <= 64 ? 4 : 3;
  return fit < most ? fit : most;
}

/* dQ's atomics on sm_90 and later: a lane adds its two adjacent columns as one float2, so a
 * warp's atomic fills 8 whole 32-byte sectors of L2 where two of single floats send them half
 * full: backward +17 to +22% (a float4 over two lanes: 0 to 1% slower at d = 128).
 * -DATTN_PAIRED_ATOMICS=0 adds single floats, as sm_80 (no vector atomics) always does. */
#ifndef ATTN_PAIRED_ATOMICS
#define ATTN_PAIRED_ATOMICS 1
#endif

/* D of every row, then, from a 128-byte boundary, the fp32 dQ the atomics add into (a warp's
 * float2 atomics fill whole 32-byte sectors of L2 only if its rows start on one: from 16 bytes
 * in, each would touch twice the sectors), then the bound on |dS| (DsStats floats). */
constexpr int SectorFloats = 32; /* 128 bytes */
static size_t delta_floats(size_t rows) {
  return (rows + SectorFloats - 1) / SectorFloats * SectorFloats;
}
constexpr int DsStats = 4; /* max |dO_i|^2 and max |V_j|^2, padded to 16 bytes */
static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) *
         (delta_floats(attn_lse_elems(p)) + (size_t)attn_lse_elems(p) * p->head_dim + DsStats);
}

/* Shared memory of the dK/dV kernel: K and V (bc x d), double-buffered Q and dO tiles, LSE
 * and D of their rows, and dS^T of one query tile (bc x rows_bwd(bc)), from which the block
 * multiplies dQ += dS K; where two warps share a key group, P^T of the tile too. */
template <typename T>
static constexpr size_t dkdv_bytes(int d, int bc) {
  return sizeof(T) * (2 * (size_t)bc + 4 * rows_bwd(bc)) * padded<T>(d) +
         sizeof(float) * 4 * rows_bwd(bc) +
         (key_group_warps(d) > 1 ? 2 : 1) * sizeof(T) * bc * padded<T>(rows_bwd(bc));
}
static_assert(tile_bytes<__half>(128, Bc_small, Br) <= 99 * 1024 &&
                  tile_bytes<__half>(128, Bc_dq, 2 * Br_dq) <= 99 * 1024 &&
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

/* Copies `rows` rows of LSE and D into shared memory, by cp.async like the Q and dO tiles, not
 * stalling on global memory every tile; the rows past them up to `tile_rows` get 0 (they are
 * masked anyway). LSE becomes log2 units where read. */
__device__ void load_row_stats(const float *lse, const float *delta, int rows, int tile_rows,
                               float *lse_s, float *delta_s) {
  for (int e = threadIdx.x; e < tile_rows; e += blockDim.x) {
    if (e < rows)
      __pipeline_memcpy_async(lse_s + e, lse + e, 4),
          __pipeline_memcpy_async(delta_s + e, delta + e, 4);
    else
      lse_s[e] = 0.f, delta_s[e] = 0.f;
  }
}

/* P = 2^(s scale log2(e) - LSE) (LSE in log2 units) and dS = P (dP - D) ds_scale for the four
 * elements of an accumulator, as half an A operand (out[0] rows 0-7, out[1] rows 8-15), `delta`
 * given as D ds_scale: one FFMA in place of the subtraction, so the scaling (1 in bf16) costs
 * nothing here, and by a power of two it rounds as (dP - D) would. A masked element is 0
 * without exp2, so a row that sees no key (LSE = -inf) makes no NaN. The clamp P <= 1: an fp32
 * LSE of logits near 1e11 is known only to about 4096 (2^4096 = inf). */
template <typename T>
__device__ void probabilities_and_ds(const float *s, const float *dp, float scale_log2,
                                     const float *lse, const float *delta, const bool *visible,
                                     float ds_scale, unsigned *p_out, unsigned *ds_out) {
  float p[4], ds[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    p[e] = visible[e] ? fminf(1.f, exp2_approx(fmaf(s[e], scale_log2, -lse[e]))) : 0.f;
    ds[e] = p[e] * fmaf(dp[e], ds_scale, -delta[e]);
  }
  p_out[0] = pack2(p[0], p[1], T()), p_out[1] = pack2(p[2], p[3], T());
  ds_out[0] = pack2(ds[0], ds[1], T()), ds_out[1] = pack2(ds[2], ds[3], T());
}

/* dQ += dS K for one query tile of the dK/dV kernel (dS read transposed from dS^T in shared
 * memory): warp w takes 32 queries and Cols columns (at 32 x 32, 4 ldmatrix.x4 for 8 mma.sync;
 * 16 x 64 read 5: backward +2 to +4% at d = 64) and adds them into the fp32 dQ by atomics,
 * rows past `rows` left out. Other key blocks add into the same rows in no fixed order, so
 * dQ's last bits change from run to run; ATTN_DETERMINISTIC=1 runs the dQ kernel instead. */
template <int D, int BC, typename T>
__device__ void accumulate_dq(const T *dSt, const T *Ks, float *dq_accum, int rows) {
  constexpr int Br_bwd = rows_bwd(BC), Warps = dkdv_threads(D, BC) / 32;
  constexpr int QFrags = D * Br_bwd / (2 * MmaM * Warps) >= 16 ? 2 : 1; /* 16 columns at least */
  constexpr int RowGroups = Br_bwd / (QFrags * MmaM), Cols = D * RowGroups / Warps;
  static_assert(Warps % RowGroups == 0 && Cols % 16 == 0, "the warps cover the tile's queries");
  int w = threadIdx.x / 32, r0 = w % RowGroups * QFrags * MmaM, c0 = w / RowGroups * Cols;
  float acc[QFrags][Cols / MmaN][4] = {};
#pragma unroll
  for (int kk = 0; kk < BC / MmaK; kk++) {
    unsigned a[QFrags][4]; /* dS (queries x keys) is dS^T read with .trans: b_operand's rows */
#pragma unroll
    for (int f = 0; f < QFrags; f++)
      ldmatrix_x4_trans(a[f], b_operand<Br_bwd>(dSt, kk * MmaK, r0 + f * MmaM));
    mma_tile<D, true, Cols, QFrags>(acc, a, Ks, kk * MmaK, c0);
  }
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
#pragma unroll
  for (int f = 0; f < QFrags; f++)
#pragma unroll
    for (int n = 0; n < Cols / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int r = r0 + f * MmaM + g + 8 * (e / 2);
        float *at = dq_accum + (long)r * D + c0 + n * MmaN + 2 * tq + e % 2;
#if ATTN_PAIRED_ATOMICS && __CUDA_ARCH__ >= 900
        if (e % 2 == 0 && r < rows) /* the lane's two columns of the row, 8-byte aligned */
          atomicAdd(reinterpret_cast<float2 *>(at), make_float2(acc[f][n][e], acc[f][n][e + 1]));
#else
        if (r < rows) atomicAdd(at, acc[f][n][e]);
#endif
      }
}

/* dV += P^T dO and dK += dS^T Q for one step of 16 queries (step n2 of the tile): the P^T and
 * dS^T of the warp's FRAGS x 16 keys as A operands, the step's rows of dO and Q, columns
 * [c0, c0 + COLS), read transposed as B. */
template <int D, int COLS, int FRAGS, typename T>
__device__ void update_dkdv(const unsigned (*p_frag)[4], const unsigned (*ds_frag)[4], const T *dOt,
                            const T *Qt, int n2, int c0, float (*dv_acc)[COLS / MmaN][4],
                            float (*dk_acc)[COLS / MmaN][4]) {
#pragma unroll
  for (int c2 = 0; c2 < COLS / 16; c2++) {
    unsigned b[4];
    ldmatrix_x4_trans(b, b_operand_trans<D>(dOt, n2 * 16, c0 + c2 * 16));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(dv_acc[f][2 * c2], p_frag[f], b, T()),
          mma_m16n8k16(dv_acc[f][2 * c2 + 1], p_frag[f], b + 2, T());
    ldmatrix_x4_trans(b, b_operand_trans<D>(Qt, n2 * 16, c0 + c2 * 16));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(dk_acc[f][2 * c2], ds_frag[f], b, T()),
          mma_m16n8k16(dk_acc[f][2 * c2 + 1], ds_frag[f], b + 2, T());
  }
}

/* A warp per WarpKeys keys j of the block's BC keys (Bc_bwd, or Bc_bwd_small where shared
 * memory is smaller), keeping their dK and dV in accumulators while it walks the query tiles:
 * per 16 queries, S^T = K Q^T and dP^T = V dO^T (keys as rows) make P^T and dS^T in registers,
 * the A operands of dV += P^T dO and dK += dS^T Q with those 16 queries as the k-step. Where
 * two warps share the keys (d = 128), each makes P^T and dS^T for half of the tile's queries,
 * writes them to shared memory, and adds dK and dV for half of the columns over the whole
 * tile, reading P^T and dS^T back as A operands. */
template <int D, int BC, bool AtomicDq, typename T>
__global__ void __launch_bounds__(dkdv_threads(D, BC), dkdv_blocks_per_sm(D))
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               const float *__restrict__ ds_stats, T *__restrict__ dk,
                               T *__restrict__ dv, float *__restrict__ dq_accum, int nq, int nkv,
                               int heads, float scale, int causal) {
  constexpr int KeyFrags = WarpKeys / MmaM, Split = key_group_warps(D);
  constexpr int ld = padded<T>(D), Br_bwd = rows_bwd(BC), Threads = dkdv_threads(D, BC);
  /* K, V (BC rows), Q, dO buffers (Br_bwd rows), then past LSE and D, dS^T and P^T (BC rows of
   * Br_bwd): every tile starts on its swizzle period */
  constexpr size_t ds_offset = /* dS^T of the tile, for dQ */
      sizeof(T) * (2 * BC + 4 * Br_bwd) * ld + sizeof(float) * 4 * Br_bwd;
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * BC * ld) &&
                    starts_swizzle_period<D, T>(sizeof(T) * Br_bwd * ld) &&
                    starts_swizzle_period<Br_bwd, T>(ds_offset) &&
                    starts_swizzle_period<Br_bwd, T>(sizeof(T) * BC * padded<T>(Br_bwd)),
                "tile alignment");
  constexpr int WarpSteps = Br_bwd / Split / MmaK, Cols = D / Split; /* each warp's share */
  constexpr int QSteps = query_steps(D) < WarpSteps ? query_steps(D) : WarpSteps;
  static_assert(WarpSteps % QSteps == 0 && Cols % 16 == 0, "whole query steps and columns");
  extern __shared__ __align__(SharedAlignment) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + BC * ld;
  T *Qs = Vs + BC * ld, *dOs = Qs + 2 * Br_bwd * ld; /* Q and dO double-buffered */
  float *lse_s = reinterpret_cast<float *>(dOs + 2 * Br_bwd * ld), *delta_s = lse_s + 2 * Br_bwd;
  T *dSt = reinterpret_cast<T *>(reinterpret_cast<unsigned char *>(smem_bwd) + ds_offset);
  T *Pt = dSt + BC * padded<T>(Br_bwd); /* P^T of the tile, if Split > 1 */
  /* Causal: key block 0 has the most query tiles, so blocks go by key block across heads,
   * heaviest first (the forward's order, mirrored; +5% at d = 128, N = 4096, else within 1%). */
  int key_blocks = (nkv + BC - 1) / BC;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / key_blocks;
  int kb = (int)(causal ? blockIdx.x / heads : blockIdx.x % key_blocks);
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  int w = threadIdx.x / 32, part = Split > 1 ? w / (BC / WarpKeys) : 0; /* the warp's share */
  int j0 = kb * BC, jw = j0 + w % (BC / WarpKeys) * WarpKeys;
  int cols = min(BC, nkv - j0), offset = nkv - nq, c0 = part * Cols;
  const T *Kw = Ks + (jw - j0) * ld, *Vw = Vs + (jw - j0) * ld; /* the warp's keys */
  const T *Q = q + bh * nq * D, *dO = d_o + bh * nq * D;
  load_kv_tile<D, BC, Threads>(k + (bh * nkv + j0) * D, v + (bh * nkv + j0) * D, cols, Ks, Vs);
  float dk_acc[KeyFrags][Cols / MmaN][4] = {}, dv_acc[KeyFrags][Cols / MmaN][4] = {};
  const float scale_log2 = scale * Log2e, dss = ds_scale(ds_stats);
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  if (i_begin < nq) {
    load_kv_tile<D, Br_bwd, Threads>(Q + (long)i_begin * D, dO + (long)i_begin * D,
                                     min(Br_bwd, nq - i_begin), Qs, dOs);
    load_row_stats(lse + bh * nq + i_begin, delta + bh * nq + i_begin, min(Br_bwd, nq - i_begin),
                   Br_bwd, lse_s, delta_s);
  }
  __pipeline_commit();
  for (int i0 = i_begin, buf = 0; i0 < nq; i0 += Br_bwd, buf ^= 1) {
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D (the first time, K and V) are in shared
                      * memory; WAR: every warp is done with the last tile, so its Q/dO buffer
                      * may be refilled and its P^T and dS^T rewritten */
    int next = i0 + Br_bwd, rows = min(Br_bwd, nq - next), nb = (buf ^ 1) * Br_bwd;
    if (next < nq) { /* the next tile's copy overlaps this tile's products */
      load_kv_tile<D, Br_bwd, Threads>(Q + (long)next * D, dO + (long)next * D, rows, Qs + nb * ld,
                                       dOs + nb * ld);
      load_row_stats(lse + bh * nq + next, delta + bh * nq + next, rows, Br_bwd, lse_s + nb,
                     delta_s + nb);
    }
    __pipeline_commit();
    const T *Qt = Qs + buf * Br_bwd * ld, *dOt = dOs + buf * Br_bwd * ld;
    const float *lse_t = lse_s + buf * Br_bwd, *delta_t = delta_s + buf * Br_bwd;
    /* Only a tile past the end of the queries or keys, or crossing the diagonal, is masked. */
    bool masked =
        i0 + Br_bwd > nq || jw + WarpKeys > nkv || (causal && jw + WarpKeys - 1 > i0 + offset);
    /* QSteps query steps of 16 share each load of the warp's K and V operands */
#pragma unroll
    for (int qq = 0; qq < WarpSteps; qq += QSteps) {
      const int q0 = part * WarpSteps + qq;
      float s[QSteps][KeyFrags][2][4] = {}, dp[QSteps][KeyFrags][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        unsigned a[KeyFrags][4];
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Kw, f * MmaM, kk * MmaK));
#pragma unroll
        for (int q = 0; q < QSteps; q++)
          mma_tile<D, false, 16, KeyFrags>(s[q], a, Qt, (q0 + q) * 16, kk * MmaK);
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Vw, f * MmaM, kk * MmaK));
#pragma unroll
        for (int q = 0; q < QSteps; q++)
          mma_tile<D, false, 16, KeyFrags>(dp[q], a, dOt, (q0 + q) * 16, kk * MmaK);
      }
#pragma unroll
      for (int q = 0; q < QSteps; q++) {
        const int n2 = q0 + q;
        unsigned p_frag[KeyFrags][4], ds_frag[KeyFrags][4];
#pragma unroll
        for (int half = 0; half < 2; half++) { /* queries 0-7, then 8-15 of the k-step */
          int col = n2 * 16 + half * MmaN + 2 * tq;
          float lo = lse_t[col] * Log2e, hi = lse_t[col + 1] * Log2e;
          float lse_e[4] = {lo, hi, lo, hi};
          float lo_d = delta_t[col] * dss, hi_d = delta_t[col + 1] * dss; /* see ds_scale */
          float delta_e[4] = {lo_d, hi_d, lo_d, hi_d};
#pragma unroll
          for (int f = 0; f < KeyFrags; f++) {
            bool visible[4] = {true, true, true, true};
            if (masked)
#pragma unroll
              for (int e = 0; e < 4; e++) {
                int i = i0 + col + e % 2, j = jw + f * MmaM + g + 8 * (e / 2);
                visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
              }
            probabilities_and_ds<T>(s[q][f][half], dp[q][f][half], scale_log2, lse_e, delta_e,
                                    visible, dss, p_frag[f] + 2 * half, ds_frag[f] + 2 * half);
#pragma unroll
            for (int h = 0; h < 2; h++) { /* rows g and g + 8 of the fragment's keys */
              int at = swizzle<Br_bwd, T>(jw - j0 + f * MmaM + g + 8 * h, col);
              if (AtomicDq || Split > 1)
                *reinterpret_cast<unsigned *>(dSt + at) = ds_frag[f][2 * half + h];
              if (Split > 1) *reinterpret_cast<unsigned *>(Pt + at) = p_frag[f][2 * half + h];
            }
          }
        }
        if (Split == 1)
          update_dkdv<D, Cols, KeyFrags>(p_frag, ds_frag, dOt, Qt, n2, 0, dv_acc, dk_acc);
      }
    }
    if (AtomicDq || Split > 1)
      __syncthreads(); /* RAW: the whole tile's dS^T (and P^T) are in shared memory */
    if (Split > 1)
#pragma unroll
      for (int n2 = 0; n2 < Br_bwd / MmaK; n2++) { /* every query step, the warp's columns */
        unsigned p_frag[KeyFrags][4], ds_frag[KeyFrags][4];
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) {
          ldmatrix_x4(p_frag[f], a_operand<Br_bwd>(Pt, jw - j0 + f * MmaM, n2 * MmaK));
          ldmatrix_x4(ds_frag[f], a_operand<Br_bwd>(dSt, jw - j0 + f * MmaM, n2 * MmaK));
        }
        update_dkdv<D, Cols, KeyFrags>(p_frag, ds_frag, dOt, Qt, n2, c0, dv_acc, dk_acc);
      }
    if (AtomicDq) accumulate_dq<D, BC>(dSt, Ks, dq_accum + (bh * nq + i0) * D, nq - i0);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  float dk_factor[2 * KeyFrags], dv_factor[2 * KeyFrags];
#pragma unroll
  for (int h = 0; h < 2 * KeyFrags; h++) dk_factor[h] = scale / dss, dv_factor[h] = 1.f;
  store_tile<Cols, KeyFrags>(dk_acc, dk_factor, dk + (bh * nkv + jw) * D + c0, nkv - jw, D);
  store_tile<Cols, KeyFrags>(dv_acc, dv_factor, dv + (bh * nkv + jw) * D + c0, nkv - jw, D);
}

/* A warp per 16 query rows, walking the key tiles like the forward with dQ in accumulators;
 * per 16 keys, S = Q K^T and dP = dO V^T become dS in registers, the A operand of dQ += dS K:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br_dq), dq_blocks_per_sm(D))
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             const float *__restrict__ ds_stats, T *__restrict__ dq, int nq,
                             int nkv, int heads, float scale, int causal) {
  constexpr int ld = padded<T>(D), Br = Br_dq, Bc = Bc_dq; /* this kernel's own tiles */
  /* K and V buffers (Bc rows), Q and dO (Br rows): each starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * Bc * ld) &&
                    starts_swizzle_period<D, T>(sizeof(T) * Br * ld),
                "tile alignment");
  constexpr int Threads = threads_for(Br);
  extern __shared__ __align__(SharedAlignment) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * Bc * ld, *Qs = Vs + 2 * Bc * ld;
  T *dOs = Qs + Br * ld;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int iw = i0 + threadIdx.x / 32 * MmaM, g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  const T *Qw = Qs + (iw - i0) * ld, *dOw = dOs + (iw - i0) * ld; /* the warp's 16 rows */
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float dq_acc[1][D / MmaN][4] = {};
  /* The warp's Q and dO rows as A operands, read once from shared memory: the same 16 rows
   * meet every key tile, and reloading them would double the ldmatrix reads of S and dP. */
  unsigned q_frag[D / MmaK][4], do_frag[D / MmaK][4];
  const float scale_log2 = scale * Log2e, dss = ds_scale(ds_stats);
  load_kv_tile<D, Br, Threads>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, min(Br, nq - i0),
                               Qs, dOs);
  /* LSE (log2 units) and D of the lane's two rows, in registers; rows past the end get 0. */
  float lse_e[4], delta_e[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    int i = iw + g + 8 * (e / 2);
    lse_e[e] = i < nq ? lse[bh * nq + i] * Log2e : 0.f;
    delta_e[e] = i < nq ? delta[bh * nq + i] * dss : 0.f; /* see ds_scale */
  }
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  if (kv_end > 0) load_kv_tile<D, Bc, Threads>(K, V, min(Bc, nkv), Ks, Vs);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += Bc, buf ^= 1) {
    int next = j0 + Bc;
    if (next < kv_end)
      load_kv_tile<D, Bc, Threads>(K + (long)next * D, V + (long)next * D, min(Bc, nkv - next),
                                   Ks + (buf ^ 1) * Bc * ld, Vs + (buf ^ 1) * Bc * ld);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: the whole tile (the first time, Q and dO too) is in shared memory */
    const T *Kt = Ks + buf * Bc * ld, *Vt = Vs + buf * Bc * ld;
    if (j0 == 0) /* Q and dO have landed: their operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++)
        ldmatrix_x4(q_frag[kk], a_operand<D>(Qw, 0, kk * MmaK)),
            ldmatrix_x4(do_frag[kk], a_operand<D>(dOw, 0, kk * MmaK));
    /* Only a tile past the end of the keys or rows, or crossing the warp's diagonal, is masked. */
    bool masked = j0 + Bc > nkv || iw + MmaM > nq || (causal && j0 + Bc - 1 > iw + offset);
#pragma unroll
    for (int n2 = 0; n2 < Bc / MmaK; n2++) { /* 16 keys: one k-step of dQ */
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        mma_tile<D, false, 16>(&s, q_frag + kk, Kt, n2 * 16, kk * MmaK);
        mma_tile<D, false, 16>(&dp, do_frag + kk, Vt, n2 * 16, kk * MmaK);
      }
      unsigned p_frag[4], ds_frag[4];
#pragma unroll
      for (int half = 0; half < 2; half++) { /* keys 0-7, then 8-15 of the k-step */
        bool visible[4] = {true, true, true, true};
        if (masked)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            int i = iw + g + 8 * (e / 2), j = j0 + n2 * 16 + half * MmaN + 2 * tq + e % 2;
            visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
          }
        probabilities_and_ds<T>(s[half], dp[half], scale_log2, lse_e, delta_e, visible, dss,
                                p_frag + 2 * half, ds_frag + 2 * half);
      }
      mma_tile<D, true, D>(dq_acc, &ds_frag, Kt, n2 * 16, 0);
    }
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  const float dq_factor[2] = {scale / dss, scale / dss};
  store_tile<D, 1>(dq_acc, dq_factor, dq + (bh * nq + iw) * D, nq - iw);
}

/* dQ = scale times the fp32 sums the dK/dV kernel added up (of dS times ds_scale), in the
 * dtype. */
template <typename T>
__global__ void convert_dq_kernel(const float *dq_accum, const float *ds_stats, T *dq, long elems,
                                  float scale) {
  long e = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (e < elems) dq[e] = T(scale / ds_scale(ds_stats) * dq_accum[e]);
}

template <int D, int BC, bool AtomicDq, typename T>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta,
                        const float *ds_stats, float *dq_accum) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC, AtomicDq, T>,
                             dkdv_bytes<T>(D, BC), "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + BC - 1) / BC * heads);
  flash_backward_dkdv_kernel<D, BC, AtomicDq>
      <<<key_blocks, dkdv_threads(D, BC), dkdv_bytes<T>(D, BC), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          ds_stats, (T *)t->dk, (T *)t->dv, dq_accum, p->seq_q, p->seq_kv, heads, p->scale,
          p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <int D, typename T = __half>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch_backward<D, __nv_bfloat16>(p, t);
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q, kv_rows = (long)heads * p->seq_kv;
  float *delta = (float *)t->workspace;
  float *dq_accum = delta + delta_floats(rows);
  long dq_elems = rows * D;
  /* The bound on |dS| in fp16 only (ds_scale); bf16 passes none. */
  float *ds_stats = std::is_same_v<T, __half> ? dq_accum + dq_elems : nullptr;
  if (ds_stats) CUDA_CHECK(cudaMemsetAsync(ds_stats, 0, sizeof(float) * DsStats, attn_stream()));
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  long delta_rows = ds_stats ? max(rows, kv_rows) : rows, lanes = D * sizeof(T) / 16;
  long delta_grid = (delta_rows * lanes + delta_threads - 1) / delta_threads;
  compute_delta_kernel<D><<<(unsigned)delta_grid, delta_threads, 0, attn_stream()>>>(
      (const T *)t->o, (const T *)t->d_o, (const T *)t->v, delta, ds_stats, rows, kv_rows);
  CHECK_LAUNCH("compute_delta_kernel");
  /* dQ by atomics from the dK/dV kernel (five products a tile), or, with
   * ATTN_DETERMINISTIC=1, by the dQ kernel (seven, every bit the same run after run). */
  bool atomic_dq = !attn_deterministic();
  if (atomic_dq) CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, sizeof(float) * dq_elems, attn_stream()));
  bool big = dkdv_bytes<T>(D, Bc_bwd) <= attn_shared_memory_limit();
  if (atomic_dq && big) launch_dkdv<D, Bc_bwd, true, T>(p, t, delta, ds_stats, dq_accum);
  if (atomic_dq && !big) launch_dkdv<D, Bc_bwd_small, true, T>(p, t, delta, ds_stats, dq_accum);
  if (!atomic_dq && big) launch_dkdv<D, Bc_bwd, false, T>(p, t, delta, ds_stats, dq_accum);
  if (!atomic_dq && !big) launch_dkdv<D, Bc_bwd_small, false, T>(p, t, delta, ds_stats, dq_accum);
  if (atomic_dq) {
    const int convert_threads = 256; /* a memory-bound pass: any full-warp count will do */
    convert_dq_kernel<<<(unsigned)((dq_elems + convert_threads - 1) / convert_threads),
                        convert_threads, 0, attn_stream()>>>(dq_accum, ds_stats, (T *)t->dq,
                                                             dq_elems, p->scale);
    CHECK_LAUNCH("convert_dq_kernel");
    return;
  }
  size_t dq_bytes = tile_bytes<T>(D, Bc_dq, 2 * Br_dq);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D, T>, dq_bytes,
                             "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Br_dq - 1) / Br_dq * heads);
  flash_backward_dq_kernel<D><<<row_blocks, threads_for(Br_dq), dq_bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta, ds_stats,
      (T *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  /* 09's backward, for 09's problems. (The harness refuses --backward with GQA or cache
   * lengths before anything runs; this line guards the library's callers.) */
  if (attn_heads_kv(p) != p->heads || p->cache_lens)
    attn_fail(EXIT_BAD_USAGE, "the backward takes Hkv = H and no cache lengths (it is 09's)");
  switch (p->head_dim) {
    case 32: launch_backward<32>(p, t); break;
    case 64: launch_backward<64>(p, t); break;
    case 128: launch_backward<128>(p, t); break;
  }
}

static const attn_stage stage = {
    .name = "11_split_kv_decode",
    .idea = "decode: keys split across blocks, merged by LSE; grouped-query attention",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward_workspace = forward_workspace,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
    .has_gqa = 1,
    .has_cache_lens = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
