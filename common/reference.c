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

/* The logit of q and k: x = scale q . k, or with a softcap c, c tanh(x / c); *t gets that
 * tanh (0 without a softcap), which the backward's chain rule needs, and *x the raw x. */
static double logit(const attn_problem *p, const double *q_row, const double *k_row, double *t,
                    double *x) {
  double dot = 0;
  for (int c = 0; c < p->head_dim; c++) dot += q_row[c] * k_row[c];
  *x = p->scale * dot;
  *t = 0;
  if (p->softcap > 0) return p->softcap * (*t = tanh(*x / p->softcap));
  return *x;
}

/* s[j - lo] = the logit of key j for the keys [lo, hi) that row i of batch b sees (t[j - lo]
 * its tanh, when t is not NULL); returns their count, hi - lo. *x_max, when not NULL, is raised
 * to the largest |scale q . k| among them. */
static int row_logits(const attn_problem *p, const double *q_row, const double *k_head, long b,
                      int i, int *lo, double *s, double *t, double *x_max) {
  int hi, d = p->head_dim;
  attn_key_range(p, b, i, lo, &hi);
  for (int j = *lo; j < hi; j++) {
    double tanh_j, x;
    s[j - *lo] = logit(p, q_row, k_head + (size_t)j * d, &tanh_j, &x);
    if (t) t[j - *lo] = tanh_j;
    if (x_max && fabs(x) > *x_max) *x_max = fabs(x);
  }
  return hi - *lo;
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
  double s_max = 0, x_max = 0;
  for (long n = 0; n < n_rows; n++) {
    long r = rows ? rows[n] : n, bh;
    int i;
    split_row(p, r, &bh, &i);
    /* Query head bh reads K/V head bh / G (grouped-query attention; G = 1 without it). */
    const double *k_head = k + attn_kv_head(p, bh), *v_head = v + attn_kv_head(p, bh);
    int lo,
        visible = row_logits(p, q + (size_t)r * d, k_head, bh / p->heads, i, &lo, s, NULL, &x_max);
    for (int j = 0; j < visible; j++) s_max = fabs(s[j]) > s_max ? fabs(s[j]) : s_max;
    lse[n] = softmax_in_place(s, visible);
    double *o_row = o + (size_t)n * d;
    for (int c = 0; c < d; c++) o_row[c] = 0; /* a row that sees no key: O = 0 */
    for (int j = 0; j < visible; j++)
      for (int c = 0; c < d; c++) o_row[c] += s[j] * v_head[(size_t)(lo + j) * d + c];
  }
  free(s);
  /* With a softcap c a stage rounds x = scale q . k, not S. That error reaches S times
   * tanh's slope (at most 1), which |S| covers; but it also moves the slope, which the backward
   * multiplies dS by, by about 2 |error| / c, and |error| grows with |x|. So the logits'
   * magnitude is also max|x| / c: in the tests' case of x about 1e3 and c = 0.5, a correct
   * fp32 stage's dK is off by 4e-5 of itself, twice what max|S| = 0.5 alone allows. */
  if (p->softcap > 0 && x_max / p->softcap > s_max) s_max = x_max / p->softcap;
  if (max_abs_s) *max_abs_s = s_max;
}

/* The backward of loss = sum(O * dO) + sum(w * LSE), straight from the chain rule:
 *   dV_j = sum_i P_ij dO_i
 *   dP_ij = dO_i . V_j
 *   dS_ij = P_ij (dP_ij - sum_l P_il dP_il) + w_i P_ij      (softmax and LSE backward)
 *   dQ_i = scale sum_j dX_ij K_j,   dK_j = scale sum_i dX_ij Q_i
 * where dX = dS, or with a softcap (S = c tanh(X / c), X = scale q . k) dX = dS (1 - tanh^2).
 * Only the keys [lo, hi) of a row (attn_key_range) enter it: the others have P = 0 and get no
 * gradient, a row that sees no key gives 0, and keys past a cache's L_b or of another packed
 * sequence are never read. Under grouped-query attention the G query heads of a group read one
 * K/V head, so its dK and dV are the sums of the G heads' contributions: every head adds into
 * the same rows. */
void reference_backward(const attn_problem *p, const double *q, const double *k, const double *v,
                        const double *d_o, const double *w_lse, double *dq, double *dk, double *dv,
                        double *ds) {
  int d = p->head_dim, nq = p->seq_q, nkv = p->seq_kv;
  /* One row at a time: a varlen problem's rows are many (the packed total), its ranges short. */
  double *P = attn_host_alloc(sizeof(double) * (size_t)nkv, "reference P");
  double *dP = attn_host_alloc(sizeof(double) * (size_t)nkv, "reference dP");
  double *T = attn_host_alloc(sizeof(double) * (size_t)nkv, "reference tanh");
  memset(dk, 0, sizeof(double) * attn_kv_elems(p));
  memset(dv, 0, sizeof(double) * attn_kv_elems(p));
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    const double *Q = q + attn_q_head(p, bh), *K = k + attn_kv_head(p, bh);
    const double *V = v + attn_kv_head(p, bh), *dO = d_o + attn_q_head(p, bh);
    double *dQ = dq + attn_q_head(p, bh), *dK = dk + attn_kv_head(p, bh);
    double *dV = dv + attn_kv_head(p, bh);
    memset(dQ, 0, sizeof(double) * (size_t)nq * d);
    for (int i = 0; i < nq; i++) {
      int lo, n = row_logits(p, Q + (size_t)i * d, K, bh / p->heads, i, &lo, P, T, NULL);
      softmax_in_place(P, n);
      double row_dot = 0; /* sum_j P_ij dP_ij */
      for (int j = 0; j < n; j++) {
        double dot = 0;
        for (int c = 0; c < d; c++) dot += dO[(size_t)i * d + c] * V[(size_t)(lo + j) * d + c];
        dP[j] = dot;
        row_dot += P[j] * dot;
      }
      double w = w_lse ? w_lse[(size_t)bh * nq + i] : 0;
      double *ds_row = ds ? ds + ((size_t)bh * nq + i) * nkv : NULL;
      if (ds_row) memset(ds_row, 0, sizeof(double) * (size_t)nkv);
      for (int j = 0; j < n; j++) {
        double dS = P[j] * (dP[j] - row_dot) + w * P[j];
        if (ds_row) ds_row[lo + j] = dS;
        double dX = p->softcap > 0 ? dS * (1 - T[j] * T[j]) : dS;
        size_t key = (size_t)(lo + j) * d;
        for (int c = 0; c < d; c++) {
          dV[key + c] += P[j] * dO[(size_t)i * d + c];
          dQ[(size_t)i * d + c] += p->scale * dX * K[key + c];
          dK[key + c] += p->scale * dX * Q[(size_t)i * d + c];
        }
      }
    }
  }
  free(P), free(dP), free(T);
}
