/* gemm.cu: cuBLASLt / cuBLAS wrappers (gemm.h).
 *
 * Row-major y[M,N] = x[M,K] w[N,K]^T is computed as the column-major product
 * D(N x M) = op(A) op(B) with A = w seen column-major as K x N (transposed),
 * B = x seen column-major as K x M: no data is moved. cuBLASLt's bias
 * epilogue adds a vector over D's rows, i.e. over n. */
#include "kernels/gemm.h"

#include "kernels/cuda_common.h"
#include "kernels/pdl.cuh"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <stdlib.h>
#include <string.h>

#define TW_GEMM_CACHE 64

typedef struct {
  int valid;
  int32_t M, N, K;
  int64_t ldx, ldw, ldy;
  tw_dtype_t y_dtype;
  int has_bias;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
} tw_gemm_entry_t;

struct tw_cuda_gemm {
  cublasLtHandle_t lt;
  cublasHandle_t blas;
  void *workspace;
  size_t workspace_bytes;
  tw_gemm_entry_t cache[TW_GEMM_CACHE];
  int next_victim;
};

static TW_NODISCARD tw_status_t tw_gemm_lt_check(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return TW_OK;
  return tw_err(TW_ERR_CUDA, "gemm: %s failed: cublas status %d", what, (int)s);
}

static void tw_gemm_entry_free(tw_gemm_entry_t *e) {
  if (!e->valid) return;
  cublasLtMatrixLayoutDestroy(e->a);
  cublasLtMatrixLayoutDestroy(e->b);
  cublasLtMatrixLayoutDestroy(e->c);
  cublasLtMatmulDescDestroy(e->desc);
  e->valid = 0;
}

extern "C" tw_status_t tw_cuda_gemm_create(size_t workspace_bytes, tw_cuda_gemm_t **gemm_p) {
  if (!gemm_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "gemm_create: gemm_p is NULL");
  if (workspace_bytes == 0) workspace_bytes = (size_t)32 << 20;
  tw_cuda_gemm_t *g = (tw_cuda_gemm_t *)calloc(1, sizeof(*g));
  if (!g) return tw_err(TW_ERR_NO_MEMORY, "gemm_create: out of host memory");
  tw_status_t st = TW_OK;
  if ((st = tw_gemm_lt_check(cublasLtCreate(&g->lt), "cublasLtCreate")) < 0) goto fail;
  if ((st = tw_gemm_lt_check(cublasCreate(&g->blas), "cublasCreate")) < 0) goto fail;
  TW_CUDA_CHECK_GOTO(cudaMalloc(&g->workspace, workspace_bytes), st, fail);
  g->workspace_bytes = workspace_bytes;
  if ((st = tw_gemm_lt_check(cublasSetWorkspace(g->blas, g->workspace, workspace_bytes),
                             "cublasSetWorkspace")) < 0)
    goto fail;
  if ((st = tw_gemm_lt_check(cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH),
                             "cublasSetMathMode")) < 0)
    goto fail;
  *gemm_p = g;
  return TW_OK;
fail:
  tw_cuda_gemm_destroy(g);
  return st;
}

extern "C" void tw_cuda_gemm_destroy(tw_cuda_gemm_t *g) {
  if (!g) return;
  for (int i = 0; i < TW_GEMM_CACHE; i++) tw_gemm_entry_free(&g->cache[i]);
  if (g->workspace) cudaFree(g->workspace);
  if (g->blas) cublasDestroy(g->blas);
  if (g->lt) cublasLtDestroy(g->lt);
  free(g);
}

static TW_NODISCARD tw_status_t tw_gemm_args_check(const char *fn, int32_t M, int32_t N, int32_t K,
                                      const void *x, int64_t ldx, const void *w, int64_t ldw,
                                      const void *y, tw_dtype_t y_dtype, int64_t ldy) {
  if (!x || !w || !y) return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: NULL operand", fn);
  if (M < 0 || N <= 0 || K <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: bad shape M=%d N=%d K=%d", fn, M, N, K);
  if (ldx < K || ldw < K || ldy < N)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "%s: stride too small (ldx %lld ldw %lld ldy %lld for K %d N %d)", fn,
                  (long long)ldx, (long long)ldw, (long long)ldy, K, N);
  if (y_dtype != TW_DTYPE_BF16 && y_dtype != TW_DTYPE_F32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: y dtype %s is not bf16 or f32", fn,
                  tw_dtype_name(y_dtype));
  return TW_OK;
}

/* Find or build the cached descriptors and algorithm for one shape. */
static TW_NODISCARD tw_status_t tw_gemm_entry_get(tw_cuda_gemm_t *g, int32_t M, int32_t N, int32_t K,
                                     int64_t ldx, int64_t ldw, int64_t ldy, tw_dtype_t y_dtype,
                                     int has_bias, tw_gemm_entry_t **entry_p) {
  for (int i = 0; i < TW_GEMM_CACHE; i++) {
    tw_gemm_entry_t *e = &g->cache[i];
    if (e->valid && e->M == M && e->N == N && e->K == K && e->ldx == ldx && e->ldw == ldw &&
        e->ldy == ldy && e->y_dtype == y_dtype && e->has_bias == has_bias) {
      *entry_p = e;
      return TW_OK;
    }
  }
  tw_gemm_entry_t *e = &g->cache[g->next_victim];
  g->next_victim = (g->next_victim + 1) % TW_GEMM_CACHE;
  tw_gemm_entry_free(e);
  memset(e, 0, sizeof(*e));
  cudaDataType_t ct = y_dtype == TW_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epi = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  tw_status_t st;
  TW_CHECK(tw_gemm_lt_check(cublasLtMatmulDescCreate(&e->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                            "cublasLtMatmulDescCreate"));
  cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (cublasLtMatrixLayoutCreate(&e->a, CUDA_R_16BF, K, N, ldw) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&e->b, CUDA_R_16BF, K, M, ldx) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&e->c, ct, N, M, ldy) != CUBLAS_STATUS_SUCCESS) {
    e->valid = 1;
    tw_gemm_entry_free(e);
    return tw_err(TW_ERR_CUDA, "gemm: cublasLtMatrixLayoutCreate failed (M=%d N=%d K=%d)", M, N,
                  K);
  }
  e->valid = 1;
  cublasLtMatmulPreference_t pref;
  st = tw_gemm_lt_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  if (st < 0) {
    tw_gemm_entry_free(e);
    return st;
  }
  size_t ws = g->workspace_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  cublasLtMatmulHeuristicResult_t res;
  int n_res = 0;
  cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(g->lt, e->desc, e->a, e->b, e->c, e->c, pref, 1, &res, &n_res);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || n_res < 1) {
    tw_gemm_entry_free(e);
    return tw_err(TW_ERR_UNSUPPORTED, "gemm: no cuBLASLt algorithm for M=%d N=%d K=%d (status %d)",
                  M, N, K, (int)hs);
  }
  e->algo = res.algo;
  e->M = M;
  e->N = N;
  e->K = K;
  e->ldx = ldx;
  e->ldw = ldw;
  e->ldy = ldy;
  e->y_dtype = y_dtype;
  e->has_bias = has_bias;
  *entry_p = e;
  return TW_OK;
}

/* y[m][n] += bias[n]: the fallback when cuBLASLt has no bias-epilogue
 * algorithm for a shape. */
template <typename T>
__global__ void tw_gemm_bias_kernel(T *y, int64_t ldy, const T *bias, int N) {
  T *row = y + (size_t)blockIdx.x * ldy;
  for (int n = threadIdx.x; n < N; n += blockDim.x) row[n] = (T)((float)row[n] + (float)bias[n]);
}

/* Small-M GEMV (the decode step's QKV and O projections at batch 1..4): one
 * warp per output column n, 16-byte loads of w[n] (read once) and x rows,
 * f32 accumulation, warp reduction, bias added and y written (f32 or bf16,
 * rounded once) by lane 0. One kernel (no split-K reduction, no memset) and
 * launched with PDL, so a decode graph has one node per projection. */
#define TW_GEMV_MAX_M 4
#define TW_GEMV_MAX_N 16384
template <int M, typename YT>
__global__ void __launch_bounds__(256)
    tw_gemv_kernel(const __nv_bfloat16 *__restrict__ x, int64_t ldx,
                   const __nv_bfloat16 *__restrict__ w, int64_t ldw, const YT *__restrict__ bias,
                   YT *__restrict__ y, int64_t ldy, int N, int K) {
  TW_PDL_WAIT();
  const int n = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return;
  const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)n * ldw);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  const int nc = K / 8;
#pragma unroll 4
  for (int c = lane; c < nc; c += 32) {
    const uint4 a = __ldg(wr + c);
    const __nv_bfloat162 *pa = reinterpret_cast<const __nv_bfloat162 *>(&a);
#pragma unroll
    for (int m = 0; m < M; m++) {
      const uint4 b = *reinterpret_cast<const uint4 *>(x + (size_t)m * ldx + (size_t)c * 8);
      const __nv_bfloat162 *pb = reinterpret_cast<const __nv_bfloat162 *>(&b);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
        acc[m] = fmaf(fa.x, fb.x, acc[m]);
        acc[m] = fmaf(fa.y, fb.y, acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; m++)
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  if (lane == 0) {
    const float b = bias ? (float)bias[n] : 0.0f;
#pragma unroll
    for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = (YT)(acc[m] + b);
  }
}

static int tw_gemv_env(void) { return tw_cuda_knobs()->gemv; } /* TWAIN_CUDA_GEMV */

template <typename YT>
static void tw_gemv_launch(int32_t M, int32_t N, int32_t K, const void *x, int64_t ldx,
                           const void *w, int64_t ldw, const void *bias, void *y, int64_t ldy,
                           cudaStream_t stream) {
  const __nv_bfloat16 *xb = (const __nv_bfloat16 *)x, *wb = (const __nv_bfloat16 *)w;
  const YT *bb = (const YT *)bias;
  YT *yy = (YT *)y;
  dim3 grid((unsigned)TW_CDIV(N, 8)), block(256);
  switch (M) {
  case 1: tw_pdl_launch(tw_gemv_kernel<1, YT>, grid, block, 0, stream, xb, ldx, wb, ldw, bb, yy, ldy, N, K); break;
  case 2: tw_pdl_launch(tw_gemv_kernel<2, YT>, grid, block, 0, stream, xb, ldx, wb, ldw, bb, yy, ldy, N, K); break;
  case 3: tw_pdl_launch(tw_gemv_kernel<3, YT>, grid, block, 0, stream, xb, ldx, wb, ldw, bb, yy, ldy, N, K); break;
  default: tw_pdl_launch(tw_gemv_kernel<4, YT>, grid, block, 0, stream, xb, ldx, wb, ldw, bb, yy, ldy, N, K); break;
  }
}

extern "C" tw_status_t tw_cuda_gemm_bf16(tw_cuda_gemm_t *g, int32_t M, int32_t N, int32_t K,
                                         const void *x, int64_t ldx, const void *w, int64_t ldw,
                                         const void *maybe_bias, void *y, tw_dtype_t y_dtype,
                                         int64_t ldy, cudaStream_t stream) {
  if (!g) return tw_err(TW_ERR_INVALID_ARGUMENT, "gemm_bf16: gemm is NULL");
  TW_CHECK(tw_gemm_args_check("gemm_bf16", M, N, K, x, ldx, w, ldw, y, y_dtype, ldy));
  if (M == 0) return TW_OK;
  if (M <= TW_GEMV_MAX_M && N <= TW_GEMV_MAX_N && K % 8 == 0 && ldx % 8 == 0 && ldw % 8 == 0 &&
      !(((uintptr_t)x | (uintptr_t)w) & 15) && tw_gemv_env()) {
    if (y_dtype == TW_DTYPE_F32)
      tw_gemv_launch<float>(M, N, K, x, ldx, w, ldw, maybe_bias, y, ldy, stream);
    else
      tw_gemv_launch<__nv_bfloat16>(M, N, K, x, ldx, w, ldw, maybe_bias, y, ldy, stream);
    TW_CUDA_CHECK_LAUNCH("tw_gemv_kernel");
    return TW_OK;
  }
  tw_gemm_entry_t *e = NULL;
  tw_status_t st = tw_gemm_entry_get(g, M, N, K, ldx, ldw, ldy, y_dtype, maybe_bias != NULL, &e);
  if (st == TW_ERR_UNSUPPORTED && maybe_bias) {
    /* no fused-bias algorithm: plain product, then the bias kernel */
    tw_clear_error();
    TW_CHECK(tw_cuda_gemm_bf16(g, M, N, K, x, ldx, w, ldw, NULL, y, y_dtype, ldy, stream));
    if (y_dtype == TW_DTYPE_F32)
      tw_gemm_bias_kernel<float><<<M, 256, 0, stream>>>((float *)y, ldy, (const float *)maybe_bias,
                                                        N);
    else
      tw_gemm_bias_kernel<__nv_bfloat16><<<M, 256, 0, stream>>>(
          (__nv_bfloat16 *)y, ldy, (const __nv_bfloat16 *)maybe_bias, N);
    TW_CUDA_CHECK_LAUNCH("tw_gemm_bias_kernel");
    return TW_OK;
  }
  TW_CHECK(st);
  if (maybe_bias)
    cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &maybe_bias,
                                   sizeof(maybe_bias));
  float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t s = cublasLtMatmul(g->lt, e->desc, &alpha, w, e->a, x, e->b, &beta, y, e->c, y,
                                    e->c, &e->algo, g->workspace, g->workspace_bytes, stream);
  if (s != CUBLAS_STATUS_SUCCESS)
    return tw_err(TW_ERR_CUDA, "gemm_bf16: cublasLtMatmul failed (status %d, M=%d N=%d K=%d)",
                  (int)s, M, N, K);
  return TW_OK;
}

extern "C" tw_status_t tw_cuda_gemm_bf16_nobias(tw_cuda_gemm_t *g, int32_t M, int32_t N,
                                                int32_t K, const void *x, int64_t ldx,
                                                const void *w, int64_t ldw, void *y,
                                                tw_dtype_t y_dtype, int64_t ldy,
                                                cudaStream_t stream) {
  if (!g) return tw_err(TW_ERR_INVALID_ARGUMENT, "gemm_bf16_nobias: gemm is NULL");
  TW_CHECK(tw_gemm_args_check("gemm_bf16_nobias", M, N, K, x, ldx, w, ldw, y, y_dtype, ldy));
  if (M == 0) return TW_OK;
  TW_CHECK(tw_gemm_lt_check(cublasSetStream(g->blas, stream), "cublasSetStream"));
  float alpha = 1.0f, beta = 0.0f;
  cudaDataType_t ct = y_dtype == TW_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  cublasStatus_t s = cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w,
                                  CUDA_R_16BF, (int)ldw, x, CUDA_R_16BF, (int)ldx, &beta, y, ct,
                                  (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS)
    return tw_err(TW_ERR_CUDA, "gemm_bf16_nobias: cublasGemmEx failed (status %d, M=%d N=%d K=%d)",
                  (int)s, M, N, K);
  return TW_OK;
}
