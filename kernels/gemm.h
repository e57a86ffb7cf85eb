/* gemm.h: cuBLAS/cuBLASLt wrappers for the dense linear layers of gpt-oss
 * (QKV, attention output, router, unembedding) and the per-expert GEMMs of
 * the MoE prefill path. All operands are row-major in PyTorch orientation:
 *     y[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n])
 * with bf16 x and w, fp32 accumulation, bf16 or fp32 y.
 *
 * A tw_cuda_gemm_t owns one cuBLASLt handle, one cuBLAS handle, a device
 * workspace and a small cache of cuBLASLt heuristics keyed by shape, so a
 * repeated shape costs no heuristic query. Calls are asynchronous on the
 * caller's stream, never synchronise and never allocate, so they can be
 * captured into CUDA graphs. Not thread-safe: one engine, one gemm handle. */
#ifndef TW_KERNELS_GEMM_H
#define TW_KERNELS_GEMM_H

#include "common/base/status.h"
#include "common/model/model.h"

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_cuda_gemm tw_cuda_gemm_t;

/** Create the handles and a device workspace of `workspace_bytes` (0 picks
 *  32 MiB) on the current device.
 *  Errors: TW_ERR_CUDA (handle creation or allocation failed), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_cuda_gemm_create(size_t workspace_bytes, tw_cuda_gemm_t **gemm_p);

/** Free the handles, descriptors and workspace. NULL does nothing. */
void tw_cuda_gemm_destroy(tw_cuda_gemm_t *gemm);

/** Dense linear layer through cuBLASLt:
 *    y[m][n] = sum_k x[m][k] * w[n][k] + (maybe_bias ? bias[n] : 0)
 *  for m < M, n < N. x bf16 [M, K] (row stride ldx elements), w bf16 [N, K]
 *  (row stride ldw), y [M, N] of y_dtype (TW_DTYPE_BF16 or TW_DTYPE_F32, row
 *  stride ldy). maybe_bias has y_dtype too (bf16 bias for bf16 y, f32 for f32
 *  y: the cuBLASLt bias epilogue rule), or NULL. fp32 accumulation.
 *  Pointers must be 16-byte aligned and strides multiples of 8 elements.
 *  M == 0 does nothing. M <= 4 with N <= 16384 runs one GEMV kernel (one
 *  launch, PDL, bias fused; the decode step's projections) instead of
 *  cuBLASLt, unless TWAIN_CUDA_GEMV=0 is in the environment.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL pointer, non-positive N/K, negative
 *  M, stride smaller than the row, other y dtype), TW_ERR_UNSUPPORTED (no
 *  cuBLASLt algorithm for the shape), TW_ERR_CUDA (cuBLAS failure, named). */
TW_NODISCARD tw_status_t tw_cuda_gemm_bf16(tw_cuda_gemm_t *gemm, int32_t M, int32_t N, int32_t K,
                                           const void *x, int64_t ldx, const void *w, int64_t ldw,
                                           const void *maybe_bias, void *y, tw_dtype_t y_dtype,
                                           int64_t ldy, cudaStream_t stream);

/** The same product without bias through cublasGemmEx (cuBLAS picks the
 *  kernel itself: cheap for many distinct M, as in the per-expert GEMMs of
 *  the MoE prefill). Same operands, errors and alignment rules as
 *  tw_cuda_gemm_bf16, minus the bias. */
TW_NODISCARD tw_status_t tw_cuda_gemm_bf16_nobias(tw_cuda_gemm_t *gemm, int32_t M, int32_t N,
                                                  int32_t K, const void *x, int64_t ldx,
                                                  const void *w, int64_t ldw, void *y,
                                                  tw_dtype_t y_dtype, int64_t ldy,
                                                  cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
