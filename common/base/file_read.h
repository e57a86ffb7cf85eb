/* file_read.h: read a small file (a configuration, an index, a tokenizer, a
 * key file) whole into memory, safely: only a regular file (a FIFO, a device
 * such as /dev/zero or a directory is refused at once, without blocking),
 * only up to a cap (checked on the size before reading, and while reading). */
#ifndef TW_COMMON_FILE_READ_H
#define TW_COMMON_FILE_READ_H

#include "common/base/status.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Read `path` into a new NUL-terminated buffer (*buf_p, free() it; *len_p
 *  bytes before the NUL). `what` names the file in messages ("config",
 *  "tokenizer"). Errors: TW_ERR_IO (cannot open, e.g. no such file, or
 *  read), TW_ERR_INVALID_ARGUMENT (not a regular file), TW_ERR_FORMAT
 *  (larger than max_bytes), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_file_read(const char *path, size_t max_bytes, const char *what,
                                      char **buf_p, size_t *len_p);

#ifdef __cplusplus
}
#endif
#endif
