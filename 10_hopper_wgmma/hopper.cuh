/* Hopper's instructions, one small helper each (PTX ISA: cp.async.bulk.tensor, mbarrier, wgmma,
 * setmaxnreg), which stage 10's forward is built on. */
#pragma once

#include <cuda.h> /* CUtensorMap; the driver's encoder is looked up at run time, not linked */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

/* A warpgroup: 4 consecutive warps, the first a multiple of 4; one wgmma is 64 rows tall. */
constexpr int WarpgroupThreads = 128, WgmmaM = 64;

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

/* One box (BoxCols columns x the map's box rows) of head `head` of sequence `seq`, from row
 * `row` and column `col`, into shared memory; rows past the head's end arrive as zeros. The
 * tensor map is a __grid_constant__ kernel parameter, addressed where it lies. */
__device__ void tma_load_box(void *dst, const CUtensorMap *map, int col, int row, int head, int seq,
                             uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(seq),
      "r"(shared_address(bar))
      : "memory");
}
/* Rows [row, row + ROWS) of head `head` (b heads + h, of `heads` a sequence) into a tile, every
 * box of it, counted on `bar`: the barrier expects the whole tile's bytes (a box past the end
 * still writes, and counts, all of its bytes). */
template <int D, int ROWS, typename T>
__device__ void load_tile_async(const CUtensorMap *map, int row, long head, int heads, T *dst,
                                uint64_t *bar) {
  constexpr int Cols = box_cols<D, T>();
  int h = (int)(head % heads), b = (int)(head / heads);
  mbarrier_expect_bytes(bar, ROWS * D * sizeof(T));
#pragma unroll
  for (int c = 0; c < D; c += Cols) tma_load_box(dst + c * ROWS, map, c, row, h, b, bar);
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
