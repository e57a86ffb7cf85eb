/* attention_prefill.cu: prefill attention over the paged KV cache (spec §2.6),
 * FlashAttention-2 style on the tensor cores. API in attention.h.
 *
 * One CTA = one query head x one tile of BM query rows of one sequence. Keys
 * stream in tiles of BN from the pool (cp.async, 16-byte, double-buffered,
 * 128-byte swizzled; block ids fetched one tile ahead) through the block
 * table; only key tiles that some row may see are visited (causal and
 * window), and only tiles crossing the diagonal or the window edge are
 * masked. Softmax is online in the log2 domain, fp32, with the sink folded in
 * as the initial state (m = sink, l = 1: exp(sink - m) = 1); O is rescaled
 * only when a row's max moved. Rows are normalised once at the end and
 * written as bf16.
 *
 * Two MMA paths, as template variants (MT m16 tiles per warp, NW warps, BN,
 * WG): mma.sync m16n8k16 per warp (Q fragments in registers, K/V by
 * ldmatrix), or Hopper wgmma per warpgroup of 4 warps (S = Q K^T with Q and K
 * read from shared memory by descriptor, O += P V with P from registers and V
 * as a transposed shared-memory operand). tw_cuda_attention_prefill uses
 * variant 5 (wgmma, 2 warpgroups, BM 128, BN 64) on full layers and variant
 * 4 (wgmma, 1 warpgroup, BM 64) on sliding layers: the fastest measured on
 * the H200 (docs/benchmarks.md "CUDA attention kernels"; 332 TFLOP/s at 32k
 * on a full layer against 240 for the best mma.sync variant).
 *
 * Grid: x = query head (CTAs of one query tile and all heads run together,
 * so the 8 heads of one KV head share its K/V in L2), y = query tiles of all
 * sequences, heaviest (last) tile of each sequence first. */
#include "kernels/attention.h"

#include "kernels/attention_mma.cuh"
#include "kernels/cuda_common.h"

#include <math.h>

/* Variants: see tw_pf_launch. All compute the same function (bit-identical
 * outputs for BN 64 on the H200); they differ in speed only.
 * twain-bench-attention and test_attention reach them through
 * tw_cuda_attention_prefill_variant. */
#define TW_PF_N_VARIANTS 8

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
  int32_t bs_shift; /* log2(block_size) if a power of two, else -1 */
  int32_t f8;       /* kv is the fp8 KV cache (common/kv/kv_fp8.h) */
  float scale_log2; /* scale * log2(e) */
} tw_pf_params_t;

/* WG: Hopper wgmma path (MT == 1, BN 64 or 128): each group of 4 warps (a
 * warpgroup, 64 rows) computes S = Q K^T with Q and K from shared memory and
 * O += P V with P from registers, instead of per-warp mma.sync. */
/* F8: the pool is the fp8 KV cache (common/kv/kv_fp8.h): each tile's e4m3 rows
 * and scales are staged by cp.async and dequantized into the bf16 tiles
 * (tw_fp8_tile_to_bf16) before the MMAs read them. */
template <int MT, int NW, int BN, int MINB, bool WG, bool F8>
static __global__ void __launch_bounds__(NW * 32, MINB) tw_attn_prefill_kernel(const tw_pf_params_t p) {
  static_assert(!WG || (MT == 1 && (BN == 64 || BN == 128) && NW % 4 == 0), "wgmma: MT 1");
  constexpr int BM = 16 * MT * NW;
  constexpr int D = TW_ATTN_D;
  constexpr int NT = NW * 32;
  constexpr int NTN = BN / 8; /* n8 tiles of scores per row block */
  extern __shared__ __align__(1024) uint8_t tw_pf_smem[];
  /* 1024-byte aligned tiles (the wgmma 128-byte swizzle atom); the launch
   * asks for 1024 bytes of slack. */
  uint8_t *sQ = tw_pf_smem + ((1024 - (tw_smem_u32(tw_pf_smem) & 1023)) & 1023); /* [BM][D] */
  uint8_t *sK0 = sQ + BM * D * 2;            /* [2][BN][D] */
  uint8_t *sV0 = sK0 + 2 * BN * D * 2;       /* [2][BN][D] */
  uint8_t *sR8 = sV0 + 2 * BN * D * 2;       /* F8: [2][k|v][BN][D] e4m3 */
  float *sS8 = reinterpret_cast<float *>(sR8 + 2 * 2 * BN * D); /* F8: [2][k|v][BN] scales */

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
  const int64_t part8 = (int64_t)bs * (D + 4), blk8 = 2 * (int64_t)p.nkv * part8; /* F8 */
  const uint8_t *kv8 = reinterpret_cast<const uint8_t *>(p.kv);
  const uint8_t *kv8_g = kv8 + (int64_t)g * part8;

  /* Q tile (rows past the sequence are zero-filled and never stored). */
  for (int c = tid; c < BM * 8; c += NT) {
    const int r = c >> 3, ch = c & 7;
    const bool ok = r < nvalid;
    const __nv_bfloat16 *src = ok ? p.q + (row0 + r) * p.q_stride + (int64_t)h * D + ch * 8 : p.q;
    tw_cp_async16(tw_smem_u32(sQ) + tw_swz(r, ch), src, ok);
  }
  /* K/V tile loads. Thread tid copies chunk (tid & 7) of rows
   * (tid >> 3) + i * NT/8, i < CPT. The block ids of a tile are fetched one
   * iteration ahead (blk_next) so the cp.async never waits on the table. */
  constexpr int CPT = BN * 8 / NT;
  const int sh = p.bs_shift;
  auto fetch_blocks = [&](int kt, int (&blk)[CPT]) {
#pragma unroll
    for (int i = 0; i < CPT; i++) {
      const int pos = kt * BN + (tid >> 3) + i * (NT / 8);
      const bool ok = kt >= kt_lo && pos >= key_lo && pos <= q_last;
      blk[i] = ok ? bt[tw_kv_block_of(pos, bs, sh)] : -1;
    }
  };
  auto load_kv = [&](int stage, int kt, const int (&blk)[CPT]) {
#pragma unroll
    for (int i = 0; i < CPT; i++) {
      const int r = (tid >> 3) + i * (NT / 8), ch = tid & 7;
      const int pos = kt * BN + r;
      const bool ok = blk[i] >= 0; /* others: zeros, masked */
      const int slot = tw_kv_slot_of(pos, bs, sh);
      if constexpr (F8) { /* chunk ch < 4: K bytes 16ch.., else V; ch 0 / 4 also the scale */
        const int kv = ch >> 2;
        const uint8_t *part = kv8_g + (int64_t)blk[i] * blk8 + kv * (int64_t)p.nkv * part8;
        tw_cp_async16(tw_smem_u32(sR8 + ((stage * 2 + kv) * BN + r) * D + (ch & 3) * 16),
                      ok ? part + (int64_t)slot * D + (ch & 3) * 16 : kv8, ok);
        if ((ch & 3) == 0)
          tw_cp_async4(tw_smem_u32(sS8 + (stage * 2 + kv) * BN + r),
                       ok ? part + (int64_t)bs * D + slot * 4 : kv8, ok);
      } else {
        const __nv_bfloat16 *src = p.kv;
        if (ok) src = kv_g + (int64_t)blk[i] * blk_elems + (int64_t)slot * D + ch * 8;
        tw_cp_async16(tw_smem_u32(sK0 + stage * BN * D * 2) + tw_swz(r, ch), src, ok);
        tw_cp_async16(tw_smem_u32(sV0 + stage * BN * D * 2) + tw_swz(r, ch),
                      ok ? src + (int64_t)p.nkv * head_elems : p.kv, ok);
      }
    }
  };
  int blk_cur[CPT], blk_next[CPT];
  fetch_blocks(kt_hi, blk_cur);
  load_kv(0, kt_hi, blk_cur);
  tw_cp_async_commit();
  fetch_blocks(kt_hi - 1, blk_next);

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
    if (kt - 1 >= kt_lo) {
      load_kv(st ^ 1, kt - 1, blk_next);
      fetch_blocks(kt - 2, blk_next); /* used next iteration */
    }
    tw_cp_async_commit();
    tw_cp_async_wait<1>();
    if constexpr (F8) { /* the staged fp8 tile into this stage's bf16 tiles */
      __syncthreads();
      for (int kv = 0; kv < 2; kv++)
        tw_fp8_tile_to_bf16((kv ? sV0 : sK0) + st * BN * D * 2, sR8 + (st * 2 + kv) * BN * D,
                            sS8 + (st * 2 + kv) * BN, BN, tid, NT);
    }
    if (WG) tw_fence_proxy_async(); /* cp.async data -> wgmma operand reads */
    __syncthreads();
    if (!WG && it == 0) {
#pragma unroll
      for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
          const int r = wrow0 + mi * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4(qf[mi][kk], tw_smem_u32(sQ) + tw_swz(r, 2 * kk + (lane >> 4)));
        }
    }
    const int k0 = kt * BN;
    /* Skip the tile for this warp (warpgroup for WG: wgmma is collective) if
     * all its keys are invisible to all its rows. */
    const int s_first = WG ? q_first + (warp >> 2) * 64 : w_first;
    const int s_last = WG ? s_first + 63 : w_last;
    const bool warp_skip = k0 > s_last || (p.window > 0 && k0 + BN - 1 < s_first - p.window + 1);
    if (!warp_skip) {
      const uint32_t kbase = tw_smem_u32(sK0 + st * BN * D * 2),
                     vbase = tw_smem_u32(sV0 + st * BN * D * 2);
      float sc[MT][NTN][4];
#pragma unroll
      for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int n = 0; n < NTN; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) sc[mi][n][e] = 0.f;
      if constexpr (WG) {
        const uint32_t qaddr = tw_smem_u32(sQ) + (uint32_t)(warp >> 2) * 64 * 128;
        tw_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
          tw_wgmma_ss(sc[0], tw_wgmma_desc(qaddr + kk * 32), tw_wgmma_desc(kbase + kk * 32), 1);
        tw_wgmma_commit();
        tw_wgmma_wait0();
        tw_reg_fence(sc[0]);
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
#pragma unroll
          for (int np = 0; np < BN / 16; np++) {
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
      }
      float alphas[MT][2];
      bool any_rescale = false;
      /* Mask only tiles crossing the diagonal or the window edge for this warp. */
      const bool need_mask = k0 + BN - 1 > w_first ||
                             (p.window > 0 && k0 < w_last - p.window + 1);
#pragma unroll
      for (int mi = 0; mi < MT; mi++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
          const int qp = w_first + mi * 16 + gq + 8 * hf;
          if (need_mask) {
#pragma unroll
            for (int n = 0; n < NTN; n++)
#pragma unroll
              for (int e = 0; e < 2; e++) {
                const int kp = k0 + n * 8 + 2 * tq + e;
                if (kp > qp || (p.window > 0 && kp <= qp - p.window))
                  sc[mi][n][2 * hf + e] = -INFINITY;
              }
          }
          /* max of the raw scores (scale > 0 commutes with max), as a tree */
          float tmx[NTN];
#pragma unroll
          for (int n = 0; n < NTN; n++) tmx[n] = fmaxf(sc[mi][n][2 * hf], sc[mi][n][2 * hf + 1]);
#pragma unroll
          for (int w = 1; w < NTN; w *= 2)
#pragma unroll
            for (int n = 0; n + w < NTN; n += 2 * w) tmx[n] = fmaxf(tmx[n], tmx[n + w]);
          float mx = tmx[0];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          /* finite: m starts at the sink; -inf * scale stays -inf */
          const float mn = fmaxf(m[mi][hf], mx * p.scale_log2);
          const float alpha = tw_ex2(m[mi][hf] - mn);
          m[mi][hf] = mn;
          float tsum[NTN];
#pragma unroll
          for (int n = 0; n < NTN; n++) {
            const float p0 = tw_ex2(fmaf(sc[mi][n][2 * hf], p.scale_log2, -mn));
            const float p1 = tw_ex2(fmaf(sc[mi][n][2 * hf + 1], p.scale_log2, -mn));
            sc[mi][n][2 * hf] = p0;
            sc[mi][n][2 * hf + 1] = p1;
            tsum[n] = p0 + p1;
          }
#pragma unroll
          for (int w = 1; w < NTN; w *= 2)
#pragma unroll
            for (int n = 0; n + w < NTN; n += 2 * w) tsum[n] += tsum[n + w];
          l[mi][hf] = l[mi][hf] * alpha + tsum[0];
          alphas[mi][hf] = alpha;
          any_rescale |= alpha != 1.f;
        }
      }
      /* Rescale O only if some row's max moved (alpha == 1 is a no-op): after
       * the first tiles of a long row this is rare. */
      if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
        for (int mi = 0; mi < MT; mi++)
#pragma unroll
          for (int n = 0; n < 8; n++) {
            acc[mi][n][0] *= alphas[mi][0];
            acc[mi][n][1] *= alphas[mi][0];
            acc[mi][n][2] *= alphas[mi][1];
            acc[mi][n][3] *= alphas[mi][1];
          }
      }
      /* acc += P V: P from the score registers (bf16), V by ldmatrix.trans
       * (mma.sync) or as an MN-major wgmma operand. */
      if constexpr (WG) {
        uint32_t pa[BN / 16][4];
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++) {
          pa[ks][0] = tw_pack_bf16(sc[0][2 * ks][0], sc[0][2 * ks][1]);
          pa[ks][1] = tw_pack_bf16(sc[0][2 * ks][2], sc[0][2 * ks][3]);
          pa[ks][2] = tw_pack_bf16(sc[0][2 * ks + 1][0], sc[0][2 * ks + 1][1]);
          pa[ks][3] = tw_pack_bf16(sc[0][2 * ks + 1][2], sc[0][2 * ks + 1][3]);
        }
        tw_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++)
          tw_wgmma_rs_tb(acc[0], pa[ks], tw_wgmma_desc(vbase + ks * 16 * 128));
        tw_wgmma_commit();
        tw_wgmma_wait0();
        tw_reg_fence(acc[0]);
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++)
#pragma unroll
          for (int e = 0; e < 4; e++) asm volatile("" : "+r"(pa[ks][e])::"memory");
      } else {
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++) {
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

template <int MT, int NW, int BN, int MINB, bool WG, bool F8 = false>
static TW_NODISCARD tw_status_t tw_pf_launch_t(const tw_pf_params_t *p, int32_t n_tokens, int32_t n_seqs,
                                  cudaStream_t stream) {
  constexpr int BM = 16 * MT * NW;
  constexpr int smem = (BM + 4 * BN) * TW_ATTN_D * 2 + 1024 /* + alignment slack */
                       + (F8 ? 4 * BN * (TW_ATTN_D + 4) : 0); /* fp8 staging and scales */
  const int64_t tiles = (int64_t)TW_CDIV(n_tokens, BM) + n_seqs; /* >= sum of per-seq tiles */
  if (tiles > 65535)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention prefill: %lld query tiles (max 65535)",
                  (long long)tiles);
  if (smem > 48 * 1024)
    TW_CUDA_CHECK(cudaFuncSetAttribute(tw_attn_prefill_kernel<MT, NW, BN, MINB, WG, F8>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dim3 grid((unsigned)p->nq, (unsigned)tiles);
  tw_attn_prefill_kernel<MT, NW, BN, MINB, WG, F8><<<grid, NW * 32, smem, stream>>>(*p);
  TW_CUDA_CHECK_LAUNCH("attention prefill");
  return TW_OK;
}

/* The variant tw_cuda_attention_prefill uses, by layer type (measured on the
 * H200, docs/benchmarks.md "CUDA attention kernels"). */
static int tw_pf_default_variant(int window) { return window > 0 ? 4 : 5; }

/* Variant table: <MT, NW, BN, min CTAs per SM, wgmma>. */
static TW_NODISCARD tw_status_t tw_pf_launch(const tw_pf_params_t *p, int32_t n_tokens, int32_t n_seqs,
                                int variant, cudaStream_t stream) {
  if (p->f8) switch (variant) { /* the fp8 cache: the default variants only */
    case 0: return tw_pf_launch_t<2, 4, 64, 2, false, true>(p, n_tokens, n_seqs, stream);
    case 4: return tw_pf_launch_t<1, 4, 64, 4, true, true>(p, n_tokens, n_seqs, stream);
    case 5: return tw_pf_launch_t<1, 8, 64, 2, true, true>(p, n_tokens, n_seqs, stream);
    default:
      return tw_err(TW_ERR_UNSUPPORTED,
                    "attention prefill: variant %d is not built for the fp8 KV cache (0, 4, 5 are)",
                    variant);
    }
  switch (variant) {
  case 1: return tw_pf_launch_t<1, 4, 64, 3, false>(p, n_tokens, n_seqs, stream);
  case 2: return tw_pf_launch_t<1, 8, 64, 2, false>(p, n_tokens, n_seqs, stream);
  case 3: return tw_pf_launch_t<1, 4, 64, 4, false>(p, n_tokens, n_seqs, stream);
  case 4: return tw_pf_launch_t<1, 4, 64, 4, true>(p, n_tokens, n_seqs, stream);
  case 5: return tw_pf_launch_t<1, 8, 64, 2, true>(p, n_tokens, n_seqs, stream);
  case 6: return tw_pf_launch_t<1, 4, 128, 3, true>(p, n_tokens, n_seqs, stream);
  case 7: return tw_pf_launch_t<1, 8, 128, 1, true>(p, n_tokens, n_seqs, stream);
  default: return tw_pf_launch_t<2, 4, 64, 2, false>(p, n_tokens, n_seqs, stream);
  }
}

static TW_NODISCARD tw_status_t tw_pf_run(const tw_cuda_attn_shape_t *shape, const void *q,
                             int64_t q_row_stride, const void *kv_layer, const float *sinks,
                             int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
                             const int32_t *start_pos, const int32_t *block_tables,
                             int32_t block_table_stride, void *out, int variant,
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
  if (shape->kv_fp8 && (shape->block_size % 4 || shape->kv_fp8 != 1))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention prefill: the fp8 KV cache needs blocks of a multiple of 4 tokens "
                  "(16-byte aligned rows), got %d (kv_fp8 %d)",
                  shape->block_size, shape->kv_fp8);
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
  p.bs_shift = tw_kv_bs_shift(shape->block_size);
  p.window = shape->window;
  p.scale_log2 = shape->scale * TW_LOG2E;
  p.f8 = shape->kv_fp8;
  return tw_pf_launch(&p, n_tokens, n_seqs, variant, stream);
}

extern "C" tw_status_t tw_cuda_attention_prefill(const tw_cuda_attn_shape_t *shape, const void *q,
                                                 int64_t q_row_stride, const void *kv_layer,
                                                 const float *sinks, int32_t n_seqs,
                                                 int32_t n_tokens, const int32_t *cu_seqlens,
                                                 const int32_t *start_pos,
                                                 const int32_t *block_tables,
                                                 int32_t block_table_stride, void *out,
                                                 cudaStream_t stream) {
  /* The wgmma variants exist only as sm_90a machine code: elsewhere (the
   * compute_90 PTX JIT-compiled for another GPU) use the mma.sync variant 0. */
  int dev = 0, major = 0, minor = 0;
  TW_CUDA_CHECK(cudaGetDevice(&dev));
  TW_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  TW_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  const int variant = major == 9 && minor == 0 ? tw_pf_default_variant(shape ? shape->window : 0)
                                               : 0;
  return tw_pf_run(shape, q, q_row_stride, kv_layer, sinks, n_seqs, n_tokens, cu_seqlens,
                   start_pos, block_tables, block_table_stride, out, variant, stream);
}

/* Tuning entry for twain-bench-attention only (not in attention.h): the same
 * as tw_cuda_attention_prefill with kernel variant 0..TW_PF_N_VARIANTS-1. */
extern "C" tw_status_t tw_cuda_attention_prefill_variant(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
    const int32_t *start_pos, const int32_t *block_tables, int32_t block_table_stride, void *out,
    int variant, cudaStream_t stream);
extern "C" tw_status_t tw_cuda_attention_prefill_variant(
    const tw_cuda_attn_shape_t *shape, const void *q, int64_t q_row_stride, const void *kv_layer,
    const float *sinks, int32_t n_seqs, int32_t n_tokens, const int32_t *cu_seqlens,
    const int32_t *start_pos, const int32_t *block_tables, int32_t block_table_stride, void *out,
    int variant, cudaStream_t stream) {
  if (variant < 0 || variant >= TW_PF_N_VARIANTS)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention prefill: variant %d", variant);
  return tw_pf_run(shape, q, q_row_stride, kv_layer, sinks, n_seqs, n_tokens, cu_seqlens,
                   start_pos, block_tables, block_table_stride, out, variant, stream);
}
