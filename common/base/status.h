/* status.h: the one status type of twain, and how errors are reported.
 *
 * Every fallible function returns tw_status_t. TW_OK is 0, TW_INPROGRESS > 0,
 * errors < 0, grouped by who acts on them (STYLE.md "Errors"):
 *   request  (-1xx): bad input from a client; reply, keep serving;
 *   resource (-2xx): out of memory/blocks/slots; back off or queue;
 *   peer     (-3xx): a worker or connection failed; fail its requests;
 *   device   (-4xx): a sticky CUDA/NCCL error; drain and exit;
 *   internal (-5xx): a bug.
 * tw_err() is called once, where the error is found: it logs the message and
 * stores it as the thread's last error (tw_last_error()) for the reply. */
#ifndef TW_COMMON_STATUS_H
#define TW_COMMON_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Put before a function returning tw_status_t whose status must not be
 *  dropped: GCC then warns (an error with TWAIN_WERROR) at a call that
 *  ignores it. A status ignored on purpose goes through TW_IGNORE, with a
 *  comment saying why. */
#define TW_NODISCARD __attribute__((warn_unused_result))

/* TW_SLOW_BUILD: how many times slower this build runs than an optimised
 * one (1; a sanitizer build sets TWAIN_TEST_TIME_SCALE, CMakeLists.txt).
 * Timers that take a slow peer for a dead one (a worker's or a rank's
 * heartbeat loss, the prefill KV-write guard, the decode quarantine) are
 * stretched by it. */
#ifndef TW_SLOW_BUILD
#define TW_SLOW_BUILD 1
#endif

/** Evaluate a status-returning call whose failure needs no action here
 *  (already logged, or best effort on a path that is failing anyway). */
#define TW_IGNORE(expr)                        \
  do {                                         \
    tw_status_t tw_ignored_ = (expr);          \
    (void)tw_ignored_;                         \
  } while (0)

typedef enum {
  TW_OK = 0,
  TW_INPROGRESS = 1,
  /* request: the caller's input is wrong */
  TW_ERR_INVALID_ARGUMENT = -100, /* malformed or out-of-range input */
  TW_ERR_NOT_FOUND = -101,        /* a named file, tensor, request or field is absent */
  TW_ERR_FORMAT = -102,           /* a file or message does not follow its format */
  TW_ERR_UNSUPPORTED = -103,      /* valid, but not something this build/backend does */
  TW_ERR_OUT_OF_RANGE = -104,     /* a length or id beyond a limit (context, vocab) */
  TW_ERR_CANCELLED = -105,        /* the request was cancelled */
  TW_ERR_DEADLINE = -106,         /* the request's deadline passed */
  /* resource */
  TW_ERR_NO_MEMORY = -200,     /* host or device allocation failed */
  TW_ERR_EXHAUSTED = -201,     /* KV blocks, slots or queue capacity used up */
  TW_ERR_IO = -202,            /* a system call on a file failed */
  /* peer */
  TW_ERR_UNAVAILABLE = -300,   /* a worker or peer is gone or not answering */
  TW_ERR_TRANSPORT = -301,     /* ZeroMQ/UCX transport failure */
  /* device */
  TW_ERR_CUDA = -400,
  TW_ERR_NCCL = -401,
  /* internal */
  TW_ERR_INTERNAL = -500,
} tw_status_t;

/** Short stable name of a status ("ok", "invalid argument", ...). Never NULL. */
const char *tw_status_str(tw_status_t status);

/** Record an error: format the message, store it as this thread's last error,
 *  log it at level error with file:line, and return `status` unchanged so the
 *  caller can write `return tw_err(TW_ERR_FORMAT, "...")`. Use the macro. */
tw_status_t tw_err_at(tw_status_t status, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define tw_err(status, ...) tw_err_at((status), __FILE__, __LINE__, __VA_ARGS__)

/** Like tw_err, but only stores the message (no log line): for expected
 *  request errors that the caller reports itself. */
tw_status_t tw_err_quiet(tw_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/** The message of this thread's last tw_err/tw_err_quiet ("" if none). */
const char *tw_last_error(void);

/** Forget this thread's last error. */
void tw_clear_error(void);

/** Propagate a non-OK status (not TW_INPROGRESS) without logging again. */
#define TW_CHECK(expr)                          \
  do {                                          \
    tw_status_t tw_check_s_ = (expr);           \
    if (tw_check_s_ < 0) return tw_check_s_;    \
  } while (0)

/** Store a failing status in `st` and jump to `label` (cleanup in reverse). */
#define TW_CHECK_GOTO(expr, st, label)          \
  do {                                          \
    (st) = (expr);                              \
    if ((st) < 0) goto label;                   \
  } while (0)

/** Invariant check for bugs, never for input: logs and returns TW_ERR_INTERNAL. */
#define TW_ASSERT(cond)                                                        \
  do {                                                                         \
    if (!(cond)) return tw_err(TW_ERR_INTERNAL, "assertion failed: %s", #cond); \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
