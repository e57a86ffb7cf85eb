/* safetensors.h: a read-only safetensors file, memory-mapped, with its JSON
 * header parsed and checked (spec §3).
 *
 * File layout: u64 little-endian header length N, N bytes of JSON (an object
 * mapping tensor name -> {"dtype", "shape", "data_offsets": [begin, end]},
 * plus an optional "__metadata__" object of strings), then the data section;
 * offsets are relative to the start of the data section.
 *
 * Everything in the header is validated when the file is opened, so a view
 * handed out later is always inside the file and of the size its dtype and
 * shape say. Opening touches only the header pages; tensor data is read by
 * whoever dereferences a view. Each error has its own message naming the file
 * and the tensor. */
#ifndef TW_COMMON_SAFETENSORS_H
#define TW_COMMON_SAFETENSORS_H

#include "common/base/status.h"
#include "common/model/model.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_SAFETENSORS_MAX_DIMS 8
/* A header larger than this is refused as absurd (real ones are < 1 MiB). */
#define TW_SAFETENSORS_MAX_HEADER_BYTES (100LL * 1000 * 1000)

/** One tensor entry of a parsed header. Borrowed from its file. */
typedef struct {
  const char *name;
  tw_dtype_t dtype;
  int32_t ndim;                              /* 0 for a scalar */
  int64_t shape[TW_SAFETENSORS_MAX_DIMS];
  int64_t n_elems;                           /* product of shape (1 for a scalar) */
  int64_t n_bytes;                           /* n_elems * tw_dtype_size(dtype) */
  int64_t begin;                             /* offset in the data section */
  const void *data;                          /* start of the bytes in the mapping */
} tw_safetensors_tensor_t;

typedef struct tw_safetensors tw_safetensors_t;

/** Parse a safetensors dtype string ("BF16", "U8", ...). Errors:
 *  TW_ERR_NOT_FOUND if the string is not a known dtype (no message stored). */
TW_NODISCARD tw_status_t tw_safetensors_dtype_parse(const char *s, tw_dtype_t *dtype_p);

/** mmap `path` read-only and parse its header.
 *  Errors: TW_ERR_IO (open/stat/mmap failed), TW_ERR_FORMAT (shorter than 8
 *  bytes; header length beyond the file or > TW_SAFETENSORS_MAX_HEADER_BYTES;
 *  header not JSON or not an object; an entry lacking dtype/shape/
 *  data_offsets or with the wrong JSON type; unknown dtype; negative dim or
 *  shape product overflow; shape x dtype size != byte range; begin > end;
 *  range beyond the end of the file (truncated); overlapping ranges; a
 *  duplicate name), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_safetensors_open(const char *path, tw_safetensors_t **file_p);

/** Parse an in-memory safetensors image (same checks and errors as
 *  tw_safetensors_open, minus TW_ERR_IO). Borrows `bytes`, which must outlive
 *  the handle; `label` names it in error messages. */
TW_NODISCARD tw_status_t tw_safetensors_parse(const void *bytes, int64_t n_bytes, const char *label,
                                              tw_safetensors_t **file_p);

/** Unmap (if it mapped) and free. NULL does nothing. */
void tw_safetensors_destroy(tw_safetensors_t *file);

/** Path (or label) given at open. */
const char *tw_safetensors_path(const tw_safetensors_t *file);

/** Number of tensors (the "__metadata__" entry is not one). */
int64_t tw_safetensors_count(const tw_safetensors_t *file);

/** The i-th tensor in name order, 0 <= i < count; NULL if out of range. */
const tw_safetensors_tensor_t *tw_safetensors_tensor_at(const tw_safetensors_t *file,
                                                        int64_t i);

/** Find a tensor by exact name (binary search); NULL if absent. */
const tw_safetensors_tensor_t *tw_safetensors_find(const tw_safetensors_t *file,
                                                   const char *name);

/** Value of a "__metadata__" key, or NULL. */
const char *tw_safetensors_metadata(const tw_safetensors_t *file, const char *key);

/** Total file size in bytes and data section size in bytes. */
int64_t tw_safetensors_file_bytes(const tw_safetensors_t *file);
int64_t tw_safetensors_data_bytes(const tw_safetensors_t *file);

#ifdef __cplusplus
}
#endif
#endif
