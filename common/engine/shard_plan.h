/* shard_plan.h: which part of the model one rank of a TP/EP group holds, the
 * one split both backends use (common/engine/cpu/engine_cpu_tp.c and
 * kernels/engine_cuda_tp.cu read it; neither works a shard out itself).
 *
 * With tp_size = P and rank r (spec §2.4-§2.7, §2.10; Megatron-LM's
 * column/row-parallel attention, Shoeybi et al. 2019, §3):
 *   query heads [r NQ/P, (r+1) NQ/P) and KV heads [r NKV/P, (r+1) NKV/P):
 *     the rows of q_proj/k_proj/v_proj (and biases) and the sinks of those
 *     heads (column-parallel); the GQA grouping NQ/NKV is the same on every
 *     rank; o_proj: the columns of the rank's heads (row-parallel), its bias
 *     added by rank 0 only, then an all-reduce of the [T, H] partial sums;
 *   unembedding: vocabulary rows [r Vp, min(V, (r+1) Vp)) with
 *     Vp = ceil(ceil(V / P) / 8) * 8 (a multiple of 8: the CUDA GEMM's
 *     stride rule; the cpu backend splits the same way so that a rank holds
 *     the same rows on either backend), all-gathered so every rank has the
 *     full logits rows and samples the token of TP 1.
 * With ep_size = P and rank r (spec §2.8-§2.9): experts [r E/P, (r+1) E/P);
 * the router runs in full on every rank, the combine is an all-reduce of
 * the [T, H] weighted sums.
 * tp_size and ep_size are each 1 or the group size; with both > 1 they are
 * the same ranks. TP 1 / EP 1 is the P = 1 case of the same rules: every
 * head, expert and vocabulary row, on rank 0. */
#ifndef TW_COMMON_SHARD_PLAN_H
#define TW_COMMON_SHARD_PLAN_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/model/model.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The vocabulary split's row granularity (the CUDA GEMM's ldc rule). */
#define TW_SHARD_VOCAB_ALIGN 8

typedef struct {
  int32_t tp_size, tp_rank, ep_size, ep_rank; /* ranks are 0 when the size is 1 */
  int32_t nq, q0;                             /* local query heads [q0, q0 + nq) */
  int32_t nkv, kv0;                           /* local KV heads [kv0, kv0 + nkv) */
  int32_t e0, e1;                             /* local experts [e0, e1) */
  int32_t v0, nv;                             /* local vocabulary rows [v0, v0 + nv), nv >= 1 */
  int32_t vp;       /* vocabulary rows a rank's slot holds (Vp above); vp >= nv */
  int dp_attention; /* data-parallel attention (tw_engine_params_t.dp_attention) */
} tw_shard_plan_t;

/** The shard of rank params->tp_rank / params->ep_rank for model config `c`
 *  in a collective group of group_size ranks (0: no group) where this
 *  process is group_rank. Pure: nothing is allocated or logged.
 *  Errors, all TW_ERR_INVALID_ARGUMENT with a message naming the field:
 *  a size < 1 or a rank outside [0, size); tp_size or ep_size > 1 without a
 *  group, or other than the group size, or with a rank other than
 *  group_rank; dp_attention without tp_size 1 and ep_size > 1; NQ or NKV not
 *  divisible by tp_size, E not divisible by ep_size; a vocabulary too small
 *  for every TP rank to hold a row. */
TW_NODISCARD tw_status_t tw_shard_plan_make(const tw_model_config_t *c,
                                            const tw_engine_params_t *params, int32_t group_size,
                                            int32_t group_rank, tw_shard_plan_t *plan);

/** tw_shard_plan_make in params->coll's group (none when NULL), logging the
 *  shard at INFO under `who` (the backend) when the group has > 1 rank.
 *  Errors: those of tw_shard_plan_make. */
TW_NODISCARD tw_status_t tw_shard_plan_init(const tw_model_config_t *c,
                                            const tw_engine_params_t *params, const char *who,
                                            tw_shard_plan_t *plan);

#ifdef __cplusplus
}
#endif
#endif
