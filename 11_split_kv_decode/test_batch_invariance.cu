/* The batch-invariant mode of the decode path (ATTN_DECODE_BATCH_INVARIANT=1, see plan_chunks
 * in attention.cu, compiled here unchanged): a sequence decoded inside a batch of others and
 * the same sequence decoded alone (B = 1, its own Q, K, V and cache length, in a cache whose
 * capacity is its own length) give the same O and LSE, bit for bit.
 *
 * A batch of 6 sequences, one cache much longer than the others (20000 keys: 20 of the mode's
 * chunks, and a split by the rule unlike the one each of the others gets alone) and lengths on
 * a chunk's end (1024, 3072), one key past it (1025), off it (2999) and 1; and a batch in
 * chunks forced to 128 keys (ATTN_DECODE_CHUNK_KEYS, which the mode keeps as fixed) with an
 * empty cache. fp16 and bf16, d = 64 and 128, Nq = 1 and 4, causal and not, 4 query heads a
 * K/V head (one row fragment); 8 (Nq = 4, d = 128: 32 rows, two fragments); and 32 on one
 * K/V head (Nq = 4: 128 rows), which takes 09's path, batch-invariant without the mode, so
 * there the default must give the same bits too. Keys past a cache's length hold NaN, as the
 * harness's do, and O and LSE start as NaN: a value read or left unwritten fails.
 *
 * Each case also decodes both ways without the mode and prints how many sequences then
 * differed, which shows that the comparison can see what the mode prevents (not a failure:
 * the rule's bits are the same for the same problem, not across batches).
 * Exit 0 when all hold, 1 on a difference (with the seed), 77 without a CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define main attn_stage_program_main
#include "attention.cu"
#undef main

#include "expect.h"

enum { MaxBatch = 6 };
/* The batches' cache lengths and capacities (see above). */
static const int LensRule[MaxBatch] = {20000, 1, 1024, 1025, 3072, 2999};
static const int LensForced[MaxBatch] = {700, 0, 1, 128, 129, 256};
static const int ForcedChunkKeys = 128;
/* A row's result: O in the dtype's bits and LSE, as the stage leaves them. */
typedef struct {
  uint16_t *o;
  float *lse;
} outputs;

/* O and LSE of problem p on inputs q, k, v (host bits of p's dtype) from the stage's forward,
 * in the mode or not. O and LSE start as NaN (all bits set). */
static outputs decode(const attn_problem *p, const uint16_t *q, const uint16_t *k,
                      const uint16_t *v, bool invariant) {
  if (invariant)
    setenv("ATTN_DECODE_BATCH_INVARIANT", "1", 1);
  else
    unsetenv("ATTN_DECODE_BATCH_INVARIANT");
  size_t q_bytes = attn_q_elems(p) * sizeof(uint16_t),
         kv_bytes = attn_kv_elems(p) * sizeof(uint16_t);
  size_t lse_bytes = attn_lse_elems(p) * sizeof(float), ws_bytes = forward_workspace(p);
  void *dq, *dk, *dv, *d_o, *dws;
  float *dlse;
  int *dlens;
  CUDA_CHECK(cudaMalloc(&dq, q_bytes));
  CUDA_CHECK(cudaMalloc(&dk, kv_bytes));
  CUDA_CHECK(cudaMalloc(&dv, kv_bytes));
  CUDA_CHECK(cudaMalloc(&d_o, q_bytes));
  CUDA_CHECK(cudaMalloc(&dlse, lse_bytes));
  CUDA_CHECK(cudaMalloc(&dlens, p->batch * sizeof(int)));
  CUDA_CHECK(cudaMalloc(&dws, ws_bytes ? ws_bytes : 1));
  CUDA_CHECK(cudaMemcpy(dq, q, q_bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dk, k, kv_bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dv, v, kv_bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dlens, p->cache_lens, p->batch * sizeof(int), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(d_o, 0xff, q_bytes)); /* NaN in fp16, bf16 and fp32 alike */
  CUDA_CHECK(cudaMemset(dlse, 0xff, lse_bytes));
  attn_buffers t = {dq, dk, dv, d_o, dlse, NULL, NULL, NULL, NULL, dws, dlens};
  forward(p, &t);
  CUDA_CHECK(cudaDeviceSynchronize());
  outputs out = {(uint16_t *)attn_host_alloc(q_bytes, "O"),
                 (float *)attn_host_alloc(lse_bytes, "LSE")};
  CUDA_CHECK(cudaMemcpy(out.o, d_o, q_bytes, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(out.lse, dlse, lse_bytes, cudaMemcpyDeviceToHost));
  void *buffers[] = {dq, dk, dv, d_o, dlse, dlens, dws};
  for (void *b : buffers) CUDA_CHECK(cudaFree(b));
  return out;
}

static void release(outputs out) { free(out.o), free(out.lse); }

/* Whether sequence b's O and LSE in the batch (rows b H Nq on) match those decoded alone. */
static bool same_bits(const attn_problem *p, outputs batch, outputs alone, int b) {
  size_t rows = (size_t)p->heads * p->seq_q, o_elems = rows * p->head_dim;
  return memcmp(batch.o + b * o_elems, alone.o, o_elems * sizeof(uint16_t)) == 0 &&
         memcmp(batch.lse + b * rows, alone.lse, rows * sizeof(float)) == 0;
}

/* The first NaN in O or LSE (a value the stage read past a cache or never wrote), or -1. */
static long first_nan(const attn_problem *p, outputs out) {
  for (size_t e = 0; e < attn_q_elems(p); e++)
    if (isnan(attn_half_bits_to_float(out.o[e], p->dtype))) return (long)e;
  for (size_t r = 0; r < attn_lse_elems(p); r++)
    if (isnan(out.lse[r])) return (long)r;
  return -1;
}

/* One case: the batch in the mode and not, then each sequence alone both ways. `path09`: the
 * shape takes 09's path, where the default must be batch-invariant too. */
static void run_case(int heads, int heads_kv, int nq, int d, attn_dtype dtype, int causal,
                     const int *lens, int forced_chunk, uint64_t seed) {
  int batch = MaxBatch, nkv = 1;
  for (int b = 0; b < batch; b++) nkv = max(nkv, lens[b]);
  attn_problem p = {batch, heads,    nq,   nkv,        d, causal, 1.f / sqrtf((float)d),
                    dtype, heads_kv, lens, LAYOUT_BHND};
  bool path09 = !decode_shaped(&p, d);
  if (forced_chunk) {
    char text[16];
    snprintf(text, sizeof text, "%d", forced_chunk);
    setenv("ATTN_DECODE_CHUNK_KEYS", text, 1);
  } else {
    unsetenv("ATTN_DECODE_CHUNK_KEYS");
  }
  /* Q, then K and V head by head: normal samples rounded to the dtype, NaN past L_b. */
  attn_rng rng;
  attn_rng_seed(&rng, seed);
  uint16_t nan_bits = attn_float_to_half_bits(NAN, dtype);
  uint16_t *q = (uint16_t *)attn_host_alloc(attn_q_elems(&p) * sizeof(uint16_t), "Q");
  uint16_t *k = (uint16_t *)attn_host_alloc(attn_kv_elems(&p) * sizeof(uint16_t), "K");
  uint16_t *v = (uint16_t *)attn_host_alloc(attn_kv_elems(&p) * sizeof(uint16_t), "V");
  for (size_t e = 0; e < attn_q_elems(&p); e++)
    q[e] = attn_float_to_half_bits((float)attn_rng_normal(&rng), dtype);
  for (uint16_t *x : {k, v})
    for (size_t e = 0; e < attn_kv_elems(&p); e++) {
      long row = (long)(e / d), b = row / nkv / heads_kv;
      x[e] = row % nkv < lens[b] ? attn_float_to_half_bits((float)attn_rng_normal(&rng), dtype)
                                 : nan_bits;
    }
  char what[160], chunk[48] = "";
  if (forced_chunk) snprintf(chunk, sizeof chunk, " ATTN_DECODE_CHUNK_KEYS=%d", forced_chunk);
  snprintf(what, sizeof what, "%s d=%d Nq=%d%s H=%d Hkv=%d%s (seed %llu)", attn_dtype_name(dtype),
           d, nq, causal ? " causal" : "", heads, heads_kv, chunk, (unsigned long long)seed);
  outputs in_batch[2] = {decode(&p, q, k, v, false), decode(&p, q, k, v, true)};
  int differ[2] = {0, 0};
  for (int mode = 0; mode < 2; mode++)
    EXPECT(first_nan(&p, in_batch[mode]) < 0, "%s: the batch%s leaves a NaN at %ld", what,
           mode ? " in the mode" : "", first_nan(&p, in_batch[mode]));
  size_t q_head = (size_t)heads * nq * d, kv_head = (size_t)nkv * d;
  for (int b = 0; b < batch; b++) {
    /* Sequence b alone: B = 1, its cache's capacity its own length (at least 1 key). */
    int len = lens[b], cap = max(1, len);
    attn_problem one = {1,       heads, nq,       cap,      d,          causal,
                        p.scale, dtype, heads_kv, &lens[b], LAYOUT_BHND};
    uint16_t *k1 = (uint16_t *)attn_host_alloc(attn_kv_elems(&one) * sizeof(uint16_t), "K");
    uint16_t *v1 = (uint16_t *)attn_host_alloc(attn_kv_elems(&one) * sizeof(uint16_t), "V");
    for (int h = 0; h < heads_kv; h++) {
      size_t from = ((size_t)b * heads_kv + h) * kv_head, to = (size_t)h * cap * d;
      memcpy(k1 + to, k + from, (size_t)cap * d * sizeof(uint16_t));
      memcpy(v1 + to, v + from, (size_t)cap * d * sizeof(uint16_t));
    }
    for (int mode = 0; mode < 2; mode++) {
      outputs alone = decode(&one, q + b * q_head, k1, v1, mode == 1);
      EXPECT(first_nan(&one, alone) < 0, "%s: sequence %d alone%s leaves a NaN", what, b,
             mode ? " in the mode" : "");
      bool same = same_bits(&p, in_batch[mode], alone, b);
      differ[mode] += !same;
      if (!same && (mode == 1 || path09)) /* a failure below: which sequence */
        fprintf(stderr, "%s%s: sequence %d (%d keys) alone differs from itself in the batch\n",
                what, mode ? " in the mode" : "", b, len);
      release(alone);
    }
    free(k1), free(v1);
  }
  EXPECT(differ[1] == 0,
         "%s: in the batch-invariant mode, %d of %d sequences decoded alone "
         "differ from the same sequences in the batch",
         what, differ[1], batch);
  if (path09)
    EXPECT(differ[0] == 0,
           "%s: on 09's path, %d of %d sequences decoded alone differ from "
           "the same sequences in the batch",
           what, differ[0], batch);
  printf("%-62s %s: mode %d of %d sequences differ alone, default %d\n", what,
         path09 ? "09's path" : "decode", differ[1], batch, differ[0]);
  release(in_batch[0]), release(in_batch[1]);
  free(q), free(k), free(v);
}

int main(void) {
  attn_program_name = "11_split_kv_decode_batch_invariance";
  int devices = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fprintf(stderr, "%s: skipped: no CUDA device\n", attn_program_name);
    return EXIT_NO_DEVICE;
  }
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 8) { /* as the stage program: compute capability 8.0 and later */
    fprintf(stderr, "%s: skipped: no CUDA device of compute capability 8.0 or later\n",
            attn_program_name);
    return EXIT_NO_DEVICE;
  }
  const uint64_t first_seed = 42;
  uint64_t seed = first_seed;
  for (attn_dtype dtype : {DTYPE_FP16, DTYPE_BF16})
    for (int causal = 0; causal < 2; causal++) {
      for (int d : {64, 128})
        for (int nq : {1, 4}) {
          run_case(8, 2, nq, d, dtype, causal, LensRule, 0, seed++);
          run_case(8, 2, nq, d, dtype, causal, LensForced, ForcedChunkKeys, seed++);
        }
      run_case(16, 2, 4, 128, dtype, causal, LensRule, 0, seed++); /* 32 rows: two fragments */
      for (int d : {64, 128}) run_case(32, 1, 4, d, dtype, causal, LensRule, 0, seed++);
    }
  unsetenv("ATTN_DECODE_CHUNK_KEYS");
  unsetenv("ATTN_DECODE_BATCH_INVARIANT");
  printf("batch invariance: %llu cases, %d failures\n", (unsigned long long)(seed - first_seed),
         failures);
  return failures ? 1 : 0;
}
