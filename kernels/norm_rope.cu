/* norm_rope.cu: residual add + RMSNorm (spec §2.3), YaRN RoPE (spec §2.5) with
 * the paged KV-cache write, and the host RoPE table builder. API and exact
 * semantics in norm_rope.h.
 *
 * Both kernels are memory-bound one-pass kernels: RMSNorm reads x (and
 * delta) once and writes x and out once; RoPE reads each f32 q/k/v element
 * once and writes it once as bf16 (q to its own buffer, k and v into the
 * pool). */
#include "kernels/pdl.cuh"
#include "kernels/norm_rope.h"

#include "kernels/cuda_common.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>

/* ---- RMSNorm + residual ---------------------------------------------------- */

#define TW_NORM_THREADS 256

/* Sum over the block; every thread gets the total. `red` holds one float per warp. */
static __device__ float tw_block_sum(float v, float *red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) t += red[w];
  return t;
}

/* Element i (4 floats) of the delta row: bf16 (DT 1) or f32 (DT 2). */
template <int DT>
static __device__ __forceinline__ float4 tw_norm_delta(const void *delta, int64_t off, int i) {
  if (DT == 1) {
    const uint2 u = reinterpret_cast<const uint2 *>(static_cast<const __nv_bfloat16 *>(delta) + off)[i];
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
  return reinterpret_cast<const float4 *>(static_cast<const float *>(delta) + off)[i];
}

/* One block per token row. DT: 0 = no delta, 1 = bf16 delta, 2 = f32 delta.
 * Rows of up to TW_NORM_REGS * 4 * TW_NORM_THREADS floats (4,096) keep their
 * x, delta and weight loads in registers, all issued before the first is
 * used (one round trip to memory instead of one per loop turn; 8-byte loads
 * of the bf16 weight, delta and output); longer rows, or those pointers not
 * 8-byte aligned, loop. Either way each thread adds its squares in the same
 * order, so the result does not depend on the path. */
#define TW_NORM_REGS 4
template <int DT>
static __global__ void __launch_bounds__(TW_NORM_THREADS)
    tw_rmsnorm_residual_kernel(float *__restrict__ x, const void *__restrict__ delta,
                               const __nv_bfloat16 *__restrict__ w, float eps, int hidden,
                               __nv_bfloat16 *__restrict__ out) {
  TW_PDL_WAIT();
  __shared__ float red[TW_NORM_THREADS / 32];
  const int64_t row = blockIdx.x;
  float4 *xr = reinterpret_cast<float4 *>(x + row * hidden);
  const uint2 *w4 = reinterpret_cast<const uint2 *>(w);
  uint2 *o4 = reinterpret_cast<uint2 *>(out + row * hidden);
  const int n4 = hidden >> 2;
  float ss = 0.f;
  const bool al8 = !(((uintptr_t)w | (uintptr_t)out | (DT == 1 ? (uintptr_t)delta : 0)) & 7);
  if (n4 <= TW_NORM_REGS * TW_NORM_THREADS && al8) {
    float4 v[TW_NORM_REGS], d[TW_NORM_REGS];
    uint2 wv[TW_NORM_REGS];
#pragma unroll
    for (int u = 0; u < TW_NORM_REGS; u++) {
      const int i = threadIdx.x + u * TW_NORM_THREADS;
      if (i < n4) {
        v[u] = xr[i];
        if (DT) d[u] = tw_norm_delta<DT>(delta, row * hidden, i);
        wv[u] = w4[i];
      }
    }
#pragma unroll
    for (int u = 0; u < TW_NORM_REGS; u++) {
      const int i = threadIdx.x + u * TW_NORM_THREADS;
      if (i >= n4) continue;
      if (DT) {
        v[u].x += d[u].x; v[u].y += d[u].y; v[u].z += d[u].z; v[u].w += d[u].w;
        xr[i] = v[u];
      }
      ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
    }
    const float r = rsqrtf(tw_block_sum(ss, red) / (float)hidden + eps);
#pragma unroll
    for (int u = 0; u < TW_NORM_REGS; u++) {
      const int i = threadIdx.x + u * TW_NORM_THREADS;
      if (i >= n4) continue;
      const float2 wa = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&wv[u].x));
      const float2 wb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&wv[u].y));
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v[u].x * r * wa.x, v[u].y * r * wa.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(v[u].z * r * wb.x, v[u].w * r * wb.y);
      o4[i] = make_uint2(*reinterpret_cast<const uint32_t *>(&lo),
                         *reinterpret_cast<const uint32_t *>(&hi));
    }
    return;
  }
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    float4 v = xr[i];
    if (DT) {
      const float4 d = tw_norm_delta<DT>(delta, row * hidden, i);
      v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
      xr[i] = v;
    }
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  const float r = rsqrtf(tw_block_sum(ss, red) / (float)hidden + eps);
  const __nv_bfloat162 *w2 = reinterpret_cast<const __nv_bfloat162 *>(w);
  __nv_bfloat162 *o2 = reinterpret_cast<__nv_bfloat162 *>(out + row * hidden);
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    const float4 v = xr[i]; /* this thread's own write above: no barrier needed */
    const float2 wa = __bfloat1622float2(w2[2 * i]), wb = __bfloat1622float2(w2[2 * i + 1]);
    o2[2 * i] = __floats2bfloat162_rn(v.x * r * wa.x, v.y * r * wa.y);
    o2[2 * i + 1] = __floats2bfloat162_rn(v.z * r * wb.x, v.w * r * wb.y);
  }
}

extern "C" tw_status_t tw_cuda_rmsnorm_residual(float *x_resid, const void *maybe_delta,
                                                tw_dtype_t delta_dtype, const void *weight,
                                                float eps, int32_t n_tokens, int32_t hidden,
                                                void *out, cudaStream_t stream) {
  if (!x_resid || !weight || !out)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rmsnorm: NULL x_resid, weight or out");
  if (n_tokens < 0 || hidden <= 0 || hidden % 4 != 0 || !(eps >= 0.f))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "rmsnorm: bad n_tokens %d / hidden %d (multiple of 4) / eps %g", n_tokens,
                  hidden, (double)eps);
  if (maybe_delta && delta_dtype != TW_DTYPE_BF16 && delta_dtype != TW_DTYPE_F32)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rmsnorm: delta dtype %d is not bf16 or f32",
                  (int)delta_dtype);
  if (n_tokens == 0) return TW_OK;
  const __nv_bfloat16 *w = static_cast<const __nv_bfloat16 *>(weight);
  __nv_bfloat16 *o = static_cast<__nv_bfloat16 *>(out);
  dim3 grid((unsigned)n_tokens), block(TW_NORM_THREADS);
  if (!maybe_delta)
    tw_pdl_launch(tw_rmsnorm_residual_kernel<0>, dim3(grid), dim3(block), 0, stream, x_resid,
                  nullptr, w, eps, hidden, o);
  else if (delta_dtype == TW_DTYPE_BF16)
    tw_pdl_launch(tw_rmsnorm_residual_kernel<1>, dim3(grid), dim3(block), 0, stream, x_resid,
                  maybe_delta, w, eps, hidden, o);
  else
    tw_pdl_launch(tw_rmsnorm_residual_kernel<2>, dim3(grid), dim3(block), 0, stream, x_resid,
                  maybe_delta, w, eps, hidden, o);
  TW_CUDA_CHECK_LAUNCH("rmsnorm_residual");
  return TW_OK;
}

/* ---- RoPE tables (host, double) ------------------------------------------ */

extern "C" tw_status_t tw_cuda_rope_table_fill(const tw_model_config_t *config, int32_t max_pos,
                                               float *cos_out, float *sin_out) {
  if (!config || !cos_out || !sin_out)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rope table: NULL config or output");
  const int D = config->head_dim;
  const double theta = config->rope_theta, f = config->rope_factor;
  const double bf = config->rope_beta_fast, bs = config->rope_beta_slow;
  const double L0 = (double)config->rope_original_max_pos;
  if (max_pos <= 0 || D <= 0 || D % 2 != 0 || !(theta > 1.0) || !(f > 0.0) || !(bf > bs) ||
      !(bs > 0.0) || !(L0 > 0.0))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "rope table: bad max_pos %d, head_dim %d, theta %g, factor %g, beta_fast %g, "
                  "beta_slow %g or original_max_position_embeddings %g",
                  max_pos, D, theta, f, bf, bs, L0);
  const int nhalf = D / 2;
  /* spec §2.5: correction dims of the YaRN ramp, in units of rotation pairs. */
  double low = (double)D * log(L0 / (bf * 2.0 * M_PI)) / (2.0 * log(theta));
  double high = (double)D * log(L0 / (bs * 2.0 * M_PI)) / (2.0 * log(theta));
  if (config->rope_truncate) {
    low = floor(low);
    high = ceil(high);
  }
  if (low < 0.0) low = 0.0;
  if (high > (double)(D - 1)) high = (double)(D - 1);
  if (low == high) high += 0.001; /* as YaRN's linear ramp does (and the CPU backend) */
  if (!(high > low))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rope table: YaRN ramp low %g > high %g", low, high);
  const double conc = f > 1.0 ? 0.1 * log(f) + 1.0 : 1.0;
  for (int i = 0; i < nhalf; i++) {
    const double base = pow(theta, (2.0 * i) / (double)D);
    const double extra = 1.0 / base, inter = 1.0 / (f * base);
    double r = ((double)i - low) / (high - low);
    r = r < 0.0 ? 0.0 : (r > 1.0 ? 1.0 : r);
    const double inv_freq = f > 1.0 ? inter * r + extra * (1.0 - r) : extra; /* no YaRN */
    for (int64_t p = 0; p < max_pos; p++) {
      const double a = (double)p * inv_freq;
      cos_out[p * nhalf + i] = (float)(conc * cos(a));
      sin_out[p * nhalf + i] = (float)(conc * sin(a));
    }
  }
  return TW_OK;
}

/* ---- RoPE + KV write -------------------------------------------------------- */

#define TW_ROPE_THREADS 128

/* Token t of a RoPE + KV-write launch: its position clamped to [0, max_pos),
 * its cache slot (-1: none) and, for a slot, the element offsets of its K
 * and V rows of kv head 0 in the layer's pool (engine.h layout). */
typedef struct {
  int p, slot;
  int64_t kbase, vbase;
} tw_rope_tok_t;
static __device__ __forceinline__ tw_rope_tok_t tw_rope_tok(int64_t t, const int32_t *positions,
                                                          int max_pos, const int32_t *slots,
                                                          int nkv, int D, int block_size) {
  tw_rope_tok_t r;
  r.p = positions[t];
  r.p = r.p < 0 ? 0 : (r.p >= max_pos ? max_pos - 1 : r.p);
  r.slot = slots ? slots[t] : -1;
  r.kbase = r.vbase = 0;
  if (r.slot >= 0) {
    const int64_t blk = r.slot / block_size, s = r.slot % block_size;
    r.kbase = ((blk * 2 + 0) * nkv) * (int64_t)block_size * D + s * D;
    r.vbase = ((blk * 2 + 1) * nkv) * (int64_t)block_size * D + s * D;
  }
  return r;
}

/* q and k rotated in fp32 from the unrounded QKV GEMM output, rounded to
 * bf16 once (q into q_out, k into the pool); v rounded once into the pool.
 * Grid (token, item block): a thread takes one item, either a
 * rotation pair-of-pairs (head h, dims j, j+1 and j+D/2, j+1+D/2: float2 in,
 * bf16x2 out) or a pair of v values, so a decode step's few tokens still
 * spread over several blocks. D % 4 == 0. */
static __global__ void __launch_bounds__(TW_ROPE_THREADS)
    tw_rope_kv_write_f32_kernel(const float *__restrict__ qkv, int64_t stride, int nq, int nkv,
                                int D, const int32_t *__restrict__ positions,
                                const float *__restrict__ tcos, const float *__restrict__ tsin,
                                int max_pos, const int32_t *__restrict__ slots,
                                __nv_bfloat16 *__restrict__ pool, int block_size,
                                __nv_bfloat16 *__restrict__ q_out, int64_t q_stride) {
  TW_PDL_WAIT();
  const int64_t t = blockIdx.x;
  const int nhalf = D >> 1, hp = nhalf >> 1;
  const float *row = qkv + t * stride;
  const tw_rope_tok_t tk = tw_rope_tok(t, positions, max_pos, slots, nkv, D, block_size);
  const int64_t head_stride_pool = (int64_t)block_size * D;
  const int it = blockIdx.y * blockDim.x + threadIdx.x;
  const int n_rot = (nq + (tk.slot >= 0 ? nkv : 0)) * hp;
  if (it < n_rot) {
    const int h = it / hp, j = (it % hp) * 2;
    const float *x = row + (int64_t)h * D;
    const float *c = tcos + (int64_t)tk.p * nhalf, *sn = tsin + (int64_t)tk.p * nhalf;
    const float2 a = *reinterpret_cast<const float2 *>(x + j);
    const float2 b = *reinterpret_cast<const float2 *>(x + j + nhalf);
    const float c0 = c[j], c1 = c[j + 1], s0 = sn[j], s1 = sn[j + 1];
    __nv_bfloat16 *o = h < nq ? q_out + t * q_stride + (int64_t)h * D
                              : pool + tk.kbase + (int64_t)(h - nq) * head_stride_pool;
    *reinterpret_cast<__nv_bfloat162 *>(o + j) =
        __floats2bfloat162_rn(a.x * c0 - b.x * s0, a.y * c1 - b.y * s1);
    *reinterpret_cast<__nv_bfloat162 *>(o + j + nhalf) =
        __floats2bfloat162_rn(b.x * c0 + a.x * s0, b.y * c1 + a.y * s1);
  } else if (tk.slot >= 0 && it - n_rot < nkv * nhalf) {
    const int v2 = it - n_rot, g = v2 / nhalf, d = (v2 % nhalf) * 2;
    const float2 v = *reinterpret_cast<const float2 *>(row + (int64_t)(nq + nkv + g) * D + d);
    *reinterpret_cast<__nv_bfloat162 *>(pool + tk.vbase + (int64_t)g * head_stride_pool + d) =
        __floats2bfloat162_rn(v.x, v.y);
  }
}

extern "C" tw_status_t tw_cuda_rope_kv_write_f32(const float *qkv, int64_t qkv_row_stride,
                                                 int32_t n_tokens, int32_t n_q_heads,
                                                 int32_t n_kv_heads, int32_t head_dim,
                                                 const int32_t *positions, const float *rope_cos,
                                                 const float *rope_sin, int32_t max_pos,
                                                 const int32_t *maybe_slots, void *kv_layer,
                                                 int32_t block_size, void *q_out,
                                                 int64_t q_row_stride, cudaStream_t stream) {
  if (!qkv || !q_out || !positions || !rope_cos || !rope_sin || (maybe_slots && !kv_layer))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "rope_kv_write_f32: NULL qkv, q_out, positions, tables or kv_layer (with slots)");
  if (n_tokens < 0 || n_q_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || head_dim % 4 ||
      head_dim > 256 || max_pos <= 0 || block_size <= 0 ||
      qkv_row_stride < (int64_t)(n_q_heads + 2 * n_kv_heads) * head_dim || qkv_row_stride % 2 ||
      q_row_stride < (int64_t)n_q_heads * head_dim || q_row_stride % 2)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "rope_kv_write_f32: bad n_tokens %d, heads %d/%d, head_dim %d (a multiple of "
                  "4), max_pos %d, block_size %d or row strides %lld/%lld (even)",
                  n_tokens, n_q_heads, n_kv_heads, head_dim, max_pos, block_size,
                  (long long)qkv_row_stride, (long long)q_row_stride);
  if (((uintptr_t)qkv & 7) || ((uintptr_t)q_out & 3))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rope_kv_write_f32: qkv or q_out misaligned");
  if (n_tokens == 0) return TW_OK;
  const int items = (n_q_heads + n_kv_heads) * (head_dim / 4) + n_kv_heads * (head_dim / 2);
  tw_pdl_launch(tw_rope_kv_write_f32_kernel,
                dim3((unsigned)n_tokens, (unsigned)TW_CDIV(items, TW_ROPE_THREADS)),
                dim3(TW_ROPE_THREADS), 0,
                stream, qkv, qkv_row_stride, n_q_heads, n_kv_heads, head_dim, positions,
                rope_cos, rope_sin, max_pos, maybe_slots,
                static_cast<__nv_bfloat16 *>(kv_layer), block_size,
                static_cast<__nv_bfloat16 *>(q_out), q_row_stride);
  TW_CUDA_CHECK_LAUNCH("rope_kv_write_f32");
  return TW_OK;
}


/* ---- RoPE + KV write into the fp8 KV cache (common/kv/kv_fp8.h) --------------- */

/* One warp per (token, k|v, kv head): rotate K like the kernel above (fp32,
 * from the unrounded GEMM output), take amax over the head's D values with
 * shuffles, store e4m3(x / s) (round to nearest even, saturating) and the
 * scale s = amax / 448 at the token's slot. Lane i takes dims i, i + D/2 (and
 * i + 32, ... for D > 64). */
#define TW_KV8_PAIRS 4 /* D / 2 / 32 for D <= 256 */
static __global__ void __launch_bounds__(128)
    tw_kv_write_fp8_kernel(const float *__restrict__ qkv, int64_t stride, int nq, int nkv, int D,
                           const int32_t *__restrict__ positions, const float *__restrict__ tcos,
                           const float *__restrict__ tsin, int max_pos,
                           const int32_t *__restrict__ slots, uint8_t *__restrict__ pool,
                           int block_size) {
  TW_PDL_WAIT();
  const int64_t t = blockIdx.x;
  const int w = (int)(blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)), lane = threadIdx.x & 31;
  if (w >= 2 * nkv) return;
  const int slot_all = slots[t];
  if (slot_all < 0) return;
  const int kv = w / nkv, g = w % nkv, nhalf = D >> 1;
  int p = positions[t];
  p = p < 0 ? 0 : (p >= max_pos ? max_pos - 1 : p);
  const float *x = qkv + t * stride + (int64_t)(nq + kv * nkv + g) * D;
  const float *c = tcos + (int64_t)p * nhalf, *sn = tsin + (int64_t)p * nhalf;
  float lo[TW_KV8_PAIRS], hi[TW_KV8_PAIRS], amax = 0.f;
#pragma unroll
  for (int k = 0; k < TW_KV8_PAIRS; k++) {
    const int i = lane + 32 * k;
    lo[k] = hi[k] = 0.f;
    if (i >= nhalf) continue;
    const float a = x[i], b = x[i + nhalf];
    if (kv == 0) { /* K: rotated half-split, as tw_rope_kv_write_f32_kernel */
      lo[k] = a * c[i] - b * sn[i];
      hi[k] = b * c[i] + a * sn[i];
    } else {
      lo[k] = a;
      hi[k] = b;
    }
    amax = fmaxf(amax, fmaxf(fabsf(lo[k]), fabsf(hi[k])));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax / 448.f;
  const int64_t blk = slot_all / block_size, sl = slot_all % block_size;
  const int64_t part = (int64_t)block_size * (D + 4);
  uint8_t *dst = pool + ((blk * 2 + kv) * nkv + g) * part;
#pragma unroll
  for (int k = 0; k < TW_KV8_PAIRS; k++) {
    const int i = lane + 32 * k;
    if (i >= nhalf) continue;
    /* s == 0: every value is 0 */
    dst[sl * D + i] = s > 0.f ? (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(lo[k], s), __NV_SATFINITE, __NV_E4M3) : 0;
    dst[sl * D + i + nhalf] =
        s > 0.f ? (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(hi[k], s), __NV_SATFINITE, __NV_E4M3) : 0;
  }
  if (lane == 0) reinterpret_cast<float *>(dst + (int64_t)block_size * D)[sl] = s;
}

extern "C" tw_status_t tw_cuda_rope_kv_write_fp8(const float *qkv, int64_t qkv_row_stride,
                                                 int32_t n_tokens, int32_t n_q_heads,
                                                 int32_t n_kv_heads, int32_t head_dim,
                                                 const int32_t *positions, const float *rope_cos,
                                                 const float *rope_sin, int32_t max_pos,
                                                 const int32_t *slots, void *kv_layer,
                                                 int32_t block_size, void *q_out,
                                                 int64_t q_row_stride, cudaStream_t stream) {
  if (!slots || !kv_layer)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "rope_kv_write_fp8: NULL slots or kv_layer");
  if (head_dim > 2 * 32 * TW_KV8_PAIRS || block_size % 4 || ((uintptr_t)kv_layer & 15))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "rope_kv_write_fp8: head_dim %d (max %d), block_size %d (a multiple of 4) or "
                  "a misaligned pool",
                  head_dim, 2 * 32 * TW_KV8_PAIRS, block_size);
  /* q alone through the bf16 kernel (no slots: k and v are not written there) */
  TW_CHECK(tw_cuda_rope_kv_write_f32(qkv, qkv_row_stride, n_tokens, n_q_heads, n_kv_heads,
                                     head_dim, positions, rope_cos, rope_sin, max_pos, NULL,
                                     NULL, block_size, q_out, q_row_stride, stream));
  if (n_tokens == 0) return TW_OK;
  const int warps = 2 * n_kv_heads;
  tw_pdl_launch(tw_kv_write_fp8_kernel, dim3((unsigned)n_tokens, (unsigned)TW_CDIV(warps, 4)),
                dim3(128), 0, stream, qkv, qkv_row_stride, n_q_heads, n_kv_heads, head_dim,
                positions, rope_cos, rope_sin, max_pos, slots, static_cast<uint8_t *>(kv_layer),
                block_size);
  TW_CUDA_CHECK_LAUNCH("rope_kv_write_fp8");
  return TW_OK;
}
