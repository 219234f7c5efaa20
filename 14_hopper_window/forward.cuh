/* Stage 14's forward: 10's, with each row's keys an interval (a sliding window, causal or
 * both: 13's visible_keys), tiles skipped at both ends and only boundary tiles masked. */
#pragma once

#include "../10_hopper_wgmma/forward_softmax.cuh"
#include "../13_window_softcap_varlen/visible.cuh"

/* Only a tile that crosses an edge of some row's keys (the window's two diagonals, the end
 * of the keys) is masked: the lane's row h, query row + 8 h, keeps the keys it sees, the rest
 * become -inf; the tile starts at key j0. m_blk[h] is row h's max over the tile, reduced over
 * the row's quad. */
template <int BC>
__device__ void mask_and_row_max(float (*s)[4], bool masked, const visible_keys &vis, int row,
                                 int j0, float *m_blk) {
  int t = threadIdx.x % Quad;
  if (masked) {
    /* Row h's keys as the tile's columns [first[h], stop[h]): computed here, on masked tiles
     * only, so that nothing of them stays live across the key loop. */
    int first[2], stop[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
      first[h] = vis.begin(row + 8 * h) - j0, stop[h] = vis.end(row + 8 * h) - j0;
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int c = n * MmaN + 2 * t + e % 2;
        if (c < first[e / 2] || c >= stop[e / 2]) s[n][e] = -INFINITY;
      }
  }
  m_blk[0] = m_blk[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) m_blk[e / 2] = fmaxf(m_blk[e / 2], s[n][e]);
#pragma unroll
  for (int h = 0; h < 2; h++) m_blk[h] = max_over_quad(m_blk[h]);
}

template <int D, int STAGES, typename T>
__global__ void __launch_bounds__(forward_threads(D), 1)
    flash_forward_kernel(const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, T *__restrict__ o,
                         float *__restrict__ lse, attn_strides qs, int nq, int nkv, int heads,
                         int group, float scale, int left, int right) {
  constexpr int Cols = box_cols<D, T>(), Br = block_rows(D), Consumers = consumers(D);
  constexpr int ConsumerWarps = Consumers * WarpgroupThreads / 32;
  /* The copy engine and wgmma swizzle by address bits, so each tile, each box of a tile and
   * each consumer's slice of Q must start on a whole swizzle atom (8 rows of a box): the
   * offsets below are whole boxes of Br, Bc or WgmmaM rows from a base on AtomAlignment. */
  constexpr size_t SwizzleAtom = 8 * Cols * sizeof(T);
  static_assert(AtomAlignment % SwizzleAtom == 0 && sizeof(T) * Br * Cols % SwizzleAtom == 0 &&
                    sizeof(T) * Bc * Cols % SwizzleAtom == 0 &&
                    sizeof(T) * WgmmaM * Cols % SwizzleAtom == 0,
                "tile alignment");
  extern __shared__ unsigned char smem_raw[];
  T *Qs = reinterpret_cast<T *>(
      smem_raw + (AtomAlignment - shared_address(smem_raw) % AtomAlignment) % AtomAlignment);
  T *Ks = Qs + Br * D, *Vs = Ks + STAGES * Bc * D; /* K and V in STAGES stages each */
  uint64_t *q_full = reinterpret_cast<uint64_t *>(Vs + STAGES * Bc * D);
  /* full: the tile has landed (the copy's bytes); empty: every consumer warp is done with it */
  uint64_t *k_full = q_full + 1, *v_full = k_full + STAGES, *k_empty = v_full + STAGES,
           *v_empty = k_empty + STAGES;
  /* Causal blocks have unequal work: row block r does about r + 1 times row block 0's. Ordered by
   * row block across all heads, every head's heaviest block starts first and the light ones
   * fill the tail. Non-causal blocks are equal, so a head's blocks stay adjacent and share
   * its K and V in L2. (09's order.) A window bounded on the left is as even. */
  bool triangle = right >= 0 && left < 0;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = triangle ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (triangle ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* Keys [kv_begin, kv_end) are visible to some row of the block, from the first row's first
   * to the last row's last; the tiles run from the one holding kv_begin (t_first). */
  const visible_keys vis = {nkv - nq, left, right, nkv};
  int last_row = min(i0 + Br, nq) - 1, kv_begin = vis.begin(i0), kv_end = vis.end(last_row);
  int t_first = kv_begin / Bc;
  int tiles = kv_end > kv_begin ? (kv_end + Bc - 1) / Bc - t_first : 0;
  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < STAGES; s++) {
      mbarrier_init(&k_full[s], 1), mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], ConsumerWarps), mbarrier_init(&v_empty[s], ConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads(); /* the barriers are initialised before anyone waits on them or copies */

  /* The producer: one thread issues every copy, K(t) and V(t) (the block's t-th tile, from
   * key (t_first + t) Bc) into stage t % STAGES once the consumers have let go of the tile that
   * stage held. A wait for parity 1 on a new barrier returns at once: the ring starts empty. */
  auto produce = [&](int t) {
    int s = t % STAGES, parity = t / STAGES & 1;
    mbarrier_wait(&k_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&k_map, (t_first + t) * Bc, bh / group, qs.heads / group,
                           Ks + s * Bc * D, &k_full[s]);
    mbarrier_wait(&v_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&v_map, (t_first + t) * Bc, bh / group, qs.heads / group,
                           Vs + s * Bc * D, &v_full[s]);
  };
  const int warpgroup = threadIdx.x / WarpgroupThreads;
  if (warpgroup == 0) {
    give_registers<ProducerRegisters>();
    if (threadIdx.x == 0) {
      load_tile_async<D, Br>(&q_map, i0, bh, qs.heads, Qs, q_full);
      for (int t = 0; t < tiles; t++) produce(t);
    }
    return; /* nothing below waits for the producer but through the barriers */
  }
  take_registers<consumer_registers(D)>();

  /* A consumer warpgroup: 64 rows of the block, 16 a warp; this lane holds rows i + 8 h. */
  const int consumer = warpgroup - Producers, warp = threadIdx.x / 32 % 4;
  int row0 = i0 + consumer * WgmmaM + warp * MmaM, i = row0 + threadIdx.x % 32 / Quad;
  const T *Q = Qs + consumer * WgmmaM * Cols; /* the warpgroup's rows, in every box */
  const bool lane0 = threadIdx.x % 32 == 0;
  float acc[1][D / MmaN][4] = {}, s[Bc / MmaN][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, m_blk[2], correction[2];
  unsigned p_frag[Bc / MmaK][4];
  mbarrier_wait(q_full, 0);
  /* The row max is taken on the raw S, which is right for a positive scale only: a negative
   * scale is a positive one on -Q (exact), and a zero scale sees Q = 0. */
  float scale_log2 = scale == 0.f ? Log2e : fabsf(scale) * Log2e;
  if (scale <= 0.f) {
    for (int e = threadIdx.x % WarpgroupThreads; e < WgmmaM * D; e += WarpgroupThreads) {
      T &x = Qs[e % D / Cols * Br * Cols + (consumer * WgmmaM + e / D) * Cols + e % Cols];
      x = T(scale < 0.f ? -float(x) : 0.f);
    }
    /* the threads' stores become visible to wgmma, which reads through the async proxy */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    warpgroup_sync(1 + consumer); /* RAW: all 64 rows are rewritten before the products */
  }
  /* One tile's softmax, from S (waited for) to P in fp32 in s: mask, row max, the running max
   * and sum. The output's rescale is left to the caller, which may have a product of it in
   * flight. */
  /* The warp's edges: a tile between them needs no mask. */
  int warp_begin = vis.begin(min(row0 + MmaM, nq) - 1), warp_end = vis.end(row0);
  auto softmax = [&](int t) {
    int j0 = (t_first + t) * Bc;
    /* A tile reaching before the warp's last row's first key or past its first row's last
     * (or past the keys) is masked: each row keeps the columns it sees, which may be none. */
    bool masked = j0 < warp_begin || j0 + Bc > warp_end;
    mask_and_row_max<Bc>(s, masked, vis, i, j0, m_blk);
    merge_block_stats(m_blk, scale_log2, m, l, correction);
    exponentiate_scores<Bc>(s, scale_log2, m, l);
  };
  auto release = [&](uint64_t *bar) {
    if (lane0) mbarrier_arrive(bar); /* after this warp's wait: its products are done */
  };
  if (tiles > 0) {
    /* S(t) and P(t - 1) V(t - 1) are in flight together; the softmax of S(t) runs while the
     * tensor cores finish P(t - 1) V(t - 1), whose end the rescale of O waits for. */
    mbarrier_wait(&k_full[0], 0);
    compute_qk_scores<D>(Q, Ks, s);
    wgmma_wait<0>();
    settle<Bc / 2>(&s[0][0]);
    release(&k_empty[0]);
    softmax(0);
    pack_probabilities<Bc, T>(s, p_frag);
    for (int t = 1; t < tiles; t++) {
      int st = t % STAGES, parity = t / STAGES & 1;
      int prev = (t - 1) % STAGES, prev_parity = (t - 1) / STAGES & 1;
      mbarrier_wait(&k_full[st], parity);
      compute_qk_scores<D>(Q, Ks + st * Bc * D, s);
      mbarrier_wait(&v_full[prev], prev_parity);
      multiply_pv<D>(p_frag, Vs + prev * Bc * D, acc[0]);
      wgmma_wait<1>(); /* S(t) is done; P(t - 1) V(t - 1) may still run */
      settle<Bc / 2>(&s[0][0]);
      release(&k_empty[st]);
      softmax(t);
      wgmma_wait<0>();
      settle<D / 2>(&acc[0][0][0]);
      release(&v_empty[prev]);
      rescale_output<D>(correction, acc[0]);
      pack_probabilities<Bc, T>(s, p_frag);
    }
    int last = (tiles - 1) % STAGES, last_parity = (tiles - 1) / STAGES & 1;
    mbarrier_wait(&v_full[last], last_parity);
    multiply_pv<D>(p_frag, Vs + last * Bc * D, acc[0]);
    wgmma_wait<0>();
    settle<D / 2>(&acc[0][0][0]);
    release(&v_empty[last]);
  }
  normalize_output<D>(acc, m, l, scale_log2, o + row_start(qs, bh, row0), lse + bh * nq + row0,
                      nq - row0, qs.row);
}

template <int D, int STAGES, typename T>
static void launch_forward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  constexpr int Br = block_rows(D);
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_strides qs = attn_q_strides(p), kvs = attn_kv_strides(p);
  CUtensorMap q_map = tile_map<D, Br, T>(t->q, qs, p->seq_q, p->batch);
  CUtensorMap k_map = tile_map<D, Bc, T>(t->k, kvs, p->seq_kv, p->batch);
  CUtensorMap v_map = tile_map<D, Bc, T>(t->v, kvs, p->seq_kv, p->batch);
  size_t bytes = forward_bytes<T>(D, STAGES);
  attn_require_shared_memory((const void *)flash_forward_kernel<D, STAGES, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, STAGES, T><<<grid, forward_threads(D), bytes, attn_stream()>>>(
      q_map, k_map, v_map, (T *)t->o, t->lse, qs, p->seq_q, p->seq_kv, heads, attn_group(p),
      p->scale, window_left(p), window_right(p));
  CHECK_LAUNCH("flash_forward_kernel");
}

/* fp16, or bf16 through launch<D, __nv_bfloat16>: the harness uploads the problem's dtype. */
template <int D, typename T = __half>
static void launch(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch<D, __nv_bfloat16>(p, t);
  if (forward_bytes<T>(D, KvStages) <= attn_shared_memory_limit())
    launch_forward<D, KvStages, T>(p, t);
  else
    launch_forward<D, 1, T>(p, t);
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  require_hopper();
  switch (p->head_dim) {
    case 32: launch<32>(p, t); break;
    case 64: launch<64>(p, t); break;
    case 128: launch<128>(p, t); break;
  }
}
