/* The GPU as the harness's device: buffers, copies, NaN poisoning, CUDA-event timing with
 * the L2 flushed before each repeat, the device stamp, and exit 77 without a device. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "device.h"
#include "gpu.h"

void attn_cuda_check(cudaError_t err, const char *what, const char *file, int line) {
  if (err == cudaSuccess) return;
  int code = err == cudaErrorMemoryAllocation ? EXIT_BAD_USAGE : EXIT_CHECK_FAILED;
  attn_fail(code, "CUDA error in %s (%s:%d): %s%s", what, file, line, cudaGetErrorString(err),
            code == EXIT_BAD_USAGE ? " (the problem is too large for device memory)" : "");
}

/* A byte count from the environment variable `name`, or 0 when it is unset or empty. */
static size_t env_bytes(const char *name) {
  const char *text = getenv(name);
  if (!text || !*text) return 0;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  /* strtoull skips spaces and negates a '-' after them: " -5" would be 2^64 - 5 */
  if (errno || end == text || *end || strchr(text, '-') || v == 0)
    attn_fail(EXIT_BAD_USAGE, "%s must be a positive byte count, got '%s'", name, text);
  return (size_t)v;
}

size_t attn_shared_memory_limit(void) {
  int device, optin;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  size_t limit = (size_t)optin;
  /* A large GPU can stand in for a small one: the tests set this to 99 KiB (sm_86, sm_89)
   * and 163 KiB (sm_80) so that the configuration those GPUs get is tested on any GPU. */
  size_t asked = env_bytes("ATTN_SHARED_MEMORY_LIMIT");
  if (asked && asked < limit) limit = asked;
  return limit;
}

size_t attn_shared_memory_per_sm(void) {
  int device, per_sm;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  size_t limit = (size_t)per_sm, asked = env_bytes("ATTN_SHARED_MEMORY_PER_SM");
  return asked && asked < limit ? asked : limit;
}

int attn_blocks_per_sm(size_t bytes, int max_blocks) {
  int device, reserved;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  size_t fit = attn_shared_memory_per_sm() / (bytes + (size_t)reserved);
  return fit < (size_t)max_blocks ? (int)fit : max_blocks;
}

/* Per thread, like the stream below: PyTorch runs backward passes on threads of its own. */
static thread_local int attn_deterministic_asked;
void attn_set_deterministic(int asked) { attn_deterministic_asked = asked; }

int attn_deterministic(void) {
  const char *text = getenv("ATTN_DETERMINISTIC");
  if (text && *text && strcmp(text, "0") != 0 && strcmp(text, "1") != 0)
    attn_fail(EXIT_BAD_USAGE, "ATTN_DETERMINISTIC must be 0 or 1, got '%s'", text);
  return attn_deterministic_asked || (text && strcmp(text, "1") == 0);
}

int attn_decode_chunk_keys(void) {
  enum { MAX_CHUNK_KEYS = 1 << 24 }; /* the largest --seq-kv: no chunk needs more keys */
  const char *text = getenv("ATTN_DECODE_CHUNK_KEYS");
  if (!text || !*text) return 0;
  char *end;
  errno = 0;
  long keys = strtol(text, &end, 10);
  if (errno || end == text || *end || keys <= 0 || keys > MAX_CHUNK_KEYS ||
      keys % ATTN_DECODE_TILE_KEYS != 0)
    attn_fail(EXIT_BAD_USAGE,
              "ATTN_DECODE_CHUNK_KEYS must be a key count in 1..%d, a multiple of %d (whole "
              "tiles), got '%s'",
              MAX_CHUNK_KEYS, ATTN_DECODE_TILE_KEYS, text);
  return (int)keys;
}

int attn_decode_batch_invariant(void) {
  const char *text = getenv("ATTN_DECODE_BATCH_INVARIANT");
  if (text && *text && strcmp(text, "0") != 0 && strcmp(text, "1") != 0)
    attn_fail(EXIT_BAD_USAGE, "ATTN_DECODE_BATCH_INVARIANT must be 0 or 1, got '%s'", text);
  return text && strcmp(text, "1") == 0;
}

void attn_check_environment(void) {
  env_bytes("ATTN_SHARED_MEMORY_LIMIT");
  env_bytes("ATTN_SHARED_MEMORY_PER_SM");
  attn_deterministic();
  attn_decode_chunk_keys();
  attn_decode_batch_invariant();
}

/* Per thread: PyTorch runs backward passes on threads of its own. 0: the legacy stream. */
static thread_local cudaStream_t attn_launch_stream;
cudaStream_t attn_stream(void) { return attn_launch_stream; }
void attn_set_stream(cudaStream_t stream) { attn_launch_stream = stream; }

void attn_require_shared_memory(const void *kernel, size_t bytes, const char *kernel_name) {
  size_t limit = attn_shared_memory_limit();
  if (bytes > limit)
    attn_fail(EXIT_BAD_USAGE,
              "%s needs %zu bytes of shared memory per block, this device allows %zu; use a "
              "smaller head dim or tile",
              kernel_name, bytes, limit);
  /* The attributes are set where they change, not on every launch: a library call (the
   * Python package) runs this before each launch, and cudaFuncSetAttribute costs host time.
   * A kernel keeps the largest opt-in asked of it (a smaller launch fits under it). One table
   * for every thread, under a lock: the attribute is the device's, not the thread's. */
  struct opted_in {
    const void *kernel;
    int device;
    size_t bytes, per_sm;
  };
  enum { Remembered = 256 }; /* more kernels than any stage launches; past it, reset */
  static opted_in done[Remembered];
  static int used;
  static std::mutex lock;
  int device;
  CUDA_CHECK(cudaGetDevice(&device));
  size_t per_sm = env_bytes("ATTN_SHARED_MEMORY_PER_SM");
  /* The CUDA calls' errors are checked once the lock is released: a failed check leaves
   * through attn_fail, which in the library jumps back to its entry point (longjmp), past
   * any destructor, and a lock held there would be held for good. */
  cudaError_t err = cudaSuccess;
  const char *failed = "";
  lock.lock();
  opted_in *entry = nullptr;
  for (int i = 0; i < used && !entry; i++)
    if (done[i].kernel == kernel && done[i].device == device) entry = &done[i];
  if (!entry || bytes > entry->bytes || per_sm != entry->per_sm) {
    if (!entry) {
      if (used == Remembered) used = 0; /* forget: the attributes are set again as asked */
      entry = &done[used++];
      *entry = {kernel, device, 0, per_sm};
    }
    if (bytes > entry->bytes) {
      /* Above 48 KiB a kernel must opt in explicitly. */
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
      failed = "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)";
      if (err == cudaSuccess) entry->bytes = bytes;
    }
    /* Standing in for a GPU of less shared memory per SM: the carveout, a percentage of the
     * largest, rounded down, since the driver rounds it up to the next capacity the SM has
     * (on Hopper 100 KiB and 164 KiB among them, the sm_86/89 and sm_80 figures). 0: the
     * default, every capacity allowed. */
    if (err == cudaSuccess && (per_sm != entry->per_sm || per_sm)) {
      int percent = -1, most = 0;
      if (per_sm) {
        err = cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
        failed = "cudaDeviceGetAttribute(MaxSharedMemoryPerMultiprocessor)";
        percent = per_sm >= (size_t)most ? 100 : (int)(per_sm * 100 / (size_t)most);
      }
      if (err == cudaSuccess) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent);
        failed = "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)";
      }
      if (err == cudaSuccess) entry->per_sm = per_sm;
    }
  }
  lock.unlock();
  attn_cuda_check(err, failed, __FILE__, __LINE__);
}

static cudaEvent_t timer_begin, timer_end;
static void *l2_flush_buffer;
static size_t l2_flush_bytes;

static int gpu_open(attn_stamp *stamp) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    /* One line with "no CUDA device" in it, the phrase CTest's skip regex and the scripts
     * look for. Without a GPU the runtime's own reason is noise (with no driver at all it
     * blames the driver's version); only a driver that is present but older than the
     * runtime is worth naming, since updating it is the fix. */
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    if (err == cudaErrorInsufficientDriver && driver > 0)
      fprintf(stderr,
              "%s: skipped: no CUDA device usable: the driver supports CUDA %d.%d, this stage "
              "was built with CUDA %d.%d\n",
              attn_program_name, driver / 1000, driver % 1000 / 10, runtime / 1000,
              runtime % 1000 / 10);
    else
      fprintf(stderr, "%s: skipped: no CUDA device\n", attn_program_name);
    return EXIT_NO_DEVICE;
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  /* Every GPU stage is built for compute capability 8.0 and later (cp.async, bf16, ldmatrix
   * and mma.sync in the half-precision stages); an older GPU would fail at its first launch. */
  if (prop.major < 8) {
    fprintf(stderr,
            "%s: skipped: no CUDA device of compute capability 8.0 or later (%s is %d.%d)\n",
            attn_program_name, prop.name, prop.major, prop.minor);
    return EXIT_NO_DEVICE;
  }
  snprintf(stamp->device, sizeof stamp->device, "%.127s", prop.name);
  stamp->units = prop.multiProcessorCount;
  int runtime;
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  snprintf(stamp->cuda, sizeof stamp->cuda, "%d.%d", runtime / 1000, runtime % 1000 / 10);
  CUDA_CHECK(cudaEventCreate(&timer_begin));
  CUDA_CHECK(cudaEventCreate(&timer_end));
  /* Writing twice the L2's size evicts whatever a previous repeat left there. */
  l2_flush_bytes = 2 * (size_t)prop.l2CacheSize;
  CUDA_CHECK(cudaMalloc(&l2_flush_buffer, l2_flush_bytes));
  return EXIT_OK;
}

static void *gpu_alloc(size_t bytes, const char *what) {
  void *ptr = NULL;
  cudaError_t err = cudaMalloc(&ptr, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total = 0;
    cudaGetLastError(); /* clear the error before asking */
    cudaMemGetInfo(&free_bytes, &total);
    attn_fail(EXIT_BAD_USAGE,
              "problem too large for device memory: %s needs %.2f GiB, %.2f GiB free of %.2f", what,
              bytes / 1073741824.0, free_bytes / 1073741824.0, total / 1073741824.0);
  }
  return ptr;
}

static void gpu_release(void *ptr) { CUDA_CHECK(cudaFree(ptr)); }
static void gpu_upload(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
static void gpu_download(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

/* cudaMemset sets bytes, not floats, so NaN is written by a kernel, in the element's type. */
template <typename T>
__global__ void fill_nan_kernel(T *x, size_t n, T nan) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = nan;
}

static void gpu_fill_nan(void *dst, size_t count, attn_dtype t) {
  const int threads = 256, blocks = 1024; /* a grid-stride loop: any count */
  if (t == DTYPE_FP32)
    fill_nan_kernel<float><<<blocks, threads>>>((float *)dst, count, nanf(""));
  else
    fill_nan_kernel<unsigned short><<<blocks, threads>>>(
        (unsigned short *)dst, count, (unsigned short)(t == DTYPE_FP16 ? 0x7e00 : 0x7fc0));
  CHECK_LAUNCH("fill_nan_kernel");
  CUDA_CHECK(cudaDeviceSynchronize());
}

static void gpu_before_repeat(void) {
  CUDA_CHECK(cudaMemsetAsync(l2_flush_buffer, 0, l2_flush_bytes));
}

static void gpu_timer_start(void) { CUDA_CHECK(cudaEventRecord(timer_begin)); }

static double gpu_timer_stop_ms(void) {
  CUDA_CHECK(cudaEventRecord(timer_end));
  CUDA_CHECK(cudaEventSynchronize(timer_end));
  CUDA_CHECK(cudaGetLastError()); /* a fault inside the timed kernels shows here */
  float ms;
  CUDA_CHECK(cudaEventElapsedTime(&ms, timer_begin, timer_end));
  return ms;
}

extern "C" const attn_device attn_cuda_device = {
    "gpu",
    gpu_open,
    gpu_alloc,
    gpu_release,
    gpu_upload,
    gpu_download,
    gpu_fill_nan,
    gpu_before_repeat,
    gpu_timer_start,
    gpu_timer_stop_ms,
    /* quick_warmups, quick_repeats, bench_warmups, bench_repeats (docs/conventions.md 5) */
    5,
    20,
    5,
    20,
};
