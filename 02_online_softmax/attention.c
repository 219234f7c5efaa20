/* Stage 02: the online softmax. One pass over the K/V tiles, no score panel.
 *
 * For each block of Br query rows, each row keeps three running quantities while the
 * Bc-key tiles go by: the max m of the logits seen so far, the sum l of exp(s - m), and the
 * accumulator acc = sum exp(s - m) v. When a tile raises the max from m to m', everything
 * summed so far was scaled by exp(-m) instead of exp(-m'), so it is multiplied by the
 * correction factor exp(m - m'). After the last tile O = acc / l and LSE = m + log l.
 * The workspace is one S tile and the row state: O(Br Bc + Br d), whatever N is.
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

/* The S tile (Br x Bc), the accumulators (Br x d), and m, l, the tile's row max (Br each). */
static size_t forward_workspace(const attn_problem *p) {
  return sizeof(float) * ((size_t)Br * Bc + (size_t)Br * p->head_dim + 3 * (size_t)Br);
}

typedef struct {
  float *S;     /* Br x Bc logits of the current tile, then their exp */
  float *acc;   /* Br x d: sum of exp(s - m) v over the keys seen so far */
  float *m;     /* Br: running max */
  float *l;     /* Br: running sum of exp(s - m) */
  float *m_blk; /* Br: max of the current tile */
} row_state;

/* S = scale * Q K^T for one tile, and each row's max over the tile. */
static void compute_qk_scores_and_max(const attn_problem *p, const float *Q, int rows,
                                      const float *K, int cols, row_state *st) {
  int d = p->head_dim;
  for (int r = 0; r < rows; r++) {
    st->m_blk[r] = -INFINITY;
    for (int j = 0; j < cols; j++) {
      float dot = 0;
      for (int c = 0; c < d; c++) dot += Q[r * d + c] * K[j * d + c];
      st->S[r * Bc + j] = p->scale * dot;
      st->m_blk[r] = fmaxf(st->m_blk[r], st->S[r * Bc + j]);
    }
  }
}

/* m' = max(m, m_blk); what was summed under exp(-m) is rescaled by exp(m - m'). */
static void merge_block_stats(const attn_problem *p, int rows, row_state *st) {
  int d = p->head_dim;
  for (int r = 0; r < rows; r++) {
    float m_new = fmaxf(st->m[r], st->m_blk[r]);
    float correction = expf(st->m[r] - m_new); /* 0 on the first tile, where m = -inf */
    st->l[r] *= correction;
    for (int c = 0; c < d; c++) st->acc[r * d + c] *= correction;
    st->m[r] = m_new;
  }
}

/* P = exp(S - m) for the tile; l += rowsum(P); acc += P V. */
static void compute_block_softmax_and_weighted_v(const attn_problem *p, int rows, const float *V,
                                                 int cols, row_state *st) {
  int d = p->head_dim;
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < cols; j++) {
      float prob = expf(st->S[r * Bc + j] - st->m[r]);
      st->l[r] += prob;
      for (int c = 0; c < d; c++) st->acc[r * d + c] += prob * V[j * d + c];
    }
}

/* O = acc / l and LSE = m + log(l), the log of the softmax's denominator. */
static void normalize_output(const attn_problem *p, int rows, const row_state *st, float *O,
                             float *LSE) {
  int d = p->head_dim;
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < d; c++) O[r * d + c] = st->acc[r * d + c] / st->l[r];
    LSE[r] = st->m[r] + logf(st->l[r]);
  }
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  int d = p->head_dim;
  float *w = t->workspace;
  row_state st = {w, w + Br * Bc, w + Br * Bc + Br * d, w + Br * Bc + Br * d + Br,
                  w + Br * Bc + Br * d + 2 * Br};
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const float *Q = (const float *)t->q + attn_q_head(p, bh);
    const float *K = (const float *)t->k + attn_kv_head(p, bh);
    const float *V = (const float *)t->v + attn_kv_head(p, bh);
    float *O = (float *)t->o + attn_q_head(p, bh);
    float *LSE = t->lse + (size_t)bh * p->seq_q;
    for (int i0 = 0; i0 < p->seq_q; i0 += Br) {
      int rows = min_int(Br, p->seq_q - i0);
      for (int r = 0; r < rows; r++) {
        st.m[r] = -INFINITY, st.l[r] = 0;
        for (int c = 0; c < d; c++) st.acc[r * d + c] = 0;
      }
      for (int j0 = 0; j0 < p->seq_kv; j0 += Bc) {
        int cols = min_int(Bc, p->seq_kv - j0);
        compute_qk_scores_and_max(p, Q + i0 * d, rows, K + j0 * d, cols, &st);
        merge_block_stats(p, rows, &st);
        compute_block_softmax_and_weighted_v(p, rows, V + j0 * d, cols, &st);
      }
      normalize_output(p, rows, &st, O + i0 * d, LSE + i0);
    }
  }
}

static const attn_stage stage = {
    .name = "02_online_softmax",
    .idea = "online softmax: one pass, running max and sum, workspace independent of N",
    .device = &attn_host_device,
    .saves_lse = 1,
    .forward_workspace = forward_workspace,
    .forward = forward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
