/* check.h: the loader tests' assertions are those of tests/test_expect.h
 * (EXPECT_TRUE, EXPECT_EQ_I64, EXPECT_EQ_F64, EXPECT_OK, EXPECT_ERR);
 * CHECK_DONE(name) is the exit status (tw_test_exit). */
#ifndef TW_TESTS_LOADER_CHECK_H
#define TW_TESTS_LOADER_CHECK_H

#include "tests/test_expect.h"

#define CHECK_DONE(name) tw_test_exit(name)

#endif
