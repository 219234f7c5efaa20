/* Stage 08's shared-memory tiles: padded rows, copied by cp.async, and where a lane's ldmatrix
 * row lies in them; and the store of a warp's accumulators to global memory. */
#pragma once

#include <cuda_pipeline.h>

#include "mma.cuh"

/* Padding of every shared-memory row, in bytes: unpadded rows of 64 to 256 bytes start on one
 * or two banks, where the rows of a fragment load would queue; 16 bytes shift a row 4 banks.
 * padded<E>(cols) is the leading dimension of a tile of `cols` elements of E per row. */
constexpr int Skew = 16;
static_assert(Skew % 16 == 0, "rows stay 16-byte aligned for 16-byte copies and fragment loads");
template <typename E>
__host__ __device__ constexpr int padded(int cols) {
  return cols + Skew / (int)sizeof(E);
}

/* Shared memory: K and V (bc rows, double-buffered), `rows` rows of Q (or Q, dO); none staged */
template <typename T>
static constexpr size_t tile_bytes(int d, int bc, int rows) {
  return sizeof(T) * (4 * (size_t)bc + rows) * padded<T>(d);
}

/* Rows [0, rows) of a [*, D] tensor into a tile of ROWS padded rows; the rows past `rows` are
 * zeroed, since they enter the products (where 0 times a stale NaN is NaN). */
template <int D, int ROWS, typename T>
__device__ void load_tile(const T *src, int rows, T *dst) {
  constexpr int W = D * sizeof(T) / 16; /* float4s per row */
  for (int e = threadIdx.x; e < ROWS * W; e += blockDim.x) {
    int r = e / W;
    if (r < rows) /* cp.async: no waiting here, see __pipeline_wait_prior */
      __pipeline_memcpy_async(dst + r * padded<T>(D) + e % W * (16 / sizeof(T)),
                              src + e * 16 / sizeof(T), 16);
    else
      reinterpret_cast<float4 *>(dst + r * padded<T>(D))[e % W] = float4{};
  }
}

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (blockDim.x, not Br:
 * the dK/dV kernel reuses this with more threads per block, and for Q and dO: ROWS.) */
template <int D, int ROWS, typename T>
__device__ void load_kv_tile(const T *K, const T *V, int cols, T *Ks, T *Vs) {
  load_tile<D, ROWS>(K, cols, Ks), load_tile<D, ROWS>(V, cols, Vs);
}

/* The shared-memory address of element (row + lane_row, col + lane_col) of a tile of D-element
 * padded rows: the lane's address is computed once, and (row, col), constants where the loops
 * are unrolled, an immediate the loads fold in. */
template <int D, typename T>
__device__ unsigned operand_address(const T *tile, int lane_row, int lane_col, int row, int col) {
  unsigned lane = (unsigned)__cvta_generic_to_shared(tile + lane_row * padded<T>(D) + lane_col);
  return lane + (row * padded<T>(D) + col) * sizeof(T);
}

/* Writes a warp's FRAGS x 16 rows of fp32 accumulators times factor[h] (h the lane's row) in
 * the dtype, rows [0, rows) only: each lane stores its two adjacent columns as one word. */
template <int D, int FRAGS, typename T>
__device__ void store_tile(const float (*acc)[D / MmaN][4], const float *factor, T *out, int rows) {
  int g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < 2 * FRAGS; h++) {
    int r = g + 8 * h, e = 2 * (h % 2);
    if (r < rows)
#pragma unroll
      for (int n = 0; n < D / MmaN; n++)
        *reinterpret_cast<unsigned *>(out + (long)r * D + n * MmaN + 2 * t) =
            pack2(acc[h / 2][n][e] * factor[h], acc[h / 2][n][e + 1] * factor[h], T());
  }
}
