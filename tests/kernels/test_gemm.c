/* test_gemm.c: the cuBLASLt/cuBLAS wrappers (kernels/gemm.h) against the CPU
 * backend's tw_cpu_matmul_bf16 (f32 accumulate of the same bf16 operands) on
 * fresh random inputs: the gpt-oss linear layers (QKV 5120 x 2880, O 2880 x
 * 4096, router 128 x 2880 with f32 logits, unembedding 201088 x 2880), the
 * tiny model's, and edges (M = 1, sizes off the tiles; M <= 4 takes the
 * GEMV kernel; 5 <= M <= 64 are the decode step's batches). Outputs are poisoned
 * with NaN first, so an unwritten element fails.
 * Tolerance: bf16 outputs are rounded once (2^-9 relative), so rel L2 1e-2
 * (the bf16 bound); f32 outputs differ only by summation order: 1e-4. */
#include "attn_test_util.h"
#include "common/engine/cpu/cpu_ops.h"
#include "kernels/gemm.h"

typedef struct {
  const char *name;
  int M, N, K;
  int f32_out, bias, nobias_api;
} gemm_case_t;

static int run(tw_cpu_pool_t *pool, tw_cuda_gemm_t *g, const gemm_case_t *c) {
  size_t M = c->M, N = c->N, K = c->K;
  uint16_t *xb = malloc(M * K * 2), *wb = malloc(N * K * 2), *bb = malloc(N * 2);
  float *x = malloc(M * K * 4), *bf = malloc(N * 4), *ref = malloc(M * N * 4), *out = malloc(M * N * 4);
  if (!xb || !wb || !bb || !x || !bf || !ref || !out) return 1;
  for (size_t i = 0; i < M * K; i++) {
    xb[i] = tt_f2bf(tt_normal(1.0f));
    x[i] = tt_bf2f(xb[i]);
  }
  for (size_t i = 0; i < N * K; i++) wb[i] = tt_f2bf(tt_normal(0.03f));
  for (size_t i = 0; i < N; i++) {
    bb[i] = tt_f2bf(tt_normal(0.5f));
    bf[i] = tt_bf2f(bb[i]);
  }
  tw_cpu_matmul_bf16(pool, x, (int64_t)M, (int64_t)K, wb, NULL, (int64_t)N, ref);
  if (c->bias)
    for (size_t m = 0; m < M; m++)
      for (size_t n = 0; n < N; n++) ref[m * N + n] += bf[n];
  void *dx, *dw, *db, *dy;
  size_t ysz = M * N * (c->f32_out ? 4 : 2);
  TT_CUDA(cudaMalloc(&dx, M * K * 2));
  TT_CUDA(cudaMalloc(&dw, N * K * 2));
  TT_CUDA(cudaMalloc(&db, N * 4));
  TT_CUDA(cudaMalloc(&dy, ysz));
  TT_CUDA(cudaMemcpy(dx, xb, M * K * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemcpy(dw, wb, N * K * 2, cudaMemcpyHostToDevice));
  if (c->f32_out) TT_CUDA(cudaMemcpy(db, bf, N * 4, cudaMemcpyHostToDevice));
  else TT_CUDA(cudaMemcpy(db, bb, N * 2, cudaMemcpyHostToDevice));
  TT_CUDA(cudaMemset(dy, 0xff, ysz));
  tw_dtype_t yt = c->f32_out ? TW_DTYPE_F32 : TW_DTYPE_BF16;
  tw_status_t st;
  if (c->nobias_api)
    st = tw_cuda_gemm_bf16_nobias(g, c->M, c->N, c->K, dx, c->K, dw, c->K, dy, yt, c->N, 0);
  else
    st = tw_cuda_gemm_bf16(g, c->M, c->N, c->K, dx, c->K, dw, c->K, c->bias ? db : NULL, dy, yt,
                           c->N, 0);
  if (st != TW_OK) {
    printf("FAIL gemm(%s): %s\n", c->name, tw_last_error());
    return 1;
  }
  TT_CUDA(cudaDeviceSynchronize());
  if (c->f32_out) {
    TT_CUDA(cudaMemcpy(out, dy, ysz, cudaMemcpyDeviceToHost));
  } else {
    uint16_t *ob = malloc(M * N * 2);
    TT_CUDA(cudaMemcpy(ob, dy, ysz, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < M * N; i++) out[i] = tt_bf2f(ob[i]);
    free(ob);
  }
  tt_l2_t acc = {0};
  for (size_t i = 0; i < M * N; i++) tt_l2_add(&acc, out[i], ref[i]);
  char name[160];
  snprintf(name, sizeof name, "gemm(%s,M=%d,N=%d,K=%d,out=%s,bias=%d%s)", c->name, c->M, c->N,
           c->K, c->f32_out ? "f32" : "bf16", c->bias, c->nobias_api ? ",cublasGemmEx" : "");
  int rc = tt_l2_report(name, &acc, c->f32_out ? 1e-4 : 1e-2);
  cudaFree(dx); cudaFree(dw); cudaFree(db); cudaFree(dy);
  free(xb); free(wb); free(bb); free(x); free(bf); free(ref); free(out);
  return rc;
}

int main(void) {
  if (!tt_gpu_available()) {
    printf("SKIP: no GPU\n");
    return TT_SKIP;
  }
  tt_seed();
  tw_cpu_pool_t *pool = NULL;
  tw_cuda_gemm_t *g = NULL;
  if (tw_cpu_pool_create(0, &pool) != TW_OK || tw_cuda_gemm_create(0, &g) != TW_OK) return 1;
  static const gemm_case_t cases[] = {
      {"qkv", 1, 5120, 2880, 0, 1, 0},
      {"qkv", 77, 5120, 2880, 0, 1, 0},
      {"o", 1, 2880, 4096, 1, 1, 0},
      {"o", 130, 2880, 4096, 1, 1, 0},
      {"router", 1, 32, 2880, 1, 1, 0},
      {"router", 257, 128, 2880, 1, 1, 0},
      {"unembed", 2, 201088, 2880, 1, 0, 0},
      {"tiny_unembed", 9, 8064, 256, 1, 0, 0},
      {"tiny_router", 3, 8, 256, 1, 1, 0},
      {"expert", 300, 5760, 2880, 0, 0, 1},
      {"expert", 1, 2880, 2880, 0, 0, 1},
      {"odd", 33, 160, 96, 1, 0, 1},
      {"repeat_qkv", 77, 5120, 2880, 0, 1, 0}, /* cached descriptors reused */
      /* M <= 4: the GEMV kernel (one warp per column, PDL) instead of cuBLASLt */
      {"qkv_gemv", 4, 5120, 2880, 0, 1, 0},
      {"o_gemv", 3, 2880, 4096, 1, 1, 0},
      {"o_gemv", 2, 2880, 4096, 1, 0, 0},
      {"odd_gemv", 2, 163, 96, 0, 1, 0},
      {"odd_gemv", 1, 9, 40, 1, 1, 0},
      /* the decode step's batches 5..64 (cuBLASLt's small-M tiles) */
      {"qkv_small", 5, 5120, 2880, 0, 1, 0},
      {"qkv_small", 16, 5120, 2880, 0, 1, 0},
      {"qkv_small", 17, 5120, 2880, 1, 1, 0},
      {"qkv_small", 64, 5120, 2880, 0, 1, 0},
      {"o_small", 8, 2880, 4096, 1, 1, 0},
      {"o_small", 13, 2880, 4096, 1, 0, 0},
      {"o_small", 33, 2880, 4096, 1, 1, 0},
      {"o_small", 61, 2880, 4096, 0, 1, 0},
      {"router_small", 64, 128, 2880, 1, 1, 0},
      {"unembed_small", 16, 201088, 2880, 1, 0, 0},
      {"odd_small", 7, 48, 32, 1, 1, 0},
      {"odd_small", 40, 160, 96, 0, 1, 0},
  };
  int rc = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) rc |= run(pool, g, &cases[i]);
  tw_cuda_gemm_destroy(g);
  tw_cpu_pool_destroy(pool);
  printf("%s\n", rc ? "test_gemm: FAILED" : "test_gemm: all passed");
  return rc ? 1 : 0;
}
