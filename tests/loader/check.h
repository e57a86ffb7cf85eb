/* check.h: plain-C assertion helpers for the loader tests. Each EXPECT logs
 * file:line and the values on failure and counts it; CHECK_DONE() returns the
 * exit status (0 when nothing failed). */
#ifndef TW_TESTS_LOADER_CHECK_H
#define TW_TESTS_LOADER_CHECK_H

#include "common/status.h"

#include <stdio.h>
#include <string.h>

static int check_failures_g;

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond);      \
      check_failures_g++;                                                     \
    }                                                                         \
  } while (0)

#define EXPECT_EQ_I64(a, b)                                                   \
  do {                                                                        \
    long long a_ = (long long)(a), b_ = (long long)(b);                       \
    if (a_ != b_) {                                                           \
      fprintf(stderr, "%s:%d: FAILED: %s == %s (%lld vs %lld)\n", __FILE__,   \
              __LINE__, #a, #b, a_, b_);                                      \
      check_failures_g++;                                                     \
    }                                                                         \
  } while (0)

#define EXPECT_EQ_F64(a, b)                                                   \
  do {                                                                        \
    double a_ = (double)(a), b_ = (double)(b);                                \
    if (!(a_ == b_)) {                                                        \
      fprintf(stderr, "%s:%d: FAILED: %s == %s (%.9g vs %.9g)\n", __FILE__,   \
              __LINE__, #a, #b, a_, b_);                                      \
      check_failures_g++;                                                     \
    }                                                                         \
  } while (0)

/* `expr` returns status `want` and tw_last_error() contains `substr`. */
#define EXPECT_ERR(expr, want, substr)                                        \
  do {                                                                        \
    tw_clear_error();                                                         \
    tw_status_t got_ = (expr);                                                \
    if (got_ != (want) || !strstr(tw_last_error(), (substr))) {               \
      fprintf(stderr,                                                         \
              "%s:%d: FAILED: %s\n  want %s with \"%s\"\n  got  %s: \"%s\"\n", \
              __FILE__, __LINE__, #expr, tw_status_str(want), (substr),       \
              tw_status_str(got_), tw_last_error());                          \
      check_failures_g++;                                                     \
    }                                                                         \
  } while (0)

#define EXPECT_OK(expr)                                                       \
  do {                                                                        \
    tw_status_t got_ = (expr);                                                \
    if (got_ != TW_OK) {                                                      \
      fprintf(stderr, "%s:%d: FAILED: %s -> %s: %s\n", __FILE__, __LINE__,    \
              #expr, tw_status_str(got_), tw_last_error());                   \
      check_failures_g++;                                                     \
    }                                                                         \
  } while (0)

#define CHECK_DONE(name)                                                      \
  (fprintf(stderr, "%s: %s (%d failure%s)\n", (name),                         \
           check_failures_g ? "FAIL" : "ok", check_failures_g,                \
           check_failures_g == 1 ? "" : "s"),                                 \
   check_failures_g ? 1 : 0)

#endif
