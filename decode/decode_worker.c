/* decode_worker.c: the decode worker daemon loop (see decode_worker.h).
 *
 * One thread: poll the router socket, handle Reserve / DecodeRequest /
 * Cancel, run one engine decode step over every running sequence
 * (continuous batching: sequences join and leave between steps), stream the
 * step's tokens, heartbeat. Blocks for prompt + max_tokens are reserved up
 * front, so a running sequence can never run out of KV mid-stream: a full
 * pool answers RESOURCE_EXHAUSTED at reservation time and the router queues
 * or tries another worker. Every exit path of a sequence goes through
 * tw_dseq_release(), which returns its blocks.
 *
 * Data-parallel attention (--dp N, issue 6): rank 0 keeps one block manager
 * per rank (each rank's pool minus its last block, the padding block of an
 * empty step), places each reservation on the rank with the most free
 * blocks, hands the prefill worker that rank's pool only, has that rank
 * check the checksums, and runs every step as per-rank batches
 * (tw_dist_engine_decode_dp). */
#include "decode/decode_worker.h"

#include "common/engine/dist_engine.h"
#include "decode/decode_ranks.h"

#include "common/base/log.h"
#include "common/base/metrics.h"
#include "common/base/test_hook.h"
#include "common/comm/msg_worker.h"
#include "common/comm/proto_engine.h"
#include "common/engine/mem_plan.h"
#include "common/kv/kv_blocks.h"
#include "common/kv/kv_transfer.h"
#include "common/model/model.h"
#include "common/model/model_path.h"
#include "common/worker/worker_daemon.h"
#include "common/worker/worker_stats.h"
#include "proto/twain_api.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TW_DSEQ_MAX_STOP 16

/* QUARANTINE: a reservation cancelled or expired before its KV arrived. A
 * prefill worker may still be writing into those blocks (one-sided puts
 * cannot be revoked), so they stay out of the free list for
 * TW_DSEQ_QUARANTINE_MS, longer than a prefill worker ever writes for a
 * request (TW_PREFILL_MAX_AGE_MS, 20 s after the router handed it over). */
/* COMMITTING: the prefill worker is done (PrefillDone) but on a staged pool
 * some pieces are still in the bounce ring or being copied to the device on
 * the ring's own stream (kv_transfer.h); the sequence joins the decode
 * batches once every byte of its blocks is on the device
 * (tw_kv_region_landed, polled each loop turn), so a handoff never stalls a
 * step. One that has not landed within TW_DSEQ_COMMIT_MS fails. */
typedef enum {
  TW_DSEQ_RESERVED = 1,
  TW_DSEQ_RUNNING = 2,
  TW_DSEQ_QUARANTINE = 3,
  TW_DSEQ_COMMITTING = 4
} tw_dseq_state_t;
/* outlasts the prefill KV-write guard; TW_SLOW_BUILD: common/base/status.h */
#define TW_DSEQ_QUARANTINE_MS (40000 * TW_SLOW_BUILD)
#define TW_DSEQ_COMMIT_MS 30000

typedef struct {
  uint64_t id;
  tw_dseq_state_t state;
  int32_t rank;       /* the dp rank whose pool holds its KV (0 without --dp) */
  int32_t *blocks;
  int32_t n_blocks;
  int32_t n_prompt;
  int32_t pos;        /* position of `token` (the next input) */
  int32_t token;      /* last generated token, fed at the next step */
  int32_t generated;  /* tokens generated so far, the prefill's first one included */
  int32_t max_tokens;
  tw_sample_params_t sample;
  int32_t stop[TW_DSEQ_MAX_STOP];
  int32_t n_stop;
  int64_t t_ns;       /* reservation time, then last step time */
  int64_t t_commit_ns; /* COMMITTING: since when */
} tw_dseq_t;

typedef struct {
  const tw_decode_params_t *p;
  tw_model_t *model;
  tw_engine_t *engine;
  int32_t n_dp;                          /* attention replicas (1: no --dp) */
  int32_t max_batch;                     /* sequences per step and dp rank (planned or --max-batch) */
  tw_kv_blocks_t *bm[TW_DECODE_MAX_DP];  /* rank 0: a block manager per dp rank */
  int32_t pad[TW_DECODE_MAX_DP];         /* each dp rank's padding block (dist_engine.h) */
  tw_kv_xfer_t *xfer;
  tw_kv_region_t *region;
  tw_worker_t wk; /* the daemon skeleton: rank, router link, metrics, drain (worker_daemon.h) */
  tw_dseq_t **seqs;
  int32_t n_seqs, cap_seqs;
  int32_t step_start[TW_DECODE_MAX_DP]; /* per dp rank: first table index its next step tries */
  bool idle;                            /* this loop turn found no sequence to step */
  bool device_failed;       /* a step failed on a device error: its answers say the worker failed */
  int64_t last_step_end_ns; /* when the last step's device work ended; 0: none ran since idle */
  tw_decode_ranks_t rk;
  ProtobufCBinaryData kv_addr[64]; /* each rank's UCX address, for Register (borrowed) */
  /* its pools, once, in Register: rank 0's address, rkey and layout, and
   * every rank's (TP, or --dp replicas) in pools.ranks (borrowed) */
  Twain__Internal__V1__KvHandoff pools;
  Twain__Internal__V1__KvLayout pools_layout;
  /* step scratch */
  int32_t *tok, *pos, *nb, *out;
  const int32_t **tables;
  tw_sample_params_t *samp;
  tw_dseq_t **batch;
  struct {
    tw_metric_t *running, *reserved, *blocks_used, *blocks_free, *tpot, *tokens, *steps,
        *kv_bytes, *sum_ok, *sum_bad, *rejected, *step_s, *gap_s;
    /* the staged receive ring (kv_rxring.h); counters advance by deltas */
    tw_metric_t *stg_bytes, *stg_waits, *stg_failed, *stg_slots, *stg_busy;
    tw_kv_rxring_stats_t stg_seen;
    tw_metric_t *dp_seqs[TW_DECODE_MAX_DP], *dp_tokens[TW_DECODE_MAX_DP],
        *dp_used[TW_DECODE_MAX_DP];
    tw_metric_t *kv_usage;
    tw_metric_t *quarantined; /* blocks of quarantined reservations (counted in blocks_used) */
  } m;
  tw_worker_stats_t stats; /* the periodic stats line */
} tw_decoder_t;

/* Blocks over every dp rank's manager: which = 0 free, 1 used, 2 total. */
static int32_t tw_decoder_blocks(const tw_decoder_t *d, int which) {
  int32_t n = 0;
  for (int32_t r = 0; r < d->n_dp; r++)
    n += which == 0 ? tw_kv_blocks_free_count(d->bm[r])
         : which == 1 ? tw_kv_blocks_used_count(d->bm[r]) : tw_kv_blocks_total(d->bm[r]);
  return n;
}

static void tw_decoder_block_gauges(tw_decoder_t *d) {
  int32_t used = tw_decoder_blocks(d, 1), total = tw_decoder_blocks(d, 2);
  tw_metric_set(d->m.blocks_used, used);
  tw_metric_set(d->m.blocks_free, tw_decoder_blocks(d, 0));
  tw_metric_set(d->m.kv_usage, total ? (double)used / total : 0);
  for (int32_t r = 0; r < d->n_dp && d->n_dp > 1; r++)
    tw_metric_set(d->m.dp_used[r], tw_kv_blocks_used_count(d->bm[r]));
}

static void tw_dseq_release(tw_decoder_t *d, int32_t idx) {
  tw_dseq_t *s = d->seqs[idx];
  if (s->n_blocks && tw_kv_blocks_free(d->bm[s->rank], s->n_blocks, s->blocks) != TW_OK)
    TW_ERROR("decode", "request %llu: could not free its %d blocks",
             (unsigned long long)s->id, s->n_blocks);
  free(s->blocks);
  free(s);
  d->seqs[idx] = d->seqs[--d->n_seqs];
  if (d->m.blocks_used) tw_decoder_block_gauges(d); /* at once, not at the end of the loop turn */
}

static int32_t tw_dseq_find(const tw_decoder_t *d, uint64_t id) {
  for (int32_t i = 0; i < d->n_seqs; i++)
    if (d->seqs[i]->id == id) return i;
  return -1;
}

static void tw_decoder_capacity(tw_decoder_t *d, Twain__Internal__V1__Capacity *c) {
  int32_t running = 0, waiting = 0, quarantined = 0;
  for (int32_t i = 0; i < d->n_seqs; i++) {
    running += d->seqs[i]->state == TW_DSEQ_RUNNING || d->seqs[i]->state == TW_DSEQ_COMMITTING;
    waiting += d->seqs[i]->state == TW_DSEQ_RESERVED;
    if (d->seqs[i]->state == TW_DSEQ_QUARANTINE) quarantined += d->seqs[i]->n_blocks;
  }
  twain__internal__v1__capacity__init(c);
  /* dp: sums over the replicas, plus the room of the emptiest one and the
   * size of the largest (a sequence's KV lives in one: the router's fit
   * test, Capacity in twain_internal.proto) */
  c->free_kv_blocks = tw_decoder_blocks(d, 0);
  c->total_kv_blocks = tw_decoder_blocks(d, 2);
  for (int32_t r = 0; r < d->n_dp && d->n_dp > 1; r++) {
    if (tw_kv_blocks_free_count(d->bm[r]) > c->replica_free_kv_blocks)
      c->replica_free_kv_blocks = tw_kv_blocks_free_count(d->bm[r]);
    if (tw_kv_blocks_total(d->bm[r]) > c->replica_total_kv_blocks)
      c->replica_total_kv_blocks = tw_kv_blocks_total(d->bm[r]);
  }
  if (d->n_dp == 1) /* the ring's room (--dp: each replica refuses for itself) */
    TW_IGNORE(tw_kv_blocks_ring_counts(d->bm[0], &c->free_ring_blocks, &c->total_ring_blocks,
                                       &c->ring_len));
  c->running = running;
  c->queued = waiting;
  tw_metric_set(d->m.running, running);
  tw_metric_set(d->m.reserved, waiting);
  tw_metric_set(d->m.quarantined, quarantined);
  tw_decoder_block_gauges(d);
  tw_kv_rxring_stats_t rs;
  if (d->m.stg_bytes && tw_kv_region_staging_stats(d->region, &rs)) {
    tw_kv_rxring_stats_t *o = &d->m.stg_seen;
    tw_metric_add(d->m.stg_bytes, (double)(rs.bytes_landed - o->bytes_landed));
    tw_metric_add(d->m.stg_waits, (double)(rs.full_waits - o->full_waits));
    tw_metric_add(d->m.stg_failed, (double)(rs.pieces_failed - o->pieces_failed));
    tw_metric_add(d->m.stg_busy, rs.busy_seconds - o->busy_seconds);
    tw_metric_set(d->m.stg_slots, rs.slots_in_use);
    *o = rs;
  }
  double tok_s, steps_s;
  if (tw_worker_stats_due(&d->stats, tw_msg_clock_ns(), running || waiting, &tok_s, &steps_s)) {
    int32_t used = tw_decoder_blocks(d, 1), total = tw_decoder_blocks(d, 2);
    TW_INFO("decode", "stats: running %d seqs, waiting %d, KV cache %.1f%% (%d of %d blocks), "
                      "generation %.1f tok/s, %.1f steps/s",
            running, waiting, total ? 100.0 * used / total : 0.0, used, total, tok_s, steps_s);
  }
}

static void tw_send_tokens(tw_decoder_t *d, uint64_t id, const int32_t *toks, size_t n,
                           bool finished, int finish_reason, int code, const char *msg) {
  Twain__Internal__V1__Tokens t = TWAIN__INTERNAL__V1__TOKENS__INIT;
  Twain__Internal__V1__Status s;
  t.request_id = id;
  t.n_tokens = n;
  t.tokens = (int32_t *)toks;
  t.finished = finished;
  t.finish_reason = finish_reason;
  t.status = tw_reply_status(&s, code, d->device_failed, msg);
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_TOKENS;
  env.tokens = &t;
  if (tw_worker_link_send(&d->wk.link, &env) != TW_OK)
    TW_WARN("decode", "request %llu: cannot send tokens to the router: %s",
            (unsigned long long)id, tw_last_error());
}

/* The wire code for a handed-off KV cache that could not be committed: a
 * device error (TW_ERR_CUDA, TW_ERR_NCCL) is sticky, so the worker marks
 * itself failed (its answers then say so and the router retries what it
 * held elsewhere) and stops after this turn (tw_decode_op_follow); anything
 * else fails the request alone, as INTERNAL. */
static int tw_decoder_kv_failed(tw_decoder_t *d, tw_status_t st) {
  if (st != TW_ERR_CUDA && st != TW_ERR_NCCL) return TWAIN__V1__CODE__INTERNAL;
  if (!d->device_failed)
    TW_ERROR("decode", "device error in a kv commit, stopping: %s", tw_last_error());
  d->device_failed = true;
  return tw_status_wire_code(st);
}

static void tw_on_reserve(tw_decoder_t *d, const Twain__Internal__V1__Reserve *r) {
  Twain__Internal__V1__Reserved out = TWAIN__INTERNAL__V1__RESERVED__INIT;
  Twain__Internal__V1__Status s = TWAIN__INTERNAL__V1__STATUS__INIT;
  Twain__Internal__V1__KvHandoff h = TWAIN__INTERNAL__V1__KV_HANDOFF__INIT;
  out.request_id = r->request_id;
  char msg[256] = "";
  tw_dseq_t *seq = NULL;
  int64_t n_tok = (int64_t)r->n_prompt_tokens + (r->max_tokens > 0 ? r->max_tokens : 1);
  int32_t need = tw_kv_blocks_needed(d->bm[0], n_tok);
  int32_t rank = 0; /* dp: the replica with the most free blocks (ties: the lowest rank) */
  for (int32_t k = 1; k < d->n_dp; k++)
    if (tw_kv_blocks_free_count(d->bm[k]) > tw_kv_blocks_free_count(d->bm[rank])) rank = k;
  if (d->wk.draining) {
    s.code = TWAIN__V1__CODE__UNAVAILABLE;
    snprintf(msg, sizeof msg, "decode worker %s is draining", d->wk.link.name);
  } else if (r->n_prompt_tokens <= 0 || tw_dseq_find(d, r->request_id) >= 0) {
    s.code = TWAIN__V1__CODE__INVALID_ARGUMENT;
    snprintf(msg, sizeof msg, "reserve for request %llu: %s", (unsigned long long)r->request_id,
             r->n_prompt_tokens <= 0 ? "no prompt tokens" : "already reserved");
  } else if (n_tok > d->model->config.max_position_embeddings) {
    s.code = TWAIN__V1__CODE__INVALID_ARGUMENT;
    snprintf(msg, sizeof msg, "prompt + max_tokens = %lld exceeds the context of %d",
             (long long)n_tok, d->model->config.max_position_embeddings);
  } else if (!(seq = calloc(1, sizeof *seq)) ||
             !(seq->blocks = malloc(sizeof(int32_t) * (size_t)need))) {
    s.code = TWAIN__V1__CODE__RESOURCE_EXHAUSTED;
    snprintf(msg, sizeof msg, "decode worker out of host memory");
  } else if (tw_kv_blocks_alloc(d->bm[rank], need, seq->blocks) != TW_OK) {
    s.code = TWAIN__V1__CODE__RESOURCE_EXHAUSTED;
    snprintf(msg, sizeof msg, "decode worker %s has %d free kv blocks%s, request needs %d%s",
             d->wk.link.name, tw_kv_blocks_free_count(d->bm[rank]),
             d->n_dp > 1 ? " in its emptiest dp rank" : "", need,
             tw_kv_blocks_free_count(d->bm[rank]) >= need
                 ? " (every window ring of the sliding layers is in use)"
                 : "");
  }
  if (s.code) {
    if (seq) free(seq->blocks);
    free(seq);
    tw_metric_add(d->m.rejected, 1);
    s.message = msg;
    out.status = &s;
  } else {
    if (d->n_seqs == d->cap_seqs) { /* grow the table (never shrinks) */
      int32_t cap = d->cap_seqs ? d->cap_seqs * 2 : 64;
      tw_dseq_t **t = realloc(d->seqs, sizeof *t * (size_t)cap);
      if (!t) {
        TW_IGNORE(tw_kv_blocks_free(d->bm[rank], need, seq->blocks)); /* just allocated */
        free(seq->blocks);
        free(seq);
        s.code = TWAIN__V1__CODE__RESOURCE_EXHAUSTED;
        s.message = "decode worker out of host memory";
        out.status = &s;
        goto send;
      }
      d->seqs = t;
      d->cap_seqs = cap;
    }
    seq->id = r->request_id;
    seq->rank = rank;
    seq->state = TW_DSEQ_RESERVED;
    seq->n_blocks = need;
    seq->n_prompt = r->n_prompt_tokens;
    seq->t_ns = tw_msg_clock_ns();
    d->seqs[d->n_seqs++] = seq;
    /* the pools' UCX address, rkey and layout went once, in Register
     * (tw_decoder_pools); the router adds them to the prefill request */
    /* only the prompt's blocks travel; the rest are for generated tokens */
    h.n_block_ids = (size_t)tw_kv_blocks_needed(d->bm[rank], r->n_prompt_tokens);
    h.checksums = d->p->verify_kv;
    h.block_ids = seq->blocks;
    h.decode_worker = d->wk.link.name;
    if (d->n_dp > 1) h.replica = rank + 1; /* that replica's pool only */
    out.handoff = &h;
    TW_DEBUG("decode", "request %llu: reserved %d blocks on rank %d",
             (unsigned long long)r->request_id, need, rank);
  }
send:;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVED;
  env.reserved = &out;
  tw_msg_note_failure(tw_worker_link_send(&d->wk.link, &env), "decode",
                      "cannot answer a reservation (the router expires it)");
}

/* Compare the checksums the prefill worker computed over what it sent with
 * those of what arrived, on the rank(s) that hold it: per layer (one pool
 * had it all), or per head (re-sharded: every TP rank its heads). */
static bool tw_decoder_verify(tw_decoder_t *d, tw_dseq_t *s,
                              const Twain__Internal__V1__DecodeRequest *r, char *msg,
                              size_t msg_len) {
  bool per_layer = r->n_layer_checksums > 0;
  /* per-head checksums read host pools only (kv_reshard.h) */
  if (!per_layer && tw_engine_kv_layout(d->engine)->on_device) return true;
  int32_t target = per_layer || d->n_dp > 1 ? s->rank : -1;
  int ok = 0, bad = 0;
  bool same = tw_decode_ranks_verify(
      &d->rk, target, per_layer, s->n_prompt, s->blocks, tw_kv_blocks_needed(d->bm[0], s->n_prompt),
      per_layer ? r->layer_checksums : r->head_checksums,
      per_layer ? r->n_layer_checksums : r->n_head_checksums, &ok, &bad, msg, msg_len);
  tw_metric_add(d->m.sum_ok, ok);
  tw_metric_add(d->m.sum_bad, bad);
  return same;
}

static bool tw_dseq_stops(const tw_dseq_t *s, int32_t tok) {
  for (int32_t i = 0; i < s->n_stop; i++)
    if (s->stop[i] == tok) return true;
  return false;
}

static void tw_on_decode(tw_decoder_t *d, const Twain__Internal__V1__DecodeRequest *r) {
  int32_t idx = tw_dseq_find(d, r->request_id);
  char msg[256] = "";
  if (idx < 0 || d->seqs[idx]->state != TW_DSEQ_RESERVED) {
    snprintf(msg, sizeof msg, "decode for request %llu: no reservation (cancelled or expired)",
             (unsigned long long)r->request_id);
    TW_WARN("decode", "%s", msg);
    tw_msg_note_failure(
        tw_worker_link_reject(&d->wk.link, r->request_id, TWAIN__V1__CODE__NOT_FOUND, msg),
        "decode", "cannot send a reject to the router");
    return;
  }
  tw_dseq_t *s = d->seqs[idx];
  const tw_kv_layout_t *l = tw_engine_kv_layout(d->engine);
  const tw_model_config_t *c = &d->model->config;
  int32_t nb = tw_kv_blocks_needed(d->bm[0], s->n_prompt);
  if (r->n_prompt_tokens != s->n_prompt || r->first_token < 0 || r->first_token >= c->vocab_size ||
      r->max_tokens <= 0 || (int64_t)s->n_prompt + r->max_tokens > (int64_t)s->n_blocks * l->block_size) {
    snprintf(msg, sizeof msg, "decode for request %llu does not match its reservation",
             (unsigned long long)r->request_id);
    tw_send_tokens(d, s->id, NULL, 0, true, TWAIN__V1__FINISH_REASON__FINISH_ERROR,
                   TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    tw_dseq_release(d, idx);
    return;
  }
  /* Staged pools: pieces may still be in the bounce ring or on their way to
   * the device; the sequence waits in COMMITTING, polled without blocking.
   * Verification reads the pool, so it waits for them (a debugging aid); so
   * do the other TP ranks (rank 0 waits for their answer; the prefill
   * worker's flush means only the copies out of their rings remain). */
  bool verify = d->p->verify_kv && (r->n_layer_checksums || r->n_head_checksums);
  int32_t firsts[TW_MAX_LAYERS];
  tw_kv_layer_firsts(c, s->n_prompt, l->block_size, firsts);
  tw_kv_rxring_stats_t rs;
  /* kv_in_place: the prefill worker copied into the device pool itself */
  bool staged = s->rank == 0 && !r->kv_in_place && tw_kv_region_staging_stats(d->region, &rs);
  tw_status_t cst = staged ? tw_kv_region_landed(d->region, s->id, s->blocks, nb, firsts) : TW_OK;
  if (cst == TW_INPROGRESS && verify)
    cst = tw_kv_region_commit(d->region, s->id, s->blocks, nb, firsts, TW_DSEQ_COMMIT_MS);
  bool landed = cst == TW_OK;
  if (cst == TW_INPROGRESS) cst = TW_OK;
  if (cst == TW_OK && staged && d->n_dp == 1)
    cst = tw_decode_ranks_commit(&d->rk, s->id, s->n_prompt, s->blocks, nb);
  if (cst == TW_OK && tw_test_kv_device_error())
    cst = tw_err(TW_ERR_CUDA, "simulated device error (the TWAIN_TEST_KV_DEVICE_ERROR hook)");
  if (cst != TW_OK || (verify && !tw_decoder_verify(d, s, r, msg, sizeof msg))) {
    if (!msg[0]) snprintf(msg, sizeof msg, "%s", tw_last_error());
    TW_ERROR("decode", "request %llu: %s", (unsigned long long)s->id, msg);
    tw_send_tokens(d, s->id, NULL, 0, true, TWAIN__V1__FINISH_REASON__FINISH_ERROR,
                   tw_decoder_kv_failed(d, cst), msg);
    if (staged && !landed) { /* pieces may still land in its blocks */
      s->state = TW_DSEQ_QUARANTINE;
      s->t_ns = tw_msg_clock_ns();
    } else {
      tw_dseq_release(d, idx);
    }
    return;
  }
  double bytes = 0; /* what the prefill worker put: sliding layers only their window */
  for (int32_t layer = 0; layer < c->n_layers; layer++)
    bytes += (double)(nb - tw_kv_layer_first_block(s->n_prompt, l->block_size,
                                                   c->layer_types[layer] == TW_LAYER_SLIDING,
                                                   c->sliding_window)) * (double)l->block_bytes;
  /* TP: every rank's pool got its part; dp: the one replica got it all */
  tw_metric_add(d->m.kv_bytes, bytes * (d->n_dp > 1 ? 1 : tw_dist_size(d->wk.dist)));
  tw_metric_add(d->m.dp_seqs[s->rank], 1);
  s->state = landed ? TW_DSEQ_RUNNING : TW_DSEQ_COMMITTING;
  s->t_commit_ns = tw_msg_clock_ns();
  s->pos = s->n_prompt;
  s->token = r->first_token;
  s->generated = 1;
  s->max_tokens = r->max_tokens;
  s->sample = tw_proto_sample_params(r->sampling);
  s->n_stop = 0;
  for (size_t i = 0; i < r->n_stop_token_ids && s->n_stop < TW_DSEQ_MAX_STOP; i++)
    s->stop[s->n_stop++] = r->stop_token_ids[i];
  s->t_ns = tw_msg_clock_ns();
  /* the first token came from prefill and was already streamed */
  if (tw_dseq_stops(s, s->token) || s->generated >= s->max_tokens) {
    int reason = tw_dseq_stops(s, s->token) ? TWAIN__V1__FINISH_REASON__FINISH_STOP
                                            : TWAIN__V1__FINISH_REASON__FINISH_LENGTH;
    tw_send_tokens(d, s->id, NULL, 0, true, reason, 0, NULL);
    if (!landed) { /* its last pieces land soon (the prefill worker flushed): not into reused blocks */
      s->state = TW_DSEQ_COMMITTING;
      s->max_tokens = 0; /* released, not run, once landed (tw_decoder_commits) */
    } else {
      tw_dseq_release(d, idx);
    }
  }
}

/* The router forgot this worker (it expired it during a stall, or restarted):
 * it will never send the handoffs or read the tokens of what it reserved or
 * started here, so free it all now instead of when reservations time out and
 * sequences reach max_tokens (a drain would wait for them). Reservations go
 * to quarantine: a prefill worker may still be writing into them. */
static void tw_decoder_forget_all(tw_decoder_t *d) {
  int32_t n = 0;
  int64_t now = tw_msg_clock_ns();
  for (int32_t i = d->n_seqs - 1; i >= 0; i--) {
    tw_dseq_t *s = d->seqs[i];
    if (s->state == TW_DSEQ_RESERVED) {
      s->state = TW_DSEQ_QUARANTINE;
      s->t_ns = now;
      n++;
    } else if (s->state == TW_DSEQ_RUNNING) {
      tw_dseq_release(d, i);
      n++;
    }
  }
  if (n) TW_WARN("decode", "the router forgot this worker: dropped %d reservations and sequences", n);
}

/* Sequences whose staged kv is all on the device join the decode batches
 * (those already finished by their first token are released); one that
 * does not land in time fails, its blocks quarantined. */
static void tw_decoder_commits(tw_decoder_t *d) {
  const tw_model_config_t *c = &d->model->config;
  int32_t block_size = tw_engine_kv_layout(d->engine)->block_size;
  int64_t now = tw_msg_clock_ns();
  for (int32_t i = d->n_seqs - 1; i >= 0; i--) {
    tw_dseq_t *s = d->seqs[i];
    if (s->state != TW_DSEQ_COMMITTING) continue;
    int32_t firsts[TW_MAX_LAYERS];
    tw_kv_layer_firsts(c, s->n_prompt, block_size, firsts);
    tw_status_t st = tw_kv_region_landed(d->region, s->id, s->blocks,
                                         tw_kv_blocks_needed(d->bm[0], s->n_prompt), firsts);
    if (st == TW_OK) {
      if (s->max_tokens == 0)
        tw_dseq_release(d, i); /* finished by its first token */
      else
        s->state = TW_DSEQ_RUNNING;
      continue;
    }
    if (st == TW_INPROGRESS && now - s->t_commit_ns <= (int64_t)TW_DSEQ_COMMIT_MS * 1000000)
      continue;
    char msg[256];
    snprintf(
        msg, sizeof msg, "request %llu: %s", (unsigned long long)s->id,
        st == TW_INPROGRESS ? "its kv did not all reach the device within 30 s" : tw_last_error());
    TW_ERROR("decode", "%s", msg);
    if (s->max_tokens > 0)
      tw_send_tokens(d, s->id, NULL, 0, true, TWAIN__V1__FINISH_REASON__FINISH_ERROR,
                     tw_decoder_kv_failed(d, st == TW_INPROGRESS ? TW_ERR_INTERNAL : st), msg);
    s->state = TW_DSEQ_QUARANTINE; /* pieces may still land there */
    s->t_ns = now;
  }
}

/* unused: no prefill worker was ever asked to fill the reservation
 * (Cancel.unused), so it is freed at once rather than quarantined. */
static void tw_on_cancel(tw_decoder_t *d, uint64_t id, bool unused) {
  int32_t idx = tw_dseq_find(d, id);
  if (idx < 0 || d->seqs[idx]->state == TW_DSEQ_QUARANTINE) return; /* already finished */
  tw_dseq_t *s = d->seqs[idx];
  if (s->state == TW_DSEQ_RESERVED && unused) {
    TW_DEBUG("decode", "request %llu cancelled before any prefill: freeing %d blocks",
             (unsigned long long)id, s->n_blocks);
    tw_dseq_release(d, idx);
    return;
  }
  if (s->state == TW_DSEQ_RESERVED || s->state == TW_DSEQ_COMMITTING) {
    TW_DEBUG("decode", "request %llu cancelled before its kv was in place: %d blocks quarantined",
             (unsigned long long)id, s->n_blocks);
    s->state = TW_DSEQ_QUARANTINE;
    s->t_ns = tw_msg_clock_ns();
    return;
  }
  TW_DEBUG("decode", "request %llu cancelled: freeing %d blocks", (unsigned long long)id, s->n_blocks);
  tw_dseq_release(d, idx);
}

/* Put running sequence s into its rank's batch (slot s->rank * max_batch + k). */
static void tw_decoder_batch_add(tw_decoder_t *d, tw_dseq_t *s, int32_t *cnt) {
  int32_t j = s->rank * d->max_batch + cnt[s->rank]++;
  d->batch[j] = s;
  d->tok[j] = s->token;
  d->pos[j] = s->pos;
  d->tables[j] = s->blocks;
  d->nb[j] = s->n_blocks;
  d->samp[j] = s->sample;
}

/* One continuous-batching step over every running sequence: with --dp one
 * batch per rank (its own sequences, at most max_batch each) in slots
 * [r * max_batch, + max_batch) of the step scratch. A rank with more
 * running sequences than max_batch takes them in turns: its batch starts
 * after the last sequence it ran (its own step_start, so that another
 * rank's batch cannot make it start at the same sequence again). */
/* While the GPU computes a step: progress UCX, so that prefill workers' KV
 * puts into this worker's pool (emulated over active messages on the staged
 * path: they move only while we progress) and their flushes land at transfer
 * speed instead of one progress call per decode step (measured on the H200
 * with gpt-oss-20b shapes: 357 ms per 28 MB handoff, 2.6 requests/s, while
 * the step was 10 ms). */
static void tw_decoder_kv_progress(void *xfer) { tw_kv_xfer_progress((tw_kv_xfer_t *)xfer); }

static TW_NODISCARD tw_status_t tw_decoder_step(tw_decoder_t *d) {
  const int32_t B = d->max_batch, R = d->n_dp;
  int32_t cnt[TW_DECODE_MAX_DP] = {0}, running[TW_DECODE_MAX_DP] = {0}, n = 0;
  bool over = false;
  for (int32_t i = 0; i < d->n_seqs; i++)
    if (d->seqs[i]->state == TW_DSEQ_RUNNING) running[d->seqs[i]->rank]++;
  for (int32_t i = 0; i < d->n_seqs; i++) { /* ranks with room for all of theirs */
    tw_dseq_t *s = d->seqs[i];
    if (s->state != TW_DSEQ_RUNNING) continue;
    n++;
    if (running[s->rank] <= B) tw_decoder_batch_add(d, s, cnt);
    else over = true;
  }
  for (int32_t r = 0; r < R && over; r++) { /* the others: B of theirs, in turns */
    if (running[r] <= B) continue;
    int32_t start = d->step_start[r] % d->n_seqs;
    for (int32_t k = 0; k < d->n_seqs && cnt[r] < B; k++) {
      int32_t i = (start + k) % d->n_seqs;
      tw_dseq_t *s = d->seqs[i];
      if (s->state != TW_DSEQ_RUNNING || s->rank != r) continue;
      tw_decoder_batch_add(d, s, cnt);
      d->step_start[r] = i + 1;
    }
  }
  if (n == 0) {
    d->last_step_end_ns = 0;
    return TW_OK;
  }
  int64_t t0 = tw_msg_clock_ns();
  /* host time between two steps of a running batch: the previous step's
   * tokens sent, messages handled, sequences admitted */
  if (d->last_step_end_ns) tw_metric_add(d->m.gap_s, (double)(t0 - d->last_step_end_ns) * 1e-9);
  tw_dist_dp_batch_t bt[TW_DECODE_MAX_DP];
  for (int32_t r = 0; r < R; r++)
    bt[r] = (tw_dist_dp_batch_t){
        .args = {.n_seqs = cnt[r], .tokens = d->tok + r * B, .positions = d->pos + r * B,
                 .block_tables = d->tables + r * B, .n_blocks = d->nb + r * B,
                 .sample = d->samp + r * B, .next_tokens_out = d->out + r * B,
                 .while_running = tw_decoder_kv_progress, .while_running_arg = d->xfer},
        .pad_block = d->pad[r]};
  /* plan to the other ranks; dp: every rank its batch, empty ones a padding row */
  tw_status_t st = R > 1 ? tw_dist_engine_decode_dp(d->wk.dist, d->engine, bt)
                         : tw_dist_engine_decode(d->wk.dist, d->engine, &bt[0].args);
  if (st == TW_OK && tw_test_device_error())
    st = tw_err(TW_ERR_CUDA, "simulated device error (the TWAIN_TEST_DEVICE_ERROR hook)");
  tw_test_step_delay();
  int64_t t1 = tw_msg_clock_ns();
  d->last_step_end_ns = t1;
  tw_metric_add(d->m.steps, 1);
  tw_metric_observe(d->m.step_s, (double)(t1 - t0) * 1e-9);
  tw_worker_stats_add(&d->stats, 0, 1);
  if (st == TW_ERR_CUDA || st == TW_ERR_NCCL) d->device_failed = true; /* sticky: it exits */
  for (int32_t r = 0; r < R; r++)
    for (int32_t j = r * B; j < r * B + cnt[r]; j++) {
      tw_dseq_t *s = d->batch[j];
      if (st != TW_OK) {
        tw_send_tokens(d, s->id, NULL, 0, true, TWAIN__V1__FINISH_REASON__FINISH_ERROR,
                       tw_status_wire_code(st < 0 ? st : TW_ERR_INTERNAL), tw_last_error());
        tw_dseq_release(d, tw_dseq_find(d, s->id));
        continue;
      }
      tw_metric_observe(d->m.tpot, (double)(t1 - t0) * 1e-9);
      tw_metric_add(d->m.tokens, 1);
      tw_worker_stats_add(&d->stats, 1, 0);
      if (R > 1) tw_metric_add(d->m.dp_tokens[r], 1);
      s->token = d->out[j];
      s->pos++;
      s->generated++;
      bool stop = tw_dseq_stops(s, s->token);
      bool len = s->generated >= s->max_tokens;
      tw_send_tokens(d, s->id, &s->token, 1, stop || len,
                     stop ? TWAIN__V1__FINISH_REASON__FINISH_STOP
                          : len ? TWAIN__V1__FINISH_REASON__FINISH_LENGTH : 0,
                     0, NULL);
      if (stop || len) tw_dseq_release(d, tw_dseq_find(d, s->id));
    }
  return st;
}

/* What a prefill worker needs of this worker's pools, sent once in
 * Register: rank 0's UCX address, rkey and layout; with TP (or --dp) every
 * rank's in `ranks` (a Reserved then names a --dp replica by number). */
static void tw_decoder_pools(tw_decoder_t *d) {
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(d->region, &rl);
  tw_proto_kv_layout_from_remote(&rl, 0, &d->pools_layout);
  Twain__Internal__V1__KvHandoff *h = &d->pools;
  twain__internal__v1__kv_handoff__init(h);
  size_t alen, rlen;
  h->ucx_address.data = (uint8_t *)tw_kv_xfer_address(d->xfer, &alen);
  h->ucx_address.len = alen;
  h->rkey.data = (uint8_t *)tw_kv_region_rkey(d->region, &rlen);
  h->rkey.len = rlen;
  h->layout = &d->pools_layout;
  h->decode_worker = d->wk.link.name;
  tw_decode_ranks_fill_handoff(&d->rk, h); /* every rank's pool when TP/EP > 1 or --dp */
}

static TW_NODISCARD tw_status_t tw_decoder_init(tw_decoder_t *d) {
  const tw_decode_params_t *p = d->p;
  TW_CHECK(tw_model_load(p->model_dir, &d->model));
  TW_CHECK(tw_model_check_finite(d->model));
  /* the rank group (issue 6): MPI for the cpu backend, NCCL for cuda */
  TW_CHECK(tw_worker_dist_create(&d->wk, p->backend));
  tw_engine_params_t ep = TW_ENGINE_PARAMS_DEFAULT;
  ep.tp_size = p->tp;
  ep.tp_rank = p->tp > 1 ? d->wk.id.rank : 0;
  ep.ep_size = p->ep;
  ep.ep_rank = p->ep > 1 ? d->wk.id.rank : 0;
  ep.dp_attention = p->dp > 1;
  ep.coll = tw_dist_coll(d->wk.dist);
  if (tw_backend_caps(p->backend).on_device) ep.device = d->wk.id.local_rank;
  ep.backend = p->backend;
  ep.kv_block_size = p->block_size;
  ep.kv_num_blocks = p->kv_blocks; /* 0: planned (mem_plan.h) */
  /* dp: an idle rank pads its step with the pool's last block, which is no
   * ring block: no window ring there */
  ep.kv_window_ring = p->dp > 1 ? -1 : p->kv_window_ring;
  ep.prefill_bf16_experts = p->prefill_bf16_experts;
  ep.kv_dtype = p->kv_dtype;
  ep.max_batch = p->max_batch;     /* 0: planned */
  ep.max_prefill_chunk = 0;        /* planned: decode workers do not prefill */
  ep.mem_role = TW_MEM_ROLE_DECODE;
  ep.mem_prefill_workers = p->colocated_prefill;
  ep.mem_decode_workers = p->colocated_decode;
  ep.mem_utilization = p->gpu_memory_utilization;
  ep.weights_share_dir = p->share_weights_dir;
  ep.n_threads = p->threads;
  TW_CHECK(tw_engine_create(d->model, &ep, &d->engine));
  d->max_batch = tw_engine_params(d->engine)->max_batch;
  /* ready means ready: weights uploaded and the kv pool allocated (above),
   * decode graphs captured (here), all before registering with the router */
  if (tw_engine_warmup(d->engine) != TW_OK)
    TW_WARN("decode", "warmup: %s (decode runs without graphs)", tw_last_error());
  const tw_kv_layout_t *l = tw_engine_kv_layout(d->engine);
  /* A host pool (the CPU backend) takes pieces through the bounce ring
   * rather than puts in place: a decode worker killed while puts into its
   * pool were in flight over shared memory could leave the prefill worker's
   * UCX unable to move anything afterwards (1 run in 8 to 20 of the kill
   * test, docs/operations.md), where the ring, which takes nothing before
   * it granted a slot, never showed it. Not with --dp (a replica's ring is
   * not waited for: tw_decode_params_check); TWAIN_KV_PATH=host keeps the
   * puts in place. */
  const char *kv_path = getenv("TWAIN_KV_PATH");
  const tw_kv_region_params_t rp = {.staging_ring = !l->on_device && p->dp <= 1 &&
                                                    !(kv_path && strcmp(kv_path, "host") == 0)};
  /* UCX's shared-memory FIFO transports only for a host pool that takes
   * puts in place (UCX 1.13 emulates puts over TCP): a prefill worker
   * killed while writing into this worker's FIFO would block it for good
   * (docs/operations.md, "Staged receive") */
  TW_CHECK(tw_kv_xfer_create_bound(p->router, !l->on_device && !rp.staging_ring, &d->xfer));
  TW_CHECK(tw_kv_region_register_ex(d->xfer, l, &rp, &d->region));
  TW_CHECK(tw_decode_ranks_init(&d->rk, d->wk.dist, d->engine, d->xfer, d->region, d->model));
  if (d->wk.id.rank != 0) return TW_OK; /* only rank 0 talks to the router and has block managers */
  d->n_dp = p->dp > 1 ? p->dp : 1;
  if (d->n_dp == 1) {
    TW_CHECK(tw_kv_blocks_create_ring(l->n_blocks, l->block_size, l->n_ring_blocks, l->ring_blocks,
                                      &d->bm[0]));
    d->pad[0] = -1;
  }
  for (int32_t r = 0; r < d->n_dp && d->n_dp > 1; r++) { /* the last block pads an empty step */
    int32_t n = d->rk.ranks[r]->layout->n_blocks;
    if (n < 2)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "decode: dp rank %d has %d kv blocks (need 2)", r,
                    n);
    TW_CHECK(tw_kv_blocks_create(n - 1, l->block_size, &d->bm[r]));
    d->pad[r] = n - 1;
  }
  /* step scratch: max_batch slots per dp rank (at most 65536 x 64: no overflow) */
  int32_t B = d->max_batch * d->n_dp;
  d->tok = malloc(sizeof(int32_t) * (size_t)B);
  d->pos = malloc(sizeof(int32_t) * (size_t)B);
  d->nb = malloc(sizeof(int32_t) * (size_t)B);
  d->out = malloc(sizeof(int32_t) * (size_t)B);
  d->tables = malloc(sizeof(int32_t *) * (size_t)B);
  d->samp = malloc(sizeof(tw_sample_params_t) * (size_t)B);
  d->batch = malloc(sizeof(tw_dseq_t *) * (size_t)B);
  if (!d->tok || !d->pos || !d->nb || !d->out || !d->tables || !d->samp || !d->batch)
    return tw_err(TW_ERR_NO_MEMORY, "decode: cannot allocate step scratch for %d sequences", B);
  TW_CHECK(tw_worker_metrics_open(&d->wk, p->name, p->metrics_port, p->metrics_addr,
                                  p->served_model_name, p->model_dir));
  tw_metrics_t *M = d->wk.metrics;
  d->m.running = tw_metrics_gauge(M, "decode_running_sequences", "sequences in the decode batch");
  d->m.reserved = tw_metrics_gauge(M, "decode_queue_depth", "reservations waiting for their kv");
  d->m.blocks_used = tw_metrics_gauge(M, "kv_blocks_used", "kv blocks reserved or in use");
  d->m.blocks_free = tw_metrics_gauge(M, "kv_blocks_free", "free kv blocks");
  d->m.quarantined = tw_metrics_gauge(
      M, "kv_blocks_quarantined",
      "kv blocks (of kv_blocks_used) held for reservations cancelled or expired before their kv "
      "arrived, in case a late write lands; free again 40 s later");
  d->m.tpot = tw_metrics_histogram(M, "decode_tpot_seconds", "time per output token (one step)",
                                   tw_metrics_latency_buckets, tw_metrics_latency_n);
  d->m.tokens = tw_metrics_counter(M, "decode_tokens_total", "tokens generated");
  d->m.steps = tw_metrics_counter(M, "decode_steps_total", "decode steps run");
  d->m.step_s = tw_metrics_histogram(M, "decode_step_seconds",
                                     "one decode step of the whole batch (device work and its sync)",
                                     tw_metrics_latency_buckets, tw_metrics_latency_n);
  d->m.gap_s = tw_metrics_counter(
      M, "decode_step_gap_seconds_total",
      "host time between consecutive steps of a running batch (tokens sent, messages handled)");
  d->m.kv_usage = tw_metrics_gauge(M, "kv_cache_usage_perc",
                                   "KV cache blocks in use, a fraction in [0, 1] (vLLM's name)");
  d->stats.interval_s = p->log_stats_interval_s;
  d->m.kv_bytes = tw_metrics_counter(M, "kv_bytes_received_total", "kv bytes handed in");
  d->m.sum_ok = tw_metrics_counter(M, "kv_checksum_ok_total", "layers whose kv checksum matched");
  d->m.sum_bad = tw_metrics_counter(M, "kv_checksum_mismatch_total", "layers whose kv checksum differed");
  d->m.rejected = tw_metrics_counter(M, "decode_reservations_refused_total", "reservations refused");
  tw_kv_rxring_stats_t rs;
  if (tw_kv_region_staging_stats(d->region, &rs)) { /* the staged receive ring */
    d->m.stg_bytes = tw_metrics_counter(M, "kv_staging_bytes_total",
                                        "kv bytes copied from the bounce ring to the device pool");
    d->m.stg_waits =
        tw_metrics_counter(M, "kv_staging_full_waits_total",
                           "kv pieces that found every bounce slot in use (back-pressure)");
    d->m.stg_failed = tw_metrics_counter(M, "kv_staging_pieces_failed_total",
                                         "kv pieces whose receive or copy to the device failed");
    d->m.stg_busy = tw_metrics_counter(M, "kv_staging_busy_seconds_total",
                                       "seconds with at least one bounce slot in use");
    d->m.stg_slots = tw_metrics_gauge(M, "kv_staging_slots_in_use", "bounce slots in use");
  }
  for (int32_t r = 0; r < d->n_dp && d->n_dp > 1; r++) {
    char mn[96];
    snprintf(mn, sizeof mn, "decode_dp_rank%d_sequences_total", r);
    d->m.dp_seqs[r] = tw_metrics_counter(M, mn, "sequences whose kv this dp rank received");
    snprintf(mn, sizeof mn, "decode_dp_rank%d_tokens_total", r);
    d->m.dp_tokens[r] = tw_metrics_counter(M, mn, "tokens this dp rank generated");
    snprintf(mn, sizeof mn, "decode_dp_rank%d_kv_blocks_used", r);
    d->m.dp_used[r] =
        tw_metrics_gauge(M, mn, "kv blocks reserved or in use in this dp rank's pool");
  }
  TW_CHECK(tw_worker_connect(&d->wk, p->router, TWAIN__INTERNAL__V1__POOL__POOL_DECODE,
                             l->block_size, l->n_layers, d->model->config.vocab_size,
                             tw_backend_name(tw_engine_backend(d->engine))));
  /* the addresses handoffs will name: the router forwards no others */
  size_t alen = 0;
  d->kv_addr[0].data = (uint8_t *)tw_kv_xfer_address(d->xfer, &alen);
  d->kv_addr[0].len = alen;
  size_t n_addr = 1;
  for (int32_t k = 1; k < d->rk.n_ranks && n_addr < sizeof d->kv_addr / sizeof d->kv_addr[0]; k++)
    d->kv_addr[n_addr++] = d->rk.ranks[k]->ucx_address;
  d->wk.link.kv_addresses = d->kv_addr;
  d->wk.link.n_kv_addresses = n_addr;
  tw_decoder_pools(d);
  d->wk.link.kv_pools = &d->pools;
  TW_INFO("decode", "%s: %s backend, %d kv blocks of %d tokens, max batch %d, router %s",
          d->wk.name, d->wk.link.backend, l->n_blocks, l->block_size, d->max_batch, p->router);
  if (d->n_dp > 1)
    TW_INFO("decode",
            "%s: data-parallel attention over %d ranks, %d kv blocks each (%d in all), "
            "experts split over the %d ranks",
            d->wk.name, d->n_dp, tw_kv_blocks_total(d->bm[0]), tw_decoder_blocks(d, 2), d->n_dp);
  return TW_OK;
}

static void tw_decoder_fini(tw_decoder_t *d) {
  while (d->n_seqs) tw_dseq_release(d, d->n_seqs - 1);
  free(d->seqs);
  if (d->wk.link.sock) tw_worker_link_close(&d->wk.link);
  tw_metrics_destroy(d->wk.metrics);
  tw_decode_ranks_fini(&d->rk);
  tw_kv_region_unregister(d->region);
  tw_kv_xfer_destroy(d->xfer);
  for (int32_t r = 0; r < TW_DECODE_MAX_DP; r++) tw_kv_blocks_destroy(d->bm[r]);
  tw_engine_destroy(d->engine);
  tw_dist_destroy(d->wk.dist);
  tw_model_destroy(d->model);
  free(d->tok);
  free(d->pos);
  free(d->nb);
  free(d->out);
  free(d->tables);
  free(d->samp);
  free(d->batch);
}

/* The skeleton's hooks (worker_daemon.h). */
static TW_NODISCARD tw_status_t tw_decode_op_init(void *arg) { return tw_decoder_init(arg); }
static void tw_decode_op_fini(void *arg) { tw_decoder_fini(arg); }
static TW_NODISCARD tw_status_t tw_decode_op_follow(void *arg) {
  return tw_decode_ranks_follow(&((tw_decoder_t *)arg)->rk);
}

/* Sequences a drain waits for: quarantined reservations are none. */
static int32_t tw_decode_op_pending(void *arg) {
  tw_decoder_t *d = arg;
  int32_t n_live = 0;
  for (int32_t i = 0; i < d->n_seqs; i++) n_live += d->seqs[i]->state != TW_DSEQ_QUARANTINE;
  return n_live;
}

static void tw_decode_op_drain(void *arg) {
  tw_decoder_t *d = arg;
  int32_t n_live = tw_decode_op_pending(d), n_quarantined = d->n_seqs - n_live;
  for (int32_t i = d->n_seqs - 1; i >= 0; i--) /* nobody will write them any more */
    if (d->seqs[i]->state == TW_DSEQ_QUARANTINE) tw_dseq_release(d, i);
  TW_INFO("decode", "draining: %d sequences to finish (%d quarantined reservations released)",
          n_live, n_quarantined);
}

/* UCX wire-up, emulated puts and flushes from prefill workers need our
 * progress: an idle worker sleeps on the router socket and the UCX event fd
 * together (heartbeats have their own thread). */
static int tw_decode_op_wait_ms(void *arg, int *fd_p) {
  tw_decoder_t *d = arg;
  bool busy = false, reserved = false;
  for (int32_t i = 0; i < d->n_seqs; i++) {
    if (d->seqs[i]->state == TW_DSEQ_QUARANTINE) continue;
    busy |= d->seqs[i]->state == TW_DSEQ_RUNNING || d->seqs[i]->state == TW_DSEQ_COMMITTING;
    reserved |= d->seqs[i]->state == TW_DSEQ_RESERVED;
  }
  d->idle = !busy;
  tw_kv_xfer_progress(d->xfer);
  if (busy) return 0;
  *fd_p = tw_kv_xfer_wait_fd(d->xfer);
  if (*fd_p < 0 && reserved) return 0; /* no fd to wake us for the KV: poll it */
  return reserved ? 20 : 200;
}

static void tw_decode_op_after_wait(void *arg) {
  tw_decoder_t *d = arg;
  if (d->idle) tw_kv_xfer_progress(d->xfer);
}

static bool tw_decode_op_msg(void *arg, Twain__Internal__V1__Envelope *env) {
  tw_decoder_t *d = arg;
  switch (env->body_case) {
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVE: tw_on_reserve(d, env->reserve); break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_DECODE: tw_on_decode(d, env->decode); break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_CANCEL:
      tw_on_cancel(d, env->cancel->request_id, env->cancel->unused);
      break;
    default: return false;
  }
  twain__internal__v1__envelope__free_unpacked(env, NULL);
  return true;
}

/* Reservations whose handoff never came, staged copies done, one step. */
static TW_NODISCARD tw_status_t tw_decode_op_work(void *arg) {
  tw_decoder_t *d = arg;
  int64_t now = tw_msg_clock_ns();
  for (int32_t i = d->n_seqs - 1; i >= 0; i--) { /* the router lost these reservations */
    tw_dseq_t *s = d->seqs[i];
    if (s->state == TW_DSEQ_RESERVED &&
        now - s->t_ns > (int64_t)d->p->reserve_timeout_ms * 1000000) {
      TW_WARN("decode", "request %llu: reservation expired: %d blocks quarantined",
              (unsigned long long)s->id, s->n_blocks);
      s->state = TW_DSEQ_QUARANTINE; /* a late prefill may still write there */
      s->t_ns = now;
    } else if (s->state == TW_DSEQ_QUARANTINE &&
               (now - s->t_ns > (int64_t)TW_DSEQ_QUARANTINE_MS * 1000000 || d->wk.draining)) {
      tw_dseq_release(d, i);
    }
  }
  tw_decoder_commits(d);
  if (d->device_failed) return TW_ERR_CUDA; /* a kv commit met one (tw_decoder_kv_failed) */
  /* a failed step has failed its sequences (each told why); a device
   * error is sticky (STYLE.md "Errors"): stop taking work and exit */
  tw_status_t ss = tw_decoder_step(d);
  if (ss == TW_ERR_CUDA || ss == TW_ERR_NCCL) {
    TW_ERROR("decode", "device error in a decode step, stopping: %s", tw_last_error());
    return ss;
  }
  return TW_OK;
}

static void tw_decode_op_capacity(void *arg, Twain__Internal__V1__Capacity *cap) {
  tw_decoder_capacity(arg, cap);
}

static void tw_decode_op_forgotten(void *arg) { tw_decoder_forget_all(arg); }

static void tw_decode_op_stop(void *arg) {
  TW_INFO("decode", "stopped: %d kv blocks in use", tw_decoder_blocks(arg, 1));
}

static const tw_worker_ops_t tw_decode_ops = {.init = tw_decode_op_init,
                                              .fini = tw_decode_op_fini,
                                              .follow = tw_decode_op_follow,
                                              .on_drain = tw_decode_op_drain,
                                              .wait_ms = tw_decode_op_wait_ms,
                                              .after_wait = tw_decode_op_after_wait,
                                              .on_msg = tw_decode_op_msg,
                                              .pending = tw_decode_op_pending,
                                              .work = tw_decode_op_work,
                                              .capacity = tw_decode_op_capacity,
                                              .on_forgotten = tw_decode_op_forgotten,
                                              .on_stop = tw_decode_op_stop};

/* The options a worker cannot start with (before any rank starts). */
static TW_NODISCARD tw_status_t tw_decode_params_check(const tw_decode_params_t *p) {
  if (p->tp < 1 || p->ep < 1 || (p->tp > 1 && p->ep > 1 && p->tp != p->ep))
    return tw_err(TW_ERR_INVALID_ARGUMENT, "decode: --tp %d --ep %d: each >= 1, equal when both > 1",
                  p->tp, p->ep);
  if (p->max_batch < 0 || p->max_batch > TW_DECODE_MAX_BATCH)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "decode: --max-batch %d: 1 to %d sequences per step%s (0: planned)",
                  p->max_batch, TW_DECODE_MAX_BATCH, p->dp > 1 ? " and dp rank" : "");
  if (p->dp < 1 || p->dp > TW_DECODE_MAX_DP || (p->dp > 1 && (p->tp != 1 || p->ep != p->dp)))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "decode: --dp %d --tp %d --ep %d: data-parallel attention needs --dp N --ep N "
                  "--tp 1 with 2 <= N <= %d (N ranks, each an attention replica with every kv "
                  "head, the experts split over all N)",
                  p->dp, p->tp, p->ep, TW_DECODE_MAX_DP);
  if (p->dp > 1 && !tw_backend_caps(p->backend).dp_attention)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "decode: --dp %d (data-parallel attention) runs on the cpu backend only; the "
                  "%s engine does not implement it: use --backend cpu, or --tp/--ep on a GPU",
                  p->dp, tw_backend_name(tw_backend_resolve(p->backend)));
  /* a dp replica's sequence is admitted when rank 0's own region says its
   * kv landed; a staged ring on the replica would still be copying it */
  const char *kv_path = getenv("TWAIN_KV_PATH");
  if (p->dp > 1 && kv_path && strcmp(kv_path, "staged") == 0)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "decode: --dp %d with TWAIN_KV_PATH=staged: a replica's sequences could start "
                  "before their staged kv is copied into its pool; unset TWAIN_KV_PATH (the "
                  "cpu backend's pools take the handoff in place)",
                  p->dp);
  return TW_OK;
}

int tw_decode_worker_main(const tw_decode_params_t *p) {
  tw_status_t st = tw_decode_params_check(p);
  if (st != TW_OK) {
    TW_ERROR("decode", "cannot start: %s: %s", tw_status_str(st), tw_last_error());
    return tw_worker_exit_code(st); /* 78: a configuration error, `twain serve` stops */
  }
  static tw_decoder_t d; /* one per process */
  memset(&d, 0, sizeof d);
  d.p = p;
  d.wk = (tw_worker_t){.prog = "twain-decode",
                       .role = "decode",
                       .unit = "sequences",
                       .router = p->router,
                       .ranks = p->tp > p->ep ? p->tp : p->ep,
                       .use_mpi = p->backend != TW_BACKEND_CUDA,
                       .argc = p->argc,
                       .argv = p->argv,
                       .drain_timeout_s = p->drain_timeout_s,
                       .ops = &tw_decode_ops,
                       .arg = &d};
  return tw_worker_main(&d.wk);
}
