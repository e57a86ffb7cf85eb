/* router_impl.h: router internals shared by router.c (clients, requests),
 * router_workers.c (registry, scheduling, worker messages) and
 * router_chat.c (Harmony). Not a public interface. */
#ifndef TW_ROUTER_ROUTER_IMPL_H
#define TW_ROUTER_ROUTER_IMPL_H

#include "router/router.h"

#include "common/base/metrics.h"
#include "common/comm/msg.h"
#include "common/model/config.h"
#include "common/text/tokenizer.h"
#include "proto/twain_api.pb-c.h"
#include "proto/twain_internal.pb-c.h"

#include <stdbool.h>
#include <stdint.h>

/* A pool whose last worker expired (stalled past its expiry, restarting)
 * may come back: requests that wait for it, new or retried, get UNAVAILABLE
 * only after --pool-grace-ms (tw_router_params_t.pool_grace_ms); until then
 * they wait (or reach their deadline) and run when a worker registers. A
 * pool that is empty otherwise (none ever registered, the last one
 * drained): TW_ROUTER_POOL_EMPTY_MS. */
#define TW_ROUTER_POOL_EMPTY_MS 2000
/* How long after a worker's expiry its heartbeats (it is alive, not yet
 * registered again) keep its empty pool's requests waiting (tw_note_revived). */
#define TW_ROUTER_REVIVE_MS 60000
#define TW_RMAX_USER_STOP 16 /* stop_token_ids a request may give; more: INVALID_ARGUMENT */
#define TW_RMAX_STOP (TW_RMAX_USER_STOP + 2) /* + chat's <|return|> and <|call|> */

typedef enum {
  TW_REQ_QUEUED = 0,    /* waiting for a decode worker with room */
  TW_REQ_RESERVING = 1, /* Reserve sent to dw */
  TW_REQ_PREFILLING = 2,/* PrefillRequest sent to pw */
  TW_REQ_DECODING = 3,  /* DecodeRequest sent to dw */
} tw_req_state_t;

typedef struct tw_rchat tw_rchat_t; /* Harmony state of a chat request */
typedef struct tw_http tw_http_t;   /* the HTTP API (http_api.c) */

typedef struct {
  uint64_t serial;      /* never reused; 0 = none */
  uint8_t id[TW_MSG_MAX_ID];
  size_t id_len;
  char name[64];
  Twain__Internal__V1__Pool pool;
  bool draining;
  int64_t last_seen_ns;
  /* a send to it failed (its process gone, its queue full): no new work
   * goes there before this time (one expiry later: a dead worker has
   * expired by then; a live one is tried again); 0: none failed */
  int64_t unreachable_until_ns;
  int32_t free_blocks, total_blocks, block_size;
  int32_t replica_free_blocks; /* decode --dp: most free blocks of one replica; 0: not dp */
  int32_t replica_total_blocks; /* decode --dp: most blocks of one replica; 0: not dp */
  int64_t queued_tokens;
  int32_t assigned_blocks;  /* blocks of this router's requests there (schedule) */
  /* decode with the window ring (Capacity.free_ring_blocks ...): its ring
   * blocks free and in all (0: no ring limit), ring length, and the ring
   * blocks of this router's requests there (schedule) */
  int32_t free_ring, total_ring, ring_len, assigned_ring;
  int64_t inflight_tokens;  /* prefill: prompt tokens of this router's requests reserving
                             * or prefilling there (schedule: the backpressure window) */
  double tok_per_s;         /* prefill: measured prompt tokens per second (EMA); 0: none yet */
  double batch_ms, batch_xfer_ms; /* prefill: the last batch's engine and longest put time */
  int64_t batch_tokens;     /* prefill: its prompt tokens so far */
  int64_t requests;         /* handed to it, for tests and logs */
  ProtobufCBinaryData *kv_addrs; /* decode: the UCX addresses it registered (owned) */
  int32_t n_kv_addrs;
  /* decode: the pools it registered (Register.kv_pools, a deep copy), put
   * into the handoff of each of its reservations that names none */
  Twain__Internal__V1__KvHandoff *kv_pools;
  uint64_t instance; /* Register.instance: this process start (0: not given) */
  int32_t kv_peers_unacked; /* prefill: KvPeers sent, not yet answered (KvPeersReady) */
} tw_rworker_t;

typedef struct {
  uint64_t id;                 /* router-wide, never reused */
  uint8_t cid[TW_MSG_MAX_ID];  /* client routing prefix */
  size_t cid_len;
  bool cdelim;
  uint64_t client_rid;
  bool chat, stream;
  int32_t *prompt;
  int32_t n_prompt;
  int32_t max_tokens;
  bool max_default; /* max_tokens is a default: it shrinks to what the context leaves */
  Twain__Internal__V1__Sampling sampling;
  int32_t stop_ids[TW_RMAX_STOP];
  int32_t n_stop;
  tw_req_state_t state;
  uint64_t dw, pw;             /* worker serials (pw: chosen before the Reserve) */
  int32_t attempts;
  uint64_t expired_instance; /* the worker whose expiry requeued it last (0: none): if that
                                * process registers again it was a stall: attempts-- */
  int64_t retry_after_ns;
  int32_t blocks_asked;
  int32_t n_out;               /* tokens produced so far */
  int32_t *out;                /* [max_tokens] all produced tokens */
  float *token_ms;             /* [max_tokens] gap before each token */
  int64_t t_arrival_ns, t_deadline_ns, t_first_ns, t_last_ns;
  int64_t t_sched_ns;          /* first handed to a prefill worker (queue time); 0: not yet */
  tw_rchat_t *hchat;           /* chat only */
  bool done;                   /* finished: freed at the loop top */
} tw_req_t;

/* What the workers of an attempt are asked for. A request resumed after
 * its decode worker was lost mid-stream (router_workers.c) has n_out tokens
 * at the client already: the attempt prefills the prompt followed by those
 * tokens and decodes the rest, so the stream goes on where it stopped (the
 * same tokens as without the loss for greedy and seeded sampling, whose
 * draw is a function of the seed and the position, common/engine/sampling.h).
 * A first attempt has n_out 0: the prompt and max_tokens. */
static inline int32_t tw_req_context(const tw_req_t *q) { return q->n_prompt + q->n_out; }
static inline int32_t tw_req_left(const tw_req_t *q) { return q->max_tokens - q->n_out; }

typedef struct {
  const tw_router_params_t *p;
  tw_model_config_t config;
  void *zctx, *csock, *wsock;
  tw_auth_keys_t keys;     /* the worker socket's CURVE keys (common/comm/link_auth.h) */
  tw_auth_guard_t *guard;  /* its ZAP handler: only holders of the client key register */
  void *czctx;             /* the client socket's own context (its own ZAP handler) */
  tw_auth_keys_t ckeys;    /* the client socket's CURVE server pair, or plaintext */
  tw_auth_guard_t *cguard; /* its ZAP handler: any client key, or an allow-list */
  tw_metrics_t *metrics;
  tw_rworker_t *workers;
  int32_t n_workers, cap_workers;
  uint64_t next_worker_serial, next_req_id;
  uint64_t seed_state; /* tw_router_draw_seed: seeds of requests that give none */
  tw_req_t **reqs;
  int32_t n_reqs, cap_reqs;
  int32_t max_prompt;
  int32_t max_tokens_limit;    /* --max-tokens-limit, 0: the model's context minus 1 */
  bool draining, ready_sent;
  int64_t ready_wait_ns; /* every worker registered, waiting for KvPeersReady since (0: not) */
  int64_t empty_since_ns[2];   /* prefill, decode: when the pool last became empty (0: it has workers) */
  bool empty_by_expiry[2];     /* ... because its last worker stopped heartbeating (a stall?) */
  /* the workers expired last (a ring): one that heartbeats again is alive and
   * registering (its main loop may be busy for a while after a stall), so its
   * empty pool's --pool-grace-ms counts from then (tw_note_revived) */
  struct {
    char name[64];
    uint8_t id[TW_MSG_MAX_ID]; /* its routing id (heartbeats come from id + "/hb") */
    size_t id_len;
    int pool;           /* 0 prefill, 1 decode */
    int64_t expired_ns; /* 0: an empty slot (or the worker registered again) */
  } expired_recent[8];
  int32_t expired_next;
  int64_t expire_check_ns;     /* the last tw_router_expire_workers (0: none yet) */
  void *chat_ctx;              /* tokenizer + Harmony encoder (router_chat.c) */
  tw_http_t *http;             /* NULL: no HTTP API */
  struct {
    tw_metric_t *requests, *errors, *ttft, *tpot, *queue, *running, *prefill_workers,
        *decode_workers, *tokens, *expired, *harmony_unexpected, *resumed;
    /* named as vLLM's (vllm:X is twain_X; docs/operations.md "Metrics") */
    tw_metric_t *prompt_tokens, *generation_tokens, *v_ttft, *v_tpot, *e2e, *queue_time,
        *running_v, *waiting_v;
    tw_metric_t *finished[3]; /* request_success_total{finished_reason=stop|length|abort} */
    tw_metric_t *by_code[17]; /* request_errors_total{code=...}, by v1 Code */
  } m;
} tw_router_t;

/* ---- router.c ---- */
/** Bind the sockets, load config and tokenizer, start the metrics server
 *  (tw_router_run's set-up; also the fuzz harnesses'). Call tw_router_fini
 *  whatever it returns. Errors: those of tw_config_load, tw_rchat_init,
 *  tw_auth_keys_from_env, tw_msg_socket_open_auth, tw_metrics_create. */
TW_NODISCARD tw_status_t tw_router_init(tw_router_t *r, const tw_router_params_t *p);
void tw_router_fini(tw_router_t *r);
/** Handle one message from a client (validate, enqueue or answer). */
void tw_router_on_client_msg(tw_router_t *r, tw_msg_t *m);
/** Deadlines, gauges, and freeing finished requests. */
void tw_router_sweep(tw_router_t *r, int64_t now_ns);
/** Reply to a request's client. On a vanished client, cancels the request. */
void tw_router_reply(tw_router_t *r, tw_req_t *q, Twain__V1__ServerReply *rep);
/** Finish a request with an error code/message (v1 Code): reply, cancel its
 *  workers' work, mark it done. */
void tw_router_fail(tw_router_t *r, tw_req_t *q, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/** Handle one decoded client request (generate, chat or cancel) from `from`
 *  (a ZeroMQ peer or an HTTP connection, http_api.h); every outcome is a
 *  reply to `from`. The caller checked the API key. */
void tw_router_dispatch(tw_router_t *r, const tw_msg_t *from, Twain__V1__ClientRequest *cr);
/** Error messages go out in a proto3 string or a JSON body, which must be
 *  UTF-8: whatever they quote (a client's role or tool name, a model name, a
 *  worker's text) that is not becomes "\xNN" escapes. Writes at most cap - 1
 *  bytes (cap >= 1) and a NUL to out, cut on a UTF-8 boundary. */
void tw_utf8_escape(const char *in, char *out, size_t cap);
/** Whether `key` is the router's API key (constant time); true when the
 *  router has none. */
bool tw_router_key_ok(const tw_router_t *r, const char *key);
/** New tokens for a request from its decode or prefill worker. */
void tw_router_on_tokens(tw_router_t *r, tw_req_t *q, const int32_t *toks, size_t n,
                         bool finished, int finish_reason);
/** The unfinished request with internal id `id` (changes on each requeue), or NULL. */
tw_req_t *tw_router_find_req(tw_router_t *r, uint64_t id);
/** Send Cancel for q to its workers (those that hold something). */
void tw_router_cancel_workers(tw_router_t *r, tw_req_t *q);

/* ---- router_workers.c ---- */
/** Free the UCX addresses a worker registered (NULL-safe fields). */
void tw_rworker_free_addrs(tw_rworker_t *w);
tw_rworker_t *tw_router_worker(tw_router_t *r, uint64_t serial);
/** Handle one message on the worker socket. */
void tw_router_on_worker_msg(tw_router_t *r, tw_msg_t *m);
/** Expire silent workers; requeue or fail their requests. A worker's
 *  silence counts only the time the router was running: a gap between two
 *  calls longer than a quarter of the expiry (the router itself stalled) is
 *  credited to every worker, beyond that quarter. */
void tw_router_expire_workers(tw_router_t *r, int64_t now_ns);
/** Try to start queued requests (pick decode workers, send Reserve). */
void tw_router_schedule(tw_router_t *r, int64_t now_ns);
/** Send env (borrowed) to worker w; a failure is returned (TW_ERR_UNAVAILABLE:
 *  queue full, worker gone; TW_ERR_TRANSPORT, as tw_msg_send_to) and marks w
 *  unreachable for one expiry (tw_rworker_t.unreachable_until_ns; logged
 *  once at WARN when the mark is set, not for every send). */
TW_NODISCARD tw_status_t tw_router_send_worker(tw_router_t *r, tw_rworker_t *w,
                                               Twain__Internal__V1__Envelope *env);
/** Whether new work may go to w: registered, not draining, not marked
 *  unreachable (tw_router_send_worker) at `now_ns`. */
bool tw_router_worker_open(const tw_rworker_t *w, int64_t now_ns);
/** Run q again from the start under a new internal id (late messages about
 *  the old one are ignored): back to QUEUED, schedulable `delay_ns` from now;
 *  `cancel`: first tell its workers to drop what they hold for it. */
void tw_router_requeue(tw_router_t *r, tw_req_t *q, bool cancel, int64_t delay_ns);
/** Registered workers of `pool` that are not draining. */
int32_t tw_router_count_workers(const tw_router_t *r, Twain__Internal__V1__Pool pool);
/** Prefill workers (not draining) that have not yet answered every KvPeers
 *  the router sent them (decode pools to connect to ahead of traffic). */
int32_t tw_router_kv_peers_pending(const tw_router_t *r);
/** /healthz: 503 "not ready: no ... worker registered" while a pool is
 *  empty, 200 otherwise (left alone while draining). */
void tw_router_update_health(tw_router_t *r);

/* ---- router_chat.c ---- */
TW_NODISCARD tw_status_t tw_rchat_init(tw_router_t *r);
/** Free what tw_rchat_init loaded (tokenizer, Harmony); safe twice. */
void tw_rchat_fini(tw_router_t *r);
/** Render a ChatRequest to prompt ids + stop ids; creates q->hchat.
 *  Errors: TW_ERR_INVALID_ARGUMENT (bad message, tool schema...), with the
 *  message in tw_last_error(). */
TW_NODISCARD tw_status_t tw_rchat_start(tw_router_t *r, tw_req_t *q,
                                        const Twain__V1__ChatRequest *c);
/** Feed new tokens; fills rep->deltas/tool_calls (owned by q->hchat until
 *  the next call). Returns true if a stop string was hit (finish now). */
bool tw_rchat_feed(tw_router_t *r, tw_req_t *q, const int32_t *toks, size_t n,
                   Twain__V1__ServerReply *rep);
/** At the end: the parsed messages into rep (and remaining deltas). */
void tw_rchat_finish(tw_router_t *r, tw_req_t *q, Twain__V1__ServerReply *rep);
/** Whether q is in the choice pass of tool_choice REQUIRED among several
 *  tools (twain_api.proto ChatRequest.tool_choice): its prompt ends in
 *  "<|channel|>commentary to", it stops at the next Harmony special id, and
 *  its ids go to tw_rchat_choice_feed, never to the client. */
bool tw_rchat_choosing(const tw_req_t *q);
/** The max_tokens q runs with first: `max_tokens` (the request's), or during
 *  the choice pass only enough for "=functions.NAME" of its longest name and
 *  one id more (the request's is restored when the function is chosen). */
int32_t tw_rchat_pass_max_tokens(tw_router_t *r, tw_req_t *q, int32_t max_tokens);
/** Ids of the choice pass (`finished`: the worker ended it). Once it has
 *  ended (finished, or a Harmony special id) picks the function, sets
 *  *chosen_p, and turns q into the forced call: q->prompt = the rendered
 *  prompt + that call's header, the request's max_tokens and stop ids, the
 *  parser past the header; the caller runs q again from the start
 *  (tw_router_requeue). Errors: TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_rchat_choice_feed(tw_router_t *r, tw_req_t *q, const int32_t *toks,
                                              size_t n, bool finished, bool *chosen_p);
/** Free a chat request's parser state (no-op for generate requests). */
void tw_rchat_free(tw_req_t *q);
/** The router's tokenizer and its encoder (router thread only). */
void tw_rchat_tokenizer(tw_router_t *r, const tw_tokenizer_t **tok_p, tw_tok_encoder_t **enc_p);
/** Default stop ids for generate requests (<|return|>, <|call|>) if known. */
int32_t tw_rchat_default_stops(tw_router_t *r, int32_t *ids, int32_t cap);

#endif
