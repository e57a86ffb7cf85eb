/* cli_keygen.c: `twain keygen FILE` writes a fresh link key set
 * (common/comm/link_auth.h) to FILE, created with mode 0600 and never
 * overwritten; `twain keygen -` prints it (for a Kubernetes Secret). */
#include "router/cli/cli.h"

#include "common/comm/link_auth.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int tw_cli_keygen(int argc, char **argv) {
  if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: twain keygen FILE|-\n\n"
           "Writes a new CURVE key set for the links between the router and the workers (and\n"
           "between a worker's ranks) to FILE (created with mode 0600; an existing file is\n"
           "never overwritten) or, with -, to stdout. Every process of one deployment gets the\n"
           "same set: TWAIN_KEYS_FILE=FILE, or TWAIN_KEYS=<its text>.\n");
    return 0;
  }
  if (argc != 2) {
    fprintf(stderr, "usage: twain keygen FILE|-   (twain keygen --help)\n");
    return 2;
  }
  tw_auth_keys_t k;
  char text[512];
  if (tw_auth_keys_generate(&k) != TW_OK || tw_auth_keys_format(&k, text, sizeof text) < 0) {
    fprintf(stderr, "twain keygen: %s\n", tw_last_error());
    return 1;
  }
  memset(&k, 0, sizeof k);
  int rc = 0;
  if (!strcmp(argv[1], "-")) {
    rc = fputs(text, stdout) < 0 || fflush(stdout) != 0;
  } else {
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    size_t len = strlen(text);
    if (fd < 0 || write(fd, text, len) != (ssize_t)len || fsync(fd) != 0) {
      fprintf(stderr, "twain keygen: cannot write %s: %s\n", argv[1], strerror(errno));
      rc = 1;
    }
    if (fd >= 0) close(fd);
  }
  memset(text, 0, sizeof text);
  return rc;
}
