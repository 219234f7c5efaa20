/* gpu_gate PROBE_FILE COMMAND [ARGS...]: how every GPU test starts. Where the probe's answer
 * (written by the CTest fixture gpu.probe, cmake/gpu_probe.cmake) says there is no CUDA
 * device, it prints that answer and exits 77 at once, which CTest shows as skipped; in every
 * other case (the file missing, unreadable, or saying there is a device) it runs COMMAND
 * unchanged, so that on a GPU machine no test is ever skipped on the probe's word alone:
 * the stage itself decides, as it always did. Plain C, no CUDA: it costs a few milliseconds
 * where the runtime's search for a device costs most of a second per process. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: gpu_gate PROBE_FILE COMMAND [ARGS...]\n");
    return 2;
  }
  FILE *f = fopen(argv[1], "r");
  char line[256] = "";
  if (f) {
    if (!fgets(line, sizeof line, f)) line[0] = 0;
    fclose(f);
  }
  if (strncmp(line, "no CUDA device", 14) == 0) {
    line[strcspn(line, "\n")] = 0;
    /* "no CUDA device" is also the phrase the tests' skip regular expression looks for. */
    printf("skipped: %s (the gpu.probe test's answer, %s)\n", line, argv[1]);
    return 77;
  }
  execvp(argv[2], argv + 2);
  fprintf(stderr, "gpu_gate: cannot run %s: %s\n", argv[2], strerror(errno));
  return 2;
}
