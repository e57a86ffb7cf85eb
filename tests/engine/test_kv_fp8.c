/* test_kv_fp8.c: the FP8 (e4m3) KV cache with per-head scales (kv_fp8.h).
 *   1. e4m3 conversion against values worked out by hand from the format
 *      (S.EEEE.MMM, bias 7, no infinities, 0x7F NaN, max 448): normals,
 *      subnormals, ties to even, saturation, NaN, signed zero; and every
 *      one of the 254 finite codes decodes and encodes back to itself.
 *   2. Per-head quantization: the scale is amax / 448, the largest value
 *      encodes as +-448, an all-zero head stores zeros with scale 0, and the
 *      round trip error of each value is at most half an e4m3 step.
 *   3. The block size of each pool dtype and the --kv-dtype parser.
 *   4. The CPU engine with the fp8 KV cache against Hugging Face (fp32) on
 *      the tiny checkpoint (argument mxfp4: tests/fixtures; bf16: the
 *      shared fixtures, exit 77 when absent): per prompt one prefill with
 *      all logits, relative L2 error of the stored rows <= TW_REL_L2_FP8
 *      and the argmax equal to the manifest at >= TW_ARGMAX_PCT_FP8% of the
 *      prompt positions (measured values below); then greedy
 *      decode steps through the fp8 cache, teacher-forced, every token equal
 *      to greedy_continuation_ids. The f32 cache's error is printed beside. */
#include "common/engine/engine.h"
#include "common/kv/kv_blocks.h"
#include "common/kv/kv_fp8.h"
#include "common/model/model.h"

#include "fixture_util.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Measured on the tiny mxfp4 checkpoint (2026-12-02): rel L2 0.0095 to 0.037,
 * argmax 96.0% to 100% of the prompt positions, every greedy token equal.
 * The CUDA bf16 engine's criterion (test_engine_cuda) is argmax >= 99% and
 * rel L2 < 0.1: the fp8 cache misses the argmax one on two prompts (near-ties
 * of the tiny model), so it stays an option, off by default. */
#define TW_REL_L2_FP8 0.05
#define TW_ARGMAX_PCT_FP8 95

static void test_e4m3_known(void) {
  static const struct {
    float x;
    uint8_t code;
  } enc[] = {
      {0.0f, 0x00},       {-0.0f, 0x80},     {1.0f, 0x38}, /* E=7, M=0 */
      {-2.0f, 0xC0},      {1.125f, 0x39},    {1.75f, 0x3E},
      {448.0f, 0x7E},     {-448.0f, 0xFE},   {240.0f, 0x77}, /* 2^7 x 1.875: E=14, M=7 */
      {256.0f, 0x78},     {0.015625f, 0x08},                 /* 2^-6: smallest normal */
      {0x1p-9f, 0x01},    {0x7p-9f, 0x07},                   /* subnormals: M x 2^-9 */
      {0x1p-10f, 0x00},                                      /* tie between 0 and 2^-9: even (0) */
      {0x3p-10f, 0x02},   /* 1.5 x 2^-9: tie between 1 and 2 units: even (2) */
      {0x5p-10f, 0x02},   /* 2.5 units: tie, even (2) */
      {0x1.4p-10f, 0x01}, /* 0.625 units: up to 1 */
      {1.0625f, 0x38},    /* 1 + 1/16: tie between M=0 and M=1: even (0) */
      {1.1875f, 0x3A},    /* 1 + 3/16: tie between M=1 and M=2: even (2) */
      {1.0626f, 0x39},    /* just past the tie: up */
      {1.9375f, 0x40},    /* 1 + 15/16: tie between 1.875 (M=7) and 2.0: even carries to E=8 */
      {0x1.ep-7f, 0x08},  /* 1.875 x 2^-7 = 7.5 units of 2^-9: a tie, to even 8 = 2^-6 */
      {464.0f, 0x7E},     /* tie between 448 and 480 (not finite): saturates */
      {1000.0f, 0x7E},    {-1e30f, 0xFE},
  };
  for (size_t i = 0; i < sizeof enc / sizeof enc[0]; i++) {
    uint8_t got = tw_f32_to_e4m3(enc[i].x);
    EXPECT(got == enc[i].code, "e4m3(%a) = 0x%02X, want 0x%02X", (double)enc[i].x, got,
           enc[i].code);
  }
  EXPECT(tw_f32_to_e4m3(INFINITY) == 0x7E && tw_f32_to_e4m3(-INFINITY) == 0xFE,
         "infinities saturate to +-448");
  EXPECT(tw_f32_to_e4m3(NAN) == 0x7F && tw_f32_to_e4m3(-NAN) == 0xFF, "NaN is 0x7F (sign kept)");
  EXPECT(isnan(tw_e4m3_to_f32(0x7F)) && isnan(tw_e4m3_to_f32(0xFF)), "0x7F, 0xFF decode to NaN");
  static const struct {
    uint8_t code;
    float x;
  } dec[] = {{0x00, 0.0f},  {0x01, 0x1p-9f}, {0x07, 0x7p-9f}, {0x08, 0x1p-6f},
             {0x38, 1.0f},  {0x3F, 1.875f},  {0x7E, 448.0f},  {0xFE, -448.0f},
             {0xB8, -1.0f}, {0x50, 8.0f},    {0x54, 12.0f},   {0x7D, 416.0f}};
  for (size_t i = 0; i < sizeof dec / sizeof dec[0]; i++)
    EXPECT(tw_e4m3_to_f32(dec[i].code) == dec[i].x, "e4m3 0x%02X = %a, want %a", dec[i].code,
           (double)tw_e4m3_to_f32(dec[i].code), (double)dec[i].x);
  EXPECT(signbit(tw_e4m3_to_f32(0x80)) && tw_e4m3_to_f32(0x80) == 0.0f, "0x80 is -0");
  int bad = 0;
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7F) == 0x7F) continue;
    float v = tw_e4m3_to_f32((uint8_t)c);
    bad += tw_f32_to_e4m3(v) != (uint8_t)c;
    /* the midpoint to the next code up rounds to the even one of the two */
    if ((c & 0x7F) < 0x7E) {
      float up = tw_e4m3_to_f32((uint8_t)(c + 1));
      float mid = (v + up) / 2; /* exact: both have few mantissa bits */
      uint8_t even = (c & 1) ? (uint8_t)(c + 1) : (uint8_t)c;
      bad += tw_f32_to_e4m3(mid) != even;
    }
  }
  EXPECT(bad == 0, "%d finite codes do not round-trip or break ties to even", bad);
  /* the dequantization (a table) against the conversion, every byte */
  uint8_t all[256];
  float deq[256];
  for (int c = 0; c < 256; c++) all[c] = (uint8_t)c;
  tw_kv_fp8_dequantize(all, 256, 1.0f, deq);
  int tbad = 0;
  for (int c = 0; c < 256; c++) {
    float v = tw_e4m3_to_f32((uint8_t)c);
    tbad += isnan(v) ? !isnan(deq[c]) : memcmp(&v, &deq[c], sizeof v) != 0;
  }
  EXPECT(tbad == 0, "the dequantization table differs from tw_e4m3_to_f32 at %d bytes", tbad);
}

static void test_quantize(void) {
  enum { D = 64 };
  float x[D], back[D], s;
  uint8_t q[D];
  uint64_t seed = 11;
  for (int rep = 0; rep < 200; rep++) {
    double mag = pow(10.0, tw_test_uniform(&seed, -6, 4)); /* scales from 1e-6 to 1e4 */
    for (int d = 0; d < D; d++) x[d] = (float)(mag * tw_test_uniform(&seed, -1, 1));
    x[rep % D] = rep & 1 ? (float)-mag : (float)mag; /* the amax, either sign */
    tw_kv_fp8_quantize(x, D, q, &s);
    EXPECT(s == (float)mag / 448.0f, "scale %g, want amax/448 = %g", (double)s, mag / 448.0);
    EXPECT(q[rep % D] == (rep & 1 ? 0xFE : 0x7E), "the amax encodes as +-448: 0x%02X", q[rep % D]);
    tw_kv_fp8_dequantize(q, D, s, back);
    for (int d = 0; d < D; d++) {
      /* half a step of e4m3 around x/s: 2^-4 relative for normals, 2^-10
       * absolute below 2^-6; a little slack for the f32 scale */
      double r = fabs((double)x[d] / s);
      double step = r < 0x1p-6 ? 0x1p-9 : ldexp(1.0, (int)floor(log2(r)) - 3);
      double err = fabs((double)back[d] - x[d]) / s;
      if (!(err <= step / 2 * 1.0001 + 1e-6)) {
        EXPECT(0, "rep %d d %d: %g -> %g (error %g units, bound %g)", rep, d, (double)x[d],
               (double)back[d], err, step / 2);
        break;
      }
    }
  }
  memset(x, 0, sizeof x);
  memset(q, 0xAA, sizeof q);
  tw_kv_fp8_quantize(x, D, q, &s);
  int nz = 0;
  for (int d = 0; d < D; d++) nz += q[d] != 0;
  EXPECT(s == 0.0f && nz == 0, "an all-zero head: scale %g, %d non-zero bytes", (double)s, nz);
  x[3] = NAN;
  tw_kv_fp8_quantize(x, D, q, &s);
  tw_kv_fp8_dequantize(q, D, s, back);
  EXPECT(isnan(s) && isnan(back[3]), "a NaN input stays NaN");
}

static void test_sizes_and_option(void) {
  EXPECT(tw_kv_head_bytes(TW_DTYPE_F32, 16, 64) == 4096 &&
             tw_kv_head_bytes(TW_DTYPE_BF16, 16, 64) == 2048 &&
             tw_kv_head_bytes(TW_DTYPE_F8_E4M3, 16, 64) == 16 * 64 + 16 * 4 &&
             tw_kv_head_bytes(TW_DTYPE_I32, 16, 64) == 0,
         "head bytes of a block");
  /* gpt-oss-20b: 8 kv heads, blocks of 16: bf16 32 KiB, fp8 17 KiB, 1.88x the blocks */
  EXPECT(2 * 8 * tw_kv_head_bytes(TW_DTYPE_BF16, 16, 64) == 32768 &&
             2 * 8 * tw_kv_head_bytes(TW_DTYPE_F8_E4M3, 16, 64) == 17408,
         "20b block bytes");
  int32_t v = -5;
  char err[128];
  EXPECT(tw_kv_dtype_opt("fp8", &v, err, sizeof err) == 0 && v == TW_KV_DTYPE_FP8, "fp8");
  EXPECT(tw_kv_dtype_opt("bf16", &v, err, sizeof err) == 0 && v == TW_KV_DTYPE_AUTO, "bf16");
  EXPECT(tw_kv_dtype_opt("auto", &v, err, sizeof err) == 0 && v == TW_KV_DTYPE_AUTO, "auto");
  EXPECT(tw_kv_dtype_opt("fp4", &v, err, sizeof err) == -1 && strstr(err, "'fp4'"),
         "fp4 refused: %s", err);
  EXPECT(tw_kv_pool_dtype(TW_KV_DTYPE_FP8, TW_DTYPE_BF16) == TW_DTYPE_F8_E4M3 &&
             tw_kv_pool_dtype(TW_KV_DTYPE_AUTO, TW_DTYPE_BF16) == TW_DTYPE_BF16,
         "pool dtypes");
  EXPECT(tw_kv_dtype_mismatch(TW_DTYPE_F8_E4M3, TW_DTYPE_BF16) == TW_ERR_UNSUPPORTED &&
             strstr(tw_last_error(), "fp8") && strstr(tw_last_error(), "bf16") &&
             strstr(tw_last_error(), "--kv-dtype"),
         "mismatch message: %s", tw_last_error());
}

static int argmax_row(const float *r, int32_t V) {
  int32_t b = 0;
  for (int32_t i = 1; i < V; i++)
    if (r[i] > r[b]) b = i;
  return b;
}

/* One engine (kv dtype `kv_dtype`) over one fixture prompt: the stored rows'
 * rel L2 against HF into *rel_p, argmax agreement count, greedy mismatches. */
static int run_prompt(const tw_model_t *m, int32_t kv_dtype, const tw_fx_entry_t *fx, double *rel_p,
                      int *argmax_ok_p, int *greedy_bad_p) {
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CPU;
  p.kv_num_blocks = 64;
  p.n_threads = 2;
  p.kv_dtype = kv_dtype;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &p, &e) != TW_OK) return -1;
  const tw_kv_layout_t *l = tw_engine_kv_layout(e);
  if (l->dtype != (kv_dtype == TW_KV_DTYPE_FP8 ? TW_DTYPE_F8_E4M3 : TW_DTYPE_F32)) {
    tw_engine_destroy(e);
    return -1;
  }
  const int32_t V = m->config.vocab_size, T = fx->n_ids;
  int32_t table[24];
  for (int i = 0; i < 24; i++) table[i] = 63 - 2 * i; /* scattered ids */
  float *logits = malloc(sizeof(float) * (size_t)T * (size_t)V);
  int32_t next = -1;
  tw_prefill_args_t pa = {.tokens = fx->ids,
                          .n_tokens = T,
                          .block_table = table,
                          .n_blocks = 24,
                          .all_logits = true,
                          .logits_out = logits,
                          .next_token_out = &next};
  int rc = logits && tw_engine_prefill(e, &pa) == TW_OK ? 0 : -1;
  if (rc == 0) {
    *rel_p =
        tw_test_rel_l2_ff(logits + (int64_t)fx->pos_begin * V, fx->logits, (int64_t)fx->n_rows * V);
    *argmax_ok_p = 0;
    for (int32_t t = 0; t < T; t++)
      *argmax_ok_p += argmax_row(logits + (int64_t)t * V, V) == fx->argmax[t];
    *greedy_bad_p = next != fx->greedy[0];
  }
  for (int32_t i = 1; i < fx->n_greedy && rc == 0; i++) { /* teacher-forced */
    int32_t tok = fx->greedy[i - 1], pos = T + i - 1, nb = 24, out = -1;
    const int32_t *tab = table;
    tw_decode_args_t da = {.n_seqs = 1,
                           .tokens = &tok,
                           .positions = &pos,
                           .block_tables = &tab,
                           .n_blocks = &nb,
                           .next_tokens_out = &out};
    rc = tw_engine_decode(e, &da) == TW_OK ? 0 : -1;
    *greedy_bad_p += rc == 0 && out != fx->greedy[i];
  }
  free(logits);
  tw_engine_destroy(e);
  return rc;
}

static void test_fixtures(const tw_model_t *m, const char *fx_dir, const char *variant) {
  for (int i = 0; i < 4; i++) {
    tw_fx_entry_t fx;
    if (tw_fx_load(fx_dir, variant, tw_fx_prompts[i], &fx) != 0) {
      EXPECT(0, "cannot load fixture %s/%s", variant, tw_fx_prompts[i]);
      return;
    }
    double rel8 = INFINITY, rel32 = INFINITY;
    int am8 = 0, am32 = 0, bad8 = -1, bad32 = -1;
    EXPECT(run_prompt(m, TW_KV_DTYPE_FP8, &fx, &rel8, &am8, &bad8) == 0, "%s fp8 run: %s",
           fx.prompt, tw_last_error());
    EXPECT(run_prompt(m, TW_KV_DTYPE_AUTO, &fx, &rel32, &am32, &bad32) == 0, "%s f32 run: %s",
           fx.prompt, tw_last_error());
    printf(
        "%s %-12s fp8 KV: logits rel L2 %.3g vs HF (f32 KV %.3g), argmax %d/%d (f32 %d), "
        "greedy %d of %d tokens differ (f32 %d)\n",
        variant, fx.prompt, rel8, rel32, am8, fx.n_ids, am32, bad8, fx.n_greedy, bad32);
    EXPECT(rel8 <= TW_REL_L2_FP8, "%s: fp8 logits rel L2 %.3g > %g", fx.prompt, rel8,
           TW_REL_L2_FP8);
    EXPECT(am8 * 100 >= fx.n_ids * TW_ARGMAX_PCT_FP8, "%s: fp8 argmax agrees at %d of %d positions",
           fx.prompt, am8, fx.n_ids);
    EXPECT(bad8 == 0, "%s: %d fp8 greedy tokens differ from HF", fx.prompt, bad8);
    tw_fx_free(&fx);
  }
}

int main(int argc, char **argv) {
  const char *variant = argc > 1 ? argv[1] : "mxfp4";
  char model_dir[1024], fx_dir[1024];
  if (!strcmp(variant, "mxfp4")) {
    const char *fixtures = getenv("TW_FIXTURES_DIR");
    if (!fixtures) fixtures = "tests/fixtures";
    snprintf(model_dir, sizeof model_dir, "%s/tiny-gptoss-wordnet-mxfp4", fixtures);
    snprintf(fx_dir, sizeof fx_dir, "%s/tiny-gptoss-wordnet", fixtures);
    test_e4m3_known();
    test_quantize();
    test_sizes_and_option();
  } else if (!strcmp(variant, "bf16")) {
    const char *shared = getenv("TW_SHARED_DIR");
    if (!shared) shared = "../shared";
    snprintf(model_dir, sizeof model_dir, "%s/models/tiny-gptoss-wordnet", shared);
    snprintf(fx_dir, sizeof fx_dir, "%s/fixtures/tiny-gptoss-wordnet", shared);
    if (access(model_dir, R_OK) != 0 || access(fx_dir, R_OK) != 0) {
      printf("skip: %s or %s absent\n", model_dir, fx_dir);
      return 77;
    }
  } else {
    fprintf(stderr, "usage: %s [mxfp4|bf16]\n", argv[0]);
    return 2;
  }
  tw_model_t *m = NULL;
  if (tw_model_load(model_dir, &m) != TW_OK) {
    fprintf(stderr, "cannot load %s: %s\n", model_dir, tw_last_error());
    return 1;
  }
  test_fixtures(m, fx_dir, variant);
  tw_model_destroy(m);
  return tw_test_exit("test_kv_fp8");
}
