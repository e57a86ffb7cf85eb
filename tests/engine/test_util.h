/* test_util.h: tiny helpers shared by the engine tests: a seeded xorshift
 * generator, relative L2 error, the tiny fixture model and where a position's
 * K/V sits in a KV pool (assertions: tests/test_expect.h). */
#ifndef TW_TESTS_ENGINE_TEST_UTIL_H
#define TW_TESTS_ENGINE_TEST_UTIL_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/kv/kv_ring.h"
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

/* Byte offset from kv->base of the head_dim elements of K (kvi 0) or V (kvi 1)
 * of local kv head g at position pos of the sequence with block table `table`,
 * in layer `layer`: table entry pos / block_size (on a ring layer, entry
 * j % ring_blocks: kv_ring.h), slot pos % block_size of a block laid out
 * [K|V][kv head][slot][head_dim] (engine.h), elements of tw_dtype_size(kv->dtype)
 * bytes (f32 on the cpu, bf16 on cuda; not the fp8 layout). */
static inline int64_t tw_test_kv_offset(const tw_kv_layout_t *kv, int32_t layer,
                                        const int32_t *table, int32_t pos, int kvi, int32_t g) {
  int32_t ring = tw_kv_layer_ring(kv->ring_layers, kv->ring_blocks, layer);
  int32_t b = table[tw_kv_ring_entry(pos / kv->block_size, ring)];
  int64_t elem = ((int64_t)kvi * kv->n_kv_heads_local + g) * kv->block_size + pos % kv->block_size;
  return tw_kv_layer_offset(kv, layer) + (int64_t)b * kv->block_bytes +
         elem * kv->head_dim * (int64_t)tw_dtype_size(kv->dtype);
}

/* The first position of a sequence of len tokens whose K/V layer `layer`
 * still holds: 0, or on a ring layer the first position of the last
 * ring_blocks blocks (the ring overwrote the earlier ones). */
static inline int32_t tw_test_kv_live_from(const tw_kv_layout_t *kv, int32_t layer, int32_t len) {
  int32_t ring = tw_kv_layer_ring(kv->ring_layers, kv->ring_blocks, layer);
  if (ring <= 0 || len <= 0) return 0;
  int32_t live = ((len - 1) / kv->block_size - ring + 1) * kv->block_size;
  return live > 0 ? live : 0;
}
#endif
