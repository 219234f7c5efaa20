/* Stage 08: the tensor-core instruction itself, mma.sync, with S, P and O in registers.
 *
 * The algorithm and the kernels are stage 07's. What changes is how a warp talks to the
 * tensor cores. WMMA does not document where a fragment's elements live: 07 wrote the layout
 * down and probed it on the device before relying on it, and its backward still passed P and
 * dS through shared memory. PTX's mma.sync.m16n8k16 and ldmatrix document their fragment
 * layouts (the PTX ISA, "Matrix Fragments for mma.m16n8k16"; drawn below), so here the code
 * owns the layout and every lane knows which rows and columns it holds:
 *   - S = Q K^T stays in the accumulators; a row's max and sum are reduced over the 4 lanes
 *     (a quad) that hold the row, with two shuffles;
 *   - P is made in registers: an accumulator of S for 16 keys is, rounded to the dtype two
 *     values at a time, exactly the left operand of P V for those 16 keys;
 *   - O stays in accumulators and is rescaled row by row in place;
 *   - the scale is folded into the exponent: p = 2^((s - m) scale log2(e)) on the raw S, with
 *     m the raw row max, so S is never scaled on its own;
 *   - only the tiles that cross the causal diagonal or the end of the keys are masked.
 * The backward likewise: S^T = K Q^T and dP^T = V dO^T are turned in registers into P^T and
 * dS^T, which are the left operands of dV += P^T dO and dK += dS^T Q; the dQ kernel makes dS
 * in registers for dQ += dS K. K, V, Q and dO tiles are copied with cp.async, the next tile
 * while the warps multiply this one.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <math.h>

#include "attention.h"
#include "gpu.h"

/* ---- the instruction ----------------------------------------------------------------------
 *
 * mma.sync.aligned.m16n8k16: D (16 x 8, fp32) = A (16 x 16) B (16 x 8) + C, one warp.
 * A lane l belongs to quad g = l / 4 and is lane t = l % 4 of it. Each operand is a set of
 * 8 x 8 blocks; in every block lane l holds row g and the two columns 2t, 2t + 1 (two 16-bit
 * values in one 32-bit register, the lower column in the lower half):
 *
 *   A (rows x k), 4 registers      B (k x cols), 2 registers     C, D (rows x cols), 4 floats
 *           k 0-7   k 8-15                 cols 0-7                        cols 0-7
 *   rows 0-7   a[0]   a[2]           k 0-7    b[0]  (transposed:   rows 0-7    c[0] c[1]
 *   rows 8-15  a[1]   a[3]           k 8-15   b[1]   lane l holds  rows 8-15   c[2] c[3]
 *                                                    column g, k 2t and 2t + 1)
 *
 * So lane l holds rows g and g + 8 of every accumulator, columns 2t and 2t + 1 of each
 * 8-column block. Two accumulators side by side (16 columns) hold exactly the elements of one
 * A operand with k = those 16 columns: c[0..1] of the first are a[0], c[2..3] are a[1], and
 * the second gives a[2] and a[3]. That is how S becomes P without leaving the registers.
 *
 * ldmatrix.x4 loads four 8 x 8 blocks of 16-bit values from shared memory, each lane giving
 * the address of one row (lanes 0-7 the rows of block 0, 8-15 of block 1, ...), and leaves
 * them in this layout; with .trans each block arrives transposed.
 */
constexpr int MmaM = 16, MmaN = 8, MmaK = 16;
constexpr int Quad = 4; /* lanes that share a row */

__device__ void mma_m16n8k16(float *c, const unsigned *a, const unsigned *b, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ void mma_m16n8k16(float *c, const unsigned *a, const unsigned *b, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* volatile: a load from shared memory must stay between the barriers that guard it. */
__device__ void ldmatrix_x4(unsigned *r, const void *row_address) {
  unsigned a = (unsigned)__cvta_generic_to_shared(row_address);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ void ldmatrix_x4_trans(unsigned *r, const void *row_address) {
  unsigned a = (unsigned)__cvta_generic_to_shared(row_address);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

/* Which row of a 16 x 16 tile (row-major in shared memory, leading dimension ld) this lane
 * points ldmatrix.x4 at, for the three ways the operands are read:
 *   a_operand: the tile as A (rows x k): blocks (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
 *     (8-15, 8-15) are a[0..3];
 *   b_operand: the tile holds B transposed, one row per output column (K for S = Q K^T):
 *     blocks (cols 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) are b[0..1] of the
 *     first 8 columns, then b[0..1] of the next 8;
 *   b_operand_trans: the tile holds B as it is, k down (V for O = P V), read with .trans:
 *     blocks (k 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15). */
template <typename T>
__device__ const T *a_operand(const T *tile, int ld) {
  int lane = threadIdx.x % 32;
  return tile + (lane % 16) * ld + lane / 16 * 8;
}
template <typename T>
__device__ const T *b_operand(const T *tile, int ld) {
  int lane = threadIdx.x % 32;
  return tile + (lane / 16 * 8 + lane % 8) * ld + lane / 8 % 2 * 8;
}
template <typename T>
__device__ const T *b_operand_trans(const T *tile, int ld) {
  int lane = threadIdx.x % 32;
  return tile + (lane / 8 % 2 * 8 + lane % 8) * ld + lane / 16 * 8;
}

/* Warps per block: 8 warps of 16 query rows each, Br = 128 rows, so that each K and V tile
 * copied into shared memory serves 128 rows. Measured on an H100 (fp16, N = 4096 and 16384,
 * TFLOP/s): 4 warps gave 199-226 at d = 64 and 206-220 at d = 128, 8 warps 235-249 and
 * 228-247. (At d = 128 a block holds 174 registers a thread, one block per SM.) */
constexpr int Warps = 8;
constexpr int Threads = Warps * 32;
/* Query rows per block: one instruction height per warp. */
constexpr int Br = Warps * MmaM;
/* Keys per tile: a warp's S tile is 16 x 64, eight accumulators, 32 registers per lane. */
constexpr int Bc = 64;
static_assert(Br <= 2 * Bc, "the forward stages its Q tile in the two K buffers");
static_assert(Bc % MmaK == 0, "a tile of keys is whole k-steps of P V");
/* Padding of every shared-memory row, in elements of the dtype (16 bytes). ldmatrix reads 8
 * rows of 16 bytes at once; unpadded rows 128 or 256 bytes long all start on the same bank,
 * so those 8 reads would queue on 4 banks. 16 extra bytes shift each row by 4 banks and the
 * 8 reads land on all 32. */
#ifndef ATTN_SKEW
#define ATTN_SKEW 8
#endif
constexpr int Skew = ATTN_SKEW;
static_assert(Skew % 8 == 0,
              "padded rows must stay 16-byte aligned: cp.async and ldmatrix move 16 bytes");
template <int D>
__host__ __device__ constexpr int ld_tile() {
  return D + Skew;
}

/* The exponentials are exp2 (one instruction): exp(x) = exp2(x log2 e), log x = ln 2 log2 x. */
constexpr float Log2e = 1.4426950408889634f, Ln2 = 0.6931471805599453f;

/* 2^x in one instruction (MUFU.EX2); 2^-inf = +0. Its relative error, about 2^-22, is far
 * below the dtype's rounding of P. */
__device__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* fp32 <-> the dtype, rounding to nearest even (the host rounds the same way). */
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/* Two dtype values in one 32-bit register, `lo` in the lower half: an operand register. */
__device__ unsigned pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}
__device__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}

/* The largest of x over the quad that holds a row (its 4 lanes are xor 1 and 2 apart). */
__device__ float max_over_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ float sum_over_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* Shared memory: Q's staging and the double-buffered K and V tiles. S and P never leave
 * the registers. */
template <typename T, int D>
static size_t tile_bytes() {
  return sizeof(T) * 4 * (size_t)Bc * ld_tile<D>();
}

/* The whole block copies `rows` rows of a [*, D] tensor into a tile of `tile_rows` rows
 * (ld_tile), 16 bytes per copy, without waiting: cp.async lets the copy of tile t + 1 run
 * while the warps multiply tile t. Rows past `rows` are zeroed: a V row there meets P = 0,
 * and 0 times uninitialised memory (possibly NaN) would be NaN. */
template <typename T, int D>
__device__ void load_tile_async(const T *src, int rows, int tile_rows, T *dst) {
  constexpr int chunk = 16 / sizeof(T), chunks = D / chunk; /* 16-byte pieces per row */
  for (int e = threadIdx.x; e < tile_rows * chunks; e += blockDim.x) {
    int r = e / chunks, c = (e % chunks) * chunk;
    if (r < rows)
      __pipeline_memcpy_async(dst + r * ld_tile<D>() + c, src + (long)r * D + c, 16);
    else
      *reinterpret_cast<float4 *>(dst + r * ld_tile<D>() + c) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

/* A warp's S = Q K^T for one tile (16 x Bc) in accumulators s[Bc / 8][4]. Only a tile that
 * crosses the causal diagonal or the end of the keys (`masked`) compares columns: there an
 * element past its row's last visible key (row_cols, one per row the lane holds) becomes
 * -inf. m_blk is each row's max over the tile, reduced over the row's quad. */
template <typename T, int D>
__device__ void compute_qk_scores_and_max(const unsigned (*q_frag)[4], const T *Kt, bool masked,
                                          const int *row_cols, float (*s)[4], float *m_blk) {
#pragma unroll
  for (int n = 0; n < Bc / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) s[n][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++)
#pragma unroll
    for (int n2 = 0; n2 < Bc / 16; n2++) { /* 16 keys: two accumulators */
      unsigned b[4];
      ldmatrix_x4(b, b_operand(Kt + n2 * 16 * ld_tile<D>() + kk * MmaK, ld_tile<D>()));
      mma_m16n8k16(s[2 * n2], q_frag[kk], b, T());
      mma_m16n8k16(s[2 * n2 + 1], q_frag[kk], b + 2, T());
    }
  int t = threadIdx.x % Quad;
  if (masked) {
#pragma unroll
    for (int n = 0; n < Bc / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (n * MmaN + 2 * t + e % 2 >= row_cols[e / 2]) s[n][e] = -INFINITY;
  }
  m_blk[0] = m_blk[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < Bc / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) m_blk[e / 2] = fmaxf(m_blk[e / 2], s[n][e]);
  m_blk[0] = max_over_quad(m_blk[0]);
  m_blk[1] = max_over_quad(m_blk[1]);
}

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l
 * and the O accumulators) is rescaled by 2^((m - m') scale log2 e), row by row. */
template <int D>
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float (*o_acc)[4]) {
  float correction[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float m_new = fmaxf(m[h], m_blk[h]);
    /* While a row has seen no key m' is still -inf, and 2^(-inf - -inf) would be NaN;
     * there is nothing to rescale then (l = 0, O = 0). */
    correction[h] = m_new == -INFINITY ? 1.f : exp2_approx((m[h] - m_new) * scale_log2);
    l[h] *= correction[h];
    m[h] = m_new;
  }
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) o_acc[n][e] *= correction[e / 2];
}

/* p = 2^((s - m) scale log2(e)) per element, l += p in fp32 (this lane's columns only; the
 * quad's partial sums are added once, at the end), and O += P V. For each 16 keys, the two
 * accumulators of S that hold them become one A operand of P V.
 * Why not one FFMA, 2^(s c - m c) with m c precomputed, as FlashAttention does: m c is
 * rounded, and for the row's largest element s c - round(m c) is that rounding error, up to
 * half an ulp of m c, which is no longer small once |m c| passes 2^16 or so (4096 at
 * logits of 1e11, bf16 inputs of magnitude 1e5): 2^4096 is inf. s - m is exact for the
 * largest element (0: p = 1) and close to exact near it. */
template <typename T, int D>
__device__ void compute_block_softmax_and_weighted_v(const float (*s)[4], float scale_log2,
                                                     const float *m, float *l, const T *Vt,
                                                     float (*o_acc)[4]) {
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
#pragma unroll
  for (int kk = 0; kk < Bc / MmaK; kk++) {
    unsigned p_frag[4];
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const float *x = s[2 * kk + half];
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        p[e] = exp2_approx((x[e] - m_use[e / 2]) * scale_log2);
        l[e / 2] += p[e];
      }
      p_frag[2 * half] = pack2(p[0], p[1], T());     /* rows 0-7 */
      p_frag[2 * half + 1] = pack2(p[2], p[3], T()); /* rows 8-15 */
    }
#pragma unroll
    for (int n2 = 0; n2 < D / 16; n2++) {
      unsigned b[4];
      ldmatrix_x4_trans(b, b_operand_trans(Vt + kk * MmaK * ld_tile<D>() + n2 * 16, ld_tile<D>()));
      mma_m16n8k16(o_acc[2 * n2], p_frag, b, T());
      mma_m16n8k16(o_acc[2 * n2 + 1], p_frag, b + 2, T());
    }
  }
}

/* Writes a warp's 16 x D fp32 accumulators, times factor[h] for the lane's row h, as dtype T,
 * rows [0, rows) only: each lane stores its two adjacent columns as one 32-bit word. */
template <typename T, int D>
__device__ void store_tile(const float (*acc)[4], const float *factor, T *out, int rows) {
  int lane = threadIdx.x % 32, g = lane / Quad, t = lane % Quad;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = g + 8 * h;
    if (r >= rows) continue;
#pragma unroll
    for (int n = 0; n < D / MmaN; n++)
      *reinterpret_cast<unsigned *>(out + (long)r * D + n * MmaN + 2 * t) =
          pack2(acc[n][2 * h] * factor[h], acc[n][2 * h + 1] * factor[h], T());
  }
}

/* O = acc / l and LSE = m scale + ln l for the lane's two rows (a row that saw no key:
 * O = 0, LSE = -inf), after adding up the quad's partial sums of l. */
__device__ void normalize_output(const float *m, float scale_log2, float *l, float *inverse,
                                 float *lse, int row, int nq) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] = sum_over_quad(l[h]);
    inverse[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    if (threadIdx.x % Quad == 0 && row + 8 * h < nq)
      lse[row + 8 * h] = l[h] > 0.f ? (m[h] * scale_log2 + log2f(l[h])) * Ln2 : -INFINITY;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(Threads)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, int nq, int nkv, int heads,
                         float scale, int causal) {
  extern __shared__ __align__(128) float4 smem[]; /* cp.async and ldmatrix want 16 bytes */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * Bc * ld_tile<D>();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  /* Block order as in stage 05: causal blocks heaviest first across heads. */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* This warp's 16 rows start at row0; this lane holds rows i and i + 8 of them. */
  int row0 = i0 + warp * MmaM, i = row0 + lane / Quad;
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;

  /* Q passes through the K buffers into registers (d / 16 A operands per warp). */
  load_tile_async<T, D>(q + (bh * nq + i0) * D, min(Br, nq - i0), Br, Ks);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads(); /* RAW: the Q tile is in shared memory before the ldmatrix loads */
  unsigned q_frag[D / MmaK][4];
  float o_acc[D / MmaN][4];
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++)
    ldmatrix_x4(q_frag[kk], a_operand(Ks + warp * MmaM * ld_tile<D>() + kk * MmaK, ld_tile<D>()));
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) o_acc[n][e] = 0.f;
  /* The row max is taken on the unscaled S, which is only right for a positive scale: a
   * negative scale flips the sign of Q instead (exact: the sign bit of both 16-bit values
   * in a register), and a zero scale is Q = 0 with any positive scale. */
  float scale_log2 = fabsf(scale) * Log2e;
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      if (scale < 0.f) q_frag[kk][r] ^= 0x80008000u;
      if (scale == 0.f) q_frag[kk][r] = 0u;
    }
  if (scale == 0.f) scale_log2 = Log2e;
  __syncthreads(); /* WAR: every warp holds its Q before the K/V pipeline reuses the buffer */

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, m_blk[2];
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  int tiles = (kv_end + Bc - 1) / Bc;
  if (tiles > 0) {
    load_tile_async<T, D>(K, min(Bc, nkv), Bc, Ks);
    load_tile_async<T, D>(V, min(Bc, nkv), Bc, Vs);
  }
  __pipeline_commit();
  for (int t = 0; t < tiles; t++) {
    int j0 = t * Bc, cols = min(Bc, nkv - j0), buf = t % 2;
    /* Start copying the next tile into the other buffer, then wait for this one. */
    if (t + 1 < tiles) {
      int next = j0 + Bc, next_cols = min(Bc, nkv - next), next_buf = (t + 1) % 2;
      load_tile_async<T, D>(K + (long)next * D, next_cols, Bc, Ks + next_buf * Bc * ld_tile<D>());
      load_tile_async<T, D>(V + (long)next * D, next_cols, Bc, Vs + next_buf * Bc * ld_tile<D>());
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: every thread's copies of tile t have landed before any warp reads it */
    const T *Kt = Ks + buf * Bc * ld_tile<D>(), *Vt = Vs + buf * Bc * ld_tile<D>();
    /* Only a tile past the end of the keys, or past the warp's first row's last visible key
     * (it crosses the diagonal), is masked; each row keeps the columns it sees, [j0,
     * i + offset], which may be none. The test is the same for the whole warp. */
    bool diagonal = causal && j0 + Bc - 1 > row0 + offset;
    bool masked = cols < Bc || diagonal;
    int row_cols[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
      row_cols[h] = diagonal ? max(0, min(cols, i + 8 * h + offset + 1 - j0)) : cols;
    float s[Bc / MmaN][4];
    compute_qk_scores_and_max<T, D>(q_frag, Kt, masked, row_cols, s, m_blk);
    merge_block_stats<D>(m_blk, scale_log2, m, l, o_acc);
    compute_block_softmax_and_weighted_v<T, D>(s, scale_log2, m, l, Vt, o_acc);
    __syncthreads(); /* WAR: every warp is done with buffer `buf` before tile t + 2 fills it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */

  float inverse[2];
  normalize_output(m, scale_log2, l, inverse, lse + bh * nq, i, nq);
  store_tile<T, D>(o_acc, inverse, o + (bh * nq + row0) * D, nq - row0);
}

template <typename T, int D>
static void launch(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  attn_require_shared_memory((const void *)flash_forward_kernel<T, D>, tile_bytes<T, D>(),
                             "flash_forward_kernel");
  flash_forward_kernel<T, D><<<grid, Threads, tile_bytes<T, D>()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (T *)t->o, t->lse, p->seq_q, p->seq_kv,
      heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

template <typename T>
static void forward_dtype(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch<T, 32>(p, t); break;
    case 64: launch<T, 64>(p, t); break;
    case 128: launch<T, 128>(p, t); break;
  }
}

static void forward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16)
    forward_dtype<__nv_bfloat16>(p, t);
  else
    forward_dtype<__half>(p, t);
}

/* ---- the backward ------------------------------------------------------------------ */

/* The backward's tiles. A dK/dV block has WARPS_DKDV warps, each owning 16 keys, and walks
 * query tiles of ROWS_DKDV rows; a dQ block has WARPS_DQ warps, each owning 16 query rows,
 * and walks the forward's tiles of Bc keys. */
template <int WARPS_DKDV, int ROWS_DKDV, int WARPS_DQ>
struct BackwardTiles {
  static constexpr int Warps_bwd = WARPS_DKDV, Threads_bwd = Warps_bwd * 32;
  /* Keys per dK/dV block: one instruction height per warp, as Br in the forward. */
  static constexpr int Bc_bwd = Warps_bwd * MmaM, Br_bwd = ROWS_DKDV;
  static constexpr int Warps_dq = WARPS_DQ, Threads_dq = Warps_dq * 32, Br_dq = Warps_dq * MmaM;
  /* Keys per tile of the dQ kernel: 32, half the forward's, so that its shared memory (70 KiB
   * at d = 128) lets 3 blocks share an SM; measured on an H100, +3 to +7% on the backward at
   * d = 128 and +2 to +3% at d = 64, against 64 keys (2 blocks). */
  static constexpr int Bc_dq = 32;
  static_assert(Br_bwd % MmaK == 0, "the dK/dV kernel's query tiles are whole k-steps");
};
/* Where the device allows it: 8 dK/dV warps, so that the block's Q and dO tiles serve 128
 * keys, query tiles of 64 rows like Bc in the forward, and 4 dQ warps. The dK/dV block needs
 * 137 KiB at d = 128 (fp16 and bf16 alike); every other block fits 99 KiB. */
using LargeTiles = BackwardTiles<8, 64, 4>;
/* Where a block gets less (99 KiB on sm_86 and sm_89, 163 KiB on sm_80): half the warps and
 * half the query rows per tile: at most 69 KiB at d = 128. */
using SmallTiles = BackwardTiles<4, 32, 2>;

/* Blocks of the dK/dV kernel that must fit an SM at once, which caps its registers: at
 * d <= 64, 2 (128 registers a thread; measured on an H100, +12 to +16% on the backward
 * against the compiler's 134 registers and one block); at d = 128 dK and dV alone take 128
 * registers, so 1. */
__host__ __device__ constexpr int dkdv_blocks_per_sm(int d) { return d <= 64 ? 2 : 1; }

static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) * attn_lse_elems(p);
}

/* Shared memory of the dK/dV kernel: its K and V tiles, double-buffered Q and dO tiles and
 * LSE and D of the tile's rows. P^T and dS^T never leave the registers. */
template <typename T, int D, typename Tiles>
static size_t dkdv_bytes() {
  return sizeof(T) * (2 * (size_t)Tiles::Bc_bwd + 4 * (size_t)Tiles::Br_bwd) * ld_tile<D>() +
         sizeof(float) * 4 * Tiles::Br_bwd;
}

/* Shared memory of the dQ kernel: its Q and dO tiles and double-buffered K and V tiles. */
template <typename T, int D, typename Tiles>
static size_t dq_bytes() {
  return sizeof(T) * (2 * (size_t)Tiles::Br_dq + 4 * (size_t)Tiles::Bc_dq) * ld_tile<D>();
}

/* D_i = sum_c dO_ic O_ic in fp32, one thread per row. (It equals sum_j dP_ij P_ij: the
 * backward of the softmax needs exactly this dot product, and O = P V makes it a d-term
 * sum.) */
template <typename T>
__global__ void compute_delta_kernel(const T *o, const T *d_o, float *delta, long rows, int d) {
  long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float sum = 0.f;
  for (int c = 0; c < d; c++) sum += to_float(d_o[r * d + c]) * to_float(o[r * d + c]);
  delta[r] = sum;
}

/* Copies rows [i0, i0 + rows) of LSE (times log2 e, for exp2) and D into shared memory;
 * rows past the end get 0 (they are masked anyway). */
__device__ void load_row_stats(const float *lse, const float *delta, int rows, int tile_rows,
                               float *lse_s, float *delta_s) {
  for (int e = threadIdx.x; e < tile_rows; e += blockDim.x) {
    lse_s[e] = e < rows ? lse[e] * Log2e : 0.f;
    delta_s[e] = e < rows ? delta[e] : 0.f;
  }
}

/* P = 2^(s scale log2(e) - LSE) (LSE in log2 units) and dS = P (dP - D) for the four
 * elements of an accumulator, left as half an A operand: out[0] packs rows 0-7, out[1] rows
 * 8-15. lse and delta give the value for column 2t + e % 2 (`by_column`: the dK/dV kernel,
 * whose rows are keys) or for row h (the dQ kernel). A masked element is 0, and exp2 is never
 * asked for it, so a row that sees no key (LSE = -inf) cannot make a NaN. P <= 1 exactly,
 * but an fp32 LSE of huge logits is only known to a few units (2^-24 |LSE|: 4096 at 1e11,
 * bf16 inputs of magnitude 1e5), and 2^4096 is inf; the clamp keeps P a probability, so
 * such inputs give finite gradients instead of NaN. */
template <typename T>
__device__ void probabilities_and_ds(const float *s, const float *dp, float scale_log2,
                                     const float *lse, const float *delta, const bool *visible,
                                     unsigned *p_out, unsigned *ds_out) {
  float p[4], ds[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    float prob = visible[e] ? fminf(1.f, exp2_approx(fmaf(s[e], scale_log2, -lse[e]))) : 0.f;
    p[e] = prob;
    ds[e] = prob * (dp[e] - delta[e]);
  }
  p_out[0] = pack2(p[0], p[1], T()), p_out[1] = pack2(p[2], p[3], T());
  ds_out[0] = pack2(ds[0], ds[1], T()), ds_out[1] = pack2(ds[2], ds[3], T());
}

/* Each warp owns 16 keys j of the block's Bc_bwd keys and keeps their dK, dV in
 * accumulators while it walks the query tiles, 16 queries at a time: S^T = K Q^T and
 * dP^T = V dO^T (keys as rows), P^T and dS^T made in registers, then dV += P^T dO and
 * dK += dS^T Q with those 16 queries as the k-step. */
template <typename T, int D, typename Tiles>
__global__ void __launch_bounds__(Tiles::Threads_bwd, dkdv_blocks_per_sm(D))
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               T *__restrict__ dk, T *__restrict__ dv, int nq, int nkv, int heads,
                               float scale, int causal) {
  constexpr int Bc_bwd = Tiles::Bc_bwd, Br_bwd = Tiles::Br_bwd;
  extern __shared__ __align__(128) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + Bc_bwd * ld_tile<D>();
  T *Qs = Vs + Bc_bwd * ld_tile<D>(), *dOs = Qs + 2 * Br_bwd * ld_tile<D>();
  float *lse_s = reinterpret_cast<float *>(dOs + 2 * Br_bwd * ld_tile<D>());
  float *delta_s = lse_s + 2 * Br_bwd;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / Quad, tq = lane % Quad;
  int key_blocks = (nkv + Bc_bwd - 1) / Bc_bwd;
  long bh = blockIdx.x / key_blocks;
  int j0 = (int)(blockIdx.x % key_blocks) * Bc_bwd, offset = nkv - nq;
  int jw = j0 + warp * MmaM; /* this warp's first key */
  const T *Kw = Ks + warp * MmaM * ld_tile<D>(), *Vw = Vs + warp * MmaM * ld_tile<D>();

  const T *Q = q + bh * nq * D, *dO = d_o + bh * nq * D;
  load_tile_async<T, D>(k + (bh * nkv + j0) * D, min(Bc_bwd, nkv - j0), Bc_bwd, Ks);
  load_tile_async<T, D>(v + (bh * nkv + j0) * D, min(Bc_bwd, nkv - j0), Bc_bwd, Vs);
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  int tiles = nq > i_begin ? (nq - i_begin + Br_bwd - 1) / Br_bwd : 0;
  if (tiles > 0) {
    int rows = min(Br_bwd, nq - i_begin);
    load_tile_async<T, D>(Q + (long)i_begin * D, rows, Br_bwd, Qs);
    load_tile_async<T, D>(dO + (long)i_begin * D, rows, Br_bwd, dOs);
    load_row_stats(lse + bh * nq + i_begin, delta + bh * nq + i_begin, rows, Br_bwd, lse_s,
                   delta_s);
  }
  __pipeline_commit();
  float dk_acc[D / MmaN][4], dv_acc[D / MmaN][4];
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk_acc[n][e] = 0.f, dv_acc[n][e] = 0.f;
  const float scale_log2 = scale * Log2e;

  for (int t = 0; t < tiles; t++) {
    int i0 = i_begin + t * Br_bwd, buf = t % 2;
    if (t + 1 < tiles) {
      int next = i0 + Br_bwd, rows = min(Br_bwd, nq - next), nb = (t + 1) % 2;
      load_tile_async<T, D>(Q + (long)next * D, rows, Br_bwd, Qs + nb * Br_bwd * ld_tile<D>());
      load_tile_async<T, D>(dO + (long)next * D, rows, Br_bwd, dOs + nb * Br_bwd * ld_tile<D>());
      load_row_stats(lse + bh * nq + next, delta + bh * nq + next, rows, Br_bwd,
                     lse_s + nb * Br_bwd, delta_s + nb * Br_bwd);
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: tile t (and, the first time, K and V) is in shared memory */
    const T *Qt = Qs + buf * Br_bwd * ld_tile<D>(), *dOt = dOs + buf * Br_bwd * ld_tile<D>();
    const float *lse_t = lse_s + buf * Br_bwd, *delta_t = delta_s + buf * Br_bwd;
    /* Only a tile with rows past the end of the queries, keys past the end of the keys, or a
     * key that some of its rows must not see (it crosses the diagonal) tests visibility. */
    bool masked = i0 + Br_bwd > nq || jw + MmaM > nkv || (causal && jw + MmaM - 1 > i0 + offset);
#pragma unroll
    for (int n2 = 0; n2 < Br_bwd / MmaK; n2++) { /* 16 queries: one k-step of dV and dK */
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        unsigned a[4], b[4];
        const T *Qn = Qt + n2 * 16 * ld_tile<D>() + kk * MmaK;
        const T *dOn = dOt + n2 * 16 * ld_tile<D>() + kk * MmaK;
        ldmatrix_x4(a, a_operand(Kw + kk * MmaK, ld_tile<D>()));
        ldmatrix_x4(b, b_operand(Qn, ld_tile<D>()));
        mma_m16n8k16(s[0], a, b, T());
        mma_m16n8k16(s[1], a, b + 2, T());
        ldmatrix_x4(a, a_operand(Vw + kk * MmaK, ld_tile<D>()));
        ldmatrix_x4(b, b_operand(dOn, ld_tile<D>()));
        mma_m16n8k16(dp[0], a, b, T());
        mma_m16n8k16(dp[1], a, b + 2, T());
      }
      unsigned p_frag[4], ds_frag[4];
#pragma unroll
      for (int half = 0; half < 2; half++) { /* queries 0-7, then 8-15 of the k-step */
        int col = n2 * 16 + half * MmaN + 2 * tq;
        float lse_e[4] = {lse_t[col], lse_t[col + 1], lse_t[col], lse_t[col + 1]};
        float delta_e[4] = {delta_t[col], delta_t[col + 1], delta_t[col], delta_t[col + 1]};
        bool visible[4] = {true, true, true, true};
        if (masked) {
#pragma unroll
          for (int e = 0; e < 4; e++) {
            int i = i0 + col + e % 2, j = jw + g + 8 * (e / 2);
            visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
          }
        }
        unsigned p2[2], ds2[2];
        probabilities_and_ds<T>(s[half], dp[half], scale_log2, lse_e, delta_e, visible, p2, ds2);
        p_frag[2 * half] = p2[0], p_frag[2 * half + 1] = p2[1];
        ds_frag[2 * half] = ds2[0], ds_frag[2 * half + 1] = ds2[1];
      }
#pragma unroll
      for (int c2 = 0; c2 < D / 16; c2++) {
        unsigned b[4];
        ldmatrix_x4_trans(b, b_operand_trans(dOt + n2 * 16 * ld_tile<D>() + c2 * 16, ld_tile<D>()));
        mma_m16n8k16(dv_acc[2 * c2], p_frag, b, T());
        mma_m16n8k16(dv_acc[2 * c2 + 1], p_frag, b + 2, T());
        ldmatrix_x4_trans(b, b_operand_trans(Qt + n2 * 16 * ld_tile<D>() + c2 * 16, ld_tile<D>()));
        mma_m16n8k16(dk_acc[2 * c2], ds_frag, b, T());
        mma_m16n8k16(dk_acc[2 * c2 + 1], ds_frag, b + 2, T());
      }
    }
    __syncthreads(); /* WAR: every warp is done with buffer `buf` before tile t + 2 is
                      * copied in */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  const float dk_factor[2] = {scale, scale}, dv_factor[2] = {1.f, 1.f};
  store_tile<T, D>(dk_acc, dk_factor, dk + (bh * nkv + jw) * D, nkv - jw);
  store_tile<T, D>(dv_acc, dv_factor, dv + (bh * nkv + jw) * D, nkv - jw);
}

/* Each warp owns 16 query rows i and keeps dQ in accumulators while it walks the key tiles
 * like the forward, 16 keys at a time: S = Q K^T and dP = dO V^T, dS = P (dP - D) made in
 * registers, then dQ += dS K with those 16 keys as the k-step. */
template <typename T, int D, typename Tiles>
__global__ void __launch_bounds__(Tiles::Threads_dq)
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             T *__restrict__ dq, int nq, int nkv, int heads, float scale,
                             int causal) {
  constexpr int Br_dq = Tiles::Br_dq, Bc = Tiles::Bc_dq;
  extern __shared__ __align__(128) float4 smem[];
  T *Qs = reinterpret_cast<T *>(smem), *dOs = Qs + Br_dq * ld_tile<D>();
  T *Ks = dOs + Br_dq * ld_tile<D>(), *Vs = Ks + 2 * Bc * ld_tile<D>();
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / Quad, tq = lane % Quad;
  int row_blocks = (nq + Br_dq - 1) / Br_dq;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 = (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) *
           Br_dq;
  int iw = i0 + warp * MmaM; /* this warp's first row */
  const T *Qw = Qs + warp * MmaM * ld_tile<D>(), *dOw = dOs + warp * MmaM * ld_tile<D>();

  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  int rows = min(Br_dq, nq - i0);
  load_tile_async<T, D>(q + (bh * nq + i0) * D, rows, Br_dq, Qs);
  load_tile_async<T, D>(d_o + (bh * nq + i0) * D, rows, Br_dq, dOs);
  /* LSE (log2 units) and D of the lane's two rows, in registers; rows past the end get 0. */
  float lse_r[2], delta_r[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int i = iw + g + 8 * h;
    lse_r[h] = i < nq ? lse[bh * nq + i] * Log2e : 0.f;
    delta_r[h] = i < nq ? delta[bh * nq + i] : 0.f;
  }
  int offset = nkv - nq, last_row = min(i0 + Br_dq, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  int tiles = (kv_end + Bc - 1) / Bc;
  if (tiles > 0) {
    load_tile_async<T, D>(K, min(Bc, nkv), Bc, Ks);
    load_tile_async<T, D>(V, min(Bc, nkv), Bc, Vs);
  }
  __pipeline_commit();
  float dq_acc[D / MmaN][4];
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) dq_acc[n][e] = 0.f;
  const float scale_log2 = scale * Log2e;

  for (int t = 0; t < tiles; t++) {
    int j0 = t * Bc, buf = t % 2;
    if (t + 1 < tiles) {
      int next = j0 + Bc, next_cols = min(Bc, nkv - next), nb = (t + 1) % 2;
      load_tile_async<T, D>(K + (long)next * D, next_cols, Bc, Ks + nb * Bc * ld_tile<D>());
      load_tile_async<T, D>(V + (long)next * D, next_cols, Bc, Vs + nb * Bc * ld_tile<D>());
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: tile t (and, the first time, Q and dO) is in shared memory */
    const T *Kt = Ks + buf * Bc * ld_tile<D>(), *Vt = Vs + buf * Bc * ld_tile<D>();
    /* Only a tile with keys past the end, rows past the end, or crossing the warp's
     * diagonal tests visibility. */
    bool masked = j0 + Bc > nkv || iw + MmaM > nq || (causal && j0 + Bc - 1 > iw + offset);
#pragma unroll
    for (int n2 = 0; n2 < Bc / MmaK; n2++) { /* 16 keys: one k-step of dQ */
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        unsigned a[4], b[4];
        ldmatrix_x4(a, a_operand(Qw + kk * MmaK, ld_tile<D>()));
        ldmatrix_x4(b, b_operand(Kt + n2 * 16 * ld_tile<D>() + kk * MmaK, ld_tile<D>()));
        mma_m16n8k16(s[0], a, b, T());
        mma_m16n8k16(s[1], a, b + 2, T());
        ldmatrix_x4(a, a_operand(dOw + kk * MmaK, ld_tile<D>()));
        ldmatrix_x4(b, b_operand(Vt + n2 * 16 * ld_tile<D>() + kk * MmaK, ld_tile<D>()));
        mma_m16n8k16(dp[0], a, b, T());
        mma_m16n8k16(dp[1], a, b + 2, T());
      }
      unsigned p_frag[4], ds_frag[4];
      float lse_e[4] = {lse_r[0], lse_r[0], lse_r[1], lse_r[1]};
      float delta_e[4] = {delta_r[0], delta_r[0], delta_r[1], delta_r[1]};
#pragma unroll
      for (int half = 0; half < 2; half++) { /* keys 0-7, then 8-15 of the k-step */
        bool visible[4] = {true, true, true, true};
        if (masked) {
#pragma unroll
          for (int e = 0; e < 4; e++) {
            int i = iw + g + 8 * (e / 2), j = j0 + n2 * 16 + half * MmaN + 2 * tq + e % 2;
            visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
          }
        }
        unsigned p2[2], ds2[2];
        probabilities_and_ds<T>(s[half], dp[half], scale_log2, lse_e, delta_e, visible, p2, ds2);
        p_frag[2 * half] = p2[0], p_frag[2 * half + 1] = p2[1];
        ds_frag[2 * half] = ds2[0], ds_frag[2 * half + 1] = ds2[1];
      }
#pragma unroll
      for (int c2 = 0; c2 < D / 16; c2++) {
        unsigned b[4];
        ldmatrix_x4_trans(b, b_operand_trans(Kt + n2 * 16 * ld_tile<D>() + c2 * 16, ld_tile<D>()));
        mma_m16n8k16(dq_acc[2 * c2], ds_frag, b, T());
        mma_m16n8k16(dq_acc[2 * c2 + 1], ds_frag, b + 2, T());
      }
    }
    __syncthreads(); /* WAR: every warp is done with buffer `buf` before tile t + 2 is
                      * copied in */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  const float dq_factor[2] = {scale, scale};
  store_tile<T, D>(dq_acc, dq_factor, dq + (bh * nq + iw) * D, nq - iw);
}

template <typename T, int D, typename Tiles>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<T, D, Tiles>,
                             dkdv_bytes<T, D, Tiles>(), "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + Tiles::Bc_bwd - 1) / Tiles::Bc_bwd * heads);
  flash_backward_dkdv_kernel<T, D, Tiles>
      <<<key_blocks, Tiles::Threads_bwd, dkdv_bytes<T, D, Tiles>()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          (T *)t->dk, (T *)t->dv, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <typename T, int D, typename Tiles>
static void launch_dq(const attn_problem *p, const attn_buffers *t, const float *delta) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<T, D, Tiles>,
                             dq_bytes<T, D, Tiles>(), "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Tiles::Br_dq - 1) / Tiles::Br_dq * heads);
  flash_backward_dq_kernel<T, D, Tiles><<<row_blocks, Tiles::Threads_dq, dq_bytes<T, D, Tiles>()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
      (T *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

template <typename T, int D>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q;
  float *delta = (float *)t->workspace;
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  compute_delta_kernel<T>
      <<<(unsigned)((rows + delta_threads - 1) / delta_threads), delta_threads>>>(
          (const T *)t->o, (const T *)t->d_o, delta, rows, D);
  CHECK_LAUNCH("compute_delta_kernel");
  /* The large tiles where the device's shared memory holds them, else the small ones. */
  size_t limit = attn_shared_memory_limit();
  if (dkdv_bytes<T, D, LargeTiles>() <= limit)
    launch_dkdv<T, D, LargeTiles>(p, t, delta);
  else
    launch_dkdv<T, D, SmallTiles>(p, t, delta);
  if (dq_bytes<T, D, LargeTiles>() <= limit)
    launch_dq<T, D, LargeTiles>(p, t, delta);
  else
    launch_dq<T, D, SmallTiles>(p, t, delta);
}

template <typename T>
static void backward_dtype(const attn_problem *p, const attn_buffers *t) {
  switch (p->head_dim) {
    case 32: launch_backward<T, 32>(p, t); break;
    case 64: launch_backward<T, 64>(p, t); break;
    case 128: launch_backward<T, 128>(p, t); break;
  }
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16)
    backward_dtype<__nv_bfloat16>(p, t);
  else
    backward_dtype<__half>(p, t);
}

static const attn_stage stage = {
    .name = "08_mma_sync",
    .idea = "mma.sync and ldmatrix: the documented fragment layout, S, P and O in registers",
    .device = &attn_cuda_device,
    .head_dims = {32, 64, 128},
    .dtypes = DTYPE_BIT(DTYPE_FP16) | DTYPE_BIT(DTYPE_BF16),
    .has_causal = 1,
    .saves_lse = 1,
    .forward = forward,
    .backward_workspace = backward_workspace,
    .backward = backward,
};

int main(int argc, char **argv) { return attention_main(&stage, argc, argv); }
