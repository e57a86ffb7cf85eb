/* moe_impl.h: internals shared by moe.cu and moe_route.cu (CUDA only; not a
 * public header). */
#ifndef TW_KERNELS_MOE_IMPL_H
#define TW_KERNELS_MOE_IMPL_H

#include "kernels/moe.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

static __device__ __forceinline__ float tw_moe_to_f32(float v) { return v; }
static __device__ __forceinline__ float tw_moe_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

/* E8M0 scale byte to 2^(s-127) exactly (s = 0 gives the denormal 2^-127,
 * s = 255 gives +inf, as ldexp in the references would). */
static __device__ __forceinline__ float tw_e8m0_to_f32(unsigned s) {
  return s == 0 ? __int_as_float(0x00400000) : __int_as_float((int)(s << 23));
}

/* The packed MXFP4 blocks (moe.h TW_MX_CHUNK) of an expert's rows of K
 * inputs: its 128-k chunks a row, KC = ceil(K / 128). */
static __host__ __device__ __forceinline__ int tw_mx_chunks(int K) { return (K + 127) / 128; }
/* Where row n of expert e starts in packed MXFP4 blocks of N rows of K
 * inputs: its chunk 0; chunk c is tw_mx_cstride(N) * c bytes further. */
static __host__ __device__ __forceinline__ int64_t tw_mx_row(int64_t e, int64_t n, int N, int K) {
  return (e * tw_mx_chunks(K) * N + n) * TW_MX_CHUNK;
}
static __host__ __device__ __forceinline__ int64_t tw_mx_cstride(int N) {
  return (int64_t)N * TW_MX_CHUNK;
}
/* 16-byte block b of a row, from the row's start (tw_mx_row), chunk stride
 * cs (tw_mx_cstride): chunk b / 4, byte 16 (b % 4). */
static __host__ __device__ __forceinline__ int64_t tw_mx_block(int b, int64_t cs) {
  return (b >> 2) * cs + (b & 3) * 16;
}

/* The clamped interleaved SwiGLU of spec §2.9 for one (gate, linear) pair. */
static __device__ __forceinline__ float tw_swiglu(float g, float l, float alpha, float limit) {
  g = fminf(g, limit);
  l = fminf(fmaxf(l, -limit), limit);
  return g / (1.0f + __expf(-alpha * g)) * (l + 1.0f);
}

/* combine (moe_route.cu): out[t] = sum_j w_tj (y[pos_of[t*k+j]] + b2[e_tj]),
 * y f32 [T*k, H]; maybe_bias b2 f32 [E, H], or NULL where y holds it. */
TW_NODISCARD tw_status_t tw_moe_combine_f32(const tw_cuda_moe_route_t *r, int32_t T, int32_t H,
                                            const float *y, const float *maybe_bias, float *out,
                                            cudaStream_t stream);

/* grouped GEMM path (moe_grouped.cu): kernel attributes, and the two
 * grouped GEMMs act = SwiGLU(gather(x) W1^T + b1), y = act W2^T + b2 of
 * tw_cuda_moe_prefill (act bf16 [T*k, I], y f32 [T*k, H]; gs_part f32
 * [TW_MOE_GS_PART_FLOATS]: the streaming kernel's partial sums of units cut
 * between warps, two slots per warp, no contents kept between calls); bf16
 * experts when w1_bf16 [E, 2I, H] and w2_bf16 [E, H, I] are given, else the
 * MXFP4 ones of w. TW_ERR_INVALID_ARGUMENT when T*k is too large for the
 * grid. */
#define TW_MOE_GS_PART_FLOATS ((size_t)TW_CUDA_MOE_GS_TICKETS * 2 * 16 * 32)
extern "C" tw_status_t tw_moe_grouped_setup(void);
extern "C" tw_status_t tw_moe_grouped_run(const tw_cuda_moe_weights_t *w,
                                          const tw_cuda_moe_route_t *r, int32_t T, const void *x,
                                          const void *w1_bf16, const void *w2_bf16, void *act,
                                          float *y, float *gs_part, cudaStream_t stream);

#endif
