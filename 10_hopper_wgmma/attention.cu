/* Stage 10: the forward rebuilt for Hopper (compute capability 9.0, built for sm_90a).
 *
 * On an H100 an mma.sync is a warp's 16 x 8 x 16 product, issued and waited for one at a time
 * beside the ldmatrix loads that feed it: stage 09 stops near FlashAttention-2's speed, a third
 * of what the tensor cores can do. The forward here uses FlashAttention-3's three ideas:
 *   - TMA: one thread copies a whole tile with one instruction (cp.async.bulk.tensor, from a
 *     tensor map the host encodes), straight into the 128-byte swizzled layout the tensor cores
 *     read, and the copy counts its bytes on an mbarrier that the readers wait on;
 *   - wgmma: a warpgroup (4 warps, 64 query rows) multiplies 64 x N x 16 in one asynchronous
 *     instruction, Q and K read from shared memory through descriptors (S = Q K^T), P from
 *     registers (O += P V);
 *   - warp specialisation: a producer warpgroup only issues copies into a ring of K and V
 *     stages and hands its registers to two consumer warpgroups (setmaxnreg), which only
 *     compute; and each consumer overlaps its softmax with its products: it issues
 *     S(t) = Q K(t)^T and O += P(t - 1) V(t - 1) before it computes the softmax of S(t), so the
 *     exponentials run while the tensor cores work.
 * The backward is stage 09's, line for line (mma.sync, ldmatrix, cp.async).
 */
#include <cuda.h> /* CUtensorMap; the driver's encoder is looked up at run time, not linked */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <math.h>
#include <stdint.h>
#include <type_traits>

#include "attention.h"
#include "gpu.h"

/* mma.sync.aligned.m16n8k16: D (16 x 8, fp32) = A (16 x 16) B (16 x 8) + C, one warp.
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
/* A warp's query rows in the forward, in instruction heights (fragments): one. A wgmma is 64
 * rows tall, 16 for each warp of its warpgroup, and its accumulators lie in each warp exactly
 * as those of mma.sync do (below), so the softmax code is 09's with one fragment. */
__host__ __device__ constexpr int row_frags(int) { return 1; }
__host__ __device__ constexpr int threads_for(int rows, int f = 1) { return rows / f / MmaM * 32; }
/* A warpgroup: 4 consecutive warps, the first a multiple of 4; one wgmma is 64 rows tall. */
constexpr int WarpgroupThreads = 128, WgmmaM = 64;
/* Consumer warpgroups per block: at d = 128, 2, so that a block's Q tile is 128 rows (as in
 * 09) and each K and V tile copied into shared memory serves 128 rows. At d <= 64 a tile's
 * products take half as long for the same exponentials, so 3 (FlashAttention-3's 192 rows):
 * one more warpgroup whose softmax can run while the others' products do. Measured on an
 * H100 (fp16, N = 4096 and 16384, causal and not, one command): forward +14 to +19% at
 * d = 64 against two (-DATTN_SMALL_D_CONSUMERS=2). */
#ifndef ATTN_SMALL_D_CONSUMERS
#define ATTN_SMALL_D_CONSUMERS 3
#endif
__host__ __device__ constexpr int consumers(int d) { return d > 64 ? 2 : ATTN_SMALL_D_CONSUMERS; }
__host__ __device__ constexpr int block_rows(int d) { return consumers(d) * WgmmaM; }
/* Keys per tile: 128, the N of S = Q K^T's wgmma (64 registers of S a thread). An SS wgmma
 * reads its A operand (Q, 64 x 16) again for every instruction: at N = 64 its two operands,
 * 2 + 2 KiB per 64 x 64 x 16, would need about 128 bytes a clock at the tensor cores' rate,
 * all of shared memory's bandwidth; at N = 128, 2 + 4 KiB per twice the work, 96. */
constexpr int Bc = 128;
/* The techniques of the A/B table, each a compile-time switch: -DATTN_WARP_SPECIALIZE=0 has
 * no producer warpgroup (thread 0, a consumer, issues the copies as it goes), and
 * -DATTN_OVERLAP=0 waits for each product before the next step. Measured on an H100 (fp16,
 * forward, N = 4096 and 16384, causal and not, one command, two consumers): the producer
 * warpgroup +7 to +18% at d = 128 and +8 to +23% at d = 64; the overlap +4 to +9% at d = 128
 * and -1 to -4% at d = 64 (with three consumers there, -3% to +4%: it stays for one loop). */
#ifndef ATTN_WARP_SPECIALIZE
#define ATTN_WARP_SPECIALIZE 1
#endif
#ifndef ATTN_OVERLAP
#define ATTN_OVERLAP 1
#endif
/* -DATTN_WGMMA=0 keeps 09's products (mma.sync, fed by ldmatrix) on the tiles the TMA writes:
 * with -DATTN_WARP_SPECIALIZE=0 -DATTN_OVERLAP=0, the table's "TMA alone". */
#ifndef ATTN_WGMMA
#define ATTN_WGMMA 1
#endif
constexpr bool WarpSpecialize = ATTN_WARP_SPECIALIZE, Overlap = ATTN_OVERLAP, Wgmma = ATTN_WGMMA;
static_assert(WarpSpecialize || !Overlap, "the overlap is built on the producer warpgroup");
static_assert(Wgmma || !Overlap, "mma.sync is not asynchronous: there is nothing to overlap");
constexpr int Producers = WarpSpecialize ? 1 : 0; /* warpgroups */
__host__ __device__ constexpr int forward_threads(int d) {
  return (Producers + consumers(d)) * WarpgroupThreads;
}
/* Registers a thread after setmaxnreg: the producer keeps 24 (it only issues copies), a
 * consumer takes what is left, a multiple of 8: 240 of two consumers (128 x 24 + 256 x 240 =
 * 64512 of the SM's 65536), 160 of three. */
constexpr int ProducerRegisters = 24;
__host__ __device__ constexpr int consumer_registers(int d) {
  return consumers(d) == 2 ? 240 : 160;
}
/* K and V tiles in flight: 2 stages of each (160 KiB of shared memory with Q at d = 128), so
 * that the copy of tile t + 1 runs while tile t is multiplied; 1 where the device gives a
 * block less (the tests lower the limit to exercise it). */
constexpr int KvStages = 2;
/* Shared-memory tiles are stored without padding, the 16-byte chunks of each row permuted:
 * logical chunk c of row r at chunk c ^ (r % 8), or c ^ (r / 2 % 4) in rows of 64 bytes (two
 * to a 128-byte line). One ldmatrix phase reads 8 rows at one logical chunk: unpermuted rows of
 * 128 or 256 bytes queue those reads on 4 banks, permuted they cover all 32 (08 padded every
 * row by 16 bytes instead, 6-12% more shared memory). At d = 64, where each chunk is stored:
 *
 *   logical chunk   0 1 2 3 4 5 6 7
 *   row 0           0 1 2 3 4 5 6 7
 *   row 1           1 0 3 2 5 4 7 6
 *   row 2           2 3 0 1 6 7 4 5
 *   row 3           3 2 1 0 7 6 5 4      ... row 7: 7 6 5 4 3 2 1 0, row 8 as row 0
 *
 * -DATTN_SWIZZLE=0 builds 08's padded rows (09's A/B table). */
#ifndef ATTN_SWIZZLE
#define ATTN_SWIZZLE 1
#endif
constexpr int Skew = ATTN_SWIZZLE ? 0 : 16; /* bytes of padding per row */
static_assert(Skew % 16 == 0, "rows stay 16-byte aligned for 16-byte copies and fragment loads");
template <typename E>
__host__ __device__ constexpr int padded(int cols) {
  return cols + Skew / (int)sizeof(E);
}
/* The offset of element (row, col) in a tile of D-element rows, from a row a multiple of 8
 * (where the pattern starts), which every warp's first row in a tile is. */
template <int D, typename T>
__host__ __device__ constexpr int swizzle(int row, int col) {
  constexpr int chunk = 16 / sizeof(T), chunks = D / chunk;  /* elements, chunks a row */
  constexpr int rows_per_line = chunks < 8 ? 8 / chunks : 1; /* rows sharing 128 bytes */
  constexpr int patterns = chunks < 8 ? chunks : 8;
  int c = ATTN_SWIZZLE ? (col / chunk ^ row / rows_per_line % patterns) * chunk + col % chunk : col;
  return row * padded<T>(D) + c;
}
/* operand_address XORs the chunk bits of the absolute shared-memory address, which lands where
 * swizzle() says only if the tile starts where those bits are 0: on a multiple of its swizzle
 * period, the bytes of a row and at least 128 (a 128-byte line, which 64-byte rows share in
 * pairs). Every kernel asserts this of each tile's offset; the block's shared memory starts on
 * 256 bytes, the largest period. (Padded rows, -DATTN_SWIZZLE=0, add instead of XOR.) */
template <int D, typename T>
__host__ __device__ constexpr bool starts_swizzle_period(size_t bytes) {
  constexpr size_t row = D * sizeof(T), period = row > 128 ? row : 128;
  return !ATTN_SWIZZLE || bytes % period == 0;
}
constexpr int SharedAlignment = 256; /* the largest swizzle period: rows of 128 fp16 */

/* Shared memory: K and V (bc rows, double-buffered), `rows` rows of Q (or Q, dO); none staged */
template <typename T>
static constexpr size_t tile_bytes(int d, int bc, int rows) {
  return sizeof(T) * (4 * (size_t)bc + rows) * padded<T>(d);
}

#ifndef ATTN_WHOLE_TILES
#define ATTN_WHOLE_TILES 1
#endif
/* Rows [0, rows) of a [*, D] tensor into a tile of ROWS swizzled rows; the rows past `rows` are
 * zeroed, since they enter the products (where 0 times a stale NaN is NaN). */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_tile(const T *src, int rows, T *dst) {
  /* THREADS known at compile time: the loop unrolls, and each thread swizzles its offset once,
   * as a pass moves whole swizzle periods (8 rows). (A runtime index cost ~30 instructions.) */
  constexpr int Chunk = 16 / sizeof(T), W = D / Chunk, Step = THREADS / W; /* rows a pass */
  static_assert(THREADS % W == 0 && Step % 8 == 0, "a pass moves whole swizzle periods");
  const int tid = threadIdx.x, r = tid / W;
  const T *from = src + tid * Chunk;
  T *to = dst + swizzle<D, T>(r, tid % W * Chunk);
  constexpr int Passes = (ROWS * W + THREADS - 1) / THREADS;
  /* A whole tile (all but a sequence's last) copies without testing rows: in 09's forward 9
   * instructions less per K or V tile at d = 64, ~55 at d = 128 (=0: tests every copy). */
  if (ATTN_WHOLE_TILES && rows >= ROWS && (ROWS * W) % THREADS == 0) {
#pragma unroll
    for (int k = 0; k < Passes; k++)
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from + k * THREADS * Chunk, 16);
    return;
  }
#pragma unroll
  for (int k = 0; k < Passes; k++) {
    if ((ROWS * W) % THREADS != 0 && k * THREADS + tid >= ROWS * W) break;
    if (r + k * Step < rows) /* cp.async: no waiting here, see __pipeline_wait_prior */
      __pipeline_memcpy_async(to + k * Step * padded<T>(D), from + k * THREADS * Chunk, 16);
    else
      *reinterpret_cast<float4 *>(to + k * Step * padded<T>(D)) = float4{};
  }
}

/* The whole block copies rows [j0, j0 + cols) of K and V into Ks, Vs: consecutive threads
 * take consecutive float4s, so each warp reads 512 contiguous bytes. (THREADS, not Br:
 * the dK/dV kernel reuses this with more threads per block, and for Q and dO: ROWS.) */
template <int D, int ROWS, int THREADS, typename T>
__device__ void load_kv_tile(const T *K, const T *V, int cols, T *Ks, T *Vs) {
  load_tile<D, ROWS, THREADS>(K, cols, Ks), load_tile<D, ROWS, THREADS>(V, cols, Vs);
}

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

/* volatile: a load from shared memory must stay between the barriers that guard it. The
 * address is a shared-memory address (the operand helpers below make it). */
__device__ void ldmatrix_x4(unsigned *r, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ void ldmatrix_x4_trans(unsigned *r, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/* The shared-memory address of element (row + lane_row, col + lane_col) of a swizzled tile
 * that starts on its swizzle period, row a multiple of 8, col of 16: the lane's address is computed
 * once, a column step (chunk bits only, which the swizzle XORs) is one XOR, and the row an
 * immediate the loads fold in. */
template <int D, typename T>
__device__ unsigned operand_address(const T *tile, int lane_row, int lane_col, int row, int col) {
  unsigned lane = (unsigned)__cvta_generic_to_shared(tile + swizzle<D, T>(lane_row, lane_col));
  unsigned moved = ATTN_SWIZZLE ? lane ^ (col * sizeof(T)) : lane + col * sizeof(T);
  return moved + row * padded<T>(D) * sizeof(T);
}

/* The row of the 16 x 16 tile at (row, col) of a larger tile this lane points ldmatrix.x4 at,
 * so that its four 8 x 8 blocks arrive in the registers' order of the picture above: a[0..3]
 * for a_operand (the tile is A, rows x k); b[0..1] of columns 0-7, then of columns 8-15, for
 * b_operand (the tile is B transposed, a row per column: K in S = Q K^T) and b_operand_trans
 * (the tile is B, k down: V in O = P V, read with .trans). */
template <int D, typename T>
__device__ unsigned a_operand(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane % 16, lane / 16 * 8, row, col);
}
template <int D, typename T>
__device__ unsigned b_operand(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane / 16 * 8 + lane % 8, lane / 8 % 2 * 8, row, col);
}
template <int D, typename T>
__device__ unsigned b_operand_trans(const T *tile, int row, int col) {
  int lane = threadIdx.x % 32;
  return operand_address<D>(tile, lane / 8 % 2 * 8 + lane % 8, lane / 16 * 8, row, col);
}

/* acc (FRAGS x 16 rows, N columns) += A B for one k-step of 16: a[f] is the A operand of the
 * rows of fragment f, and each B operand, loaded from shared memory once, feeds every fragment.
 * B is read from the rows of an N x 16 tile (K in S = Q K^T), or with TRANS from a 16 x N tile
 * (V in O = P V), at (row, col) of a tile of D-element rows. */
template <int D, bool TRANS, int N, int FRAGS = 1, typename T>
__device__ void mma_tile(float (*acc)[N / MmaN][4], const unsigned (*a)[4], const T *B, int row,
                         int col) {
#pragma unroll
  for (int n2 = 0; n2 < N / 16; n2++) { /* 16 columns: two accumulators per fragment */
    unsigned b[4];
    if constexpr (TRANS)
      ldmatrix_x4_trans(b, b_operand_trans<D>(B, row, col + n2 * 16));
    else
      ldmatrix_x4(b, b_operand<D>(B, row + n2 * 16, col));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(acc[f][2 * n2], a[f], b, T()),
          mma_m16n8k16(acc[f][2 * n2 + 1], a[f], b + 2, T());
  }
}

/* exp(x) = 2^(x log2 e) and log x = ln 2 log2 x: 2^x is one instruction (MUFU.EX2), 2^-inf = +0;
 * its relative error (about 2^-22) is far below the dtype's rounding of P. */
constexpr float Log2e = 1.4426950408889634f, Ln2 = 0.6931471805599453f;
__device__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Two dtype values in one operand register, `lo` in the lower half, rounded to nearest even. */
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

/* ---- Hopper's instructions, one small helper each (PTX ISA: cp.async.bulk.tensor, mbarrier,
 * wgmma, setmaxnreg) --------------------------------------------------------------------- */

__device__ unsigned shared_address(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* TMA writes, and wgmma reads, a tile in rows of SwizzleBytes (128; 64 at d = 32 in 16 bits)
 * whose 16-byte chunks are permuted within each atom of 8 rows: chunk c of row r is stored at
 * chunk c ^ (r % 8) (at 64 bytes, c ^ (r / 2 % 4)), 09's swizzle, now applied by the copy
 * engine to the shared-memory address it writes and undone by the tensor cores from the
 * address they read. Both work on the address bits, so a tile starts on a whole atom pattern
 * (1024 bytes). A row of d = 128 (256 bytes) is two boxes of 64 columns, and a tile of ROWS
 * rows is stored box after box: [d / BoxCols][ROWS][BoxCols]. */
template <int D, typename T>
__host__ __device__ constexpr int box_cols() {
  return D * (int)sizeof(T) >= 128 ? 128 / (int)sizeof(T) : D;
}
constexpr int AtomAlignment = 1024;

/* mbarriers: a 64-bit counter in shared memory. A phase completes when `count` arrivals and
 * the bytes announced by expect_tx have come; a waiter names the parity of the phase it waits
 * for, so a barrier is reused for every tile of a stage without being reset. */
__device__ void mbarrier_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count)
               : "memory");
}
/* Makes the initialised barriers visible to the copy engine, which sees shared memory through
 * another proxy than the threads' loads and stores. */
__device__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ void mbarrier_expect_bytes(uint64_t *bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}
__device__ void mbarrier_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
__device__ void mbarrier_wait(uint64_t *bar, int parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

/* One box (BoxCols columns x the map's box rows) of head `head`, from row `row` and column
 * `col`, into shared memory; rows past the head's end arrive as zeros. The tensor map is a
 * __grid_constant__ kernel parameter, addressed where it lies. */
__device__ void tma_load_box(void *dst, const CUtensorMap *map, int col, int row, int head,
                             uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(shared_address(bar))
      : "memory");
}
/* Rows [row, row + ROWS) of head `head` into a tile, every box of it, counted on `bar`: the
 * barrier expects the whole tile's bytes (a box past the end still writes, and counts, all of
 * its bytes). */
template <int D, int ROWS, typename T>
__device__ void load_tile_async(const CUtensorMap *map, int row, long head, T *dst, uint64_t *bar) {
  constexpr int Cols = box_cols<D, T>();
  mbarrier_expect_bytes(bar, ROWS * D * sizeof(T));
#pragma unroll
  for (int c = 0; c < D; c += Cols) tma_load_box(dst + c * ROWS, map, c, row, (int)head, bar);
}

/* The 64-bit descriptor of a wgmma operand in shared memory:
 *   bits  0-13  start address / 16       bits 16-29  LBO / 16       bits 32-45  SBO / 16
 *   bits 62-63  swizzle (1: 128 bytes, 2: 64 bytes)
 * The operand is a grid of atoms of 8 rows x SwizzleBytes:
 *   K-major (Q and K in S = Q K^T: the 16 k-values of one instruction lie along a row, inside
 *     one atom): SBO is the step from one atom to the next down the rows, 8 x SwizzleBytes;
 *     LBO is not used;
 *   MN-major (V in O = P V, read transposed: its 16 k-values run down 16 rows, two atoms, and
 *     N along the rows): SBO is again the step between atoms down the rows, and LBO the step
 *     to the next SwizzleBytes of a row, which is the next box, BC rows on.
 * The next k-step inside a row starts 32 bytes further: the tensor cores swizzle the address
 * they form from it, as the copy engine did. */
template <int SWIZZLE_BYTES>
__device__ uint64_t operand_descriptor(const void *start, unsigned lbo, unsigned sbo) {
  static_assert(SWIZZLE_BYTES == 128 || SWIZZLE_BYTES == 64, "the swizzles TMA writes here");
  constexpr uint64_t mode = SWIZZLE_BYTES == 128 ? 1 : 2;
  return (uint64_t)(shared_address(start) >> 4 & 0x3FFF) | (uint64_t)(lbo >> 4 & 0x3FFF) << 16 |
         (uint64_t)(sbo >> 4 & 0x3FFF) << 32 | mode << 62;
}

/* wgmma.fence before the first product that reads or writes registers the thread itself
 * touched (accumulators, P); commit closes a group of products, wait<N> lets at most N groups
 * still run. The accumulators change behind the compiler's back until the wait: `settle`
 * after it makes the compiler treat them as written there, so no read moves above it. */
__device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ void wgmma_wait() {
  if constexpr (Wgmma) asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int R>
__device__ void settle(float *r) {
#pragma unroll
  for (int i = 0; i < R; i++) asm volatile("" : "+f"(r[i])::"memory");
}

/* The operand lists of one wgmma are long (N / 2 accumulators a thread); these macros only
 * spell them out. */
#define WG_ACC8(i)                                                                            \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC16 WG_ACC8(0), WG_ACC8(8)
#define WG_ACC32 WG_ACC16, WG_ACC8(16), WG_ACC8(24)
#define WG_ACC64 WG_ACC32, WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56)
#define WG_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_REGS32                                                            \
  WG_REGS16                                                                  \
  ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, " \
  "%30, %31"
#define WG_REGS64                                                                 \
  WG_REGS32                                                                       \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
  "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
/* S (64 x 128, fp32) = Q (64 x 16) K^T (16 x 128), both from shared memory, K-major; with
 * `accumulate` 0 the old S is not read (the first k-step). */
#define WG_QK(TYPE)                                                               \
  asm volatile(                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" WG_REGS64 \
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                          \
      : WG_ACC64                                                                  \
      : "l"(a), "l"(b), "r"(accumulate))
template <typename T>
__device__ void wgmma_qk(float *d, uint64_t a, uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __half>)
    WG_QK("f16");
  else
    WG_QK("bf16");
}
/* O (64 x N, fp32) += P (64 x 16, registers, mma.sync's A layout) V (16 x N), V from shared
 * memory MN-major (the last 1: read transposed). */
#define WG_PV(TYPE, N, REGS, ACC, A, ONE)                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ONE                                           \
               ", 0;\n"                                                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, " A \
               ", p, 1, 1, 1;\n}\n"                                                              \
               : ACC                                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <int N, typename T>
__device__ void wgmma_pv(float *d, const unsigned *a, uint64_t b) {
  constexpr bool half = std::is_same_v<T, __half>;
  if constexpr (N == 128 && half)
    WG_PV("f16", 128, WG_REGS64, WG_ACC64, "{%64, %65, %66, %67}, %68", "%69");
  if constexpr (N == 128 && !half)
    WG_PV("bf16", 128, WG_REGS64, WG_ACC64, "{%64, %65, %66, %67}, %68", "%69");
  if constexpr (N == 64 && half)
    WG_PV("f16", 64, WG_REGS32, WG_ACC32, "{%32, %33, %34, %35}, %36", "%37");
  if constexpr (N == 64 && !half)
    WG_PV("bf16", 64, WG_REGS32, WG_ACC32, "{%32, %33, %34, %35}, %36", "%37");
  if constexpr (N == 32 && half)
    WG_PV("f16", 32, WG_REGS16, WG_ACC16, "{%16, %17, %18, %19}, %20", "%21");
  if constexpr (N == 32 && !half)
    WG_PV("bf16", 32, WG_REGS16, WG_ACC16, "{%16, %17, %18, %19}, %20", "%21");
}

/* A warpgroup's registers: the producer gives some back, each consumer takes more (every warp
 * of a warpgroup executes the same one). */
template <int R>
__device__ void give_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ void take_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
/* A barrier of one warpgroup's 128 threads (id 0 is __syncthreads'). */
__device__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(WarpgroupThreads) : "memory");
}

/* A lane holds 2 rows of the warp's 16: its row h is g + 8 h of the warp's rows, element e of
 * an accumulator belongs to row e / 2. A wgmma's accumulators (64 x N) are, in each warp of the
 * warpgroup, mma.sync's for that warp's 16 rows, N / 8 of them side by side. */

/* -DATTN_WGMMA=0: the shared-memory address of element (row + lane_row, col + lane_col) of a
 * tile of ROWS rows as the TMA wrote it, box after box, for ldmatrix: inside a box it is 09's
 * swizzled tile of Cols-element rows. */
template <int D, int ROWS, typename T>
__device__ unsigned box_operand_address(const T *tile, int lane_row, int lane_col, int row,
                                        int col) {
  constexpr int Cols = box_cols<D, T>();
  static_assert(ATTN_SWIZZLE, "the copy engine's layout is the swizzled one");
  return operand_address<Cols>(tile + col / Cols * ROWS * Cols, lane_row, lane_col, row,
                               col % Cols);
}

/* Issues S = Q K^T for one tile (the warpgroup's 64 rows, BC keys) into the accumulators
 * s[BC / 8][4], one wgmma a k-step, Q and K read from shared memory; the caller waits. */
template <int D, typename T>
__device__ void compute_qk_scores(const T *Q, const T *K, float (*s)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T), Br = block_rows(D);
  if constexpr (!Wgmma) { /* 09's product: each warp its 16 rows, by mma.sync */
    const int lane = threadIdx.x % 32, warp_row = threadIdx.x / 32 % 4 * MmaM;
#pragma unroll
    for (int n = 0; n < Bc / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / MmaK; kk++) {
      unsigned a[4];
      ldmatrix_x4(a, box_operand_address<D, Br>(Q, lane % 16, lane / 16 * 8, warp_row, kk * MmaK));
#pragma unroll
      for (int n2 = 0; n2 < Bc / 16; n2++) {
        unsigned b[4];
        ldmatrix_x4(b, box_operand_address<D, Bc>(K, lane / 16 * 8 + lane % 8, lane / 8 % 2 * 8,
                                                  n2 * 16, kk * MmaK));
        mma_m16n8k16(s[2 * n2], a, b, T()), mma_m16n8k16(s[2 * n2 + 1], a, b + 2, T());
      }
    }
    return;
  }
  wgmma_fence(); /* the softmax's reads of the last S come before this product overwrites it */
#pragma unroll
  for (int kk = 0; kk < D / MmaK; kk++) {
    const int box = kk * MmaK / Cols, col = kk * MmaK % Cols;
    uint64_t a = operand_descriptor<Cols * sizeof(T)>(Q + box * Br * Cols + col, 16, Atom);
    uint64_t b = operand_descriptor<Cols * sizeof(T)>(K + box * Bc * Cols + col, 16, Atom);
    wgmma_qk<T>(&s[0][0], a, b, kk > 0);
  }
  wgmma_commit();
}

/* Only a tile that crosses the causal diagonal or the end of the keys is masked: an element
 * past its row's last visible key becomes -inf. A row sees the tile's first `cols` keys, and
 * on a diagonal tile the lane's row h only `visible + 8 h` of them. m_blk[h] is row h's max
 * over the tile, reduced over the row's quad. */
template <int BC>
__device__ void mask_and_row_max(float (*s)[4], int cols, bool diagonal, int visible,
                                 float *m_blk) {
  int t = threadIdx.x % Quad;
  if (diagonal || cols < BC)
#pragma unroll
    for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (n * MmaN + 2 * t + e % 2 >= (diagonal ? min(cols, visible + 8 * (e / 2)) : cols))
          s[n][e] = -INFINITY;
  m_blk[0] = m_blk[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) m_blk[e / 2] = fmaxf(m_blk[e / 2], s[n][e]);
#pragma unroll
  for (int h = 0; h < 2; h++) m_blk[h] = max_over_quad(m_blk[h]);
}

/* m' = max(m, m_blk), in units of the raw S; what was summed under 2^(-m scale log2 e) (l,
 * and the O accumulators, which rescale_output multiplies once they are no longer being
 * written) is rescaled by correction = 2^((m - m') scale log2 e), row by row. */
__device__ void merge_block_stats(const float *m_blk, float scale_log2, float *m, float *l,
                                  float *correction) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float m_new = fmaxf(m[h], m_blk[h]);
    /* While a row has seen no key m' is still -inf, and 2^(-inf - -inf) would be NaN; there
     * is nothing to rescale then (l = 0, acc = 0). Otherwise 0 on the first visible tile. */
    correction[h] = m_new == -INFINITY ? 1.f : exp2_approx((m[h] - m_new) * scale_log2);
    l[h] *= correction[h];
    m[h] = m_new;
  }
}
template <int D>
__device__ void rescale_output(const float *correction, float (*acc)[4]) {
#pragma unroll
  for (int n = 0; n < D / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[n][e] *= correction[e / 2];
}

/* p = 2^((s - m) scale log2(e)) in place of s; l += p (this lane's columns only: the quad's
 * partial sums are added once, at the end). Not one FFMA, 2^(s c - m c) with m c precomputed
 * as FlashAttention does: m c is rounded, and for the row's largest element s c - round(m c)
 * is that rounding error, half an ulp of m c, which is no longer small once |m c| passes
 * 2^16 or so (4096 at logits of 1e11, bf16 inputs near 1e5): 2^4096 is inf. */
template <int BC>
__device__ void exponentiate_scores(float (*s)[4], float scale_log2, const float *m, float *l) {
  /* A row that has seen no key (m = -inf) has only -inf logits: 2^(-inf - 0) = 0. */
  float m_use[2];
#pragma unroll
  for (int h = 0; h < 2; h++) m_use[h] = m[h] == -INFINITY ? 0.f : m[h];
#pragma unroll
  for (int n = 0; n < BC / MmaN; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      s[n][e] = exp2_approx((s[n][e] - m_use[e / 2]) * scale_log2);
      l[e / 2] += s[n][e];
    }
}

/* P in the dtype, as the A operands of P V: for each 16 keys, the two accumulators of S that
 * hold them become one A operand (mma.sync's layout, which wgmma's register A shares). */
template <int BC, typename T>
__device__ void pack_probabilities(const float (*s)[4], unsigned (*p_frag)[4]) {
#pragma unroll
  for (int kk = 0; kk < BC / MmaK; kk++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const float *p = s[2 * kk + half];
      p_frag[kk][2 * half] = pack2(p[0], p[1], T());     /* rows 0-7 */
      p_frag[kk][2 * half + 1] = pack2(p[2], p[3], T()); /* rows 8-15 */
    }
}

/* Issues acc += P V for one tile, one wgmma per 16 keys, V read transposed from shared
 * memory; the caller waits. */
template <int D, typename T>
__device__ void multiply_pv(const unsigned (*p_frag)[4], const T *V, float (*acc)[4]) {
  constexpr int Cols = box_cols<D, T>(), Atom = 8 * Cols * sizeof(T);
  if constexpr (!Wgmma) { /* 09's product, V read transposed by ldmatrix */
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < Bc / MmaK; kk++)
#pragma unroll
      for (int n2 = 0; n2 < D / 16; n2++) {
        unsigned b[4];
        ldmatrix_x4_trans(b, box_operand_address<D, Bc>(V, lane / 8 % 2 * 8 + lane % 8,
                                                        lane / 16 * 8, kk * MmaK, n2 * 16));
        mma_m16n8k16(acc[2 * n2], p_frag[kk], b, T()),
            mma_m16n8k16(acc[2 * n2 + 1], p_frag[kk], b + 2, T());
      }
    return;
  }
  wgmma_fence(); /* the writes of P and of the rescaled acc come before the products read them */
#pragma unroll
  for (int kk = 0; kk < Bc / MmaK; kk++)
    wgmma_pv<D, T>(
        &acc[0][0], p_frag[kk],
        operand_descriptor<Cols * sizeof(T)>(V + kk * MmaK * Cols, Bc * Cols * sizeof(T), Atom));
  wgmma_commit();
}
/* Writes a warp's FRAGS x 16 rows of fp32 accumulators times factor[h] (h the lane's row) in
 * the dtype, rows [0, rows) only: each lane stores its two adjacent columns as one word. */
template <int D, int FRAGS, typename T>
__device__ void store_tile(const float (*acc)[D / MmaN][4], const float *factor, T *out, int rows,
                           int ld = D) {
  int g = threadIdx.x % 32 / Quad, t = threadIdx.x % Quad;
#pragma unroll
  for (int h = 0; h < 2 * FRAGS; h++) {
    int r = g + 8 * h, e = 2 * (h % 2);
    if (r < rows)
#pragma unroll
      for (int n = 0; n < D / MmaN; n++)
        *reinterpret_cast<unsigned *>(out + (long)r * ld + n * MmaN + 2 * t) =
            pack2(acc[h / 2][n][e] * factor[h], acc[h / 2][n][e + 1] * factor[h], T());
  }
}

/* O = acc / l, LSE = m scale + ln l for the lane's rows (a row that saw no key: O = 0,
 * LSE = -inf), after adding up the quad's partial sums of l. */
template <int D, typename T>
__device__ void normalize_output(const float (*acc)[D / MmaN][4], const float *m, float *l,
                                 float scale_log2, T *O, float *LSE, int rows) {
  constexpr int RowFrags = row_frags(D), LaneRows = 2 * RowFrags;
  float inv_l[LaneRows];
#pragma unroll
  for (int h = 0; h < LaneRows; h++) {
    l[h] = sum_over_quad(l[h]);
    inv_l[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    int r = threadIdx.x % 32 / Quad + 8 * h;
    if (threadIdx.x % Quad == 0 && r < rows)
      LSE[r] = l[h] > 0.f ? (m[h] * scale_log2 + log2f(l[h])) * Ln2 : -INFINITY;
  }
  store_tile<D, RowFrags>(acc, inv_l, O, rows);
}

/* Shared memory of a forward block: the Q tile, KvStages K and V tiles, their mbarriers,
 * and room to start the tiles on an atom boundary. */
template <typename T>
static constexpr size_t forward_bytes(int d, int stages) {
  return AtomAlignment + sizeof(T) * (size_t)d * (block_rows(d) + 2 * (size_t)stages * Bc) +
         sizeof(uint64_t) * (1 + 4 * (size_t)stages);
}

template <int D, int STAGES, typename T>
__global__ void __launch_bounds__(forward_threads(D), 1)
    flash_forward_kernel(const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, T *__restrict__ o,
                         float *__restrict__ lse, int nq, int nkv, int heads, float scale,
                         int causal) {
  constexpr int Cols = box_cols<D, T>(), Br = block_rows(D), Consumers = consumers(D);
  constexpr int ConsumerWarps = Consumers * WarpgroupThreads / 32;
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
   * its K and V in L2. (09's order.) */
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  /* Keys [0, kv_end) are visible to some row of the block: the last row sees the most. */
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  int tiles = (kv_end + Bc - 1) / Bc;
  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < STAGES; s++) {
      mbarrier_init(&k_full[s], 1), mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], ConsumerWarps), mbarrier_init(&v_empty[s], ConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads(); /* the barriers are initialised before anyone waits on them or copies */

  /* The producer: one thread issues every copy, K(t) and V(t) into stage t % STAGES once the
   * consumers have let go of the tile that stage held. A wait for parity 1 on a new barrier
   * returns at once: the ring starts empty. */
  auto produce = [&](int t) {
    int s = t % STAGES, parity = t / STAGES & 1;
    mbarrier_wait(&k_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&k_map, t * Bc, bh, Ks + s * Bc * D, &k_full[s]);
    mbarrier_wait(&v_empty[s], parity ^ 1);
    load_tile_async<D, Bc>(&v_map, t * Bc, bh, Vs + s * Bc * D, &v_full[s]);
  };
  const int warpgroup = threadIdx.x / WarpgroupThreads;
  if (WarpSpecialize && warpgroup == 0) {
    give_registers<ProducerRegisters>();
    if (threadIdx.x == 0) {
      load_tile_async<D, Br>(&q_map, i0, bh, Qs, q_full);
      for (int t = 0; t < tiles; t++) produce(t);
    }
    return; /* nothing below waits for the producer but through the barriers */
  }
  if (WarpSpecialize) take_registers<consumer_registers(D)>();
  if (!WarpSpecialize && threadIdx.x == 0) {
    load_tile_async<D, Br>(&q_map, i0, bh, Qs, q_full);
    for (int t = 0; t < min(tiles, STAGES); t++) produce(t);
  }
  __syncwarp(); /* wgmma is .aligned: the warp runs it together, thread 0 included */

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
  auto softmax = [&](int t) {
    int j0 = t * Bc, cols = min(Bc, nkv - j0);
    /* A tile past the warp's first row's limit crosses the diagonal: each row keeps the
     * columns it sees, [j0, i + offset], which may be none. */
    bool diagonal = causal && j0 + cols - 1 > row0 + offset;
    mask_and_row_max<Bc>(s, cols, diagonal, i + offset + 1 - j0, m_blk);
    merge_block_stats(m_blk, scale_log2, m, l, correction);
    exponentiate_scores<Bc>(s, scale_log2, m, l);
  };
  auto release = [&](uint64_t *bar) {
    if (lane0) mbarrier_arrive(bar); /* after this warp's wait: its products are done */
  };
  if (!Overlap) {
    for (int t = 0; t < tiles; t++) {
      int st = t % STAGES, parity = t / STAGES & 1;
      mbarrier_wait(&k_full[st], parity);
      compute_qk_scores<D>(Q, Ks + st * Bc * D, s);
      wgmma_wait<0>();
      settle<Bc / 2>(&s[0][0]);
      release(&k_empty[st]);
      softmax(t);
      rescale_output<D>(correction, acc[0]);
      pack_probabilities<Bc, T>(s, p_frag);
      mbarrier_wait(&v_full[st], parity);
      multiply_pv<D>(p_frag, Vs + st * Bc * D, acc[0]);
      wgmma_wait<0>();
      settle<D / 2>(&acc[0][0][0]);
      release(&v_empty[st]);
      if (!WarpSpecialize && threadIdx.x == 0 && t + STAGES < tiles) produce(t + STAGES);
      __syncwarp(); /* (as above: the next wgmma is .aligned) */
    }
  } else if (tiles > 0) {
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
  normalize_output<D>(acc, m, l, scale_log2, o + (bh * nq + row0) * D, lse + bh * nq + row0,
                      nq - row0);
}

/* The driver's tensor-map encoder, looked up through the runtime (cudaGetDriverEntryPoint)
 * rather than linked: a program linked against libcuda.so.1 could not even start on a
 * machine without the driver, where it must say "no CUDA device" and exit 77. */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult found;
    void *fn = nullptr;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !fn)
      attn_fail(EXIT_NO_DEVICE, "the CUDA driver has no cuTensorMapEncodeTiled (TMA)");
    encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
  }
  return encode;
}

/* A [heads, rows, D] tensor as TMA sees it, copied in boxes of BoxCols columns x ROWS rows of
 * one head, swizzled like the tiles above; rows past `rows` read as zeros. */
template <int D, int ROWS, typename T>
static CUtensorMap tile_map(const void *tensor, int rows, long heads) {
  constexpr int Cols = box_cols<D, T>();
  cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)rows, (cuuint64_t)heads};
  cuuint64_t strides[2] = {D * sizeof(T), (cuuint64_t)rows * D * sizeof(T)}; /* bytes */
  cuuint32_t box[3] = {(cuuint32_t)Cols, (cuuint32_t)ROWS, 1}, steps[3] = {1, 1, 1};
  CUtensorMap map;
  CUresult r = tensor_map_encoder()(
      &map,
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      3, const_cast<void *>(tensor), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
      Cols * sizeof(T) == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    attn_fail(EXIT_CHECK_FAILED, "cuTensorMapEncodeTiled failed (CUresult %d)", (int)r);
  return map;
}

template <int D, int STAGES, typename T>
static void launch_forward(const attn_problem *p, const attn_buffers *t) {
  int heads = p->batch * p->heads;
  constexpr int Br = block_rows(D);
  dim3 grid((unsigned)((p->seq_q + Br - 1) / Br * heads));
  CUtensorMap q_map = tile_map<D, Br, T>(t->q, p->seq_q, heads);
  CUtensorMap k_map = tile_map<D, Bc, T>(t->k, p->seq_kv, heads);
  CUtensorMap v_map = tile_map<D, Bc, T>(t->v, p->seq_kv, heads);
  size_t bytes = forward_bytes<T>(D, STAGES);
  attn_require_shared_memory((const void *)flash_forward_kernel<D, STAGES, T>, bytes,
                             "flash_forward_kernel");
  flash_forward_kernel<D, STAGES, T><<<grid, forward_threads(D), bytes, attn_stream()>>>(
      q_map, k_map, v_map, (T *)t->o, t->lse, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_forward_kernel");
}

/* The kernels are built for sm_90a only: any other GPU is told so before a launch fails.
 * Asked at every launch, not once: a process (PyTorch's) may move between GPUs. */
static void require_hopper() {
  int device, major, minor;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0)
    attn_fail(EXIT_NO_DEVICE,
              "needs compute capability 9.0 (Hopper: wgmma, TMA, setmaxnreg); this GPU is %d.%d",
              major, minor);
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
/* ---- the backward ------------------------------------------------------------------ */

/* Keys per dK/dV block, 16 a warp: 8 warps, so that each Q and dO tile serves 128 keys
 * (stage 08 on an H100, fp16, N = 4096 and 16384: 8 warps 35% faster than 4 at d = 128). */
constexpr int Bc_bwd = 128;
/* Keys per dK/dV block where the device cannot give a block dkdv_bytes(d, Bc_bwd): half the
 * keys and query rows (161 KiB at d = 128; sm_86 and sm_89 allow 99 KiB, sm_80 163 KiB). */
constexpr int Bc_bwd_small = 64;
/* Query steps (16 queries) per load of a dK/dV warp's K and V operands, each feeding QSteps
 * products. Backward TFLOP/s (N = 4096 and 16384, one command): d = 128, 4 steps 164-204,
 * 1 146-180, 2 157-196; d = 64, 2 steps 160-196, 1 159-191, 4 151-183 (spills). */
#ifndef ATTN_BWD_QSTEPS
#define ATTN_BWD_QSTEPS 0 /* N: N steps at every d */
#endif
__host__ __device__ constexpr int query_steps(int d) {
  return ATTN_BWD_QSTEPS ? ATTN_BWD_QSTEPS : d > 64 ? 4 : 2;
}
/* A dK/dV warp's keys: 32, so that each Q and dO operand it loads feeds two mma.sync; against
 * 16 (-DATTN_BWD_WARP_KEYS=16), backward +8 to +12% at d = 64, +2 to +4% at d = 128. */
#ifndef ATTN_BWD_WARP_KEYS
#define ATTN_BWD_WARP_KEYS 32
#endif
constexpr int WarpKeys = ATTN_BWD_WARP_KEYS;
static_assert(WarpKeys % MmaM == 0, "whole fragments of keys");
/* Warps that share a group of WarpKeys keys: at d <= 64 one, with dK, dV, P^T, dS^T in
 * registers; at d = 128, where dK and dV of 32 keys would take 256 registers, two, which
 * split the work through shared memory (FlashAttention-2's split; see the dK/dV kernel). */
__host__ __device__ constexpr int key_group_warps(int d) {
  return WarpKeys > MmaM && d > 64 ? 2 : 1;
}
__host__ __device__ constexpr int dkdv_threads(int d, int bc) {
  return bc / WarpKeys * key_group_warps(d) * 32;
}
/* Query rows per tile of the dK/dV kernel: half its keys (64 rows, like Bc in the forward). */
__host__ __device__ constexpr int rows_bwd(int bc) { return bc / 2; }
/* The dQ kernel: 4 warps of 16 query rows, tiles of 32 keys, so that 3 blocks (68 KiB each at
 * d = 128) share an SM: backward +3 to +7% at d = 128, +2 to +3% at d = 64, against 64 keys. */
constexpr int Br_dq = 4 * MmaM, Bc_dq = 32;
static_assert(rows_bwd(Bc_bwd_small) % MmaK == 0 && Bc_dq % MmaK == 0, "whole k-steps");

/* Blocks of the dK/dV kernel that must fit an SM, which caps its registers: at d <= 64, 2
 * blocks of 4 warps (up to 255 registers: dK and dV of 32 keys take 128); at d = 128, 1 of 8. */
__host__ __device__ constexpr int dkdv_blocks_per_sm(int d) { return d <= 64 ? 2 : 1; }
/* Blocks of the dQ kernel that must fit an H100's SM, with its Q and dO operands in registers: 4 at
 * d <= 64 (128 registers, an 8-byte spill; at d = 64 uncapped 132, 3 blocks) and 3 at d = 128
 * (168, a 108-byte spill; uncapped 178, 2 blocks). A cap that makes room for more blocks than the
 * SM's shared memory holds spills for nothing, so the architecture being compiled caps the count
 * too: an A100 fits 2 blocks at d = 128, RTX 30 and 40 one (3 at d = 64), and there the registers
 * are not capped below what those need. */
__host__ __device__ constexpr int sm_shared_kib() { /* one SM's shared memory */
#if defined(__CUDA_ARCH__) && \
    (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
  return 100; /* sm_86, sm_89: RTX 30, 40; sm_120: RTX 50 */
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return 164; /* sm_80: A100; sm_87 */
#else
  return 228; /* sm_90: H100, H200 (and the host's pass, which needs none) */
#endif
}
constexpr int ReservedKib = 1; /* the shared memory an SM keeps for each block (sm_80 on) */
__host__ __device__ constexpr int dq_blocks_per_sm(int d) {
  int tile_kib = (int)((4 * Bc_dq + 2 * Br_dq) * padded<__half>(d) * sizeof(__half) + 1023) / 1024;
  int fit = sm_shared_kib() / (tile_kib + ReservedKib), most = d <= 64 ? 4 : 3;
  return fit < most ? fit : most;
}

/* dQ's atomics on sm_90 and later: a lane adds its two adjacent columns as one float2, so a
 * warp's atomic fills 8 whole 32-byte sectors of L2 where two of single floats send them half
 * full: backward +17 to +22% (a float4 over two lanes: 0 to 1% slower at d = 128).
 * -DATTN_PAIRED_ATOMICS=0 adds single floats, as sm_80 (no vector atomics) always does. */
#ifndef ATTN_PAIRED_ATOMICS
#define ATTN_PAIRED_ATOMICS 1
#endif

/* D of every row, then, from a 128-byte boundary, the fp32 dQ the atomics add into (a warp's
 * float2 atomics fill whole 32-byte sectors of L2 only if its rows start on one: from 16 bytes
 * in, each would touch twice the sectors), then the bound on |dS| (DsStats floats). */
constexpr int SectorFloats = 32; /* 128 bytes */
static size_t delta_floats(size_t rows) {
  return (rows + SectorFloats - 1) / SectorFloats * SectorFloats;
}
constexpr int DsStats = 4; /* max |dO_i|^2 and max |V_j|^2, padded to 16 bytes */
static size_t backward_workspace(const attn_problem *p) {
  return sizeof(float) *
         (delta_floats(attn_lse_elems(p)) + (size_t)attn_lse_elems(p) * p->head_dim + DsStats);
}

/* Shared memory of the dK/dV kernel: K and V (bc x d), double-buffered Q and dO tiles, LSE
 * and D of their rows, and dS^T of one query tile (bc x rows_bwd(bc)), from which the block
 * multiplies dQ += dS K; where two warps share a key group, P^T of the tile too. */
template <typename T>
static constexpr size_t dkdv_bytes(int d, int bc) {
  return sizeof(T) * (2 * (size_t)bc + 4 * rows_bwd(bc)) * padded<T>(d) +
         sizeof(float) * 4 * rows_bwd(bc) +
         (key_group_warps(d) > 1 ? 2 : 1) * sizeof(T) * bc * padded<T>(rows_bwd(bc));
}
static_assert(forward_bytes<__half>(128, 1) <= 99 * 1024 &&
                  tile_bytes<__half>(128, Bc_dq, 2 * Br_dq) <= 99 * 1024 &&
                  dkdv_bytes<__half>(128, Bc_bwd_small) <= 99 * 1024,
              "every kernel has a configuration within 99 KiB, which the tests exercise");

/* dS = P (dP - D) is rounded to the dtype for the dK and dQ products, and fp16 ends at 65504:
 * with large V and dO and a small softmax scale |dS| passes that while the gradients stay
 * small. D_i is a P-weighted mean of row i's dP, so |dP_ij - D_i| <= 2 max_j |dO_i . V_j|, and
 * with P <= 1, |dS| <= 2 max|dO_i| max|V_j| (Euclidean norms of rows). In fp16 the kernels
 * multiply dS by 2^-k before rounding it, k the least that brings this bound under 2^DsLimitLog2,
 * and dK and dQ by 2^k after their fp32 sums: powers of two, so both steps are exact (bar
 * elements that fall below fp16's normal range, 2^-14 of the bound and less). bf16 has fp32's
 * range and needs none of it. */
constexpr int DsLimitLog2 = 15; /* 2^15: half of fp16's range, leaving room for rounding */
constexpr int DsMaxShift = 64;  /* norms of finite fp16 rows need far less */
__device__ float ds_scale(const float *stats) {
  if (!stats) return 1.f;
  int e;
  frexpf(2.f * sqrtf(stats[0]) * sqrtf(stats[1]), &e); /* the bound is below 2^e */
  return ldexpf(1.f, -min(max(e - DsLimitLog2, 0), DsMaxShift));
}

/* The largest of x over the block into *out (x >= 0, so its bits order as unsigned integers;
 * *out starts at 0): one atomic a block, not a thread. */
__device__ void block_max_into(float x, float *out) {
  __shared__ unsigned warp_max[32];
  unsigned bits = __reduce_max_sync(0xffffffffu, __float_as_uint(x));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads(); /* RAW: every warp's maximum is in shared memory */
  if (threadIdx.x < 32) {
    bits = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0u;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned *>(out), bits);
  }
}

/* D_i = sum_c dO_ic O_ic. (It equals sum_j dP_ij P_ij: the backward of the softmax needs
 * exactly this dot product, and O = P V makes it a d-term sum.) D / 8 adjacent threads share a
 * row, each reading 16 bytes of it, so that a warp reads whole rows, 512 contiguous bytes of
 * each tensor (a thread walking a row alone reads 32 rows d elements apart). With `stats`
 * (fp16), also max |dO_i|^2 and max |V_j|^2 into stats[0], stats[1] for ds_scale. */
template <int D, typename T>
__global__ void compute_delta_kernel(const T *o, const T *d_o, const T *v, float *delta,
                                     float *stats, long rows, long kv_rows) {
  constexpr int Chunk = 16 / sizeof(T), Lanes = D / Chunk; /* threads a row */
  static_assert(32 % Lanes == 0, "a row's threads are within one warp");
  long r = (blockIdx.x * (long)blockDim.x + threadIdx.x) / Lanes;
  long at = r * D + threadIdx.x % Lanes * Chunk;
  float sum = 0.f, do_norm2 = 0.f, v_norm2 = 0.f;
  if (r < rows) {
    float4 dov = *reinterpret_cast<const float4 *>(d_o + at);
    float4 ov = *reinterpret_cast<const float4 *>(o + at);
    const T *dos = reinterpret_cast<const T *>(&dov), *os = reinterpret_cast<const T *>(&ov);
#pragma unroll
    for (int c = 0; c < Chunk; c++) {
      float x = float(dos[c]);
      sum += x * float(os[c]), do_norm2 += x * x;
    }
  }
  if (stats && r < kv_rows) {
    float4 vv = *reinterpret_cast<const float4 *>(v + at);
    const T *vs = reinterpret_cast<const T *>(&vv);
#pragma unroll
    for (int c = 0; c < Chunk; c++) v_norm2 += float(vs[c]) * float(vs[c]);
  }
#pragma unroll
  for (int lane = Lanes / 2; lane > 0; lane /= 2) /* over the row's threads, adjacent lanes */
    sum += __shfl_xor_sync(0xffffffffu, sum, lane),
        do_norm2 += __shfl_xor_sync(0xffffffffu, do_norm2, lane),
        v_norm2 += __shfl_xor_sync(0xffffffffu, v_norm2, lane);
  if (r < rows && threadIdx.x % Lanes == 0) delta[r] = sum;
  if (!stats) return;
  block_max_into(do_norm2, stats);
  __syncthreads(); /* WAR: block_max_into's shared memory is read before it is reused */
  block_max_into(v_norm2, stats + 1);
}

/* Copies `rows` rows of LSE and D into shared memory, by cp.async like the Q and dO tiles, not
 * stalling on global memory every tile; the rows past them up to `tile_rows` get 0 (they are
 * masked anyway). LSE becomes log2 units where read. */
__device__ void load_row_stats(const float *lse, const float *delta, int rows, int tile_rows,
                               float *lse_s, float *delta_s) {
  for (int e = threadIdx.x; e < tile_rows; e += blockDim.x) {
    if (e < rows)
      __pipeline_memcpy_async(lse_s + e, lse + e, 4),
          __pipeline_memcpy_async(delta_s + e, delta + e, 4);
    else
      lse_s[e] = 0.f, delta_s[e] = 0.f;
  }
}

/* P = 2^(s scale log2(e) - LSE) (LSE in log2 units) and dS = P (dP - D) ds_scale for the four
 * elements of an accumulator, as half an A operand (out[0] rows 0-7, out[1] rows 8-15), `delta`
 * given as D ds_scale: one FFMA in place of the subtraction, so the scaling (1 in bf16) costs
 * nothing here, and by a power of two it rounds as (dP - D) would. A masked element is 0
 * without exp2, so a row that sees no key (LSE = -inf) makes no NaN. The clamp P <= 1: an fp32
 * LSE of logits near 1e11 is known only to about 4096 (2^4096 = inf). */
template <typename T>
__device__ void probabilities_and_ds(const float *s, const float *dp, float scale_log2,
                                     const float *lse, const float *delta, const bool *visible,
                                     float ds_scale, unsigned *p_out, unsigned *ds_out) {
  float p[4], ds[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    p[e] = visible[e] ? fminf(1.f, exp2_approx(fmaf(s[e], scale_log2, -lse[e]))) : 0.f;
    ds[e] = p[e] * fmaf(dp[e], ds_scale, -delta[e]);
  }
  p_out[0] = pack2(p[0], p[1], T()), p_out[1] = pack2(p[2], p[3], T());
  ds_out[0] = pack2(ds[0], ds[1], T()), ds_out[1] = pack2(ds[2], ds[3], T());
}

/* dQ += dS K for one query tile of the dK/dV kernel (dS read transposed from dS^T in shared
 * memory): warp w takes 32 queries and Cols columns (at 32 x 32, 4 ldmatrix.x4 for 8 mma.sync;
 * 16 x 64 read 5: backward +2 to +4% at d = 64) and adds them into the fp32 dQ by atomics,
 * rows past `rows` left out. Other key blocks add into the same rows in no fixed order, so
 * dQ's last bits change from run to run; ATTN_DETERMINISTIC=1 runs the dQ kernel instead. */
template <int D, int BC, typename T>
__device__ void accumulate_dq(const T *dSt, const T *Ks, float *dq_accum, int rows) {
  constexpr int Br_bwd = rows_bwd(BC), Warps = dkdv_threads(D, BC) / 32;
  constexpr int QFrags = D * Br_bwd / (2 * MmaM * Warps) >= 16 ? 2 : 1; /* 16 columns at least */
  constexpr int RowGroups = Br_bwd / (QFrags * MmaM), Cols = D * RowGroups / Warps;
  static_assert(Warps % RowGroups == 0 && Cols % 16 == 0, "the warps cover the tile's queries");
  int w = threadIdx.x / 32, r0 = w % RowGroups * QFrags * MmaM, c0 = w / RowGroups * Cols;
  float acc[QFrags][Cols / MmaN][4] = {};
#pragma unroll
  for (int kk = 0; kk < BC / MmaK; kk++) {
    unsigned a[QFrags][4]; /* dS (queries x keys) is dS^T read with .trans: b_operand's rows */
#pragma unroll
    for (int f = 0; f < QFrags; f++)
      ldmatrix_x4_trans(a[f], b_operand<Br_bwd>(dSt, kk * MmaK, r0 + f * MmaM));
    mma_tile<D, true, Cols, QFrags>(acc, a, Ks, kk * MmaK, c0);
  }
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
#pragma unroll
  for (int f = 0; f < QFrags; f++)
#pragma unroll
    for (int n = 0; n < Cols / MmaN; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int r = r0 + f * MmaM + g + 8 * (e / 2);
        float *at = dq_accum + (long)r * D + c0 + n * MmaN + 2 * tq + e % 2;
#if ATTN_PAIRED_ATOMICS && __CUDA_ARCH__ >= 900
        if (e % 2 == 0 && r < rows) /* the lane's two columns of the row, 8-byte aligned */
          atomicAdd(reinterpret_cast<float2 *>(at), make_float2(acc[f][n][e], acc[f][n][e + 1]));
#else
        if (r < rows) atomicAdd(at, acc[f][n][e]);
#endif
      }
}

/* dV += P^T dO and dK += dS^T Q for one step of 16 queries (step n2 of the tile): the P^T and
 * dS^T of the warp's FRAGS x 16 keys as A operands, the step's rows of dO and Q, columns
 * [c0, c0 + COLS), read transposed as B. */
template <int D, int COLS, int FRAGS, typename T>
__device__ void update_dkdv(const unsigned (*p_frag)[4], const unsigned (*ds_frag)[4], const T *dOt,
                            const T *Qt, int n2, int c0, float (*dv_acc)[COLS / MmaN][4],
                            float (*dk_acc)[COLS / MmaN][4]) {
#pragma unroll
  for (int c2 = 0; c2 < COLS / 16; c2++) {
    unsigned b[4];
    ldmatrix_x4_trans(b, b_operand_trans<D>(dOt, n2 * 16, c0 + c2 * 16));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(dv_acc[f][2 * c2], p_frag[f], b, T()),
          mma_m16n8k16(dv_acc[f][2 * c2 + 1], p_frag[f], b + 2, T());
    ldmatrix_x4_trans(b, b_operand_trans<D>(Qt, n2 * 16, c0 + c2 * 16));
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
      mma_m16n8k16(dk_acc[f][2 * c2], ds_frag[f], b, T()),
          mma_m16n8k16(dk_acc[f][2 * c2 + 1], ds_frag[f], b + 2, T());
  }
}

/* A warp per WarpKeys keys j of the block's BC keys (Bc_bwd, or Bc_bwd_small where shared
 * memory is smaller), keeping their dK and dV in accumulators while it walks the query tiles:
 * per 16 queries, S^T = K Q^T and dP^T = V dO^T (keys as rows) make P^T and dS^T in registers,
 * the A operands of dV += P^T dO and dK += dS^T Q with those 16 queries as the k-step. Where
 * two warps share the keys (d = 128), each makes P^T and dS^T for half of the tile's queries,
 * writes them to shared memory, and adds dK and dV for half of the columns over the whole
 * tile, reading P^T and dS^T back as A operands. */
template <int D, int BC, bool AtomicDq, typename T>
__global__ void __launch_bounds__(dkdv_threads(D, BC), dkdv_blocks_per_sm(D))
    flash_backward_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k,
                               const T *__restrict__ v, const T *__restrict__ d_o,
                               const float *__restrict__ lse, const float *__restrict__ delta,
                               const float *__restrict__ ds_stats, T *__restrict__ dk,
                               T *__restrict__ dv, float *__restrict__ dq_accum, int nq, int nkv,
                               int heads, float scale, int causal) {
  constexpr int KeyFrags = WarpKeys / MmaM, Split = key_group_warps(D);
  constexpr int ld = padded<T>(D), Br_bwd = rows_bwd(BC), Threads = dkdv_threads(D, BC);
  /* K, V (BC rows), Q, dO buffers (Br_bwd rows), then past LSE and D, dS^T and P^T (BC rows of
   * Br_bwd): every tile starts on its swizzle period */
  constexpr size_t ds_offset = /* dS^T of the tile, for dQ */
      sizeof(T) * (2 * BC + 4 * Br_bwd) * ld + sizeof(float) * 4 * Br_bwd;
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * BC * ld) &&
                    starts_swizzle_period<D, T>(sizeof(T) * Br_bwd * ld) &&
                    starts_swizzle_period<Br_bwd, T>(ds_offset) &&
                    starts_swizzle_period<Br_bwd, T>(sizeof(T) * BC * padded<T>(Br_bwd)),
                "tile alignment");
  constexpr int WarpSteps = Br_bwd / Split / MmaK, Cols = D / Split; /* each warp's share */
  constexpr int QSteps = query_steps(D) < WarpSteps ? query_steps(D) : WarpSteps;
  static_assert(WarpSteps % QSteps == 0 && Cols % 16 == 0, "whole query steps and columns");
  extern __shared__ __align__(SharedAlignment) float4 smem_bwd[];
  T *Ks = reinterpret_cast<T *>(smem_bwd), *Vs = Ks + BC * ld;
  T *Qs = Vs + BC * ld, *dOs = Qs + 2 * Br_bwd * ld; /* Q and dO double-buffered */
  float *lse_s = reinterpret_cast<float *>(dOs + 2 * Br_bwd * ld), *delta_s = lse_s + 2 * Br_bwd;
  T *dSt = reinterpret_cast<T *>(reinterpret_cast<unsigned char *>(smem_bwd) + ds_offset);
  T *Pt = dSt + BC * padded<T>(Br_bwd); /* P^T of the tile, if Split > 1 */
  /* Causal: key block 0 has the most query tiles, so blocks go by key block across heads,
   * heaviest first (the forward's order, mirrored; +5% at d = 128, N = 4096, else within 1%). */
  int key_blocks = (nkv + BC - 1) / BC;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / key_blocks;
  int kb = (int)(causal ? blockIdx.x / heads : blockIdx.x % key_blocks);
  int g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  int w = threadIdx.x / 32, part = Split > 1 ? w / (BC / WarpKeys) : 0; /* the warp's share */
  int j0 = kb * BC, jw = j0 + w % (BC / WarpKeys) * WarpKeys;
  int cols = min(BC, nkv - j0), offset = nkv - nq, c0 = part * Cols;
  const T *Kw = Ks + (jw - j0) * ld, *Vw = Vs + (jw - j0) * ld; /* the warp's keys */
  const T *Q = q + bh * nq * D, *dO = d_o + bh * nq * D;
  load_kv_tile<D, BC, Threads>(k + (bh * nkv + j0) * D, v + (bh * nkv + j0) * D, cols, Ks, Vs);
  float dk_acc[KeyFrags][Cols / MmaN][4] = {}, dv_acc[KeyFrags][Cols / MmaN][4] = {};
  const float scale_log2 = scale * Log2e, dss = ds_scale(ds_stats);
  /* Under the causal mask the first query that sees key j0 is j0 - offset: the query tiles
   * before it are skipped. */
  int i_begin = causal ? max(0, j0 - offset) : 0;
  if (i_begin < nq) {
    load_kv_tile<D, Br_bwd, Threads>(Q + (long)i_begin * D, dO + (long)i_begin * D,
                                     min(Br_bwd, nq - i_begin), Qs, dOs);
    load_row_stats(lse + bh * nq + i_begin, delta + bh * nq + i_begin, min(Br_bwd, nq - i_begin),
                   Br_bwd, lse_s, delta_s);
  }
  __pipeline_commit();
  for (int i0 = i_begin, buf = 0; i0 < nq; i0 += Br_bwd, buf ^= 1) {
    __pipeline_wait_prior(0);
    __syncthreads(); /* RAW: the Q/dO tile, LSE and D (the first time, K and V) are in shared
                      * memory; WAR: every warp is done with the last tile, so its Q/dO buffer
                      * may be refilled and its P^T and dS^T rewritten */
    int next = i0 + Br_bwd, rows = min(Br_bwd, nq - next), nb = (buf ^ 1) * Br_bwd;
    if (next < nq) { /* the next tile's copy overlaps this tile's products */
      load_kv_tile<D, Br_bwd, Threads>(Q + (long)next * D, dO + (long)next * D, rows, Qs + nb * ld,
                                       dOs + nb * ld);
      load_row_stats(lse + bh * nq + next, delta + bh * nq + next, rows, Br_bwd, lse_s + nb,
                     delta_s + nb);
    }
    __pipeline_commit();
    const T *Qt = Qs + buf * Br_bwd * ld, *dOt = dOs + buf * Br_bwd * ld;
    const float *lse_t = lse_s + buf * Br_bwd, *delta_t = delta_s + buf * Br_bwd;
    /* Only a tile past the end of the queries or keys, or crossing the diagonal, is masked. */
    bool masked =
        i0 + Br_bwd > nq || jw + WarpKeys > nkv || (causal && jw + WarpKeys - 1 > i0 + offset);
    /* QSteps query steps of 16 share each load of the warp's K and V operands */
#pragma unroll
    for (int qq = 0; qq < WarpSteps; qq += QSteps) {
      const int q0 = part * WarpSteps + qq;
      float s[QSteps][KeyFrags][2][4] = {}, dp[QSteps][KeyFrags][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        unsigned a[KeyFrags][4];
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Kw, f * MmaM, kk * MmaK));
#pragma unroll
        for (int q = 0; q < QSteps; q++)
          mma_tile<D, false, 16, KeyFrags>(s[q], a, Qt, (q0 + q) * 16, kk * MmaK);
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) ldmatrix_x4(a[f], a_operand<D>(Vw, f * MmaM, kk * MmaK));
#pragma unroll
        for (int q = 0; q < QSteps; q++)
          mma_tile<D, false, 16, KeyFrags>(dp[q], a, dOt, (q0 + q) * 16, kk * MmaK);
      }
#pragma unroll
      for (int q = 0; q < QSteps; q++) {
        const int n2 = q0 + q;
        unsigned p_frag[KeyFrags][4], ds_frag[KeyFrags][4];
#pragma unroll
        for (int half = 0; half < 2; half++) { /* queries 0-7, then 8-15 of the k-step */
          int col = n2 * 16 + half * MmaN + 2 * tq;
          float lo = lse_t[col] * Log2e, hi = lse_t[col + 1] * Log2e;
          float lse_e[4] = {lo, hi, lo, hi};
          float lo_d = delta_t[col] * dss, hi_d = delta_t[col + 1] * dss; /* see ds_scale */
          float delta_e[4] = {lo_d, hi_d, lo_d, hi_d};
#pragma unroll
          for (int f = 0; f < KeyFrags; f++) {
            bool visible[4] = {true, true, true, true};
            if (masked)
#pragma unroll
              for (int e = 0; e < 4; e++) {
                int i = i0 + col + e % 2, j = jw + f * MmaM + g + 8 * (e / 2);
                visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
              }
            probabilities_and_ds<T>(s[q][f][half], dp[q][f][half], scale_log2, lse_e, delta_e,
                                    visible, dss, p_frag[f] + 2 * half, ds_frag[f] + 2 * half);
#pragma unroll
            for (int h = 0; h < 2; h++) { /* rows g and g + 8 of the fragment's keys */
              int at = swizzle<Br_bwd, T>(jw - j0 + f * MmaM + g + 8 * h, col);
              if (AtomicDq || Split > 1)
                *reinterpret_cast<unsigned *>(dSt + at) = ds_frag[f][2 * half + h];
              if (Split > 1) *reinterpret_cast<unsigned *>(Pt + at) = p_frag[f][2 * half + h];
            }
          }
        }
        if (Split == 1)
          update_dkdv<D, Cols, KeyFrags>(p_frag, ds_frag, dOt, Qt, n2, 0, dv_acc, dk_acc);
      }
    }
    if (AtomicDq || Split > 1)
      __syncthreads(); /* RAW: the whole tile's dS^T (and P^T) are in shared memory */
    if (Split > 1)
#pragma unroll
      for (int n2 = 0; n2 < Br_bwd / MmaK; n2++) { /* every query step, the warp's columns */
        unsigned p_frag[KeyFrags][4], ds_frag[KeyFrags][4];
#pragma unroll
        for (int f = 0; f < KeyFrags; f++) {
          ldmatrix_x4(p_frag[f], a_operand<Br_bwd>(Pt, jw - j0 + f * MmaM, n2 * MmaK));
          ldmatrix_x4(ds_frag[f], a_operand<Br_bwd>(dSt, jw - j0 + f * MmaM, n2 * MmaK));
        }
        update_dkdv<D, Cols, KeyFrags>(p_frag, ds_frag, dOt, Qt, n2, c0, dv_acc, dk_acc);
      }
    if (AtomicDq) accumulate_dq<D, BC>(dSt, Ks, dq_accum + (bh * nq + i0) * D, nq - i0);
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  float dk_factor[2 * KeyFrags], dv_factor[2 * KeyFrags];
#pragma unroll
  for (int h = 0; h < 2 * KeyFrags; h++) dk_factor[h] = scale / dss, dv_factor[h] = 1.f;
  store_tile<Cols, KeyFrags>(dk_acc, dk_factor, dk + (bh * nkv + jw) * D + c0, nkv - jw, D);
  store_tile<Cols, KeyFrags>(dv_acc, dv_factor, dv + (bh * nkv + jw) * D + c0, nkv - jw, D);
}

/* A warp per 16 query rows, walking the key tiles like the forward with dQ in accumulators;
 * per 16 keys, S = Q K^T and dP = dO V^T become dS in registers, the A operand of dQ += dS K:
 * dQ_i = scale sum_j dS_ij K_j with dS_ij = P_ij (dO_i . V_j - D_i) recomputed key by key. */
template <int D, typename T>
__global__ void __launch_bounds__(threads_for(Br_dq), dq_blocks_per_sm(D))
    flash_backward_dq_kernel(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ d_o,
                             const float *__restrict__ lse, const float *__restrict__ delta,
                             const float *__restrict__ ds_stats, T *__restrict__ dq, int nq,
                             int nkv, int heads, float scale, int causal) {
  constexpr int ld = padded<T>(D), Br = Br_dq, Bc = Bc_dq; /* this kernel's own tiles */
  /* K and V buffers (Bc rows), Q and dO (Br rows): each starts on its swizzle period */
  static_assert(starts_swizzle_period<D, T>(sizeof(T) * Bc * ld) &&
                    starts_swizzle_period<D, T>(sizeof(T) * Br * ld),
                "tile alignment");
  constexpr int Threads = threads_for(Br);
  extern __shared__ __align__(SharedAlignment) float4 smem[];
  T *Ks = reinterpret_cast<T *>(smem), *Vs = Ks + 2 * Bc * ld, *Qs = Vs + 2 * Bc * ld;
  T *dOs = Qs + Br * ld;
  int row_blocks = (nq + Br - 1) / Br;
  long bh = causal ? blockIdx.x % heads : blockIdx.x / row_blocks;
  int i0 =
      (causal ? row_blocks - 1 - (int)(blockIdx.x / heads) : (int)(blockIdx.x % row_blocks)) * Br;
  int iw = i0 + threadIdx.x / 32 * MmaM, g = threadIdx.x % 32 / Quad, tq = threadIdx.x % Quad;
  const T *Qw = Qs + (iw - i0) * ld, *dOw = dOs + (iw - i0) * ld; /* the warp's 16 rows */
  const T *K = k + bh * nkv * D, *V = v + bh * nkv * D;
  float dq_acc[1][D / MmaN][4] = {};
  /* The warp's Q and dO rows as A operands, read once from shared memory: the same 16 rows
   * meet every key tile, and reloading them would double the ldmatrix reads of S and dP. */
  unsigned q_frag[D / MmaK][4], do_frag[D / MmaK][4];
  const float scale_log2 = scale * Log2e, dss = ds_scale(ds_stats);
  load_kv_tile<D, Br, Threads>(q + (bh * nq + i0) * D, d_o + (bh * nq + i0) * D, min(Br, nq - i0),
                               Qs, dOs);
  /* LSE (log2 units) and D of the lane's two rows, in registers; rows past the end get 0. */
  float lse_e[4], delta_e[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    int i = iw + g + 8 * (e / 2);
    lse_e[e] = i < nq ? lse[bh * nq + i] * Log2e : 0.f;
    delta_e[e] = i < nq ? delta[bh * nq + i] * dss : 0.f; /* see ds_scale */
  }
  int offset = nkv - nq, last_row = min(i0 + Br, nq) - 1;
  int kv_end = causal ? max(0, min(nkv, last_row + offset + 1)) : nkv;
  if (kv_end > 0) load_kv_tile<D, Bc, Threads>(K, V, min(Bc, nkv), Ks, Vs);
  __pipeline_commit();
  for (int j0 = 0, buf = 0; j0 < kv_end; j0 += Bc, buf ^= 1) {
    int next = j0 + Bc;
    if (next < kv_end)
      load_kv_tile<D, Bc, Threads>(K + (long)next * D, V + (long)next * D, min(Bc, nkv - next),
                                   Ks + (buf ^ 1) * Bc * ld, Vs + (buf ^ 1) * Bc * ld);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads(); /* RAW: the whole tile (the first time, Q and dO too) is in shared memory */
    const T *Kt = Ks + buf * Bc * ld, *Vt = Vs + buf * Bc * ld;
    if (j0 == 0) /* Q and dO have landed: their operands, once */
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++)
        ldmatrix_x4(q_frag[kk], a_operand<D>(Qw, 0, kk * MmaK)),
            ldmatrix_x4(do_frag[kk], a_operand<D>(dOw, 0, kk * MmaK));
    /* Only a tile past the end of the keys or rows, or crossing the warp's diagonal, is masked. */
    bool masked = j0 + Bc > nkv || iw + MmaM > nq || (causal && j0 + Bc - 1 > iw + offset);
#pragma unroll
    for (int n2 = 0; n2 < Bc / MmaK; n2++) { /* 16 keys: one k-step of dQ */
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / MmaK; kk++) {
        mma_tile<D, false, 16>(&s, q_frag + kk, Kt, n2 * 16, kk * MmaK);
        mma_tile<D, false, 16>(&dp, do_frag + kk, Vt, n2 * 16, kk * MmaK);
      }
      unsigned p_frag[4], ds_frag[4];
#pragma unroll
      for (int half = 0; half < 2; half++) { /* keys 0-7, then 8-15 of the k-step */
        bool visible[4] = {true, true, true, true};
        if (masked)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            int i = iw + g + 8 * (e / 2), j = j0 + n2 * 16 + half * MmaN + 2 * tq + e % 2;
            visible[e] = i < nq && j < nkv && (!causal || j <= i + offset);
          }
        probabilities_and_ds<T>(s[half], dp[half], scale_log2, lse_e, delta_e, visible, dss,
                                p_frag + 2 * half, ds_frag + 2 * half);
      }
      mma_tile<D, true, D>(dq_acc, &ds_frag, Kt, n2 * 16, 0);
    }
    __syncthreads(); /* WAR: every row is done with the tile before the next load overwrites it */
  }
  __pipeline_wait_prior(0); /* nothing is left in flight when the block exits */
  const float dq_factor[2] = {scale / dss, scale / dss};
  store_tile<D, 1>(dq_acc, dq_factor, dq + (bh * nq + iw) * D, nq - iw);
}

/* dQ = scale times the fp32 sums the dK/dV kernel added up (of dS times ds_scale), in the
 * dtype. */
template <typename T>
__global__ void convert_dq_kernel(const float *dq_accum, const float *ds_stats, T *dq, long elems,
                                  float scale) {
  long e = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (e < elems) dq[e] = T(scale / ds_scale(ds_stats) * dq_accum[e]);
}

template <int D, int BC, bool AtomicDq, typename T>
static void launch_dkdv(const attn_problem *p, const attn_buffers *t, const float *delta,
                        const float *ds_stats, float *dq_accum) {
  int heads = p->batch * p->heads;
  attn_require_shared_memory((const void *)flash_backward_dkdv_kernel<D, BC, AtomicDq, T>,
                             dkdv_bytes<T>(D, BC), "flash_backward_dkdv_kernel");
  unsigned key_blocks = (unsigned)((p->seq_kv + BC - 1) / BC * heads);
  flash_backward_dkdv_kernel<D, BC, AtomicDq>
      <<<key_blocks, dkdv_threads(D, BC), dkdv_bytes<T>(D, BC), attn_stream()>>>(
          (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta,
          ds_stats, (T *)t->dk, (T *)t->dv, dq_accum, p->seq_q, p->seq_kv, heads, p->scale,
          p->causal);
  CHECK_LAUNCH("flash_backward_dkdv_kernel");
}

template <int D, typename T = __half>
static void launch_backward(const attn_problem *p, const attn_buffers *t) {
  if (p->dtype == DTYPE_BF16 && !std::is_same_v<T, __nv_bfloat16>)
    return launch_backward<D, __nv_bfloat16>(p, t);
  int heads = p->batch * p->heads;
  long rows = (long)heads * p->seq_q, kv_rows = (long)heads * p->seq_kv;
  float *delta = (float *)t->workspace;
  float *dq_accum = delta + delta_floats(rows);
  long dq_elems = rows * D;
  /* The bound on |dS| in fp16 only (ds_scale); bf16 passes none. */
  float *ds_stats = std::is_same_v<T, __half> ? dq_accum + dq_elems : nullptr;
  if (ds_stats) CUDA_CHECK(cudaMemsetAsync(ds_stats, 0, sizeof(float) * DsStats, attn_stream()));
  const int delta_threads = 256; /* a memory-bound pass: any full-warp count will do */
  long delta_rows = ds_stats ? max(rows, kv_rows) : rows, lanes = D * sizeof(T) / 16;
  long delta_grid = (delta_rows * lanes + delta_threads - 1) / delta_threads;
  compute_delta_kernel<D><<<(unsigned)delta_grid, delta_threads, 0, attn_stream()>>>(
      (const T *)t->o, (const T *)t->d_o, (const T *)t->v, delta, ds_stats, rows, kv_rows);
  CHECK_LAUNCH("compute_delta_kernel");
  /* dQ by atomics from the dK/dV kernel (five products a tile), or, with
   * ATTN_DETERMINISTIC=1, by the dQ kernel (seven, every bit the same run after run). */
  bool atomic_dq = !attn_deterministic();
  if (atomic_dq) CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, sizeof(float) * dq_elems, attn_stream()));
  bool big = dkdv_bytes<T>(D, Bc_bwd) <= attn_shared_memory_limit();
  if (atomic_dq && big) launch_dkdv<D, Bc_bwd, true, T>(p, t, delta, ds_stats, dq_accum);
  if (atomic_dq && !big) launch_dkdv<D, Bc_bwd_small, true, T>(p, t, delta, ds_stats, dq_accum);
  if (!atomic_dq && big) launch_dkdv<D, Bc_bwd, false, T>(p, t, delta, ds_stats, dq_accum);
  if (!atomic_dq && !big) launch_dkdv<D, Bc_bwd_small, false, T>(p, t, delta, ds_stats, dq_accum);
  if (atomic_dq) {
    const int convert_threads = 256; /* a memory-bound pass: any full-warp count will do */
    convert_dq_kernel<<<(unsigned)((dq_elems + convert_threads - 1) / convert_threads),
                        convert_threads, 0, attn_stream()>>>(dq_accum, ds_stats, (T *)t->dq,
                                                             dq_elems, p->scale);
    CHECK_LAUNCH("convert_dq_kernel");
    return;
  }
  size_t dq_bytes = tile_bytes<T>(D, Bc_dq, 2 * Br_dq);
  attn_require_shared_memory((const void *)flash_backward_dq_kernel<D, T>, dq_bytes,
                             "flash_backward_dq_kernel");
  unsigned row_blocks = (unsigned)((p->seq_q + Br_dq - 1) / Br_dq * heads);
  flash_backward_dq_kernel<D><<<row_blocks, threads_for(Br_dq), dq_bytes, attn_stream()>>>(
      (const T *)t->q, (const T *)t->k, (const T *)t->v, (const T *)t->d_o, t->lse, delta, ds_stats,
      (T *)t->dq, p->seq_q, p->seq_kv, heads, p->scale, p->causal);
  CHECK_LAUNCH("flash_backward_dq_kernel");
}

static void backward(const attn_problem *p, const attn_buffers *t) {
  require_hopper();
  switch (p->head_dim) {
    case 32: launch_backward<32>(p, t); break;
    case 64: launch_backward<64>(p, t); break;
    case 128: launch_backward<128>(p, t); break;
  }
}

static const attn_stage stage = {
    .name = "10_hopper_wgmma",
    .idea = "Hopper's forward: TMA, wgmma, a producer warpgroup, softmax overlapping products",
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
