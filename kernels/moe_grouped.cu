/* moe_grouped.cu: the prefill MoE's expert GEMMs as two grouped GEMMs whose
 * per-expert sizes are read on the device (moe.h, tw_cuda_moe_prefill), so a
 * prefill chunk never waits on the host and the path can be captured in a
 * CUDA graph.
 *
 * One kernel, two epilogues (p runs over the T*k (token, slot) assignments
 * sorted by expert):
 *   gate_up: act[p] = SwiGLU(x[sorted[p] / k] W1_e^T + b1_e)   (spec §2.9)
 *   down:    y[p] = act[p] W2_e^T + b2_e  (f32; the routing weights in the combine)
 *
 * The product is computed transposed, C^T = W X^T: a CTA takes 128 weight
 * rows (two warpgroups of 64) for 128 assignments of one expert, K in steps
 * of 64, with Hopper wgmma m64n128k16 reading the weights from registers (A)
 * and the assignment rows from shared memory (B, K-major, 128-byte swizzle;
 * gate_up gathers them from the token rows with cp.async). blockIdx.x is the
 * weight-row tile, blockIdx.y counts row tiles expert by expert: expert e has
 * ceil(counts[e] / 128) tiles, found by a warp scan of the device counts; the
 * grid is launched for the upper bound floor(T*k / 128) + min(E, T*k) and the
 * spare CTAs exit.
 *
 * Expert weights stay MXFP4 in global memory (4.25 bits per weight read):
 * each warp copies the raw blocks of its 16 weight rows into a stage and
 * converts them straight into its mma A fragments: fragment row g needs
 * bytes t, t+4, ..., t+28 of the row's 32 bytes of a k-tile (byte t of each
 * word). Each such byte (two E2M1 values) becomes its bf16x2 pair by one
 * lookup in a 256-entry shared-memory table kept once per lane (32 KB, built
 * by the CTA at start; lane l reads bank l, so no conflicts), then one bf16x2
 * multiply by the block's E8M0 scale (a power of two, so exact: the same bf16
 * values as tw_mxfp4_dequant): about four instructions per two weights
 * (byte permute, address, load, multiply), where register-only conversion
 * took about eight; the conversion is what bounds the kernel when experts
 * hold few tokens (decode; measured, docs/benchmarks.md). bf16 experts (bf16 checkpoints) load their fragments
 * with ldmatrix instead. For gate_up, fragment row r < 8 of warp w is the gate
 * row 2i and r + 8 the linear row 2i + 1 of i = n0/2 + 8w + r, so a SwiGLU
 * pair lands in one thread.
 *
 * Pipeline: 3 to 8 cp.async stages by tile (assignment rows + raw weights,
 * TW_GG_STAGES), prefetch depth S - 1; per k-tile one barrier, the fragments, 4 wgmma, and a wait for them
 * (with 5 or more stages, tiles of 16 to 64 rows, two k-tiles per barrier
 * and wait, prefetch depth S - 2: 7-10% faster at 32 rows, docs/benchmarks.md):
 * ptxas serialises wgmma whose register operands are produced while an
 * earlier one is in flight (warning C7513), so the overlap of conversion and
 * tensor work comes from the other warpgroups of the SM (two CTAs per SM).
 * Measured against the other layouts tried (weights dequantised into a shared
 * bf16 tile, 3 or 4 warpgroups, warp-specialised producers): this one was the
 * fastest then (2026-12-02); since then tw_gw_kernel, below, has passed it
 * from the 64-row tile, docs/benchmarks.md.
 *
 * tw_gw_kernel, below, runs the same arithmetic fed by a TMA producer warp
 * (no CTA barrier a k-tile), its warpgroups converting the next k-tile
 * while their wgmma runs (ptxas keeps that overlap there, with two
 * fragment sets), and takes the tiles from 64 rows on MXFP4 experts
 * (TWAIN_CUDA_MOE_WS), where it measured faster than this kernel (at the
 * 64-row tile with four consumer warpgroups; docs/benchmarks.md).
 *
 * A second kernel for the same grid and epilogues, tw_gm_kernel (mma.sync,
 * MXFP4 converted in registers once per CTA for all rows of the tile; see
 * its comment below), runs the tiles named by TWAIN_CUDA_MOE_MMA /
 * tw_cuda_moe_set_mma_tiles (default: none). */
#include "kernels/pdl.cuh"
#include "kernels/attention_mma.cuh"
#include "kernels/cuda_common.h"
#include "kernels/moe.h"
#include "kernels/moe_impl.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#define TW_GG_BM 128      /* largest assignment-row tile (of one expert) per CTA */
#define TW_GG_BM_MIN 16   /* smallest: decode, few tokens per expert */
#define TW_GG_BW 128      /* weight rows (output columns) per CTA: two warpgroups */
#define TW_GG_THREADS 256
/* cp.async stages by weight format and assignment tile: a small tile leaves
 * shared memory for deeper weight prefetch, which a few-token tile needs;
 * MXFP4 CTAs also hold the 32 KB conversion table (two CTAs per SM) */
#define TW_GG_STAGES(fmt, bt)                                                 \
  ((fmt) == TW_GG_MXFP4 ? ((bt) >= 128 ? 3 : (bt) >= 64 ? 5 : 8)              \
                        : ((bt) >= 128 ? 4 : (bt) >= 64 ? 6 : 8))
/* FP4 pair -> bf16x2 table: 256 entries (a byte: two E2M1 values) x 32 lane
 * copies (entry e of lane l at word 32 e + l, so a warp's lookups never share
 * a bank) */
#define TW_GG_LUT_BYTES (256 * 32 * 4)
#define TW_GG_MAX_K 8192 /* scales of the CTA's rows stay in shared memory */

enum { TW_GG_MXFP4 = 0, TW_GG_BF16 = 1 };
enum { TW_GG_SWIGLU = 0, TW_GG_PLAIN = 1 };

typedef struct {
  const __nv_bfloat16 *a; /* [rows, K] bf16: tokens (gather) or assignments */
  const int32_t *sorted;  /* gather: A row of assignment p = sorted[p] / k_top; NULL: row p */
  int k_top;
  const uint8_t *wq;        /* MXFP4 blocks, packed (moe.h TW_MX_CHUNK) */
  const uint8_t *ws;        /* MXFP4 scales [E, N, K/32] */
  const __nv_bfloat16 *wh;  /* bf16 weights [E, N, K] */
  const float *bias;        /* [E, N] */
  float alpha, limit;
  const int32_t *counts, *offsets;
  const int32_t *active, *n_active; /* experts with tokens, increasing id (the route's) */
  int E, N, K;
  void *out; /* SwiGLU: bf16 [T*k, N/2]; plain: f32 [T*k, N] */
  /* streaming kernel only: ks k-parts per (expert, 32-row slice) item (1 or
   * 2; plain: the parts add into out with atomicAdd, so out must be zero
   * first); zero / zero_n: f32 values this launch sets to 0 after its
   * dependency wait (the gate_up launch clears what its down launch adds into) */
  int ks;
  float *zero;
  int64_t zero_n;
  /* streaming kernel only: the route's counters of last-round units cut
   * into pieces and the pieces' sums (tw_gs_kernel); NULL: the static order */
  int32_t *gs_ticket;
  float *gs_part;
} tw_gg_args_t;

/* The two E2M1 values of byte e (value 2i in the low nibble, spec §3.4) as
 * bf16x2 (low half first): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 by the low
 * three bits, the sign in bit 3; exact in bf16. */
static __device__ __forceinline__ uint32_t tw_fp4_bf16(uint32_t n) {
  const uint32_t ex = (n >> 1) & 3, m = n & 1; /* 2^(ex-1) (1 + m/2); ex = 0: m/2 */
  const uint32_t mag = ex ? ((126 + ex) << 7) | (m << 6) : (m ? 0x3F00u : 0u);
  return mag | ((n & 8u) << 12);
}
static __device__ __forceinline__ uint32_t tw_fp4x2_bf16(uint32_t e) {
  return tw_fp4_bf16(e & 15) | (tw_fp4_bf16((e >> 4) & 15) << 16);
}

/* Every accumulator of a warp's H m16 tiles (or a thread's H m64 halves)
 * to 0. */
template <int H, int N8>
static __device__ __forceinline__ void tw_acc_zero(float (&acc)[H][N8][4]) {
#pragma unroll
  for (int mt = 0; mt < H; mt++)
#pragma unroll
    for (int j = 0; j < N8; j++)
#pragma unroll
      for (int q = 0; q < 4; q++) acc[mt][j][q] = 0.f;
}

/* Row tiles of a grouped launch's grid (gridDim.y) for tk assignments over
 * E experts at tile bt: the upper bound floor(tk / bt) + min(E, tk) of the
 * tiles tw_gg_find_tile numbers (spare CTAs exit). */
static __host__ __device__ __forceinline__ int tw_gg_row_tiles(int tk, int bt, int E) {
  return tk / bt + (E < tk ? E : tk);
}

/* Which expert and which of its row tiles CTA row blockIdx.y computes (warp
 * 0, lane `lane`): expert e has ceil(counts[e] / bm) row tiles, numbered
 * expert by expert. Writes s_tile = {e, first row in e, counts[e],
 * offsets[e]}, or e = -1 for a spare CTA of the upper-bound grid. */
static __device__ __forceinline__ void tw_gg_find_tile(const tw_gg_args_t &p, int bm, int lane,
                                                       int *s_tile) {
  const int E = p.E, per = (E + 31) / 32, e0 = lane * per, mt = blockIdx.y;
  int sum = 0;
  for (int i = 0; i < per; i++)
    if (e0 + i < E) sum += (p.counts[e0 + i] + bm - 1) / bm;
  int inc = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += v;
  }
  const bool hit = mt >= inc - sum && mt < inc;
  if (__ballot_sync(0xffffffffu, hit) == 0) {
    if (lane == 0) s_tile[0] = -1;
  } else if (hit) {
    int t = inc - sum;
    for (int i = 0; i < per && e0 + i < E; i++) {
      const int c = p.counts[e0 + i], nt = (c + bm - 1) / bm;
      if (mt < t + nt) {
        s_tile[0] = e0 + i;
        s_tile[1] = (mt - t) * bm;
        s_tile[2] = c;
        s_tile[3] = p.offsets[e0 + i];
        break;
      }
      t += nt;
    }
  }
}

/* This CTA's E8M0 scales, [rows][KB + 1] bytes at sS, weight row r of the
 * CTA at global row grow(r) (clamped to N - 1); the pad column (scale 1) is
 * read only against zero-filled weights of a K tail. A warp takes a row at a
 * time, its lanes the row's consecutive bytes (one or two 32-byte sectors a
 * load), TW_GG_SR rows of TW_GG_SC such loads in flight before any store
 * (unconditional, clamped: no branch between them). Two threads a row at
 * alternate bytes touched 16 rows, 16 sectors, a warp load: Nsight Compute
 * counted 39% (tw_gg_kernel) and 88% (tw_gw_kernel) of their global sectors
 * as excess, all of it here (docs/benchmarks.md). */
#define TW_GG_SR 8
#define TW_GG_SC 3
template <typename RowOf>
static __device__ __forceinline__ void tw_gg_load_scales(const tw_gg_args_t &p, int e, int rows,
                                                         RowOf grow, uint8_t *sS, int nthreads) {
  const int KB = p.K / 32, KBP = KB + 1, lane = threadIdx.x & 31, nw = nthreads >> 5;
  const uint8_t *ws = p.ws + (int64_t)e * p.N * KB;
  for (int r0 = threadIdx.x >> 5; r0 < rows; r0 += nw * TW_GG_SR)
    for (int b0 = lane; b0 < KBP; b0 += 32 * TW_GG_SC) {
      uint32_t v[TW_GG_SR][TW_GG_SC];
#pragma unroll
      for (int i = 0; i < TW_GG_SR; i++) {
        const uint8_t *src = ws + (int64_t)min(grow(min(r0 + nw * i, rows - 1)), p.N - 1) * KB;
#pragma unroll
        for (int j = 0; j < TW_GG_SC; j++) {
          const int b = b0 + 32 * j;
          const uint32_t x = __ldg(src + min(b, KB - 1));
          v[i][j] = b < KB ? x : 127u;
        }
      }
#pragma unroll
      for (int i = 0; i < TW_GG_SR; i++)
#pragma unroll
        for (int j = 0; j < TW_GG_SC; j++)
          if (r0 + nw * i < rows && b0 + 32 * j < KBP)
            sS[(r0 + nw * i) * KBP + b0 + 32 * j] = (uint8_t)v[i][j];
    }
}

/* E8M0 scale byte to bf16x2 2^(s-127) in both halves (s = 0: the denormal). */
static __device__ __forceinline__ uint32_t tw_gg_scale2(uint32_t s) {
  return s ? (s << 7) * 0x10001u : 0x00400040u;
}

/* The A fragments of one 16-byte half h (words 0-3: k16 steps 2h, 2h + 1)
 * of fragment row g + 8 hr's MXFP4 blocks in a k-tile, E8M0 scale byte
 * scale: byte t of word j is the pair at k 8 j + 2 t of this half, its
 * bf16x2 at lut_lane + 128 b in the per-lane table (sel: byte t to the low
 * byte), times the scale (exact); a0 / a1 (row g / g + 8) of step 2h from
 * word 0, a2 / a3 from word 1, step 2h + 1 from words 2 and 3. */
static __device__ __forceinline__ void tw_gg_cvt_half(uint32_t lut_lane, uint32_t sel, uint4 w,
                                                      uint32_t scale, int h, int hr,
                                                      uint32_t (&af)[4][4]) {
  const uint32_t sc = tw_gg_scale2(scale);
  const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162 *>(&sc);
  auto cv = [&](uint32_t word) {
    uint32_t v;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(lut_lane + (__byte_perm(word, 0, sel) << 7)));
    __nv_bfloat162 o = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&v), s2);
    return *reinterpret_cast<uint32_t *>(&o);
  };
  af[2 * h][hr] = cv(w.x);
  af[2 * h][2 + hr] = cv(w.y);
  af[2 * h + 1][hr] = cv(w.z);
  af[2 * h + 1][2 + hr] = cv(w.w);
}

/* The MXFP4 conversion table (TW_GG_LUT_BYTES at sL) by the CTA's nthreads
 * threads: entry i, its 32 lane copies, 16-byte chunks rotated by i (no
 * bank conflicts). */
static __device__ __forceinline__ void tw_gg_build_lut(uint32_t *sL, int nthreads) {
  for (int i = threadIdx.x; i < 256; i += nthreads) {
    const uint32_t v = tw_fp4x2_bf16((uint32_t)i);
#pragma unroll
    for (int j = 0; j < 8; j++)
      reinterpret_cast<uint4 *>(sL)[i * 8 + ((j + i) & 7)] = make_uint4(v, v, v, v);
  }
}

/* f(std::integral_constant<int, W>()) with W the wgmma width (n8 tiles) of
 * a tile whose rows fill nq of its quarters (GQ n8 tiles each, at least one:
 * W2, W3 and N8 for two, three, four), so that a tile holding fewer rows
 * than its size does not multiply the zero rows (a uniform branch). */
template <int GQ, int W2, int W3, int N8, typename F>
static __device__ __forceinline__ void tw_by_quarters(int nq, F &&f) {
  if (nq == 1)
    f(std::integral_constant<int, GQ>());
  else if (nq == 2)
    f(std::integral_constant<int, W2>());
  else if (nq == 3)
    f(std::integral_constant<int, W3>());
  else
    f(std::integral_constant<int, N8>());
}

/* The four k16 steps of a k-tile on the first W8 n8 tiles of the
 * accumulators (wgmma m64n(8 W8)k16; the B tile's rows past 8 W8 are not
 * read), with their fence and commit (in each branch of the caller, so
 * ptxas need not add them). */
template <int W8, int N8>
static __device__ __forceinline__ void tw_gg_wgmma4(float (&acc)[N8][4], const uint32_t (&af)[4][4],
                                                    uint64_t xd) {
  static_assert(W8 >= 1 && W8 <= N8, "wgmma N within the tile");
  float(&d)[W8][4] = *reinterpret_cast<float(*)[W8][4]>(&acc[0][0]);
  tw_wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; s++) tw_wgmma_rs(d, af[s], xd + 2 * s);
  tw_wgmma_commit();
}

/* The same for two k-tiles at once (A fragments af, then af2; B
 * descriptors xd, then xd2): eight k16 steps behind one fence and commit. */
template <int W8, int N8>
static __device__ __forceinline__ void tw_gg_wgmma8(float (&acc)[N8][4], const uint32_t (&af)[4][4],
                                                    const uint32_t (&af2)[4][4], uint64_t xd,
                                                    uint64_t xd2) {
  static_assert(W8 >= 1 && W8 <= N8, "wgmma N within the tile");
  float(&d)[W8][4] = *reinterpret_cast<float(*)[W8][4]>(&acc[0][0]);
  tw_wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; s++) tw_wgmma_rs(d, af[s], xd + 2 * s);
#pragma unroll
  for (int s = 0; s < 4; s++) tw_wgmma_rs(d, af2[s], xd2 + 2 * s);
  tw_wgmma_commit();
}

/* A warp's epilogue: acc[j] = (its weight rows nw + g and nw + g + 8; for
 * SwiGLU the gate and linear rows of i = nw / 2 + g) x (assignments 8 j + 2
 * t, + 1 of the tile at off, rows of them real): bias, then SwiGLU into the
 * bf16 act [T*k, N/2] or the f32 rows [T*k, N]. */
template <int EPI, int N8>
static __device__ __forceinline__ void tw_gg_epilogue(const tw_gg_args_t &p,
                                                      const float (&acc)[N8][4], int e, int rows,
                                                      int off, int nw) {
  const int N = p.N, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float *bias = p.bias + (int64_t)e * N;
  /* this thread's two bias values, read once before the stores (the float
   * output may alias the bias as far as the compiler knows: read inside the
   * loop, each would wait for the previous store) */
  const int i = nw / 2 + g, n = nw + g;
  float b0 = 0.0f, b1 = 0.0f;
  if (EPI == TW_GG_SWIGLU) {
    if (2 * i < N) b0 = __ldg(bias + 2 * i), b1 = __ldg(bias + 2 * i + 1);
  } else {
    if (n < N) b0 = __ldg(bias + n);
    if (n + 8 < N) b1 = __ldg(bias + n + 8);
  }
#pragma unroll
  for (int j = 0; j < N8; j++)
#pragma unroll
    for (int c = 0; c < 2; c++) {
      const int m = j * 8 + 2 * t + c;
      if (m >= rows) continue;
      const int64_t prow = off + m;
      if (EPI == TW_GG_SWIGLU) {
        if (2 * i >= N) continue;
        reinterpret_cast<__nv_bfloat16 *>(p.out)[prow * (N / 2) + i] =
            __float2bfloat16(tw_swiglu(acc[j][c] + b0, acc[j][2 + c] + b1, p.alpha, p.limit));
      } else {
        float *y = reinterpret_cast<float *>(p.out) + prow * N;
        if (n < N) y[n] = acc[j][c] + b0;
        if (n + 8 < N) y[n + 8] = acc[j][2 + c] + b1;
      }
    }
}

/* The grouped GEMM kernel (see the file comment). FMT: TW_GG_MXFP4 or
 * TW_GG_BF16 weights; EPI: TW_GG_SWIGLU or TW_GG_PLAIN; BT: assignment rows
 * per CTA (the wgmma N: 16, 32, 64 or 128). A tile of BT rows reads its
 * expert's 128 weight rows once, so the smaller BT the less tensor work is
 * padding when experts hold few tokens (decode), at the price of reading a
 * busy expert's weights once per BT of its tokens. */
template <int FMT, int EPI, int BT>
static __global__ void __launch_bounds__(TW_GG_THREADS, 2) tw_gg_kernel(const tw_gg_args_t p) {
  constexpr int NT = TW_GG_THREADS, BW = TW_GG_BW, S = TW_GG_STAGES(FMT, BT);
  constexpr int LUT = FMT == TW_GG_MXFP4 ? TW_GG_LUT_BYTES : 0;
  /* 16-byte chunks of a stage's BT x 64 assignment rows per thread (BT = 16:
   * half the threads copy one) */
  constexpr int N8 = BT / 8, XCH = (BT * 8 + NT - 1) / NT;
  constexpr int RROW = FMT == TW_GG_MXFP4 ? 32 : 128, RST = BW * RROW;
  extern __shared__ __align__(1024) uint8_t tw_gg_smem[];
  __shared__ int s_tile[4];
  TW_PDL_WAIT();
  uint32_t *sL = reinterpret_cast<uint32_t *>(
      tw_gg_smem + ((1024 - (tw_smem_u32(tw_gg_smem) & 1023)) & 1023));
  uint8_t *sX = reinterpret_cast<uint8_t *>(sL) + LUT;
  uint8_t *sR = sX + S * BT * 128;
  uint8_t *sS = sR + S * RST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (FMT == TW_GG_MXFP4) tw_gg_build_lut(sL, NT);
  if (warp == 0) tw_gg_find_tile(p, BT, lane, s_tile);
  __syncthreads();
  const int e = s_tile[0];
  if (e < 0) return; /* spare CTA of the upper-bound grid */
  const int m0 = s_tile[1], rows = min(BT, s_tile[2] - m0), off = s_tile[3] + m0;
  const int N = p.N, K = p.K, KT = (K + 63) / 64, KB = K / 32, KBP = KB + 1;
  const int n0 = blockIdx.x * BW;
  /* global weight row of CTA row cr = 16 w + r */
  auto grow = [&](int cr) {
    if (EPI == TW_GG_SWIGLU) {
      const int i = n0 / 2 + 8 * (cr >> 4) + (cr & 7);
      return 2 * i + ((cr >> 3) & 1);
    }
    return n0 + cr;
  };
  if (FMT == TW_GG_MXFP4) tw_gg_load_scales(p, e, BW, grow, sS, NT);

  /* The copies of a stage. Everything but the k-tile is computed here once
   * (the main loop is bound by instructions when experts hold few tokens:
   * per k-tile a copy is a shared offset plus a stage base, a source pointer
   * plus the k offset, and a byte count of 16 or 0 that zero-fills), so the
   * loop carries no 64-bit address arithmetic, modulo or branch per copy.
   * Assignment rows: chunk c = tid + NT i of a stage is row c / 8, 16-byte
   * chunk c % 8; a row past the expert's count is zero-filled, a row past
   * BT (BT = 16: the rows run out before the threads) is not copied. */
  const int xch = tid & 7;
  const __nv_bfloat16 *xsrc[XCH];
  uint32_t xdst[XCH], xok = 0, xin = 0;
#pragma unroll
  for (int i = 0; i < XCH; i++) {
    const int r = (tid >> 3) + NT / 8 * i;
    const bool in = r < BT, ok = in && r < rows;
    int64_t row = off + r;
    if (ok && p.sorted) row = p.sorted[row] / p.k_top;
    xsrc[i] = ok ? p.a + row * K + xch * 8 : p.a;
    xdst[i] = tw_swz(in ? r : 0, xch);
    xok |= (uint32_t)ok << i;
    xin |= (uint32_t)in << i;
  }
  const int xkt = (K - xch * 8 + 63) / 64; /* k-tiles whose chunk xch is inside K */
  /* raw weights: warp w copies its 16 rows. MXFP4: lane l = row l/2, block
   * half l%2, stored at half ^ ((row >> 2) & 1) (conflict-free fragment
   * reads); bf16: 4 chunks per lane in the swizzled 64-wide layout. */
  constexpr int WCH = FMT == TW_GG_MXFP4 ? 1 : 4;
  const uint8_t *wsrc[WCH];
  uint32_t wdst[WCH];
  int wkt; /* k-tiles whose weight chunk is inside K */
  if (FMT == TW_GG_MXFP4) {
    const int r = lane >> 1, h = lane & 1, gr = min(grow(16 * warp + r), N - 1);
    wsrc[0] = p.wq + tw_mx_row(e, gr, N, K) + h * 16; /* packed (moe.h TW_MX_CHUNK) */
    wdst[0] = 16 * warp * RROW + r * 32 + ((h ^ ((r >> 2) & 1)) * 16);
    wkt = (KB - h + 1) / 2;
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int c = lane + 32 * i, gr = min(grow(16 * warp + (c >> 3)), N - 1);
      wsrc[i] = reinterpret_cast<const uint8_t *>(p.wh + ((int64_t)e * N + gr) * K + (c & 7) * 8);
      wdst[i] = 16 * warp * RROW + tw_swz(c >> 3, c & 7);
    }
    wkt = (K - (lane & 7) * 8 + 63) / 64;
  }
  const uint32_t sX_u = tw_smem_u32(sX), sR_u = tw_smem_u32(sR);
  auto load_stage = [&](int kt, int st) {
    const uint32_t x_st = sX_u + st * (BT * 128);
#pragma unroll
    for (int i = 0; i < XCH; i++)
      tw_cp_async16_if(x_st + xdst[i], xsrc[i] + kt * 64,
                       ((xok >> i) & 1) && kt < xkt ? 16 : 0, (xin >> i) & 1);
    const uint32_t r_st = sR_u + st * RST;
    const int wn = kt < wkt ? 16 : 0;
#pragma unroll
    for (int i = 0; i < WCH; i++)
      tw_cp_async16_if(r_st + wdst[i],
                       wsrc[i] + (FMT == TW_GG_MXFP4
                                      ? (kt >> 1) * tw_mx_cstride(N) + (kt & 1) * 32
                                      : (int64_t)kt * 128),
                       wn, true);
  };
  /* this warp's A fragments of k-tile kt (4 k16 steps) from raw stage st */
  const uint32_t lut_lane = tw_smem_u32(sL) + 4 * lane; /* entry b of this lane: + 128 b */
  auto fragments = [&](int kt, int st, uint32_t (&af)[4][4]) {
    const uint8_t *rb = sR + st * RST + 16 * warp * RROW;
    if (FMT == TW_GG_MXFP4) {
      const int sw = (g >> 2) & 1; /* rows g and g + 8 share it */
      const uint32_t sel = 0x4440u | (uint32_t)t; /* byte t to the low byte, zeros above */
#pragma unroll
      for (int hr = 0; hr < 2; hr++) { /* row g, then g + 8 */
        const int r = g + 8 * hr, cr = 16 * warp + r;
#pragma unroll
        for (int h = 0; h < 2; h++) { /* words 0-3 (steps 0, 1), 4-7 (steps 2, 3) */
          tw_gg_cvt_half(lut_lane, sel, *reinterpret_cast<const uint4 *>(rb + r * 32 + ((h ^ sw) * 16)),
                         sS[cr * KBP + 2 * kt + h], h, hr, af);
        }
      }
    } else {
      const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int s = 0; s < 4; s++)
        tw_ldmatrix_x4(af[s], tw_smem_u32(rb) + tw_swz(r, 2 * s + (lane >> 4)));
    }
  };

  float acc[N8][4];
#pragma unroll
  for (int j = 0; j < N8; j++)
#pragma unroll
    for (int q = 0; q < 4; q++) acc[j][q] = 0.f;
  /* each k-tile completes its wgmma before the next fragments are made
   * (see the file comment: C7513). With S >= 5 stages the loop takes the
   * k-tiles two at a time (PAIR): one wait for the copies, one barrier, the
   * fragments of both tiles (independent chains the scheduler interleaves),
   * eight wgmma and one wait for them, so the per-tile barrier and wgmma
   * latency are paid once per 128 k; the prefetch depth is S - 2 tiles. */
  constexpr bool PAIR = S >= 5;
  constexpr int PRE = PAIR ? S - 2 : S - 1; /* tiles in flight ahead of the one computed */
  uint32_t af[4][4], af2[4][4];
#pragma unroll
  for (int s = 0; s < PRE; s++) {
    if (s < KT) load_stage(s, s);
    tw_cp_async_commit();
  }
  /* the B descriptor of stage st, k16 step s: the base's plus (st BT 128 +
   * 32 s) / 16 (the address field, bits 0-13, never carries: shared memory
   * ends below 256 KB) */
  const uint64_t xd0 = tw_wgmma_desc(sX_u);
  constexpr int GQ = N8 / 4 > 0 ? N8 / 4 : 1; /* n8 tiles of a quarter tile */
  constexpr int W2 = 2 * GQ < N8 ? 2 * GQ : N8, W3 = 3 * GQ < N8 ? 3 * GQ : N8;
  const int nq = (rows + 8 * GQ - 1) / (8 * GQ);
  auto nxt = [](int x) { return x + 1 == S ? 0 : x + 1; };
  int st = 0, lst = PRE; /* the stage computed, the stage loaded next */
  for (int kt = 0; kt < KT; kt += PAIR ? 2 : 1) {
    tw_cp_async_wait<PAIR ? S - 4 : S - 2>(); /* tile kt (and kt + 1): this thread's copies */
    tw_fence_proxy_async();    /* cp.async data -> wgmma operand reads */
    __syncthreads();           /* everyone's copies; the last wgmma done everywhere */
    if (kt + PRE < KT) load_stage(kt + PRE, lst);
    tw_cp_async_commit();
    lst = nxt(lst);
    if (PAIR) {
      if (kt + PRE + 1 < KT) load_stage(kt + PRE + 1, lst);
      tw_cp_async_commit();
      lst = nxt(lst);
    }
    const bool two = PAIR && kt + 1 < KT;
    fragments(kt, st, af);
    const uint64_t xd = xd0 + (uint64_t)(st * (BT * 128 / 16));
    st = nxt(st);
    tw_reg_fence(acc);
    /* the tile's rows rounded up to a quarter of BT (at least 8): the wgmma
     * N, so a tile whose expert holds fewer than BT rows does not multiply
     * the zero rows (a uniform branch) */
    if (two) {
      fragments(kt + 1, st, af2);
      const uint64_t xd2 = xd0 + (uint64_t)(st * (BT * 128 / 16));
      st = nxt(st);
      tw_reg_fence(acc);
      tw_by_quarters<GQ, W2, W3, N8>(nq, [&](auto w8) {
        tw_gg_wgmma8<decltype(w8)::value>(acc, af, af2, xd, xd2);
      });
    } else {
      tw_by_quarters<GQ, W2, W3, N8>(
          nq, [&](auto w8) { tw_gg_wgmma4<decltype(w8)::value>(acc, af, xd); });
    }
    tw_reg_fence(acc);
    tw_wgmma_wait0();
    tw_reg_fence(acc);
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
      for (int q = 0; q < 4; q++) {
        asm volatile("" : "+r"(af[s][q])::"memory");
        asm volatile("" : "+r"(af2[s][q])::"memory");
      }
  }

  tw_gg_epilogue<EPI>(p, acc, e, rows, off, n0 + 16 * warp);
}

/* Dynamic shared memory: the MXFP4 conversion table (TW_GG_LUT_BYTES), S
 * stages of [bt rows][64] bf16 assignment rows and raw weights ([128 rows][32
 * bytes] MXFP4, [128][64] bf16), the MXFP4 scales [128][K/32 + 1], and 1024
 * bytes of slack for the swizzle alignment. */
static size_t tw_gg_smem_bytes(int fmt, int bt, int K) {
  size_t kbp = (size_t)K / 32 + 1;
  return 1024 + (size_t)TW_GG_STAGES(fmt, bt) * ((size_t)bt * 128 +
                                                 (size_t)TW_GG_BW * (fmt == TW_GG_MXFP4 ? 32 : 128)) +
         (fmt == TW_GG_MXFP4 ? (size_t)TW_GG_BW * kbp + TW_GG_LUT_BYTES : 0);
}
typedef void (*tw_gg_fn)(const tw_gg_args_t);
template <int BT>
static tw_gg_fn tw_gg_pick_bt(int fmt, int epi) {
  if (fmt == TW_GG_MXFP4)
    return epi == TW_GG_SWIGLU ? tw_gg_kernel<TW_GG_MXFP4, TW_GG_SWIGLU, BT>
                               : tw_gg_kernel<TW_GG_MXFP4, TW_GG_PLAIN, BT>;
  return epi == TW_GG_SWIGLU ? tw_gg_kernel<TW_GG_BF16, TW_GG_SWIGLU, BT>
                             : tw_gg_kernel<TW_GG_BF16, TW_GG_PLAIN, BT>;
}
static tw_gg_fn tw_gg_pick(int fmt, int epi, int bt) {
  switch (bt) {
  case 16: return tw_gg_pick_bt<16>(fmt, epi);
  case 32: return tw_gg_pick_bt<32>(fmt, epi);
  case 64: return tw_gg_pick_bt<64>(fmt, epi);
  default: return tw_gg_pick_bt<128>(fmt, epi);
  }
}

/* ---- decode kernel: mma.sync, MXFP4 converted in registers once per CTA ----
 *
 * For assignment tiles of few rows (decode) the wgmma kernel above is bound
 * by instructions and per-k-tile latency, not by bytes (docs/benchmarks.md):
 * its register-A wgmma is serialised by ptxas (C7513) and waited for every
 * k-tile. This variant (TWAIN_CUDA_MOE_MMA, tw_cuda_moe_set_mma_tiles) keeps
 * the grid, the tile rule and the epilogues, and changes the inner loop:
 *
 * - A CTA is 4 warps; warp w owns CTA rows 32 w .. 32 w + 31 (two m16 tiles,
 *   the row order of grow() above) and all BT assignment rows, as n8 tiles of
 *   mma.sync m16n8k16 (bf16 in, f32 accumulators): each weight is converted
 *   once per CTA and used for every token of the tile; n8 tiles past the
 *   tile's rows are skipped (padding costs at most 7 columns, not BT - rows).
 * - K in steps of 128: a stage holds 64 bytes of each of the 128 weight rows
 *   (4 MXFP4 blocks) and BT x 128 bf16 assignment values, copied by cp.async
 *   TW_GM_STAGES deep; one CTA barrier per step.
 * - Lane (g, t) reads block t of its rows g and g + 8 (one 16-byte load per
 *   row and step) and turns each 32-bit word (E2M1 values v0..v7) into four
 *   bf16x2 registers (v_i, v_i+4), i = 0..3, by shifts, masks and one
 *   integer multiply (3-4 instructions a pair, no table): the bits
 *   (n & 7) << 6 | (n & 8) << 12 are the FP4 value times 2^-126 (E2M1 with
 *   e = 0 lands on the bf16 subnormals), and one bf16x2 multiply by
 *   2^(s - 1) (the E8M0 scale 2^(s - 127) times 2^126) gives the same exact
 *   bf16 weight as tw_mxfp4_dequant (scales above 2^1 take two multiplies).
 *   Word j of the block feeds k-steps 2j and 2j + 1; the k order inside an
 *   mma is a permutation, the same for both operands: the assignment rows are
 *   stored with each group of 8 values reordered to (v0, v4, v1, v5, v2, v6,
 *   v3, v7), so one 16-byte load gives the B registers of two steps. gate_up
 *   reads them from a gathered, reordered copy of its token rows
 *   (tw_gm_gather_kernel, in the expert-output buffer, which down overwrites
 *   later); its SwiGLU epilogue writes the activations in that order for down.
 * - Token rows in a stage are 256 bytes; chunk c of row r is stored at
 *   c ^ ((c >> 3) << 1) ^ (r & 1), so the 8 lanes of a quarter warp (two
 *   rows, four chunks 4 t + j) hit 8 different 16-byte bank groups. */
#define TW_GM_THREADS 128 /* 4 warps x 32 weight rows = TW_GG_BW */
#define TW_GM_STAGES(bt) ((bt) <= 16 ? 4 : (bt) <= 64 ? 3 : 2)

/* The four bf16x2 pairs (v_i, v_i+4), i = 0..3, of the eight E2M1 values of
 * w (v_j in bits 4j..4j+3), each value as the bf16 bits
 * (n & 7) << 6 | (n & 8) << 12 = the FP4 value times 2^-126. The multiplies
 * add two shifted copies of masked nibbles that never overlap. */
static __device__ __forceinline__ void tw_gm_fp4x8(uint32_t w, uint32_t r[4]) {
  r[0] = ((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;       /* v0, v4: << 6 and << 12 */
  r[1] = ((w & 0x00F000F0u) * 0x104u) & 0x81C081C0u;        /* v1, v5: << 2 and << 8 */
  r[2] = (((w >> 2) & 0x03C003C0u) * 0x41u) & 0x81C081C0u;  /* v2, v6: >> 2 and << 4 */
  r[3] = (w & 0x80008000u) | ((w >> 6) & 0x01C001C0u);      /* v3, v7: sign in place */
}
static __device__ __forceinline__ uint32_t tw_gm_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<__nv_bfloat162 *>(&a), *reinterpret_cast<__nv_bfloat162 *>(&b));
  return *reinterpret_cast<uint32_t *>(&r);
}
/* Eight bf16 values (v0..v7 as four bf16x2 words) in the B order (v0, v4),
 * (v1, v5), (v2, v6), (v3, v7). */
static __device__ __forceinline__ uint4 tw_gm_perm8(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}
/* Where value i of a row sits in that order. */
static __device__ __forceinline__ int tw_gm_pos(int i) {
  return (i & ~7) | ((i & 3) << 1) | ((i >> 2) & 1);
}
/* 16-byte chunk c (0..15) of token row r in a stage, as a chunk index. */
static __device__ __forceinline__ int tw_gm_xswz(int c, int r) {
  return c ^ (((c >> 3) & 1) << 1) ^ (r & 1);
}

/* xg[p] = x[sorted[p] / k], each group of 8 values in the B order (PERM)
 * or as they are; rows of h8 16-byte chunks. */
template <bool PERM>
static __global__ void tw_gm_gather_kernel(const uint4 *__restrict__ x,
                                           const int32_t *__restrict__ sorted, int k, int h8,
                                           int tk, uint4 *__restrict__ xg) {
  TW_PDL_WAIT();
  const int64_t n = (int64_t)tk * h8;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t pr = i / h8;
    const int c = (int)(i - pr * h8);
    const uint4 v = x[(int64_t)(sorted[pr] / k) * h8 + c];
    xg[i] = PERM ? tw_gm_perm8(v) : v;
  }
}

/* The decode grouped GEMM (see above). EPI: TW_GG_SWIGLU (act in the B
 * order) or TW_GG_PLAIN; BT: assignment rows per CTA (16, 32, 64, 128);
 * p.a: the assignment rows in the B order (p.sorted unused), MXFP4 weights. */
template <int EPI, int BT>
static __global__ void __launch_bounds__(TW_GM_THREADS, BT <= 32 ? 3 : 2)
    tw_gm_kernel(const tw_gg_args_t p) {
  constexpr int NT = TW_GM_THREADS, BW = TW_GG_BW, S = TW_GM_STAGES(BT), NJ = BT / 8;
  constexpr int WST = BW * 64;  /* weight bytes of a stage: 128 rows x 4 blocks */
  constexpr int XST = BT * 256; /* token bytes of a stage: BT rows x 128 bf16 */
  constexpr int XCH = BT / 8;   /* token chunks per thread and stage (16 per row) */
  extern __shared__ __align__(16) uint8_t tw_gm_smem[];
  __shared__ int s_tile[4];
  TW_PDL_WAIT();
  uint8_t *sW = tw_gm_smem, *sX = sW + S * WST, *sS = sX + S * XST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (warp == 0) tw_gg_find_tile(p, BT, lane, s_tile);
  __syncthreads();
  const int e = s_tile[0];
  if (e < 0) return; /* spare CTA of the upper-bound grid */
  const int m0 = s_tile[1], rows = min(BT, s_tile[2] - m0), off = s_tile[3] + m0;
  const int rows8 = (rows + 7) & ~7; /* token rows copied (the rest of the last n8 tile zeroed) */
  const int N = p.N, K = p.K, KB = K / 32, KT = tw_mx_chunks(K), KBP = 4 * (KT | 1);
  const int n0 = blockIdx.x * BW;
  auto grow = [&](int cr) { /* global weight row of CTA row cr, as tw_gg_kernel */
    if (EPI == TW_GG_SWIGLU) {
      const int i = n0 / 2 + 8 * (cr >> 4) + (cr & 7);
      return 2 * i + ((cr >> 3) & 1);
    }
    return n0 + cr;
  };
  /* copies: weight chunk wc of CTA rows tid / 4 + 32 q; token chunk xc of
   * rows tid / 16 + 8 i */
  const int wc = tid & 3, xc = tid & 15;
  const uint8_t *wsrc[4];
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const int gr = min(grow((tid >> 2) + 32 * q), N - 1);
    wsrc[q] = p.wq + tw_mx_row(e, gr, N, K) + wc * 16; /* packed (moe.h TW_MX_CHUNK) */
  }
  const __nv_bfloat16 *xsrc = p.a + (int64_t)(off + (tid >> 4)) * K + xc * 8;
  auto load_stage = [&](int kt, int st) {
    const uint32_t w_st = tw_smem_u32(sW + st * WST) + (tid >> 2) * 64 + wc * 16;
    const bool wok = 4 * kt + wc < KB;
#pragma unroll
    for (int q = 0; q < 4; q++)
      tw_cp_async16(w_st + 32 * 64 * q, wok ? wsrc[q] + kt * tw_mx_cstride(N) : (const uint8_t *)p.wq,
                    wok);
    const uint32_t x_st = tw_smem_u32(sX + st * XST);
    const bool kok = kt * 128 + xc * 8 < K;
#pragma unroll
    for (int i = 0; i < XCH; i++) {
      const int r = (tid >> 4) + 8 * i;
      if (r >= rows8) break; /* rows8 is a multiple of 8: the same for the whole pass */
      const bool ok = kok && r < rows;
      tw_cp_async16(x_st + r * 256 + tw_gm_xswz(xc, r) * 16,
                    ok ? xsrc + (int64_t)8 * i * K + kt * 128 : p.a, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < S - 1; s++) {
    if (s < KT) load_stage(s, s);
    tw_cp_async_commit();
  }
  /* the CTA's E8M0 scales [128][KBP] (pad columns: 127, i.e. 1, read only
   * against zero-filled weights), loaded while the first stages are in flight */
  for (int r = warp; r < BW; r += NT / 32) {
    const uint8_t *src = p.ws + ((int64_t)e * N + min(grow(r), N - 1)) * KB;
#pragma unroll 4
    for (int b = lane; b < KBP; b += 32) sS[r * KBP + b] = b < KB ? src[b] : (uint8_t)127;
  }

  float acc[2][NJ][4];
  tw_acc_zero(acc);
  const int rowA = 32 * warp + g; /* CTA row of fragment row g of m-tile 0 */
  for (int kt = 0; kt < KT; kt++) {
    const int st = kt % S;
    tw_cp_async_wait<S - 2>(); /* stage kt: this thread's copies */
    __syncthreads();           /* everyone's copies (and the scales); stage kt - 1 is free */
    if (kt + S - 1 < KT) load_stage(kt + S - 1, (kt + S - 1) % S);
    tw_cp_async_commit();
    const uint8_t *wst = sW + st * WST, *xst = sX + st * XST;
    uint32_t raw[2][2][4], m1[2][2], sc[2][2];
    bool big = false;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++) { /* fragment rows g (h = 0) and g + 8 */
        const int cr = rowA + 16 * mt + 8 * h;
        const uint4 v = *reinterpret_cast<const uint4 *>(wst + cr * 64 + t * 16);
        raw[mt][h][0] = v.x;
        raw[mt][h][1] = v.y;
        raw[mt][h][2] = v.z;
        raw[mt][h][3] = v.w;
        const uint32_t s = sS[cr * KBP + 4 * kt + t];
        sc[mt][h] = s;
        big |= s > 128;
        /* bf16x2 2^(s - 1) (exponent field s + 126); above s = 128: 2^126, then 2^(s - 127) */
        m1[mt][h] = s > 128 ? 0x7E807E80u : ((s + 126u) << 7) * 0x10001u;
      }
    const bool any_big = __any_sync(0xffffffffu, big);
#pragma unroll
    for (int w = 0; w < 4; w++) { /* word w of the block: k-steps 2w and 2w + 1 */
      uint32_t a[2][2][4];          /* [m-tile][step][A register] */
#pragma unroll
      for (int mt = 0; mt < 2; mt++) {
        uint32_t lo[4], hi[4];
        tw_gm_fp4x8(raw[mt][0][w], lo);
        tw_gm_fp4x8(raw[mt][1][w], hi);
#pragma unroll
        for (int i = 0; i < 4; i++) {
          lo[i] = tw_gm_mul(lo[i], m1[mt][0]);
          hi[i] = tw_gm_mul(hi[i], m1[mt][1]);
        }
        if (any_big) {
          const uint32_t b0 = sc[mt][0] > 128 ? (sc[mt][0] << 7) * 0x10001u : 0x3F803F80u;
          const uint32_t b1 = sc[mt][1] > 128 ? (sc[mt][1] << 7) * 0x10001u : 0x3F803F80u;
#pragma unroll
          for (int i = 0; i < 4; i++) {
            lo[i] = tw_gm_mul(lo[i], b0);
            hi[i] = tw_gm_mul(hi[i], b1);
          }
        }
        /* step 2w: pairs 0 (k 2t..) and 1 (k 2t + 8..); step 2w + 1: pairs 2, 3 */
        a[mt][0][0] = lo[0];
        a[mt][0][1] = hi[0];
        a[mt][0][2] = lo[1];
        a[mt][0][3] = hi[1];
        a[mt][1][0] = lo[2];
        a[mt][1][1] = hi[2];
        a[mt][1][2] = lo[3];
        a[mt][1][3] = hi[3];
      }
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        if (8 * j >= rows) break; /* the same for the whole CTA */
        const int r = 8 * j + g;
        const uint4 b =
            *reinterpret_cast<const uint4 *>(xst + r * 256 + tw_gm_xswz(4 * t + w, r) * 16);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          tw_mma16816(acc[mt][j], a[mt][0], b.x, b.y);
          tw_mma16816(acc[mt][j], a[mt][1], b.z, b.w);
        }
      }
    }
  }

  /* Epilogue: acc[mt][j] = (fragment rows g, g + 8 of m-tile 2 warp + mt) x
   * (assignments 8 j + 2 t, + 1 of the tile). */
  const float *bias = p.bias + (int64_t)e * N;
#pragma unroll
  for (int mt = 0; mt < 2; mt++) {
    const int mi = 2 * warp + mt;
    if (EPI == TW_GG_SWIGLU) {
      const int i = n0 / 2 + 8 * mi + g;
      if (2 * i >= N) continue;
      const float bg = bias[2 * i], bl = bias[2 * i + 1];
      const int pi = tw_gm_pos(i);
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const int m = 8 * j + 2 * t + c;
          if (m >= rows) continue;
          reinterpret_cast<__nv_bfloat16 *>(p.out)[(int64_t)(off + m) * (N / 2) + pi] =
              __float2bfloat16(tw_swiglu(acc[mt][j][c] + bg, acc[mt][j][2 + c] + bl, p.alpha,
                                         p.limit));
        }
    } else {
      const int n = n0 + 16 * mi + g;
      const float b0 = n < N ? bias[n] : 0.f, b8 = n + 8 < N ? bias[n + 8] : 0.f;
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const int m = 8 * j + 2 * t + c;
          if (m >= rows) continue;
          float *y = reinterpret_cast<float *>(p.out) + (int64_t)(off + m) * N;
          if (n < N) y[n] = acc[mt][j][c] + b0;
          if (n + 8 < N) y[n + 8] = acc[mt][j][2 + c] + b8;
        }
    }
  }
}

/* Dynamic shared memory of tw_gm_kernel: S stages of 128 x 64 weight bytes
 * and bt x 256 token bytes, then the scales [128][4 (KT | 1)]. */
static size_t tw_gm_smem_bytes(int bt, int K) {
  const size_t kt = (size_t)tw_mx_chunks(K);
  return (size_t)TW_GM_STAGES(bt) * ((size_t)TW_GG_BW * 64 + (size_t)bt * 256) +
         (size_t)TW_GG_BW * 4 * (kt | 1);
}
static tw_gg_fn tw_gm_pick(int epi, int bt) {
  switch (bt) {
  case 16: return epi == TW_GG_SWIGLU ? tw_gm_kernel<TW_GG_SWIGLU, 16> : tw_gm_kernel<TW_GG_PLAIN, 16>;
  case 32: return epi == TW_GG_SWIGLU ? tw_gm_kernel<TW_GG_SWIGLU, 32> : tw_gm_kernel<TW_GG_PLAIN, 32>;
  case 64: return epi == TW_GG_SWIGLU ? tw_gm_kernel<TW_GG_SWIGLU, 64> : tw_gm_kernel<TW_GG_PLAIN, 64>;
  default: return epi == TW_GG_SWIGLU ? tw_gm_kernel<TW_GG_SWIGLU, 128> : tw_gm_kernel<TW_GG_PLAIN, 128>;
  }
}

/* Which assignment tiles take tw_gm_kernel: a mask, the OR of the tile sizes
 * (16 | 32 | 64 | 128), from TWAIN_CUDA_MOE_MMA (read once: "all", or a
 * comma list such as "16,32"; unset, empty or "0": none) unless
 * tw_cuda_moe_set_mma_tiles set it. */
static int tw_gm_mask = -1;
static uint32_t tw_gm_tiles(void) {
  if (tw_gm_mask < 0) {
    const char *v = tw_cuda_knobs()->moe_mma;
    uint32_t m = 0;
    while (v && *v) {
      char *end = NULL;
      if (!strncmp(v, "all", 3)) {
        m |= 16 | 32 | 64 | 128;
        end = (char *)v + 3;
      } else {
        const long b = strtol(v, &end, 10);
        if (end == v) break;
        if (b == 16 || b == 32 || b == 64 || b == 128) m |= (uint32_t)b;
      }
      v = *end == ',' ? end + 1 : end;
      if (*end && *end != ',') break;
    }
    tw_gm_mask = (int)m;
  }
  return (uint32_t)tw_gm_mask;
}
extern "C" uint32_t tw_cuda_moe_mma_tiles(void) { return tw_gm_tiles(); }
extern "C" void tw_cuda_moe_set_mma_tiles(uint32_t tiles) {
  tw_gm_mask = (int)(tiles & (16 | 32 | 64 | 128));
}

/* ---- streaming decode kernel: per-warp weight pipelines, no barriers ----
 *
 * For the decode loads (the 16-row assignment tile: an expert holds a few
 * tokens) the two kernels above stage every weight k-tile through shared
 * memory behind a CTA barrier and spend most of their instructions on it
 * (Nsight Compute, 20b gate_up at 64 tokens: 6.8 instructions per weight,
 * 0.66 issued per cycle per scheduler; docs/benchmarks.md). Here every warp
 * is its own pipeline: it owns 32 weight rows (two m16 tiles) of one expert
 * at a time, copies lane (g, t)'s MXFP4 block 4c + t of its rows g, g + 8,
 * g + 16, g + 24 for k-chunk c (128 k) with cp.async into its private
 * shared-memory stages (three: two chunks in flight while one is computed),
 * reads back only its own 16-byte pieces (so no barrier at all), converts
 * them with one lookup per two weights in a 64 KB per-lane table whose
 * address is one byte permute (entry v at 256 v + 4 lane), multiplies by the
 * block's scale and feeds mma.sync m16n8k16 with the token rows as B.
 * The K order inside a chunk is permuted so that each lane's A values are its
 * own block: mma step j of chunk c takes, for lane t, k = 128 c + 32 t + 4 j
 * + {0, 1} (a0, a1) and + {2, 3} (a2, a3), and the B fragment holds the same
 * k of the token rows (8 contiguous bytes, read through L1). Tokens beyond
 * the expert's load and k beyond K read as zero.
 * Work is (expert, 32-row slice) items taken by the warps of a persistent
 * grid (one CTA of 16 warps per SM) in turn, over the experts that hold
 * tokens only (the route's active list), so the tail of an uneven grid is one
 * item, not a CTA wave. An expert with
 * more than 16 assignments is done in passes of 16 (its weights read once per
 * pass). */
/* warps per CTA: 16 (one CTA per SM: one table, and the L1 left beside 160
 * KB of shared memory keeps the token rows) or 8 (two CTAs per SM);
 * TWAIN_CUDA_MOE_STREAM_WARPS picks (knobs.h; default 16) */
#define TW_GS_STAGES 3
#define TW_GS_LUT_BYTES (256 * 256)
#define TW_GS_STAGE_BYTES (4 * 32 * 16) /* one warp: 4 rows x 32 lanes x 16 bytes */
/* the table, the warps' stages, then the tiled order's prefix over the
 * active experts (up to TW_GS_PRE - 1 of them; two CTAs of 8 warps still
 * fit in an SM's 228 KB with the driver's 1 KB each) */
#define TW_GS_PRE 256
/* the last round's pieces: at most this many times its units (about as
 * many pieces a unit; ranges need not meet the units' ends, so one more at
 * times) */
#define TW_GS_PIECES 8
#define TW_GS_SMEM(warps) \
  (TW_GS_LUT_BYTES + (warps) * TW_GS_STAGES * TW_GS_STAGE_BYTES + 4 * TW_GS_PRE)

/* The pair of bf16 weights of byte `b` (0..3) of `word` times the scale s2;
 * lane4 = 4 * lane: the table entry is one byte permute away. */
template <int B>
static __device__ __forceinline__ uint32_t tw_gs_cvt(const uint8_t *lut, uint32_t word,
                                                     uint32_t lane4, __nv_bfloat162 s2) {
  const uint32_t off = __byte_perm(word, lane4, 0x7604u | (B << 4)); /* byte B << 8 | lane4 */
  const uint32_t v = *reinterpret_cast<const uint32_t *>(lut + off);
  __nv_bfloat162 o = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&v), s2);
  return *reinterpret_cast<uint32_t *>(&o);
}
static __device__ __forceinline__ uint32_t tw_u4(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* The eight mma steps of one 128-k chunk of a warp's 32 rows (both
 * streaming kernels): W[q], this lane's 16-byte MXFP4 block of row piece q
 * (SwiGLU: gate rows 2 mt, linear rows 2 mt + 1), s2[q] its scale; b(nt,
 * wd) gives the token rows' 16-byte piece wd of n8 tile nt (fetched at the
 * even steps). FENCE: keep the table lookups of later steps from being
 * hoisted (tw_gs_kernel: the registers they would hold spill, measured by
 * ptxas). */
template <int NT, bool FENCE, typename GetB>
static __device__ __forceinline__ void tw_gs_chunk(const uint8_t *lut, uint32_t lane4,
                                                   const uint4 (&W)[4],
                                                   const __nv_bfloat162 (&s2)[4],
                                                   float (&acc)[2][NT][4], GetB b) {
  uint4 Bv[NT];
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const int wd = j >> 1;
    if (!(j & 1)) /* the token rows' k of steps 2 wd, 2 wd + 1 */
#pragma unroll
      for (int nt = 0; nt < NT; nt++) Bv[nt] = b(nt, wd);
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      uint32_t a[4];
      const uint32_t w0 = tw_u4(W[2 * mt], wd), w1 = tw_u4(W[2 * mt + 1], wd);
      if (j & 1) {
        a[0] = tw_gs_cvt<2>(lut, w0, lane4, s2[2 * mt]);
        a[1] = tw_gs_cvt<2>(lut, w1, lane4, s2[2 * mt + 1]);
        a[2] = tw_gs_cvt<3>(lut, w0, lane4, s2[2 * mt]);
        a[3] = tw_gs_cvt<3>(lut, w1, lane4, s2[2 * mt + 1]);
      } else {
        a[0] = tw_gs_cvt<0>(lut, w0, lane4, s2[2 * mt]);
        a[1] = tw_gs_cvt<0>(lut, w1, lane4, s2[2 * mt + 1]);
        a[2] = tw_gs_cvt<1>(lut, w0, lane4, s2[2 * mt]);
        a[3] = tw_gs_cvt<1>(lut, w1, lane4, s2[2 * mt + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        tw_mma16816(acc[mt][nt], a, tw_u4(Bv[nt], 2 * (j & 1)), tw_u4(Bv[nt], 2 * (j & 1) + 1));
    }
    if (FENCE && (j & 1)) asm volatile("" ::: "memory");
  }
}

/* The output of a warp's 32 rows r0.. of expert e for assignments [base,
 * base + 8 NT) (those < ne), rows off + m of out (both streaming kernels):
 * SwiGLU(acc + bias) as bf16, or acc + bias as f32; with p.ks > 1 (plain
 * only) added with atomicAdd, the bias with the first K part (cb == 0). */
template <int EPI, int NT>
static __device__ __forceinline__ void tw_gs_store(const tw_gg_args_t &p,
                                                   const float (&acc)[2][NT][4], int e, int ne,
                                                   int off, int base, int r0, int cb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, N = p.N;
  const float *bias = p.bias + (int64_t)e * N;
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int m = base + nt * 8 + 2 * t + c;
        if (m >= ne) continue;
        const int64_t prow = off + m;
        if (EPI == TW_GG_SWIGLU) {
          const int i = (r0 + 16 * mt) / 2 + g;
          if (2 * i >= N) continue;
          reinterpret_cast<__nv_bfloat16 *>(p.out)[prow * (N / 2) + i] =
              __float2bfloat16(tw_swiglu(acc[mt][nt][c] + bias[2 * i],
                                         acc[mt][nt][2 + c] + bias[2 * i + 1], p.alpha, p.limit));
        } else {
          const int n = r0 + 16 * mt + g;
          float *y = reinterpret_cast<float *>(p.out) + prow * N;
          if (p.ks > 1) { /* two parts: a + b == b + a, so the sum is the same every run */
            if (n < N) atomicAdd(y + n, acc[mt][nt][c] + (cb == 0 ? bias[n] : 0.f));
            if (n + 8 < N) atomicAdd(y + n + 8, acc[mt][nt][2 + c] + (cb == 0 ? bias[n + 8] : 0.f));
          } else {
            if (n < N) y[n] = acc[mt][nt][c] + bias[n];
            if (n + 8 < N) y[n + 8] = acc[mt][nt][2 + c] + bias[n + 8];
          }
        }
      }
}

/* The per-lane conversion table (both streaming kernels): entry v's 32 lane
 * copies at 256 v (bytes 128-255 of each unused), built by the CTA. */
static __device__ __forceinline__ void tw_gs_build_lut(uint8_t *lut) {
  for (int i = threadIdx.x; i < 256 * 8; i += blockDim.x) {
    const uint32_t c = tw_fp4x2_bf16((uint32_t)(i >> 3));
    reinterpret_cast<uint4 *>(lut + (i >> 3) * 256)[i & 7] = make_uint4(c, c, c, c);
  }
}

/* p.zero[0, p.zero_n) to 0 over the whole grid (both streaming kernels):
 * the next launch's split-K output; every earlier kernel is done (after the
 * PDL wait). */
static __device__ __forceinline__ void tw_gs_clear_next(const tw_gg_args_t &p) {
  if (p.zero)
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.zero_n;
         i += (int64_t)gridDim.x * blockDim.x)
      p.zero[i] = 0.f;
}

/* The active expert whose passes hold pass number v: the largest i in [0,
 * n_act) with pre[i] <= v (pre: tw_gs_prefix). */
static __device__ __forceinline__ int tw_gs_expert_of(const int *pre, int n_act, int v) {
  int lo = 0, hi = n_act - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (pre[mid] <= v) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* pre[i]: passes of `pass` assignments of the active experts before i
 * (pre[0] = 0 .. pre[n_act]); one warp (both streaming kernels). */
static __device__ __forceinline__ void tw_gs_prefix(const tw_gg_args_t &p, int n_act, int pass,
                                                    int *pre) {
  const int lane = threadIdx.x & 31;
  int sum = 0;
  for (int i0 = 0; i0 < n_act; i0 += 32) {
    const int i = i0 + lane;
    int v = i < n_act ? (p.counts[p.active[i]] + pass - 1) / pass : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int u = __shfl_up_sync(0xFFFFFFFFu, v, d);
      if (lane >= d) v += u;
    }
    if (i < n_act) pre[i + 1] = sum + v;
    sum += __shfl_sync(0xFFFFFFFFu, v, 31);
  }
  if (lane == 0) pre[0] = 0;
}

/* A unit of the last round cut between warps (tw_gs_kernel): s, its number
 * among the round's units (-1: not cut); the warps wa..wb that share it,
 * each a piece of the round's Ut k-chunks split evenly over Wt warps (warp
 * w: chunks [Ut w / Wt, Ut (w + 1) / Wt)); slot, where this piece's sums
 * go (2 w, or 2 w + 1 for the second unit of w's range). */
typedef struct {
  int s, wa, wb, Wt, KC, slot;
  int64_t Ut;
} tw_gs_split_t;

/* One pass of a warp over its 32 rows (r0..r0 + 31 of expert e) for
 * assignments [base, base + 8 NT) of the expert (those < ne hold data), over
 * k-chunks [cb, ce) of 128 (all of K: 0, ceil(K / 128)). With p.ks > 1
 * (plain only) the part adds into the output with atomicAdd, the bias with
 * the first part (cb == 0). */
/* PF: the token rows' k of chunk c + 1 are loaded into registers while chunk
 * c is computed, instead of at the top of their own chunk after an L1
 * prefetch two chunks ahead (Nsight Compute, 20b gate_up at 16 tokens: a
 * third of the stall samples were mma waiting on those loads, which queue
 * behind the weight copies in L1; ptxas still sinks the early loads part of
 * the way toward their use, to save registers). */
/* sp.s >= 0: k-chunks [cb, ce) are one piece of these rows and assignments;
 * each piece stores its sums in its slot of p.gs_part and counts on
 * p.gs_ticket[sp.s]; the last to count adds every piece's sums in the order
 * of the warps (the same sum whichever finishes first), sets the counter
 * back to 0 and writes the output (bias and epilogue as for a whole unit). */
template <int EPI, int NT, bool PF>
static __device__ __forceinline__ void tw_gs_pass(const tw_gg_args_t &p, const uint8_t *lut,
                                                  uint8_t *stg, int e, int ne, int off, int base,
                                                  int r0, int cb, int ce,
                                                  const tw_gs_split_t &sp) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t lane4 = 4u * (uint32_t)lane;
  const int K = p.K, N = p.N, KB = K / 32, KC = ce;
  /* rows of piece q = 2 mt + h; SwiGLU: row g of an m-tile is the gate row of
   * pair i, row g + 8 its linear row */
  /* block index in [E, N, K/32] of (row of piece q, block t of chunk 0):
   * blk0 + qrow(q) * KB, rows r0 + g + {0, 8, 16, 24} (plain) or r0 + 2 g +
   * {0, 1, 16, 17} (SwiGLU); N % 32 == 0, so every row exists */
  const int blk0 = (e * N + r0 + (EPI == TW_GG_SWIGLU ? 2 * g : g)) * KB + t;
  /* the same rows' blocks in the packed layout (moe.h TW_MX_CHUNK): chunk c of
   * row piece q at wrow0 + 64 qrow(q) + c wcs */
  const int64_t wrow0 = tw_mx_row(e, r0 + (EPI == TW_GG_SWIGLU ? 2 * g : g), N, K) + 16 * t,
                wcs = tw_mx_cstride(N);
  auto qrow = [](int q) { return EPI == TW_GG_SWIGLU ? 16 * (q >> 1) + (q & 1) : 8 * q; };
  int32_t xoff[NT]; /* 16-byte index of this lane's k of chunk 0 in the token row; -1: none */
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const int m = base + nt * 8 + g;
    int row = m < ne ? off + m : -1;
    if (row >= 0 && p.sorted) row = p.sorted[row] / p.k_top;
    xoff[nt] = row >= 0 ? row * (K / 8) + 4 * t : -1;
  }
  const uint4 *xa = reinterpret_cast<const uint4 *>(p.a);
  float acc[2][NT][4];
  tw_acc_zero(acc);
  uint32_t S[TW_GS_STAGES]; /* the four rows' scale bytes of a stage, row q in byte q */
  /* chunk c into stage st: this lane's four 16-byte blocks, and their scales */
  auto issue = [&](int st, int c) {
    const bool ok = c < KC && 4 * c + t < KB;
    const uint32_t dst = tw_smem_u32(stg + st * TW_GS_STAGE_BYTES + lane * 16);
    uint32_t sc = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int b = blk0 + qrow(q) * KB + 4 * c;
      tw_cp_async16(dst + q * 512,
                    ok ? p.wq + wrow0 + (int64_t)qrow(q) * TW_MX_CHUNK + c * wcs : p.wq, ok);
      sc |= (ok ? (uint32_t)__ldg(p.ws + b) : 127u) << (8 * q);
    }
    S[st] = sc;
    /* the token rows' k of chunk c into L1 now, read two chunks later (one
     * 128-byte line covers lanes t, t ^ 1 of a row) */
    if (!PF)
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        if (ok && xoff[nt] >= 0 && !(t & 1))
          asm volatile("prefetch.global.L1 [%0];" ::"l"(xa + xoff[nt] + 16 * c));
    tw_cp_async_commit();
  };
  /* 16-byte piece wd of this lane's k of chunk c in token row nt (zero
   * where ok is false or the row holds no assignment) */
  auto xrow = [&](bool ok, int nt, int c, int wd) {
    return ok && xoff[nt] >= 0 ? __ldg(xa + xoff[nt] + 16 * c + wd) : make_uint4(0, 0, 0, 0);
  };
  uint4 Bn[PF ? NT * 4 : 1];
  auto load_b = [&](int c) {
    if (!PF) return;
    const bool ok = c < KC && 4 * c + t < KB;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int wd = 0; wd < 4; wd++) Bn[nt * 4 + wd] = xrow(ok, nt, c, wd);
  };
  load_b(cb);
  auto compute = [&](int st, int c) {
    const bool kok = 4 * c + t < KB;
    uint4 Bc[PF ? NT * 4 : 1];
    if (PF) {
#pragma unroll
      for (int i = 0; i < NT * 4; i++) Bc[i] = Bn[i];
      load_b(c + 1);
    }
    tw_cp_async_wait<TW_GS_STAGES - 2>(); /* chunk c: this lane's own copies */
    uint4 W[4];
    __nv_bfloat162 s2[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
      W[q] = *reinterpret_cast<const uint4 *>(stg + st * TW_GS_STAGE_BYTES + q * 512 + lane * 16);
      const uint32_t sc = tw_gg_scale2((S[st] >> (8 * q)) & 0xFFu);
      s2[q] = *reinterpret_cast<const __nv_bfloat162 *>(&sc);
    }
    tw_gs_chunk<NT, true>(lut, lane4, W, s2, acc, [&](int nt, int wd) {
      return PF ? Bc[nt * 4 + wd] : xrow(kok, nt, c, wd);
    });
  };
  issue(0, cb);
  issue(1, cb + 1);
  for (int c = cb; c < KC; c += 3) {
    issue(2, c + 2);
    compute(0, c);
    if (c + 1 >= KC) break;
    issue(0, c + 3);
    compute(1, c + 1);
    if (c + 2 >= KC) break;
    issue(1, c + 4);
    compute(2, c + 2);
  }
  tw_cp_async_wait<0>();
  if (sp.s >= 0) {
    float4 *part = reinterpret_cast<float4 *>(p.gs_part) + lane;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        part[(sp.slot * 4 + mt * NT + nt) * 32] =
            make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
    __threadfence(); /* the sums before the count (the CUDA guide's last-block pattern) */
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      last = atomicAdd(p.gs_ticket + sp.s, 1) == sp.wb - sp.wa;
      __threadfence(); /* the count before the other pieces' sums are read */
    }
    last = __shfl_sync(0xFFFFFFFFu, last, 0);
    __syncwarp();
    if (!last) return; /* another piece writes the output */
    for (int w2 = sp.wa; w2 <= sp.wb; w2++) {
      const int first = (int)(sp.Ut * w2 / sp.Wt / sp.KC); /* w2's range starts in unit first */
      const int slot = 2 * w2 + (first == sp.s ? 0 : 1);
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          const float4 o = __ldcg(part + (slot * 4 + mt * NT + nt) * 32); /* L2: other SMs' */
          if (w2 == sp.wa) {
            acc[mt][nt][0] = o.x, acc[mt][nt][1] = o.y, acc[mt][nt][2] = o.z, acc[mt][nt][3] = o.w;
          } else {
            acc[mt][nt][0] += o.x, acc[mt][nt][1] += o.y, acc[mt][nt][2] += o.z, acc[mt][nt][3] += o.w;
          }
        }
    }
    if (lane == 0) p.gs_ticket[sp.s] = 0;
  }
  tw_gs_store<EPI, NT>(p, acc, e, ne, off, base, r0, cb);
}

/* PF: which passes load their token rows a chunk ahead (tw_gs_pass): 1,
 * those of up to 8 assignments; 2, every pass (the 16-assignment passes then
 * spill a few registers, ptxas: 48 bytes); 0, none. */
template <int EPI, int WARPS, int PF>
static __global__ void __launch_bounds__(WARPS * 32, 16 / WARPS) tw_gs_kernel(const tw_gg_args_t p) {
  extern __shared__ __align__(128) uint8_t tw_gs_smem[];
  TW_PDL_WAIT();
  const int tid = threadIdx.x, warp = tid >> 5;
  tw_gs_clear_next(p);
  tw_gs_build_lut(tw_gs_smem);
  uint8_t *stg = tw_gs_smem + TW_GS_LUT_BYTES + warp * (TW_GS_STAGES * TW_GS_STAGE_BYTES);
  const int slices = (p.N + 31) / 32, KC = tw_mx_chunks(p.K), n_act = *p.n_active;
  const int W = gridDim.x * WARPS, w = blockIdx.x * WARPS + warp;
  /* Tiled (p.gs_ticket set): the work is units (active expert i, 32-row
   * slice, pass of 16 assignments), expert by expert, slice by slice, of KC
   * k-chunks each. Whole rounds of W units go to the warps in turn (warp w:
   * units w, w + W, ...: a round reads a few experts' weights, from one
   * region of memory); the last round's R units are cut into Wt equal pieces
   * of k-chunks (Wt at most TW_GS_PIECES R), so that no warp streams a
   * whole unit while others idle (20b at 16 tokens: 5,040 gate_up units on
   * 2,112 warps, 2.39 rounds, took three; at one token 720 units). The
   * pieces' sums meet in p.gs_part (tw_gs_pass). pre[i]: passes of the
   * active experts before i (shared memory, after the stages). Static,
   * below, where the active experts are too many for pre or the warps for
   * the counters. */
  int *pre = reinterpret_cast<int *>(tw_gs_smem + TW_GS_LUT_BYTES +
                                     WARPS * TW_GS_STAGES * TW_GS_STAGE_BYTES);
  const bool tiled = p.gs_ticket && n_act < TW_GS_PRE && W <= TW_CUDA_MOE_GS_TICKETS;
  if (warp == 0 && tiled) tw_gs_prefix(p, n_act, 16, pre);
  __syncthreads(); /* the table and pre */
  const int units = tiled ? slices * pre[n_act] : 0, full = units / W * W, R = units - full;
  const int Wt = min(W, R * min(TW_GS_PIECES, KC));
  const int64_t Ut = (int64_t)R * KC;
  int64_t u = 0, u1 = 0; /* this warp's piece of the last round: chunks [u, u1) */
  if (w < Wt) {
    u = Ut * w / Wt;
    u1 = Ut * (w + 1) / Wt;
  }
  const int first = (int)(u / KC);
  /* static: items over the experts that hold tokens only: every warp gets
   * the same number of them, +-1 (over all experts, a warp's share of the
   * busy ones varied with the route: 120b at 16 tokens ran 30% slower).
   * With p.ks = 2 an item is (expert, slice, half of K): for the down
   * launch of small batches, whose (expert, slice) items are barely more
   * than the warps (20b at 64 tokens: 2,880 items, 2,112 warps: most warps
   * would take one item, the rest two, and the launch lasts two) */
  const int parts = slices * p.ks, total = parts * n_act;
  int unit = w, item = w, sbase = 0;
  for (;;) {
    int e, base, r0, cb = 0, ce = KC;
    tw_gs_split_t sp;
    sp.s = -1;
    if (tiled) {
      int su;
      if (unit < full) {
        su = unit;
        unit += W;
      } else if (u < u1) {
        const int s = (int)(u / KC);
        cb = (int)(u - (int64_t)s * KC);
        ce = u1 - u < KC - cb ? cb + (int)(u1 - u) : KC;
        u += ce - cb;
        su = full + s;
        if (cb > 0 || ce < KC) { /* the warps of chunks s KC and (s + 1) KC - 1 */
          sp.s = s;
          sp.Wt = Wt;
          sp.KC = KC;
          sp.Ut = Ut;
          sp.wa = (int)((((int64_t)s * KC + 1) * Wt - 1) / Ut);
          sp.wb = (int)((((int64_t)s + 1) * KC * Wt - 1) / Ut);
          sp.slot = 2 * w + (s != first);
        }
      } else {
        break;
      }
      const int lo = tw_gs_expert_of(pre, n_act, su / slices); /* the active expert of unit su */
      const int P = pre[lo + 1] - pre[lo], rest = su - slices * pre[lo];
      e = p.active[lo];
      r0 = rest / P * 32;
      base = rest % P * 16;
    } else {
      if (item >= total) break;
      const int ai = item / parts;
      e = p.active[ai];
      const int rest = item - ai * parts, kp = rest / slices;
      r0 = (rest % slices) * 32;
      cb = KC * kp / p.ks;
      ce = KC * (kp + 1) / p.ks;
      base = sbase;
      sbase += 16;
      if (sbase >= p.counts[e]) {
        sbase = 0;
        item += W;
      }
    }
    const int ne = p.counts[e], off = p.offsets[e];
    if (ne - base <= 8)
      tw_gs_pass<EPI, 1, PF >= 1>(p, tw_gs_smem, stg, e, ne, off, base, r0, cb, ce, sp);
    else
      tw_gs_pass<EPI, 2, PF >= 2>(p, tw_gs_smem, stg, e, ne, off, base, r0, cb, ce, sp);
  }
}

/* ---- The decode MoE with its weights brought in by the tensor memory
 * accelerator (TMA): tw_gt_kernel ----
 *
 * The same units of work (at passes of 16) and the same mma.sync arithmetic as tw_gs_kernel
 * (the K order inside a 128-k chunk permuted so that lane t's A values are
 * its own MXFP4 block t, the same per-lane conversion table, the same
 * epilogues), but no warp copies weights: one producer warp per CTA keeps
 * TW_GT_STAGES stages in flight, each stage the MXFP4 blocks of 128 k of
 * TW_GT_RT = 256 weight rows of one expert (one 3-D TMA box of the [E, N,
 * K/2] bytes: rows past N and k past K arrive as zeros) and the same 128 k of
 * the unit's up to P assignment rows (one bulk copy a row, gathered through
 * the route's sorted order for gate_up); the scale bytes of the unit's rows
 * (contiguous in [E, N, K/32]) come once per unit into one of two buffers.
 * Eight consumer warps (32 rows each) wait on a stage's mbarrier, read
 * their weights, scales and the shared token rows from shared memory,
 * convert, multiply, and release the stage. So the copies in flight no
 * longer depend on how far each warp's chain of loads, conversions and mma
 * has got (tw_gs_kernel's limit, docs/benchmarks.md), and the token rows are
 * read from L2 once per 256 rows instead of once per 32.
 *
 * A unit is (active expert, pass of P assignments, K part, 256-row tile),
 * numbered in that order (tiles fastest: a round of units reads neighbouring
 * rows of few experts); CTA b takes units b, b + G, ... One CTA per SM.
 * P = 16 at the 16-row assignment tile (two consumer groups), 32 at the
 * 32-row tile (one group: each warp's 32 rows times up to four n8 tiles of
 * tokens, the token rows read from shared memory step by step); at the
 * 64- and 128-row tiles the wgmma kernel stays faster (passes of 32 and 64
 * measured 20-100% slower there: every warp reads all the pass's token rows
 * from shared memory, where wgmma reads them once per warpgroup;
 * docs/benchmarks.md). */
#define TW_GT_CW 8                   /* consumer warps of a group: 32 rows each */
#define TW_GT_RT (32 * TW_GT_CW)     /* weight rows a unit */
#define TW_GT_WBYTES (TW_GT_RT * 64) /* one stage's weights: RT rows x 64 bytes (128 k) */
/* A token row's 128 k of bf16 in a stage, rows TW_GT_TS bytes apart (32
 * mod 128: with lanes t >= 2 taking their pieces in rotated order, the eight
 * 16-byte pieces a quarter-warp reads fall in eight different bank groups) */
#define TW_GT_TS 288
#define TW_GT_THREADS(G) (32 * (TW_GT_CW * (G) + 1))
#define TW_GT_MAX_K 3072
/* A kernel's plan by its pass P (assignment rows a unit: 16 or 32) and
 * consumer groups G (P = 32: one; two groups' sums would not fit in shared
 * memory beside four stages, and with an odd stage count the groups'
 * alternate chunks would not keep to stages of their own): TW_GT_STAGES
 * stages, a stage's bytes (the weights, then P token rows), and with two
 * groups the buffer where group 1's sums of a unit meet group 0's
 * ([warp][mt][nt][4][lane] floats, P / 8 n8 tiles). */
#define TW_GT_STAGES 4
static __host__ __device__ constexpr int tw_gt_stage(int P) { return TW_GT_WBYTES + P * TW_GT_TS; }
static __host__ __device__ constexpr int tw_gt_red(int P, int G) {
  return G > 1 ? TW_GT_CW * 2 * (P / 8) * 4 * 32 * 4 : 0;
}

static __host__ __device__ __forceinline__ int tw_gt_scale_bytes(int K) {
  return (TW_GT_RT * (K / 32) + 127) / 128 * 128;
}
static size_t tw_gt_smem(int K, int G, int P) {
  const int S = TW_GT_STAGES;
  return TW_GS_LUT_BYTES + (size_t)S * tw_gt_stage(P) + 2 * (size_t)tw_gt_scale_bytes(K) +
         tw_gt_red(P, G) + 4 * TW_GS_PRE + 8 * (2 * S + 4);
}

static __device__ __forceinline__ void tw_mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void tw_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
static __device__ __forceinline__ void tw_mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/* Wait until the phase of parity `parity` of the mbarrier has completed. */
static __device__ __forceinline__ void tw_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!ok);
}
static __device__ __forceinline__ void tw_tma_3d(uint32_t dst, const CUtensorMap *map, int c0,
                                                 int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
static __device__ __forceinline__ void tw_bulk_g2s(uint32_t dst, const void *src, uint32_t bytes,
                                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

/* Unit u of the launch (see above): expert e, its first assignment base,
 * K part kp, first weight row r0. pre: passes before each active expert. */
typedef struct {
  int e, base, kp, r0, ne, off;
} tw_gt_unit_t;
static __device__ __forceinline__ tw_gt_unit_t tw_gt_unit(const tw_gg_args_t &p, const int *pre,
                                                          int n_act, int tiles, int pass, int u) {
  tw_gt_unit_t x;
  const int pu = u / tiles, gp = pu / p.ks;
  x.r0 = (u - pu * tiles) * TW_GT_RT;
  x.kp = pu - gp * p.ks;
  const int lo = tw_gs_expert_of(pre, n_act, gp);
  x.e = p.active[lo];
  x.base = (gp - pre[lo]) * pass;
  x.ne = p.counts[x.e];
  x.off = p.offsets[x.e];
  return x;
}

/* A consumer warp's part of one unit: its 32 rows for assignments [base,
 * base + 8 NT) over k-chunks [cb, ce), stage by stage (it: the CTA's running
 * chunk count, the stages' phases), then the epilogue (tw_gs_pass's). P: the
 * kernel's pass (NT <= P / 8). Up to two n8 tiles the token rows of a chunk
 * are read into registers at once; more are read step by step (registers). */
template <int EPI, int NT, int G, int P>
static __device__ __forceinline__ void tw_gt_consume(const tw_gg_args_t &p, const uint8_t *lut,
                                                     const uint8_t *stg, const uint8_t *scl,
                                                     float *red, uint32_t bar0,
                                                     const tw_gt_unit_t &x, int cb, int ce,
                                                     int &it) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int gr = (threadIdx.x >> 5) / TW_GT_CW, warp = (threadIdx.x >> 5) % TW_GT_CW;
  const uint32_t lane4 = 4u * (uint32_t)lane;
  const int K = p.K, N = p.N, KB = K / 32;
  const int wr = 32 * warp + (EPI == TW_GG_SWIGLU ? 2 * g : g); /* this lane's row 0, in the unit */
  const bool active = x.r0 + 32 * warp < N;
  auto qrow = [](int q) { return EPI == TW_GG_SWIGLU ? 16 * (q >> 1) + (q & 1) : 8 * q; };
  constexpr int S = TW_GT_STAGES, NTM = P / 8;
  static_assert(NT <= NTM, "n8 tiles within the pass");
  float acc[2][NT][4];
  tw_acc_zero(acc);
  for (int c = cb; c < ce; c++, it++) {
    if (G > 1 && (it & 1) != gr) continue; /* the other group's chunk */
    const int s = it % S;
    tw_mbar_wait(bar0 + 8 * s, (uint32_t)(it / S) & 1u);
    if (active) {
      const uint8_t *st = stg + s * tw_gt_stage(P);
      const int kb = 4 * c + t;
      const bool kok = kb < KB;
      uint4 W[4];
      __nv_bfloat162 s2[4];
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int r = wr + qrow(q);
        /* SwiGLU: lanes of odd g read their linear row first, so that a
         * quarter-warp's rows 2g are not all 128 bytes apart (bank conflicts) */
        const int rl = EPI == TW_GG_SWIGLU && (g & 1) ? r ^ 1 : r;
        W[q] = *reinterpret_cast<const uint4 *>(st + rl * 64 + 16 * t);
        const uint32_t sc = tw_gg_scale2(kok ? scl[r * KB + kb] : 127u);
        s2[q] = *reinterpret_cast<const __nv_bfloat162 *>(&sc);
      }
      if (EPI == TW_GG_SWIGLU && (g & 1))
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          const uint4 v = W[2 * mt];
          W[2 * mt] = W[2 * mt + 1];
          W[2 * mt + 1] = v;
        }
      /* lanes t >= 2 take the 8-k pieces of their block in the order 1, 2, 3,
       * 0 (their k order, the same for every lane of that t, so the mma sums
       * stay right): the token rows' pieces are loaded in that order below */
      const bool rot = t >= 2;
      if (rot)
#pragma unroll
        for (int q = 0; q < 4; q++) W[q] = make_uint4(W[q].y, W[q].z, W[q].w, W[q].x);
      auto ldb = [&](int nt, int wd) {
        return kok ? *reinterpret_cast<const uint4 *>(st + TW_GT_WBYTES + (nt * 8 + g) * TW_GT_TS +
                                                      64 * t + 16 * (rot ? (wd + 1) & 3 : wd))
                   : make_uint4(0, 0, 0, 0);
      };
      if constexpr (NT <= 2) {
        uint4 B[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
          for (int wd = 0; wd < 4; wd++) B[nt][wd] = ldb(nt, wd);
        tw_gs_chunk<NT, false>(lut, lane4, W, s2, acc, [&](int nt, int wd) { return B[nt][wd]; });
      } else {
        tw_gs_chunk<NT, false>(lut, lane4, W, s2, acc, ldb);
      }
    }
    __syncwarp();
    if (lane == 0) tw_mbar_arrive(bar0 + 8 * (S + s)); /* the stage is free */
  }
  if (G > 1) { /* group 1's sums into group 0's, in that order (the same bits every run) */
    float4 *r4 = reinterpret_cast<float4 *>(red) + warp * (2 * NTM * 32) + lane;
    if (gr == 1 && active)
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
          r4[(mt * NTM + nt) * 32] =
              make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
    asm volatile("bar.sync 1, %0;" ::"n"(32 * TW_GT_CW * G) : "memory");
    if (gr == 0 && active)
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          const float4 o = r4[(mt * NTM + nt) * 32];
          acc[mt][nt][0] += o.x, acc[mt][nt][1] += o.y, acc[mt][nt][2] += o.z, acc[mt][nt][3] += o.w;
        }
    asm volatile("bar.sync 1, %0;" ::"n"(32 * TW_GT_CW * G) : "memory");
    if (gr == 1) return;
  }
  if (active) tw_gs_store<EPI, NT>(p, acc, x.e, x.ne, x.off, x.base, x.r0 + 32 * warp, cb);
}

/* The kernel at pass P (assignment rows a unit: 16 or 32) with G consumer
 * groups (see above). */
template <int EPI, int G, int P>
static __global__ void __launch_bounds__(TW_GT_THREADS(G), 1)
    tw_gt_kernel(const tw_gg_args_t p, const __grid_constant__ CUtensorMap wmap) {
  extern __shared__ __align__(128) uint8_t tw_gt_smem_b[];
  constexpr int S = TW_GT_STAGES, SB = tw_gt_stage(P);
  static_assert(P <= 32 && (G == 1 || P == 16), "passes of 16 (one or two groups) or 32 (one)");
  TW_PDL_WAIT();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  tw_gs_clear_next(p);
  tw_gs_build_lut(tw_gt_smem_b);
  const int K = p.K, N = p.N, KB = K / 32, KC = tw_mx_chunks(K), sbytes = tw_gt_scale_bytes(K);
  uint8_t *stg = tw_gt_smem_b + TW_GS_LUT_BYTES;
  uint8_t *scl = stg + S * SB;
  float *red = reinterpret_cast<float *>(scl + 2 * sbytes);
  int *pre = reinterpret_cast<int *>(scl + 2 * sbytes + tw_gt_red(P, G));
  /* mbarriers: full[S], empty[S], scales full[2], scales empty[2] */
  const uint32_t bar0 = tw_smem_u32(pre + TW_GS_PRE);
  const uint32_t sbar = bar0 + 8 * 2 * S;
  const int n_act = *p.n_active;
  if (tid == 0) {
    for (int s = 0; s < S; s++) {
      tw_mbar_init(bar0 + 8 * s, 1);
      tw_mbar_init(bar0 + 8 * (S + s), TW_GT_CW);
    }
    for (int b = 0; b < 2; b++) {
      tw_mbar_init(sbar + 8 * b, 1);
      tw_mbar_init(sbar + 8 * (2 + b), TW_GT_CW * G);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (warp == 0) tw_gs_prefix(p, n_act, P, pre);
  __syncthreads(); /* the table, pre, the barriers */
  const int tiles = (N + TW_GT_RT - 1) / TW_GT_RT;
  const int units = pre[n_act] * p.ks * tiles;
  int it = 0, un = 0;
  if (warp == TW_GT_CW * G) { /* the producer */
    for (int u = blockIdx.x; u < units; u += gridDim.x, un++) {
      const tw_gt_unit_t x = tw_gt_unit(p, pre, n_act, tiles, P, u);
      const int cb = KC * x.kp / p.ks, ce = KC * (x.kp + 1) / p.ks;
      const int rows = min(TW_GT_RT, N - x.r0), nrow = min(P, x.ne - x.base), sb = un & 1;
      tw_mbar_wait(sbar + 8 * (2 + sb), ((uint32_t)(un >> 1) & 1u) ^ 1u);
      if (lane == 0) {
        tw_mbar_expect_tx(sbar + 8 * sb, (uint32_t)(rows * KB));
        tw_bulk_g2s(tw_smem_u32(scl + sb * sbytes), p.ws + ((int64_t)x.e * N + x.r0) * KB,
                    (uint32_t)(rows * KB), sbar + 8 * sb);
      }
      int64_t trow = 0;
      if (lane < nrow) {
        const int q = x.off + x.base + lane;
        trow = p.sorted ? p.sorted[q] / p.k_top : q;
      }
      for (int c = cb; c < ce; c++, it++) {
        const int s = it % S;
        tw_mbar_wait(bar0 + 8 * (S + s), ((uint32_t)(it / S) & 1u) ^ 1u);
        const uint32_t kbytes = (uint32_t)min(128, K - 128 * c) * 2u;
        const uint32_t dst = tw_smem_u32(stg + s * SB);
        if (lane == 0) {
          tw_mbar_expect_tx(bar0 + 8 * s, TW_GT_WBYTES + (uint32_t)nrow * kbytes);
          tw_tma_3d(dst, &wmap, 0, x.r0, x.e * KC + c, bar0 + 8 * s);
        }
        __syncwarp();
        if (lane < nrow)
          tw_bulk_g2s(dst + TW_GT_WBYTES + lane * TW_GT_TS, p.a + trow * K + 128 * c, kbytes,
                      bar0 + 8 * s);
      }
    }
    return;
  }
  for (int u = blockIdx.x; u < units; u += gridDim.x, un++) { /* the consumers */
    const tw_gt_unit_t x = tw_gt_unit(p, pre, n_act, tiles, P, u);
    const int cb = KC * x.kp / p.ks, ce = KC * (x.kp + 1) / p.ks, sb = un & 1;
    tw_mbar_wait(sbar + 8 * sb, (uint32_t)(un >> 1) & 1u);
    const uint8_t *sc = scl + sb * sbytes;
    const int nt = (min(P, x.ne - x.base) + 7) / 8; /* the n8 tiles the unit's rows fill */
#define TW_GT_CONSUME(n) \
  tw_gt_consume<EPI, (n), G, P>(p, tw_gt_smem_b, stg, sc, red, bar0, x, cb, ce, it)
    if constexpr (P == 16) {
      if (nt <= 1) TW_GT_CONSUME(1);
      else TW_GT_CONSUME(2);
    } else {
      if (nt <= 1) TW_GT_CONSUME(1);
      else if (nt == 2) TW_GT_CONSUME(2);
      else if (nt == 3) TW_GT_CONSUME(3);
      else TW_GT_CONSUME(4);
    }
#undef TW_GT_CONSUME
    __syncwarp();
    if (lane == 0) tw_mbar_arrive(sbar + 8 * (2 + sb)); /* done with these scales */
  }
}

static int tw_gs_sms(void);

/* Whether the TMA kernel takes the streaming kernel's launches, and with how
 * many consumer groups at passes of 16: TWAIN_CUDA_MOE_TMA's 0 (off), 1 (one
 * group) or 2 (two, the default) unless tw_cuda_moe_set_stream_tma said
 * otherwise. */
static int tw_gt_on = -1;
extern "C" void tw_cuda_moe_set_stream_tma(int on) { tw_gt_on = on < 0 ? -1 : on > 2 ? 2 : on; }
extern "C" int tw_cuda_moe_stream_tma(void) {
  return tw_gt_on >= 0 ? tw_gt_on : tw_cuda_knobs()->moe_tma;
}

typedef CUresult (*tw_tmap_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                      const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                      const cuuint32_t *, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion,
                                      CUtensorMapFloatOOBfill);
static tw_tmap_encode_fn tw_tmap_encode(void) {
  static tw_tmap_encode_fn fn = (tw_tmap_encode_fn)tw_cuda_driver_sym("cuTensorMapEncodeTiled");
  return fn;
}

/* The tensor map of packed MXFP4 blocks wq (moe.h TW_MX_CHUNK) as bytes
 * [E KC][N][64], box bw bytes x rows x 1 chunk with swizzle sw
 * (tw_gt_kernel: 64 x TW_GT_RT at (0, row, e KC + c), none; tw_gw_kernel: 32
 * x tw_gw_bw(bt) at (32 (kt % 2), row, e KC + kt / 2), 32-byte); false where
 * the driver refuses. */
static bool tw_mxfp4_map(const uint8_t *wq, int E, int N, int K, int bw, int rows,
                         CUtensorMapSwizzle sw, CUtensorMap *map) {
  tw_tmap_encode_fn enc = tw_tmap_encode();
  if (!enc || ((uintptr_t)wq & 15)) return false;
  /* packed (moe.h TW_MX_CHUNK): rows of 64 bytes, N of them a chunk, E KC
   * chunks; rows past N of a box are zero-filled */
  const cuuint64_t dims[3] = {TW_MX_CHUNK, (cuuint64_t)N, (cuuint64_t)E * tw_mx_chunks(K)};
  const cuuint64_t strides[2] = {TW_MX_CHUNK, (cuuint64_t)N * TW_MX_CHUNK};
  const cuuint32_t box[3] = {(cuuint32_t)bw, (cuuint32_t)rows, 1}, estr[3] = {1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)wq, dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Consumer groups of the TMA kernel at pass P: 2 (16 warps; the chunks of a
 * unit alternate between the groups) unless TWAIN_CUDA_MOE_TMA=1 or
 * tw_cuda_moe_set_stream_tma(1) asks for one; one at P = 32 (TW_GT_STAGES). */
static int tw_gt_groups(int P) { return tw_cuda_moe_stream_tma() == 1 || P > 16 ? 1 : 2; }
typedef void (*tw_gt_fn)(const tw_gg_args_t, const CUtensorMap);
template <int G, int P> static tw_gt_fn tw_gt_pick_gp(int epi) {
  return epi == TW_GG_SWIGLU ? tw_gt_kernel<TW_GG_SWIGLU, G, P> : tw_gt_kernel<TW_GG_PLAIN, G, P>;
}
/* The kernel of (epi, G, P); P = 32 has G = 1 only. */
static tw_gt_fn tw_gt_pick(int epi, int G, int P) {
  if (P <= 16) return G == 1 ? tw_gt_pick_gp<1, 16>(epi) : tw_gt_pick_gp<2, 16>(epi);
  return tw_gt_pick_gp<1, 32>(epi);
}

/* Whether the TMA kernel can take both launches of an MoE (gate_up on x,
 * down on act): K of each at most TW_GT_MAX_K, fewer than TW_GS_PRE
 * experts, every tensor it copies 16-byte aligned (bulk copies and tensor
 * maps need it), the driver's tensor-map encoder found. */
static bool tw_gt_fits(const tw_cuda_moe_weights_t *w, const void *x, const void *act) {
  const uintptr_t any = (uintptr_t)x | (uintptr_t)act | (uintptr_t)w->gate_up_blocks |
                        (uintptr_t)w->gate_up_scales | (uintptr_t)w->down_blocks |
                        (uintptr_t)w->down_scales;
  return tw_cuda_moe_stream_tma() && w->hidden % 32 == 0 && w->intermediate % 32 == 0 &&
         w->hidden <= TW_GT_MAX_K &&
         w->intermediate <= TW_GT_MAX_K && w->n_experts < TW_GS_PRE && (any & 15) == 0 &&
         tw_tmap_encode();
}

static TW_NODISCARD tw_status_t tw_gt_launch(const tw_gg_args_t *a, int epi, int tk, int P,
                                             cudaStream_t stream) {
  CUtensorMap map;
  if (!tw_mxfp4_map(a->wq, a->E, a->N, a->K, 64, TW_GT_RT, CU_TENSOR_MAP_SWIZZLE_NONE, &map))
    return tw_err(TW_ERR_CUDA, "moe: the driver refused the tensor map of %d x %d x %d bytes",
                  a->E, a->N, a->K / 2);
  const int experts = a->E < tk ? a->E : tk, tiles = TW_CDIV(a->N, TW_GT_RT);
  const int units = tiles * a->ks * (tk / P + experts), sms = tw_gs_sms();
  const int G = tw_gt_groups(P);
  dim3 grid(units < sms ? units : sms);
  tw_pdl_launch(tw_gt_pick(epi, G, P), grid, dim3(TW_GT_THREADS(G)), tw_gt_smem(a->K, G, P),
                stream, *a, map);
  TW_CUDA_CHECK_LAUNCH(epi == TW_GG_SWIGLU ? "tw_gt_kernel(gate_up)" : "tw_gt_kernel(down)");
  return TW_OK;
}

/* The TMA kernel's pass at assignment tile bt (tw_gg_tile_rows), 0 where the
 * TMA kernel does not take the launch: tw_cuda_moe_set_tma_pass's (every
 * load), else bt where bt is at most TWAIN_CUDA_MOE_TMA_PASS (16 or 32, the
 * default: the 32-row tile's loads, an expert's mean load 9-16, run as
 * passes of 32 on the TMA kernel instead of the wgmma kernel; measured,
 * docs/benchmarks.md). */
static int tw_gt_pass_forced = 0;
extern "C" void tw_cuda_moe_set_tma_pass(int pass) {
  tw_gt_pass_forced = pass == 16 || pass == 32 ? pass : 0;
}
static int tw_gt_pass(int bt) {
  if (tw_gt_pass_forced) return tw_gt_pass_forced;
  return bt <= tw_cuda_knobs()->moe_tma_pass ? bt : 0;
}

/* ---- The grouped GEMM with a TMA producer warp: tw_gw_kernel ----
 *
 * The wgmma kernel's arithmetic (MXFP4 converted by the per-lane table into
 * register A fragments, wgmma m64nNk16 against the assignment rows in
 * shared memory, the same epilogues and the same grid of (weight-row tile,
 * assignment tile) with the same tile rule), with its copies and barriers
 * changed. tw_gg_kernel's threads copy their own stages with cp.async and
 * meet at a CTA barrier every k-tile (measured there: barrier and copy waits
 * are the top stalls, docs/benchmarks.md). Here one producer warp keeps
 * TW_GW_STAGES stages in flight, each two TMA boxes: 64 k of the CTA's
 * 256 weight rows (128 at the 256-row tile) of MXFP4 blocks (rows past N
 * arrive as zeros; 32-byte swizzle, which is the layout tw_gg_kernel's
 * fragment reads were placed for) and 64 k of the tile's BT assignment rows
 * (128-byte swizzle: the wgmma B layout; gate_up reads them from a gathered
 * copy of the token rows in the route's order, so that one box holds them),
 * so the assignment rows are read from L2 once per 256 weight rows, not per
 * 128. Consumer warpgroups (tw_gw_cw) wait on a stage's mbarrier, issue
 * their m64 halves' wgmma, convert the next stage's weights while it runs,
 * wait for it and release the stage; they meet only through the stage ring
 * (no CTA barrier). Up to the 64-row tile four warpgroups of one m64 half
 * each take 112 registers a thread (setmaxnreg; the producer warpgroup drops
 * to 24): the conversion's chains of dependent instructions, which bound the
 * kernel (Nsight Compute, two warpgroups at the 256-row tile: 2.2 warps a
 * scheduler, 0.44 of them eligible, "wait" and short-scoreboard stalls
 * first), then have four warps a scheduler to hide them, as tw_gg_kernel's
 * two CTAs an SM do. There one 20b layer at 256 decode tokens took 0.318 ->
 * 0.288 ms against tw_gg_kernel's 0.318 (two warpgroups: 0.324), the engine
 * 20,830 -> 22,274 tok/s at batch 256 (H100; on the H200 22,425-22,498 ->
 * 24,221-24,441, docs/benchmarks.md). At the 128-row
 * tile four warpgroups too, each with one k-tile's fragments at a time
 * (tw_gw_sets: two would spill, 0.571 ms against 0.400 at 512 tokens): one
 * 20b layer at 512 tokens 0.400 -> 0.349 ms, the engine at batch 512 +6%
 * (H100, docs/benchmarks.md). Where experts hold more than 128 rows on
 * average (tw_gw_tile), a CTA takes 256 assignment rows on 128 weight rows
 * instead (two warpgroups of one m64 half, wgmma N up to 256): the
 * conversion is done once per 256 of an expert's rows instead of once per
 * 128, and is half as much a k-tile a thread. One CTA an SM. */
/* weight rows a CTA of cw consumer warpgroups of wh m64 halves each; the
 * CTA is those warpgroups and a producer warpgroup (one thread of it copies;
 * a whole warpgroup so that registers can move to the consumers: setmaxnreg
 * works by warpgroups) */
static __host__ __device__ constexpr int tw_gw_rows(int cw, int wh) { return 64 * cw * wh; }
/* The consumer warpgroups (CW) and m64 halves each (WH) of the kernel of
 * tile bt, the one rule for its template and its launch: 4 x 1 up to 128
 * rows (256 weight rows a CTA, 112 registers a thread; at 128 with one
 * fragment set, tw_gw_sets), 2 x 1 at 256 (128 rows), docs/benchmarks.md.
 * (2 x 2 at 128, the rule before, took 0.400 ms a 20b layer at 512 tokens
 * where 4 x 1 takes 0.349, H100.) */
static __host__ __device__ constexpr int tw_gw_cw(int bt) { return bt <= TW_GG_BM ? 4 : 2; }
/* (every tile one half now; the kernel keeps WH = 2, the 128-row tile's
 * rule before the four warpgroups, as a template case) */
static __host__ __device__ constexpr int tw_gw_halves(int bt) { return (void)bt, 1; }
/* Fragment sets a consumer thread holds (FS of tw_gw_kernel): two (the next
 * k-tile converted while this one's wgmma runs) where the registers allow,
 * one at the 128-row tile with four warpgroups (64 accumulators: two sets
 * would spill in 112 registers; the other three warpgroups' conversions
 * overlap a warpgroup's wgmma instead). */
static __host__ __device__ constexpr int tw_gw_sets(int bt) { return bt == TW_GG_BM ? 1 : 2; }
/* Registers a thread after setmaxnreg (tw_gw_kernel): the consumers', the
 * producer warpgroup's (CW = 2: 256 x 232 + 128 x 40 = 384 x 168, the
 * launch's; CW = 4: 512 x 112 + 128 x 24 <= 640 x 96, the launch's; asking
 * more than the launch holds never returns) */
#define TW_GW_CREG(cw) ((cw) == 2 ? 232 : 112)
#define TW_GW_PREG(cw) ((cw) == 2 ? 40 : 24)
#define TW_GW_MAX_K 3072                 /* the CTA's scales stay in shared memory */
#define TW_GW_STAGES(bt, bw) ((bt) >= 256 ? 5 : (bt) >= 128 && (bw) == 256 ? 6 : 8)
static __host__ __device__ constexpr int tw_gw_stage(int bt, int bw) { return bw * 32 + bt * 128; }
/* Dynamic shared memory: 1024 bytes of alignment slack, the conversion
 * table, the stages, the scales [rows][K/32 + 1] and 2 S mbarriers (at most
 * 230,608 bytes: the 256-row tile at K = 3,072). */
static size_t tw_gw_smem(int bt, int bw, int K) {
  const size_t S = TW_GW_STAGES(bt, bw);
  return 1024 + TW_GG_LUT_BYTES + S * tw_gw_stage(bt, bw) +
         ((size_t)bw * (K / 32 + 1) + 7) / 8 * 8 + 16 * S;
}

static __device__ __forceinline__ void tw_tma_2d(uint32_t dst, const CUtensorMap *map, int c0,
                                                 int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

/* The WH m64 halves' four k16 steps on the first W8 n8 tiles (one fence
 * and one commit). */
template <int W8, int N8, int WH>
static __device__ __forceinline__ void tw_gw_wgmma(float (&acc)[WH][N8][4],
                                                   const uint32_t (&af)[WH][4][4], uint64_t xd) {
  static_assert(W8 >= 1 && W8 <= N8, "wgmma N within the tile");
  tw_wgmma_fence();
#pragma unroll
  for (int mh = 0; mh < WH; mh++) {
    float(&d)[W8][4] = *reinterpret_cast<float(*)[W8][4]>(&acc[mh][0][0]);
#pragma unroll
    for (int s = 0; s < 4; s++) tw_wgmma_rs(d, af[mh][s], xd + 2 * s);
  }
  tw_wgmma_commit();
}

/* The kernel (see above). EPI: TW_GG_SWIGLU or TW_GG_PLAIN; BT: assignment
 * rows a CTA (16, 32, 64 or 128 with CW = 4, WH = 1; 256 with CW = 2,
 * WH = 1: tw_gw_cw, tw_gw_halves); WH: m64 halves a consumer warpgroup;
 * CW: consumer warpgroups (64 CW WH weight rows a CTA; tw_gw_cw); FS: the
 * k-tiles' fragment sets a consumer thread holds (tw_gw_sets). wmap: the
 * MXFP4 blocks [E][N][K/2] bytes, box 32 x 64 CW WH x 1; xmap: the
 * assignment rows [tk][K] bf16, box 64 x BT. */
template <int EPI, int BT, int WH, int CW, int FS>
static __global__ void __launch_bounds__(128 * (CW + 1), 1)
    tw_gw_kernel(const tw_gg_args_t p, const __grid_constant__ CUtensorMap wmap,
                 const __grid_constant__ CUtensorMap xmap) {
  constexpr int BW = tw_gw_rows(CW, WH), WB = BW * 32, CT = 128 * CW;
  constexpr int S = TW_GW_STAGES(BT, BW), SB = tw_gw_stage(BT, BW), N8 = BT / 8;
  extern __shared__ __align__(1024) uint8_t tw_gw_smem_b[];
  __shared__ int s_tile[4];
  TW_PDL_WAIT();
  uint8_t *base = tw_gw_smem_b + ((1024 - (tw_smem_u32(tw_gw_smem_b) & 1023)) & 1023);
  uint32_t *sL = reinterpret_cast<uint32_t *>(base);
  uint8_t *stg = base + TW_GG_LUT_BYTES;
  uint8_t *sS = stg + S * SB;
  const int K = p.K, KT = (K + 63) / 64, KB = K / 32, KBP = KB + 1;
  const uint32_t bar0 = (tw_smem_u32(sS + BW * KBP) + 7) & ~7u; /* full[S], empty[S] */
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  tw_gg_build_lut(sL, CT + 128);
  if (warp == 0) tw_gg_find_tile(p, BT, lane, s_tile);
  if (tid == 32) {
    for (int s = 0; s < S; s++) {
      tw_mbar_init(bar0 + 8 * s, 1);
      tw_mbar_init(bar0 + 8 * (S + s), 4 * CW); /* one arrival a consumer warp */
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int e = s_tile[0];
  if (e < 0) return; /* spare CTA of the upper-bound grid */
  const int m0 = s_tile[1], rows = min(BT, s_tile[2] - m0), off = s_tile[3] + m0;
  const int n0 = blockIdx.x * BW;
  const uint32_t stg_u = tw_smem_u32(stg);
  if (warp >= 4 * CW) { /* the producer */
#if TW_HAVE_WGMMA /* sm_90a only, as wgmma */
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(TW_GW_PREG(CW)) : "memory");
#endif
    if (warp == 4 * CW && lane == 0)
      for (int kt = 0; kt < KT; kt++) {
        const int s = kt % S;
        tw_mbar_wait(bar0 + 8 * (S + s), ((uint32_t)(kt / S) & 1u) ^ 1u);
        tw_mbar_expect_tx(bar0 + 8 * s, (uint32_t)SB);
        tw_tma_3d(stg_u + s * SB, &wmap, 32 * (kt & 1), n0, e * tw_mx_chunks(K) + (kt >> 1),
                  bar0 + 8 * s);
        tw_tma_2d(stg_u + s * SB + WB, &xmap, 64 * kt, off, bar0 + 8 * s);
      }
    return;
  }
  /* the consumers (BT = 128: 128 accumulators and two sets of 32 fragment
   * registers a thread; BT = 256: 128 and two of 16; CW = 4: at most 32 and
   * two of 16 in 112 registers, as the 96 a thread of the launch (640
   * threads) allow with the producer at 24): their rows' scales first (a
   * barrier of the consumers) */
#if TW_HAVE_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(TW_GW_CREG(CW)) : "memory");
#endif
  tw_gg_load_scales(p, e, BW, [&](int r) { return n0 + r; }, sS, CT);
  asm volatile("bar.sync 1, %0;" ::"n"(CT) : "memory");
  const int wg = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  /* CTA row of fragment row r (0..15) of m64 half mh: SwiGLU pairs (gate 2i,
   * linear 2i + 1) as fragment rows g and g + 8 */
  auto lrow = [&](int mh, int r) {
    const int b = 64 * WH * wg + 64 * mh + 16 * w;
    return EPI == TW_GG_SWIGLU ? b + 2 * (r & 7) + (r >> 3) : b + r;
  };
  const uint32_t lut_lane = tw_smem_u32(sL) + 4 * lane;
  const uint32_t sel = 0x4440u | (uint32_t)t; /* byte t to the low byte, zeros above */
  auto fragments = [&](int kt, const uint8_t *rb, uint32_t (&af)[WH][4][4]) {
#pragma unroll
    for (int mh = 0; mh < WH; mh++)
#pragma unroll
      for (int hr = 0; hr < 2; hr++) { /* row g, then g + 8 */
        const int r = lrow(mh, g + 8 * hr), sw = (r >> 2) & 1;
#pragma unroll
        for (int h = 0; h < 2; h++) { /* words 0-3 (steps 0, 1), 4-7 (steps 2, 3) */
          tw_gg_cvt_half(lut_lane, sel, *reinterpret_cast<const uint4 *>(rb + r * 32 + ((h ^ sw) * 16)),
                         sS[r * KBP + 2 * kt + h], h, hr, af[mh]);
        }
      }
  };
  float acc[WH][N8][4];
  tw_acc_zero(acc);
  /* the wgmma N: the tile's rows rounded up to a quarter of BT (at least 8) */
  constexpr int GQ = N8 / 4 > 0 ? N8 / 4 : 1;
  constexpr int W2 = 2 * GQ < N8 ? 2 * GQ : N8, W3 = 3 * GQ < N8 ? 3 * GQ : N8;
  const int nq = (rows + 8 * GQ - 1) / (8 * GQ);
  const uint64_t xd0 = tw_wgmma_desc(stg_u + WB);
  auto fence = [&]() {
#pragma unroll
    for (int mh = 0; mh < WH; mh++) tw_reg_fence(acc[mh]);
  };
  auto issue = [&](const uint32_t(&af)[WH][4][4], int s) {
    const uint64_t xd = xd0 + (uint64_t)(s * (SB / 16));
    fence();
    tw_by_quarters<GQ, W2, W3, N8>(
        nq, [&](auto w8) { tw_gw_wgmma<decltype(w8)::value>(acc, af, xd); });
    fence();
  };
  /* the wgmma done; af (its register operand) kept live up to here */
  auto done = [&](uint32_t(&af)[WH][4][4], int s) {
    tw_wgmma_wait0();
    fence();
#pragma unroll
    for (int mh = 0; mh < WH; mh++)
#pragma unroll
      for (int s4 = 0; s4 < 4; s4++)
#pragma unroll
        for (int q = 0; q < 4; q++) asm volatile("" : "+r"(af[mh][s4][q])::"memory");
    __syncwarp();
    if (lane == 0) tw_mbar_arrive(bar0 + 8 * (S + s)); /* this warp is done with the stage */
  };
  auto ready = [&](int kt) {
    const int s = kt % S;
    tw_mbar_wait(bar0 + 8 * s, (uint32_t)(kt / S) & 1u);
    return s;
  };
  /* FS == 2: k-tile kt + 1 converted while kt's wgmma runs (two sets of
   * fragments, the loop unrolled by two so that each set keeps its
   * registers; one layer measured 4-6% faster than converting after the
   * wait, the engine 2-3%, docs/benchmarks.md). FS == 1 (the 128-row tile's
   * four warpgroups, whose 64 accumulators leave no room for a second set):
   * convert, then wait; the other warpgroups' conversions fill the wait. */
  uint32_t af[WH][4][4];
  if constexpr (FS == 1) {
    for (int kt = 0; kt < KT; kt++) {
      const int s = ready(kt);
      fragments(kt, stg + s * SB, af);
      issue(af, s);
      done(af, s);
    }
  } else {
    uint32_t af2[WH][4][4];
    int s = ready(0);
    fragments(0, stg + s * SB, af);
    for (int kt = 0; kt < KT; kt += 2) {
      issue(af, s);
      int s1 = 0;
      if (kt + 1 < KT) {
        s1 = ready(kt + 1);
        fragments(kt + 1, stg + s1 * SB, af2);
      }
      done(af, s);
      if (kt + 1 >= KT) break;
      issue(af2, s1);
      if (kt + 2 < KT) {
        s = ready(kt + 2);
        fragments(kt + 2, stg + s * SB, af);
      }
      done(af2, s1);
    }
  }

#pragma unroll
  for (int mh = 0; mh < WH; mh++)
    tw_gg_epilogue<EPI>(p, acc[mh], e, rows, off, n0 + 64 * WH * wg + 64 * mh + 16 * w);
}

typedef void (*tw_gw_fn)(const tw_gg_args_t, const CUtensorMap, const CUtensorMap);
template <int BT> static tw_gw_fn tw_gw_pick_bt(int epi) {
  constexpr int WH = tw_gw_halves(BT), CW = tw_gw_cw(BT), FS = tw_gw_sets(BT);
  return epi == TW_GG_SWIGLU ? tw_gw_kernel<TW_GG_SWIGLU, BT, WH, CW, FS>
                             : tw_gw_kernel<TW_GG_PLAIN, BT, WH, CW, FS>;
}
/* The kernel of tile bt (16, 32, 64, 128 or 256). */
static tw_gw_fn tw_gw_pick(int epi, int bt) {
  switch (bt) {
  case 16: return tw_gw_pick_bt<16>(epi);
  case 32: return tw_gw_pick_bt<32>(epi);
  case 64: return tw_gw_pick_bt<64>(epi);
  case 128: return tw_gw_pick_bt<128>(epi);
  default: return tw_gw_pick_bt<256>(epi);
  }
}
/* Weight rows a CTA of the kernel of tile bt. */
static int tw_gw_bw(int bt) { return tw_gw_rows(tw_gw_cw(bt), tw_gw_halves(bt)); }

/* The smallest assignment tile the kernel takes (0: none): the setter's,
 * else TWAIN_CUDA_MOE_WS. */
static int tw_gw_min = -1;
extern "C" void tw_cuda_moe_set_ws(int min_tile) {
  tw_gw_min = min_tile < 0 ? -1 : min_tile == 16 || min_tile == 32 || min_tile == 64 ||
                                          min_tile == 128
                                      ? min_tile
                                      : 0;
}
static bool tw_gw_takes(int bt) {
  const int m = tw_gw_min >= 0 ? tw_gw_min : tw_cuda_knobs()->moe_ws;
  return m > 0 && bt >= m;
}

/* An expert's mean load over tk assignments of E experts, rounded up
 * (rows; the divisor taken as 1 where E is 0): what the tile rules size by
 * (tw_gw_tile, tw_gg_tile_rows). */
static int tw_gg_mean_load(int tk, int E) { return (tk + E - 1) / (E > 0 ? E : 1); }

/* TWAIN_CUDA_MOE_BT's tile (16, 32, 64 or 128; read once), 0 where unset
 * or another value. */
static int tw_gg_tile_forced(void) {
  static int forced = -1;
  if (forced < 0) {
    const char *v = tw_cuda_knobs()->moe_bt;
    const int f = v ? atoi(v) : 0;
    forced = (f == 16 || f == 32 || f == 64 || f == 128) ? f : 0;
  }
  return forced;
}

/* The kernel's tile for the grouped path's tile bt over tk assignments of E
 * experts: where an expert's mean load passes 128 rows (the 128-row tile
 * would take each expert in two passes or more) and no tile is forced
 * (TWAIN_CUDA_MOE_BT), 256 assignment rows on 128 weight rows a CTA (one
 * m64 half a warpgroup): an expert's weights converted once per 256 of its
 * rows instead of once per 128; else bt on 256 weight rows. Measured
 * (docs/benchmarks.md, H100): one 20b layer at 8,192 prefill tokens 3.642
 * -> 2.976 ms on the 256-row tile (the engine's prefill of 8,192 66,398
 * tok/s against 63,531 on the 128-row tile of four warpgroups); at a mean
 * load of 128 (20b decode batch 1,024), where the 256-row tile was taken
 * while the 128-row one had two warpgroups of two halves (0.643 -> 0.602
 * ms), the 128-row tile of four warpgroups is ahead: the engine 33,827 ->
 * 35,199 tok/s. */
static int tw_gw_tile(int tk, int E, int bt) {
  if (tw_gg_tile_forced()) return bt;
  return bt == TW_GG_BM && tw_gg_mean_load(tk, E) > TW_GG_BM ? 2 * TW_GG_BM : bt;
}

/* The tensor maps of one launch: the MXFP4 blocks [E][N][K/2] bytes (box 32
 * x bw x 1, bw the CTA's weight rows; 32-byte swizzle) and the assignment rows a [tk][K]
 * bf16 (box 64 x bt, 128-byte swizzle); false where the driver refuses. */
static bool tw_gw_maps(const tw_gg_args_t *a, int tk, int bt, int bw, CUtensorMap *wm,
                       CUtensorMap *xm) {
  if (!tw_mxfp4_map(a->wq, a->E, a->N, a->K, 32, bw, CU_TENSOR_MAP_SWIZZLE_32B, wm))
    return false;
  const cuuint64_t xd[2] = {(cuuint64_t)a->K, (cuuint64_t)tk};
  const cuuint64_t xs[1] = {(cuuint64_t)a->K * 2};
  const cuuint32_t xb[2] = {64, (cuuint32_t)bt}, one[2] = {1, 1};
  return tw_tmap_encode()(xm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)a->a, xd, xs, xb, one,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Whether the kernel can take both launches of an MoE: K of each at most
 * TW_GW_MAX_K and a multiple of 32, every tensor it reads by TMA (the
 * blocks, x's gathered copy in y, act) 16-byte aligned, the encoder found. */
static bool tw_gw_fits(const tw_cuda_moe_weights_t *w, const void *act, const void *y) {
  const uintptr_t any = (uintptr_t)act | (uintptr_t)y | (uintptr_t)w->gate_up_blocks |
                        (uintptr_t)w->down_blocks;
  return w->hidden % 32 == 0 && w->intermediate % 32 == 0 && w->hidden <= TW_GW_MAX_K &&
         w->intermediate <= TW_GW_MAX_K && (any & 15) == 0 && tw_tmap_encode();
}

static TW_NODISCARD tw_status_t tw_gw_launch(const tw_gg_args_t *a, int epi, int tk, int bt,
                                             cudaStream_t stream) {
  const int bw = tw_gw_bw(bt);
  CUtensorMap wm, xm;
  if (!tw_gw_maps(a, tk, bt, bw, &wm, &xm))
    return tw_err(TW_ERR_CUDA, "moe: the driver refused the tensor maps of %d x %d x %d bytes and %d x %d rows",
                  a->E, a->N, a->K / 2, tk, a->K);
  const int tiles_m = tw_gg_row_tiles(tk, bt, a->E);
  tw_pdl_launch(tw_gw_pick(epi, bt), dim3(TW_CDIV(a->N, bw), tiles_m),
                dim3(128 * (tw_gw_cw(bt) + 1)), tw_gw_smem(bt, bw, a->K), stream, *a, wm, xm);
  TW_CUDA_CHECK_LAUNCH(epi == TW_GG_SWIGLU ? "tw_gw_kernel(gate_up)" : "tw_gw_kernel(down)");
  return TW_OK;
}

/* The gate_up launch's arguments: assignment rows from a (gathered through
 * sorted, or in order where sorted is NULL), SwiGLU into act; bf16 weights
 * w1h or NULL (MXFP4). */
static tw_gg_args_t tw_gg_gate_up(const tw_cuda_moe_weights_t *w, const tw_cuda_moe_route_t *r,
                                  const void *a_rows, const int32_t *sorted,
                                  const __nv_bfloat16 *w1h, void *act) {
  tw_gg_args_t a = {};
  a.a = (const __nv_bfloat16 *)a_rows;
  a.sorted = sorted;
  a.k_top = r->k;
  a.wq = w->gate_up_blocks;
  a.ws = w->gate_up_scales;
  a.wh = w1h;
  a.bias = w->gate_up_bias;
  a.alpha = w->swiglu_alpha;
  a.limit = w->swiglu_limit;
  a.counts = r->counts;
  a.offsets = r->offsets;
  a.active = r->active;
  a.n_active = r->n_active;
  a.E = w->n_experts;
  a.N = 2 * w->intermediate;
  a.K = w->hidden;
  a.out = act;
  a.ks = 1;
  return a;
}
/* Turn gate_up's arguments into down's: act [T*k, I] in order, f32 into y;
 * bf16 weights w2h or NULL; nothing to clear. */
static void tw_gg_to_down(tw_gg_args_t *a, const tw_cuda_moe_weights_t *w,
                          const __nv_bfloat16 *w2h, const void *act, float *y) {
  a->a = (const __nv_bfloat16 *)act;
  a->sorted = NULL;
  a->wq = w->down_blocks;
  a->ws = w->down_scales;
  a->wh = w2h;
  a->bias = w->down_bias;
  a->N = w->hidden;
  a->K = w->intermediate;
  a->out = y;
  a->zero = NULL;
  a->zero_n = 0;
}

/* The MoE on a kernel that reads its assignment rows in the route's order
 * (tw_gm_kernel: each group of 8 values in the B order, perm; tw_gw_kernel:
 * as they are): x's rows gathered into y (free until down writes it),
 * gate_up into act, down into y; launch(a, epi) runs one of the two GEMMs. */
template <typename Launch>
static TW_NODISCARD tw_status_t tw_gathered_run(const tw_cuda_moe_weights_t *w,
                                                const tw_cuda_moe_route_t *r, int32_t T,
                                                const void *x, void *act, float *y, bool perm,
                                                cudaStream_t stream, Launch launch) {
  const int H = w->hidden, k = r->k, tk = T * k;
  uint4 *xg = reinterpret_cast<uint4 *>(y);
  const int64_t chunks = (int64_t)tk * (H / 8);
  const int blocks = (int)(TW_CDIV(chunks, 256) < 2048 ? TW_CDIV(chunks, 256) : 2048);
  tw_pdl_launch(perm ? tw_gm_gather_kernel<true> : tw_gm_gather_kernel<false>, dim3(blocks),
                dim3(256), 0, stream, reinterpret_cast<const uint4 *>(x),
                (const int32_t *)r->sorted, k, H / 8, tk, xg);
  TW_CUDA_CHECK_LAUNCH("tw_gm_gather_kernel");
  tw_gg_args_t a = tw_gg_gate_up(w, r, xg, NULL, NULL, act);
  TW_CHECK(launch(a, TW_GG_SWIGLU));
  tw_gg_to_down(&a, w, NULL, act, y);
  return launch(a, TW_GG_PLAIN);
}

/* Whether the streaming kernels take the decode MoE: MXFP4 experts, the
 * 16-row tile (an expert's mean load at most 8) and the TMA kernel's passes
 * (tw_gt_pass), unless TWAIN_CUDA_MOE_STREAM=0 (knobs.h) or
 * tw_cuda_moe_set_stream said otherwise. */
static int tw_gs_on = -1;
static int tw_gs_enabled(void) { return tw_gs_on >= 0 ? tw_gs_on : tw_cuda_knobs()->moe_stream; }
extern "C" void tw_cuda_moe_set_stream(int on) { tw_gs_on = on < 0 ? -1 : on ? 1 : 0; }
extern "C" int tw_cuda_moe_stream(void) { return tw_gs_enabled(); }
static int tw_gs_balance_on = -1;
extern "C" void tw_cuda_moe_set_stream_balance(int on) {
  tw_gs_balance_on = on < 0 ? -1 : on ? 1 : 0;
}
extern "C" int tw_cuda_moe_stream_balance(void) {
  return tw_gs_balance_on >= 0 ? tw_gs_balance_on : tw_cuda_knobs()->moe_stream_balance;
}
static int tw_gs_warps(void) { return tw_cuda_knobs()->moe_stream_warps == 8 ? 8 : 16; }
template <int PF> static tw_gg_fn tw_gs_pick_pf(int epi, int warps) {
  if (warps == 8)
    return epi == TW_GG_SWIGLU ? tw_gs_kernel<TW_GG_SWIGLU, 8, PF> : tw_gs_kernel<TW_GG_PLAIN, 8, PF>;
  return epi == TW_GG_SWIGLU ? tw_gs_kernel<TW_GG_SWIGLU, 16, PF> : tw_gs_kernel<TW_GG_PLAIN, 16, PF>;
}
static tw_gg_fn tw_gs_pick(int epi, int warps, int pf) {
  return pf == 2 ? tw_gs_pick_pf<2>(epi, warps)
         : pf    ? tw_gs_pick_pf<1>(epi, warps)
                 : tw_gs_pick_pf<0>(epi, warps);
}
/* The kernel's PF for tk assignments over E experts: TWAIN_CUDA_MOE_STREAM_BPF
 * (knobs.h) when set, else 2 where an expert's mean load (over at most
 * min(E, tk) experts) is 4 or more, so that 16-assignment passes are common
 * (20b at 64 tokens, 120b at 256), and 1 below (measured on the H200,
 * docs/benchmarks.md: 1 is faster at 20b 16 and 120b 16 / 64 tokens, 2 at
 * 20b 64 and 120b 256). */
static int tw_gs_pf(int tk, int E) {
  const int knob = tw_cuda_knobs()->moe_stream_bpf;
  if (knob >= 0) return knob;
  const int experts = E < tk ? E : tk;
  return tk >= 4 * experts ? 2 : 1;
}
static int tw_gs_sms(void) {
  static int sms = 0;
  if (sms <= 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 132;
  }
  return sms;
}
/* Warps of the streaming grid at its largest: 16 / tw_gs_warps() CTAs of
 * tw_gs_warps() warps on every SM (the kernel's __launch_bounds__), so 16
 * warps per SM whichever CTA size the knob picks. */
static int tw_gs_grid_warps(void) { return 16 / tw_gs_warps() * tw_gs_warps() * tw_gs_sms(); }
/* K parts of a streaming kernel's down launch (N rows, K the intermediate
 * size) whose units are `rows` weight rows of one expert (experts: at most
 * min(E, assignments)): 2 where those units are fewer than `limit`, so the
 * last round is a small part of the launch; 1 with
 * TWAIN_CUDA_MOE_STREAM_SPLITK=0 (knobs.h), and where K is one 128-k chunk
 * (both parts would start at chunk 0 and each add the bias). The per-warp
 * kernel: 32-row slices against twice its grid's warps; the TMA kernel:
 * 256-row tiles against four times the SMs. */
static int tw_down_parts(int N, int K, int E, int tk, int rows, int limit) {
  if (!tw_cuda_knobs()->moe_stream_splitk || TW_CDIV(K / 32, 4) < 2) return 1;
  const int experts = E < tk ? E : tk;
  return TW_CDIV(N, rows) * experts < limit ? 2 : 1;
}
/* One launch of the streaming kernel on a's experts; pf: its token-row
 * prefetch (tw_gs_pf). */
static TW_NODISCARD tw_status_t tw_gs_launch(const tw_gg_args_t *a, int epi, int pf,
                                             cudaStream_t stream) {
  const int warps = tw_gs_warps(), items = (a->N + 31) / 32 * a->E * a->ks;
  const int ctas = TW_CDIV(items, warps), max_ctas = tw_gs_grid_warps() / warps;
  dim3 grid(ctas < max_ctas ? ctas : max_ctas);
  tw_pdl_launch(tw_gs_pick(epi, warps, pf), grid, dim3(warps * 32), (size_t)TW_GS_SMEM(warps),
                stream, *a);
  TW_CUDA_CHECK_LAUNCH(epi == TW_GG_SWIGLU ? "tw_gs_kernel(gate_up)" : "tw_gs_kernel(down)");
  return TW_OK;
}

extern "C" tw_status_t tw_moe_grouped_setup(void) {
  for (int epi = 0; epi < 2; epi++)
    for (int P = 16; P <= 32; P *= 2)
      for (int G = 1; G <= (P > 16 ? 1 : 2); G++)
        TW_CUDA_CHECK(cudaFuncSetAttribute(tw_gt_pick(epi, G, P),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)tw_gt_smem(TW_GT_MAX_K, G, P)));
  for (int epi = 0; epi < 2; epi++)
    for (int wp = 8; wp <= 16; wp *= 2)
      for (int pf = 0; pf <= 2; pf++)
        TW_CUDA_CHECK(cudaFuncSetAttribute(tw_gs_pick(epi, wp, pf),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           TW_GS_SMEM(wp)));
  for (int bt = TW_GG_BM_MIN; bt <= TW_GG_BM; bt *= 2)
    for (int fmt = 0; fmt < 2; fmt++)
      for (int epi = 0; epi < 2; epi++)
        TW_CUDA_CHECK(cudaFuncSetAttribute(tw_gg_pick(fmt, epi, bt),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)tw_gg_smem_bytes(fmt, bt, TW_GG_MAX_K)));
  for (int bt = TW_GG_BM_MIN; bt <= 2 * TW_GG_BM; bt *= 2)
    for (int epi = 0; epi < 2; epi++)
      TW_CUDA_CHECK(cudaFuncSetAttribute(tw_gw_pick(epi, bt),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)tw_gw_smem(bt, tw_gw_bw(bt), TW_GW_MAX_K)));
  for (int bt = TW_GG_BM_MIN; bt <= TW_GG_BM; bt *= 2)
    for (int epi = 0; epi < 2; epi++)
      TW_CUDA_CHECK(cudaFuncSetAttribute(tw_gm_pick(epi, bt),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)tw_gm_smem_bytes(bt, TW_GG_MAX_K)));
  return TW_OK;
}

/* The assignment tile for tk assignments over E experts: the smallest of 16,
 * 32, 64, 128 that holds twice an expert's mean load (decode: most experts
 * in one tile, the busier ones in two), full 128-row tiles from 64 tokens per
 * expert (prefill). Measured on the H200 (docs/benchmarks.md, 20b decode at
 * batch 16..1,024): each step of this rule was the fastest tile at its load.
 * TWAIN_CUDA_MOE_BT forces one (read once). */
static int tw_gg_tile_rows(int tk, int E) {
  const int forced = tw_gg_tile_forced();
  if (forced) return forced;
  const int twice = 2 * tw_gg_mean_load(tk, E);
  return twice <= 16 ? 16 : twice <= 32 ? 32 : twice <= 64 ? 64 : 128;
}

extern "C" int tw_cuda_moe_grouped_supported(int32_t hidden, int32_t intermediate) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  /* wgmma exists only as sm_90a machine code (compute capability 9.0); the
   * shared-memory plan holds the scales of K up to TW_GG_MAX_K */
  return major == 9 && minor == 0 && hidden > 0 && intermediate > 0 && hidden % 32 == 0 &&
         intermediate % 32 == 0 && hidden <= TW_GG_MAX_K && intermediate <= TW_GG_MAX_K;
}

/* One grouped GEMM over the route's experts (see the file comment). */
static TW_NODISCARD tw_status_t tw_gg_launch(const tw_gg_args_t *a, int fmt, int epi, int tk, int bt,
                                cudaStream_t stream) {
  dim3 grid(TW_CDIV(a->N, TW_GG_BW), tw_gg_row_tiles(tk, bt, a->E));
  tw_pdl_launch(tw_gg_pick(fmt, epi, bt), grid, dim3(TW_GG_THREADS),
                tw_gg_smem_bytes(fmt, bt, a->K), stream, *a);
  TW_CUDA_CHECK_LAUNCH(epi == TW_GG_SWIGLU ? "tw_gg_kernel(gate_up)" : "tw_gg_kernel(down)");
  return TW_OK;
}

/* The decode kernel's MoE (tw_gathered_run, the rows in the B order). */
static TW_NODISCARD tw_status_t tw_gm_run(const tw_cuda_moe_weights_t *w,
                                          const tw_cuda_moe_route_t *r, int32_t T, const void *x,
                                          void *act, float *y, int bt, cudaStream_t stream) {
  const int tiles_m = tw_gg_row_tiles(T * r->k, bt, w->n_experts);
  return tw_gathered_run(w, r, T, x, act, y, true, stream,
                         [&](const tw_gg_args_t &a, int epi) -> tw_status_t {
                           tw_pdl_launch(tw_gm_pick(epi, bt), dim3(TW_CDIV(a.N, TW_GG_BW), tiles_m),
                                         dim3(TW_GM_THREADS), tw_gm_smem_bytes(bt, a.K), stream, a);
                           TW_CUDA_CHECK_LAUNCH(epi == TW_GG_SWIGLU ? "tw_gm_kernel(gate_up)"
                                                                    : "tw_gm_kernel(down)");
                           return TW_OK;
                         });
}

extern "C" tw_status_t tw_moe_grouped_run(const tw_cuda_moe_weights_t *w,
                                          const tw_cuda_moe_route_t *r, int32_t T,
                                          const void *x, const void *w1_bf16,
                                          const void *w2_bf16, void *act, float *y,
                                          float *gs_part, cudaStream_t stream) {
  const int E = w->n_experts, H = w->hidden, I = w->intermediate, k = r->k, tk = T * k;
  const int bt = tw_gg_tile_rows(tk, E);
  if (tk / bt + E > 65535) /* the grid's row tiles (gridDim.y) */
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "moe_prefill: %d assignments exceed the grid (at most %d * (65535 - E))", tk,
                  bt);
  const int fmt = w1_bf16 ? TW_GG_BF16 : TW_GG_MXFP4;
  if (fmt == TW_GG_MXFP4 && (tw_gm_tiles() & (uint32_t)bt))
    return tw_gm_run(w, r, T, x, act, y, bt, stream);
  /* decode loads of MXFP4 experts: the TMA kernel at the pass tw_gt_pass
   * gives, where it fits; else at the 16-row tile the per-warp streaming
   * kernel */
  const bool mx = fmt == TW_GG_MXFP4 && H % 32 == 0 && I % 16 == 0 && tw_gs_enabled();
  const int pass = mx ? tw_gt_pass(bt) : 0;
  const __nv_bfloat16 *w1h = (const __nv_bfloat16 *)w1_bf16;
  const __nv_bfloat16 *w2h = (const __nv_bfloat16 *)w2_bf16;
  tw_gg_args_t a = tw_gg_gate_up(w, r, x, r->sorted, w1h, act);
  const int pf = tw_gs_pf(tk, E);
  /* the TMA kernel where it fits (tw_gt_kernel; its down launch in two K
   * parts for small batches), else the streaming kernel's last round in
   * pieces (tw_gs_kernel), or else its down launch in two K parts */
  const bool gt = pass > 0 && tw_gt_fits(w, x, act);
  const bool gs = mx && bt == 16 && !gt;
  if (fmt == TW_GG_MXFP4 && !gt && !gs && tw_gw_takes(bt) && tw_gw_fits(w, act, y))
    return tw_gathered_run(w, r, T, x, act, y, false, stream,
                           [&](const tw_gg_args_t &g, int epi) {
                             return tw_gw_launch(&g, epi, tk, tw_gw_tile(tk, E, bt), stream);
                           });
  const bool tiled = gs && tw_cuda_moe_stream_balance();
  const int down_ks = gt            ? tw_down_parts(H, I, E, tk, TW_GT_RT, 4 * tw_gs_sms())
                      : gs && !tiled ? tw_down_parts(H, I, E, tk, 32, 2 * tw_gs_grid_warps())
                                     : 1;
  if (tiled) {
    a.gs_ticket = r->gs_ticket;
    a.gs_part = gs_part;
  }
  if (down_ks > 1) { /* the down launch adds its K parts into y: gate_up clears it */
    a.zero = y;
    a.zero_n = (int64_t)tk * H;
  }
  TW_CHECK(gt   ? tw_gt_launch(&a, TW_GG_SWIGLU, tk, pass, stream)
           : gs ? tw_gs_launch(&a, TW_GG_SWIGLU, pf, stream)
                : tw_gg_launch(&a, fmt, TW_GG_SWIGLU, tk, bt, stream));
  tw_gg_to_down(&a, w, w2h, act, y);
  a.ks = down_ks;
  return gt   ? tw_gt_launch(&a, TW_GG_PLAIN, tk, pass, stream)
         : gs ? tw_gs_launch(&a, TW_GG_PLAIN, pf, stream)
              : tw_gg_launch(&a, fmt, TW_GG_PLAIN, tk, bt, stream);
}
