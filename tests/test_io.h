/* test_io.h: whole-buffer pipe I/O for tests that fork a peer process. */
#ifndef TW_TESTS_TEST_IO_H
#define TW_TESTS_TEST_IO_H

#include <stddef.h>
#include <sys/select.h>
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

/** Call progress(arg) and wait up to 100 us for fd to be readable, again and
 *  again (bounded: 200000 rounds): for a process that must keep its own
 *  transport moving while a forked peer works. 1 once readable, 0 if never. */
static inline int tw_test_progress_until_readable(int fd, void (*progress)(void *), void *arg) {
  for (int it = 0; it < 200000; it++) {
    progress(arg);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(fd, &fds);
    struct timeval tv = {0, 100};
    if (select(fd + 1, &fds, NULL, NULL, &tv) > 0) return 1;
  }
  return 0;
}

#endif
