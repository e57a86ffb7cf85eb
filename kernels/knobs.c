/* knobs.c: the CUDA kernel knobs read once from the environment (knobs.h). */
#include "kernels/knobs.h"

#include "common/base/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_KNOB_STR_MAX 64

static tw_cuda_knobs_t g_knobs;
static char g_moe_bt[TW_KNOB_STR_MAX], g_moe_mma[TW_KNOB_STR_MAX];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* An integer knob in [lo, hi]: dflt when unset or empty; a value that is not
 * a whole number in range is logged and means dflt. */
static int tw_knob_int(const char *name, int dflt, int lo, int hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = NULL;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || x < lo || x > hi) {
    TW_WARN("cuda", "%s=%s is not in %d..%d: the default %d", name, v, lo, hi, dflt);
    return dflt;
  }
  return (int)x;
}

/* A switch: `on` is the default; the opposite when the value starts with
 * the other digit (PDL=0 off, PROFILE=1 on). */
static int tw_knob_switch(const char *name, int dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  return dflt ? v[0] != '0' : v[0] == '1';
}

/* A string knob copied (the environment may change later); NULL when unset. */
static const char *tw_knob_str(const char *name, char *buf) {
  const char *v = getenv(name);
  if (!v) return NULL;
  if (strlen(v) >= TW_KNOB_STR_MAX)
    TW_WARN("cuda", "%s is longer than %d characters: cut", name, TW_KNOB_STR_MAX - 1);
  snprintf(buf, TW_KNOB_STR_MAX, "%s", v);
  return buf;
}

static void tw_knobs_read(void) {
  tw_cuda_knobs_t k;
  k.moe_cublas = tw_knob_switch("TWAIN_CUDA_MOE_CUBLAS", 0);
  k.prefill_bf16_min =
      tw_knob_int("TWAIN_CUDA_PREFILL_BF16_MIN", TW_PREFILL_BF16_MIN_TOKENS, 0, 1 << 20);
  k.moe_gemv_max = tw_knob_int("TWAIN_CUDA_MOE_GEMV_MAX", -1, 0, TW_CUDA_KNOB_GEMV_MAX);
  k.profile = tw_knob_switch("TWAIN_CUDA_PROFILE", 0);
  k.gemv = tw_knob_switch("TWAIN_CUDA_GEMV", 1);
  k.fused_router = tw_knob_switch("TWAIN_CUDA_FUSED_ROUTER", 1);
  k.pdl = tw_knob_switch("TWAIN_CUDA_PDL", 1);
  k.dc_ctas = tw_knob_int("TWAIN_CUDA_DC_CTAS", TW_DC_TARGET_CTAS, 1, 1 << 20);
  k.dc_stages = tw_knob_int("TWAIN_CUDA_DC_STAGES", 3, 2, 3);
  k.dc_fused = tw_knob_int("TWAIN_CUDA_DC_FUSED", 1, 0, 1);
  k.moe_bt = tw_knob_str("TWAIN_CUDA_MOE_BT", g_moe_bt);
  k.moe_mma = tw_knob_str("TWAIN_CUDA_MOE_MMA", g_moe_mma);
  k.moe_stream = tw_knob_switch("TWAIN_CUDA_MOE_STREAM", 1);
  k.moe_stream_warps = tw_knob_int("TWAIN_CUDA_MOE_STREAM_WARPS", 16, 8, 16);
  k.moe_stream_bpf = tw_knob_int("TWAIN_CUDA_MOE_STREAM_BPF", -1, 0, 2);
  k.moe_stream_splitk = tw_knob_switch("TWAIN_CUDA_MOE_STREAM_SPLITK", 1);
  k.moe_stream_balance = tw_knob_switch("TWAIN_CUDA_MOE_STREAM_BALANCE", 1);
  k.moe_tma = tw_knob_int("TWAIN_CUDA_MOE_TMA", 2, 0, 2);
  k.moe_tma_pass = tw_knob_int("TWAIN_CUDA_MOE_TMA_PASS", 32, 16, 32);
  if (k.moe_tma_pass != 16 && k.moe_tma_pass != 32) {
    TW_WARN("cuda", "TWAIN_CUDA_MOE_TMA_PASS=%d is not 16 or 32: 32", k.moe_tma_pass);
    k.moe_tma_pass = 32;
  }
  k.moe_ws = tw_knob_int("TWAIN_CUDA_MOE_WS", 64, 0, 128);
  if (k.moe_ws & (k.moe_ws - 1) || (k.moe_ws && k.moe_ws < 16)) {
    TW_WARN("cuda", "TWAIN_CUDA_MOE_WS=%d is not 0, 16, 32, 64 or 128: 64", k.moe_ws);
    k.moe_ws = 64;
  }
  k.route_fused_max = tw_knob_int("TWAIN_CUDA_ROUTE_FUSED_MAX", 128, 0, 1024);
  if (k.moe_stream_warps != 8 && k.moe_stream_warps != 16) {
    TW_WARN("cuda", "TWAIN_CUDA_MOE_STREAM_WARPS=%d is not 8 or 16: 16", k.moe_stream_warps);
    k.moe_stream_warps = 16;
  }
  g_knobs = k;
}

const tw_cuda_knobs_t *tw_cuda_knobs(void) {
  pthread_once(&g_once, tw_knobs_read);
  return &g_knobs;
}

void tw_cuda_knobs_reload(void) {
  pthread_once(&g_once, tw_knobs_read);
  tw_knobs_read();
}
