/* Stage 09's shared-memory tiles: swizzled rows, copied by cp.async in loops the compiler
 * unrolls, and where a lane's ldmatrix row lies in them; and the store of a warp's accumulators
 * to global memory. Stages 10 and 11 include this file. */
#pragma once

#include <cuda_pipeline.h>

#include "../08_mma_sync/mma.cuh"

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
 * -DATTN_SWIZZLE=0 builds 08's padded rows (the README's A/B table). */
#ifndef ATTN_SWIZZLE
#define ATTN_SWIZZLE 1
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

/* Shared memory: K and V (bc rows, `buffers` buffers each), `rows` rows of Q (or Q, dO); none
 * staged */
template <typename T>
static constexpr size_t tile_bytes(int d, int bc, int rows, int buffers = 2) {
  return sizeof(T) * (2 * buffers * (size_t)bc + rows) * padded<T>(d);
}

#ifndef ATTN_WHOLE_TILES
#define ATTN_WHOLE_TILES 1
#endif
/* Rows [0, rows) of a tensor whose rows start `ld` elements apart (D in [B, H, N, d], H D in
 * [B, N, H, d]) into a tile of ROWS swizzled rows; the rows past `rows` are zeroed, since they
 * enter the products (where 0 times a stale NaN is NaN). */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_tile(const T *src, int rows, T *dst, long ld = D) {
  /* THREADS known at compile time: the loop unrolls, and each thread swizzles its offset once,
   * as a pass moves whole swizzle periods (8 rows). (A runtime index cost ~30 instructions.) */
  constexpr int Chunk = 16 / sizeof(T), W = D / Chunk, Step = THREADS / W; /* rows a pass */
  static_assert(THREADS % W == 0 && Step % 8 == 0, "a pass moves whole swizzle periods");
  const int tid = threadIdx.x, r = tid / W;
  /* One source pointer moved a pass at a time, not an offset per pass: with `ld` known only at
   * run time, Passes offsets k Step ld are 64-bit values kept live through the key loop, which
   * pushed the forward at d = 64 past its register cap into spills (ptxas -v shows both). */
  const T *from = src + r * ld + tid % W * Chunk;
  const long step = Step * ld;
  T *to = dst + swizzle<D, T>(r, tid % W * Chunk);
  constexpr int Passes = (ROWS * W + THREADS - 1) / THREADS;
  /* A whole tile (all but a sequence's last) copies without testing rows: in 09's forward 9
   * instructions less per K or V tile at d = 64, ~55 at d = 128 (=0: tests every copy). */
  if (ATTN_WHOLE_TILES && rows >= ROWS && (ROWS * W) % THREADS == 0) {
#pragma unroll
    for (int k = 0; k < Passes; k++, from += step)
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from, 16);
    return;
  }
#pragma unroll
  for (int k = 0; k < Passes; k++, from += step) {
    if ((ROWS * W) % THREADS != 0 && k * THREADS + tid >= ROWS * W) break;
    if (r + k * Step < rows) /* cp.async: no waiting here, see __pipeline_wait_prior */
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from, 16);
    else
      *reinterpret_cast<float4 *>(to + k * Step * padded<T>(D)) = float4{};
  }
}

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (THREADS, not Br:
 * the dK/dV kernel reuses this with more threads per block, and for Q and dO: ROWS.) */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_kv_tile(const T *K, const T *V, int cols, T *Ks, T *Vs, long ld = D) {
  load_tile<D, ROWS, THREADS>(K, cols, Ks, ld), load_tile<D, ROWS, THREADS>(V, cols, Vs, ld);
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

/* Writes a warp's FRAGS x 16 rows of fp32 accumulators times factor[h] (h the lane's row) in
 * the dtype, rows [0, rows) only: each lane stores its two adjacent columns as one word. */
template <int D, int FRAGS, typename T>
__device__ void store_tile(const float (*acc)[D / MmaN][4], const float *factor, T *out, int rows,
                           long ld = D) {
  int g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < 2 * FRAGS; h++) {
    int r = g + 8 * h, e = 2 * (h % 2);
    if (r < rows)
#pragma unroll
      for (int n = 0; n < D / MmaN; n++)
        *reinterpret_cast<unsigned *>(out + r * ld + n * MmaN + 2 * t) =
            pack2(acc[h / 2][n][e] * factor[h], acc[h / 2][n][e + 1] * factor[h], T());
  }
}
