/* Stage 14's backward: 12's, with each row's keys an interval (13's visible_keys): a key
 * block walks only the query tiles that see its keys, and only boundary tiles are masked.
 * (d = 32 runs 13's backward, whose backward.cuh the program includes first.) As in 12,
 * FlashAttention-3's backward on Hopper's machinery, at d = 64 and 128:
 *
 * A block owns HbKeys keys of one K/V head and keeps their K and V tiles in shared memory. A
 * producer warpgroup streams the query tiles of every query head that reads them (Q and dO by
 * TMA, LSE and D by one warp) through a ring of hb_stages(D) stages; two consumer warpgroups, 64
 * keys each, compute per tile:
 *   S^T = K Q^T, dP^T = V dO^T                 wgmma, both operands in shared memory
 *   P^T = 2^(S^T scale log2 e - LSE), dS^T = P^T (dP^T - D)     in registers
 *   dV += P^T dO, dK += dS^T Q                 wgmma, A from registers (P^T, dS^T)
 *   dQ = dS K                                  wgmma on dS^T stored to shared memory, the
 *                                              fp32 sum added into global memory by the copy
 *                                              engine (one bulk reduce-add a tile)
 * dK and dV stay in registers for the whole walk over the queries. */
#pragma once

#include "../12_hopper_backward/products.cuh"
#include "../13_window_softcap_varlen/visible.cuh"

/* 12's probabilities_t with the window's two diagonals (13's key_band, formed on masked tiles
 * only) in place of the causal one. */
template <int ROWS, typename T>
__device__ void probabilities_t(float (*s)[4], const float *lse_s, float scale_log2, int i0, int jw,
                                int nq, int nkv, const visible_keys &vis, bool masked,
                                unsigned (*p_frag)[4]) {
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  /* Two copies of the loop, chosen once a tile (masked is the same in the whole warp): inside
   * one loop the compiler guards each exponential with its own branch and reconvergence
   * point, a cost the unmasked tiles, nearly all of them, need not pay. */
  if (!masked) {
#pragma unroll
    for (int n = 0; n < ROWS / MmaN; n++) {
      float2 l2 = *reinterpret_cast<const float2 *>(lse_s + n * MmaN + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[n][e] = fminf(1.f, exp2_approx(fmaf(s[n][e], scale_log2, e % 2 ? -l2.y : -l2.x)));
    }
  } else {
    const key_band band = band_of(vis);
#pragma unroll
    for (int n = 0; n < ROWS / MmaN; n++) {
      float2 l2 = *reinterpret_cast<const float2 *>(lse_s + n * MmaN + 2 * tq);
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int i = i0 + n * MmaN + 2 * tq + e % 2, j = jw + g + 8 * (e / 2);
        bool visible = i < nq && j < nkv && band.sees(i, j);
        s[n][e] = visible
                      ? fminf(1.f, exp2_approx(fmaf(s[n][e], scale_log2, e % 2 ? -l2.y : -l2.x)))
                      : 0.f;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < ROWS / MmaN; n++) {
    p_frag[n / 2][2 * (n % 2)] = pack2(s[n][0], s[n][1], T());
    p_frag[n / 2][2 * (n % 2) + 1] = pack2(s[n][2], s[n][3], T());
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(HbThreads, 1)
    hopper_backward_kernel(const __grid_constant__ CUtensorMap q_map,
                           const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map,
                           const __grid_constant__ CUtensorMap do_map,
                           const float *__restrict__ lse, const float *__restrict__ delta,
                           const float *__restrict__ ds_stats, T *__restrict__ dk,
                           T *__restrict__ dv, float *__restrict__ dq_accum, int *dq_turns,
                           attn_strides kvs, int nq, int nkv, int kv_heads, int group, float scale,
                           int left, int right) {
  using L = HbLayout<D, T>;
  constexpr int HbRows = L::Rows, HbStages = L::Stages;
  /* Aligned by an offset from the shared array itself, as 10's forward is, so that the
   * compiler still knows every pointer below as shared memory (LDS and STS, not generic
   * loads and stores). */
  extern __shared__ __align__(16) unsigned char hb_smem_raw[];
  unsigned char *smem =
      hb_smem_raw + (AtomAlignment - shared_address(hb_smem_raw) % AtomAlignment) % AtomAlignment;
  T *Ks = reinterpret_cast<T *>(smem + L::k), *Vs = reinterpret_cast<T *>(smem + L::v);
  T *Qs = reinterpret_cast<T *>(smem + L::q), *dOs = reinterpret_cast<T *>(smem + L::d_o);
  T *dSs = reinterpret_cast<T *>(smem + L::ds);
  float *dQs = reinterpret_cast<float *>(smem + L::dq);
  float *stats_s = reinterpret_cast<float *>(smem + L::stats); /* [stage][LSE, D][HbRows] */
  uint64_t *kv_full = reinterpret_cast<uint64_t *>(smem + L::barriers);
  uint64_t *full = kv_full + 1, *empty = full + HbStages;
  constexpr int RowTile = HbRows * D; /* elements of a Q or dO tile */

  /* Causal blocks have unequal work: key block 0 meets every query tile. Ordered by key block
   * across a group of CausalHeadGroup heads, the heaviest start first (09's order, within the
   * group); non-causal, a head's key blocks stay adjacent and share its Q and dO in L2. Either
   * way a head's lower key blocks come first, which the deterministic path relies on. A window
   * bounded on the left is as even as non-causal. */
  bool triangle = right >= 0 && left < 0;
  int key_blocks = (nkv + HbKeys - 1) / HbKeys;
  long bh_kv = blockIdx.x / key_blocks;
  int kb = (int)(blockIdx.x % key_blocks);
  if (triangle) {
    long heads = CausalHeadGroup > 0 ? CausalHeadGroup : kv_heads;
    long first_head = blockIdx.x / (heads * key_blocks) * heads;
    long in_group = min(heads, kv_heads - first_head), at = blockIdx.x - first_head * key_blocks;
    bh_kv = first_head + at % in_group, kb = (int)(at / in_group);
  }
  int j0 = kb * HbKeys;
  /* The queries that see some key of the block are [first_row(j0), end_row(j0 + HbKeys)): the
   * tiles before and after them are skipped. Tiles start at multiples of HbRows, the same in
   * every key block, so that they add into the same dQ tiles. */
  const visible_keys vis = {nkv - nq, left, right, nkv};
  int m_tiles = (nq + HbRows - 1) / HbRows, first = vis.first_row(j0) / HbRows;
  int end_tile = (vis.end_row(j0 + HbKeys, nq) + HbRows - 1) / HbRows;
  int head_tiles = max(0, end_tile - first), tiles = group * head_tiles;
  /* The same in every lane; read from lane 0 so that the compiler knows it too and keeps the
   * tile addresses and wgmma descriptors made from it in uniform registers. */
  const int wg = __shfl_sync(~0u, threadIdx.x / WarpgroupThreads, 0);

  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 2); /* K's and V's expect_bytes */
    /* full: Q's and dO's expect_bytes and each row-stats lane's arrival; empty: each consumer
     * thread's (each arrives after its own reads and writes, which the arrival releases) */
    for (int s = 0; s < HbStages; s++)
      mbarrier_init(&full[s], 2 + 32), mbarrier_init(&empty[s], HbConsumers * WarpgroupThreads);
    fence_barrier_init();
  }
  __syncthreads(); /* the barriers are initialised before anyone waits on them */

  /* Tile t: query head bh_kv group + t / head_tiles (the group's heads read this K and V),
   * rows from (first + t % head_tiles) HbRows. */
  auto tile_head = [&](int t) { return bh_kv * group + t / head_tiles; };
  auto tile_row = [&](int t) { return (first + t % head_tiles) * HbRows; };
  if (wg == 0) { /* the producer: one thread issues every copy, one warp the row stats */
    give_registers<ProducerRegisters>();
    produce_query_tiles<D, T>(&q_map, &k_map, &v_map, &do_map, lse, delta, ds_stats, Ks, Vs, Qs,
                              dOs, stats_s, kv_full, full, empty, kvs, nq, group, bh_kv, j0, first,
                              head_tiles, tiles);
    return; /* nothing below waits for the producer but through the barriers */
  }

  take_registers<consumer_registers(128)>();
  const int c = wg - 1, tw = threadIdx.x % WarpgroupThreads;
  const int jw = j0 + c * WgmmaM + tw / 32 * MmaM; /* this warp's first key */
  const T *Kc = Ks + c * WgmmaM * box_cols<D, T>(), *Vc = Vs + c * WgmmaM * box_cols<D, T>();
  float *dq_part = dQs + c * HbRows * D / 2;
  const float scale_log2 = scale * Log2e, dss = ds_scale(ds_stats);
  float dk_acc[D / MmaN][4] = {}, dv_acc[D / MmaN][4] = {};
  mbarrier_wait(kv_full, 0); /* RAW: K and V have landed */
  for (int t = 0; t < tiles; t++) {
    int s = t % HbStages, i0 = tile_row(t);
    long head = tile_head(t);
    const T *Qt = Qs + s * RowTile, *dOt = dOs + s * RowTile;
    T *dSt = dSs + t % HbDsBuffers * (HbKeys * HbRows);
    mbarrier_wait(&full[s], t / HbStages % 2); /* RAW: the tile's Q, dO, LSE and D have landed */
    /* Three groups in flight at most: while the tensor cores compute dP^T the warpgroup turns
     * S^T into P^T, and while they compute dV it turns dP^T into dS^T. */
    float st[HbRows / MmaN][4], dpt[HbRows / MmaN][4];
    wgmma_fence(); /* the last tile's reads of st and dpt come before these products */
    issue_scores<D, T>(Kc, Qt, st);
    wgmma_commit();
    issue_scores<D, T>(Vc, dOt, dpt);
    wgmma_commit();
    wgmma_wait<1>(); /* S^T is done; dP^T may still run */
    settle<HbRows / 2>(&st[0][0]);
    /* A tile whose last row's first key is past the warp's first key, or whose first row's
     * last key is before the warp's last, is masked (begin and end grow with the row). */
    bool masked = i0 + HbRows > nq || jw + MmaM > nkv || jw < vis.begin(i0 + HbRows - 1) ||
                  jw + MmaM > vis.end(i0);
    unsigned p_frag[HbRows / MmaK][4], ds_frag[HbRows / MmaK][4];
    const float *lse_t = stats_s + s * 2 * HbRows;
    probabilities_t<HbRows, T>(st, lse_t, scale_log2, i0, jw, nq, nkv, vis, masked, p_frag);
    wgmma_fence(); /* P^T's registers are written before the product reads them */
    issue_update<D, T>(p_frag, dOt, dv_acc);
    wgmma_commit();
    wgmma_wait<1>(); /* dP^T is done; dV may still run */
    settle<HbRows / 2>(&dpt[0][0]);
    ds_t<HbRows, T>(p_frag, dpt, lse_t + HbRows, dss, ds_frag);
    store_ds_t<HbRows, T>(ds_frag, dSt, c * WgmmaM + tw / 32 * MmaM);
    fence_async_shared(); /* dS^T's stores, before the tensor cores read them */
    wgmma_fence();
    issue_update<D, T>(ds_frag, Qt, dk_acc);
    wgmma_commit();
    /* WAR on dq_part: the last tile's bulk add has read it (the barrier below publishes it) */
    if (tw == 0) bulk_wait_read();
    /* RAW: both halves of dS^T are whole. (WAR: the other consumer's dQ of tile t - 1 read
     * the buffer this one writes next, and it finished that before arriving here.) */
    asm volatile("bar.sync %0, %1;" ::"n"(ConsumersBarrier), "n"(HbConsumers * WarpgroupThreads)
                 : "memory");
    float dq[dq_cols(D) / MmaN][4];
    wgmma_fence(); /* the last tile's reads of dq come before this product overwrites it */
    issue_dq<D, T>(dSt, Ks, c, dq);
    wgmma_commit();
    wgmma_wait<1>(); /* dV and dK are done: dQ reads neither Q nor dO */
    /* WAR: the thread is done with this stage's Q, dO, LSE and D */
    mbarrier_arrive(&empty[s]);
    wgmma_wait<0>();
    settle<D / MmaN * 4>(&dk_acc[0][0]), settle<D / MmaN * 4>(&dv_acc[0][0]),
        settle<dq_cols(D) / 2>(&dq[0][0]);
    store_dq_part<dq_cols(D) / MmaN>(dq, dq_part);
    fence_async_shared(); /* the part's stores, before the copy engine reads them */
    /* RAW: the whole part is in shared memory before one thread hands it to the copy engine */
    asm volatile("bar.sync %0, %1;" ::"r"(WarpgroupBarrier + c), "n"(WarpgroupThreads) : "memory");
    if (tw == 0) {
      long tile = head * m_tiles + i0 / HbRows;
      int *turn = dq_turns ? dq_turns + tile * HbConsumers + c : nullptr;
      /* The key blocks that add into this tile are those from the one holding its first row's
       * first key up to the last that some row of it sees: this block's turn is its place
       * among them. */
      int order = kb - vis.begin(i0) / HbKeys;
      if (turn) wait_turn(turn, order);
      bulk_add_f32(dq_accum + tile * HbRows * D + c * HbRows * D / 2, dq_part, L::dq_part);
      if (turn) bulk_wait_done(), pass_turn(turn, order + 1);
    }
  }
  if (tw == 0) bulk_wait_done(); /* the last part is read before the block's memory goes */
  /* dK = scale / ds_scale dS^T Q, dV = P^T dO: the warp's 16 keys, rows past nkv not stored. */
  float dk_factor[2] = {scale / dss, scale / dss}, dv_factor[2] = {1.f, 1.f};
  store_tile<D, 1>(reinterpret_cast<const float(*)[D / MmaN][4]>(dk_acc), dk_factor,
                   dk + row_start(kvs, bh_kv, jw), nkv - jw, kvs.row);
  store_tile<D, 1>(reinterpret_cast<const float(*)[D / MmaN][4]>(dv_acc), dv_factor,
                   dv + row_start(kvs, bh_kv, jw), nkv - jw, kvs.row);
}

template <int D, typename T>
static void launch_hopper_backward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads, kv_heads = p->batch * attn_heads_kv(p);
  long rows = (long)heads * p->seq_q, kv_rows = (long)kv_heads * p->seq_kv;
  float *delta = (float *)t->workspace, *dq_accum = delta + delta_floats(rows);
  long tile_floats = (long)hb_tile_floats(p);
  float *ds_stats = dq_accum + tile_floats;
  int *turns = attn_deterministic() ? reinterpret_cast<int *>(ds_stats + DsStats) : nullptr;
  launch_delta<D, T>(p, t, delta, std::is_same_v<T, __half> ? ds_stats : nullptr, rows, kv_rows);
  if (!std::is_same_v<T, __half>) ds_stats = nullptr; /* bf16: no scaling of dS */
  CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, sizeof(float) * tile_floats, attn_stream()));
  if (turns) CUDA_CHECK(cudaMemsetAsync(turns, 0, sizeof(int) * hb_turns(p), attn_stream()));
  attn_strides qs = attn_q_strides(p), kvs = attn_kv_strides(p);
  CUtensorMap q_map = tile_map<D, hb_rows(D), T>(t->q, qs, p->seq_q, p->batch);
  CUtensorMap do_map = tile_map<D, hb_rows(D), T>(t->d_o, qs, p->seq_q, p->batch);
  CUtensorMap k_map = tile_map<D, HbKeys, T>(t->k, kvs, p->seq_kv, p->batch);
  CUtensorMap v_map = tile_map<D, HbKeys, T>(t->v, kvs, p->seq_kv, p->batch);
  size_t bytes = HbLayout<D, T>::bytes;
  attn_require_shared_memory((const void *)hopper_backward_kernel<D, T>, bytes,
                             "hopper_backward_kernel");
  unsigned blocks = (unsigned)((p->seq_kv + HbKeys - 1) / HbKeys * kv_heads);
  hopper_backward_kernel<D, T><<<blocks, HbThreads, bytes, attn_stream()>>>(
      q_map, k_map, v_map, do_map, t->lse, delta, ds_stats, (T *)t->dk, (T *)t->dv, dq_accum, turns,
      kvs, p->seq_q, p->seq_kv, kv_heads, attn_group(p), p->scale, window_left(p), window_right(p));
  CHECK_LAUNCH("hopper_backward_kernel");
  const int convert_threads = 256; /* a memory-bound pass: any full-warp count will do */
  long tiles = tile_floats / (hb_rows(D) * D);
  convert_dq_tiles<D, T>
      <<<(unsigned)((tile_floats / 4 + convert_threads - 1) / convert_threads), convert_threads, 0,
         attn_stream()>>>(dq_accum, ds_stats, (T *)t->dq, tiles, qs, p->seq_q, p->scale);
  CHECK_LAUNCH("convert_dq_tiles");
}

template <int D, typename T = __half>
static void launch_hopper(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch_hopper<D, __nv_bfloat16>(p, t);
  launch_hopper_backward<D, T>(p, t);
}

/* Where this backward cannot run, 13's does: at d = 32 (see 12's README) and on a device whose
 * shared memory is smaller than the block's. 13's has no grouped-query backward. */
static void hopper_backward(const attn_problem *p, const attn_buffers *t) {
  require_hopper();
  size_t bytes = p->head_dim == 64    ? HbLayout<64, __half>::bytes
                 : p->head_dim == 128 ? HbLayout<128, __half>::bytes
                                      : 0;
  if (bytes && bytes <= attn_shared_memory_limit()) {
    if (p->head_dim == 64) launch_hopper<64>(p, t);
    if (p->head_dim == 128) launch_hopper<128>(p, t);
    return;
  }
  if (attn_group(p) > 1)
    attn_fail(EXIT_BAD_USAGE,
              "the grouped-query backward needs d = 64 or 128 and %zu bytes of shared memory a "
              "block; here 13's backward runs, which has none",
              bytes ? bytes : HbLayout<64, __half>::bytes);
  backward(p, t);
}
