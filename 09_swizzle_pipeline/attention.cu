/* Stage 09: keeping the tensor cores fed.
 *
 * The kernels are stage 08's; what changes is how operands reach ldmatrix and what a warp
 * issues beside its products: tiles without padding, their 16-byte chunks permuted by XOR
 * with the row (`swizzle`: conflict-free, and a d = 128 forward block fits 96 KiB); copies
 * the compiler unrolls; the forward's K and V waited for separately, so V(t)'s copy overlaps
 * S = Q K(t)^T and K(t + 1)'s the softmax and P V(t); at d <= 64 32-row warps over 128-key
 * tiles, each operand read for two products, and masks only on the tiles that need them; in
 * the backward, dQ by fp32 atomics from the dK/dV kernel (ATTN_DETERMINISTIC=1 keeps 08's dQ
 * kernel), K, V operands reused.
 */
#include "attention.h"
#include "backward.cuh"
#include "forward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "09_swizzle_pipeline",
    .idea = "feeding the tensor cores: swizzled tiles, split K/V waits, atomic dQ",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
    .has_layouts = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
