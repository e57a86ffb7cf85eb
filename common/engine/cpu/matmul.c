/* matmul.c: float32 GEMV/GEMM over bf16 and MXFP4 weights read in place.
 *
 * Weights are never converted as a whole: each thread converts a tile of
 * TW_MM_TILE values of up to four weight rows into a small stack buffer and
 * uses it for every token of the batch, so each weight byte is read once per
 * call whatever T is (prefill batches a whole chunk into one call). Output
 * rows are split evenly over the pool's threads. The inner products use
 * native-width GCC vector types (simd.h) with f32
 * accumulators; lanes are summed in a fixed order, so results do not depend
 * on the thread count. */
#include "common/engine/cpu/cpu_ops.h"

#include "common/engine/cpu/simd.h"
#include "common/model/model.h"

#include <math.h>
#include <string.h>

#define TW_MM_TILE 512 /* values per row tile: 4 rows x 2 KiB stay in L1 */
#define TW_MM_ROWS 4   /* weight rows per micro-kernel */


/* FP4 E2M1 nibble -> value (spec §3.4), and a byte -> (low nibble, high
 * nibble) pair table so a block byte expands with one 8-byte copy. */
#define TW_FP4_MAG(m)                                                                        \
  ((m) == 0 ? 0.0f : (m) == 1 ? 0.5f : (m) == 2 ? 1.0f : (m) == 3 ? 1.5f : (m) == 4 ? 2.0f \
   : (m) == 5 ? 3.0f : (m) == 6 ? 4.0f : 6.0f)
#define TW_FP4(n) (((n) & 8) ? -TW_FP4_MAG((n) & 7) : TW_FP4_MAG((n) & 7))
#define TW_FP4_PAIR(b) {{TW_FP4((b) & 15), TW_FP4((b) >> 4)}}
#define TW_FP4_ROW(h)                                                                        \
  TW_FP4_PAIR((h) * 16 + 0), TW_FP4_PAIR((h) * 16 + 1), TW_FP4_PAIR((h) * 16 + 2),                 \
  TW_FP4_PAIR((h) * 16 + 3), TW_FP4_PAIR((h) * 16 + 4), TW_FP4_PAIR((h) * 16 + 5),                 \
  TW_FP4_PAIR((h) * 16 + 6), TW_FP4_PAIR((h) * 16 + 7), TW_FP4_PAIR((h) * 16 + 8),                 \
  TW_FP4_PAIR((h) * 16 + 9), TW_FP4_PAIR((h) * 16 + 10), TW_FP4_PAIR((h) * 16 + 11),               \
  TW_FP4_PAIR((h) * 16 + 12), TW_FP4_PAIR((h) * 16 + 13), TW_FP4_PAIR((h) * 16 + 14),              \
  TW_FP4_PAIR((h) * 16 + 15)
static const union {
  float f[2];
  uint64_t u; /* both values as one 8-byte lane */
} tw_mm_fp4_pair[256] = {
    TW_FP4_ROW(0),  TW_FP4_ROW(1),  TW_FP4_ROW(2),  TW_FP4_ROW(3), TW_FP4_ROW(4),  TW_FP4_ROW(5),
    TW_FP4_ROW(6),  TW_FP4_ROW(7),  TW_FP4_ROW(8),  TW_FP4_ROW(9), TW_FP4_ROW(10), TW_FP4_ROW(11),
    TW_FP4_ROW(12), TW_FP4_ROW(13), TW_FP4_ROW(14), TW_FP4_ROW(15)};

/* bf16 -> f32 for n values (exact). */
static void tw_bf16_convert(const uint16_t *src, int64_t n, float *dst) {
  int64_t i = 0;
  for (; i + TW_VL <= n; i += TW_VL) {
    tw_vu16 h;
    memcpy(&h, src + i, sizeof(h));
    tw_vu32 u = __builtin_convertvector(h, tw_vu32) << 16;
    memcpy(dst + i, &u, sizeof(u));
  }
  for (; i < n; i++) dst[i] = tw_bf16_to_f32(src[i]);
}

void tw_cpu_mxfp4_row(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks,
                      float *out) {
  for (int64_t g = 0; g < n_blocks; g++) {
    float sc;
    if (scales[g] != 0 && scales[g] != 255) { /* 2^(s-127) is a normal float: exponent bits */
      uint32_t bits = (uint32_t)scales[g] << 23;
      memcpy(&sc, &bits, sizeof(sc));
    } else {
      sc = ldexpf(1.0f, (int)scales[g] - 127);
    }
    const uint8_t *b = blocks + g * 16;
    float *o = out + g * 32;
    /* lanes are filled in registers: storing 8-byte pairs and reloading them
     * as one vector stalls store-to-load forwarding (measured 2x slower) */
    tw_vf scv = (tw_vf){0} + sc, v; /* exact: FP4 values times a power of two */
    for (int k = 0; k < 32; k += TW_VL) {
      tw_vu64 q;
      for (int l = 0; l < TW_VL / 2; l++) q[l] = tw_mm_fp4_pair[b[k / 2 + l]].u;
      v = (tw_vf)q * scv;
      TW_VF_STORE(o + k, v);
    }
  }
}

/* Dot products of 4 weight rows w[r] (f32, stride TW_MM_TILE) with x[0..n):
 * four named accumulators so they stay in registers. */
static void tw_dot4(const float *w, const float *x, int64_t n, float *s) {
  tw_vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, xv, w0, w1, w2, w3;
  int64_t i = 0;
  for (; i + TW_VL <= n; i += TW_VL) {
    TW_VF_LOAD(xv, x + i);
    TW_VF_LOAD(w0, w + i);
    TW_VF_LOAD(w1, w + TW_MM_TILE + i);
    TW_VF_LOAD(w2, w + 2 * TW_MM_TILE + i);
    TW_VF_LOAD(w3, w + 3 * TW_MM_TILE + i);
    a0 += w0 * xv;
    a1 += w1 * xv;
    a2 += w2 * xv;
    a3 += w3 * xv;
  }
  float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
  for (; i < n; i++) {
    t0 += w[i] * x[i];
    t1 += w[TW_MM_TILE + i] * x[i];
    t2 += w[2 * TW_MM_TILE + i] * x[i];
    t3 += w[3 * TW_MM_TILE + i] * x[i];
  }
  s[0] = tw_vf_sum(&a0) + t0;
  s[1] = tw_vf_sum(&a1) + t1;
  s[2] = tw_vf_sum(&a2) + t2;
  s[3] = tw_vf_sum(&a3) + t3;
}

/* The same for one row (the last rows of a thread's share). Same
 * accumulation order per row as tw_dot4, so results do not depend on how
 * rows are grouped. */
static float tw_dot1(const float *w, const float *x, int64_t n) {
  tw_vf a0 = {0}, xv, w0;
  int64_t i = 0;
  for (; i + TW_VL <= n; i += TW_VL) {
    TW_VF_LOAD(xv, x + i);
    TW_VF_LOAD(w0, w + i);
    a0 += w0 * xv;
  }
  float t0 = 0.0f;
  for (; i < n; i++) t0 += w[i] * x[i];
  return tw_vf_sum(&a0) + t0;
}

static void tw_dot_rows(const float *w, int nr, const float *x, int64_t n, float *s) {
  if (nr == TW_MM_ROWS) {
    tw_dot4(w, x, n, s);
    return;
  }
  for (int r = 0; r < nr; r++) s[r] = tw_dot1(w + r * TW_MM_TILE, x, n);
}

typedef enum { TW_MM_BF16, TW_MM_MXFP4 } tw_mm_kind_t;

typedef struct {
  tw_mm_kind_t kind;
  const float *x;
  int64_t T, K, N;
  const uint16_t *w;       /* bf16 [N, K] */
  int64_t ldw;             /* bf16 rows: elements between rows of w (K unless strided) */
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
          tw_bf16_convert(c->w + (r + i) * c->ldw + k0, kl, dst);
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
  tw_mm_ctx_t c = {.kind = TW_MM_BF16, .x = x, .T = T, .K = K, .N = N, .w = w, .ldw = K,
                   .bias = maybe_bias, .y = y};
  tw_cpu_pool_run(pool, tw_mm_rows_task, &c);
}

void tw_cpu_matmul_bf16_ld(tw_cpu_pool_t *pool, const float *x, int64_t T, int64_t K,
                           const uint16_t *w, int64_t ldw, const uint16_t *maybe_bias, int64_t N,
                           float *y) {
  tw_mm_ctx_t c = {.kind = TW_MM_BF16, .x = x, .T = T, .K = K, .N = N, .w = w, .ldw = ldw,
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
        tw_vf xv = xk - (tw_vf){0}; /* broadcast */
        for (; j + TW_VL <= nl; j += TW_VL) {
          tw_vf yv, wv;
          TW_VF_LOAD(yv, yt + j);
          TW_VF_LOAD(wv, wseg + j);
          yv += xv * wv;
          TW_VF_STORE(yt + j, yv);
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
