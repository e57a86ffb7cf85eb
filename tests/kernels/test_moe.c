/* test_moe.c: the MoE kernels (kernels/moe.h) against the CPU engine's MoE
 * (common/engine/cpu/cpu_ops.h: tw_cpu_router_topk, then tw_cpu_moe_experts,
 * the very expert loop the CPU engine runs; tw_mxfp4_dequant_row of the
 * loader) on fresh random inputs (expert biases drawn as bf16 values, the
 * checkpoint's dtype, given to the kernels as the same values in f32):
 * gpt-oss shapes (H = I = 2880, E = 32 and 128, top-4) and edges (T = 1,
 * the tiny model's H 256 / I 512 / E 8 / top-2, widths off the 32-row
 * tiles, prefill chunks with experts left empty), through the
 * GEMV path (T = 1 and T > 1 kernel variants) and the GEMM paths: the
 * grouped GEMM (on MXFP4 experts and on the same experts dequantised to bf16,
 * which must agree bit for bit; rerun and captured in a CUDA graph, which
 * must give the same bits) and the cuBLAS path (dequantising inside, or on
 * experts dequantised beforehand). The grouped GEMM's decode kernel
 * (tw_cuda_moe_set_mma_tiles: mma.sync, weights converted in registers) runs
 * every grouped case too, at whichever tile the case picks: against the
 * reference, against the wgmma kernel's output (relative L2 <= 1e-3: the
 * same bf16 products summed in another order), rerun and captured in a graph
 * (same bits); "bigscale" cases use E8M0 scales up to 2^4, which take its
 * two-multiply conversion. The streaming decode kernel
 * (tw_cuda_moe_set_stream: weights through per-warp cp.async stages, used
 * at the 16-row tile) runs every grouped case the same way (cases at the
 * larger tiles check that it leaves them to the wgmma kernel: 0
 * difference; in mode 8 the TMA kernel also takes the 32-row tile),
 * including "hot" loads of more than 16 rows, which it takes in passes; the
 * last round of its (expert, rows, pass) units is cut into pieces over all
 * its warps (on the H200's 2,112 warps: 20b T=1, 720 gate_up units, all in
 * pieces; 120b T=3, one whole round of 2,160 and 48 in pieces), the pieces
 * summed through a counter per unit that must be back to 0 afterwards; and
 * once more with that off (tw_cuda_moe_set_stream_balance(0): whole units
 * to the end, the down launch of small batches in two K parts added into
 * a cleared output), "stream_static"; and through the TMA kernel
 * (tw_cuda_moe_set_stream_tma(2): the same units with the weights and token
 * rows brought in by a producer warp; the odd shapes' partial 256-row tiles,
 * K below one 128-k chunk and hot multi-pass experts included),
 * "stream_tma"; and through the TMA kernel at passes of 32 assignment rows
 * a unit (tw_cuda_moe_set_tma_pass(32): then it takes every grouped case,
 * whatever its tile), "stream_tma32"; and at passes of 16 on every case
 * (the heavily loaded experts of the large tiles in many passes), with one group of
 * consumer warps (tw_cuda_moe_set_stream_tma(1), as TWAIN_CUDA_MOE_TMA=1),
 * "stream_tma16g1", and with two, "stream_tma16". Modes 6 and 7 set it
 * off, so they keep testing the per-warp kernel whichever the default.
 * Every grouped case also runs through the warp-specialised grouped GEMM at
 * every tile (tw_cuda_moe_set_ws(16); by default it takes the tiles from
 * 64 rows), "ws": four consumer warpgroups of one m64 half at the tiles up
 * to 64 rows, two of two halves at 128, TMA boxes with partial 256-row tiles, K tails and
 * tiles holding fewer rows than their size included, and its 256-row tile
 * on 128 weight rows a CTA where experts hold more than 64 rows on average
 * (20b T = 1024, odd T = 300, odd-bigscale); modes 1-11 set it off, so
 * mode 1 stays the wgmma kernel the others are compared with.
 *
 * Tolerances: route indices must match exactly and weights to 1e-5 (fp32
 * softmax of the same fp32 logits). The GEMV path keeps activations in f32
 * and reads exact weights, so it must agree to 1e-3 (bound for fp32
 * reordering of 2880-term sums); the GEMM path rounds its inputs, the
 * gate_up output, the activations and the expert outputs to bf16 (8-bit
 * mantissa, 2^-9 relative each), hence 1e-2. Outputs are poisoned with NaN
 * before each run: a NaN or an unwritten value fails. Dequantisation must be
 * bit exact (every FP4 value times a power of two is a bf16). The fused
 * router (GEMV + top-k + sort) is checked against logits computed here. */
#include "attn_test_util.h"
#include "common/engine/cpu/cpu_ops.h"
#include "common/model/model.h"
#include "kernels/moe.h"

#include <stdbool.h>

typedef struct {
  const char *name;
  int H, I, E, k, T;
} moe_case_t;

#define MMA_ALL (16u | 32u | 64u | 128u) /* tw_cuda_moe_set_mma_tiles: every tile */
/* gpt-oss's SwiGLU constants (config.json swiglu_limit; alpha is fixed, §2.9) */
#define SWIGLU_ALPHA 1.702f
#define SWIGLU_LIMIT 7.0f

/* Biases are bf16 values (the checkpoint's dtype, what the CPU engine reads)
 * kept twice: as bf16 bits for the reference and as f32 for the kernels. */
typedef struct {
  uint8_t *gu_b, *gu_s, *dn_b, *dn_s;
  float *gu_bias, *dn_bias;
  uint16_t *gu_bias16, *dn_bias16;
} host_experts_t;

static void *xmalloc(size_t n) {
  void *p = malloc(n);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(2);
  }
  return p;
}

static void fill_experts(const moe_case_t *c, host_experts_t *h) {
  size_t E = c->E, H = c->H, I = c->I;
  size_t n_gu = E * 2 * I * (H / 32), n_dn = E * H * (I / 32);
  h->gu_b = xmalloc(n_gu * 16);
  h->gu_s = xmalloc(n_gu);
  h->dn_b = xmalloc(n_dn * 16);
  h->dn_s = xmalloc(n_dn);
  h->gu_bias = xmalloc(E * 2 * I * 4);
  h->dn_bias = xmalloc(E * H * 4);
  h->gu_bias16 = xmalloc(E * 2 * I * 2);
  h->dn_bias16 = xmalloc(E * H * 2);
  for (size_t i = 0; i < n_gu * 16; i++) h->gu_b[i] = (uint8_t)tt_rng_u64();
  for (size_t i = 0; i < n_dn * 16; i++) h->dn_b[i] = (uint8_t)tt_rng_u64();
  /* scales 2^-8..2^-4; "bigscale": 2^-3..2^4 (bytes above 128 = scales above 2) */
  const int slo = strstr(c->name, "bigscale") ? 124 : 119, shi = slo == 124 ? 131 : 123;
  for (size_t i = 0; i < n_gu; i++) h->gu_s[i] = (uint8_t)tt_randint(slo, shi);
  for (size_t i = 0; i < n_dn; i++) h->dn_s[i] = (uint8_t)tt_randint(slo, shi);
  for (size_t i = 0; i < E * 2 * I; i++) {
    h->gu_bias16[i] = tt_f2bf(tt_uniform(0.5f));
    h->gu_bias[i] = tt_bf2f(h->gu_bias16[i]);
  }
  for (size_t i = 0; i < E * H; i++) {
    h->dn_bias16[i] = tt_f2bf(tt_uniform(0.5f));
    h->dn_bias[i] = tt_bf2f(h->dn_bias16[i]);
  }
}

static void free_experts(host_experts_t *h) {
  free(h->gu_b);
  free(h->gu_s);
  free(h->dn_b);
  free(h->dn_s);
  free(h->gu_bias);
  free(h->dn_bias);
  free(h->gu_bias16);
  free(h->dn_bias16);
}

static int upload(void **d, const void *h, size_t n) {
  TT_CUDA(cudaMalloc(d, n));
  TT_CUDA(cudaMemcpy(*d, h, n, cudaMemcpyHostToDevice));
  return 0;
}

/* E experts' MXFP4 blocks of N rows of K (the checkpoint's layout, host) on
 * the device in the packed layout every kernel reads (moe.h TW_MX_CHUNK),
 * through tw_cuda_mxfp4_pack; every MoE check below then compares kernels
 * reading that layout with the CPU reference reading the checkpoint's. */
static int upload_packed(void **d, const uint8_t *h, int E, int N, int K) {
  void *nat;
  if (upload(&nat, h, (size_t)E * N * (K / 2))) return 1;
  TT_CUDA(cudaMalloc(d, tw_cuda_mxfp4_packed_bytes(E, N, K)));
  if (tw_cuda_mxfp4_pack(nat, E, N, K, *d, 0) != TW_OK) {
    printf("FAIL mxfp4_pack(E=%d,N=%d,K=%d): %s\n", E, N, K, tw_last_error());
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  cudaFree(nat);
  return 0;
}

/* Device counters [n] that a kernel must leave at 0: how many are not
 * (-1: the copy failed). */
static int counters_left(const int32_t *d, int n) {
  int32_t h[TW_CUDA_MOE_GS_TICKETS];
  if (n > TW_CUDA_MOE_GS_TICKETS || cudaMemcpy(h, d, (size_t)n * 4, cudaMemcpyDeviceToHost))
    return -1;
  int left = 0;
  for (int i = 0; i < n; i++) left += h[i] != 0;
  return left;
}

/* CPU reference of the whole block, the CPU engine's MoE (tw_cpu_router_topk
 * then tw_cpu_moe_experts over every expert): out [T, H]. */
static void moe_reference(tw_cpu_pool_t *pool, const moe_case_t *c, const host_experts_t *h,
                          const float *x, const float *logits, float *out) {
  int H = c->H, I = c->I, E = c->E, k = c->k, T = c->T;
  int32_t *idx = xmalloc((size_t)T * k * 4);
  float *w = xmalloc((size_t)T * k * 4);
  for (int t = 0; t < T; t++) tw_cpu_router_topk(logits + (size_t)t * E, E, k, idx + t * k, w + t * k);
  const tw_cpu_experts_t ex = {.hidden = H,
                               .intermediate = I,
                               .mxfp4 = 1,
                               .gate_up_blocks = h->gu_b,
                               .gate_up_scales = h->gu_s,
                               .down_blocks = h->dn_b,
                               .down_scales = h->dn_s,
                               .gate_up_bias = h->gu_bias16,
                               .down_bias = h->dn_bias16,
                               .swiglu_alpha = SWIGLU_ALPHA,
                               .swiglu_limit = SWIGLU_LIMIT};
  tw_cpu_moe_scratch_t sc = {.tok = xmalloc((size_t)T * 4),
                             .w = xmalloc((size_t)T * 4),
                             .xe = xmalloc((size_t)T * H * 4),
                             .ue = xmalloc((size_t)T * 2 * I * 4),
                             .ae = xmalloc((size_t)T * I * 4),
                             .ye = xmalloc((size_t)T * H * 4)};
  tw_cpu_moe_experts(pool, &ex, 0, E, x, T, k, idx, w, &sc, out);
  free(idx);
  free(w);
  free(sc.tok);
  free(sc.w);
  free(sc.xe);
  free(sc.ue);
  free(sc.ae);
  free(sc.ye);
}

/* Route checks: indices exact, weights 1e-5, permutation consistent. */
static int check_route(const moe_case_t *c, const tw_cuda_moe_route_t *r, const float *logits) {
  int T = c->T, k = c->k, E = c->E, TK = T * k, fails = 0;
  int32_t *idx = xmalloc((size_t)TK * 4), *sorted = xmalloc((size_t)TK * 4);
  int32_t *pos_of = xmalloc((size_t)TK * 4), *counts = xmalloc((size_t)E * 4);
  int32_t *offs = xmalloc(((size_t)E + 1) * 4), *active = xmalloc((size_t)E * 4), n_active = 0;
  float *w = xmalloc((size_t)TK * 4);
  TT_CUDA(cudaMemcpy(idx, r->topk_idx, (size_t)TK * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(w, r->topk_w, (size_t)TK * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(sorted, r->sorted, (size_t)TK * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(pos_of, r->pos_of, (size_t)TK * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(counts, r->counts, (size_t)E * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(offs, r->offsets, ((size_t)E + 1) * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(active, r->active, (size_t)E * 4, cudaMemcpyDeviceToHost));
  TT_CUDA(cudaMemcpy(&n_active, r->n_active, 4, cudaMemcpyDeviceToHost));
  int32_t ri[32];
  float rw[32];
  double maxw = 0;
  for (int t = 0; t < T; t++) {
    tw_cpu_router_topk(logits + (size_t)t * E, E, k, ri, rw);
    for (int j = 0; j < k; j++) {
      if (ri[j] != idx[t * k + j]) fails++;
      double d = fabs((double)rw[j] - w[t * k + j]);
      if (!(d <= maxw)) maxw = isfinite(d) ? d : 1e30;
    }
  }
  int expect_active = 0, run = 0;
  for (int e = 0; e < E; e++) {
    if (offs[e] != run) fails++;
    int n = 0;
    for (int a = 0; a < TK; a++) n += idx[a] == e;
    if (n != counts[e]) fails++;
    for (int q = 0; q < counts[e]; q++) {
      int a = sorted[run + q];
      if (a < 0 || a >= TK || idx[a] != e || pos_of[a] != run + q) fails++;
      if (q > 0 && sorted[run + q - 1] >= a) fails++; /* stable order */
    }
    if (counts[e] > 0 && (expect_active >= n_active || active[expect_active++] != e)) fails++;
    run += counts[e];
  }
  if (offs[E] != TK || n_active != expect_active) fails++;
  bool ok = fails == 0 && maxw <= 1e-5;
  printf("%s moe_route(%s,T=%d,E=%d,k=%d): %d mismatches, max |dw| %.2e\n", ok ? "ok  " : "FAIL",
         c->name, T, E, k, fails, maxw);
  free(idx); free(sorted); free(pos_of); free(counts); free(offs); free(active); free(w);
  return ok ? 0 : 1;
}

/* Run the MoE path of `mode` on the default stream into d_out (poisoned with
 * NaN first) and copy it to out. mode 0: GEMV; 1: grouped GEMM on the MXFP4
 * experts; 2: grouped GEMM on bf16 experts (d_wdq); 3: cuBLAS path
 * dequantising inside; 4: cuBLAS path on d_wdq; 5: grouped GEMM on the MXFP4
 * experts through the decode kernel (every tile); 6: grouped GEMM on the
 * MXFP4 experts through the streaming kernel (at the 16-row tile; other
 * tiles run the wgmma kernel); 7: the same with its last round whole
 * (tw_cuda_moe_set_stream_balance(0)); 8: the streaming units through the
 * TMA kernel (tw_cuda_moe_set_stream_tma(2)); 9: every launch through the
 * TMA kernel at pass 32; 10: every launch through it at pass 16 with one
 * consumer group; 11: the same with two; 12: every launch through the
 * warp-specialised grouped GEMM (tw_cuda_moe_set_ws(16)). */
/* The TMA kernel of mode: tw_cuda_moe_set_stream_tma's value (10: one
 * consumer group at passes of 16; 8, 9, 11: two) and its forced pass (9: 32;
 * 10, 11: 16; else the rule). */
static int tma_groups(int mode) { return mode == 10 ? 1 : mode >= 8 && mode <= 11 ? 2 : 0; }
static void tma_mode(int mode) {
  tw_cuda_moe_set_tma_pass(mode == 9 ? 32 : mode == 10 || mode == 11 ? 16 : 0);
}
/* Every kernel switch as mode asks (run_mode and run_captured alike). */
static uint32_t mma_tiles(int mode) { return mode == 5 ? MMA_ALL : 0; }
static void set_mode(int mode) {
  tw_cuda_moe_set_mma_tiles(mma_tiles(mode));
  tw_cuda_moe_set_stream(mode >= 6 && mode <= 11);
  tw_cuda_moe_set_ws(mode == 12 ? 16 : 0);
  tw_cuda_moe_set_stream_balance(mode == 7 ? 0 : -1);
  tw_cuda_moe_set_stream_tma(tma_groups(mode));
  tma_mode(mode);
}

static int run_mode(tw_cuda_gemm_t *gemm, const tw_cuda_moe_weights_t *w,
                    const tw_cuda_moe_route_t *r, const moe_case_t *c, int mode, const void *d_x,
                    const void *d_wdq, void *d_ws, size_t wsb, int32_t *hc, float *d_out,
                    float *out) {
  int T = c->T;
  TT_CUDA(cudaMemset(d_out, 0xff, (size_t)T * c->H * 4)); /* NaN poison */
  TT_CUDA(cudaDeviceSynchronize());
  const void *wdq = mode == 2 || mode == 4 ? d_wdq : NULL;
  tw_status_t st;
  set_mode(mode);
  if (mode == 0)
    st = tw_cuda_moe_decode(w, r, T, d_x, d_ws, wsb, d_out, 0);
  else if (mode <= 2 || mode >= 5)
    st = tw_cuda_moe_prefill(w, r, T, d_x, wdq, d_ws, wsb, d_out, 0);
  else
    st = tw_cuda_moe_prefill_cublas(gemm, w, r, T, d_x, wdq, d_ws, wsb, hc, d_out, 0);
  if (st != TW_OK) {
    printf("FAIL moe(%s, mode %d): status %s: %s\n", c->name, mode, tw_status_str(st),
           tw_last_error());
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(out, d_out, (size_t)T * c->H * 4, cudaMemcpyDeviceToHost));
  return 0;
}

/* The grouped path of mode once more, captured in a CUDA graph on a fresh
 * stream and replayed twice: capture fails if the path synchronises the
 * host; each replay must give `want` bit for bit. */
static int run_captured(const tw_cuda_moe_weights_t *w, const tw_cuda_moe_route_t *r,
                        const moe_case_t *c, const void *d_x, void *d_ws, size_t wsb, float *d_out,
                        float *out, const float *want, int mode) {
  const uint32_t mma = mma_tiles(mode);
  const int stream_k = mode >= 6 && mode <= 11, tma = tma_groups(mode);
  set_mode(mode);
  cudaStream_t s;
  TT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  TT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  tw_status_t st = tw_cuda_moe_prefill(w, r, c->T, d_x, NULL, d_ws, wsb, d_out, s);
  cudaError_t ce = cudaStreamEndCapture(s, &g);
  if (st != TW_OK || ce != cudaSuccess || cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) {
    printf("FAIL moe_grouped_graph(%s,T=%d,mma=%u,stream=%d,tma=%d,mode=%d): capture: %s / %s\n",
           c->name, c->T, mma, stream_k, tma, mode, st != TW_OK ? tw_last_error() : "ok",
           cudaGetErrorString(ce));
    cudaGetLastError();
    return 1;
  }
  size_t n = (size_t)c->T * c->H;
  long diff = 0;
  for (int rep = 0; rep < 2; rep++) {
    TT_CUDA(cudaMemset(d_out, 0xff, n * 4));
    TT_CUDA(cudaDeviceSynchronize());
    TT_CUDA(cudaGraphLaunch(ge, s));
    TT_CUDA(cudaStreamSynchronize(s));
    TT_CUDA(cudaMemcpy(out, d_out, n * 4, cudaMemcpyDeviceToHost));
    diff += tt_count_bits_differ(out, want, n);
  }
  printf(
      "%s moe_grouped_graph(%s,T=%d,mma=%u,stream=%d,tma=%d,mode=%d): captured without a host "
      "sync, %ld values differ from the eager run over 2 replays\n",
      diff ? "FAIL" : "ok  ", c->name, c->T, mma, stream_k, tma, mode, diff);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return diff ? 1 : 0;
}

/* kind 0: GEMV path. kind 1: GEMM paths: the grouped GEMM on MXFP4 experts
 * (also run twice: same bits; and captured in a graph), the grouped GEMM on
 * the same experts dequantised to bf16 beforehand (must equal the MXFP4 run
 * bit for bit: the on-chip dequantisation gives the same bf16 weights), and
 * the cuBLAS path (dequantising inside when cublas_mode is 3, on the
 * dequantised experts when 4). Every output against the CPU reference. */
static int run_case(tw_cpu_pool_t *pool, tw_cuda_gemm_t *gemm, const moe_case_t *c, int kind,
                    int cublas_mode) {
  bool prefill = kind != 0;
  int H = c->H, I = c->I, E = c->E, k = c->k, T = c->T, rc = 0;
  host_experts_t h;
  fill_experts(c, &h);
  uint16_t *xb = xmalloc((size_t)T * H * 2);
  float *x = xmalloc((size_t)T * H * 4), *logits = xmalloc((size_t)T * E * 4);
  float *out = xmalloc((size_t)T * H * 4), *ref = xmalloc((size_t)T * H * 4);
  float *out1 = xmalloc((size_t)T * H * 4), *out5 = xmalloc((size_t)T * H * 4);
  for (size_t i = 0; i < (size_t)T * H; i++) {
    xb[i] = tt_f2bf(tt_normal(1.0f));
    x[i] = tt_bf2f(xb[i]);
  }
  for (size_t i = 0; i < (size_t)T * E; i++) logits[i] = tt_normal(2.0f);
  if (T > 3) logits[(size_t)3 * E + 1] = logits[(size_t)3 * E + 2]; /* a tie */
  if (strstr(c->name, "hot")) /* ragged: every token on experts 0..k-1, the rest empty */
    for (int t = 0; t < T; t++)
      for (int j = 0; j < k; j++) logits[(size_t)t * E + j] += 40.0f;
  tw_cuda_moe_weights_t w = {E,    H,    I,    NULL,         NULL,        NULL,
                             NULL, NULL, NULL, SWIGLU_ALPHA, SWIGLU_LIMIT};
  size_t n_gu = (size_t)E * 2 * I * (H / 32), n_dn = (size_t)E * H * (I / 32);
  void *d_x, *d_logits, *d_out, *d_route, *d_ws, *p;
  if (upload_packed(&p, h.gu_b, E, 2 * I, H)) return 1;
  w.gate_up_blocks = p;
  if (upload(&p, h.gu_s, n_gu)) return 1;
  w.gate_up_scales = p;
  if (upload_packed(&p, h.dn_b, E, H, I)) return 1;
  w.down_blocks = p;
  if (upload(&p, h.dn_s, n_dn)) return 1;
  w.down_scales = p;
  if (upload(&p, h.gu_bias, (size_t)E * 2 * I * 4)) return 1;
  w.gate_up_bias = p;
  if (upload(&p, h.dn_bias, (size_t)E * H * 4)) return 1;
  w.down_bias = p;
  if (upload(&d_x, xb, (size_t)T * H * 2) || upload(&d_logits, logits, (size_t)T * E * 4)) return 1;
  TT_CUDA(cudaMalloc(&d_out, (size_t)T * H * 4));
  size_t rb = tw_cuda_moe_route_bytes(T, E, k);
  TT_CUDA(cudaMalloc(&d_route, rb));
  tw_cuda_moe_route_t r;
  if (tw_cuda_moe_route_init(d_route, rb, T, E, k, &r) != TW_OK) return 1;
  if (tw_cuda_moe_route(&r, d_logits, T, 0) != TW_OK) return 1;
  TT_CUDA(cudaDeviceSynchronize());
  rc |= check_route(c, &r, logits);
  size_t wsb = tw_cuda_moe_decode_ws_bytes(T, k, H, I);
  if (prefill) {
    size_t a = tw_cuda_moe_prefill_ws_bytes(T, k, H, I);
    size_t b = tw_cuda_moe_prefill_cublas_ws_bytes(T, E, k, H, I, 1);
    wsb = a > b ? a : b;
  }
  TT_CUDA(cudaMalloc(&d_ws, wsb));
  void *d_wdq = NULL;
  if (prefill) {
    TT_CUDA(cudaMalloc(&d_wdq, tw_cuda_moe_dequant_bytes(E, H, I)));
    if (tw_cuda_moe_dequant(&w, NULL, d_wdq, 0) != TW_OK) return 1;
  }
  int32_t *hc;
  TT_CUDA(cudaMallocHost((void **)&hc, (size_t)E * 4));
  moe_reference(pool, c, &h, x, logits, ref);
  int modes[13], n_modes = 0;
  bool grouped = prefill && tw_cuda_moe_grouped_supported(H, I);
  if (!prefill) modes[n_modes++] = 0;
  if (grouped) {
    modes[n_modes++] = 1;
    modes[n_modes++] = 2;
    modes[n_modes++] = 5;
    modes[n_modes++] = 6;
    modes[n_modes++] = 7;
    modes[n_modes++] = 8;
    modes[n_modes++] = 9;
    modes[n_modes++] = 10;
    modes[n_modes++] = 11;
    modes[n_modes++] = 12;
  } else if (prefill) {
    printf("SKIP moe_grouped(%s): no grouped GEMM on this GPU\n", c->name);
  }
  if (prefill) modes[n_modes++] = cublas_mode;
  for (int mi = 0; mi < n_modes; mi++) {
    int mode = modes[mi];
    if (run_mode(gemm, &w, &r, c, mode, d_x, d_wdq, d_ws, wsb, hc, (float *)d_out, out)) {
      rc = 1;
      continue;
    }
    tt_l2_t acc = {0};
    for (size_t i = 0; i < (size_t)T * H; i++) tt_l2_add(&acc, out[i], ref[i]);
    static const char *const names[] = {"gemv",
                                        "grouped_mxfp4",
                                        "grouped_bf16",
                                        "cublas",
                                        "cublas_predequant",
                                        "grouped_mma",
                                        "grouped_stream",
                                        "grouped_stream_static",
                                        "grouped_stream_tma",
                                        "grouped_stream_tma32",
                                        "grouped_stream_tma16g1",
                                        "grouped_stream_tma16",
                                        "grouped_ws"};
    char name[160];
    snprintf(name, sizeof name, "moe_%s(%s,H=%d,I=%d,E=%d,k=%d,T=%d)", names[mode], c->name, H,
             I, E, k, T);
    rc |= tt_l2_report(name, &acc, prefill ? 1e-2 : 1e-3);
    if (mode == 1) {
      memcpy(out1, out, (size_t)T * H * 4);
      /* deterministic: a second run gives the same bits */
      if (run_mode(gemm, &w, &r, c, 1, d_x, d_wdq, d_ws, wsb, hc, (float *)d_out, out)) rc = 1;
      long d = tt_count_bits_differ(out, out1, (size_t)T * H);
      printf("%s moe_grouped_rerun(%s,T=%d): %ld values differ\n", d ? "FAIL" : "ok  ", c->name,
             T, d);
      rc |= d != 0;
      rc |= run_captured(&w, &r, c, d_x, d_ws, wsb, (float *)d_out, out, out1, 1);
    } else if (mode == 2) {
      long d = tt_count_bits_differ(out, out1, (size_t)T * H);
      printf("%s moe_grouped_mxfp4_vs_bf16(%s,T=%d): %ld values differ (on-chip dequantisation "
             "must give the same bf16 weights)\n", d ? "FAIL" : "ok  ", c->name, T, d);
      rc |= d != 0;
    } else if (mode >= 5) {
      /* a decode kernel (5: mma.sync, 6: streaming, 7: streaming with its
       * last round whole, 8: TMA, 9: TMA at pass 32, 10 and 11: TMA at pass
       * 16 with one and two consumer groups, 12: the warp-specialised
       * grouped GEMM): against the wgmma kernel,
       * rerun, graph; named as in names[] less its "grouped_" */
      const char *kn = names[mode] + strlen("grouped_");
      memcpy(out5, out, (size_t)T * H * 4);
      tt_l2_t ab = {0};
      for (size_t i = 0; i < (size_t)T * H; i++) tt_l2_add(&ab, out5[i], out1[i]);
      snprintf(name, sizeof name, "moe_grouped_%s_vs_wgmma(%s,T=%d)", kn, c->name, T);
      rc |= tt_l2_report(name, &ab, 1e-3);
      if (run_mode(gemm, &w, &r, c, mode, d_x, d_wdq, d_ws, wsb, hc, (float *)d_out, out)) rc = 1;
      long d = tt_count_bits_differ(out, out5, (size_t)T * H);
      printf("%s moe_grouped_%s_rerun(%s,T=%d): %ld values differ\n", d ? "FAIL" : "ok  ", kn,
             c->name, T, d);
      rc |= d != 0;
      rc |= run_captured(&w, &r, c, d_x, d_ws, wsb, (float *)d_out, out, out5, mode);
      if (mode == 6) { /* the counters of units cut into pieces: back to 0 */
        int nz = counters_left(r.gs_ticket, TW_CUDA_MOE_GS_TICKETS);
        printf("%s moe_grouped_stream_tickets(%s,T=%d): %d counters left non-zero\n",
               nz ? "FAIL" : "ok  ", c->name, T, nz);
        rc |= nz != 0;
      }
    }
  }
  tw_cuda_moe_set_mma_tiles(0);
  tw_cuda_moe_set_stream(-1);
  tw_cuda_moe_set_stream_balance(-1);
  tw_cuda_moe_set_stream_tma(-1);
  tw_cuda_moe_set_ws(-1);
  tma_mode(0);
  cudaFree((void *)w.gate_up_blocks); cudaFree((void *)w.gate_up_scales);
  cudaFree((void *)w.down_blocks); cudaFree((void *)w.down_scales);
  cudaFree((void *)w.gate_up_bias); cudaFree((void *)w.down_bias);
  cudaFree(d_x); cudaFree(d_logits); cudaFree(d_out); cudaFree(d_route); cudaFree(d_ws);
  if (d_wdq) cudaFree(d_wdq);
  cudaFreeHost(hc);
  free(xb);
  free(x);
  free(logits);
  free(out);
  free(out1);
  free(out5);
  free(ref);
  free_experts(&h);
  return rc;
}

static int test_dequant(void) {
  const int rows = 67, cols = 2880, nb = cols / 32;
  uint8_t *b = xmalloc((size_t)rows * nb * 16), *s = xmalloc((size_t)rows * nb);
  for (int i = 0; i < rows * nb * 16; i++) b[i] = (uint8_t)tt_rng_u64();
  for (int i = 0; i < rows * nb; i++) s[i] = (uint8_t)tt_randint(100, 150);
  s[0] = 0;   /* 2^-127: subnormal products */
  s[1] = 254; /* 2^127: huge but finite for |fp4| <= 1 ... overflow to inf beyond */
  void *db, *ds, *dout;
  if (upload(&db, b, (size_t)rows * nb * 16) || upload(&ds, s, (size_t)rows * nb)) return 1;
  TT_CUDA(cudaMalloc(&dout, (size_t)rows * cols * 2));
  TT_CUDA(cudaMemset(dout, 0xff, (size_t)rows * cols * 2));
  if (tw_cuda_mxfp4_dequant(db, ds, rows, cols, dout, 0) != TW_OK) return 1;
  uint16_t *out = xmalloc((size_t)rows * cols * 2);
  float *ref = xmalloc((size_t)cols * 4);
  TT_CUDA(cudaMemcpy(out, dout, (size_t)rows * cols * 2, cudaMemcpyDeviceToHost));
  long bad = 0;
  for (int r = 0; r < rows; r++) {
    tw_mxfp4_dequant_row(b + (size_t)r * nb * 16, s + (size_t)r * nb, nb, ref);
    for (int c = 0; c < cols; c++) {
      uint16_t want = tt_f2bf(ref[c]);
      uint16_t got = out[(size_t)r * cols + c];
      if (got != want && !(ref[c] == 0.0f && (got & 0x7fff) == 0)) bad++;
    }
  }
  printf("%s mxfp4_dequant(rows=%d,cols=%d): %ld values differ from tw_mxfp4_dequant_row\n",
         bad ? "FAIL" : "ok  ", rows, cols, bad);
  cudaFree(db); cudaFree(ds); cudaFree(dout);
  free(b); free(s); free(out); free(ref);
  return bad ? 1 : 0;
}

/* tw_cuda_mxfp4_pack (moe.h TW_MX_CHUNK) at a shape whose rows end inside a
 * chunk (K = 160: K/2 = 80 bytes, chunks of 64 and 16 + 48 zero bytes) and
 * an odd row count: every byte of the packed tensor against the index
 * arithmetic of the layout done here, and its errors. */
static int test_pack(void) {
  const int E = 3, N = 70, K = 160, KH = K / 2, KC = (K + 127) / 128;
  const size_t nat_n = (size_t)E * N * KH, pk_n = tw_cuda_mxfp4_packed_bytes(E, N, K);
  int bad = pk_n != (size_t)E * KC * N * 64;
  uint8_t *nat = xmalloc(nat_n), *pk = xmalloc(pk_n);
  for (size_t i = 0; i < nat_n; i++) nat[i] = (uint8_t)tt_rng_u64();
  void *dn, *dp;
  if (upload(&dn, nat, nat_n)) return 1;
  TT_CUDA(cudaMalloc(&dp, pk_n));
  TT_CUDA(cudaMemset(dp, 0xa5, pk_n));
  if (tw_cuda_mxfp4_pack(dn, E, N, K, dp, 0) != TW_OK) bad++;
  TT_CUDA(cudaMemcpy(pk, dp, pk_n, cudaMemcpyDeviceToHost));
  long wrong = 0;
  for (int e = 0; e < E; e++)
    for (int c = 0; c < KC; c++)
      for (int n = 0; n < N; n++)
        for (int b = 0; b < 64; b++) {
          const int j = c * 64 + b;
          const uint8_t want = j < KH ? nat[((size_t)e * N + n) * KH + j] : 0;
          wrong += pk[(((size_t)e * KC + c) * N + n) * 64 + b] != want;
        }
  /* errors: a K that is not a multiple of 32, a NULL buffer, a misaligned one */
  const int e1 = tw_cuda_mxfp4_pack(dn, E, N, 48 + 1, dp, 0) == TW_ERR_INVALID_ARGUMENT;
  const int e2 = tw_cuda_mxfp4_pack(NULL, E, N, K, dp, 0) == TW_ERR_INVALID_ARGUMENT;
  const int e3 =
      tw_cuda_mxfp4_pack((const uint8_t *)dn + 1, E, N, K, dp, 0) == TW_ERR_INVALID_ARGUMENT;
  bad += wrong != 0 || !e1 || !e2 || !e3;
  printf("%s mxfp4_pack(E=%d,N=%d,K=%d): %ld of %zu bytes wrong; errors %d %d %d\n",
         bad ? "FAIL" : "ok  ", E, N, K, wrong, pk_n, e1, e2, e3);
  cudaFree(dn);
  cudaFree(dp);
  free(nat);
  free(pk);
  return bad ? 1 : 0;
}

/* tw_cuda_moe_router_fused (router GEMV + top-k + sort in one launch) against
 * the logits computed here in double from the same bf16 inputs (|d| <= 1e-5
 * of the sum of |terms|, the fp32 reordering bound) and check_route on the
 * logits it wrote; launched twice in a row (the block counters must come
 * back to 0) and the second result checked. */
static int run_router_case(const moe_case_t *c) {
  int H = c->H, E = c->E, k = c->k, T = c->T, fails = 0;
  uint16_t *xb = xmalloc((size_t)T * H * 2), *wb = xmalloc((size_t)E * H * 2);
  float *bias = xmalloc((size_t)E * 4), *got = xmalloc((size_t)T * E * 4);
  for (size_t i = 0; i < (size_t)T * H; i++) xb[i] = tt_f2bf(tt_normal(1.0f));
  for (size_t i = 0; i < (size_t)E * H; i++) wb[i] = tt_f2bf(tt_normal(0.05f));
  for (int e = 0; e < E; e++) bias[e] = tt_uniform(0.5f);
  void *d_x, *d_w, *d_b, *d_lg, *d_route;
  if (upload(&d_x, xb, (size_t)T * H * 2) || upload(&d_w, wb, (size_t)E * H * 2) ||
      upload(&d_b, bias, (size_t)E * 4))
    return 1;
  TT_CUDA(cudaMalloc(&d_lg, (size_t)T * E * 4));
  size_t rb = tw_cuda_moe_route_bytes(T, E, k);
  TT_CUDA(cudaMalloc(&d_route, rb));
  tw_cuda_moe_route_t r;
  if (tw_cuda_moe_route_init(d_route, rb, T, E, k, &r) != TW_OK) return 1;
  if (!tw_cuda_moe_router_fused_supported(&r, d_x, d_w, T, H)) {
    printf("FAIL moe_router_fused(%s,T=%d,E=%d,H=%d): not supported\n", c->name, T, E, H);
    return 1;
  }
  double worst = 0;
  for (int rep = 0; rep < 2; rep++) {
    TT_CUDA(cudaMemset(d_lg, 0xff, (size_t)T * E * 4)); /* NaN poison */
    if (tw_cuda_moe_router_fused(&r, d_x, d_w, d_b, T, H, d_lg, 0) != TW_OK) {
      printf("FAIL moe_router_fused(%s): %s\n", c->name, tw_last_error());
      return 1;
    }
  }
  TT_CUDA(cudaDeviceSynchronize());
  TT_CUDA(cudaMemcpy(got, d_lg, (size_t)T * E * 4, cudaMemcpyDeviceToHost));
  int ticket = counters_left(r.ticket, TW_CUDA_MOE_ROUTE_TICKETS); /* every counter back to 0 */
  for (int t = 0; t < T; t++)
    for (int e = 0; e < E; e++) {
      double ref = bias[e], mag = fabs(bias[e]);
      for (int h = 0; h < H; h++) {
        double term = (double)tt_bf2f(xb[(size_t)t * H + h]) * tt_bf2f(wb[(size_t)e * H + h]);
        ref += term;
        mag += fabs(term);
      }
      double d = fabs(got[(size_t)t * E + e] - ref);
      if (!(d <= 1e-5 * mag + 1e-6)) fails++;
      if (!(d / (mag + 1e-30) <= worst)) worst = isfinite(d) ? d / (mag + 1e-30) : 1e30;
    }
  moe_case_t rc = *c;
  int bad = check_route(&rc, &r, got);
  bool ok = fails == 0 && ticket == 0;
  printf(
      "%s moe_router_fused(%s,H=%d,E=%d,k=%d,T=%d): %d logits off, worst |d|/sum|terms| %.2e, "
      "%d counters left non-zero\n",
      ok ? "ok  " : "FAIL", c->name, H, E, k, T, fails, worst, ticket);
  cudaFree(d_x); cudaFree(d_w); cudaFree(d_b); cudaFree(d_lg); cudaFree(d_route);
  free(xb); free(wb); free(bias); free(got);
  return (ok ? 0 : 1) | bad;
}

int main(void) {
  if (!tt_gpu_available()) {
    printf("SKIP: no GPU\n");
    return TT_SKIP;
  }
  tt_seed();
  if (tw_cuda_moe_setup() != TW_OK) return 1;
  tw_cpu_pool_t *pool = NULL;
  tw_cuda_gemm_t *gemm = NULL;
  if (tw_cpu_pool_create(0, &pool) != TW_OK || tw_cuda_gemm_create(0, &gemm) != TW_OK) return 1;
  int rc = test_dequant();
  rc |= test_pack();
  static const moe_case_t gemv[] = {
      {"20b", 2880, 2880, 32, 4, 1},   {"20b", 2880, 2880, 32, 4, 3},
      {"20b", 2880, 2880, 32, 4, 6},   {"tiny", 256, 512, 8, 2, 4},
      {"120b", 2880, 2880, 128, 4, 1}, {"120b", 2880, 2880, 128, 4, 64},
      {"tiny", 256, 512, 8, 2, 1},     {"tiny", 256, 512, 8, 2, 13},
      {"odd", 96, 160, 5, 3, 70},
  };
  /* grouped shapes, each assignment tile (kernels/moe_grouped.cu picks the
   * smallest of 16/32/64/128 rows that holds the mean expert load): one
   * token and decode batches (20b T=1/16/64, 120b T=97/256: tile 16); many
   * row tiles per expert (20b T=1024: tile 128, ~128 rows each); 64 (20b
   * T=300, odd T=300 at 128); 32 (120b T=600, tiny T=75, odd T=33); experts of
   * a few rows and empty ones (120b); ragged "hot" loads where every token
   * goes to the same k experts and the others are empty (many 16-row tiles
   * of one expert); K tails of 32 and column tiles cut by N (odd: K = 96 and
   * 160, N = 320 and 96); the tile is the smallest holding twice the mean
   * load, so 20b T=100 takes 32 and odd T=300 128; bigscale: E8M0 scales
   * above 2 (the decode kernel's two-multiply conversion), at tiles 16 (20b
   * T=40) and 128 (odd T=300); 120b T=3: 12 experts of one row; narrow:
   * an intermediate size of one 128-k chunk (I = 64) at the 16-row tile,
   * where the down launch must not be cut into two K parts */
  static const moe_case_t gemm_cases[] = {
      {"20b", 2880, 2880, 32, 4, 1},
      {"20b", 2880, 2880, 32, 4, 300},
      {"20b", 2880, 2880, 32, 4, 1024},
      {"120b", 2880, 2880, 128, 4, 97},
      {"120b", 2880, 2880, 128, 4, 600},
      {"tiny", 256, 512, 8, 2, 75},
      {"odd", 96, 160, 5, 3, 33},
      {"odd", 96, 160, 5, 3, 300},
      {"20b", 2880, 2880, 32, 4, 16},
      {"20b", 2880, 2880, 32, 4, 64},
      {"20b-hot", 2880, 2880, 32, 4, 64},
      {"120b", 2880, 2880, 128, 4, 256},
      {"120b-hot", 2880, 2880, 128, 4, 100},
      {"odd-hot", 96, 160, 5, 3, 41},
      {"20b-bigscale", 2880, 2880, 32, 4, 40},
      {"odd-bigscale", 96, 160, 5, 3, 300},
      {"120b", 2880, 2880, 128, 4, 3},
      {"20b", 2880, 2880, 32, 4, 100},
      {"narrow", 96, 64, 5, 3, 6},
  };
  for (size_t i = 0; i < sizeof gemv / sizeof gemv[0]; i++)
    rc |= run_case(pool, gemm, &gemv[i], 0, 0);
  for (size_t i = 0; i < sizeof gemm_cases / sizeof gemm_cases[0]; i++)
    rc |= run_case(pool, gemm, &gemm_cases[i], 1, 3 + (int)(i % 2));
  static const moe_case_t router[] = {
      {"20b", 2880, 2880, 32, 4, 1},
      {"20b", 2880, 2880, 32, 4, 61},
      {"20b", 2880, 2880, 32, 4, 64},
      {"120b", 2880, 2880, 128, 4, 1},
      {"120b", 2880, 2880, 128, 4, 16},
      {"tiny", 256, 512, 8, 2, 13},
      {"odd", 96, 160, 5, 3, 7},
      /* up to T x E = 4,096 (120b: 32 tokens); E = 130: a token group's
       * logits past the 2,048 of before */
      {"120b", 2880, 2880, 128, 4, 32},
      {"120b", 2880, 2880, 128, 4, 25},
      {"odd", 96, 160, 5, 3, 64},
      {"wide", 256, 512, 130, 4, 31},
  };
  for (size_t i = 0; i < sizeof router / sizeof router[0]; i++) rc |= run_router_case(&router[i]);
  tw_cuda_gemm_destroy(gemm);
  tw_cpu_pool_destroy(pool);
  printf("%s\n", rc ? "test_moe: FAILED" : "test_moe: all passed");
  return rc ? 1 : 0;
}
