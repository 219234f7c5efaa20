/* Stage 00: standard attention, as the textbook writes it.
 *
 * For each (batch, head): S = scale * Q K^T is materialised in full (Nq x Nkv floats),
 * softmax runs over each row of S in three passes (max, exp-sum, normalise), then O = P V.
 * The workspace is the whole of S, O(Nq Nkv): at N = 16384 that is 1 GiB per head. That
 * quadratic memory (and the traffic to fill and re-read it) is what FlashAttention removes.
 */
#include <math.h>

#include "attention.h"

static size_t forward_workspace(const attn_problem *p) {
  return sizeof(float) * (size_t)p->seq_q * p->seq_kv;
}

/* S = scale * Q K^T, every query against every key. */
static void compute_scores(const attn_problem *p, const float *Q, const float *K, float *S) {
  int d = p->head_dim, nkv = p->seq_kv;
  for (int i = 0; i < p->seq_q; i++)
    for (int j = 0; j < nkv; j++) {
      float dot = 0;
      for (int c = 0; c < d; c++) dot += Q[i * d + c] * K[j * d + c];
      S[(size_t)i * nkv + j] = p->scale * dot;
    }
}

/* P = softmax(S) row by row, in place. Subtracting the row max first keeps exp() <= 1, so
 * that large logits cannot overflow; it does not change the result. */
static void softmax_rows(const attn_problem *p, float *S) {
  int nkv = p->seq_kv;
  for (int i = 0; i < p->seq_q; i++) {
    float *row = S + (size_t)i * nkv;
    float m = -INFINITY, l = 0;
    for (int j = 0; j < nkv; j++) m = fmaxf(m, row[j]);
    for (int j = 0; j < nkv; j++) l += (row[j] = expf(row[j] - m));
    for (int j = 0; j < nkv; j++) row[j] /= l;
  }
}

/* O = P V. */
static void multiply_pv(const attn_problem *p, const float *P, const float *V, float *O) {
  int d = p->head_dim, nkv = p->seq_kv;
  for (int i = 0; i < p->seq_q; i++)
    for (int c = 0; c < d; c++) {
      float acc = 0;
      for (int j = 0; j < nkv; j++) acc += P[(size_t)i * nkv + j] * V[j * d + c];
      O[i * d + c] = acc;
    }
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  float *S = t->workspace; /* reused by every head */
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const float *Q = (const float *)t->q + attn_q_head(p, bh);
    const float *K = (const float *)t->k + attn_kv_head(p, bh);
    const float *V = (const float *)t->v + attn_kv_head(p, bh);
    float *O = (float *)t->o + attn_q_head(p, bh);
    compute_scores(p, Q, K, S);
    softmax_rows(p, S);
    multiply_pv(p, S, V, O);
  }
}

static const attn_stage stage = {
    .name = "00_naive",
    .idea = "standard attention: materialise S, softmax it, multiply by V",
    .device = &attn_host_device,
    .forward_workspace = forward_workspace,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
