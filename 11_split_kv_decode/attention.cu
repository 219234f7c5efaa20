/* Stage 11: decoding against a KV cache, with grouped-query attention.
 *
 * The kernels are stage 09's. What is added:
 *   - grouped-query attention (GQA/MQA): K and V have Hkv heads, and query head h reads K/V
 *     head h / G, G = H / Hkv;
 *   - cache lengths: sequence b attends to its first L_b <= Nkv keys (bottom-right causal
 *     against L_b), and nothing past them is read;
 *   - a decode path (FlashDecoding) for problems with few query rows per K/V head: the keys
 *     of each (sequence, K/V head) are split into chunks across blocks, each block takes all
 *     G x Nq query rows of its K/V head so that K and V are read once, writes a partial O and
 *     LSE, and a second kernel merges a row's chunks by their LSE (stage 02's merge).
 * The backward is 09's, for the problems 09 computes (Hkv = H, no cache lengths).
 */
#include "../09_swizzle_pipeline/backward.cuh"
#include "attention.h"
#include "forward.cuh"
#include "gpu.h"

/* 09's backward, for 09's problems. (The harness refuses --backward with GQA or cache lengths
 * before anything runs; this line guards the library's callers.) */
static void mha_backward(const attn_problem *p, const attn_buffers *t) {
  if (attn_heads_kv(p) != p->heads || p->cache_lens || t->cache_lens)
    attn_fail(EXIT_BAD_USAGE, "the backward takes Hkv = H and no cache lengths (it is 09's)");
  backward(p, t);
}

static const attn_stage stage = {
    .name = "11_split_kv_decode",
    .idea = "decode: keys split across blocks, merged by LSE; grouped-query attention",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward_workspace = forward_workspace,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = mha_backward,
    .has_gqa = 1,
    .has_cache_lens = 1,
    .has_layouts = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
