/* Stage 13's backward: 09's, with each row's keys an interval (visible.cuh) in both kernels,
 * query and key tiles skipped at both ends, and dS carried through the softcap's tanh. */
#pragma once

#include <math.h>
#include <type_traits>

#include "../09_swizzle_pipeline/backward_products.cuh"
#include "../09_swizzle_pipeline/tiles.cuh"
#include "attention.h"
#include "gpu.h"
#include "visible.cuh"

/* With a softcap c > 0 (cap_k: see softcap_exponent), s becomes the capped logit c tanh(s scale /
 * c) first, and dS, the gradient of the capped logit, is carried to the raw one by its slope 1 -
 * tanh^2 (at most 1: the bound of ds_scale still holds; never NaN, so a masked element's 0 stays
 * 0). P = 2^(s scale log2(e) - LSE) (LSE in log2 units) and dS = P (dP - D) ds_scale for the four
 * elements of an accumulator, as half an A operand (out[0] rows 0-7, out[1] rows 8-15), `delta`
 * given as D ds_scale: one FFMA in place of the subtraction, so the scaling (1 in bf16) costs
 * nothing here, and by a power of two it rounds as (dP - D) would. A masked element is 0
 * without exp2, so a row that sees no key (LSE = -inf) makes no NaN. The clamp P <= 1: an fp32
 * LSE of logits near 1e11 is known only to about 4096 (2^4096 = inf). */
template <typename T>
__device__ void probabilities_and_ds(const float *s, const float *dp, float scale_log2,
                                     const float *lse, const float *delta, const bool *visible,
                                     float ds_scale, float cap, float cap_k, unsigned *p_out,
                                     unsigned *ds_out) {
  float p[4], ds[4];
  /* One test of the cap for the four elements, not one an element: small per-element
   * branches may be compiled as predicated code, which would charge the plain backward for
   * the tanh as well. */
  if (cap > 0.f) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      softcap_t capped = softcap_tanh_and_slope(s[e], cap_k);
      float x = cap * capped.t;
      p[e] = visible[e] ? fminf(1.f, exp2_approx(fmaf(x, scale_log2, -lse[e]))) : 0.f;
      ds[e] = p[e] * fmaf(dp[e], ds_scale, -delta[e]) * capped.slope;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      p[e] = visible[e] ? fminf(1.f, exp2_approx(fmaf(s[e], scale_log2, -lse[e]))) : 0.f;
      ds[e] = p[e] * fmaf(dp[e], ds_scale, -delta[e]);
    }
  }
  p_out[0] = pack2(p[0], p[1], T()), p_out[1] = pack2(p[2], p[3], T());
  ds_out[0] = pack2(ds[0], ds[1], T()), ds_out[1] = pack2(ds[2], ds[3], T());
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
                               T *__restrict__ dv, float *__restrict__ dq_accum, attn_strides qs,
                               attn_strides kvs, int nq, int nkv, int pairs, float scale, int left,
                               int right, float softcap, const int *__restrict__ cu_q,
                               const int *__restrict__ cu_k, int seq_heads, int max_nkv) {
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
   * heaviest first (the forward's order, mirrored: docs/techniques.md). The grid covers
   * `pairs` (sequence, head) pairs of max_nkv keys, as the forward's. */
  bool triangle = right >= 0 && left < 0;
  int key_blocks = (max_nkv + BC - 1) / BC;
  long pair = triangle ? blockIdx.x % pairs : blockIdx.x / key_blocks;
  int kb = (int)(triangle ? blockIdx.x / pairs : blockIdx.x % key_blocks);
  sequence_rows seq = sequence_of(cu_q, cu_k, (int)(pair / seq_heads), nq, nkv);
  long bh = cu_q ? pair % seq_heads : pair;
  if (kb * BC >= seq.nkv) return; /* the whole block, before any barrier */
  const visible_keys vis = {seq.nkv - seq.nq, left, right, seq.nkv};
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  int w = threadIdx.x / 32, part = Split > 1 ? w / (BC / WarpKeys) : 0; /* the warp's share */
  int j0 = kb * BC, jw = j0 + w % (BC / WarpKeys) * WarpKeys;
  int cols = min(BC, seq.nkv - j0), c0 = part * Cols;
  const T *Kw = Ks + (jw - j0) * ld, *Vw = Vs + (jw - j0) * ld; /* the warp's keys */
  const T *Q = q + row_start(qs, bh, seq.q_first), *dO = d_o + row_start(qs, bh, seq.q_first);
  /* The sequence's rows of LSE, D and the fp32 dQ */
  const float *lse_q = lse + bh * nq + seq.q_first, *delta_q = delta + bh * nq + seq.q_first;
  float *dq_q = dq_accum + (bh * nq + seq.q_first) * D;
  load_kv_tile<D, BC, Threads>(k + row_start(kvs, bh, seq.k_first + j0),
                               v + row_start(kvs, bh, seq.k_first + j0), cols, Ks, Vs, kvs.row);
  float dk_acc[KeyFrags][Cols / MmaN][4] = {}, dv_acc[KeyFrags][Cols / MmaN][4] = {};
  const float scale_log2 = softcap > 0.f ? Log2e : scale * Log2e, dss = ds_scale(ds_stats);
  const float cap_k = softcap_exponent(scale, softcap);
  /* Only the queries [i_begin, i_end) see a key of the block: the tiles before and after are
   * skipped. */
  int i_begin = vis.first_row(j0), i_end = vis.end_row(j0 + cols, seq.nq);
  if (i_begin < i_end) {
    load_kv_tile<D, Br_bwd, Threads>(Q + i_begin * qs.row, dO + i_begin * qs.row,
                                     min(Br_bwd, seq.nq - i_begin), Qs, dOs, qs.row);
    load_row_stats(lse_q + i_begin, delta_q + i_begin, min(Br_bwd, seq.nq - i_begin), Br_bwd, lse_s,
                   delta_s);
  }
  __pipeline_commit();
  for (int i0 = i_begin, buf = 0; i0 < i_end; i0 += Br_bwd, buf ^= 1) {
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D (the first time, K and V) are in shared
                      * memory; WAR: every warp is done with the last tile, so its Q/dO buffer
                      * may be refilled and its P^T and dS^T rewritten */
    int next = i0 + Br_bwd, rows = min(Br_bwd, seq.nq - next), nb = (buf ^ 1) * Br_bwd;
    if (next < i_end) { /* the next tile's copy overlaps this tile's products */
      load_kv_tile<D, Br_bwd, Threads>(Q + next * qs.row, dO + next * qs.row, rows, Qs + nb * ld,
                                       dOs + nb * ld, qs.row);
      load_row_stats(lse_q + next, delta_q + next, rows, Br_bwd, lse_s + nb, delta_s + nb);
    }
    __pipeline_commit();
    const T *Qt = Qs + buf * Br_bwd * ld, *dOt = dOs + buf * Br_bwd * ld;
    const float *lse_t = lse_s + buf * Br_bwd, *delta_t = delta_s + buf * Br_bwd;
    /* Only a tile past the end of the queries, or whose first query does not see the warp's
     * last key or last query its first key, is masked (the end of the keys is the first's
     * bound). */
    bool masked =
        i0 + Br_bwd > seq.nq || vis.end(i0) < jw + WarpKeys || vis.begin(i0 + Br_bwd - 1) > jw;
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
            if (masked) {
              const key_band band = band_of(vis); /* here, not live across the loop */
#pragma unroll
              for (int e = 0; e < 4; e++) {
                int i = i0 + col + e % 2, j = jw + f * MmaM + g + 8 * (e / 2);
                visible[e] = i < seq.nq && j < seq.nkv && band.sees(i, j);
              }
            }
            probabilities_and_ds<T>(s[q][f][half], dp[q][f][half], scale_log2, lse_e, delta_e,
                                    visible, dss, softcap, cap_k, p_frag[f] + 2 * half,
                                    ds_frag[f] + 2 * half);
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
    if (AtomicDq) accumulate_dq<D, BC>(dSt, Ks, dq_q + (long)i0 * D, seq.nq - i0);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  float dk_factor[2 * KeyFrags], dv_factor[2 * KeyFrags];
#pragma unroll
  for (int h = 0; h < 2 * KeyFrags; h++) dk_factor[h] = scale / dss, dv_factor[h] = 1.f;
  store_tile<Cols, KeyFrags>(dk_acc, dk_factor, dk + row_start(kvs, bh, seq.k_first + jw) + c0,
                             seq.nkv - jw, kvs.row);
  store_tile<Cols, KeyFrags>(dv_acc, dv_factor, dv + row_start(kvs, bh, seq.k_first + jw) + c0,
                             seq.nkv - jw, kvs.row);
}

/* A warp per 16 query rows, walking the key tiles like the forward with dQ in accumulators;
 * per 16 keys, S = Q K^T and dP = dO V^T become dS in registers, the A operand of dQ += dS K:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br_dq), dq_blocks_per_sm(D))
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             const float *__restrict__ ds_stats, T *__restrict__ dq,
                             attn_strides qs, attn_strides kvs, int nq, int nkv, int pairs,
                             float scale, int left, int right, float softcap,
                             const int *__restrict__ cu_q, const int *__restrict__ cu_k,
                             int seq_heads, int max_nq) {
  constexpr int ld = padded<T>(D), Br = Br_dq, Bc = Bc_dq; /* this kernel's own tiles */
  /* K and V buffers (Bc rows), Q and dO (Br rows): each starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * Bc * ld) &&
                    starts_swizzle_period<D, T>(sizeof(T) * Br * ld),
                "tile alignment");
  constexpr int Threads = threads_for(Br);
  extern __shared__ __align__(SharedAlignment) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * Bc * ld, *Qs = Vs + 2 * Bc * ld;
  T *dOs = Qs + Br * ld;
  /* The blocks as the forward's (sequence, head) pairs and rows. */
  bool triangle = right >= 0 && left < 0;
  int row_blocks = (max_nq + Br - 1) / Br;
  long pair = triangle ? blockIdx.x % pairs : blockIdx.x / row_blocks;
  int i0 =
      (triangle ? row_blocks - 1 - (int)(blockIdx.x / pairs) : (int)(blockIdx.x % row_blocks)) * Br;
  sequence_rows seq = sequence_of(cu_q, cu_k, (int)(pair / seq_heads), nq, nkv);
  long bh = cu_q ? pair % seq_heads : pair;
  if (i0 >= seq.nq) return; /* the whole block, before any barrier */
  const visible_keys vis = {seq.nkv - seq.nq, left, right, seq.nkv};
  int iw = i0 + threadIdx.x / 32 * MmaM, g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  const T *Qw = Qs + (iw - i0) * ld, *dOw = dOs + (iw - i0) * ld; /* the warp's 16 rows */
  const T *K = k + row_start(kvs, bh, seq.k_first), *V = v + row_start(kvs, bh, seq.k_first);
  float dq_acc[1][D / MmaN][4] = {};
  /* The warp's Q and dO rows as A operands, read once from shared memory: the same 16 rows
   * meet every key tile, and reloading them would double the ldmatrix reads of S and dP. */
  unsigned q_frag[D / MmaK][4], do_frag[D / MmaK][4];
  const float scale_log2 = softcap > 0.f ? Log2e : scale * Log2e, dss = ds_scale(ds_stats);
  const float cap_k = softcap_exponent(scale, softcap);
  load_kv_tile<D, Br, Threads>(q + row_start(qs, bh, seq.q_first + i0),
                               d_o + row_start(qs, bh, seq.q_first + i0), min(Br, seq.nq - i0), Qs,
                               dOs, qs.row);
  /* LSE (log2 units) and D of the lane's two rows, in registers; rows past the end get 0. */
  float lse_e[4], delta_e[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    int i = iw + g + 8 * (e / 2);
    lse_e[e] = i < seq.nq ? lse[bh * nq + seq.q_first + i] * Log2e : 0.f;
    delta_e[e] = i < seq.nq ? delta[bh * nq + seq.q_first + i] * dss : 0.f; /* see ds_scale */
  }
  /* The block's keys, from its first row's first to its last row's last, as in the forward. */
  int last_row = min(i0 + Br, seq.nq) - 1, kv_begin = vis.begin(i0), kv_end = vis.end(last_row);
  int j_first = kv_begin / Bc * Bc;
  if (kv_end <= kv_begin) kv_end = j_first; /* no row of the block sees a key: no tile */
  int warp_begin = vis.begin(min(iw + MmaM, seq.nq) - 1), warp_end = vis.end(iw);
  if (j_first < kv_end)
    load_kv_tile<D, Bc, Threads>(K + j_first * kvs.row, V + j_first * kvs.row,
                                 min(Bc, seq.nkv - j_first), Ks, Vs, kvs.row);
  __pipeline_commit();
  for (int j0 = j_first, buf = 0; j0 < kv_end; j0 += Bc, buf ^= 1) {
    int next = j0 + Bc;
    if (next < kv_end)
      load_kv_tile<D, Bc, Threads>(K + next * kvs.row, V + next * kvs.row, min(Bc, seq.nkv - next),
                                   Ks + (buf ^ 1) * Bc * ld, Vs + (buf ^ 1) * Bc * ld, kvs.row);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: the whole tile (the first time, Q and dO too) is in shared memory */
    const T *Kt = Ks + buf * Bc * ld, *Vt = Vs + buf * Bc * ld;
    if (j0 == j_first) /* Q and dO have landed: their operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++)
        ldmatrix_x4(q_frag[kk], a_operand<D>(Qw, 0, kk * MmaK)),
            ldmatrix_x4(do_frag[kk], a_operand<D>(dOw, 0, kk * MmaK));
    /* Only a tile past the end of the rows, or reaching before the warp's last row's first key
     * or past its first row's last, is masked. */
    bool masked = iw + MmaM > seq.nq || j0 < warp_begin || j0 + Bc > warp_end;
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
        if (masked) {
          const key_band band = band_of(vis); /* here, not live across the loop */
#pragma unroll
          for (int e = 0; e < 4; e++) {
            int i = iw + g + 8 * (e / 2), j = j0 + n2 * 16 + half * MmaN + 2 * tq + e % 2;
            visible[e] = i < seq.nq && j < seq.nkv && band.sees(i, j);
          }
        }
        probabilities_and_ds<T>(s[half], dp[half], scale_log2, lse_e, delta_e, visible, dss,
                                softcap, cap_k, p_frag + 2 * half, ds_frag + 2 * half);
      }
      mma_tile<D, true, D>(dq_acc, &ds_frag, Kt, n2 * 16, 0);
    }
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  const float dq_factor[2] = {scale / dss, scale / dss};
  store_tile<D, 1>(dq_acc, dq_factor, dq + row_start(qs, bh, seq.q_first + iw), seq.nq - iw,
                   qs.row);
}

/* dQ = scale times the fp32 sums the dK/dV kernel added up (of dS times ds_scale), in the
 * dtype; dq_accum is [B, H, Nq, D] whatever the layout of dQ. */
template <int D, typename T>
__global__ void convert_dq_kernel(const float *dq_accum, const float *ds_stats, T *dq, long elems,
                                  float scale, attn_strides qs, int nq) {
  long e = blockIdx.x * (long)blockDim.x + threadIdx.x, r = e / D;
  if (e < elems)
    dq[row_start(qs, r / nq, r % nq) + e % D] = T(scale / ds_scale(ds_stats) * dq_accum[e]);
}

template <int D, int BC, bool AtomicDq, typename T>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta,
                        const float *ds_stats, float *dq_accum) {
  int pairs = (p->seqs ? p->seqs : p->batch) * p->heads;
  int max_nkv =
      p->seqs ? longest_sequence(p->cu_seqlens_k, p->seqs, p->max_seqlen_k, p->seq_kv) : p->seq_kv;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC, AtomicDq, T>,
                             dkdv_bytes<T>(D, BC), "flash_backward_dkdv_kernel");
  unsigned key_blocks = grid_blocks((max_nkv + BC - 1) / BC, pairs, "flash_backward_dkdv_kernel");
  if (key_blocks == 0) return; /* no keys: dK and dV are empty, dQ stays 0 */
  flash_backward_dkdv_kernel<D, BC, AtomicDq>
      <<<key_blocks, dkdv_threads(D, BC), dkdv_bytes<T>(D, BC), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          ds_stats, (T *)t->dk, (T *)t->dv, dq_accum, attn_q_strides(p), attn_kv_strides(p),
          p->seq_q, p->seq_kv, pairs, p->scale, window_left(p), window_right(p), p->softcap,
          t->cu_seqlens_q, t->cu_seqlens_k, p->heads, max_nkv);
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
  launch_delta<D, T>(p, t, delta, ds_stats, rows, kv_rows);
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
    convert_dq_kernel<D><<<(unsigned)((dq_elems + convert_threads - 1) / convert_threads),
                           convert_threads, 0, attn_stream()>>>(
        dq_accum, ds_stats, (T *)t->dq, dq_elems, p->scale, attn_q_strides(p), p->seq_q);
    CHECK_LAUNCH("convert_dq_kernel");
    return;
  }
  size_t dq_bytes = tile_bytes<T>(D, Bc_dq, 2 * Br_dq);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D, T>, dq_bytes,
                             "flash_backward_dq_kernel");
  int pairs = (p->seqs ? p->seqs : p->batch) * p->heads;
  int max_nq =
      p->seqs ? longest_sequence(p->cu_seqlens_q, p->seqs, p->max_seqlen_q, p->seq_q) : p->seq_q;
  unsigned row_blocks =
      grid_blocks((max_nq + Br_dq - 1) / Br_dq, pairs, "flash_backward_dq_kernel");
  if (row_blocks == 0) return; /* no queries: nothing to write */
  flash_backward_dq_kernel<D><<<row_blocks, threads_for(Br_dq), dq_bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta, ds_stats,
      (T *)t->dq, attn_q_strides(p), attn_kv_strides(p), p->seq_q, p->seq_kv, pairs, p->scale,
      window_left(p), window_right(p), p->softcap, t->cu_seqlens_q, t->cu_seqlens_k, p->heads,
      max_nq);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch_backward<32>(p, t); break;
    case 64: launch_backward<64>(p, t); break;
    case 128: launch_backward<128>(p, t); break;
  }
}
