/* Stage 10's forward: a producer warpgroup copies K and V by TMA, consumer warpgroups multiply
 * by wgmma and overlap the softmax with their products. */
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

/* Only a tile that crosses the causal diagonal or the end of the keys is masked: an element
 * past its row's last visible key becomes -inf. A row sees the tile's first `cols` keys, and
 * on a diagonal tile the lane's row h only `visible + 8 h` of them. m_blk[h] is row h's max
 * over the tile, reduced over the row's quad. */
template <int BC>
__device__ void mask_and_row_max(float (*s)[4], int cols, bool diagonal, int visible,
                                 float *m_blk) {
  int t = threadIdx.x % Quad;
  if (diagonal || cols < BC)
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (n * MmaN + 2 * t + e % 2 >= (diagonal ? min(cols, visible + 8 * (e / 2)) : cols))
          s[n][e] = -INFINITY;
  m_blk[0] = m_blk[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) m_blk[e / 2] = fmaxf(m_blk[e / 2], s[n][e]);
#pragma unroll
  for (int h = 0; h < 2; h++) m_blk[h] = max_over_quad(m_blk[h]);
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

template <int D, int STAGES, typename T>
__global__ void __launch_bounds__(forward_threads(D), 1)
    flash_forward_kernel(const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, T *__restrict__ o,
                         float *__restrict__ lse, attn_strides qs, int nq, int nkv, int heads,
                         int group, float scale, int causal) {
  constexpr int Cols = box_cols<D, T>(), Br = block_rows(D), Consumers = consumers(D);
  constexpr int ConsumerWarps = Consumers * WarpgroupThreads / 32;
  /* The copy engine and wgmma swizzle by address bits, so each tile, each box of a tile and
   * each consumer's slice of Q must start on a whole swizzle atom (8 rows of a box): the
   * offsets below are whole boxes of Br, Bc or WgmmaM rows from a base on AtomAlignment. */
  constexpr size_t SwizzleAtom = 8 * Cols * sizeof(T);
  static_assert(AtomAlignment % SwizzleAtom == 0 && sizeof(T) * Br * Cols % SwizzleAtom == 0 &&
                    sizeof(T) * Bc * Cols % SwizzleAtom == 0 &&
                    sizeof(T) * WgmmaM * Cols % SwizzleAtom == 0,
                "tile alignment");
  extern __shared__ unsigned char smem_raw[];
  T *Qs = reinterpret_cast<T *>(
      smem_raw + (AtomAlignment - shared_address(smem_raw) % AtomAlignment) % AtomAlignment);
  T *Ks = Qs + Br * D, *Vs = Ks + STAGES * Bc * D; /* K and V in STAGES stages each */
  uint64_t *q_full = reinterpret_cast<uint64_t *>(Vs + STAGES * Bc * D);
  /* full: the tile has landed (the copy's bytes); empty: every consumer warp is done with it */
  uint64_t *k_full = q_full + 1, *v_full = k_full + STAGES, *k_empty = v_full + STAGES,
           *v_empty = k_empty + STAGES;
  /* Causal blocks have unequal work: row block r does about r + 1 times row block 0's. Ordered by
   * row block across all heads, every head's heaviest block starts first and the light ones
   * fill the tail. Non-causal blocks are equal, so a head's blocks stay adjacent and share
   * its K and V in L2. (09's order.) */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  int tiles = (kv_end + Bc - 1) / Bc;
  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < STAGES; s++) {
      mbarrier_init(&k_full[s], 1), mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], ConsumerWarps), mbarrier_init(&v_empty[s], ConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads(); /* the barriers are initialised before anyone waits on them or copies */

  /* The producer: one thread issues every copy, K(t) and V(t) into stage t % STAGES once the
   * consumers have let go of the tile that stage held. A wait for parity 1 on a new barrier
   * returns at once: the ring starts empty. */
  auto produce = [&](int t) {
    int s = t % STAGES, parity = t / STAGES & 1;
    mbarrier_wait(&k_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&k_map, t * Bc, bh / group, qs.heads / group, Ks + s * Bc * D,
                           &k_full[s]);
    mbarrier_wait(&v_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&v_map, t * Bc, bh / group, qs.heads / group, Vs + s * Bc * D,
                           &v_full[s]);
  };
  const int warpgroup = threadIdx.x / WarpgroupThreads;
  if (warpgroup == 0) {
    give_registers<ProducerRegisters>();
    if (threadIdx.x == 0) {
      load_tile_async<D, Br>(&q_map, i0, bh, qs.heads, Qs, q_full);
      for (int t = 0; t < tiles; t++) produce(t);
    }
    return; /* nothing below waits for the producer but through the barriers */
  }
  take_registers<consumer_registers(D)>();

  /* A consumer warpgroup: 64 rows of the block, 16 a warp; this lane holds rows i + 8 h. */
  const int consumer = warpgroup - Producers, warp = threadIdx.x / 32 % 4;
  int row0 = i0 + consumer * WgmmaM + warp * MmaM, i = row0 + threadIdx.x % 32 / Quad;
  const T *Q = Qs + consumer * WgmmaM * Cols; /* the warpgroup's rows, in every box */
  const bool lane0 = threadIdx.x % 32 == 0;
  float acc[1][D / MmaN][4] = {}, s[Bc / MmaN][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, m_blk[2], correction[2];
  unsigned p_frag[Bc / MmaK][4];
  mbarrier_wait(q_full, 0);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    for (int e = threadIdx.x % WarpgroupThreads; e < WgmmaM * D; e += WarpgroupThreads) {
      T &x = Qs[e % D / Cols * Br * Cols + (consumer * WgmmaM + e / D) * Cols + e % Cols];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
    /* the threads' stores become visible to wgmma, which reads through the async proxy */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    warpgroup_sync(1 + consumer); /* RAW: all 64 rows are rewritten before the products */
  }
  /* One tile's softmax, from S (waited for) to P in fp32 in s: mask, row max, the running max
   * and sum. The output's rescale is left to the caller, which may have a product of it in
   * flight. */
  auto softmax = [&](int t) {
    int j0 = t * Bc, cols = min(Bc, nkv - j0);
    /* A tile past the warp's first row's limit crosses the diagonal: each row keeps the
     * columns it sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    mask_and_row_max<Bc>(s, cols, diagonal, i + offset + 1 - j0, m_blk);
    merge_block_stats(m_blk, scale_log2, m, l, correction);
    exponentiate_scores<Bc>(s, scale_log2, m, l);
  };
  auto release = [&](uint64_t *bar) {
    if (lane0) mbarrier_arrive(bar); /* after this warp's wait: its products are done */
  };
  if (tiles > 0) {
    /* S(t) and P(t - 1) V(t - 1) are in flight together; the softmax of S(t) runs while the
     * tensor cores finish P(t - 1) V(t - 1), whose end the rescale of O waits for. */
    mbarrier_wait(&k_full[0], 0);
    compute_qk_scores<D>(Q, Ks, s);
    wgmma_wait<0>();
    settle<Bc / 2>(&s[0][0]);
    release(&k_empty[0]);
    softmax(0);
    pack_probabilities<Bc, T>(s, p_frag);
    for (int t = 1; t < tiles; t++) {
      int st = t % STAGES, parity = t / STAGES & 1;
      int prev = (t - 1) % STAGES, prev_parity = (t - 1) / STAGES & 1;
      mbarrier_wait(&k_full[st], parity);
      compute_qk_scores<D>(Q, Ks + st * Bc * D, s);
      mbarrier_wait(&v_full[prev], prev_parity);
      multiply_pv<D>(p_frag, Vs + prev * Bc * D, acc[0]);
      wgmma_wait<1>(); /* S(t) is done; P(t - 1) V(t - 1) may still run */
      settle<Bc / 2>(&s[0][0]);
      release(&k_empty[st]);
      softmax(t);
      wgmma_wait<0>();
      settle<D / 2>(&acc[0][0][0]);
      release(&v_empty[prev]);
      rescale_output<D>(correction, acc[0]);
      pack_probabilities<Bc, T>(s, p_frag);
    }
    int last = (tiles - 1) % STAGES, last_parity = (tiles - 1) / STAGES & 1;
    mbarrier_wait(&v_full[last], last_parity);
    multiply_pv<D>(p_frag, Vs + last * Bc * D, acc[0]);
    wgmma_wait<0>();
    settle<D / 2>(&acc[0][0][0]);
    release(&v_empty[last]);
  }
  normalize_output<D>(acc, m, l, scale_log2, o + row_start(qs, bh, row0), lse + bh * nq + row0,
                      nq - row0, qs.row);
}

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

template <int D, int STAGES, typename T>
static void launch_forward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  constexpr int Br = block_rows(D);
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_strides qs = attn_q_strides(p), kvs = attn_kv_strides(p);
  CUtensorMap q_map = tile_map<D, Br, T>(t->q, qs, p->seq_q, p->batch);
  CUtensorMap k_map = tile_map<D, Bc, T>(t->k, kvs, p->seq_kv, p->batch);
  CUtensorMap v_map = tile_map<D, Bc, T>(t->v, kvs, p->seq_kv, p->batch);
  size_t bytes = forward_bytes<T>(D, STAGES);
  attn_require_shared_memory((const void *)flash_forward_kernel<D, STAGES, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, STAGES, T><<<grid, forward_threads(D), bytes, attn_stream()>>>(
      q_map, k_map, v_map, (T *)t->o, t->lse, qs, p->seq_q, p->seq_kv, heads, attn_group(p),
      p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
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

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  if (forward_bytes<T>(D, KvStages) <= attn_shared_memory_limit())
    launch_forward<D, KvStages, T>(p, t);
  else
    launch_forward<D, 1, T>(p, t);
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  require_hopper();
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}
