/* bench_gemm.c (twain-bench-gemm): the dense projections of a decode step
 * through tw_cuda_gemm_bf16 (kernels/gemm.h) at small M, one shape at a
 * time: gpt-oss QKV (5120 x 2880, f32 out + bias), O (2880 x 4096, f32 +
 * bias), the router (32 or 128 x 2880, f32 + bias) and the unembedding
 * (201088 x 2880, f32), for M = 1 .. 64 tokens. Which kernel runs follows
 * the library's own rule: the GEMV for M <= 4, cuBLASLt otherwise or where
 * TWAIN_CUDA_GEMV=0 turns the GEMV off (run twice to compare).
 *
 * Timing: 20 launches back to back inside a CUDA graph, replayed; median of
 * --reps replays over 20 (the weights, up to 1.16 GB, rotate over 4 copies
 * where they fit in 8 GB, so the L2 does not serve a repeat). Reports us a
 * call, the bytes it must move (weights + x + y) and GB/s against the copy
 * ceiling (GBS_CEIL), and the FLOPs (2 M N K).
 *
 * Usage: twain-bench-gemm [--m 1,5,8,16,32,64] [--reps N] */
#include "bench_util.h"
#include "common/base/log.h"
#include "kernels/gemm.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  const char *name;
  int N, K, bias;
} shape_t;

#define CALLS 20
#define COPIES 4

static int bench_shape(tw_cuda_gemm_t *g, const shape_t *sh, const int *Ms, int nM, int reps,
                       cudaStream_t s) {
  const size_t wbytes = (size_t)sh->N * sh->K * 2;
  void *w[COPIES], *x, *y, *b;
  for (int i = 0; i < COPIES; i++) CK(cudaMalloc(&w[i], wbytes));
  CK(cudaMalloc(&x, (size_t)64 * sh->K * 2));
  CK(cudaMalloc(&y, (size_t)64 * sh->N * 4));
  CK(cudaMalloc(&b, (size_t)sh->N * 4));
  for (int i = 0; i < COPIES; i++) CK(cudaMemset(w[i], 0x3c, wbytes)); /* bf16 ~ 0.0115 */
  CK(cudaMemset(x, 0x3c, (size_t)64 * sh->K * 2));
  CK(cudaMemset(b, 0, (size_t)sh->N * 4));
  for (int mi = 0; mi < nM; mi++) {
    const int M = Ms[mi];
    /* warm-up (cuBLASLt heuristics, descriptors) outside the capture */
    if (tw_cuda_gemm_bf16(g, M, sh->N, sh->K, x, sh->K, w[0], sh->K, sh->bias ? b : NULL, y,
                          TW_DTYPE_F32, sh->N, s) != TW_OK) {
      fprintf(stderr, "gemm %s M=%d: %s\n", sh->name, M, tw_last_error());
      return 1;
    }
    CK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < CALLS; c++)
      if (tw_cuda_gemm_bf16(g, M, sh->N, sh->K, x, sh->K, w[c % COPIES], sh->K, sh->bias ? b : NULL,
                            y, TW_DTYPE_F32, sh->N, s) != TW_OK) {
        fprintf(stderr, "gemm %s M=%d: %s\n", sh->name, M, tw_last_error());
        return 1;
      }
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    float *t = malloc(sizeof(float) * (size_t)reps);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = 0; r < reps; r++) {
      CK(cudaEventRecord(e0, s));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    qsort(t, (size_t)reps, sizeof(float), cmp_float);
    const double us = t[reps / 2] * 1e3 / CALLS;
    const double bytes = (double)wbytes + (double)M * sh->K * 2 + (double)M * sh->N * 4;
    const double gbs = bytes / (us * 1e-6) / 1e9;
    printf("| %s | %d | %d x %d | %.2f | %.1f MB | %.0f | %.2f | %.2f GFLOP |\n", sh->name, M,
           sh->N, sh->K, us, bytes / 1e6, gbs, gbs / GBS_CEIL, 2.0 * M * sh->N * sh->K / 1e9);
    free(t);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  for (int i = 0; i < COPIES; i++) cudaFree(w[i]);
  cudaFree(x);
  cudaFree(y);
  cudaFree(b);
  return 0;
}

int main(int argc, char **argv) {
  int Ms[32] = {1, 5, 8, 16, 32, 64}, nM = 6, reps = 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--m") && i + 1 < argc) {
      nM = 0;
      for (char *p = strtok(argv[++i], ","); p && nM < 32; p = strtok(NULL, ",")) {
        int m = atoi(p);
        if (m < 1 || m > 64) {
          fprintf(stderr, "--m: %d is outside 1..64\n", m);
          return 2;
        }
        Ms[nM++] = m;
      }
    } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = atoi(argv[++i]);
      if (reps < 1) reps = 1;
    } else {
      fprintf(stderr, "usage: twain-bench-gemm [--m 1,5,8,16,32,64] [--reps N]\n");
      return 2;
    }
  }
  static const shape_t shapes[] = {{"qkv", 5120, 2880, 1},
                                   {"o_proj", 2880, 4096, 1},
                                   {"router_20b", 32, 2880, 1},
                                   {"router_120b", 128, 2880, 1},
                                   {"lm_head", 201088, 2880, 0}};
  tw_cuda_gemm_t *g = NULL;
  if (tw_cuda_gemm_create(0, &g) != TW_OK) {
    fprintf(stderr, "twain-bench-gemm: %s\n", tw_last_error());
    return 1;
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const char *gv = getenv("TWAIN_CUDA_GEMV");
  printf("twain-bench-gemm: TWAIN_CUDA_GEMV=%s, %d calls a replay, median of %d\n", gv ? gv : "(1)",
         CALLS, reps);
  printf(
      "| shape | M | N x K | us a call | bytes | GB/s | of the copy ceiling | FLOPs |\n"
      "|---|---|---|---|---|---|---|---|\n");
  int rc = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0] && !rc; i++)
    rc = bench_shape(g, &shapes[i], Ms, nM, reps, s);
  cudaStreamDestroy(s);
  tw_cuda_gemm_destroy(g);
  return rc;
}
