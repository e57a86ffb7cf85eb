/* test_hook.h: the fault-injection hooks of test builds (TWAIN_TEST_HOOKS,
 * CMakeLists.txt; compiled where TW_TEST_HOOKS is defined). A hook fires on
 * the N-th time its site is reached, N read once from an environment
 * variable (0, unset or negative: never): TWAIN_TEST_BAD_PLAN
 * (common/engine/dist_engine.c), TWAIN_TEST_DEVICE_ERROR (below:
 * prefill/worker_handoff.c, decode/decode_worker.c),
 * TWAIN_TEST_KV_DEVICE_ERROR (below: decode/decode_worker.c); and one that
 * slows every decode step, TWAIN_TEST_STEP_DELAY_US (below). */
#ifndef TW_COMMON_TEST_HOOK_H
#define TW_COMMON_TEST_HOOK_H

#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

/** One hook site's state: a static `tw_test_hook_t h = TW_TEST_HOOK_INIT`. */
typedef struct {
  long at;   /* the firing call (-1: not read yet, 0: never) */
  long seen; /* calls so far */
} tw_test_hook_t;
#define TW_TEST_HOOK_INIT {-1, 0}

/** The value of the environment variable `env` as a number in [0, max]:
 *  0 where it is unset, negative or above max. */
static inline long tw_test_hook_env(const char *env, long max) {
  const char *v = getenv(env);
  const long n = v ? strtol(v, NULL, 10) : 0;
  return n < 0 || n > max ? 0 : n;
}

/** Counts one call of the site `h` and returns true on the N-th, N from the
 *  environment variable `env` (read on the first call). */
static inline bool tw_test_hook_nth(tw_test_hook_t *h, const char *env) {
  if (h->at < 0) h->at = tw_test_hook_env(env, LONG_MAX);
  return h->at > 0 && ++h->seen == h->at;
}

/** TWAIN_TEST_DEVICE_ERROR=N: this worker's N-th engine call (a prefill
 *  batch, a decode step) fails as a sticky device error would
 *  (tests/service/test_service_device_error.py); false without the hooks. */
static inline bool tw_test_device_error(void) {
#ifdef TW_TEST_HOOKS
  static tw_test_hook_t h = TW_TEST_HOOK_INIT; /* one site a process: its worker's engine */
  return tw_test_hook_nth(&h, "TWAIN_TEST_DEVICE_ERROR");
#else
  return false;
#endif
}

/** TWAIN_TEST_KV_DEVICE_ERROR=N: this decode worker's N-th commit of a
 *  handed-off KV cache (the step that makes its blocks the sequence's)
 *  fails as a sticky device error would; false without the hooks. */
static inline bool tw_test_kv_device_error(void) {
#ifdef TW_TEST_HOOKS
  static tw_test_hook_t h = TW_TEST_HOOK_INIT;
  return tw_test_hook_nth(&h, "TWAIN_TEST_KV_DEVICE_ERROR");
#else
  return false;
#endif
}

/** TWAIN_TEST_STEP_DELAY_US=N (0..1,000,000, read once; unset, 0 or out of
 *  range: none): this decode worker sleeps N microseconds after each step, so
 *  that a test's stream outlasts a timeout on any machine
 *  (tests/service/test_service_ops.py); nothing without the hooks. */
static inline void tw_test_step_delay(void) {
#ifdef TW_TEST_HOOKS
  static long us = -1; /* one site a process: its decode loop's thread */
  if (us < 0) us = tw_test_hook_env("TWAIN_TEST_STEP_DELAY_US", 1000000);
  if (us > 0) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
#endif
}

#endif
