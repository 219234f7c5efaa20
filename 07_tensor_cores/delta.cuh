/* The D pre-pass and the bound on |dS| it measures: the part of a half-precision backward
 * that stays the same from this stage on (08 and 09 include this file). */
#pragma once

/* dS = P (dP - D) is rounded to the dtype for the dK and dQ products, and fp16 ends at 65504:
 * with large V and dO and a small softmax scale |dS| passes that while the gradients stay
 * small. D_i is a P-weighted mean of row i's dP, so |dP_ij - D_i| <= 2 max_j |dO_i . V_j|, and
 * with P <= 1, |dS| <= 2 max|dO_i| max|V_j| (Euclidean norms of rows). In fp16 the kernels
 * multiply dS by 2^-k before rounding it, k the least that brings this bound under 2^DsLimitLog2,
 * and dK and dQ by 2^k after their fp32 sums: powers of two, so both steps are exact (bar
 * elements that fall below fp16's normal range, 2^-14 of the bound and less). bf16 has fp32's
 * range and needs none of it. */
constexpr int DsLimitLog2 = 15; /* 2^15: half of fp16's range, leaving room for rounding */
constexpr int DsMaxShift = 64;  /* norms of finite fp16 rows need far less */
__device__ float ds_scale(const float *stats) {
  if (!stats) return 1.f;
  int e;
  frexpf(2.f * sqrtf(stats[0]) * sqrtf(stats[1]), &e); /* the bound is below 2^e */
  return ldexpf(1.f, -min(max(e - DsLimitLog2, 0), DsMaxShift));
}

/* The largest of x over the block into *out (x >= 0, so its bits order as unsigned integers;
 * *out starts at 0): one atomic a block, not a thread. */
__device__ void block_max_into(float x, float *out) {
  __shared__ unsigned warp_max[32];
  unsigned bits = __reduce_max_sync(0xffffffffu, __float_as_uint(x));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads(); /* RAW: every warp's maximum is in shared memory */
  if (threadIdx.x < 32) {
    bits = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0u;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned *>(out), bits);
  }
}

/* D_i = sum_c dO_ic O_ic. (It equals sum_j dP_ij P_ij: the backward of the softmax needs
 * exactly this dot product, and O = P V makes it a d-term sum.) D / 8 adjacent threads share a
 * row, each reading 16 bytes of it, so that a warp reads whole rows, 512 contiguous bytes of
 * each tensor (a thread walking a row alone reads 32 rows d elements apart). With `stats`
 * (fp16), also max |dO_i|^2 and max |V_j|^2 into stats[0], stats[1] for ds_scale. */
template <int D, typename T>
__global__ void compute_delta_kernel(const T *o, const T *d_o, const T *v, float *delta,
                                     float *stats, long rows, long kv_rows, attn_strides qs, int nq,
                                     attn_strides kvs, int nkv) {
  constexpr int Chunk = 16 / sizeof(T), Lanes = D / Chunk; /* threads a row */
  static_assert(32 % Lanes == 0, "a row's threads are within one warp");
  long r = (blockIdx.x * (long)blockDim.x + threadIdx.x) / Lanes; /* row r % N of head r / N */
  long at = row_start(qs, r / nq, r % nq) + threadIdx.x % Lanes * Chunk;
  float sum = 0.f, do_norm2 = 0.f, v_norm2 = 0.f;
  if (r < rows) {
    float4 dov = *reinterpret_cast<const float4 *>(d_o + at);
    float4 ov = *reinterpret_cast<const float4 *>(o + at);
    const T *dos = reinterpret_cast<const T *>(&dov), *os = reinterpret_cast<const T *>(&ov);
#pragma unroll
    for (int c = 0; c < Chunk; c++) {
      float x = float(dos[c]);
      sum += x * float(os[c]), do_norm2 += x * x;
    }
  }
  if (stats && r < kv_rows) {
    float4 vv = *reinterpret_cast<const float4 *>(v + row_start(kvs, r / nkv, r % nkv) +
                                                  threadIdx.x % Lanes * Chunk);
    const T *vs = reinterpret_cast<const T *>(&vv);
#pragma unroll
    for (int c = 0; c < Chunk; c++) v_norm2 += float(vs[c]) * float(vs[c]);
  }
#pragma unroll
  for (int lane = Lanes / 2; lane > 0; lane /= 2) /* over the row's threads, adjacent lanes */
    sum += __shfl_xor_sync(0xffffffffu, sum, lane),
        do_norm2 += __shfl_xor_sync(0xffffffffu, do_norm2, lane),
        v_norm2 += __shfl_xor_sync(0xffffffffu, v_norm2, lane);
  if (r < rows && threadIdx.x % Lanes == 0) delta[r] = sum;
  if (!stats) return;
  block_max_into(do_norm2, stats);
  __syncthreads(); /* WAR: block_max_into's shared memory is read before it is reused */
  block_max_into(v_norm2, stats + 1);
}

/* The pre-pass: D of `rows` rows into `delta`, and, with `ds_stats` (fp16), the bound's two
 * maxima over those rows and the `kv_rows` rows of V (zeroed first: they are atomic maxima). */
template <int D, typename T>
static void launch_delta(const attn_problem *p, const attn_buffers *t, float *delta,
                         float *ds_stats, long rows, long kv_rows) {
  if (ds_stats) CUDA_CHECK(cudaMemsetAsync(ds_stats, 0, sizeof(float) * DsStats, attn_stream()));
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  long delta_rows = ds_stats ? max(rows, kv_rows) : rows, lanes = D * sizeof(T) / 16;
  long delta_grid = (delta_rows * lanes + delta_threads - 1) / delta_threads;
  compute_delta_kernel<D><<<(unsigned)delta_grid, delta_threads, 0, attn_stream()>>>(
      (const T *)t->o, (const T *)t->d_o, (const T *)t->v, delta, ds_stats, rows, kv_rows,
      attn_q_strides(p), p->seq_q, attn_kv_strides(p), p->seq_kv);
  CHECK_LAUNCH("compute_delta_kernel");
}
