/* attn_test_util.h: small helpers of the attention / norm / RoPE kernel tests
 * (header-only, static functions): seeded RNG, bf16 conversion, relative L2
 * accumulation, GPU presence, CUDA checks that fail the test. */
#ifndef TW_TESTS_KERNELS_ATTN_TEST_UTIL_H
#define TW_TESTS_KERNELS_ATTN_TEST_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TT_SKIP 77

/* Fail the test (return 1 from the enclosing int function) on a CUDA error. */
#define TT_CUDA(call)                                                              \
  do {                                                                             \
    cudaError_t tt_e_ = (call);                                                    \
    if (tt_e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call,           \
              cudaGetErrorString(tt_e_));                                          \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

static uint64_t tt_rng_state;

static inline uint64_t tt_rng_u64(void) {
  uint64_t z = (tt_rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The default seed: every run draws the same inputs, so a failure replays
 * and a pass means the same thing each time. TW_TEST_SEED=<n> picks another,
 * TW_TEST_SEED=random one from time and pid (printed for replay). */
#define TT_DEFAULT_SEED 20250805ull

static inline void tt_seed(void) {
  const char *e = getenv("TW_TEST_SEED");
  if (e && !strcmp(e, "random"))
    tt_rng_state = ((uint64_t)time(NULL) * 1000003u) ^ (uint64_t)getpid();
  else
    tt_rng_state = e && *e ? strtoull(e, NULL, 10) : TT_DEFAULT_SEED;
  printf("seed %llu (TW_TEST_SEED to replay)\n", (unsigned long long)tt_rng_state);
}

/* Uniform in [-a, a). */
static inline float tt_uniform(float a) {
  return a * (2.0f * (float)((tt_rng_u64() >> 40) * (1.0 / 16777216.0)) - 1.0f);
}
static inline int tt_randint(int lo, int hi) { /* [lo, hi] */
  return lo + (int)(tt_rng_u64() % (uint64_t)(hi - lo + 1));
}
static inline float tt_normal(float sd) {
  double u1 = ((tt_rng_u64() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
  double u2 = (tt_rng_u64() >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sd * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

static inline uint16_t tt_f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float tt_bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* A uniform random bf16 in [-a, a), never exactly zero. */
static inline uint16_t tt_rand_bf16(float a) {
  for (;;) {
    uint16_t b = tt_f2bf(tt_uniform(a));
    if ((b & 0x7fff) != 0) return b;
  }
}

#define TT_BF16_NAN 0x7fc0

/* Relative L2 accumulator; any non-finite output counts as a failure. */
typedef struct {
  double err2, ref2;
  long n, n_bad;
} tt_l2_t;

static inline void tt_l2_add(tt_l2_t *a, double out, double ref) {
  a->n++;
  if (!isfinite(out)) {
    a->n_bad++;
    return;
  }
  a->err2 += (out - ref) * (out - ref);
  a->ref2 += ref * ref;
}
static inline double tt_l2_rel(const tt_l2_t *a) { return a->ref2 > 0 ? sqrt(a->err2 / a->ref2) : 0; }

/* Print a case line and return 0 if rel <= tol and nothing non-finite, else 1. */
static inline int tt_l2_report(const char *name, const tt_l2_t *a, double tol) {
  const double rel = tt_l2_rel(a);
  const int ok = a->n_bad == 0 && rel <= tol && a->n > 0;
  printf("%s %s: rel_l2 %.3e (tol %.0e) over %ld values, %ld non-finite\n", ok ? "ok  " : "FAIL",
         name, rel, tol, a->n, a->n_bad);
  return ok ? 0 : 1;
}

/* How many of n floats differ from want bit for bit (NaN poison never equals
 * a written value). */
static inline long tt_count_bits_differ(const float *got, const float *want, size_t n) {
  long d = 0;
  for (size_t i = 0; i < n; i++) d += memcmp(&got[i], &want[i], sizeof(float)) != 0;
  return d;
}

static inline int tt_gpu_available(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n > 0;
}

#endif
