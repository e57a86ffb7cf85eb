/* engine_cpu_tp.c: the shard of one TP/EP rank in the cpu backend and its
 * collectives (see engine_cpu_tp.h; issue 6 item 2). */
#include "common/engine/cpu/engine_cpu_tp.h"

#include "common/base/log.h"

#include <stdlib.h>
#include <string.h>

TW_NODISCARD tw_status_t tw_cpu_tp_init(const tw_model_config_t *c, const tw_engine_params_t *p,
                                        tw_cpu_tp_t *tp) {
  tw_cpu_tp_t t = {.coll = p->coll};
  TW_CHECK(tw_shard_plan_init(c, p, "cpu", &t.sh));
  if (t.sh.tp_size == 1 && t.sh.ep_size == 1) t.coll = NULL;
  *tp = t;
  return TW_OK;
}

static void tw_cpu_moe_bufs_free(tw_cpu_moe_bufs_t *b) {
  free(b->xn);
  free(b->proj);
  free(b->router);
  free(b->topk_idx);
  free(b->topk_w);
  free(b->exp_tok);
  free(b->exp_w);
  free(b->xe);
  free(b->ue);
  free(b->ae);
  free(b->ye);
  memset(b, 0, sizeof *b);
}

void tw_cpu_tp_fini(tw_cpu_tp_t *tp) {
  free(tp->lg_local);
  free(tp->lg_all);
  tp->lg_local = tp->lg_all = NULL;
  tp->cap_rows = 0;
  tw_cpu_moe_bufs_free(&tp->all);
  free(tp->dp_recv);
  tp->dp_recv = NULL;
  tp->cap_all = 0;
}

TW_NODISCARD tw_status_t tw_cpu_tp_dp_gather(tw_cpu_tp_t *tp, const tw_model_config_t *c,
                                             const float *xn, int64_t T) {
  const int32_t P = tw_coll_size(tp->coll), me = tw_coll_rank(tp->coll);
  const int64_t H = c->hidden;
  int64_t counts[64];
  if (P > 64) return tw_err(TW_ERR_UNSUPPORTED, "cpu engine: dp over more than 64 ranks");
  TW_CHECK(tw_coll_allgather(tp->coll, &T, counts, sizeof T));
  tp->t_total = tp->t_off = tp->t_max = 0;
  for (int32_t r = 0; r < P; r++) {
    if (r == me) tp->t_off = tp->t_total;
    tp->t_total += counts[r];
    if (counts[r] > tp->t_max) tp->t_max = counts[r];
  }
  int64_t need = tp->t_total > P * tp->t_max ? tp->t_total : P * tp->t_max;
  if (need > tp->cap_all) {
    tw_cpu_moe_bufs_free(&tp->all);
    free(tp->dp_recv);
    size_t n = (size_t)need, f = sizeof(float), k = (size_t)c->n_experts_per_tok;
    size_t h = (size_t)H, I = (size_t)c->intermediate;
    tw_cpu_moe_bufs_t *b = &tp->all;
    b->xn = malloc(n * h * f);
    b->proj = malloc(n * h * f);
    b->router = malloc(n * (size_t)c->n_experts * f);
    b->topk_idx = malloc(n * k * sizeof(int32_t));
    b->topk_w = malloc(n * k * f);
    b->exp_tok = malloc(n * sizeof(int32_t));
    b->exp_w = malloc(n * f);
    b->xe = malloc(n * h * f);
    b->ue = malloc(n * 2 * I * f);
    b->ae = malloc(n * I * f);
    b->ye = malloc(n * h * f);
    tp->dp_recv = malloc(n * h * f);
    if (!b->xn || !b->proj || !b->router || !b->topk_idx || !b->topk_w || !b->exp_tok ||
        !b->exp_w || !b->xe || !b->ue || !b->ae || !b->ye || !tp->dp_recv) {
      tw_cpu_moe_bufs_free(b);
      free(tp->dp_recv);
      tp->dp_recv = NULL;
      tp->cap_all = 0;
      return tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory for the dp moe of %lld tokens",
                    (long long)need);
    }
    tp->cap_all = need;
  }
  /* rows padded to t_max per rank, then packed in rank order */
  float *send = tp->all.xe; /* free until the MoE runs */
  memcpy(send, xn, sizeof(float) * (size_t)(T * H));
  TW_CHECK(tw_coll_allgather(tp->coll, send, tp->dp_recv,
                             (int64_t)sizeof(float) * tp->t_max * H));
  int64_t off = 0;
  for (int32_t r = 0; r < P; r++) {
    memcpy(tp->all.xn + off * H, tp->dp_recv + (int64_t)r * tp->t_max * H,
           sizeof(float) * (size_t)(counts[r] * H));
    off += counts[r];
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_cpu_tp_dp_combine(tw_cpu_tp_t *tp, int64_t H, float *proj, int64_t T) {
  TW_CHECK(tw_coll_allreduce_sum_f32(tp->coll, tp->all.proj, tp->t_total * H));
  memcpy(proj, tp->all.proj + tp->t_off * H, sizeof(float) * (size_t)(T * H));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_cpu_tp_reduce_attn(tw_cpu_tp_t *tp, float *x, int64_t n) {
  if (tp->sh.tp_size == 1) return TW_OK;
  return tw_coll_allreduce_sum_f32(tp->coll, x, n);
}

TW_NODISCARD tw_status_t tw_cpu_tp_reduce_moe(tw_cpu_tp_t *tp, float *x, int64_t n) {
  if (tp->sh.ep_size == 1 || tp->sh.dp_attention) return TW_OK; /* dp: tw_cpu_tp_dp_combine */
  return tw_coll_allreduce_sum_f32(tp->coll, x, n);
}

TW_NODISCARD tw_status_t tw_cpu_tp_unembed(tw_cpu_tp_t *tp, tw_cpu_pool_t *pool, const float *xn,
                                           int64_t n_rows, int64_t H, const uint16_t *lm_head,
                                           int64_t V, float *logits) {
  if (tp->sh.tp_size == 1) {
    tw_cpu_matmul_bf16(pool, xn, n_rows, H, lm_head, NULL, V, logits);
    return TW_OK;
  }
  if (n_rows > tp->cap_rows) {
    size_t per = sizeof(float) * (size_t)n_rows * (size_t)tp->sh.vp;
    float *a = malloc(per), *b = malloc(per * (size_t)tp->sh.tp_size);
    if (!a || !b) {
      free(a);
      free(b);
      return tw_err(TW_ERR_NO_MEMORY, "cpu engine: out of memory for the logits gather of %lld rows",
                    (long long)n_rows);
    }
    tw_cpu_tp_fini(tp);
    tp->lg_local = a;
    tp->lg_all = b;
    tp->cap_rows = n_rows;
  }
  const int64_t vp = tp->sh.vp;
  if (tp->sh.nv > 0)
    tw_cpu_matmul_bf16(pool, xn, n_rows, H, lm_head + (int64_t)tp->sh.v0 * H, NULL, tp->sh.nv,
                       tp->sh.nv == vp ? tp->lg_local : logits);
  if (tp->sh.nv != vp) { /* last rank: repack [n_rows, nv] into [n_rows, vp], zero padding */
    for (int64_t r = 0; r < n_rows; r++) {
      memcpy(tp->lg_local + r * vp, logits + r * tp->sh.nv, sizeof(float) * (size_t)tp->sh.nv);
      memset(tp->lg_local + r * vp + tp->sh.nv, 0, sizeof(float) * (size_t)(vp - tp->sh.nv));
    }
  }
  int64_t bytes = (int64_t)sizeof(float) * n_rows * vp;
  TW_CHECK(tw_coll_allgather(tp->coll, tp->lg_local, tp->lg_all, bytes));
  /* [rank][row][vp] -> [row][V] */
  for (int32_t rk = 0; rk < tp->sh.tp_size; rk++) {
    int64_t v0 = (int64_t)rk * vp;
    if (v0 >= V) break;
    int64_t nv = V - v0 < vp ? V - v0 : vp;
    for (int64_t r = 0; r < n_rows; r++)
      memcpy(logits + r * V + v0, tp->lg_all + ((int64_t)rk * n_rows + r) * vp,
             sizeof(float) * (size_t)nv);
  }
  return TW_OK;
}
