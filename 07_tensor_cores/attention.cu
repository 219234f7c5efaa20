/* Stage 07: the matrix products on tensor cores, through nvcuda::wmma, in fp16 or bf16.
 *
 * The forward is stage 06's with S = Q K^T and O += P V on WMMA. The backward never stores
 * P: it recomputes P_ij = exp(S_ij - LSE_i) tile by tile from Q, K and LSE. Three kernels:
 *   compute_delta_kernel         D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i))
 *   flash_backward_dkdv_kernel   a warp per 16 keys j, walking the query tiles:
 *                                dV_j += P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - D_i),
 *                                dK_j += scale dS_ij Q_i      (dK, dV in registers)
 *   flash_backward_dq_kernel     a warp per 16 queries i, walking the key tiles like the
 *                                forward: dQ_i += scale dS_ij K_j  (dQ in registers)
 * A warp multiplies its rows on tensor cores (fp16 or bf16 in, fp32 accumulation). WMMA
 * does not say which lane holds which element of a fragment, so each thread reads its row of
 * a product from shared memory, and P and dS go back there as operands (not so in stage 08).
 * dQ gets its own pass instead of atomics from the dK/dV kernel: it recomputes S and dP
 * once more (7 d instead of 5 d multiply-adds per (i, j)), and in exchange every gradient
 * is written by exactly one thread, so the backward is deterministic.
 */
#include "attention.h"
#include "backward.cuh"
#include "forward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "07_tensor_cores",
    .idea = "the matrix products on tensor cores through WMMA: fp16/bf16 in, fp32 accumulation",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
