/* Small shared pieces: the seeded generator, FLOP counts, dtype names, failing clearly. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "attention.h"

void attn_rng_seed(attn_rng *r, uint64_t seed) { r->state = seed; }

static uint64_t splitmix64_next(attn_rng *r) {
  uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double attn_rng_uniform(attn_rng *r) {
  /* 53 random bits, shifted by half a step so that 0 never comes out (log(0) below). */
  return ((double)(splitmix64_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

double attn_rng_normal(attn_rng *r) {
  const double two_pi = 6.283185307179586;
  double u1 = attn_rng_uniform(r), u2 = attn_rng_uniform(r);
  return sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}

/* The (query, key) pairs one head computes, summed over its rows' visible ranges. */
static double visible_pairs_per_head(const attn_problem *p) {
  double pairs = 0;
  for (long b = 0; b < p->batch; b++)
    for (int i = 0; i < p->seq_q; i++) {
      int lo, hi;
      attn_key_range(p, b, i, &lo, &hi);
      pairs += hi - lo;
    }
  return pairs;
}

/* FlashAttention's convention: 2 matmuls of 2*Nq*Nkv*d each, halved when causal (Nq = Nkv).
 * With cache lengths each sequence counts its own L_b keys instead of Nkv (and no halving:
 * decode has Nq far below L_b, where the causal mask removes almost nothing). With a window
 * or varlen the visible pairs are counted exactly: a dense count would credit a stage with
 * work no one asked of it (packed sequences of 1k keys in a 1M-row batch, a 256-key window
 * over 32k keys), and no halving rule fits a band. */
double attn_forward_flops(const attn_problem *p) {
  if (p->windowed || p->seqs > 0) return 4.0 * p->heads * p->head_dim * visible_pairs_per_head(p);
  if (p->cache_lens) {
    double keys = 0;
    for (int b = 0; b < p->batch; b++) keys += p->cache_lens[b];
    return 4.0 * p->heads * (double)p->seq_q * keys * p->head_dim;
  }
  double f = 4.0 * p->batch * p->heads * (double)p->seq_q * p->seq_kv * p->head_dim;
  return (p->causal && p->seq_q == p->seq_kv) ? f / 2 : f;
}

double attn_backward_flops(const attn_problem *p) { return 2.5 * attn_forward_flops(p); }

size_t attn_dtype_size(attn_dtype t) { return t == DTYPE_FP32 ? 4 : 2; }

const char *attn_dtype_name(attn_dtype t) {
  return t == DTYPE_FP16 ? "fp16" : t == DTYPE_BF16 ? "bf16" : "fp32";
}

const char *attn_layout_name(attn_layout l) { return l == LAYOUT_BSHD ? "bshd" : "bhnd"; }

const char *attn_program_name = "attention";
char attn_failure_note[ATTN_FAILURE_NOTE_BYTES] = "";

/* Per thread: PyTorch runs backward passes on threads of its own. */
static _Thread_local jmp_buf *fail_target;
static _Thread_local char fail_line[4096];
static _Thread_local int fail_code;

void attn_fail_return_to(jmp_buf *target) { fail_target = target; }
const char *attn_last_failure(void) { return fail_line; }
int attn_last_failure_code(void) { return fail_code; }

void attn_fail(int code, const char *fmt, ...) {
  /* The line is composed once, for both ends: kept for a caller that set a return point, or
   * printed. A line past the buffer is cut short (snprintf returns the length it wanted). */
  va_list ap;
  va_start(ap, fmt);
  size_t n = (size_t)snprintf(fail_line, sizeof fail_line, "%s: ", attn_program_name);
  if (n < sizeof fail_line) n += (size_t)vsnprintf(fail_line + n, sizeof fail_line - n, fmt, ap);
  if (n < sizeof fail_line) snprintf(fail_line + n, sizeof fail_line - n, "%s", attn_failure_note);
  va_end(ap);
  fail_code = code;
  if (fail_target) {
    jmp_buf *target = fail_target;
    fail_target = NULL; /* one jump a return point: its frame returns next */
    longjmp(*target, code);
  }
  fprintf(stderr, "%s\n", fail_line);
  exit(code);
}

void *attn_host_alloc(size_t bytes, const char *what) {
  void *ptr = malloc(bytes ? bytes : 1);
  if (!ptr)
    attn_fail(EXIT_BAD_USAGE, "problem too large for host memory: %s needs %.2f GiB", what,
              bytes / 1073741824.0);
  return ptr;
}
