/* NumPy .npy files, format 1.0 (2.0 read too), little-endian float32, C order. */
#ifndef ATTN_NPY_H
#define ATTN_NPY_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NPY_MAX_DIMS 8

/* Reads the header of `path`: its shape. Returns 0, or -1 with a one-line reason in err;
 * a negative dimension, or a shape whose size in bytes would not fit a size_t, is refused. */
int npy_read_shape(const char *path, size_t *shape, int *ndim, char *err, size_t err_len);
/* Reads `path` into out, which must have the given shape. Returns 0 or -1 with err. */
int npy_read_f32(const char *path, const size_t *shape, int ndim, float *out, char *err,
                 size_t err_len);
/* Writes a float32 array. Returns 0 or -1 with err. */
int npy_write_f32(const char *path, const size_t *shape, int ndim, const float *data, char *err,
                  size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
