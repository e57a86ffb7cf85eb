/* test_synthetic.c: tw_model_synthetic gives exactly the tensors (names'
 * views, dtypes, shapes, byte counts) that the real tiny checkpoints have,
 * for MXFP4 and bf16 experts; values are seeded (same seed, same bytes) and of
 * the advertised scale (weights ~N(0, 0.02), norms ~1, sinks ~N(0, 1), E8M0
 * scales 118..122, FP4 nibbles uniform). */
#include "check.h"

#include "common/model.h"
#include "common/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void same_layout(const tw_tensor_t *a, const tw_tensor_t *b, const char *what) {
  if ((a->data == NULL) != (b->data == NULL) || a->dtype != b->dtype || a->ndim != b->ndim ||
      a->n_bytes != b->n_bytes || memcmp(a->shape, b->shape, sizeof a->shape) != 0) {
    fprintf(stderr, "FAILED: %s: synthetic layout differs from the checkpoint\n", what);
    fails++;
  }
}

static void compare_layout(const tw_model_t *syn, const tw_model_t *real) {
  same_layout(&syn->embed, &real->embed, "embed");
  same_layout(&syn->final_norm, &real->final_norm, "final_norm");
  same_layout(&syn->lm_head, &real->lm_head, "lm_head");
  EXPECT_EQ_I64(syn->weight_bytes, real->weight_bytes);
  EXPECT_EQ_I64(((const tw_model_impl_t *)syn->impl)->n_tensors,
                ((const tw_model_impl_t *)real->impl)->n_tensors);
  for (int l = 0; l < real->config.n_layers; l++) {
    const tw_layer_weights_t *x = &syn->layers[l], *y = &real->layers[l];
    EXPECT_EQ_I64(x->experts_format, y->experts_format);
#define SAME(f) same_layout(&x->f, &y->f, #f)
    SAME(attn_norm); SAME(q_w); SAME(q_b); SAME(k_w); SAME(k_b); SAME(v_w); SAME(v_b);
    SAME(o_w); SAME(o_b); SAME(sinks); SAME(mlp_norm); SAME(router_w); SAME(router_b);
    SAME(gate_up); SAME(gate_up_blocks); SAME(gate_up_scales); SAME(gate_up_bias);
    SAME(down); SAME(down_blocks); SAME(down_scales); SAME(down_bias);
#undef SAME
  }
}

static void moments(const tw_tensor_t *t, double *mean_p, double *sd_p) {
  const uint16_t *h = t->data;
  int64_t n = t->n_bytes / 2;
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < n; i++) {
    double v = tw_bf16_to_f32(h[i]);
    s += v;
    s2 += v * v;
  }
  *mean_p = s / (double)n;
  *sd_p = sqrt(s2 / (double)n - *mean_p * *mean_p);
}

static void check_values(const tw_model_t *m) {
  double mean, sd;
  moments(&m->embed, &mean, &sd);
  EXPECT_TRUE(fabs(mean) < 0.001 && fabs(sd - 0.02) < 0.001);
  moments(&m->layers[0].q_w, &mean, &sd);
  EXPECT_TRUE(fabs(mean) < 0.001 && fabs(sd - 0.02) < 0.001);
  moments(&m->layers[1].attn_norm, &mean, &sd);
  EXPECT_TRUE(fabs(mean - 1.0) < 0.01 && sd < 0.05);
  moments(&m->final_norm, &mean, &sd);
  EXPECT_TRUE(fabs(mean - 1.0) < 0.01);
  /* 4 sinks per layer are too few for moments: pool them */
  double s2 = 0;
  int n = 0;
  for (int l = 0; l < m->config.n_layers; l++) {
    const uint16_t *h = m->layers[l].sinks.data;
    for (int i = 0; i < m->config.n_heads; i++, n++) s2 += pow(tw_bf16_to_f32(h[i]), 2);
  }
  EXPECT_TRUE(s2 / n > 0.1 && s2 / n < 5.0);
  if (m->layers[0].experts_format == TW_EXPERTS_MXFP4) {
    const tw_tensor_t *sc = &m->layers[2].down_scales, *bl = &m->layers[2].gate_up_blocks;
    const uint8_t *s = sc->data, *b = bl->data;
    int64_t count[256] = {0};
    for (int64_t i = 0; i < sc->n_bytes; i++) count[s[i]]++;
    for (int v = 0; v < 256; v++)
      if (v < 118 || v > 122) EXPECT_EQ_I64(count[v], 0);
    for (int v = 118; v <= 122; v++) EXPECT_TRUE(count[v] > sc->n_bytes / 5 * 8 / 10);
    int64_t nib[16] = {0};
    for (int64_t i = 0; i < bl->n_bytes; i++) {
      nib[b[i] & 15]++;
      nib[b[i] >> 4]++;
    }
    for (int v = 0; v < 16; v++) EXPECT_TRUE(fabs((double)nib[v] / (2.0 * bl->n_bytes) - 1.0 / 16) < 0.005);
  }
}

static void check_seed(const tw_model_config_t *c) {
  tw_model_t *a = NULL, *b = NULL, *d = NULL;
  EXPECT_OK(tw_model_synthetic(c, 42, &a));
  EXPECT_OK(tw_model_synthetic(c, 42, &b));
  EXPECT_OK(tw_model_synthetic(c, 43, &d));
  if (a && b && d) {
    EXPECT_TRUE(memcmp(a->embed.data, b->embed.data, (size_t)a->embed.n_bytes) == 0);
    EXPECT_TRUE(memcmp(a->layers[3].down_bias.data, b->layers[3].down_bias.data,
                  (size_t)a->layers[3].down_bias.n_bytes) == 0);
    EXPECT_TRUE(memcmp(a->embed.data, d->embed.data, (size_t)a->embed.n_bytes) != 0);
    EXPECT_TRUE(memcmp(a->lm_head.data, d->lm_head.data, (size_t)a->lm_head.n_bytes) != 0);
    /* different tensors get different streams */
    EXPECT_TRUE(memcmp(a->layers[0].q_b.data, a->layers[1].q_b.data,
                  (size_t)a->layers[0].q_b.n_bytes) != 0);
    check_values(a);
  }
  tw_model_destroy(a);
  tw_model_destroy(b);
  tw_model_destroy(d);
}

static void check_against(const char *dir) {
  tw_model_t *real = NULL, *syn = NULL;
  EXPECT_OK(tw_model_load(dir, &real));
  if (!real) return;
  tw_model_config_t c = real->config;
  c.mxfp4 = real->layers[0].experts_format == TW_EXPERTS_MXFP4;
  EXPECT_OK(tw_model_synthetic(&c, 7, &syn));
  if (syn) compare_layout(syn, real);
  check_seed(&c);
  tw_model_destroy(syn);
  tw_model_destroy(real);
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  const char *shared = getenv("TW_SHARED_DIR");
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/tiny-gptoss-wordnet-mxfp4", fixtures ? fixtures : "tests/fixtures");
  check_against(dir);
  snprintf(dir, sizeof dir, "%s/models/tiny-gptoss-wordnet", shared ? shared : "../shared");
  char probe[4200];
  snprintf(probe, sizeof probe, "%s/config.json", dir);
  FILE *f = fopen(probe, "r");
  if (f) {
    fclose(f);
    check_against(dir);
  }
  tw_model_config_t bad;
  memset(&bad, 0, sizeof bad);
  tw_model_t *m = NULL;
  EXPECT_ERR(tw_model_synthetic(&bad, 1, &m), TW_ERR_INVALID_ARGUMENT, "non-positive");
  EXPECT_TRUE(m == NULL);
  return CHECK_DONE("test_synthetic");
}
