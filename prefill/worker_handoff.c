/* worker_handoff.c: prefill overlapped with the UCX KV handoff layer by layer
 * (see worker_handoff.h). */
#include "prefill/worker_handoff.h"

#include "common/log.h"
#include "common/msg.h"
#include "common/kv_reshard.h"
#include "common/proto_engine.h"

#include <stdio.h>
#include <stdlib.h>

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
  int64_t t_last_layer_ns; /* when the last layer's compute was reported done */
  tw_status_t st; /* first error (the callback cannot return one) */
} tw_handoff_state_t;

/* Put layer l's blocks that are final once positions < end are computed. */
static void tw_handoff_send(tw_handoff_state_t *s, int32_t l, int32_t end, bool in_engine) {
  if (s->st != TW_OK || l < 0 || l >= s->n_layers) return;
  int32_t done = tw_kv_blocks_final(end, s->n, s->nb, s->src->block_size);
  if (done <= s->sent[l]) return;
  int64_t t0 = tw_msg_clock_ns();
  s->st = tw_proto_kv_write_guard(s->r->request_id, s->r->issued_unix_ms, s->ctx->max_age_ms);
  if (s->st != TW_OK) return;
  /* device pools: checksums read everything back, so only for a verifier */
  bool sums = s->r->handoff->checksums || !s->src->on_device;
  s->st = tw_kv_xfer_send_layer(s->ctx->xfer, s->peer, s->src, &s->rl, l, s->ids,
                                s->r->handoff->block_ids, s->sent[l], done,
                                sums ? &s->sums[l] : NULL);
  if (s->st == TW_OK) {
    s->bytes += (int64_t)(done - s->sent[l]) * s->src->block_bytes;
    s->sent[l] = done;
    s->layer_sends++;
    if (in_engine) s->layer_sends_in_engine++;
  }
  s->t_put_ns += tw_msg_clock_ns() - t0;
}

/* One request's handoff set up: its endpoint, the first block each layer sends. */
static TW_NODISCARD tw_status_t tw_handoff_begin(tw_handoff_state_t *s) {
  const Twain__Internal__V1__KvLayout *hl = s->r->handoff->layout;
  const Twain__Internal__V1__KvHandoff *h = s->r->handoff;
  const tw_model_config_t *c = &s->ctx->model->config;
  tw_proto_kv_layout_to_remote(hl, &s->rl);
  s->rl.handoff_tag = s->r->request_id; /* names its pieces to a staged receiver */
  /* never hand UCX an empty address; only a staged pool has no rkey */
  if (!h->ucx_address.len || (!h->rkey.len && hl->staging_slot_bytes <= 0))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv handoff has no UCX address or rkey");
  TW_CHECK(tw_kv_xfer_peer(s->ctx->xfer, h->ucx_address.data, h->ucx_address.len, h->rkey.data,
                           h->rkey.len, &s->peer));
  for (int32_t l = 0; l < c->n_layers; l++) {
    s->sent[l] = tw_kv_layer_first_block(s->n, s->src->block_size,
                                         c->layer_types[l] == TW_LAYER_SLIDING, c->sliding_window);
    s->sums[l] = TW_KV_FNV_INIT;
  }
  return TW_OK;
}

/* A batch between its engine run and its flush. */
struct tw_prefill_handoff_batch {
  const tw_prefill_handoff_ctx_t *ctx;
  tw_prefill_handoff_item_t *items;
  int32_t n, n_seqs;
  tw_handoff_state_t *states; /* [n_seqs] */
  int32_t *firsts;            /* [n_seqs] */
  tw_status_t est;            /* the engine's status */
  char emsg[256];
  int64_t t_engine, t_puts;
};

/* tw_prefill_batch_args_t.on_layer_done: layer l of request seq's positions
 * start..start+T-1 is in the pool. */
static void tw_handoff_on_batch_layer(void *arg, int32_t seq, int32_t layer, int32_t start,
                                      int32_t n_tokens) {
  tw_prefill_handoff_batch_t *b = arg;
  tw_handoff_state_t *s = &b->states[seq];
  if (layer == s->n_layers - 1) s->t_last_layer_ns = tw_msg_clock_ns();
  tw_handoff_send(s, layer, start + n_tokens, true);
  if (b->ctx->on_layer) b->ctx->on_layer(b->ctx->on_layer_arg);
}

void tw_prefill_handoff_finish(tw_prefill_handoff_batch_t *b) {
  if (!b) return;
  const tw_prefill_handoff_ctx_t *ctx = b->ctx;
  for (int32_t i = 0; i < b->n; i++) {
    tw_prefill_handoff_item_t *it = &b->items[i];
    if (it->st != TW_OK) continue;
    tw_handoff_state_t *s = &b->states[it->seq];
    if (b->est != TW_OK) {
      it->st = b->est;
      snprintf(it->msg, sizeof it->msg, "%s", b->emsg);
      continue;
    }
    if (s->st == TW_OK) { /* remote completion; a failed peer is dropped from the cache */
      int64_t t2 = tw_msg_clock_ns();
      s->st = tw_kv_xfer_flush(ctx->xfer, s->peer, ctx->flush_timeout_ms);
      int64_t t3 = tw_msg_clock_ns();
      s->t_put_ns += t3 - t2;
      /* with the flush deferred to the next batch's compute this includes
       * the wait for it: the time until the prompt can be answered */
      it->out.tail_ms = (double)(t3 - s->t_last_layer_ns) * 1e-6;
      if (s->st != TW_OK) /* the other requests to that peer fail with it, unflushed */
        for (int32_t k = 0; k < b->n_seqs; k++)
          if (k != it->seq && b->states[k].peer == s->peer && b->states[k].st == TW_OK) {
            b->states[k].st = s->st;
            b->states[k].peer = NULL;
          }
    }
    it->st = s->st;
    if (it->st != TW_OK) {
      snprintf(it->msg, sizeof it->msg, "%s", tw_last_error());
      continue;
    }
    it->out.first_token = b->firsts[it->seq];
    it->out.kv_bytes = s->bytes;
    /* the batch's engine time less every put issued during it (all requests') */
    it->out.prefill_ms = (double)(b->t_engine - b->t_puts) * 1e-6;
    it->out.transfer_ms = (double)s->t_put_ns * 1e-6;
    it->out.layer_sends = s->layer_sends;
    it->out.layer_sends_in_engine = s->layer_sends_in_engine;
    it->out.kv_in_place =
        tw_kv_xfer_path_to(s->peer, s->src->on_device, &s->rl) == TW_KV_PATH_DIRECT_CUDA_IPC;
  }
  free(b->states);
  free(b->firsts);
  free(b);
}

TW_NODISCARD tw_status_t tw_prefill_handoff_start(const tw_prefill_handoff_ctx_t *ctx,
                                                  tw_prefill_handoff_item_t *items, int32_t n,
                                                  tw_prefill_handoff_batch_t **b_p) {
  const tw_model_config_t *c = &ctx->model->config;
  *b_p = NULL;
  tw_status_t st = TW_OK;
  if (c->n_layers > TW_MAX_LAYERS) st = tw_err(TW_ERR_INTERNAL, "too many layers");
  tw_prefill_handoff_batch_t *b = st == TW_OK ? calloc(1, sizeof *b) : NULL;
  tw_prefill_seq_t *seqs = calloc((size_t)(n > 0 ? n : 1), sizeof *seqs);
  if (b) {
    b->states = calloc((size_t)(n > 0 ? n : 1), sizeof *b->states);
    b->firsts = calloc((size_t)(n > 0 ? n : 1), sizeof *b->firsts);
  }
  if (st == TW_OK && (!b || !seqs || !b->states || !b->firsts))
    st = tw_err(TW_ERR_NO_MEMORY, "prefill handoff: out of memory for a batch of %d", n);
  if (st != TW_OK) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    for (int32_t i = 0; i < n; i++) {
      items[i].st = st;
      snprintf(items[i].msg, sizeof items[i].msg, "%s", msg);
    }
    if (b) {
      free(b->states);
      free(b->firsts);
    }
    free(b);
    free(seqs);
    return tw_err(st, "%s", msg);
  }
  *b = (tw_prefill_handoff_batch_t){.ctx = ctx, .items = items, .n = n, .states = b->states,
                                    .firsts = b->firsts, .est = TW_OK};
  const tw_kv_layout_t *src = tw_engine_kv_layout(ctx->engine);
  for (int32_t i = 0; i < n; i++) {
    tw_prefill_handoff_item_t *it = &items[i];
    it->out = (tw_prefill_handoff_result_t){.first_token = -1};
    tw_handoff_state_t *s = &b->states[b->n_seqs];
    *s = (tw_handoff_state_t){.ctx = ctx, .r = it->r, .src = src, .ids = it->ids, .nb = it->nb,
                              .n = (int32_t)it->r->n_prompt_ids, .n_layers = c->n_layers,
                              .sums = it->sums, .st = TW_OK};
    it->st = tw_handoff_begin(s);
    if (it->st != TW_OK) {
      snprintf(it->msg, sizeof it->msg, "%s", tw_last_error());
      continue;
    }
    int32_t k = b->n_seqs++;
    it->seq = k;
    b->firsts[k] = -1;
    seqs[k] = (tw_prefill_seq_t){.tokens = it->r->prompt_ids, .n_tokens = s->n,
                                 .block_table = it->ids, .n_blocks = it->nb, .sample = &it->sp,
                                 .next_token_out = &b->firsts[k]};
  }
  int64_t t0 = tw_msg_clock_ns();
  if (b->n_seqs > 0) {
    /* layer l's blocks of every request are put from on_layer_done while
     * layers > l compute (and the next pass, for a prompt split over passes) */
    tw_prefill_batch_args_t ba = {.n_seqs = b->n_seqs, .seqs = seqs,
                                  .on_layer_done = tw_handoff_on_batch_layer, .on_layer_arg = b};
    b->est = tw_engine_prefill_batch(ctx->engine, &ba);
    /* a backend that reported nothing (or not everything): the rest now */
    for (int32_t k = 0; b->est == TW_OK && k < b->n_seqs; k++)
      for (int32_t l = 0; l < c->n_layers; l++)
        tw_handoff_send(&b->states[k], l, b->states[k].n, false);
    b->t_engine = tw_msg_clock_ns() - t0;
    for (int32_t k = 0; k < b->n_seqs; k++) /* a backend that reported nothing */
      if (!b->states[k].t_last_layer_ns) b->states[k].t_last_layer_ns = t0 + b->t_engine;
    if (b->est != TW_OK) snprintf(b->emsg, sizeof b->emsg, "%s", tw_last_error());
  }
  for (int32_t k = 0; k < b->n_seqs; k++) b->t_puts += b->states[k].t_put_ns;
  free(seqs);
  *b_p = b;
  return b->est != TW_OK ? tw_err(b->est, "%s", b->emsg) : TW_OK;
}

TW_NODISCARD tw_status_t tw_prefill_handoff_batch(const tw_prefill_handoff_ctx_t *ctx,
                                                  tw_prefill_handoff_item_t *items, int32_t n) {
  tw_prefill_handoff_batch_t *b = NULL;
  tw_status_t st = tw_prefill_handoff_start(ctx, items, n, &b);
  tw_prefill_handoff_finish(b);
  return st;
}

TW_NODISCARD tw_status_t tw_kv_handoff_pool(const Twain__Internal__V1__KvHandoff *h, size_t d,
                                            const Twain__Internal__V1__KvLayout **kl,
                                            const ProtobufCBinaryData **addr,
                                            const ProtobufCBinaryData **rkey) {
  bool ranked = h->n_ranks > 0 && d < h->n_ranks && h->ranks[d];
  *kl = ranked ? h->ranks[d]->layout : h->layout;
  *addr = ranked ? &h->ranks[d]->ucx_address : &h->ucx_address;
  *rkey = ranked ? &h->ranks[d]->rkey : &h->rkey;
  if (!*kl || !(*addr)->len || (!(*rkey)->len && (*kl)->staging_slot_bytes <= 0)) /* staged: no rkey */
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv handoff rank %zu has no layout, UCX address or rkey",
                  d);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_prefill_kv_connect(tw_kv_xfer_t *xfer, const tw_kv_layout_t *src,
                                               const Twain__Internal__V1__KvHandoff *h,
                                               int32_t *n_p, tw_kv_path_t *path_p) {
  *n_p = 0;
  *path_p = TW_KV_PATH_UNREACHABLE;
  size_t n = h->n_ranks ? h->n_ranks : 1;
  for (size_t d = 0; d < n; d++) {
    const Twain__Internal__V1__KvLayout *kl;
    const ProtobufCBinaryData *addr, *rkey;
    TW_CHECK(tw_kv_handoff_pool(h, d, &kl, &addr, &rkey));
    int32_t a0, a1;
    tw_kv_heads_overlap(src->kv_head_offset, src->n_kv_heads_local, kl->kv_head_offset,
                        kl->n_kv_heads, &a0, &a1);
    if (a1 <= a0) continue;
    tw_kv_peer_t *peer = NULL;
    TW_CHECK(tw_kv_xfer_peer(xfer, addr->data, addr->len, rkey->data, rkey->len, &peer));
    if (!*n_p) {
      tw_kv_remote_layout_t rl;
      tw_proto_kv_layout_to_remote(kl, &rl);
      *path_p = tw_kv_xfer_path_to(peer, src->on_device, &rl);
    }
    (*n_p)++;
  }
  return TW_OK;
}
