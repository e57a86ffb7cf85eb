/* moe_route.cu: router top-k + softmax and the sort of assignments by expert
 * (moe.h, spec §2.8), and the combine kernels shared by both MoE paths.
 *
 * Determinism: the per-expert order of assignments is stable (increasing
 * a = t*k + j), computed by one block per expert that scans all assignments
 * with ballots, not by atomics, so replays give identical results. */
#include "kernels/pdl.cuh"
#include "kernels/moe.h"

#include "kernels/cuda_common.h"
#include "kernels/moe_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TW_ROUTE_ALIGN 256

static size_t tw_align_up(size_t n) { return (n + TW_ROUTE_ALIGN - 1) / TW_ROUTE_ALIGN * TW_ROUTE_ALIGN; }

extern "C" size_t tw_cuda_moe_route_bytes(int32_t max_tokens, int32_t n_experts, int32_t k) {
  if (max_tokens <= 0 || n_experts <= 0 || k <= 0) return 0;
  size_t tk = (size_t)max_tokens * (size_t)k;
  return tw_align_up(tk * 4) * 4 /* topk_idx, topk_w, sorted, pos_of */ +
         tw_align_up((size_t)n_experts * 4) * 2 /* counts, active */ +
         tw_align_up(((size_t)n_experts + 1) * 4) + tw_align_up(4) /* n_active */ +
         tw_align_up(TW_CUDA_MOE_ROUTE_TICKETS * 4) /* tickets */ +
         tw_align_up(TW_CUDA_MOE_GS_TICKETS * 4) /* the streaming MoE kernel's */;
}

extern "C" tw_status_t tw_cuda_moe_route_init(void *mem, size_t bytes, int32_t max_tokens,
                                              int32_t n_experts, int32_t k,
                                              tw_cuda_moe_route_t *route_p) {
  if (!mem || !route_p) return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_route_init: NULL argument");
  if (max_tokens <= 0 || n_experts <= 0 || k <= 0 || k > n_experts || n_experts > 1024 || k > 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "moe_route_init: bad sizes max_tokens=%d experts=%d k=%d (need k <= experts "
                  "<= 1024, k <= 32)",
                  max_tokens, n_experts, k);
  size_t need = tw_cuda_moe_route_bytes(max_tokens, n_experts, k);
  if (bytes < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_route_init: %zu bytes given, %zu needed", bytes,
                  need);
  char *p = (char *)mem;
  size_t tk = (size_t)max_tokens * (size_t)k;
  tw_cuda_moe_route_t r;
  r.max_tokens = max_tokens;
  r.n_experts = n_experts;
  r.k = k;
  r.topk_idx = (int32_t *)p; p += tw_align_up(tk * 4);
  r.topk_w = (float *)p; p += tw_align_up(tk * 4);
  r.sorted = (int32_t *)p; p += tw_align_up(tk * 4);
  r.pos_of = (int32_t *)p; p += tw_align_up(tk * 4);
  r.counts = (int32_t *)p; p += tw_align_up((size_t)n_experts * 4);
  r.active = (int32_t *)p; p += tw_align_up((size_t)n_experts * 4);
  r.offsets = (int32_t *)p; p += tw_align_up(((size_t)n_experts + 1) * 4);
  r.n_active = (int32_t *)p; p += tw_align_up(4);
  r.ticket = (int32_t *)p; p += tw_align_up(TW_CUDA_MOE_ROUTE_TICKETS * 4);
  r.gs_ticket = (int32_t *)p;
  /* tw_cuda_moe_router_fused's counters (one for the step, one per token
   * group; TW_CUDA_MOE_ROUTE_TICKETS) and the streaming MoE kernel's: each
   * leaves its own 0 */
  TW_CUDA_CHECK(cudaMemset(r.ticket, 0, TW_CUDA_MOE_ROUTE_TICKETS * 4));
  TW_CUDA_CHECK(cudaMemset(r.gs_ticket, 0, TW_CUDA_MOE_GS_TICKETS * 4));
  *route_p = r;
  return TW_OK;
}

/* Top-k of one token by one warp: k rounds of warp argmax (value desc, id
 * asc; NaN as -inf), softmax over the selected logits. sel/selv: this warp's
 * shared scratch [32]. Lane 0 writes idx_out[k], w_out[k]. */
static __device__ void tw_moe_topk_warp(const float *__restrict__ z, int E, int k, int lane,
                                        int *sel, float *selv, int32_t *idx_out, float *w_out) {
  for (int r = 0; r < k; r++) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      bool taken = false;
      for (int q = 0; q < r; q++) taken |= (sel[q] == e);
      if (taken) continue;
      float v = z[e];
      if (isnan(v)) v = -INFINITY;
      if (v > best || (v == best && e < bi)) {
        best = v;
        bi = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, best, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > best || (ov == best && oi < bi)) {
        best = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      sel[r] = bi;
      selv[r] = best;
    }
    __syncwarp();
  }
  if (lane == 0) {
    float m = selv[0], sum = 0.0f;
    for (int r = 0; r < k; r++) sum += expf(selv[r] - m);
    for (int r = 0; r < k; r++) {
      idx_out[r] = sel[r];
      w_out[r] = expf(selv[r] - m) / sum;
    }
  }
  __syncwarp();
}

/* One warp per token; per-expert counts by atomics (large T). */
__global__ void tw_moe_topk_kernel(const float *__restrict__ logits, int T, int E, int k,
                                   int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                   int32_t *__restrict__ counts) {
  TW_PDL_WAIT();
  __shared__ int sel[8][32];
  __shared__ float selv[8][32];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int t = blockIdx.x * 8 + warp;
  if (t >= T) return;
  tw_moe_topk_warp(logits + (size_t)t * E, E, k, lane, sel[warp], selv[warp],
                   topk_idx + (size_t)t * k, topk_w + (size_t)t * k);
  if (lane == 0)
    for (int r = 0; r < k; r++) atomicAdd(&counts[sel[warp][r]], 1);
}

/* Small T: top-k, counts, offsets, active list and the stable sort in one
 * block of 256 threads (one launch per step). The block's warps take the
 * tokens one after the other, so the route after the router GEMM uses it
 * only up to TWAIN_CUDA_ROUTE_FUSED_MAX assignments (knobs.h; 128) and the
 * top-k and sort kernels above (with a quadratic sort, at 1,024 assignments,
 * gpt-oss-20b batch 256, it took about 94 us a layer on the H200, 13% of the
 * decode step; docs/benchmarks.md). The fused router (GEMV + this block)
 * keeps it up to TW_ROUTE_FUSED_MAX. */
#define TW_ROUTE_FUSED_MAX 1024
/* Top-k and softmax of tokens t0 .. t0 + nt - 1 by the 8 warps of a block,
 * one token per warp in turn: logits f32 [nt, E] (global or shared) are
 * those tokens' rows; topk_idx / topk_w are the whole step's [T, k] arrays;
 * idx_s (shared, or NULL) receives each token's experts at t * k + r. */
static __device__ void tw_moe_topk_rows(const float *logits, int t0, int nt, int E, int k,
                                        int32_t *__restrict__ topk_idx,
                                        float *__restrict__ topk_w, int *idx_s) {
  __shared__ int sel[8][32];
  __shared__ float selv[8][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < nt; i += 8) {
    const int t = t0 + i;
    tw_moe_topk_warp(logits + (size_t)i * E, E, k, lane, sel[warp], selv[warp],
                     topk_idx + (size_t)t * k, topk_w + (size_t)t * k);
    if (lane == 0 && idx_s)
      for (int r = 0; r < k; r++) idx_s[t * k + r] = sel[warp][r];
    __syncwarp();
  }
}

/* Counts, offsets, active list and the stable sort of TK assignments whose
 * experts are idx_s[0 .. TK) (shared), by one block of 256 threads. It
 * reads idx_s only after its first __syncthreads, so the block may have
 * just written it. */
static __device__ void tw_moe_sort_block(const int *idx_s, int TK, int E,
                                         int32_t *__restrict__ counts,
                                         int32_t *__restrict__ offsets,
                                         int32_t *__restrict__ sorted,
                                         int32_t *__restrict__ pos_of,
                                         int32_t *__restrict__ active,
                                         int32_t *__restrict__ n_active) {
  __shared__ int cnt_s[1024], off_s[1024];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt_s[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < TK; a += blockDim.x) atomicAdd(&cnt_s[idx_s[a]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0, na = 0;
    for (int e = 0; e < E; e++) {
      int c = cnt_s[e];
      off_s[e] = run;
      offsets[e] = run;
      counts[e] = c;
      if (c > 0) active[na++] = e;
      run += c;
    }
    offsets[E] = run;
    *n_active = na;
  }
  __syncthreads();
  /* the stable sort: warp 0 walks the assignments 32 at a time, in order;
   * the lanes holding the same expert find each other (match), each takes
   * the expert's next slot plus the count of its peers before it, and the
   * first of them moves the expert's next slot on (linear in T*k) */
  if (warp == 0)
    for (int a0 = 0; a0 < TK; a0 += 32) {
      const int a = a0 + lane;
      const bool in = a < TK;
      const int e = in ? idx_s[a] : -1 - lane; /* past the end: matches no one */
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int before = __popc(peers & ((1u << lane) - 1u));
      if (in) {
        const int p = off_s[e] + before;
        sorted[p] = a;
        pos_of[a] = p;
      }
      __syncwarp();
      if (in && before == 0) off_s[e] += __popc(peers);
      __syncwarp();
    }
}

/* The body of the single-block route: one block of 256 threads (8 warps);
 * logits f32 [T, E] (global or shared). */
static __device__ void tw_moe_route_block(const float *logits, int T, int E, int k,
                                          int32_t *__restrict__ topk_idx,
                                          float *__restrict__ topk_w,
                                          int32_t *__restrict__ counts,
                                          int32_t *__restrict__ offsets,
                                          int32_t *__restrict__ sorted,
                                          int32_t *__restrict__ pos_of,
                                          int32_t *__restrict__ active,
                                          int32_t *__restrict__ n_active) {
  __shared__ int idx_s[TW_ROUTE_FUSED_MAX];
  tw_moe_topk_rows(logits, 0, T, E, k, topk_idx, topk_w, idx_s);
  tw_moe_sort_block(idx_s, T * k, E, counts, offsets, sorted, pos_of, active, n_active);
}

__global__ void tw_moe_route_fused_kernel(const float *__restrict__ logits, int T, int E, int k,
                                          int32_t *__restrict__ topk_idx,
                                          float *__restrict__ topk_w, int32_t *__restrict__ counts,
                                          int32_t *__restrict__ offsets,
                                          int32_t *__restrict__ sorted,
                                          int32_t *__restrict__ pos_of,
                                          int32_t *__restrict__ active,
                                          int32_t *__restrict__ n_active) {
  TW_PDL_WAIT();
  tw_moe_route_block(logits, T, E, k, topk_idx, topk_w, counts, offsets, sorted, pos_of, active,
                     n_active);
}

/* Router GEMV + route in one launch: block (e, j) (256 threads) computes
 * logits[t][e] = x[t] . w[e] + bias[e] for the tokens t of group j (at most
 * TW_ROUTER_TOKENS_PER_BLOCK, all at once; f32 accumulation, 16-byte loads,
 * 8 warps over H, then a fixed-order reduction: the same sums for any T),
 * writes it to global memory; the last block of group j to finish (counter
 * ticket[1 + j]) reads the group's logits back into shared memory and takes
 * its tokens' top-k, one token per warp; the last group to finish (counter
 * ticket[0]) counts and sorts the step's assignments (tw_moe_sort_block).
 * Each counter is reset to 0 by the block that read it last. Token groups
 * keep the serial parts short at batch 64 (one group of 64 tokens took 66 us
 * a layer on the H200). It runs up to T x E = 4,096 (gpt-oss-20b: 64 tokens,
 * gpt-oss-120b: 32): beyond, the router GEMM and the route kernels were
 * faster (120b at 64 tokens, 20b at 128 and 256), below slower (120b at 32:
 * 1,605 -> 1,649 tok/s on an H100; docs/benchmarks.md). Blocks of four
 * experts each (the token rows read once per four) measured 0.7-0.8% slower
 * at 16 and 64 tokens. */
#define TW_ROUTER_TOKENS_PER_BLOCK 8
#define TW_ROUTER_FUSED_MAX_T 64
#define TW_ROUTER_FUSED_MAX_TE 4096 /* T x E */
#define TW_ROUTER_GROUP_MAX_E 256   /* a token group's logits in shared memory */
__global__ void __launch_bounds__(256)
    tw_moe_router_fused_kernel(const __nv_bfloat16 *__restrict__ x,
                               const __nv_bfloat16 *__restrict__ w,
                               const float *__restrict__ bias, int T, int H, int E, int k,
                               float *__restrict__ logits, int32_t *__restrict__ topk_idx,
                               float *__restrict__ topk_w, int32_t *__restrict__ counts,
                               int32_t *__restrict__ offsets, int32_t *__restrict__ sorted,
                               int32_t *__restrict__ pos_of, int32_t *__restrict__ active,
                               int32_t *__restrict__ n_active, int32_t *__restrict__ ticket) {
  TW_PDL_WAIT();
  __shared__ float part[8][TW_ROUTER_TOKENS_PER_BLOCK];
  __shared__ float lg_s[TW_ROUTER_TOKENS_PER_BLOCK * TW_ROUTER_GROUP_MAX_E]; /* [nt, E] */
  __shared__ int last_s;
  const int e = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nc = H / 8;
  const int t0 = blockIdx.y * TW_ROUTER_TOKENS_PER_BLOCK,
            t1 = min(T, t0 + TW_ROUTER_TOKENS_PER_BLOCK);
  const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)e * H);
  /* every token of the group at once: one weight load per chunk and the
   * token rows' loads in flight together (one L2 round trip per chunk, not
   * one per token); each token's sum keeps its order (chunks in turn, the
   * eight products of a chunk in turn, then the warp's butterfly) */
  float acc[TW_ROUTER_TOKENS_PER_BLOCK];
#pragma unroll
  for (int j = 0; j < TW_ROUTER_TOKENS_PER_BLOCK; j++) acc[j] = 0.0f;
  for (int c = threadIdx.x; c < nc; c += 256) {
    const uint4 a = __ldg(wr + c);
    const __nv_bfloat162 *pa = reinterpret_cast<const __nv_bfloat162 *>(&a);
    uint4 b[TW_ROUTER_TOKENS_PER_BLOCK];
#pragma unroll
    for (int j = 0; j < TW_ROUTER_TOKENS_PER_BLOCK; j++)
      if (t0 + j < t1) b[j] = reinterpret_cast<const uint4 *>(x + (size_t)(t0 + j) * H)[c];
#pragma unroll
    for (int j = 0; j < TW_ROUTER_TOKENS_PER_BLOCK; j++) {
      if (t0 + j >= t1) continue;
      const __nv_bfloat162 *pb = reinterpret_cast<const __nv_bfloat162 *>(&b[j]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
        acc[j] = fmaf(fa.x, fb.x, acc[j]);
        acc[j] = fmaf(fa.y, fb.y, acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < TW_ROUTER_TOKENS_PER_BLOCK; j++) {
    float v = acc[j];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && t0 + j < t1) part[warp][j] = v;
  }
  __syncthreads();
  for (int t = t0 + (int)threadIdx.x; t < t1; t += blockDim.x) {
    float v = 0.0f;
    for (int q = 0; q < 8; q++) v += part[q][t - t0];
    logits[(size_t)t * E + e] = v + (bias ? bias[e] : 0.0f);
  }
  /* the last block of this token group (all E experts' logits written)
   * takes the group's top-k, one token per warp; the last group to finish
   * counts and sorts the step's assignments */
  __threadfence();
  __syncthreads();
  const int g = blockIdx.y, nt = t1 - t0;
  if (threadIdx.x == 0) last_s = atomicAdd(&ticket[1 + g], 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  for (int i = threadIdx.x; i < nt * E; i += blockDim.x)
    lg_s[i] = __ldcg(logits + (size_t)t0 * E + i);
  if (threadIdx.x == 0) ticket[1 + g] = 0;
  __syncthreads();
  tw_moe_topk_rows(lg_s, t0, nt, E, k, topk_idx, topk_w, NULL);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_s = atomicAdd(&ticket[0], 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  __shared__ int idx_s[TW_ROUTE_FUSED_MAX];
  for (int a = threadIdx.x; a < T * k; a += blockDim.x) idx_s[a] = __ldcg(topk_idx + a);
  if (threadIdx.x == 0) ticket[0] = 0;
  tw_moe_sort_block(idx_s, T * k, E, counts, offsets, sorted, pos_of, active, n_active);
}

/* TWAIN_CUDA_FUSED_ROUTER (knobs.h) */
static int tw_router_fused_env(void) { return tw_cuda_knobs()->fused_router; }

extern "C" int tw_cuda_moe_router_fused_supported(const tw_cuda_moe_route_t *r, const void *x,
                                                  const void *w, int32_t T, int32_t H) {
  return r && x && w && !(((uintptr_t)x | (uintptr_t)w) & 15) && tw_router_fused_env() && T >= 1 && T <= TW_ROUTER_FUSED_MAX_T && T <= r->max_tokens &&
         T * r->n_experts <= TW_ROUTER_FUSED_MAX_TE && r->n_experts <= TW_ROUTER_GROUP_MAX_E &&
         T * r->k <= TW_ROUTE_FUSED_MAX && H > 0 &&
         H % 8 == 0;
}

extern "C" tw_status_t tw_cuda_moe_router_fused(const tw_cuda_moe_route_t *r, const void *x,
                                                const void *w, const float *bias, int32_t T,
                                                int32_t H, float *logits, cudaStream_t stream) {
  if (!r || !x || !w || !logits)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_router_fused: NULL argument");
  if (((uintptr_t)x | (uintptr_t)w) & 15)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_router_fused: x or w not 16-byte aligned");
  if (!tw_cuda_moe_router_fused_supported(r, x, w, T, H))
    return tw_err(TW_ERR_UNSUPPORTED,
                  "moe_router_fused: T=%d, H=%d, E=%d, k=%d outside its limits (T <= %d, T*E <= "
                  "%d, E <= %d, H %% 8 == 0, 16-byte aligned) or turned off "
                  "(TWAIN_CUDA_FUSED_ROUTER=0)",
                  T, H, r->n_experts, r->k, TW_ROUTER_FUSED_MAX_T, TW_ROUTER_FUSED_MAX_TE,
                  TW_ROUTER_GROUP_MAX_E);
  tw_pdl_launch(tw_moe_router_fused_kernel,
                dim3(r->n_experts, TW_CDIV(T, TW_ROUTER_TOKENS_PER_BLOCK)), dim3(256), 0, stream,
                static_cast<const __nv_bfloat16 *>(x), static_cast<const __nv_bfloat16 *>(w),
                bias, T, H, r->n_experts, r->k, logits, r->topk_idx, r->topk_w, r->counts,
                r->offsets, r->sorted, r->pos_of, r->active, r->n_active, r->ticket);
  TW_CUDA_CHECK_LAUNCH("tw_moe_router_fused_kernel");
  return TW_OK;
}

/* One block (256 threads) per expert: its offset and active rank from the
 * counts, then a stable ballot scan of all assignments for this expert. */
__global__ void tw_moe_sort_kernel(const int32_t *__restrict__ topk_idx, int TK, int E,
                                   const int32_t *__restrict__ counts, int32_t *__restrict__ offsets,
                                   int32_t *__restrict__ sorted, int32_t *__restrict__ pos_of,
                                   int32_t *__restrict__ active, int32_t *__restrict__ n_active) {
  TW_PDL_WAIT();
  __shared__ int red_off[8], red_act[8], warp_tot[8];
  __shared__ int base_s;
  int e = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int off = 0, act = 0;
  for (int q = tid; q < E; q += blockDim.x) {
    int c = counts[q];
    if (q < e) {
      off += c;
      act += c > 0;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    off += __shfl_xor_sync(0xffffffffu, off, o);
    act += __shfl_xor_sync(0xffffffffu, act, o);
  }
  if (lane == 0) {
    red_off[warp] = off;
    red_act[warp] = act;
  }
  __syncthreads();
  if (tid == 0) {
    int so = 0, sa = 0;
    for (int w = 0; w < 8; w++) {
      so += red_off[w];
      sa += red_act[w];
    }
    int c = counts[e];
    offsets[e] = so;
    if (e == E - 1) {
      offsets[E] = so + c;
      *n_active = sa + (c > 0);
    }
    if (c > 0) active[sa] = e;
    base_s = so;
  }
  __syncthreads();
  for (int a0 = 0; a0 < TK; a0 += blockDim.x) {
    int a = a0 + tid;
    bool f = a < TK && topk_idx[a] == e;
    unsigned bal = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_tot[warp] = __popc(bal);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < 8; w++) {
      before += w < warp ? warp_tot[w] : 0;
      total += warp_tot[w];
    }
    if (f) {
      int p = base_s + before + __popc(bal & ((1u << lane) - 1u));
      sorted[p] = a;
      pos_of[a] = p;
    }
    __syncthreads();
    if (tid == 0) base_s += total;
    __syncthreads();
  }
}

extern "C" tw_status_t tw_cuda_moe_route(const tw_cuda_moe_route_t *r, const float *logits,
                                         int32_t T, cudaStream_t stream) {
  if (!r || !logits) return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_route: NULL argument");
  if (T <= 0 || T > r->max_tokens)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "moe_route: T=%d outside [1, %d]", T, r->max_tokens);
  if (T * r->k <= tw_cuda_knobs()->route_fused_max) {
    tw_pdl_launch(tw_moe_route_fused_kernel, dim3(1), dim3(256), 0, stream, logits, T, r->n_experts,
                  r->k, r->topk_idx, r->topk_w, r->counts, r->offsets, r->sorted, r->pos_of,
                  r->active, r->n_active);
    TW_CUDA_CHECK_LAUNCH("tw_moe_route_fused_kernel");
    return TW_OK;
  }
  TW_CUDA_CHECK(cudaMemsetAsync(r->counts, 0, sizeof(int32_t) * (size_t)r->n_experts, stream));
  tw_pdl_launch(tw_moe_topk_kernel, dim3(TW_CDIV(T, 8)), dim3(256), 0, stream, logits, T,
                r->n_experts, r->k, r->topk_idx, r->topk_w, r->counts);
  TW_CUDA_CHECK_LAUNCH("tw_moe_topk_kernel");
  tw_pdl_launch(tw_moe_sort_kernel, dim3(r->n_experts), dim3(256), 0, stream, r->topk_idx, T * r->k,
                r->n_experts, r->counts, r->offsets, r->sorted, r->pos_of, r->active, r->n_active);
  TW_CUDA_CHECK_LAUNCH("tw_moe_sort_kernel");
  return TW_OK;
}

/* out[t][c] = sum_j w[t,j] * (y[pos_of[t*k+j]][c] (+ bias[e_tj][c])), y f32:
 * the bias already added (grouped and GEMV paths) or added here (cuBLAS
 * path). Block (t, q): token t, columns [q*V*256, (q+1)*V*256) read V at a
 * time (V = 4 where H % 4 == 0: 16-byte loads), so a thread has one column
 * group and its k loads in flight together; the sum over j keeps its order
 * whatever V. */
template <int V> static __device__ __forceinline__ void tw_combine_ld(const float *p, float *o) {
  if constexpr (V == 4) {
    const float4 v = *reinterpret_cast<const float4 *>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  } else {
    o[0] = *p;
  }
}

#define TW_COMBINE_THREADS 256
template <bool ADD_BIAS, int V>
__global__ void __launch_bounds__(TW_COMBINE_THREADS)
    tw_moe_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pos_of,
                          const int32_t *__restrict__ topk_idx, const float *__restrict__ topk_w,
                          const float *__restrict__ bias, int H, int k, float *__restrict__ out) {
  TW_PDL_WAIT();
  const int t = blockIdx.x;
  const int c = (blockIdx.y * TW_COMBINE_THREADS + threadIdx.x) * V;
  if (c >= H) return;
  float acc[V];
#pragma unroll
  for (int i = 0; i < V; i++) acc[i] = 0.0f;
  for (int j = 0; j < k; j++) {
    const int a = t * k + j;
    float v[V];
    tw_combine_ld<V>(y + (size_t)pos_of[a] * H + c, v);
    if (ADD_BIAS) {
      float bv[V];
      tw_combine_ld<V>(bias + (size_t)topk_idx[a] * H + c, bv);
#pragma unroll
      for (int i = 0; i < V; i++) v[i] += bv[i];
    }
    const float wa = topk_w[a];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] += wa * v[i];
  }
  if constexpr (V == 4)
    *reinterpret_cast<float4 *>(out + (size_t)t * H + c) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  else
    out[(size_t)t * H + c] = acc[0];
}

template <bool ADD_BIAS>
static void tw_moe_combine_launch(const tw_cuda_moe_route_t *r, int32_t T, int32_t H,
                                  const float *y, const float *bias, float *out,
                                  cudaStream_t stream) {
  const bool vec = H % 4 == 0 && !(((uintptr_t)y | (uintptr_t)out | (uintptr_t)bias) & 15);
  const int V = vec ? 4 : 1;
  const dim3 grid((unsigned)T, (unsigned)TW_CDIV(TW_CDIV(H, V), TW_COMBINE_THREADS));
  if (vec)
    tw_pdl_launch(tw_moe_combine_kernel<ADD_BIAS, 4>, grid, dim3(TW_COMBINE_THREADS), 0,
                  stream, y, r->pos_of, r->topk_idx, r->topk_w, bias, H, r->k, out);
  else
    tw_pdl_launch(tw_moe_combine_kernel<ADD_BIAS, 1>, grid, dim3(TW_COMBINE_THREADS), 0,
                  stream, y, r->pos_of, r->topk_idx, r->topk_w, bias, H, r->k, out);
}

TW_NODISCARD tw_status_t tw_moe_combine_f32(const tw_cuda_moe_route_t *r, int32_t T, int32_t H,
                                            const float *y, const float *maybe_bias, float *out,
                                            cudaStream_t stream) {
  if (maybe_bias)
    tw_moe_combine_launch<true>(r, T, H, y, maybe_bias, out, stream);
  else
    tw_moe_combine_launch<false>(r, T, H, y, nullptr, out, stream);
  TW_CUDA_CHECK_LAUNCH("tw_moe_combine_kernel<f32>");
  return TW_OK;
}
