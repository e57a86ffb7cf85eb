/* bench_moe.c (twain-bench-moe): times the prefill MoE of kernels/moe.h on
 * the gpt-oss shapes (H = I = 2880, top-4; 20b: 32 experts, 120b: 128) for
 * T tokens, with random MXFP4 experts (E8M0 scales 2^-8..2^-4) and random
 * router logits (about T*4/E rows per expert):
 *   grouped    tw_cuda_moe_prefill on the MXFP4 experts (no host sync)
 *   cublas     tw_cuda_moe_prefill_cublas on experts dequantised beforehand
 *              (the engine's previous path: the dequantisation ran on a side
 *              stream, one layer ahead), host sync included
 *   grouped bf16  tw_cuda_moe_prefill on the same dequantised experts
 *   dequant    tw_cuda_moe_dequant of the whole layer (what that side stream
 *              paid per layer and chunk)
 * Each is the whole block (GEMMs, SwiGLU, combine). TFLOP/s counts the expert
 * GEMMs only: 2 * T * k * (2I * H + H * I); against the 742 TFLOP/s bf16 GEMM
 * ceiling of MACHINES.md. CUDA events after a warm-up, median of 7 runs. The
 * grouped and cuBLAS outputs are compared (relative L2; above 1e-2 the
 * benchmark fails) as a sanity check.
 * --decode: decode batches instead (default T = 16, 64, 256, 512, 1024):
 * the grouped GEMM's wgmma kernel ("old") against its streaming decode kernel
 * ("new", TWAIN_CUDA_MOE_STREAM, kernels/moe_grouped.cu; it runs at the
 * 16- and 32-row tiles, other tiles stay on the wgmma kernel; --pass 16|32
 * makes its TMA kernel take every load at that pass) in one process, at the tile
 * tw_cuda_moe_prefill picks, with the bytes the block must move (the selected
 * experts once, the token rows, activations and outputs), TB/s and TFLOP/s
 * of each, old/new and the relative L2 of new against old (above 1e-3 the
 * benchmark fails).
 * Usage: twain-bench-moe [--decode [--pass 16|32]] [T,T,...] (default 128,1024,8192). */
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

typedef enum { RUN_GROUPED, RUN_GROUPED_BF16, RUN_CUBLAS, RUN_DEQUANT } run_kind_t;

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
  case RUN_GROUPED_BF16:
    return tw_cuda_moe_prefill(c->w, c->r, c->T, c->x, c->wdq, c->ws, c->ws_bytes, c->out, c->s);
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

/* One model's layer of experts and inputs on the device (random MXFP4
 * experts, E8M0 scales 2^-8..2^-4, zero biases, N(0,1) bf16 tokens and
 * router logits) for up to Tmax tokens. */
typedef struct {
  int E, H, I, k, Tmax;
  tw_cuda_moe_weights_t w;
  tw_cuda_moe_route_t r;
  void *gub, *gus, *dnb, *dns, *gbias, *dbias, *x, *logits, *rmem, *wdq, *ws, *out, *out2;
  size_t wsz;
  int32_t *hc;
} model_t;

static void model_free(model_t *m) {
  cudaFree(m->gub);
  cudaFree(m->gus);
  cudaFree(m->dnb);
  cudaFree(m->dns);
  cudaFree(m->gbias);
  cudaFree(m->dbias);
  cudaFree(m->x);
  cudaFree(m->logits);
  cudaFree(m->rmem);
  cudaFree(m->wdq);
  cudaFree(m->ws);
  cudaFree(m->out);
  cudaFree(m->out2);
  cudaFreeHost(m->hc);
}

static int model_init(model_t *m, int E, int Tmax, int with_dequant, cudaStream_t s) {
  const int H = 2880, I = 2880, k = 4;
  memset(m, 0, sizeof *m);
  m->E = E, m->H = H, m->I = I, m->k = k, m->Tmax = Tmax;
  size_t n_gu = (size_t)E * 2 * I * (H / 32), n_dn = (size_t)E * H * (I / 32);
  tw_cuda_moe_weights_t w = {E, H, I, NULL, NULL, NULL, NULL, NULL, NULL, 1.702f, 7.0f};
  /* the experts' blocks in the packed layout (moe.h TW_MX_CHUNK): random
   * bytes, so packing them would change nothing that is timed */
  CK(cudaMalloc(&m->gub, tw_cuda_mxfp4_packed_bytes(E, 2 * I, H)));
  CK(cudaMalloc(&m->gus, n_gu));
  CK(cudaMalloc(&m->dnb, tw_cuda_mxfp4_packed_bytes(E, H, I)));
  CK(cudaMalloc(&m->dns, n_dn));
  CK(cudaMalloc(&m->gbias, (size_t)E * 2 * I * 4));
  CK(cudaMalloc(&m->dbias, (size_t)E * H * 4));
  if (fill_bytes(m->gub, tw_cuda_mxfp4_packed_bytes(E, 2 * I, H), 0, 256) ||
      fill_bytes(m->dnb, tw_cuda_mxfp4_packed_bytes(E, H, I), 0, 256) ||
      fill_bytes(m->gus, n_gu, 119, 5) || fill_bytes(m->dns, n_dn, 119, 5))
    return 1;
  CK(cudaMemset(m->gbias, 0, (size_t)E * 2 * I * 4));
  CK(cudaMemset(m->dbias, 0, (size_t)E * H * 4));
  w.gate_up_blocks = m->gub;
  w.gate_up_scales = m->gus;
  w.down_blocks = m->dnb;
  w.down_scales = m->dns;
  w.gate_up_bias = m->gbias;
  w.down_bias = m->dbias;
  m->w = w;
  size_t rb = tw_cuda_moe_route_bytes(Tmax, E, k);
  size_t wsa = tw_cuda_moe_prefill_ws_bytes(Tmax, k, H, I);
  size_t wsb = with_dequant ? tw_cuda_moe_prefill_cublas_ws_bytes(Tmax, E, k, H, I, 0) : 0;
  m->wsz = wsa > wsb ? wsa : wsb;
  CK(cudaMalloc(&m->x, (size_t)Tmax * H * 2));
  CK(cudaMalloc(&m->logits, (size_t)Tmax * E * 4));
  CK(cudaMalloc(&m->rmem, rb));
  if (with_dequant) CK(cudaMalloc(&m->wdq, tw_cuda_moe_dequant_bytes(E, H, I)));
  CK(cudaMalloc(&m->ws, m->wsz));
  CK(cudaMalloc(&m->out, (size_t)Tmax * H * 4));
  CK(cudaMalloc(&m->out2, (size_t)Tmax * H * 4));
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
    CK(cudaMemcpy(m->x, hx, (size_t)Tmax * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(m->logits, hl, (size_t)Tmax * E * 4, cudaMemcpyHostToDevice));
    free(hx);
    free(hl);
  }
  CK(cudaMallocHost((void **)&m->hc, (size_t)E * 4));
  TWK(tw_cuda_moe_route_init(m->rmem, rb, Tmax, E, k, &m->r));
  if (with_dequant) TWK(tw_cuda_moe_dequant(&m->w, NULL, m->wdq, s));
  CK(cudaStreamSynchronize(s));
  return 0;
}

/* Relative L2 of a against b over n floats of device memory (1e30 when not finite). */
static double rel_l2_dev(const void *da, const void *db, size_t n) {
  float *a = malloc(n * 4), *b = malloc(n * 4);
  double e2 = 0, r2 = 0;
  if (!a || !b || cudaMemcpy(a, da, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(b, db, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
    free(a);
    free(b);
    return 1e30;
  }
  for (size_t j = 0; j < n; j++) {
    double d = (double)a[j] - b[j];
    e2 += d * d;
    r2 += (double)b[j] * b[j];
  }
  free(a);
  free(b);
  return isfinite(e2) && r2 > 0 ? sqrt(e2 / r2) : 1e30;
}

static int bench_model(const char *name, int E, const int *Ts, int nT, tw_cuda_gemm_t *gemm,
                       cudaStream_t s) {
  int Tmax = 0;
  for (int i = 0; i < nT; i++) Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
  model_t m;
  if (model_init(&m, E, Tmax, 1, s)) return 1;
  const int H = m.H, I = m.I, k = m.k;
  size_t n_gu = (size_t)E * 2 * I * (H / 32), n_dn = (size_t)E * H * (I / 32);
  double mxfp4_gb = (double)(n_gu + n_dn) * 17.0 / 1e9;
  printf("gpt-oss-%s experts: E=%d H=%d I=%d top-%d, MXFP4 %.2f GB per layer, bf16 %.2f GB\n",
         name, E, H, I, k, mxfp4_gb, (double)tw_cuda_moe_dequant_bytes(E, H, I) / 1e9);
  for (int i = 0; i < nT; i++) {
    int T = Ts[i];
    TWK(tw_cuda_moe_route(&m.r, m.logits, T, s));
    CK(cudaStreamSynchronize(s));
    ctx_t c = {gemm, &m.w, &m.r, T, m.x, m.wdq, m.ws, m.wsz, m.hc, m.out, s};
    double flop = 2.0 * T * k * (2.0 * I * H + (double)H * I);
    double best = time_ms(&c, RUN_GROUPED);
    /* sanity: grouped against cuBLAS */
    ctx_t c2 = c;
    c2.out = m.out2;
    if (run_once(&c, RUN_GROUPED) != TW_OK || run_once(&c2, RUN_CUBLAS) != TW_OK) return 1;
    CK(cudaStreamSynchronize(s));
    double rel = rel_l2_dev(m.out, m.out2, (size_t)T * H);
    double cb = time_ms(&c, RUN_CUBLAS);
    double gb = time_ms(&c, RUN_GROUPED_BF16);
    double dq = time_ms(&c, RUN_DEQUANT);
    if (!(rel <= 1e-2)) {
      fprintf(stderr, "bench_moe: grouped and cuBLAS outputs differ (rel L2 %.2e > 1e-2)\n", rel);
      return 1;
    }
    if (best < 0 || cb < 0 || gb < 0 || dq < 0) {
      fprintf(stderr, "bench_moe: a run failed: %s\n", tw_last_error());
      return 1;
    }
    printf(
        "| %s | %d | %d | %.3f | %.0f (%.0f%%) | %.3f | %.0f | %.3f | %.0f | %.3f | %.2fx | %.1e "
        "|\n",
        name, T, T * k, best, flop / best / 1e9, 100.0 * flop / best / 1e9 / TFLOPS_CEIL, cb,
        flop / cb / 1e9, gb, flop / gb / 1e9, dq, cb / best, rel);
    fflush(stdout);
  }
  model_free(&m);
  return 0;
}

/* Decode shapes: tw_cuda_moe_prefill with the wgmma kernel ("old",
 * tw_cuda_moe_set_stream(0)) against the streaming kernel ("new",
 * tw_cuda_moe_set_stream(1); 16- and 32-row tiles), at the tile the rule picks (or TWAIN_CUDA_MOE_BT). Bytes: the
 * MXFP4 blocks, scales and biases of the experts the route selects (each
 * once) plus the token rows in (bf16), the activations (bf16) and expert
 * outputs (f32) written and read once, and the output (f32): the floor a
 * step's MoE must move. */
static int bench_decode(const char *name, int E, const int *Ts, int nT, cudaStream_t s) {
  int Tmax = 0;
  for (int i = 0; i < nT; i++) Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
  model_t m;
  if (model_init(&m, E, Tmax, 0, s)) return 1;
  const int H = m.H, I = m.I, k = m.k;
  const double per_expert =
      (double)2 * I * (H / 32) * 17 + (double)H * (I / 32) * 17 + (double)(2 * I + H) * 4;
  const char *forced = getenv("TWAIN_CUDA_MOE_BT");
  const uint32_t keep = tw_cuda_moe_mma_tiles();
  for (int i = 0; i < nT; i++) {
    const int T = Ts[i], tk = T * k;
    TWK(tw_cuda_moe_route(&m.r, m.logits, T, s));
    CK(cudaMemcpyAsync(m.hc, m.r.counts, (size_t)E * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    int active = 0, maxc = 0;
    for (int e = 0; e < E; e++) {
      active += m.hc[e] > 0;
      maxc = m.hc[e] > maxc ? m.hc[e] : maxc;
    }
    const int twice = 2 * ((tk + E - 1) / E);
    const int tile = twice <= 16 ? 16 : twice <= 32 ? 32 : twice <= 64 ? 64 : 128;
    const double bytes =
        active * per_expert + (double)T * H * (2 + 4) + (double)tk * (I * 2 * 2 + H * 4 * 2);
    const double flop = 2.0 * tk * (2.0 * I * H + (double)H * I);
    ctx_t c = {NULL, &m.w, &m.r, T, m.x, NULL, m.ws, m.wsz, m.hc, m.out, s};
    ctx_t c2 = c;
    c2.out = m.out2;
    tw_cuda_moe_set_mma_tiles(0);
    tw_cuda_moe_set_stream(0);
    const double t_old = time_ms(&c, RUN_GROUPED);
    tw_cuda_moe_set_stream(1);
    const double t_new = time_ms(&c2, RUN_GROUPED);
    tw_cuda_moe_set_mma_tiles(keep);
    tw_cuda_moe_set_stream(-1);
    if (t_old < 0 || t_new < 0) {
      fprintf(stderr, "bench_moe: a run failed: %s\n", tw_last_error());
      return 1;
    }
    const double rel = rel_l2_dev(m.out2, m.out, (size_t)T * H);
    printf(
        "| %s | %d | %s%d | %d (max %d) | %.1f | %.1f | %.3f | %.2f | %.0f | %.3f | %.2f | "
        "%.0f | %.2fx | %.1e |\n",
        name, T, forced ? "forced " : "", forced ? atoi(forced) : tile, active, maxc, bytes / 1e6,
        flop / 1e9, t_old, bytes / t_old / 1e9, flop / t_old / 1e9, t_new, bytes / t_new / 1e9,
        flop / t_new / 1e9, t_old / t_new, rel);
    fflush(stdout);
    if (!(rel <= 1e-3)) {
      fprintf(stderr, "bench_moe: old and new kernels differ (rel L2 %.2e > 1e-3)\n", rel);
      return 1;
    }
  }
  model_free(&m);
  return 0;
}

int main(int argc, char **argv) {
  int Ts[16] = {128, 1024, 8192}, nT = 3, decode = 0, ai = 1, pass = 0;
  if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf(
        "usage: twain-bench-moe [--decode [--pass 16|32]] [T,T,...]\n"
        "  tokens per call; default 128,1024,8192 (prefill: grouped GEMM against cuBLAS)\n"
        "  --decode: the grouped GEMM's wgmma kernel against its streaming decode kernel\n"
        "            (TWAIN_CUDA_MOE_STREAM), default 16,64,256,512,1024\n"
        "  --pass P: the decode kernel's TMA kernel takes every load, at passes of P rows\n");
    return 0;
  }
  if (argc > ai && !strcmp(argv[ai], "--decode")) {
    decode = 1;
    ai++;
    static const int dT[] = {16, 64, 256, 512, 1024};
    nT = 5;
    memcpy(Ts, dT, sizeof dT);
    if (argc > ai && !strcmp(argv[ai], "--pass")) {
      pass = argc > ai + 1 && (!strcmp(argv[ai + 1], "16") || !strcmp(argv[ai + 1], "32"))
                 ? atoi(argv[ai + 1])
                 : 0;
      if (!pass) {
        fprintf(stderr, "twain-bench-moe: --pass takes 16 or 32, not '%s'\n",
                argc > ai + 1 ? argv[ai + 1] : "nothing");
        return 2;
      }
      ai += 2;
    }
  }
  if (argc > ai) {
    nT = 0;
    for (char *p = argv[ai]; *p && nT < 16;) {
      long v = strtol(p, &p, 10);
      if (v <= 0 || v > 65536) {
        fprintf(stderr, "twain-bench-moe: bad token count list '%s'\n", argv[ai]);
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
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TWK(tw_cuda_moe_setup());
  int rc;
  if (decode) {
    printf(
        "decode MoE block, ms (median of %d): grouped GEMM, wgmma kernel (old) against the "
        "streaming decode kernel (new, 16- and 32-row tiles%s); TB/s of the bytes a step must "
        "move, TFLOP/s "
        "of the expert "
        "GEMMs (ceilings %.2f TB/s copy, %.0f TFLOP/s)\n",
        REPS,
        pass == 16   ? "; every load at passes of 16"
        : pass == 32 ? "; every load at passes of 32"
                     : "",
        GBS_CEIL / 1000.0, TFLOPS_CEIL);
    printf(
        "| model | T | tile | experts used (max rows) | MB | GFLOP | old ms | old TB/s | old "
        "TFLOP/s | new ms | new TB/s | new TFLOP/s | old/new | rel L2 new vs old |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    tw_cuda_moe_set_tma_pass(pass);
    rc = bench_decode("20b", 32, Ts, nT, s) || bench_decode("120b", 128, Ts, nT, s);
    tw_cuda_moe_set_tma_pass(0);
  } else {
    tw_cuda_gemm_t *gemm = NULL;
    TWK(tw_cuda_gemm_create(0, &gemm));
    printf("prefill MoE block, ms (median of %d); TFLOP/s of the expert GEMMs (%% of %.0f)\n", REPS,
           TFLOPS_CEIL);
    printf(
        "| model | T | T*k | grouped | grouped TFLOP/s | cublas | cublas TFLOP/s | grouped bf16 | "
        "grouped bf16 TFLOP/s | dequant | cublas/grouped | rel L2 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    rc = bench_model("20b", 32, Ts, nT, gemm, s) || bench_model("120b", 128, Ts, nT, gemm, s);
    tw_cuda_gemm_destroy(gemm);
  }
  cudaStreamDestroy(s);
  return rc;
}
