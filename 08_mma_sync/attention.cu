/* Stage 08: the tensor-core instruction itself, mma.sync, with S, P and O in registers.
 *
 * The kernels are stage 07's, every product on mma.sync. The backward never stores
 * P: it recomputes P_ij = exp(S_ij - LSE_i) tile by tile from Q, K and LSE. Three kernels:
 *   compute_delta_kernel         D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i))
 *   flash_backward_dkdv_kernel   a warp per 16 keys j, walking the query tiles:
 *                                dV_j += P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - D_i),
 *                                dK_j += scale dS_ij Q_i      (dK, dV in registers)
 *   flash_backward_dq_kernel     a warp per 16 queries i, walking the key tiles like the
 *                                forward: dQ_i += scale dS_ij K_j  (dQ in registers)
 * A warp multiplies its rows on tensor cores (fp16 or bf16 in, fp32 accumulation). WMMA
 * does not say which lane holds which element of a fragment, so each thread reads its row of
 * a product from shared memory in stage 07. mma.sync.m16n8k16 and ldmatrix document theirs
 * (the PTX ISA; drawn below), so S, P and O stay in registers: a row's max and sum over the 4
 * lanes (a quad) holding it, P (or dS, P^T, dS^T) made an A operand in place. Beside that:
 * exp2 with the scale folded in, masks only where needed, cp.async copying the next tile.
 * dQ gets its own pass instead of atomics from the dK/dV kernel: it recomputes S and dP
 * once more (7 d instead of 5 d multiply-adds per (i, j)), and in exchange every gradient
 * is written by exactly one thread, so the backward is deterministic.
 */
#include "attention.h"
#include "backward.cuh"
#include "forward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "08_mma_sync",
    .idea = "mma.sync and ldmatrix: the documented fragment layout, S, P and O in registers",
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
