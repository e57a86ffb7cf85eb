/* matmul.c: float32 GEMV/GEMM over bf16 and MXFP4 weights read in place.
 *
 * Weights are never converted as a whole: each thread converts a tile of
 * TW_MM_TILE values of up to four weight rows into a small stack buffer and
 * uses it for every token of the batch, so each weight byte is read once per
 * call whatever T is (prefill batches a whole chunk into one call). Output
 * rows are split evenly over the pool's threads. The inner products use
 * 8-lane GCC vector types (plain SSE/AVX code without -march) with f32
 * accumulators; lanes are summed in a fixed order, so results do not depend
 * on the thread count. */
#include "common/cpu/cpu_ops.h"

#include "common/model.h"

#include <math.h>
#include <string.h>

#define TW_MM_TILE 512 /* values per row tile: 4 rows x 2 KiB stay in L1 */
#define TW_MM_ROWS 4   /* weight rows per micro-kernel */

typedef float tw_v8f __attribute__((vector_size(32)));
typedef uint16_t tw_v8u16 __attribute__((vector_size(16)));
typedef uint32_t tw_v8u32 __attribute__((vector_size(32)));

/* FP4 E2M1 nibble -> value (spec §3.4). */
static const float tw_mm_fp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Vectors are never passed to or returned from functions: without -mavx
 * that would change the ABI (-Wpsabi). */
#define TW_V8F_LOAD(v, p) memcpy(&(v), (p), sizeof(tw_v8f))

static inline float tw_v8f_sum(const tw_v8f *v) {
  return (((*v)[0] + (*v)[4]) + ((*v)[1] + (*v)[5])) + (((*v)[2] + (*v)[6]) + ((*v)[3] + (*v)[7]));
}

/* bf16 -> f32 for n values (exact). */
static void tw_bf16_convert(const uint16_t *src, int64_t n, float *dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    tw_v8u16 h;
    memcpy(&h, src + i, sizeof(h));
    tw_v8u32 u = __builtin_convertvector(h, tw_v8u32) << 16;
    memcpy(dst + i, &u, sizeof(u));
  }
  for (; i < n; i++) dst[i] = tw_bf16_to_f32(src[i]);
}

void tw_cpu_mxfp4_row(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks,
                      float *out) {
  for (int64_t g = 0; g < n_blocks; g++) {
    float sc = ldexpf(1.0f, (int)scales[g] - 127);
    const uint8_t *b = blocks + g * 16;
    float *o = out + g * 32;
    for (int j = 0; j < 16; j++) {
      o[2 * j] = tw_mm_fp4[b[j] & 0x0f] * sc;
      o[2 * j + 1] = tw_mm_fp4[b[j] >> 4] * sc;
    }
  }
}

/* Dot products of nr (<= 4) weight rows w[r] (f32, stride TW_MM_TILE) with
 * x[0..n). */
static void tw_dot_rows(const float *w, int nr, const float *x, int64_t n, float *s) {
  tw_v8f acc[TW_MM_ROWS] = {{0}};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    tw_v8f xv, wv;
    TW_V8F_LOAD(xv, x + i);
    for (int r = 0; r < nr; r++) {
      TW_V8F_LOAD(wv, w + r * TW_MM_TILE + i);
      acc[r] += wv * xv;
    }
  }
  for (int r = 0; r < nr; r++) {
    float tail = 0.0f;
    for (int64_t j = i; j < n; j++) tail += w[r * TW_MM_TILE + j] * x[j];
    s[r] = tw_v8f_sum(&acc[r]) + tail;
  }
}

typedef enum { TW_MM_BF16, TW_MM_MXFP4 } tw_mm_kind_t;

typedef struct {
  tw_mm_kind_t kind;
  const float *x;
  int64_t T, K, N;
  const uint16_t *w;       /* bf16 [N, K] */
  const uint8_t *blocks;   /* mxfp4 [N, K/32, 16] */
  const uint8_t *scales;   /* mxfp4 [N, K/32] */
  const uint16_t *bias;    /* bf16 [N] or NULL */
  float *y;
} tw_mm_ctx_t;

/* Rows [r0, r1) of this thread: equal shares rounded to the micro-kernel. */
static void tw_mm_share(int64_t n, int ti, int nt, int64_t align, int64_t *r0, int64_t *r1) {
  int64_t per = (n + nt - 1) / nt;
  per = (per + align - 1) / align * align;
  *r0 = per * ti < n ? per * ti : n;
  *r1 = *r0 + per < n ? *r0 + per : n;
}

static void tw_mm_rows_task(void *ctx_v, int ti, int nt) {
  const tw_mm_ctx_t *c = ctx_v;
  float wbuf[TW_MM_ROWS * TW_MM_TILE] __attribute__((aligned(32)));
  int64_t r0, r1;
  tw_mm_share(c->N, ti, nt, TW_MM_ROWS, &r0, &r1);
  for (int64_t r = r0; r < r1; r += TW_MM_ROWS) {
    int nr = (int)(r1 - r < TW_MM_ROWS ? r1 - r : TW_MM_ROWS);
    for (int64_t k0 = 0; k0 < c->K; k0 += TW_MM_TILE) {
      int64_t kl = c->K - k0 < TW_MM_TILE ? c->K - k0 : TW_MM_TILE;
      for (int i = 0; i < nr; i++) {
        float *dst = wbuf + i * TW_MM_TILE;
        if (c->kind == TW_MM_BF16) {
          tw_bf16_convert(c->w + (r + i) * c->K + k0, kl, dst);
        } else {
          int64_t nb = c->K / 32;
          tw_cpu_mxfp4_row(c->blocks + ((r + i) * nb + k0 / 32) * 16,
                           c->scales + (r + i) * nb + k0 / 32, kl / 32, dst);
        }
      }
      for (int64_t t = 0; t < c->T; t++) {
        float s[TW_MM_ROWS];
        tw_dot_rows(wbuf, nr, c->x + t * c->K + k0, kl, s);
        float *yt = c->y + t * c->N + r;
        if (k0 == 0) {
          for (int i = 0; i < nr; i++) yt[i] = s[i];
        } else {
          for (int i = 0; i < nr; i++) yt[i] += s[i];
        }
      }
    }
    if (c->bias) {
      for (int64_t t = 0; t < c->T; t++)
        for (int i = 0; i < nr; i++) c->y[t * c->N + r + i] += tw_bf16_to_f32(c->bias[r + i]);
    }
  }
}

void tw_cpu_matmul_bf16(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                        const uint16_t *w, const uint16_t *maybe_bias, int64_t N, float *y) {
  tw_mm_ctx_t c = {.kind = TW_MM_BF16, .x = x, .T = T, .K = K, .N = N, .w = w,
                   .bias = maybe_bias, .y = y};
  tw_cpu_pool_run(pool, tw_mm_rows_task, &c);
}

void tw_cpu_matmul_mxfp4(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                         const uint8_t *blocks, const uint8_t *scales,
                         const uint16_t *maybe_bias, int64_t N, float *y) {
  tw_mm_ctx_t c = {.kind = TW_MM_MXFP4, .x = x, .T = T, .K = K, .N = N, .blocks = blocks,
                   .scales = scales, .bias = maybe_bias, .y = y};
  tw_cpu_pool_run(pool, tw_mm_rows_task, &c);
}

/* x @ W, W [K, N]: each thread owns a range of output columns and streams
 * the K weight rows through a column tile, doing y[t] += x[t][k] * W[k]. */
static void tw_mm_kn_task(void *ctx_v, int ti, int nt) {
  const tw_mm_ctx_t *c = ctx_v;
  float wseg[TW_MM_TILE] __attribute__((aligned(32)));
  int64_t c0, c1;
  tw_mm_share(c->N, ti, nt, 8, &c0, &c1);
  for (int64_t n0 = c0; n0 < c1; n0 += TW_MM_TILE) {
    int64_t nl = c1 - n0 < TW_MM_TILE ? c1 - n0 : TW_MM_TILE;
    for (int64_t t = 0; t < c->T; t++) {
      float *yt = c->y + t * c->N + n0;
      for (int64_t j = 0; j < nl; j++) yt[j] = 0.0f;
    }
    for (int64_t k = 0; k < c->K; k++) {
      tw_bf16_convert(c->w + k * c->N + n0, nl, wseg);
      for (int64_t t = 0; t < c->T; t++) {
        float xk = c->x[t * c->K + k];
        float *yt = c->y + t * c->N + n0;
        int64_t j = 0;
        tw_v8f xv = {xk, xk, xk, xk, xk, xk, xk, xk};
        for (; j + 8 <= nl; j += 8) {
          tw_v8f yv, wv;
          TW_V8F_LOAD(yv, yt + j);
          TW_V8F_LOAD(wv, wseg + j);
          yv += xv * wv;
          memcpy(yt + j, &yv, sizeof(yv));
        }
        for (; j < nl; j++) yt[j] += xk * wseg[j];
      }
    }
    if (c->bias) {
      for (int64_t t = 0; t < c->T; t++)
        for (int64_t j = 0; j < nl; j++) c->y[t * c->N + n0 + j] += tw_bf16_to_f32(c->bias[n0 + j]);
    }
  }
}

void tw_cpu_matmul_bf16_kn(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                           const uint16_t *w, const uint16_t *maybe_bias, int64_t N, float *y) {
  tw_mm_ctx_t c = {.kind = TW_MM_BF16, .x = x, .T = T, .K = K, .N = N, .w = w,
                   .bias = maybe_bias, .y = y};
  tw_cpu_pool_run(pool, tw_mm_kn_task, &c);
}
