/* The comparisons. Every one is written !(err <= tol), so that a NaN fails. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "baseline.h"
#include "check.h"
#include "reference.h"

/* Above this many multiply-adds the reference checks a sample of rows, not every row
 * (about 2 s in double on one core). The tests stay under it: they check every row. */
#define FULL_CHECK_MAX_MACS 2147483648.0
/* The least number of rows a sampled check compares (docs/conventions.md section 3). */
enum { MIN_SAMPLED_ROWS = 256 };
/* XORed into the seed for the row sample: a stream of its own, apart from the inputs'. */
#define ROW_SAMPLE_STREAM 0x726f7773u /* "rows" */

typedef struct {
  double err;
  long worst; /* element index, -1 if none */
  double got, want;
} max_error;

static void track(max_error *m, long idx, double got, double want) {
  double e = fabs(got - want);
  if (isnan(m->err)) return; /* a NaN stays the verdict */
  if (!(e <= m->err)) m->err = e, m->worst = idx, m->got = got, m->want = want;
}

static double *widen(const float *x, size_t n) {
  double *y = attn_host_alloc(n * sizeof(double), "reference inputs");
  for (size_t i = 0; i < n; i++) y[i] = x[i];
  return y;
}

/* ---- the half-precision rule (docs/conventions.md section 3) ---------------------------------
 * A half-precision output cannot be compared with the float64 reference at fp32 accuracy:
 * rounding P or dS to 8 or 11 bits costs more than any kernel bug worth catching. So the
 * stage's error may be at most `m` times the error of the plain same-precision baseline
 * (common/baseline.c) on the same rounded inputs, plus a floor for outputs whose baseline
 * happens to be exact (twice the worst error of one round trip through x + 0.3 in the
 * dtype); O also has a hard cap, so that a broken baseline cannot excuse a broken stage. */
enum { M_OUTPUT = 2, M_DKDV = 3, M_DQ = 4 };
/* The hard cap on O, per unit of max(1, max|V|): O is a weighted mean of V rows, so it reaches
 * max|V| (O = V_0 at Nkv = 1) and its own rounding grows with it; at |O| = 4 rounding to bf16
 * alone costs up to 0.016, so a cap fixed at 2e-2 would leave a correct bf16 stage no room on
 * unit-normal inputs, whose max|V| is about 4-5. */
#define O_CAP_FP16 4e-3
#define O_CAP_BF16 2e-2
/* The fp32 rule's base for LSE, which every stage computes in fp32. */
#define LSE_REL_FP32 2e-6

static double rounding_floor(const double *ref, size_t n, attn_dtype t) {
  double worst = 0;
  for (size_t e = 0; e < n; e++) {
    float x = attn_round_to_dtype((float)ref[e], t);
    float y = attn_round_to_dtype(attn_round_to_dtype(x + 0.3f, t) - 0.3f, t);
    worst = fmax(worst, fabs((double)y - x));
  }
  return 2 * worst;
}

static double max_error_of(const float *got, const double *want, size_t n) {
  double worst = 0;
  for (size_t e = 0; e < n; e++) worst = fmax(worst, fabs(got[e] - want[e]));
  return worst;
}

/* max|V| over the keys a stage may read: rows past a sequence's cache length never reach a
 * result, so they do not scale the tolerance. */
static double max_abs_kv(const attn_problem *p, const float *x) {
  double m = 0;
  size_t d = (size_t)p->head_dim;
  for (long bh = 0; bh < (long)p->batch * attn_heads_kv(p); bh++) {
    size_t n = (size_t)attn_cache_len(p, bh / attn_heads_kv(p)) * d;
    const float *head = x + (size_t)bh * p->seq_kv * d;
    for (size_t e = 0; e < n; e++) m = fabs(head[e]) > m ? fabs(head[e]) : m;
  }
  return m;
}

/* Why this thread's last check failed, for the result line: the first failure found, named by
 * its tensor ("dK: 12 non-finite values", "dQ: max err 2.1e-03 > tol 6.4e-04"), so that a line
 * whose overall figures would pass still says what failed. */
static _Thread_local char verdict[160];
const char *attn_check_verdict(void) { return verdict; }

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static void
set_verdict(const char *fmt, ...) {
  if (verdict[0]) return; /* the first failure is the one the line names */
  va_list args;
  va_start(args, fmt);
  vsnprintf(verdict, sizeof verdict, fmt, args);
  va_end(args);
}

/* Prints where the worst element of a [B,heads,N,d] (d = 1 for LSE) tensor is. */
static void report(const char *what, const max_error *m, double tol, int heads, int rows, int d) {
  long r = m->worst / d, c = m->worst % d;
  long bh = r / rows, i = r % rows;
  fprintf(stderr,
          "%s: %s: mismatch: max |error| %.3e > tol %.3e at b=%ld h=%ld i=%ld c=%ld: got %.9g, "
          "reference %.9g%s\n",
          attn_program_name, what, m->err, tol, bh / heads, bh % heads, i, c, m->got, m->want,
          attn_failure_note);
  set_verdict("%s: max err %.1e > tol %.1e", what, m->err, tol);
}

/* Every element finite; prints the first that is not and how many are not. */
static int all_finite(const char *what, const float *x, size_t n, int d) {
  size_t bad = 0, first = 0;
  for (size_t e = 0; e < n; e++)
    if (!isfinite(x[e]) && bad++ == 0) first = e;
  if (bad == 0) return 1;
  fprintf(stderr,
          "%s: %s: mismatch: %zu non-finite value%s, the first element %zu (row %zu) %g%s\n",
          attn_program_name, what, bad, bad == 1 ? "" : "s", first, first / (size_t)d, x[first],
          attn_failure_note);
  set_verdict("%s: %zu non-finite value%s", what, bad, bad == 1 ? "" : "s");
  return 0;
}

static int lse_well_formed(const attn_check_inputs *in, const float *lse) {
  const attn_problem *p = in->p;
  for (size_t r = 0; r < attn_lse_elems(p); r++) {
    int i = (int)(r % (size_t)p->seq_q), lo, hi;
    attn_key_range(p, (long)(r / ((size_t)p->heads * p->seq_q)), i, &lo, &hi);
    int empty = lo == hi;
    int fine = empty ? (isinf(lse[r]) && lse[r] < 0) : isfinite(lse[r]);
    if (fine) continue;
    fprintf(stderr, "%s: LSE: mismatch: row %zu is %g, expected %s%s\n", attn_program_name, r,
            lse[r], empty ? "-inf (the row sees no key)" : "a finite value", attn_failure_note);
    set_verdict("LSE: row %zu is %g, expected %s", r, lse[r], empty ? "-inf" : "a finite value");
    return 0;
  }
  return 1;
}

/* The multiply-adds of one of the forward's two products: B H Nq Nkv d, or with a window or
 * varlen d times the visible pairs, which can be orders of magnitude fewer (a packed batch of
 * short sequences), so that such a problem is sampled and refused by its real size. */
static double product_macs(const attn_problem *p) {
  if (p->windowed || p->seqs > 0) return attn_forward_flops(p) / 4; /* 2 products of 2 flops */
  return (double)p->batch * p->heads * p->seq_q * p->seq_kv * p->head_dim;
}

/* The rows to check: all of them, or, on a large problem, a random sample spread over every
 * (batch, head) pair, at least MIN_SAMPLED_ROWS in all: each pair's rows cut into per_head
 * equal runs and one row drawn from each, uniformly (the first run gives row 0 and the last
 * the last row, where a tile's edge and the causal diagonal's end lie). Random, not evenly
 * spaced: even spacing meets the same few row positions within a tile on every run, random
 * rows reach any position over seeds; drawn from the run's seed, so a failing sample repeats. */
static long *choose_rows(const attn_problem *p, uint64_t seed, long *n_rows) {
  long heads = (long)p->batch * p->heads, nq = p->seq_q;
  long per_head = nq;
  if (product_macs(p) > FULL_CHECK_MAX_MACS) {
    per_head = (MIN_SAMPLED_ROWS + heads - 1) / heads;
    if (per_head < 2) per_head = 2;
    if (per_head > nq) per_head = nq;
  }
  attn_rng rng;
  attn_rng_seed(&rng, seed ^ ROW_SAMPLE_STREAM);
  long *rows = attn_host_alloc(sizeof(long) * (size_t)(heads * per_head), "row list");
  for (long bh = 0; bh < heads; bh++)
    for (long t = 0; t < per_head; t++) {
      long begin = t * nq / per_head, end = (t + 1) * nq / per_head; /* run t: [begin, end) */
      long i = begin + (long)(attn_rng_uniform(&rng) * (double)(end - begin));
      if (t == 0) i = 0;
      if (t == per_head - 1) i = nq - 1;
      rows[bh * per_head + t] = bh * nq + (i < end ? i : end - 1); /* the product may round up */
    }
  *n_rows = heads * per_head;
  if (per_head < nq)
    printf("%s: checked %ld of %ld rows (a random sample in every batch and head)\n",
           attn_program_name, *n_rows, heads * nq);
  return rows;
}

/* ---- the fp32 rule's conditioning term (docs/conventions.md section 3) --------------------
 * An fp32 stage computes each logit with an error: the dot product's rounding (at most about
 * d ulps of |scale| sum_c |q_c k_c|), the scaling, the exp2 base change and the running max's
 * rescaling (an ulp or so of |S_ij| and of the row's max m each). So say S'_j = S_j + delta_j
 * with |delta_j| <= e_j = EPS_LOGIT (|scale| sum_c |q_c k_c| + |S_j| + |m|). Measured from the
 * row's largest logit t, r_j = exp(S_j - S_t) becomes r'_j = r_j exp(delta_j - delta_t), within
 * a factor exp(e_j + e_t) of r_j, and r'_t = r_t = 1. As P'_j = r'_j / sum_k r'_k,
 *   r_j exp(-e_j - e_t) / B <= P'_j <= min(1, r_j exp(e_j + e_t) / A)     (j != t)
 *   1 / B <= P'_t <= 1 / A,
 * with A = 1 + sum_{k != t} r_k exp(-e_k - e_t) and B = 1 + sum_{k != t} r_k exp(e_k + e_t);
 * and, as sum_j (P'_j - P_j) = 0, |O'_i - O_i| <= sum_j |P'_j - P_j| max_c |V_jc - O_ic|.
 * This bound follows the answer: where the logits are far apart compared with their rounding
 * (large inputs, a softmax close to one-hot) it shrinks with the gaps instead of growing as
 * |S| does, and it is large only on rows whose leading logits fp32 cannot tell apart. EPS_LOGIT
 * is the worst case of a 128-term fp32 dot product (128 x 2^-24 = 7.6e-6), rounded up. */
#define EPS_LOGIT 8e-6
/* The fp32 rule's floor: rounding P, its sum and the P V products, per unit of max|V|. */
#define O_REL_FP32 2e-6

static double row_conditioning_bound(const attn_problem *p, const double *q_row,
                                     const double *k_keys, const double *v_keys, int visible,
                                     const double *o_row, double *s, double *e) {
  int d = p->head_dim, t = 0;
  if (visible == 0) return 0;
  for (int j = 0; j < visible; j++) {
    double dot = 0, abs_dot = 0;
    for (int c = 0; c < d; c++) {
      double x = q_row[c] * k_keys[(size_t)j * d + c];
      dot += x, abs_dot += fabs(x);
    }
    s[j] = p->scale * dot;
    /* A softcap c passes the dot product's error on times its slope, 1 - tanh^2 <= 1, and
     * rounds once more in c tanh (an ulp of |S_j|, which the term below holds). */
    double slope = 1;
    if (p->softcap > 0) {
      double th = tanh(s[j] / p->softcap);
      s[j] = p->softcap * th, slope = 1 - th * th;
    }
    e[j] = slope * fabs(p->scale) * abs_dot + fabs(s[j]);
    if (s[j] > s[t]) t = j;
  }
  for (int j = 0; j < visible; j++) e[j] = EPS_LOGIT * (e[j] + fabs(s[t]));
  double a = 1, b = 1, l = 0;
  for (int j = 0; j < visible; j++) {
    l += exp(s[j] - s[t]);
    if (j == t) continue;
    a += exp(s[j] - s[t] - e[j] - e[t]);
    b += exp(s[j] - s[t] + e[j] + e[t]); /* may be infinite: then that row resolves nothing */
  }
  double bound = 0;
  for (int j = 0; j < visible; j++) {
    double pj = exp(s[j] - s[t]) / l, hi, lo;
    if (j == t)
      hi = 1 / a, lo = 1 / b;
    else
      hi = fmin(1, exp(s[j] - s[t] + e[j] + e[t]) / a), lo = exp(s[j] - s[t] - e[j] - e[t]) / b;
    double dp = fmax(hi - pj, pj - lo);
    if (!(dp > 0)) continue;
    double spread = 0;
    for (int c = 0; c < d; c++) spread = fmax(spread, fabs(v_keys[(size_t)j * d + c] - o_row[c]));
    bound += dp * spread;
  }
  return bound;
}

typedef struct {
  const attn_problem *p;
  const long *rows;
  const double *q, *k, *v, *o_ref;
  double o_tol, floor; /* the first bound; the second's floor */
  double *row_tol;     /* NaN where not computed yet */
  double *work;        /* 2 Nkv doubles */
} tol_context;

/* Row n's O tolerance: o_tol, and for fp32 the smaller of it and the floor plus the row's
 * conditioning term. */
static double row_tolerance(tol_context *c, long n) {
  if (!isnan(c->row_tol[n])) return c->row_tol[n];
  const attn_problem *p = c->p;
  if (p->dtype != DTYPE_FP32) return c->row_tol[n] = c->o_tol;
  long r = c->rows[n], bh = r / p->seq_q;
  int d = p->head_dim, lo, hi;
  attn_key_range(p, bh / p->heads, (int)(r % p->seq_q), &lo, &hi);
  size_t first = attn_kv_head(p, bh) + (size_t)lo * d; /* the row's first visible key */
  double bound =
      row_conditioning_bound(p, c->q + (size_t)r * d, c->k + first, c->v + first, hi - lo,
                             c->o_ref + (size_t)n * d, c->work, c->work + p->seq_kv);
  return c->row_tol[n] = fmin(c->o_tol, c->floor + bound);
}

void attn_check_forward(const attn_check_inputs *in, const float *o, const float *lse,
                        int v_is_constant, int q_is_zero, double *err, double *tol, int *ok) {
  const attn_problem *p = in->p;
  int d = p->head_dim;
  verdict[0] = 0;
  *ok = all_finite("O", o, attn_q_elems(p), d);
  if (in->saves_lse) *ok &= lse_well_formed(in, lse);

  long n_rows;
  long *rows = choose_rows(p, in->seed, &n_rows);
  double *q = widen(in->q, attn_q_elems(p)), *k = widen(in->k, attn_kv_elems(p));
  double *v = widen(in->v, attn_kv_elems(p));
  double *o_ref = attn_host_alloc(sizeof(double) * (size_t)n_rows * d, "reference O");
  double *lse_ref = attn_host_alloc(sizeof(double) * (size_t)n_rows, "reference LSE");
  double *row_tol = attn_host_alloc(sizeof(double) * (size_t)n_rows, "tolerances");
  double max_s;
  reference_forward_rows(p, q, k, v, rows, n_rows, o_ref, lse_ref, &max_s);

  double max_v = max_abs_kv(p, in->v);
  /* The fp32 rule: a row's tolerance is the smaller of two bounds on a correct fp32 stage's
   * error. The first, O_REL_FP32 max(1, max|S|) max(1, max|V|), is tight for unit-sized
   * logits and grows with |S|; the second follows the row's own softmax (see
   * row_conditioning_bound), so that large inputs are still checked against the answer. */
  double o_tol = O_REL_FP32 * fmax(1, max_s) * fmax(1, max_v),
         lse_tol = LSE_REL_FP32 * fmax(1, max_s);
  if (p->dtype != DTYPE_FP32) {
    float *o_base = attn_host_alloc(sizeof(float) * (size_t)n_rows * d, "baseline O");
    float *lse_base = attn_host_alloc(sizeof(float) * (size_t)n_rows, "baseline LSE");
    baseline_forward_rows(p, in->q, in->k, in->v, rows, n_rows, o_base, lse_base);
    double base_o = max_error_of(o_base, o_ref, (size_t)n_rows * d), base_lse = 0;
    for (long n = 0; n < n_rows; n++)
      if (isfinite(lse_ref[n])) base_lse = fmax(base_lse, fabs(lse_base[n] - lse_ref[n]));
    double cap = (p->dtype == DTYPE_BF16 ? O_CAP_BF16 : O_CAP_FP16) * fmax(1, max_v);
    o_tol = fmin(M_OUTPUT * base_o + rounding_floor(o_ref, (size_t)n_rows * d, p->dtype), cap);
    lse_tol = M_OUTPUT * base_lse + lse_tol;
    free(o_base), free(lse_base);
  }
  /* A row's fp32 tolerance is computed only where it can change a verdict: where the row's
   * error passes the smaller of o_tol and the floor it passes either way (its tolerance lies
   * between them), and where o_tol < max|O| no row can make the check vacuous. This keeps
   * the check's cost on ordinary inputs what the reference's own is. */
  double max_o = 0;
  for (size_t e = 0; e < (size_t)n_rows * d; e++) max_o = fmax(max_o, fabs(o_ref[e]));
  tol_context tc = {
      p,       rows,
      q,       k,
      v,       o_ref,
      o_tol,   O_REL_FP32 * max_v,
      row_tol, attn_host_alloc(sizeof(double) * 2 * (size_t)p->seq_kv, "conditioning")};
  for (long n = 0; n < n_rows; n++) row_tol[n] = NAN;
  int all_rows = p->dtype == DTYPE_FP32 && !(o_tol < max_o);
  double cheap_pass = fmin(o_tol, tc.floor);

  /* Each row against its own tolerance; the figures reported are those of the row nearest to
   * (or furthest past) its tolerance, so that a failing line's figures fail too. */
  max_error eo = {0, -1, 0, 0}, el = {0, -1, 0, 0}, ea = {0, -1, 0, 0};
  double eo_tol = o_tol, ea_tol = o_tol, worst_ratio = -1, worst_ratio_a = -1, max_tol = 0;
  long worst_n = -1, worst_n_a = -1; /* the rows reported */
  for (long n = 0; n < n_rows; n++) {
    long r = rows[n];
    max_error row = {0, -1, 0, 0};
    for (int c = 0; c < d; c++) track(&row, r * d + c, o[r * d + c], o_ref[n * d + c]);
    double t = all_rows || !(row.err <= cheap_pass) ? row_tolerance(&tc, n) : o_tol;
    max_tol = fmax(max_tol, t);
    double ratio = isnan(row.err) ? INFINITY : row.err / t;
    if (!(ratio <= worst_ratio)) worst_ratio = ratio, eo = row, eo_tol = t, worst_n = n;
    if (in->saves_lse && isfinite(lse_ref[n])) track(&el, r, lse[r], lse_ref[n]);
  }
  /* The closed forms, computed from the inputs alone, so that they also test the reference. */
  int has_closed_form = v_is_constant || q_is_zero || p->seq_kv == 1;
  for (long n = 0; has_closed_form && n < n_rows; n++) {
    long r = rows[n], bh = r / p->seq_q;
    int lo, hi;
    attn_key_range(p, bh / p->heads, (int)(r % p->seq_q), &lo, &hi);
    if (lo == hi) continue;
    /* The row's visible keys: every V row the same, or one key, O is that row; Q = 0, every
     * logit is 0 (softcap or not) and O is their mean. */
    const double *v_keys = v + attn_kv_head(p, bh) + (size_t)lo * d;
    max_error row = {0, -1, 0, 0};
    for (int c = 0; c < d; c++) {
      double want = 0;
      if (v_is_constant || p->seq_kv == 1) {
        want = v_keys[c];
      } else {
        for (int j = 0; j < hi - lo; j++) want += v_keys[(size_t)j * d + c];
        want /= hi - lo;
      }
      track(&row, r * d + c, o[r * d + c], want);
    }
    double t = all_rows || !(row.err <= cheap_pass) ? row_tolerance(&tc, n) : o_tol;
    double ratio = isnan(row.err) ? INFINITY : row.err / t;
    if (!(ratio <= worst_ratio_a)) worst_ratio_a = ratio, ea = row, ea_tol = t, worst_n_a = n;
  }
  /* The tolerances printed are the reported rows' own, not the first bound they passed. */
  if (worst_n >= 0) eo_tol = row_tolerance(&tc, worst_n);
  if (worst_n_a >= 0) ea_tol = row_tolerance(&tc, worst_n_a);
  free(tc.work);
  if (!(eo.err <= eo_tol)) *ok = 0, report("O", &eo, eo_tol, p->heads, p->seq_q, d);
  if (!(el.err <= lse_tol)) *ok = 0, report("LSE", &el, lse_tol, p->heads, p->seq_q, 1);
  if (!(ea.err <= ea_tol))
    *ok = 0, report("O against its closed form", &ea, ea_tol, p->heads, p->seq_q, d);
  *err = eo.err, *tol = eo_tol;
  free(rows), free(q), free(k), free(v), free(o_ref), free(lse_ref), free(row_tol);
  /* A tolerance as large as the answer checks nothing: rather than pass such a check, refuse
   * it (a mismatch found with it is still one, so this comes after the comparisons). */
  if (*ok && max_o > 0 && !(max_tol < max_o))
    attn_fail(EXIT_BAD_USAGE,
              "the check cannot resolve this problem: O's tolerance %.3g reaches max|O| %.3g "
              "(logits up to %.3g, beyond what %s tells apart); use smaller inputs, or "
              "--check-finite",
              max_tol, max_o, max_s, attn_dtype_name(p->dtype));
}

int attn_check_finite(const attn_check_inputs *in, const float *o, const float *lse,
                      const float *dq, const float *dk, const float *dv) {
  const attn_problem *p = in->p;
  verdict[0] = 0;
  int d = p->head_dim, ok = all_finite("O", o, attn_q_elems(p), d);
  if (in->saves_lse) ok &= lse_well_formed(in, lse);
  if (dq) ok &= all_finite("dQ", dq, attn_q_elems(p), d);
  if (dk) ok &= all_finite("dK", dk, attn_kv_elems(p), d);
  if (dv) ok &= all_finite("dV", dv, attn_kv_elems(p), d);
  return ok;
}

void attn_check_backward(const attn_check_inputs *in, const float *o, const float *lse,
                         const float *dq, const float *dk, const float *dv, double *err,
                         double *tol, int *ok) {
  const attn_problem *p = in->p;
  (void)o, (void)lse;
  verdict[0] = 0;
  double macs = 3.0 * product_macs(p);
  if (macs > 4 * FULL_CHECK_MAX_MACS)
    attn_fail(EXIT_BAD_USAGE,
              "the problem is too large for the float64 backward reference (%.1e multiply-adds, "
              "limit %.1e); check a smaller one, or use --bench alone",
              macs, 4 * FULL_CHECK_MAX_MACS);
  size_t nq = attn_q_elems(p), nkv = attn_kv_elems(p);
  double *q = widen(in->q, nq), *k = widen(in->k, nkv), *v = widen(in->v, nkv);
  double *d_o = widen(in->d_o, nq);
  double *ref[3] = {attn_host_alloc(nq * sizeof(double), "reference dQ"),
                    attn_host_alloc(nkv * sizeof(double), "reference dK"),
                    attn_host_alloc(nkv * sizeof(double), "reference dV")};
  reference_backward(p, q, k, v, d_o, NULL, ref[0], ref[1], ref[2], NULL);
  /* max|S| over every row, for the tolerance. */
  double *o_ref = attn_host_alloc(sizeof(double) * nq, "reference O");
  double *lse_ref = attn_host_alloc(sizeof(double) * attn_lse_elems(p), "reference LSE");
  double max_s;
  reference_forward_rows(p, q, k, v, NULL, (long)attn_lse_elems(p), o_ref, lse_ref, &max_s);

  const char *names[3] = {"dQ", "dK", "dV"};
  const float *got[3] = {dq, dk, dv};
  size_t counts[3] = {nq, nkv, nkv};
  int rows[3] = {p->seq_q, p->seq_kv, p->seq_kv};
  int heads[3] = {p->heads, attn_heads_kv(p), attn_heads_kv(p)};
  const int m_factor[3] = {M_DQ, M_DKDV, M_DKDV};
  float *base[3] = {NULL, NULL, NULL};
  if (p->dtype != DTYPE_FP32) {
    for (int g = 0; g < 3; g++) base[g] = attn_host_alloc(counts[g] * sizeof(float), "baseline");
    baseline_backward(p, in->q, in->k, in->v, in->d_o, base[0], base[1], base[2]);
  }
  /* The figures reported: the first failing tensor's (so that a failing line's figures fail
   * too), else those of the tensor nearest its tolerance. */
  *ok = 1, *err = 0, *tol = 1;
  int vacuous = -1; /* a gradient whose fp32 tolerance is as large as the gradient */
  double worst_ratio = -1;
  for (int g = 0; g < 3; g++) {
    int finite = all_finite(names[g], got[g], counts[g], p->head_dim);
    double max_ref = 0;
    for (size_t e = 0; e < counts[g]; e++) max_ref = fmax(max_ref, fabs(ref[g][e]));
    double g_tol = 2e-5 * fmax(1, max_s) * fmax(1, max_ref);
    if (base[g])
      g_tol = m_factor[g] * max_error_of(base[g], ref[g], counts[g]) +
              rounding_floor(ref[g], counts[g], p->dtype);
    /* The fp32 rule's relative factor 2e-5 max|S| reaching 1 leaves nothing checked. (Only
     * the factor: a gradient that is 0 up to rounding, dQ and dK with V constant, is fine.) */
    if (!base[g] && !(2e-5 * max_s < 1) && vacuous < 0) vacuous = g;
    max_error m = {0, -1, 0, 0};
    for (size_t e = 0; e < counts[g]; e++) track(&m, (long)e, got[g][e], ref[g][e]);
    int fails = !finite || !(m.err <= g_tol);
    if (!(m.err <= g_tol)) report(names[g], &m, g_tol, heads[g], rows[g], p->head_dim);
    double ratio = fails ? INFINITY : m.err / g_tol;
    if (*ok && !(ratio <= worst_ratio)) worst_ratio = ratio, *err = m.err, *tol = g_tol;
    if (fails) *ok = 0;
  }
  if (*ok && vacuous >= 0)
    attn_fail(EXIT_BAD_USAGE,
              "the check cannot resolve this backward: %s's fp32 tolerance 2e-5 x max|S| (%.3g) "
              "is as large as the gradient itself; use smaller inputs, or --check-finite",
              names[vacuous], max_s);
  free(q), free(k), free(v), free(d_o), free(o_ref), free(lse_ref);
  for (int g = 0; g < 3; g++) free(ref[g]), free(base[g]);
}
