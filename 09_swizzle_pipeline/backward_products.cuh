/* Stage 09's backward tiles and workspace, and the steps around its probabilities: LSE and D
 * copied into shared memory, dQ += dS K, and dK += dS^T Q, dV += P^T dO. Stage 09's backward
 * includes them, and so does stage 13's, which changes only which elements are visible and
 * how P and dS are made. */
#pragma once

#include <math.h>

#include "attention.h"
#include "gpu.h"
#include "tiles.cuh"

/* Keys per dK/dV block, 16 a warp: 8 warps, so that each Q and dO tile copied into shared
 * memory serves 128 keys (8 warps against 4: docs/techniques.md). */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys and query rows (161 KiB at d = 128; sm_86 and sm_89 allow 99 KiB, sm_80 163 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query steps (16 queries) per load of a dK/dV warp's K and V operands, each feeding QSteps
 * products: 4 at d = 128, 2 at d <= 64, where 4 spills (the README's A/B table). */
#ifndef ATTN_BWD_QSTEPS
#define ATTN_BWD_QSTEPS 0 /* N: N steps at every d */
#endif
__host__ __device__ constexpr int query_steps(int d) {
  return ATTN_BWD_QSTEPS ? ATTN_BWD_QSTEPS : d > 64 ? 4 : 2;
}
/* A dK/dV warp's keys: 32, so that each Q and dO operand it loads feeds two mma.sync
 * (-DATTN_BWD_WARP_KEYS=16: 16 keys, the README's A/B table). */
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
 * d = 128) share an H100's SM, where 64 keys fit 2 (docs/techniques.md). */
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
 * full (the README's A/B table; a float4 over two lanes gains nothing more).
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
static_assert(tile_bytes<__half>(128, Bc_dq, 2 * Br_dq) <= 99 * 1024 &&
                  dkdv_bytes<__half>(128, Bc_bwd_small) <= 99 * 1024,
              "every backward kernel has a configuration within the 99 KiB of sm_86 and sm_89");

#include "../07_tensor_cores/delta.cuh"

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

/* dQ += dS K for one query tile of the dK/dV kernel (dS read transposed from dS^T in shared
 * memory): warp w takes 32 queries and Cols columns (at 32 x 32, 4 ldmatrix.x4 for 8 mma.sync,
 * where 16 x 64 read 5) and adds them into the fp32 dQ by atomics,
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
