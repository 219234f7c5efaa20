/* The masks of docs/conventions.md section 1 (causal, sliding window, cache lengths, varlen)
 * and the logit softcap, checked against a brute-force computation written here from the
 * definitions alone: the full matrix visible[i][j] is built by testing every (query, key) pair
 * (the sequence of a packed row found by a linear scan), never from attn_key_range, and dense
 * attention is computed over it with masked logits at -inf. The float64 reference must give
 * the same O and LSE, its dS must be 0 exactly where the matrix says masked, and the FLOP count
 * of a windowed or varlen problem must be 4 d H times the matrix's visible pairs. Exit 0 when
 * all hold. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "expect.h"
#include "reference.h"

enum { D = 3, HEADS = 2 };
/* O and LSE follow the same arithmetic in both, up to the order of a few additions. */
#define SAME_TOL 1e-12

/* The sequence whose rows [cu[s], cu[s + 1]) hold `row`, by a linear scan; -1 if none. */
static int sequence_of(const int *cu, int seqs, int row) {
  for (int s = 0; s < seqs; s++)
    if (cu[s] <= row && row < cu[s + 1]) return s;
  return -1;
}

/* Whether key j is visible to query row i of batch b, from the definition: the pair lies in
 * one sequence (varlen) and inside its keys (cache lengths), and with diag = i' + Nkv' - Nq'
 * in that sequence's own rows, j' <= diag when causal and diag - left <= j' <= diag + right
 * when windowed (a side of -1 unbounded). */
static int visible(const attn_problem *p, long b, int i, int j) {
  long nq = p->seq_q, nkv = p->cache_lens ? p->cache_lens[b] : p->seq_kv, ii = i, jj = j;
  if (p->seqs > 0) {
    int s = sequence_of(p->cu_seqlens_q, p->seqs, i);
    if (s < 0 || sequence_of(p->cu_seqlens_k, p->seqs, j) != s) return 0;
    nq = p->cu_seqlens_q[s + 1] - p->cu_seqlens_q[s];
    nkv = p->cu_seqlens_k[s + 1] - p->cu_seqlens_k[s];
    ii = i - p->cu_seqlens_q[s], jj = j - p->cu_seqlens_k[s];
  }
  if (jj >= nkv) return 0;
  long diag = ii + nkv - nq;
  if (p->causal && jj > diag) return 0;
  if (p->windowed && p->window_left >= 0 && jj < diag - p->window_left) return 0;
  if (p->windowed && p->window_right >= 0 && jj > diag + p->window_right) return 0;
  return 1;
}

static double *randn(attn_rng *rng, size_t n) {
  double *x = malloc(sizeof(double) * n);
  for (size_t i = 0; i < n; i++) x[i] = attn_rng_normal(rng);
  return x;
}

static char description[160];
static const char *describe(const attn_problem *p) {
  int used = snprintf(description, sizeof description, "Nq=%d Nkv=%d Hkv=%d causal=%d", p->seq_q,
                      p->seq_kv, attn_heads_kv(p), p->causal);
  if (p->windowed)
    used += snprintf(description + used, sizeof description - (size_t)used, " window=%d,%d",
                     p->window_left, p->window_right);
  if (p->softcap > 0)
    used += snprintf(description + used, sizeof description - (size_t)used, " softcap=%g",
                     (double)p->softcap);
  if (p->cache_lens)
    used += snprintf(description + used, sizeof description - (size_t)used, " cache lengths");
  for (int s = 0; s < p->seqs && used < (int)sizeof description; s++)
    used += snprintf(description + used, sizeof description - (size_t)used, "%s%d/%d",
                     s ? "," : " seqlens q/kv ", p->cu_seqlens_q[s + 1] - p->cu_seqlens_q[s],
                     p->cu_seqlens_k[s + 1] - p->cu_seqlens_k[s]);
  return description;
}

/* Dense attention over the brute-force mask against the reference; the reference's dS against
 * the mask; the FLOP count against the mask's pairs. */
static void compare(const attn_problem *p, unsigned seed) {
  attn_rng rng;
  attn_rng_seed(&rng, seed);
  int nq = p->seq_q, nkv = p->seq_kv, hkv = attn_heads_kv(p), group = p->heads / hkv;
  size_t nqe = attn_q_elems(p), nkve = attn_kv_elems(p), rows = attn_lse_elems(p);
  double *q = randn(&rng, nqe), *k = randn(&rng, nkve), *v = randn(&rng, nkve);
  double *d_o = randn(&rng, nqe);
  double *o = malloc(sizeof(double) * nqe), *lse = malloc(sizeof(double) * rows);
  reference_forward_rows(p, q, k, v, NULL, (long)rows, o, lse, NULL);
  double *dq = malloc(sizeof(double) * nqe), *dk = malloc(sizeof(double) * nkve);
  double *dv = malloc(sizeof(double) * nkve), *ds = malloc(sizeof(double) * rows * nkv);
  reference_backward(p, q, k, v, d_o, NULL, dq, dk, dv, ds);
  double *s = malloc(sizeof(double) * nkv);
  char *seen = calloc((size_t)p->batch * hkv * nkv, 1); /* keys some query of the group sees */
  double pairs = 0;
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    long b = bh / p->heads, kv_head = bh / group;
    const double *K = k + (size_t)kv_head * nkv * D, *V = v + (size_t)kv_head * nkv * D;
    for (int i = 0; i < nq; i++) {
      const double *q_row = q + ((size_t)bh * nq + i) * D;
      double m = -INFINITY;
      int count = 0;
      for (int j = 0; j < nkv; j++) {
        s[j] = -INFINITY;
        if (!visible(p, b, i, j)) continue;
        double dot = 0;
        for (int c = 0; c < D; c++) dot += q_row[c] * K[(size_t)j * D + c];
        s[j] = p->scale * dot;
        if (p->softcap > 0) s[j] = p->softcap * tanh(s[j] / p->softcap);
        m = fmax(m, s[j]), count++, seen[(size_t)kv_head * nkv + j] = 1;
      }
      pairs += count;
      double l = 0, want_o[D] = {0};
      for (int j = 0; count > 0 && j < nkv; j++) l += exp(s[j] - m); /* exp(-inf) = 0 */
      for (int j = 0; count > 0 && j < nkv; j++)
        for (int c = 0; c < D; c++) want_o[c] += exp(s[j] - m) / l * V[(size_t)j * D + c];
      double want_lse = count > 0 ? m + log(l) : -INFINITY, got_lse = lse[bh * nq + i];
      EXPECT(count > 0 ? fabs(got_lse - want_lse) <= SAME_TOL * (1 + fabs(want_lse))
                       : isinf(got_lse) && got_lse < 0,
             "%s: b=%ld h=%ld i=%d: LSE %.17g, brute force %.17g", describe(p), b, bh % p->heads, i,
             got_lse, want_lse);
      const double *ds_row = ds + ((size_t)bh * nq + i) * nkv;
      double ds_sum = 0, ds_abs = 0;
      for (int c = 0; c < D; c++) {
        double got = o[((size_t)bh * nq + i) * D + c];
        EXPECT(fabs(got - want_o[c]) <= SAME_TOL * (1 + fabs(want_o[c])),
               "%s: b=%ld h=%ld i=%d: O[%d] %.17g, brute force %.17g", describe(p), b,
               bh % p->heads, i, c, got, want_o[c]);
        EXPECT(count > 0 || dq[((size_t)bh * nq + i) * D + c] == 0,
               "%s: row %d sees no key but dQ[%d] = %.3g", describe(p), i, c,
               dq[((size_t)bh * nq + i) * D + c]);
      }
      for (int j = 0; j < nkv; j++) {
        EXPECT(visible(p, b, i, j) || ds_row[j] == 0, "%s: b=%ld i=%d j=%d masked but dS = %.3g",
               describe(p), b, i, j, ds_row[j]);
        ds_sum += ds_row[j], ds_abs += fabs(ds_row[j]);
      }
      EXPECT(fabs(ds_sum) <= 1e-12 * (1 + ds_abs), "%s: dS row %d sums to %.3g, expected 0",
             describe(p), i, ds_sum);
    }
  }
  /* A key no query of its group sees gets no gradient at all. */
  for (size_t e = 0; e < nkve; e++)
    EXPECT(seen[e / D] || (dk[e] == 0 && dv[e] == 0),
           "%s: K/V row %zu seen by no query but dK "
           "%.3g, dV %.3g",
           describe(p), e / D, dk[e], dv[e]);
  if (p->windowed || p->seqs > 0) {
    double want = 4.0 * D * pairs;
    EXPECT(attn_forward_flops(p) == want,
           "%s: forward FLOPs %.17g, 4 d x %.0f visible pairs = "
           "%.17g",
           describe(p), attn_forward_flops(p), pairs, want);
  }
  free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
  free(ds), free(s), free(seen);
}

int main(void) {
  const int lengths[4] = {1, 2, 3, 5}, sides[4] = {-1, 0, 1, 3};
  const float caps[2] = {0, 0.8f};
  unsigned seed = 1;
  int cases = 0;
  /* Every small shape, both masks, every window of sides in {-1, 0, 1, 3} and none, softcap or
   * not; Nq > Nkv gives rows that see no key under the causal mask and narrow windows. */
  for (int a = 0; a < 4; a++)
    for (int c = 0; c < 4; c++)
      for (int causal = 0; causal < 2; causal++)
        for (int w = -1; w < 16; w++)
          for (int cap = 0; cap < 2; cap++, cases++) {
            attn_problem p = {.batch = 1,
                              .heads = HEADS,
                              .seq_q = lengths[a],
                              .seq_kv = lengths[c],
                              .head_dim = D,
                              .causal = causal,
                              .scale = 0.7f,
                              .dtype = DTYPE_FP32,
                              .heads_kv = HEADS,
                              .softcap = caps[cap]};
            if (w >= 0) p.windowed = 1, p.window_left = sides[w / 4], p.window_right = sides[w % 4];
            compare(&p, seed++);
          }
  /* Windows against cache lengths (the library's decode problems may carry both): full, short
   * and empty caches, grouped-query heads. */
  const int lens[3] = {5, 2, 0};
  for (int causal = 0; causal < 2; causal++)
    for (int w = 0; w < 16; w++, cases++) {
      attn_problem p = {.batch = 3,
                        .heads = HEADS,
                        .seq_q = 3,
                        .seq_kv = 5,
                        .head_dim = D,
                        .causal = causal,
                        .scale = 0.7f,
                        .dtype = DTYPE_FP32,
                        .heads_kv = 1,
                        .cache_lens = lens,
                        .windowed = 1,
                        .window_left = sides[w / 4],
                        .window_right = sides[w % 4]};
      compare(&p, seed++);
    }
  /* Varlen: random packings of 1 to 5 sequences of 0 to 4 rows each side, with random masks,
   * windows, softcaps and K/V heads. */
  attn_rng rng;
  attn_rng_seed(&rng, 2024);
  for (int t = 0; t < 400; t++, cases++) {
    enum { MAX_SEQS = 5, MAX_LEN = 5 };
    int cu_q[MAX_SEQS + 1] = {0}, cu_k[MAX_SEQS + 1] = {0};
    int seqs = 1 + (int)(attn_rng_uniform(&rng) * MAX_SEQS), longest_q = 0, longest_k = 0;
    for (int s = 0; s < seqs; s++) {
      int lq = (int)(attn_rng_uniform(&rng) * MAX_LEN),
          lk = (int)(attn_rng_uniform(&rng) * MAX_LEN);
      cu_q[s + 1] = cu_q[s] + lq, cu_k[s + 1] = cu_k[s] + lk;
      longest_q = lq > longest_q ? lq : longest_q, longest_k = lk > longest_k ? lk : longest_k;
    }
    if (cu_q[seqs] == 0 || cu_k[seqs] == 0) { /* the harness refuses empty totals */
      t--, cases--;
      continue;
    }
    /* Drawn one by one: an initialiser list's expressions come in no fixed order. */
    int w = (int)(attn_rng_uniform(&rng) * 17) - 1, causal = attn_rng_uniform(&rng) < 0.5;
    int heads_kv = attn_rng_uniform(&rng) < 0.5 ? 1 : HEADS, cap = attn_rng_uniform(&rng) < 0.5;
    attn_problem p = {.batch = 1,
                      .heads = HEADS,
                      .seq_q = cu_q[seqs],
                      .seq_kv = cu_k[seqs],
                      .head_dim = D,
                      .causal = causal,
                      .scale = 0.7f,
                      .dtype = DTYPE_FP32,
                      .heads_kv = heads_kv,
                      .softcap = caps[cap],
                      .seqs = seqs,
                      .max_seqlen_q = longest_q,
                      .max_seqlen_k = longest_k,
                      .cu_seqlens_q = cu_q,
                      .cu_seqlens_k = cu_k};
    if (w >= 0) p.windowed = 1, p.window_left = sides[w / 4], p.window_right = sides[w % 4];
    compare(&p, seed++);
  }
  printf("masks: %d cases against brute force, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
