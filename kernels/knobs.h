/* knobs.h: the CUDA backend's kernel knobs, environment variables for A/B runs
 * on the GPU machine that change how it computes, never what
 * (docs/operations.md "CUDA kernel knobs" lists each with its default and
 * range). They are read from the environment once per process, at the first
 * engine creation (or the first kernel call that needs one, in kernel tests
 * and benchmarks), into one struct; no kernel calls getenv. A value outside
 * its range is logged at WARN and means the default. */
#ifndef TW_KERNELS_KNOBS_H
#define TW_KERNELS_KNOBS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Decode attention's split CTAs per call (TWAIN_CUDA_DC_CTAS's default): one
 * wave of 4 CTAs per SM (48 KB of shared memory each) on an H200's 132 SMs.
 * On the H200, 512 beat 528 (2 waves at batch 4 and 16) by up to 26% at
 * batch 4-16, 1024 was slower at batch 1-16, and from batch 64 (one split)
 * all three agree within noise (docs/benchmarks.md). */
#define TW_DC_TARGET_CTAS 512
/* TWAIN_CUDA_PREFILL_BF16_MIN's default: a prefill pass of at least this
 * many tokens runs its MoE through cuBLAS on the worker's bf16 copy of the
 * experts (engine.h prefill_bf16_experts); a shorter one keeps the grouped
 * GEMM on the MXFP4 experts, faster there (docs/benchmarks.md, "The prefill
 * MoE on a bf16 copy of the experts"). */
#define TW_PREFILL_BF16_MIN_TOKENS 2048
/* TWAIN_CUDA_MOE_GEMV_MAX's upper bound (TW_CE_GEMV_MAX_TOKENS) */
#define TW_CUDA_KNOB_GEMV_MAX 64

typedef struct {
  int moe_cublas;       /* TWAIN_CUDA_MOE_CUBLAS=1: per-expert cuBLAS MoE (default 0) */
  int prefill_bf16_min; /* TWAIN_CUDA_PREFILL_BF16_MIN 0..1048576: tokens from which a prefill
                           pass runs its MoE on the bf16 copy (TW_PREFILL_BF16_MIN_TOKENS) */
  int moe_gemv_max;     /* TWAIN_CUDA_MOE_GEMV_MAX 0..64, -1 unset: the engine's default */
  int profile;          /* TWAIN_CUDA_PROFILE=1: per-op timing, no graphs (default 0) */
  int gemv;             /* TWAIN_CUDA_GEMV=0 turns the small-M GEMV kernel off (default 1) */
  int fused_router;     /* TWAIN_CUDA_FUSED_ROUTER=0 turns the fused router off (default 1) */
  int pdl;              /* TWAIN_CUDA_PDL=0 turns programmatic dependent launch off (default 1) */
  int dc_ctas;          /* TWAIN_CUDA_DC_CTAS 1..1048576: decode attention target CTAs (512) */
  int dc_stages;        /* TWAIN_CUDA_DC_STAGES 2 or 3: cp.async stages (3) */
  int dc_fused;         /* TWAIN_CUDA_DC_FUSED 0 or 1: last-CTA merge of the splits (1) */
  const char *moe_bt;   /* TWAIN_CUDA_MOE_BT as given (NULL unset): grouped MoE tile rows */
  const char *moe_mma;  /* TWAIN_CUDA_MOE_MMA as given (NULL unset): mma.sync tiles */
  int moe_stream;       /* TWAIN_CUDA_MOE_STREAM=0 turns the streaming decode MoE off (default 1) */
  int moe_stream_warps; /* TWAIN_CUDA_MOE_STREAM_WARPS 8 or 16: its warps per CTA (16) */
  int moe_stream_bpf;   /* TWAIN_CUDA_MOE_STREAM_BPF 0, 1 or 2: which of its passes load their
                         * token rows a k-chunk ahead in registers (moe_grouped.cu tw_gs_pf);
                         * -1 (unset): by the expected load */
  int moe_stream_splitk; /* TWAIN_CUDA_MOE_STREAM_SPLITK=0: its down launch in one K part (1:
                            two parts where its items are fewer than twice the warps) */
  int moe_stream_balance; /* TWAIN_CUDA_MOE_STREAM_BALANCE=0: its last round of (expert, rows)
                             units is not cut into pieces over every warp (default 1) */
  int moe_tma;            /* TWAIN_CUDA_MOE_TMA 0, 1 or 2: the streaming decode MoE's weight
                            copies in its own warps (0; the 32-row tile then runs the wgmma
                            kernel), or by the TMA kernel's producer warp for 8 (1) or 16 (2,
                            default) consumer warps at the 16-row tile (8 at the 32-row tile) */
  int moe_tma_pass;       /* TWAIN_CUDA_MOE_TMA_PASS 16 or 32: the largest assignment tile the
                            TMA decode MoE takes, as its pass (rows a unit); 32 (default) */
  int moe_ws;             /* TWAIN_CUDA_MOE_WS 0, 16, 32, 64 or 128: the smallest assignment tile
                            the warp-specialised grouped GEMM (tw_gw_kernel) takes on MXFP4
                            experts; 64 (default); 0: none (the wgmma kernel everywhere) */
  int route_fused_max;   /* TWAIN_CUDA_ROUTE_FUSED_MAX 0..1024: assignments (T x k) up to which
                            the router GEMM's route runs as one block (128) */
} tw_cuda_knobs_t;

/** The knobs, read from the environment on the first call (thread-safe);
 *  later calls return the same values without reading it again. */
const tw_cuda_knobs_t *tw_cuda_knobs(void);

/** Read the environment again (kernel tests that setenv between cases).
 *  Not safe while another thread launches kernels; a captured CUDA graph
 *  keeps the values it was captured with. */
void tw_cuda_knobs_reload(void);

#ifdef __cplusplus
}
#endif
#endif
