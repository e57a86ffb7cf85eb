/* test_attention.c: the prefill and decode attention kernels (attention.h)
 * against a float64 reference of spec §2.6 written here (GQA, scale, causal,
 * sliding window of W keys including the current one, sinks in the
 * denominator only), on fresh random inputs (seed printed).
 *
 * K/V live in a paged pool with shuffled block ids; every pool slot that no
 * sequence owns is NaN, and every output is poisoned with NaN before the
 * launch, so an unwritten output or a read of a foreign slot fails the case.
 * Tolerance: relative L2 <= 1e-2 over the checked outputs. bf16 inputs are
 * exact in the reference; what remains is the bf16 rounding of P before the
 * PV product and of the output (each ~2^-9 relative), far below 1e-2, while
 * a wrong mask, sink or scale gives errors of 1e-1 or more.
 * The float64 reference itself is checked against the CPU backend's
 * tw_cpu_attention (host only, also without a GPU).
 * The fp8 KV cache (common/kv/kv_fp8.h, shape.kv_fp8): the same random pools
 * quantized per (token, head) on the host by common/kv/kv_fp8.c (the NaN of an
 * unowned slot stays NaN), both kernels against the CPU backend's
 * tw_cpu_attention on the same fp8 bytes, relative L2 <= 1e-2 (the kernels
 * round the dequantized K/V to bf16, 2^-9 relative), NaN never passing.
 * Exit 77 when no GPU is usable (after the host check). */
#include "attn_test_util.h"

#include "common/engine/cpu/cpu_ops.h"
#include "common/kv/kv_fp8.h"
#include "kernels/attention.h"
#include "kernels/knobs.h"

#define D 64

/* Tuning entry of attention_prefill.cu (not in attention.h): kernel variant
 * 0..5 of the prefill kernel. With TW_ATTN_TEST_VARIANTS set, a subset of the
 * prefill cases runs once per variant (g_variant >= 0). */
TW_NODISCARD tw_status_t tw_cuda_attention_prefill_variant(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
    const int32_t *start_pos, const int32_t *block_tables, int32_t block_table_stride, void *out,
    int variant, cudaStream_t stream);
#define TT_N_VARIANTS 8
static int g_variant = -1;

typedef struct {
  const char *name;
  int nq, nkv, window, block_size;
} tt_shape_t;

/* A paged pool holding n_seqs sequences of n_keys[s] positions each. */
typedef struct {
  uint16_t *pool;     /* host bf16 [n_blocks][2][nkv][bs][D] */
  int32_t *bt;        /* host [n_seqs][bt_stride] */
  int bt_stride, n_blocks;
  size_t pool_elems;
} tt_pool_t;

static void tt_pool_free(tt_pool_t *p) {
  free(p->pool);
  free(p->bt);
}

static int tt_pool_make(const tt_shape_t *sh, int n_seqs, const int *n_keys, tt_pool_t *p) {
  const int bs = sh->block_size;
  int total = 0, maxnb = 1;
  for (int s = 0; s < n_seqs; s++) {
    const int nb = (n_keys[s] + bs - 1) / bs;
    total += nb;
    if (nb > maxnb) maxnb = nb;
  }
  p->n_blocks = total + 3; /* three blocks nobody owns */
  p->bt_stride = maxnb + 1;
  p->pool_elems = (size_t)p->n_blocks * 2 * sh->nkv * bs * D;
  p->pool = malloc(p->pool_elems * 2);
  p->bt = malloc(sizeof(int32_t) * n_seqs * p->bt_stride);
  int *perm = malloc(sizeof(int) * p->n_blocks);
  if (!p->pool || !p->bt || !perm) return 1;
  for (int i = 0; i < p->n_blocks; i++) perm[i] = i;
  for (int i = p->n_blocks - 1; i > 0; i--) {
    int j = tt_randint(0, i), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (size_t i = 0; i < p->pool_elems; i++) p->pool[i] = TT_BF16_NAN;
  int next = 0;
  for (int s = 0; s < n_seqs; s++) {
    int32_t *row = p->bt + (size_t)s * p->bt_stride;
    for (int i = 0; i < p->bt_stride; i++) row[i] = -1; /* never read */
    const int nb = (n_keys[s] + bs - 1) / bs;
    for (int i = 0; i < nb; i++) row[i] = perm[next++];
    for (int pos = 0; pos < n_keys[s]; pos++)
      for (int kv = 0; kv < 2; kv++)
        for (int g = 0; g < sh->nkv; g++) {
          uint16_t *x = p->pool + ((((size_t)row[pos / bs] * 2 + kv) * sh->nkv + g) * bs +
                                   pos % bs) * D;
          for (int d = 0; d < D; d++) x[d] = tt_rand_bf16(1.7f);
        }
  }
  free(perm);
  return 0;
}

static const uint16_t *tt_kv_at(const tt_shape_t *sh, const tt_pool_t *p, int s, int pos, int kv,
                                int g) {
  const int bs = sh->block_size;
  const int32_t blk = p->bt[(size_t)s * p->bt_stride + pos / bs];
  return p->pool + ((((size_t)blk * 2 + kv) * sh->nkv + g) * bs + pos % bs) * D;
}

/* float64 attention of one query row (spec §2.6) into ref[D]. */
static void tt_ref_attention(const tt_shape_t *sh, const tt_pool_t *p, int s, int pos,
                             const uint16_t *qh, int h, float sink, double *scores,
                             double *ref) {
  const int g = h / (sh->nq / sh->nkv);
  const int lo = sh->window > 0 ? (pos - sh->window + 1 > 0 ? pos - sh->window + 1 : 0) : 0;
  double q[D];
  for (int d = 0; d < D; d++) q[d] = tt_bf2f(qh[d]);
  double mx = sink;
  for (int j = lo; j <= pos; j++) {
    const uint16_t *k = tt_kv_at(sh, p, s, j, 0, g);
    double acc = 0;
    for (int d = 0; d < D; d++) acc += q[d] * tt_bf2f(k[d]);
    scores[j - lo] = acc * 0.125;
    if (scores[j - lo] > mx) mx = scores[j - lo];
  }
  double den = exp((double)sink - mx);
  for (int d = 0; d < D; d++) ref[d] = 0;
  for (int j = lo; j <= pos; j++) {
    const double w = exp(scores[j - lo] - mx);
    den += w;
    const uint16_t *v = tt_kv_at(sh, p, s, j, 1, g);
    for (int d = 0; d < D; d++) ref[d] += w * tt_bf2f(v[d]);
  }
  for (int d = 0; d < D; d++) ref[d] /= den;
}

/* Prefill of n_seqs sequences: sequence s has len[s] new queries after
 * start[s] cached positions. Rows checked: all if few, else a sample. */
static int tt_prefill_case(const tt_shape_t *sh, int n_seqs, const int *start, const int *len) {
  char name[160];
  int n_tokens = 0, n_keys[16], cu[17];
  cu[0] = 0;
  for (int s = 0; s < n_seqs; s++) {
    n_keys[s] = start[s] + len[s];
    n_tokens += len[s];
    cu[s + 1] = n_tokens;
  }
  char vtag[32] = "";
  if (g_variant >= 0) snprintf(vtag, sizeof vtag, ",variant=%d", g_variant);
  snprintf(name, sizeof name, "attention_prefill(%s,W=%d,seqs=%d,T=%d,start0=%d%s)", sh->name,
           sh->window, n_seqs, n_tokens, start[0], vtag);
  tt_pool_t p;
  if (tt_pool_make(sh, n_seqs, n_keys, &p)) return 1;
  const int64_t q_stride = (int64_t)(sh->nq + 2 * sh->nkv) * D; /* as in the fused qkv */
  uint16_t *q = malloc(sizeof(uint16_t) * n_tokens * q_stride);
  uint16_t *out = malloc(sizeof(uint16_t) * n_tokens * sh->nq * D);
  float *sinks = malloc(sizeof(float) * sh->nq);
  for (int64_t i = 0; i < n_tokens * q_stride; i++) q[i] = tt_rand_bf16(3.4f);
  for (int h = 0; h < sh->nq; h++) sinks[h] = tt_normal(2.0f);

  void *d_pool, *d_q, *d_out;
  float *d_sinks;
  int32_t *d_cu, *d_start, *d_bt;
  TT_CUDA(cudaMalloc(&d_pool, p.pool_elems * 2));
  TT_CUDA(cudaMalloc(&d_q, sizeof(uint16_t) * n_tokens * q_stride));
  TT_CUDA(cudaMalloc(&d_out, sizeof(uint16_t) * n_tokens * sh->nq * D));
  TT_CUDA(cudaMalloc((void **)&d_sinks, sizeof(float) * sh->nq));
  TT_CUDA(cudaMalloc((void **)&d_cu, sizeof(int32_t) * (n_seqs + 1)));
  TT_CUDA(cudaMalloc((void **)&d_start, sizeof(int32_t) * n_seqs));
  TT_CUDA(cudaMalloc((void **)&d_bt, sizeof(int32_t) * n_seqs * p.bt_stride));
  TT_CUDA(cudaMemcpy(d_pool, p.pool, p.pool_elems * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_q, q, sizeof(uint16_t) * n_tokens * q_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_sinks, sinks, sizeof(float) * sh->nq, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_cu, cu, sizeof(int32_t) * (n_seqs + 1), cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_start, start, sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_bt, p.bt, sizeof(int32_t) * n_seqs * p.bt_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_out, 0xff, sizeof(uint16_t) * n_tokens * sh->nq * D)); /* NaN */

  const tw_cuda_attn_shape_t ash = {.n_q_heads = sh->nq, .n_kv_heads = sh->nkv,
                                    .head_dim = D, .block_size = sh->block_size,
                                    .window = sh->window, .scale = 0.125f};
  tw_status_t st =
      g_variant < 0
          ? tw_cuda_attention_prefill(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, n_tokens,
                                      d_cu, d_start, d_bt, p.bt_stride, d_out, 0)
          : tw_cuda_attention_prefill_variant(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs,
                                              n_tokens, d_cu, d_start, d_bt, p.bt_stride, d_out,
                                              g_variant, 0);
  if (st != TW_OK) {
    printf("FAIL %s: status %d\n", name, (int)st);
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaGetLastError());
  TT_CUDA(cudaMemcpy(out, d_out, sizeof(uint16_t) * n_tokens * sh->nq * D,
                     cudaMemcpyDeviceToHost));

  tt_l2_t l2 = {0};
  int max_keys = 1;
  for (int s = 0; s < n_seqs; s++)
    if (n_keys[s] > max_keys) max_keys = n_keys[s];
  double *scores = malloc(sizeof(double) * max_keys), ref[D];
  const int stride = n_tokens <= 300 ? 1 : (n_tokens <= 1200 ? 3 : 16);
  long n_unwritten = 0;
  for (int s = 0; s < n_seqs; s++)
    for (int i = 0; i < len[s]; i++) {
      const int t = cu[s] + i;
      const int check = i % stride == 0 || i < 16 || i >= len[s] - 16;
      for (int h = 0; h < sh->nq; h++) {
        const uint16_t *o = out + ((size_t)t * sh->nq + h) * D;
        if (!check) {
          for (int d = 0; d < D; d++) n_unwritten += !isfinite(tt_bf2f(o[d]));
          continue;
        }
        tt_ref_attention(sh, &p, s, start[s] + i, q + t * q_stride + (int64_t)h * D, h,
                         sinks[h], scores, ref);
        for (int d = 0; d < D; d++) tt_l2_add(&l2, tt_bf2f(o[d]), ref[d]);
      }
    }
  l2.n_bad += n_unwritten;
  int rc = tt_l2_report(name, &l2, 1e-2);
  free(scores);
  free(q);
  free(out);
  free(sinks);
  tt_pool_free(&p);
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_sinks);
  cudaFree(d_cu);
  cudaFree(d_start);
  cudaFree(d_bt);
  return rc;
}

/* Decode of a batch: sequence b has lens[b] keys, its query at lens[b]-1. */
/* Decode over sequences of lens[]; `bound` is the host max_seq_len passed
 * (0: the longest length; a decode graph passes its context bucket, up to 2x).
 * The kernel runs twice: the second output must equal the first bit for bit
 * and the split counters at the start of the workspace must be back at zero. */
static int tt_decode_case(const tt_shape_t *sh, int n_seqs, const int *lens, int bound,
                          const char *tag) {
  char name[200];
  int max_len = 1;
  for (int b = 0; b < n_seqs; b++)
    if (lens[b] > max_len) max_len = lens[b];
  const int longest = max_len;
  if (bound > max_len) max_len = bound;
  const char *mode = getenv("TWAIN_CUDA_DC_MODE_NAME");
  snprintf(name, sizeof name, "attention_decode(%s,W=%d,B=%d,longest=%d,bound=%d,%s%s%s)",
           sh->name, sh->window, n_seqs, longest, max_len, tag, mode ? "," : "",
           mode ? mode : "");
  tt_pool_t p;
  if (tt_pool_make(sh, n_seqs, lens, &p)) return 1;
  const int64_t q_stride = (int64_t)(sh->nq + 2 * sh->nkv) * D;
  uint16_t *q = malloc(sizeof(uint16_t) * n_seqs * q_stride);
  uint16_t *out = malloc(sizeof(uint16_t) * n_seqs * sh->nq * D);
  float *sinks = malloc(sizeof(float) * sh->nq);
  for (int64_t i = 0; i < n_seqs * q_stride; i++) q[i] = tt_rand_bf16(3.4f);
  for (int h = 0; h < sh->nq; h++) sinks[h] = tt_normal(2.0f);
  const tw_cuda_attn_shape_t ash = {.n_q_heads = sh->nq, .n_kv_heads = sh->nkv,
                                    .head_dim = D, .block_size = sh->block_size,
                                    .window = sh->window, .scale = 0.125f};
  const size_t ws_bytes = tw_cuda_attention_decode_workspace_bytes(&ash, n_seqs, max_len);
  void *d_pool, *d_q, *d_out, *d_ws;
  float *d_sinks;
  int32_t *d_lens, *d_bt;
  TT_CUDA(cudaMalloc(&d_pool, p.pool_elems * 2));
  TT_CUDA(cudaMalloc(&d_q, sizeof(uint16_t) * n_seqs * q_stride));
  TT_CUDA(cudaMalloc(&d_out, sizeof(uint16_t) * n_seqs * sh->nq * D));
  TT_CUDA(cudaMalloc(&d_ws, ws_bytes));
  TT_CUDA(cudaMalloc((void **)&d_sinks, sizeof(float) * sh->nq));
  TT_CUDA(cudaMalloc((void **)&d_lens, sizeof(int32_t) * n_seqs));
  TT_CUDA(cudaMalloc((void **)&d_bt, sizeof(int32_t) * n_seqs * p.bt_stride));
  TT_CUDA(cudaMemcpy(d_pool, p.pool, p.pool_elems * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_q, q, sizeof(uint16_t) * n_seqs * q_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_sinks, sinks, sizeof(float) * sh->nq, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_lens, lens, sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_bt, p.bt, sizeof(int32_t) * n_seqs * p.bt_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_out, 0xff, sizeof(uint16_t) * n_seqs * sh->nq * D));
  TT_CUDA(cudaMemset(d_ws, 0xff, ws_bytes)); /* NaN: partials must all be written */
  TT_CUDA(cudaMemset(d_ws, 0, sizeof(int32_t) * n_seqs * sh->nkv)); /* split counters */

  int rc = 0;
  if (tw_cuda_attention_decode(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, d_lens, d_bt,
                               p.bt_stride, max_len, d_ws, ws_bytes / 2, d_out,
                               0) != TW_ERR_INVALID_ARGUMENT) {
    printf("FAIL %s: a too small workspace was accepted\n", name);
    rc = 1;
  }
  tw_status_t st = tw_cuda_attention_decode(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, d_lens,
                                            d_bt, p.bt_stride, max_len, d_ws, ws_bytes, d_out, 0);
  if (st != TW_OK) {
    printf("FAIL %s: status %d\n", name, (int)st);
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaGetLastError());
  TT_CUDA(cudaMemcpy(out, d_out, sizeof(uint16_t) * n_seqs * sh->nq * D,
                     cudaMemcpyDeviceToHost));
  { /* second run: same bits, counters back at zero */
    uint16_t *out2 = malloc(sizeof(uint16_t) * n_seqs * sh->nq * D);
    int32_t *ctr = malloc(sizeof(int32_t) * n_seqs * sh->nkv);
    TT_CUDA(cudaMemset(d_out, 0xff, sizeof(uint16_t) * n_seqs * sh->nq * D));
    if (tw_cuda_attention_decode(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, d_lens, d_bt,
                                 p.bt_stride, max_len, d_ws, ws_bytes, d_out, 0) != TW_OK) {
      printf("FAIL %s: second run failed\n", name);
      rc = 1;
    }
    TT_CUDA(cudaDeviceSynchronize());
    TT_CUDA(cudaMemcpy(out2, d_out, sizeof(uint16_t) * n_seqs * sh->nq * D,
                       cudaMemcpyDeviceToHost));
    TT_CUDA(cudaMemcpy(ctr, d_ws, sizeof(int32_t) * n_seqs * sh->nkv, cudaMemcpyDeviceToHost));
    if (memcmp(out, out2, sizeof(uint16_t) * n_seqs * sh->nq * D) != 0) {
      printf("FAIL %s: the second run's output differs from the first\n", name);
      rc = 1;
    }
    for (int i = 0; i < n_seqs * sh->nkv; i++)
      if (ctr[i] != 0) {
        printf("FAIL %s: split counter %d is %d after the call (want 0)\n", name, i, ctr[i]);
        rc = 1;
        break;
      }
    free(out2);
    free(ctr);
  }
  tt_l2_t l2 = {0};
  double *scores = malloc(sizeof(double) * max_len), ref[D];
  for (int b = 0; b < n_seqs; b++)
    for (int h = 0; h < sh->nq; h++) {
      tt_ref_attention(sh, &p, b, lens[b] - 1, q + b * q_stride + (int64_t)h * D, h, sinks[h],
                       scores, ref);
      const uint16_t *o = out + ((size_t)b * sh->nq + h) * D;
      for (int d = 0; d < D; d++) tt_l2_add(&l2, tt_bf2f(o[d]), ref[d]);
    }
  rc |= tt_l2_report(name, &l2, 1e-2);
  free(scores);
  free(q);
  free(out);
  free(sinks);
  tt_pool_free(&p);
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_ws);
  cudaFree(d_sinks);
  cudaFree(d_lens);
  cudaFree(d_bt);
  return rc;
}

/* Lengths log-uniform in [1, max_len], with 1 and max_len always present. */
static void tt_mixed_lens(int n, int max_len, int *lens) {
  for (int b = 0; b < n; b++) {
    const double u = (tt_rng_u64() >> 11) * (1.0 / 9007199254740992.0);
    lens[b] = (int)exp(u * log((double)max_len));
    if (lens[b] < 1) lens[b] = 1;
    if (lens[b] > max_len) lens[b] = max_len;
  }
  lens[0] = max_len;
  if (n > 1) lens[n - 1] = 1;
}

/* Host only (runs without a GPU too): the float64 reference of this file
 * against the CPU backend's tw_cpu_attention (common/engine/cpu, float32) on the
 * same paged pool, so the GPU kernels, checked against the former, are tied
 * to the CPU backend. Tolerance 1e-5: float32 accumulation vs float64. */
static int tt_cpu_backend_crosscheck(const tt_shape_t *sh) {
  const int n_keys = 300;
  tt_pool_t p;
  if (tt_pool_make(sh, 1, &n_keys, &p)) return 1;
  float *pool32 = malloc(sizeof(float) * p.pool_elems);
  float *q32 = malloc(sizeof(float) * sh->nq * D), *out = malloc(sizeof(float) * sh->nq * D);
  uint16_t *q = malloc(sizeof(uint16_t) * sh->nq * D);
  float *sinks = malloc(sizeof(float) * sh->nq), scores[300];
  double sc64[300], ref[D];
  for (size_t i = 0; i < p.pool_elems; i++) pool32[i] = tt_bf2f(p.pool[i]);
  for (int h = 0; h < sh->nq; h++) sinks[h] = tt_normal(2.0f);
  const tw_cpu_kv_view_t view = {.layer_base = pool32, .block_size = sh->block_size,
                                 .n_kv_heads = sh->nkv, .head_dim = D};
  tt_l2_t l2 = {0};
  const int positions[] = {0, 5, 127, 128, 299};
  for (int i = 0; i < 5; i++) {
    for (int k = 0; k < sh->nq * D; k++) {
      q[k] = tt_rand_bf16(3.4f);
      q32[k] = tt_bf2f(q[k]);
    }
    tw_cpu_attention(q32, sh->nq, 0, sh->nq, &view, p.bt, positions[i], sh->window, sinks,
                     0.125f, scores, out);
    for (int h = 0; h < sh->nq; h++) {
      tt_ref_attention(sh, &p, 0, positions[i], q + h * D, h, sinks[h], sc64, ref);
      for (int d = 0; d < D; d++) tt_l2_add(&l2, out[h * D + d], ref[d]);
    }
  }
  char name[96];
  snprintf(name, sizeof name, "reference_vs_tw_cpu_attention(%s,W=%d)", sh->name, sh->window);
  const int rc = tt_l2_report(name, &l2, 1e-5);
  tt_pool_free(&p);
  free(pool32);
  free(q32);
  free(out);
  free(q);
  free(sinks);
  return rc;
}

/* The fp8 KV cache: pool p (bf16 values) quantized into the fp8 layout of
 * common/kv/kv_fp8.h; `prefill` (queries start[s]..start[s]+len[s]-1 of each
 * sequence) or decode (one query at start[s] + len[s] - 1, keys 0..it) with
 * kv_fp8 = 1, against tw_cpu_attention over the same bytes. `spread`: each
 * (token, k|v, head) row times its own power of two in 2^-12..2^8 before it
 * is quantized, so that the scales of neighbouring keys differ by up to 2^20
 * (the decode kernel keeps its V accumulator in the largest V scale it has
 * seen and rescales when a larger one comes). */
static int tt_fp8_case(const tt_shape_t *sh, int prefill, int n_seqs, const int *start,
                       const int *len, int spread) {
  char name[160];
  int n_keys[16], cu[17], n_tokens = 0, max_keys = 1;
  cu[0] = 0;
  for (int s = 0; s < n_seqs; s++) {
    n_keys[s] = start[s] + len[s];
    if (n_keys[s] > max_keys) max_keys = n_keys[s];
    n_tokens += prefill ? len[s] : 1;
    cu[s + 1] = n_tokens;
  }
  char vtag[24] = "";
  if (prefill && g_variant >= 0) snprintf(vtag, sizeof vtag, ",variant=%d", g_variant);
  snprintf(name, sizeof name, "fp8_kv_%s(%s,W=%d,seqs=%d,T=%d,keys=%d%s%s)",
           prefill ? "prefill" : "decode", sh->name, sh->window, n_seqs, n_tokens, max_keys,
           spread ? ",spread" : "", vtag);
  tt_pool_t p;
  if (tt_pool_make(sh, n_seqs, n_keys, &p)) return 1;
  const int bs = sh->block_size;
  const size_t part = (size_t)bs * (D + 4), pool_bytes = (size_t)p.n_blocks * 2 * sh->nkv * part;
  uint8_t *pool8 = malloc(pool_bytes);
  for (int b = 0; b < p.n_blocks; b++)
    for (int kvg = 0; kvg < 2 * sh->nkv; kvg++)
      for (int sl = 0; sl < bs; sl++) {
        const uint16_t *x = p.pool + (((size_t)b * 2 * sh->nkv + kvg) * bs + sl) * D;
        uint8_t *dst = pool8 + ((size_t)b * 2 * sh->nkv + kvg) * part;
        float row[D], scale;
        const uint32_t h = (uint32_t)((b * 2 * sh->nkv + kvg) * bs + sl) * 2654435761u;
        const float mul = spread ? ldexpf(1.f, (int)((h >> 16) % 21) - 12) : 1.f;
        for (int d = 0; d < D; d++) row[d] = tt_bf2f(x[d]) * mul;
        tw_kv_fp8_quantize(row, D, dst + (size_t)sl * D, &scale);
        memcpy(dst + (size_t)bs * D + (size_t)sl * 4, &scale, 4);
      }
  const int64_t q_stride = (int64_t)(sh->nq + 2 * sh->nkv) * D;
  uint16_t *q = malloc(sizeof(uint16_t) * n_tokens * q_stride);
  uint16_t *out = malloc(sizeof(uint16_t) * n_tokens * sh->nq * D);
  float *sinks = malloc(sizeof(float) * sh->nq), *q32 = malloc(sizeof(float) * sh->nq * D);
  float *ref = malloc(sizeof(float) * sh->nq * D), *scores = malloc(sizeof(float) * max_keys);
  for (int64_t i = 0; i < n_tokens * q_stride; i++) q[i] = tt_rand_bf16(3.4f);
  for (int h = 0; h < sh->nq; h++) sinks[h] = tt_normal(2.0f);
  int32_t seq_lens[16];
  for (int s = 0; s < n_seqs; s++) seq_lens[s] = n_keys[s];
  const tw_cuda_attn_shape_t ash = {.n_q_heads = sh->nq,
                                    .n_kv_heads = sh->nkv,
                                    .head_dim = D,
                                    .block_size = bs,
                                    .window = sh->window,
                                    .scale = 0.125f,
                                    .kv_fp8 = 1};
  const size_t ws_bytes =
      prefill ? 16 : tw_cuda_attention_decode_workspace_bytes(&ash, n_seqs, max_keys);
  void *d_pool, *d_q, *d_out, *d_ws;
  float *d_sinks;
  int32_t *d_cu, *d_start, *d_bt, *d_lens;
  TT_CUDA(cudaMalloc(&d_pool, pool_bytes));
  TT_CUDA(cudaMalloc(&d_q, sizeof(uint16_t) * n_tokens * q_stride));
  TT_CUDA(cudaMalloc(&d_out, sizeof(uint16_t) * n_tokens * sh->nq * D));
  TT_CUDA(cudaMalloc(&d_ws, ws_bytes));
  TT_CUDA(cudaMalloc((void **)&d_sinks, sizeof(float) * sh->nq));
  TT_CUDA(cudaMalloc((void **)&d_cu, sizeof(int32_t) * (n_seqs + 1)));
  TT_CUDA(cudaMalloc((void **)&d_start, sizeof(int32_t) * n_seqs));
  TT_CUDA(cudaMalloc((void **)&d_lens, sizeof(int32_t) * n_seqs));
  TT_CUDA(cudaMalloc((void **)&d_bt, sizeof(int32_t) * n_seqs * p.bt_stride));
  TT_CUDA(cudaMemcpy(d_pool, pool8, pool_bytes, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_q, q, sizeof(uint16_t) * n_tokens * q_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_sinks, sinks, sizeof(float) * sh->nq, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_cu, cu, sizeof(int32_t) * (n_seqs + 1), cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_start, start, sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_lens, seq_lens, sizeof(int32_t) * n_seqs, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(d_bt, p.bt, sizeof(int32_t) * n_seqs * p.bt_stride, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(d_out, 0xff, sizeof(uint16_t) * n_tokens * sh->nq * D)); /* NaN */
  TT_CUDA(cudaMemset(d_ws, 0, ws_bytes));
  tw_status_t st =
      prefill && g_variant >= 0 ? tw_cuda_attention_prefill_variant(
                                      &ash, d_q, q_stride, d_pool, d_sinks, n_seqs, n_tokens, d_cu,
                                      d_start, d_bt, p.bt_stride, d_out, g_variant, 0)
      : prefill ? tw_cuda_attention_prefill(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, n_tokens,
                                            d_cu, d_start, d_bt, p.bt_stride, d_out, 0)
                : tw_cuda_attention_decode(&ash, d_q, q_stride, d_pool, d_sinks, n_seqs, d_lens,
                                           d_bt, p.bt_stride, max_keys, d_ws, ws_bytes, d_out, 0);
  int rc = 0;
  if (st != TW_OK) {
    printf("FAIL %s: %s\n", name, tw_last_error());
    rc = 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(out, d_out, sizeof(uint16_t) * n_tokens * sh->nq * D, cudaMemcpyDeviceToHost));
  const tw_cpu_kv_view_t view = {
      .layer_base = pool8, .block_size = bs, .n_kv_heads = sh->nkv, .head_dim = D, .fp8 = 1};
  tt_l2_t l2 = {0};
  for (int s = 0; s < n_seqs && !rc; s++)
    for (int i = 0; i < (prefill ? len[s] : 1); i++) {
      const int t = cu[s] + i, pos = prefill ? start[s] + i : n_keys[s] - 1;
      for (int k = 0; k < sh->nq * D; k++) q32[k] = tt_bf2f(q[t * q_stride + k]);
      tw_cpu_attention(q32, sh->nq, 0, sh->nq, &view, p.bt + (size_t)s * p.bt_stride, pos,
                       sh->window, sinks, 0.125f, scores, ref);
      for (int k = 0; k < sh->nq * D; k++)
        tt_l2_add(&l2, tt_bf2f(out[(size_t)t * sh->nq * D + k]), ref[k]);
    }
  rc |= tt_l2_report(name, &l2, 1e-2);
  tt_pool_free(&p);
  free(pool8);
  free(q);
  free(out);
  free(sinks);
  free(q32);
  free(ref);
  free(scores);
  cudaFree(d_pool);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_ws);
  cudaFree(d_sinks);
  cudaFree(d_cu);
  cudaFree(d_start);
  cudaFree(d_lens);
  cudaFree(d_bt);
  return rc;
}

static int tt_api_errors(void) {
  tw_cuda_attn_shape_t sh = {.n_q_heads = 64, .n_kv_heads = 8, .head_dim = 128,
                             .block_size = 16, .window = 0, .scale = 0.125f};
  int dummy[2] = {0, 1};
  float f = 0;
  int rc = 0;
  if (tw_cuda_attention_prefill(&sh, dummy, 64 * 128, dummy, &f, 1, 1, dummy, dummy, dummy, 1,
                                dummy, 0) != TW_ERR_UNSUPPORTED) {
    printf("FAIL api: head_dim 128 not rejected as unsupported\n");
    rc = 1;
  }
  sh.head_dim = 64;
  sh.n_kv_heads = 7;
  if (tw_cuda_attention_prefill(&sh, dummy, 64 * 64, dummy, &f, 1, 1, dummy, dummy, dummy, 1,
                                dummy, 0) != TW_ERR_INVALID_ARGUMENT) {
    printf("FAIL api: NQ not a multiple of NKV accepted\n");
    rc = 1;
  }
  if (!rc) printf("ok   api errors (head_dim 128, NQ %% NKV)\n");
  return rc;
}

int main(void) {
  tt_seed();
  const tt_shape_t real_full = {"gptoss", 64, 8, 0, 16};
  const tt_shape_t real_slide = {"gptoss", 64, 8, 128, 16};
  const tt_shape_t tiny_full = {"tiny", 4, 2, 0, 16};
  const tt_shape_t tiny_slide = {"tiny", 4, 2, 32, 16};
  /* a block size that is not a power of two (the kernels' division path) */
  const tt_shape_t bs12_full = {"gptoss-bs12", 64, 8, 0, 12};
  const tt_shape_t bs12_slide = {"gptoss-bs12", 64, 8, 128, 12};
  int fails = tt_cpu_backend_crosscheck(&real_full) + tt_cpu_backend_crosscheck(&real_slide) +
              tt_cpu_backend_crosscheck(&tiny_slide);
  if (!tt_gpu_available()) {
    printf("no GPU: GPU cases skipped\n");
    return fails ? 1 : TT_SKIP;
  }
  fails += tt_api_errors();
  /* TW_ATTN_TEST_QUICK: small cases only (for compute-sanitizer runs).
   * TW_ATTN_TEST_VARIANTS="0,4,...": only the variant subset below. */
  const int quick = getenv("TW_ATTN_TEST_QUICK") != NULL;
  const char *variants = getenv("TW_ATTN_TEST_VARIANTS");
  if (variants) goto variant_cases;

  const int Ts[] = {1, 7, 127, 128, 129, 1000, 4096};
  for (size_t i = 0; i < (quick ? 5 : sizeof Ts / sizeof Ts[0]); i++) {
    const int start = 0;
    fails += tt_prefill_case(&real_full, 1, &start, &Ts[i]);
    fails += tt_prefill_case(&real_slide, 1, &start, &Ts[i]);
  }
  { /* chunked prefill: earlier chunks already in the cache */
    const int starts[] = {1000, 4000, 127, 5};
    const int lens[] = {129, 300, 64, 1};
    for (int i = 0; i < 4; i++) {
      fails += tt_prefill_case(&real_full, 1, &starts[i], &lens[i]);
      fails += tt_prefill_case(&real_slide, 1, &starts[i], &lens[i]);
    }
  }
  { /* several sequences in one launch, mixed starts and lengths */
    const int starts[] = {0, 300, 17, 2000};
    const int lens[] = {200, 129, 1, 77};
    fails += tt_prefill_case(&real_full, 4, starts, lens);
    fails += tt_prefill_case(&real_slide, 4, starts, lens);
    fails += tt_prefill_case(&tiny_full, 4, starts, lens);
    fails += tt_prefill_case(&tiny_slide, 4, starts, lens);
    fails += tt_prefill_case(&bs12_full, 4, starts, lens);
    fails += tt_prefill_case(&bs12_slide, 4, starts, lens);
  }
  if (!quick) {
    const int start = 0, T = 1000;
    fails += tt_prefill_case(&tiny_full, 1, &start, &T);
    fails += tt_prefill_case(&tiny_slide, 1, &start, &T);
  }
  {
    int lens[64];
    const int one = 1, mid = 3000;
    fails += tt_decode_case(&real_full, 1, &one, 0, "len1");
    fails += tt_decode_case(&real_slide, 1, &mid, 0, "len3000");
    fails += tt_decode_case(&real_full, 1, &mid, 0, "len3000");
    fails += tt_decode_case(&real_full, 1, &mid, 4096, "len3000");
    const int bs[] = {1, 8, 64};
    for (int i = 0; i < 3; i++) {
      tt_mixed_lens(bs[i], quick ? 3000 : 40000, lens);
      fails += tt_decode_case(&real_full, bs[i], lens, 0, "mixed");
      fails += tt_decode_case(&real_slide, bs[i], lens, 0, "mixed");
    }
    tt_mixed_lens(8, 2000, lens);
    fails += tt_decode_case(&tiny_full, 8, lens, 0, "mixed");
    fails += tt_decode_case(&tiny_slide, 8, lens, 0, "mixed");
    fails += tt_decode_case(&bs12_full, 8, lens, 0, "mixed");
    fails += tt_decode_case(&bs12_slide, 8, lens, 0, "mixed");
    /* The kernel's other configurations (knobs.h, read again after each
     * setenv): the separate combine kernel with 2 stages, and many small
     * splits (a merge over up to 128 splits), each with a context bucket 2x
     * the longest sequence as a decode graph has it. */
    static const char *const modes[][3] = {{"0", "2", "528"}, {"1", "2", "4096"},
                                           {"1", "3", "4096"}};
    for (int m = 0; m < 3; m++) {
      char mname[64];
      snprintf(mname, sizeof mname, "fused=%s,stages=%s,ctas=%s", modes[m][0], modes[m][1],
               modes[m][2]);
      setenv("TWAIN_CUDA_DC_FUSED", modes[m][0], 1);
      setenv("TWAIN_CUDA_DC_STAGES", modes[m][1], 1);
      setenv("TWAIN_CUDA_DC_CTAS", modes[m][2], 1);
      setenv("TWAIN_CUDA_DC_MODE_NAME", mname, 1);
      tw_cuda_knobs_reload();
      const int big = quick ? 3000 : 33000;
      fails += tt_decode_case(&real_full, 1, &big, 2 * big, "one");
      fails += tt_decode_case(&real_slide, 1, &big, 2 * big, "one");
      tt_mixed_lens(8, big, lens);
      fails += tt_decode_case(&real_full, 8, lens, 2 * big, "mixed");
      /* the block lookup's division path in this configuration too */
      tt_mixed_lens(8, 3000, lens);
      fails += tt_decode_case(&bs12_full, 8, lens, 6000, "mixed");
      fails += tt_decode_case(&bs12_slide, 8, lens, 6000, "mixed");
    }
    unsetenv("TWAIN_CUDA_DC_FUSED");
    unsetenv("TWAIN_CUDA_DC_STAGES");
    unsetenv("TWAIN_CUDA_DC_CTAS");
    unsetenv("TWAIN_CUDA_DC_MODE_NAME");
    tw_cuda_knobs_reload();
  }
  { /* the fp8 KV cache: prefill (one and several sequences, chunked) and decode */
    const int s0[] = {0}, l0[] = {300}, s1[] = {0, 300, 17, 2000}, l1[] = {200, 129, 1, 77};
    const int s2[] = {1000}, l2[] = {129};
    const tt_shape_t *shapes[] = {&real_full, &real_slide, &tiny_slide, &bs12_full, &bs12_slide};
    for (int k = 0; k < 5; k++) {
      fails += tt_fp8_case(shapes[k], 1, 1, s0, l0, 0);
      fails += tt_fp8_case(shapes[k], 1, 4, s1, l1, 0);
      fails += tt_fp8_case(shapes[k], 1, 1, s2, l2, 0);
      fails += tt_fp8_case(shapes[k], 0, 4, s1, l1, 0);
      fails += tt_fp8_case(shapes[k], 0, 4, s1, l1, 1);
    }
    int lens[8], zero8[8] = {0};
    tt_mixed_lens(8, quick ? 3000 : 20000, lens);
    fails += tt_fp8_case(&real_full, 0, 8, zero8, lens, 0);
    fails += tt_fp8_case(&real_slide, 0, 8, zero8, lens, 0);
    fails += tt_fp8_case(&real_full, 0, 8, zero8, lens, 1);
    const int one = 1;
    fails += tt_fp8_case(&real_full, 0, 1, zero8, &one, 0);
    setenv("TWAIN_CUDA_DC_STAGES", "2", 1); /* the fp8 decode kernel's 3-stage variant */
    tw_cuda_knobs_reload();
    fails += tt_fp8_case(&real_full, 0, 8, zero8, lens, 1);
    fails += tt_fp8_case(&bs12_full, 0, 4, s1, l1, 1);
    fails += tt_fp8_case(&bs12_slide, 0, 4, s1, l1, 0);
    unsetenv("TWAIN_CUDA_DC_STAGES");
    tw_cuda_knobs_reload();
  }
variant_cases:
  if (variants) { /* the listed prefill kernel variants */
    for (const char *c = variants; *c; c++) {
      if (*c < '0' || *c >= '0' + TT_N_VARIANTS) continue;
      g_variant = *c - '0';
      const int starts[] = {0, 300, 17, 2000};
      const int lens[] = {200, 129, 1, 77};
      const int s1 = 1000, l1 = 129, s0 = 0, l2 = 1000;
      fails += tt_prefill_case(&real_full, 4, starts, lens);
      fails += tt_prefill_case(&real_slide, 4, starts, lens);
      fails += tt_prefill_case(&tiny_slide, 4, starts, lens);
      fails += tt_prefill_case(&real_full, 1, &s1, &l1);
      fails += tt_prefill_case(&real_slide, 1, &s1, &l1);
      fails += tt_prefill_case(&real_full, 1, &s0, &l2);
      fails += tt_prefill_case(&bs12_full, 4, starts, lens);
      fails += tt_prefill_case(&bs12_slide, 4, starts, lens);
      /* Built for the fp8 cache. Not `spread`: the prefill kernel rounds the
       * dequantized tiles to bf16 (what a bf16 cache holds) and the f32
       * reference does not; with keys scaled by up to 2^8 the scores are
       * large and that rounding shows (rel L2 2.4e-2 on the H100,
       * 2026-12-07, the same in variants 0, 4 and 5, where the same
       * sequences without the spread pass at 3.6e-3). The spread is the
       * decode kernel's case (its V-unit rescaling). */
      if (g_variant == 0 || g_variant == 4 || g_variant == 5) {
        fails += tt_fp8_case(&real_slide, 1, 4, starts, lens, 0);
        fails += tt_fp8_case(&bs12_full, 1, 4, starts, lens, 0);
        fails += tt_fp8_case(&bs12_slide, 1, 4, starts, lens, 0);
      }
    }
  }
  printf("%s: %d failing case(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
