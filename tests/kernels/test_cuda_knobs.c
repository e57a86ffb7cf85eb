/* test_cuda_knobs.c: the CUDA kernel knobs (kernels/knobs.h) read from the
 * environment once: their defaults, set values, out-of-range and malformed
 * values (the default), and that a later setenv changes nothing until
 * tw_cuda_knobs_reload. No GPU needed: nothing here touches the device. */
#include "kernels/knobs.h"

#include "tests/test_expect.h"

static const char *const k_vars[] = {"TWAIN_CUDA_MOE_CUBLAS",
                                     "TWAIN_CUDA_MOE_GEMV_MAX",
                                     "TWAIN_CUDA_PROFILE",
                                     "TWAIN_CUDA_GEMV",
                                     "TWAIN_CUDA_FUSED_ROUTER",
                                     "TWAIN_CUDA_PDL",
                                     "TWAIN_CUDA_DC_CTAS",
                                     "TWAIN_CUDA_DC_STAGES",
                                     "TWAIN_CUDA_DC_FUSED",
                                     "TWAIN_CUDA_MOE_BT",
                                     "TWAIN_CUDA_MOE_MMA",
                                     "TWAIN_CUDA_ROUTE_FUSED_MAX",
                                     "TWAIN_CUDA_PREFILL_BF16_MIN",
                                     "TWAIN_CUDA_MOE_TMA_PASS",
                                     "TWAIN_CUDA_MOE_WS"};

static void clear_all(void) {
  for (size_t i = 0; i < sizeof k_vars / sizeof k_vars[0]; i++) unsetenv(k_vars[i]);
}

static void set_all(const char *const (*pairs)[2], size_t n) {
  for (size_t i = 0; i < n; i++) setenv(pairs[i][0], pairs[i][1], 1);
}

static void expect_defaults(const tw_cuda_knobs_t *k) {
  EXPECT_EQ_I64(k->moe_cublas, 0);
  EXPECT_EQ_I64(k->prefill_bf16_min, 2048);
  EXPECT_EQ_I64(k->moe_gemv_max, -1);
  EXPECT_EQ_I64(k->profile, 0);
  EXPECT_EQ_I64(k->gemv, 1);
  EXPECT_EQ_I64(k->fused_router, 1);
  EXPECT_EQ_I64(k->pdl, 1);
  EXPECT_EQ_I64(k->dc_ctas, 512);
  EXPECT_EQ_I64(k->dc_stages, 3);
  EXPECT_EQ_I64(k->dc_fused, 1);
  EXPECT_EQ_I64(k->route_fused_max, 128);
  EXPECT_EQ_I64(k->moe_tma_pass, 32);
  EXPECT_EQ_I64(k->moe_ws, 64);
  EXPECT(k->moe_bt == NULL && k->moe_mma == NULL, "moe_bt %s moe_mma %s",
         k->moe_bt ? k->moe_bt : "NULL", k->moe_mma ? k->moe_mma : "NULL");
}

int main(void) {
  clear_all();
  tw_test_case = "defaults";
  expect_defaults(tw_cuda_knobs());

  tw_test_case = "values";
  static const char *const values[][2] = {
      {"TWAIN_CUDA_MOE_CUBLAS", "1"},       {"TWAIN_CUDA_MOE_GEMV_MAX", "8"},
      {"TWAIN_CUDA_PROFILE", "1"},          {"TWAIN_CUDA_GEMV", "0"},
      {"TWAIN_CUDA_FUSED_ROUTER", "0"},     {"TWAIN_CUDA_PDL", "0"},
      {"TWAIN_CUDA_DC_CTAS", "4096"},       {"TWAIN_CUDA_DC_STAGES", "2"},
      {"TWAIN_CUDA_DC_FUSED", "0"},         {"TWAIN_CUDA_MOE_BT", "32"},
      {"TWAIN_CUDA_MOE_MMA", "16,32"},      {"TWAIN_CUDA_ROUTE_FUSED_MAX", "1024"},
      {"TWAIN_CUDA_PREFILL_BF16_MIN", "0"}, {"TWAIN_CUDA_MOE_TMA_PASS", "16"},
      {"TWAIN_CUDA_MOE_WS", "128"}};
  set_all(values, sizeof values / sizeof values[0]);
  const tw_cuda_knobs_t *k = tw_cuda_knobs();
  EXPECT_EQ_I64(k->pdl, 1); /* read once: nothing changes before a reload */
  EXPECT_EQ_I64(k->dc_ctas, 512);
  tw_cuda_knobs_reload();
  k = tw_cuda_knobs();
  EXPECT_EQ_I64(k->moe_cublas, 1);
  EXPECT_EQ_I64(k->prefill_bf16_min, 0);
  EXPECT_EQ_I64(k->moe_gemv_max, 8);
  EXPECT_EQ_I64(k->profile, 1);
  EXPECT_EQ_I64(k->gemv, 0);
  EXPECT_EQ_I64(k->fused_router, 0);
  EXPECT_EQ_I64(k->pdl, 0);
  EXPECT_EQ_I64(k->dc_ctas, 4096);
  EXPECT_EQ_I64(k->dc_stages, 2);
  EXPECT_EQ_I64(k->dc_fused, 0);
  EXPECT_EQ_I64(k->route_fused_max, 1024);
  EXPECT_EQ_I64(k->moe_tma_pass, 16);
  EXPECT_EQ_I64(k->moe_ws, 128);
  EXPECT(k->moe_bt && strcmp(k->moe_bt, "32") == 0, "moe_bt %s", k->moe_bt);
  EXPECT(k->moe_mma && strcmp(k->moe_mma, "16,32") == 0, "moe_mma %s", k->moe_mma);
  setenv("TWAIN_CUDA_MOE_MMA", "all", 1); /* the knob keeps its own copy */
  EXPECT(strcmp(tw_cuda_knobs()->moe_mma, "16,32") == 0, "moe_mma after setenv: %s",
         tw_cuda_knobs()->moe_mma);

  tw_test_case = "range ends";
  static const char *const low[][2] = {{"TWAIN_CUDA_MOE_GEMV_MAX", "0"},
                                       {"TWAIN_CUDA_DC_CTAS", "1048576"}};
  static const char *const high[][2] = {{"TWAIN_CUDA_MOE_GEMV_MAX", "64"},
                                        {"TWAIN_CUDA_DC_CTAS", "1"}};
  clear_all();
  set_all(low, 2);
  tw_cuda_knobs_reload();
  EXPECT_EQ_I64(tw_cuda_knobs()->moe_gemv_max, 0);
  EXPECT_EQ_I64(tw_cuda_knobs()->dc_ctas, 1048576);
  setenv("TWAIN_CUDA_MOE_WS", "0", 1); /* 0: the wgmma kernel at every tile */
  tw_cuda_knobs_reload();
  EXPECT_EQ_I64(tw_cuda_knobs()->moe_ws, 0);
  unsetenv("TWAIN_CUDA_MOE_WS");
  set_all(high, 2);
  tw_cuda_knobs_reload();
  EXPECT_EQ_I64(tw_cuda_knobs()->moe_gemv_max, 64);
  EXPECT_EQ_I64(tw_cuda_knobs()->dc_ctas, 1);

  tw_test_case = "out of range or malformed: the default";
  static const char *const bad[][2] = {{"TWAIN_CUDA_MOE_GEMV_MAX", "65"},
                                       {"TWAIN_CUDA_DC_CTAS", "12x"},
                                       {"TWAIN_CUDA_DC_STAGES", "4"},
                                       {"TWAIN_CUDA_DC_FUSED", "-1"},
                                       {"TWAIN_CUDA_PDL", ""},
                                       {"TWAIN_CUDA_PROFILE", "0"},
                                       {"TWAIN_CUDA_MOE_CUBLAS", "yes"},
                                       {"TWAIN_CUDA_ROUTE_FUSED_MAX", "1025"},
                                       {"TWAIN_CUDA_MOE_TMA_PASS", "24"},
                                       {"TWAIN_CUDA_MOE_WS", "48"}};
  static const char *const bad2[][2] = {{"TWAIN_CUDA_DC_CTAS", "0"},
                                        {"TWAIN_CUDA_DC_STAGES", "1"},
                                        {"TWAIN_CUDA_MOE_GEMV_MAX", "99999999999999999999"},
                                        {"TWAIN_CUDA_MOE_TMA_PASS", "64"},
                                        {"TWAIN_CUDA_MOE_WS", "256"}};
  clear_all();
  set_all(bad, sizeof bad / sizeof bad[0]);
  tw_cuda_knobs_reload();
  expect_defaults(tw_cuda_knobs());
  set_all(bad2, sizeof bad2 / sizeof bad2[0]);
  tw_cuda_knobs_reload();
  expect_defaults(tw_cuda_knobs());
  return tw_test_exit("test_cuda_knobs");
}
