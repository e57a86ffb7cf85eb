/* engine_cuda_impl.h: private state of the CUDA engine, shared by
 * engine_cuda.cu (create, upload, memory plan, destroy) and
 * engine_cuda_step.cu (the forward pass, prefill, decode, CUDA graphs).
 * Not a public header. */
#ifndef TW_KERNELS_ENGINE_CUDA_IMPL_H
#define TW_KERNELS_ENGINE_CUDA_IMPL_H

#include "common/engine/engine_impl.h"
#include "common/engine/shard_plan.h"
#include "common/kv/kv_ring.h"
#include "kernels/embed_sample.h"
#include "kernels/gemm.h"
#include "kernels/knobs.h"
#include "kernels/moe.h"

#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* decode graphs kept: (batch bucket, context bucket) pairs. Batches whose
 * attention split count follows the context have one graph per context
 * bucket (gpt-oss on one GPU: batches below 64, 7 x 10 buckets at 131k
 * context), larger ones one graph for every context (29 more up to batch
 * 1,024); see tw_ce_batch_bucket */
#define TW_CE_MAX_GRAPHS 160
/* Decode batches up to this size may run the MoE by GEMV of MXFP4 experts
 * (the workspace holds this many rows); which ones do is ce->gemv_max. Larger
 * ones (and prefill chunks) take the GEMM path: tw_cuda_moe_prefill (grouped
 * GEMMs, no host sync) or, without it, tw_cuda_moe_prefill_cublas. */
#define TW_CE_GEMV_MAX_TOKENS 64
static_assert(TW_CE_GEMV_MAX_TOKENS == TW_CUDA_KNOB_GEMV_MAX, "TWAIN_CUDA_MOE_GEMV_MAX range");
/* Device bytes the memory plan sets aside per captured decode graph (an
 * estimate: the instantiated graph's kernel nodes and parameters). */
#define TW_CE_GRAPH_BYTES ((int64_t)4 << 20)
/* Decode batches at or below which the MoE runs as a GEMV when the grouped
 * GEMMs exist (measured on the H200, docs/benchmarks.md: above it the
 * few-token grouped tiles read each expert once and win); none when those
 * tiles are the streaming kernel with its last round in pieces over every
 * warp (tw_cuda_moe_stream_balance: 20b batch 1 404 against 362 tok/s,
 * batch 2 654 against 434). tw_ce_gemv_default picks. */
#define TW_CE_GEMV_GROUPED_DEFAULT 2
#define TW_CE_GEMV_STREAM_DEFAULT 0
/* Rows of logits computed per unembedding GEMM when all logits are asked. */
#define TW_CE_LOGIT_ROWS 256

enum {
  TW_CE_PROF_EMBED, TW_CE_PROF_NORM, TW_CE_PROF_QKV, TW_CE_PROF_ROPE, TW_CE_PROF_ATTN,
  TW_CE_PROF_OPROJ, TW_CE_PROF_ROUTER, TW_CE_PROF_ROUTE, TW_CE_PROF_MOE, TW_CE_PROF_LMHEAD,
  TW_CE_PROF_SAMPLE, TW_CE_PROF_N
};

typedef struct {
  const void *attn_norm; /* bf16 [H] */
  const void *wqkv;      /* bf16 [NQ*D + 2*NKV*D, H] (q, k, v rows stacked) */
  const void *bqkv;      /* f32 [NQ*D + 2*NKV*D] (the QKV GEMM writes f32) */
  const void *wo;        /* bf16 [H, NQ*D] */
  const float *bo;       /* f32 [H] */
  const float *sinks;    /* f32 [NQ] */
  const void *mlp_norm;  /* bf16 [H] */
  const void *wr;        /* bf16 [E, H] */
  const float *br;       /* f32 [E] */
  tw_cuda_moe_weights_t moe;
  /* bf16-expert checkpoints (spec §3.5): the experts uploaded once in the
   * dequantised layout of tw_cuda_moe_dequant (gate_up [E, 2I, H], then down
   * [E, H, I]); NULL for MXFP4 experts */
  const void *wdq;
  /* MXFP4 experts with the prefill bf16 copy (tw_ce_t.pbf16): this layer's
   * experts in the same layout, for prefill passes; NULL without */
  const void *pwdq;
} tw_ce_layer_t;

typedef struct {
  int32_t b;   /* batch bucket */
  int32_t ctx; /* max_seq_len bucket */
  cudaGraphExec_t exec;
} tw_ce_graph_t;

typedef struct {
  const tw_model_config_t *cfg;
  int32_t qkv_dim, q_dim; /* (NQ + 2 NKV) D, NQ D */
  int bf16_experts; /* every MoE runs the GEMM path on layers[l].wdq */
  int moe_grouped;  /* MoE GEMM path = tw_cuda_moe_prefill (no host sync), else cuBLAS */
  int32_t gemv_max; /* MXFP4 MoE rows at or below which the GEMV runs (<= TW_CE_GEMV_MAX_TOKENS) */
  cudaStream_t stream;
  tw_cuda_gemm_t *gemm;
  /* weights: one device arena, own or mapped (engine_cuda_share.cu) */
  void *warena;
  size_t warena_bytes;
  int warena_imported;  /* mapped from another worker (its shareable handle) */
  int share_exported;   /* uploaded here and offered to the other workers */
  int share_fd;         /* the share lock while uploading; -1 otherwise */
  uint64_t share_fp;
  char share_path[1024]; /* this holder's socket (<base>.<pid>.sock) */
  char share_base[1024]; /* <dir>/weights-dev<D>-tp<T>r<R>-ep<E>r<Q> */
  int share_device;
  /* the arena from the CUDA virtual memory API (engine_cuda_share.cu) */
  int warena_vmm;
  unsigned long long vmm_handle; /* CUmemGenericAllocationHandle */
  size_t vmm_bytes;              /* reserved and mapped: bytes rounded to the granularity */
  int share_mem_fd;              /* the arena's POSIX file descriptor handle, served; -1 */
  int share_sock;                /* the listening socket; -1 */
  pthread_t share_thread;        /* serves share_mem_fd to the workers that connect */
  int share_serving;
  volatile int share_stop;
  const void *embed, *lm_head, *final_norm;
  tw_ce_layer_t *layers;
  float *rope_cos, *rope_sin;
  int32_t max_pos;
  /* KV pool */
  void *kv_pool;
  size_t kv_bytes;
  int64_t kv_layer_stride_bytes;
  int64_t *kv_layer_off;  /* [n_layers] where each layer starts (kv_ring.h) */
  int64_t kv_block_bytes; /* one block of one layer */
  bool kv_fp8;            /* the fp8 KV cache (common/kv/kv_fp8.h; engine kv_dtype) */
  /* the window ring of the sliding layers (common/kv/kv_ring.h; ring_blocks 0:
   * none): ring layers write and read through d_ring_slots / d_ring_tables,
   * a decode step its sequences' ring views, a prefill pass the scratch of
   * its plan (copied in and out by d_ring_pairs: n_ring_in then n_ring_out) */
  int32_t ring_blocks;
  uint64_t ring_layers;
  int32_t *d_ring_slots, *d_ring_tables, *d_ring_pairs; /* [max_rows] [B][mbps] [4 B R] */
  int32_t *h_ring_slots, *h_ring_tables, *h_ring_pairs; /* pinned staging, the same sizes */
  int32_t n_ring_in, n_ring_out;
  void *ring_scratch;  /* prefill: the pass's scratch blocks of one layer */
  int32_t cap_scratch; /* blocks */
  tw_kv_ring_pass_t ring_plan;
  /* workspace: one device arena */
  void *ws_arena;
  size_t ws_bytes;
  int32_t block_size; /* KV block (tokens) */
  int32_t chunk;    /* prefill chunk (tokens) */
  int32_t max_rows; /* max(chunk, max_batch) */
  int32_t max_batch;
  float *x, *o, *moe_out, *rlog, *logits;
  void *xn, *qkv, *q, *attn; /* qkv: f32 QKV GEMM output; q: rotated bf16 queries */
  tw_cuda_moe_route_t route;
  void *moe_dec_ws, *moe_pre_ws, *attn_ws;
  /* MoE GEMM path: layer l+1's experts are dequantised on dq_stream into
   * dq_buf[(l+1)%2] while layer l computes (two buffers, events between) */
  cudaStream_t dq_stream;
  void *dq_buf[2];
  size_t dq_bytes;
  cudaEvent_t dq_start, dq_done[2], dq_free[2];
  size_t moe_dec_bytes, moe_pre_bytes, attn_ws_bytes;
  /* the prefill bf16 copy of the MXFP4 experts (engine.h prefill_bf16_experts,
   * mem_plan.h): n_layers x tw_cuda_moe_dequant_bytes, dequantised once at
   * create; prefill passes of at least pbf16_min rows (and more than
   * gemv_max) run their MoE on it through cuBLAS, the workspace sized for
   * that path. NULL without. */
  void *pbf16;
  int32_t pbf16_min; /* TWAIN_CUDA_PREFILL_BF16_MIN (knobs.h); INT32_MAX without the copy */
  int32_t *d_tokens, *d_positions, *d_slots, *d_seq_lens, *d_cu, *d_start, *d_block_tables,
      *d_next;
  tw_cuda_sample_row_t *d_params;
  int32_t max_blocks_per_seq;
  /* pinned host staging */
  void *h_arena;
  int32_t *h_tokens, *h_positions, *h_slots, *h_seq_lens, *h_cu, *h_next, *h_counts,
      *h_block_tables;
  tw_cuda_sample_row_t *h_params;
  /* tensor/expert parallelism (issue 6; engine_cuda_tp.cu). tp = ep = 1
   * (coll NULL) leaves every path of the single-GPU engine unchanged. */
  struct tw_coll *coll;   /* borrowed NCCL group; NULL when tp = ep = 1 */
  tw_shard_plan_t sh;     /* this rank's heads, experts, vocabulary rows (shard_plan.h) */
  float *lg_local, *lg_all; /* tp > 1: [lrows, vp] and [tp, lrows, vp] */
  /* decode graphs */
  tw_ce_graph_t graphs[TW_CE_MAX_GRAPHS];
  int32_t n_graphs;
  int use_graphs;
  /* TWAIN_CUDA_PROFILE=1: eager steps, each op timed with events (debug);
   * 1 until the third decode step resets the sums (first calls excluded), then 2 */
  int profile;
  cudaEvent_t prof_ev[2];
  double prof_ms[TW_CE_PROF_N];
  int64_t prof_steps[2]; /* prefill chunks, decode steps */
} tw_ce_t;

/** This rank's shard plan into ce->sh (tw_shard_plan_init: every head,
 *  expert and vocabulary row when tp = ep = 1), checked against what this
 *  backend builds, and ce->coll bound to ce->stream (engine_cuda_tp.cu).
 *  Errors: those of tw_shard_plan_init (TW_ERR_INVALID_ARGUMENT);
 *  TW_ERR_UNSUPPORTED with the reason: tp or ep > 1 without an NCCL group,
 *  bf16 experts with ep > 1, data-parallel attention; those of
 *  tw_coll_nccl_set_stream. */
TW_NODISCARD tw_status_t tw_ce_tp_init(tw_ce_t *ce, const tw_model_config_t *c,
                                       const tw_engine_params_t *p, int bf16_experts);
/** Sum x f32 [n] (device) over the group on ce->stream (NCCL all-reduce). */
TW_NODISCARD tw_status_t tw_ce_tp_allreduce(tw_ce_t *ce, float *x, int64_t n);
/** tp > 1: logits of `rows` normalised rows xn bf16 [rows, H] into
 *  ce->logits [rows, V]: this rank's vocabulary rows, all-gather, scatter. */
TW_NODISCARD tw_status_t tw_ce_tp_unembed(tw_ce_t *ce, const void *xn, int32_t rows);
/** ep > 1: the MoE of T rows of ce->xn into ce->moe_out (partial sums of
 *  this rank's experts, then the all-reduce): router, route, mask of the
 *  other ranks' experts and GEMV in slices of TW_CE_GEMV_MAX_TOKENS rows. */
TW_NODISCARD tw_status_t tw_ce_ep_moe(tw_ce_t *ce, const tw_ce_layer_t *L, int32_t T);

/** Weights shared between the workers on a GPU (engine_cuda_share.cu;
 *  engine.h weights_share_dir). Open: map the arena of `bytes` that a live
 *  worker for this device and shard holds, received as a file descriptor
 *  over its socket (*imported_p = 1: the weights are there, build pointers
 *  only), or allocate it (*imported_p = 0) holding the share lock; the
 *  caller uploads, then calls publish. Errors: TW_ERR_IO (the lock or the
 *  directory), TW_ERR_DEADLINE (another worker held the lock for 900 s),
 *  TW_ERR_NO_MEMORY, TW_ERR_CUDA (the virtual memory API failed). */
TW_NODISCARD tw_status_t tw_ce_share_open(tw_ce_t *ce, const tw_model_t *m,
                                          const tw_engine_params_t *p, size_t bytes,
                                          int *imported_p);
/** Offer the uploaded arena to the other workers (its socket) and release
 *  the lock. Errors: TW_ERR_CUDA (no shareable handle), TW_ERR_IO (the
 *  socket). */
TW_NODISCARD tw_status_t tw_ce_share_publish(tw_ce_t *ce, int device);
/** Stop serving the arena, then unmap it and release this process's
 *  reference (the memory lives on while another worker maps it). */
void tw_ce_share_close(tw_ce_t *ce);
/** The decode graph batch bucket for n live sequences (1 <= n <= max_batch):
 *  the padded batch a step runs (engine_cuda_step.cu). */
int32_t tw_ce_batch_bucket(int32_t n, int32_t max_batch);

/** The engine ops (engine_cuda_step.cu). */
TW_NODISCARD tw_status_t tw_ce_prefill_pass(tw_engine_t *engine, const tw_prefill_pass_t *pass);
TW_NODISCARD tw_status_t tw_ce_decode(tw_engine_t *engine, const tw_decode_args_t *args);
/** Capture the decode graph of every (batch, context) bucket (tw_engine_warmup). */
TW_NODISCARD tw_status_t tw_ce_warmup(tw_engine_t *engine);
/** Log the per-op times gathered in profile mode (engine_cuda_step.cu). */
void tw_ce_profile_log(const tw_ce_t *ce);
/** Destroy the captured graphs (engine_cuda_step.cu). */
void tw_ce_graphs_destroy(tw_ce_t *ce);

#ifdef __cplusplus
}
#endif
#endif
