/* test_expect.h: the soft assertion of the C tests that count failures and
 * report them all before exiting (one translation unit per test program). */
#ifndef TW_TESTS_TEST_EXPECT_H
#define TW_TESTS_TEST_EXPECT_H

#include <stdio.h>

/** Failed EXPECTs so far; the test's main returns non-zero when > 0. */
static int fails;

/** Counts a failure and prints "FAIL file:line: <printf message>" when c is false. */
#define EXPECT(c, ...)                                     \
  do {                                                     \
    if (!(c)) {                                            \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      fails++;                                             \
    }                                                      \
  } while (0)

#endif
