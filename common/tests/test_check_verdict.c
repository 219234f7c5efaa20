/* The fp32 check against wrong answers (docs/conventions.md section 3):
 *  - O halved is a mismatch at every input scale from 1 to 1e9: the tolerance follows the
 *    answer, it does not outgrow it, while the reference's own O (rounded to fp32) passes;
 *  - a gradient with one NaN fails, and the verdict names the tensor and the reason
 *    ("dK: 1 non-finite value"), as does one moved past its tolerance ("dQ: max err ..."),
 *    so that a failing result line never shows only figures that would pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "check.h"
#include "reference.h"

static int failures = 0;

static void expect(int cond, const char *what, double x) {
  if (cond) return;
  failures++;
  fprintf(stderr, "FAIL: %s (input scale %g; verdict '%s')\n", what, x, attn_check_verdict());
}

static float *narrow(const double *x, size_t n) {
  float *y = attn_host_alloc(n * sizeof(float), "test output");
  for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
  return y;
}

static double *widen(const float *x, size_t n) {
  double *y = attn_host_alloc(n * sizeof(double), "test input");
  for (size_t i = 0; i < n; i++) y[i] = x[i];
  return y;
}

int main(void) {
  const double scales[] = {1, 10, 100, 300, 1e3, 1e4, 1e6, 1e9};
  for (size_t s = 0; s < sizeof scales / sizeof *scales; s++) {
    double x = scales[s];
    attn_problem p = {.batch = 1,
                      .heads = 2,
                      .seq_q = 37,
                      .seq_kv = 53,
                      .head_dim = 16,
                      .scale = 0.25f,
                      .dtype = DTYPE_FP32,
                      .heads_kv = 2};
    size_t nq = attn_q_elems(&p), nkv = attn_kv_elems(&p), nl = attn_lse_elems(&p);
    attn_rng rng;
    attn_rng_seed(&rng, 11);
    float *in[4];
    size_t counts[4] = {nq, nkv, nkv, nq};
    for (int t = 0; t < 4; t++) {
      in[t] = attn_host_alloc(counts[t] * sizeof(float), "test input");
      for (size_t i = 0; i < counts[t]; i++)
        in[t][i] = (float)((t < 3 ? x : 1.0) * attn_rng_normal(&rng));
    }
    double *q = widen(in[0], nq), *k = widen(in[1], nkv), *v = widen(in[2], nkv);
    double *d_o = widen(in[3], nq);
    double *o_ref = attn_host_alloc(nq * sizeof(double), "O"),
           *l_ref = attn_host_alloc(nl * 8, "L");
    reference_forward_rows(&p, q, k, v, NULL, (long)nl, o_ref, l_ref, NULL);
    float *o = narrow(o_ref, nq), *lse = narrow(l_ref, nl);
    attn_check_inputs ci = {&p, in[0], in[1], in[2], in[3], 11, 1};
    double err, tol;
    int ok;
    attn_check_forward(&ci, o, lse, 0, 0, &err, &tol, &ok);
    expect(ok && !attn_check_verdict()[0], "forward: the reference's own O passes", x);
    for (size_t i = 0; i < nq; i++) o[i] *= 0.5f;
    attn_check_forward(&ci, o, lse, 0, 0, &err, &tol, &ok);
    expect(!ok && strncmp(attn_check_verdict(), "O: max err", 10) == 0,
           "forward: O halved is a mismatch", x);
    expect(!(err <= tol), "forward: a failing check's figures fail too", x);

    if (x <= 10) { /* the fp32 backward rule resolves gradients of moderate logits only */
      double *g_ref[3] = {attn_host_alloc(nq * 8, "dQ"), attn_host_alloc(nkv * 8, "dK"),
                          attn_host_alloc(nkv * 8, "dV")};
      reference_backward(&p, q, k, v, d_o, NULL, g_ref[0], g_ref[1], g_ref[2], NULL);
      float *g[3] = {narrow(g_ref[0], nq), narrow(g_ref[1], nkv), narrow(g_ref[2], nkv)};
      attn_check_backward(&ci, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
      expect(ok && !attn_check_verdict()[0], "backward: the reference's own gradients pass", x);
      g[1][7] = NAN;
      attn_check_backward(&ci, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
      expect(!ok && strcmp(attn_check_verdict(), "dK: 1 non-finite value") == 0,
             "backward: one NaN in dK is named", x);
      g[1][7] = (float)g_ref[1][7];
      g[2][3] = INFINITY, g[2][4] = NAN;
      attn_check_backward(&ci, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
      expect(!ok && strcmp(attn_check_verdict(), "dV: 2 non-finite values") == 0,
             "backward: two non-finite values in dV are named", x);
      g[2][3] = (float)g_ref[2][3], g[2][4] = (float)g_ref[2][4];
      g[0][5] += 1e4f; /* past any of the three tolerances at these scales */
      attn_check_backward(&ci, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
      expect(!ok && strncmp(attn_check_verdict(), "dQ: max err", 11) == 0,
             "backward: dQ moved past its tolerance is named", x);
      expect(!(err <= tol), "backward: a failing check's figures fail too", x);
      for (int w = 0; w < 3; w++) free(g[w]), free(g_ref[w]);
    }
    for (int t = 0; t < 4; t++) free(in[t]);
    free(q), free(k), free(v), free(d_o), free(o_ref), free(l_ref), free(o), free(lse);
  }
  printf("the check against wrong answers: %d failures\n", failures);
  return failures ? 1 : 0;
}
