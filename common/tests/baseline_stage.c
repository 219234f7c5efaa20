/* The harness's own fp32 baseline (common/baseline.c) run as a CPU stage that claims every
 * option, so that the harness's handling of the sliding window, the softcap and varlen (the
 * options, the reference and the checks, the result line, the TSV row, --save and --load) is
 * tested end to end before any stage has them. Not a stage of the ladder: the ladder's stages
 * refuse these options (tests of their own prove it). In fp32 the baseline rounds nothing, so
 * it is plain attention in float over attn_key_range's keys. */
#include "attention.h"
#include "baseline.h"

static void forward(const attn_problem *p, const attn_buffers *t) {
  baseline_forward_rows(p, t->q, t->k, t->v, NULL, (long)attn_lse_elems(p), t->o, t->lse);
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  baseline_backward(p, t->q, t->k, t->v, t->d_o, t->dq, t->dk, t->dv);
}

static const attn_stage stage = {
    .name = "baseline_stage",
    .idea = "the harness's fp32 baseline with every option, to test the harness",
    .device = &attn_host_device,
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward = backward,
    .has_gqa = 1,
    .has_gqa_backward = 1,
    .has_window = 1,
    .has_softcap = 1,
    .has_varlen = 1,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
