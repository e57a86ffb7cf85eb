/* moe.h: the mixture-of-experts block of gpt-oss on the GPU (spec §2.8, §2.9).
 *
 *   route:   top-k of the fp32 router logits (ties: lowest expert id), softmax
 *            over the k selected logits, then the permutation of the T*k
 *            (token, slot) assignments sorted by expert (stable: within an
 *            expert, assignments keep increasing a = t*k + j order).
 *   decode:  for small T. Reads only the selected experts' MXFP4 rows
 *            (16-byte loads), fuses bias + clamped interleaved SwiGLU into the
 *            gate_up pass and bias into the down pass; a combine kernel sums
 *            the k expert outputs with their routing weights. No host sync,
 *            fixed grids: capturable in CUDA graphs.
 *   prefill: for large T (and bf16 experts). Two grouped tensor-core GEMMs
 *            over all experts (moe_grouped.cu, Hopper wgmma) that read the
 *            per-expert counts on the device: gate_up gathers the token rows
 *            and dequantises MXFP4 tiles on the fly, with bias + SwiGLU fused;
 *            down; then the combine. No host sync, fixed grids: capturable.
 *            On GPUs without wgmma (compute capability other than 9.0) the
 *            cuBLAS path: dequantise, gather, one cuBLAS GEMM per expert,
 *            which reads the counts on the host (one sync per layer).
 *
 * Expert weights stay MXFP4 in device memory in the checkpoint layout (spec
 * §3.4): gate_up blocks [E, 2I, H/32, 16] u8 + scales [E, 2I, H/32] u8 (E8M0),
 * down blocks [E, H, I/32, 16] + scales [E, H, I/32]; biases fp32. Gate rows
 * are the even rows of gate_up, linear rows the odd ones.
 * Output of both paths: out f32 [T, H] = sum_j w_j (W2_e (SwiGLU(W1_e x + b1_e)) + b2_e),
 * which the engine adds to the residual stream. */
#ifndef TW_KERNELS_MOE_H
#define TW_KERNELS_MOE_H

#include "common/base/status.h"
#include "kernels/gemm.h"

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The device layout of an expert tensor's MXFP4 blocks (the checkpoint's
 *  [E, N, K/32, 16], i.e. [E][N][K/2] bytes, spec §3.4), chosen at upload
 *  by tw_cuda_mxfp4_pack: [E][KC][N][64] bytes with KC = ceil(K / 128), so
 *  byte j of row n of expert e is at ((e * KC + j / 64) * N + n) * 64 +
 *  j % 64, and bytes past K/2 in the last chunk are 0. A 128-k chunk of 256
 *  consecutive rows is then 16 contiguous KB: the decode MoE's TMA boxes
 *  read whole lines and few DRAM pages instead of 64 bytes of each row 1,440
 *  bytes apart (one 20b layer at 16 tokens 7% faster, 120b at 16 to 256
 *  tokens 6-8%; docs/benchmarks.md, "Expert weights repacked so that a TMA
 *  box is contiguous"). A 16-byte block never crosses a chunk. */
#define TW_MX_CHUNK 64

/** Bytes of E experts' packed blocks of N rows of K inputs (K a multiple of 32). */
size_t tw_cuda_mxfp4_packed_bytes(int32_t n_experts, int32_t n_rows, int32_t k);

/** Pack E experts' MXFP4 blocks from the checkpoint layout natural ([E][N][K/2]
 *  bytes, device) into packed (device, tw_cuda_mxfp4_packed_bytes, not
 *  overlapping natural), on stream. Errors: TW_ERR_INVALID_ARGUMENT (NULL,
 *  E, N or K not positive, K not a multiple of 32), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_mxfp4_pack(const uint8_t *natural, int32_t n_experts,
                                            int32_t n_rows, int32_t k, uint8_t *packed,
                                            cudaStream_t stream);

/** Device views of one layer's experts. */
typedef struct {
  int32_t n_experts;      /* E */
  int32_t hidden;         /* H, multiple of 32 */
  int32_t intermediate;   /* I, multiple of 32 */
  const uint8_t *gate_up_blocks; /* E experts of 2I rows of H, packed (TW_MX_CHUNK) */
  const uint8_t *gate_up_scales; /* [E, 2I, H/32] */
  const float *gate_up_bias;     /* [E, 2I] */
  const uint8_t *down_blocks;    /* E experts of H rows of I, packed (TW_MX_CHUNK) */
  const uint8_t *down_scales;    /* [E, H, I/32] */
  const float *down_bias;        /* [E, H] */
  float swiglu_alpha;            /* 1.702 */
  float swiglu_limit;            /* 7.0 */
} tw_cuda_moe_weights_t;

/** Block counters of the fused router (tw_cuda_moe_route_t.ticket): 1 + its token groups (<= 8). */
#define TW_CUDA_MOE_ROUTE_TICKETS 64
/** Counters of the streaming decode kernel's units cut into pieces (tw_cuda_moe_route_t.gs_ticket):
 *  one per unit of its last round, so at most this many warps in its grid. */
#define TW_CUDA_MOE_GS_TICKETS 4096

/** Routing results, device arrays carved from one buffer by tw_cuda_moe_route_init. */
typedef struct {
  int32_t max_tokens, n_experts, k;
  int32_t *topk_idx;  /* [T, k] selected experts, by descending logit */
  float *topk_w;      /* [T, k] softmax over the selected logits */
  int32_t *counts;    /* [E] assignments per expert */
  int32_t *offsets;   /* [E + 1] exclusive prefix sum of counts */
  int32_t *sorted;    /* [T*k] assignment a = t*k + j at each sorted position */
  int32_t *pos_of;    /* [T*k] sorted position of assignment a */
  int32_t *active;    /* [E] experts with counts > 0, increasing id (first n_active valid) */
  int32_t *n_active;  /* [1] */
  int32_t *ticket;    /* [TW_CUDA_MOE_ROUTE_TICKETS] block counters of tw_cuda_moe_router_fused
                       * (one for the step, one per token group); 0 between launches */
  int32_t *gs_ticket; /* [TW_CUDA_MOE_GS_TICKETS] the streaming MoE kernel's counters of
                       * (expert, rows) units cut between warps; 0 between launches */
} tw_cuda_moe_route_t;

/** Bytes of device memory for the routing arrays of up to max_tokens tokens. */
size_t tw_cuda_moe_route_bytes(int32_t max_tokens, int32_t n_experts, int32_t k);

/** Carve the routing arrays out of `mem` (device, 256-byte aligned, at least
 *  tw_cuda_moe_route_bytes bytes). Errors: TW_ERR_INVALID_ARGUMENT (NULL,
 *  non-positive sizes, k > n_experts, n_experts > 1024 or k > 32, too small). */
TW_NODISCARD tw_status_t tw_cuda_moe_route_init(void *mem, size_t bytes, int32_t max_tokens,
                                                int32_t n_experts, int32_t k,
                                                tw_cuda_moe_route_t *route_p);

/** Whether tw_cuda_moe_router_fused takes T tokens of hidden size H from x
 *  and w: 1 <= T <= 64, T <= route->max_tokens, T * E <= 4096, E <= 256,
 *  T * k <= 1024, H % 8 == 0, x and w 16-byte aligned, and
 *  TWAIN_CUDA_FUSED_ROUTER is not "0" in the environment. */
int tw_cuda_moe_router_fused_supported(const tw_cuda_moe_route_t *route, const void *x,
                                       const void *w, int32_t T, int32_t H);

/** Router GEMV and tw_cuda_moe_route in one launch (spec §2.8; the decode
 *  step's router): logits[t][e] = sum_h x[t][h] * w[e][h] + bias[e] with f32
 *  accumulation, written to `logits` (device f32 [T, E]), then top-k,
 *  softmax and the sort by expert into `route` exactly as tw_cuda_moe_route
 *  on those logits. x bf16 [T, H] and w bf16 [E, H] (row stride H, device,
 *  16-byte aligned); bias f32 [E] or NULL. Uses route->ticket (zeroed by
 *  tw_cuda_moe_route_init, left zero; one launch at a time per route).
 *  Grid depends on E and T only: capturable.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL, misaligned), TW_ERR_UNSUPPORTED
 *  (tw_cuda_moe_router_fused_supported is false: use a GEMM and
 *  tw_cuda_moe_route), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_router_fused(const tw_cuda_moe_route_t *route, const void *x,
                                                  const void *w, const float *bias, int32_t T,
                                                  int32_t H, float *logits, cudaStream_t stream);

/** Set kernel attributes (large dynamic shared memory). Call once per process
 *  and device before any other function here. Errors: TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_setup(void);

/** Router top-k + softmax + sort by expert (spec §2.8). logits f32 [T, E]
 *  (device; bias already added), 1 <= T <= route->max_tokens. NaN logits
 *  never win. Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_route(const tw_cuda_moe_route_t *route, const float *logits,
                                           int32_t T, cudaStream_t stream);

/** Bytes of the decode workspace for up to max_tokens tokens (act f32
 *  [T*k, I] and expert outputs f32 [T*k, H]). */
size_t tw_cuda_moe_decode_ws_bytes(int32_t max_tokens, int32_t k, int32_t hidden,
                                   int32_t intermediate);

/** MoE of T tokens by GEMV over the selected experts only. x bf16 [T, H]
 *  (device, the post-attention RMSNorm output); route computed from the same
 *  tokens; workspace device >= tw_cuda_moe_decode_ws_bytes(T, k, H, I);
 *  out f32 [T, H] (every element written). T <= route->max_tokens.
 *  Grids depend only on T, E and k: capturable.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL, sizes, H or I not a multiple of 32),
 *  TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_decode(const tw_cuda_moe_weights_t *w,
                                            const tw_cuda_moe_route_t *route, int32_t T,
                                            const void *x, void *workspace, size_t workspace_bytes,
                                            float *out, cudaStream_t stream);

/** Bytes of one layer's dequantised experts: bf16 gate_up [E, 2I, H] followed
 *  (256-byte aligned) by bf16 down [E, H, I]. */
size_t tw_cuda_moe_dequant_bytes(int32_t n_experts, int32_t hidden, int32_t intermediate);

/** Dequantise one layer's experts (spec §3.4) into `wdq` (device, at least
 *  tw_cuda_moe_dequant_bytes; layout above). maybe_counts (device [E]) skips
 *  experts with no tokens; NULL dequantises all, so it can run ahead of the
 *  routing, on another stream. Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_dequant(const tw_cuda_moe_weights_t *w,
                                             const int32_t *maybe_counts, void *wdq,
                                             cudaStream_t stream);

/** Whether tw_cuda_moe_prefill runs here for experts of hidden size H and
 *  intermediate size I: the current device has compute capability 9.0
 *  (wgmma), H and I are positive multiples of 32 and at most 8192 (the
 *  scales of a CTA's 128 weight rows stay in shared memory; above about 7900
 *  only one CTA fits per SM, slower but correct). */
int tw_cuda_moe_grouped_supported(int32_t hidden, int32_t intermediate);

/** The assignment tiles of tw_cuda_moe_prefill (16, 32, 64 or 128 rows of
 *  one expert per CTA, chosen from the mean expert load) whose MXFP4 experts
 *  run the decode kernel of moe_grouped.cu (mma.sync, each weight converted
 *  in registers once per CTA and used for every row of the tile) instead of
 *  the wgmma kernel: a mask, the OR of those tile sizes (0: none, 240: all).
 *  Initialised once from TWAIN_CUDA_MOE_MMA ("all", or a comma list such as
 *  "16,32"; unset, empty or "0": none, the default). Same operands, results
 *  within the GEMM path's tolerance (bf16 products, f32 sums in another
 *  order); no host sync, capturable. A graph captured before a change keeps
 *  the kernels it captured. */
uint32_t tw_cuda_moe_mma_tiles(void);

/** Set the mask of tw_cuda_moe_mma_tiles (bits other than 16, 32, 64, 128
 *  are ignored); for tests and benchmarks that compare the two kernels in one
 *  process. Not thread-safe against concurrent MoE calls. */
void tw_cuda_moe_set_mma_tiles(uint32_t tiles);

/** Whether tw_cuda_moe_prefill's MXFP4 experts at decode loads (the 16-row
 *  assignment tile: an expert's mean load at most 8; and the 32-row tile
 *  where the TMA kernel takes it, tw_cuda_moe_set_tma_pass) run the
 *  streaming kernels of moe_grouped.cu (tw_gt_kernel, or tw_gs_kernel:
 *  weights streamed from global memory into registers, mma.sync, no
 *  shared-memory staging) instead of the wgmma kernel: 1 unless
 *  TWAIN_CUDA_MOE_STREAM=0 (read once). The
 *  TWAIN_CUDA_MOE_MMA tiles take precedence. Results within the GEMM path's
 *  tolerance of the wgmma kernel (same bf16 products, f32 sums in another
 *  order); no host sync, capturable. */
int tw_cuda_moe_stream(void);

/** Set tw_cuda_moe_stream: 1 on, 0 off, negative: back to the environment's
 *  choice. For tests and benchmarks that compare kernels in one process; not
 *  thread-safe against concurrent MoE calls; a captured graph keeps its
 *  kernels. */
void tw_cuda_moe_set_stream(int on);

/** Whether the streaming decode MoE runs as the TMA kernel of
 *  moe_grouped.cu (tw_gt_kernel: one producer warp per CTA brings each
 *  256-row stage of MXFP4 weights in with the tensor memory accelerator,
 *  one or two groups of eight consumer warps convert and multiply; same
 *  arithmetic and tolerance as tw_gs_kernel) where its shapes fit (hidden
 *  and intermediate sizes multiples of 32 and at most 3,072, fewer than 256
 *  experts, 16-byte aligned tensors): nonzero unless TWAIN_CUDA_MOE_TMA=0
 *  (read once): 2 (the default) for two groups at passes of 16, 1 for one;
 *  passes of 32 always take one. */
int tw_cuda_moe_stream_tma(void);

/** Set tw_cuda_moe_stream_tma as TWAIN_CUDA_MOE_TMA would: 0 off, 1 on
 *  with one group of consumer warps at passes of 16, 2 on with two (the
 *  default; larger values: 2), negative: back to the environment's choice.
 *  For tests and benchmarks; not thread-safe against concurrent MoE calls;
 *  a captured graph keeps its kernels. */
void tw_cuda_moe_set_stream_tma(int on);

/** Force the TMA kernel's pass (assignment rows a unit of work: 16 or 32;
 *  32 with one group of eight consumer warps): it then takes every grouped
 *  launch on MXFP4 experts that it fits (TWAIN_CUDA_MOE_MMA tiles still
 *  take precedence),
 *  whatever the load (while tw_cuda_moe_stream and tw_cuda_moe_stream_tma
 *  are on); 0: back to the rule (the assignment tile as the pass, where the
 *  tile is at most TWAIN_CUDA_MOE_TMA_PASS, 16 or 32 (default): moe_grouped.cu
 *  tw_gt_pass). For tests and benchmarks; not thread-safe
 *  against concurrent MoE calls; a captured graph keeps its kernels. */
void tw_cuda_moe_set_tma_pass(int pass);

/** Force the smallest assignment tile (16, 32, 64 or 128 rows) from which the
 *  warp-specialised grouped GEMM (moe_grouped.cu tw_gw_kernel: a TMA
 *  producer warp, consumer warpgroups of 256 weight rows in all) takes the
 *  grouped launches on MXFP4 experts that the decode kernels above do not
 *  take, where it fits (hidden and intermediate sizes multiples of 32 and
 *  at most 3,072, the activation and output buffers 16-byte aligned, the
 *  driver's tensor-map encoder found; else the wgmma kernel runs); 0 or any
 *  other value: never; negative: back to TWAIN_CUDA_MOE_WS (knobs.h;
 *  default 64). Same results as the wgmma kernel within the grouped GEMM's
 *  tolerance, no host sync, capturable. For tests and benchmarks; not
 *  thread-safe against concurrent MoE calls; a captured graph keeps its
 *  kernels. */
void tw_cuda_moe_set_ws(int min_tile);

/** Whether the streaming kernel cuts its last round of (expert, 32 rows, 16
 *  assignments) units into equal k-chunk pieces over all its warps, summed
 *  in warp order (the same bits every run; a token's bits then depend on the
 *  other tokens' routes, as any split does): 1 unless
 *  TWAIN_CUDA_MOE_STREAM_BALANCE=0 (read once); with 0 whole units in turn
 *  to the end (and the down launch of small batches in two K parts). */
int tw_cuda_moe_stream_balance(void);

/** Set tw_cuda_moe_stream_balance: 1 on, 0 off, negative: back to the
 *  environment's choice. For tests and benchmarks; not thread-safe against
 *  concurrent MoE calls; a captured graph keeps its arguments. */
void tw_cuda_moe_set_stream_balance(int on);

/** Bytes of the tw_cuda_moe_prefill workspace for up to max_tokens tokens:
 *  activations bf16 [T*k, I], expert outputs f32 [T*k, H] and the decode
 *  kernel's partial sums (16 MiB, whatever the tokens). */
size_t tw_cuda_moe_prefill_ws_bytes(int32_t max_tokens, int32_t k, int32_t hidden,
                                    int32_t intermediate);

/** MoE of T tokens through two grouped tensor-core GEMMs whose per-expert
 *  row counts come from `route` on the device (see the file comment): no
 *  host synchronisation, grids that depend only on T, k, E, H and I, so it
 *  can be captured in a CUDA graph. x bf16 [T, H] (device, row stride H);
 *  route computed from the same tokens; maybe_wbf16: this layer's experts
 *  as bf16 in the layout of tw_cuda_moe_dequant (bf16 checkpoints), or NULL
 *  to read the MXFP4 experts of w (dequantised tile by tile on chip, the
 *  same bf16 values as tw_cuda_mxfp4_dequant). workspace device >=
 *  tw_cuda_moe_prefill_ws_bytes(T, k, H, I); out f32 [T, H], every element
 *  written. x and workspace 16-byte aligned (cp.async), T * k at most
 *  128 * (65535 - E) (the grid's row tiles). Products are bf16 x bf16 with
 *  f32 accumulation; bias, SwiGLU and the expert outputs stay f32, the
 *  activations are rounded to bf16. The on-chip dequantisation multiplies
 *  by the E8M0 scale in bf16: exact, as tw_cuda_mxfp4_dequant, for the
 *  normal range of scales (bytes 1..254; 0 and 255 are untested extremes).
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL, sizes, misaligned x or workspace,
 *  T * k too large, workspace too small),
 *  TW_ERR_UNSUPPORTED (tw_cuda_moe_grouped_supported is false: use
 *  tw_cuda_moe_prefill_cublas), TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_prefill(const tw_cuda_moe_weights_t *w,
                                             const tw_cuda_moe_route_t *route, int32_t T,
                                             const void *x, const void *maybe_wbf16,
                                             void *workspace, size_t workspace_bytes, float *out,
                                             cudaStream_t stream);

/** Bytes of the tw_cuda_moe_prefill_cublas workspace for up to max_tokens
 *  tokens: gathered inputs bf16 [T*k, H], gate_up output f32 [T*k, 2I],
 *  activations bf16 [T*k, I] and expert outputs f32 [T*k, H], plus the
 *  dequantised experts (tw_cuda_moe_dequant_bytes) when with_dequant is
 *  non-zero. */
size_t tw_cuda_moe_prefill_cublas_ws_bytes(int32_t max_tokens, int32_t n_experts, int32_t k,
                                           int32_t hidden, int32_t intermediate,
                                           int with_dequant);

/** The MoE of tw_cuda_moe_prefill through one cuBLAS GEMM per expert, for
 *  GPUs without wgmma (and the benchmark's reference). Same operands plus
 *  the gemm handle, a pinned host buffer host_counts [E] (cudaMallocHost)
 *  and maybe_wdq: this layer's experts already dequantised by
 *  tw_cuda_moe_dequant (complete on `stream` before this call's work
 *  starts), or NULL to dequantise the active experts here into the
 *  workspace (then sized with_dequant). The GEMMs write f32, so bias,
 *  SwiGLU and the expert outputs stay f32 and only the activations are
 *  rounded to bf16, as in tw_cuda_moe_prefill. Synchronises the host once,
 *  to read the per-expert counts. Not capturable.
 *  Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_moe_prefill_cublas(
    tw_cuda_gemm_t *gemm, const tw_cuda_moe_weights_t *w, const tw_cuda_moe_route_t *route,
    int32_t T, const void *x, const void *maybe_wdq, void *workspace, size_t workspace_bytes,
    int32_t *host_counts, float *out, cudaStream_t stream);

/** Dequantise MXFP4 rows to bf16 (spec §3.4): n_rows rows of n_cols (a
 *  multiple of 32) from blocks [n_rows, n_cols/32, 16] (the checkpoint's
 *  layout, not the packed one) and scales
 *  [n_rows, n_cols/32] into out bf16 [n_rows, n_cols]. Used by the prefill
 *  path and by tests. Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales,
                                               int64_t n_rows, int32_t n_cols, void *out,
                                               cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
