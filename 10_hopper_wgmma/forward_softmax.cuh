/* Stage 10's forward, the parts that stage 12's backward and stage 14 build on: the block's
 * shape and registers, the products and online-softmax steps of a tile, the tensor maps of
 * TMA, and the check for Hopper. forward.cuh walks them over the key tiles. */
#pragma once

#include <cudaTypedefs.h>
#include <math.h>
#include <type_traits>

#include "../09_swizzle_pipeline/tiles.cuh"
#include "attention.h"
#include "gpu.h"
#include "hopper.cuh"

/* A warp's query rows in the forward, in instruction heights (fragments): one. A wgmma is 64
 * rows tall, 16 for each warp of its warpgroup, and its accumulators lie in each warp exactly
 * as those of mma.sync do (08's mma.cuh), so the softmax code is 09's with one fragment. */
__host__ __device__ constexpr int row_frags(int) { return 1; }
/* Consumer warpgroups per block: at d = 128, 2, so that a block's Q tile is 128 rows (as in
 * 09) and each K and V tile copied into shared memory serves 128 rows. At d <= 64 a tile's
 * products take half as long for the same exponentials, so 3 (FlashAttention-3's 192 rows):
 * one more warpgroup whose softmax can run while the others' products do (against two,
 * -DATTN_SMALL_D_CONSUMERS=2: the README's A/B table). */
#ifndef ATTN_SMALL_D_CONSUMERS
#define ATTN_SMALL_D_CONSUMERS 3
#endif
__host__ __device__ constexpr int consumers(int d) { return d > 64 ? 2 : ATTN_SMALL_D_CONSUMERS; }
__host__ __device__ constexpr int block_rows(int d) { return consumers(d) * WgmmaM; }
/* Keys per tile: 128, the N of S = Q K^T's wgmma (64 registers of S a thread). An SS wgmma
 * reads its A operand (Q, 64 x 16) again for every instruction: at N = 64 its two operands,
 * 2 + 2 KiB per 64 x 64 x 16, would need about 128 bytes a clock at the tensor cores' rate,
 * all of shared memory's bandwidth; at N = 128, 2 + 4 KiB per twice the work, 96. */
constexpr int Bc = 128;
/* Waits for all but the last N committed wgmma groups (hopper.cuh). */
template <int N>
__device__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
constexpr int Producers = 1; /* warpgroups */
__host__ __device__ constexpr int forward_threads(int d) {
  return (Producers + consumers(d)) * WarpgroupThreads;
}
/* Registers a thread after setmaxnreg: the producer keeps 24 (it only issues copies), a
 * consumer takes what is left, a multiple of 8: 240 of two consumers (128 x 24 + 256 x 240 =
 * 64512 of the SM's 65536), 160 of three. */
constexpr int ProducerRegisters = 24;
__host__ __device__ constexpr int consumer_registers(int d) {
  return consumers(d) == 2 ? 240 : 160;
}
/* K and V tiles in flight: 2 stages of each (160 KiB of shared memory with Q at d = 128), so
 * that the copy of tile t + 1 runs while tile t is multiplied; 1 where the device gives a
 * block less (the tests lower the limit to exercise it). */
constexpr int KvStages = 2;
/* A lane holds 2 rows of the warp's 16: its row h is g + 8 h of the warp's rows, element e of
 * an accumulator belongs to row e / 2. A wgmma's accumulators (64 x N) are, in each warp of the
 * warpgroup, mma.sync's for that warp's 16 rows, N / 8 of them side by side. */

/* Issues S = Q K^T for one tile (the warpgroup's 64 rows, BC keys) into the accumulators
 * s[BC / 8][4], one wgmma a k-step, Q and K read from shared memory; the caller waits. */
template <int D, typename T>
__device__ void compute_qk_scores(const T *Q, const T *K, float (*s)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T), Br = block_rows(D);
  wgmma_fence(); /* the softmax's reads of the last S come before this product overwrites it */
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    const int box = kk * MmaK / Cols, col = kk * MmaK % Cols;
    uint64_t a = operand_descriptor<Cols * sizeof(T)>(Q + box * Br * Cols + col, 16, Atom);
    uint64_t b = operand_descriptor<Cols * sizeof(T)>(K + box * Bc * Cols + col, 16, Atom);
    wgmma_qk<T>(&s[0][0], a, b, kk > 0);
  }
  wgmma_commit();
}

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l,
 * and the O accumulators, which rescale_output multiplies once they are no longer being
 * written) is rescaled by correction = 2^((m - m') scale log2 e), row by row. */
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float *correction) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float m_new = fmaxf(m[h], m_blk[h]);
    /* While a row has seen no key m' is still -inf, and 2^(-inf - -inf) would be NaN; there
     * is nothing to rescale then (l = 0, acc = 0). Otherwise 0 on the first visible tile. */
    correction[h] = m_new == -INFINITY ? 1.f : exp2_approx((m[h] - m_new) * scale_log2);
    l[h] *= correction[h];
    m[h] = m_new;
  }
}
template <int D>
__device__ void rescale_output(const float *correction, float (*acc)[4]) {
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[n][e] *= correction[e / 2];
}

/* p = 2^((s - m) scale log2(e)) in place of s; l += p (this lane's columns only: the quad's
 * partial sums are added once, at the end). Not one FFMA, 2^(s c - m c) with m c precomputed
 * as FlashAttention does: m c is rounded, and for the row's largest element s c - round(m c)
 * is that rounding error, half an ulp of m c, which is no longer small once |m c| passes
 * 2^16 or so (4096 at logits of 1e11, bf16 inputs near 1e5): 2^4096 is inf. */
template <int BC>
__device__ void exponentiate_scores(float (*s)[4], float scale_log2, const float *m, float *l) {
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[2];
#pragma unroll
  for (int h = 0; h < 2; h++) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];
#pragma unroll
  for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      s[n][e] = exp2_approx((s[n][e] - m_use[e / 2]) * scale_log2);
      l[e / 2] += s[n][e];
    }
}

/* P in the dtype, as the A operands of P V: for each 16 keys, the two accumulators of S that
 * hold them become one A operand (mma.sync's layout, which wgmma's register A shares). */
template <int BC, typename T>
__device__ void pack_probabilities(const float (*s)[4], unsigned (*p_frag)[4]) {
#pragma unroll
  for (int kk = 0; kk < BC / MmaK; kk++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const float *p = s[2 * kk + half];
      p_frag[kk][2 * half] = pack2(p[0], p[1], T());     /* rows 0-7 */
      p_frag[kk][2 * half + 1] = pack2(p[2], p[3], T()); /* rows 8-15 */
    }
}

/* Issues acc += P V for one tile, one wgmma per 16 keys, V read transposed from shared
 * memory; the caller waits. */
template <int D, typename T>
__device__ void multiply_pv(const unsigned (*p_frag)[4], const T *V, float (*acc)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T);
  wgmma_fence(); /* the writes of P and of the rescaled acc come before the products read them */
#pragma unroll
  for (int kk = 0; kk < Bc / MmaK; kk++)
    wgmma_pv<D, T>(
        &acc[0][0], p_frag[kk],
        operand_descriptor<Cols * sizeof(T)>(V + kk * MmaK * Cols, Bc * Cols * sizeof(T), Atom));
  wgmma_commit();
}
/* O = acc / l, LSE = m scale + ln l for the lane's rows (a row that saw no key: O = 0,
 * LSE = -inf), after adding up the quad's partial sums of l. */
template <int D, typename T>
__device__ void normalize_output(const float (*acc)[D / MmaN][4], const float *m, float *l,
                                 float scale_log2, T *O, float *LSE, int rows, long ld) {
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
  store_tile<D, RowFrags>(acc, inv_l, O, rows, ld);
}

/* Shared memory of a forward block: the Q tile, KvStages K and V tiles, their mbarriers,
 * and room to start the tiles on an atom boundary. */
template <typename T>
static constexpr size_t forward_bytes(int d, int stages) {
  return AtomAlignment + sizeof(T) * (size_t)d * (block_rows(d) + 2 * (size_t)stages * Bc) +
         sizeof(uint64_t) * (1 + 4 * (size_t)stages);
}
static_assert(forward_bytes<__half>(128, 1) <= 99 * 1024,
              "the forward has a configuration within 99 KiB, which the tests exercise");

/* The driver's tensor-map encoder, looked up through the runtime (cudaGetDriverEntryPoint)
 * rather than linked: a program linked against libcuda.so.1 could not even start on a
 * machine without the driver, where it must say "no CUDA device" and exit 77. */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult found;
    void *fn = nullptr;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !fn)
      attn_fail(EXIT_NO_DEVICE, "the CUDA driver has no cuTensorMapEncodeTiled (TMA)");
    encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
  }
  return encode;
}

/* A tensor of `batch` sequences of s.heads heads of `rows` rows, laid out as `s` says ([B, H, N,
 * d] or [B, N, H, d]), as TMA sees it: dims (D, rows, heads, batch), copied in boxes of BoxCols
 * columns x ROWS rows of one head, swizzled like the tiles above; rows past `rows` read as
 * zeros. */
template <int D, int ROWS, typename T>
static CUtensorMap tile_map(const void *tensor, attn_strides s, int rows, int batch) {
  constexpr int Cols = box_cols<D, T>();
  cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)rows, (cuuint64_t)s.heads, (cuuint64_t)batch};
  cuuint64_t strides[3] = {s.row * sizeof(T), s.head * sizeof(T), s.batch * sizeof(T)}; /* bytes */
  cuuint32_t box[4] = {(cuuint32_t)Cols, (cuuint32_t)ROWS, 1, 1}, steps[4] = {1, 1, 1, 1};
  CUtensorMap map;
  CUresult r = tensor_map_encoder()(
      &map,
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      4, const_cast<void *>(tensor), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
      Cols * sizeof(T) == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    attn_fail(EXIT_CHECK_FAILED, "cuTensorMapEncodeTiled failed (CUresult %d)", (int)r);
  return map;
}

/* The kernels are built for sm_90a only: any other GPU is told so before a launch fails.
 * Asked at every launch, not once: a process (PyTorch's) may move between GPUs. */
static void require_hopper() {
  int device, major, minor;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0)
    attn_fail(EXIT_NO_DEVICE,
              "needs compute capability 9.0 (Hopper: wgmma, TMA, setmaxnreg); this GPU is %d.%d",
              major, minor);
}
