/* .npy reading and writing. The format: 6 magic bytes "\x93NUMPY", the version (1.0: a
 * 2-byte header length; 2.0: 4 bytes), then a Python dict literal padded with spaces to a
 * multiple of 64 bytes and ended by '\n', then the raw data. */
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npy.h"

static const char npy_magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
enum { NPY_MAX_HEADER = 1 << 16 };

static int failf(char *err, size_t err_len, const char *path, const char *why) {
  snprintf(err, err_len, "%s: %s", path, why);
  return -1;
}

/* The text after "'key':" in the header dict, spaces skipped; NULL when the key is absent. */
static const char *dict_value(const char *dict, const char *key) {
  char quoted[32];
  snprintf(quoted, sizeof quoted, "'%s'", key);
  const char *at = strstr(dict, quoted);
  if (!at) return NULL;
  at += strlen(quoted);
  while (isspace((unsigned char)*at)) at++;
  if (*at++ != ':') return NULL;
  while (isspace((unsigned char)*at)) at++;
  return at;
}

/* Parses the header; leaves the file at the first data byte. */
static int read_header(FILE *f, const char *path, size_t *shape, int *ndim, char *err,
                       size_t err_len) {
  unsigned char pre[10];
  if (fread(pre, 1, 8, f) != 8 || memcmp(pre, npy_magic, 6) != 0)
    return failf(err, err_len, path, "not a .npy file (bad magic bytes)");
  size_t header_len;
  if (pre[6] == 1) {
    if (fread(pre + 8, 1, 2, f) != 2) return failf(err, err_len, path, "truncated header");
    header_len = pre[8] | (size_t)pre[9] << 8;
  } else if (pre[6] == 2 || pre[6] == 3) {
    unsigned char len[4];
    if (fread(len, 1, 4, f) != 4) return failf(err, err_len, path, "truncated header");
    header_len = len[0] | (size_t)len[1] << 8 | (size_t)len[2] << 16 | (size_t)len[3] << 24;
  } else {
    return failf(err, err_len, path, "unsupported .npy format version");
  }
  if (header_len == 0 || header_len > NPY_MAX_HEADER)
    return failf(err, err_len, path, "implausible header length");
  char *h = malloc(header_len + 1);
  if (!h || fread(h, 1, header_len, f) != header_len) {
    free(h);
    return failf(err, err_len, path, "truncated header");
  }
  h[header_len] = 0;
  int rc = 0;
  const char *descr = dict_value(h, "descr"), *order = dict_value(h, "fortran_order");
  const char *shp = dict_value(h, "shape");
  if (!descr || !order || !shp) {
    rc = failf(err, err_len, path, "header lacks descr, fortran_order or shape");
  } else if (strncmp(descr, "'<f4'", 5) != 0) {
    char got[16] = "";
    sscanf(descr, "%15[^,}]", got);
    snprintf(err, err_len,
             "%s: dtype %s, expected '<f4' (little-endian float32; use arr.astype(np.float32))",
             path, got);
    rc = -1;
  } else if (strncmp(order, "False", 5) != 0) {
    rc = failf(err, err_len, path, "Fortran order, expected C order (use np.ascontiguousarray)");
  } else {
    const char *c = shp;
    /* Elements so far: a shape whose byte size would wrap a size_t is refused. */
    size_t count = 1, max_count = SIZE_MAX / sizeof(float);
    *ndim = 0;
    if (*c != '(') rc = failf(err, err_len, path, "shape is not a tuple");
    for (c++; rc == 0;) {
      while (isspace((unsigned char)*c) || *c == ',') c++;
      if (*c == ')') break;
      /* Signed: strtoull would read "-3" as 2^64 - 3. */
      char *end;
      errno = 0;
      long long n = strtoll(c, &end, 10);
      if (end == c || *ndim == NPY_MAX_DIMS) {
        rc = failf(err, err_len, path, "cannot read the shape");
      } else if (n < 0) {
        snprintf(err, err_len, "%s: dimension %d is %.*s; a size cannot be negative", path, *ndim,
                 (int)(end - c), c);
        rc = -1;
      } else if (errno == ERANGE || (uintmax_t)n > max_count ||
                 (n > 0 && count > max_count / (size_t)n)) {
        snprintf(err, err_len, "%s: dimension %d is %.*s; the array's size overflows", path, *ndim,
                 (int)(end - c), c);
        rc = -1;
      } else {
        count *= (size_t)n;
        shape[(*ndim)++] = (size_t)n;
        c = end;
      }
    }
  }
  free(h);
  return rc;
}

int npy_read_shape(const char *path, size_t *shape, int *ndim, char *err, size_t err_len) {
  FILE *f = fopen(path, "rb");
  if (!f) return failf(err, err_len, path, strerror(errno));
  int rc = read_header(f, path, shape, ndim, err, err_len);
  fclose(f);
  return rc;
}

static void shape_text(const size_t *shape, int ndim, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "(");
  for (int i = 0; i < ndim && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, i ? ", %zu" : "%zu", shape[i]);
  if (used < len) snprintf(buf + used, len - used, ")");
}

int npy_read_f32(const char *path, const size_t *shape, int ndim, float *out, char *err,
                 size_t err_len) {
  FILE *f = fopen(path, "rb");
  if (!f) return failf(err, err_len, path, strerror(errno));
  size_t got[NPY_MAX_DIMS];
  int got_ndim = 0;
  if (read_header(f, path, got, &got_ndim, err, err_len)) {
    fclose(f);
    return -1;
  }
  int same = got_ndim == ndim;
  for (int i = 0; same && i < ndim; i++) same = got[i] == shape[i];
  if (!same) {
    char want_s[96], got_s[96];
    shape_text(shape, ndim, want_s, sizeof want_s);
    shape_text(got, got_ndim, got_s, sizeof got_s);
    snprintf(err, err_len, "%s: shape %s, expected %s", path, got_s, want_s);
    fclose(f);
    return -1;
  }
  size_t count = 1;
  for (int i = 0; i < ndim; i++) count *= shape[i];
  size_t n = fread(out, sizeof(float), count, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  if (n != count) {
    snprintf(err, err_len, "%s: truncated, %zu of %zu float32 values present", path, n, count);
    return -1;
  }
  if (extra) return failf(err, err_len, path, "has bytes after the data its shape declares");
  return 0;
}

int npy_write_f32(const char *path, const size_t *shape, int ndim, const float *data, char *err,
                  size_t err_len) {
  char dict[256], shape_s[160];
  shape_text(shape, ndim, shape_s, sizeof shape_s);
  if (ndim == 1) shape_s[strlen(shape_s) - 1] = 0, strcat(shape_s, ",)");
  int len = snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }",
                     shape_s);
  /* magic (6) + version (2) + length (2) + dict + padding + '\n' is a multiple of 64. */
  int total = 10 + len + 1, padded = (total + 63) / 64 * 64;
  FILE *f = fopen(path, "wb");
  if (!f) return failf(err, err_len, path, strerror(errno));
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  pre[8] = (unsigned char)((padded - 10) & 0xff);
  pre[9] = (unsigned char)((padded - 10) >> 8);
  size_t count = 1;
  for (int i = 0; i < ndim; i++) count *= shape[i];
  int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)len, f) == (size_t)len;
  for (int i = total; ok && i < padded; i++) ok = fputc(' ', f) != EOF;
  ok = ok && fputc('\n', f) != EOF && fwrite(data, sizeof(float), count, f) == count;
  ok = (fclose(f) == 0) && ok;
  return ok ? 0 : failf(err, err_len, path, "write failed");
}
