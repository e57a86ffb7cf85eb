/* router_workers.c: the worker registry (register, heartbeat, expiry), the
 * scheduling policy and the worker side of the request flow:
 *   queued --Reserve--> decode worker --Reserved(handoff)--> router
 *          --PrefillRequest(handoff)--> prefill worker --PrefillDone(first
 *          token, after the KV is remotely complete)--> router
 *          --DecodeRequest--> decode worker --Tokens...--> router --> client.
 * A request whose worker dies is retried elsewhere (up to 3 attempts): from
 * the start if no token reached the client yet, else resumed from the tokens
 * it has (its prompt and those tokens prefilled again, the rest decoded:
 * tw_req_context, router_impl.h); after that the client gets UNAVAILABLE. A
 * worker that was only stalled (expired, then the same process registers
 * again: Register.instance) gives its requests their attempts back: a pause
 * costs latency, not requests.
 * Backpressure: a queued request leaves the queue only when a prefill worker
 * has room in its window and a decode worker has the blocks, in arrival
 * order: a request that cannot start holds back the ones behind it, so
 * nothing waits in a worker's queue long enough to go stale and none
 * starves. A prefill worker's window is the prompt tokens it prefills in
 * TW_ROUTER_PREFILL_QUEUE_S at its measured speed (at most
 * prefill_window_tokens; TW_ROUTER_PREFILL_FIRST_WINDOW until one prompt
 * is measured). */
#include "router/router_impl.h"

#include "common/base/log.h"
#include "common/comm/msg_worker.h" /* tw_reject_msg */
#include "common/comm/proto_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_ROUTER_MAX_ATTEMPTS 3
/* Seconds of prefill work a prefill worker is given at a time: far below the
 * prefill worker's 20 s KV-write guard, enough to keep it busy (and to batch). */
#define TW_ROUTER_PREFILL_QUEUE_S 4.0
/* The window of a prefill worker whose speed is not measured yet (tokens). */
#define TW_ROUTER_PREFILL_FIRST_WINDOW 4096

tw_rworker_t *tw_router_worker(tw_router_t *r, uint64_t serial) {
  for (int32_t i = 0; i < r->n_workers; i++)
    if (r->workers[i].serial == serial) return &r->workers[i];
  return NULL;
}

static tw_rworker_t *tw_worker_by_id(tw_router_t *r, const uint8_t *id, size_t len) {
  for (int32_t i = 0; i < r->n_workers; i++)
    if (r->workers[i].id_len == len && memcmp(r->workers[i].id, id, len) == 0) return &r->workers[i];
  return NULL;
}

/* Whether the sender of `m` is the worker registered under routing id `id`:
 * that socket itself or its heartbeat socket (routing id "<id>/hb",
 * msg_worker.c). The routing id is bound to the authenticated connection
 * (CURVE), so another peer cannot speak for a worker by naming it. */
static bool tw_sender_is_worker(const tw_msg_t *m, const uint8_t *id, size_t id_len) {
  if (m->id_len != id_len && m->id_len != id_len + 3) return false;
  if (memcmp(m->id, id, id_len) != 0) return false;
  return m->id_len == id_len || memcmp(m->id + id_len, "/hb", 3) == 0;
}

/* The worker a heartbeat for `name` speaks for: one of that name that the
 * sender is (tw_sender_is_worker); NULL gets the same NOT_FOUND as a name
 * nobody has. */
static tw_rworker_t *tw_worker_of_heartbeat(tw_router_t *r, const tw_msg_t *m, const char *name) {
  for (int32_t i = 0; i < r->n_workers; i++) {
    tw_rworker_t *w = &r->workers[i];
    if (strcmp(w->name, name) == 0 && tw_sender_is_worker(m, w->id, w->id_len)) return w;
  }
  return NULL;
}

/* A heartbeat from a worker that expired less than TW_ROUTER_REVIVE_MS ago:
 * it is alive again (a stall ended) and registers as soon as its main loop
 * gets to it, which on a busy host can take seconds, so the grace of its
 * pool, if that is still empty, counts from now: the requests that wait for
 * that pool are not failed while their worker is on its way back. Bounded:
 * a worker that heartbeats but never registers stops extending it
 * TW_ROUTER_REVIVE_MS after its expiry. */
static void tw_note_revived(tw_router_t *r, const tw_msg_t *m, const char *name, int64_t now) {
  const int32_t n = (int32_t)(sizeof r->expired_recent / sizeof r->expired_recent[0]);
  int32_t best = -1; /* the newest entry of that worker */
  for (int32_t i = 0; i < n; i++) {
    const int64_t t = r->expired_recent[i].expired_ns;
    if (!t || now - t > (int64_t)TW_ROUTER_REVIVE_MS * 1000000 ||
        !tw_sender_is_worker(m, r->expired_recent[i].id, r->expired_recent[i].id_len) ||
        strcmp(r->expired_recent[i].name, name) != 0)
      continue;
    if (best < 0 || t > r->expired_recent[best].expired_ns) best = i;
  }
  if (best < 0) return;
  const int64_t t = r->expired_recent[best].expired_ns;
  const int k = r->expired_recent[best].pool;
  if (r->empty_by_expiry[k] && r->empty_since_ns[k] && r->empty_since_ns[k] < now) {
    if (now - r->empty_since_ns[k] > 500 * 1000000LL)
      TW_INFO("router",
              "worker %s heartbeats again (it expired %lld ms ago): waiting for it to register",
              name, (long long)((now - t) / 1000000));
    r->empty_since_ns[k] = now;
  }
}

int32_t tw_router_count_workers(const tw_router_t *r, Twain__Internal__V1__Pool pool) {
  int32_t n = 0;
  for (int32_t i = 0; i < r->n_workers; i++) n += r->workers[i].pool == pool && !r->workers[i].draining;
  return n;
}

TW_NODISCARD tw_status_t tw_router_send_worker(tw_router_t *r, tw_rworker_t *w,
                                               Twain__Internal__V1__Envelope *env) {
  tw_status_t st = tw_msg_send_to(r->wsock, w->id, w->id_len, false, &env->base);
  if (st == TW_OK) return st;
  int64_t now = tw_msg_clock_ns();
  /* a killed worker fails every send until it expires: take it out of the
   * schedule at once, so that the requests sent there wait for a worker
   * instead of spending their attempts on it within milliseconds */
  if (w->unreachable_until_ns <= now)
    TW_WARN("router", "cannot send to worker %s: %s; no new work goes there for %d ms", w->name,
            tw_last_error(), r->p->expire_ms);
  w->unreachable_until_ns = now + (int64_t)r->p->expire_ms * 1000000;
  return st;
}

bool tw_router_worker_open(const tw_rworker_t *w, int64_t now_ns) {
  return w->serial && !w->draining && now_ns >= w->unreachable_until_ns;
}

static void tw_reject_to(tw_router_t *r, const tw_msg_t *m, uint64_t rid, int code, const char *msg) {
  tw_reject_msg_t rm;
  tw_msg_note_failure(tw_msg_send(r->wsock, m, &tw_reject_msg(&rm, rid, code, msg)->base), "router",
                      "cannot send a reject to a worker");
}

static void tw_update_gauges(tw_router_t *r) {
  int32_t np = tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL);
  int32_t nd = tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_DECODE);
  int64_t now = tw_msg_clock_ns();
  for (int k = 0; k < 2; k++) {
    int32_t n = k ? nd : np;
    if (n) r->empty_since_ns[k] = 0, r->empty_by_expiry[k] = false;
    else if (!r->empty_since_ns[k]) r->empty_since_ns[k] = now;
  }
  tw_metric_set(r->m.prefill_workers, np);
  tw_metric_set(r->m.decode_workers, nd);
  tw_router_update_health(r);
  if (r->p->on_workers) r->p->on_workers(r->p->on_workers_arg, np, nd);
}

void tw_router_update_health(tw_router_t *r) {
  if (r->draining) return; /* "draining" stays */
  int32_t np = tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL);
  int32_t nd = tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_DECODE);
  if (np && nd) tw_metrics_set_health(r->metrics, true, NULL);
  else tw_metrics_set_health(r->metrics, false,
                             !np && !nd ? "not ready: no prefill and no decode worker registered"
                             : !np      ? "not ready: no prefill worker registered"
                                        : "not ready: no decode worker registered");
}

static void tw_apply_capacity(tw_rworker_t *w, const Twain__Internal__V1__Capacity *c) {
  if (!c) return;
  w->free_blocks = c->free_kv_blocks;
  w->total_blocks = c->total_kv_blocks;
  w->replica_free_blocks = c->replica_free_kv_blocks;
  w->replica_total_blocks = c->replica_total_kv_blocks;
  w->queued_tokens = c->queued_prompt_tokens;
  w->free_ring = c->free_ring_blocks;
  w->total_ring = c->total_ring_blocks;
  w->ring_len = c->ring_len;
}

void tw_rworker_free_addrs(tw_rworker_t *w) {
  for (int32_t i = 0; i < w->n_kv_addrs; i++) free(w->kv_addrs[i].data);
  free(w->kv_addrs);
  w->kv_addrs = NULL;
  w->n_kv_addrs = 0;
  if (w->kv_pools) twain__internal__v1__kv_handoff__free_unpacked(w->kv_pools, NULL);
  w->kv_pools = NULL;
}

static bool tw_handoff_vouched(const tw_rworker_t *w, const Twain__Internal__V1__KvHandoff *h);

/* Keep the UCX addresses a decode worker registered (at most 64 of 64 KiB),
 * and its pools. */
static void tw_keep_addrs(tw_rworker_t *w, const Twain__Internal__V1__Register *g) {
  tw_rworker_free_addrs(w);
  size_t n = g->n_kv_addresses < 64 ? g->n_kv_addresses : 64;
  if (!n || !(w->kv_addrs = calloc(n, sizeof *w->kv_addrs))) return;
  for (size_t i = 0; i < n; i++) {
    size_t len = g->kv_addresses[i].len;
    if (!len || len > 65536 || !(w->kv_addrs[w->n_kv_addrs].data = malloc(len))) continue;
    memcpy(w->kv_addrs[w->n_kv_addrs].data, g->kv_addresses[i].data, len);
    w->kv_addrs[w->n_kv_addrs++].len = len;
  }
  /* its pools: kept only when they name registered addresses (the prefill
   * worker connects to them), as a deep copy (pack, unpack) */
  if (!g->kv_pools || !tw_handoff_vouched(w, g->kv_pools)) {
    if (g->kv_pools)
      TW_WARN("router",
              "decode worker %s registered kv pools naming an unregistered UCX address: "
              "ignored",
              w->name);
    return;
  }
  size_t n_bytes = twain__internal__v1__kv_handoff__get_packed_size(g->kv_pools);
  uint8_t *buf = malloc(n_bytes ? n_bytes : 1);
  if (!buf) return; /* its reservations then fail clearly (no pools) */
  twain__internal__v1__kv_handoff__pack(g->kv_pools, buf);
  w->kv_pools = twain__internal__v1__kv_handoff__unpack(NULL, n_bytes, buf);
  free(buf);
}

/* A reservation's handoff as the prefill worker needs it: one that names no
 * UCX address (pools sent at registration) gets the registered pools, or
 * with --dp the one replica's (KvHandoff.replica), in *full (borrowing the
 * worker's copy). A worker that registered no pools has its handoff
 * forwarded as it is (the prefill worker refuses one without an address).
 * Returns NULL when it names a replica this worker never registered. */
static const Twain__Internal__V1__KvHandoff *tw_handoff_complete(
    const tw_rworker_t *w, const Twain__Internal__V1__KvHandoff *h,
    Twain__Internal__V1__KvHandoff *full) {
  if (!h || h->ucx_address.len) return h; /* the pools came with it (vouched separately) */
  const Twain__Internal__V1__KvHandoff *p = w->kv_pools;
  if (!p) return h;
  if (h->replica < 0 || (size_t)h->replica > p->n_ranks) return NULL;
  *full = *h;
  full->replica = 0;
  if (h->replica > 0) { /* --dp: that replica's pool holds every kv head */
    const Twain__Internal__V1__KvRank *k = p->ranks[h->replica - 1];
    full->ucx_address = k->ucx_address;
    full->rkey = k->rkey;
    full->layout = k->layout;
    full->n_ranks = 0;
    full->ranks = NULL;
  } else {
    full->ucx_address = p->ucx_address;
    full->rkey = p->rkey;
    full->layout = p->layout;
    full->n_ranks = p->n_ranks;
    full->ranks = p->ranks;
  }
  return full;
}

/* A handoff may name only UCX addresses its decode worker registered: the
 * prefill worker makes endpoints to them, and UCX aborts on some malformed
 * addresses (a poisoned handoff must never reach a prefill worker). */
static bool tw_handoff_vouched(const tw_rworker_t *w, const Twain__Internal__V1__KvHandoff *h) {
  if (!h) return true; /* nothing to connect to; the prefill worker refuses it */
  size_t n = 1 + h->n_ranks;
  for (size_t k = 0; k < n; k++) {
    const ProtobufCBinaryData *a = k == 0 ? &h->ucx_address
                                          : (h->ranks[k - 1] ? &h->ranks[k - 1]->ucx_address : NULL);
    if (!a || !a->len) continue;
    bool known = false;
    for (int32_t i = 0; i < w->n_kv_addrs && !known; i++)
      known = w->kv_addrs[i].len == a->len && !memcmp(w->kv_addrs[i].data, a->data, a->len);
    if (!known) return false;
  }
  return true;
}

/* Tell prefill worker(s) about decode pools ahead of traffic (KvPeers): to
 * `to` alone the pools of every registered decode worker (a prefill worker
 * that registered), or to every prefill worker the pools of `from` (a decode
 * worker that registered). Only pools kept by tw_keep_addrs go out (vouched:
 * they name the UCX addresses their decode worker registered). */
static void tw_send_kv_peers(tw_router_t *r, tw_rworker_t *to, const tw_rworker_t *from) {
  int32_t n = 0;
  Twain__Internal__V1__KvHandoff *copies = calloc((size_t)r->n_workers + 1, sizeof *copies);
  Twain__Internal__V1__KvHandoff **pools = calloc((size_t)r->n_workers + 1, sizeof *pools);
  if (!copies || !pools) { /* not fatal: the first handoff connects instead */
    TW_WARN("router", "out of memory for the kv pools sent ahead of traffic");
    free(copies);
    free(pools);
    return;
  }
  for (int32_t i = 0; i < r->n_workers; i++) {
    const tw_rworker_t *d = &r->workers[i];
    if (d->pool != TWAIN__INTERNAL__V1__POOL__POOL_DECODE || d->draining || !d->kv_pools ||
        (from && d != from))
      continue;
    copies[n] = *d->kv_pools; /* shallow: borrows the worker's copy for the send */
    copies[n].decode_worker = (char *)d->name;
    pools[n] = &copies[n];
    n++;
  }
  Twain__Internal__V1__KvPeers kp = TWAIN__INTERNAL__V1__KV_PEERS__INIT;
  kp.pools = pools;
  kp.n_pools = (size_t)n;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_KV_PEERS;
  env.kv_peers = &kp;
  for (int32_t i = 0; n > 0 && i < r->n_workers; i++) {
    tw_rworker_t *p = &r->workers[i];
    if (p->pool != TWAIN__INTERNAL__V1__POOL__POOL_PREFILL || p->draining || (to && p != to))
      continue;
    if (tw_router_send_worker(r, p, &env) == TW_OK) p->kv_peers_unacked++; /* failure logged */
  }
  free(copies);
  free(pools);
}

int32_t tw_router_kv_peers_pending(const tw_router_t *r) {
  int32_t n = 0;
  for (int32_t i = 0; i < r->n_workers; i++)
    n += r->workers[i].pool == TWAIN__INTERNAL__V1__POOL__POOL_PREFILL && !r->workers[i].draining &&
         r->workers[i].kv_peers_unacked > 0;
  return n;
}

static void tw_retry_held(tw_router_t *r, uint64_t serial, const char *why,
                          const tw_rworker_t *expired);

static void tw_on_register(tw_router_t *r, const tw_msg_t *m, const Twain__Internal__V1__Register *g) {
  if (g->pool != TWAIN__INTERNAL__V1__POOL__POOL_PREFILL && g->pool != TWAIN__INTERNAL__V1__POOL__POOL_DECODE) {
    tw_reject_to(r, m, 0, TWAIN__V1__CODE__INVALID_ARGUMENT, "register: pool must be prefill or decode");
    return;
  }
  if (g->vocab_size && g->vocab_size != r->config.vocab_size) {
    tw_reject_to(r, m, 0, TWAIN__V1__CODE__INVALID_ARGUMENT, "register: worker serves another model (vocab differs)");
    return;
  }
  tw_rworker_t *w = tw_worker_by_id(r, m->id, m->id_len);
  /* registered again while held (a reject of a message that crossed the
   * registration made the worker doubt it): nothing it holds is void */
  const bool known = w && g->instance && w->instance == g->instance;
  for (size_t i = 0; i < sizeof r->expired_recent / sizeof r->expired_recent[0]; i++)
    if (r->expired_recent[i].id_len == m->id_len &&
        memcmp(r->expired_recent[i].id, m->id, m->id_len) == 0)
      r->expired_recent[i].expired_ns = 0; /* back: its heartbeats are its own again */
  if (!w) {
    if (r->n_workers == r->cap_workers) {
      int32_t cap = r->cap_workers ? r->cap_workers * 2 : 16;
      tw_rworker_t *t = realloc(r->workers, sizeof *t * (size_t)cap);
      if (!t) return;
      r->workers = t;
      r->cap_workers = cap;
    }
    w = &r->workers[r->n_workers++];
    memset(w, 0, sizeof *w);
    w->serial = r->next_worker_serial++;
    memcpy(w->id, m->id, m->id_len);
    w->id_len = m->id_len;
  } else if (w->instance && g->instance && w->instance != g->instance) {
    /* another process under a registered name (a worker restarted before the
     * router expired it): the one before is gone, and with it what it held */
    TW_WARN("router",
            "worker %s registered again as a new process (pid %d): the requests of the one "
            "before are retried",
            w->name, g->pid);
    tw_metric_add(r->m.expired, 1);
    uint64_t dead = w->serial;
    w->serial = r->next_worker_serial++; /* what the one before still sends matches nothing */
    char why[160];
    snprintf(why, sizeof why, "%s worker %s was replaced by a new process",
             w->pool == TWAIN__INTERNAL__V1__POOL__POOL_DECODE ? "decode" : "prefill", w->name);
    tw_retry_held(r, dead, why, w);
  }
  snprintf(w->name, sizeof w->name, "%s", g->name && g->name[0] ? g->name : "worker");
  w->pool = g->pool;
  w->block_size = g->kv_block_size > 0 ? g->kv_block_size : 16;
  w->draining = false;
  w->last_seen_ns = tw_msg_clock_ns();
  tw_apply_capacity(w, g->capacity);
  tw_keep_addrs(w, g);
  w->instance = g->instance;
  if (g->instance) { /* back after its expiry: a stall, not a failure of its requests */
    int32_t n = 0;
    for (int32_t k = 0; k < r->n_reqs; k++) {
      tw_req_t *q = r->reqs[k];
      if (q->done || q->expired_instance != g->instance) continue;
      q->expired_instance = 0;
      if (q->attempts > 0) q->attempts--, n++;
    }
    if (n)
      TW_INFO("router",
              "worker %s is back (the same process: it was stalled): %d requests it held "
              "keep their attempts",
              g->name ? g->name : "", n);
  }
  TW_INFO("router", "worker %s registered: %s pool, backend %s, pid %d, %d/%d free kv blocks", w->name,
          w->pool == TWAIN__INTERNAL__V1__POOL__POOL_PREFILL ? "prefill" : "decode",
          g->backend ? g->backend : "?", g->pid, w->free_blocks, w->total_blocks);
  Twain__Internal__V1__RegisterAck ack = TWAIN__INTERNAL__V1__REGISTER_ACK__INIT;
  ack.worker_id = w->name;
  ack.known = known;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER_ACK;
  env.register_ack = &ack;
  /* logged there; the worker registers again until it hears the ack */
  TW_IGNORE(tw_router_send_worker(r, w, &env));
  /* the decode pools, so the prefill worker connects before its first handoff */
  if (w->pool == TWAIN__INTERNAL__V1__POOL__POOL_PREFILL) {
    w->kv_peers_unacked = 0; /* registered again: what it was sent before is moot */
    tw_send_kv_peers(r, w, NULL);
  } else if (w->kv_pools) {
    tw_send_kv_peers(r, NULL, w);
  }
  tw_update_gauges(r);
}

/* A twain.v1.Code a worker may report for a request; anything else becomes
 * INTERNAL so clients only ever see codes of the API. */
static int tw_known_code(int code) {
  switch (code) {
    case TWAIN__V1__CODE__CANCELLED: case TWAIN__V1__CODE__UNKNOWN:
    case TWAIN__V1__CODE__INVALID_ARGUMENT: case TWAIN__V1__CODE__DEADLINE_EXCEEDED:
    case TWAIN__V1__CODE__NOT_FOUND: case TWAIN__V1__CODE__RESOURCE_EXHAUSTED:
    case TWAIN__V1__CODE__UNIMPLEMENTED: case TWAIN__V1__CODE__INTERNAL:
    case TWAIN__V1__CODE__UNAVAILABLE:
      return code;
    default:
      return TWAIN__V1__CODE__INTERNAL;
  }
}

/* Token ids a worker sends must be ids of the model: fails the request (the
 * worker is broken or hostile) and returns false otherwise. */
static bool tw_tokens_valid(tw_router_t *r, tw_rworker_t *w, tw_req_t *q, const int32_t *toks, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (toks[i] >= 0 && toks[i] < r->config.vocab_size) continue;
    TW_WARN("router", "worker %s sent token id %d outside the vocabulary [0, %d) for request %llu",
            w->name, toks[i], r->config.vocab_size, (unsigned long long)q->id);
    tw_router_fail(r, q, TWAIN__V1__CODE__INTERNAL, "worker %s sent an invalid token id (%d)", w->name,
                   toks[i]);
    return false;
  }
  return true;
}

void tw_router_requeue(tw_router_t *r, tw_req_t *q, bool cancel, int64_t delay_ns) {
  if (cancel) tw_router_cancel_workers(r, q);
  q->id = r->next_req_id++; /* late messages about the old attempt are ignored */
  q->state = TW_REQ_QUEUED;
  q->dw = q->pw = 0;
  q->retry_after_ns = tw_msg_clock_ns() + delay_ns;
}

/* Requeue or fail a request whose worker went away or refused it. One with
 * tokens at the client already is resumed from there (tw_req_context: its
 * prompt and those tokens are prefilled again), unless that context is
 * longer than a prompt may be. */
static void tw_retry_or_fail(tw_router_t *r, tw_req_t *q, int code, const char *why) {
  if (q->done) return;
  if (q->attempts < TW_ROUTER_MAX_ATTEMPTS && tw_req_context(q) <= r->max_prompt) {
    if (q->n_out == 0 || q->state != TW_REQ_DECODING) { /* not a stream lost while decoding */
      TW_INFO("router", "request %llu: %s; retrying elsewhere%s", (unsigned long long)q->id, why,
              q->n_out ? " (a resumed stream)" : "");
    } else {
      TW_INFO("router", "request %llu: %s after %d tokens; resuming it elsewhere from there",
              (unsigned long long)q->id, why, q->n_out);
      tw_metric_add(r->m.resumed, 1);
    }
    tw_router_requeue(r, q, true, 20 * 1000000);
    return;
  }
  tw_router_fail(r, q, code, "%s", why);
}

/* Every request that worker `serial` holds (as its decode worker, or
 * prefilling there) runs again elsewhere (tw_retry_or_fail): the worker is
 * gone or going, so nothing is cancelled there. `expired`: the expired
 * worker, whose process coming back (Register.instance) gives the attempt
 * back; NULL: a worker whose failure is no stall. */
static void tw_retry_held(tw_router_t *r, uint64_t serial, const char *why,
                          const tw_rworker_t *expired) {
  for (int32_t k = 0; k < r->n_reqs; k++) {
    tw_req_t *q = r->reqs[k];
    if (q->done || q->state == TW_REQ_QUEUED) continue;
    bool on_dw = q->dw == serial, on_pw = q->pw == serial && q->state == TW_REQ_PREFILLING;
    if (!on_dw && !on_pw) continue;
    if (on_dw)
      q->dw = 0;
    else
      q->pw = 0;
    tw_retry_or_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE, why);
    if (expired && !q->done) q->expired_instance = expired->instance;
  }
}

/* A worker that said its device failed (Status.worker_failed) stops and
 * exits: no more work to it (as if it drained) until a process registers
 * again; every request it holds runs again elsewhere (tw_retry_or_fail), as
 * after an expiry, and its pool, if now empty, is waited for as after one
 * (--pool-grace-ms): its supervisor starts a fresh worker. */
static void tw_worker_failed(tw_router_t *r, tw_rworker_t *w, const char *why) {
  if (!w->draining) {
    TW_WARN("router", "worker %s reports its device failed: sending it nothing more", w->name);
    w->draining = true;
    tw_update_gauges(r);
  }
  if (tw_router_count_workers(r, w->pool) == 0)
    r->empty_by_expiry[w->pool == TWAIN__INTERNAL__V1__POOL__POOL_DECODE ? 1 : 0] = true;
  tw_retry_held(r, w->serial, why, NULL);
}

/* An answer's status that says its worker failed: tw_worker_failed, true. */
static bool tw_worker_says_failed(tw_router_t *r, tw_rworker_t *w,
                                  const Twain__Internal__V1__Status *st, const char *role) {
  if (!st || !st->code || !st->worker_failed) return false;
  char why[300];
  snprintf(why, sizeof why, "%s worker %s failed: %s", role, w->name,
           st->message ? st->message : "");
  tw_worker_failed(r, w, why);
  return true;
}

/* The ring-capable blocks a sequence of n blocks takes on decode worker w
 * (Capacity.ring_len; 0 where it reports no ring). */
static int32_t tw_ring_need(const tw_rworker_t *w, int32_t n) {
  if (w->total_ring <= 0) return 0;
  return n < w->ring_len ? n : w->ring_len;
}

/* This router's prompt tokens reserving or prefilling on each worker
 * (tw_rworker_t.inflight_tokens), and the blocks it asked of each decode
 * worker (assigned_blocks). */
static void tw_count_inflight(tw_router_t *r) {
  for (int32_t i = 0; i < r->n_workers; i++) {
    r->workers[i].assigned_blocks = 0;
    r->workers[i].assigned_ring = 0;
    r->workers[i].inflight_tokens = 0;
  }
  for (int32_t k = 0; k < r->n_reqs; k++) {
    tw_req_t *q = r->reqs[k];
    if (q->done || q->state == TW_REQ_QUEUED) continue;
    tw_rworker_t *w = tw_router_worker(r, q->dw);
    if (w) {
      w->assigned_blocks += q->blocks_asked;
      w->assigned_ring += tw_ring_need(w, q->blocks_asked);
    }
    w = q->state != TW_REQ_DECODING && q->pw ? tw_router_worker(r, q->pw) : NULL;
    if (w) w->inflight_tokens += tw_req_context(q);
  }
}

/* The prefill worker with the least in flight (this router's exact count, or
 * the heartbeat's queue when larger: other routers' work) that can take
 * n_prompt more tokens within its window (an idle one always can); n_prompt
 * 0: any, window ignored; `now`: the clock, for tw_router_worker_open. NULL
 * when none can. */
static tw_rworker_t *tw_pick_prefill(tw_router_t *r, int32_t n_prompt, int64_t now) {
  tw_rworker_t *best = NULL;
  int64_t best_load = 0;
  for (int32_t i = 0; i < r->n_workers; i++) {
    tw_rworker_t *p = &r->workers[i];
    if (p->pool != TWAIN__INTERNAL__V1__POOL__POOL_PREFILL || !tw_router_worker_open(p, now))
      continue;
    double window = r->p->prefill_window_tokens;
    double known = p->tok_per_s > 0 ? p->tok_per_s * TW_ROUTER_PREFILL_QUEUE_S
                                    : TW_ROUTER_PREFILL_FIRST_WINDOW;
    if (known < window) window = known;
    if (n_prompt > 0 && p->inflight_tokens > 0 && (double)(p->inflight_tokens + n_prompt) > window)
      continue;
    int64_t load = p->queued_tokens > p->inflight_tokens ? p->queued_tokens : p->inflight_tokens;
    if (!best || load < best_load) {
      best = p;
      best_load = load;
    }
  }
  return best;
}

static void tw_on_reserved(tw_router_t *r, tw_rworker_t *w, const Twain__Internal__V1__Reserved *rs) {
  TW_DEBUG("router", "request %llu: reserved on %s (%s)", (unsigned long long)rs->request_id, w->name,
           rs->status && rs->status->code ? rs->status->message : "ok");
  tw_req_t *q = tw_router_find_req(r, rs->request_id);
  if (!q || q->state != TW_REQ_RESERVING || q->dw != w->serial) {
    if (!rs->status || !rs->status->code) { /* a reservation nobody wants: free it */
      Twain__Internal__V1__Cancel c = TWAIN__INTERNAL__V1__CANCEL__INIT;
      c.request_id = rs->request_id;
      Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
      env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_CANCEL;
      env.cancel = &c;
      /* logged there; an unclaimed reservation expires on the worker */
      TW_IGNORE(tw_router_send_worker(r, w, &env));
    }
    return;
  }
  if (rs->status && rs->status->code) {
    if (rs->status->code == TWAIN__V1__CODE__RESOURCE_EXHAUSTED ||
        rs->status->code == TWAIN__V1__CODE__UNAVAILABLE) { /* full or draining: wait in the queue */
      /* full: its room is less than its last heartbeat said (reservations
       * since, quarantined ones): none goes there until the next one */
      if (rs->status->code == TWAIN__V1__CODE__RESOURCE_EXHAUSTED)
        w->free_blocks = w->free_ring = 0;
      q->state = TW_REQ_QUEUED;
      q->dw = q->pw = 0;
      q->attempts--; /* a refused reservation is no failed attempt */
      q->id = r->next_req_id++;
      q->retry_after_ns = tw_msg_clock_ns() + 20 * 1000000;
      return;
    }
    tw_router_fail(r, q, tw_known_code(rs->status->code), "%s",
                   rs->status->message ? rs->status->message : "reserve failed");
    return;
  }
  if (!tw_handoff_vouched(w, rs->handoff)) {
    TW_WARN("router", "decode worker %s sent a handoff for request %llu naming a UCX address it "
            "did not register: refused", w->name, (unsigned long long)q->id);
    tw_router_fail(r, q, TWAIN__V1__CODE__INTERNAL,
                   "decode worker %s sent an invalid handoff (unregistered UCX address)", w->name);
    return;
  }
  /* the prefill worker schedule chose (its window counted this prompt), or,
   * if it went away or drains meanwhile, the least loaded one */
  tw_rworker_t *best = q->pw ? tw_router_worker(r, q->pw) : NULL;
  const int64_t now = tw_msg_clock_ns();
  if (best && !tw_router_worker_open(best, now)) best = NULL;
  if (!best) best = tw_pick_prefill(r, 0, now);
  if (!best) { /* back to the queue, which waits for the pool (--pool-grace-ms): no attempt */
    q->attempts--;
    tw_router_requeue(r, q, true, 20 * 1000000); /* the cancel frees the reservation */
    return;
  }
  Twain__Internal__V1__PrefillRequest pr = TWAIN__INTERNAL__V1__PREFILL_REQUEST__INIT;
  pr.request_id = q->id;
  pr.prompt_ids = q->prompt;
  pr.n_prompt_ids = (size_t)tw_req_context(q);
  pr.sampling = &q->sampling;
  Twain__Internal__V1__KvHandoff full;
  const Twain__Internal__V1__KvHandoff *h = tw_handoff_complete(w, rs->handoff, &full);
  if (!h) {
    TW_WARN("router",
            "decode worker %s reserved request %llu naming no pools it registered: refused",
            w->name, (unsigned long long)q->id);
    tw_router_fail(r, q, TWAIN__V1__CODE__INTERNAL,
                   "decode worker %s sent a handoff without its kv pools", w->name);
    return;
  }
  pr.handoff = (Twain__Internal__V1__KvHandoff *)h;
  pr.issued_unix_ms = tw_proto_unix_ms(); /* the workers' staleness clock (proto_engine.h) */
  int32_t *resumed = NULL; /* a resumed request's context: prompt, then its tokens so far */
  if (q->n_out > 0) {
    if (!(resumed = malloc(sizeof(int32_t) * pr.n_prompt_ids))) {
      tw_router_fail(r, q, TWAIN__V1__CODE__RESOURCE_EXHAUSTED, "router out of memory");
      return;
    }
    memcpy(resumed, q->prompt, sizeof(int32_t) * (size_t)q->n_prompt);
    memcpy(resumed + q->n_prompt, q->out, sizeof(int32_t) * (size_t)q->n_out);
    pr.prompt_ids = resumed;
  }
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL;
  env.prefill = &pr;
  q->pw = best->serial;
  q->state = TW_REQ_PREFILLING;
  if (!q->t_sched_ns) q->t_sched_ns = tw_msg_clock_ns(); /* end of its queue time */
  best->requests++;
  tw_status_t sent = tw_router_send_worker(r, best, &env);
  free(resumed);
  if (sent != TW_OK) {           /* the worker's failure, not the request's: no attempt spent */
    q->state = TW_REQ_RESERVING; /* it never got there: the reservation is unused */
    q->pw = 0;
    q->attempts--;
    tw_retry_or_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE, "prefill worker unreachable");
  }
}

static void tw_on_prefill_done(tw_router_t *r, tw_rworker_t *w, const Twain__Internal__V1__PrefillDone *d) {
  if (tw_worker_says_failed(r, w, d->status, "prefill")) return; /* whichever request it names */
  tw_req_t *q = tw_router_find_req(r, d->request_id);
  if (!q || q->state != TW_REQ_PREFILLING || q->pw != w->serial) return; /* cancelled meanwhile */
  if (d->status && d->status->code) {
    char why[300];
    snprintf(why, sizeof why, "prefill failed on %s: %s", w->name, d->status->message ? d->status->message : "");
    /* UNAVAILABLE: draining, it waited in the worker's queue past the 20 s
     * KV-write guard, or its decode worker did not take the staged kv in
     * time (handoff_send.c); RESOURCE_EXHAUSTED: queue full: the worker's state, not
     * the request's, so it waits in the queue again without spending an
     * attempt (its deadline bounds that). DEADLINE_EXCEEDED: the KV-write
     * guard stopped a prefill that ran too long: an attempt. None sent a token. */
    if (d->status->code == TWAIN__V1__CODE__UNAVAILABLE ||
        d->status->code == TWAIN__V1__CODE__RESOURCE_EXHAUSTED) {
      q->attempts--;
      tw_retry_or_fail(r, q, d->status->code, why);
    } else if (d->status->code == TWAIN__V1__CODE__DEADLINE_EXCEEDED)
      tw_retry_or_fail(r, q, d->status->code, why);
    else
      tw_router_fail(r, q, tw_known_code(d->status->code), "%s", why);
    return;
  }
  /* the worker's speed, for its window: the prompts of one batch share its
   * engine time (prefill_ms), so a batch counts once, with all its tokens */
  if (d->prefill_ms > 0 && d->prefill_ms == w->batch_ms) {
    w->batch_tokens += tw_req_context(q);
    if (d->transfer_ms > w->batch_xfer_ms) w->batch_xfer_ms = d->transfer_ms;
  } else if (d->prefill_ms > 0) {
    if (w->batch_tokens > 0) { /* the previous batch is complete */
      double rate = (double)w->batch_tokens / ((w->batch_ms + w->batch_xfer_ms) * 1e-3);
      w->tok_per_s = w->tok_per_s > 0 ? 0.7 * w->tok_per_s + 0.3 * rate : rate;
    }
    w->batch_ms = d->prefill_ms;
    w->batch_xfer_ms = d->transfer_ms;
    w->batch_tokens = tw_req_context(q);
    if (w->tok_per_s <= 0) /* a first estimate at once (a lower bound) */
      w->tok_per_s = (double)tw_req_context(q) / ((d->prefill_ms + d->transfer_ms) * 1e-3);
  }
  if (!tw_tokens_valid(r, w, q, &d->first_token, 1)) return;
  tw_rworker_t *dw = tw_router_worker(r, q->dw);
  if (!dw) {
    tw_retry_or_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE, "decode worker went away during prefill");
    return;
  }
  Twain__Internal__V1__DecodeRequest dr = TWAIN__INTERNAL__V1__DECODE_REQUEST__INIT;
  dr.request_id = q->id;
  dr.n_prompt_tokens = tw_req_context(q);
  dr.first_token = d->first_token;
  dr.max_tokens = tw_req_left(q);
  dr.sampling = &q->sampling;
  dr.stop_token_ids = q->stop_ids;
  dr.n_stop_token_ids = (size_t)q->n_stop;
  dr.layer_checksums = d->layer_checksums;
  dr.n_layer_checksums = d->n_layer_checksums;
  dr.head_checksums = d->head_checksums; /* re-sharded handoffs (issue 6) */
  dr.n_head_checksums = d->n_head_checksums;
  dr.kv_in_place = d->kv_in_place;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_DECODE;
  env.decode = &dr;
  q->state = TW_REQ_DECODING;
  if (tw_router_send_worker(r, dw, &env) != TW_OK) {
    q->attempts--; /* as for the prefill worker above */
    tw_retry_or_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE, "decode worker unreachable");
    return;
  }
  /* the first token streams now: TTFT does not wait for the decode worker */
  int32_t first = d->first_token;
  bool stop = false;
  for (int32_t i = 0; i < q->n_stop; i++) stop |= q->stop_ids[i] == first;
  tw_router_on_tokens(
      r, q, &first, 1, stop || tw_req_left(q) == 1,
      stop ? TWAIN__V1__FINISH_REASON__FINISH_STOP : TWAIN__V1__FINISH_REASON__FINISH_LENGTH);
}

static void tw_on_worker_tokens(tw_router_t *r, tw_rworker_t *w, const Twain__Internal__V1__Tokens *t) {
  if (tw_worker_says_failed(r, w, t->status, "decode")) return; /* whichever request it names */
  tw_req_t *q = tw_router_find_req(r, t->request_id);
  if (!q || q->state != TW_REQ_DECODING || q->dw != w->serial) return; /* not this worker's */
  if (t->status && t->status->code) {
    tw_router_fail(r, q, tw_known_code(t->status->code), "decode failed on %s: %s", w->name,
                   t->status->message ? t->status->message : "");
    return;
  }
  if (!tw_tokens_valid(r, w, q, t->tokens, t->n_tokens)) return;
  int reason = t->finish_reason;
  if (reason != TWAIN__V1__FINISH_REASON__FINISH_NONE && reason != TWAIN__V1__FINISH_REASON__FINISH_STOP &&
      reason != TWAIN__V1__FINISH_REASON__FINISH_LENGTH && reason != TWAIN__V1__FINISH_REASON__FINISH_TOOL_CALL) {
    TW_WARN("router", "worker %s sent finish reason %d for request %llu", w->name, reason,
            (unsigned long long)q->id);
    tw_router_fail(r, q, TWAIN__V1__CODE__INTERNAL, "worker %s sent an invalid finish reason (%d)",
                   w->name, reason);
    return;
  }
  tw_router_on_tokens(r, q, t->tokens, t->n_tokens, t->finished, reason);
}

void tw_router_on_worker_msg(tw_router_t *r, tw_msg_t *m) {
  Twain__Internal__V1__Envelope *env = twain__internal__v1__envelope__unpack(NULL, m->len, m->data);
  bool strings_ok = env && tw_msg_check_strings(&twain__internal__v1__envelope__descriptor, m->data,
                                                 m->len) == TW_OK;
  if (!strings_ok) {
    static tw_msg_ratelimit_t rl;
    uint64_t sup = 0;
    if (tw_msg_ratelimit(&rl, &sup)) {
      if (sup) TW_WARN("router", "suppressed %llu similar warnings", (unsigned long long)sup);
      TW_WARN("router", "malformed protobuf on the worker socket (%zu bytes)%s%s", m->len,
              env ? ": " : "", env ? tw_last_error() : "");
    }
    tw_reject_to(r, m, 0, TWAIN__V1__CODE__INVALID_ARGUMENT,
                 env ? "Envelope with a string that is not UTF-8 or holds a NUL byte"
                     : "malformed twain.internal.v1.Envelope");
    if (env) twain__internal__v1__envelope__free_unpacked(env, NULL);
    return;
  }
  int64_t now = tw_msg_clock_ns();
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER) {
    tw_on_register(r, m, env->register_);
    twain__internal__v1__envelope__free_unpacked(env, NULL);
    return;
  }
  tw_rworker_t *w = NULL;
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT && env->heartbeat->worker &&
      env->heartbeat->worker[0])
    w = tw_worker_of_heartbeat(r, m, env->heartbeat->worker);
  else
    w = tw_worker_by_id(r, m->id, m->id_len);
  if (!w) { /* expired, or the router restarted: ask it to register again */
    if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT && env->heartbeat->worker)
      tw_note_revived(r, m, env->heartbeat->worker, now);
    tw_reject_to(r, m, 0, TWAIN__V1__CODE__NOT_FOUND, "unknown worker: register first");
    twain__internal__v1__envelope__free_unpacked(env, NULL);
    return;
  }
  w->last_seen_ns = now;
  switch (env->body_case) {
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT:
      tw_apply_capacity(w, env->heartbeat->capacity);
      if (env->heartbeat->draining && !w->draining) {
        TW_INFO("router", "worker %s is draining", w->name);
        w->draining = true;
        tw_update_gauges(r);
      }
      break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVED: tw_on_reserved(r, w, env->reserved); break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL_DONE: tw_on_prefill_done(r, w, env->prefill_done); break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_TOKENS: tw_on_worker_tokens(r, w, env->tokens); break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_KV_PEERS_READY:
      if (w->kv_peers_unacked > 0) w->kv_peers_unacked--;
      TW_INFO("router",
              "prefill worker %s connected to %d decode workers' kv pools ahead of traffic%s",
              w->name, env->kv_peers_ready->connected,
              env->kv_peers_ready->failed ? " (some failed: retried at their first handoff)" : "");
      break;
    case TWAIN__INTERNAL__V1__ENVELOPE__BODY_REJECT: {
      const Twain__Internal__V1__Reject *rj = env->reject;
      TW_WARN("router", "worker %s rejected a message for request %llu: %s", w->name,
              (unsigned long long)rj->request_id, rj->status && rj->status->message ? rj->status->message : "");
      tw_req_t *q = rj->request_id ? tw_router_find_req(r, rj->request_id) : NULL;
      if (q && (q->dw == w->serial || q->pw == w->serial))
        tw_router_fail(r, q, rj->status ? tw_known_code(rj->status->code) : TWAIN__V1__CODE__INTERNAL, "worker %s: %s",
                       w->name, rj->status && rj->status->message ? rj->status->message : "rejected");
      break;
    }
    default:
      TW_WARN("router", "worker %s sent an unexpected message type %d", w->name, (int)env->body_case);
      tw_reject_to(r, m, 0, TWAIN__V1__CODE__UNIMPLEMENTED, "unexpected message type for the router");
  }
  twain__internal__v1__envelope__free_unpacked(env, NULL);
}

void tw_router_expire_workers(tw_router_t *r, int64_t now) {
  /* A router that did not run for a while (descheduled on a loaded machine,
   * stopped) has its workers' heartbeats of that time unread in its socket:
   * expiring them now would take live workers out and retry their requests
   * (the prefill already put their kv; the decode worker quarantines the
   * abandoned reservations for TW_DSEQ_QUARANTINE_MS). So a gap between two
   * checks beyond a quarter of the expiry is credited to every worker: its
   * silence counts the time the router listened, and a dead worker still
   * goes after expire_ms of that (a turn is at most 100 ms of poll plus its
   * work, well inside the quarter, so a busy router credits nothing). */
  int64_t expire_ns = (int64_t)r->p->expire_ms * 1000000, slack_ns = expire_ns / 4;
  int64_t gap_ns = r->expire_check_ns ? now - r->expire_check_ns : 0;
  r->expire_check_ns = now;
  if (gap_ns > slack_ns) {
    if (gap_ns >= expire_ns)
      TW_WARN("router",
              "the router did not run for %lld ms (a loaded machine?): its workers get that time "
              "to be heard before any expires",
              (long long)(gap_ns / 1000000));
    for (int32_t i = 0; i < r->n_workers; i++) {
      tw_rworker_t *w = &r->workers[i];
      w->last_seen_ns += gap_ns - slack_ns;
      if (w->last_seen_ns > now) w->last_seen_ns = now;
    }
  }
  for (int32_t i = 0; i < r->n_workers; i++) {
    tw_rworker_t *w = &r->workers[i];
    if (now - w->last_seen_ns <= expire_ns) continue;
    TW_WARN("router", "worker %s expired: no heartbeat for %lld ms", w->name,
            (long long)((now - w->last_seen_ns) / 1000000));
    tw_metric_add(r->m.expired, 1);
    uint64_t dead = w->serial;
    w->serial = 0; /* lookups fail from here on */
    char why[160];
    snprintf(why, sizeof why, "%s worker %s stopped responding",
             w->pool == TWAIN__INTERNAL__V1__POOL__POOL_DECODE ? "decode" : "prefill", w->name);
    tw_retry_held(r, dead, why, w);
    Twain__Internal__V1__Pool pool = w->pool;
    int k = pool == TWAIN__INTERNAL__V1__POOL__POOL_DECODE ? 1 : 0;
    int32_t slot = r->expired_next;
    r->expired_next =
        (slot + 1) % (int32_t)(sizeof r->expired_recent / sizeof r->expired_recent[0]);
    snprintf(r->expired_recent[slot].name, sizeof r->expired_recent[slot].name, "%s", w->name);
    memcpy(r->expired_recent[slot].id, w->id, w->id_len);
    r->expired_recent[slot].id_len = w->id_len;
    r->expired_recent[slot].pool = k;
    r->expired_recent[slot].expired_ns = now;
    tw_rworker_free_addrs(w);
    r->workers[i] = r->workers[--r->n_workers];
    if (tw_router_count_workers(r, pool) == 0 && !r->empty_by_expiry[k])
      r->empty_by_expiry[k] = true, r->empty_since_ns[k] = now;
    i--;
    tw_update_gauges(r);
  }
}

void tw_router_schedule(tw_router_t *r, int64_t now) {
  tw_count_inflight(r);
  for (int32_t k = 0; k < r->n_reqs; k++) {
    tw_req_t *q = r->reqs[k];
    if (q->done || q->state != TW_REQ_QUEUED || now < q->retry_after_ns) continue;
    bool no_decode = tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_DECODE) == 0;
    if (no_decode || tw_router_count_workers(r, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL) == 0) {
      /* a stalled or restarting worker costs latency, not the request: wait
       * for the pool to come back for --pool-grace-ms (counted from when it
       * emptied, or from arrival if later) or until the deadline */
      int pk = no_decode ? 1 : 0;
      int64_t since = r->empty_since_ns[pk];
      if (!since || since < q->t_arrival_ns) since = q->t_arrival_ns;
      int grace_ms = r->empty_by_expiry[pk] ? r->p->pool_grace_ms : TW_ROUTER_POOL_EMPTY_MS;
      const bool given_up = r->p->pool_given_up && atomic_load(&r->p->pool_given_up[pk]);
      if (given_up)
        tw_router_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE,
                       "no %s worker is registered and none will be restarted (their restarts "
                       "are used up: see the log)",
                       no_decode ? "decode" : "prefill");
      else if (now - since > (int64_t)grace_ms * 1000000)
        tw_router_fail(r, q, TWAIN__V1__CODE__UNAVAILABLE, "no %s worker is registered (for %d ms)%s",
                       no_decode ? "decode" : "prefill", grace_ms,
                       q->attempts ? " after its worker failed" : "");
      continue;
    }
    /* decode worker with the most free blocks that can hold prompt + max_tokens
     * (for a resumed request: its context + what is left, the same sum) */
    tw_rworker_t *best = NULL;
    int32_t best_free = -1, need = 0, largest = 0, n_open = 0, n_never = 0, n_draining = 0;
    int64_t largest_tokens =
        0; /* what the largest pool holds, in tokens (block sizes may differ) */
    bool largest_dp = false;
    for (int32_t i = 0; i < r->n_workers; i++) {
      tw_rworker_t *w = &r->workers[i];
      if (w->pool != TWAIN__INTERNAL__V1__POOL__POOL_DECODE) continue;
      if (w->draining) { /* may be larger than the rest: no verdict of "never" meanwhile */
        n_draining++;
        continue;
      }
      /* one a send just failed to: counted as open (a request too large for
       * every pool still fails at once) but given nothing until then */
      const bool open = tw_router_worker_open(w, now);
      int32_t n = (int32_t)(((int64_t)q->n_prompt + q->max_tokens + w->block_size - 1) / w->block_size);
      /* what one sequence can ever get there: one replica's pool (dp) or the pool */
      int32_t size = w->replica_total_blocks > 0 ? w->replica_total_blocks : w->total_blocks;
      n_open++;
      if ((int64_t)size * w->block_size > largest_tokens) {
        largest = size;
        largest_tokens = (int64_t)size * w->block_size;
        largest_dp = w->replica_total_blocks > 0;
      }
      if (size > 0 && n > size) {
        n_never++;
        if (!need) need = n; /* for the message below */
        continue;
      }
      /* the heartbeat lags the reservations in flight; what this router holds
       * there is exact, so take the smaller estimate */
      int32_t f = w->total_blocks - w->assigned_blocks;
      if (w->free_blocks < f) f = w->free_blocks;
      /* data-parallel attention: the sequence's KV goes to one replica, so it
       * must fit there (the worker picks the emptiest); f, the sum, ranks */
      bool dp = w->replica_total_blocks > 0 || w->replica_free_blocks > 0;
      bool fits = open && f >= n && (!dp || w->replica_free_blocks >= n);
      if (fits && w->total_ring > 0) { /* and a window ring for it (Capacity.free_ring_blocks) */
        int32_t fr = w->total_ring - w->assigned_ring;
        if (w->free_ring < fr) fr = w->free_ring;
        fits = fr >= tw_ring_need(w, n);
      }
      if (fits && f > best_free) {
        best = w;
        best_free = f;
        need = n;
      }
    }
    if (!best && n_open > 0 && n_never == n_open && n_draining == 0) {
      /* larger than any decode worker (or dp replica) could ever hold: no
       * wait for room helps. A max_tokens the client did not give shrinks
       * to what the largest one holds, as it does to the model's context
       * (while that still leaves a token to produce); otherwise the request
       * is refused now, as an error of the request (a retry cannot help),
       * instead of waiting for its deadline; a stream resumed after its
       * worker was lost (n_out > 0) lost the one that held it: UNAVAILABLE */
      const int64_t room = largest_tokens - q->n_prompt;
      if (q->max_default && room > q->n_out && room < q->max_tokens) {
        TW_DEBUG("router",
                 "request %llu: default max_tokens %d shrinks to %lld, what the largest decode "
                 "worker%s holds after the prompt",
                 (unsigned long long)q->id, q->max_tokens, (long long)room,
                 largest_dp ? " replica" : "");
        q->max_tokens = (int32_t)room;
        k--; /* this request again, with its new size */
        continue;
      }
      tw_router_fail(
          r, q, q->n_out > 0 ? TWAIN__V1__CODE__UNAVAILABLE : TWAIN__V1__CODE__INVALID_ARGUMENT,
          "request needs %d kv blocks (%d prompt + %d max_tokens tokens); the largest "
          "decode worker%s holds %d: lower max_tokens or shorten the prompt (or give "
          "the decode workers more --kv-blocks)",
          need, q->n_prompt, q->max_tokens, largest_dp ? " replica (--dp)" : "", largest);
      continue;
    }
    if (!best) break; /* admission control: wait for room (or the deadline), in order */
    /* backpressure: a prefill worker must have room before anything is reserved */
    tw_rworker_t *pf = tw_pick_prefill(r, tw_req_context(q), now);
    if (!pf) break; /* every window is full: this one and those behind it wait, in order */
    Twain__Internal__V1__Reserve rv = TWAIN__INTERNAL__V1__RESERVE__INIT;
    rv.request_id = q->id;
    rv.n_prompt_tokens = tw_req_context(q);
    rv.max_tokens = tw_req_left(q);
    Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVE;
    env.reserve = &rv;
    q->attempts++;
    q->dw = best->serial;
    q->pw = pf->serial;
    q->state = TW_REQ_RESERVING;
    q->blocks_asked = need;
    best->assigned_blocks += need;
    best->assigned_ring += tw_ring_need(best, need);
    best->free_ring -= tw_ring_need(best, need); /* until its next heartbeat says */
    pf->inflight_tokens += tw_req_context(q);
    best->requests++;
    /* dp: the worker puts it in its emptiest replica; until the next
     * heartbeat says how much room is left there, count it as gone, so that
     * the same stale figure does not send more than that replica holds (each
     * would come back RESOURCE_EXHAUSTED and retry) */
    int32_t replica_before = best->replica_free_blocks;
    if (best->replica_total_blocks > 0)
      best->replica_free_blocks = replica_before > need ? replica_before - need : 0;
    if (tw_router_send_worker(r, best, &env) != TW_OK) {
      q->state = TW_REQ_QUEUED;
      q->dw = q->pw = 0;
      q->attempts--;
      best->assigned_blocks -= need;
      best->assigned_ring -= tw_ring_need(best, need);
      best->free_ring += tw_ring_need(best, need);
      pf->inflight_tokens -= tw_req_context(q);
      best->replica_free_blocks = replica_before;
    }
  }
}
