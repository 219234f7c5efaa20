/* Stage 08's tensor-core helpers: mma.sync and ldmatrix, one function each, the fragment
 * layout they share (drawn below), and what the kernels build on it: operands loaded from a tile,
 * a product over a tile, P packed in place, a row's max and sum over its quad. Later stages
 * include this file; each defines the tile layout (operand_address) in its tiles.cuh. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
__host__ __device__ constexpr int threads_for(int rows, int f = 1) { return rows / f / MmaM * 32; }

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

/* The shared-memory address of element (row + lane_row, col + lane_col) of a tile of D-element
 * rows: the tile layout's, so each stage's tiles.cuh defines it (08's rows are padded, 09's
 * swizzled). */
template <int D, typename T>
__device__ unsigned operand_address(const T *tile, int lane_row, int lane_col, int row, int col);
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
