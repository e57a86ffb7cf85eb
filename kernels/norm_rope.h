/* norm_rope.h: RMSNorm fused with the residual add (spec §2.3), YaRN RoPE
 * (spec §2.5) fused with the KV-cache write into the paged pool, and the host
 * function that builds the RoPE tables.
 *
 * The device functions are asynchronous on the caller's stream: they never
 * synchronise and never allocate. bf16 tensors are passed as void pointers
 * (bit patterns of bfloat16); all math is fp32. */
#ifndef TW_KERNELS_NORM_ROPE_H
#define TW_KERNELS_NORM_ROPE_H

#include "common/base/status.h"
#include "common/model/config.h"
#include "common/model/model.h"

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Residual add + RMSNorm (spec §2.3), per token row t < n_tokens:
 *    if maybe_delta: x_resid[t] += delta[t]       (in place, fp32)
 *    out[t] = bf16( x_resid[t] / sqrt(mean(x_resid[t]^2) + eps) * float(weight) )
 *  x_resid f32 [n_tokens, hidden] (device, updated in place when a delta is
 *  given); maybe_delta NULL or [n_tokens, hidden] of delta_dtype
 *  (TW_DTYPE_BF16 or TW_DTYPE_F32; ignored when NULL); weight bf16 [hidden];
 *  out bf16 [n_tokens, hidden]. hidden must be a multiple of 4 (2880 is);
 *  x_resid and an f32 delta 16-byte aligned (float4 access).
 *  n_tokens == 0 does nothing.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL x_resid/weight/out, n_tokens < 0,
 *  hidden <= 0 or not a multiple of 4, eps < 0, other delta dtype),
 *  TW_ERR_CUDA (launch failed). */
TW_NODISCARD tw_status_t tw_cuda_rmsnorm_residual(float *x_resid, const void *maybe_delta,
                                                  tw_dtype_t delta_dtype, const void *weight,
                                                  float eps, int32_t n_tokens, int32_t hidden,
                                                  void *out, cudaStream_t stream);

/** Fill the YaRN RoPE tables (spec §2.5) on the host, computed in double and
 *  rounded to f32: for p < max_pos, i < D/2,
 *    cos_out[p * D/2 + i] = c * cos(p * inv_freq_i),
 *    sin_out[p * D/2 + i] = c * sin(p * inv_freq_i),
 *  with inv_freq_i blending theta^(-2i/D) and theta^(-2i/D)/f over the ramp
 *  [low, high] (not rounded unless config->rope_truncate; plain theta^(-2i/D)
 *  when f <= 1), f = rope_factor,
 *  L0 = rope_original_max_pos, and the concentration c = 0.1 ln f + 1
 *  (1 when f <= 1). Upload both tables once (f32 [max_pos, D/2] each).
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL pointer, max_pos <= 0, head_dim odd
 *  or <= 0, theta <= 1, f <= 0, beta_fast <= beta_slow, or low/high outside
 *  the ramp's valid range). */
TW_NODISCARD tw_status_t tw_cuda_rope_table_fill(const tw_model_config_t *config, int32_t max_pos,
                                                 float *cos_out, float *sin_out);

/** RoPE on q and k of the QKV GEMM's f32 output, plus the KV-cache write,
 *  each value rounded to bf16 once, after the rotation. qkv: f32, row t at
 *  qkv + t * qkv_row_stride (elements) holding [q: NQ * D][k: NKV * D]
 *  [v: NKV * D], not modified. For each token t at position p = positions[t]
 *  (clamped to [0, max_pos)), every q and k head is rotated half-split
 *  (x'[i] = x[i] C - x[i+D/2] S, x'[i+D/2] = x[i+D/2] C + x[i] S, C/S from
 *  the tables of tw_cuda_rope_table_fill, fp32 math). The rotated q goes to
 *  q_out (bf16, row t at q_out + t * q_row_stride, NQ * D values); if
 *  maybe_slots is not NULL and maybe_slots[t] >= 0, the rotated k and
 *  bf16(v) of every kv head go into kv_layer (bf16 pool of this layer,
 *  engine.h layout) at slot maybe_slots[t] = block_id * block_size +
 *  p % block_size (k is not kept otherwise).
 *    positions int32 [n_tokens], device; rope_cos/rope_sin f32 [max_pos, D/2],
 *    device; maybe_slots int32 [n_tokens], device, or NULL.
 *  n_tokens == 0 does nothing.
 *  qkv 8-byte and q_out 4-byte aligned (float2 reads, bf16x2 writes).
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL qkv/q_out/positions/tables,
 *  kv_layer NULL while maybe_slots is given, n_tokens < 0, head counts <= 0,
 *  head_dim not a multiple of 4 or > 256, max_pos <= 0, qkv_row_stride <
 *  (NQ + 2 NKV) * D or odd, q_row_stride < NQ * D or odd, block_size <= 0,
 *  misaligned qkv or q_out), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_rope_kv_write_f32(
    const float *qkv, int64_t qkv_row_stride, int32_t n_tokens, int32_t n_q_heads,
    int32_t n_kv_heads, int32_t head_dim, const int32_t *positions, const float *rope_cos,
    const float *rope_sin, int32_t max_pos, const int32_t *maybe_slots, void *kv_layer,
    int32_t block_size, void *q_out, int64_t q_row_stride, cudaStream_t stream);

/** tw_cuda_rope_kv_write_f32 for the fp8 KV cache (common/kv/kv_fp8.h): q the
 *  same (bf16, rotated, into q_out); the rotated k and v of each kv head of
 *  token t go into kv_layer (the fp8 pool of this layer) at slot slots[t]
 *  (>= 0; -1 skips the token) as e4m3(x / s) rounded to nearest even,
 *  saturating, with s = max |x| / 448 over the head's values (f32, stored
 *  in the block's scales; 0 for an all-zero head, whose bytes are then 0),
 *  from the unrounded f32 values. slots and kv_layer are required.
 *  Errors: those of tw_cuda_rope_kv_write_f32, plus TW_ERR_INVALID_ARGUMENT
 *  (NULL slots or kv_layer, head_dim > 256, block_size not a multiple of 4,
 *  kv_layer not 16-byte aligned). */
TW_NODISCARD tw_status_t tw_cuda_rope_kv_write_fp8(
    const float *qkv, int64_t qkv_row_stride, int32_t n_tokens, int32_t n_q_heads,
    int32_t n_kv_heads, int32_t head_dim, const int32_t *positions, const float *rope_cos,
    const float *rope_sin, int32_t max_pos, const int32_t *slots, void *kv_layer,
    int32_t block_size, void *q_out, int64_t q_row_stride, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
