/* file_read.c: capped reads of regular files (see file_read.h). */
#include "common/base/file_read.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

TW_NODISCARD tw_status_t tw_file_read(const char *path, size_t max_bytes, const char *what,
                                      char **buf_p, size_t *len_p) {
  *buf_p = NULL;
  if (len_p) *len_p = 0;
  /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below */
  int fd;
  do {
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return tw_err(TW_ERR_IO, "cannot open %s %s: %s", what,
                  path, strerror(errno));
  struct stat sb;
  tw_status_t st = TW_OK;
  char *buf = NULL;
  size_t len = 0;
  if (fstat(fd, &sb) != 0) {
    st = tw_err(TW_ERR_IO, "cannot stat %s %s: %s", what, path, strerror(errno));
  } else if (!S_ISREG(sb.st_mode)) {
    st = tw_err(TW_ERR_INVALID_ARGUMENT, "%s %s is not a regular file", what, path);
  } else if ((uint64_t)sb.st_size > max_bytes) {
    st = tw_err(TW_ERR_FORMAT, "%s %s is larger than %zu bytes", what, path, max_bytes);
  } else if (!(buf = malloc((size_t)sb.st_size + 1))) {
    st = tw_err(TW_ERR_NO_MEMORY, "out of memory reading %s %s", what, path);
  } else {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    size_t cap = (size_t)sb.st_size; /* a file that grows meanwhile is read up to its size */
    while (len < cap) {
      ssize_t r = read(fd, buf + len, cap - len);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        st = tw_err(TW_ERR_IO, "cannot read %s %s: %s", what, path, strerror(errno));
        break;
      }
      if (r == 0) break;
      len += (size_t)r;
    }
  }
  close(fd);
  if (st != TW_OK) {
    free(buf);
    return st;
  }
  buf[len] = '\0';
  *buf_p = buf;
  if (len_p) *len_p = len;
  return TW_OK;
}
