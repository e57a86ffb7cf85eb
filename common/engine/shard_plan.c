/* shard_plan.c: the TP/EP shard of one rank (see shard_plan.h). */
#include "common/engine/shard_plan.h"

#include "common/base/log.h"
#include "common/comm/collective.h"

static TW_NODISCARD tw_status_t tw_shard_check_group(const char *name, int32_t size, int32_t rank,
                                                     int32_t group_size, int32_t group_rank) {
  if (size < 1 || rank < 0 || rank >= size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine shard: %s_rank %d of %s_size %d", name, rank,
                  name, size);
  if (size == 1) return TW_OK;
  if (group_size <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine shard: %s_size %d needs params.coll (the worker's collective group)",
                  name, size);
  if (size != group_size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine shard: %s_size %d is not the group size %d",
                  name, size, group_size);
  if (rank != group_rank)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine shard: %s_rank %d is not the group rank %d",
                  name, rank, group_rank);
  return TW_OK;
}

/* [rank n/size, (rank+1) n/size) */
static TW_NODISCARD tw_status_t tw_shard_split(const char *what, const char *by, int32_t n,
                                               int32_t size, int32_t rank, int32_t *first_p,
                                               int32_t *count_p) {
  if (n % size != 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "engine shard: %s %d not divisible by %s %d", what, n,
                  by, size);
  *count_p = n / size;
  *first_p = rank * (n / size);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_shard_plan_make(const tw_model_config_t *c, const tw_engine_params_t *p,
                                            int32_t group_size, int32_t group_rank,
                                            tw_shard_plan_t *plan) {
  TW_CHECK(tw_shard_check_group("tp", p->tp_size, p->tp_rank, group_size, group_rank));
  TW_CHECK(tw_shard_check_group("ep", p->ep_size, p->ep_rank, group_size, group_rank));
  if (p->dp_attention && (p->tp_size != 1 || p->ep_size < 2))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine shard: dp_attention needs tp_size 1 (got %d) and ep_size > 1 (got %d)",
                  p->tp_size, p->ep_size);
  tw_shard_plan_t s = {.tp_size = p->tp_size,
                       .tp_rank = p->tp_rank,
                       .ep_size = p->ep_size,
                       .ep_rank = p->ep_rank,
                       .dp_attention = p->dp_attention != 0};
  TW_CHECK(tw_shard_split("num_attention_heads", "tp_size", c->n_heads, s.tp_size, s.tp_rank, &s.q0,
                          &s.nq));
  TW_CHECK(tw_shard_split("num_key_value_heads", "tp_size", c->n_kv_heads, s.tp_size, s.tp_rank,
                          &s.kv0, &s.nkv));
  int32_t ne = 0;
  TW_CHECK(tw_shard_split("num_local_experts", "ep_size", c->n_experts, s.ep_size, s.ep_rank, &s.e0,
                          &ne));
  s.e1 = s.e0 + ne;
  const int32_t V = c->vocab_size, a = TW_SHARD_VOCAB_ALIGN;
  if (V < 1) return tw_err(TW_ERR_INVALID_ARGUMENT, "engine shard: vocab_size %d < 1", V);
  s.vp = ((V + s.tp_size - 1) / s.tp_size + a - 1) / a * a;
  if ((int64_t)(s.tp_size - 1) * s.vp >= V) /* the last rank would hold no row */
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "engine shard: vocab_size %d too small for tp_size %d (slots of %d rows)", V,
                  s.tp_size, s.vp);
  s.v0 = s.tp_rank * s.vp;
  s.nv = V - s.v0 < s.vp ? V - s.v0 : s.vp;
  *plan = s;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_shard_plan_init(const tw_model_config_t *c, const tw_engine_params_t *p,
                                            const char *who, tw_shard_plan_t *plan) {
  int32_t size = p->coll ? tw_coll_size(p->coll) : 0, rank = p->coll ? tw_coll_rank(p->coll) : 0;
  TW_CHECK(tw_shard_plan_make(c, p, size, rank, plan));
  const tw_shard_plan_t *s = plan;
  if (s->tp_size > 1 || s->ep_size > 1)
    TW_INFO("engine",
            "%s: rank tp %d/%d ep %d/%d: q heads [%d,%d) kv heads [%d,%d) experts [%d,%d) "
            "vocab [%d,%d)%s",
            who, s->tp_rank, s->tp_size, s->ep_rank, s->ep_size, s->q0, s->q0 + s->nq, s->kv0,
            s->kv0 + s->nkv, s->e0, s->e1, s->v0, s->v0 + s->nv,
            s->dp_attention ? " dp attention" : "");
  return TW_OK;
}
