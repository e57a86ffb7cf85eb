/* bench_moe.c (twain-bench-moe): times the prefill MoE of kernels/moe.h on
 * the gpt-oss shapes (H = I = 2880, top-4; 20b: 32 experts, 120b: 128) for
 * T tokens, with random MXFP4 experts (E8M0 scales 2^-8..2^-4) and random
 * router logits (about T*4/E rows per expert):
 *   grouped    tw_cuda_moe_prefill on the MXFP4 experts (no host sync)
 *   cublas     tw_cuda_moe_prefill_cublas on experts dequantised beforehand
 *              (the engine's previous path: the dequantisation ran on a side
 *              stream, one layer ahead), host sync included
 *   dequant    tw_cuda_moe_dequant of the whole layer (what that side stream
 *              paid per layer and chunk)
 * Each is the whole block (GEMMs, SwiGLU, combine). TFLOP/s counts the expert
 * GEMMs only: 2 * T * k * (2I * H + H * I); against the 742 TFLOP/s bf16 GEMM
 * ceiling of MACHINES.md. CUDA events after a warm-up, median of 7 runs. The
 * grouped and cuBLAS outputs are compared (relative L2; above 1e-2 the
 * benchmark fails) as a sanity check.
 * Usage: twain-bench-moe [T,T,...] (default 128,1024,8192). */
#include "kernels/gemm.h"
#include "kernels/moe.h"

#include "bench_util.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 7

#define TWK(call)                                                                  \
  do {                                                                             \
    if ((call) != TW_OK) {                                                         \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, tw_last_error()); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint64_t rng(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static float normal(void) {
  double u1 = ((rng() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
  double u2 = (rng() >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}


/* Random bytes in [lo, lo + span) over n bytes of device memory (host staging). */
static int fill_bytes(void *d, size_t n, int lo, int span) {
  size_t chunk = (size_t)64 << 20;
  uint8_t *h = malloc(chunk);
  if (!h) return 1;
  for (size_t i = 0; i < chunk; i++) h[i] = (uint8_t)(lo + (int)(rng() % (uint64_t)span));
  for (size_t off = 0; off < n; off += chunk) {
    size_t m = n - off < chunk ? n - off : chunk;
    if (cudaMemcpy((char *)d + off, h, m, cudaMemcpyHostToDevice) != cudaSuccess) {
      free(h);
      return 1;
    }
  }
  free(h);
  return 0;
}

typedef enum { RUN_GROUPED, RUN_CUBLAS, RUN_DEQUANT } run_kind_t;

typedef struct {
  tw_cuda_gemm_t *gemm;
  tw_cuda_moe_weights_t *w;
  tw_cuda_moe_route_t *r;
  int T;
  void *x, *wdq, *ws;
  size_t ws_bytes;
  int32_t *hc;
  float *out;
  cudaStream_t s;
} ctx_t;

static TW_NODISCARD tw_status_t run_once(const ctx_t *c, run_kind_t k) {
  switch (k) {
  case RUN_GROUPED:
    return tw_cuda_moe_prefill(c->w, c->r, c->T, c->x, NULL, c->ws, c->ws_bytes, c->out, c->s);
  case RUN_CUBLAS:
    return tw_cuda_moe_prefill_cublas(c->gemm, c->w, c->r, c->T, c->x, c->wdq, c->ws, c->ws_bytes,
                                      c->hc, c->out, c->s);
  default:
    return tw_cuda_moe_dequant(c->w, NULL, c->wdq, c->s);
  }
}

/* Median milliseconds of REPS runs after one warm-up; -1 on an error. */
static double time_ms(const ctx_t *c, run_kind_t k) {
  cudaEvent_t a, b;
  float t[REPS];
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return -1;
  if (run_once(c, k) != TW_OK || cudaStreamSynchronize(c->s) != cudaSuccess) return -1;
  for (int i = 0; i < REPS; i++) {
    cudaEventRecord(a, c->s);
    if (run_once(c, k) != TW_OK) return -1;
    cudaEventRecord(b, c->s);
    if (cudaEventSynchronize(b) != cudaSuccess) return -1;
    cudaEventElapsedTime(&t[i], a, b);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  qsort(t, REPS, sizeof t[0], cmp_float);
  return t[REPS / 2];
}

static int bench_model(const char *name, int E, const int *Ts, int nT, tw_cuda_gemm_t *gemm,
                       cudaStream_t s) {
  const int H = 2880, I = 2880, k = 4;
  int Tmax = 0;
  for (int i = 0; i < nT; i++) Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
  size_t n_gu = (size_t)E * 2 * I * (H / 32), n_dn = (size_t)E * H * (I / 32);
  tw_cuda_moe_weights_t w = {E, H, I, NULL, NULL, NULL, NULL, NULL, NULL, 1.702f, 7.0f};
  void *gub, *gus, *dnb, *dns, *gbias, *dbias, *x, *logits, *rmem, *wdq, *ws, *out, *out2;
  CK(cudaMalloc(&gub, n_gu * 16));
  CK(cudaMalloc(&gus, n_gu));
  CK(cudaMalloc(&dnb, n_dn * 16));
  CK(cudaMalloc(&dns, n_dn));
  CK(cudaMalloc(&gbias, (size_t)E * 2 * I * 4));
  CK(cudaMalloc(&dbias, (size_t)E * H * 4));
  if (fill_bytes(gub, n_gu * 16, 0, 256) || fill_bytes(dnb, n_dn * 16, 0, 256) ||
      fill_bytes(gus, n_gu, 119, 5) || fill_bytes(dns, n_dn, 119, 5))
    return 1;
  CK(cudaMemset(gbias, 0, (size_t)E * 2 * I * 4));
  CK(cudaMemset(dbias, 0, (size_t)E * H * 4));
  w.gate_up_blocks = gub;
  w.gate_up_scales = gus;
  w.down_blocks = dnb;
  w.down_scales = dns;
  w.gate_up_bias = gbias;
  w.down_bias = dbias;
  size_t rb = tw_cuda_moe_route_bytes(Tmax, E, k);
  size_t wsa = tw_cuda_moe_prefill_ws_bytes(Tmax, k, H, I);
  size_t wsb = tw_cuda_moe_prefill_cublas_ws_bytes(Tmax, E, k, H, I, 0);
  size_t wsz = wsa > wsb ? wsa : wsb;
  CK(cudaMalloc(&x, (size_t)Tmax * H * 2));
  CK(cudaMalloc(&logits, (size_t)Tmax * E * 4));
  CK(cudaMalloc(&rmem, rb));
  CK(cudaMalloc(&wdq, tw_cuda_moe_dequant_bytes(E, H, I)));
  CK(cudaMalloc(&ws, wsz));
  CK(cudaMalloc(&out, (size_t)Tmax * H * 4));
  CK(cudaMalloc(&out2, (size_t)Tmax * H * 4));
  {
    uint16_t *hx = malloc((size_t)Tmax * H * 2);
    float *hl = malloc((size_t)Tmax * E * 4);
    if (!hx || !hl) return 1;
    for (size_t i = 0; i < (size_t)Tmax * H; i++) {
      float f = normal();
      uint32_t u;
      memcpy(&u, &f, 4);
      hx[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    for (size_t i = 0; i < (size_t)Tmax * E; i++) hl[i] = normal();
    CK(cudaMemcpy(x, hx, (size_t)Tmax * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(logits, hl, (size_t)Tmax * E * 4, cudaMemcpyHostToDevice));
    free(hx);
    free(hl);
  }
  int32_t *hc;
  CK(cudaMallocHost((void **)&hc, (size_t)E * 4));
  tw_cuda_moe_route_t r;
  TWK(tw_cuda_moe_route_init(rmem, rb, Tmax, E, k, &r));
  TWK(tw_cuda_moe_dequant(&w, NULL, wdq, s));
  CK(cudaStreamSynchronize(s));
  double mxfp4_gb = (double)(n_gu + n_dn) * 17.0 / 1e9;
  printf("gpt-oss-%s experts: E=%d H=%d I=%d top-%d, MXFP4 %.2f GB per layer, bf16 %.2f GB\n",
         name, E, H, I, k, mxfp4_gb, (double)tw_cuda_moe_dequant_bytes(E, H, I) / 1e9);
  for (int i = 0; i < nT; i++) {
    int T = Ts[i];
    TWK(tw_cuda_moe_route(&r, logits, T, s));
    CK(cudaStreamSynchronize(s));
    ctx_t c = {gemm, &w, &r, T, x, wdq, ws, wsz, hc, out, s};
    double flop = 2.0 * T * k * (2.0 * I * H + (double)H * I);
    double best = time_ms(&c, RUN_GROUPED);
    /* sanity: grouped against cuBLAS */
    double rel = -1;
    {
      ctx_t c2 = c;
      c2.out = out2;
      if (run_once(&c, RUN_GROUPED) != TW_OK || run_once(&c2, RUN_CUBLAS) != TW_OK) return 1;
      CK(cudaStreamSynchronize(s));
      size_t n = (size_t)T * H;
      float *a = malloc(n * 4), *b = malloc(n * 4);
      if (!a || !b) return 1;
      CK(cudaMemcpy(a, out, n * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b, out2, n * 4, cudaMemcpyDeviceToHost));
      double e2 = 0, r2 = 0;
      for (size_t j = 0; j < n; j++) {
        double d = (double)a[j] - b[j];
        e2 += d * d;
        r2 += (double)b[j] * b[j];
      }
      rel = isfinite(e2) && r2 > 0 ? sqrt(e2 / r2) : 1e30;
      free(a);
      free(b);
    }
    double cb = time_ms(&c, RUN_CUBLAS);
    double dq = time_ms(&c, RUN_DEQUANT);
    if (!(rel <= 1e-2)) {
      fprintf(stderr, "bench_moe: grouped and cuBLAS outputs differ (rel L2 %.2e > 1e-2)\n", rel);
      return 1;
    }
    if (best < 0 || cb < 0 || dq < 0) {
      fprintf(stderr, "bench_moe: a run failed: %s\n", tw_last_error());
      return 1;
    }
    printf("| %s | %d | %d | %.3f | %.0f (%.0f%%) | %.3f | %.0f | %.3f | %.2fx | %.1e |\n", name,
           T, T * k, best, flop / best / 1e9, 100.0 * flop / best / 1e9 / TFLOPS_CEIL, cb,
           flop / cb / 1e9, dq, cb / best, rel);
    fflush(stdout);
  }
  cudaFree(gub); cudaFree(gus); cudaFree(dnb); cudaFree(dns); cudaFree(gbias); cudaFree(dbias);
  cudaFree(x); cudaFree(logits); cudaFree(rmem); cudaFree(wdq); cudaFree(ws); cudaFree(out);
  cudaFree(out2);
  cudaFreeHost(hc);
  return 0;
}

int main(int argc, char **argv) {
  int Ts[16] = {128, 1024, 8192}, nT = 3;
  if (argc > 1) {
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
      printf("usage: twain-bench-moe [T,T,...]   (tokens per call; default 128,1024,8192)\n");
      return 0;
    }
    nT = 0;
    for (char *p = argv[1]; *p && nT < 16;) {
      long v = strtol(p, &p, 10);
      if (v <= 0 || v > 65536) {
        fprintf(stderr, "twain-bench-moe: bad token count list '%s'\n", argv[1]);
        return 2;
      }
      Ts[nT++] = (int)v;
      if (*p == ',') p++;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("twain-bench-moe: no GPU\n");
    return 77;
  }
  if (!tw_cuda_moe_grouped_supported(2880, 2880)) {
    printf("twain-bench-moe: the grouped GEMM needs compute capability 9.0\n");
    return 77;
  }
  cudaStream_t s;
  tw_cuda_gemm_t *gemm = NULL;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TWK(tw_cuda_moe_setup());
  TWK(tw_cuda_gemm_create(0, &gemm));
  printf("prefill MoE block, ms (median of %d); TFLOP/s of the expert GEMMs (%% of %.0f)\n", REPS,
         TFLOPS_CEIL);
  printf("| model | T | T*k | grouped | grouped TFLOP/s | cublas | cublas TFLOP/s | dequant | "
         "cublas/grouped | rel L2 |\n|---|---|---|---|---|---|---|---|---|---|\n");
  int rc = bench_model("20b", 32, Ts, nT, gemm, s) || bench_model("120b", 128, Ts, nT, gemm, s);
  tw_cuda_gemm_destroy(gemm);
  cudaStreamDestroy(s);
  return rc;
}
