/* Writes the malformed .npy folders the bad-input tests load: one bad q.npy each, next to
 * good k.npy and v.npy of shape [1, 2, 5, 32] (the tests ask for Nq = 3, Nkv = 5, d = 32). */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "npy.h"

static int write_raw(const char *path, const char *dict, size_t data_bytes) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  char header[128];
  int len = snprintf(header, sizeof header, "%s", dict);
  while ((10 + len + 1) % 64) header[len++] = ' ';
  header[len++] = '\n';
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)len, 0};
  fwrite(pre, 1, 10, f);
  fwrite(header, 1, (size_t)len, f);
  for (size_t i = 0; i < data_bytes; i++) fputc(0, f);
  return fclose(f);
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  static float zeros[1 * 2 * 5 * 32];
  size_t kv_shape[4] = {1, 2, 5, 32};
  enum { FIXTURES = 6 };
  const char *names[FIXTURES] = {"wrong_dtype", "wrong_shape",  "fortran_order",
                                 "truncated",   "negative_dim", "huge_dim"};
  /* negative_dim: read as unsigned, -3 once became 18446744073709551613. huge_dim: a size
   * whose element count wraps a 64-bit size_t. */
  const char *dicts[FIXTURES] = {
      "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2, 3, 32), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3, 33), }",
      "{'descr': '<f4', 'fortran_order': True, 'shape': (1, 2, 3, 32), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3, 32), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, -3, 32), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 4611686018427387904, 32), }"};
  size_t data_bytes[FIXTURES] = {8 * 192, 4 * 198, 4 * 192, 4 * 100, 0, 0};
  char path[4096], err[256];
  mkdir(argv[1], 0777);
  for (int n = 0; n < FIXTURES; n++) {
    snprintf(path, sizeof path, "%s/%s", argv[1], names[n]);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/%s/q.npy", argv[1], names[n]);
    if (write_raw(path, dicts[n], data_bytes[n])) return 1;
    for (int t = 0; t < 2; t++) {
      snprintf(path, sizeof path, "%s/%s/%s", argv[1], names[n], t ? "v.npy" : "k.npy");
      if (npy_write_f32(path, kv_shape, 4, zeros, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
      }
    }
  }
  return 0;
}
