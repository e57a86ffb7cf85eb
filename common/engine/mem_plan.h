/* mem_plan.h: the memory plan of the workers that share one device (one GPU,
 * or the host for the cpu backend). A pure function: from the device's size,
 * the model, the KV dtype and block size, the workers placed on the device
 * (prefill, decode) and whether they share one copy of the weights, and the
 * backend's workspace needs, it works out for every worker its KV pool, the
 * decode max batch and the prefill token budget, and describes the plan in
 * lines a person can read (the engine logs them at INFO).
 *
 * The budget is utilization x total bytes (vLLM's --gpu-memory-utilization,
 * default 0.90), split in this order:
 *   1. the weights: one copy per worker, or one in all when shared;
 *   2. a runtime reserve per process (CUDA context, cuBLAS workspaces,
 *      allocator slack: TW_MEM_PROCESS_RESERVE on a GPU);
 *   3. each prefill worker's workspace at its token budget (8,192 tokens, or
 *      the largest of 4,096 / 2,048 / 1,024 that fits) and its KV pool: one
 *      prompt of the full context plus a token budget in flight while the
 *      previous batch is handed off, but at most an eighth of the memory
 *      left for KV and at least two token budgets (a prefill worker holds
 *      its prompts only until their handoff);
 *   4. the rest to the decode workers in equal parts: each takes the largest
 *      max batch (a decode graph bucket: a power of two up to 1,024) whose
 *      workspace and decode graphs leave a KV pool of at least
 *      TW_MEM_TOKENS_PER_SEQ tokens per sequence, and makes all the rest its
 *      KV pool (never more than max batch sequences of the full context).
 * With the window ring (kv_ring.h, window_ring) a pool's blocks hold every
 * position of the full-attention layers, and the sliding layers keep R
 * blocks a sequence for TW_MEM_RING_SEQS x max batch sequences (running and
 * reserved; prefill: x TW_MEM_PREFILL_SEQS), so past the window a token
 * costs only the full layers' bytes: kv_blocks counts positions, and
 * kv_ring_blocks the sliding layers' blocks.
 * A backend that can hold a bf16 copy of the MXFP4 experts for its prefill
 * MoE (the cuda engine: dense tensor-core GEMMs instead of converting the
 * weights in every tile) says what the copy costs (prefill_bf16_bytes); each
 * prefill worker then holds one when asked (prefill_bf16 1), or with
 * prefill_bf16 0 (auto; the workers' own default is off, -1) when the
 * prefill workers' copies take at most TW_MEM_PREFILL_BF16_SHARE of
 * the budget left after the weights and reserves and the plan still fits
 * with them (step 3 adds it to the prefill worker's workspace).
 * Flags override a planned value for the worker they are given to. */
#ifndef TW_COMMON_MEM_PLAN_H
#define TW_COMMON_MEM_PLAN_H

#include "common/base/status.h"
#include "common/model/config.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MEM_GIB (1024.0 * 1024.0 * 1024.0)
#define TW_MEM_DEFAULT_UTILIZATION 0.90
/* per process on a GPU: CUDA context (~0.5 GiB on Hopper), cuBLAS/cuBLASLt
 * workspaces, NCCL, allocator slack */
#define TW_MEM_PROCESS_RESERVE ((int64_t)1 << 30)
#define TW_MEM_MAX_BATCH 1024      /* largest decode graph bucket */
#define TW_MEM_TOKENS_PER_SEQ 1024 /* a planned max batch leaves this many KV tokens each */
#define TW_MEM_PREFILL_TOKENS 8192 /* prefill token budget when memory allows */
#define TW_MEM_PREFILL_SEQS 64     /* prompts in one prefill batch (twain-prefill --batch-seqs) */
#define TW_MEM_MIN_DECODE_TOKENS 4096 /* smallest decode KV pool the plan accepts */
#define TW_MEM_GRAPH_CTX_MIN 256   /* smallest decode graph context bucket (engine_cuda_step.cu) */
#define TW_MEM_RING_SEQS 2         /* window rings per max-batch sequence: running + reserved */
#define TW_MEM_PREFILL_BF16_SHARE 0.40 /* most of the memory after the weights for those copies */
#define TW_MEM_MAX_LINES 10

typedef enum {
  TW_MEM_ROLE_NONE = 0,    /* not planned: the caller's fixed counts */
  TW_MEM_ROLE_PREFILL = 1, /* this worker prefills prompts */
  TW_MEM_ROLE_DECODE = 2,  /* this worker decodes */
} tw_mem_role_t;

/** Device bytes the backend's workspace takes for a worker running decode
 *  steps of up to `max_batch` sequences and prefill forwards of up to
 *  `chunk` tokens (activations, logits, MoE and attention workspaces, index
 *  buffers, RoPE tables). Must be a pure function of its arguments. */
typedef int64_t (*tw_mem_ws_fn)(void *arg, int32_t max_batch, int32_t chunk);

typedef struct {
  int64_t total_bytes;     /* device memory (cudaMemGetInfo total, or host RAM) */
  int64_t free_bytes;      /* free now, read after this worker's weights are in place;
                              0: unknown (no check against it) */
  double utilization;      /* share of total the co-located workers may use; 0: 0.90 */
  const tw_model_config_t *cfg;
  int64_t weight_bytes;    /* one copy of the weights as this worker holds them;
                              0: tw_mem_weight_bytes(cfg) */
  int32_t kv_elem_bytes;   /* bytes per K/V value: 2 (bf16, cuda), 4 (f32, cpu) */
  bool kv_fp8;             /* the fp8 KV cache (kv_fp8.h): 1 byte a value and a 4-byte scale
                            * per (token, kv head) of K and of V; kv_elem_bytes unused */
  int32_t kv_heads;        /* kv heads this worker holds (tp shard); 0: cfg->n_kv_heads */
  int32_t block_size;      /* tokens per KV block */
  int32_t n_prefill, n_decode; /* workers on this device, this one included */
  bool shared_weights;     /* one copy of the weights serves them all */
  tw_mem_role_t role;      /* this worker's */
  tw_mem_ws_fn ws_bytes;   /* the backend's workspace (NULL: none) */
  void *ws_arg;
  int64_t graph_bytes;     /* device bytes per captured decode graph (0: no graphs) */
  /* decode graphs captured at most for a max batch (called with ws_arg);
   * NULL: one per power-of-two batch bucket and context bucket from 256 */
  int32_t (*graph_count)(void *arg, int32_t max_batch);
  int64_t process_reserve; /* per process; 0: TW_MEM_PROCESS_RESERVE; < 0: none */
  int32_t max_batch_cap;   /* 0: TW_MEM_MAX_BATCH */
  int64_t kv_cap_bytes;    /* most KV bytes per worker; 0: no cap */
  bool window_ring;        /* the sliding layers keep only their window (kv_ring.h) */
  /* bytes of one prefill worker's bf16 copy of the experts (0: the backend
   * holds none), and whether the prefill workers hold one: 1 yes, -1 no, 0
   * the rule at the top of this file. Both roles must be given the same
   * values (the decode workers plan around the prefill workers' copies). */
  int64_t prefill_bf16_bytes;
  int32_t prefill_bf16;
  /* overrides for this worker (flags); 0: planned */
  int32_t kv_blocks, max_batch, prefill_tokens;
} tw_mem_plan_in_t;

typedef struct {
  /* this worker */
  int32_t kv_blocks;
  int32_t kv_ring_blocks;  /* blocks the sliding layers hold (= kv_blocks without the ring) */
  int32_t max_batch;       /* decode: sequences per step; prefill: prompts a batch */
  int32_t prefill_tokens;  /* prefill: token budget per forward; decode: rows of its workspace */
  int64_t workspace_bytes; /* its workspace (+ decode graphs) */
  int64_t kv_bytes;
  /* the whole device */
  int64_t budget_bytes, weight_bytes; /* weight_bytes: one copy */
  int32_t weight_copies;
  int64_t prefill_kv_bytes, decode_kv_bytes; /* per worker of each role as planned */
  int32_t prefill_kv_blocks, decode_kv_blocks, decode_max_batch;
  int32_t prefill_kv_ring_blocks, decode_kv_ring_blocks;
  int64_t unplanned_bytes; /* budget left after the whole plan (>= 0) */
  bool prefill_bf16;       /* each prefill worker holds a bf16 copy of the experts */
  int64_t prefill_bf16_bytes; /* its bytes (in the prefill workspace); 0 without */
  int n_lines;
  char lines[TW_MEM_MAX_LINES][320];
} tw_mem_plan_t;

/** Bytes of one copy of the weights as the engines hold them (tp = ep = 1):
 *  MXFP4 experts as their packed blocks and e8m0 scales (spec §3.4: E x R x
 *  C / 2 + E x R x C / 32 per projection), expert biases, attention biases,
 *  sinks and router bias as f32, every other tensor (embedding, lm_head,
 *  attention, router, norms) bf16. mxfp4_p / rest_p (may be NULL) get the
 *  expert blocks+scales and the rest. Checkpoints with bf16 experts count
 *  them as bf16 (2 bytes a value). The checkpoint's byte count: the CUDA
 *  engine's device layout of the blocks (kernels/moe.h TW_MX_CHUNK) pads
 *  each row's K / 2 bytes to a multiple of 64 (2.2% more at K = 2,880), so
 *  that engine passes its arena's real size as weight_bytes instead. */
int64_t tw_mem_weight_bytes(const tw_model_config_t *cfg, int64_t *mxfp4_p, int64_t *rest_p);

/** Work out the plan (see the top of this file) for `in->role`'s worker.
 *  Errors: TW_ERR_INVALID_ARGUMENT (NULL, no config, no workers, role not
 *  among the workers, block size or utilization out of range, negative
 *  override), TW_ERR_NO_MEMORY (the weights and reserves exceed the budget,
 *  or no decode KV pool of TW_MEM_MIN_DECODE_TOKENS tokens is left, or the
 *  free memory cannot hold this worker's share; the message gives the
 *  figures and what to change). On error *plan_p is zeroed. */
TW_NODISCARD tw_status_t tw_mem_plan(const tw_mem_plan_in_t *in, tw_mem_plan_t *plan_p);

/** Log the plan's lines at INFO under `subsys`. */
void tw_mem_plan_log(const tw_mem_plan_t *plan, const char *subsys);

/** Parse --gpu-memory-utilization: a number in (0, 1]. Errors:
 *  TW_ERR_INVALID_ARGUMENT naming the value. */
TW_NODISCARD tw_status_t tw_mem_parse_utilization(const char *s, double *out_p);

/** Parse --colocated P,D (prefill and decode workers on this device, this
 *  one included; each 0..64, not both 0). Errors: TW_ERR_INVALID_ARGUMENT. */
TW_NODISCARD tw_status_t tw_mem_parse_colocated(const char *s, int32_t *n_prefill_p,
                                                int32_t *n_decode_p);

/** Where --colocated P,D goes: the two counts of a worker's options. */
typedef struct {
  int32_t *n_prefill, *n_decode;
} tw_mem_colocated_t;

/** The --colocated option's parser (common/base/opts.h TW_OPT_FN; dst:
 *  tw_mem_colocated_t *): tw_mem_parse_colocated, its message in err. */
int tw_mem_colocated_opt(const char *text, void *dst, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
