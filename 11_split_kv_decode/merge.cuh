/* Stage 11's merge of a row's chunks: the partial O and LSE the decode blocks wrote, combined
 * by stage 02's rule across blocks, and the launch overlap that lets the merge grid start
 * while the decode grid runs. Included by decode.cuh before its decode kernel. */
#pragma once

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
                        float *__restrict__ lse, attn_strides qs, int nq, int nkv, int heads,
                        int group, int chunk_keys, int chunks) {
  constexpr int Groups = D / 4, Ways = MergeThreads / Groups;
  static_assert(MergeThreads % Groups == 0, "every thread has a group of columns");
  __shared__ merge_state merged[MergeThreads];
  long row = blockIdx.x, bh = row / nq;
  int rows = group * nq, r = (int)(bh % group) * nq + (int)(row % nq);
  int len = cache_len(cache_lens, bh / heads, nkv), n = (len + chunk_keys - 1) / chunk_keys;
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
  *reinterpret_cast<uint2 *>(o + row_start(qs, bh, row % nq) + group4 * 4) =
      make_uint2(pack2(x.a.x * inv, x.a.y * inv, T()), pack2(x.a.z * inv, x.a.w * inv, T()));
  if (threadIdx.x == 0) lse[row] = x.s > 0.f ? (x.m + log2f(x.s)) * Ln2 : -INFINITY;
}
