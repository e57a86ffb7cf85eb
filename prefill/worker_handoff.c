/* worker_handoff.c: prefill overlapped with the UCX KV handoff layer by layer
 * (see worker_handoff.h). */
#include "prefill/worker_handoff.h"
#include "prefill/handoff_send.h"

#include "common/base/log.h"
#include "common/base/test_hook.h"
#include "common/comm/msg.h"
#include "common/comm/proto_engine.h"

#include <stdio.h>
#include <stdlib.h>

/* A batch between its engine run and its flush. */
struct tw_prefill_handoff_batch {
  const tw_prefill_handoff_ctx_t *ctx;
  tw_prefill_handoff_item_t *items;
  int32_t n, n_seqs;
  tw_handoff_send_t *states;  /* [n_seqs] */
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
  tw_handoff_send_on_layer(&b->states[seq], layer, start + n_tokens);
  if (b->ctx->on_layer) b->ctx->on_layer(b->ctx->on_layer_arg);
}

void tw_prefill_handoff_finish(tw_prefill_handoff_batch_t *b) {
  if (!b) return;
  const tw_prefill_handoff_ctx_t *ctx = b->ctx;
  for (int32_t i = 0; i < b->n; i++) {
    tw_prefill_handoff_item_t *it = &b->items[i];
    if (it->st != TW_OK) continue;
    tw_handoff_send_t *s = &b->states[it->seq];
    if (b->est != TW_OK) {
      it->st = b->est;
      snprintf(it->msg, sizeof it->msg, "%s", b->emsg);
      continue;
    }
    if (s->st == TW_OK) { /* remote completion; a failed peer is dropped from the cache */
      tw_status_t fs = tw_handoff_send_flush(s, ctx->flush_timeout_ms);
      /* with the flush deferred to the next batch's compute this includes
       * the wait for it: the time until the prompt can be answered */
      it->out.tail_ms = (double)(tw_msg_clock_ns() - s->t_last_layer_ns) * 1e-6;
      if (fs != TW_OK) /* the other requests to that peer fail with it, unflushed */
        for (int32_t k = 0; k < b->n_seqs; k++)
          if (k != it->seq && b->states[k].st == TW_OK &&
              tw_handoff_send_share_peer(&b->states[k], s)) {
            b->states[k].st = fs;
            snprintf(b->states[k].msg, sizeof b->states[k].msg, "%s", s->msg);
          }
    }
    it->st = s->st;
    if (it->st != TW_OK) { /* the handoff's own message, naming the decode worker */
      snprintf(it->msg, sizeof it->msg, "%s", s->msg[0] ? s->msg : tw_last_error());
      continue;
    }
    it->out.first_token = b->firsts[it->seq];
    it->out.kv_bytes = s->bytes;
    /* the batch's engine time less every put issued during it (all requests') */
    it->out.prefill_ms = (double)(b->t_engine - b->t_puts) * 1e-6;
    it->out.transfer_ms = (double)s->t_put_ns * 1e-6;
    it->out.layer_sends = s->layer_sends;
    it->out.layer_sends_in_engine = s->layer_sends_in_engine;
    it->out.kv_in_place = tw_kv_xfer_path_to(s->dst[0].peer, s->src->on_device, &s->dst[0].rl) ==
                          TW_KV_PATH_DIRECT_CUDA_IPC;
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
    tw_handoff_send_t *s = &b->states[b->n_seqs];
    /* device pools: checksums read everything back, so only for a verifier */
    bool sums = it->r->handoff->checksums || !src->on_device;
    it->st = tw_handoff_send_begin(s, ctx->xfer, it->r, src, it->ids, it->nb, c->n_layers, c,
                                   ctx->max_age_ms, it->sums, sums);
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
    if (b->est == TW_OK && tw_test_device_error())
      b->est = tw_err(TW_ERR_CUDA, "simulated device error (the TWAIN_TEST_DEVICE_ERROR hook)");
    int64_t t_done = tw_msg_clock_ns();
    /* a backend that reported nothing (or not everything): the rest now; a
     * failed send stays in its state, for finish */
    for (int32_t k = 0; b->est == TW_OK && k < b->n_seqs; k++) {
      tw_status_t rs = tw_handoff_send_rest(&b->states[k], t_done);
      (void)rs;
    }
    b->t_engine = tw_msg_clock_ns() - t0;
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
