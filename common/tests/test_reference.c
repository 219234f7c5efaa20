/* The float64 reference backward, checked against central finite differences of its own
 * forward (docs/conventions.md section 3), and the invariants of dS. Exit 0 when all hold. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "attention.h"
#include "reference.h"

static int failures = 0;

#define EXPECT(cond, ...)                    \
  do {                                       \
    if (!(cond)) {                           \
      failures++;                            \
      fprintf(stderr, "FAIL: " __VA_ARGS__); \
      fputc('\n', stderr);                   \
    }                                        \
  } while (0)

typedef struct {
  attn_problem p;
  double *q, *k, *v, *g, *w; /* inputs, dLoss/dO, the LSE weights */
} fd_case;

/* loss = sum(G * O) + sum(w * LSE); rows that see no key carry w = 0 (their LSE is -inf). */
static double loss(const fd_case *c) {
  const attn_problem *p = &c->p;
  long rows = (long)attn_lse_elems(p);
  double *o = malloc(sizeof(double) * attn_q_elems(p)), *lse = malloc(sizeof(double) * rows);
  reference_forward_rows(p, c->q, c->k, c->v, NULL, rows, o, lse, NULL);
  double total = 0;
  for (size_t e = 0; e < attn_q_elems(p); e++) total += c->g[e] * o[e];
  for (long r = 0; r < rows; r++)
    if (c->w[r] != 0) total += c->w[r] * lse[r];
  free(o), free(lse);
  return total;
}

static double *randn(attn_rng *rng, size_t n) {
  double *x = malloc(sizeof(double) * n);
  for (size_t i = 0; i < n; i++) x[i] = attn_rng_normal(rng);
  return x;
}

static void finite_differences(int nq, int nkv, int d, int causal) {
  fd_case c = {{1, 2, nq, nkv, d, causal, (float)(1 / sqrt((double)d)), DTYPE_FP32}, 0, 0, 0, 0, 0};
  const attn_problem *p = &c.p;
  attn_rng rng;
  attn_rng_seed(&rng, 1000u * nq + 100u * nkv + 10u * d + causal);
  size_t nqe = attn_q_elems(p), nkve = attn_kv_elems(p), rows = attn_lse_elems(p);
  c.q = randn(&rng, nqe), c.k = randn(&rng, nkve), c.v = randn(&rng, nkve);
  c.g = randn(&rng, nqe), c.w = randn(&rng, rows);
  for (size_t r = 0; r < rows; r++)
    if (attn_visible_keys(p, (int)(r % (size_t)nq)) == 0) c.w[r] = 0;
  double *grad[3] = {malloc(sizeof(double) * nqe), malloc(sizeof(double) * nkve),
                     malloc(sizeof(double) * nkve)};
  reference_backward(p, c.q, c.k, c.v, c.g, c.w, grad[0], grad[1], grad[2], NULL);
  double *inputs[3] = {c.q, c.k, c.v};
  size_t counts[3] = {nqe, nkve, nkve};
  const char *names[3] = {"dQ", "dK", "dV"};
  const double h = 1e-6;
  for (int t = 0; t < 3; t++)
    for (size_t e = 0; e < counts[t]; e++) {
      double saved = inputs[t][e];
      inputs[t][e] = saved + h;
      double up = loss(&c);
      inputs[t][e] = saved - h;
      double down = loss(&c);
      inputs[t][e] = saved;
      double num = (up - down) / (2 * h), ana = grad[t][e];
      EXPECT(fabs(num - ana) <= 1e-5 + 1e-3 * fabs(num),
             "%s[%zu] Nq=%d Nkv=%d d=%d causal=%d: finite difference %.9g, reference %.9g",
             names[t], e, nq, nkv, d, causal, num, ana);
    }
  for (int t = 0; t < 3; t++) free(grad[t]);
  free(c.q), free(c.k), free(c.v), free(c.g), free(c.w);
}

/* dS rows sum to 0 (softmax is shift-invariant), masked entries of dS are 0, rows that see
 * no key get dQ = 0, and with dO = 0 (loss = sum(w * LSE) only) dV is exactly 0. */
static void invariants(int nq, int nkv, int causal) {
  int d = 8;
  attn_problem p = {1, 2, nq, nkv, d, causal, 0.35f, DTYPE_FP32};
  attn_rng rng;
  attn_rng_seed(&rng, 7u + (unsigned)causal);
  size_t nqe = attn_q_elems(&p), nkve = attn_kv_elems(&p), rows = attn_lse_elems(&p);
  double *q = randn(&rng, nqe), *k = randn(&rng, nkve), *v = randn(&rng, nkve);
  double *d_o = randn(&rng, nqe), *w = randn(&rng, rows);
  double *dq = malloc(sizeof(double) * nqe), *dk = malloc(sizeof(double) * nkve);
  double *dv = malloc(sizeof(double) * nkve), *ds = malloc(sizeof(double) * rows * nkv);
  reference_backward(&p, q, k, v, d_o, NULL, dq, dk, dv, ds);
  for (size_t r = 0; r < rows; r++) {
    int i = (int)(r % (size_t)nq), visible = attn_visible_keys(&p, i);
    double sum = 0, scale_sum = 0;
    for (int j = 0; j < nkv; j++) sum += ds[r * nkv + j], scale_sum += fabs(ds[r * nkv + j]);
    EXPECT(fabs(sum) <= 1e-12 * (1 + scale_sum), "dS row %zu sums to %.3g, expected 0", r, sum);
    for (int j = visible; j < nkv; j++)
      EXPECT(ds[r * nkv + j] == 0, "dS[%zu][%d] is masked but %.3g", r, j, ds[r * nkv + j]);
    for (int c = 0; visible == 0 && c < d; c++)
      EXPECT(dq[r * d + c] == 0, "row %zu sees no key but dQ = %.3g", r, dq[r * d + c]);
  }
  for (size_t e = 0; e < nqe; e++) d_o[e] = 0;
  reference_backward(&p, q, k, v, d_o, w, dq, dk, dv, NULL);
  for (size_t e = 0; e < nkve; e++)
    EXPECT(dv[e] == 0, "LSE-only loss but dV[%zu] = %.3g", e, dv[e]);
  free(q), free(k), free(v), free(d_o), free(w), free(dq), free(dk), free(dv), free(ds);
}

int main(void) {
  const int lengths[3] = {1, 3, 5}, dims[2] = {4, 8};
  int cases = 0;
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 3; b++)
      for (int t = 0; t < 2; t++)
        for (int causal = 0; causal < 2; causal++, cases++)
          finite_differences(lengths[a], lengths[b], dims[t], causal);
  /* Nq = 5 > Nkv = 3 under the causal mask: rows 0 and 1 see no key. */
  invariants(5, 3, 1), invariants(5, 3, 0), invariants(4, 9, 1);
  printf("reference backward: %d finite-difference cases, 3 invariant cases, %d failures\n", cases,
         failures);
  return failures ? 1 : 0;
}
