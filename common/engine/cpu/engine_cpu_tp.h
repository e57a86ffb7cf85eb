/* engine_cpu_tp.h: what one rank of a TP/EP group holds in the cpu backend
 * (issue 6 item 2), and the collectives its forward pass needs. The split is
 * the shard plan of common/engine/shard_plan.h (heads, experts, vocabulary rows);
 * here are the buffers and collectives that go with it: an all-reduce of
 * the O projection's partials (TP) and of the MoE combine (EP), the
 * all-gather of the vocabulary rows, and data-parallel attention's gather
 * of every rank's MoE input rows. Weights are views into the model mmap,
 * never copies. */
#ifndef TW_COMMON_CPU_ENGINE_CPU_TP_H
#define TW_COMMON_CPU_ENGINE_CPU_TP_H

#include "common/comm/collective.h"
#include "common/engine/cpu/cpu_ops.h"
#include "common/engine/engine.h"
#include "common/engine/shard_plan.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The buffers the MoE of one forward uses, for T tokens (engine_cpu.c). */
typedef struct {
  float *xn, *proj;        /* [T, H] in / out */
  float *router;           /* [T, E] */
  int32_t *topk_idx;       /* [T, k] */
  float *topk_w;           /* [T, k] */
  int32_t *exp_tok;        /* [T] */
  float *exp_w;            /* [T] */
  float *xe, *ue, *ae, *ye; /* [T, H] [T, 2I] [T, I] [T, H] */
} tw_cpu_moe_bufs_t;

typedef struct {
  tw_coll_t *coll;         /* borrowed; NULL when tp_size = ep_size = 1 */
  tw_shard_plan_t sh;      /* this rank's heads, experts, vocabulary rows */
  int64_t cap_rows;        /* logits rows the gather buffers hold */
  float *lg_local;         /* [cap_rows, vp] */
  float *lg_all;           /* [tp, cap_rows, vp] */
  /* data-parallel attention (params.dp_attention): this forward's token
   * counts over the group, and the MoE buffers for all of them */
  int64_t t_total, t_off, t_max, cap_all;
  tw_cpu_moe_bufs_t all;   /* [cap_all] rows each */
  float *dp_recv;          /* [size, t_max, H] */
} tw_cpu_tp_t;

/** The shard plan of params->tp_rank/ep_rank for model config `c`
 *  (tw_shard_plan_init), no buffers yet. Errors: those of tw_shard_plan_init. */
TW_NODISCARD tw_status_t tw_cpu_tp_init(const tw_model_config_t *c,
                                        const tw_engine_params_t *params, tw_cpu_tp_t *tp);
/** Free the gather buffers (the collective stays the caller's). */
void tw_cpu_tp_fini(tw_cpu_tp_t *tp);

/** Sum the attention output projection's partials x f32 [n] over the TP
 *  group (nothing when tp_size = 1). Errors: those of tw_coll_allreduce. */
TW_NODISCARD tw_status_t tw_cpu_tp_reduce_attn(tw_cpu_tp_t *tp, float *x, int64_t n);
/** Sum the MoE partial combines x f32 [n] over the EP group (nothing when
 *  ep_size = 1). Errors: those of tw_coll_allreduce. */
TW_NODISCARD tw_status_t tw_cpu_tp_reduce_moe(tw_cpu_tp_t *tp, float *x, int64_t n);

/** Data-parallel attention: every rank's normalised MoE input rows. Gathers
 *  the token counts of this forward, then the rows xn f32 [T, H] of every
 *  rank into tp->all.xn [t_total, H] (rank order; this rank's rows start at
 *  t_off), sizing tp->all for t_total tokens of config c.
 *  Errors: TW_ERR_NO_MEMORY, those of tw_coll_allgather. */
TW_NODISCARD tw_status_t tw_cpu_tp_dp_gather(tw_cpu_tp_t *tp, const tw_model_config_t *c,
                                             const float *xn, int64_t T);
/** Data-parallel attention: sum the MoE partial combines tp->all.proj
 *  [t_total, H] over the group and copy this rank's rows into proj [T, H].
 *  Errors: those of tw_coll_allreduce. */
TW_NODISCARD tw_status_t tw_cpu_tp_dp_combine(tw_cpu_tp_t *tp, int64_t H, float *proj, int64_t T);

/** Unembedding of n_rows normalised rows xn f32 [n_rows, H] with lm_head
 *  bf16 [V, H] (spec §2.10): this rank's vocabulary rows, then the
 *  all-gather into logits f32 [n_rows, V] on every rank.
 *  Errors: TW_ERR_NO_MEMORY, those of tw_coll_allgather. */
TW_NODISCARD tw_status_t tw_cpu_tp_unembed(tw_cpu_tp_t *tp, tw_cpu_pool_t *pool, const float *xn,
                                           int64_t n_rows, int64_t H, const uint16_t *lm_head,
                                           int64_t V, float *logits);

#ifdef __cplusplus
}
#endif
#endif
