/* kv_fp8.c: e4m3 conversion and the FP8 KV cache's quantization (kv_fp8.h). */
#include "common/kv/kv_fp8.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

uint8_t tw_f32_to_e4m3(float x) {
  uint8_t sign = signbit(x) ? 0x80u : 0u;
  if (isnan(x)) return (uint8_t)(sign | 0x7Fu);
  float a = fabsf(x);
  if (!(a < TW_E4M3_MAX)) return (uint8_t)(sign | 0x7Eu); /* 448 and beyond, inf: saturate */
  /* nearbyintf rounds to nearest, ties to even (the default rounding mode);
   * the scalings by powers of two are exact */
  if (a < 0x1p-6f) /* subnormal: units of 2^-9; 8 units is 2^-6, code 0x08 */
    return (uint8_t)(sign | (uint8_t)nearbyintf(a * 512.0f));
  int k;
  (void)frexpf(a, &k); /* a = f 2^k, f in [0.5, 1): a in [2^(k-1), 2^k) */
  int e = k - 1;       /* -6 .. 8 */
  /* mantissa in units of 2^(e-3): 8..16; 16 carries into the exponent, which
   * the sum below does by itself */
  int m = (int)nearbyintf(ldexpf(a, 3 - e));
  int code = ((e + 7) << 3) + m - 8;
  if (code > 0x7E) code = 0x7E; /* rounded up past 448 */
  return (uint8_t)(sign | (uint8_t)code);
}

float tw_e4m3_to_f32(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
  return (b & 0x80u) ? -v : v;
}

void tw_kv_fp8_quantize(const float *x, int32_t n, uint8_t *q, float *scale_p) {
  float amax = 0.0f;
  int nan = 0;
  for (int32_t d = 0; d < n; d++) {
    float a = fabsf(x[d]);
    nan |= isnan(a);
    if (a > amax) amax = a;
  }
  float s = nan ? NAN : amax / TW_E4M3_MAX;
  *scale_p = s;
  for (int32_t d = 0; d < n; d++) q[d] = s > 0.0f || nan ? tw_f32_to_e4m3(x[d] / s) : 0;
}

/* tw_e4m3_to_f32 of every byte (engine.kv_fp8 checks the two agree), for the
 * cpu attention's dequantization of every key it reads */
static const float tw_e4m3_table[256] = {
    0.0f,     0x1p-9f,    0x1p-8f,    0x1.8p-8f,  0x1p-7f,    0x1.4p-7f,  0x1.8p-7f,  0x1.cp-7f,
    0x1p-6f,  0x1.2p-6f,  0x1.4p-6f,  0x1.6p-6f,  0x1.8p-6f,  0x1.ap-6f,  0x1.cp-6f,  0x1.ep-6f,
    0x1p-5f,  0x1.2p-5f,  0x1.4p-5f,  0x1.6p-5f,  0x1.8p-5f,  0x1.ap-5f,  0x1.cp-5f,  0x1.ep-5f,
    0x1p-4f,  0x1.2p-4f,  0x1.4p-4f,  0x1.6p-4f,  0x1.8p-4f,  0x1.ap-4f,  0x1.cp-4f,  0x1.ep-4f,
    0x1p-3f,  0x1.2p-3f,  0x1.4p-3f,  0x1.6p-3f,  0x1.8p-3f,  0x1.ap-3f,  0x1.cp-3f,  0x1.ep-3f,
    0x1p-2f,  0x1.2p-2f,  0x1.4p-2f,  0x1.6p-2f,  0x1.8p-2f,  0x1.ap-2f,  0x1.cp-2f,  0x1.ep-2f,
    0x1p-1f,  0x1.2p-1f,  0x1.4p-1f,  0x1.6p-1f,  0x1.8p-1f,  0x1.ap-1f,  0x1.cp-1f,  0x1.ep-1f,
    0x1p+0f,  0x1.2p+0f,  0x1.4p+0f,  0x1.6p+0f,  0x1.8p+0f,  0x1.ap+0f,  0x1.cp+0f,  0x1.ep+0f,
    0x1p+1f,  0x1.2p+1f,  0x1.4p+1f,  0x1.6p+1f,  0x1.8p+1f,  0x1.ap+1f,  0x1.cp+1f,  0x1.ep+1f,
    0x1p+2f,  0x1.2p+2f,  0x1.4p+2f,  0x1.6p+2f,  0x1.8p+2f,  0x1.ap+2f,  0x1.cp+2f,  0x1.ep+2f,
    0x1p+3f,  0x1.2p+3f,  0x1.4p+3f,  0x1.6p+3f,  0x1.8p+3f,  0x1.ap+3f,  0x1.cp+3f,  0x1.ep+3f,
    0x1p+4f,  0x1.2p+4f,  0x1.4p+4f,  0x1.6p+4f,  0x1.8p+4f,  0x1.ap+4f,  0x1.cp+4f,  0x1.ep+4f,
    0x1p+5f,  0x1.2p+5f,  0x1.4p+5f,  0x1.6p+5f,  0x1.8p+5f,  0x1.ap+5f,  0x1.cp+5f,  0x1.ep+5f,
    0x1p+6f,  0x1.2p+6f,  0x1.4p+6f,  0x1.6p+6f,  0x1.8p+6f,  0x1.ap+6f,  0x1.cp+6f,  0x1.ep+6f,
    0x1p+7f,  0x1.2p+7f,  0x1.4p+7f,  0x1.6p+7f,  0x1.8p+7f,  0x1.ap+7f,  0x1.cp+7f,  0x1.ep+7f,
    0x1p+8f,  0x1.2p+8f,  0x1.4p+8f,  0x1.6p+8f,  0x1.8p+8f,  0x1.ap+8f,  0x1.cp+8f,  NAN,
    -0.0f,    -0x1p-9f,   -0x1p-8f,   -0x1.8p-8f, -0x1p-7f,   -0x1.4p-7f, -0x1.8p-7f, -0x1.cp-7f,
    -0x1p-6f, -0x1.2p-6f, -0x1.4p-6f, -0x1.6p-6f, -0x1.8p-6f, -0x1.ap-6f, -0x1.cp-6f, -0x1.ep-6f,
    -0x1p-5f, -0x1.2p-5f, -0x1.4p-5f, -0x1.6p-5f, -0x1.8p-5f, -0x1.ap-5f, -0x1.cp-5f, -0x1.ep-5f,
    -0x1p-4f, -0x1.2p-4f, -0x1.4p-4f, -0x1.6p-4f, -0x1.8p-4f, -0x1.ap-4f, -0x1.cp-4f, -0x1.ep-4f,
    -0x1p-3f, -0x1.2p-3f, -0x1.4p-3f, -0x1.6p-3f, -0x1.8p-3f, -0x1.ap-3f, -0x1.cp-3f, -0x1.ep-3f,
    -0x1p-2f, -0x1.2p-2f, -0x1.4p-2f, -0x1.6p-2f, -0x1.8p-2f, -0x1.ap-2f, -0x1.cp-2f, -0x1.ep-2f,
    -0x1p-1f, -0x1.2p-1f, -0x1.4p-1f, -0x1.6p-1f, -0x1.8p-1f, -0x1.ap-1f, -0x1.cp-1f, -0x1.ep-1f,
    -0x1p+0f, -0x1.2p+0f, -0x1.4p+0f, -0x1.6p+0f, -0x1.8p+0f, -0x1.ap+0f, -0x1.cp+0f, -0x1.ep+0f,
    -0x1p+1f, -0x1.2p+1f, -0x1.4p+1f, -0x1.6p+1f, -0x1.8p+1f, -0x1.ap+1f, -0x1.cp+1f, -0x1.ep+1f,
    -0x1p+2f, -0x1.2p+2f, -0x1.4p+2f, -0x1.6p+2f, -0x1.8p+2f, -0x1.ap+2f, -0x1.cp+2f, -0x1.ep+2f,
    -0x1p+3f, -0x1.2p+3f, -0x1.4p+3f, -0x1.6p+3f, -0x1.8p+3f, -0x1.ap+3f, -0x1.cp+3f, -0x1.ep+3f,
    -0x1p+4f, -0x1.2p+4f, -0x1.4p+4f, -0x1.6p+4f, -0x1.8p+4f, -0x1.ap+4f, -0x1.cp+4f, -0x1.ep+4f,
    -0x1p+5f, -0x1.2p+5f, -0x1.4p+5f, -0x1.6p+5f, -0x1.8p+5f, -0x1.ap+5f, -0x1.cp+5f, -0x1.ep+5f,
    -0x1p+6f, -0x1.2p+6f, -0x1.4p+6f, -0x1.6p+6f, -0x1.8p+6f, -0x1.ap+6f, -0x1.cp+6f, -0x1.ep+6f,
    -0x1p+7f, -0x1.2p+7f, -0x1.4p+7f, -0x1.6p+7f, -0x1.8p+7f, -0x1.ap+7f, -0x1.cp+7f, -0x1.ep+7f,
    -0x1p+8f, -0x1.2p+8f, -0x1.4p+8f, -0x1.6p+8f, -0x1.8p+8f, -0x1.ap+8f, -0x1.cp+8f, NAN,
};

void tw_kv_fp8_dequantize(const uint8_t *q, int32_t n, float scale, float *out) {
  for (int32_t d = 0; d < n; d++) out[d] = tw_e4m3_table[q[d]] * scale;
}

tw_dtype_t tw_kv_pool_dtype(tw_kv_dtype_t kv, tw_dtype_t native) {
  return kv == TW_KV_DTYPE_FP8 ? TW_DTYPE_F8_E4M3 : native;
}

int64_t tw_kv_head_bytes(tw_dtype_t pool_dtype, int32_t block_size, int32_t head_dim) {
  int64_t n = (int64_t)block_size * head_dim;
  switch (pool_dtype) {
    case TW_DTYPE_F32: return 4 * n;
    case TW_DTYPE_BF16: return 2 * n;
    case TW_DTYPE_F8_E4M3: return n + 4ll * block_size;
    default: return 0;
  }
}

const char *tw_kv_dtype_name(tw_kv_dtype_t kv) { return kv == TW_KV_DTYPE_FP8 ? "fp8" : "bf16"; }

const char *tw_kv_pool_dtype_name(tw_dtype_t pool_dtype) {
  switch (pool_dtype) {
    case TW_DTYPE_F32: return "f32";
    case TW_DTYPE_BF16: return "bf16";
    case TW_DTYPE_F8_E4M3: return "fp8 e4m3 + per-head scales";
    default: return "?";
  }
}

tw_status_t tw_kv_dtype_mismatch(tw_dtype_t src, tw_dtype_t dst) {
  return tw_err(TW_ERR_UNSUPPORTED,
                "kv handoff: the prefill worker's KV cache is %s, the decode pool's %s: start both "
                "with the same --kv-dtype (and backend)",
                tw_kv_pool_dtype_name(src), tw_kv_pool_dtype_name(dst));
}

int tw_kv_dtype_opt(const char *text, void *dst, char *err, size_t errlen) {
  int32_t *v = dst;
  if (text && (!strcmp(text, "bf16") || !strcmp(text, "auto")))
    *v = TW_KV_DTYPE_AUTO;
  else if (text && !strcmp(text, "fp8"))
    *v = TW_KV_DTYPE_FP8;
  else {
    snprintf(err, errlen, "must be bf16, fp8 or auto, got '%s'", text ? text : "");
    return -1;
  }
  return 0;
}
