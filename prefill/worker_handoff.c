/* worker_handoff.c: chunked prefill overlapped with the UCX KV handoff (see
 * worker_handoff.h). */
#include "prefill/worker_handoff.h"

#include "common/log.h"
#include "common/msg.h"

#include <time.h>

int tw_prefill_handoff_stale(const Twain__Internal__V1__PrefillRequest *r, int64_t max_age_ms) {
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  int64_t now = (int64_t)wall.tv_sec * 1000 + wall.tv_nsec / 1000000;
  return r->issued_unix_ms && now - r->issued_unix_ms > max_age_ms;
}

tw_status_t tw_prefill_handoff_run(const tw_prefill_handoff_ctx_t *ctx,
                                   const Twain__Internal__V1__PrefillRequest *r, const int32_t *ids,
                                   int32_t nb, const tw_sample_params_t *sp, uint64_t *sums,
                                   tw_prefill_handoff_result_t *out) {
  const tw_model_config_t *c = &ctx->model->config;
  const tw_kv_layout_t *src = tw_engine_kv_layout(ctx->engine);
  const Twain__Internal__V1__KvHandoff *h = r->handoff;
  const Twain__Internal__V1__KvLayout *hl = h->layout;
  const int32_t n = (int32_t)r->n_prompt_ids, bs = src->block_size;
  if (c->n_layers > TW_MAX_LAYERS) return tw_err(TW_ERR_INTERNAL, "too many layers");
  tw_kv_remote_layout_t rl = {.dtype = (tw_dtype_t)hl->dtype, .on_device = hl->on_device,
                              .n_layers = hl->n_layers, .n_blocks = hl->n_blocks,
                              .block_size = hl->block_size, .n_kv_heads = hl->n_kv_heads,
                              .head_dim = hl->head_dim, .layer_stride_bytes = hl->layer_stride_bytes,
                              .block_bytes = hl->block_bytes, .remote_base = hl->remote_base,
                              .total_bytes = hl->total_bytes};
  tw_kv_peer_t *peer = NULL;
  TW_CHECK(tw_kv_xfer_peer(ctx->xfer, h->ucx_address.data, h->ucx_address.len, h->rkey.data,
                           h->rkey.len, &peer));
  int32_t sent[TW_MAX_LAYERS]; /* next block to send per layer */
  for (int32_t l = 0; l < c->n_layers; l++) {
    sent[l] = tw_kv_layer_first_block(n, bs, c->layer_types[l] == TW_LAYER_SLIDING, c->sliding_window);
    sums[l] = TW_KV_FNV_INIT;
  }
  int32_t first = -1;
  int64_t bytes = 0, t_engine = 0, t_xfer = 0;
  int32_t chunk = ctx->chunk_tokens > 0 ? ctx->chunk_tokens : n;
  for (int32_t off = 0; off < n; off += chunk) {
    int32_t T = n - off < chunk ? n - off : chunk;
    bool last = off + T == n;
    tw_prefill_args_t a = {.tokens = r->prompt_ids + off, .n_tokens = T, .start_pos = off,
                           .block_table = ids, .n_blocks = nb, .sample = last ? sp : NULL,
                           .next_token_out = last ? &first : NULL};
    int64_t t0 = tw_msg_clock_ns();
    TW_CHECK(tw_engine_prefill(ctx->engine, &a));
    int64_t t1 = tw_msg_clock_ns();
    t_engine += t1 - t0;
    /* blocks whose every position is now final (all of them after the last chunk) */
    int32_t done = last ? nb : (off + T) / bs;
    if (tw_prefill_handoff_stale(r, ctx->max_age_ms))
      return tw_err(TW_ERR_DEADLINE, "request %llu is older than %lld ms: not writing its kv",
                    (unsigned long long)r->request_id, (long long)ctx->max_age_ms);
    for (int32_t l = 0; l < c->n_layers; l++) {
      if (done <= sent[l]) continue;
      TW_CHECK(tw_kv_xfer_send_layer(ctx->xfer, peer, src, &rl, l, ids, h->block_ids, sent[l], done,
                                     &sums[l]));
      bytes += (int64_t)(done - sent[l]) * src->block_bytes;
      sent[l] = done;
    }
    t_xfer += tw_msg_clock_ns() - t1;
  }
  int64_t t2 = tw_msg_clock_ns();
  TW_CHECK(tw_kv_xfer_flush(ctx->xfer, peer, ctx->flush_timeout_ms));
  t_xfer += tw_msg_clock_ns() - t2;
  out->first_token = first;
  out->kv_bytes = bytes;
  out->prefill_ms = (double)t_engine * 1e-6;
  out->transfer_ms = (double)t_xfer * 1e-6;
  return TW_OK;
}
