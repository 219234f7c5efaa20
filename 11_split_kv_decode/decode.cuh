/* Stage 11's decode path (FlashDecoding): a block per (sequence, K/V head, chunk of keys),
 * then the merge of each row's chunks (merge.cuh). Included by forward.cuh after 09's forward
 * kernels, whose steps it reuses. */
#pragma once

/* ---- the decode path ------------------------------------------------------------------ */

/* Decode: each sequence brings a few new queries (Nq; 1 for a model generating a token at a
 * time) against a cache of L_b keys. The grid above has a block per 128 query rows of one
 * head, B x H blocks in all (32 at B = 1, H = 32 on an H100's 132 SMs), each reading its
 * head's K and V alone, and the work is reading K and V, not multiplying. So the decode path
 * splits the other way (FlashDecoding):
 *   - a block per (sequence, K/V head, chunk of keys): each K/V head's L_b keys are cut into
 *     chunks of chunk_keys, and the chunks of every head run at once;
 *   - a block takes every query row that reads its K/V head: the G = H / Hkv query heads of
 *     the group, Nq rows each, G Nq rows in all (contiguous in Q: heads G kvh .. G kvh + G - 1
 *     of the sequence), padded to one row fragment (16 rows) where they fit it, else to 09's
 *     two (32 rows, d = 128 only). So each element of K and V crosses from memory once,
 *     whatever G is;
 *   - the block's warps share each tile's keys, 16 each (09's share its rows; here there are
 *     too few rows to share), each keeping its own running max, sum and O, which 09's
 *     helpers update, told the block's row fragments; at the end they are merged into the
 *     chunk's partial O (fp32, normalised) and LSE, written to the workspace;
 *   - merge_chunks_kernel combines a row's chunks by their LSE, stage 02's merge of partial
 *     softmaxes, in a fixed order: no atomics, every run of a problem gives the same bits (a
 *     sequence alone and in a batch, only in the batch-invariant mode: see plan_chunks).
 * The rule: a problem takes this path when one block's rows hold its group's G Nq query rows
 * (G Nq <= decode_rows(d): 16 at d <= 64, 32 at d = 128), so that K and V are read once;
 * any other problem takes 09's path above, which has GQA and cache lengths too. */
/* The most rows a decode block takes. A group of up to 16 rows takes one fragment at every d:
 * at d = 128 one instead of two halves the products of the decode benchmark's 4 query rows
 * and takes the kernel from 214 registers to 162, faster at short caches and never slower
 * beyond the spread of repeats (docs/techniques.md). At most one fragment at
 * d <= 64, two at d = 128: 09's rows a warp when this path and its rule were measured. (09's
 * d <= 64 warps have had two since; a 32-row decode block at d <= 64, which would take groups
 * of 17 to 32 rows off 09's path, has not been measured.) */
__host__ __device__ constexpr int decode_frags(int d) { return d > 64 ? 2 : 1; }
__host__ __device__ constexpr int decode_rows(int d) { return decode_frags(d) * MmaM; }
/* Warps per decode block: 4, as a d = 128 block of 09 (two blocks an SM at 255 registers a
 * thread), each taking 16 keys of a tile, one k-step of P V; so a tile has 64 keys (09's at
 * d = 128), and a d = 128 block's K and V tiles move 32 KiB per tile, 8 copies of 16 bytes a
 * thread. */
constexpr int DecodeWarps = 4, DecodeThreads = DecodeWarps * 32, DecodeKeys = DecodeWarps * MmaK;
static_assert(DecodeKeys == ATTN_DECODE_TILE_KEYS, "ATTN_DECODE_CHUNK_KEYS's check knows the tile");
/* Stages of the decode block's ring of K and V tiles: 2, as 09. A decode block has no
 * arithmetic to hide its loads behind, only more loads, so a deeper ring looked promising, but
 * 3 and 4 stages gained nothing at the decode benchmark's shapes (docs/techniques.md): two
 * tiles of K and V in flight already keep an SM's share of the bandwidth busy.
 * -DATTN_DECODE_STAGES=3 or 4 for the alternatives, which fall back to 2 where their ring does not
 * fit the shared memory. */
#ifndef ATTN_DECODE_STAGES
#define ATTN_DECODE_STAGES 2
#endif
constexpr int DecodeStages = ATTN_DECODE_STAGES;
static_assert(DecodeStages >= 2, "a ring of at least two tiles");
/* A decode block's shared memory: its ring of K and V tiles and its query rows. */
template <typename T>
__host__ __device__ constexpr size_t decode_bytes(int d, int stages) {
  return sizeof(T) * (2 * (size_t)stages * DecodeKeys + decode_rows(d)) * padded<T>(d);
}
/* The chunk rule. A decode grid should give every SM one block (a block streams as fast as
 * an SM pulls bytes: a second one an SM adds no bandwidth, only blocks with fixed costs and
 * partials to merge), in whole waves (a partial wave is a tail), and a chunk should be long
 * enough that a block's fixed costs (loading Q, waiting for its first tiles, merging its
 * warps, writing its partial) stay small beside the tiles it streams: at least MinChunkKeys
 * keys. So
 *   chunks = min(floor(DecodeBlocksPerSm x SMs / (B Hkv)), floor(Lmax / MinChunkKeys)),
 *            at least 1;  chunk_keys = ceil(Lmax / chunks) rounded up to whole tiles,
 * Lmax the longest cache. The README's chunk sweep (chunk lengths forced with
 * ATTN_DECODE_CHUNK_KEYS) finds the rule's pick the fastest or within a few percent of it;
 * two blocks an SM (-DATTN_DECODE_BLOCKS_PER_SM=2) and four waves of chunks of at least 128
 * keys were slower.
 * On an H100: B = 1 gets 128 keys a chunk at L = 1k, 2048 at 32k, 8192 at 128k (16 chunks);
 * B = 8 two chunks; B = 32 one, whose blocks write O and LSE themselves.
 * ATTN_DECODE_CHUNK_KEYS=N (a multiple of 64) sets chunk_keys instead, for the tests and for
 * measuring the rule. */
#ifndef ATTN_DECODE_BLOCKS_PER_SM
#define ATTN_DECODE_BLOCKS_PER_SM 1
#endif
constexpr int DecodeBlocksPerSm = ATTN_DECODE_BLOCKS_PER_SM, MinChunkKeys = 2 * DecodeKeys;

/* Batch invariance (ATTN_DECODE_BATCH_INVARIANT=1). The rule reads the SM count, B Hkv and
 * Lmax, so a sequence's chunks, and with them the order in which its keys' sums are added,
 * depend on the batch it is decoded in: alone and inside a batch, its O and LSE may differ in
 * their last bits (both within the fp16 rule). Serving systems ask for the same bits whatever
 * else shares the batch. In the mode, sequence b's O and LSE are a function of its own Q, K,
 * V and L_b (and of H, Hkv, Nq, d, the dtype, the scale and causal) alone:
 *   - chunks of BatchInvariantChunkKeys keys, whatever the batch and the GPU
 *     (ATTN_DECODE_CHUNK_KEYS, as fixed, still sets another length);
 *   - the merge always runs, also where every sequence has one chunk: a sequence of one
 *     chunk then takes one path (its partial, then the merge) whether the batch's longest
 *     cache has one chunk or many, instead of the decode block writing O itself in one case
 *     and the merge in the other;
 *   - the rest does not depend on the batch already: a decode block's rows are the G Nq query
 *     rows of its K/V head, its keys start at c chunk_keys, the merge takes a row's
 *     ceil(L_b / chunk_keys) chunks in an order set by that count and by d (its Ways), and the
 *     grid's count of chunks, ceil(Lmax / chunk_keys), only places the partials in the
 *     workspace (a chunk past L_b writes nothing, and nothing reads it).
 * 09's path (G Nq past decode_rows) is batch-invariant without the mode: a block for 128 query
 * rows of one head streams that head's cache from key 0 to its end, whatever the grid.
 * The length: 1024 keys, from the chunk sweep (the README). Long enough that a chunk streams
 * efficiently (shorter chunks pay a block's fixed costs over fewer tiles), short enough that
 * B = 1 still gives about every SM of an H100 or H200 (132) a block from L = 16k on
 * (B Hkv L / 1024 = 128 blocks there), where 2048 keys leave at least half of them idle below
 * 32k. The price falls on B = 1 with short caches, which the rule splits finer, and on
 * batches of one chunk a sequence, which gain the merge. */
constexpr int BatchInvariantChunkKeys = 16 * DecodeKeys;
static_assert(BatchInvariantChunkKeys % DecodeKeys == 0, "a chunk is whole tiles");

/* merge: whether merge_chunks_kernel follows, the decode blocks writing partials; without it
 * (one chunk a sequence, outside the batch-invariant mode) they write O and LSE themselves. */
struct decode_plan {
  int chunk_keys, chunks;
  bool merge;
};

/* The chunk rule above on a GPU of `sms` SMs, or the batch-invariant mode's fixed chunks.
 * Plain host arithmetic, so that the workspace and the launch agree and a test can call it. */
static decode_plan plan_chunks(const attn_problem *p, long sms) {
  int lmax = 0;
  for (int b = 0; b < p->batch; b++) lmax = max(lmax, attn_cache_len(p, b));
  long pairs = (long)p->batch * attn_heads_kv(p);
  long chunks = DecodeBlocksPerSm * sms / pairs; /* whole waves: a partial one is a tail */
  chunks = max(1L, min(chunks, (long)(lmax / MinChunkKeys)));
  long keys = (lmax + chunks - 1) / chunks;
  keys = max((long)DecodeKeys, (keys + DecodeKeys - 1) / DecodeKeys * DecodeKeys);
  bool invariant = attn_decode_batch_invariant();
  if (invariant) keys = BatchInvariantChunkKeys;
  if (int forced = attn_decode_chunk_keys()) keys = forced; /* whole tiles: see its check */
  chunks = max(1L, (lmax + keys - 1) / keys);
  return {(int)keys, (int)chunks, invariant || chunks > 1};
}

/* The block's warps hold a running max m_w, sum l_w and unnormalised O_w for the same rows
 * over different keys; the chunk's partial is their merge (c = scale log2 e):
 *   M = max_w m_w,   L = sum_w l_w 2^((m_w - M) c),   O = sum_w O_w 2^((m_w - M) c) / L,
 * and its LSE in log2 units, M c + log2 L. A row that saw no key of the chunk (M = -inf) gets
 * O = 0 and LSE = -inf. Each warp leaves O_w, m_w and l_w in shared memory (`work`: the
 * tiles' memory, free now), then every thread combines 16-byte groups of the output, so that
 * the partial leaves in coalesced stores. (The fragment-layout stores, rows D floats apart,
 * meet 8-way bank conflicts: once a block, beside the tiles it streamed, they do not show.) */
__host__ __device__ constexpr size_t merge_bytes(int d) {
  return sizeof(float) * DecodeWarps * decode_rows(d) * (d + 2);
}
static_assert(merge_bytes(32) <= decode_bytes<__half>(32, 2) &&
                  merge_bytes(64) <= decode_bytes<__half>(64, 2) &&
                  merge_bytes(128) <= decode_bytes<__half>(128, 2),
              "the warps' merge fits in the shared memory of the tiles it replaces");
static_assert(decode_bytes<__half>(128, 2) <= 99 * 1024,
              "a decode block fits the 99 KiB of sm_86 and sm_89 (72 KiB at d = 128, 2 stages)");
template <int D, int FRAGS, typename T>
__device__ void merge_warps(const float (*acc)[D / MmaN][4], const float *m, float *l,
                            float scale_log2, float *work, float *part_o, float *part_lse, T *o,
                            float *lse, int rows, int nq, const attn_strides &qs) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  float *o_s = work, *m_s = o_s + DecodeWarps * Rows * D, *l_s = m_s + DecodeWarps * Rows;
  int w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    l[h] = sum_over_quad(l[h]); /* the lanes' partial sums, as in normalize_output */
    if (t == 0) m_s[w * Rows + g + 8 * h] = m[h], l_s[w * Rows + g + 8 * h] = l[h];
  }
#pragma unroll
  for (int f = 0; f < RowFrags; f++)
#pragma unroll
    for (int n = 0; n < D / MmaN; n++)
#pragma unroll
      for (int half = 0; half < 2; half++) /* rows g and g + 8 of the fragment */
        *reinterpret_cast<float2 *>(o_s + (w * Rows + f * MmaM + g + 8 * half) * D + n * MmaN +
                                    2 * t) =
            make_float2(acc[f][n][2 * half], acc[f][n][2 * half + 1]);
  __syncthreads(); /* RAW: every warp's O, max and sum are in shared memory */
  for (int e = threadIdx.x * 4; e < rows * D; e += DecodeThreads * 4) {
    int r = e / D;
    float mx = -INFINITY, sum = 0.f;
    float4 out = {0.f, 0.f, 0.f, 0.f};
    for (int x = 0; x < DecodeWarps; x++) mx = fmaxf(mx, m_s[x * Rows + r]);
    for (int x = 0; mx != -INFINITY && x < DecodeWarps; x++) {
      float f = exp2_approx((m_s[x * Rows + r] - mx) * scale_log2); /* 0 for a warp with no key */
      float4 o_w = *reinterpret_cast<const float4 *>(o_s + (x * Rows + r) * D + e % D);
      sum += f * l_s[x * Rows + r];
      out.x += f * o_w.x, out.y += f * o_w.y, out.z += f * o_w.z, out.w += f * o_w.w;
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f, row_lse = mx * scale_log2 + log2f(sum);
    out = make_float4(out.x * inv, out.y * inv, out.z * inv, out.w * inv);
    if (o) { /* the only chunk: the partial is the output, row r = g Nq + i query i of head g */
      *reinterpret_cast<uint2 *>(o + r / nq * qs.head + r % nq * qs.row + e % D) =
          make_uint2(pack2(out.x, out.y, T()), pack2(out.z, out.w, T()));
      if (e % D == 0) lse[r] = sum > 0.f ? row_lse * Ln2 : -INFINITY;
    } else {
      *reinterpret_cast<float4 *>(part_o + e) = out;
      if (e % D == 0) part_lse[r] = sum > 0.f ? row_lse : -INFINITY;
    }
  }
}

#include "merge.cuh"

/* The group's rows of Q into a tile of ROWS swizzled rows: row r = g Nq + i is query i of the
 * group's head g (in [B, H, N, d] simply r D on, in [B, N, H, d] two strides); rows past `rows`
 * are zeroed. Once a block, a few rows: a plain loop, not load_tile's unrolled one. */
template <int D, int ROWS, typename T>
__device__ void load_group_rows(const T *q, int rows, int nq, const attn_strides &qs, T *dst) {
  constexpr int Chunk = 16 / sizeof(T), W = D / Chunk; /* 16-byte chunks a row */
  for (int e = threadIdx.x; e < ROWS * W; e += DecodeThreads) {
    int r = e / W, c = e % W * Chunk;
    T *to = dst + swizzle<D, T>(r, c);
    if (r < rows)
      __pipeline_memcpy_async(to, q + r / nq * qs.head + r % nq * qs.row + c, 16);
    else
      *reinterpret_cast<float4 *>(to) = float4{};
  }
}

/* One block: chunk `blockIdx.x % chunks` of K/V head pair = blockIdx.x / chunks (b Hkv + K/V
 * head), so a head's chunks are adjacent. 09's forward loop, K and V in a ring of STAGES
 * tiles and waited for separately; warp w computes the tile's keys [16 w, 16 w + 16) for all
 * rows. */
template <int D, int FRAGS, int STAGES, typename T>
__global__ void __launch_bounds__(DecodeThreads, 2)
    flash_decode_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                        const int *__restrict__ cache_lens, float *__restrict__ part_o,
                        float *__restrict__ part_lse, T *__restrict__ o, float *__restrict__ lse,
                        attn_strides qs, attn_strides kvs, int nq, int nkv, int heads_kv, int group,
                        int chunk_keys, int chunks, bool merge, float scale, int causal) {
  constexpr int RowFrags = FRAGS, LaneRows = 2 * RowFrags, Rows = FRAGS * MmaM;
  constexpr int BC = DecodeKeys, ld = padded<T>(D);
  /* K and V stages of BC rows each, then Q: every tile starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * BC * ld), "tile alignment");
  extern __shared__ __align__(SharedAlignment) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + STAGES * BC * ld, *Qs = Vs + STAGES * BC * ld;
  allow_merge_launch(); /* the merge waits for the whole grid anyway: let it launch now */
  long pair = blockIdx.x / chunks;
  int len = cache_len(cache_lens, pair / heads_kv, nkv);
  int j_begin = (int)(blockIdx.x % chunks) * chunk_keys, j_end = min(len, j_begin + chunk_keys);
  if (j_begin >= len && merge) return; /* past the cache: the merge reads nothing of it */
  int rows = group * nq, w = threadIdx.x / 32, g = threadIdx.x % 32 / Quad;
  const T *K = k + row_start(kvs, pair, 0), *V = v + row_start(kvs, pair, 0);
  float acc[RowFrags][D / MmaN][4] = {};
  float m[LaneRows], l[LaneRows], m_blk[LaneRows];
  unsigned q_frag[RowFrags == 1 ? D / MmaK : 1][4];
  /* Row g + 8 h of the block is query i = (g + 8 h) % Nq of head (g + 8 h) / Nq of the group:
   * it sees keys j < row_end[h] = len, or, causal, min(len, i + len - Nq + 1) (maybe <= 0). */
  int row_end[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    m[h] = -INFINITY, l[h] = 0.f;
    row_end[h] = causal ? min(len, (g + 8 * h) % nq + len - nq + 1) : len;
  }
  load_group_rows<D, Rows>(q + row_start(qs, pair * group, 0), rows, nq, qs, Qs);
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q tile has landed before it is rewritten */
    for (int e = threadIdx.x; e < Rows * D; e += blockDim.x) {
      T &x = Qs[swizzle<D, T>(e / D, e % D)];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
  } /* (the first barrier of the loop orders these writes before the loads of Q) */
  /* Tiles 0 .. STAGES - 2 in flight before the loop, K and V each a group of its own; an
   * empty group past the chunk's end keeps the count of groups that the waits rely on. */
  for (int s = 0; s < STAGES - 1; s++) {
    int j = j_begin + s * BC;
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(K + j * kvs.row, min(BC, j_end - j), Ks + s * BC * ld,
                                      kvs.row);
    __pipeline_commit();
    if (j < j_end)
      load_tile<D, BC, DecodeThreads>(V + j * kvs.row, min(BC, j_end - j), Vs + s * BC * ld,
                                      kvs.row);
    __pipeline_commit();
  }
  /* Groups committed after K(t) when it is waited for: V(t), K and V of the STAGES - 2 tiles
   * after it, and K(t + STAGES - 1); after V(t): K and V of the STAGES - 1 tiles after it. */
  constexpr int InFlight = 2 * STAGES - 2;
  for (int j0 = j_begin, buf = 0; j0 < j_end; j0 += BC, buf = (buf + 1) % STAGES) {
    int cols = min(BC, j_end - j0), next = j0 + (STAGES - 1) * BC;
    int nbuf = (buf + STAGES - 1) % STAGES; /* the buffer of tile t - 1, done with */
    T *Kn = Ks + nbuf * BC * ld, *Vn = Vs + nbuf * BC * ld;
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(K + next * kvs.row, min(BC, j_end - next), Kn, kvs.row);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* K(t) has landed; V(t) and later tiles may be in flight */
    __syncthreads(); /* RAW: K(t) (the first time, Q too) is in shared memory; WAR: every warp is
                      * done with P V(t - 1), so V(t + STAGES - 1) may overwrite its buffer */
    /* The warp's keys start at jw; row h sees row_cols[h] of its 16 (the chunk ends, the cache
     * ends, or the causal limit falls inside them: masked). */
    int jw = j0 + w * MmaK, row_cols[LaneRows];
    bool masked = false;
#pragma unroll
    for (int h = 0; h < LaneRows; h++) {
      row_cols[h] = min(j0 + cols, row_end[h]) - jw;
      masked |= row_cols[h] < MmaK;
    }
    const T *Kt = Ks + (buf * BC + w * MmaK) * ld, *Vt = Vs + (buf * BC + w * MmaK) * ld;
    float s[RowFrags][MmaK / MmaN][4] = {};
    if (RowFrags == 1 && j0 == j_begin) /* Q has landed: its operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) ldmatrix_x4(q_frag[kk], a_operand<D>(Qs, 0, kk * MmaK));
    compute_qk_scores_and_max<D, MmaK, FRAGS>(Qs, q_frag, Kt, masked, row_cols, s, m_blk);
    merge_block_stats<D, FRAGS>(m_blk, scale_log2, m, l, acc);
    if (next < j_end)
      load_tile<D, BC, DecodeThreads>(V + next * kvs.row, min(BC, j_end - next), Vn, kvs.row);
    __pipeline_commit();
    __pipeline_wait_prior(InFlight); /* V(t) has landed; later tiles may still be in flight */
    __syncthreads();                 /* RAW: V(t) is in shared memory; WAR: every warp is done with
                                      * S = Q K(t)^T, so K(t + STAGES) may overwrite its buffer */
    compute_block_softmax_and_weighted_v<D, MmaK, FRAGS>(s, Vt, scale_log2, m, l, acc);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight: the tiles' memory is reused below */
  __syncthreads();          /* WAR: every warp is done with the last K and V tiles (and Q) */
  /* Without a merge (one chunk a sequence), the block's rows are the output's rows
   * (b H + h) Nq + i of heads (b Hkv + K/V head) G on. */
  long first = (long)blockIdx.x * rows;
  merge_warps<D, FRAGS>(acc, m, l, scale_log2, reinterpret_cast<float *>(smem),
                        merge ? part_o + first * D : nullptr, merge ? part_lse + first : nullptr,
                        merge ? nullptr : o + row_start(qs, pair * group, 0), lse + first, rows, nq,
                        qs);
}

/* The decode kernel this GPU runs: DecodeStages of K and V where they fit the shared memory,
 * else 2. */
template <int D, typename T>
static bool decode_deep() {
  return DecodeStages > 2 && decode_bytes<T>(D, DecodeStages) <= attn_shared_memory_limit();
}

/* The chunk plan on this GPU, after checking that the decode block fits its shared memory. */
template <int D, int STAGES, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  attn_require_shared_memory((const void *)flash_decode_kernel<D, decode_frags(D), STAGES, T>,
                             decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  int device, sms;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return plan_chunks(p, sms);
}
template <int D, typename T>
static decode_plan plan_decode(const attn_problem *p) {
  return decode_deep<D, T>() ? plan_decode<D, DecodeStages, T>(p) : plan_decode<D, 2, T>(p);
}

/* The decode path's workspace: each chunk's partial O (G Nq rows of d floats) and LSE; none
 * without a merge. */
static size_t decode_workspace(const attn_problem *p, decode_plan plan) {
  if (!plan.merge) return 0; /* the decode kernel writes O itself */
  return sizeof(float) * (size_t)p->batch * attn_heads_kv(p) * plan.chunks * attn_group(p) *
         p->seq_q * (p->head_dim + 1);
}

template <int D, int STAGES, typename T, int FRAGS = decode_frags(D)>
static void launch_decode(const attn_problem *p, const attn_buffers *t) {
  /* A group of up to 16 rows takes one row fragment, also where 09 gives a warp two (d = 128):
   * half the products and registers (see decode_rows). */
  if (FRAGS > 1 && attn_group(p) * p->seq_q <= MmaM) return launch_decode<D, STAGES, T, 1>(p, t);
  decode_plan plan = plan_decode<D, STAGES, T>(p);
  if (FRAGS != decode_frags(D))
    attn_require_shared_memory((const void *)flash_decode_kernel<D, FRAGS, STAGES, T>,
                               decode_bytes<T>(D, STAGES), "flash_decode_kernel");
  long pairs = (long)p->batch * attn_heads_kv(p), blocks = pairs * plan.chunks;
  int rows = attn_group(p) * p->seq_q;
  if (blocks > INT_MAX || (long)attn_lse_elems(p) > INT_MAX)
    attn_fail(EXIT_BAD_USAGE, "too many (sequence, K/V head, chunk) blocks for one grid: %ld",
              blocks);
  float *part_o = (float *)t->workspace, *part_lse = part_o + (size_t)blocks * rows * D;
  flash_decode_kernel<D, FRAGS, STAGES>
      <<<(unsigned)blocks, DecodeThreads, decode_bytes<T>(D, STAGES), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, t->cache_lens, part_o, part_lse,
          (T *)t->o, t->lse, attn_q_strides(p), attn_kv_strides(p), p->seq_q, p->seq_kv,
          attn_heads_kv(p), attn_group(p), plan.chunk_keys, plan.chunks, plan.merge, p->scale,
          p->causal);
  CHECK_LAUNCH("flash_decode_kernel");
  if (!plan.merge) return; /* the decode blocks wrote O and LSE */
  /* The merge as a programmatic dependent launch where the GPU has it (see wait_for_decode). */
  int device, major;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaLaunchAttribute early = {};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)attn_lse_elems(p));
  config.blockDim = dim3(MergeThreads);
  config.stream = attn_stream();
  config.attrs = &early;
  config.numAttrs = major >= 9 ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, merge_chunks_kernel<D, T>, (const float *)part_o,
                                (const float *)part_lse, (const int *)t->cache_lens, (T *)t->o,
                                t->lse, attn_q_strides(p), p->seq_q, p->seq_kv, p->heads,
                                attn_group(p), plan.chunk_keys, plan.chunks));
  CHECK_LAUNCH("merge_chunks_kernel");
}

/* The decode path's rule (see its comment above): the group's query rows fill one block. */
static bool decode_shaped(const attn_problem *p, int d) {
  return (long)attn_group(p) * p->seq_q <= decode_rows(d);
}
