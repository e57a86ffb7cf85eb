/* embed_sample.cu: embedding gather, argmax and exact GPU sampling
 * (embed_sample.h). The sampler reproduces common/engine/sampling.c: it never sorts;
 * the sets the CPU builds by sorting are found by bitwise searches over
 * order-preserving keys of z (ranking = z descending, then id ascending), and
 * every probability mass is a double sum of exp(z - max), as on the CPU (the
 * summation order differs, so a draw can differ only when the target falls
 * within double rounding of a boundary). */
#include "kernels/pdl.cuh"
#include "kernels/embed_sample.h"

#include "kernels/cuda_common.h"

#include <cuda_bf16.h>
#include <math.h>

#define TW_SAMPLE_THREADS 1024

__global__ void tw_embed_kernel(const uint4 *__restrict__ table, int V, int row_vec,
                                const int32_t *__restrict__ tokens, float *__restrict__ x) {
  TW_PDL_WAIT();
  int t = blockIdx.x;
  int id = tokens[t];
  id = id < 0 ? 0 : (id >= V ? V - 1 : id);
  const uint4 *src = table + (size_t)id * row_vec;
  float4 *dst = reinterpret_cast<float4 *>(x + (size_t)t * row_vec * 8);
  for (int i = threadIdx.x; i < row_vec; i += blockDim.x) {
    uint4 v = src[i];
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&v);
    float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    float2 c = __bfloat1622float2(h[2]), d = __bfloat1622float2(h[3]);
    dst[2 * i] = make_float4(a.x, a.y, b.x, b.y);
    dst[2 * i + 1] = make_float4(c.x, c.y, d.x, d.y);
  }
}

extern "C" tw_status_t tw_cuda_embed(const void *table, int32_t V, int32_t H,
                                     const int32_t *tokens, int32_t T, float *x,
                                     cudaStream_t stream) {
  if (!table || !tokens || !x) return tw_err(TW_ERR_INVALID_ARGUMENT, "embed: NULL argument");
  if (T < 0 || V <= 0 || H <= 0 || H % 8)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "embed: bad sizes T=%d V=%d H=%d", T, V, H);
  if (T == 0) return TW_OK;
  tw_pdl_launch(tw_embed_kernel, dim3(T), dim3(128), 0, stream, (const uint4 *)table, V, H / 8,
                tokens, x);
  TW_CUDA_CHECK_LAUNCH("tw_embed_kernel");
  return TW_OK;
}

/* ---- block reductions (TW_SAMPLE_THREADS threads) ------------------------ */

template <typename T>
static __device__ T tw_block_sum(T v, T *red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T s = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
  return s;
}

/* Better candidate: valid first, then larger value, then lower id. */
static __device__ __forceinline__ void tw_argmax_merge(float &bv, int &bi, float v, int i) {
  if (i < 0) return;
  if (bi < 0 || v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

/* Argmax of one row by the block: 16-byte loads, TW_ARGMAX_UNROLL of them in
 * flight per thread before any is merged (a row of 201,088 logits is then
 * about 6 round trips to memory a thread, not 200); the merge is a total
 * order (larger value, then lower id; NaN skipped), so the order of the
 * visits does not change the result. */
#define TW_ARGMAX_UNROLL 8
static __device__ int tw_block_argmax(const float *__restrict__ row, int V, float *redv,
                                      int *redi) {
  float bv = 0.0f;
  int bi = -1;
  int tail = 0;
  if (!((uintptr_t)row & 15)) {
    const float4 *r4 = reinterpret_cast<const float4 *>(row);
    const int n4 = V / 4, step = (int)blockDim.x;
    for (int base = threadIdx.x; base < n4; base += step * TW_ARGMAX_UNROLL) {
      float4 q[TW_ARGMAX_UNROLL];
#pragma unroll
      for (int u = 0; u < TW_ARGMAX_UNROLL; u++) {
        const int j = base + u * step;
        q[u] = j < n4 ? __ldg(r4 + j) : make_float4(NAN, NAN, NAN, NAN);
      }
#pragma unroll
      for (int u = 0; u < TW_ARGMAX_UNROLL; u++) {
        const int i = (base + u * step) * 4;
        if (!isnan(q[u].x)) tw_argmax_merge(bv, bi, q[u].x, i);
        if (!isnan(q[u].y)) tw_argmax_merge(bv, bi, q[u].y, i + 1);
        if (!isnan(q[u].z)) tw_argmax_merge(bv, bi, q[u].z, i + 2);
        if (!isnan(q[u].w)) tw_argmax_merge(bv, bi, q[u].w, i + 3);
      }
    }
    tail = n4 * 4;
  }
  for (int i = tail + (int)threadIdx.x; i < V; i += blockDim.x) {
    float v = row[i];
    if (!isnan(v)) tw_argmax_merge(bv, bi, v, i);
  }
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    tw_argmax_merge(bv, bi, ov, oi);
  }
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) {
    redv[warp] = bv;
    redi[warp] = bi;
  }
  __syncthreads();
  bv = 0.0f;
  bi = -1;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) tw_argmax_merge(bv, bi, redv[w], redi[w]);
  return bi < 0 ? 0 : bi;
}

__global__ void tw_argmax_kernel(const float *__restrict__ logits, int64_t ld, int V,
                                 int32_t *__restrict__ out) {
  TW_PDL_WAIT();
  __shared__ float redv[32];
  __shared__ int redi[32];
  int r = tw_block_argmax(logits + (size_t)blockIdx.x * ld, V, redv, redi);
  if (threadIdx.x == 0) out[blockIdx.x] = r;
}

extern "C" tw_status_t tw_cuda_argmax(const float *logits, int64_t ld, int32_t n_rows, int32_t V,
                                      int32_t *out, cudaStream_t stream) {
  if (!logits || !out) return tw_err(TW_ERR_INVALID_ARGUMENT, "argmax: NULL argument");
  if (n_rows < 0 || V <= 0 || ld < V)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "argmax: bad sizes rows=%d V=%d ld=%lld", n_rows, V,
                  (long long)ld);
  if (n_rows == 0) return TW_OK;
  tw_pdl_launch(tw_argmax_kernel, dim3(n_rows), dim3(TW_SAMPLE_THREADS), 0, stream, logits, ld, V,
                out);
  TW_CUDA_CHECK_LAUNCH("tw_argmax_kernel");
  return TW_OK;
}

/* ---- sampling ------------------------------------------------------------- */

/* Order-preserving key of a float (larger float, larger key; -inf lowest
 * among non-NaN; NaN has been mapped to -inf before). */
static __device__ __forceinline__ uint32_t tw_fkey(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct tw_sample_ctx {
  const float *row;
  int V;
  float temp;
  float m;
  /* kept set of top-k: key > k_key, or key == k_key and id <= k_id */
  uint32_t k_key;
  int k_id;
  /* top-p prefix, same form */
  uint32_t p_key;
  int p_id;
};

static __device__ __forceinline__ float tw_z(const tw_sample_ctx &c, int i) {
  float v = c.row[i] / c.temp;
  return isnan(v) ? -INFINITY : v;
}

static __device__ __forceinline__ bool tw_in(uint32_t key, int i, uint32_t kk, int ki) {
  return key > kk || (key == kk && i <= ki);
}

/* Mass (double) of the kept tokens with key >= thr_key (ids unrestricted
 * when equal unless eq_id >= 0: then key == thr_key needs id <= eq_id), and
 * id <= max_id. use_p: also inside the top-p prefix. */
static __device__ double tw_mass(const tw_sample_ctx &c, uint32_t thr_key, int eq_id, int max_id,
                                 bool use_p, double *red) {
  double s = 0.0;
  for (int i = threadIdx.x; i < c.V && i <= max_id; i += blockDim.x) {
    float z = tw_z(c, i);
    uint32_t key = tw_fkey(z);
    if (!tw_in(key, i, c.k_key, c.k_id)) continue;
    if (use_p && !tw_in(key, i, c.p_key, c.p_id)) continue;
    bool ok = key > thr_key || (key == thr_key && (eq_id < 0 || i <= eq_id));
    if (ok) s += exp((double)z - (double)c.m);
  }
  return tw_block_sum<double>(s, red);
}

static __device__ int tw_count(const tw_sample_ctx &c, uint32_t thr_key, bool eq_only, int max_id,
                               int *red) {
  int n = 0;
  for (int i = threadIdx.x; i < c.V; i += blockDim.x) {
    uint32_t key = tw_fkey(tw_z(c, i));
    n += eq_only ? (key == thr_key && i <= max_id) : (key >= thr_key);
  }
  return tw_block_sum<int>(n, red);
}

__global__ void tw_sample_kernel(const float *__restrict__ logits, int64_t ld, int V,
                                 const tw_cuda_sample_row_t *__restrict__ params,
                                 int32_t *__restrict__ out) {
  TW_PDL_WAIT();
  __shared__ double redd[32];
  __shared__ int redi[32];
  __shared__ float redv[32];
  const float *row = logits + (size_t)blockIdx.x * ld;
  tw_cuda_sample_row_t p = params[blockIdx.x];
  if (!(p.temperature > 0.0f)) {
    int r = tw_block_argmax(row, V, redv, redi);
    if (threadIdx.x == 0) out[blockIdx.x] = r;
    return;
  }
  tw_sample_ctx c;
  c.row = row;
  c.V = V;
  c.temp = p.temperature;
  c.k_key = 0;
  c.k_id = V; /* everything kept */
  c.p_key = 0;
  c.p_id = V;
  /* top-k: the k-th largest key, then the lowest ids among its ties. */
  if (p.top_k > 0 && p.top_k < V) {
    uint32_t pre = 0;
    for (int bit = 31; bit >= 0; bit--) {
      uint32_t cand = pre | (1u << bit);
      if (tw_count(c, cand, false, V, redi) >= p.top_k) pre = cand;
    }
    int gt = pre == 0xffffffffu ? 0 : tw_count(c, pre + 1, false, V, redi);
    int need = p.top_k - gt, lo = 0, hi = V - 1;
    while (lo < hi) { /* smallest id with count(key == pre, id <= id) >= need */
      int mid = (lo + hi) / 2;
      if (tw_count(c, pre, true, mid, redi) >= need) hi = mid;
      else lo = mid + 1;
    }
    c.k_key = pre;
    c.k_id = lo;
  }
  /* max z over the kept set = the top-ranked z */
  float m = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, tw_z(c, i));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) redv[threadIdx.x >> 5] = m;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, redv[w]);
  if (m == -INFINITY) {
    int r = tw_block_argmax(row, V, redv, redi);
    if (threadIdx.x == 0) out[blockIdx.x] = r;
    return;
  }
  c.m = m;
  double total = tw_mass(c, 0, -1, V, false, redd);
  bool use_p = p.top_p > 0.0f && p.top_p < 1.0f;
  if (use_p) {
    double need = (double)p.top_p * total;
    uint32_t pre = 0;
    for (int bit = 31; bit >= 0; bit--) {
      uint32_t cand = pre | (1u << bit);
      if (tw_mass(c, cand, -1, V, false, redd) >= need) pre = cand;
    }
    double gt = pre == 0xffffffffu ? 0.0 : tw_mass(c, pre + 1, -1, V, false, redd);
    int lo = 0, hi = V - 1;
    while (lo < hi) { /* smallest id cutoff among ties reaching the need */
      int mid = (lo + hi) / 2;
      double eq = tw_mass(c, pre, mid, V, false, redd) - gt;
      if (gt + eq >= need) hi = mid;
      else lo = mid + 1;
    }
    c.p_key = pre;
    c.p_id = lo;
    total = tw_mass(c, 0, -1, V, true, redd);
  }
  /* draw: smallest id whose running mass (increasing ids) exceeds the target */
  double target = p.uniform * total;
  int lo = 0, hi = V - 1;
  if (tw_mass(c, 0, -1, V - 1, use_p, redd) <= target) {
    lo = -1; /* rounding: the CPU takes the last kept token */
  } else {
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      if (tw_mass(c, 0, -1, mid, use_p, redd) > target) hi = mid;
      else lo = mid + 1;
    }
  }
  if (lo < 0) { /* last kept id */
    int best = -1;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      uint32_t key = tw_fkey(tw_z(c, i));
      if (tw_in(key, i, c.k_key, c.k_id) && (!use_p || tw_in(key, i, c.p_key, c.p_id)))
        best = max(best, i);
    }
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) redi[threadIdx.x >> 5] = best;
    __syncthreads();
    best = -1;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) best = max(best, redi[w]);
    lo = best < 0 ? 0 : best;
  }
  if (threadIdx.x == 0) out[blockIdx.x] = lo;
}

extern "C" tw_status_t tw_cuda_sample(const float *logits, int64_t ld, int32_t n_rows, int32_t V,
                                      const tw_cuda_sample_row_t *params, int32_t *out,
                                      cudaStream_t stream) {
  if (!logits || !params || !out) return tw_err(TW_ERR_INVALID_ARGUMENT, "sample: NULL argument");
  if (n_rows < 0 || V <= 0 || ld < V)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "sample: bad sizes rows=%d V=%d ld=%lld", n_rows, V,
                  (long long)ld);
  if (n_rows == 0) return TW_OK;
  tw_pdl_launch(tw_sample_kernel, dim3(n_rows), dim3(TW_SAMPLE_THREADS), 0, stream, logits, ld, V,
                params, out);
  TW_CUDA_CHECK_LAUNCH("tw_sample_kernel");
  return TW_OK;
}
