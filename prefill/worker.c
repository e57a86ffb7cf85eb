/* worker.c: the prefill worker daemon (see worker.h). One thread for the work
 * (the heartbeat has its own, msg_worker.h), a FIFO of requests taken in
 * batches (one variable-length engine prefill per batch, worker_handoff.h);
 * cancels and new requests are read between batches. */
#include "prefill/worker.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/metrics.h"
#include "common/comm/msg_worker.h"
#include "common/comm/proto_engine.h"
#include "common/engine/dist_engine.h"
#include "common/engine/engine.h"
#include "common/engine/mem_plan.h"
#include "common/kv/kv_blocks.h"
#include "common/kv/kv_transfer.h"
#include "common/model/model.h"
#include "common/model/model_path.h"
#include "common/worker/worker_daemon.h"
#include "common/worker/worker_stats.h"
#include "prefill/handoff_send.h"
#include "prefill/prefill_ranks.h"
#include "prefill/worker_handoff.h"
#include "proto/twain_api.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

#define TW_PREFILL_MAX_QUEUE 4096
/* KV is never written more than this long after the router handed the
 * request to a prefill worker (issued_unix_ms in the proto: the KV-write
 * guard of worker_handoff.c and prefill_ranks.c); decode workers quarantine
 * cancelled or expired reservations for longer (40 s). Time in the router's
 * queue does not count (the router stamps a request when it leaves it), and
 * the router's backpressure window keeps this worker's queue far shorter. */
#define TW_PREFILL_MAX_AGE_MS (20000 * TW_SLOW_BUILD) /* common/base/status.h */
/* Idle: wait on the router socket this long (a message wakes it at once;
 * heartbeats have their own thread), so an idle worker costs ~0 CPU. */
#define TW_PREFILL_IDLE_WAIT_MS 200


typedef struct {
  tw_prefill_opts_t o;
  tw_worker_stats_t stats; /* the periodic stats line */
  tw_model_t *model;
  tw_engine_t *engine;
  tw_kv_blocks_t *blocks;
  tw_kv_xfer_t *xfer;
  tw_worker_t wk; /* the daemon skeleton: rank, router link, metrics, drain (worker_daemon.h) */
  Twain__Internal__V1__Envelope *queue[TW_PREFILL_MAX_QUEUE]; /* ring of PrefillRequests */
  int q_head, q_len;
  int64_t queued_tokens;
  tw_prefill_ranks_t rk;
  /* two batch buffers: the batch computing and the one whose handoff
   * finishes meanwhile (pending), [batch_seqs] each */
  tw_prefill_handoff_item_t *batch[2];
  Twain__Internal__V1__Envelope **batch_envs[2];
  int cur; /* the buffer the next batch fills */
  tw_prefill_handoff_ctx_t hc;
  struct {
    tw_prefill_handoff_batch_t *b; /* NULL: none */
    tw_prefill_handoff_item_t *items;
    Twain__Internal__V1__Envelope **envs;
    int32_t n;
  } pending;
  const uint64_t *head_sums; /* for the next PrefillDone (re-sharded handoffs) */
  bool kv_in_place;          /* for the next PrefillDone (direct CUDA IPC handoff) */
  /* a prompt failed on a device error (sticky, STYLE.md "Errors"): the work
   * loop stops and the worker exits, so its supervisor starts a fresh one */
  tw_status_t device_error;
  char device_msg[256];
  size_t n_head_sums;
  struct {
    tw_metric_t *queue, *queued_tokens, *prefill, *transfer, *kv_bytes, *requests, *failed;
    tw_metric_t *layer_sends, *layer_sends_overlapped, *batches, *overlapped, *tail;
    tw_metric_t *kv_peers;
  } m;
} tw_prefiller_t;

static void tw_prefill_done(tw_prefiller_t *w, uint64_t id, int32_t first, const uint64_t *sums,
                            size_t n_sums, int64_t bytes, double prefill_ms, double transfer_ms,
                            int code, const char *msg) {
  Twain__Internal__V1__PrefillDone d = TWAIN__INTERNAL__V1__PREFILL_DONE__INIT;
  Twain__Internal__V1__Status s;
  d.request_id = id;
  d.first_token = first;
  d.layer_checksums = (uint64_t *)sums;
  d.n_layer_checksums = n_sums;
  d.kv_bytes = bytes;
  d.prefill_ms = prefill_ms;
  d.transfer_ms = transfer_ms;
  d.head_checksums = (uint64_t *)w->head_sums;
  d.n_head_checksums = w->n_head_sums;
  d.kv_in_place = w->kv_in_place;
  d.status = tw_reply_status(&s, code, w->device_error != TW_OK, msg);
  if (code) tw_metric_add(w->m.failed, 1);
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL_DONE;
  env.prefill_done = &d;
  if (tw_worker_link_send(&w->wk.link, &env) != TW_OK)
    TW_WARN("prefill", "request %llu: cannot answer the router: %s", (unsigned long long)id,
            tw_last_error());
}

/* A prompt failed with st: a device error (the first) is kept for
 * tw_prefill_op_work, which stops the worker on it. */
static void tw_prefill_note_device_error(tw_prefiller_t *w, tw_status_t st, const char *msg) {
  if ((st != TW_ERR_CUDA && st != TW_ERR_NCCL) || w->device_error != TW_OK) return;
  w->device_error = st;
  snprintf(w->device_msg, sizeof w->device_msg, "%s", msg);
}

/* A prompt that needs the multi-rank path (TP ranks here or a TP decode
 * worker, issue 6): alone, re-sharded. ids[nb] are its local blocks. */
static void tw_prefill_ranks_one(tw_prefiller_t *w, const Twain__Internal__V1__PrefillRequest *r,
                                 int32_t *ids, int32_t nb) {
  const tw_model_config_t *c = &w->model->config;
  char msg[256];
  size_t n_hs = (size_t)c->n_layers * (size_t)c->n_kv_heads;
  uint64_t *hs = calloc(n_hs, sizeof(uint64_t));
  int32_t first = -1;
  int64_t bytes = 0;
  double pms = 0, xms = 0;
  tw_status_t st = hs ? tw_prefill_ranks_run(&w->rk, r, ids, nb, &first, &bytes, hs, &pms, &xms)
                      : tw_err(TW_ERR_NO_MEMORY, "prefill worker out of host memory");
  TW_IGNORE(tw_kv_blocks_free(w->blocks, nb, ids)); /* ours, allocated above */
  if (st != TW_OK) {
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    TW_WARN("prefill", "request %llu failed: %s", (unsigned long long)r->request_id, msg);
    tw_prefill_note_device_error(w, st, msg); /* first: the answer says the worker failed */
    tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, pms, xms, tw_status_wire_code(st), msg);
  } else {
    tw_metric_observe(w->m.prefill, pms * 1e-3);
    tw_metric_observe(w->m.transfer, xms * 1e-3);
    tw_metric_observe(w->m.tail, w->rk.tail_ms * 1e-3);
    tw_metric_add(w->m.layer_sends, (double)w->rk.layer_sends); /* rank 0's */
    tw_metric_add(w->m.layer_sends_overlapped, (double)w->rk.layer_sends_in_engine);
    tw_metric_add(w->m.kv_bytes, (double)bytes);
    tw_metric_add(w->m.requests, 1);
    tw_worker_stats_add(&w->stats, (int64_t)r->n_prompt_ids, 1);
    TW_DEBUG("prefill", "request %llu: %lld kv bytes, handoff tail %.2f ms after the last layer",
             (unsigned long long)r->request_id, (long long)bytes, w->rk.tail_ms);
    w->head_sums = hs;
    w->n_head_sums = tw_engine_kv_layout(w->engine)->on_device ? 0 : n_hs; /* host pools only */
    tw_prefill_done(w, r->request_id, first, NULL, 0, bytes, pms, xms, 0, NULL);
    w->head_sums = NULL;
    w->n_head_sums = 0;
  }
  free(hs);
}

/* Check a queued prompt and take its local blocks into *it. Returns 1 when
 * it is ready, 0 when it was answered with an error (nothing held), -1 when
 * may_wait and its blocks are not free now (it stays queued: the batch being
 * formed or the pending one holds them). */
static int tw_prefill_prepare(tw_prefiller_t *w, const Twain__Internal__V1__PrefillRequest *r,
                              bool may_wait, tw_prefill_handoff_item_t *it) {
  const tw_model_config_t *c = &w->model->config;
  const Twain__Internal__V1__KvHandoff *h = r->handoff;
  int32_t n = (int32_t)r->n_prompt_ids;
  char msg[256];
  if (!h || !h->layout || n <= 0) {
    tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__INVALID_ARGUMENT,
                    "prefill request without prompt or kv handoff");
    return 0;
  }
  int32_t nb = tw_kv_blocks_needed(w->blocks, n);
  if ((int32_t)h->n_block_ids < nb) {
    snprintf(msg, sizeof msg, "handoff has %zu blocks, the prompt of %d tokens needs %d",
             h->n_block_ids, n, nb);
    tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return 0;
  }
  if (may_wait && !tw_kv_blocks_can_alloc(w->blocks, nb)) return -1;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)nb);
  uint64_t *sums = calloc((size_t)c->n_layers, sizeof(uint64_t));
  if (!ids || !sums) {
    free(ids);
    free(sums);
    tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__RESOURCE_EXHAUSTED,
                    "prefill worker out of host memory");
    return 0;
  }
  if (tw_kv_blocks_alloc(w->blocks, nb, ids) != TW_OK) {
    free(ids);
    free(sums);
    snprintf(msg, sizeof msg, "prompt of %d tokens needs %d kv blocks, prefill pool has %d", n, nb,
             tw_kv_blocks_total(w->blocks));
    tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return 0;
  }
  *it = (tw_prefill_handoff_item_t){
      .r = r, .ids = ids, .nb = nb, .sp = tw_proto_sample_params(r->sampling), .sums = sums};
  return 1;
}

/* Answer each prompt of a finished batch (PrefillDone, metrics), free its
 * blocks, ids, checksums and request. */
static void tw_prefill_answer(tw_prefiller_t *w, tw_prefill_handoff_item_t *items,
                              Twain__Internal__V1__Envelope **envs, int32_t n) {
  const tw_model_config_t *c = &w->model->config;
  for (int32_t i = 0; i < n; i++) {
    tw_prefill_handoff_item_t *it = &items[i];
    const Twain__Internal__V1__PrefillRequest *r = it->r;
    /* a failed free is a bookkeeping bug (kv_blocks.c logged which id):
     * the blocks stay held and the capacity we report shows it */
    if (tw_kv_blocks_free(w->blocks, it->nb, it->ids) != TW_OK)
      TW_ERROR("prefill", "request %llu: its %d KV blocks were not freed",
               (unsigned long long)r->request_id, it->nb);
    const tw_prefill_handoff_result_t *hr = &it->out;
    if (it->st != TW_OK) {
      TW_WARN("prefill", "request %llu failed: %s", (unsigned long long)r->request_id, it->msg);
      tw_prefill_note_device_error(w, it->st, it->msg); /* first: the answer says so */
      tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, tw_status_wire_code(it->st), it->msg);
    } else {
      tw_metric_observe(w->m.prefill, hr->prefill_ms * 1e-3);
      tw_metric_observe(w->m.transfer, hr->transfer_ms * 1e-3);
      tw_metric_add(w->m.kv_bytes, (double)hr->kv_bytes);
      tw_metric_add(w->m.requests, 1);
      tw_worker_stats_add(&w->stats, (int64_t)r->n_prompt_ids, 0);
      tw_metric_add(w->m.layer_sends, (double)hr->layer_sends);
      tw_metric_add(w->m.layer_sends_overlapped, (double)hr->layer_sends_in_engine);
      tw_metric_observe(w->m.tail, hr->tail_ms * 1e-3);
      TW_DEBUG("prefill",
               "request %llu: %zu tokens in a batch of %d, %.2f ms, %lld kv bytes to %s in %.2f ms, "
               "tail %.2f ms after the last layer",
               (unsigned long long)r->request_id, r->n_prompt_ids, n, hr->prefill_ms,
               (long long)hr->kv_bytes, r->handoff->decode_worker, hr->transfer_ms, hr->tail_ms);
      w->kv_in_place = hr->kv_in_place;
      tw_prefill_done(w, r->request_id, hr->first_token, it->sums, (size_t)c->n_layers,
                      hr->kv_bytes, hr->prefill_ms, hr->transfer_ms, 0, NULL);
      w->kv_in_place = false;
    }
    free((void *)it->ids);
    free(it->sums);
    twain__internal__v1__envelope__free_unpacked(envs[i], NULL);
  }
}

/* Flush and answer the pending batch, if any. */
static void tw_prefill_finish_pending(tw_prefiller_t *w) {
  tw_prefill_handoff_batch_t *b = w->pending.b;
  if (!b) return;
  w->pending.b = NULL;
  tw_prefill_handoff_finish(b);
  tw_prefill_answer(w, w->pending.items, w->pending.envs, w->pending.n);
}

/* hc.on_layer: from the next batch's per-layer callbacks, so the previous
 * batch's flush and answers overlap that batch's compute. */
static void tw_prefill_on_engine_layer(void *arg) {
  tw_prefiller_t *w = arg;
  if (!w->pending.b) return;
  tw_metric_add(w->m.overlapped, 1);
  tw_prefill_finish_pending(w);
}

/* Run a batch of prepared prompts (one variable-length engine prefill); its
 * handoff is finished and its prompts answered now, or, when more prompts
 * wait, during the next batch's compute (pending). A batch the engine
 * refuses on its argument checks (nothing ran) is run again prompt by
 * prompt, so only the bad prompt fails. */
static void tw_prefill_batch_run(tw_prefiller_t *w, tw_prefill_handoff_item_t *items,
                                 Twain__Internal__V1__Envelope **envs, int32_t n) {
  tw_prefill_handoff_batch_t *b = NULL;
  tw_status_t st = tw_prefill_handoff_start(&w->hc, items, n, &b);
  tw_prefill_finish_pending(w); /* when this batch's engine run reported no layer */
  tw_metric_add(w->m.batches, 1);
  if (n > 1 && (st == TW_ERR_INVALID_ARGUMENT || st == TW_ERR_OUT_OF_RANGE)) {
    TW_INFO("prefill", "batch of %d refused (%s): running its prompts one by one", n,
            tw_last_error());
    tw_prefill_handoff_finish(b);
    b = NULL;
    /* each item carries its own status (answered by tw_prefill_answer) */
    for (int32_t i = 0; i < n; i++) TW_IGNORE(tw_prefill_handoff_batch(&w->hc, &items[i], 1));
  }
  if (b && w->q_len > 0 && !w->wk.draining) {
    w->pending.b = b;
    w->pending.items = items;
    w->pending.envs = envs;
    w->pending.n = n;
    w->cur ^= 1; /* the next batch fills the other buffer */
    return;
  }
  tw_prefill_handoff_finish(b);
  tw_prefill_answer(w, items, envs, n);
}

/* Take the next work off the queue: prompts in arrival order up to the
 * token budget of one forward pass (--chunk-tokens) and --batch-seqs
 * prompts, as one batch; a prompt longer than the budget goes alone (the
 * engine splits it over passes); a multi-rank prompt goes alone. */
static void tw_prefill_next(tw_prefiller_t *w) {
  tw_prefill_handoff_item_t *items = w->batch[w->cur];
  Twain__Internal__V1__Envelope **envs = w->batch_envs[w->cur];
  int32_t n = 0;
  int64_t tokens = 0;
  while (w->q_len && n < w->o.batch_seqs) {
    Twain__Internal__V1__Envelope *e = w->queue[w->q_head];
    const Twain__Internal__V1__PrefillRequest *r = e ? e->prefill : NULL;
    bool ranks = r && tw_prefill_ranks_wanted(&w->rk, r);
    if (r && n > 0 && (ranks || tokens + (int64_t)r->n_prompt_ids > w->o.chunk_tokens)) break;
    if (ranks) tw_prefill_finish_pending(w); /* it runs alone, after every earlier handoff */
    /* queued past the KV-write guard: back to the router, which reserves it
     * again (not the client's failure; its queue time there is free) */
    int64_t waited = 0;
    bool stale =
        r && !w->wk.draining && tw_proto_stale(r->issued_unix_ms, TW_PREFILL_MAX_AGE_MS, &waited);
    int ready = 0;
    if (r && !w->wk.draining && !stale) {
      ready = tw_prefill_prepare(w, r, n > 0 || w->pending.b, &items[n]);
      if (ready < 0 && n == 0) { /* the pending batch holds the blocks: finish it first */
        tw_prefill_finish_pending(w);
        continue;
      }
      if (ready < 0) break; /* waits for this batch's blocks */
    }
    w->q_head = (w->q_head + 1) % TW_PREFILL_MAX_QUEUE;
    w->q_len--;
    if (!e) continue; /* cancelled */
    w->queued_tokens -= (int64_t)r->n_prompt_ids;
    if (w->wk.draining)
      tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__UNAVAILABLE,
                      "prefill worker is draining");
    else if (stale) {
      char why[200];
      snprintf(why, sizeof why, "request waited %lld ms in the prefill queue, past the %d ms "
               "kv-write guard: reserve again", (long long)waited, TW_PREFILL_MAX_AGE_MS);
      tw_prefill_done(w, r->request_id, -1, NULL, 0, 0, 0, 0, TWAIN__V1__CODE__UNAVAILABLE, why);
    }
    if (!ready) {
      twain__internal__v1__envelope__free_unpacked(e, NULL);
      continue;
    }
    if (ranks) { /* n == 0 here */
      /* the multi-rank path reports no kv_in_place: it puts over UCX only */
      tw_kv_xfer_set_direct_ipc(w->xfer, false);
      tw_prefill_ranks_one(w, r, (int32_t *)items[0].ids, items[0].nb);
      tw_kv_xfer_set_direct_ipc(w->xfer, true);
      free((void *)items[0].ids);
      free(items[0].sums);
      twain__internal__v1__envelope__free_unpacked(e, NULL);
      return;
    }
    envs[n++] = e;
    tokens += (int64_t)r->n_prompt_ids;
  }
  if (n == 0) {
    tw_prefill_finish_pending(w); /* nothing to overlap it with */
    return;
  }
  tw_prefill_batch_run(w, items, envs, n);
}

static void tw_prefill_capacity(tw_prefiller_t *w, Twain__Internal__V1__Capacity *cap) {
  twain__internal__v1__capacity__init(cap);
  cap->queued_prompt_tokens = w->queued_tokens;
  cap->queued = w->q_len;
  cap->free_kv_blocks = tw_kv_blocks_free_count(w->blocks);
  cap->total_kv_blocks = tw_kv_blocks_total(w->blocks);
  tw_metric_set(w->m.queue, w->q_len);
  tw_metric_set(w->m.queued_tokens, (double)w->queued_tokens);
  double tok_s, steps_s;
  if (tw_worker_stats_due(&w->stats, tw_msg_clock_ns(), w->q_len > 0, &tok_s, &steps_s))
    TW_INFO("prefill", "stats: waiting %d prompts (%lld tokens), prompt %.1f tok/s", w->q_len,
            (long long)w->queued_tokens, tok_s);
}

/* KvPeers: connect to the decode workers' pools before their first handoff
 * (tw_handoff_connect: the handoff then reuses the endpoint), one line
 * each; a failure is a warning (the first handoff connects again), then
 * KvPeersReady tells the router (it prints ready once every prefill worker
 * answered). */
static void tw_prefill_kv_peers(tw_prefiller_t *w, const Twain__Internal__V1__KvPeers *kp) {
  tw_prefill_finish_pending(w); /* a new endpoint may evict a cached one the batch uses */
  const tw_kv_layout_t *src = tw_engine_kv_layout(w->engine);
  Twain__Internal__V1__KvPeersReady ready = TWAIN__INTERNAL__V1__KV_PEERS_READY__INIT;
  for (size_t i = 0; i < kp->n_pools; i++) {
    const Twain__Internal__V1__KvHandoff *h = kp->pools[i];
    const char *name = h->decode_worker && h->decode_worker[0] ? h->decode_worker : "?";
    int32_t n = 0;
    tw_kv_path_t path = TW_KV_PATH_UNREACHABLE;
    int64_t t0 = tw_msg_clock_ns();
    if (tw_handoff_connect(w->xfer, src, h, &n, &path) != TW_OK) {
      ready.failed++;
      TW_WARN("prefill",
              "kv pools of decode worker %s not connected ahead of traffic (its first "
              "handoff tries again): %s",
              name, tw_last_error());
      continue;
    }
    ready.connected++;
    tw_metric_add(w->m.kv_peers, 1);
    TW_INFO("prefill",
            "kv pools of decode worker %s connected ahead of traffic: %d pools, %s "
            "path, %.1f ms",
            name, n, tw_kv_path_name(path), (double)(tw_msg_clock_ns() - t0) * 1e-6);
  }
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_KV_PEERS_READY;
  env.kv_peers_ready = &ready;
  if (tw_worker_link_send(&w->wk.link, &env) != TW_OK)
    TW_WARN("prefill", "cannot tell the router the kv peers are connected: %s", tw_last_error());
}

static bool tw_prefill_on_msg(tw_prefiller_t *w, Twain__Internal__V1__Envelope *env) {
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_KV_PEERS) {
    tw_prefill_kv_peers(w, env->kv_peers);
    twain__internal__v1__envelope__free_unpacked(env, NULL);
    return true;
  }
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL) {
    if (w->wk.draining || w->q_len == TW_PREFILL_MAX_QUEUE) {
      tw_prefill_done(
          w, env->prefill->request_id, -1, NULL, 0, 0, 0, 0,
          w->wk.draining ? TWAIN__V1__CODE__UNAVAILABLE : TWAIN__V1__CODE__RESOURCE_EXHAUSTED,
          w->wk.draining ? "prefill worker is draining" : "prefill queue is full");
      twain__internal__v1__envelope__free_unpacked(env, NULL);
      return true;
    }
    w->queue[(w->q_head + w->q_len++) % TW_PREFILL_MAX_QUEUE] = env;
    w->queued_tokens += (int64_t)env->prefill->n_prompt_ids;
    return true;
  }
  if (env->body_case != TWAIN__INTERNAL__V1__ENVELOPE__BODY_CANCEL) return false;
  for (int i = 0; i < w->q_len; i++) {
    Twain__Internal__V1__Envelope **e = &w->queue[(w->q_head + i) % TW_PREFILL_MAX_QUEUE];
    if (*e && (*e)->prefill->request_id == env->cancel->request_id) {
      w->queued_tokens -= (int64_t)(*e)->prefill->n_prompt_ids;
      twain__internal__v1__envelope__free_unpacked(*e, NULL);
      *e = NULL; /* skipped when it reaches the head */
    }
  }
  twain__internal__v1__envelope__free_unpacked(env, NULL);
  return true;
}

/* Prefill passes of the shapes traffic takes, on throwaway prompts in this
 * worker's own pool, before it registers (issue 15 item 6, "ready means
 * ready"): a CUDA engine loads each kernel at its first launch (lazy module
 * loading) and cuBLAS picks and loads its kernels per GEMM shape, which made
 * the first prompt after `ready` take 108 ms to its first token against 23
 * ms for the next ones (20b, 1,024 tokens, one H200, docs/benchmarks.md).
 * The calls: one prompt of 16, 200 and 1,024 tokens (the small-M GEMV, the
 * decode-sized and the mid MoE tiles), then as many prompts of 1,024 tokens
 * as one pass of the token budget holds (the full grouped-GEMM tile and the
 * batched attention). A call runs only within the token budget and the
 * model's context, and with the sequences whose blocks the pool holds (one
 * sequence at least). Nothing is sent and the blocks are freed. By default
 * (--warmup auto) device engines only: the CPU backend has nothing to load;
 * and one rank only either way: the ranks of a TP or EP pool run their
 * passes in lockstep with rank 0's requests (prefill_ranks.h). A device
 * error (TW_ERR_CUDA, TW_ERR_NCCL) is returned: the worker exits, as it
 * would on that error at its first prompt; any other failure is logged and
 * the worker goes on (the first prompts then pay for what was not warmed). */
static TW_NODISCARD tw_status_t tw_prefill_warmup(tw_prefiller_t *w) {
  const tw_kv_layout_t *l = tw_engine_kv_layout(w->engine);
  if (w->o.warmup < 0 || (w->o.warmup == 0 && !l->on_device)) return TW_OK;
  if (w->o.tp > 1 || w->o.ep > 1) {
    if (w->o.warmup > 0)
      TW_WARN("prefill",
              "--warmup 1: not for a worker of %d ranks (the first prompts load kernels)",
              w->o.tp * w->o.ep);
    return TW_OK;
  }
  const tw_model_config_t *c = &w->model->config;
  const int32_t V = c->vocab_size, budget = w->o.chunk_tokens;
  const int32_t full = budget / 1024 < w->o.batch_seqs ? budget / 1024 : w->o.batch_seqs;
  const int32_t lens[4] = {16, 200, 1024, 1024};
  int64_t t0 = tw_msg_clock_ns(), tokens = 0;
  char ran[96] = "";
  size_t used = 0;
  for (int call = 0; call < 4; call++) {
    const int32_t want = call < 3 ? 1 : full, len = lens[call];
    if (want <= 0 || len > budget || len > c->max_position_embeddings) continue;
    const int32_t nb = tw_kv_blocks_needed(w->blocks, len);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)nb * (size_t)want);
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)len);
    int32_t *next = malloc(sizeof(int32_t) * (size_t)want);
    tw_prefill_seq_t *seqs = calloc((size_t)want, sizeof *seqs);
    tw_status_t st =
        ids && toks && next && seqs ? TW_OK : tw_err(TW_ERR_NO_MEMORY, "out of host memory");
    /* sequence by sequence (a ring pool lays out each table's sliding
     * blocks), as many as the pool holds */
    int32_t held = 0;
    while (st == TW_OK && held < want && tw_kv_blocks_can_alloc(w->blocks, nb) &&
           tw_kv_blocks_alloc(w->blocks, nb, ids + (size_t)held * nb) == TW_OK)
      held++;
    if (st == TW_OK && held > 0) {
      for (int32_t i = 0; i < len; i++)
        toks[i] = (int32_t)((1009u * (uint32_t)i + 7u) % (uint32_t)V);
      for (int32_t k = 0; k < held; k++)
        seqs[k] = (tw_prefill_seq_t){.tokens = toks,
                                     .n_tokens = len,
                                     .block_table = ids + (size_t)k * nb,
                                     .n_blocks = nb,
                                     .next_token_out = next + k};
      st = tw_engine_prefill_batch(w->engine,
                                   &(tw_prefill_batch_args_t){.n_seqs = held, .seqs = seqs});
    }
    for (int32_t k = 0; k < held; k++)
      if (tw_kv_blocks_free(w->blocks, nb, ids + (size_t)k * nb) != TW_OK)
        TW_ERROR("prefill", "warm-up: %d KV blocks were not freed", nb);
    free(ids);
    free(toks);
    free(next);
    free(seqs);
    if (st == TW_ERR_CUDA || st == TW_ERR_NCCL) return st;
    if (st != TW_OK) {
      TW_WARN("prefill", "warm-up pass of %d x %d tokens failed (the first prompts pay for it): %s",
              held, len, tw_last_error());
      return TW_OK;
    }
    if (held == 0) continue; /* the pool holds none: skipped */
    const char *sep = used ? ", " : "";
    int n = held > 1 ? snprintf(ran + used, sizeof ran - used, "%s%d x %d", sep, held, len)
                     : snprintf(ran + used, sizeof ran - used, "%s%d", sep, len);
    if (n > 0 && (size_t)n < sizeof ran - used) used += (size_t)n;
    tokens += (int64_t)held * len;
  }
  TW_INFO("prefill", "warm-up: prefill calls of %s tokens (%lld in all) in %.0f ms",
          used ? ran : "no", (long long)tokens, (double)(tw_msg_clock_ns() - t0) * 1e-6);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_prefiller_init(tw_prefiller_t *w) {
  for (int k = 0; k < 2; k++) {
    w->batch[k] = calloc((size_t)w->o.batch_seqs, sizeof *w->batch[k]);
    w->batch_envs[k] = calloc((size_t)w->o.batch_seqs, sizeof *w->batch_envs[k]);
    if (!w->batch[k] || !w->batch_envs[k])
      return tw_err(TW_ERR_NO_MEMORY, "prefill worker: out of memory for batches of %d prompts",
                    w->o.batch_seqs);
  }
  TW_CHECK(tw_model_load(w->o.model_dir, &w->model));
  TW_CHECK(tw_model_check_finite(w->model));
  /* the rank group (issue 6): MPI for the cpu backend, NCCL for cuda */
  TW_CHECK(tw_worker_dist_create(&w->wk, w->o.backend));
  tw_engine_params_t ep = TW_ENGINE_PARAMS_DEFAULT;
  ep.tp_size = w->o.tp;
  ep.tp_rank = w->o.tp > 1 ? w->wk.id.rank : 0;
  ep.ep_size = w->o.ep;
  ep.ep_rank = w->o.ep > 1 ? w->wk.id.rank : 0;
  ep.coll = tw_dist_coll(w->wk.dist);
  if (tw_backend_caps(w->o.backend).on_device) ep.device = w->wk.id.local_rank;
  ep.backend = w->o.backend;
  ep.kv_block_size = w->o.block_size;
  ep.kv_num_blocks = w->o.kv_blocks; /* 0: planned (mem_plan.h) */
  ep.kv_window_ring = w->o.kv_window_ring;
  ep.prefill_bf16_experts = w->o.prefill_bf16_experts;
  ep.kv_dtype = w->o.kv_dtype;
  ep.max_batch = w->o.batch_seqs;
  ep.max_prefill_chunk = w->o.chunk_tokens; /* 0: planned, the token budget */
  ep.mem_role = TW_MEM_ROLE_PREFILL;
  ep.mem_prefill_workers = w->o.colocated_prefill;
  ep.mem_decode_workers = w->o.colocated_decode;
  ep.mem_utilization = w->o.gpu_memory_utilization;
  ep.weights_share_dir = w->o.share_weights_dir;
  ep.n_threads = w->o.threads;
  TW_CHECK(tw_engine_create(w->model, &ep, &w->engine));
  w->o.chunk_tokens = tw_engine_params(w->engine)->max_prefill_chunk; /* planned or given */
  const tw_kv_layout_t *l = tw_engine_kv_layout(w->engine);
  TW_CHECK(tw_kv_blocks_create_ring(l->n_blocks, l->block_size, l->n_ring_blocks, l->ring_blocks,
                                    &w->blocks));
  /* shared-memory FIFOs kept: a decode worker that takes puts in place
   * keeps them too and gets real puts; any other leaves them out, and so
   * does every endpoint to it (tw_kv_xfer_create_bound) */
  TW_CHECK(tw_kv_xfer_create_bound(w->o.router, true, &w->xfer));
  tw_kv_xfer_set_direct_ipc(w->xfer, true); /* PrefillDone.kv_in_place tells the decode worker */
  w->hc = (tw_prefill_handoff_ctx_t){.engine = w->engine, .model = w->model, .xfer = w->xfer,
                                     .flush_timeout_ms = w->o.flush_timeout_ms,
                                     .max_age_ms = TW_PREFILL_MAX_AGE_MS,
                                     .on_layer = tw_prefill_on_engine_layer, .on_layer_arg = w};
  w->rk = (tw_prefill_ranks_t){.dist = w->wk.dist,
                               .engine = w->engine,
                               .xfer = w->xfer,
                               .model = w->model,
                               .flush_timeout_ms = w->o.flush_timeout_ms,
                               .max_age_ms = TW_PREFILL_MAX_AGE_MS};
  TW_CHECK(tw_prefill_warmup(w));       /* before the router hears of this worker */
  if (w->wk.id.rank != 0) return TW_OK; /* only rank 0 talks to the router */
  TW_CHECK(tw_worker_metrics_open(&w->wk, w->o.name, w->o.metrics_port, w->o.metrics_addr,
                                  w->o.served_model_name, w->o.model_dir));
  tw_metrics_t *M = w->wk.metrics;
  w->stats.interval_s = w->o.log_stats_interval_s;
  w->m.queue = tw_metrics_gauge(M, "prefill_queue_depth", "prompts waiting");
  w->m.queued_tokens = tw_metrics_gauge(M, "prefill_queued_prompt_tokens", "prompt tokens waiting");
  w->m.prefill = tw_metrics_histogram(M, "prefill_seconds", "engine prefill time per prompt",
                                      tw_metrics_latency_buckets, tw_metrics_latency_n);
  w->m.transfer = tw_metrics_histogram(M, "kv_transfer_seconds", "kv puts + flush per prompt",
                                       tw_metrics_latency_buckets, tw_metrics_latency_n);
  w->m.kv_bytes = tw_metrics_counter(M, "kv_bytes_sent_total", "kv bytes put to decode workers");
  w->m.requests = tw_metrics_counter(M, "prefill_requests_total", "prompts prefilled and handed off");
  w->m.failed = tw_metrics_counter(M, "prefill_failures_total", "prompts that failed");
  w->m.tail = tw_metrics_histogram(M, "kv_handoff_tail_seconds",
                                   "kv handoff time left after the last layer's compute, per prompt",
                                   tw_metrics_latency_buckets, tw_metrics_latency_n);
  w->m.layer_sends = tw_metrics_counter(M, "kv_layer_sends_total",
                                        "kv puts issued for one layer's finished blocks");
  w->m.layer_sends_overlapped = tw_metrics_counter(
      M, "kv_layer_sends_overlapped_total",
      "of those, issued from the engine's per-layer callback while later layers compute");
  w->m.batches = tw_metrics_counter(M, "prefill_batches_total",
                                    "engine prefill batches (prompts run as one variable-length "
                                    "prefill)");
  w->m.overlapped = tw_metrics_counter(M, "prefill_batch_handoffs_overlapped_total",
                                       "batches whose kv flush and answers ran while the next "
                                       "batch computed");
  w->m.kv_peers = tw_metrics_counter(M, "kv_peers_connected_ahead_total",
                                     "decode workers whose kv pools were connected (UCX endpoint, "
                                     "CUDA IPC mapping) before their first handoff");
  TW_CHECK(tw_worker_connect(&w->wk, w->o.router, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL,
                             l->block_size, l->n_layers, w->model->config.vocab_size,
                             tw_backend_name(tw_engine_backend(w->engine))));
  TW_INFO("prefill", "%s: %s backend, local pool %d blocks of %d tokens, router %s", w->wk.name,
          w->wk.link.backend, l->n_blocks, l->block_size, w->o.router);
  return TW_OK;
}

static void tw_prefiller_fini(tw_prefiller_t *w) {
  for (int i = 0; i < w->q_len; i++) {
    Twain__Internal__V1__Envelope *e = w->queue[(w->q_head + i) % TW_PREFILL_MAX_QUEUE];
    if (e) twain__internal__v1__envelope__free_unpacked(e, NULL);
  }
  tw_prefill_finish_pending(w);
  for (int k = 0; k < 2; k++) {
    free(w->batch[k]);
    free(w->batch_envs[k]);
  }
  if (w->wk.link.sock) tw_worker_link_close(&w->wk.link);
  tw_metrics_destroy(w->wk.metrics);
  tw_kv_xfer_destroy(w->xfer);
  tw_kv_blocks_destroy(w->blocks);
  tw_engine_destroy(w->engine);
  tw_dist_destroy(w->wk.dist);
  tw_model_destroy(w->model);
}

/* The skeleton's hooks (worker_daemon.h). */
static TW_NODISCARD tw_status_t tw_prefill_op_init(void *arg) { return tw_prefiller_init(arg); }
static void tw_prefill_op_fini(void *arg) { tw_prefiller_fini(arg); }

static TW_NODISCARD tw_status_t tw_prefill_op_follow(void *arg) {
  tw_prefiller_t *w = arg;
  return tw_dist_follow(w->wk.dist, w->engine, tw_prefill_ranks_hook, &w->rk, NULL);
}

static void tw_prefill_op_drain(void *arg) {
  tw_prefiller_t *w = arg;
  TW_INFO("prefill", "draining: refusing %d queued prompts", w->q_len);
}

/* Idle (no prompt queued, no batch whose handoff is to finish): block on
 * the router socket (a message wakes it at once). */
static int tw_prefill_op_wait_ms(void *arg, int *fd_p) {
  tw_prefiller_t *w = arg;
  (void)fd_p;
  return w->q_len == 0 && !w->pending.b ? TW_PREFILL_IDLE_WAIT_MS : 0;
}

static bool tw_prefill_op_msg(void *arg, Twain__Internal__V1__Envelope *env) {
  return tw_prefill_on_msg(arg, env);
}

/* What a drain waits for: the queue (refused) and the batch whose handoff
 * finishes during the next one (answered). */
static int32_t tw_prefill_op_pending(void *arg) {
  tw_prefiller_t *w = arg;
  return w->q_len + (w->pending.b ? 1 : 0);
}

/* One batch; after a device error (its prompts answered with it, marked as
 * the worker's failure) the worker stops and exits: the router retries what
 * it held there elsewhere, and its supervisor (twain serve, Kubernetes, Slurm)
 * starts a fresh one; a CUDA context with a sticky error serves nothing
 * again (under CUDA MPS it also keeps the server from taking new clients). */
static TW_NODISCARD tw_status_t tw_prefill_op_work(void *arg) {
  tw_prefiller_t *w = arg;
  tw_prefill_next(w);
  if (w->device_error == TW_OK) return TW_OK;
  tw_prefill_finish_pending(w); /* answered, not left hanging */
  TW_ERROR("prefill", "device error in a prefill batch, stopping: %s", w->device_msg);
  return w->device_error;
}

static void tw_prefill_op_capacity(void *arg, Twain__Internal__V1__Capacity *cap) {
  tw_prefill_capacity(arg, cap);
}

static void tw_prefill_op_stop(void *arg) {
  (void)arg;
  TW_INFO("prefill", "stopped");
}

static const tw_worker_ops_t tw_prefill_ops = {.init = tw_prefill_op_init,
                                               .fini = tw_prefill_op_fini,
                                               .follow = tw_prefill_op_follow,
                                               .on_drain = tw_prefill_op_drain,
                                               .wait_ms = tw_prefill_op_wait_ms,
                                               .on_msg = tw_prefill_op_msg,
                                               .pending = tw_prefill_op_pending,
                                               .work = tw_prefill_op_work,
                                               .capacity = tw_prefill_op_capacity,
                                               .on_stop = tw_prefill_op_stop};

int tw_prefill_worker_main(const tw_prefill_opts_t *opts, int argc, char **argv) {
  static tw_prefiller_t w; /* large queue array: not on the stack */
  memset(&w, 0, sizeof w);
  w.o = *opts;
  if (w.o.tp < 1 || w.o.ep < 1 || (w.o.tp > 1 && w.o.ep > 1 && w.o.tp != w.o.ep)) {
    fprintf(stderr, "twain-prefill: --tp %d --ep %d: each >= 1, equal when both > 1\n", w.o.tp,
            w.o.ep);
    return 2;
  }
  w.wk = (tw_worker_t){.prog = "twain-prefill",
                       .role = "prefill",
                       .unit = "prompts",
                       .router = w.o.router,
                       .ranks = w.o.tp > w.o.ep ? w.o.tp : w.o.ep,
                       .use_mpi = w.o.backend != TW_BACKEND_CUDA,
                       .argc = argc,
                       .argv = argv,
                       .drain_timeout_s = -1, /* the queue is refused, the batch finishes */
                       .ops = &tw_prefill_ops,
                       .arg = &w};
  return tw_worker_main(&w.wk);
}
