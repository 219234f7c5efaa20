/* Stage 13: which keys a query sees.
 *
 * The kernels are stage 09's; what changes is the set of keys each query row sees. Causal
 * masking (05) made it a prefix; a sliding window bounds it on the left too, and a packed
 * batch of sequences (varlen) confines it to the row's own sequence. Every one of these is an
 * interval of keys per row, non-decreasing in the row, so 05's classification of tiles carries
 * over with a second edge: tiles wholly outside a block's keys are skipped at both ends, tiles
 * wholly inside run unmasked, and only the boundary tiles compare indices. A logit softcap,
 * c tanh(S / c), changes the scores themselves: one more step before the mask, and its
 * derivative, 1 - tanh^2, in the backward.
 */
#include "attention.h"
#include "backward.cuh"
#include "forward.cuh"
#include "gpu.h"

static const attn_stage stage = {
    .name = "13_window_softcap_varlen",
    .idea = "which keys a query sees: sliding windows, logit softcap, packed sequences",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
    .has_layouts = 1,
    .has_window = 1,
    .has_softcap = 1,
    .has_varlen = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
