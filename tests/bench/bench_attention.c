/* bench_attention.c (twain-bench-attention): times the attention kernels of
 * attention.h on the gpt-oss shapes (NQ 64, NKV 8, D 64, block 16).
 *   prefill: one sequence of T tokens from position 0, full and sliding (W 128)
 *     layer; TFLOP/s counts 4 * D * NQ per unmasked (query, key) pair.
 *   decode: B sequences of `ctx` keys each; GB/s counts the K/V bytes read
 *     (B * ctx * NKV * D * 2 * 2); inputs rotate over enough copies of the
 *     pool to exceed the 60 MB L2.
 * CUDA events after a warm-up, median of several runs. Random non-zero bf16
 * data (a random host buffer tiled over the device buffers).
 * Usage: twain-bench-attention [prefill|decode|decode-fp8|all] [prefill variants, e.g. 0,4]
 * (decode-fp8: the decode rows on the fp8 KV cache)
 * (default: all, through tw_cuda_attention_prefill and its own variant choice). */
#include "kernels/attention.h"

#include "bench_util.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NQ 64
#define NKV 8
#define D 64
#define BS 16


#define RAND_BYTES (64u << 20)
static uint16_t *g_rand_dev; /* 64 MiB of random bf16 on the device */

static int fill_random(void *dst, size_t bytes) {
  for (size_t off = 0; off < bytes; off += RAND_BYTES) {
    size_t n = bytes - off < RAND_BYTES ? bytes - off : RAND_BYTES;
    CK(cudaMemcpy((char *)dst + off, g_rand_dev, n, cudaMemcpyDeviceToDevice));
  }
  return 0;
}


/* Tuning entry of attention_prefill.cu (not in attention.h). */
TW_NODISCARD tw_status_t tw_cuda_attention_prefill_variant(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
    const int32_t *start_pos, const int32_t *block_tables, int32_t block_table_stride, void *out,
    int variant, cudaStream_t stream);
#define N_VARIANTS 8

/* Host copy of variant 0's output of the current (T, window), to check the others. */
static uint16_t *g_ref_out[2]; /* [full, sliding] */

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static int bench_prefill(int T, int window, int variant) {
  const size_t q_bytes = (size_t)T * NQ * D * 2;
  const int n_blocks = (T + BS - 1) / BS;
  const size_t pool_bytes = (size_t)n_blocks * 2 * NKV * BS * D * 2;
  void *q, *pool, *out;
  float *sinks;
  int32_t *cu, *start, *bt;
  CK(cudaMalloc(&q, q_bytes));
  CK(cudaMalloc(&out, q_bytes));
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMalloc((void **)&sinks, NQ * sizeof(float)));
  CK(cudaMalloc((void **)&cu, 2 * sizeof(int32_t)));
  CK(cudaMalloc((void **)&start, sizeof(int32_t)));
  CK(cudaMalloc((void **)&bt, n_blocks * sizeof(int32_t)));
  if (fill_random(q, q_bytes) || fill_random(pool, pool_bytes)) return 1;
  float hs[NQ];
  for (int h = 0; h < NQ; h++) hs[h] = (float)((h * 37) % 11) * 0.4f - 2.0f;
  int32_t *hbt = malloc(n_blocks * sizeof(int32_t));
  for (int i = 0; i < n_blocks; i++) hbt[i] = i;
  int32_t hcu[2] = {0, T}, hst = 0;
  CK(cudaMemcpy(sinks, hs, sizeof hs, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(cu, hcu, sizeof hcu, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(start, &hst, sizeof hst, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bt, hbt, n_blocks * sizeof(int32_t), cudaMemcpyHostToDevice));
  free(hbt);
  const tw_cuda_attn_shape_t sh = {.n_q_heads = NQ, .n_kv_heads = NKV, .head_dim = D,
                                   .block_size = BS, .window = window, .scale = 0.125f};
  double pairs = 0;
  for (int64_t p = 0; p < T; p++) pairs += (window > 0 && p + 1 > window) ? window : p + 1;
  const double flops = 4.0 * D * NQ * pairs;
  const int reps = T >= 65536 ? 3 : 7;
  float ms[8];
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int r = -1; r < reps; r++) {
    CK(cudaEventRecord(e0, 0));
    const tw_status_t st =
        variant < 0 ? tw_cuda_attention_prefill(&sh, q, NQ * D, pool, sinks, 1, T, cu, start, bt,
                                                n_blocks, out, 0)
                    : tw_cuda_attention_prefill_variant(&sh, q, NQ * D, pool, sinks, 1, T, cu,
                                                        start, bt, n_blocks, out, variant, 0);
    if (st != 0) return 1;
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    if (r >= 0) CK(cudaEventElapsedTime(&ms[r], e0, e1));
  }
  CK(cudaGetLastError());
  qsort(ms, reps, sizeof(float), cmp_float);
  const double med = ms[reps / 2];
  const double tf = flops / (med * 1e-3) / 1e12;
  /* variants must agree with variant 0 (same math, different tiling) */
  char agree[64] = "";
  if (T <= 32768 && variant >= 0) {
    const size_t n = (size_t)T * NQ * D;
    uint16_t *h = malloc(n * 2);
    CK(cudaMemcpy(h, out, n * 2, cudaMemcpyDeviceToHost));
    if (variant == 0) {
      free(g_ref_out[window > 0]);
      g_ref_out[window > 0] = h;
    } else {
      double e2 = 0, r2 = 0;
      long bad = 0;
      for (size_t i = 0; i < n; i++) {
        const double a = bf2f(h[i]), b = bf2f(g_ref_out[window > 0][i]);
        if (!isfinite(a)) bad++;
        e2 += (a - b) * (a - b);
        r2 += b * b;
      }
      snprintf(agree, sizeof agree, " vs v0 rel_l2 %.1e, %ld non-finite", sqrt(e2 / r2), bad);
      free(h);
    }
  }
  char vname[16] = "default";
  if (variant >= 0) snprintf(vname, sizeof vname, "v%d", variant);
  printf("| prefill %s | %s | %d | %.3f | %.1f | %.0f%% |%s\n", vname,
         window ? "sliding W128" : "full", T, med, tf, 100.0 * tf / TFLOPS_CEIL, agree);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(q);
  cudaFree(out);
  cudaFree(pool);
  cudaFree(sinks);
  cudaFree(cu);
  cudaFree(start);
  cudaFree(bt);
  return 0;
}

/* B sequences of ctx keys; max_len is the host bound (the decode graphs pass
 * their context bucket, up to 2x ctx, which sizes the split grid).
 * fp8: the pool in the fp8 KV cache's layout (common/kv/kv_fp8.h: e4m3 rows
 * and one f32 scale a (token, KV head); random bytes, timing only); the bytes
 * counted are then the e4m3 rows and their scales. */
static int bench_decode(int B, int ctx, int max_len, int window, int fp8) {
  const int nb_seq = (ctx + BS - 1) / BS;
  const size_t tok_bytes = fp8 ? (size_t)(D + 4) : (size_t)D * 2; /* a (token, head) of K or V */
  const size_t set_bytes = (size_t)B * nb_seq * 2 * NKV * BS * tok_bytes;
  int n_rot = (int)((256u << 20) / set_bytes) + 1; /* > 256 MiB over all copies */
  if (n_rot > 8) n_rot = 8;
  void *q, *pool, *out, *ws;
  float *sinks;
  int32_t *lens, *bt;
  CK(cudaMalloc(&q, (size_t)B * NQ * D * 2));
  CK(cudaMalloc(&out, (size_t)B * NQ * D * 2));
  CK(cudaMalloc(&pool, set_bytes * n_rot));
  CK(cudaMalloc((void **)&sinks, NQ * sizeof(float)));
  CK(cudaMalloc((void **)&lens, B * sizeof(int32_t)));
  CK(cudaMalloc((void **)&bt, (size_t)n_rot * B * nb_seq * sizeof(int32_t)));
  if (fill_random(q, (size_t)B * NQ * D * 2) || fill_random(pool, set_bytes * n_rot)) return 1;
  int32_t *hbt = malloc((size_t)n_rot * B * nb_seq * sizeof(int32_t));
  for (size_t i = 0; i < (size_t)n_rot * B * nb_seq; i++) hbt[i] = (int32_t)i;
  int32_t *hl = malloc(B * sizeof(int32_t));
  for (int b = 0; b < B; b++) hl[b] = ctx;
  float hs[NQ];
  for (int h = 0; h < NQ; h++) hs[h] = (float)((h * 37) % 11) * 0.4f - 2.0f;
  CK(cudaMemcpy(bt, hbt, (size_t)n_rot * B * nb_seq * sizeof(int32_t), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(lens, hl, B * sizeof(int32_t), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sinks, hs, sizeof hs, cudaMemcpyHostToDevice));
  free(hbt);
  free(hl);
  const tw_cuda_attn_shape_t sh = {.n_q_heads = NQ,
                                   .n_kv_heads = NKV,
                                   .head_dim = D,
                                   .block_size = BS,
                                   .window = window,
                                   .scale = 0.125f,
                                   .kv_fp8 = fp8};
  const size_t ws_bytes = tw_cuda_attention_decode_workspace_bytes(&sh, B, max_len);
  CK(cudaMalloc(&ws, ws_bytes));
  CK(cudaMemset(ws, 0, ws_bytes)); /* the split counters start at zero */
  const int iters = 20, reps = 5;
  float ms[5];
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int r = -1; r < reps; r++) {
    CK(cudaEventRecord(e0, 0));
    for (int i = 0; i < iters; i++) {
      const int32_t *btr = bt + (size_t)(i % n_rot) * B * nb_seq;
      if (tw_cuda_attention_decode(&sh, q, NQ * D, pool, sinks, B, lens, btr, nb_seq, max_len, ws,
                                   ws_bytes, out, 0) != 0)
        return 1;
    }
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    if (r >= 0) CK(cudaEventElapsedTime(&ms[r], e0, e1));
  }
  CK(cudaGetLastError());
  qsort(ms, reps, sizeof(float), cmp_float);
  const double med = ms[reps / 2] / iters;
  const int keys = window > 0 && window < ctx ? window : ctx;
  const double bytes = (double)B * keys * NKV * (double)tok_bytes * 2;
  const double gbs = bytes / (med * 1e-3) / 1e9;
  char bound[32] = "";
  if (max_len != ctx) snprintf(bound, sizeof bound, " (bound %d)", max_len);
  printf("| decode%s | %s | B=%d ctx=%d%s | %.4f | %.0f | %.0f%% |\n", fp8 ? " fp8" : "",
         window ? "sliding W128" : "full", B, ctx, bound, med, gbs, 100.0 * gbs / GBS_CEIL);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(q);
  cudaFree(out);
  cudaFree(pool);
  cudaFree(sinks);
  cudaFree(lens);
  cudaFree(bt);
  cudaFree(ws);
  return 0;
}

int main(int argc, char **argv) {
  const char *what = argc > 1 ? argv[1] : "all";
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no GPU\n");
    return 77;
  }
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  uint16_t *hr = malloc(RAND_BYTES);
  uint64_t s = 0x1234567ull;
  for (size_t i = 0; i < RAND_BYTES / 2; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    /* bf16 in about [-2, 2], never zero: sign, exponent 126..128, random mantissa */
    const uint16_t sign = (uint16_t)((s >> 63) << 15);
    const uint16_t ex = (uint16_t)(126 + (s >> 40) % 3);
    hr[i] = sign | (uint16_t)(ex << 7) | (uint16_t)((s >> 20) & 0x7f);
  }
  CK(cudaMalloc((void **)&g_rand_dev, RAND_BYTES));
  CK(cudaMemcpy(g_rand_dev, hr, RAND_BYTES, cudaMemcpyHostToDevice));
  free(hr);
  int rc = 0;
  if (!strcmp(what, "prefill") || !strcmp(what, "all")) {
    /* variant list "0,4,6" (argv[2]); without one, tw_cuda_attention_prefill
     * itself (variant -1). Put 0 first for the agreement check. */
    int vars[N_VARIANTS], n_vars = 0;
    const char *vl = argc > 2 ? argv[2] : "";
    for (const char *c = vl; *c && n_vars < N_VARIANTS; c++)
      if (*c >= '0' && *c < '0' + N_VARIANTS) vars[n_vars++] = *c - '0';
    if (n_vars == 0) vars[n_vars++] = -1;
    printf("| kernel | layer | tokens | ms | TFLOP/s | of 742 |\n|---|---|---|---|---|---|\n");
    const int Ts[] = {8192, 32768, 65536, 128000};
    for (int i = 0; i < 4 && !rc; i++)
      for (int v = 0; v < n_vars && !rc; v++) {
        /* long runs: only variant 0 of an mma.sync-only list, and wgmma ones */
        if (Ts[i] > 32768 && vars[v] >= 0 && vars[v] < 4 &&
            !(vars[v] == 0 && vars[n_vars - 1] < 4))
          continue;
        rc |= bench_prefill(Ts[i], 0, vars[v]);
        rc |= bench_prefill(Ts[i], 128, vars[v]);
      }
  }
  const int fp8 = !strcmp(what, "decode-fp8");
  if (!strcmp(what, "decode") || fp8 || !strcmp(what, "all")) {
    printf("| kernel | layer | batch x context | ms | GB/s (K/V read) | of 4200 |\n"
           "|---|---|---|---|---|---|\n");
    const int Bs[] = {1, 4, 16, 64, 128, 256};
    const int ctxs[] = {8192, 32768};
    for (int c = 0; c < 2 && !rc; c++)
      for (int i = 0; i < 6 && !rc; i++) rc |= bench_decode(Bs[i], ctxs[c], ctxs[c], 0, fp8);
    /* the engine's shapes at context 1,024: batches 64..1,024 */
    for (int i = 2; i < 6 && !rc; i++) rc |= bench_decode(4 * Bs[i], 1024, 1024, 0, fp8);
    /* batch 1 as a decode graph sees it: a context one past the bucket below */
    for (int c = 0; c < 2 && !rc; c++) rc |= bench_decode(1, ctxs[c] + 1, 2 * ctxs[c], 0, fp8);
    rc |= bench_decode(1, 8193, 16384, 128, fp8);
    rc |= bench_decode(64, 32768, 32768, 128, fp8);
  }
  cudaFree(g_rand_dev);
  return rc;
}
