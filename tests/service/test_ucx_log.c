/* test_ucx_log.c: UCX's own log messages as twain log lines
 * (common/kv/ucx_log.h). Messages go through UCX's real dispatcher
 * (ucs_log_dispatch, as UCX's ucs_warn and ucs_error do) with this
 * process's stderr caught in a file: after tw_ucx_log_install a WARN and an
 * ERROR come out as one `WARN ... ucx: TEXT (FILE:LINE)` line each; a burst
 * of 25 in one second gives TW_UCX_LOG_BURST lines and counts the rest,
 * which the first line of the next second names; installing twice changes
 * nothing. */
#include "common/base/log.h"
#include "common/kv/ucx_log.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include "tests/test_expect.h"

static char g_path[] = "/tmp/tw_ucx_log_XXXXXX";

/* What was written to the caught stderr so far. */
static char *caught(void) {
  static char buf[1 << 16];
  FILE *f = fopen(g_path, "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f) fclose(f);
  buf[n] = '\0';
  return buf;
}

static int count(const char *text, const char *what) {
  int n = 0;
  for (const char *p = text; (p = strstr(p, what)) != NULL; p += strlen(what)) n++;
  return n;
}

/* Sleeps until the monotonic clock is in a new second (the limit's window). */
static void next_second(void) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    struct timespec d = {0, 10 * 1000000};
    nanosleep(&d, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t);
  } while (t.tv_sec == t0.tv_sec);
}

int main(void) {
  tw_log_init("test_ucx_log", 0);
  int fd = mkstemp(g_path);
  if (fd < 0) {
    perror("mkstemp");
    return 1;
  }
  int saved = dup(STDERR_FILENO);
  dup2(fd, STDERR_FILENO);
  tw_ucx_log_install();
  tw_ucx_log_install(); /* once per process */
  ucs_log_component_config_t *comp = &ucs_global_opts.log_component;
  next_second();
  ucs_log_dispatch("src/ucp/core/ucp_worker.c", 42, "f", UCS_LOG_LEVEL_WARN, comp, "a warning %d",
                   7);
  ucs_log_dispatch("src/uct/tcp/tcp_ep.c", 9, "f", UCS_LOG_LEVEL_ERROR, comp,
                   "error during flush: %s", "Endpoint timeout");
  const char *t = caught();
  tw_test_case = "format";
  EXPECT(strstr(t, "WARN  test_ucx_log[") && strstr(t, " ucx: a warning 7 (ucp_worker.c:42)\n"),
         "a UCX warning as one twain line: %s", t);
  EXPECT(strstr(t, " ucx: error during flush: Endpoint timeout (tcp_ep.c:9)\n") &&
             !strstr(t, "ERROR "),
         "a UCX error as a WARN line: %s", t);
  EXPECT(count(t, "\n") == 2 && !strstr(t, "UCX  WARN") && !strstr(t, "UCX  ERROR"),
         "nothing in UCX's own format besides (%d lines): %s", count(t, "\n"), t);
  tw_test_case = "rate limit";
  next_second();
  for (int i = 0; i < 25; i++)
    ucs_log_dispatch("x.c", 1, "f", UCS_LOG_LEVEL_WARN, comp, "burst %d", i);
  t = caught();
  EXPECT(count(t, " ucx: burst ") == TW_UCX_LOG_BURST &&
             tw_ucx_log_suppressed() == 25 - TW_UCX_LOG_BURST,
         "25 in one second: %d lines, %llu held back", count(t, " ucx: burst "),
         (unsigned long long)tw_ucx_log_suppressed());
  next_second();
  ucs_log_dispatch("x.c", 2, "f", UCS_LOG_LEVEL_WARN, comp, "after");
  t = caught();
  char want[128];
  snprintf(want, sizeof want,
           " ucx: after (x.c:2; %d more of UCX's messages held back before this one)\n",
           25 - TW_UCX_LOG_BURST);
  EXPECT(strstr(t, want) != NULL, "the next second's first line names them: %s", strrchr(t, ']'));
  dup2(saved, STDERR_FILENO);
  close(fd);
  unlink(g_path);
  return tw_test_exit("test_ucx_log");
}
