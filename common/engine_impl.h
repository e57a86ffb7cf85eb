/* engine_impl.h: the backend op table behind engine.h. Each backend provides
 * one tw_engine_ops_t and a create function; engine.c dispatches. */
#ifndef TW_COMMON_ENGINE_IMPL_H
#define TW_COMMON_ENGINE_IMPL_H

#include "common/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_ENGINE_MAGIC 0x7477656eu /* "twen" */

typedef struct {
  const char *name;
  void (*destroy)(tw_engine_t *engine);
  tw_status_t (*prefill)(tw_engine_t *engine, const tw_prefill_args_t *args);
  tw_status_t (*decode)(tw_engine_t *engine, const tw_decode_args_t *args);
  tw_status_t (*warmup)(tw_engine_t *engine); /* NULL: nothing to prepare */
} tw_engine_ops_t;

struct tw_engine {
  uint32_t magic;
  const tw_engine_ops_t *ops;
  const tw_model_t *model;  /* borrowed */
  tw_engine_params_t params;
  tw_kv_layout_t kv;
  void *backend;            /* backend-private state */
};

/** CPU backend constructor (common/cpu/engine_cpu.c). */
tw_status_t tw_cpu_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                 tw_engine_t **engine_p);
/** CUDA backend constructor (kernels/engine_cuda.cu); only when TWAIN_HAVE_CUDA. */
tw_status_t tw_cuda_engine_create(const tw_model_t *model, const tw_engine_params_t *params,
                                  tw_engine_t **engine_p);
/** Whether a CUDA device is usable at run time (false without TWAIN_HAVE_CUDA). */
int tw_cuda_available(void);

#ifdef __cplusplus
}
#endif
#endif
