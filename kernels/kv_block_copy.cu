/* kv_block_copy.cu: whole-block KV copies (kv_block_copy.h). */
#include "kernels/kv_block_copy.h"

#include "kernels/cuda_common.h"

/* one CTA per (pair, slice of the block); 16-byte words */
__global__ void tw_kv_block_copy_kernel(uint4 *dst, const uint4 *src, const int32_t *pairs,
                                        int64_t words) {
  int32_t p = blockIdx.x;
  const uint4 *s = src + (int64_t)pairs[2 * p] * words;
  uint4 *d = dst + (int64_t)pairs[2 * p + 1] * words;
  for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < words;
       i += (int64_t)gridDim.y * blockDim.x)
    d[i] = s[i];
}

extern "C" tw_status_t tw_cuda_kv_block_copy(void *dst_base, const void *src_base,
                                             const int32_t *pairs, int32_t n_pairs,
                                             int64_t block_bytes, cudaStream_t stream) {
  if (n_pairs == 0) return TW_OK;
  if (!dst_base || !src_base || !pairs || n_pairs < 0 || block_bytes <= 0 || block_bytes % 16 ||
      ((uintptr_t)dst_base | (uintptr_t)src_base) % 16)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv block copy: %d pairs of %lld bytes (a positive multiple of 16, aligned "
                  "bases)", n_pairs, (long long)block_bytes);
  int64_t words = block_bytes / 16;
  int32_t slices = (int32_t)((words + 255) / 256);
  if (slices > 16) slices = 16;
  dim3 grid((unsigned)n_pairs, (unsigned)slices);
  tw_kv_block_copy_kernel<<<grid, 256, 0, stream>>>((uint4 *)dst_base, (const uint4 *)src_base,
                                                    pairs, words);
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}
