/* The host as a "device": plain memory and a monotonic clock, for the CPU stages 00-02. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "device.h"

static int host_open(attn_stamp *stamp) {
  snprintf(stamp->device, sizeof stamp->device, "cpu");
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[256];
  while (f && fgets(line, sizeof line, f)) {
    char *colon = strchr(line, ':');
    if (strncmp(line, "model name", 10) == 0 && colon) {
      snprintf(stamp->device, sizeof stamp->device, "%s", colon + 2);
      stamp->device[strcspn(stamp->device, "\n")] = 0;
      break;
    }
  }
  if (f) fclose(f);
  stamp->units = (int)sysconf(_SC_NPROCESSORS_ONLN);
  snprintf(stamp->cuda, sizeof stamp->cuda, "-");
  return EXIT_OK;
}

static void *host_alloc(size_t bytes, const char *what) { return attn_host_alloc(bytes, what); }
static void host_release(void *ptr) { free(ptr); }
static void host_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }

static void host_fill_nan(void *dst, size_t count, attn_dtype t) {
  (void)t; /* the CPU stages are fp32 */
  float *x = dst;
  for (size_t i = 0; i < count; i++) x[i] = NAN;
}

static void host_before_repeat(void) {}

static struct timespec host_t0;
static void host_timer_start(void) { clock_gettime(CLOCK_MONOTONIC, &host_t0); }
static double host_timer_stop_ms(void) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (t1.tv_sec - host_t0.tv_sec) * 1e3 + (t1.tv_nsec - host_t0.tv_nsec) * 1e-6;
}

const attn_device attn_host_device = {
    .kind = "cpu",
    .open = host_open,
    .alloc = host_alloc,
    .release = host_release,
    .upload = host_copy,
    .download = host_copy,
    .fill_nan = host_fill_nan,
    .before_repeat = host_before_repeat,
    .timer_start = host_timer_start,
    .timer_stop_ms = host_timer_stop_ms,
    /* The check run already warmed the caches; a CPU run of a large N takes seconds. */
    .quick_warmups = 0,
    .quick_repeats = 3,
    .bench_warmups = 1,
    .bench_repeats = 5,
};
