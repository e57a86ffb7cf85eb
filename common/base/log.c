/* log.c: the one-line logger (see log.h). */
#include "common/base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int tw_log_level_g = TW_LOG_INFO;
static char tw_log_proc[32] = "twain";
static int tw_log_rank = 0;
static char tw_log_subsys[256] = "";

static const char *const tw_level_names[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};

void tw_log_init(const char *process_name, int rank) {
  const char *lv = getenv("TWAIN_LOG");
  if (lv) {
    for (int i = 0; i <= TW_LOG_TRACE; i++)
      if (strcasecmp(lv, tw_level_names[i]) == 0) tw_log_level_g = i;
  }
  const char *ss = getenv("TWAIN_LOG_SUBSYS");
  if (ss) snprintf(tw_log_subsys, sizeof tw_log_subsys, ",%s,", ss);
  if (process_name) snprintf(tw_log_proc, sizeof tw_log_proc, "%s", process_name);
  tw_log_rank = rank;
}

int tw_log_enabled(tw_log_level_t level, const char *subsys) {
  if (level <= TW_LOG_INFO || !tw_log_subsys[0] || !subsys) return 1;
  char key[64];
  snprintf(key, sizeof key, ",%s,", subsys);
  return strstr(tw_log_subsys, key) != NULL;
}

void tw_log_write(tw_log_level_t level, const char *subsys, const char *fmt, ...) {
  char line[2048];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s[%d] r%d %s: ",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                   ts.tv_nsec / 1000000, tw_level_names[level], tw_log_proc, (int)getpid(),
                   tw_log_rank, subsys ? subsys : "-");
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && n < (int)sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  if (n >= (int)sizeof line - 1) n = (int)sizeof line - 2;
  /* one line per event: fold embedded newlines */
  for (int i = 0; i < n; i++)
    if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
  line[n++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}
