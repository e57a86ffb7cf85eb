/* engine_impl.h: the backend op table behind engine.h. Each backend provides
 * one tw_engine_ops_t and a create function; engine.c dispatches. */
#ifndef TW_COMMON_ENGINE_IMPL_H
#define TW_COMMON_ENGINE_IMPL_H

#include "common/engine/engine.h"
#include "common/engine/mem_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_ENGINE_MAGIC 0x7477656eu /* "twen" */

/* One segment of a prefill pass: consecutive positions of one sequence. */
typedef struct {
  const int32_t *tokens;      /* [n_tokens] */
  int32_t n_tokens;
  int32_t start_pos;
  const int32_t *block_table; /* [n_blocks] */
  int32_t n_blocks;
  int32_t out;                /* -1, or the output row of its last position (below) */
} tw_prefill_seg_t;

/* One forward pass of a prefill, planned by engine.c (the chunking to
 * max_prefill_chunk tokens and max_batch segments, which rows come out and
 * at which positions they are sampled live there, once for all backends).
 * The backend runs the n_tokens = sum of segs[].n_tokens tokens as one
 * batch (token row t of segment s is row cu[s] + t, cu the running sum)
 * and then produces:
 *   all_logits: NULL, or host f32 [n_tokens, V]: every row's logits (only
 *     planned for a pass of one segment).
 *   for each output row k < n_out (the last row of the segment whose
 *     out == k; outs are 0, 1, ... in segment order):
 *     logits_rows[k] NULL or host f32 [V]: that row's logits;
 *     next_tokens (NULL = no sampling) [n_out]: the token sampled from it with
 *     sample[k] at position sample_pos[k] (tw_sample, sampling.h).
 * on_pass_layer (may be NULL): called with (arg, layer) once layer's K/V of
 * every segment is complete in the pool (the engine.h on_layer_done rules). */
typedef struct {
  int32_t n_segs, n_tokens, n_out;
  const tw_prefill_seg_t *segs;
  float *all_logits;
  float *const *logits_rows;          /* [n_out] */
  const tw_sample_params_t *sample;   /* [n_out], always set */
  const int64_t *sample_pos;          /* [n_out] */
  int32_t *next_tokens;               /* [n_out] or NULL */
  void (*on_pass_layer)(void *arg, int32_t layer);
  void *on_pass_arg;
} tw_prefill_pass_t;

typedef struct {
  const char *name;
  void (*destroy)(tw_engine_t *engine);
  /* one prefill pass (above); arguments already checked by engine.c */
  TW_NODISCARD tw_status_t (*prefill_pass)(tw_engine_t *engine, const tw_prefill_pass_t *pass);
  TW_NODISCARD tw_status_t (*decode)(tw_engine_t *engine, const tw_decode_args_t *args);
  TW_NODISCARD tw_status_t (*warmup)(tw_engine_t *engine); /* NULL: nothing to prepare */
} tw_engine_ops_t;

struct tw_engine {
  uint32_t magic;
  const tw_engine_ops_t *ops;
  const tw_model_t *model;  /* borrowed */
  tw_engine_params_t params;
  tw_kv_layout_t kv;
  void *backend;            /* backend-private state */
  int weights_origin;       /* tw_engine_weights_origin */
};

/** The backend-independent part of the memory plan's input from the
 *  engine params (role, workers on the device, utilization, overrides);
 *  the backend adds the device's size, weights, KV dtype, workspace. */
void tw_engine_plan_input(const tw_model_t *model, const tw_engine_params_t *params,
                          tw_mem_plan_in_t *in);
/** Log a plan at INFO and take its kv blocks, and its max batch and prefill
 *  chunk where params has none (0). */
void tw_engine_plan_apply(const tw_mem_plan_t *plan, tw_engine_params_t *params);

/** CPU backend constructor (common/engine/cpu/engine_cpu.c). */
TW_NODISCARD tw_status_t tw_cpu_engine_create(const tw_model_t *model,
                                              const tw_engine_params_t *params,
                                              tw_engine_t **engine_p);
/** CUDA backend constructor (kernels/engine_cuda.cu); only when TWAIN_HAVE_CUDA. */
TW_NODISCARD tw_status_t tw_cuda_engine_create(const tw_model_t *model,
                                               const tw_engine_params_t *params,
                                               tw_engine_t **engine_p);
/** Device bytes of the CUDA engine's workspace (tp = ep = 1) for decode
 *  steps of max_batch sequences and prefill chunks of `chunk` tokens, with
 *  the grouped-GEMM MoE (Hopper) or the cuBLAS one: what the memory plan
 *  reserves (kernels/engine_cuda.cu); no device is touched. -1 on a bad
 *  config. Only when TWAIN_HAVE_CUDA. */
int64_t tw_cuda_engine_workspace_bytes(const tw_model_config_t *c, int32_t block_size,
                                       int32_t max_batch, int32_t chunk, int grouped_moe);
/** Decode graphs the CUDA engine captures at most (tp = ep = 1) for decode
 *  steps of up to max_batch sequences (its batch and context buckets); no
 *  device is touched. -1 on a bad config. Only when TWAIN_HAVE_CUDA. */
int32_t tw_cuda_engine_graph_count(const tw_model_config_t *c, int32_t max_batch);
/** Whether a CUDA device is usable at run time (false without TWAIN_HAVE_CUDA). */
int tw_cuda_available(void);

#ifdef __cplusplus
}
#endif
#endif
