/* test_util.h: tiny helpers shared by the engine tests: a seeded xorshift
 * generator, relative L2 error and the tiny fixture model (assertions:
 * tests/test_expect.h). */
#ifndef TW_TESTS_ENGINE_TEST_UTIL_H
#define TW_TESTS_ENGINE_TEST_UTIL_H

#include "common/base/status.h"
#include "common/model/model.h"
#include "tests/test_expect.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

/* Load the tiny MXFP4 fixture checkpoint ($TW_FIXTURES_DIR, default
 * tests/fixtures, /tiny-gptoss-wordnet-mxfp4) into *m. 0, or 1 with the reason
 * on stderr. */
static inline int tw_test_load_tiny(tw_model_t **m) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  if (!fixtures) fixtures = "tests/fixtures";
  char dir[512];
  snprintf(dir, sizeof(dir), "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
  *m = NULL;
  if (tw_model_load(dir, m) != TW_OK) {
    fprintf(stderr, "cannot load %s: %s\n", dir, tw_last_error());
    return 1;
  }
  return 0;
}
#endif
