/* engine_impl.h: the backend op table behind engine.h. Each backend provides
 * one tw_engine_ops_t and a create function; engine.c dispatches. */
#ifndef TW_COMMON_ENGINE_IMPL_H
#define TW_COMMON_ENGINE_IMPL_H

#include "common/engine.h"
#include "common/mem_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_ENGINE_MAGIC 0x7477656eu /* "twen" */

typedef struct {
  const char *name;
  void (*destroy)(tw_engine_t *engine);
  tw_status_t (*prefill)(tw_engine_t *engine, const tw_prefill_args_t *args);
  tw_status_t (*decode)(tw_engine_t *engine, const tw_decode_args_t *args);
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

/** CPU backend constructor (common/cpu/engine_cpu.c). */
tw_status_t tw_cpu_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                 tw_engine_t **engine_p);
/** CUDA backend constructor (kernels/engine_cuda.cu); only when TWAIN_HAVE_CUDA. */
tw_status_t tw_cuda_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                  tw_engine_t **engine_p);
/** Device bytes of the CUDA engine's workspace (tp = ep = 1) for decode
 *  steps of max_batch sequences and prefill chunks of `chunk` tokens, with
 *  the grouped-GEMM MoE (Hopper) or the cuBLAS one: what the memory plan
 *  reserves (kernels/engine_cuda.cu); no device is touched. -1 on a bad
 *  config. Only when TWAIN_HAVE_CUDA. */
int64_t tw_cuda_engine_workspace_bytes(const tw_model_config_t *c, int32_t block_size,
                                       int32_t max_batch, int32_t chunk, int grouped_moe);
/** Whether a CUDA device is usable at run time (false without TWAIN_HAVE_CUDA). */
int tw_cuda_available(void);

#ifdef __cplusplus
}
#endif
#endif
