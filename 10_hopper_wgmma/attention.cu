/* Stage 10: the forward rebuilt for Hopper (compute capability 9.0, built for sm_90a).
 *
 * On an H100 an mma.sync is a warp's 16 x 8 x 16 product, issued and waited for one at a time
 * beside the ldmatrix loads that feed it: stage 09 stops near FlashAttention-2's speed, a third
 * of what the tensor cores can do. The forward here uses FlashAttention-3's three ideas:
 *   - TMA: one thread copies a whole tile with one instruction (cp.async.bulk.tensor, from a
 *     tensor map the host encodes), straight into the 128-byte swizzled layout the tensor cores
 *     read, and the copy counts its bytes on an mbarrier that the readers wait on;
 *   - wgmma: a warpgroup (4 warps, 64 query rows) multiplies 64 x N x 16 in one asynchronous
 *     instruction, Q and K read from shared memory through descriptors (S = Q K^T), P from
 *     registers (O += P V);
 *   - warp specialisation: a producer warpgroup only issues copies into a ring of K and V
 *     stages and hands its registers to two consumer warpgroups (setmaxnreg), which only
 *     compute; and each consumer overlaps its softmax with its products: it issues
 *     S(t) = Q K(t)^T and O += P(t - 1) V(t - 1) before it computes the softmax of S(t), so the
 *     exponentials run while the tensor cores work.
 * The backward is stage 09's (its backward.cuh: mma.sync, ldmatrix, cp.async).
 */
#include "../09_swizzle_pipeline/backward.cuh"
#include "attention.h"
#include "forward.cuh"
#include "gpu.h"

/* 09's backward, which this stage refuses on any GPU but the one it is built for, as its
 * forward does. */
static void hopper_backward(const attn_problem *p, const attn_buffers *t) {
  require_hopper();
  backward(p, t);
}

static const attn_stage stage = {
    .name = "10_hopper_wgmma",
    .idea = "Hopper's forward: TMA, wgmma, a producer warpgroup, softmax overlapping products",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = hopper_backward,
    .has_gqa = 1,
    .has_layouts = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
