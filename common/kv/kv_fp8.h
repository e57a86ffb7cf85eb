/* kv_fp8.h: the KV cache's dtypes (engine.h kv_dtype) and the FP8 (e4m3)
 * KV cache with per-head scales, written once for every backend.
 *
 * FP8 layout. With kv_dtype TW_KV_DTYPE_FP8 a block keeps the engine.h
 * order [k | v][kv_head][...], and each (k|v, kv head) part of a block
 * holds its block_size x head_dim values as e4m3 (1 byte each, slot-major)
 * followed by block_size f32 scales, one per slot (token):
 *     [k | v][kv_head][ slot x head_dim e4m3 | slot x f32 scale ]
 * so a head's part is still contiguous (head re-sharding keeps one put per
 * head range, kv_reshard.c) and a block is still opaque bytes to the block
 * manager, the window ring, the memory plan and the handoff. A token's
 * K (or V) of one head is stored as q[d] = e4m3(x[d] / s), s = amax / 448,
 * amax = max |x[d]| over the head's head_dim values (448: the largest
 * finite e4m3), and read as q[d] * s: no calibration, any weights. amax 0
 * stores zeros with s = 0. e4m3 is the OCP 8-bit float E4M3 ("fn": no
 * infinities, S.1111.111 the only NaN, largest finite 448, smallest
 * subnormal 2^-9; OCP "OCP 8-bit Floating Point Specification (OFP8)"
 * rev. 1.0, 2023, table 1). */
#ifndef TW_COMMON_KV_FP8_H
#define TW_COMMON_KV_FP8_H

#include "common/base/status.h"
#include "common/model/model.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_KV_DTYPE_AUTO = 0, /* the backend's own: cpu f32, cuda bf16 */
  TW_KV_DTYPE_FP8 = 1,  /* e4m3 with a per-(token, kv head) f32 scale (top of this file) */
} tw_kv_dtype_t;

#define TW_E4M3_MAX 448.0f /* largest finite e4m3 */

/** f32 to e4m3 (the byte), round to nearest, ties to even; magnitudes past
 *  448 (infinities included) saturate to +-448; NaN gives 0x7F (sign
 *  kept: 0xFF). Exact for every value of the e4m3 grid. */
uint8_t tw_f32_to_e4m3(float x);

/** e4m3 byte to f32 (exact): S.EEEE.MMM is (-1)^S 2^(E-7) (1 + M/8) for
 *  E >= 1, (-1)^S 2^-6 M/8 for E = 0; 0x7F and 0xFF are NaN. */
float tw_e4m3_to_f32(uint8_t b);

/** Quantize one token's K or V of one head: n values x (f32) into q[n]
 *  (e4m3) and *scale_p = max |x| / 448 (0 if all are 0; NaN input gives
 *  NaN bytes). */
void tw_kv_fp8_quantize(const float *x, int32_t n, uint8_t *q, float *scale_p);

/** Dequantize n e4m3 values with their scale: out[d] = e4m3(q[d]) * scale. */
void tw_kv_fp8_dequantize(const uint8_t *q, int32_t n, float scale, float *out);

/** The tw_dtype_t of a pool of kv dtype `kv` on a backend whose own KV
 *  dtype is `native` (cpu TW_DTYPE_F32, cuda TW_DTYPE_BF16). */
tw_dtype_t tw_kv_pool_dtype(tw_kv_dtype_t kv, tw_dtype_t native);

/** Bytes of one (k|v, kv head) part of a block of `pool_dtype` (f32, bf16:
 *  block_size x head_dim values; TW_DTYPE_F8_E4M3: those values as bytes
 *  plus block_size f32 scales); 0 for any other dtype. A block of one layer
 *  is 2 x kv heads x this. */
int64_t tw_kv_head_bytes(tw_dtype_t pool_dtype, int32_t block_size, int32_t head_dim);

/** "fp8" or "bf16" (auto), for log lines; "f32"/"bf16"/"fp8" of a pool
 *  dtype by tw_kv_pool_dtype_name. */
const char *tw_kv_dtype_name(tw_kv_dtype_t kv);
const char *tw_kv_pool_dtype_name(tw_dtype_t pool_dtype);

/** TW_ERR_UNSUPPORTED with "the prefill worker's KV cache is <src>, the
 *  decode pool's <dst>: start both with the same --kv-dtype" (a handoff
 *  between pools of different KV dtypes; nothing is sent). */
TW_NODISCARD tw_status_t tw_kv_dtype_mismatch(tw_dtype_t src, tw_dtype_t dst);

/** The --kv-dtype option's parser (opts.h TW_OPT_FN; dst: int32_t *, a
 *  tw_kv_dtype_t): "bf16" or "auto" -> TW_KV_DTYPE_AUTO (the backend's
 *  full-precision cache: bf16 on cuda, f32 on the cpu reference), "fp8" ->
 *  TW_KV_DTYPE_FP8; 0, or -1 with "must be bf16, fp8 or auto, got 'X'" in
 *  err. */
int tw_kv_dtype_opt(const char *text, void *dst, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
