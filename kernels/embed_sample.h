/* embed_sample.h: embedding gather (spec §2.2) and token sampling on the GPU
 * with exactly the rules of common/engine/sampling.c (greedy; temperature, top-k,
 * top-p, inverse-CDF draw), so the CPU and CUDA backends pick the same token
 * from the same logits. The uniform of a draw is tw_sample_uniform(seed,
 * position), computed by the caller on the host (a pure function) and passed
 * in per row. The unembedding itself is a tw_cuda_gemm_bf16 call (gemm.h).
 * All functions are asynchronous on the caller's stream and never allocate. */
#ifndef TW_KERNELS_EMBED_SAMPLE_H
#define TW_KERNELS_EMBED_SAMPLE_H

#include "common/base/status.h"

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** x[t][:] = float(table[tokens[t]][:]) for t < T. table bf16 [V, H]; tokens
 *  int32 [T] on the device, each in [0, V) (the caller checks them; ids
 *  outside are clamped, never read out of bounds); x f32 [T, H].
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL, T < 0, H not a multiple of 8,
 *  V <= 0), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_embed(const void *table, int32_t V, int32_t H,
                                       const int32_t *tokens, int32_t T, float *x,
                                       cudaStream_t stream);

/** One row's sampling parameters (device array, one per row). */
typedef struct {
  float temperature; /* <= 0: greedy */
  int32_t top_k;     /* <= 0 or >= V: no cut */
  float top_p;       /* outside (0, 1): no cut */
  int32_t pad_;
  double uniform;    /* tw_sample_uniform(seed, position) */
} tw_cuda_sample_row_t;

/** Greedy for every row: out[r] = argmax of logits[r] (lowest id on ties;
 *  NaN never wins unless the row is all NaN, then 0). logits f32 [n_rows, V]
 *  with row stride ld (elements); out int32 [n_rows] on the device.
 *  Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_argmax(const float *logits, int64_t ld, int32_t n_rows, int32_t V,
                                        int32_t *out, cudaStream_t stream);

/** Sample every row with its parameters (sampling.h order: temperature,
 *  top-k, softmax, top-p, draw in increasing id order). Rows with
 *  temperature <= 0 take the argmax. params device [n_rows]; out int32
 *  [n_rows] device. One block per row; cost grows with V (about 100 passes
 *  over the row for top-k + top-p), so greedy rows should use
 *  tw_cuda_argmax. Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_sample(const float *logits, int64_t ld, int32_t n_rows, int32_t V,
                                        const tw_cuda_sample_row_t *params, int32_t *out,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
