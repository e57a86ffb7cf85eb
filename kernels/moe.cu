/* moe.cu: the two MoE paths of moe.h (GEMV decode, GEMM prefill) and the
 * MXFP4 dequantisation.
 *
 * Decode GEMV layout: grid (row blocks, active-expert slots). A block owns one
 * active expert and 8 warps; each warp owns TW_MOE_RPW output rows (gate_up:
 * gate/linear row pairs). Lane l reads 16-byte MXFP4 blocks l, l+32, ... of a
 * row (coalesced: a row is contiguous), decodes nibbles through a 16-entry
 * shared table and multiplies with the tokens' inputs, held in shared memory
 * as f32 [token][block][36] (32 values + 4 pad: conflict-free float4 reads).
 * The tokens of the expert are processed TC at a time, so each weight byte
 * comes from DRAM once per step whatever the batch. */
#include "kernels/pdl.cuh"
#include "kernels/moe.h"

#include "kernels/cuda_common.h"
#include "kernels/moe_impl.h"

#include <cuda_fp16.h>
#include <stdint.h>

#define TW_MOE_WARPS 8
#define TW_MOE_RPW 2 /* rows (or row pairs) per warp */
#define TW_MOE_ROWS_PER_BLOCK (TW_MOE_WARPS * TW_MOE_RPW)
#define TW_MOE_XPAD 36
#define TW_MOE_MAX_SMEM (200 * 1024)

__constant__ float tw_fp4_c[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* FP4 E2M1 nibble (low 4 bits of n) to f32 without a table: the 3 magnitude
 * bits placed at fp16 bits 9..11 give value * 2^-14 exactly (e = 0 lands on
 * fp16 subnormals), the sign goes to bit 15. */
static __device__ __forceinline__ float tw_fp4_to_f32(uint32_t n) {
  unsigned short h = (unsigned short)(((n & 7u) << 9) | ((n & 8u) << 12));
  return __half2float(__ushort_as_half(h)) * 16384.0f;
}

static size_t tw_moe_smem_bytes(int tc, int cols) {
  return (16 + (size_t)tc * (cols / 32) * TW_MOE_XPAD) * sizeof(float);
}

/* Dot products of one MXFP4 row (NB blocks; packed, moe.h TW_MX_CHUNK: rb
 * its chunk 0, cs the chunk stride) with TC token vectors in smem;
 * lane-partial sums (caller reduces across the warp). */
template <int TC>
static __device__ __forceinline__ void tw_moe_row_dot(const uint8_t *__restrict__ rb, int64_t cs,
                                                      const uint8_t *__restrict__ rs, int NB,
                                                      const float *xs, const float *tab, int lane,
                                                      int nt, float acc[TC]) {
  for (int b = lane; b < NB; b += 32) {
    uint4 wv = __ldg(reinterpret_cast<const uint4 *>(rb + tw_mx_block(b, cs)));
    float sc = tw_e8m0_to_f32(__ldg(rs + b));
    float part[TC];
#pragma unroll
    for (int t = 0; t < TC; t++) part[t] = 0.0f;
    const uint32_t wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
      float v[8];
#pragma unroll
      for (int n = 0; n < 8; n++) v[n] = tab[(wq[q] >> (4 * n)) & 15u];
#pragma unroll
      for (int t = 0; t < TC; t++) {
        if (t >= nt) break; /* warp-uniform: skip the chunk's empty token slots */
        const float4 *xb =
            reinterpret_cast<const float4 *>(xs + ((size_t)t * NB + b) * TW_MOE_XPAD + q * 8);
        float4 x0 = xb[0], x1 = xb[1];
        part[t] += x0.x * v[0] + x0.y * v[1] + x0.z * v[2] + x0.w * v[3] + x1.x * v[4] +
                   x1.y * v[5] + x1.z * v[6] + x1.w * v[7];
      }
    }
#pragma unroll
    for (int t = 0; t < TC; t++) acc[t] += part[t] * sc;
  }
}

/* Load TC rows of inputs into smem as f32 [t][block][36]; rows past nt are 0.
 * Row t is src + row_of(t) * cols, where row_of comes from the sorted list
 * (gate_up: the token of the assignment; down: the sorted position itself). */
template <typename XT, int TC>
static __device__ __forceinline__ void tw_moe_load_x(float *xs, const XT *__restrict__ src,
                                                     const int32_t *__restrict__ sorted, int base,
                                                     int nt, int k, int cols, bool by_token) {
  int NB = cols / 32;
  for (int i = threadIdx.x; i < TC * cols; i += blockDim.x) {
    int t = i / cols, c = i - t * cols;
    float v = 0.0f;
    if (t < nt) {
      size_t row = by_token ? (size_t)(sorted[base + t] / k) : (size_t)(base + t);
      v = tw_moe_to_f32(src[row * cols + c]);
    }
    xs[((size_t)t * NB + (c >> 5)) * TW_MOE_XPAD + (c & 31)] = v;
  }
}

template <int TC>
__global__ void __launch_bounds__(TW_MOE_WARPS * 32)
    tw_moe_gate_up_kernel(tw_cuda_moe_weights_t w, const int32_t *__restrict__ active,
                          const int32_t *__restrict__ n_active, const int32_t *__restrict__ counts,
                          const int32_t *__restrict__ offsets, const int32_t *__restrict__ sorted,
                          int k, const __nv_bfloat16 *__restrict__ x, float *__restrict__ act) {
  TW_PDL_WAIT();
  extern __shared__ float smem[];
  float *tab = smem, *xs = smem + 16;
  if ((int)blockIdx.y >= *n_active) return;
  int e = active[blockIdx.y], cnt = counts[e], off = offsets[e];
  int H = w.hidden, I = w.intermediate, NB = H / 32;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x < 16) tab[threadIdx.x] = tw_fp4_c[threadIdx.x];
  int p0 = blockIdx.x * TW_MOE_ROWS_PER_BLOCK + warp * TW_MOE_RPW;
  for (int c0 = 0; c0 < cnt; c0 += TC) {
    int nt = min(TC, cnt - c0);
    __syncthreads();
    tw_moe_load_x<__nv_bfloat16, TC>(xs, x, sorted, off + c0, nt, k, H, true);
    __syncthreads();
    for (int q = 0; q < TW_MOE_RPW; q++) {
      int p = p0 + q;
      if (p >= I) break;
      size_t rg = (size_t)e * 2 * I + 2 * (size_t)p;
      float ag[TC], au[TC];
#pragma unroll
      for (int t = 0; t < TC; t++) ag[t] = au[t] = 0.0f;
      const uint8_t *rb = w.gate_up_blocks + tw_mx_row(e, 2 * (int64_t)p, 2 * I, H);
      const int64_t cs = tw_mx_cstride(2 * I);
      tw_moe_row_dot<TC>(rb, cs, w.gate_up_scales + rg * NB, NB, xs, tab, lane, nt, ag);
      tw_moe_row_dot<TC>(rb + TW_MX_CHUNK, cs, w.gate_up_scales + (rg + 1) * NB, NB, xs, tab,
                         lane, nt, au);
#pragma unroll
      for (int t = 0; t < TC; t++)
        for (int o = 16; o > 0; o >>= 1) {
          ag[t] += __shfl_xor_sync(0xffffffffu, ag[t], o);
          au[t] += __shfl_xor_sync(0xffffffffu, au[t], o);
        }
      if (lane == 0) {
        float bg = w.gate_up_bias[rg], bu = w.gate_up_bias[rg + 1];
#pragma unroll
        for (int t = 0; t < TC; t++)
          if (t < nt)
            act[(size_t)(off + c0 + t) * I + p] =
                tw_swiglu(ag[t] + bg, au[t] + bu, w.swiglu_alpha, w.swiglu_limit);
      }
    }
  }
}

template <int TC>
__global__ void __launch_bounds__(TW_MOE_WARPS * 32)
    tw_moe_down_kernel(tw_cuda_moe_weights_t w, const int32_t *__restrict__ active,
                       const int32_t *__restrict__ n_active, const int32_t *__restrict__ counts,
                       const int32_t *__restrict__ offsets, const float *__restrict__ act,
                       float *__restrict__ y) {
  TW_PDL_WAIT();
  extern __shared__ float smem[];
  float *tab = smem, *xs = smem + 16;
  if ((int)blockIdx.y >= *n_active) return;
  int e = active[blockIdx.y], cnt = counts[e], off = offsets[e];
  int H = w.hidden, I = w.intermediate, NB = I / 32;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x < 16) tab[threadIdx.x] = tw_fp4_c[threadIdx.x];
  int r0 = blockIdx.x * TW_MOE_ROWS_PER_BLOCK + warp * TW_MOE_RPW;
  for (int c0 = 0; c0 < cnt; c0 += TC) {
    int nt = min(TC, cnt - c0);
    __syncthreads();
    tw_moe_load_x<float, TC>(xs, act, NULL, off + c0, nt, 1, I, false);
    __syncthreads();
    for (int q = 0; q < TW_MOE_RPW; q++) {
      int r = r0 + q;
      if (r >= H) break;
      size_t row = (size_t)e * H + r;
      float acc[TC];
#pragma unroll
      for (int t = 0; t < TC; t++) acc[t] = 0.0f;
      tw_moe_row_dot<TC>(w.down_blocks + tw_mx_row(e, r, H, I), tw_mx_cstride(H),
                         w.down_scales + row * NB, NB, xs, tab, lane, nt, acc);
#pragma unroll
      for (int t = 0; t < TC; t++)
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
      if (lane == 0) {
        float b = w.down_bias[row];
#pragma unroll
        for (int t = 0; t < TC; t++)
          if (t < nt) y[(size_t)(off + c0 + t) * H + r] = acc[t] + b;
      }
    }
  }
}

extern "C" tw_status_t tw_cuda_moe_setup(void) {
  int mx = TW_MOE_MAX_SMEM;
  TW_CUDA_CHECK(cudaFuncSetAttribute(tw_moe_gate_up_kernel<1>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, mx));
  TW_CUDA_CHECK(cudaFuncSetAttribute(tw_moe_gate_up_kernel<4>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, mx));
  TW_CUDA_CHECK(
      cudaFuncSetAttribute(tw_moe_down_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, mx));
  TW_CUDA_CHECK(
      cudaFuncSetAttribute(tw_moe_down_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, mx));
  return tw_moe_grouped_setup();
}

static TW_NODISCARD tw_status_t tw_moe_weights_check(const char *fn, const tw_cuda_moe_weights_t *w,
                                        const tw_cuda_moe_route_t *r, int32_t T, const void *x,
                                        const void *out, int bf16_given) {
  if (!w || !r || !x || !out) return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  if (!w->gate_up_bias || !w->down_bias)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: NULL expert bias", fn);
  if (!bf16_given && (!w->gate_up_blocks || !w->gate_up_scales || !w->down_blocks ||
                      !w->down_scales))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: NULL expert tensor", fn);
  if (w->hidden <= 0 || w->hidden % 32 || w->intermediate <= 0 || w->intermediate % 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: H=%d I=%d must be positive multiples of 32", fn,
                  w->hidden, w->intermediate);
  if (w->n_experts != r->n_experts)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: weights have %d experts, route %d", fn,
                  w->n_experts, r->n_experts);
  if (T <= 0 || T > r->max_tokens)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s: T=%d outside [1, %d]", fn, T, r->max_tokens);
  int maxc = w->hidden > w->intermediate ? w->hidden : w->intermediate;
  if (tw_moe_smem_bytes(4, maxc) > TW_MOE_MAX_SMEM)
    return tw_err(TW_ERR_UNSUPPORTED, "%s: width %d too large for the GEMV kernels", fn, maxc);
  return TW_OK;
}

extern "C" size_t tw_cuda_moe_decode_ws_bytes(int32_t max_tokens, int32_t k, int32_t hidden,
                                              int32_t intermediate) {
  size_t tk = (size_t)max_tokens * (size_t)k;
  return tk * (size_t)intermediate * 4 + 256 + tk * (size_t)hidden * 4;
}

extern "C" tw_status_t tw_cuda_moe_decode(const tw_cuda_moe_weights_t *w,
                                          const tw_cuda_moe_route_t *r, int32_t T, const void *x,
                                          void *workspace, size_t workspace_bytes, float *out,
                                          cudaStream_t stream) {
  TW_CHECK(tw_moe_weights_check("moe_decode", w, r, T, x, out, 0));
  int H = w->hidden, I = w->intermediate, k = r->k;
  size_t need = tw_cuda_moe_decode_ws_bytes(T, k, H, I);
  if (!workspace || workspace_bytes < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_decode: workspace %zu bytes, %zu needed",
                  workspace_bytes, need);
  float *act = (float *)workspace;
  float *y = (float *)((char *)workspace + (((size_t)T * k * I * 4 + 255) / 256) * 256);
  int slots = T * k < r->n_experts ? T * k : r->n_experts;
  dim3 g1(TW_CDIV(I, TW_MOE_ROWS_PER_BLOCK), slots), g2(TW_CDIV(H, TW_MOE_ROWS_PER_BLOCK), slots);
  const __nv_bfloat16 *xb = (const __nv_bfloat16 *)x;
  if (T == 1) {
    tw_pdl_launch(tw_moe_gate_up_kernel<1>, dim3(g1), dim3(TW_MOE_WARPS * 32),
                  tw_moe_smem_bytes(1, H), stream, *w, r->active, r->n_active, r->counts,
                  r->offsets, r->sorted, k, xb, act);
    TW_CUDA_CHECK_LAUNCH("tw_moe_gate_up_kernel<1>");
    tw_pdl_launch(tw_moe_down_kernel<1>, dim3(g2), dim3(TW_MOE_WARPS * 32), tw_moe_smem_bytes(1, I),
                  stream, *w, r->active, r->n_active, r->counts, r->offsets, act, y);
    TW_CUDA_CHECK_LAUNCH("tw_moe_down_kernel<1>");
  } else {
    tw_pdl_launch(tw_moe_gate_up_kernel<4>, dim3(g1), dim3(TW_MOE_WARPS * 32),
                  tw_moe_smem_bytes(4, H), stream, *w, r->active, r->n_active, r->counts,
                  r->offsets, r->sorted, k, xb, act);
    TW_CUDA_CHECK_LAUNCH("tw_moe_gate_up_kernel<4>");
    tw_pdl_launch(tw_moe_down_kernel<4>, dim3(g2), dim3(TW_MOE_WARPS * 32), tw_moe_smem_bytes(4, I),
                  stream, *w, r->active, r->n_active, r->counts, r->offsets, act, y);
    TW_CUDA_CHECK_LAUNCH("tw_moe_down_kernel<4>");
  }
  return tw_moe_combine_f32(r, T, H, y, NULL, out, stream);
}

/* ---- the packed device layout of the MXFP4 blocks (moe.h TW_MX_CHUNK) ---- */

/* One thread per 16-byte piece of the packed tensor, in its order (coalesced
 * writes; each read is a 16-byte piece of a row). */
__global__ void tw_mxfp4_pack_kernel(const uint8_t *__restrict__ nat, int64_t pieces, int N,
                                     int K, uint8_t *__restrict__ pk) {
  const int KC = tw_mx_chunks(K), KH = K / 2;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < pieces;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int q = (int)(i & 3);            /* piece of the 64-byte chunk */
    const int64_t rc = i >> 2;             /* (e, c, n) in that order */
    const int n = (int)(rc % N);
    const int64_t ec = rc / N;
    const int c = (int)(ec % KC);
    const int64_t e = ec / KC;
    const int j = c * TW_MX_CHUNK + 16 * q; /* byte of the row */
    uint4 v = make_uint4(0, 0, 0, 0);
    if (j < KH) v = *reinterpret_cast<const uint4 *>(nat + (e * N + n) * KH + j);
    reinterpret_cast<uint4 *>(pk)[i] = v;
  }
}

extern "C" size_t tw_cuda_mxfp4_packed_bytes(int32_t n_experts, int32_t n_rows, int32_t k) {
  if (n_experts <= 0 || n_rows <= 0 || k <= 0) return 0;
  return (size_t)n_experts * (size_t)tw_mx_chunks(k) * (size_t)n_rows * TW_MX_CHUNK;
}

extern "C" tw_status_t tw_cuda_mxfp4_pack(const uint8_t *natural, int32_t n_experts,
                                          int32_t n_rows, int32_t k, uint8_t *packed,
                                          cudaStream_t stream) {
  if (!natural || !packed) return tw_err(TW_ERR_INVALID_ARGUMENT, "mxfp4_pack: NULL");
  if (n_experts <= 0 || n_rows <= 0 || k <= 0 || k % 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "mxfp4_pack: bad shape E=%d N=%d K=%d (positive, K a multiple of 32)",
                  n_experts, n_rows, k);
  if (((uintptr_t)natural | (uintptr_t)packed) & 15)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "mxfp4_pack: buffers not 16-byte aligned");
  const int64_t pieces = (int64_t)tw_cuda_mxfp4_packed_bytes(n_experts, n_rows, k) / 16;
  const int64_t grid = TW_CDIV(pieces, 256);
  tw_mxfp4_pack_kernel<<<(unsigned)(grid < 65535 * 16 ? grid : 65535 * 16), 256, 0, stream>>>(
      natural, pieces, n_rows, k, packed);
  TW_CUDA_CHECK_LAUNCH("tw_mxfp4_pack_kernel");
  return TW_OK;
}

/* ---- prefill path --------------------------------------------------------- */

/* One thread per 4-byte word of a block (8 values): 4 bytes + the block's
 * scale in, 16 bytes of bf16 out, so a warp reads 128 and writes 512
 * contiguous bytes per instruction (fully coalesced both ways). Rows of
 * experts with no tokens are skipped when counts is given. */
__global__ void tw_mxfp4_dequant_kernel(const uint8_t *__restrict__ blocks,
                                        const uint8_t *__restrict__ scales, int64_t n_blocks,
                                        int NB, int64_t rows_per_expert,
                                        const int32_t *__restrict__ maybe_counts, bool packed,
                                        __nv_bfloat16 *__restrict__ out) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* word */
  if (i >= n_blocks * 4) return;
  int64_t blk = i >> 2;
  if (maybe_counts && maybe_counts[(blk / NB) / rows_per_expert] == 0) return;
  int64_t src = i * 4; /* the word's byte in the checkpoint's layout */
  if (packed) { /* moe.h TW_MX_CHUNK: rows_per_expert rows of 32 NB inputs */
    const int64_t row = blk / NB, b = blk - row * NB, e = row / rows_per_expert;
    const int N = (int)rows_per_expert;
    src = tw_mx_row(e, row - e * rows_per_expert, N, 32 * NB) +
          tw_mx_block((int)b, tw_mx_cstride(N)) + (i & 3) * 4;
  }
  uint32_t wq = __ldg(reinterpret_cast<const uint32_t *>(blocks + src));
  float sc = tw_e8m0_to_f32(__ldg(scales + blk));
  uint4 o;
  uint32_t *ow = reinterpret_cast<uint32_t *>(&o);
#pragma unroll
  for (int n = 0; n < 8; n += 2) {
    __nv_bfloat162 v = __floats2bfloat162_rn(tw_fp4_to_f32(wq >> (4 * n)) * sc,
                                             tw_fp4_to_f32(wq >> (4 * n + 4)) * sc);
    ow[n / 2] = *reinterpret_cast<uint32_t *>(&v);
  }
  reinterpret_cast<uint4 *>(out)[i] = o;
}

extern "C" tw_status_t tw_cuda_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales,
                                             int64_t n_rows, int32_t n_cols, void *out,
                                             cudaStream_t stream) {
  if (!blocks || !scales || !out) return tw_err(TW_ERR_INVALID_ARGUMENT, "mxfp4_dequant: NULL");
  if (n_rows < 0 || n_cols <= 0 || n_cols % 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "mxfp4_dequant: bad shape %lld x %d",
                  (long long)n_rows, n_cols);
  int64_t nb = n_rows * (n_cols / 32);
  if (nb == 0) return TW_OK;
  tw_mxfp4_dequant_kernel<<<(unsigned)TW_CDIV(nb * 4, 256), 256, 0, stream>>>(
      blocks, scales, nb, n_cols / 32, n_rows > 0 ? n_rows : 1, NULL, false,
      (__nv_bfloat16 *)out);
  TW_CUDA_CHECK_LAUNCH("tw_mxfp4_dequant_kernel");
  return TW_OK;
}

/* xp[p] = x[sorted[p] / k] (bf16 rows, 16-byte copies). */
__global__ void tw_moe_gather_kernel(const uint4 *__restrict__ x, const int32_t *__restrict__ sorted,
                                     int k, int row_vec, uint4 *__restrict__ xp) {
  int p = blockIdx.x;
  const uint4 *src = x + (size_t)(sorted[p] / k) * row_vec;
  for (int i = threadIdx.x; i < row_vec; i += blockDim.x) xp[(size_t)p * row_vec + i] = src[i];
}

/* act[p][i] = SwiGLU(u[p][2i] + b1[e][2i], u[p][2i+1] + b1[e][2i+1]): u and
 * the bias f32, act rounded to bf16 (the down GEMM's input). */
__global__ void tw_moe_swiglu_kernel(const float2 *__restrict__ u,
                                     const int32_t *__restrict__ sorted,
                                     const int32_t *__restrict__ topk_idx,
                                     const float *__restrict__ bias, int I, float alpha,
                                     float limit, __nv_bfloat16 *__restrict__ act) {
  int p = blockIdx.x;
  int e = topk_idx[sorted[p]];
  const float2 *b = reinterpret_cast<const float2 *>(bias + (size_t)e * 2 * I);
  for (int i = threadIdx.x; i < I; i += blockDim.x) {
    float2 v = u[(size_t)p * I + i];
    float2 bb = b[i];
    act[(size_t)p * I + i] = __float2bfloat16(tw_swiglu(v.x + bb.x, v.y + bb.y, alpha, limit));
  }
}

static size_t tw_al256(size_t n) { return (n + 255) / 256 * 256; }

/* Where the down experts start in a dequantised layer (the layout of
 * tw_cuda_moe_dequant_bytes: gate_up bf16 [E, 2I, H], then down bf16
 * [E, H, I] at the next 256-byte boundary). */
static char *tw_moe_wdq_down(const void *wdq, int E, int H, int I) {
  return (char *)wdq + tw_al256((size_t)E * 2 * I * H * 2);
}

extern "C" size_t tw_cuda_moe_dequant_bytes(int32_t n_experts, int32_t hidden,
                                            int32_t intermediate) {
  size_t E = (size_t)n_experts, H = (size_t)hidden, I = (size_t)intermediate;
  return tw_al256(E * 2 * I * H * 2) + tw_al256(E * H * I * 2);
}

extern "C" tw_status_t tw_cuda_moe_dequant(const tw_cuda_moe_weights_t *w,
                                           const int32_t *maybe_counts, void *wdq,
                                           cudaStream_t stream) {
  if (!w || !wdq) return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_dequant: NULL argument");
  int E = w->n_experts, H = w->hidden, I = w->intermediate;
  if (E <= 0 || H <= 0 || H % 32 || I <= 0 || I % 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_dequant: bad shape E=%d H=%d I=%d", E, H, I);
  __nv_bfloat16 *w1 = (__nv_bfloat16 *)wdq;
  __nv_bfloat16 *w2 = (__nv_bfloat16 *)tw_moe_wdq_down(wdq, E, H, I);
  int64_t nb1 = (int64_t)E * 2 * I * (H / 32), nb2 = (int64_t)E * H * (I / 32);
  tw_mxfp4_dequant_kernel<<<(unsigned)TW_CDIV(nb1 * 4, 256), 256, 0, stream>>>(
      w->gate_up_blocks, w->gate_up_scales, nb1, H / 32, 2 * (int64_t)I, maybe_counts, true, w1);
  TW_CUDA_CHECK_LAUNCH("tw_mxfp4_dequant_kernel(gate_up)");
  tw_mxfp4_dequant_kernel<<<(unsigned)TW_CDIV(nb2 * 4, 256), 256, 0, stream>>>(
      w->down_blocks, w->down_scales, nb2, I / 32, H, maybe_counts, true, w2);
  TW_CUDA_CHECK_LAUNCH("tw_mxfp4_dequant_kernel(down)");
  return TW_OK;
}

extern "C" size_t tw_cuda_moe_prefill_ws_bytes(int32_t max_tokens, int32_t k, int32_t hidden,
                                               int32_t intermediate) {
  size_t tk = (size_t)max_tokens * (size_t)k;
  return tw_al256(tk * (size_t)intermediate * 2) + tw_al256(tk * (size_t)hidden * 4) +
         TW_MOE_GS_PART_FLOATS * 4;
}

extern "C" tw_status_t tw_cuda_moe_prefill(const tw_cuda_moe_weights_t *w,
                                           const tw_cuda_moe_route_t *r, int32_t T, const void *x,
                                           const void *maybe_wbf16, void *workspace,
                                           size_t workspace_bytes, float *out,
                                           cudaStream_t stream) {
  TW_CHECK(tw_moe_weights_check("moe_prefill", w, r, T, x, out, maybe_wbf16 != NULL));
  int H = w->hidden, I = w->intermediate, k = r->k;
  if (!tw_cuda_moe_grouped_supported(H, I))
    return tw_err(TW_ERR_UNSUPPORTED,
                  "moe_prefill: grouped GEMM needs compute capability 9.0 and H, I <= 8192 "
                  "(H=%d I=%d); use the cuBLAS path", H, I);
  size_t need = tw_cuda_moe_prefill_ws_bytes(T, k, H, I);
  if (!workspace || workspace_bytes < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_prefill: workspace %zu bytes, %zu needed",
                  workspace_bytes, need);
  if (((uintptr_t)x | (uintptr_t)workspace) & 15)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_prefill: x or workspace not 16-byte aligned");
  size_t tk = (size_t)T * k;
  char *act = (char *)workspace;
  float *y = (float *)(act + tw_al256(tk * I * 2));
  float *gs_part = (float *)((char *)y + tw_al256(tk * H * 4));
  const void *w2h = maybe_wbf16 ? tw_moe_wdq_down(maybe_wbf16, w->n_experts, H, I) : NULL;
  TW_CHECK(tw_moe_grouped_run(w, r, T, x, maybe_wbf16, w2h, act, y, gs_part, stream));
  return tw_moe_combine_f32(r, T, H, y, NULL, out, stream);
}

extern "C" size_t tw_cuda_moe_prefill_cublas_ws_bytes(int32_t max_tokens, int32_t n_experts,
                                                      int32_t k, int32_t hidden,
                                                      int32_t intermediate, int with_dequant) {
  size_t tk = (size_t)max_tokens * (size_t)k, H = (size_t)hidden, I = (size_t)intermediate;
  size_t wbytes = with_dequant ? tw_cuda_moe_dequant_bytes(n_experts, hidden, intermediate) : 0;
  return wbytes + tw_al256(tk * H * 2) + tw_al256(tk * 2 * I * 4) + tw_al256(tk * I * 2) +
         tw_al256(tk * H * 4);
}

extern "C" tw_status_t tw_cuda_moe_prefill_cublas(tw_cuda_gemm_t *gemm,
                                                  const tw_cuda_moe_weights_t *w,
                                                  const tw_cuda_moe_route_t *r, int32_t T,
                                                  const void *x, const void *maybe_wdq,
                                                  void *workspace, size_t workspace_bytes,
                                                  int32_t *host_counts, float *out,
                                                  cudaStream_t stream) {
  TW_CHECK(tw_moe_weights_check("moe_prefill_cublas", w, r, T, x, out, maybe_wdq != NULL));
  if (!gemm || !host_counts)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_prefill_cublas: NULL argument");
  int E = w->n_experts, H = w->hidden, I = w->intermediate, k = r->k;
  size_t need = tw_cuda_moe_prefill_cublas_ws_bytes(T, E, k, H, I, maybe_wdq == NULL);
  if (!workspace || workspace_bytes < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_prefill_cublas: workspace %zu bytes, %zu needed",
                  workspace_bytes, need);
  size_t tk = (size_t)T * k;
  char *p = (char *)workspace;
  const char *wdq = (const char *)maybe_wdq;
  if (!wdq) {
    wdq = p;
    p += tw_cuda_moe_dequant_bytes(E, H, I);
  }
  const __nv_bfloat16 *w1 = (const __nv_bfloat16 *)wdq;
  const __nv_bfloat16 *w2 = (const __nv_bfloat16 *)tw_moe_wdq_down(wdq, E, H, I);
#define TW_CARVE(ptr, type, n)                              \
  type *ptr = (type *)p;                                    \
  p += tw_al256((size_t)(n) * sizeof(type))
  TW_CARVE(xp, __nv_bfloat16, tk * H);
  TW_CARVE(u, float, tk * 2 * I);
  TW_CARVE(act, __nv_bfloat16, tk * I);
  TW_CARVE(y, float, tk * H);
#undef TW_CARVE
  /* Counts to the host first, so the dequantisation below overlaps the wait. */
  TW_CUDA_CHECK(cudaMemcpyAsync(host_counts, r->counts, sizeof(int32_t) * E,
                                cudaMemcpyDeviceToHost, stream));
  cudaEvent_t ev;
  TW_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  tw_status_t st = TW_OK;
  TW_CUDA_CHECK_GOTO(cudaEventRecord(ev, stream), st, done);
  if (!maybe_wdq) {
    st = tw_cuda_moe_dequant(w, r->counts, (void *)wdq, stream);
    if (st < 0) goto done;
  }
  tw_moe_gather_kernel<<<(unsigned)tk, 128, 0, stream>>>((const uint4 *)x, r->sorted, k, H / 8,
                                                         (uint4 *)xp);
  {
    cudaError_t le = cudaGetLastError();
    if (le != cudaSuccess) {
      st = tw_err(TW_ERR_CUDA, "moe_prefill: gather launch failed: %s", cudaGetErrorString(le));
      goto done;
    }
  }
  TW_CUDA_CHECK_GOTO(cudaEventSynchronize(ev), st, done);
  {
    int64_t off = 0;
    for (int e = 0; e < E; e++) {
      int n = host_counts[e];
      if (n <= 0) continue;
      st = tw_cuda_gemm_bf16_nobias(gemm, n, 2 * I, H, xp + off * H, H, w1 + (size_t)e * 2 * I * H,
                                    H, u + off * 2 * I, TW_DTYPE_F32, 2 * I, stream);
      if (st < 0) goto done;
      off += n;
    }
    if (off != (int64_t)tk) {
      st = tw_err(TW_ERR_INTERNAL, "moe_prefill: counts sum to %lld, expected %zu",
                  (long long)off, tk);
      goto done;
    }
    tw_moe_swiglu_kernel<<<(unsigned)tk, 256, 0, stream>>>((const float2 *)u, r->sorted,
                                                           r->topk_idx, w->gate_up_bias, I,
                                                           w->swiglu_alpha, w->swiglu_limit, act);
    off = 0;
    for (int e = 0; e < E; e++) {
      int n = host_counts[e];
      if (n <= 0) continue;
      st = tw_cuda_gemm_bf16_nobias(gemm, n, H, I, act + off * I, I, w2 + (size_t)e * H * I, I,
                                    y + off * H, TW_DTYPE_F32, H, stream);
      if (st < 0) goto done;
      off += n;
    }
    st = tw_moe_combine_f32(r, T, H, y, w->down_bias, out, stream);
  }
done:
  cudaEventDestroy(ev);
  return st;
}
