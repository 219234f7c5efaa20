/* Stage 07's tiles and tensor-core products: padded shared-memory rows, WMMA's 16 x 16 x 16
 * fragments, and a warp's product staged through shared memory so that each thread can read
 * its row of it. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <type_traits>

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
