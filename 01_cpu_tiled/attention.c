/* Stage 01: tiling. Br query rows at a time, their scores built tile by tile over Bc keys.
 *
 * For each (batch, head) and each block of Br query rows: the Br x Nkv panel of S is built
 * from Bc-key tiles of K, softmax runs over each row of the panel, then O = P V for the
 * block. Only the current panel lives in the workspace: O(Br Nkv) instead of O(Nq Nkv).
 * The panel still spans every key, because a softmax needs the whole row before it can
 * normalise: stage 02 removes exactly that.
 */
#include <math.h>

#include "attention.h"

/* Query rows per block: a 32 x 64 tile of Q (8 KiB at d = 64) stays in L1 while it meets
 * every key tile. */
enum { Br = 32 };
/* Keys per tile: 64 keys x d = 64 floats is 16 KiB of K, which stays in L1/L2 while the
 * Br rows of the block use it. */
enum { Bc = 64 };

static int min_int(int a, int b) { return a < b ? a : b; }

static size_t forward_workspace(const attn_problem *p) {
  return sizeof(float) * (size_t)min_int(Br, p->seq_q) * p->seq_kv;
}

/* One tile of the panel: S[r][j0 + j] = scale * q_r . k_j for the block's rows and the
 * tile's keys. */
static void compute_qk_scores(const attn_problem *p, const float *Q, int rows, const float *K,
                              int j0, int cols, float *S) {
  int d = p->head_dim, nkv = p->seq_kv;
  for (int r = 0; r < rows; r++)
    for (int j = j0; j < j0 + cols; j++) {
      float dot = 0;
      for (int c = 0; c < d; c++) dot += Q[r * d + c] * K[j * d + c];
      S[(size_t)r * nkv + j] = p->scale * dot;
    }
}

/* P = softmax(S) over each row of the panel, in place: the whole row is needed here. */
static void softmax_rows(const attn_problem *p, int rows, float *S) {
  int nkv = p->seq_kv;
  for (int r = 0; r < rows; r++) {
    float *row = S + (size_t)r * nkv;
    float m = -INFINITY, l = 0;
    for (int j = 0; j < nkv; j++) m = fmaxf(m, row[j]);
    for (int j = 0; j < nkv; j++) l += (row[j] = expf(row[j] - m));
    for (int j = 0; j < nkv; j++) row[j] /= l;
  }
}

/* O = P V for the block's rows. */
static void multiply_pv(const attn_problem *p, int rows, const float *P, const float *V, float *O) {
  int d = p->head_dim, nkv = p->seq_kv;
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < d; c++) {
      float acc = 0;
      for (int j = 0; j < nkv; j++) acc += P[(size_t)r * nkv + j] * V[j * d + c];
      O[r * d + c] = acc;
    }
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  float *S = t->workspace; /* the Br x Nkv panel of the current row block */
  int d = p->head_dim;
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const float *Q = (const float *)t->q + attn_q_head(p, bh);
    const float *K = (const float *)t->k + attn_kv_head(p, bh);
    const float *V = (const float *)t->v + attn_kv_head(p, bh);
    float *O = (float *)t->o + attn_q_head(p, bh);
    for (int i0 = 0; i0 < p->seq_q; i0 += Br) {
      int rows = min_int(Br, p->seq_q - i0);
      for (int j0 = 0; j0 < p->seq_kv; j0 += Bc)
        compute_qk_scores(p, Q + i0 * d, rows, K, j0, min_int(Bc, p->seq_kv - j0), S);
      softmax_rows(p, rows, S);
      multiply_pv(p, rows, S, V, O + i0 * d);
    }
  }
}

static const attn_stage stage = {
    .name = "01_cpu_tiled",
    .idea = "tiling: Br query rows at a time, scores built over Bc-key tiles",
    .device = &attn_host_device,
    .forward_workspace = forward_workspace,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
