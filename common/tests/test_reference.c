/* The float64 reference backward, checked against central finite differences of its own
 * forward (docs/conventions.md section 3), also under grouped-query attention (where dK and dV
 * sum over a group's query heads), with cache lengths, with the softcap, sliding windows and
 * varlen; the invariants of dS; and the forward with cache lengths against the same problem
 * whose cache holds exactly L_b keys. (test_masks.c checks the masks themselves.)
 * Exit 0 when all hold. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "attention.h"
#include "expect.h"
#include "reference.h"

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

/* The reference backward of problem p against central finite differences of its forward;
 * `what` names the case in a failure. */
static void check_gradients(const attn_problem *p, unsigned seed, const char *what) {
  fd_case c = {.p = *p};
  attn_rng rng;
  attn_rng_seed(&rng, seed);
  size_t nqe = attn_q_elems(p), nkve = attn_kv_elems(p), rows = attn_lse_elems(p);
  c.q = randn(&rng, nqe), c.k = randn(&rng, nkve), c.v = randn(&rng, nkve);
  c.g = randn(&rng, nqe), c.w = randn(&rng, rows);
  for (size_t r = 0; r < rows; r++) {
    int lo, hi;
    attn_key_range(p, (long)(r / ((size_t)p->heads * p->seq_q)), (int)(r % (size_t)p->seq_q), &lo,
                   &hi);
    if (lo == hi) c.w[r] = 0;
  }
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
             "%s[%zu] B=%d H=%d Hkv=%d Nq=%d Nkv=%d d=%d causal=%d%s: finite difference %.9g, "
             "reference %.9g",
             names[t], e, p->batch, p->heads, attn_heads_kv(p), p->seq_q, p->seq_kv, p->head_dim,
             p->causal, what, num, ana);
    }
  for (int t = 0; t < 3; t++) free(grad[t]);
  free(c.q), free(c.k), free(c.v), free(c.g), free(c.w);
}

/* B sequences of H query heads and Hkv K/V heads; cache_lens: NULL or B lengths. */
static void finite_differences(int nq, int nkv, int d, int causal, int batch, int heads,
                               int heads_kv, const int *cache_lens) {
  attn_problem p = {.batch = batch,
                    .heads = heads,
                    .seq_q = nq,
                    .seq_kv = nkv,
                    .head_dim = d,
                    .causal = causal,
                    .scale = (float)(1 / sqrt((double)d)),
                    .dtype = DTYPE_FP32,
                    .heads_kv = heads_kv,
                    .cache_lens = cache_lens};
  check_gradients(&p, 1000u * nq + 100u * nkv + 10u * d + causal + 7919u * (heads / heads_kv - 1),
                  cache_lens ? " (cache lengths)" : "");
}

/* The softcap: dQ and dK carry 1 - tanh^2 of the capped logit. c = 0.5 saturates unit-sized
 * logits (scale 1: q . k of about +-2 at d = 4), c = 5 barely bends them; under both masks,
 * Nq > Nkv giving rows that see no key, and grouped-query heads. */
static int softcap_cases(void) {
  const float caps[2] = {0.5f, 5.f};
  int cases = 0;
  for (int c = 0; c < 2; c++)
    for (int causal = 0; causal < 2; causal++)
      for (int shape = 0; shape < 3; shape++, cases++) {
        const int nq[3] = {3, 5, 4}, nkv[3] = {5, 3, 4}, heads_kv[3] = {2, 2, 1};
        attn_problem p = {.batch = 1 + (shape == 2),
                          .heads = 2,
                          .seq_q = nq[shape],
                          .seq_kv = nkv[shape],
                          .head_dim = 4,
                          .causal = causal,
                          .scale = 1.f,
                          .dtype = DTYPE_FP32,
                          .heads_kv = heads_kv[shape],
                          .softcap = caps[c]};
        char what[48];
        snprintf(what, sizeof what, " softcap=%g", (double)caps[c]);
        check_gradients(&p, 31u * (unsigned)cases + 5, what);
      }
  return cases;
}

/* Sliding windows, causal and not, each side bounded or not, on Nq < Nkv, Nq > Nkv and Nq = Nkv.
 * Windows (0, 0) and (1, 0) on Nq = 5 > Nkv = 3 leave rows 0 and 1 seeing no key (their diag
 * is below key 0), and (0, 0) is one key a row: a softmax of one. One case adds a softcap. */
static int window_cases(void) {
  const int windows[7][2] = {{1, 0}, {0, 1}, {2, -1}, {-1, 1}, {0, 0}, {1, 2}, {-1, -1}};
  const int nq[3] = {3, 5, 4}, nkv[3] = {5, 3, 4};
  int cases = 0;
  for (int w = 0; w < 7; w++)
    for (int causal = 0; causal < 2; causal++)
      for (int shape = 0; shape < 3; shape++, cases++) {
        attn_problem p = {.batch = 1,
                          .heads = 2,
                          .seq_q = nq[shape],
                          .seq_kv = nkv[shape],
                          .head_dim = 4,
                          .causal = causal,
                          .scale = 0.5f,
                          .dtype = DTYPE_FP32,
                          .heads_kv = 2,
                          .windowed = 1,
                          .window_left = windows[w][0],
                          .window_right = windows[w][1]};
        if (w == 5 && shape == 0) p.softcap = 0.5f;
        char what[48];
        snprintf(what, sizeof what, " window=%d,%d%s", windows[w][0], windows[w][1],
                 p.softcap > 0 ? " softcap=0.5" : "");
        check_gradients(&p, 97u * (unsigned)cases + 3, what);
      }
  return cases;
}

/* Varlen: four packed sequences of (queries, keys) (2, 3), (0, 2) (keys no query sees: no
 * gradient), (1, 1) (one token) and (3, 0) (queries that see nothing), and the same with equal
 * lengths (3, 0, 1, 2); causal and not, with a window and a softcap and without, on two K/V
 * heads and on one. */
static int varlen_cases(void) {
  const int cu[2][2][5] = {{{0, 2, 2, 3, 6}, {0, 3, 5, 6, 6}}, {{0, 3, 3, 4, 6}, {0, 3, 3, 4, 6}}};
  int cases = 0;
  for (int set = 0; set < 2; set++)
    for (int causal = 0; causal < 2; causal++)
      for (int extra = 0; extra < 3; extra++, cases++) {
        attn_problem p = {.batch = 1,
                          .heads = 2,
                          .seq_q = cu[set][0][4],
                          .seq_kv = cu[set][1][4],
                          .head_dim = 4,
                          .causal = causal,
                          .scale = 0.8f,
                          .dtype = DTYPE_FP32,
                          .heads_kv = extra == 2 ? 1 : 2,
                          .seqs = 4,
                          .max_seqlen_q = 3,
                          .max_seqlen_k = 3,
                          .cu_seqlens_q = cu[set][0],
                          .cu_seqlens_k = cu[set][1]};
        if (extra == 1) p.windowed = 1, p.window_left = 1, p.window_right = 0, p.softcap = 0.5f;
        const char *what[3] = {" (varlen)", " (varlen, window 1,0, softcap 0.5)", " (varlen)"};
        check_gradients(&p, 53u * (unsigned)cases + 17, what[extra]);
      }
  return cases;
}

/* dS rows sum to 0 (softmax is shift-invariant), masked entries of dS are 0, rows that see
 * no key get dQ = 0, and with dO = 0 (loss = sum(w * LSE) only) dV is exactly 0. */
static void invariants(int nq, int nkv, int causal) {
  int d = 8;
  attn_problem p = {.batch = 1,
                    .heads = 2,
                    .seq_q = nq,
                    .seq_kv = nkv,
                    .head_dim = d,
                    .causal = causal,
                    .scale = 0.35f,
                    .dtype = DTYPE_FP32,
                    .heads_kv = 2};
  attn_rng rng;
  attn_rng_seed(&rng, 7u + (unsigned)causal);
  size_t nqe = attn_q_elems(&p), nkve = attn_kv_elems(&p), rows = attn_lse_elems(&p);
  double *q = randn(&rng, nqe), *k = randn(&rng, nkve), *v = randn(&rng, nkve);
  double *d_o = randn(&rng, nqe), *w = randn(&rng, rows);
  double *dq = malloc(sizeof(double) * nqe), *dk = malloc(sizeof(double) * nkve);
  double *dv = malloc(sizeof(double) * nkve), *ds = malloc(sizeof(double) * rows * nkv);
  reference_backward(&p, q, k, v, d_o, NULL, dq, dk, dv, ds);
  for (size_t r = 0; r < rows; r++) {
    int i = (int)(r % (size_t)nq), visible, lo;
    attn_key_range(&p, 0, i, &lo, &visible); /* lo = 0: no window, no varlen */
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

/* With cache lengths, sequence b's rows equal those of the same problem whose cache holds
 * exactly L_b keys; the keys past L_b are NaN, so one read into a result shows. */
static void cache_lengths(int causal) {
  enum { B = 3, H = 4, HKV = 2, NQ = 3, NKV = 7, D = 8 };
  const int lens[B] = {7, 2, 0}; /* full, shorter than Nq (causal: rows that see no key), empty */
  attn_problem p = {.batch = B,
                    .heads = H,
                    .seq_q = NQ,
                    .seq_kv = NKV,
                    .head_dim = D,
                    .causal = causal,
                    .scale = 0.3f,
                    .dtype = DTYPE_FP32,
                    .heads_kv = HKV,
                    .cache_lens = lens};
  attn_rng rng;
  attn_rng_seed(&rng, 11u + (unsigned)causal);
  size_t nqe = attn_q_elems(&p), nkve = attn_kv_elems(&p), rows = attn_lse_elems(&p);
  double *q = randn(&rng, nqe), *k = randn(&rng, nkve), *v = randn(&rng, nkve);
  for (long bh = 0; bh < B * HKV; bh++)
    for (size_t e = (size_t)lens[bh / HKV] * D; e < (size_t)NKV * D; e++)
      k[bh * NKV * D + e] = v[bh * NKV * D + e] = NAN;
  double *o = malloc(sizeof(double) * nqe), *lse = malloc(sizeof(double) * rows);
  reference_forward_rows(&p, q, k, v, NULL, (long)rows, o, lse, NULL);
  for (int b = 0; b < B; b++) {
    /* Sequence b alone, its cache cut to L_b keys (an empty cache: one key no row sees). */
    int len = lens[b] > 0 ? lens[b] : 1;
    attn_problem one = {.batch = 1,
                        .heads = H,
                        .seq_q = NQ,
                        .seq_kv = len,
                        .head_dim = D,
                        .causal = causal,
                        .scale = 0.3f,
                        .dtype = DTYPE_FP32,
                        .heads_kv = HKV};
    int none = 0, *one_lens = lens[b] > 0 ? NULL : &none;
    one.cache_lens = one_lens;
    double *k1 = malloc(sizeof(double) * HKV * len * D),
           *v1 = malloc(sizeof(double) * HKV * len * D);
    for (int hk = 0; hk < HKV; hk++)
      for (int e = 0; e < len * D; e++) {
        k1[hk * len * D + e] = lens[b] > 0 ? k[((size_t)b * HKV + hk) * NKV * D + e] : 0;
        v1[hk * len * D + e] = lens[b] > 0 ? v[((size_t)b * HKV + hk) * NKV * D + e] : 0;
      }
    double o1[H * NQ * D], lse1[H * NQ];
    reference_forward_rows(&one, q + (size_t)b * H * NQ * D, k1, v1, NULL, H * NQ, o1, lse1, NULL);
    for (int r = 0; r < H * NQ; r++) {
      double want = lse1[r], got = lse[(size_t)b * H * NQ + r];
      EXPECT(got == want || (isinf(got) && isinf(want) && got < 0 && want < 0),
             "cache lengths, causal=%d: sequence %d row %d LSE %.9g, alone %.9g", causal, b, r, got,
             want);
      for (int c = 0; c < D; c++)
        EXPECT(o[((size_t)b * H * NQ + r) * D + c] == o1[r * D + c],
               "cache lengths, causal=%d: sequence %d row %d O[%d] %.9g, alone %.9g", causal, b, r,
               c, o[((size_t)b * H * NQ + r) * D + c], o1[r * D + c]);
    }
    free(k1), free(v1);
  }
  free(q), free(k), free(v), free(o), free(lse);
}

int main(void) {
  const int lengths[3] = {1, 3, 5}, dims[2] = {4, 8};
  int cases = 0;
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 3; b++)
      for (int t = 0; t < 2; t++)
        for (int causal = 0; causal < 2; causal++, cases++)
          finite_differences(lengths[a], lengths[b], dims[t], causal, 1, 2, 2, NULL);
  /* Grouped-query attention: 4 query heads on 2 K/V heads and on 1 (MQA). dK and dV are sums
   * over each group's query heads; a reference that kept one head's share, or overwrote
   * instead of adding, fails here. Nq > Nkv under the causal mask gives rows that see no key. */
  for (int heads_kv = 2; heads_kv >= 1; heads_kv--)
    for (int causal = 0; causal < 2; causal++, cases += 2) {
      finite_differences(3, 5, 4, causal, 1, 4, heads_kv, NULL);
      finite_differences(5, 3, 4, causal, 2, 4, heads_kv, NULL);
    }
  /* Cache lengths: keys past L_b get no gradient and move no output. */
  const int lens[2] = {2, 5};
  for (int causal = 0; causal < 2; causal++, cases++)
    finite_differences(3, 5, 4, causal, 2, 2, 1, lens);
  int added = softcap_cases();
  added += window_cases();
  added += varlen_cases();
  cases += added;
  /* Nq = 5 > Nkv = 3 under the causal mask: rows 0 and 1 see no key. */
  invariants(5, 3, 1), invariants(5, 3, 0), invariants(4, 9, 1);
  cache_lengths(0), cache_lengths(1);
  printf(
      "reference backward: %d finite-difference cases (%d with softcap, window or varlen), 3 "
      "invariant cases, 2 cache-length cases, %d failures\n",
      cases, added, failures);
  return failures ? 1 : 0;
}
