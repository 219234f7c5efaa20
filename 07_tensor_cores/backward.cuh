/* Stage 07's backward: D, then dK and dV a warp per 16 keys, then dQ a warp per 16 queries. */
#pragma once

#include <math.h>
#include <type_traits>

#include "attention.h"
#include "gpu.h"
#include "tiles.cuh"

/* Keys per dK/dV block, 16 a warp: 8 warps, so that each Q and dO tile copied into shared
 * memory serves 128 keys (8 warps against 4: docs/techniques.md). */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys, half the K and V tiles (123 KiB at d = 128; sm_86 and sm_89 allow 99 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query rows per tile of the dK/dV kernel: 2 fragments (64: 104 KiB at d = 128, small). */
constexpr int Br_bwd = 32;
static_assert(Bc_bwd_small % Frag == 0 && Br_bwd <= threads_for(Bc_bwd_small),
              "whole warps of keys; a thread per query row loads LSE and D");

/* D of every row, then the bound on |dS| (DsStats floats). */
static size_t delta_floats(size_t rows) { return (rows + 3) / 4 * 4; }
constexpr int DsStats = 4; /* max |dO_i|^2 and max |V_j|^2, padded to 16 bytes */
static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) * (delta_floats(attn_lse_elems(p)) + DsStats);
}

/* Shared memory of the dK/dV kernel: K and V (bc x d), Q and dO tiles (Br_bwd x d), LSE and D
 * of their rows, and per key a staging row (fp32: S^T, then dP^T), a P^T and a dS^T row. */
template <typename T>
static constexpr size_t dkdv_bytes(int d, int bc) {
  return sizeof(T) * 2 * ((size_t)bc + Br_bwd) * padded<T>(d) +
         bc * (sizeof(float) * padded<float>(Br_bwd) + 2 * sizeof(T) * padded<T>(Br_bwd)) +
         sizeof(float) * 2 * Br_bwd;
}
static_assert(tile_bytes<__half>(128, Bc, 2 * Br) <= 99 * 1024 &&
                  dkdv_bytes<__half>(128, Bc_bwd_small) <= 99 * 1024,
              "every kernel has a configuration within the 99 KiB of sm_86 and sm_89");

#include "delta.cuh"

/* A warp per 16 keys j of the block's BC keys (Bc_bwd, or Bc_bwd_small where shared memory
 * is smaller), keeping their dK and dV in accumulators while it walks the query tiles: per
 * tile it stages S^T = K Q^T and dP^T = V dO^T, makes P^T and dS^T: dV += P^T dO, dK += dS^T Q. */
template <int D, int BC, typename T>
__global__ void __launch_bounds__(threads_for(BC))
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               const float *__restrict__ ds_stats, T *__restrict__ dk,
                               T *__restrict__ dv, int nq, int nkv, int heads, float scale,
                               int causal) {
  constexpr int ld = padded<T>(D), ld_s = padded<float>(Br_bwd), ld_p = padded<T>(Br_bwd);
  extern __shared__ __align__(32) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + BC * ld;
  T *Qs = Vs + BC * ld, *dOs = Qs + Br_bwd * ld;
  float *St = reinterpret_cast<float *>(dOs + Br_bwd * ld); /* a staging row per key */
  T *Pt = reinterpret_cast<T *>(St + BC * ld_s), *dSt = Pt + BC * ld_p;
  float *lse_s = reinterpret_cast<float *>(dSt + BC * ld_p), *delta_s = lse_s + Br_bwd;
  int key_blocks = (nkv + BC - 1) / BC;
  long bh = blockIdx.x / key_blocks;
  int key = threadIdx.x / LANES, part = threadIdx.x % LANES;
  int j0 = (int)(blockIdx.x % key_blocks) * BC, j = j0 + key;
  int cols = min(BC, nkv - j0), offset = nkv - nq;
  const float dss = ds_scale(ds_stats);
  load_kv_tile<D, BC>(k + (bh * nkv + j0) * D, v + (bh * nkv + j0) * D, cols, Ks, Vs);
  FragAcc dk_acc[D / Frag], dv_acc[D / Frag];
#pragma unroll
  for (int c = 0; c < D / Frag; c++)
    wmma::fill_fragment(dk_acc[c], 0.f), wmma::fill_fragment(dv_acc[c], 0.f);
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  for (int i0 = i_begin; i0 < nq; i0 += Br_bwd) {
    int rows = min(Br_bwd, nq - i0);
    __syncthreads(); /* WAR: every thread is done with the previous Q/dO tile (and, the first
                      * time, the K and V tiles are complete before anyone reads them) */
    load_kv_tile<D, Br_bwd>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, rows, Qs, dOs);
    if (threadIdx.x < rows) {
      lse_s[threadIdx.x] = lse[bh * nq + i0 + threadIdx.x];
      delta_s[threadIdx.x] = delta[bh * nq + i0 + threadIdx.x];
    }
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D are in shared memory before use */
    const float *S_j = stage_product<wmma::col_major, Br_bwd, D>(Ks, ld, Qs, ld, St, ld_s);
    float prob[Br_bwd / LANES];
#pragma unroll
    for (int c = 0, r = part; c < Br_bwd / LANES; c++, r += LANES) {
      bool visible = r < rows && j < nkv && (!causal || j <= i0 + r + offset);
      /* P from the saved LSE; a masked entry is 0 (and exp is never asked for it, so a row
       * that sees no key, LSE = -inf, cannot make a NaN). */
      /* P <= 1, but an fp32 LSE of logits near 1e11 is off by up to 4096: exp(4096) = inf */
      prob[c] = visible ? fminf(1.f, expf(scale * S_j[c * LANES] - lse_s[r])) : 0.f;
      Pt[key * ld_p + r] = T(prob[c]);
    }
    const float *dP_j = stage_product<wmma::col_major, Br_bwd, D>(Vs, ld, dOs, ld, St, ld_s);
#pragma unroll
    for (int c = 0, r = part; c < Br_bwd / LANES; c++, r += LANES) /* no LSE or D past `rows` */
      dSt[key * ld_p + r] = T(r < rows ? prob[c] * (dP_j[c * LANES] - delta_s[r]) * dss : 0.f);
    __syncwarp(); /* RAW: the warp's rows of P^T and dS^T are whole before they load */
    mma_tile<wmma::row_major, D, Br_bwd>(dv_acc, Pt, ld_p, dOs, ld);
    mma_tile<wmma::row_major, D, Br_bwd>(dk_acc, dSt, ld_p, Qs, ld);
  }
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += Br_bwd) { /* through St, Br_bwd columns at a time */
    const float *dK_j = stage_rows<Br_bwd>(dk_acc + c0 / Frag, St, ld_s);
#pragma unroll
    for (int c = 0; c < Br_bwd / LANES; c++)
      if (j < nkv)
        dk[(bh * nkv + j) * D + c0 + c * LANES + part] = T(scale / dss * dK_j[c * LANES]);
    const float *dV_j = stage_rows<Br_bwd>(dv_acc + c0 / Frag, St, ld_s);
#pragma unroll
    for (int c = 0; c < Br_bwd / LANES; c++)
      if (j < nkv) dv[(bh * nkv + j) * D + c0 + c * LANES + part] = T(dV_j[c * LANES]);
  }
}

/* LANES threads per query row, the forward's grid and K/V tiles:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br))
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             const float *__restrict__ ds_stats, T *__restrict__ dq, int nq,
                             int nkv, int heads, float scale, int causal) {
  constexpr int ld = padded<T>(D), ld_s = padded<float>(Bc), ld_p = padded<T>(Bc);
  extern __shared__ __align__(32) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + Bc * ld, *Qs = Vs + Bc * ld;
  float *Ss = reinterpret_cast<float *>(Qs + Br * ld); /* a staging row per query row */
  T *dSs = reinterpret_cast<T *>(Ss + Br * ld_s), *dOs = dSs + Br * ld_p;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int i = i0 + threadIdx.x / LANES, part = threadIdx.x % LANES;
  bool has_row = i < nq;
  const float dss = ds_scale(ds_stats);
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  load_kv_tile<D, Br>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, min(Br, nq - i0), Qs, dOs);
  FragAcc dq_acc[D / Frag];
#pragma unroll
  for (int c = 0; c < D / Frag; c++) wmma::fill_fragment(dq_acc[c], 0.f);
  float lse_i = has_row ? lse[bh * nq + i] : 0.f, delta_i = has_row ? delta[bh * nq + i] : 0.f;
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  for (int j0 = 0; j0 < kv_end; j0 += Bc) {
    int cols = min(Bc, nkv - j0);
    int row_cols = causal ? max(0, min(cols, i + offset + 1 - j0)) : cols;
    load_kv_tile<D>(K + (long)j0 * D, V + (long)j0 * D, cols, Ks, Vs);
    __syncthreads(); /* RAW: the whole tile (the first time, Q and dO too) is in shared memory */
    /* The clamp P <= 1 is the dK/dV kernel's; the keys past
     * its row's row_cols get dS = 0, and exp is never asked for them. */
    const float *S_i = stage_product<wmma::col_major, Bc, D>(Qs, ld, Ks, ld, Ss, ld_s);
    float prob[Bc / LANES];
#pragma unroll
    for (int c = 0, j = part; c < Bc / LANES; c++, j += LANES)
      prob[c] = j < row_cols ? fminf(1.f, expf(scale * S_i[c * LANES] - lse_i)) : 0.f;
    const float *dP_i = stage_product<wmma::col_major, Bc, D>(dOs, ld, Vs, ld, Ss, ld_s);
#pragma unroll
    for (int c = 0, j = part; c < Bc / LANES; c++, j += LANES)
      dSs[threadIdx.x / LANES * ld_p + j] = T(prob[c] * (dP_i[c * LANES] - delta_i) * dss);
    __syncwarp(); /* RAW: the warp's rows of dS are whole before they load */
    mma_tile<wmma::row_major, D, Bc>(dq_acc, dSs, ld_p, Ks, ld);
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += Frag) { /* through Ss, a fragment's columns at a time */
    const float *dQ_i = stage_rows<Frag>(dq_acc + c0 / Frag, Ss, ld_s);
#pragma unroll
    for (int c = 0; c < Frag / LANES; c++)
      if (has_row) dq[(bh * nq + i) * D + c0 + c * LANES + part] = T(scale / dss * dQ_i[c * LANES]);
  }
}

template <int D, int BC, typename T>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta,
                        const float *ds_stats) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC, T>,
                             dkdv_bytes<T>(D, BC), "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + BC - 1) / BC * heads);
  flash_backward_dkdv_kernel<D, BC>
      <<<key_blocks, threads_for(BC), dkdv_bytes<T>(D, BC), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          ds_stats, (T *)t->dk, (T *)t->dv, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <int D, typename T = __half>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch_backward<D, __nv_bfloat16>(p, t);
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q, kv_rows = (long)heads * p->seq_kv;
  float *delta = (float *)t->workspace;
  /* The bound on |dS| in fp16 only (ds_scale); bf16 passes none. */
  float *ds_stats = std::is_same_v<T, __half> ? delta + delta_floats(rows) : nullptr;
  launch_delta<D, T>(p, t, delta, ds_stats, rows, kv_rows);
  if (dkdv_bytes<T>(D, Bc_bwd) <= attn_shared_memory_limit())
    launch_dkdv<D, Bc_bwd, T>(p, t, delta, ds_stats);
  else
    launch_dkdv<D, Bc_bwd_small, T>(p, t, delta, ds_stats);
  size_t dq_bytes = tile_bytes<T>(D, Bc, 2 * Br);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D, T>, dq_bytes,
                             "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Br - 1) / Br * heads);
  flash_backward_dq_kernel<D><<<row_blocks, threads_for(Br), dq_bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta, ds_stats,
      (T *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch_backward<32>(p, t); break;
    case 64: launch_backward<64>(p, t); break;
    case 128: launch_backward<128>(p, t); break;
  }
}
