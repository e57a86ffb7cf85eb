/* test_util.h: tiny helpers shared by the engine tests: a failure counter
 * with file:line messages, a seeded xorshift generator, relative L2 error. */
#ifndef TW_TESTS_ENGINE_TEST_UTIL_H
#define TW_TESTS_ENGINE_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

static int tw_test_failures = 0;

#define TW_EXPECT(cond, ...)                                          \
  do {                                                                \
    if (!(cond)) {                                                    \
      tw_test_failures++;                                             \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
    }                                                                 \
  } while (0)

/* xorshift64*: deterministic test inputs. */
static inline uint64_t tw_test_rand_u64(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}

/* Uniform in [lo, hi). */
static inline double tw_test_uniform(uint64_t *s, double lo, double hi) {
  return lo + (hi - lo) * (double)(tw_test_rand_u64(s) >> 11) * 0x1.0p-53;
}

/* ||a - ref|| / ||ref|| in double; a NaN anywhere gives +inf. */
static inline double tw_test_rel_l2_f(const float *a, const double *ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) {
    if (isnan(a[i])) return INFINITY;
    double d = (double)a[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline double tw_test_rel_l2_ff(const float *a, const float *ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) {
    if (isnan(a[i])) return INFINITY;
    double d = (double)a[i] - (double)ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline int tw_test_result(const char *name) {
  if (tw_test_failures) {
    fprintf(stderr, "%s: %d failure(s)\n", name, tw_test_failures);
    return 1;
  }
  printf("%s: all checks passed\n", name);
  return 0;
}

#endif
