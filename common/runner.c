/* attention_main(): the life of every stage program, written once.
 *
 *   options -> inputs (seeded or --load) -> device buffers, outputs poisoned with NaN
 *   -> forward (and backward) once -> check against the float64 reference
 *   -> timing (warm-up, median of repeats) -> one result line, a TSV row, --save
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "npy.h"

/* The default problem: small enough that stage 00 and the float64 reference finish in a
 * blink on a laptop, large enough that every stage runs several tiles. */
enum { DEFAULT_BATCH = 1, DEFAULT_HEADS = 4, DEFAULT_SEQ = 512, DEFAULT_DIM = 64 };
enum { DEFAULT_SEED = 42 };
/* No size beyond this: keeps every index product far from overflow. */
enum { MAX_SIZE = 1 << 24 };

typedef enum { PATTERN_RANDN, PATTERN_CONST_V, PATTERN_ZERO_Q, PATTERN_LARGE_Q } input_pattern;
/* --inputs large-q: Q times 2^8, a power of two, so that rounding Q to the dtype loses no more
 * than it does unscaled, and small enough that Q stays in fp16's range (unit-normal elements
 * reach about 5, times 256 is 1280 < 65504). Logits then reach about 1e3 at every d, since the
 * default scale 1/sqrt(d) undoes the growth of q . k with d. */
enum { LARGE_Q_FACTOR = 256 };

typedef struct {
  attn_problem p;
  int given_batch, given_heads, given_heads_kv, given_seq_q, given_seq_kv, given_dim, given_scale;
  int given_check, given_input_scale;
  const char *cache_lens_text;                /* --cache-lens, parsed once B and Nkv are known */
  int *cache_lens;                            /* what p.cache_lens points to */
  const char *seqlens_text, *seqlens_kv_text; /* --seqlens, --seqlens-kv */
  int *cu_seqlens_q, *cu_seqlens_k;           /* what p.cu_seqlens_q and _k point to */
  uint64_t seed;
  int check, bench, backward, check_finite;
  const char *load_dir, *save_dir, *tsv_path;
  input_pattern pattern;
  double input_scale;
} options;

static void usage(const attn_stage *s) {
  printf("%s: %s\n\n", s->name, s->idea);
  printf(
      "usage: %s [options]\n"
      "  -b, --batch B      batch size (default %d)\n"
      "  -H, --heads H      heads (default %d)\n"
      "      --heads-kv HKV key/value heads, a divisor of H: query head h reads K/V head\n"
      "                     h / (H / HKV) (grouped-query attention; default H)\n"
      "  -n, --seq N        sequence length of queries and keys (default %d)\n"
      "      --seq-q NQ     query length (overrides --seq)\n"
      "      --seq-kv NKV   key/value length (overrides --seq)\n"
      "  -d, --dim D        head dim (default %d)\n"
      "  -c, --causal       causal mask, bottom-right aligned (from stage 05_causal)\n"
      "      --scale S      softmax scale (default 1/sqrt(d))\n"
      "      --seed S       seed of the input generator (default %d)\n"
      "      --dtype T      fp32|fp16|bf16 (stages that have it)\n"
      "      --cache-lens L decode against a KV cache: L0,L1,... (B lengths, each 0..Nkv) or\n"
      "                     'random' (uniform in 1..Nkv, from --seed); sequence b holds L_b\n"
      "                     valid keys (Nkv is the cache's capacity), causal is bottom-right\n"
      "                     against L_b, and Nq is 1 unless --seq-q says otherwise\n"
      "      --layout L     bhnd (default): Q, K, V, O and the gradients [B, H, N, d] in the\n"
      "                     stage's memory | bshd: [B, N, H, d], FlashAttention's order, read\n"
      "                     in place (from stage 09_swizzle_pipeline; .npy files stay bhnd)\n"
      "      --window L,R   sliding window: query i sees key j iff diag - L <= j <= diag + R,\n"
      "                     diag = i + Nkv - Nq; -1 leaves a side unbounded (with --causal the\n"
      "                     causal bound holds too) (from stage 13_window_softcap_varlen)\n"
      "      --softcap C    logit softcap, C > 0: S = C tanh(scale q.k / C), before masking\n"
      "                     (from stage 13_window_softcap_varlen)\n"
      "      --seqlens N0,N1,..  varlen: sequences of these query lengths (0 allowed) packed\n"
      "                     end to end in one batch, B = 1 and Nq their total; each query sees\n"
      "                     only its own sequence's keys, masks aligned per sequence (from\n"
      "                     stage 13_window_softcap_varlen; not with -b, -n, --seq-q, --seq-kv)\n"
      "      --seqlens-kv M0,M1,..  varlen: the sequences' key lengths, as many (default:\n"
      "                     --seqlens); Nkv is their total\n"
      "      --check        compare with the float64 reference, exit 1 on a mismatch\n"
      "                     (on by default unless --bench or --check-finite is given)\n"
      "      --check-finite only check that every output is finite, LSE -inf exactly on\n"
      "                     rows that see no key (for inputs beyond fp32's precision)\n"
      "      --bench        warm up, repeat, report the median time and TFLOP/s\n"
      "      --backward     also run and check the backward (from stage 06_backward)\n"
      "      --load DIR     read q.npy, k.npy, v.npy (do.npy) from DIR; sizes not given\n"
      "                     are taken from the files\n"
      "      --save DIR     write the inputs (q, k, v, do.npy) and the outputs (o, lse,\n"
      "                     dq, dk, dv.npy) into DIR, so that --load DIR reruns the case\n"
      "      --tsv FILE     append one result row per pass (a header when FILE is new)\n"
      "      --inputs P     randn (default) | const-v (every V row the same: O = V)\n"
      "                     | zero-q (Q = 0: O = mean of the visible V rows)\n"
      "                     | large-q (Q times 256: logits of about 1e3)\n"
      "      --input-scale X  multiply the random Q, K and V by X (large logits; not\n"
      "                     with --load)\n"
      "      --describe     one tab-separated line of what this stage supports\n"
      "  -h, --help         this text\n"
      "long options also take --name=value and any unambiguous prefix (--seq-k 300)\n"
      "exit codes: 0 ok, 1 check failed, 2 bad usage or input, 77 no CUDA device\n",
      s->name, DEFAULT_BATCH, DEFAULT_HEADS, DEFAULT_SEQ, DEFAULT_DIM, DEFAULT_SEED);
}

/* One machine-readable line for the scripts: name, kind, head dims, dtypes, causal,
 * backward, idea, grouped-query attention, cache lengths, layouts, window, softcap, varlen
 * (tab-separated). */
static void describe(const attn_stage *s) {
  printf("%s\t%s\t", s->name, s->device->kind);
  for (int i = 0; i < 8 && s->head_dims[i]; i++) printf(i ? ",%d" : "%d", s->head_dims[i]);
  if (!s->head_dims[0]) printf("any");
  unsigned dtypes = s->dtypes ? s->dtypes : DTYPE_BIT(DTYPE_FP32);
  const char *sep = "\t";
  for (int t = DTYPE_FP32; t <= DTYPE_BF16; t++)
    if (dtypes & DTYPE_BIT(t)) printf("%s%s", sep, attn_dtype_name((attn_dtype)t)), sep = ",";
  printf("\t%d\t%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\n", s->has_causal, s->backward != NULL, s->idea,
         s->has_gqa, s->has_cache_lens, s->has_layouts, s->has_window, s->has_softcap,
         s->has_varlen);
}

static long parse_int(const char *opt, const char *text) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || *end || v <= 0 || v > MAX_SIZE)
    attn_fail(EXIT_BAD_USAGE, "%s must be an integer in 1..%d, got '%s'", opt, MAX_SIZE, text);
  return v;
}

static double parse_real(const char *opt, const char *text) {
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (errno || end == text || *end || !isfinite(v))
    attn_fail(EXIT_BAD_USAGE, "%s must be a finite number, got '%s'", opt, text);
  return v;
}

/* --window LEFT,RIGHT: two integers, each -1 (that side unbounded) or 0..MAX_SIZE (a window
 * wider than any sequence is unbounded already, and the bound keeps a kernel's diag + right
 * inside int). */
static void parse_window(attn_problem *p, const char *text) {
  long side[2];
  const char *c = text;
  for (int k = 0; k < 2; k++) {
    char *end;
    errno = 0;
    side[k] = strtol(c, &end, 10);
    int ends_right = k == 0 ? *end == ',' : *end == 0;
    if (errno || end == c || !ends_right || side[k] < -1 || side[k] > MAX_SIZE)
      attn_fail(EXIT_BAD_USAGE,
                "--window must be LEFT,RIGHT, each -1 (unbounded) or an integer in 0..%d, got "
                "'%s'",
                MAX_SIZE, text);
    c = end + 1;
  }
  p->windowed = 1, p->window_left = (int)side[0], p->window_right = (int)side[1];
}

/* Option codes of the options that have no one-letter name. */
enum {
  OPT_SEQ_Q = 256,
  OPT_SEQ_KV,
  OPT_SCALE,
  OPT_SEED,
  OPT_DTYPE,
  OPT_CHECK,
  OPT_CHECK_FINITE,
  OPT_BENCH,
  OPT_BACKWARD,
  OPT_LOAD,
  OPT_SAVE,
  OPT_TSV,
  OPT_INPUTS,
  OPT_INPUT_SCALE,
  OPT_DESCRIBE,
  OPT_HEADS_KV,
  OPT_CACHE_LENS,
  OPT_LAYOUT,
  OPT_WINDOW,
  OPT_SOFTCAP,
  OPT_SEQLENS,
  OPT_SEQLENS_KV,
};

static const struct option long_options[] = {
    {"help", no_argument, NULL, 'h'},
    {"describe", no_argument, NULL, OPT_DESCRIBE},
    {"batch", required_argument, NULL, 'b'},
    {"heads", required_argument, NULL, 'H'},
    {"heads-kv", required_argument, NULL, OPT_HEADS_KV},
    {"seq", required_argument, NULL, 'n'},
    {"seq-q", required_argument, NULL, OPT_SEQ_Q},
    {"seq-kv", required_argument, NULL, OPT_SEQ_KV},
    {"dim", required_argument, NULL, 'd'},
    {"causal", no_argument, NULL, 'c'},
    {"scale", required_argument, NULL, OPT_SCALE},
    {"seed", required_argument, NULL, OPT_SEED},
    {"dtype", required_argument, NULL, OPT_DTYPE},
    {"cache-lens", required_argument, NULL, OPT_CACHE_LENS},
    {"layout", required_argument, NULL, OPT_LAYOUT},
    {"window", required_argument, NULL, OPT_WINDOW},
    {"softcap", required_argument, NULL, OPT_SOFTCAP},
    {"seqlens", required_argument, NULL, OPT_SEQLENS},
    {"seqlens-kv", required_argument, NULL, OPT_SEQLENS_KV},
    {"check", no_argument, NULL, OPT_CHECK},
    {"check-finite", no_argument, NULL, OPT_CHECK_FINITE},
    {"bench", no_argument, NULL, OPT_BENCH},
    {"backward", no_argument, NULL, OPT_BACKWARD},
    {"load", required_argument, NULL, OPT_LOAD},
    {"save", required_argument, NULL, OPT_SAVE},
    {"tsv", required_argument, NULL, OPT_TSV},
    {"inputs", required_argument, NULL, OPT_INPUTS},
    {"input-scale", required_argument, NULL, OPT_INPUT_SCALE},
    {NULL, 0, NULL, 0},
};
/* The leading ':' makes getopt_long report a missing value as ':' rather than '?'. */
static const char short_options[] = ":hb:H:n:d:c";

/* The long option that `name` (len characters, no "--") names: an exact name, or else the one
 * option it is a prefix of; *matches counts the candidates (more than 1: ambiguous). */
static const struct option *find_long_option(const char *name, size_t len, int *matches) {
  const struct option *hit = NULL;
  *matches = 0;
  for (const struct option *l = long_options; l->name; l++) {
    if (strncmp(l->name, name, len) != 0) continue;
    if (strlen(l->name) == len) return *matches = 1, l;
    hit = l, ++*matches;
  }
  return *matches == 1 ? hit : NULL;
}

/* Says in one line what was wrong with the option getopt_long just refused: code '?' (unknown,
 * ambiguous, or a value given to an option that takes none) or ':' (its value missing).
 * getopt's own messages are off (opterr = 0): they lack the stage's name and the exit code 2.
 * getopt_long sets optopt to 0 for an unknown long option and to the option's code otherwise;
 * argv[optind - 1] is the word of a long option, or of a short option that ended its word. */
static void refuse_option(int code, char **argv) {
  const char *word = argv[optind - 1];
  if (strncmp(word, "--", 2) == 0) {
    size_t len = strcspn(word + 2, "=");
    int matches;
    const struct option *l = find_long_option(word + 2, len, &matches);
    if (code == ':' && l) attn_fail(EXIT_BAD_USAGE, "--%s needs a value (see --help)", l->name);
    if (code == '?' && optopt == 0 && matches > 1)
      attn_fail(EXIT_BAD_USAGE, "option '--%.*s' is ambiguous (see --help)", (int)len, word + 2);
    if (code == '?' && optopt == 0)
      attn_fail(EXIT_BAD_USAGE, "unknown option '--%.*s' (see --help)", (int)len, word + 2);
    if (code == '?' && l && l->val == optopt && l->has_arg == no_argument && word[2 + len] == '=')
      attn_fail(EXIT_BAD_USAGE, "--%s takes no value, got '%s'", l->name, word);
  }
  for (const struct option *l = long_options; code == ':' && l->name; l++)
    if (l->val == optopt)
      attn_fail(EXIT_BAD_USAGE, "-%c (--%s) needs a value (see --help)", optopt, l->name);
  attn_fail(EXIT_BAD_USAGE, "unknown option '-%c' (see --help)", optopt);
}

/* What the options cannot mean together, each refused in one line. */
static void check_option_combinations(const options *o, int seq_given) {
  const attn_problem *p = &o->p;
  if (o->seqlens_kv_text && !o->seqlens_text)
    attn_fail(EXIT_BAD_USAGE, "--seqlens-kv needs --seqlens: the queries' lengths come first");
  if (o->seqlens_text && o->given_batch)
    attn_fail(EXIT_BAD_USAGE,
              "--batch cannot be given with --seqlens: varlen packs its sequences into one "
              "batch (B = 1)");
  if (o->seqlens_text && (seq_given || o->given_seq_q || o->given_seq_kv))
    attn_fail(EXIT_BAD_USAGE,
              "--seq, --seq-q and --seq-kv cannot be given with --seqlens: Nq and Nkv are the "
              "totals of --seqlens and --seqlens-kv");
  if (o->cache_lens_text && (p->windowed || p->softcap > 0 || o->seqlens_text))
    attn_fail(EXIT_BAD_USAGE,
              "--cache-lens cannot be combined with --window, --softcap or --seqlens: no stage "
              "decodes against a KV cache with them");
}

/* A comma-separated list of non-negative lengths, at most MAX_SIZE in all; returns it (n of
 * them) as seqs + 1 offsets from 0, and sets *n, *longest. */
static int *parse_offsets(const char *opt, const char *text, int *n, int *longest) {
  int count = 1;
  for (const char *c = text; *c; c++) count += *c == ',';
  int *offsets = attn_host_alloc(sizeof(int) * ((size_t)count + 1), opt);
  long total = 0;
  const char *c = text;
  offsets[0] = 0, *longest = 0;
  for (int s = 0; s < count; s++) {
    char *end;
    errno = 0;
    long len = strtol(c, &end, 10);
    if (errno || end == c || (*end && *end != ',') || len < 0 || len > MAX_SIZE)
      attn_fail(EXIT_BAD_USAGE,
                "%s must be comma-separated sequence lengths, each an integer in 0..%d, got '%s'",
                opt, MAX_SIZE, text);
    total += len;
    if (total > MAX_SIZE)
      attn_fail(EXIT_BAD_USAGE, "%s: the lengths add up to more than %d rows: '%s'", opt, MAX_SIZE,
                text);
    offsets[s + 1] = (int)total;
    if (len > *longest) *longest = (int)len;
    c = end + 1;
  }
  if (total == 0)
    attn_fail(EXIT_BAD_USAGE, "%s: the sequences hold no rows at all; give at least one", opt);
  *n = count;
  return offsets;
}

/* --seqlens and --seqlens-kv: B = 1, Nq and Nkv the totals, the offsets in the problem. */
static void parse_seqlens(options *o) {
  attn_problem *p = &o->p;
  int seqs, seqs_kv;
  o->cu_seqlens_q = parse_offsets("--seqlens", o->seqlens_text, &seqs, &p->max_seqlen_q);
  const char *kv_text = o->seqlens_kv_text ? o->seqlens_kv_text : o->seqlens_text;
  o->cu_seqlens_k = parse_offsets(o->seqlens_kv_text ? "--seqlens-kv" : "--seqlens", kv_text,
                                  &seqs_kv, &p->max_seqlen_k);
  if (seqs_kv != seqs)
    attn_fail(EXIT_BAD_USAGE,
              "--seqlens-kv: %d key length%s for %d sequence%s; give one per sequence of --seqlens",
              seqs_kv, seqs_kv == 1 ? "" : "s", seqs, seqs == 1 ? "" : "s");
  p->seqs = seqs;
  p->cu_seqlens_q = o->cu_seqlens_q, p->cu_seqlens_k = o->cu_seqlens_k;
  p->batch = 1, p->seq_q = o->cu_seqlens_q[seqs], p->seq_kv = o->cu_seqlens_k[seqs];
  o->given_batch = o->given_seq_q = o->given_seq_kv = 1; /* --load must match, not replace */
}

static void parse_options(const attn_stage *s, int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->p.batch = DEFAULT_BATCH;
  o->p.heads = DEFAULT_HEADS;
  o->p.seq_q = o->p.seq_kv = DEFAULT_SEQ;
  o->p.head_dim = DEFAULT_DIM;
  /* The stage's first dtype: fp32, or fp16 for the tensor-core stage. */
  unsigned dtypes = s->dtypes ? s->dtypes : DTYPE_BIT(DTYPE_FP32);
  o->p.dtype = dtypes & DTYPE_BIT(DTYPE_FP32)   ? DTYPE_FP32
               : dtypes & DTYPE_BIT(DTYPE_FP16) ? DTYPE_FP16
                                                : DTYPE_BF16;
  o->seed = DEFAULT_SEED;
  o->input_scale = 1;
  int seq_given = 0;
  opterr = 0;
  for (int c; (c = getopt_long(argc, argv, short_options, long_options, NULL)) != -1;) {
    const char *v = optarg;
    switch (c) {
      case 'h': usage(s), exit(EXIT_OK);
      case OPT_DESCRIBE: describe(s), exit(EXIT_OK);
      case 'b': o->p.batch = (int)parse_int("--batch", v), o->given_batch = 1; break;
      case 'H': o->p.heads = (int)parse_int("--heads", v), o->given_heads = 1; break;
      case OPT_HEADS_KV:
        o->p.heads_kv = (int)parse_int("--heads-kv", v), o->given_heads_kv = 1;
        break;
      case OPT_CACHE_LENS: o->cache_lens_text = v; break;
      case OPT_WINDOW: parse_window(&o->p, v); break;
      case OPT_SOFTCAP: {
        double cap = parse_real("--softcap", v);
        /* Held as a float: it must stay a positive finite one. */
        if (!(cap > 0) || !((float)cap > 0) || cap > FLT_MAX)
          attn_fail(EXIT_BAD_USAGE,
                    "--softcap must be a positive number within fp32's range, got '%s'", v);
        o->p.softcap = (float)cap;
        break;
      }
      case OPT_SEQLENS: o->seqlens_text = v; break;
      case OPT_SEQLENS_KV: o->seqlens_kv_text = v; break;
      case 'n': seq_given = (int)parse_int("--seq", v); break;
      case OPT_SEQ_Q: o->p.seq_q = (int)parse_int("--seq-q", v), o->given_seq_q = 1; break;
      case OPT_SEQ_KV: o->p.seq_kv = (int)parse_int("--seq-kv", v), o->given_seq_kv = 1; break;
      case 'd': o->p.head_dim = (int)parse_int("--dim", v), o->given_dim = 1; break;
      case 'c': o->p.causal = 1; break;
      case OPT_SCALE: {
        double scale = parse_real("--scale", v);
        /* The stages hold the scale as a float: a larger one would be infinity. */
        if (fabs(scale) > FLT_MAX)
          attn_fail(EXIT_BAD_USAGE, "--scale %s is beyond fp32's range (largest %g)", v,
                    (double)FLT_MAX);
        o->p.scale = (float)scale, o->given_scale = 1;
        break;
      }
      case OPT_SEED: {
        char *end;
        errno = 0;
        o->seed = strtoull(v, &end, 10);
        if (errno || end == v || *end || v[0] == '-')
          attn_fail(EXIT_BAD_USAGE, "--seed must be a non-negative integer, got '%s'", v);
        break;
      }
      case OPT_DTYPE:
        if (strcmp(v, "fp32") == 0)
          o->p.dtype = DTYPE_FP32;
        else if (strcmp(v, "fp16") == 0)
          o->p.dtype = DTYPE_FP16;
        else if (strcmp(v, "bf16") == 0)
          o->p.dtype = DTYPE_BF16;
        else
          attn_fail(EXIT_BAD_USAGE, "--dtype must be fp32, fp16 or bf16, got '%s'", v);
        break;
      case OPT_LAYOUT:
        if (strcmp(v, "bhnd") == 0)
          o->p.layout = LAYOUT_BHND;
        else if (strcmp(v, "bshd") == 0)
          o->p.layout = LAYOUT_BSHD;
        else
          attn_fail(EXIT_BAD_USAGE, "--layout must be bhnd or bshd, got '%s'", v);
        break;
      case OPT_CHECK_FINITE: o->check_finite = 1; break;
      case OPT_CHECK: o->check = o->given_check = 1; break;
      case OPT_BENCH: o->bench = 1; break;
      case OPT_BACKWARD: o->backward = 1; break;
      case OPT_LOAD: o->load_dir = v; break;
      case OPT_SAVE: o->save_dir = v; break;
      case OPT_TSV: o->tsv_path = v; break;
      case OPT_INPUTS:
        if (strcmp(v, "randn") == 0)
          o->pattern = PATTERN_RANDN;
        else if (strcmp(v, "const-v") == 0)
          o->pattern = PATTERN_CONST_V;
        else if (strcmp(v, "zero-q") == 0)
          o->pattern = PATTERN_ZERO_Q;
        else if (strcmp(v, "large-q") == 0)
          o->pattern = PATTERN_LARGE_Q;
        else
          attn_fail(EXIT_BAD_USAGE, "--inputs must be randn, const-v, zero-q or large-q, got '%s'",
                    v);
        break;
      case OPT_INPUT_SCALE:
        o->input_scale = parse_real("--input-scale", v);
        if (!(o->input_scale > 0))
          attn_fail(EXIT_BAD_USAGE, "--input-scale must be positive, got '%s'", v);
        o->given_input_scale = 1;
        break;
      default: refuse_option(c, argv); /* '?' (unknown) or ':' (a value missing) */
    }
  }
  /* getopt_long moves the words that are not options to the end; every one is a mistake. */
  if (optind < argc)
    attn_fail(EXIT_BAD_USAGE,
              "unexpected argument '%s': every value follows its option (see --help)",
              argv[optind]);
  /* The scale multiplies random inputs as they are drawn; loaded ones are used as they are. */
  if (o->load_dir && o->given_input_scale)
    attn_fail(EXIT_BAD_USAGE,
              "--input-scale scales random inputs, not loaded ones: scale the .npy files instead");
  /* The same for large-q: a case saved with it holds the scaled Q already. */
  if (o->load_dir && o->pattern == PATTERN_LARGE_Q)
    attn_fail(EXIT_BAD_USAGE,
              "--inputs large-q scales random inputs, not loaded ones: scale q.npy instead");
  check_option_combinations(o, seq_given);
  /* Varlen: one batch of the sequences' total rows, as the options give them. */
  if (o->seqlens_text) parse_seqlens(o);
  /* Decode: one new query per sequence, unless --seq-q (or a loaded q.npy) says otherwise;
   * --seq then sets the cache's capacity. */
  if (o->cache_lens_text && !o->given_seq_q && !o->load_dir) o->p.seq_q = 1, o->given_seq_q = 1;
  if (seq_given) {
    if (!o->given_seq_q) o->p.seq_q = seq_given, o->given_seq_q = 1;
    if (!o->given_seq_kv) o->p.seq_kv = seq_given, o->given_seq_kv = 1;
  }
  if (!o->bench && !o->check_finite) o->check = 1; /* a plain run always checks */
}

/* What the stage supports; every refusal names what would work. */
static void validate_for_stage(const attn_stage *s, const options *o) {
  const attn_problem *p = &o->p;
  if (s->head_dims[0]) {
    int ok = 0;
    char list[64] = "";
    for (int i = 0; i < 8 && s->head_dims[i]; i++) {
      ok |= s->head_dims[i] == p->head_dim;
      snprintf(list + strlen(list), sizeof list - strlen(list), i ? ", %d" : "%d", s->head_dims[i]);
    }
    if (!ok)
      attn_fail(EXIT_BAD_USAGE,
                "head dim %d is not supported: this stage compiles its kernels for d in {%s}",
                p->head_dim, list);
  }
  unsigned dtypes = s->dtypes ? s->dtypes : DTYPE_BIT(DTYPE_FP32);
  if (!(dtypes & DTYPE_BIT(p->dtype)))
    attn_fail(
        EXIT_BAD_USAGE, "--dtype %s is not supported by this stage%s", attn_dtype_name(p->dtype),
        dtypes == DTYPE_BIT(DTYPE_FP32) ? " (fp32 only; 07_tensor_cores adds fp16 and bf16)" : "");
  if (p->causal && !s->has_causal)
    attn_fail(EXIT_BAD_USAGE,
              "--causal is not supported by this stage: the causal mask comes in 05_causal");
  if ((double)p->seq_q * p->head_dim >= 2147483648.0 ||
      (double)p->seq_kv * p->head_dim >= 2147483648.0)
    attn_fail(EXIT_BAD_USAGE, "one head is too large: N x d must stay below 2^31 elements");
  if (o->backward && !s->backward)
    attn_fail(EXIT_BAD_USAGE,
              "--backward is not supported by this stage: the backward comes in 06_backward");
  int hkv = attn_heads_kv(p);
  if (hkv != p->heads && !s->has_gqa)
    attn_fail(EXIT_BAD_USAGE,
              "%d K/V heads for %d query heads (--heads-kv, or k.npy's shape) is grouped-query "
              "attention, which this stage does not have: it comes in 11_split_kv_decode",
              hkv, p->heads);
  if (p->heads % hkv != 0)
    attn_fail(EXIT_BAD_USAGE,
              "--heads-kv %d must divide --heads %d: query head h reads K/V head h / (H / Hkv)",
              hkv, p->heads);
  if (o->cache_lens_text && !s->has_cache_lens)
    attn_fail(EXIT_BAD_USAGE,
              "--cache-lens is not supported by this stage: decoding against a KV cache comes in "
              "11_split_kv_decode");
  if (o->backward && o->cache_lens_text)
    attn_fail(EXIT_BAD_USAGE,
              "--backward is not supported with --cache-lens: no stage has a backward for a KV "
              "cache (decode needs none)");
  if (p->layout != LAYOUT_BHND && !s->has_layouts)
    attn_fail(EXIT_BAD_USAGE,
              "--layout %s is not supported by this stage: reading [B, N, H, d] in place comes in "
              "09_swizzle_pipeline",
              attn_layout_name(p->layout));
  if (p->windowed && !s->has_window)
    attn_fail(EXIT_BAD_USAGE,
              "--window is not supported by this stage: the sliding window comes in "
              "13_window_softcap_varlen");
  if (p->softcap > 0 && !s->has_softcap)
    attn_fail(EXIT_BAD_USAGE,
              "--softcap is not supported by this stage: the logit softcap comes in "
              "13_window_softcap_varlen");
  if (p->seqs > 0 && !s->has_varlen)
    attn_fail(EXIT_BAD_USAGE,
              "--seqlens is not supported by this stage: packed variable-length sequences "
              "(varlen) come in 13_window_softcap_varlen");
  if (o->backward && hkv != p->heads && !s->has_gqa_backward)
    attn_fail(EXIT_BAD_USAGE,
              "--backward is not supported with --heads-kv other than --heads by this stage: the "
              "grouped-query backward comes in 12_hopper_backward");
}

/* A stream of the generator for --cache-lens random, apart from the inputs' (any constant
 * would do; this one spells "cache" in ASCII): a seed's Q, K and V are the same with or
 * without cache lengths. */
#define CACHE_LENS_STREAM 0x6361636865ull

/* --cache-lens, now that B and Nkv are known: B comma-separated lengths in 0..Nkv, or
 * "random": L_b = 1 + floor(u_b Nkv), u_b uniform in (0, 1) from SplitMix64 seeded with
 * --seed XOR CACHE_LENS_STREAM, so uniform in 1..Nkv. */
static void parse_cache_lens(options *o) {
  attn_problem *p = &o->p;
  const char *text = o->cache_lens_text;
  if (!text) return;
  o->cache_lens = attn_host_alloc(sizeof(int) * (size_t)p->batch, "cache lengths");
  if (strcmp(text, "random") == 0) {
    attn_rng rng;
    attn_rng_seed(&rng, o->seed ^ CACHE_LENS_STREAM);
    for (int b = 0; b < p->batch; b++)
      o->cache_lens[b] = 1 + (int)(attn_rng_uniform(&rng) * p->seq_kv);
  } else {
    int n = 0;
    for (const char *c = text;;) {
      char *end;
      errno = 0;
      long len = strtol(c, &end, 10);
      if (errno || end == c || (*end && *end != ','))
        attn_fail(EXIT_BAD_USAGE,
                  "--cache-lens must be 'random' or B comma-separated lengths, got '%s'", text);
      if (n == p->batch)
        attn_fail(EXIT_BAD_USAGE, "--cache-lens gives more than B = %d lengths: '%s'", p->batch,
                  text);
      if (len < 0 || len > p->seq_kv)
        attn_fail(EXIT_BAD_USAGE,
                  "--cache-lens: sequence %d holds %ld keys, outside 0..%d (Nkv, the cache's "
                  "capacity)",
                  n, len, p->seq_kv);
      o->cache_lens[n++] = (int)len;
      if (!*end) break;
      c = end + 1;
    }
    if (n != p->batch)
      attn_fail(EXIT_BAD_USAGE, "--cache-lens gives %d lengths, expected one per sequence (B = %d)",
                n, p->batch);
  }
  p->cache_lens = o->cache_lens;
}

/* ---- inputs -------------------------------------------------------------------------- */

typedef struct {
  float *q, *k, *v, *d_o; /* as the stage sees them: already rounded to its dtype */
} host_inputs;

static void fill_normal(attn_rng *rng, float *x, size_t n, double scale) {
  for (size_t i = 0; i < n; i++) {
    double v = scale * attn_rng_normal(rng);
    /* A double beyond float's range converts to infinity only where C's Annex F holds; say
     * so explicitly, and round_inputs_or_refuse() refuses it. */
    x[i] = fabs(v) <= FLT_MAX ? (float)v : v > 0 ? INFINITY : -INFINITY;
  }
}

static void make_inputs(const options *o, host_inputs *in) {
  const attn_problem *p = &o->p;
  attn_rng rng;
  attn_rng_seed(&rng, o->seed);
  fill_normal(&rng, in->q, attn_q_elems(p), o->input_scale);
  fill_normal(&rng, in->k, attn_kv_elems(p), o->input_scale);
  fill_normal(&rng, in->v, attn_kv_elems(p), o->input_scale);
  if (in->d_o) fill_normal(&rng, in->d_o, attn_q_elems(p), 1.0);
}

static void apply_pattern(const options *o, host_inputs *in) {
  const attn_problem *p = &o->p;
  size_t d = (size_t)p->head_dim, nkv = (size_t)p->seq_kv;
  if (o->pattern == PATTERN_ZERO_Q) memset(in->q, 0, sizeof(float) * attn_q_elems(p));
  if (o->pattern == PATTERN_LARGE_Q)
    for (size_t e = 0; e < attn_q_elems(p); e++) in->q[e] *= LARGE_Q_FACTOR;
  if (o->pattern == PATTERN_CONST_V)
    for (size_t bh = 0; bh < (size_t)p->batch * attn_heads_kv(p); bh++)
      for (size_t j = 1; j < nkv; j++)
        memcpy(in->v + (bh * nkv + j) * d, in->v + bh * nkv * d, sizeof(float) * d);
}

/* The largest logit bound accepted: FLT_MAX / 2^8. The stages hold S in fp32 and go on to
 * compute with it: S * log2(e) (exp2-based kernels), S - m with m another logit of either
 * sign (up to 2 |S|), and sums of fp32 products on the way to S; 2^8 covers those factors
 * with room to spare, so that no intermediate of a stage's softmax overflows. */
#define LOGIT_LIMIT (FLT_MAX / 256)

/* Rounds the inputs to the stage's dtype (the stage sees exactly these values), and refuses,
 * with exit 2 and one line, inputs that the stage cannot represent. Without this, such inputs
 * end in infinities, NaN and a failed check that blames the stage for the input:
 *  - an element beyond the dtype's range (65504 in fp16; 3.4e38 in fp32 and bf16) becomes
 *    infinity, and the softmax of an infinity is NaN;
 *  - finite inputs can still give logits beyond fp32. By Cauchy-Schwarz each logit obeys
 *    |S_ij| <= |scale| ||q_i|| ||k_j||, and a stage may form Q K^T before scaling it, or
 *    scale Q first; so per head, the bound max(|scale|, 1) max_i ||q_i|| max(max_j ||k_j||, 1)
 *    covers every such intermediate and must stay below LOGIT_LIMIT. Unit-normal inputs at
 *    d = 64 with --scale 100 (logits about 3e3) or bf16 inputs of 133120 (about 1e10) are
 *    far inside it. */
static void round_inputs_or_refuse(const options *o, host_inputs *in) {
  const attn_problem *p = &o->p;
  const char *hint = o->load_dir ? "smaller values in the files" : "a smaller --input-scale";
  struct {
    const char *name;
    float *x;
    size_t n;
  } tensors[4] = {{"Q", in->q, attn_q_elems(p)},
                  {"K", in->k, attn_kv_elems(p)},
                  {"V", in->v, attn_kv_elems(p)},
                  {"dO", in->d_o, attn_q_elems(p)}};
  for (int t = 0; t < 4 && tensors[t].x; t++)
    for (size_t i = 0; i < tensors[t].n; i++) {
      float x = tensors[t].x[i], r = attn_round_to_dtype(x, p->dtype);
      if (isfinite(r)) {
        tensors[t].x[i] = r;
        continue;
      }
      float largest = p->dtype == DTYPE_FP16   ? 65504.0f
                      : p->dtype == DTYPE_BF16 ? 3.3895314e38f
                                               : FLT_MAX;
      if (isfinite(x))
        attn_fail(EXIT_BAD_USAGE, "%s element %zu is %.3g, beyond %s's range (largest %g); use %s",
                  tensors[t].name, i, x, attn_dtype_name(p->dtype), largest, hint);
      attn_fail(EXIT_BAD_USAGE, "%s element %zu overflows fp32 (largest %g); use %s",
                tensors[t].name, i, (double)FLT_MAX, hint);
    }
  size_t d = (size_t)p->head_dim;
  for (long bh = 0; bh < (long)p->batch * p->heads; bh++) {
    double max_q = 0, max_k = 0;
    for (size_t i = 0; i < (size_t)p->seq_q; i++) {
      const float *q = in->q + attn_q_head(p, bh) + i * d;
      double sum = 0;
      for (size_t c = 0; c < d; c++) sum += (double)q[c] * q[c];
      max_q = fmax(max_q, sqrt(sum));
    }
    for (size_t j = 0; j < (size_t)attn_cache_len(p, bh / p->heads); j++) {
      const float *k = in->k + attn_kv_head(p, bh) + j * d;
      double sum = 0;
      for (size_t c = 0; c < d; c++) sum += (double)k[c] * k[c];
      max_k = fmax(max_k, sqrt(sum));
    }
    double bound = fmax(fabs(p->scale), 1) * max_q * fmax(max_k, 1);
    if (!(bound <= LOGIT_LIMIT))
      attn_fail(
          EXIT_BAD_USAGE,
          "logits could overflow fp32: in batch %ld head %ld, scale %g, max||q_i|| %.3g "
          "and max||k_j|| %.3g bound |S| and its partial products by %.3g, above FLT_MAX / 2^8 = "
          "%.3g; "
          "use %s or a smaller --scale",
          bh / p->heads, bh % p->heads, (double)p->scale, max_q, max_k, bound, (double)LOGIT_LIMIT,
          hint);
  }
}

static void npy_path(char *buf, size_t len, const char *dir, const char *name) {
  snprintf(buf, len, "%s/%s", dir, name);
}

/* Sizes not given on the command line come from q.npy [B,H,Nq,d] and k.npy [B,Hkv,Nkv,d]. */
static void shape_from_files(options *o) {
  char path[4096], err[512];
  size_t shape[NPY_MAX_DIMS];
  int ndim;
  const char *names[2] = {"q.npy", "k.npy"};
  for (int f = 0; f < 2; f++) {
    npy_path(path, sizeof path, o->load_dir, names[f]);
    if (npy_read_shape(path, shape, &ndim, err, sizeof err)) attn_fail(EXIT_BAD_USAGE, "%s", err);
    if (ndim != 4)
      attn_fail(EXIT_BAD_USAGE, "%s: %d dimensions, expected 4 ([B, H, N, d])", path, ndim);
    for (int i = 0; i < 4; i++)
      if (shape[i] == 0 || shape[i] > MAX_SIZE)
        attn_fail(EXIT_BAD_USAGE, "%s: dimension %d is %zu, expected 1..%d", path, i, shape[i],
                  MAX_SIZE);
    if (!o->given_batch) o->p.batch = (int)shape[0];
    if (f == 0 && !o->given_heads) o->p.heads = (int)shape[1];
    if (f == 1 && !o->given_heads_kv) o->p.heads_kv = (int)shape[1];
    if (!o->given_dim) o->p.head_dim = (int)shape[3];
    if (f == 0 && !o->given_seq_q) o->p.seq_q = (int)shape[2];
    if (f == 1 && !o->given_seq_kv) o->p.seq_kv = (int)shape[2];
  }
}

static void load_inputs(const options *o, host_inputs *in) {
  const attn_problem *p = &o->p;
  size_t q_shape[4] = {(size_t)p->batch, (size_t)p->heads, (size_t)p->seq_q, (size_t)p->head_dim};
  size_t kv_shape[4] = {q_shape[0], (size_t)attn_heads_kv(p), (size_t)p->seq_kv, q_shape[3]};
  struct {
    const char *name;
    float *dst;
    const size_t *shape;
  } files[4] = {{"q.npy", in->q, q_shape},
                {"k.npy", in->k, kv_shape},
                {"v.npy", in->v, kv_shape},
                {"do.npy", in->d_o, q_shape}};
  for (int f = 0; f < 4; f++) {
    if (!files[f].dst) continue;
    char path[4096], err[512];
    npy_path(path, sizeof path, o->load_dir, files[f].name);
    if (npy_read_f32(path, files[f].shape, 4, files[f].dst, err, sizeof err))
      attn_fail(EXIT_BAD_USAGE, "%s%s", err,
                p->seqs > 0 && strstr(err, ", expected (")
                    ? " (with --seqlens, the sequences packed: [1, H, the total rows, d])"
                    : "");
    size_t n = files[f].shape[0] * files[f].shape[1] * files[f].shape[2] * files[f].shape[3];
    for (size_t i = 0; i < n; i++)
      if (!isfinite(files[f].dst[i]))
        attn_fail(EXIT_BAD_USAGE, "%s: element %zu is %g; inputs must be finite", path, i,
                  files[f].dst[i]);
  }
}

/* ---- what a run leaves behind ----------------------------------------------------------
 * A run that ends early (Ctrl-C, a kill, a failure while writing) removes the files it had
 * created, so that no half-written .npy file or empty --save folder is taken for a result.
 * Rows appended to an existing --tsv file are written last, in one go. */
enum { MAX_OWNED = 16, OWNED_PATH = 4096 };
static char owned_paths[MAX_OWNED][OWNED_PATH];
static volatile sig_atomic_t n_owned, run_complete;
static char owned_dir[OWNED_PATH]; /* the --save folder, where this run created it */

static void own_path(const char *path) {
  if (n_owned < MAX_OWNED) snprintf(owned_paths[n_owned], OWNED_PATH, "%s", path), n_owned++;
}

/* Only async-signal-safe calls: it also runs from the signal handler. */
static void remove_owned(void) {
  for (int i = 0; i < n_owned; i++) unlink(owned_paths[i]);
  if (owned_dir[0]) rmdir(owned_dir); /* only if empty: never anything of the user's */
}

static void remove_owned_at_exit(void) {
  if (!run_complete) remove_owned();
}

static void on_interrupt(int sig) {
  remove_owned();
  static const char line[] = ": interrupted; the files it had begun were removed\n";
  const char *name = attn_program_name ? attn_program_name : "stage";
  ssize_t ignored = write(STDERR_FILENO, name, strlen(name));
  ignored = write(STDERR_FILENO, line, sizeof line - 1);
  (void)ignored;
  _exit(128 + sig);
}

static void install_cleanup(void) {
  atexit(remove_owned_at_exit);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
}

/* ---- long runs: an estimate first, then progress ----------------------------------------
 * A CPU stage on a large problem runs for minutes or hours (01_cpu_tiled at N = 3e6 and d = 1:
 * hours), and a run that only goes quiet looks hung. So a CPU run first times the stage on a
 * small problem of the same head dim, extrapolates by FLOPs, and where the whole run would
 * pass about a minute it says so before it starts; then a line every PROGRESS_EVERY seconds.
 * The float64 check is estimated at REFERENCE_MACS_PER_S, a slow core's rate. */
#define LONG_RUN_S 60.0
/* check.c's limit of a full check, above which it samples rows. */
#define FULL_CHECK_MAX_MACS 2147483648.0
#define PROGRESS_EVERY 30.0
#define REFERENCE_MACS_PER_S 2e8
/* One pass longer than this is timed once, from the checked run, instead of repeated: a
 * repeat would only double a long wait for a figure the first pass already gives. */
#define TIME_ONE_PASS_S 10.0

static _Atomic int progress_stop;
static _Atomic(const char *) progress_phase;
static double progress_estimate_s;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void human_duration(char *buf, size_t len, double s) {
  if (s < 60)
    snprintf(buf, len, "%.0fs", s);
  else if (s < 3600)
    snprintf(buf, len, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
  else
    snprintf(buf, len, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
}

static void *progress_thread(void *arg) {
  (void)arg;
  double start = now_s(), last = start;
  while (!atomic_load(&progress_stop)) {
    struct timespec tick = {0, 200000000};
    nanosleep(&tick, NULL);
    double t = now_s();
    if (t - last < PROGRESS_EVERY || atomic_load(&progress_stop)) continue;
    last = t;
    char done[32], total[32];
    human_duration(done, sizeof done, t - start);
    human_duration(total, sizeof total, progress_estimate_s);
    fprintf(stderr, "%s: %s elapsed of about %s (%s)\n", attn_program_name, done, total,
            atomic_load(&progress_phase));
  }
  return NULL;
}

/* Seconds one forward pass of `s` on `p` takes, extrapolated by FLOPs from a timed run on a
 * small problem of the same head dim and mask (host stages only; 0 when not estimated). */
static double estimate_forward_s(const attn_stage *s, const attn_problem *p) {
  if (s->device != &attn_host_device) return 0;
  attn_problem small = *p;
  small.batch = small.heads = small.heads_kv = 1;
  small.seq_q = p->seq_q < 128 ? p->seq_q : 128;
  small.seq_kv = p->seq_kv < 512 ? p->seq_kv : 512;
  small.cache_lens = NULL;
  /* One dense sequence: the small problem's rows are not the packed ones. Window and softcap
   * stay, so that their cost is in the rate. */
  small.seqs = small.max_seqlen_q = small.max_seqlen_k = 0;
  small.cu_seqlens_q = small.cu_seqlens_k = NULL;
  size_t nq = attn_q_elems(&small), nkv = attn_kv_elems(&small);
  attn_buffers t = {0};
  float *q = attn_host_alloc(nq * sizeof(float), "estimate"), *o = attn_host_alloc(nq * 4, "o");
  float *k = attn_host_alloc(nkv * sizeof(float), "estimate"), *v = attn_host_alloc(nkv * 4, "v");
  float *lse = attn_host_alloc(attn_lse_elems(&small) * sizeof(float), "estimate");
  for (size_t i = 0; i < nq; i++) q[i] = (float)((i * 7919 % 101) / 101.0 - 0.5);
  for (size_t i = 0; i < nkv; i++) k[i] = v[i] = (float)((i * 104729 % 97) / 97.0 - 0.5);
  size_t ws = s->forward_workspace ? s->forward_workspace(&small) : 0;
  void *work = ws ? attn_host_alloc(ws, "estimate workspace") : NULL;
  t.q = q, t.k = k, t.v = v, t.o = o, t.lse = lse, t.workspace = work;
  double begin = now_s(), elapsed = 0;
  int runs = 0;
  do { /* at least 20 ms of runs, so that the clock's grain does not matter */
    s->forward(&small, &t);
    runs++;
    elapsed = now_s() - begin;
  } while (elapsed < 0.02 && runs < 1000);
  free(q), free(k), free(v), free(o), free(lse), free(work);
  return attn_forward_flops(p) / (attn_forward_flops(&small) * runs / elapsed);
}

static void save_array(const options *o, const char *name, const float *x, const size_t *shape,
                       int ndim) {
  char path[4096], err[512];
  npy_path(path, sizeof path, o->save_dir, name);
  own_path(path);
  if (npy_write_f32(path, shape, ndim, x, err, sizeof err)) attn_fail(EXIT_BAD_USAGE, "%s", err);
}

/* ---- device buffers --------------------------------------------------------------------- */

typedef struct {
  const attn_device *dev;
  size_t bytes; /* what this run holds on the device: inputs, outputs, workspace */
} allocator;

static void *dev_alloc(allocator *a, size_t bytes, const char *what) {
  a->bytes += bytes;
  return a->dev->alloc(bytes, what);
}

/* A tensor's side: Q, O, dO and dQ hold H heads of Nq rows; K, V, dK and dV Hkv heads of Nkv. */
typedef enum { SIDE_Q, SIDE_KV } tensor_side;

/* The host (the reference, the checks, .npy files) holds every tensor as [B, heads, rows, d];
 * with --layout bshd the stage's copy is [B, rows, heads, d]. Copies x into out in the stage's
 * order (to_stage), or the stage's order in x back into the host's. Written from the layout's
 * definition, not from attn_layout_strides, so that the harness checks the kernels' strides. */
static void reorder(const attn_problem *p, tensor_side side, const float *x, float *out,
                    int to_stage) {
  size_t heads = (size_t)(side == SIDE_Q ? p->heads : attn_heads_kv(p));
  size_t rows = (size_t)(side == SIDE_Q ? p->seq_q : p->seq_kv), d = (size_t)p->head_dim;
  for (size_t b = 0; b < (size_t)p->batch; b++)
    for (size_t h = 0; h < heads; h++)
      for (size_t i = 0; i < rows; i++) {
        size_t host = ((b * heads + h) * rows + i) * d, stage = ((b * rows + i) * heads + h) * d;
        memcpy(out + (to_stage ? stage : host), x + (to_stage ? host : stage), d * sizeof(float));
      }
}

/* Uploads float values as the stage's dtype (half-precision stages get 16-bit values), in the
 * problem's layout. */
static void *upload_tensor(allocator *a, const attn_problem *p, tensor_side side, const float *x,
                           size_t n, const char *what) {
  attn_dtype t = p->dtype;
  void *d = dev_alloc(a, n * attn_dtype_size(t), what);
  float *ordered = NULL;
  if (p->layout == LAYOUT_BSHD) {
    ordered = attn_host_alloc(n * sizeof(float), what);
    reorder(p, side, x, ordered, 1);
    x = ordered;
  }
  if (t == DTYPE_FP32) {
    a->dev->upload(d, x, n * sizeof(float));
  } else {
    uint16_t *h = attn_host_alloc(n * sizeof(uint16_t), what);
    for (size_t i = 0; i < n; i++) h[i] = attn_float_to_half_bits(x[i], t);
    a->dev->upload(d, h, n * sizeof(uint16_t));
    free(h);
  }
  free(ordered);
  return d;
}

/* K or V as the stage sees it: with cache lengths, the rows past each sequence's L_b are NaN,
 * so that a stage that reads one into a result fails the check. The host copy, which the
 * reference and --save use, keeps the generated values. */
static void *upload_kv(allocator *a, const attn_problem *p, const float *x, const char *what) {
  size_t n = attn_kv_elems(p), d = (size_t)p->head_dim, nkv = (size_t)p->seq_kv;
  if (!p->cache_lens) return upload_tensor(a, p, SIDE_KV, x, n, what);
  float *poisoned = attn_host_alloc(n * sizeof(float), what);
  memcpy(poisoned, x, n * sizeof(float));
  for (long bh = 0; bh < (long)p->batch * attn_heads_kv(p); bh++)
    for (size_t j = (size_t)attn_cache_len(p, bh / attn_heads_kv(p)); j < nkv; j++)
      for (size_t c = 0; c < d; c++) poisoned[(bh * nkv + j) * d + c] = NAN;
  void *dev = upload_tensor(a, p, SIDE_KV, poisoned, n, what);
  free(poisoned);
  return dev;
}

/* Downloads a tensor into x as floats, in the host's order [B, heads, rows, d]. */
static void download_tensor(const attn_device *dev, const attn_problem *p, tensor_side side,
                            float *x, const void *d, size_t n) {
  attn_dtype t = p->dtype;
  float *got = p->layout == LAYOUT_BSHD ? attn_host_alloc(n * sizeof(float), "download") : x;
  if (t == DTYPE_FP32) {
    dev->download(got, d, n * sizeof(float));
  } else {
    uint16_t *h = attn_host_alloc(n * sizeof(uint16_t), "download");
    dev->download(h, d, n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) got[i] = attn_half_bits_to_float(h[i], t);
    free(h);
  }
  if (got != x) {
    reorder(p, side, got, x, 0);
    free(got);
  }
}

/* ---- timing ------------------------------------------------------------------------------- */

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median of `repeats` timed runs after `warmups` untimed ones; each timed run starts from a
 * cold L2 on the GPU (before_repeat). Only the stage's own launches are inside the timer. */
static double time_pass(const attn_device *dev, attn_pass_fn fn, const attn_problem *p,
                        const attn_buffers *t, int warmups, int repeats) {
  for (int i = 0; i < warmups; i++) {
    fn(p, t);
  }
  double *ms = attn_host_alloc(sizeof(double) * (size_t)repeats, "timings");
  for (int i = 0; i < repeats; i++) {
    dev->before_repeat();
    dev->timer_start();
    fn(p, t);
    ms[i] = dev->timer_stop_ms();
  }
  qsort(ms, (size_t)repeats, sizeof(double), compare_double);
  double median = repeats % 2 ? ms[repeats / 2] : 0.5 * (ms[repeats / 2 - 1] + ms[repeats / 2]);
  free(ms);
  return median;
}

/* ---- reporting ------------------------------------------------------------------------------ */

typedef struct {
  const char *direction; /* "fwd" or "bwd" */
  double ms, flops, err, tol;
  int checked, ok;
  char why[160]; /* what failed, naming the tensor (attn_check_verdict) */
  size_t workspace, device_bytes;
} pass_result;

static long peak_rss_bytes(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? ru.ru_maxrss * 1024L : -1;
}

static void human_bytes(char *buf, size_t len, double bytes) {
  const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, u++;
  snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", bytes, unit[u]);
}

/* The mask as the result line shows it: "causal" or "non-causal", then the window and the
 * softcap where given ("causal window=256,0 softcap=30"). */
static void mask_text(char *buf, size_t len, const attn_problem *p) {
  size_t used = (size_t)snprintf(buf, len, "%s", p->causal ? "causal" : "non-causal");
  if (p->windowed && used < len)
    used +=
        (size_t)snprintf(buf + used, len - used, " window=%d,%d", p->window_left, p->window_right);
  if (p->softcap > 0 && used < len)
    snprintf(buf + used, len - used, " softcap=%g", (double)p->softcap);
}

static void print_line(const attn_stage *s, const attn_problem *p, const pass_result *r) {
  char shape[192], heads[32] = "", lens[48] = "", ws[32], rate[32], check[256], mask[96];
  if (attn_heads_kv(p) != p->heads) snprintf(heads, sizeof heads, " Hkv=%d", attn_heads_kv(p));
  /* Varlen: how many sequences (Nq and Nkv are their totals). */
  if (p->seqs > 0)
    snprintf(heads + strlen(heads), sizeof heads - strlen(heads), " seqs=%d", p->seqs);
  if (p->cache_lens) {
    int lo = p->seq_kv, hi = 0;
    for (int b = 0; b < p->batch; b++)
      lo = p->cache_lens[b] < lo ? p->cache_lens[b] : lo,
      hi = p->cache_lens[b] > hi ? p->cache_lens[b] : hi;
    snprintf(lens, sizeof lens, " L=%d..%d", lo, hi);
  }
  const char *layout = p->layout == LAYOUT_BSHD ? " bshd" : "";
  if (p->seq_q == p->seq_kv && !p->cache_lens)
    snprintf(shape, sizeof shape, "B=%d H=%d%s N=%d d=%d%s", p->batch, p->heads, heads, p->seq_q,
             p->head_dim, layout);
  else
    snprintf(shape, sizeof shape, "B=%d H=%d%s Nq=%d Nkv=%d%s d=%d%s", p->batch, p->heads, heads,
             p->seq_q, p->seq_kv, lens, p->head_dim, layout);
  human_bytes(ws, sizeof ws, (double)r->workspace);
  double tflops = r->flops / (r->ms * 1e-3) / 1e12;
  if (tflops >= 1)
    snprintf(rate, sizeof rate, "%.2f TFLOP/s", tflops);
  else
    snprintf(rate, sizeof rate, "%.2f GFLOP/s", tflops * 1e3);
  if (r->checked)
    snprintf(check, sizeof check, "max err %.1e (tol %.1e) %s%s%s%s", r->err, r->tol,
             r->ok ? "ok" : "FAIL", r->ok ? "" : " (", r->ok ? "" : r->why, r->ok ? "" : ")");
  else
    snprintf(check, sizeof check, "not checked");
  mask_text(mask, sizeof mask, p);
  printf("%-18s %s %-28s %s %-10s | %s | %9.3f ms | %s | workspace %s\n", s->name, r->direction,
         shape, attn_dtype_name(p->dtype), mask, check, r->ms, rate, ws);
}

/* The --tsv table's header: a file that starts with another line is another table. The
 * columns up to date are those of the rows written before 13_window_softcap_varlen; window,
 * softcap, seqlens and seqlens_kv were added at the end, so that every older column keeps its
 * place, and hold "-" where the run has none. */
#define TSV_COLUMNS_BEFORE_WINDOW                                                                  \
  "stage\tdirection\tdtype\tB\tH\tNq\tNkv\td\tcausal\tms\ttflops\tworkspace_bytes\tdevice_bytes\t" \
  "peak_rss_bytes\tmax_err\ttol\tcheck\tdevice\tunits\tcuda\tdate"
#define TSV_HEADER TSV_COLUMNS_BEFORE_WINDOW "\twindow\tsoftcap\tseqlens\tseqlens_kv\n"
/* Set where the header went out before the run (a file that is not a regular file). */
static int tsv_header_written;

static void write_tsv(const char *path, const attn_stage *s, const attn_problem *p,
                      const attn_stamp *st, const pass_result *r) {
  FILE *f = fopen(path, "a");
  if (!f) attn_fail(EXIT_BAD_USAGE, "--tsv %s: %s", path, strerror(errno));
  if (!tsv_header_written && ftell(f) == 0) fputs(TSV_HEADER, f);
  tsv_header_written = 1;
  fprintf(f,
          "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%.6g\t%.6g\t%zu\t%zu\t%ld\t%.3g\t%.3g\t%s\t%s\t%d\t%"
          "s\t%s",
          s->name, r->direction, attn_dtype_name(p->dtype), p->batch, p->heads, p->seq_q, p->seq_kv,
          p->head_dim, p->causal, r->ms, r->flops / (r->ms * 1e-3) / 1e12, r->workspace,
          r->device_bytes, peak_rss_bytes(), r->checked ? r->err : NAN, r->checked ? r->tol : NAN,
          r->checked ? (r->ok ? "ok" : "fail") : "none", st->device, st->units, st->cuda, st->date);
  if (p->windowed)
    fprintf(f, "\t%d,%d", p->window_left, p->window_right);
  else
    fputs("\t-", f);
  if (p->softcap > 0)
    fprintf(f, "\t%.9g", (double)p->softcap); /* every digit: the row reruns the case */
  else
    fputs("\t-", f);
  /* The lengths, as --seqlens and --seqlens-kv take them (from the offsets). */
  for (int side = 0; side < 2; side++) {
    const int *cu = side == 0 ? p->cu_seqlens_q : p->cu_seqlens_k;
    fputs(p->seqs > 0 ? "\t" : "\t-", f);
    for (int q = 0; p->seqs > 0 && q < p->seqs; q++)
      fprintf(f, q ? ",%d" : "%d", cu[q + 1] - cu[q]);
  }
  fputc('\n', f);
  if (fclose(f) != 0) attn_fail(EXIT_BAD_USAGE, "--tsv %s: write failed", path);
}

/* Refuses, with exit 2, a problem whose host-side arrays cannot fit in physical memory
 * (Linux would otherwise promise the memory and kill the process later). */
static void check_host_memory(const attn_stage *s, const options *o) {
  const attn_problem *p = &o->p;
  /* In double, not size_t: B x H x N x d of sizes up to 2^24 can wrap a 64-bit count. */
  double nlse = (double)p->batch * p->heads * p->seq_q;
  double nq = nlse * p->head_dim,
         nkv = (double)p->batch * attn_heads_kv(p) * p->seq_kv * p->head_dim;
  double grads = o->backward ? 2 * nq + 2 * nkv : 0;
  double bytes = 4 * (2 * nq + 2 * nkv + 2 * nlse + 2 * grads); /* inputs, outputs, copies */
  /* With cache lengths, K or V is copied once more, with NaN past the caches, to upload it. */
  if (p->cache_lens) bytes += 4 * nkv;
  /* With --layout bshd, each tensor is reordered into a copy of its own to upload or download
   * it (one at a time: the largest counts). */
  if (p->layout == LAYOUT_BSHD) bytes += 4 * (nq > nkv ? nq : nkv);
  if (s->device == &attn_host_device) /* the CPU stage's own buffers live here too */
    bytes += 4 * (2 * nq + 2 * nkv + nlse + grads) +
             (s->forward_workspace ? (double)s->forward_workspace(p) : 0);
  if (o->check) bytes += 8 * (2 * nq + 2 * nkv + nlse + grads); /* the float64 reference */
  double physical = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  if (physical > 0 && bytes > physical)
    attn_fail(EXIT_BAD_USAGE,
              "problem too large for host memory: needs %.1f GiB, the host has %.1f GiB",
              bytes / 1073741824.0, physical / 1073741824.0);
}

/* Whether the file system holding fd has no block left for an ordinary user. */
static int statvfs_full(int fd) {
  struct statvfs v;
  return fstatvfs(fd, &v) == 0 && v.f_bavail == 0;
}

/* Refuses, before any computing, a --tsv file or --save folder that cannot be written: a
 * typo in a path should cost a second, not the minutes of a long run. The TSV file is opened
 * for appending; one that did not exist is removed again, so that a run refused later leaves
 * nothing behind (write_tsv writes the header when it creates the file); one that holds
 * another table (another first line) is refused, and a full file system too. The --save
 * folder is created, and a probe file created in it and removed. */
static void check_outputs_writable(const options *o) {
  if (o->tsv_path) {
    int fd = open(o->tsv_path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL, 0666);
    int created = fd >= 0;
    if (fd < 0 && errno == EEXIST) fd = open(o->tsv_path, O_RDWR | O_APPEND);
    if (fd < 0 && errno == EACCES) fd = open(o->tsv_path, O_WRONLY | O_APPEND);
    if (fd < 0) attn_fail(EXIT_BAD_USAGE, "--tsv %s: %s", o->tsv_path, strerror(errno));
    struct stat st;
    int regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (regular && st.st_size > 0) {
      /* Rows appended under another header would be read as that table's columns. */
      char head[sizeof TSV_HEADER] = "";
      ssize_t n = pread(fd, head, sizeof head - 1, 0);
      head[n > 0 ? n : 0] = 0;
      if (strcmp(head, TSV_HEADER) != 0) {
        close(fd);
        if (strncmp(head, TSV_COLUMNS_BEFORE_WINDOW "\n", strlen(TSV_COLUMNS_BEFORE_WINDOW) + 1) ==
            0)
          attn_fail(EXIT_BAD_USAGE,
                    "--tsv %s: the file holds this program's table from before the window, "
                    "softcap, seqlens and seqlens_kv columns; give a new file",
                    o->tsv_path);
        attn_fail(EXIT_BAD_USAGE,
                  "--tsv %s: the file holds another table (its first line is not this "
                  "program's header); give a new file",
                  o->tsv_path);
      }
    } else if (!regular) {
      /* A device or a pipe: the header goes out now, so that one that cannot take a write
       * (/dev/full) is refused before the run, not after it. */
      size_t len = strlen(TSV_HEADER);
      if (write(fd, TSV_HEADER, len) != (ssize_t)len) {
        int e = errno;
        close(fd);
        attn_fail(EXIT_BAD_USAGE, "--tsv %s: %s", o->tsv_path, strerror(e));
      }
      tsv_header_written = 1;
    } else if (statvfs_full(fd)) {
      close(fd);
      if (created) unlink(o->tsv_path);
      attn_fail(EXIT_BAD_USAGE, "--tsv %s: %s", o->tsv_path, strerror(ENOSPC));
    }
    close(fd);
    if (created) unlink(o->tsv_path);
  }
  if (o->save_dir) {
    if (mkdir(o->save_dir, 0777) == 0)
      snprintf(owned_dir, sizeof owned_dir, "%s", o->save_dir);
    else if (errno != EEXIST)
      attn_fail(EXIT_BAD_USAGE, "--save %s: %s", o->save_dir, strerror(errno));
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/.attn_write_probe_%ld", o->save_dir, (long)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0) attn_fail(EXIT_BAD_USAGE, "--save %s: %s", o->save_dir, strerror(errno));
    close(fd);
    unlink(probe);
  }
}

/* ATTN_TEST_FAULT, for the tests of the check itself (never for a measurement): spoils what
 * the stage returned, after it returned and before the check, so that a test can prove the
 * check catches it on every stage, CPU and GPU alike. "halve-o": every element of O halved;
 * "nan-dq", "nan-dk", "nan-dv": one element of that gradient made NaN. */
static void apply_test_fault(const attn_problem *p, float *o, float **grads) {
  const char *fault = getenv("ATTN_TEST_FAULT");
  if (!fault || !*fault) return;
  const char *names[3] = {"nan-dq", "nan-dk", "nan-dv"};
  if (strcmp(fault, "halve-o") == 0) {
    for (size_t e = 0; o && e < attn_q_elems(p); e++) o[e] *= 0.5f;
    return;
  }
  for (int g = 0; g < 3; g++)
    if (strcmp(fault, names[g]) == 0) {
      if (grads && grads[g]) grads[g][0] = NAN;
      return;
    }
  attn_fail(EXIT_BAD_USAGE, "ATTN_TEST_FAULT must be halve-o, nan-dq, nan-dk or nan-dv, got '%s'",
            fault);
}

/* ---- the program ------------------------------------------------------------------------------
 */

int attention_main(const attn_stage *s, int argc, char **argv) {
  attn_program_name = s->name;
  options o;
  parse_options(s, argc, argv, &o);
  install_cleanup();
  check_outputs_writable(&o);
  if (o.load_dir) shape_from_files(&o);
  attn_problem *p = &o.p;
  if (!o.given_scale) p->scale = (float)(1.0 / sqrt((double)p->head_dim));
  if (p->heads_kv == 0) p->heads_kv = p->heads; /* neither --heads-kv nor a k.npy said */
  validate_for_stage(s, &o);
  parse_cache_lens(&o);

  /* Host inputs, as the stage sees them (rounded to its dtype). */
  host_inputs in = {0};
  size_t nq = attn_q_elems(p), nkv = attn_kv_elems(p), nlse = attn_lse_elems(p);
  check_host_memory(s, &o);
  in.q = attn_host_alloc(nq * sizeof(float), "Q");
  in.k = attn_host_alloc(nkv * sizeof(float), "K");
  in.v = attn_host_alloc(nkv * sizeof(float), "V");
  if (o.backward) in.d_o = attn_host_alloc(nq * sizeof(float), "dO");
  if (o.load_dir)
    load_inputs(&o, &in);
  else {
    make_inputs(&o, &in);
    snprintf(attn_failure_note, sizeof attn_failure_note, " (seed %llu)",
             (unsigned long long)o.seed);
  }
  apply_pattern(&o, &in);
  round_inputs_or_refuse(&o, &in);

  attn_stamp stamp;
  memset(&stamp, 0, sizeof stamp);
  time_t now = time(NULL);
  strftime(stamp.date, sizeof stamp.date, "%Y-%m-%d", gmtime(&now));
  int rc = s->device->open(&stamp);
  if (rc != EXIT_OK) return rc;

  /* Device buffers; outputs are poisoned so that an element the stage forgot is a NaN. */
  allocator a = {s->device, 0};
  attn_buffers t = {0};
  t.q = upload_tensor(&a, p, SIDE_Q, in.q, nq, "Q");
  t.k = upload_kv(&a, p, in.k, "K");
  t.v = upload_kv(&a, p, in.v, "V");
  if (p->cache_lens) { /* the stage's own copy, uploaded once, before anything is timed */
    void *lens = dev_alloc(&a, sizeof(int) * (size_t)p->batch, "cache lengths");
    s->device->upload(lens, p->cache_lens, sizeof(int) * (size_t)p->batch);
    t.cache_lens = lens;
  }
  if (p->seqs > 0) { /* the same for the varlen offsets */
    size_t bytes = sizeof(int) * ((size_t)p->seqs + 1);
    void *cu_q = dev_alloc(&a, bytes, "cu_seqlens_q"), *cu_k = dev_alloc(&a, bytes, "cu_seqlens_k");
    s->device->upload(cu_q, p->cu_seqlens_q, bytes);
    s->device->upload(cu_k, p->cu_seqlens_k, bytes);
    t.cu_seqlens_q = cu_q, t.cu_seqlens_k = cu_k;
  }
  t.o = dev_alloc(&a, nq * attn_dtype_size(p->dtype), "O");
  t.lse = dev_alloc(&a, nlse * sizeof(float), "LSE");
  size_t fwd_workspace = s->forward_workspace ? s->forward_workspace(p) : 0;
  size_t bwd_workspace = o.backward && s->backward_workspace ? s->backward_workspace(p) : 0;
  size_t workspace = fwd_workspace > bwd_workspace ? fwd_workspace : bwd_workspace;
  t.workspace = workspace ? dev_alloc(&a, workspace, "workspace") : NULL;
  if (o.backward) {
    t.d_o = upload_tensor(&a, p, SIDE_Q, in.d_o, nq, "dO");
    t.dq = dev_alloc(&a, nq * attn_dtype_size(p->dtype), "dQ");
    t.dk = dev_alloc(&a, nkv * attn_dtype_size(p->dtype), "dK");
    t.dv = dev_alloc(&a, nkv * attn_dtype_size(p->dtype), "dV");
  }
  s->device->fill_nan(t.o, nq, p->dtype);
  s->device->fill_nan(t.lse, nlse, DTYPE_FP32);

  pass_result fwd = {
      .direction = "fwd", .flops = attn_forward_flops(p), .workspace = fwd_workspace};
  float *o_host = attn_host_alloc(nq * sizeof(float), "O");
  float *lse_host = attn_host_alloc(nlse * sizeof(float), "LSE");

  /* A long run says so before it starts, then shows progress (see estimate_forward_s). */
  int warmups = o.bench ? s->device->bench_warmups : s->device->quick_warmups;
  int repeats = o.bench ? s->device->bench_repeats : s->device->quick_repeats;
  double pass_s = estimate_forward_s(s, p);
  int time_first_pass = pass_s > TIME_ONE_PASS_S && !o.bench;
  double rows = (double)p->batch * p->heads * p->seq_q, macs = (double)p->seq_kv * p->head_dim;
  if (rows * macs > FULL_CHECK_MAX_MACS) rows = fmin(rows, fmax(256, 2.0 * p->batch * p->heads));
  double check_s = o.check ? 3 * rows * macs / REFERENCE_MACS_PER_S : 0; /* the reference, the
                                                    conditioning term, the closed forms */
  double run_s = pass_s * (1 + (time_first_pass ? 0 : warmups + repeats)) + check_s;
  pthread_t progress;
  int progress_on = 0;
  if (pass_s > 0 && run_s > LONG_RUN_S) {
    char total[32], pass[32], check[32];
    human_duration(total, sizeof total, run_s);
    human_duration(pass, sizeof pass, pass_s);
    human_duration(check, sizeof check, check_s);
    fprintf(stderr,
            "%s: this run will take about %s (a forward pass about %s, %d pass%s; the float64 "
            "check about %s), estimated from a small problem; Ctrl-C stops it cleanly\n",
            s->name, total, pass, time_first_pass ? 1 : 1 + warmups + repeats,
            time_first_pass ? ", timed once" : "es", check);
    progress_estimate_s = run_s;
    atomic_store(&progress_phase, "the forward");
    progress_on = pthread_create(&progress, NULL, progress_thread, NULL) == 0;
  }
  double first_begin = now_s();
  s->forward(p, &t);
  double first_ms = (now_s() - first_begin) * 1e3;
  atomic_store(&progress_phase, "the float64 check");
  download_tensor(s->device, p, SIDE_Q, o_host, t.o, nq);
  s->device->download(lse_host, t.lse, nlse * sizeof(float));
  apply_test_fault(p, o_host, NULL);

  attn_check_inputs ci = {p, in.q, in.k, in.v, in.d_o, o.seed, s->saves_lse};
  int failed = 0;
  if (o.check) {
    attn_check_forward(&ci, o_host, lse_host, o.pattern == PATTERN_CONST_V,
                       o.pattern == PATTERN_ZERO_Q, &fwd.err, &fwd.tol, &fwd.ok);
    snprintf(fwd.why, sizeof fwd.why, "%s", attn_check_verdict());
    fwd.checked = 1;
    failed |= !fwd.ok;
  }

  pass_result bwd = {
      .direction = "bwd", .flops = attn_backward_flops(p), .workspace = bwd_workspace};
  float *grads[3] = {NULL, NULL, NULL};
  if (o.backward) {
    void *dgrad[3] = {t.dq, t.dk, t.dv};
    size_t counts[3] = {nq, nkv, nkv};
    for (int g = 0; g < 3; g++) s->device->fill_nan(dgrad[g], counts[g], p->dtype);
    s->backward(p, &t);
    for (int g = 0; g < 3; g++) {
      grads[g] = attn_host_alloc(counts[g] * sizeof(float), "gradient");
      download_tensor(s->device, p, g == 0 ? SIDE_Q : SIDE_KV, grads[g], dgrad[g], counts[g]);
    }
    apply_test_fault(p, NULL, grads);
    if (o.check) {
      attn_check_backward(&ci, o_host, lse_host, grads[0], grads[1], grads[2], &bwd.err, &bwd.tol,
                          &bwd.ok);
      snprintf(bwd.why, sizeof bwd.why, "%s", attn_check_verdict());
      bwd.checked = 1;
      failed |= !bwd.ok;
    }
  }

  if (o.check_finite) {
    int ok = attn_check_finite(&ci, o_host, lse_host, grads[0], grads[1], grads[2]);
    printf("%s: every output finite%s: %s\n", s->name,
           s->saves_lse ? ", LSE -inf exactly on the rows that see no key" : "", ok ? "yes" : "NO");
    failed |= !ok;
  }

  atomic_store(&progress_phase, "timing the passes");
  /* A long pass is timed once, from the checked run (a CPU stage: no cache to warm). */
  fwd.ms = time_first_pass ? first_ms : time_pass(s->device, s->forward, p, &t, warmups, repeats);
  fwd.device_bytes = a.bytes;
  bwd.device_bytes = a.bytes;
  if (o.backward) bwd.ms = time_pass(s->device, s->backward, p, &t, warmups, repeats);

  print_line(s, p, &fwd);
  if (o.backward) print_line(s, p, &bwd);
  if (o.tsv_path) {
    write_tsv(o.tsv_path, s, p, &stamp, &fwd);
    if (o.backward) write_tsv(o.tsv_path, s, p, &stamp, &bwd);
  }
  if (o.save_dir) { /* the folder exists: check_outputs_writable() made it */
    size_t q_shape[4] = {(size_t)p->batch, (size_t)p->heads, (size_t)p->seq_q, (size_t)p->head_dim};
    size_t kv_shape[4] = {q_shape[0], (size_t)attn_heads_kv(p), (size_t)p->seq_kv, q_shape[3]};
    /* The inputs as the stage saw them, so that --load of this folder reruns the case. */
    save_array(&o, "q.npy", in.q, q_shape, 4);
    save_array(&o, "k.npy", in.k, kv_shape, 4);
    save_array(&o, "v.npy", in.v, kv_shape, 4);
    if (o.backward) save_array(&o, "do.npy", in.d_o, q_shape, 4);
    save_array(&o, "o.npy", o_host, q_shape, 4);
    if (s->saves_lse) save_array(&o, "lse.npy", lse_host, q_shape, 3);
    if (o.backward) {
      save_array(&o, "dq.npy", grads[0], q_shape, 4);
      save_array(&o, "dk.npy", grads[1], kv_shape, 4);
      save_array(&o, "dv.npy", grads[2], kv_shape, 4);
    }
  }

  run_complete = 1; /* every output written: nothing to remove at exit */
  if (progress_on) {
    atomic_store(&progress_stop, 1);
    pthread_join(progress, NULL);
  }

  void *device_buffers[] = {(void *)t.q,
                            (void *)t.k,
                            (void *)t.v,
                            t.o,
                            t.lse,
                            t.workspace,
                            (void *)t.d_o,
                            t.dq,
                            t.dk,
                            t.dv,
                            (void *)t.cache_lens,
                            (void *)t.cu_seqlens_q,
                            (void *)t.cu_seqlens_k};
  for (size_t i = 0; i < sizeof device_buffers / sizeof *device_buffers; i++)
    if (device_buffers[i]) s->device->release(device_buffers[i]);
  free(in.q), free(in.k), free(in.v), free(in.d_o), free(o_host), free(lse_host);
  free(o.cache_lens), free(o.cu_seqlens_q), free(o.cu_seqlens_k);
  for (int g = 0; g < 3; g++) free(grads[g]);
  if (failed) fprintf(stderr, "%s: check FAILED%s\n", s->name, attn_failure_note);
  return failed ? EXIT_CHECK_FAILED : EXIT_OK;
}
