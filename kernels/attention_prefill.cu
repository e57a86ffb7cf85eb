/* attention_prefill.cu: prefill attention over the paged KV cache (spec §2.6),
 * FlashAttention-2 style on the tensor cores. API in attention.h.
 *
 * One CTA = one query head x one tile of BM = 64 * MT query rows of one
 * sequence; 4 warps, each owning 16 * MT rows (MT m16 tiles, so every K/V
 * fragment read from shared memory feeds MT MMAs). Keys stream in tiles of
 * 64 from the pool (cp.async, 16-byte, double-buffered, swizzled) through
 * the block table; only key tiles that some row may see are visited (causal
 * and window), and only tiles crossing the diagonal or the window edge are
 * masked. Softmax is online in the log2 domain, fp32, with the sink folded in
 * as the initial state (m = sink, l = 1: exp(sink - m) = 1). Rows are
 * normalised once at the end and written as bf16.
 *
 * Grid: x = query head (CTAs of one query tile and all heads run together,
 * so the 8 heads of one KV head share its K/V in L2), y = query tiles of all
 * sequences, heaviest (last) tile of each sequence first. */
#include "kernels/attention.h"

#include "kernels/attention_mma.cuh"
#include "kernels/cuda_common.h"

#include <math.h>

#define TW_PF_BN 64    /* keys per tile */
#define TW_PF_WARPS 4
#define TW_PF_MT 2     /* m16 tiles per warp: BM = 128 */

typedef struct {
  const __nv_bfloat16 *q;
  int64_t q_stride;
  const __nv_bfloat16 *kv;
  const float *sinks;
  const int32_t *cu_seqlens;
  const int32_t *start_pos;
  const int32_t *block_tables;
  int32_t bt_stride;
  __nv_bfloat16 *out;
  int32_t n_seqs, nq, nkv, group, block_size, window;
  float scale_log2; /* scale * log2(e) */
} tw_pf_params_t;

template <int MT>
static __global__ void __launch_bounds__(TW_PF_WARPS * 32)
    tw_attn_prefill_kernel(const tw_pf_params_t p) {
  constexpr int BM = 16 * MT * TW_PF_WARPS;
  constexpr int BN = TW_PF_BN;
  constexpr int D = TW_ATTN_D;
  constexpr int NT = TW_PF_WARPS * 32;
  __shared__ __align__(128) uint8_t sQ[BM * D * 2];
  __shared__ __align__(128) uint8_t sK[2][BN * D * 2];
  __shared__ __align__(128) uint8_t sV[2][BN * D * 2];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h = blockIdx.x, g = h / p.group;

  /* Which sequence and query tile: the y index counts tiles sequence by
   * sequence, last tile of each sequence first. */
  int j = blockIdx.y, s = 0, qt = -1, len = 0;
  for (; s < p.n_seqs; s++) {
    len = p.cu_seqlens[s + 1] - p.cu_seqlens[s];
    const int nt = (len + BM - 1) / BM;
    if (j < nt) {
      qt = nt - 1 - j;
      break;
    }
    j -= nt;
  }
  if (qt < 0) return; /* spare CTA of the upper-bound grid */
  const int64_t row0 = (int64_t)p.cu_seqlens[s] + (int64_t)qt * BM;
  const int nvalid = min(BM, len - qt * BM);
  const int q_first = p.start_pos[s] + qt * BM;
  const int q_last = q_first + nvalid - 1;
  const int key_lo = p.window > 0 ? max(0, q_first - p.window + 1) : 0;
  const int kt_lo = key_lo / BN, kt_hi = q_last / BN;
  const int32_t *bt = p.block_tables + (int64_t)s * p.bt_stride;
  const int bs = p.block_size;
  const int64_t head_elems = (int64_t)bs * D;
  const int64_t blk_elems = 2 * (int64_t)p.nkv * head_elems;
  const __nv_bfloat16 *kv_g = p.kv + (int64_t)g * head_elems;

  /* Q tile (rows past the sequence are zero-filled and never stored). */
  for (int c = tid; c < BM * 8; c += NT) {
    const int r = c >> 3, ch = c & 7;
    const bool ok = r < nvalid;
    const __nv_bfloat16 *src = ok ? p.q + (row0 + r) * p.q_stride + (int64_t)h * D + ch * 8 : p.q;
    tw_cp_async16(tw_smem_u32(sQ) + tw_swz(r, ch), src, ok);
  }
  auto load_kv = [&](int stage, int kt) {
    for (int c = tid; c < BN * 8; c += NT) {
      const int r = c >> 3, ch = c & 7;
      const int pos = kt * BN + r;
      const bool ok = pos >= key_lo && pos <= q_last; /* others: zeros, masked */
      const __nv_bfloat16 *src = p.kv;
      if (ok) src = kv_g + (int64_t)bt[pos / bs] * blk_elems + (int64_t)(pos % bs) * D + ch * 8;
      tw_cp_async16(tw_smem_u32(sK[stage]) + tw_swz(r, ch), src, ok);
      tw_cp_async16(tw_smem_u32(sV[stage]) + tw_swz(r, ch),
                    ok ? src + (int64_t)p.nkv * head_elems : p.kv, ok);
    }
  };
  load_kv(0, kt_hi);
  tw_cp_async_commit();

  /* Per-thread state: rows (warp*16*MT + mi*16 + gq + 8*hf), gq = lane/4. */
  const int gq = lane >> 2, tq = lane & 3;
  uint32_t qf[MT][4][4];
  float acc[MT][8][4];
  float m[MT][2], l[MT][2];
  const float sink = p.sinks[h] * TW_LOG2E;
#pragma unroll
  for (int mi = 0; mi < MT; mi++) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      m[mi][hf] = sink;
      l[mi][hf] = tq == 0 ? 1.f : 0.f; /* exp2(sink - m); the quad sums l at the end */
    }
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[mi][n][e] = 0.f;
  }
  const int wrow0 = warp * 16 * MT; /* first tile row of this warp */
  const int w_first = q_first + wrow0, w_last = q_first + wrow0 + 16 * MT - 1;

  for (int it = 0, kt = kt_hi; kt >= kt_lo; it++, kt--) {
    const int st = it & 1;
    if (kt - 1 >= kt_lo) load_kv(st ^ 1, kt - 1);
    tw_cp_async_commit();
    tw_cp_async_wait<1>();
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
          const int r = wrow0 + mi * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4(qf[mi][kk], tw_smem_u32(sQ) + tw_swz(r, 2 * kk + (lane >> 4)));
        }
    }
    const int k0 = kt * BN;
    /* Skip the tile for this warp if all its keys are invisible to all its rows. */
    const bool warp_skip = k0 > w_last || (p.window > 0 && k0 + BN - 1 < w_first - p.window + 1);
    if (!warp_skip) {
      const uint32_t kbase = tw_smem_u32(sK[st]), vbase = tw_smem_u32(sV[st]);
      float sc[MT][8][4];
#pragma unroll
      for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) sc[mi][n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int np = 0; np < 4; np++) {
          uint32_t b[4];
          const int r = np * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4(b, kbase + tw_swz(r, 2 * kk + (lane >> 4)));
#pragma unroll
          for (int mi = 0; mi < MT; mi++) {
            tw_mma16816(sc[mi][2 * np], qf[mi][kk], b[0], b[2]);
            tw_mma16816(sc[mi][2 * np + 1], qf[mi][kk], b[1], b[3]);
          }
        }
      }
      /* Mask only tiles crossing the diagonal or the window edge for this warp. */
      const bool need_mask = k0 + BN - 1 > w_first ||
                             (p.window > 0 && k0 < w_last - p.window + 1);
#pragma unroll
      for (int mi = 0; mi < MT; mi++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
          const int qp = w_first + mi * 16 + gq + 8 * hf;
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
              float v = sc[mi][n][2 * hf + e] * p.scale_log2;
              if (need_mask) {
                const int kp = k0 + n * 8 + 2 * tq + e;
                if (kp > qp || (p.window > 0 && kp <= qp - p.window)) v = -INFINITY;
              }
              sc[mi][n][2 * hf + e] = v;
              mx = fmaxf(mx, v);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(m[mi][hf], mx); /* finite: m starts at the sink */
          const float alpha = tw_fast_exp2(m[mi][hf] - mn);
          m[mi][hf] = mn;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
              const float pe = tw_fast_exp2(sc[mi][n][2 * hf + e] - mn);
              sc[mi][n][2 * hf + e] = pe;
              sum += pe;
            }
          l[mi][hf] = l[mi][hf] * alpha + sum;
#pragma unroll
          for (int n = 0; n < 8; n++) {
            acc[mi][n][2 * hf] *= alpha;
            acc[mi][n][2 * hf + 1] *= alpha;
          }
        }
      }
      /* acc += P V: P from the score registers, V^T fragments by ldmatrix.trans. */
#pragma unroll
      for (int ks = 0; ks < 4; ks++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; mi++) {
          pa[mi][0] = tw_pack_bf16(sc[mi][2 * ks][0], sc[mi][2 * ks][1]);
          pa[mi][1] = tw_pack_bf16(sc[mi][2 * ks][2], sc[mi][2 * ks][3]);
          pa[mi][2] = tw_pack_bf16(sc[mi][2 * ks + 1][0], sc[mi][2 * ks + 1][1]);
          pa[mi][3] = tw_pack_bf16(sc[mi][2 * ks + 1][2], sc[mi][2 * ks + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < 4; np++) {
          uint32_t b[4];
          const int r = ks * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4_trans(b, vbase + tw_swz(r, 2 * np + (lane >> 4)));
#pragma unroll
          for (int mi = 0; mi < MT; mi++) {
            tw_mma16816(acc[mi][2 * np], pa[mi], b[0], b[1]);
            tw_mma16816(acc[mi][2 * np + 1], pa[mi], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads(); /* everyone is done with stage st before it is refilled */
  }
  tw_cp_async_wait<0>();

  /* Normalise and store. */
#pragma unroll
  for (int mi = 0; mi < MT; mi++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      float lt = l[mi][hf];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = 1.f / lt;
      const int r = wrow0 + mi * 16 + gq + 8 * hf;
      if (r < nvalid) {
        __nv_bfloat16 *o = p.out + (row0 + r) * (int64_t)p.nq * D + (int64_t)h * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < 8; n++)
          *reinterpret_cast<__nv_bfloat162 *>(o + n * 8) =
              __floats2bfloat162_rn(acc[mi][n][2 * hf] * inv, acc[mi][n][2 * hf + 1] * inv);
      }
    }
}

extern "C" tw_status_t tw_cuda_attention_prefill(const tw_cuda_attn_shape_t *shape, const void *q,
                                                 int64_t q_row_stride, const void *kv_layer,
                                                 const float *sinks, int32_t n_seqs,
                                                 int32_t n_tokens, const int32_t *cu_seqlens,
                                                 const int32_t *start_pos,
                                                 const int32_t *block_tables,
                                                 int32_t block_table_stride, void *out,
                                                 cudaStream_t stream) {
  if (!shape || !q || !kv_layer || !sinks || !cu_seqlens || !start_pos || !block_tables || !out)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention prefill: NULL argument");
  if (shape->n_q_heads <= 0 || shape->n_kv_heads <= 0 ||
      shape->n_q_heads % shape->n_kv_heads != 0 || !(shape->scale > 0.f) || shape->window < 0 ||
      shape->block_size <= 0 || n_seqs <= 0 || n_tokens <= 0 || block_table_stride <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention prefill: bad shape (heads %d/%d, scale %g, window %d, block_size "
                  "%d) or counts (n_seqs %d, n_tokens %d, block_table_stride %d)",
                  shape->n_q_heads, shape->n_kv_heads, (double)shape->scale, shape->window,
                  shape->block_size, n_seqs, n_tokens, block_table_stride);
  if (shape->head_dim != TW_ATTN_D)
    return tw_err(TW_ERR_UNSUPPORTED, "attention prefill: head_dim %d (only %d is built)",
                  shape->head_dim, TW_ATTN_D);
  if (q_row_stride < (int64_t)shape->n_q_heads * TW_ATTN_D || q_row_stride % 8 != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention prefill: q row stride %lld (>= NQ*D, multiple of 8)",
                  (long long)q_row_stride);
  tw_pf_params_t p;
  p.q = static_cast<const __nv_bfloat16 *>(q);
  p.q_stride = q_row_stride;
  p.kv = static_cast<const __nv_bfloat16 *>(kv_layer);
  p.sinks = sinks;
  p.cu_seqlens = cu_seqlens;
  p.start_pos = start_pos;
  p.block_tables = block_tables;
  p.bt_stride = block_table_stride;
  p.out = static_cast<__nv_bfloat16 *>(out);
  p.n_seqs = n_seqs;
  p.nq = shape->n_q_heads;
  p.nkv = shape->n_kv_heads;
  p.group = shape->n_q_heads / shape->n_kv_heads;
  p.block_size = shape->block_size;
  p.window = shape->window;
  p.scale_log2 = shape->scale * TW_LOG2E;
  constexpr int BM = 16 * TW_PF_MT * TW_PF_WARPS;
  const int64_t tiles = (int64_t)TW_CDIV(n_tokens, BM) + n_seqs; /* >= sum of per-seq tiles */
  if (tiles > 65535)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention prefill: %lld query tiles (max 65535)",
                  (long long)tiles);
  dim3 grid((unsigned)p.nq, (unsigned)tiles);
  tw_attn_prefill_kernel<TW_PF_MT><<<grid, TW_PF_WARPS * 32, 0, stream>>>(p);
  TW_CUDA_CHECK_LAUNCH("attention prefill");
  return TW_OK;
}
