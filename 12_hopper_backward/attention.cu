/* Stage 12: the backward rebuilt for Hopper (compute capability 9.0, built for sm_90a).
 *
 * The forward is stage 10's (its forward.cuh). The backward takes the same three ideas to the
 * five products of the backward: TMA copies of the query tiles through a ring of mbarriers,
 * wgmma for S^T, dP^T and dQ from shared memory and for dV and dK with P^T and dS^T from
 * registers, and a producer warpgroup feeding two consumer warpgroups (backward.cuh).
 */
#include "../09_swizzle_pipeline/backward.cuh"
#include "../10_hopper_wgmma/forward.cuh"
#include "attention.h"
#include "backward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "12_hopper_backward",
    .idea = "Hopper's backward: K and V resident, Q and dO by TMA, five products on wgmma",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = hopper_backward_workspace,
    .backward = hopper_backward,
    .has_gqa = 1,
    .has_gqa_backward = 1,
    .has_layouts = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
