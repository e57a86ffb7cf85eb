/* status.c: status names and the thread-local last error. */
#include "common/base/status.h"

#include "common/base/log.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char tw_last_error_buf[1024];

const char *tw_status_str(tw_status_t s) {
  switch (s) {
    case TW_OK: return "ok";
    case TW_INPROGRESS: return "in progress";
    case TW_ERR_INVALID_ARGUMENT: return "invalid argument";
    case TW_ERR_NOT_FOUND: return "not found";
    case TW_ERR_FORMAT: return "bad format";
    case TW_ERR_UNSUPPORTED: return "unsupported";
    case TW_ERR_OUT_OF_RANGE: return "out of range";
    case TW_ERR_CANCELLED: return "cancelled";
    case TW_ERR_DEADLINE: return "deadline exceeded";
    case TW_ERR_NO_MEMORY: return "out of memory";
    case TW_ERR_EXHAUSTED: return "resource exhausted";
    case TW_ERR_IO: return "i/o error";
    case TW_ERR_UNAVAILABLE: return "unavailable";
    case TW_ERR_TRANSPORT: return "transport error";
    case TW_ERR_CUDA: return "cuda error";
    case TW_ERR_NCCL: return "nccl error";
    case TW_ERR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

static void tw_store(const char *fmt, va_list ap) {
  vsnprintf(tw_last_error_buf, sizeof tw_last_error_buf, fmt, ap);
}

tw_status_t tw_err_at(tw_status_t status, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tw_store(fmt, ap);
  va_end(ap);
  const char *base = strrchr(file, '/');
  TW_LOG(TW_LOG_ERROR, "err", "%s (%s, %s:%d)", tw_last_error_buf, tw_status_str(status),
         base ? base + 1 : file, line);
  return status;
}

tw_status_t tw_err_quiet(tw_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tw_store(fmt, ap);
  va_end(ap);
  return status;
}

const char *tw_last_error(void) { return tw_last_error_buf; }
void tw_clear_error(void) { tw_last_error_buf[0] = '\0'; }
