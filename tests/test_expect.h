/* test_expect.h: the one assertion header of the C tests. Every EXPECT counts
 * a failure and reports it with file:line, so a test reports every failed
 * check before it exits; tw_test_exit() turns the count into the exit status.
 * A part of a test skipped for a missing dependency is reported with
 * tw_test_skip_part(): the test then exits 77 (ctest: skipped) instead of 0,
 * and fails when TWAIN_REQUIRE_ALL=1 (CI sets it where every dependency is
 * installed), so a skipped part is never reported as passed.
 * Include once per test program (its counters are static). */
#ifndef TW_TESTS_TEST_EXPECT_H
#define TW_TESTS_TEST_EXPECT_H

#include "common/base/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_TEST_SKIP 77

/** Failed checks so far. */
static int fails;
/** Parts skipped for a missing dependency so far. */
static int tw_test_skipped;
/** What the test is checking now, printed with each failure (NULL: nothing). */
static const char *tw_test_case;

static inline void tw_test_fail_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline void tw_test_fail_at(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "FAIL %s:%d: ", file, line);
  if (tw_test_case) fprintf(stderr, "[%s] ", tw_test_case);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fails++;
}

/** Counts a failure and prints "FAIL file:line: <printf message>" when c is false. */
#define EXPECT(c, ...)                                           \
  do {                                                           \
    if (!(c)) tw_test_fail_at(__FILE__, __LINE__, __VA_ARGS__);  \
  } while (0)

/** EXPECT with the condition's text as the message. */
#define EXPECT_TRUE(c) EXPECT(c, "%s", #c)

/** Two integers are equal (both printed on failure). */
#define EXPECT_EQ_I64(a, b)                                                         \
  do {                                                                              \
    long long a_ = (long long)(a), b_ = (long long)(b);                             \
    EXPECT(a_ == b_, "%s == %s (%lld vs %lld)", #a, #b, a_, b_);                    \
  } while (0)

/** Two doubles are exactly equal (both printed on failure). */
#define EXPECT_EQ_F64(a, b)                                                         \
  do {                                                                              \
    double a_ = (double)(a), b_ = (double)(b);                                      \
    EXPECT(a_ == b_, "%s == %s (%.9g vs %.9g)", #a, #b, a_, b_);                    \
  } while (0)

/** `expr` returns TW_OK. */
#define EXPECT_OK(expr)                                                             \
  do {                                                                              \
    tw_status_t got_ = (expr);                                                      \
    EXPECT(got_ == TW_OK, "%s -> %s: %s", #expr, tw_status_str(got_), tw_last_error()); \
  } while (0)

/** `expr` returns status `want` and tw_last_error() contains `substr`. */
#define EXPECT_ERR(expr, want, substr)                                              \
  do {                                                                              \
    tw_clear_error();                                                               \
    tw_status_t got_ = (expr);                                                      \
    EXPECT(got_ == (want) && strstr(tw_last_error(), (substr)),                     \
           "%s\n  want %s with \"%s\"\n  got  %s: \"%s\"", #expr, tw_status_str(want), \
           (substr), tw_status_str(got_), tw_last_error());                         \
  } while (0)

/** Report a part of the test skipped because a dependency is missing. */
static inline void tw_test_skip_part(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void tw_test_skip_part(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("SKIP (part): ");
  vprintf(fmt, ap);
  putchar('\n');
  va_end(ap);
  tw_test_skipped++;
}

/** The exit status: 1 after a failure; after a skipped part 77, or 1 under
 *  TWAIN_REQUIRE_ALL=1; else 0. Prints one summary line naming the test. */
static inline int tw_test_exit(const char *name) {
  const char *req = getenv("TWAIN_REQUIRE_ALL");
  int require_all = req && strcmp(req, "") != 0 && strcmp(req, "0") != 0;
  if (fails) {
    fprintf(stderr, "%s: %d failure(s)\n", name, fails);
    return 1;
  }
  if (tw_test_skipped) {
    printf("%s: checks passed, %d part(s) skipped%s\n", name, tw_test_skipped,
           require_all ? ": a failure under TWAIN_REQUIRE_ALL=1" : "");
    return require_all ? 1 : TW_TEST_SKIP;
  }
  printf("%s: all checks passed\n", name);
  return 0;
}

#endif
