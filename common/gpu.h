/* What a GPU stage needs from the harness: checked CUDA calls and launches, and the
 * shared-memory check against the device's opt-in limit. */
#ifndef ATTN_GPU_H
#define ATTN_GPU_H

#include <cuda_runtime.h>

#include "attention.h"

/* Exits with a clear line when a CUDA call fails: 2 for out of memory (the problem is too
 * large), 1 for anything else (a broken kernel is a failed run). */
void attn_cuda_check(cudaError_t err, const char *what, const char *file, int line);
#define CUDA_CHECK(call) attn_cuda_check((call), #call, __FILE__, __LINE__)
/* After every launch: a bad configuration shows at once, a fault in the kernel at the next
 * synchronising call, which the harness makes after every timed run. */
#define CHECK_LAUNCH(kernel_name) \
  attn_cuda_check(cudaGetLastError(), kernel_name, __FILE__, __LINE__)

/* The shared memory one block may opt in to on this device, in bytes; the environment
 * variable ATTN_SHARED_MEMORY_LIMIT lowers it (never raises it), so that a stage's choice of
 * tile for a smaller GPU can be exercised on a larger one. */
size_t attn_shared_memory_limit(void);

/* The shared memory of one SM on this device, in bytes; the environment variable
 * ATTN_SHARED_MEMORY_PER_SM lowers it (never raises it) and, for every kernel that
 * attn_require_shared_memory sets up, lowers the SM's carveout to match: with
 * ATTN_SHARED_MEMORY_LIMIT, a large GPU then stands in for a smaller one (A100: 163 KiB a
 * block, 164 an SM; RTX 30 and 40: 99 and 100). */
size_t attn_shared_memory_per_sm(void);
/* How many blocks of `bytes` dynamic shared memory fit one SM (each also holds the
 * per-block reserve the device keeps), at most `max_blocks`: a stage chooses its tiles so that
 * as many blocks as its registers allow share an SM. */
int attn_blocks_per_sm(size_t bytes, int max_blocks);

/* Whether the environment variable ATTN_DETERMINISTIC is 1, or the calling thread asked for
 * determinism (attn_set_deterministic): a stage whose backward adds dQ by fp32 atomics (in an
 * order that changes from run to run, and so do dQ's last bits) then takes its deterministic
 * path. Any other value of the variable but unset or 0 is a usage error. The Python package
 * asks around each backward while torch's deterministic mode is on, leaving the caller's
 * environment as it is; the stage programs never ask. */
int attn_deterministic(void);
void attn_set_deterministic(int asked);

/* The chunk length a decode stage (11) splits every sequence's keys into, from the environment
 * variable ATTN_DECODE_CHUNK_KEYS, instead of the stage's own rule: so that tests can put a
 * cache length exactly on a chunk boundary and one key past it, and a measurement can compare
 * chunk lengths without rebuilding. 0 when unset (or empty); anything but a positive key count
 * that is whole tiles of the stage's decode kernel (ATTN_DECODE_TILE_KEYS) is a usage error. */
#define ATTN_DECODE_TILE_KEYS 64
int attn_decode_chunk_keys(void);

/* Whether the environment variable ATTN_DECODE_BATCH_INVARIANT is 1: a decode stage (11) then
 * splits every sequence's keys into chunks of a fixed length and always merges them, so that
 * a sequence's O and LSE are the same bits whatever batch it is decoded in (see its README).
 * 0, empty or unset is the default rule; any other value is a usage error. Read at each call,
 * so it reaches the Python package too. */
int attn_decode_batch_invariant(void);

/* Reads every variable above, exiting 2 (naming it) on a value its reader would refuse: the
 * library (stage_library.cu) runs this before each call, so that a bad value is an error
 * whichever stage is called, not only in the stages that read it. */
void attn_check_environment(void);

/* The stream every launch of a stage goes to (its fourth launch parameter): the legacy
 * default stream (0) in the stage programs, whose timing records its events there; the
 * Python package sets PyTorch's current stream around each call (common/stage_library.cu). */
cudaStream_t attn_stream(void);
void attn_set_stream(cudaStream_t stream);

#ifdef __CUDACC__
/* Where row i of head bh = b * heads + h starts in a tensor laid out as `s` says (attention.h):
 * one expression for [B, H, N, d] and [B, N, H, d], so that a kernel reads either in place. */
__device__ __forceinline__ long row_start(const attn_strides &s, long bh, long i) {
  return bh / s.heads * s.batch + bh % s.heads * s.head + i * s.row;
}

/* Sequence b's KV-cache length as the kernels read it (attn_buffers.cache_lens), kept in
 * [0, nkv]: lengths that no host has read (the Python package under CUDA graphs passes them on
 * the device only) cannot move a read outside the cache. */
__device__ __forceinline__ int cache_len(const int *cache_lens, long b, int nkv) {
  return cache_lens ? min(max(cache_lens[b], 0), nkv) : nkv;
}
#endif

/* Allows `kernel` `bytes` of dynamic shared memory, or exits 2 naming the limit when the
 * device cannot give that much to one block. */
void attn_require_shared_memory(const void *kernel, size_t bytes, const char *kernel_name);

#endif
