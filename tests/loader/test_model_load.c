/* test_model_load.c: load the tiny MXFP4 checkpoint (tests/fixtures) and the
 * tiny bf16 checkpoint (../shared/models) and check tensor counts, dtypes,
 * shapes and raw values. The expected element bits were read from the files
 * with Python's json + struct (an independent header parser), not with ours. */
#include "check.h"

#include "common/model/model.h"
#include "common/model/model_impl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint16_t bf16_at(const tw_tensor_t *t, int64_t i) {
  uint16_t v;
  memcpy(&v, (const uint8_t *)t->data + 2 * i, 2);
  return v;
}

static void expect_shape(const tw_tensor_t *t, tw_dtype_t dt, int ndim, int64_t a, int64_t b,
                         int64_t c, int64_t d) {
  EXPECT_TRUE(t->data != NULL);
  EXPECT_EQ_I64(t->dtype, dt);
  EXPECT_EQ_I64(t->ndim, ndim);
  const int64_t want[4] = {a, b, c, d};
  int64_t n = (int64_t)tw_dtype_size(dt);
  for (int i = 0; i < ndim; i++) {
    EXPECT_EQ_I64(t->shape[i], want[i]);
    n *= want[i];
  }
  EXPECT_EQ_I64(t->n_bytes, n);
}

static void test_mxfp4(const char *fixtures) {
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
  tw_model_t *m = NULL;
  EXPECT_OK(tw_model_load(dir, &m));
  if (!m) return;
  const tw_model_impl_t *impl = m->impl;
  EXPECT_EQ_I64(impl->n_tensors, 79); /* README: 79 tensors */
  EXPECT_EQ_I64(impl->n_files, 1);
  EXPECT_EQ_I64(m->config.n_layers, 4);
  EXPECT_TRUE(m->config.mxfp4);
  /* 16,632,736 file bytes minus 8 + 8504 header bytes */
  EXPECT_EQ_I64(m->weight_bytes, 16632736 - 8 - 8504);
  expect_shape(&m->embed, TW_DTYPE_BF16, 2, 8064, 256, 0, 0);
  expect_shape(&m->lm_head, TW_DTYPE_BF16, 2, 8064, 256, 0, 0);
  expect_shape(&m->final_norm, TW_DTYPE_BF16, 1, 256, 0, 0, 0);
  for (int l = 0; l < 4; l++) {
    const tw_layer_weights_t *w = &m->layers[l];
    EXPECT_EQ_I64(w->experts_format, TW_EXPERTS_MXFP4);
    expect_shape(&w->q_w, TW_DTYPE_BF16, 2, 256, 256, 0, 0);
    expect_shape(&w->k_w, TW_DTYPE_BF16, 2, 128, 256, 0, 0);
    expect_shape(&w->v_b, TW_DTYPE_BF16, 1, 128, 0, 0, 0);
    expect_shape(&w->o_w, TW_DTYPE_BF16, 2, 256, 256, 0, 0);
    expect_shape(&w->sinks, TW_DTYPE_BF16, 1, 4, 0, 0, 0);
    expect_shape(&w->router_w, TW_DTYPE_BF16, 2, 8, 256, 0, 0);
    expect_shape(&w->router_b, TW_DTYPE_BF16, 1, 8, 0, 0, 0);
    expect_shape(&w->gate_up_blocks, TW_DTYPE_U8, 4, 8, 1024, 8, 16);
    expect_shape(&w->gate_up_scales, TW_DTYPE_U8, 3, 8, 1024, 8, 0);
    expect_shape(&w->gate_up_bias, TW_DTYPE_BF16, 2, 8, 1024, 0, 0);
    expect_shape(&w->down_blocks, TW_DTYPE_U8, 4, 8, 256, 16, 16);
    expect_shape(&w->down_scales, TW_DTYPE_U8, 3, 8, 256, 16, 0);
    expect_shape(&w->down_bias, TW_DTYPE_BF16, 2, 8, 256, 0, 0);
    EXPECT_TRUE(w->gate_up.data == NULL && w->down.data == NULL);
  }
  /* raw values (python json+struct) */
  EXPECT_EQ_I64(bf16_at(&m->embed, 0), 0x3d18);
  EXPECT_EQ_I64(bf16_at(&m->embed, 3), 0xbd09);
  EXPECT_EQ_I64(bf16_at(&m->lm_head, 8063 * 256 + 255), 0xbdd7);
  EXPECT_EQ_I64(bf16_at(&m->layers[1].sinks, 0), 0x3e33);
  EXPECT_EQ_I64(bf16_at(&m->layers[1].sinks, 3), 0x3eb7);
  EXPECT_EQ_I64(bf16_at(&m->layers[3].gate_up_bias, 8 * 1024 - 1), 0xbdf6);
  const uint8_t *gb = m->layers[0].gate_up_blocks.data;
  EXPECT_EQ_I64(gb[0], 0x0e);
  EXPECT_EQ_I64(gb[1], 0xdb);
  EXPECT_EQ_I64(gb[2], 0x42);
  EXPECT_EQ_I64(((const uint8_t *)m->layers[0].gate_up_scales.data)[0], 0x7a);
  EXPECT_EQ_I64(((const uint8_t *)m->layers[3].down_blocks.data)[8 * 256 * 16 * 16 - 1], 0x2a);
  tw_model_destroy(m);
}

static void test_bf16(const char *shared) {
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/models/tiny-gptoss-wordnet", shared);
  tw_model_t *m = NULL;
  EXPECT_OK(tw_model_load(dir, &m));
  if (!m) return;
  const tw_model_impl_t *impl = m->impl;
  EXPECT_EQ_I64(impl->n_tensors, 71); /* README: 71 tensors */
  EXPECT_TRUE(!m->config.mxfp4);
  EXPECT_EQ_I64(m->weight_bytes, 35113024 - 8 - 7640);
  expect_shape(&m->embed, TW_DTYPE_BF16, 2, 8064, 256, 0, 0);
  for (int l = 0; l < 4; l++) {
    const tw_layer_weights_t *w = &m->layers[l];
    EXPECT_EQ_I64(w->experts_format, TW_EXPERTS_BF16);
    expect_shape(&w->gate_up, TW_DTYPE_BF16, 3, 8, 256, 1024, 0);
    expect_shape(&w->gate_up_bias, TW_DTYPE_BF16, 2, 8, 1024, 0, 0);
    expect_shape(&w->down, TW_DTYPE_BF16, 3, 8, 512, 256, 0);
    expect_shape(&w->down_bias, TW_DTYPE_BF16, 2, 8, 256, 0, 0);
    EXPECT_TRUE(w->gate_up_blocks.data == NULL && w->down_scales.data == NULL);
  }
  EXPECT_EQ_I64(bf16_at(&m->embed, 0), 0x3d18);
  EXPECT_EQ_I64(bf16_at(&m->embed, 1), 0x3d78);
  EXPECT_EQ_I64(bf16_at(&m->embed, 2), 0xbd6c);
  EXPECT_EQ_I64(bf16_at(&m->embed, 8063 * 256 + 255), 0xbc90);
  EXPECT_EQ_I64(bf16_at(&m->lm_head, 0), 0x3d99);
  EXPECT_EQ_I64(bf16_at(&m->layers[3].sinks, 0), 0x3f76);
  EXPECT_EQ_I64(bf16_at(&m->layers[3].sinks, 3), 0x3faf);
  EXPECT_EQ_I64(bf16_at(&m->layers[2].gate_up, 0), 0xbd32);
  EXPECT_EQ_I64(bf16_at(&m->layers[2].gate_up, 1), 0x3de9);
  EXPECT_EQ_I64(bf16_at(&m->layers[3].down, 8 * 512 * 256 - 1), 0x3ce0);
  EXPECT_EQ_I64(bf16_at(&m->layers[3].down_bias, 8 * 256 - 1), 0x3bd3);
  EXPECT_EQ_I64(bf16_at(&m->final_norm, 0), 0x402a);
  tw_model_destroy(m);
}

int main(void) {
  const char *fixtures = getenv("TW_FIXTURES_DIR");
  const char *shared = getenv("TW_SHARED_DIR");
  if (!fixtures) fixtures = "tests/fixtures";
  test_mxfp4(fixtures);
  char probe[4096];
  snprintf(probe, sizeof probe, "%s/models/tiny-gptoss-wordnet/config.json",
           shared ? shared : "../shared");
  FILE *f = fopen(probe, "r");
  if (f) {
    fclose(f);
    test_bf16(shared ? shared : "../shared");
  } else {
    fprintf(stderr, "skipping the bf16 checkpoint: %s absent\n", probe);
  }
  return CHECK_DONE("test_model_load");
}
