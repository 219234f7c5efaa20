/* Stage 14: which keys a query sees, on Hopper (compute capability 9.0, built for sm_90a).
 *
 * Stage 13 made each row's keys an interval (causal, a sliding window or both) on 09's
 * kernels, which run on every GPU from sm_80; there a window's backward stays near 09's
 * speed, and Hopper's wgmma kernels, 10's forward and 12's backward, are faster still. This
 * stage gives those two kernels 13's intervals: a block skips the tiles outside its keys
 * (the forward) or queries (the backward) at both ends, masks only the boundary tiles, and
 * the deterministic dQ counts its turns from the first key block that sees each tile. The
 * softcap and packed sequences stay 13's.
 */
#include "../13_window_softcap_varlen/backward.cuh"
#include "attention.h"
#include "backward.cuh"
#include "forward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "14_hopper_window",
    .idea = "13's sliding windows on Hopper's kernels: 10's forward, 12's backward",
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
    .has_window = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
