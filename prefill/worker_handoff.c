/* worker_handoff.c: prefill overlapped with the UCX KV handoff layer by layer
 * (see worker_handoff.h). */
#include "prefill/worker_handoff.h"

#include "common/log.h"
#include "common/msg.h"

#include <time.h>

int64_t tw_prefill_age_ms(const Twain__Internal__V1__PrefillRequest *r) {
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  int64_t now = (int64_t)wall.tv_sec * 1000 + wall.tv_nsec / 1000000;
  return r->issued_unix_ms ? now - r->issued_unix_ms : 0;
}

int tw_prefill_handoff_stale(const Twain__Internal__V1__PrefillRequest *r, int64_t max_age_ms) {
  return max_age_ms > 0 && tw_prefill_age_ms(r) > max_age_ms;
}

/* State shared by the chunk loop and the engine's on_layer_done callback. */
typedef struct {
  const tw_prefill_handoff_ctx_t *ctx;
  const Twain__Internal__V1__PrefillRequest *r;
  const tw_kv_layout_t *src;
  tw_kv_remote_layout_t rl;
  tw_kv_peer_t *peer;
  const int32_t *ids;
  int32_t nb, n, n_layers;
  int32_t sent[TW_MAX_LAYERS]; /* next block to send per layer */
  uint64_t *sums;
  int64_t bytes, t_put_ns;
  int64_t layer_sends, layer_sends_in_engine;
  tw_status_t st; /* first error (the callback cannot return one) */
} tw_handoff_state_t;

/* Put layer l's blocks that are final once positions < end are computed. */
static void tw_handoff_send(tw_handoff_state_t *s, int32_t l, int32_t end, bool in_engine) {
  if (s->st != TW_OK || l < 0 || l >= s->n_layers) return;
  int32_t done = end >= s->n ? s->nb : end / s->src->block_size;
  if (done <= s->sent[l]) return;
  int64_t t0 = tw_msg_clock_ns();
  if (tw_prefill_handoff_stale(s->r, s->ctx->max_age_ms)) {
    s->st = tw_err(TW_ERR_DEADLINE,
                   "request %llu was handed to this prefill worker more than %lld ms ago: not "
                   "writing its kv (its decode blocks may have been reused)",
                   (unsigned long long)s->r->request_id, (long long)s->ctx->max_age_ms);
    return;
  }
  s->st = tw_kv_xfer_send_layer(s->ctx->xfer, s->peer, s->src, &s->rl, l, s->ids,
                                s->r->handoff->block_ids, s->sent[l], done, &s->sums[l]);
  if (s->st == TW_OK) {
    s->bytes += (int64_t)(done - s->sent[l]) * s->src->block_bytes;
    s->sent[l] = done;
    s->layer_sends++;
    if (in_engine) s->layer_sends_in_engine++;
  }
  s->t_put_ns += tw_msg_clock_ns() - t0;
}

/* tw_prefill_args_t.on_layer_done: layer l of positions start..start+T-1 is in the pool. */
static void tw_handoff_on_layer(void *arg, int32_t layer, int32_t start, int32_t n_tokens) {
  tw_handoff_send(arg, layer, start + n_tokens, true);
}

tw_status_t tw_prefill_handoff_run(const tw_prefill_handoff_ctx_t *ctx,
                                   const Twain__Internal__V1__PrefillRequest *r, const int32_t *ids,
                                   int32_t nb, const tw_sample_params_t *sp, uint64_t *sums,
                                   tw_prefill_handoff_result_t *out) {
  const tw_model_config_t *c = &ctx->model->config;
  const Twain__Internal__V1__KvHandoff *h = r->handoff;
  const Twain__Internal__V1__KvLayout *hl = h->layout;
  if (c->n_layers > TW_MAX_LAYERS) return tw_err(TW_ERR_INTERNAL, "too many layers");
  tw_handoff_state_t s = {.ctx = ctx, .r = r, .src = tw_engine_kv_layout(ctx->engine), .ids = ids,
                           .nb = nb, .n = (int32_t)r->n_prompt_ids, .n_layers = c->n_layers,
                           .sums = sums, .st = TW_OK};
  s.rl = (tw_kv_remote_layout_t){.dtype = (tw_dtype_t)hl->dtype, .on_device = hl->on_device,
                                 .n_layers = hl->n_layers, .n_blocks = hl->n_blocks,
                                 .block_size = hl->block_size, .n_kv_heads = hl->n_kv_heads,
                                 .head_dim = hl->head_dim,
                                 .layer_stride_bytes = hl->layer_stride_bytes,
                                 .block_bytes = hl->block_bytes, .remote_base = hl->remote_base,
                                 .total_bytes = hl->total_bytes};
  TW_CHECK(tw_kv_xfer_peer(ctx->xfer, h->ucx_address.data, h->ucx_address.len, h->rkey.data,
                           h->rkey.len, &s.peer));
  for (int32_t l = 0; l < c->n_layers; l++) {
    s.sent[l] = tw_kv_layer_first_block(s.n, s.src->block_size,
                                        c->layer_types[l] == TW_LAYER_SLIDING, c->sliding_window);
    sums[l] = TW_KV_FNV_INIT;
  }
  int32_t first = -1;
  int64_t t_total = 0;
  int32_t chunk = ctx->chunk_tokens > 0 ? ctx->chunk_tokens : s.n;
  for (int32_t off = 0; off < s.n; off += chunk) {
    int32_t T = s.n - off < chunk ? s.n - off : chunk;
    bool last = off + T == s.n;
    /* layer l's blocks are put from on_layer_done while layers > l compute */
    tw_prefill_args_t a = {.tokens = r->prompt_ids + off, .n_tokens = T, .start_pos = off,
                           .block_table = ids, .n_blocks = nb, .sample = last ? sp : NULL,
                           .next_token_out = last ? &first : NULL,
                           .on_layer_done = tw_handoff_on_layer, .on_layer_arg = &s};
    int64_t t0 = tw_msg_clock_ns();
    TW_CHECK(tw_engine_prefill(ctx->engine, &a));
    /* a backend that reported nothing (or not everything): the rest now */
    for (int32_t l = 0; l < c->n_layers; l++) tw_handoff_send(&s, l, off + T, false);
    t_total += tw_msg_clock_ns() - t0;
    TW_CHECK(s.st);
  }
  int64_t t2 = tw_msg_clock_ns();
  TW_CHECK(tw_kv_xfer_flush(ctx->xfer, s.peer, ctx->flush_timeout_ms));
  int64_t t_flush = tw_msg_clock_ns() - t2;
  out->first_token = first;
  out->kv_bytes = s.bytes;
  out->prefill_ms = (double)(t_total - s.t_put_ns) * 1e-6;
  out->transfer_ms = (double)(s.t_put_ns + t_flush) * 1e-6;
  out->layer_sends = s.layer_sends;
  out->layer_sends_in_engine = s.layer_sends_in_engine;
  return TW_OK;
}
