/* test_io.h: whole-buffer pipe I/O for tests that fork a peer process. */
#ifndef TW_TESTS_TEST_IO_H
#define TW_TESTS_TEST_IO_H

#include <stddef.h>
#include <sys/types.h>
#include <unistd.h>

/** Write all n bytes of p to fd (retrying short writes). 0, or -1 on error/EOF. */
static inline int tw_test_write_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n) {
    ssize_t w = write(fd, c, n);
    if (w <= 0) return -1;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

/** Read exactly n bytes from fd into p. 0, or -1 on error/EOF. */
static inline int tw_test_read_all(int fd, void *p, size_t n) {
  char *c = p;
  while (n) {
    ssize_t r = read(fd, c, n);
    if (r <= 0) return -1;
    c += r;
    n -= (size_t)r;
  }
  return 0;
}

#endif
