/* kv_block_copy.h: whole-block copies between KV regions on the GPU, for the
 * window ring of the sliding layers (common/kv/kv_ring.h): a prefill pass copies
 * the ring blocks of earlier positions into its scratch and its last blocks
 * back into the ring. */
#ifndef TW_KERNELS_KV_BLOCK_COPY_H
#define TW_KERNELS_KV_BLOCK_COPY_H

#include "common/base/status.h"

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** For each i < n_pairs: block pairs[2i] of src_base to block pairs[2i+1] of
 *  dst_base, block_bytes each (K and V of every local kv head: one engine.h
 *  block of one layer). pairs: int32 on the device; the destination blocks
 *  are distinct and not among the sources. Asynchronous on `stream`.
 *  n_pairs == 0 does nothing. Errors: TW_ERR_INVALID_ARGUMENT (NULL
 *  pointer, n_pairs < 0, block_bytes not a positive multiple of 16, bases
 *  not 16-byte aligned), TW_ERR_CUDA (launch failed). */
TW_NODISCARD tw_status_t tw_cuda_kv_block_copy(void *dst_base, const void *src_base,
                                               const int32_t *pairs, int32_t n_pairs,
                                               int64_t block_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
