/* st_writer.h: test-only helpers to write safetensors files (well-formed or
 * deliberately broken) and temporary checkpoint directories. */
#ifndef TW_TESTS_LOADER_ST_WRITER_H
#define TW_TESTS_LOADER_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  char name[160];
  char dtype[16];       /* safetensors dtype string, written as is */
  int ndim;
  int64_t shape[8];
  const void *data;     /* NULL: zero bytes */
  int64_t n_bytes;
} stw_tensor_t;

/** Write a safetensors file of `n` tensors laid out back to back in the
 *  given order (header padded with spaces to a multiple of 8). 0 on success. */
int stw_write(const char *path, const stw_tensor_t *tensors, int n);

/** Write `len_field` as the u64 header length, then `header` (strlen bytes),
 *  then `n_data` bytes of `data` (zeros if NULL). 0 on success. */
int stw_write_raw(const char *path, uint64_t len_field, const char *header, const void *data,
                  int64_t n_data);

/** Fill `out` (capacity `cap`) with the tensors of a safetensors file, data
 *  pointing into `*mapping_p` (free with free()). Returns the count or -1. */
int stw_read(const char *path, stw_tensor_t *out, int cap, void **mapping_p);

/** Create a fresh directory under $TMPDIR or /tmp; returns a malloc'd path. */
char *stw_tmpdir(const char *tag);
/** Remove a directory tree (bounded depth, no symlink following). */
void stw_rmtree(const char *dir);
/** Copy a file. 0 on success. */
int stw_copy(const char *src, const char *dst);
/** Write a text file. 0 on success. */
int stw_write_text(const char *path, const char *text);
/** Read a whole file (NUL-terminated, malloc'd); *n_p gets its size. */
char *stw_slurp(const char *path, int64_t *n_p);

#endif
