/* The plain same-precision baseline (docs/conventions.md section 3). Everything in float (fp32
 * accumulation); the two matrices a tensor-core kernel must feed to a product in the
 * dtype, P and dS, are rounded to it first; the outputs are rounded to it, and the
 * backward's D = rowsum(dO * O) uses O as the forward stored it, in the dtype (as every
 * FlashAttention backward does: where P is nearly one-hot, dP - D is a difference of two
 * nearly equal numbers, and O's rounding dominates dS). No tiling, no online softmax: the
 * simplest computation with the dtype's unavoidable roundings. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"

/* x rounded to the dtype's precision with the exponent range it needs: the kernels keep dS
 * inside fp16's range by an exact power-of-two scaling (docs/conventions.md section 2), so the
 * baseline's dS must not overflow where theirs does not. */
static float round_unbounded(float x, attn_dtype t) {
  const int limit_log2 = 15; /* 2^15: well inside fp16's range */
  int e;
  frexpf(x, &e);
  int shift = e > limit_log2 ? e - limit_log2 : 0;
  return ldexpf(attn_round_to_dtype(ldexpf(x, -shift), t), shift);
}

/* p_row[j - lo] = softmax of the logits of the keys [lo, hi) that row i of batch b sees, rounded
 * to the dtype (t_row[j - lo] the softcap's tanh of each, where t_row is not NULL); returns their
 * count and sets *lo and *lse (-inf when none). With a softcap c the logit is c tanhf(x / c) of
 * the fp32 x = scale q . k, as a kernel would form it. */
static int baseline_probabilities(const attn_problem *p, const float *q_row, const float *K, long b,
                                  int i, int *lo, float *p_row, float *t_row, float *lse) {
  int d = p->head_dim, hi;
  attn_key_range(p, b, i, lo, &hi);
  int visible = hi - *lo;
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j < visible; j++) {
    const float *k_row = K + (size_t)(*lo + j) * d;
    float dot = 0.f;
    for (int c = 0; c < d; c++) dot += q_row[c] * k_row[c];
    p_row[j] = p->scale * dot;
    if (p->softcap > 0) {
      float t = tanhf(p_row[j] / p->softcap);
      p_row[j] = p->softcap * t;
      if (t_row) t_row[j] = t;
    }
    m = p_row[j] > m ? p_row[j] : m;
  }
  for (int j = 0; j < visible; j++) l += (p_row[j] = expf(p_row[j] - m));
  for (int j = 0; j < visible; j++) p_row[j] = attn_round_to_dtype(p_row[j] / l, p->dtype);
  *lse = visible ? m + logf(l) : -INFINITY;
  return visible;
}

void baseline_forward_rows(const attn_problem *p, const float *q, const float *k, const float *v,
                           const long *rows, long n_rows, float *o, float *lse) {
  int d = p->head_dim;
  float *P = attn_host_alloc(sizeof(float) * (size_t)p->seq_kv, "baseline P");
  float *acc = attn_host_alloc(sizeof(float) * (size_t)d, "baseline O row");
  for (long n = 0; n < n_rows; n++) {
    long r = rows ? rows[n] : n, bh = r / p->seq_q;
    int i = (int)(r % p->seq_q);
    const float *K = k + attn_kv_head(p, bh), *V = v + attn_kv_head(p, bh);
    int lo, visible = baseline_probabilities(p, q + (size_t)r * d, K, bh / p->heads, i, &lo, P,
                                             NULL, &lse[n]);
    memset(acc, 0, sizeof(float) * (size_t)d);
    for (int j = 0; j < visible; j++)
      for (int c = 0; c < d; c++) acc[c] += P[j] * V[(size_t)(lo + j) * d + c];
    for (int c = 0; c < d; c++) o[(size_t)n * d + c] = attn_round_to_dtype(acc[c], p->dtype);
  }
  free(P), free(acc);
}

void baseline_backward(const attn_problem *p, const float *q, const float *k, const float *v,
                       const float *d_o, float *dq, float *dk, float *dv) {
  int d = p->head_dim, nq = p->seq_q, nkv = p->seq_kv;
  float *P = attn_host_alloc(sizeof(float) * (size_t)nkv, "baseline P");
  float *dP = attn_host_alloc(sizeof(float) * (size_t)nkv, "baseline dP");
  float *T = attn_host_alloc(sizeof(float) * (size_t)nkv, "baseline tanh");
  float *dq_row = attn_host_alloc(sizeof(float) * (size_t)d, "baseline dQ row");
  /* dK and dV in fp32 until the end: under grouped-query attention the G query heads of a group
   * add into one K/V head's rows, which are rounded once, as a GQA kernel would. */
  float *dk_acc = attn_host_alloc(sizeof(float) * attn_kv_elems(p), "baseline dK");
  float *dv_acc = attn_host_alloc(sizeof(float) * attn_kv_elems(p), "baseline dV");
  memset(dk_acc, 0, sizeof(float) * attn_kv_elems(p));
  memset(dv_acc, 0, sizeof(float) * attn_kv_elems(p));
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const float *K = k + attn_kv_head(p, bh), *V = v + attn_kv_head(p, bh);
    float *dK = dk_acc + attn_kv_head(p, bh), *dV = dv_acc + attn_kv_head(p, bh);
    for (int i = 0; i < nq; i++) {
      const float *Q_i = q + attn_q_head(p, bh) + (size_t)i * d;
      const float *dO_i = d_o + attn_q_head(p, bh) + (size_t)i * d;
      float lse, row_dot = 0.f; /* D_i = rowsum(dO_i * O_i), from O as the dtype stores it */
      int lo, visible = baseline_probabilities(p, Q_i, K, bh / p->heads, i, &lo, P, T, &lse);
      const float *K_lo = K + (size_t)lo * d, *V_lo = V + (size_t)lo * d;
      float *dK_lo = dK + (size_t)lo * d, *dV_lo = dV + (size_t)lo * d;
      memset(dq_row, 0, sizeof(float) * (size_t)d);
      for (int j = 0; j < visible; j++)
        for (int c = 0; c < d; c++) dq_row[c] += P[j] * V_lo[(size_t)j * d + c];
      for (int c = 0; c < d; c++) row_dot += dO_i[c] * attn_round_to_dtype(dq_row[c], p->dtype);
      for (int j = 0; j < visible; j++) {
        float dot = 0.f;
        for (int c = 0; c < d; c++) dot += dO_i[c] * V_lo[(size_t)j * d + c];
        dP[j] = dot;
      }
      memset(dq_row, 0, sizeof(float) * (size_t)d);
      for (int j = 0; j < visible; j++) {
        /* The softcap's 1 - tanh^2 in fp32, before dS is rounded for its products. */
        float dS = P[j] * (dP[j] - row_dot);
        if (p->softcap > 0) dS *= 1.f - T[j] * T[j];
        dS = round_unbounded(dS, p->dtype);
        for (int c = 0; c < d; c++) {
          dV_lo[(size_t)j * d + c] += P[j] * dO_i[c];
          dq_row[c] += dS * K_lo[(size_t)j * d + c];
          dK_lo[(size_t)j * d + c] += dS * Q_i[c];
        }
      }
      float *dQ_i = dq + attn_q_head(p, bh) + (size_t)i * d;
      for (int c = 0; c < d; c++) dQ_i[c] = attn_round_to_dtype(p->scale * dq_row[c], p->dtype);
    }
  }
  for (size_t e = 0; e < attn_kv_elems(p); e++) {
    dk[e] = attn_round_to_dtype(p->scale * dk_acc[e], p->dtype);
    dv[e] = attn_round_to_dtype(dv_acc[e], p->dtype);
  }
  free(P), free(dP), free(T), free(dq_row), free(dk_acc), free(dv_acc);
}
