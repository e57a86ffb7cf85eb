/* test_synthetic.c: tw_model_synthetic gives exactly the tensors (names'
 * views, dtypes, shapes, byte counts) that the real tiny checkpoints have,
 * for MXFP4 and bf16 experts; values are seeded (same seed, same bytes) and of
 * the advertised scale (weights ~N(0, 0.02), norms ~1, sinks ~N(0, 1), E8M0
 * scales 118..122, FP4 nibbles uniform, router rows N(0, 4/H)); a checkpoint
 * written by tw_model_write_synthetic (sharded, index) loads through the
 * real loader as exactly the synthetic model of its seed. */
#include "check.h"
#include "st_writer.h"

#include "common/model/model.h"
#include "common/model/model_impl.h"

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
  /* router: sd 2/sqrt(H), so logits of a unit-rms input have sd ~2 */
  moments(&m->layers[0].router_w, &mean, &sd);
  double want = 2.0 / sqrt((double)m->config.hidden);
  EXPECT_TRUE(fabs(mean) < 0.1 * want && fabs(sd - want) < 0.05 * want);
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

static int64_t count_files(const char *dir, const char *suffix) {
  int64_t n = 0;
  char path[4200];
  for (int k = 0; k < 64; k++)
    for (int of = k; of < 64; of++) {
      snprintf(path, sizeof path, "%s/model-%05d-of-%05d%s", dir, k, of, suffix);
      FILE *f = fopen(path, "r");
      if (f) {
        n++;
        fclose(f);
      }
    }
  return n;
}

/* Write c's checkpoint in shards of at most 1 MiB, load it, compare with
 * the synthetic model of the same seed, tensor by tensor. */
static void check_written(const char *fixture_dir, tw_model_config_t c) {
  char *dir = stw_tmpdir("twwrite");
  char src[4200], dst[4200];
  snprintf(src, sizeof src, "%s/config.json", fixture_dir);
  snprintf(dst, sizeof dst, "%s/config.json", dir);
  EXPECT_TRUE(stw_copy(src, dst) == 0);
  tw_model_write_info_t plan, info;
  EXPECT_OK(tw_model_write_synthetic(&c, dir, 5, 1 << 20, 3, true, &plan));
  EXPECT_EQ_I64(count_files(dir, ".safetensors"), 0); /* a plan writes nothing */
  EXPECT_OK(tw_model_write_synthetic(&c, dir, 5, 1 << 20, 3, false, &info));
  EXPECT_EQ_I64(info.total_bytes, plan.total_bytes);
  EXPECT_TRUE(info.n_shards > 2);
  EXPECT_EQ_I64(count_files(dir, ".safetensors"), info.n_shards);
  tw_model_t *disk = NULL, *syn = NULL;
  EXPECT_OK(tw_model_load(dir, &disk));
  EXPECT_OK(tw_model_synthetic(&c, 5, &syn));
  if (disk && syn) {
    compare_layout(syn, disk);
    EXPECT_EQ_I64(disk->weight_bytes, info.total_bytes);
    EXPECT_TRUE(memcmp(disk->embed.data, syn->embed.data, (size_t)syn->embed.n_bytes) == 0);
    EXPECT_TRUE(memcmp(disk->lm_head.data, syn->lm_head.data, (size_t)syn->lm_head.n_bytes) == 0);
    for (int l = 0; l < c.n_layers; l++) {
      const tw_layer_weights_t *x = &disk->layers[l], *y = &syn->layers[l];
#define SAME_BYTES(f) EXPECT_TRUE(memcmp(x->f.data, y->f.data, (size_t)y->f.n_bytes) == 0)
      SAME_BYTES(q_w); SAME_BYTES(sinks); SAME_BYTES(router_w); SAME_BYTES(router_b);
      SAME_BYTES(gate_up_blocks); SAME_BYTES(gate_up_scales); SAME_BYTES(down_blocks);
      SAME_BYTES(down_bias); SAME_BYTES(mlp_norm);
#undef SAME_BYTES
    }
  }
  tw_model_destroy(disk);
  tw_model_destroy(syn);
  /* an unwritable place fails with the path in the message */
  EXPECT_ERR(tw_model_write_synthetic(&c, "/proc/no/such/dir", 5, 1 << 20, 1, false, &info),
             TW_ERR_IO, "/proc/no/such/dir");
  tw_model_config_t bf = c;
  bf.mxfp4 = false;
  EXPECT_ERR(tw_model_write_synthetic(&bf, dir, 5, 1 << 20, 1, false, &info),
             TW_ERR_INVALID_ARGUMENT, "MXFP4");
  stw_rmtree(dir);
  free(dir);
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
  tw_model_t *fx = NULL;
  EXPECT_OK(tw_model_load(dir, &fx));
  if (fx) {
    tw_model_config_t c = fx->config;
    c.mxfp4 = true;
    tw_model_destroy(fx);
    check_written(dir, c);
  }
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
