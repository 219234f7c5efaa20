/* Stage 07: the matrix products on tensor cores, in fp16 or bf16.
 *
 * The algorithm is stage 06's: the same tiles, the same online softmax, the same backward
 * (D pre-pass, a dK/dV kernel over key tiles, a deterministic dQ kernel over query tiles).
 * What changes is who multiplies. A warp hands a 16 x 16 x 16 product to a tensor core
 * through nvcuda::wmma (inputs fp16 or bf16, fp32 accumulation), so the unit of work is a
 * warp and a 16-row fragment, no longer a thread and a row:
 *   S = Q K^T, O += P V                       (forward)
 *   S = Q K^T, dP = dO V^T, dV += P^T dO,     (backward; P and dS rounded to the dtype
 *   dK += dS^T Q, dQ += dS K                   before they enter a product)
 * The softmax statistics (m, l, LSE, D) stay in fp32.
 *
 * A fragment's elements are spread over the 32 threads of a warp in a layout CUDA does not
 * document. This stage relies on the layout of sm_80 to sm_90 (fragment_row, fragment_col)
 * and checks it on the device before the first launch. Knowing it, the forward keeps S and
 * P in registers: a row's max and sum are reduced over the 4 lanes that hold the row, and
 * S's accumulator becomes P's operand without passing through shared memory. The backward
 * computes P and dS element by element on S and dP's accumulators.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <math.h>
#include <mma.h>
#include <string.h>

#include "attention.h"
#include "gpu.h"

using namespace nvcuda;

/* The WMMA shape: a warp multiplies 16 x 16 by 16 x 16 tiles (fp16 and bf16 both offer
 * m16n16k16). Every tile below is a multiple of it. */
constexpr int Frag = 16;
/* Warps per block: 4 warps of 16 query rows each, Br = 64 rows. A forward block needs 36 KiB
 * (d = 64) or 68 KiB (d = 128) of shared memory and 128 or 168 registers per thread, so 4 or
 * 3 blocks share an SM: 16 or 12 warps to hide one another's loads and products. (8 warps
 * per block measured +3% at d = 64 and -11% at d = 128 on an H100.) */
constexpr int Warps = 4;
constexpr int Threads = Warps * 32;
/* Query rows per block: one fragment height per warp. */
constexpr int Br = Warps * Frag;
/* Keys per tile: 4 fragments wide, so a warp's S tile is 4 accumulator fragments, 32
 * registers per lane. (Bc = 128 doubles them: 229 registers at d = 128, and the forward
 * measured 7% slower at d = 64 and 40% slower at d = 128 on an H100.) */
constexpr int Bc = 64;
static_assert(Br <= 2 * Bc, "the forward stages its Q tile in the two K buffers");
/* Padding of every shared-memory row, in elements of the dtype (16 bytes). A wmma load
 * reads 8 rows of 16 bytes at a time; unpadded rows 128 or 256 bytes long all start on the
 * same bank, so those 8 reads queue on 4 banks. 16 extra bytes shift each row by 4 banks
 * and the 8 reads land on all 32. (Build with -DATTN_SKEW=0 to measure the difference;
 * the README gives the numbers.) */
#ifndef ATTN_SKEW
#define ATTN_SKEW 8
#endif
constexpr int Skew = ATTN_SKEW;
static_assert(Skew % 8 == 0,
              "padded rows must stay 16-byte aligned: cp.async copies 16 bytes at a time and "
              "WMMA's leading dimension is a multiple of 8 16-bit elements (4 floats)");
/* Leading dimensions: Q, K, V, dO tiles (dtype), the backward's P and dS tiles (dtype), the
 * fp32 staging of an output tile (the same 16 bytes of padding). */
template <int D>
__host__ __device__ constexpr int ld_tile() {
  return D + Skew;
}
constexpr int ld_p = Bc + Skew;
constexpr int ld_s = Bc + Skew / 2;

/* The exponentials are exp2 (one instruction): exp(x) = exp2(x log2 e), log x = ln 2 log2 x. */
constexpr float Log2e = 1.4426950408889634f, Ln2 = 0.6931471805599453f;

/* fp32 <-> the dtype, rounding to nearest even (the host rounds the same way). */
template <typename T>
__device__ T from_float(float x);
template <>
__device__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, Frag, Frag, Frag, T, wmma::row_major>;
/* K^T as the right operand: K is row-major in shared memory, which is K^T column-major. */
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, Frag, Frag, Frag, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, Frag, Frag, Frag, T, wmma::row_major>;
using FragAcc = wmma::fragment<wmma::accumulator, Frag, Frag, Frag, float>;

/* Loads a fragment from shared memory. For fp16, wmma::load_matrix_sync compiles to
 * ldmatrix from the shared state space; for bf16 (CUDA 13.0) it addresses the same tiles
 * generically, without ldmatrix, and the forward ran 17% slower in bf16 than in fp16. The
 * bf16 overloads below state the shared state space in PTX, as the fp16 path does. */
template <typename Fragment, typename T>
__device__ void load_fragment(Fragment &f, const T *p, int ld) {
  wmma::load_matrix_sync(f, p, ld);
}
#define LOAD_BF16_FRAGMENT(FragType, ptx_op)                                                  \
  __device__ void load_fragment(FragType<__nv_bfloat16> &f, const __nv_bfloat16 *p, int ld) { \
    unsigned r[4], address = (unsigned)__cvta_generic_to_shared(p);                           \
    static_assert(sizeof f.x == sizeof r, "a bf16 fragment is four 32-bit registers");        \
    asm volatile(ptx_op " {%0, %1, %2, %3}, [%4], %5;"                                        \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                             \
                 : "r"(address), "r"(ld));                                                    \
    memcpy(f.x, r, sizeof r);                                                                 \
  }
LOAD_BF16_FRAGMENT(FragA, "wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16")
LOAD_BF16_FRAGMENT(FragBt, "wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16")
LOAD_BF16_FRAGMENT(FragB, "wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16")

/* Where element e of a 16 x 16 fragment sits in its tile, for this lane. CUDA does not
 * document it. On sm_80 to sm_90 a 16 x 16 x 16 product is two m16n8k16 tensor-core
 * instructions, and the accumulator and the left operand (matrix_a, row-major) both follow
 * their layout: the 4 lanes of a quad hold the same two rows, lane / 4 and lane / 4 + 8,
 * each lane two adjacent columns, 2 (lane mod 4) and 2 (lane mod 4) + 1, and those plus 8.
 * An fp16 matrix_a (16 elements) holds every element twice, at e and e + 8: WMMA keeps
 * Volta's fragment size. require_fragment_layout checks every element of it on the device
 * before the first launch, so a GPU that places them otherwise fails clearly instead of
 * computing garbage. */
constexpr int Quad = 4;        /* lanes that share a row */
constexpr int Half = Frag / 2; /* a lane's second row is its first plus Half */
__device__ constexpr int row_half(int e) { return e / 2 % 2; } /* 0: row lane / 4, 1: + Half */
__device__ int fragment_row(int e) { return threadIdx.x % 32 / Quad + Half * row_half(e); }
__device__ int fragment_col(int e) { return 2 * (threadIdx.x % Quad) + e % 2 + Half * (e / 4 % 2); }

/* The largest of x over the quad that holds a row (its 4 lanes are xor 1 and 2 apart). */
__device__ float max_over_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ float sum_over_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* Counts the fragment elements that are not where fragment_row and fragment_col say: loads
 * tiles whose entry (r, c) is 16 r + c (exact in fp16 and bf16: integers up to 256) into an
 * accumulator and a matrix_a fragment, and compares. One warp. */
template <typename T>
__global__ void count_misplaced_kernel(int *misplaced) {
  __shared__ __align__(32) float probe_acc[Frag * Frag];
  __shared__ __align__(32) T probe_a[Frag * Frag];
  for (int e = threadIdx.x; e < Frag * Frag; e += 32) {
    probe_acc[e] = (float)e;
    probe_a[e] = from_float<T>((float)e);
  }
  __syncwarp(); /* RAW: the probe tiles are written before the warp loads them */
  FragAcc acc;
  FragA<T> a;
  wmma::load_matrix_sync(acc, probe_acc, Frag, wmma::mem_row_major);
  load_fragment(a, probe_a, Frag);
  int wrong = 0;
  for (int e = 0; e < acc.num_elements; e++)
    wrong += acc.x[e] != (float)(fragment_row(e) * Frag + fragment_col(e));
  for (int e = 0; e < a.num_elements; e++)
    wrong += to_float(a.x[e]) != (float)(fragment_row(e) * Frag + fragment_col(e));
  atomicAdd(misplaced, wrong);
}

template <typename T>
static void require_fragment_layout() {
  static bool checked = false; /* once per dtype and process */
  if (checked) return;
  int *misplaced, count = 0;
  CUDA_CHECK(cudaMalloc(&misplaced, sizeof(int)));
  CUDA_CHECK(cudaMemset(misplaced, 0, sizeof(int)));
  count_misplaced_kernel<T><<<1, 32>>>(misplaced);
  CHECK_LAUNCH("count_misplaced_kernel");
  CUDA_CHECK(cudaMemcpy(&count, misplaced, sizeof(int), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(misplaced));
  if (count > 0)
    attn_fail(EXIT_CHECK_FAILED,
              "%d WMMA fragment elements are not where this stage expects them (the "
              "sm_80-sm_90 tensor-core layout); it cannot run on this GPU",
              count);
  checked = true;
}

/* Shared memory: Q's staging and the double-buffered K and V tiles. S and P never leave
 * the registers. */
template <typename T, int D>
static size_t tile_bytes() {
  return sizeof(T) * 4 * (size_t)Bc * ld_tile<D>();
}

/* The whole block copies `rows` rows of a [*, D] tensor into a tile of Bc or Br rows
 * (ld_tile), 16 bytes per copy, without waiting: cp.async lets the copy of tile t + 1
 * run while the warps multiply tile t. Rows past `rows` are zeroed: a V row there meets
 * P = 0, and 0 times uninitialised memory (possibly NaN) would be NaN. */
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

/* A warp's S = Q K^T for one tile (16 x Bc), on tensor cores, left in accumulator
 * fragments: Bc / 16 fragments, 8 elements per lane each. Each element becomes a logit in
 * log2 units (the exponentials below are exp2), or -inf where its column is past the row's
 * last visible key (row_cols, one per row the lane holds); m_blk is each row's max over the
 * tile, reduced over the row's quad. */
template <typename T, int D>
__device__ void compute_qk_scores_and_max(const FragA<T> *q_frag, const T *Kt, const int *row_cols,
                                          float scale_log2, FragAcc *s, float *m_blk) {
#pragma unroll
  for (int n = 0; n < Bc / Frag; n++) {
    wmma::fill_fragment(s[n], 0.f);
#pragma unroll
    for (int c = 0; c < D / Frag; c++) {
      FragBt<T> k_frag;
      load_fragment(k_frag, Kt + n * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
      wmma::mma_sync(s[n], q_frag[c], k_frag, s[n]);
    }
  }
  m_blk[0] = m_blk[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < Bc / Frag; n++)
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; e++) {
      int h = row_half(e);
      float x = n * Frag + fragment_col(e) < row_cols[h] ? s[n].x[e] * scale_log2 : -INFINITY;
      s[n].x[e] = x;
      m_blk[h] = fmaxf(m_blk[h], x);
    }
  m_blk[0] = max_over_quad(m_blk[0]);
  m_blk[1] = max_over_quad(m_blk[1]);
}

/* m' = max(m, m_blk); what was summed under 2^-m (l and the O accumulators) is rescaled by
 * 2^(m - m'), row by row. */
template <int D>
__device__ void merge_block_stats(const float *m_blk, float *m, float *l, FragAcc *o_frag) {
  float correction[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float m_new = fmaxf(m[h], m_blk[h]);
    /* While a row has seen no key m' is still -inf, and 2^(-inf - -inf) would be NaN;
     * there is nothing to rescale then (l = 0, O = 0). */
    correction[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
    l[h] *= correction[h];
    m[h] = m_new;
  }
#pragma unroll
  for (int f = 0; f < D / Frag; f++)
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; e++) o_frag[f].x[e] *= correction[row_half(e)];
}

/* Two dtype values in one 32-bit word, rounded to nearest even. */
__device__ unsigned pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}
__device__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}

/* p = 2^(x - m) per element, l += p in fp32 (this lane's columns only; the quad's partial
 * sums are added once, at the end), and O += P V on tensor cores. P's matrix_a fragment is
 * made in registers: its element e is the accumulator's element e mod 8 (the same position),
 * rounded to the dtype two at a time. */
template <typename T, int D>
__device__ void compute_block_softmax_and_weighted_v(const FragAcc *s, const float *m, float *l,
                                                     const T *Vt, FragAcc *o_frag) {
#pragma unroll
  for (int n = 0; n < Bc / Frag; n++) {
    float prob[FragAcc::num_elements];
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; e++) {
      int h = row_half(e);
      prob[e] = m[h] == -INFINITY ? 0.f : exp2f(s[n].x[e] - m[h]);
      l[h] += prob[e];
    }
    FragA<T> p_frag;
    static_assert(sizeof p_frag.x % sizeof(unsigned) == 0, "elements pack two to a 32-bit word");
#pragma unroll
    for (int e = 0; e < p_frag.num_elements; e += 2) {
      unsigned pair =
          pack2(prob[e % FragAcc::num_elements], prob[(e + 1) % FragAcc::num_elements], T());
      memcpy(&p_frag.x[e], &pair, sizeof pair);
    }
#pragma unroll
    for (int f = 0; f < D / Frag; f++) {
      FragB<T> v_frag;
      load_fragment(v_frag, Vt + n * Frag * ld_tile<D>() + f * Frag, ld_tile<D>());
      wmma::mma_sync(o_frag[f], p_frag, v_frag, o_frag[f]);
    }
  }
}

/* Writes a warp's 16 x D fp32 accumulator tile, times `factor`, as dtype T, rows [0, rows)
 * only. It passes through a staging area 64 columns at a time, so that each row leaves as
 * contiguous stores. */
template <typename T, int D>
__device__ void store_tile(const FragAcc *acc, float *S_w, float factor, T *out, int rows) {
  constexpr int group = Bc / Frag; /* fragments that fit the staging area's width */
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int f0 = 0; f0 < D / Frag; f0 += group) {
    constexpr int width = (D < Bc ? D : Bc);
#pragma unroll
    for (int f = 0; f < width / Frag; f++)
      wmma::store_matrix_sync(S_w + f * Frag, acc[f0 + f], ld_s, wmma::mem_row_major);
    __syncwarp(); /* RAW: every lane's fragment elements are staged before rows are read */
    for (int e = lane; e < Frag * width; e += 32) {
      int r = e / width, c = e % width;
      if (r < rows) out[(long)r * D + f0 * Frag + c] = from_float<T>(S_w[r * ld_s + c] * factor);
    }
    __syncwarp(); /* WAR: the staging area is read before the next group overwrites it */
  }
}

/* O = acc / l and LSE = (m + log2 l) ln 2 for the lane's two rows (a row that saw no key:
 * O = 0, LSE = -inf), after adding up the quad's partial sums of l. */
template <int D>
__device__ void normalize_output(FragAcc *o_frag, const float *m, float *l, float *lse, int row,
                                 int nq) {
  float inverse[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] = sum_over_quad(l[h]);
    inverse[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    if (threadIdx.x % Quad == 0 && row + Half * h < nq)
      lse[row + Half * h] = l[h] > 0.f ? (m[h] + log2f(l[h])) * Ln2 : -INFINITY;
  }
#pragma unroll
  for (int f = 0; f < D / Frag; f++)
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; e++) o_frag[f].x[e] *= inverse[row_half(e)];
}

template <typename T, int D>
__global__ void __launch_bounds__(Threads)
    flash_forward_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         T *__restrict__ o, float *__restrict__ lse, int nq, int nkv, int heads,
                         float scale, int causal) {
  extern __shared__ __align__(128) float4 smem[]; /* cp.async wants 16 bytes, wmma 32 */
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * Bc * ld_tile<D>();
  int warp = threadIdx.x / 32;
  /* Block order as in stage 05: causal blocks heaviest first across heads. */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* This warp's 16 rows start at row0; this lane holds rows i and i + Half of them. */
  int row0 = i0 + warp * Frag, i = row0 + fragment_row(0);
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;

  /* Q passes through the K buffers into registers (d / 16 fragments per warp). */
  load_tile_async<T, D>(q + (bh * nq + i0) * D, min(Br, nq - i0), Br, Ks);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads(); /* RAW: the Q tile is in shared memory before the fragment loads */
  FragA<T> q_frag[D / Frag];
  FragAcc o_frag[D / Frag];
#pragma unroll
  for (int c = 0; c < D / Frag; c++) {
    load_fragment(q_frag[c], Ks + warp * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
    wmma::fill_fragment(o_frag[c], 0.f);
  }
  __syncthreads(); /* WAR: every warp holds its Q before the K/V pipeline reuses the buffer */

  const float scale_log2 = scale * Log2e;
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
    /* A tile past the first row's limit crosses the diagonal: each row keeps the columns it
     * sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > i0 + offset;
    int row_cols[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
      row_cols[h] = diagonal ? max(0, min(cols, i + Half * h + offset + 1 - j0)) : cols;
    FragAcc s[Bc / Frag];
    compute_qk_scores_and_max<T, D>(q_frag, Kt, row_cols, scale_log2, s, m_blk);
    merge_block_stats<D>(m_blk, m, l, o_frag);
    compute_block_softmax_and_weighted_v<T, D>(s, m, l, Vt, o_frag);
    __syncthreads(); /* WAR: every warp is done with buffer `buf` before tile t + 2 fills it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */

  normalize_output<D>(o_frag, m, l, lse + bh * nq, i, nq);
  /* The store stages through the K and V buffers, which no warp reads after the loop's
   * last barrier (or, with no tile, after Q's). */
  static_assert(Warps * Frag * ld_s * sizeof(float) <= 4 * Bc * ld_tile<32>() * sizeof(__half),
                "the K and V buffers hold every warp's fp32 staging tile");
  float *stage = reinterpret_cast<float *>(Ks) + warp * Frag * ld_s;
  store_tile<T, D>(o_frag, stage, 1.f, o + (bh * nq + row0) * D, nq - row0);
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
  require_fragment_layout<T>();
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
  /* Keys per dK/dV block: one fragment height per warp, as Br in the forward. */
  static constexpr int Bc_bwd = Warps_bwd * Frag, Br_bwd = ROWS_DKDV;
  static constexpr int Warps_dq = WARPS_DQ, Threads_dq = Warps_dq * 32, Br_dq = Warps_dq * Frag;
  static_assert(Br_bwd % Frag == 0, "the dK/dV kernel's query tiles are whole fragments");
  static_assert(Br_bwd <= ld_p && Bc <= ld_p,
                "a P^T or dS^T row (Br_bwd columns) and a dS row (Bc columns) fit in ld_p");
};
/* Where the device allows it: 8 dK/dV warps, so that the block's Q and dO tiles serve 128
 * keys (measured at N = 4096, d = 128: 74.5 TFLOP/s with 4 warps, 100.5 with 8; at d = 64 no
 * difference), query tiles of 4 fragments like Bc in the forward, and 4 dQ warps (8 measured
 * 10% slower at d = 64). The dK/dV block needs 109 KiB at d = 64 and 173 KiB at d = 128, the
 * dQ block 112 KiB at d = 128 (fp16 and bf16 alike). */
using LargeTiles = BackwardTiles<8, 64, 4>;
/* Where a block gets less (99 KiB on sm_86 and sm_89, 163 KiB on sm_80): half the warps and
 * half the query rows per tile: at most 90 KiB at d = 128. */
using SmallTiles = BackwardTiles<4, 32, 2>;

static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) * attn_lse_elems(p);
}

/* Shared memory of the dK/dV kernel: its K and V tiles, double-buffered Q and dO tiles,
 * the per-warp P^T and dS^T tiles, double-buffered LSE and D of the tile's rows. */
template <typename T, int D, typename Tiles>
static size_t dkdv_bytes() {
  return sizeof(T) * (2 * (size_t)Tiles::Bc_bwd * ld_tile<D>() +
                      4 * (size_t)Tiles::Br_bwd * ld_tile<D>() + 2 * (size_t)Tiles::Bc_bwd * ld_p) +
         sizeof(float) * 4 * Tiles::Br_bwd;
}

/* Shared memory of the dQ kernel: its Q and dO tiles, double-buffered K and V tiles, the
 * per-warp dS tile, LSE and D of its rows. */
template <typename T, int D, typename Tiles>
static size_t dq_bytes() {
  return sizeof(T) * (2 * (size_t)Tiles::Br_dq * ld_tile<D>() + 4 * (size_t)Bc * ld_tile<D>() +
                      (size_t)Tiles::Br_dq * ld_p) +
         sizeof(float) * 2 * Tiles::Br_dq;
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

/* Each warp owns 16 keys j of the block's Bc_bwd keys and keeps their dK, dV in
 * accumulator fragments while it walks the query tiles. For every tile it computes
 * S^T = K Q^T and dP^T = V dO^T (keys as rows), turns them element by element into
 * P^T = exp(S^T - LSE) and dS^T = P^T (dP^T - D) in shared memory (fragment_row and fragment_col
 * give each element's row and column), then adds dV += P^T dO and dK += dS^T Q. */
template <typename T, int D, typename Tiles>
__global__ void __launch_bounds__(Tiles::Threads_bwd)
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               T *__restrict__ dk, T *__restrict__ dv, int nq, int nkv, int heads,
                               float scale, int causal) {
  constexpr int Warps_bwd = Tiles::Warps_bwd, Bc_bwd = Tiles::Bc_bwd, Br_bwd = Tiles::Br_bwd;
  extern __shared__ __align__(128) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + Bc_bwd * ld_tile<D>();
  T *Qs = Vs + Bc_bwd * ld_tile<D>(), *dOs = Qs + 2 * Br_bwd * ld_tile<D>();
  T *Pt = dOs + 2 * Br_bwd * ld_tile<D>(), *dSt = Pt + Bc_bwd * ld_p;
  float *lse_s = reinterpret_cast<float *>(dSt + Bc_bwd * ld_p), *delta_s = lse_s + 2 * Br_bwd;
  int warp = threadIdx.x / 32;
  int key_blocks = (nkv + Bc_bwd - 1) / Bc_bwd;
  long bh = blockIdx.x / key_blocks;
  int j0 = (int)(blockIdx.x % key_blocks) * Bc_bwd, offset = nkv - nq;
  int jw = j0 + warp * Frag; /* this warp's first key */
  T *Pt_w = Pt + warp * Frag * ld_p, *dSt_w = dSt + warp * Frag * ld_p;

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
  FragAcc dk_frag[D / Frag], dv_frag[D / Frag];
#pragma unroll
  for (int f = 0; f < D / Frag; f++)
    wmma::fill_fragment(dk_frag[f], 0.f), wmma::fill_fragment(dv_frag[f], 0.f);
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
#pragma unroll
    for (int n = 0; n < Br_bwd / Frag; n++) {
      FragAcc s, dp;
      wmma::fill_fragment(s, 0.f);
      wmma::fill_fragment(dp, 0.f);
#pragma unroll
      for (int c = 0; c < D / Frag; c++) {
        FragA<T> a;
        FragBt<T> b;
        load_fragment(a, Ks + warp * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        load_fragment(b, Qt + n * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        wmma::mma_sync(s, a, b, s);
        load_fragment(a, Vs + warp * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        load_fragment(b, dOt + n * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        wmma::mma_sync(dp, a, b, dp);
      }
#pragma unroll
      for (int e = 0; e < s.num_elements; e++) {
        int key = fragment_row(e), col = n * Frag + fragment_col(e), i = i0 + col, j = jw + key;
        bool visible = i < nq && j < nkv && (!causal || j <= i + offset);
        /* P from the saved LSE; a masked entry is 0, and exp2 is never asked for it, so a
         * row that sees no key (LSE = -inf) cannot make a NaN. P <= 1 exactly, but an fp32
         * LSE of huge logits is only known to a few units (2^-24 |LSE|: 4096 at 1e11, bf16
         * inputs of magnitude 1e5), and exp2 of +4096 is inf; the clamp keeps P a
         * probability, so such inputs give finite gradients instead of NaN. */
        float prob = visible ? fminf(1.f, exp2f(s.x[e] * scale_log2 - lse_t[col])) : 0.f;
        Pt_w[key * ld_p + col] = from_float<T>(prob);
        dSt_w[key * ld_p + col] = from_float<T>(prob * (dp.x[e] - delta_t[col]));
      }
    }
    __syncwarp(); /* RAW: the warp's P^T and dS^T tiles are complete before the loads */
#pragma unroll
    for (int n = 0; n < Br_bwd / Frag; n++) {
      FragA<T> p_frag, ds_frag;
      load_fragment(p_frag, Pt_w + n * Frag, ld_p);
      load_fragment(ds_frag, dSt_w + n * Frag, ld_p);
#pragma unroll
      for (int f = 0; f < D / Frag; f++) {
        FragB<T> b;
        load_fragment(b, dOt + n * Frag * ld_tile<D>() + f * Frag, ld_tile<D>());
        wmma::mma_sync(dv_frag[f], p_frag, b, dv_frag[f]);
        load_fragment(b, Qt + n * Frag * ld_tile<D>() + f * Frag, ld_tile<D>());
        wmma::mma_sync(dk_frag[f], ds_frag, b, dk_frag[f]);
      }
    }
    __syncthreads(); /* WAR: every warp is done with buffer `buf` (and with its P^T, dS^T)
                      * before tile t + 2 is copied in and the next tile's entries written */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  /* The stores stage through the K, V, Q, dO tiles, which no warp reads after this barrier. */
  static_assert(Warps_bwd * Frag * ld_s * sizeof(float) <=
                    (2 * Bc_bwd + 4 * Br_bwd) * ld_tile<32>() * sizeof(T),
                "the tiles hold every warp's fp32 staging tile");
  __syncthreads(); /* WAR: every warp is done reading the tiles before they become staging */
  float *stage = reinterpret_cast<float *>(Ks) + warp * Frag * ld_s;
  store_tile<T, D>(dk_frag, stage, scale, dk + (bh * nkv + jw) * D, nkv - jw);
  store_tile<T, D>(dv_frag, stage, 1.f, dv + (bh * nkv + jw) * D, nkv - jw);
}

/* Each warp owns 16 query rows i and keeps dQ in accumulator fragments while it walks the
 * key tiles like the forward: S = Q K^T and dP = dO V^T, dS = P (dP - D) element by
 * element into shared memory, then dQ += dS K. */
template <typename T, int D, typename Tiles>
__global__ void __launch_bounds__(Tiles::Threads_dq)
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             T *__restrict__ dq, int nq, int nkv, int heads, float scale,
                             int causal) {
  constexpr int Warps_dq = Tiles::Warps_dq, Br_dq = Tiles::Br_dq;
  extern __shared__ __align__(128) float4 smem[];
  T *Qs = reinterpret_cast<T *>(smem), *dOs = Qs + Br_dq * ld_tile<D>();
  T *Ks = dOs + Br_dq * ld_tile<D>(), *Vs = Ks + 2 * Bc * ld_tile<D>();
  T *dSs = Vs + 2 * Bc * ld_tile<D>();
  float *lse_s = reinterpret_cast<float *>(dSs + Br_dq * ld_p), *delta_s = lse_s + Br_dq;
  int warp = threadIdx.x / 32;
  int row_blocks = (nq + Br_dq - 1) / Br_dq;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 = (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) *
           Br_dq;
  int iw = i0 + warp * Frag; /* this warp's first row */
  T *dS_w = dSs + warp * Frag * ld_p;

  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  int rows = min(Br_dq, nq - i0);
  load_tile_async<T, D>(q + (bh * nq + i0) * D, rows, Br_dq, Qs);
  load_tile_async<T, D>(d_o + (bh * nq + i0) * D, rows, Br_dq, dOs);
  load_row_stats(lse + bh * nq + i0, delta + bh * nq + i0, rows, Br_dq, lse_s, delta_s);
  int offset = nkv - nq, last_row = min(i0 + Br_dq, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  int tiles = (kv_end + Bc - 1) / Bc;
  if (tiles > 0) {
    load_tile_async<T, D>(K, min(Bc, nkv), Bc, Ks);
    load_tile_async<T, D>(V, min(Bc, nkv), Bc, Vs);
  }
  __pipeline_commit();
  FragAcc dq_frag[D / Frag];
#pragma unroll
  for (int f = 0; f < D / Frag; f++) wmma::fill_fragment(dq_frag[f], 0.f);
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
    __syncthreads(); /* RAW: tile t (and, the first time, Q, dO, LSE, D) is in shared memory */
    const T *Kt = Ks + buf * Bc * ld_tile<D>(), *Vt = Vs + buf * Bc * ld_tile<D>();
#pragma unroll
    for (int n = 0; n < Bc / Frag; n++) {
      FragAcc s, dp;
      wmma::fill_fragment(s, 0.f);
      wmma::fill_fragment(dp, 0.f);
#pragma unroll
      for (int c = 0; c < D / Frag; c++) {
        FragA<T> a;
        FragBt<T> b;
        load_fragment(a, Qs + warp * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        load_fragment(b, Kt + n * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        wmma::mma_sync(s, a, b, s);
        load_fragment(a, dOs + warp * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        load_fragment(b, Vt + n * Frag * ld_tile<D>() + c * Frag, ld_tile<D>());
        wmma::mma_sync(dp, a, b, dp);
      }
#pragma unroll
      for (int e = 0; e < s.num_elements; e++) {
        int row = fragment_row(e), col = n * Frag + fragment_col(e), i = iw + row, j = j0 + col;
        bool visible = i < nq && j < nkv && (!causal || j <= i + offset);
        int rs = warp * Frag + row;
        float prob = visible ? fminf(1.f, exp2f(s.x[e] * scale_log2 - lse_s[rs])) : 0.f;
        dS_w[row * ld_p + col] = from_float<T>(prob * (dp.x[e] - delta_s[rs]));
      }
    }
    __syncwarp(); /* RAW: the warp's dS tile is complete before the fragment loads */
#pragma unroll
    for (int n = 0; n < Bc / Frag; n++) {
      FragA<T> ds_frag;
      load_fragment(ds_frag, dS_w + n * Frag, ld_p);
#pragma unroll
      for (int f = 0; f < D / Frag; f++) {
        FragB<T> b;
        load_fragment(b, Kt + n * Frag * ld_tile<D>() + f * Frag, ld_tile<D>());
        wmma::mma_sync(dq_frag[f], ds_frag, b, dq_frag[f]);
      }
    }
    __syncthreads(); /* WAR: every warp is done with buffer `buf` (and with its dS) before
                      * tile t + 2 is copied in and the next tile's dS written */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  /* The stores stage through the Q, dO, K, V tiles, which no warp reads after this barrier. */
  static_assert(
      Warps_dq * Frag * ld_s * sizeof(float) <= (2 * Br_dq + 4 * Bc) * ld_tile<32>() * sizeof(T),
      "the tiles hold every warp's fp32 staging tile");
  __syncthreads(); /* WAR: every warp is done reading the tiles before they become staging */
  float *stage = reinterpret_cast<float *>(Qs) + warp * Frag * ld_s;
  store_tile<T, D>(dq_frag, stage, scale, dq + (bh * nq + iw) * D, nq - iw);
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
  require_fragment_layout<T>();
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
    .name = "07_tensor_cores",
    .idea = "the matrix products on tensor cores (WMMA, fp16/bf16 in, fp32 accumulation)",
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
