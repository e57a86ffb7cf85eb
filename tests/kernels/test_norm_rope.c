/* test_norm_rope.c: the RMSNorm + residual kernel, the YaRN RoPE table and
 * the RoPE + KV-cache write kernel (norm_rope.h) against float64 references
 * of spec §2.3 and §2.5 written here, on fresh random inputs (seed printed).
 *
 *  - RoPE table: the spec's float64 (C, S) samples (§2.5 table), |err| <= 2e-7
 *    (the values are given to 8 decimals; f32 rounding is 6e-8 relative).
 *  - RMSNorm: x_resid after the add must equal the f32 sum exactly (one f32
 *    add, same rounding on both sides); out bf16 within relative L2 1e-2
 *    (bf16 output rounding is ~2^-9).
 *  - RoPE (f32 QKV in, bf16 out): q and k within relative L2 4e-3 of a
 *    float64 rotation with float64 angles, and each value one bf16 rounding
 *    of the fp32 rotation; the pool must hold bf16(v) bit-exactly at each
 *    token's slot, and every other slot must keep its NaN poison.
 *  - the RoPE table is also compared with the CPU backend's
 *    tw_cpu_rope_init/tw_cpu_rope_table (host only).
 *  - RoPE + KV write into the fp8 KV cache (tw_cuda_rope_kv_write_fp8,
 *    common/kv/kv_fp8.h) against common/kv/kv_fp8.c's quantization of the same
 *    rotation in f32 on the host: v's bytes and scales bit-exact, k's scale
 *    within 1e-6 relative and each byte within one e4m3 code (the device may
 *    fuse the rotation's multiply-add), under 1% of k's bytes off at all;
 *    untouched slots keep their poison.
 * Exit 77 when no GPU is usable (after the host-only table checks). */
#include "attn_test_util.h"

#include "common/engine/cpu/cpu_ops.h"
#include "common/kv/kv_fp8.h"
#include "kernels/norm_rope.h"

static tw_model_config_t tt_gptoss_config(int head_dim) {
  tw_model_config_t c;
  memset(&c, 0, sizeof c);
  c.head_dim = head_dim;
  c.rope_theta = 150000.0;
  c.rope_factor = 32.0;
  c.rope_beta_fast = 32.0;
  c.rope_beta_slow = 1.0;
  c.rope_original_max_pos = 4096;
  c.rope_truncate = false;
  return c;
}

/* float64 inv_freq of spec §2.5 (independent of the kernel file's code path). */
static void tt_inv_freq(int D, double *inv) {
  const double theta = 150000.0, f = 32.0, L0 = 4096.0;
  const double low = (D / 2.0) * log(L0 / (32.0 * 2 * M_PI)) / log(theta);
  const double high = (D / 2.0) * log(L0 / (1.0 * 2 * M_PI)) / log(theta);
  for (int i = 0; i < D / 2; i++) {
    const double base = pow(theta, 2.0 * i / D);
    double r = (i - low) / (high - low);
    r = r < 0 ? 0 : (r > 1 ? 1 : r);
    inv[i] = (1.0 / (f * base)) * r + (1.0 / base) * (1 - r);
  }
}

#define TT_CONC 1.3465735902799727

static int tt_table_case(void) {
  const int max_pos = 131072, half = 32;
  float *c = malloc(sizeof(float) * max_pos * half), *s = malloc(sizeof(float) * max_pos * half);
  tw_model_config_t cfg = tt_gptoss_config(64);
  if (tw_cuda_rope_table_fill(&cfg, max_pos, c, s) != TW_OK) {
    printf("FAIL rope_table: status\n");
    return 1;
  }
  static const struct { int p, i; double C, S; } smp[] = {
      {1, 0, 0.72755682, 1.13310261},     {1, 9, 1.34589682, 0.04268690},
      {100, 0, 1.16117582, -0.68185860},  {4096, 17, 1.16204460, 0.68037695},
      {131071, 9, -1.08824612, 0.79308311}};
  int rc = 0;
  double worst = 0;
  for (size_t k = 0; k < sizeof smp / sizeof smp[0]; k++) {
    const double ec = fabs(c[(size_t)smp[k].p * half + smp[k].i] - smp[k].C);
    const double es = fabs(s[(size_t)smp[k].p * half + smp[k].i] - smp[k].S);
    if (ec > worst) worst = ec;
    if (es > worst) worst = es;
  }
  rc = worst > 2e-7;
  printf("%s rope_table(gptoss, spec §2.5 samples): max |err| %.2e (tol 2e-07)\n",
         rc ? "FAIL" : "ok  ", worst);
  /* and against the CPU backend's tables (both float64 rounded to f32: equal
   * up to the last bit of the phase product) at every 97th position */
  double inv[32], conc;
  float cc[32], cs[32];
  tw_cpu_rope_init(&cfg, inv, &conc);
  double worst_cpu = 0;
  for (int p = 0; p < max_pos; p += 97) {
    tw_cpu_rope_table(inv, half, conc, p, cc, cs);
    for (int i = 0; i < half; i++) {
      const double e1 = fabs(cc[i] - c[(size_t)p * half + i]);
      const double e2 = fabs(cs[i] - s[(size_t)p * half + i]);
      if (e1 > worst_cpu) worst_cpu = e1;
      if (e2 > worst_cpu) worst_cpu = e2;
    }
  }
  const int rc_cpu = worst_cpu > 1e-6;
  printf("%s rope_table vs tw_cpu_rope_table (every 97th position): max |err| %.2e (tol 1e-06)\n",
         rc_cpu ? "FAIL" : "ok  ", worst_cpu);
  rc |= rc_cpu;
  free(c);
  free(s);
  return rc;
}

static int tt_rmsnorm_case(int T, int H, int mode) {
  char name[128];
  static const char *modes[] = {"none", "bf16", "f32"};
  snprintf(name, sizeof name, "rmsnorm_residual(H=%d,T=%d,delta=%s)", H, T, modes[mode]);
  const size_t n = (size_t)T * H;
  float *x = malloc(n * 4), *xo = malloc(n * 4), *df = malloc(n * 4);
  uint16_t *db = malloc(n * 2), *w = malloc(H * 2), *out = malloc(n * 2);
  for (size_t i = 0; i < n; i++) {
    x[i] = tt_uniform(3.0f) + 0.01f;
    df[i] = tt_uniform(2.0f);
    db[i] = tt_rand_bf16(2.0f);
  }
  for (int i = 0; i < H; i++) w[i] = tt_f2bf(0.5f + (tt_uniform(0.5f) + 0.5f));
  float *d_x;
  void *d_delta = NULL, *d_w, *d_out;
  TT_CUDA(cudaMalloc((void **)&d_x, n * 4));
  TT_CUDA(cudaMalloc(&d_w, H * 2));
  TT_CUDA(cudaMalloc(&d_out, n * 2));
  TT_CUDA(cudaMemcpy(d_x, x, n * 4, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_w, w, H * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_out, 0xff, n * 2));
  if (mode == 1) {
    TT_CUDA(cudaMalloc(&d_delta, n * 2));
    TT_CUDA(cudaMemcpy(d_delta, db, n * 2, cudaMemcpyHostToDevice));
  } else if (mode == 2) {
    TT_CUDA(cudaMalloc(&d_delta, n * 4));
    TT_CUDA(cudaMemcpy(d_delta, df, n * 4, cudaMemcpyHostToDevice));
  }
  tw_status_t st = tw_cuda_rmsnorm_residual(d_x, d_delta, mode == 1 ? TW_DTYPE_BF16 : TW_DTYPE_F32,
                                            d_w, 1e-5f, T, H, d_out, 0);
  if (st != TW_OK) {
    printf("FAIL %s: status %d\n", name, (int)st);
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(xo, d_x, n * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(out, d_out, n * 2, cudaMemcpyDeviceToHost));
  long x_mismatch = 0;
  tt_l2_t l2 = {0};
  for (int t = 0; t < T; t++) {
    double ss = 0;
    for (int i = 0; i < H; i++) {
      const size_t k = (size_t)t * H + i;
      const float xe = mode == 0 ? x[k] : (mode == 1 ? x[k] + tt_bf2f(db[k]) : x[k] + df[k]);
      x_mismatch += xo[k] != xe;
      ss += (double)xe * xe;
    }
    const double r = 1.0 / sqrt(ss / H + 1e-5);
    for (int i = 0; i < H; i++) {
      const size_t k = (size_t)t * H + i;
      tt_l2_add(&l2, tt_bf2f(out[k]), (double)xo[k] * r * tt_bf2f(w[i]));
    }
  }
  int rc = tt_l2_report(name, &l2, 1e-2);
  if (x_mismatch) {
    printf("FAIL %s: %ld residual values differ from the f32 sum\n", name, x_mismatch);
    rc = 1;
  }
  free(x);
  free(xo);
  free(df);
  free(db);
  free(w);
  free(out);
  cudaFree(d_x);
  cudaFree(d_w);
  cudaFree(d_out);
  cudaFree(d_delta);
  return rc;
}

/* Values of the pool's slots not marked in `written` that are no longer the
 * 0xffff poison (K and V of every kv head). */
static long tt_unwritten_changed(const uint16_t *pool, const char *written, int n_slots, int nkv,
                                 int bs, int D) {
  long bad = 0;
  for (int sidx = 0; sidx < n_slots; sidx++) {
    if (written[sidx]) continue;
    const int blk = sidx / bs, sl = sidx % bs;
    for (int kv = 0; kv < 2; kv++)
      for (int g = 0; g < nkv; g++)
        for (int d = 0; d < D; d++)
          bad += pool[(((size_t)blk * 2 + kv) * nkv + g) * bs * D + sl * D + d] != 0xffff;
  }
  return bad;
}

/* Whether bf16 `got` is one rounding of a*c - b*s (or a*c + b*s, sign in
 * b*s) computed in fp32: within half a bf16 ulp of the exact value, plus the
 * fp32 error of the products and the sum (a generous 2^-22 of the terms).
 * Rounding the inputs to bf16 first leaves errors near 2^-9 of the terms. */
static int tt_one_rounding(uint16_t got, double ac, double bs) {
  const double exact = ac + bs, g = tt_bf2f(got);
  int e = 0;
  frexp(g, &e);
  const double half_ulp = g != 0.0 ? ldexp(1.0, e - 9) : 0.0;
  return fabs(g - exact) <= half_ulp + ldexp(fabs(ac) + fabs(bs), -22) + ldexp(fabs(exact), -23);
}

/* tw_cuda_rope_kv_write_f32: f32 QKV rows (padded stride), q out to its own
 * bf16 buffer (padded stride), k and v into the pool. q and k against the
 * rotation in double (rel L2 <= 4e-3), and every rotated value must be one
 * bf16 rounding of the fp32 rotation with the same tables
 * (tt_one_rounding); v must be exactly bf16(v); q_out padding, qkv and
 * unwritten slots unchanged. */
static int tt_rope_f32_case(int T, int nq, int nkv, const float *d_cos, const float *d_sin,
                            const float *h_cos, const float *h_sin, int max_pos) {
  char name[128];
  const int D = 64, half = 32, bs = 16;
  snprintf(name, sizeof name, "rope_kv_write_f32(NQ=%d,NKV=%d,T=%d)", nq, nkv, T);
  const int64_t stride = (int64_t)(nq + 2 * nkv) * D + 4, qstride = (int64_t)nq * D + 8;
  const size_t n = (size_t)T * stride, nqo = (size_t)T * qstride;
  float *qkv = malloc(n * 4), *qkv_after = malloc(n * 4);
  uint16_t *qo = malloc(nqo * 2);
  int32_t *pos = malloc(4 * T), *slots = malloc(4 * T);
  const int n_blocks = (T + bs - 1) / bs + 2, n_slots = n_blocks * bs;
  const size_t pool_elems = (size_t)n_blocks * 2 * nkv * bs * D;
  uint16_t *pool = malloc(pool_elems * 2);
  for (size_t i = 0; i < n; i++) qkv[i] = tt_normal(2.0f);
  for (int t = 0; t < T; t++) {
    pos[t] = t == 0 ? max_pos - 1 : (t == 1 ? 0 : tt_randint(0, max_pos - 1));
    slots[t] = (t % 5 == 3) ? -1 : (n_slots - 1 - t); /* some tokens write no KV */
  }
  void *d_qkv, *d_pool, *d_qo;
  int32_t *d_pos, *d_slots;
  TT_CUDA(cudaMalloc(&d_qkv, n * 4));
  TT_CUDA(cudaMalloc(&d_qo, nqo * 2));
  TT_CUDA(cudaMalloc(&d_pool, pool_elems * 2));
  TT_CUDA(cudaMalloc((void **)&d_pos, 4 * T));
  TT_CUDA(cudaMalloc((void **)&d_slots, 4 * T));
  TT_CUDA(cudaMemcpy(d_qkv, qkv, n * 4, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_pos, pos, 4 * T, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_slots, slots, 4 * T, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_pool, 0xff, pool_elems * 2));
  TT_CUDA(cudaMemset(d_qo, 0xff, nqo * 2));
  tw_status_t st = tw_cuda_rope_kv_write_f32(d_qkv, stride, T, nq, nkv, D, d_pos, d_cos, d_sin,
                                             max_pos, d_slots, d_pool, bs, d_qo, qstride, 0);
  if (st != TW_OK) {
    printf("FAIL %s: status %d: %s\n", name, (int)st, tw_last_error());
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(qkv_after, d_qkv, n * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(qo, d_qo, nqo * 2, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(pool, d_pool, pool_elems * 2, cudaMemcpyDeviceToHost));
  double inv[32];
  tt_inv_freq(D, inv);
  tt_l2_t l2 = {0};
  long bad = 0, n_off = 0, n_rounded = 0;
  char *written = calloc(n_slots, 1);
  for (int t = 0; t < T; t++) {
    const float *xin = qkv + t * stride;
    const int slot = slots[t], blk = slot / bs, sl = slot % bs;
    if (slot >= 0) written[slot] = 1;
    for (int h = 0; h < nq + nkv; h++) {
      if (h >= nq && slot < 0) continue;
      for (int i = 0; i < half; i++) {
        const double a = xin[h * D + i], b = xin[h * D + i + half];
        const double C = TT_CONC * cos(pos[t] * inv[i]), S = TT_CONC * sin(pos[t] * inv[i]);
        const uint16_t *o =
            h < nq ? qo + t * qstride + h * D
                   : pool + (((size_t)blk * 2 + 0) * nkv + (h - nq)) * bs * D + (size_t)sl * D;
        tt_l2_add(&l2, tt_bf2f(o[i]), a * C - b * S);
        tt_l2_add(&l2, tt_bf2f(o[i + half]), b * C + a * S);
        const double fc = h_cos[(size_t)pos[t] * half + i], fs = h_sin[(size_t)pos[t] * half + i];
        n_rounded += 2;
        n_off += !tt_one_rounding(o[i], a * fc, -b * fs);
        n_off += !tt_one_rounding(o[i + half], b * fc, a * fs);
      }
    }
    for (int64_t k = nq * D; k < qstride; k++) bad += qo[t * qstride + k] != 0xffff;
    if (slot < 0) continue;
    for (int g = 0; g < nkv; g++)
      for (int d = 0; d < D; d++)
        bad += pool[(((size_t)blk * 2 + 1) * nkv + g) * bs * D + (size_t)sl * D + d] !=
               tt_f2bf(xin[(nq + nkv + g) * D + d]);
  }
  bad += memcmp(qkv, qkv_after, n * 4) != 0;
  bad += tt_unwritten_changed(pool, written, n_slots, nkv, bs, D);
  int rc = tt_l2_report(name, &l2, 4e-3);
  if (bad) {
    printf("FAIL %s: %ld values wrong (v in the pool, q padding, qkv or unwritten slots)\n", name,
           bad);
    rc = 1;
  }
  printf("%s %s: %ld of %ld rotated values are not one bf16 rounding of the fp32 rotation\n",
         n_off ? "FAIL" : "ok  ", name, n_off, n_rounded);
  rc |= n_off != 0;
  free(written); free(qkv); free(qkv_after); free(qo); free(pos); free(slots); free(pool);
  cudaFree(d_qkv); cudaFree(d_qo); cudaFree(d_pool); cudaFree(d_pos); cudaFree(d_slots);
  return rc;
}

/* tw_cuda_rope_kv_write_fp8 (see the top of the file). */
static int tt_rope_fp8_case(int T, int nq, int nkv, const float *d_cos, const float *d_sin,
                            const float *h_cos, const float *h_sin, int max_pos) {
  char name[128];
  const int D = 64, half = 32, bs = 16, part = bs * (D + 4);
  snprintf(name, sizeof name, "rope_kv_write_fp8(NQ=%d,NKV=%d,T=%d)", nq, nkv, T);
  const int64_t stride = (int64_t)(nq + 2 * nkv) * D + 4, qstride = (int64_t)nq * D + 8;
  const size_t n = (size_t)T * stride;
  float *qkv = malloc(n * 4);
  int32_t *pos = malloc(4 * T), *slots = malloc(4 * T);
  const int n_blocks = (T + bs - 1) / bs + 2;
  const size_t pool_bytes = (size_t)n_blocks * 2 * nkv * part;
  uint8_t *pool = malloc(pool_bytes);
  char *written = calloc((size_t)n_blocks * bs, 1);
  for (size_t i = 0; i < n; i++) qkv[i] = tt_normal(2.0f) * (i % 7 == 0 ? 30.0f : 1.0f);
  for (int t = 0; t < T; t++) {
    pos[t] = t == 0 ? max_pos - 1 : (t == 1 ? 0 : tt_randint(0, max_pos - 1));
    slots[t] = (t % 5 == 3) ? -1 : (n_blocks * bs - 1 - t);
    if (slots[t] >= 0) written[slots[t]] = 1;
  }
  if (T > 2) /* an all-zero v head: scale 0, zero bytes */
    for (int d = 0; d < D; d++) qkv[2 * stride + (nq + nkv) * D + d] = 0.0f;
  void *d_qkv, *d_pool, *d_qo;
  int32_t *d_pos, *d_slots;
  TT_CUDA(cudaMalloc(&d_qkv, n * 4));
  TT_CUDA(cudaMalloc(&d_qo, (size_t)T * qstride * 2));
  TT_CUDA(cudaMalloc(&d_pool, pool_bytes));
  TT_CUDA(cudaMalloc((void **)&d_pos, 4 * T));
  TT_CUDA(cudaMalloc((void **)&d_slots, 4 * T));
  TT_CUDA(cudaMemcpy(d_qkv, qkv, n * 4, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_pos, pos, 4 * T, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_slots, slots, 4 * T, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_pool, 0xff, pool_bytes));
  tw_status_t st = tw_cuda_rope_kv_write_fp8(d_qkv, stride, T, nq, nkv, D, d_pos, d_cos, d_sin,
                                             max_pos, d_slots, d_pool, bs, d_qo, qstride, 0);
  if (st != TW_OK) {
    printf("FAIL %s: status %d: %s\n", name, (int)st, tw_last_error());
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(pool, d_pool, pool_bytes, cudaMemcpyDeviceToHost));
  long bad = 0, k_off = 0, k_total = 0;
  for (int t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    const int blk = slots[t] / bs, sl = slots[t] % bs;
    for (int kv = 0; kv < 2; kv++)
      for (int g = 0; g < nkv; g++) {
        const float *x = qkv + t * stride + (int64_t)(nq + kv * nkv + g) * D;
        float row[64], s_host, s_dev;
        uint8_t q_host[64];
        for (int i = 0; i < half; i++) {
          const float c = h_cos[(size_t)pos[t] * half + i], sn = h_sin[(size_t)pos[t] * half + i];
          row[i] = kv ? x[i] : x[i] * c - x[i + half] * sn;
          row[i + half] = kv ? x[i + half] : x[i + half] * c + x[i] * sn;
        }
        tw_kv_fp8_quantize(row, D, q_host, &s_host);
        const uint8_t *dst = pool + (((size_t)blk * 2 + kv) * nkv + g) * part;
        memcpy(&s_dev, dst + bs * D + sl * 4, 4);
        if (kv) {
          bad += s_dev != s_host || memcmp(dst + sl * D, q_host, D) != 0;
          continue;
        }
        bad += !(fabsf(s_dev - s_host) <= 1e-6f * s_host);
        for (int d = 0; d < D; d++) {
          const int a = dst[sl * D + d], b = q_host[d];
          k_total++;
          k_off += a != b;
          const float va = tw_e4m3_to_f32((uint8_t)a), vb = tw_e4m3_to_f32((uint8_t)b);
          bad += !(fabsf(va - vb) <= fmaxf(fabsf(va), fabsf(vb)) / 8 + 0x1p-9f); /* one code */
        }
      }
  }
  for (int sl = 0; sl < n_blocks * bs; sl++) /* untouched slots: 0xff bytes and scales */
    for (int kvg = 0; kvg < 2 * nkv && !written[sl]; kvg++) {
      const uint8_t *dst = pool + ((size_t)(sl / bs) * 2 * nkv + kvg) * part;
      for (int d = 0; d < D; d++) bad += dst[(sl % bs) * D + d] != 0xff;
      for (int b = 0; b < 4; b++) bad += dst[bs * D + (sl % bs) * 4 + b] != 0xff;
    }
  const int rc = bad != 0 || k_off * 100 > k_total;
  printf("%s %s: %ld values wrong, %ld of %ld k bytes one code off the host's\n",
         rc ? "FAIL" : "ok  ", name, bad, k_off, k_total);
  free(qkv);
  free(pos);
  free(slots);
  free(pool);
  free(written);
  cudaFree(d_qkv);
  cudaFree(d_qo);
  cudaFree(d_pool);
  cudaFree(d_pos);
  cudaFree(d_slots);
  return rc;
}

int main(void) {
  tt_seed();
  int fails = tt_table_case();
  if (!tt_gpu_available()) {
    printf("no GPU: GPU cases skipped\n");
    return fails ? 1 : TT_SKIP;
  }
  const int Ts[] = {1, 7, 128, 1000};
  for (int m = 0; m < 3; m++)
    for (int i = 0; i < 4; i++) {
      fails += tt_rmsnorm_case(Ts[i], 2880, m);
      fails += tt_rmsnorm_case(Ts[i], 256, m);
    }
  const int max_pos = 131072;
  float *c = malloc(sizeof(float) * max_pos * 32), *s = malloc(sizeof(float) * max_pos * 32);
  tw_model_config_t cfg = tt_gptoss_config(64);
  if (tw_cuda_rope_table_fill(&cfg, max_pos, c, s) != TW_OK) return 1;
  float *d_cos, *d_sin;
  TT_CUDA(cudaMalloc((void **)&d_cos, sizeof(float) * max_pos * 32));
  TT_CUDA(cudaMalloc((void **)&d_sin, sizeof(float) * max_pos * 32));
  TT_CUDA(cudaMemcpy(d_cos, c, sizeof(float) * max_pos * 32, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_sin, s, sizeof(float) * max_pos * 32, cudaMemcpyHostToDevice));
  const int Tr[] = {1, 7, 129, 1000};
  for (int i = 0; i < 4; i++) {
    fails += tt_rope_f32_case(Tr[i], 64, 8, d_cos, d_sin, c, s, max_pos);
    fails += tt_rope_f32_case(Tr[i], 4, 2, d_cos, d_sin, c, s, max_pos);
    fails += tt_rope_fp8_case(Tr[i], 64, 8, d_cos, d_sin, c, s, max_pos);
    fails += tt_rope_fp8_case(Tr[i], 4, 2, d_cos, d_sin, c, s, max_pos);
  }
  free(c);
  free(s);
  cudaFree(d_cos);
  cudaFree(d_sin);
  printf("%s: %d failing case(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
