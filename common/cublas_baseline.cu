/* The standard GPU attention that FlashAttention is measured against, in fp32 without TF32:
 *   S = scale Q K^T   cuBLAS, strided-batched over every (batch, head)
 *   P = softmax(S)    one block per row; the causal mask and LSE as every stage has them
 *   O = P V           cuBLAS, strided-batched
 * It materialises S and P: B H Nq Nkv floats of workspace, the quadratic memory of
 * stage 00 on the GPU. A problem whose S does not fit is refused with exit 2. */
#include <cublas_v2.h>
#include <limits.h>
#include <math.h>

#include "attention.h"
#include "gpu.h"

static void cublas_check(cublasStatus_t st, const char *what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    attn_fail(EXIT_CHECK_FAILED, "cuBLAS error %d in %s", (int)st, what);
}

/* Threads per softmax row: 256 threads sweep a row of up to 16384 logits in 64 steps;
 * each block reduces with shared memory. */
constexpr int SOFTMAX_THREADS = 256;

__device__ float block_reduce(float x, bool is_max, float *scratch) {
  for (int off = 16; off > 0; off >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads(); /* every warp's partial is written before warp 0 reads them */
  if (warp == 0) {
    x = lane < SOFTMAX_THREADS / 32 ? scratch[lane] : (is_max ? -INFINITY : 0.f);
    for (int off = 16; off > 0; off >>= 1) {
      float y = __shfl_xor_sync(0xffffffffu, x, off);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (lane == 0) scratch[0] = x;
  }
  __syncthreads(); /* the total is written before anyone reads it */
  float total = scratch[0];
  __syncthreads(); /* everyone has read it before the scratch is reused */
  return total;
}

/* Row r of S (already scaled) becomes P in place; masked entries become 0. A block takes
 * rows blockIdx.x, + gridDim.x, ...: B H Nq may pass the 2^31 - 1 blocks a grid can have. */
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    softmax_rows_kernel(float *S, float *lse, long rows, int nq, int nkv, int causal) {
  __shared__ float scratch[SOFTMAX_THREADS / 32];
  for (long r = blockIdx.x; r < rows; r += gridDim.x) {
    int i = (int)(r % nq);
    long limit = causal ? (long)i + nkv - nq + 1 : nkv; /* keys [0, limit) are visible */
    int visible = (int)(limit < 0 ? 0 : (limit > nkv ? nkv : limit));
    float *row = S + r * nkv;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < visible; j += SOFTMAX_THREADS) m = fmaxf(m, row[j]);
    m = block_reduce(m, true, scratch);
    float l = 0;
    for (int j = threadIdx.x; j < visible; j += SOFTMAX_THREADS) l += expf(row[j] - m);
    l = block_reduce(l, false, scratch);
    float inv_l = visible ? 1.f / l : 0.f; /* a row that sees no key: P = 0, so O = 0 */
    for (int j = threadIdx.x; j < nkv; j += SOFTMAX_THREADS)
      row[j] = j < visible ? expf(row[j] - m) * inv_l : 0.f;
    if (threadIdx.x == 0) lse[r] = visible ? m + logf(l) : -INFINITY;
  }
}

static size_t forward_workspace(const attn_problem *p) {
  return sizeof(float) * (size_t)p->batch * p->heads * p->seq_q * p->seq_kv;
}

static cublasHandle_t handle(void) {
  static cublasHandle_t h = NULL;
  if (!h) {
    cublas_check(cublasCreate(&h), "cublasCreate");
    /* fp32 products in fp32: no TF32 tensor cores (docs/conventions.md: fp32 against fp32). */
    cublas_check(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  }
  return h;
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  int nq = p->seq_q, nkv = p->seq_kv, d = p->head_dim, heads = p->batch * p->heads;
  float *S = (float *)t->workspace;
  const float one = 1.f, zero = 0.f;
  /* Row-major S (Nq x Nkv) is column-major S^T = K Q^T: A = K (as K^T, d x Nkv, transposed),
   * B = Q (as Q^T, d x Nq). */
  cublas_check(
      cublasGemmStridedBatchedEx(handle(), CUBLAS_OP_T, CUBLAS_OP_N, nkv, nq, d, &p->scale, t->k,
                                 CUDA_R_32F, d, (long long)nkv * d, t->q, CUDA_R_32F, d,
                                 (long long)nq * d, &zero, S, CUDA_R_32F, nkv, (long long)nq * nkv,
                                 heads, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
      "S = scale Q K^T");
  long rows = (long)heads * nq;
  softmax_rows_kernel<<<(unsigned)(rows < INT_MAX ? rows : INT_MAX), SOFTMAX_THREADS>>>(
      S, t->lse, rows, nq, nkv, p->causal);
  CHECK_LAUNCH("softmax_rows_kernel");
  /* Row-major O (Nq x d) is column-major O^T = V^T P^T. */
  cublas_check(
      cublasGemmStridedBatchedEx(handle(), CUBLAS_OP_N, CUBLAS_OP_N, d, nq, nkv, &one, t->v,
                                 CUDA_R_32F, d, (long long)nkv * d, S, CUDA_R_32F, nkv,
                                 (long long)nq * nkv, &zero, t->o, CUDA_R_32F, d, (long long)nq * d,
                                 heads, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
      "O = P V");
}

static const attn_stage stage = {
    .name = "cublas_baseline",
    .idea = "standard GPU attention: cuBLAS S = Q K^T, softmax kernel, cuBLAS P V (fp32, no TF32)",
    .device = &attn_cuda_device,
    .has_causal = 1,
    .saves_lse = 1,
    .forward_workspace = forward_workspace,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
