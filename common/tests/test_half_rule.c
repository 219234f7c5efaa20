/* The half-precision tolerance rule (docs/conventions.md section 3) accepts what it should and
 * rejects what it should: the baseline's own outputs pass; the same outputs with one element
 * moved by twice the tolerance, or one NaN, fail. fp16 and bf16, causal and not, forward
 * and backward, on a shape with a fully masked row (Nq > Nkv, causal), with as many K/V heads
 * as query heads and with one K/V head for both (grouped-query attention). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "attention.h"
#include "baseline.h"
#include "check.h"

static int failures = 0;

static void expect(int got_ok, int want_ok, const char *what, attn_dtype t, int causal) {
  if (got_ok == want_ok) return;
  failures++;
  fprintf(stderr, "FAIL: %s (%s, %s): the check said %s\n", what, attn_dtype_name(t),
          causal ? "causal" : "non-causal", got_ok ? "ok" : "failed");
}

static float *random_rounded(attn_rng *rng, size_t n, attn_dtype t) {
  float *x = attn_host_alloc(n * sizeof(float), "test input");
  for (size_t i = 0; i < n; i++) x[i] = attn_round_to_dtype((float)attn_rng_normal(rng), t);
  return x;
}

int main(void) {
  for (int t = DTYPE_FP16; t <= DTYPE_BF16; t++)
    for (int causal = 0; causal <= 1; causal++)
      for (int heads_kv = 2; heads_kv >= 1; heads_kv--) {
        attn_problem p = {.batch = 1,
                          .heads = 2,
                          .seq_q = 41,
                          .seq_kv = 29,
                          .head_dim = 16,
                          .causal = causal,
                          .scale = 0.25f,
                          .dtype = (attn_dtype)t,
                          .heads_kv = heads_kv};
        attn_rng rng;
        attn_rng_seed(&rng, 7);
        size_t nq = attn_q_elems(&p), nkv = attn_kv_elems(&p), nl = attn_lse_elems(&p);
        float *q = random_rounded(&rng, nq, p.dtype), *k = random_rounded(&rng, nkv, p.dtype);
        float *v = random_rounded(&rng, nkv, p.dtype), *d_o = random_rounded(&rng, nq, p.dtype);
        attn_check_inputs in = {&p, q, k, v, d_o, 7, 1};
        float *o = attn_host_alloc(nq * sizeof(float), "O"), *lse = attn_host_alloc(nl * 4, "LSE");
        baseline_forward_rows(&p, q, k, v, NULL, (long)nl, o, lse);
        double err, tol;
        int ok;
        attn_check_forward(&in, o, lse, 0, 0, &err, &tol, &ok);
        expect(ok, 1, "forward: the baseline itself", p.dtype, causal);
        size_t e = nq - 3; /* a row that sees keys in both masks */
        float saved = o[e];
        o[e] += (float)(2 * tol);
        attn_check_forward(&in, o, lse, 0, 0, &err, &tol, &ok);
        expect(ok, 0, "forward: one element moved by 2 x tol", p.dtype, causal);
        o[e] = NAN;
        attn_check_forward(&in, o, lse, 0, 0, &err, &tol, &ok);
        expect(ok, 0, "forward: one NaN", p.dtype, causal);
        o[e] = saved;

        float *g[3] = {attn_host_alloc(nq * 4, "dQ"), attn_host_alloc(nkv * 4, "dK"),
                       attn_host_alloc(nkv * 4, "dV")};
        baseline_backward(&p, q, k, v, d_o, g[0], g[1], g[2]);
        attn_check_backward(&in, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
        expect(ok, 1, "backward: the baseline itself", p.dtype, causal);
        for (int which = 0; which < 3; which++) {
          float keep = g[which][5];
          g[which][5] += (float)(2 * tol + 1e-2); /* beyond the worst gradient's tolerance */
          attn_check_backward(&in, o, lse, g[0], g[1], g[2], &err, &tol, &ok);
          expect(ok, 0, "backward: one gradient element moved", p.dtype, causal);
          g[which][5] = keep;
        }
        free(q), free(k), free(v), free(d_o), free(o), free(lse);
        for (int w = 0; w < 3; w++) free(g[w]);
      }
  printf("half-precision rule: %d failures\n", failures);
  return failures ? 1 : 0;
}
