/* attention_decode.cu: decode attention over the paged KV cache (spec §2.6),
 * one query token per sequence, split along the keys (flash-decoding).
 * API in attention.h.
 *
 * Split kernel: one CTA = (sequence, KV head, split). All query heads of the
 * KV head (the GQA group, <= 16) are the 16 rows of one m16n8k16 tile, so
 * each K/V element is read from memory once per CTA (memory-bound: 16-byte
 * cp.async loads, double-buffered 64-key tiles through the block table). Warp
 * w takes keys 16w..16w+15 of every tile; the 4 warps' (m, l, acc) are merged
 * in shared memory and written as the split's partial state (unnormalised
 * acc, log2-domain max m, denominator l). The sink is the initial state of
 * warp 0 of split 0 only. K/V tiles stream through NS stages of cp.async
 * (NS - 1 tiles in flight while one is multiplied).
 * The grid has S splits per (sequence, KV head); each sequence divides its
 * own keys over them (chunk = its length / S, rounded up to a tile), so a
 * sequence far below the context bucket the graph was captured for still
 * uses every split. A sequence whose keys fit one split writes its output
 * directly. Otherwise the splits are merged either by the last split CTA of
 * the (sequence, KV head) to finish (a counter in the workspace, threadfence
 * reduction; the default) or by a separate combine kernel, one warp per
 * (sequence, query head) (TWAIN_CUDA_DC_FUSED=0).
 *
 * The fp8 KV cache (F8; common/kv/kv_fp8.h: e4m3 rows with one f32 scale a
 * (token, KV head)): the e4m3 tiles stream into shared memory as they are
 * (half the bytes of bf16) and go into f16 MMAs without a dequantized copy:
 * e4m3 -> f16 is exact, one instruction a pair. K: a thread reads 16 bytes
 * of a key row (dims 16t..16t+15) and k-step kk takes dims 16t+4kk..+3 as
 * the MMA's k positions (2t, 2t+1, 2t+8, 2t+9); the query fragments use the
 * same order (a dot product does not care), in f16; each key's scale
 * multiplies its score. V: ldmatrix.trans of the e4m3 rows as 16-bit pairs
 * gives a thread two keys x two dims, one byte permute makes the (key, key)
 * pairs of each dim, and each MMA's 8 columns are the dims 16c + 2g + par;
 * each key's scale goes into its probability, relative to the largest V
 * scale the warp has seen (u, so that P stays within f16's range), and the
 * warp's accumulator is multiplied by u before the merge. The raw tiles
 * are swizzled (16-byte chunk c of row r at c ^ ((r >> 1) & 3)) so that the
 * 64-byte rows' ldmatrix is conflict-free. */
#include "kernels/pdl.cuh"
#include "kernels/attention.h"

#include "kernels/attention_mma.cuh"
#include "kernels/cuda_common.h"

#include <math.h>
#include <stdlib.h>

#define TW_DC_BN 64
#define TW_DC_WARPS 4
#define TW_DC_MIN_KEYS_PER_SPLIT 256
#define TW_DC_MAX_SPLITS 128
typedef struct {
  const __nv_bfloat16 *q;
  int64_t q_stride;
  const __nv_bfloat16 *kv; /* F8: the fp8 pool's bytes (common/kv/kv_fp8.h) */
  const float *sinks;
  const int32_t *seq_lens;
  const int32_t *block_tables;
  int32_t bt_stride;
  int32_t nq, nkv, group, block_size, window, n_splits, fused;
  int32_t bs_shift; /* tw_kv_bs_shift(block_size) */
  float scale_log2;
  float *ws_m, *ws_l, *ws_acc; /* [B][NQ][S], [B][NQ][S], [B][NQ][S][D] */
  int32_t *counters;           /* [B][NKV], zero between calls (fused merge) */
  __nv_bfloat16 *out;
} tw_dc_params_t;

/* Keys per split of a sequence with `len` keys over `n_splits` splits: a
 * whole number of tiles. Its active splits are cdiv(len, chunk). */
static __device__ __forceinline__ int tw_dc_chunk(int len, int n_splits) {
  const int c = (len + n_splits - 1) / n_splits;
  return max(TW_DC_BN, (c + TW_DC_BN - 1) / TW_DC_BN * TW_DC_BN);
}

/* Shared memory of the split kernel: bf16: [NS][k|v][BN x D] bf16 tiles;
 * F8 (the fp8 cache): [NS][k|v][BN x D] e4m3 tiles (tw_dc_swz8), then
 * [NS][k|v][BN] f32 scales. Reused by the merge at the end either way. */
template <int NS, bool F8>
struct tw_dc_smem {
  static constexpr int BN = TW_DC_BN, D = TW_ATTN_D;
  static constexpr int RAW = NS * 2 * BN * D, SCL = NS * 2 * BN * 4;
  static constexpr int BYTES = F8 ? RAW + SCL : NS * 2 * BN * D * 2;
};

/* Byte offset of (row, 16-byte chunk) in a 64-byte-row e4m3 tile: chunk c of
 * row r at c ^ ((r >> 1) & 3), so the 8 rows of one ldmatrix 8x8 matrix hit
 * all 32 banks once. */
static __device__ __forceinline__ int tw_dc_swz8(int row, int chunk) {
  return row * TW_ATTN_D + 16 * (chunk ^ ((row >> 1) & 3));
}

template <int NS, bool F8>
static __global__ void __launch_bounds__(TW_DC_WARPS * 32) tw_attn_decode_split_kernel(
    const tw_dc_params_t p) {
  TW_PDL_WAIT();
  constexpr int BN = TW_DC_BN, D = TW_ATTN_D, NT = TW_DC_WARPS * 32;
  using SM = tw_dc_smem<NS, F8>;
  static_assert(SM::BYTES >= (TW_DC_WARPS * 16 * (D + 2) + 1) * 4 &&
                    SM::BYTES >= 16 * TW_DC_MAX_SPLITS * 4,
                "the merge reuses the tiles' shared memory");
  __shared__ __align__(128) uint8_t sbuf[SM::BYTES]; /* the tiles, reused below */
  uint8_t *const raw8 = sbuf;                                   /* F8 */
  float *const scl = reinterpret_cast<float *>(sbuf + SM::RAW); /* F8 */
  const int sp = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;

  const int hi = p.seq_lens[b];
  const int lo = p.window > 0 ? max(0, hi - p.window) : 0;
  const int chunk = tw_dc_chunk(hi - lo, p.n_splits);
  const int n_act = (hi - lo + chunk - 1) / chunk;
  const int s_lo = lo + sp * chunk;
  if (s_lo >= hi) return; /* empty split: nobody reads its state */
  const int s_hi = min(hi, s_lo + chunk);
  const int32_t *bt = p.block_tables + (int64_t)b * p.bt_stride;
  const int bs = p.block_size;
  const int64_t head_elems = (int64_t)bs * D;
  const int64_t blk_elems = 2 * (int64_t)p.nkv * head_elems;
  const __nv_bfloat16 *kv_g = p.kv + (int64_t)g * head_elems;
  const int t_lo = s_lo / BN, t_hi = (s_hi - 1) / BN;
  /* F8: bytes of one (k|v, head) part of a block and of a block */
  const int64_t part8 = (int64_t)bs * (D + 4), blk8 = 2 * (int64_t)p.nkv * part8;
  const uint8_t *kv8 = reinterpret_cast<const uint8_t *>(p.kv);
  const uint8_t *kv8_g = kv8 + (int64_t)g * part8;

  auto load_kv = [&](int stage, int kt) {
    if constexpr (F8) { /* 4 chunks of 16 bytes a row; the row's two scales by its chunk 0 */
      for (int c = tid; c < BN * 4; c += NT) {
        const int r = c >> 2, ch = c & 3;
        const int pos = kt * BN + r;
        const bool ok = pos >= s_lo && pos < s_hi;
        const uint8_t *src = kv8, *ssrc = kv8;
        if (ok) {
          const int off = tw_kv_slot_of(pos, bs, p.bs_shift);
          const uint8_t *blk = kv8_g + (int64_t)bt[tw_kv_block_of(pos, bs, p.bs_shift)] * blk8;
          src = blk + (int64_t)off * D + ch * 16;
          ssrc = blk + (int64_t)bs * D + off * 4;
        }
        tw_cp_async16(tw_smem_u32(raw8 + (stage * 2 + 0) * BN * D + tw_dc_swz8(r, ch)), src, ok);
        tw_cp_async16(tw_smem_u32(raw8 + (stage * 2 + 1) * BN * D + tw_dc_swz8(r, ch)),
                      ok ? src + (int64_t)p.nkv * part8 : kv8, ok);
        if (ch == 0) {
          tw_cp_async4(tw_smem_u32(scl + (stage * 2 + 0) * BN + r), ssrc, ok);
          tw_cp_async4(tw_smem_u32(scl + (stage * 2 + 1) * BN + r),
                       ok ? ssrc + (int64_t)p.nkv * part8 : kv8, ok);
        }
      }
    } else {
    for (int c = tid; c < BN * 8; c += NT) {
      const int r = c >> 3, ch = c & 7;
      const int pos = kt * BN + r;
      const bool ok = pos >= s_lo && pos < s_hi;
      const __nv_bfloat16 *src = p.kv;
      if (ok)
        src = kv_g + (int64_t)bt[tw_kv_block_of(pos, bs, p.bs_shift)] * blk_elems +
              (int64_t)tw_kv_slot_of(pos, bs, p.bs_shift) * D + ch * 8;
      tw_cp_async16(tw_smem_u32(sbuf + (stage * 2 + 0) * BN * D * 2) + tw_swz(r, ch), src, ok);
      tw_cp_async16(tw_smem_u32(sbuf + (stage * 2 + 1) * BN * D * 2) + tw_swz(r, ch),
                    ok ? src + (int64_t)p.nkv * head_elems : p.kv, ok);
    }
    }
  };
#pragma unroll
  for (int i = 0; i < NS - 1; i++) {
    if (t_lo + i <= t_hi) load_kv(i, t_lo + i);
    tw_cp_async_commit();
  }

  /* Q fragments straight from global memory: row = query head within the
   * group. F8: in f16, k-step kk on dims 16tq + 4kk..+3 (the K side's order). */
  uint32_t qa[4][4];
  {
    const __nv_bfloat16 *qb = p.q + (int64_t)b * p.q_stride + (int64_t)g * p.group * D;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int row = gq + 8 * (e & 1);
        const int col = F8 ? 16 * tq + 4 * kk + 2 * (e >> 1) : kk * 16 + 2 * tq + 8 * (e >> 1);
        uint32_t v =
            row < p.group ? *reinterpret_cast<const uint32_t *>(qb + (int64_t)row * D + col) : 0u;
        if constexpr (F8) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&v));
          v = tw_pack_f16_sat(f.x, f.y);
        }
        qa[kk][e] = v;
      }
  }
  float u = 0.f; /* F8: the largest V scale this warp has seen (its accumulator's unit) */
  float acc[8][4];
  float m[2], l[2];
#pragma unroll
  for (int hf = 0; hf < 2; hf++) {
    const int row = gq + 8 * hf;
    const bool sink_here = sp == 0 && warp == 0 && row < p.group;
    m[hf] = sink_here ? p.sinks[g * p.group + row] * TW_LOG2E : -INFINITY;
    l[hf] = sink_here && tq == 0 ? 1.f : 0.f;
  }
#pragma unroll
  for (int n = 0; n < 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[n][e] = 0.f;

  for (int it = 0, kt = t_lo; kt <= t_hi; it++, kt++) {
    const int st = it % NS;
    if (kt + NS - 1 <= t_hi) load_kv((it + NS - 1) % NS, kt + NS - 1);
    tw_cp_async_commit();
    tw_cp_async_wait<NS - 1>();
    __syncthreads();
    const int k0 = kt * BN + warp * 16; /* this warp's 16 keys */
    if (k0 + 15 >= s_lo && k0 < s_hi) {
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float2 smul[2]; /* a score's factor by key (2tq, 2tq + 1 of n-tile n) */
      float2 vsc[2];  /* F8: the keys' V scales over u */
      float resc = 1.f; /* F8: the accumulator's change of unit */
      if constexpr (F8) {
        const uint8_t *const k8 = raw8 + (st * 2 + 0) * BN * D;
        uint4 kw[2];
#pragma unroll
        for (int n = 0; n < 2; n++) {
          const int r = warp * 16 + n * 8 + gq;
          kw[n] = *reinterpret_cast<const uint4 *>(k8 + tw_dc_swz8(r, tq));
          const float2 ks =
              *reinterpret_cast<const float2 *>(scl + (st * 2 + 0) * BN + warp * 16 + n * 8 + 2 * tq);
          smul[n] = make_float2(ks.x * p.scale_log2, ks.y * p.scale_log2);
          vsc[n] =
              *reinterpret_cast<const float2 *>(scl + (st * 2 + 1) * BN + warp * 16 + n * 8 + 2 * tq);
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
          for (int n = 0; n < 2; n++) {
            const uint32_t w = kk == 0 ? kw[n].x : kk == 1 ? kw[n].y : kk == 2 ? kw[n].z : kw[n].w;
            tw_mma16816_f16(sc[n], qa[kk], tw_e4m3x2_f16x2(w), tw_e4m3x2_f16x2(w >> 16));
          }
        /* the V scales of this tile's 16 keys against the unit u */
        float t = fmaxf(fmaxf(vsc[0].x, vsc[0].y), fmaxf(vsc[1].x, vsc[1].y));
        t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 1));
        t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 2));
        const float un = fmaxf(u, t);
        if (un > 0.f) {
          resc = u / un; /* 0 while nothing was accumulated */
          const float inv = 1.f / un;
#pragma unroll
          for (int n = 0; n < 2; n++) vsc[n] = make_float2(vsc[n].x * inv, vsc[n].y * inv);
        }
        u = un;
      } else {
        const uint32_t kbase = tw_smem_u32(sbuf + (st * 2 + 0) * BN * D * 2);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
          uint32_t bb[4];
          const int r = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4(bb, kbase + tw_swz(r, 2 * kk + (lane >> 4)));
          tw_mma16816(sc[0], qa[kk], bb[0], bb[2]);
          tw_mma16816(sc[1], qa[kk], bb[1], bb[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; n++) smul[n] = make_float2(p.scale_log2, p.scale_log2);
      }
#pragma unroll
      for (int n = 0; n < 2; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) sc[n][e] *= e & 1 ? smul[n].y : smul[n].x;
      if (k0 < s_lo || k0 + 16 > s_hi) { /* a tile at the split's edge (warp-uniform) */
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int kp = k0 + n * 8 + 2 * tq + (e & 1);
            if (kp < s_lo || kp >= s_hi) sc[n][e] = -INFINITY;
          }
      }
      float aa[2]; /* the accumulator's factor by row half */
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; n++)
          mx = fmaxf(mx, fmaxf(sc[n][2 * hf], sc[n][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[hf], mx);
        const float ms = mn == -INFINITY ? 0.f : mn; /* no key and no sink yet */
        const float alpha = tw_fast_exp2(m[hf] - ms);
        m[hf] = mn;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const float pe = tw_fast_exp2(sc[n][2 * hf + e] - ms);
            sc[n][2 * hf + e] = pe;
            sum += pe;
          }
        l[hf] = l[hf] * alpha + sum;
        aa[hf] = alpha * resc; /* F8: the accumulator also changes its unit; l does not */
      }
      /* Once a row's maximum settles (and, F8, the unit u), its factors are 1:
       * the warp skips the 32 multiplies unless one of its rows needs them. */
      if (__any_sync(0xffffffffu, aa[0] != 1.f || aa[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) acc[n][e] *= aa[e >> 1];
      }
      uint32_t pa[4];
      if constexpr (F8) { /* P with the keys' V scales (over u), in f16 */
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
          for (int hf = 0; hf < 2; hf++) {
            const __half2 h =
                __floats2half2_rn(sc[n][2 * hf] * vsc[n].x, sc[n][2 * hf + 1] * vsc[n].y);
            pa[2 * n + hf] = *reinterpret_cast<const uint32_t *>(&h);
          }
        const uint8_t *const v8 = raw8 + (st * 2 + 1) * BN * D;
        /* matrix j of an x4: keys 8 (j & 1).., 16-byte column block 2 cp + (j >> 1) */
        const int j = lane >> 3, r = warp * 16 + 8 * (j & 1) + (lane & 7);
#pragma unroll
        for (int cp = 0; cp < 2; cp++) {
          uint32_t bb[4];
          tw_ldmatrix_x4_trans(bb, tw_smem_u32(v8 + tw_dc_swz8(r, 2 * cp + (j >> 1))));
#pragma unroll
          for (int h = 0; h < 2; h++) { /* column block c: dims 16c + 2gq + par */
            const int c = 2 * cp + h;
            const uint32_t x0 = __byte_perm(bb[2 * h], 0u, 0x3120),
                           x1 = __byte_perm(bb[2 * h + 1], 0u, 0x3120);
            tw_mma16816_f16(acc[2 * c], pa, tw_e4m3x2_f16x2(x0), tw_e4m3x2_f16x2(x1));
            tw_mma16816_f16(acc[2 * c + 1], pa, tw_e4m3x2_f16x2(x0 >> 16),
                            tw_e4m3x2_f16x2(x1 >> 16));
          }
        }
      } else {
        pa[0] = tw_pack_bf16(sc[0][0], sc[0][1]);
        pa[1] = tw_pack_bf16(sc[0][2], sc[0][3]);
        pa[2] = tw_pack_bf16(sc[1][0], sc[1][1]);
        pa[3] = tw_pack_bf16(sc[1][2], sc[1][3]);
        const uint32_t vbase = tw_smem_u32(sbuf + (st * 2 + 1) * BN * D * 2);
#pragma unroll
        for (int np = 0; np < 4; np++) {
          uint32_t bb[4];
          const int r = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          tw_ldmatrix_x4_trans(bb, vbase + tw_swz(r, 2 * np + (lane >> 4)));
          tw_mma16816(acc[2 * np], pa, bb[0], bb[1]);
          tw_mma16816(acc[2 * np + 1], pa, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();
  }
  tw_cp_async_wait<0>();
  __syncthreads();

  /* Merge the 4 warps in shared memory (the stage buffers are free now). */
  float *sm_m = reinterpret_cast<float *>(sbuf); /* [warp][16] */
  float *sm_l = sm_m + TW_DC_WARPS * 16;                    /* [warp][16] */
  float *sm_acc = sm_l + TW_DC_WARPS * 16;                  /* [warp][16][D] */
  int *is_last = reinterpret_cast<int *>(sm_acc + TW_DC_WARPS * 16 * D); /* fused merge */
#pragma unroll
  for (int hf = 0; hf < 2; hf++) {
    float lt = l[hf];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int row = gq + 8 * hf;
    if (tq == 0) {
      sm_m[warp * 16 + row] = m[hf];
      sm_l[warp * 16 + row] = lt;
    }
#pragma unroll
    for (int n = 0; n < 8; n++) {
      if constexpr (F8) { /* MMA n = 2c + par: dims 16c + 4tq + par and + 2, times the unit */
        float *a = sm_acc + (warp * 16 + row) * D + 16 * (n >> 1) + 4 * tq + (n & 1);
        a[0] = acc[n][2 * hf] * u;
        a[2] = acc[n][2 * hf + 1] * u;
      } else {
        float *a = sm_acc + (warp * 16 + row) * D + n * 8 + 2 * tq;
        a[0] = acc[n][2 * hf];
        a[1] = acc[n][2 * hf + 1];
      }
    }
  }
  __syncthreads();
  const int64_t row0 = (int64_t)b * p.nq + (int64_t)g * p.group; /* first query head */
  for (int i = tid; i < p.group * D; i += NT) {
    const int row = i / D, d = i % D;
    float mm = -INFINITY;
    for (int w = 0; w < TW_DC_WARPS; w++) mm = fmaxf(mm, sm_m[w * 16 + row]);
    const float ms = mm == -INFINITY ? 0.f : mm;
    float a = 0.f, ll = 0.f;
    for (int w = 0; w < TW_DC_WARPS; w++) {
      const float f = tw_fast_exp2(sm_m[w * 16 + row] - ms);
      a += f * sm_acc[(w * 16 + row) * D + d];
      ll += f * sm_l[w * 16 + row];
    }
    if (n_act == 1) { /* the only split (it holds the sink): final output */
      p.out[(row0 + row) * D + d] = __float2bfloat16_rn(a / ll);
      continue;
    }
    const int64_t idx = (row0 + row) * p.n_splits + sp;
    p.ws_acc[idx * D + d] = a;
    if (d == 0) {
      p.ws_m[idx] = mm;
      p.ws_l[idx] = ll;
    }
  }
  if (n_act == 1 || !p.fused) return;

  /* Fused merge: the last of the n_act split CTAs of (b, g) to finish merges
   * them all (threadfence reduction; it resets the counter for the next call). */
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int32_t *ctr = p.counters + (int64_t)b * p.nkv + g;
    const int prev = atomicAdd(ctr, 1);
    *is_last = prev == n_act - 1;
    if (*is_last) *ctr = 0;
  }
  __syncthreads();
  if (!*is_last) return;
  __threadfence();
  /* Per row (a warp each): the splits' maximum, then each split's weight
   * 2^(m_s - max) / sum_s(2^(m_s - max) l_s) into shared memory. */
  float *sw = reinterpret_cast<float *>(sbuf); /* [16][TW_DC_MAX_SPLITS] */
  for (int row = warp; row < p.group; row += TW_DC_WARPS) {
    const int64_t base = (row0 + row) * p.n_splits;
    float mm = -INFINITY;
    for (int sidx = lane; sidx < n_act; sidx += 32) mm = fmaxf(mm, __ldcg(p.ws_m + base + sidx));
    for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
    float ll = 0.f; /* split 0 holds the sink, so mm is finite */
    for (int sidx = lane; sidx < n_act; sidx += 32) {
      const float f = tw_fast_exp2(__ldcg(p.ws_m + base + sidx) - mm);
      sw[row * TW_DC_MAX_SPLITS + sidx] = f;
      ll += f * __ldcg(p.ws_l + base + sidx);
    }
    for (int o = 16; o > 0; o >>= 1) ll += __shfl_xor_sync(0xffffffffu, ll, o);
    const float inv = 1.f / ll;
    for (int sidx = lane; sidx < n_act; sidx += 32) sw[row * TW_DC_MAX_SPLITS + sidx] *= inv;
  }
  __syncthreads();
  /* thread = (row, 4 dims): the weighted sum of the splits' accumulators */
  for (int i = tid; i < p.group * (D / 4); i += NT) {
    const int row = i / (D / 4), d4 = i % (D / 4);
    const float4 *a = reinterpret_cast<const float4 *>(p.ws_acc + (row0 + row) * p.n_splits * D) + d4;
    const float *w = sw + row * TW_DC_MAX_SPLITS;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sidx = 0; sidx < n_act; sidx++) {
      const float f = w[sidx];
      const float4 v = __ldcg(a + (int64_t)sidx * (D / 4));
      o.x += f * v.x;
      o.y += f * v.y;
      o.z += f * v.z;
      o.w += f * v.w;
    }
    __nv_bfloat162 *dst = reinterpret_cast<__nv_bfloat162 *>(p.out + (row0 + row) * D + 4 * d4);
    dst[0] = __floats2bfloat162_rn(o.x, o.y);
    dst[1] = __floats2bfloat162_rn(o.z, o.w);
  }
}

/* One warp per (sequence, query head): merge the non-empty splits. */
static __global__ void __launch_bounds__(128) tw_attn_decode_combine_kernel(
    const tw_dc_params_t p, int n_rows) {
  TW_PDL_WAIT();
  constexpr int D = TW_ATTN_D;
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= n_rows) return;
  const int b = row / p.nq;
  const int hi = p.seq_lens[b];
  const int lo = p.window > 0 ? max(0, hi - p.window) : 0;
  const int chunk = tw_dc_chunk(hi - lo, p.n_splits);
  const int n_act = (hi - lo + chunk - 1) / chunk;
  if (n_act == 1) return; /* the split kernel wrote this row */
  const int64_t base = (int64_t)row * p.n_splits;
  float mm = -INFINITY;
  for (int s = lane; s < n_act; s += 32) mm = fmaxf(mm, p.ws_m[base + s]);
  for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
  /* split 0 holds the sink, so mm is finite */
  float a0 = 0.f, a1 = 0.f, ll = 0.f;
  for (int s = 0; s < n_act; s++) {
    const float f = tw_fast_exp2(p.ws_m[base + s] - mm);
    const float2 a = *reinterpret_cast<const float2 *>(p.ws_acc + (base + s) * D + 2 * lane);
    a0 += f * a.x;
    a1 += f * a.y;
    ll += f * p.ws_l[base + s];
  }
  const float inv = 1.f / ll;
  *reinterpret_cast<__nv_bfloat162 *>(p.out + (int64_t)row * D + 2 * lane) =
      __floats2bfloat162_rn(a0 * inv, a1 * inv);
}

/* Tuning knobs (knobs.h, read once per process; a decode graph keeps what
 * it was captured with; the workspace size follows TWAIN_CUDA_DC_CTAS when
 * it is computed): TWAIN_CUDA_DC_CTAS (target split CTAs per call, default
 * 512), TWAIN_CUDA_DC_STAGES (2 or 3 cp.async stages, default 3; the fp8
 * cache's half-size tiles take one more),
 * TWAIN_CUDA_DC_FUSED (0: separate combine kernel; default 1). For A/B runs
 * on the GPU machine and the kernel test. */
static int tw_dc_target_ctas(void) { return tw_cuda_knobs()->dc_ctas; }
static int tw_dc_stages(void) { return tw_cuda_knobs()->dc_stages; }
static int tw_dc_fused(void) { return tw_cuda_knobs()->dc_fused; }

/* Splits per (sequence, KV head) for a batch whose sequences have at most
 * `keys` keys: about `target_ctas` CTAs (tw_dc_target_ctas), at least
 * TW_DC_MIN_KEYS_PER_SPLIT keys each at `keys`. */
static int tw_dc_splits(int n_seqs, int nkv, int keys, int target_ctas) {
  int max_by_len = TW_CDIV(keys, TW_DC_MIN_KEYS_PER_SPLIT);
  if (max_by_len > TW_DC_MAX_SPLITS) max_by_len = TW_DC_MAX_SPLITS;
  const long long per = (long long)n_seqs * nkv;
  const long long want = (target_ctas + per - 1) / per;
  int s = want < max_by_len ? (int)want : max_by_len;
  return s < 1 ? 1 : s;
}

/* Bytes of the counter region at the start of the workspace. */
static size_t tw_dc_counter_bytes(int n_seqs, int nkv) {
  return ((size_t)n_seqs * nkv * sizeof(int32_t) + 255) & ~(size_t)255;
}

static bool tw_dc_shape_ok(const tw_cuda_attn_shape_t *sh) {
  return sh && sh->n_q_heads > 0 && sh->n_kv_heads > 0 && sh->n_q_heads % sh->n_kv_heads == 0 &&
         sh->scale > 0.f && sh->window >= 0 && sh->block_size > 0;
}

extern "C" int tw_cuda_attention_decode_splits(const tw_cuda_attn_shape_t *shape,
                                               int32_t n_seqs, int32_t keys) {
  if (!tw_dc_shape_ok(shape) || n_seqs <= 0 || keys <= 0) return 0;
  return tw_dc_splits(n_seqs, shape->n_kv_heads, keys, tw_dc_target_ctas());
}

extern "C" size_t tw_cuda_attention_decode_workspace_bytes(const tw_cuda_attn_shape_t *shape,
                                                           int32_t max_seqs,
                                                           int32_t max_seq_len) {
  if (!tw_dc_shape_ok(shape) || max_seqs <= 0 || max_seq_len <= 0) return 0;
  /* The window is ignored here so that one workspace serves every layer. */
  size_t best = 0;
  const int target = tw_dc_target_ctas(); /* read once, not once per batch size */
  for (int b = 1; b <= max_seqs; b++) {
    const int s = tw_dc_splits(b, shape->n_kv_heads, max_seq_len, target);
    const size_t need = (size_t)b * shape->n_q_heads * s * (TW_ATTN_D + 2) * sizeof(float);
    if (need > best) best = need;
  }
  /* counters first, then room to align the three arrays */
  return tw_dc_counter_bytes(max_seqs, shape->n_kv_heads) + best + 1024;
}

extern "C" tw_status_t tw_cuda_attention_decode(const tw_cuda_attn_shape_t *shape, const void *q,
                                                int64_t q_row_stride, const void *kv_layer,
                                                const float *sinks, int32_t n_seqs,
                                                const int32_t *seq_lens,
                                                const int32_t *block_tables,
                                                int32_t block_table_stride, int32_t max_seq_len,
                                                void *workspace, size_t workspace_bytes,
                                                void *out, cudaStream_t stream) {
  if (!shape || !q || !kv_layer || !sinks || !seq_lens || !block_tables || !workspace || !out)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention decode: NULL argument");
  if (!tw_dc_shape_ok(shape) || n_seqs <= 0 || max_seq_len <= 0 || block_table_stride <= 0 ||
      n_seqs > 65535)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention decode: bad shape (heads %d/%d, scale %g, window %d, block_size "
                  "%d) or counts (n_seqs %d, max_seq_len %d, block_table_stride %d)",
                  shape->n_q_heads, shape->n_kv_heads, (double)shape->scale, shape->window,
                  shape->block_size, n_seqs, max_seq_len, block_table_stride);
  if (shape->head_dim != TW_ATTN_D || shape->n_q_heads / shape->n_kv_heads > 16)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "attention decode: head_dim %d (only %d is built) or GQA group %d (max 16)",
                  shape->head_dim, TW_ATTN_D, shape->n_q_heads / shape->n_kv_heads);
  if (q_row_stride < (int64_t)shape->n_q_heads * TW_ATTN_D || q_row_stride % 2 != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "attention decode: q row stride %lld",
                  (long long)q_row_stride);
  if (shape->kv_fp8 && (shape->block_size % 4 || shape->kv_fp8 != 1))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention decode: the fp8 KV cache needs blocks of a multiple of 4 tokens "
                  "(16-byte aligned rows), got %d (kv_fp8 %d)",
                  shape->block_size, shape->kv_fp8);
  const size_t need = tw_cuda_attention_decode_workspace_bytes(shape, n_seqs, max_seq_len);
  if (workspace_bytes < need)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "attention decode: workspace of %zu bytes, %zu needed", workspace_bytes, need);
  const int keys = shape->window > 0 && shape->window < max_seq_len ? shape->window : max_seq_len;
  tw_dc_params_t p;
  p.n_splits = tw_dc_splits(n_seqs, shape->n_kv_heads, keys, tw_dc_target_ctas());
  p.fused = tw_dc_fused();
  p.q = static_cast<const __nv_bfloat16 *>(q);
  p.q_stride = q_row_stride;
  p.kv = static_cast<const __nv_bfloat16 *>(kv_layer); /* the bytes of the fp8 pool with kv_fp8 */
  p.sinks = sinks;
  p.seq_lens = seq_lens;
  p.block_tables = block_tables;
  p.bt_stride = block_table_stride;
  p.nq = shape->n_q_heads;
  p.nkv = shape->n_kv_heads;
  p.group = shape->n_q_heads / shape->n_kv_heads;
  p.block_size = shape->block_size;
  p.bs_shift = tw_kv_bs_shift(shape->block_size);
  p.window = shape->window;
  p.scale_log2 = shape->scale * TW_LOG2E;
  const size_t n_part = (size_t)n_seqs * p.nq * p.n_splits;
  uintptr_t w = ((uintptr_t)workspace + 255) & ~(uintptr_t)255;
  p.counters = reinterpret_cast<int32_t *>(w);
  w += tw_dc_counter_bytes(n_seqs, shape->n_kv_heads);
  p.ws_acc = reinterpret_cast<float *>(w);
  w += (n_part * TW_ATTN_D * sizeof(float) + 255) & ~(size_t)255;
  p.ws_m = reinterpret_cast<float *>(w);
  w += (n_part * sizeof(float) + 127) & ~(size_t)127;
  p.ws_l = reinterpret_cast<float *>(w);
  p.out = static_cast<__nv_bfloat16 *>(out);
  dim3 grid((unsigned)p.n_splits, (unsigned)p.nkv, (unsigned)n_seqs);
  if (shape->kv_fp8 && tw_dc_stages() == 2) /* fp8 tiles are half the bytes: one stage more */
    tw_pdl_launch(tw_attn_decode_split_kernel<3, true>, dim3(grid), dim3(TW_DC_WARPS * 32), 0,
                  stream, p);
  else if (shape->kv_fp8)
    tw_pdl_launch(tw_attn_decode_split_kernel<4, true>, dim3(grid), dim3(TW_DC_WARPS * 32), 0,
                  stream, p);
  else if (tw_dc_stages() == 2)
    tw_pdl_launch(tw_attn_decode_split_kernel<2, false>, dim3(grid), dim3(TW_DC_WARPS * 32), 0,
                  stream, p);
  else
    tw_pdl_launch(tw_attn_decode_split_kernel<3, false>, dim3(grid), dim3(TW_DC_WARPS * 32), 0,
                  stream, p);
  TW_CUDA_CHECK_LAUNCH("attention decode (split)");
  /* one split per sequence: the split kernel wrote the output; fused: it merged */
  if (p.n_splits == 1 || p.fused) return TW_OK;
  const int n_rows = n_seqs * p.nq;
  tw_pdl_launch(tw_attn_decode_combine_kernel, dim3(TW_CDIV(n_rows, 4)), dim3(128), 0, stream, p,
                n_rows);
  TW_CUDA_CHECK_LAUNCH("attention decode (combine)");
  return TW_OK;
}
