/* test_mxfp4.c: tw_mxfp4_dequant_row against spec §3.4 (worked example, every
 * nibble, scale extremes), then the tiny MXFP4 checkpoint's experts against
 * the bf16 checkpoint's: the relative Frobenius error per tensor must match
 * the numbers measured with transformers (mxfp4_verification.json, 11.1-11.2%)
 * which also checks the orientation: MXFP4 gate_up row r, column c is bf16
 * gate_up[e][c][r], and down row r, column c is bf16 down[e][c][r]. */
#include "check.h"

#include "common/model/model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_table(void) {
  /* spec §3.4 table */
  static const float want[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int i = 0; i < 16; i++) {
    EXPECT_EQ_F64(tw_fp4_e2m1_table[i], want[i]);
    EXPECT_EQ_I64(signbit(tw_fp4_e2m1_table[i]) != 0, i >= 8);
  }
}

static void test_worked_example(void) {
  uint8_t blocks[16] = {0x2F};
  uint8_t scale = 126;
  float out[32];
  tw_mxfp4_dequant_row(blocks, &scale, 1, out);
  EXPECT_EQ_F64(out[0], -3.0);
  EXPECT_EQ_F64(out[1], 0.5);
  for (int i = 2; i < 32; i++) EXPECT_EQ_F64(out[i], 0.0);
}

static void test_every_nibble(void) {
  static const float want[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int lo = 0; lo < 16; lo++) {
    int hi = 15 - lo;
    uint8_t blocks[16];
    for (int j = 0; j < 16; j++) blocks[j] = (uint8_t)(lo | (hi << 4));
    uint8_t scale = 127; /* x1 */
    float out[32];
    tw_mxfp4_dequant_row(blocks, &scale, 1, out);
    for (int j = 0; j < 16; j++) {
      EXPECT_EQ_F64(out[2 * j], want[lo]);       /* low nibble: even element */
      EXPECT_EQ_F64(out[2 * j + 1], want[hi]);   /* high nibble: odd element */
      EXPECT_EQ_I64(signbit(out[2 * j]) != 0, lo >= 8);
    }
  }
}

static void test_scales(void) {
  struct { uint8_t scale, byte; float even, odd; } cases[] = {
      {127, 0x71, 0.5f, 6.0f},
      {128, 0x71, 1.0f, 12.0f},
      {0, 0x71, 0x1p-128f, 0x1.8p-125f},   /* 2^-127: subnormal range, exact */
      {1, 0x21, 0x1p-127f, 0x1p-126f},
      {254, 0x21, 0x1p126f, 0x1p127f},
      {254, 0x07, INFINITY, 0.0f},          /* 6 * 2^127 overflows */
      {255, 0x01, 0x1p127f, 0.0f},          /* 0.5 * 2^128, as ldexp gives */
      {255, 0xA2, INFINITY, -INFINITY},
      {120, 0x9F, -6.0f * 0x1p-7f, -0.5f * 0x1p-7f},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint8_t blocks[16];
    memset(blocks, cases[i].byte, sizeof blocks);
    float out[32];
    tw_mxfp4_dequant_row(blocks, &cases[i].scale, 1, out);
    for (int j = 0; j < 16; j++) {
      if (out[2 * j] != cases[i].even || out[2 * j + 1] != cases[i].odd) {
        fprintf(stderr, "scale %u byte 0x%02x: got %a %a want %a %a\n", cases[i].scale,
                cases[i].byte, out[2 * j], out[2 * j + 1], cases[i].even, cases[i].odd);
        fails++;
        break;
      }
    }
  }
  /* several blocks: each uses its own scale */
  uint8_t blocks[3 * 16];
  memset(blocks, 0x22, sizeof blocks); /* 1.0, 1.0 */
  uint8_t scales[3] = {127, 130, 120};
  float out[96];
  tw_mxfp4_dequant_row(blocks, scales, 3, out);
  EXPECT_EQ_F64(out[0], 1.0);
  EXPECT_EQ_F64(out[31], 1.0);
  EXPECT_EQ_F64(out[32], 8.0);
  EXPECT_EQ_F64(out[63], 8.0);
  EXPECT_EQ_F64(out[64], 0x1p-7);
  EXPECT_EQ_F64(out[95], 0x1p-7);
}

/* Relative Frobenius error of the dequantised MXFP4 matrix against bf16:
 * mx blocks/scales [E, R, C/32, (16)], bf16 [E, C, R] (the transpose). */
static double rel_error(const tw_tensor_t *blocks, const tw_tensor_t *scales,
                        const tw_tensor_t *bf) {
  const int64_t E = blocks->shape[0], R = blocks->shape[1], G = blocks->shape[2], C = G * 32;
  const uint8_t *b = blocks->data, *s = scales->data;
  const uint16_t *w = bf->data;
  float *row = malloc((size_t)C * sizeof *row);
  double num = 0, den = 0;
  for (int64_t e = 0; e < E; e++) {
    for (int64_t r = 0; r < R; r++) {
      tw_mxfp4_dequant_row(b + ((e * R + r) * G) * 16, s + (e * R + r) * G, G, row);
      for (int64_t c = 0; c < C; c++) {
        uint16_t h;
        memcpy(&h, &w[(e * C + c) * R + r], 2);
        double ref = tw_bf16_to_f32(h);
        num += (row[c] - ref) * (row[c] - ref);
        den += ref * ref;
      }
    }
  }
  free(row);
  return sqrt(num / den);
}

static void test_checkpoints(const char *shared) {
  /* transformers' numbers, mxfp4_verification.json: per layer, down then gate_up */
  static const double ref[4][2] = {{0.1121063381433487, 0.11145307868719101},
                                   {0.11236163973808289, 0.11167989671230316},
                                   {0.1124790608882904, 0.11165113002061844},
                                   {0.11191878467798233, 0.11130284518003464}};
  char dir[4096];
  tw_model_t *mx = NULL, *bf = NULL;
  snprintf(dir, sizeof dir, "%s/models/tiny-gptoss-wordnet-mxfp4", shared);
  EXPECT_OK(tw_model_load(dir, &mx));
  snprintf(dir, sizeof dir, "%s/models/tiny-gptoss-wordnet", shared);
  EXPECT_OK(tw_model_load(dir, &bf));
  if (!mx || !bf) goto out;
  for (int l = 0; l < mx->config.n_layers; l++) {
    const tw_layer_weights_t *a = &mx->layers[l], *b = &bf->layers[l];
    double gu = rel_error(&a->gate_up_blocks, &a->gate_up_scales, &b->gate_up);
    double dn = rel_error(&a->down_blocks, &a->down_scales, &b->down);
    fprintf(stderr, "layer %d: relative error gate_up %.6f down %.6f\n", l, gu, dn);
    EXPECT_TRUE(gu > 0.10 && gu < 0.13);
    EXPECT_TRUE(dn > 0.10 && dn < 0.13);
    EXPECT_TRUE(fabs(gu - ref[l][1]) < 1e-4);
    EXPECT_TRUE(fabs(dn - ref[l][0]) < 1e-4);
    /* the expert biases are not quantised: identical bytes (spec §3.4) */
    EXPECT_TRUE(memcmp(a->gate_up_bias.data, b->gate_up_bias.data, (size_t)a->gate_up_bias.n_bytes) ==
           0);
    EXPECT_TRUE(memcmp(a->down_bias.data, b->down_bias.data, (size_t)a->down_bias.n_bytes) == 0);
  }
out:
  tw_model_destroy(mx);
  tw_model_destroy(bf);
}

int main(void) {
  test_table();
  test_worked_example();
  test_every_nibble();
  test_scales();
  const char *shared = getenv("TW_SHARED_DIR");
  if (!shared) shared = "../shared";
  char probe[4096];
  snprintf(probe, sizeof probe, "%s/models/tiny-gptoss-wordnet/config.json", shared);
  FILE *f = fopen(probe, "r");
  if (!f) {
    fprintf(stderr, "%s absent: checkpoint comparison skipped\n", probe);
    int rc = CHECK_DONE("test_mxfp4");
    return rc ? rc : 77;
  }
  fclose(f);
  test_checkpoints(shared);
  return CHECK_DONE("test_mxfp4");
}
