/* The float64 reference: attention exactly as docs/conventions.md section 1 defines it, in
 * double, one row at a time, written to be read rather than to be fast. Every stage is
 * checked against it; its backward is itself checked by finite differences
 * (tests/test_reference.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "reference.h"

/* Row r of the B*H*Nq query rows: its (b,h) pair and its index i inside the sequence. */
static void split_row(const attn_problem *p, long r, long *bh, int *i) {
  *bh = r / p->seq_q;
  *i = (int)(r % p->seq_q);
}

/* s[j] = scale * q . k_j for the keys row i of sequence b sees; returns their count. */
static int row_logits(const attn_problem *p, const double *q_row, const double *k_head, long b,
                      int i, double *s) {
  int d = p->head_dim, visible = attn_visible_keys(p, b, i);
  for (int j = 0; j < visible; j++) {
    double dot = 0;
    for (int c = 0; c < d; c++) dot += q_row[c] * k_head[(size_t)j * d + c];
    s[j] = p->scale * dot;
  }
  return visible;
}

/* Softmax of s[0..n) in place; returns log(sum exp(s)), or -inf for an empty row. */
static double softmax_in_place(double *s, int n) {
  if (n == 0) return -INFINITY;
  double m = s[0], l = 0;
  for (int j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
  for (int j = 0; j < n; j++) l += (s[j] = exp(s[j] - m));
  for (int j = 0; j < n; j++) s[j] /= l;
  return m + log(l);
}

void reference_forward_rows(const attn_problem *p, const double *q, const double *k,
                            const double *v, const long *rows, long n_rows, double *o, double *lse,
                            double *max_abs_s) {
  int d = p->head_dim;
  double *s = attn_host_alloc(sizeof(double) * (size_t)p->seq_kv, "reference scores");
  double s_max = 0;
  for (long n = 0; n < n_rows; n++) {
    long r = rows ? rows[n] : n, bh;
    int i;
    split_row(p, r, &bh, &i);
    /* Query head bh reads K/V head bh / G (grouped-query attention; G = 1 without it). */
    const double *k_head = k + attn_kv_head(p, bh), *v_head = v + attn_kv_head(p, bh);
    int visible = row_logits(p, q + (size_t)r * d, k_head, bh / p->heads, i, s);
    for (int j = 0; j < visible; j++) s_max = fabs(s[j]) > s_max ? fabs(s[j]) : s_max;
    lse[n] = softmax_in_place(s, visible);
    double *o_row = o + (size_t)n * d;
    for (int c = 0; c < d; c++) o_row[c] = 0; /* a row that sees no key: O = 0 */
    for (int j = 0; j < visible; j++)
      for (int c = 0; c < d; c++) o_row[c] += s[j] * v_head[(size_t)j * d + c];
  }
  free(s);
  if (max_abs_s) *max_abs_s = s_max;
}

/* The backward of loss = sum(O * dO) + sum(w * LSE), straight from the chain rule:
 *   dV_j = sum_i P_ij dO_i
 *   dP_ij = dO_i . V_j
 *   dS_ij = P_ij (dP_ij - sum_l P_il dP_il) + w_i P_ij      (softmax and LSE backward)
 *   dQ_i = scale sum_j dS_ij K_j,   dK_j = scale sum_i dS_ij Q_i
 * Masked entries have P = 0, so they get no gradient, and a row that sees no key gives 0.
 * Under grouped-query attention the G query heads of a group read one K/V head, so its dK
 * and dV are the sums of the G heads' contributions: every head adds into the same rows. */
void reference_backward(const attn_problem *p, const double *q, const double *k, const double *v,
                        const double *d_o, const double *w_lse, double *dq, double *dk, double *dv,
                        double *ds) {
  int d = p->head_dim, nq = p->seq_q, nkv = p->seq_kv;
  double *P = attn_host_alloc(sizeof(double) * (size_t)nq * nkv, "reference P");
  double *dP = attn_host_alloc(sizeof(double) * (size_t)nq * nkv, "reference dP");
  memset(dk, 0, sizeof(double) * attn_kv_elems(p));
  memset(dv, 0, sizeof(double) * attn_kv_elems(p));
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const double *Q = q + attn_q_head(p, bh), *K = k + attn_kv_head(p, bh);
    const double *V = v + attn_kv_head(p, bh), *dO = d_o + attn_q_head(p, bh);
    double *dQ = dq + attn_q_head(p, bh), *dK = dk + attn_kv_head(p, bh);
    double *dV = dv + attn_kv_head(p, bh);
    /* Keys past the cache's L_b are never read: their gradients stay 0. */
    int len = attn_cache_len(p, bh / p->heads);
    memset(dQ, 0, sizeof(double) * (size_t)nq * d);
    for (int i = 0; i < nq; i++) {
      double *P_row = P + (size_t)i * nkv, *dP_row = dP + (size_t)i * nkv;
      int visible = row_logits(p, Q + (size_t)i * d, K, bh / p->heads, i, P_row);
      softmax_in_place(P_row, visible);
      for (int j = visible; j < nkv; j++) P_row[j] = 0;
      double row_dot = 0; /* sum_j P_ij dP_ij */
      for (int j = 0; j < len; j++) {
        double dot = 0;
        for (int c = 0; c < d; c++) dot += dO[(size_t)i * d + c] * V[(size_t)j * d + c];
        dP_row[j] = dot;
        row_dot += P_row[j] * dot;
      }
      double w = w_lse ? w_lse[(size_t)bh * nq + i] : 0;
      for (int j = 0; j < nkv; j++) {
        double dS = j < len ? P_row[j] * (dP_row[j] - row_dot) + w * P_row[j] : 0;
        if (ds) ds[((size_t)bh * nq + i) * nkv + j] = dS;
        if (j >= len) continue;
        for (int c = 0; c < d; c++) {
          dV[(size_t)j * d + c] += P_row[j] * dO[(size_t)i * d + c];
          dQ[(size_t)i * d + c] += p->scale * dS * K[(size_t)j * d + c];
          dK[(size_t)j * d + c] += p->scale * dS * Q[(size_t)i * d + c];
        }
      }
    }
  }
  free(P);
  free(dP);
}
