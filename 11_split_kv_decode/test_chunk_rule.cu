/* The decode path's chunk rule (plan_chunks in attention.cu, compiled here unchanged) on the
 * CPU, over many shapes and GPU sizes: the chunks cover every sequence's keys in whole tiles,
 * the longest sequence has no empty chunk, a chunk holds at least MinChunkKeys keys where
 * the cache has them, the grid asks for about DecodeBlocksPerSm blocks an SM where the keys
 * allow and never many more, a merge follows exactly where a sequence has more than one chunk,
 * and ATTN_DECODE_CHUNK_KEYS sets the chunk length. In the batch-invariant mode
 * (ATTN_DECODE_BATCH_INVARIANT=1), the chunk length is BatchInvariantChunkKeys whatever the
 * batch and the GPU, and the merge always follows. Then the plans of the decode benchmark's
 * shapes on an H100 (132 SMs), printed.
 * Exit 0 when all hold. */
#include <stdio.h>
#include <stdlib.h>

#define main attn_stage_program_main
#include "attention.cu"
#undef main

#include "expect.h"

/* B sequences, the first holding `len` keys and the others half as many (ragged). */
static decode_plan plan_for(int batch, int heads_kv, int len, long sms, int *lens) {
  for (int b = 0; b < batch; b++) lens[b] = b == 0 ? len : len / 2;
  attn_problem p = {batch,      4 * heads_kv, 1,    len > 0 ? len : 1, 128, 0, 1.f,
                    DTYPE_FP16, heads_kv,     lens, LAYOUT_BHND};
  return plan_chunks(&p, sms);
}

int main(void) {
  const int batches[] = {1, 3, 8, 32, 64}, heads_kv[] = {1, 8, 32};
  const int lens[] = {0,    1,    63,   64,    65,     127,    128,    129,
                      1000, 1024, 4096, 32768, 100000, 131072, 1 << 24};
  const long sm_counts[] = {1, 7, 46, 108, 132, 144, 1056};
  static int cache_lens[64];
  int cases = 0;
  unsetenv("ATTN_DECODE_CHUNK_KEYS");
  unsetenv("ATTN_DECODE_BATCH_INVARIANT");
  for (int batch : batches)
    for (int hkv : heads_kv)
      for (int len : lens)
        for (long sms : sm_counts) {
          decode_plan plan = plan_for(batch, hkv, len, sms, cache_lens);
          long pairs = (long)batch * hkv, blocks = pairs * plan.chunks;
          long wanted = DecodeBlocksPerSm * sms, by_keys = pairs * max(1, len / MinChunkKeys);
          const char *why[7] = {"not whole tiles",
                                "the keys are not covered",
                                "the longest sequence has an empty chunk",
                                "chunks shorter than MinChunkKeys",
                                "fewer than half the blocks asked",
                                "more blocks than asked",
                                "a merge where there is one chunk, or none where there are more"};
          bool holds[7] = {plan.chunk_keys > 0 && plan.chunk_keys % DecodeKeys == 0,
                           plan.chunks >= 1 && (long)plan.chunks * plan.chunk_keys >= len,
                           len == 0 || (long)(plan.chunks - 1) * plan.chunk_keys < len,
                           len < MinChunkKeys || plan.chunk_keys >= MinChunkKeys,
                           2 * blocks >= min(wanted, by_keys),
                           blocks <= max(pairs, wanted + pairs),
                           plan.merge == (plan.chunks > 1)};
          cases++;
          for (int k = 0; k < 7; k++)
            EXPECT(holds[k], "B=%d Hkv=%d L=%d SMs=%ld: chunk_keys %d, chunks %d: %s", batch, hkv,
                   len, sms, plan.chunk_keys, plan.chunks, why[k]);
        }
  /* The chunk length forced from the environment, as the boundary tests set it. */
  setenv("ATTN_DECODE_CHUNK_KEYS", "128", 1);
  for (int len : lens) {
    decode_plan plan = plan_for(3, 8, len, 132, cache_lens);
    cases++;
    EXPECT(plan.chunk_keys == 128 && plan.chunks == max(1, (len + 127) / 128),
           "ATTN_DECODE_CHUNK_KEYS=128, L=%d: chunk_keys %d, chunks %d", len, plan.chunk_keys,
           plan.chunks);
  }
  unsetenv("ATTN_DECODE_CHUNK_KEYS");

  /* The batch-invariant mode: every shape and GPU size gets the fixed length, covering the
   * longest cache, and a merge; so sequence b's chunks (the first ceil(L_b / chunk_keys)) are
   * those it gets alone. With ATTN_DECODE_CHUNK_KEYS too, that length, as fixed. */
  setenv("ATTN_DECODE_BATCH_INVARIANT", "1", 1);
  for (int forced : {0, 128}) {
    if (forced) setenv("ATTN_DECODE_CHUNK_KEYS", "128", 1);
    int keys = forced ? forced : BatchInvariantChunkKeys;
    for (int batch : batches)
      for (int hkv : heads_kv)
        for (int len : lens)
          for (long sms : sm_counts) {
            decode_plan plan = plan_for(batch, hkv, len, sms, cache_lens);
            cases++;
            EXPECT(plan.chunk_keys == keys && plan.chunks == max(1, (len + keys - 1) / keys) &&
                       plan.merge,
                   "batch-invariant, chunk %d: B=%d Hkv=%d L=%d SMs=%ld: chunk_keys %d, chunks "
                   "%d, merge %d",
                   keys, batch, hkv, len, sms, plan.chunk_keys, plan.chunks, plan.merge);
          }
  }
  unsetenv("ATTN_DECODE_CHUNK_KEYS");
  unsetenv("ATTN_DECODE_BATCH_INVARIANT");

  printf("the decode benchmark's plans on an H100 (Hkv = 8, d = 128, 132 SMs):\n");
  printf("  B   L      chunk_keys  chunks  blocks  per SM\n");
  for (int batch : {1, 8, 32})
    for (int len = 1024; len <= 131072; len *= 2) {
      for (int b = 0; b < batch; b++) cache_lens[b] = len;
      attn_problem p = {batch, 32, 1, len, 128, 0, 1.f, DTYPE_FP16, 8, cache_lens, LAYOUT_BHND};
      decode_plan plan = plan_chunks(&p, 132);
      long blocks = (long)batch * 8 * plan.chunks;
      printf("  %-3d %-6d %-11d %-7d %-7ld %.1f\n", batch, len, plan.chunk_keys, plan.chunks,
             blocks, blocks / 132.0);
    }
  printf("chunk rule: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
