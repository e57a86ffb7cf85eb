/* test_cpu_ops.c: each CPU operator against its formula (spec §2, §3.4),
 * with the reference computed here independently in double precision on
 * seeded random inputs, plus the spec's own reference values for RoPE
 * (§2.5) and MXFP4 (§3.4). Bounds: the operators accumulate in float32, so
 * relative L2 errors of a few 1e-7 are expected; 1e-5 leaves margin while
 * still catching any formula or indexing mistake (those give >1e-2). */
#include "common/engine/cpu/cpu_ops.h"
#include "common/model/model.h"

#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static uint16_t bf16_rand(uint64_t *s, double lo, double hi) {
  return tw_f32_to_bf16((float)tw_test_uniform(s, lo, hi));
}
static double bf16_d(uint16_t h) { return (double)tw_bf16_to_f32(h); }

/* ---- RMSNorm §2.3 ---- */
static void test_rmsnorm(void) {
  uint64_t seed = 1;
  enum { T = 3, H = 264 };
  float x[T * H], y[T * H];
  uint16_t w[H];
  double ref[T * H];
  for (int i = 0; i < T * H; i++) x[i] = (float)tw_test_uniform(&seed, -3, 3);
  for (int i = 0; i < H; i++) w[i] = bf16_rand(&seed, 0.5, 1.5);
  const double eps = 1e-5;
  for (int t = 0; t < T; t++) {
    double ss = 0;
    for (int i = 0; i < H; i++) ss += (double)x[t * H + i] * x[t * H + i];
    double r = 1.0 / sqrt(ss / H + eps);
    for (int i = 0; i < H; i++) ref[t * H + i] = x[t * H + i] * r * bf16_d(w[i]);
  }
  tw_cpu_rmsnorm(x, T, H, w, (float)eps, y);
  double e = tw_test_rel_l2_f(y, ref, T * H);
  EXPECT(e < 1e-6, "rmsnorm rel l2 %.3g", e);
  tw_cpu_rmsnorm(x, T, H, w, (float)eps, x); /* in place */
  EXPECT(memcmp(x, y, sizeof(y)) == 0, "rmsnorm in place differs");
}

/* ---- RoPE §2.5 ---- */
static tw_model_config_t gptoss_rope_config(void) {
  tw_model_config_t c;
  memset(&c, 0, sizeof(c));
  c.head_dim = 64;
  c.rope_theta = 150000.0;
  c.rope_factor = 32.0;
  c.rope_beta_fast = 32.0;
  c.rope_beta_slow = 1.0;
  c.rope_original_max_pos = 4096;
  c.rope_truncate = false;
  return c;
}

static void test_rope(void) {
  static const double spec_inv_freq[32] = {
      1.000000000e+00, 6.890443059e-01, 4.747820555e-01, 3.271458719e-01, 2.254180002e-01,
      1.553229895e-01, 1.070244215e-01, 7.374456821e-02, 5.081327482e-02, 3.170569618e-02,
      1.933500113e-02, 1.159204926e-02, 6.794959490e-03, 3.860359317e-03, 2.093792379e-03,
      1.052602101e-03, 4.564839192e-04, 1.293187012e-04, 3.830881237e-05, 2.639646903e-05,
      1.818833668e-05, 1.253256982e-05, 8.635495875e-06, 5.950239261e-06, 4.099978482e-06,
      2.825066827e-06, 1.946596211e-06, 1.341291035e-06, 9.242089502e-07, 6.368209146e-07,
      4.387978251e-07, 3.023511428e-07};
  tw_model_config_t c = gptoss_rope_config();
  double inv[32], conc;
  tw_cpu_rope_init(&c, inv, &conc);
  for (int i = 0; i < 32; i++)
    EXPECT(fabs(inv[i] - spec_inv_freq[i]) <= 1e-6 * spec_inv_freq[i],
              "inv_freq[%d] %.10g vs spec %.10g", i, inv[i], spec_inv_freq[i]);
  EXPECT(fabs(conc - 1.3465735902799727) < 1e-12, "concentration %.17g", conc);
  /* independent formula: low/high not rounded, L0 = 4096 */
  double low = 32.0 * log(4096.0 / (32.0 * 2 * M_PI)) / log(150000.0);
  double high = 32.0 * log(4096.0 / (1.0 * 2 * M_PI)) / log(150000.0);
  EXPECT(fabs(low - 8.092779115512402) < 1e-12 && fabs(high - 17.39802450158856) < 1e-12,
            "low %.15g high %.15g", low, high);
  for (int i = 0; i < 32; i++) {
    double base = pow(150000.0, 2.0 * i / 64.0);
    double r = fmin(fmax((i - low) / (high - low), 0.0), 1.0);
    double want = 1.0 / (32.0 * base) * r + 1.0 / base * (1 - r);
    EXPECT(fabs(inv[i] - want) <= 1e-12 * want, "inv_freq[%d] formula", i);
  }
  /* (C, S) samples of the spec table, concentration included */
  static const struct { int64_t p; int i; double C, S; } cs[] = {
      {1, 0, 0.72755682, 1.13310261},       {1, 9, 1.34589682, 0.04268690},
      {100, 0, 1.16117582, -0.68185860},    {4096, 17, 1.16204460, 0.68037695},
      {131071, 9, -1.08824612, 0.79308311}};
  for (size_t k = 0; k < sizeof(cs) / sizeof(cs[0]); k++) {
    float C[32], S[32];
    tw_cpu_rope_table(inv, 32, conc, cs[k].p, C, S);
    EXPECT(fabs(C[cs[k].i] - cs[k].C) <= 1e-6 * fabs(cs[k].C), "C[%lld][%d] %.9f vs %.8f",
              (long long)cs[k].p, cs[k].i, C[cs[k].i], cs[k].C);
    EXPECT(fabs(S[cs[k].i] - cs[k].S) <= 1e-6 * fabs(cs[k].S), "S[%lld][%d] %.9f vs %.8f",
              (long long)cs[k].p, cs[k].i, S[cs[k].i], cs[k].S);
  }
  /* truncate = true rounds low/high (wrong for gpt-oss, but must follow the flag) */
  c.rope_truncate = true;
  double inv_t[32], conc_t;
  tw_cpu_rope_init(&c, inv_t, &conc_t);
  EXPECT(fabs(inv_t[9] - 3.162075228e-02) <= 1e-6 * 3.162075228e-02, "truncated inv_freq_9 %.10g",
            inv_t[9]);
  /* rotation: half-split pairs (i, i+32) on several heads */
  uint64_t seed = 7;
  enum { NH = 3, D = 64 };
  float x[NH * D];
  double ref[NH * D];
  float C[32], S[32];
  tw_cpu_rope_table(inv, 32, conc, 777, C, S);
  for (int i = 0; i < NH * D; i++) x[i] = (float)tw_test_uniform(&seed, -2, 2);
  for (int h = 0; h < NH; h++)
    for (int i = 0; i < 32; i++) {
      double ph = 777.0 * inv[i];
      double a = x[h * D + i], b = x[h * D + i + 32];
      ref[h * D + i] = a * conc * cos(ph) - b * conc * sin(ph);
      ref[h * D + i + 32] = b * conc * cos(ph) + a * conc * sin(ph);
    }
  tw_cpu_rope_apply(x, NH, D, C, S);
  double e = tw_test_rel_l2_f(x, ref, NH * D);
  EXPECT(e < 1e-6, "rope apply rel l2 %.3g", e);
}

/* ---- attention §2.6 ---- */
typedef struct {
  int NQ, NKV, D, bs, n_blocks;
  float *pool;       /* [block][2][NKV][bs][D] */
  int32_t *table;    /* block ids of the sequence, shuffled */
  double *K, *V;     /* dense copies [pos][NKV][D] */
} attn_case_t;

static void attn_case_init(attn_case_t *a, int n_pos, uint64_t *seed) {
  a->n_blocks = (n_pos + a->bs - 1) / a->bs + 3;
  size_t pool_n = (size_t)a->n_blocks * 2 * a->NKV * a->bs * a->D;
  a->pool = calloc(pool_n, sizeof(float));
  a->table = malloc(sizeof(int32_t) * a->n_blocks);
  a->K = malloc(sizeof(double) * n_pos * a->NKV * a->D);
  a->V = malloc(sizeof(double) * n_pos * a->NKV * a->D);
  for (int i = 0; i < a->n_blocks; i++) a->table[i] = i;
  for (int i = a->n_blocks - 1; i > 0; i--) { /* shuffled: positions must go through the table */
    int j = (int)(tw_test_rand_u64(seed) % (uint64_t)(i + 1));
    int32_t t = a->table[i];
    a->table[i] = a->table[j];
    a->table[j] = t;
  }
  tw_cpu_kv_view_t kv = {a->pool, a->bs, a->NKV, a->D, 0};
  for (int p = 0; p < n_pos; p++)
    for (int g = 0; g < a->NKV; g++)
      for (int d = 0; d < a->D; d++) {
        float k = (float)tw_test_uniform(seed, -1.5, 1.5), v = (float)tw_test_uniform(seed, -1, 1);
        tw_cpu_kv_at(&kv, a->table, p, 0, g)[d] = k;
        tw_cpu_kv_at(&kv, a->table, p, 1, g)[d] = v;
        a->K[(p * a->NKV + g) * a->D + d] = k;
        a->V[(p * a->NKV + g) * a->D + d] = v;
      }
}

static void attn_ref(const attn_case_t *a, const float *q, int64_t pos, int window,
                     const float *sinks, double *out) {
  int G = a->NQ / a->NKV;
  for (int h = 0; h < a->NQ; h++) {
    int g = h / G;
    double s[512], M = sinks[h];
    for (int64_t j = 0; j <= pos; j++) {
      int allowed = window <= 0 || j >= pos - (window - 1);
      s[j] = -INFINITY;
      if (!allowed) continue;
      double dot = 0;
      for (int d = 0; d < a->D; d++) dot += (double)q[h * a->D + d] * a->K[(j * a->NKV + g) * a->D + d];
      s[j] = dot / sqrt((double)a->D);
      if (s[j] > M) M = s[j];
    }
    double den = exp(sinks[h] - M);
    for (int64_t j = 0; j <= pos; j++) if (s[j] > -INFINITY) den += exp(s[j] - M);
    for (int d = 0; d < a->D; d++) {
      double o = 0;
      for (int64_t j = 0; j <= pos; j++)
        if (s[j] > -INFINITY) o += exp(s[j] - M) * a->V[(j * a->NKV + g) * a->D + d];
      out[h * a->D + d] = o / den;
    }
  }
}

static void test_attention(void) {
  uint64_t seed = 11;
  attn_case_t a = {.NQ = 8, .NKV = 2, .D = 64, .bs = 5};
  enum { NPOS = 300, W = 32 };
  attn_case_init(&a, NPOS, &seed);
  float q[8 * 64], out[8 * 64], sinks[8], scores[NPOS];
  double ref[8 * 64];
  for (int h = 0; h < 8; h++) sinks[h] = (float)tw_test_uniform(&seed, -2.0, 3.0);
  tw_cpu_kv_view_t kv = {a.pool, a.bs, a.NKV, a.D, 0};
  const int64_t positions[] = {0, 1, 4, W - 2, W - 1, W, W + 1, 100, NPOS - 1};
  for (size_t pi = 0; pi < sizeof(positions) / sizeof(positions[0]); pi++) {
    int64_t pos = positions[pi];
    for (int i = 0; i < 8 * 64; i++) q[i] = (float)tw_test_uniform(&seed, -1.5, 1.5);
    for (int win = 0; win <= W; win += W) {
      attn_ref(&a, q, pos, win, sinks, ref);
      memset(out, 0, sizeof(out));
      tw_cpu_attention(q, 8, 0, 8, &kv, a.table, pos, win, sinks, 0.125f, scores, out);
      double e = tw_test_rel_l2_f(out, ref, 8 * 64);
      EXPECT(e < 1e-5, "attention pos %lld window %d rel l2 %.3g", (long long)pos, win, e);
    }
  }
  /* off-by-one at exactly W: at pos W-1 the window still holds every key
   * (same as full); at pos W it drops key 0 (differs from full) */
  for (int i = 0; i < 8 * 64; i++) q[i] = (float)tw_test_uniform(&seed, -1.5, 1.5);
  float full[8 * 64], slid[8 * 64];
  tw_cpu_attention(q, 8, 0, 8, &kv, a.table, W - 1, 0, sinks, 0.125f, scores, full);
  tw_cpu_attention(q, 8, 0, 8, &kv, a.table, W - 1, W, sinks, 0.125f, scores, slid);
  EXPECT(memcmp(full, slid, sizeof(full)) == 0, "window W at pos W-1 must see all W keys");
  tw_cpu_attention(q, 8, 0, 8, &kv, a.table, W, 0, sinks, 0.125f, scores, full);
  tw_cpu_attention(q, 8, 0, 8, &kv, a.table, W, W, sinks, 0.125f, scores, slid);
  EXPECT(tw_test_rel_l2_ff(slid, full, 8 * 64) > 1e-4, "window W at pos W must drop key 0");
  /* sinks matter: a huge sink shrinks the output towards zero */
  float big[8];
  for (int h = 0; h < 8; h++) big[h] = 30.0f;
  tw_cpu_attention(q, 8, 0, 8, &kv, a.table, 50, 0, big, 0.125f, scores, out);
  double mx = 0;
  for (int i = 0; i < 8 * 64; i++) mx = fmax(mx, fabs(out[i]));
  EXPECT(mx < 1e-6, "sink 30 should absorb the softmax, max |out| %.3g", mx);
  free(a.pool);
  free(a.table);
  free(a.K);
  free(a.V);
}

/* ---- router §2.8 ---- */
static void test_router(void) {
  const float z[6] = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f, -1.0f};
  int32_t idx[3];
  float w[3];
  tw_cpu_router_topk(z, 6, 2, idx, w);
  EXPECT(idx[0] == 1 && idx[1] == 3, "ties must pick the lowest indices: got %d %d", idx[0], idx[1]);
  EXPECT(fabsf(w[0] - 0.5f) < 1e-7f && fabsf(w[1] - 0.5f) < 1e-7f, "tie weights %g %g", w[0], w[1]);
  tw_cpu_router_topk(z, 6, 3, idx, w);
  EXPECT(idx[0] == 1 && idx[1] == 3 && idx[2] == 4, "top-3 %d %d %d", idx[0], idx[1], idx[2]);
  uint64_t seed = 5;
  for (int trial = 0; trial < 20; trial++) {
    float l[32];
    for (int i = 0; i < 32; i++) l[i] = (float)tw_test_uniform(&seed, -3, 3);
    int32_t id4[4];
    float w4[4];
    tw_cpu_router_topk(l, 32, 4, id4, w4);
    /* reference: sort indices by value descending */
    int order[32];
    for (int i = 0; i < 32; i++) order[i] = i;
    for (int i = 0; i < 32; i++)
      for (int j = i + 1; j < 32; j++)
        if (l[order[j]] > l[order[i]]) { int t = order[i]; order[i] = order[j]; order[j] = t; }
    double den = 0;
    for (int j = 0; j < 4; j++) den += exp((double)l[order[j]]);
    for (int j = 0; j < 4; j++) {
      EXPECT(id4[j] == order[j], "trial %d rank %d: %d vs %d", trial, j, id4[j], order[j]);
      double want = exp((double)l[order[j]]) / den;
      EXPECT(fabs(w4[j] - want) < 1e-6, "trial %d weight %d: %g vs %g", trial, j, w4[j], want);
    }
  }
}

/* ---- SwiGLU §2.9 ---- */
static void test_swiglu(void) {
  enum { I = 12 };
  const float u[2 * I] = {0.5f, 0.5f,   8.0f, 1.0f,   -9.0f, 2.0f,  1.0f, 9.0f,
                          1.0f, -9.0f,  -0.3f, -7.5f, 7.0f, 7.0f, 12.0f, -12.0f,
                          -2.0f, 0.0f,  3.0f, -1.0f,  -20.0f, 20.0f, 6.9f, 6.99f};
  float a[I];
  tw_cpu_swiglu(u, I, 1.702f, 7.0f, a);
  for (int i = 0; i < I; i++) {
    double g = fmin((double)u[2 * i], 7.0);
    double l = fmin(fmax((double)u[2 * i + 1], -7.0), 7.0);
    double want = g / (1.0 + exp(-1.702 * g)) * (l + 1.0);
    EXPECT(fabs(a[i] - want) <= 1e-6 * fmax(1.0, fabs(want)), "swiglu[%d] %.9g vs %.9g", i, a[i],
              want);
  }
  /* spot values: gate 8 clamps to 7; gate -9 is not clamped below */
  EXPECT(fabs(a[1] - 7.0 / (1 + exp(-1.702 * 7)) * 2.0) < 1e-5, "gate above limit");
  EXPECT(fabs(a[2] - (-9.0 / (1 + exp(1.702 * 9)) * 3.0)) < 1e-7, "gate below -limit");
  EXPECT(fabs(a[4] - 1.0 / (1 + exp(-1.702)) * -6.0) < 1e-5, "linear clamped at -7, +1");
}

/* ---- matmuls ---- */
static void test_matmul_bf16(tw_cpu_pool_t *pool) {
  uint64_t seed = 3;
  const int64_t Ts[] = {1, 5}, Ns[] = {1, 37, 130};
  const int64_t K = 264;
  for (size_t ti = 0; ti < 2; ti++)
    for (size_t ni = 0; ni < 3; ni++) {
      int64_t T = Ts[ti], N = Ns[ni];
      float *x = malloc(sizeof(float) * T * K), *y = malloc(sizeof(float) * T * N);
      uint16_t *w = malloc(2 * N * K), *b = malloc(2 * N), *wkn = malloc(2 * N * K);
      double *ref = malloc(sizeof(double) * T * N), *refkn = malloc(sizeof(double) * T * N);
      for (int64_t i = 0; i < T * K; i++) x[i] = (float)tw_test_uniform(&seed, -1, 1);
      for (int64_t i = 0; i < N * K; i++) w[i] = bf16_rand(&seed, -0.2, 0.2);
      for (int64_t i = 0; i < N * K; i++) wkn[i] = bf16_rand(&seed, -0.2, 0.2);
      for (int64_t i = 0; i < N; i++) b[i] = bf16_rand(&seed, -1, 1);
      for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
          double s = bf16_d(b[n]), skn = bf16_d(b[n]);
          for (int64_t k = 0; k < K; k++) {
            s += (double)x[t * K + k] * bf16_d(w[n * K + k]);
            skn += (double)x[t * K + k] * bf16_d(wkn[k * N + n]);
          }
          ref[t * N + n] = s;
          refkn[t * N + n] = skn;
        }
      tw_cpu_matmul_bf16(pool, x, T, K, w, b, N, y);
      double e = tw_test_rel_l2_f(y, ref, T * N);
      EXPECT(e < 1e-5, "matmul_bf16(T=%lld,N=%lld) rel l2 %.3g", (long long)T, (long long)N, e);
      tw_cpu_matmul_bf16_kn(pool, x, T, K, wkn, b, N, y);
      e = tw_test_rel_l2_f(y, refkn, T * N);
      EXPECT(e < 1e-5, "matmul_bf16_kn(T=%lld,N=%lld) rel l2 %.3g", (long long)T, (long long)N, e);
      free(x); free(y); free(w); free(b); free(wkn); free(ref); free(refkn);
    }
}

static double fp4_value(int nib) {
  /* E2M1 from its bits (spec §3.4): sign bit 3, exponent bits 2-1, mantissa bit 0 */
  int sign = nib >> 3, ex = (nib >> 1) & 3, man = nib & 1;
  double mag = ex == 0 ? 0.5 * man : ldexp(1.0 + 0.5 * man, ex - 1);
  return sign ? -mag : mag;
}

static void test_matmul_mxfp4(tw_cpu_pool_t *pool) {
  /* worked example of spec §3.4: byte 0x2F, scale 126 -> -3.0, +0.5 */
  uint8_t blk[16] = {0x2F}, sc = 126;
  float row[32];
  tw_cpu_mxfp4_row(blk, &sc, 1, row);
  EXPECT(row[0] == -3.0f && row[1] == 0.5f && row[2] == 0.0f, "worked example %g %g", row[0], row[1]);
  /* every byte under every scale: same values as the loader's dequantiser */
  for (int scale = 0; scale < 255; scale++) { /* 255 is NaN in OCP, inf here: not compared */
    uint8_t blocks[16 * 16], scales[16];
    float ours[512], loader[512];
    for (int i = 0; i < 256; i++) blocks[i] = (uint8_t)i;
    for (int g = 0; g < 16; g++) scales[g] = (uint8_t)scale;
    tw_cpu_mxfp4_row(blocks, scales, 16, ours);
    tw_mxfp4_dequant_row(blocks, scales, 16, loader);
    EXPECT(memcmp(ours, loader, sizeof(ours)) == 0, "mxfp4 row vs loader at scale %d", scale);
  }
  uint64_t seed = 9;
  const int64_t K = 96 * 8, Ns[] = {3, 64}, Ts[] = {1, 4};
  for (size_t ni = 0; ni < 2; ni++)
    for (size_t ti = 0; ti < 2; ti++) {
      int64_t N = Ns[ni], T = Ts[ti], nb = K / 32;
      uint8_t *blocks = malloc(N * nb * 16), *scales = malloc(N * nb);
      uint16_t *b = malloc(2 * N);
      float *x = malloc(sizeof(float) * T * K), *y = malloc(sizeof(float) * T * N);
      double *dense = malloc(sizeof(double) * N * K), *ref = malloc(sizeof(double) * T * N);
      for (int64_t i = 0; i < N * nb * 16; i++) blocks[i] = (uint8_t)tw_test_rand_u64(&seed);
      for (int64_t i = 0; i < N * nb; i++) scales[i] = (uint8_t)(118 + tw_test_rand_u64(&seed) % 12);
      for (int64_t i = 0; i < N; i++) b[i] = bf16_rand(&seed, -1, 1);
      for (int64_t i = 0; i < T * K; i++) x[i] = (float)tw_test_uniform(&seed, -1, 1);
      for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < K; c++) {
          int64_t g = c / 32, j = (c % 32) / 2;
          uint8_t byte = blocks[(r * nb + g) * 16 + j];
          int nib = (c % 2 == 0) ? (byte & 0xF) : (byte >> 4);
          dense[r * K + c] = ldexp(fp4_value(nib), scales[r * nb + g] - 127);
        }
      for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < N; r++) {
          double s = bf16_d(b[r]);
          for (int64_t c = 0; c < K; c++) s += (double)x[t * K + c] * dense[r * K + c];
          ref[t * N + r] = s;
        }
      tw_cpu_matmul_mxfp4(pool, x, T, K, blocks, scales, b, N, y);
      double e = tw_test_rel_l2_f(y, ref, T * N);
      EXPECT(e < 1e-5, "matmul_mxfp4(T=%lld,N=%lld) rel l2 %.3g", (long long)T, (long long)N, e);
      free(blocks); free(scales); free(b); free(x); free(y); free(dense); free(ref);
    }
}

int main(void) {
  test_rmsnorm();
  test_rope();
  test_attention();
  test_router();
  test_swiglu();
  tw_cpu_pool_t *pool = NULL;
  if (tw_cpu_pool_create(3, &pool) != TW_OK) {
    fprintf(stderr, "cannot create pool\n");
    return 1;
  }
  test_matmul_bf16(NULL);
  test_matmul_bf16(pool);
  test_matmul_mxfp4(NULL);
  test_matmul_mxfp4(pool);
  tw_cpu_pool_destroy(pool);
  return tw_test_exit("test_cpu_ops");
}
