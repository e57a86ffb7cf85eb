/* prefill_ranks.c: the per-rank prefill and re-sharded KV handoff of a
 * multi-rank prefill worker (see prefill_ranks.h). Plan (rank 0 -> others):
 * i32 nb, i32 ids[nb], then the packed PrefillRequest. Reply (others -> 0):
 * i32 status, i64 bytes, u64 head_sums[L * NKV], then a message. */
#include "prefill/prefill_ranks.h"
#include "prefill/handoff_send.h"
#include "prefill/worker_handoff.h"

#include "common/base/log.h"
#include "common/comm/msg.h"
#include "common/comm/proto_engine.h"
#include "common/engine/dist_engine.h"
#include "common/kv/kv_reshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int tw_prefill_ranks_wanted(const tw_prefill_ranks_t *rk,
                            const Twain__Internal__V1__PrefillRequest *r) {
  return tw_dist_size(rk->dist) > 1 || (r->handoff && r->handoff->n_ranks > 0);
}

/* tw_prefill_args_t.on_layer_done: layer l of positions start..start+T-1 is in the pool. */
static void tw_rank_on_layer(void *arg, int32_t layer, int32_t start, int32_t n_tokens) {
  tw_handoff_send_on_layer(arg, layer, start + n_tokens);
}

/* This rank's part: engine prefill, its heads put into every decode rank
 * layer by layer as the engine reports them done (the transfer of layer l
 * overlaps the compute of the layers after it), then the flushes. */
static TW_NODISCARD tw_status_t tw_prefill_rank_run(tw_prefill_ranks_t *rk,
                                                    const Twain__Internal__V1__PrefillRequest *r,
                                                    const int32_t *ids, int32_t nb,
                                                    int32_t *first_p, int64_t *bytes_p,
                                                    uint64_t *head_sums, int64_t *t_mid_p) {
  const tw_model_config_t *c = &rk->model->config;
  const tw_kv_layout_t *src = tw_engine_kv_layout(rk->engine);
  int32_t n = (int32_t)r->n_prompt_ids;
  if (c->n_layers > TW_MAX_LAYERS) return tw_err(TW_ERR_INTERNAL, "too many layers");
  tw_sample_params_t sp = tw_proto_sample_params(r->sampling);
  tw_handoff_send_t *s = malloc(sizeof *s);
  if (!s) return tw_err(TW_ERR_NO_MEMORY, "prefill rank: out of memory for the handoff state");
  /* this rank's heads into every decode rank that holds some of them */
  tw_status_t st = tw_handoff_send_begin(s, rk->xfer, r, src, ids, nb, c->n_layers, c,
                                         rk->max_age_ms, NULL, false);
  int32_t first = -1;
  tw_prefill_args_t a = {.tokens = r->prompt_ids, .n_tokens = n, .block_table = ids,
                         .n_blocks = nb, .sample = &sp, .next_token_out = &first,
                         .on_layer_done = tw_rank_on_layer, .on_layer_arg = s};
  if (st == TW_OK) st = tw_engine_prefill(rk->engine, &a);
  *t_mid_p = tw_msg_clock_ns();
  /* what the backend did not report (or a failed callback's error) */
  if (st == TW_OK) st = tw_handoff_send_rest(s, *t_mid_p);
  if (!s->t_last_layer_ns) s->t_last_layer_ns = *t_mid_p;
  if (st == TW_OK) st = tw_handoff_send_flush(s, rk->flush_timeout_ms);
  int64_t bytes = s->bytes;
  rk->tail_ms = (double)(tw_msg_clock_ns() - s->t_last_layer_ns) * 1e-6;
  rk->layer_sends = s->layer_sends;
  rk->layer_sends_in_engine = s->layer_sends_in_engine;
  free(s);
  TW_CHECK(st);
  uint64_t sums[64];
  if (src->n_kv_heads_local > 64) return tw_err(TW_ERR_UNSUPPORTED, "more than 64 kv heads");
  /* device pools: no per-head checksums (kv_reshard.h reads host pools only) */
  for (int32_t l = 0; !src->on_device && l < c->n_layers; l++) {
    int32_t f = tw_kv_layer_first_block(n, src->block_size, c->layer_types[l] == TW_LAYER_SLIDING,
                                        c->sliding_window);
    TW_CHECK(tw_kv_head_checksums(src, l, ids, f, nb, sums));
    for (int32_t g = 0; g < src->n_kv_heads_local; g++)
      head_sums[(int64_t)l * c->n_kv_heads + src->kv_head_offset + g] = sums[g];
  }
  *first_p = first;
  *bytes_p = bytes;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_prefill_ranks_run(tw_prefill_ranks_t *rk,
                                              const Twain__Internal__V1__PrefillRequest *r,
                                              const int32_t *ids, int32_t nb, int32_t *first_p,
                                              int64_t *bytes_p, uint64_t *head_sums,
                                              double *prefill_ms_p, double *xfer_ms_p) {
  const tw_model_config_t *c = &rk->model->config;
  const int32_t size = tw_dist_size(rk->dist);
  const size_t n_sums = (size_t)c->n_layers * (size_t)c->n_kv_heads;
  if (size > 1) {
    size_t plen = twain__internal__v1__prefill_request__get_packed_size(r);
    size_t len = sizeof(int32_t) * (1 + (size_t)nb) + plen;
    uint8_t *plan = malloc(len);
    if (!plan) return tw_err(TW_ERR_NO_MEMORY, "prefill ranks: out of memory for a plan");
    memcpy(plan, &nb, sizeof nb);
    memcpy(plan + sizeof nb, ids, sizeof(int32_t) * (size_t)nb);
    twain__internal__v1__prefill_request__pack(r, plan + sizeof(int32_t) * (1 + (size_t)nb));
    tw_status_t st = tw_dist_plan_user(rk->dist, plan, len);
    free(plan);
    TW_CHECK(st);
  }
  int64_t t0 = tw_msg_clock_ns(), tm = t0;
  int32_t first = -1;
  int64_t bytes = 0;
  tw_status_t st = tw_prefill_rank_run(rk, r, ids, nb, &first, &bytes, head_sums, &tm);
  int64_t t1 = tw_msg_clock_ns();
  char err[256] = "";
  if (st != TW_OK) snprintf(err, sizeof err, "rank 0: %s", tw_last_error());
  if (size > 1) { /* every rank answers, even after a failure here */
    void *bufs[64];
    size_t lens[64];
    tw_status_t rs = tw_dist_replies_recv(rk->dist, rk->flush_timeout_ms + 60000, bufs, lens);
    if (rs != TW_OK && st == TW_OK) {
      st = rs;
      snprintf(err, sizeof err, "%s", tw_last_error());
    }
    for (int32_t k = 1; rs == TW_OK && k < size; k++) {
      size_t need = sizeof(int32_t) + sizeof(int64_t) + n_sums * sizeof(uint64_t);
      const uint8_t *b = bufs[k];
      int32_t code = TW_ERR_FORMAT;
      if (lens[k] >= need) memcpy(&code, b, sizeof code);
      if (code != TW_OK && st == TW_OK) {
        st = code;
        snprintf(err, sizeof err, "rank %d: %.*s", k,
                 (int)(lens[k] >= need ? lens[k] - need : 0), (const char *)b + need);
      }
      if (code == TW_OK) {
        int64_t rb;
        memcpy(&rb, b + sizeof(int32_t), sizeof rb);
        bytes += rb;
        /* rank k of size holds kv heads [k NKV/size, (k+1) NKV/size) */
        const uint8_t *s = b + sizeof(int32_t) + sizeof(int64_t);
        int32_t per = c->n_kv_heads / size;
        for (int32_t l = 0; l < c->n_layers; l++)
          for (int32_t g = k * per; g < (k + 1) * per; g++)
            memcpy(&head_sums[(int64_t)l * c->n_kv_heads + g],
                   s + ((size_t)l * (size_t)c->n_kv_heads + (size_t)g) * sizeof(uint64_t),
                   sizeof(uint64_t));
      }
    }
    for (int32_t k = 1; rs == TW_OK && k < size; k++) free(bufs[k]);
  }
  if (st != TW_OK) return tw_err(st, "%s", err);
  *first_p = first;
  *bytes_p = bytes;
  *prefill_ms_p = (double)(tm - t0) * 1e-6;
  *xfer_ms_p = (double)(t1 - tm) * 1e-6;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_prefill_ranks_hook(void *ctx, const void *buf, size_t len) {
  tw_prefill_ranks_t *rk = ctx;
  const tw_model_config_t *c = &rk->model->config;
  const size_t n_sums = (size_t)c->n_layers * (size_t)c->n_kv_heads;
  int32_t nb = -1;
  if (len >= sizeof nb) memcpy(&nb, buf, sizeof nb);
  size_t off = sizeof(int32_t) * (1 + (size_t)(nb > 0 ? nb : 0));
  Twain__Internal__V1__PrefillRequest *r = NULL;
  int32_t *ids = NULL;
  tw_status_t st = TW_OK;
  if (nb <= 0 || off > len) {
    st = tw_err(TW_ERR_FORMAT, "prefill plan of %zu bytes is malformed", len);
  } else {
    ids = malloc(sizeof(int32_t) * (size_t)nb);
    r = twain__internal__v1__prefill_request__unpack(NULL, len - off, (const uint8_t *)buf + off);
    if (!ids || !r) st = tw_err(TW_ERR_FORMAT, "prefill plan: request does not decode");
    else memcpy(ids, (const uint8_t *)buf + sizeof(int32_t), sizeof(int32_t) * (size_t)nb);
  }
  size_t rlen = sizeof(int32_t) + sizeof(int64_t) + n_sums * sizeof(uint64_t);
  uint8_t *reply = calloc(1, rlen + 256);
  if (!reply) st = tw_err(TW_ERR_NO_MEMORY, "prefill rank: out of memory for a reply");
  int32_t first = -1;
  int64_t bytes = 0, tm = 0;
  uint64_t *sums = calloc(n_sums, sizeof(uint64_t));
  if (!sums && st == TW_OK) st = tw_err(TW_ERR_NO_MEMORY, "prefill rank: out of memory");
  if (st == TW_OK && reply) st = tw_prefill_rank_run(rk, r, ids, nb, &first, &bytes, sums, &tm);
  if (sums && reply)
    memcpy(reply + sizeof(int32_t) + sizeof(int64_t), sums, n_sums * sizeof(uint64_t));
  free(sums);
  if (reply) {
    int32_t code = st;
    memcpy(reply, &code, sizeof code);
    memcpy(reply + sizeof(int32_t), &bytes, sizeof bytes);
    size_t ml = 0;
    if (st != TW_OK) {
      snprintf((char *)reply + rlen, 256, "%s", tw_last_error());
      ml = strlen((char *)reply + rlen);
    }
    tw_status_t rs = tw_dist_reply(rk->dist, reply, rlen + ml);
    if (st == TW_OK) st = rs;
  }
  free(reply);
  free(ids);
  if (r) twain__internal__v1__prefill_request__free_unpacked(r, NULL);
  return st;
}
