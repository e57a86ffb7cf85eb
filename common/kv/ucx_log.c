/* ucx_log.c: UCX's log messages as twain log lines (ucx_log.h). */
#include "common/kv/ucx_log.h"

#include "common/base/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <ucs/debug/log_def.h>

static pthread_mutex_t tw_ucx_log_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t tw_ucx_log_second; /* the second being counted (CLOCK_MONOTONIC) */
static int tw_ucx_log_lines;      /* lines written in it */
static uint64_t tw_ucx_log_held;  /* held back since the last line written */
static uint64_t tw_ucx_log_held_all;

static ucs_log_func_rc_t tw_ucx_log(const char *file, unsigned line, const char *function,
                                    ucs_log_level_t level, const ucs_log_component_config_t *comp,
                                    const char *fmt, va_list ap) {
  (void)function;
  (void)comp;
  if (level > UCS_LOG_LEVEL_WARN && level != UCS_LOG_LEVEL_PRINT)
    return UCS_LOG_FUNC_RC_CONTINUE; /* diagnostics asked for with UCX_LOG_LEVEL: UCX's format */
  char msg[512];
  va_list aq;
  va_copy(aq, ap);
  vsnprintf(msg, sizeof msg, fmt, aq);
  va_end(aq);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == ' ')) msg[--n] = '\0';
  const char *base = file ? strrchr(file, '/') : NULL;
  base = base ? base + 1 : file ? file : "?";
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  pthread_mutex_lock(&tw_ucx_log_mu);
  if (ts.tv_sec != tw_ucx_log_second) {
    tw_ucx_log_second = ts.tv_sec;
    tw_ucx_log_lines = 0;
  }
  bool out = level == UCS_LOG_LEVEL_FATAL || tw_ucx_log_lines < TW_UCX_LOG_BURST;
  uint64_t held = 0;
  if (out) {
    tw_ucx_log_lines++;
    held = tw_ucx_log_held;
    tw_ucx_log_held = 0;
  } else {
    tw_ucx_log_held++;
    tw_ucx_log_held_all++;
  }
  pthread_mutex_unlock(&tw_ucx_log_mu);
  if (!out) return UCS_LOG_FUNC_RC_STOP;
  tw_log_level_t lv = level == UCS_LOG_LEVEL_FATAL   ? TW_LOG_ERROR
                      : level == UCS_LOG_LEVEL_PRINT ? TW_LOG_INFO
                                                     : TW_LOG_WARN;
  if (held)
    TW_LOG(lv, "ucx", "%s (%s:%u; %llu more of UCX's messages held back before this one)", msg,
           base, line, (unsigned long long)held);
  else
    TW_LOG(lv, "ucx", "%s (%s:%u)", msg, base, line);
  /* FATAL: UCX's own handler too (it aborts after) */
  return level == UCS_LOG_LEVEL_FATAL ? UCS_LOG_FUNC_RC_CONTINUE : UCS_LOG_FUNC_RC_STOP;
}

static void tw_ucx_log_push(void) { ucs_log_push_handler(tw_ucx_log); }

void tw_ucx_log_install(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, tw_ucx_log_push);
}

uint64_t tw_ucx_log_suppressed(void) {
  pthread_mutex_lock(&tw_ucx_log_mu);
  uint64_t n = tw_ucx_log_held_all;
  pthread_mutex_unlock(&tw_ucx_log_mu);
  return n;
}
