/* How the harness talks to the place a stage runs: the host (host_device.c) or a CUDA GPU
 * (gpu.cu). The runner in runner.c is written once against this table, so a CPU stage and
 * a GPU stage are checked, timed and reported by the same code. */
#ifndef ATTN_DEVICE_H
#define ATTN_DEVICE_H

#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  char device[128]; /* CPU model or GPU name */
  int units;        /* cores or streaming multiprocessors */
  char cuda[32];    /* CUDA runtime version, "-" on the host */
  char date[16];    /* YYYY-MM-DD of the run */
} attn_stamp;

struct attn_device {
  const char *kind; /* "cpu" or "gpu" */
  /* Returns EXIT_OK, or EXIT_NO_DEVICE after printing one line saying why. */
  int (*open)(attn_stamp *stamp);
  void *(*alloc)(size_t bytes, const char *what); /* exits 2 when it does not fit */
  void (*release)(void *ptr);
  void (*upload)(void *dst, const void *src, size_t bytes);
  void (*download)(void *dst, const void *src, size_t bytes);
  void (*fill_nan)(void *dst, size_t count, attn_dtype t); /* poison an output */
  void (*before_repeat)(void);                             /* GPU: flush the L2 cache */
  void (*timer_start)(void);
  double (*timer_stop_ms)(void);    /* waits for the work since timer_start */
  int quick_warmups, quick_repeats; /* a default run */
  int bench_warmups, bench_repeats; /* --bench (docs/conventions.md section 5) */
};

extern const attn_device attn_host_device;

#ifdef __cplusplus
}
#endif

#endif
