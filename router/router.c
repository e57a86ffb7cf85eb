/* router.c: the router's loop, the client side (twain.v1) and the request
 * lifecycle (see router.h). Requests are never freed where a handler can
 * still hold them: finishing marks `done`, the loop top frees them. */
#include "router/router_impl.h"

#include "common/base/log.h"
#include "common/comm/proto_engine.h"
#include "common/model/model_path.h"
#include "common/text/tokenizer.h"
#include "router/http_api.h"

#include <zmq.h>

#include <errno.h>
#include <malloc.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

/* The longest `ready` waits for prefill workers to connect to the decode
 * workers' kv pools (KvPeersReady): mapping a large pool over CUDA IPC
 * takes a fraction of a second; one that never answers delays ready no more. */
#define TW_ROUTER_KV_PEERS_WAIT_MS 30000

tw_req_t *tw_router_find_req(tw_router_t *r, uint64_t id) {
  for (int32_t i = 0; i < r->n_reqs; i++)
    if (r->reqs[i]->id == id && !r->reqs[i]->done) return r->reqs[i];
  return NULL;
}

static void tw_req_free(tw_req_t *q) {
  if (!q) return;
  tw_rchat_free(q);
  free(q->prompt);
  free(q->out);
  free(q->token_ms);
  free(q);
}

void tw_utf8_escape(const char *in, char *out, size_t cap) {
  size_t len = strlen(in), o = 0, i = 0;
  while (i < len) {
    size_t bad = len - i;
    size_t n = tw_utf8_valid(in + i, len - i, &bad) ? len - i : bad; /* the valid run */
    if (n > cap - 1 - o) { /* full: cut on a character boundary */
      n = cap - 1 - o;
      while (n && ((unsigned char)in[i + n] & 0xC0) == 0x80) n--;
      memcpy(out + o, in + i, n);
      o += n;
      break;
    }
    memcpy(out + o, in + i, n);
    o += n;
    i += n;
    if (i == len || o + 4 > cap - 1) break;
    snprintf(out + o, 5, "\\x%02X", (unsigned char)in[i]);
    o += 4;
    i++;
  }
  out[o] = '\0';
}

/* Send a reply to a ZeroMQ client or an HTTP connection (http_api.h). */
static TW_NODISCARD tw_status_t tw_router_send_client(tw_router_t *r, const uint8_t *id,
                                                      size_t id_len, bool delim,
                                                      Twain__V1__ServerReply *rep) {
  if (tw_http_owns(id, id_len)) return tw_http_on_reply(r->http, id, id_len, rep);
  return tw_msg_send_to(r->csock, id, id_len, delim, &rep->base);
}

bool tw_router_key_ok(const tw_router_t *r, const char *key) {
  const char *want = r->p->api_key;
  if (!want || !want[0]) return true;
  if (!key) key = "";
  size_t lw = strlen(want), lk = strlen(key);
  unsigned char diff = (unsigned char)(lw != lk);
  for (size_t i = 0; i < lw; i++) diff |= (unsigned char)(want[i] ^ key[i < lk ? i : 0]);
  return diff == 0;
}

/* Reply to a client that has no request object (bad input). */
static void tw_reply_raw(tw_router_t *r, const tw_msg_t *from, uint64_t rid, int code,
                         const char *msg) {
  Twain__V1__ServerReply rep = TWAIN__V1__SERVER_REPLY__INIT;
  Twain__V1__Error e = TWAIN__V1__ERROR__INIT;
  char safe[1024];
  rep.request_id = rid;
  rep.done = true;
  if (code) {
    tw_utf8_escape(msg ? msg : "", safe, sizeof safe);
    e.code = code;
    e.message = safe;
    rep.error = &e;
    rep.finish_reason = TWAIN__V1__FINISH_REASON__FINISH_ERROR;
    tw_metric_add(r->m.errors, 1);
    if (code > 0 && code < (int)(sizeof r->m.by_code / sizeof r->m.by_code[0]))
      tw_metric_add(r->m.by_code[code], 1);
  }
  /* no request to cancel: a client that cannot be answered is gone */
  tw_msg_note_failure(tw_router_send_client(r, from->id, from->id_len, from->delim, &rep), "router",
                      "cannot answer a client");
}

static void tw_router_finished(tw_router_t *r, const tw_req_t *q, int64_t now, int finish_reason,
                               int code);

void tw_router_reply(tw_router_t *r, tw_req_t *q, Twain__V1__ServerReply *rep) {
  rep->request_id = q->client_rid;
  tw_status_t st = tw_router_send_client(r, q->cid, q->cid_len, q->cdelim, rep);
  if (st != TW_OK && !q->done) {
    TW_INFO("router", "request %llu: client gone (%s): cancelling", (unsigned long long)q->id,
            tw_last_error());
    tw_router_cancel_workers(r, q);
    /* ended by its client's going, as by a cancel (the last reply's sender
     * counts the request itself) */
    if (!rep->done)
      tw_router_finished(r, q, tw_msg_clock_ns(), TWAIN__V1__FINISH_REASON__FINISH_CANCELLED, 0);
    q->done = true;
  }
}

void tw_router_cancel_workers(tw_router_t *r, tw_req_t *q) {
  Twain__Internal__V1__Cancel c = TWAIN__INTERNAL__V1__CANCEL__INIT;
  c.request_id = q->id;
  /* reserving: no PrefillRequest went out under this id (ids are per attempt) */
  c.unused = q->state == TW_REQ_RESERVING;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_CANCEL;
  env.cancel = &c;
  tw_rworker_t *d = q->dw ? tw_router_worker(r, q->dw) : NULL;
  tw_rworker_t *p = q->state == TW_REQ_PREFILLING && q->pw ? tw_router_worker(r, q->pw) : NULL;
  /* best effort: a worker that misses it expires the request itself (logged there) */
  if (d && q->state != TW_REQ_QUEUED) TW_IGNORE(tw_router_send_worker(r, d, &env));
  if (p) TW_IGNORE(tw_router_send_worker(r, p, &env));
}

static void tw_fill_timings(tw_req_t *q, int64_t now, Twain__V1__Timings *t, Twain__V1__Usage *u) {
  u->prompt_tokens = q->n_prompt;
  u->completion_tokens = q->n_out;
  t->ttft_ms = q->t_first_ns ? (double)(q->t_first_ns - q->t_arrival_ns) * 1e-6 : 0;
  t->total_ms = (double)(now - q->t_arrival_ns) * 1e-6;
  t->mean_tpot_ms = q->n_out > 1 ? (double)(q->t_last_ns - q->t_first_ns) * 1e-6 / (q->n_out - 1) : 0;
  t->n_token_ms = (size_t)q->n_out;
  t->token_ms = q->token_ms;
}

static const char *tw_v1_enum_name(const ProtobufCEnumDescriptor *d, int v, const char *dflt) {
  const ProtobufCEnumValue *x = protobuf_c_enum_descriptor_get_value(d, v);
  return x ? x->name : dflt;
}

/* A request is over (reply sent): its metrics under vLLM's names, and one
 * INFO line unless --disable-log-requests (finish reason, or the error code). */
static void tw_router_finished(tw_router_t *r, const tw_req_t *q, int64_t now, int finish_reason,
                               int code) {
  double e2e = (double)(now - q->t_arrival_ns) * 1e-9;
  double queue = (double)((q->t_sched_ns ? q->t_sched_ns : now) - q->t_arrival_ns) * 1e-9;
  double ttft = q->t_first_ns ? (double)(q->t_first_ns - q->t_arrival_ns) * 1e-9 : 0;
  double tpot = q->n_out > 1 ? (double)(q->t_last_ns - q->t_first_ns) * 1e-9 / (q->n_out - 1) : 0;
  tw_metric_add(r->m.prompt_tokens, q->n_prompt);
  tw_metric_add(r->m.generation_tokens, q->n_out);
  tw_metric_observe(r->m.e2e, e2e);
  tw_metric_observe(r->m.queue_time, queue);
  if (q->n_out > 1) tw_metric_observe(r->m.v_tpot, tpot);
  int fr = finish_reason == TWAIN__V1__FINISH_REASON__FINISH_LENGTH      ? 1
           : finish_reason == TWAIN__V1__FINISH_REASON__FINISH_CANCELLED ? 2
           : code                                                        ? -1
                                                                         : 0;
  if (fr >= 0) tw_metric_add(r->m.finished[fr], 1);
  if (code > 0 && code < (int)(sizeof r->m.by_code / sizeof r->m.by_code[0]))
    tw_metric_add(r->m.by_code[code], 1);
  if (r->p->disable_log_requests) return;
  const char *reason = fr == 1 ? "length" : fr == 2 ? "abort" : fr == 0 ? "stop" : "error";
  TW_INFO("router",
          "request %llu finished: %s%s%s, prompt %d tokens, output %d tokens, ttft %.1f ms, tpot "
          "%.2f ms, e2e %.1f ms, queue %.1f ms",
          (unsigned long long)q->id, reason, code && fr != 2 ? " " : "",
          code && fr != 2 ? tw_v1_enum_name(&twain__v1__code__descriptor, code, "UNKNOWN") : "",
          q->n_prompt, q->n_out, ttft * 1e3, tpot * 1e3, e2e * 1e3, queue * 1e3);
}

void tw_router_fail(tw_router_t *r, tw_req_t *q, int code, const char *fmt, ...) {
  if (q->done) return;
  char raw[512], msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  tw_utf8_escape(raw, msg, sizeof msg);
  TW_INFO("router", "request %llu failed: %s", (unsigned long long)q->id, msg);
  tw_router_cancel_workers(r, q);
  Twain__V1__ServerReply rep = TWAIN__V1__SERVER_REPLY__INIT;
  Twain__V1__Error e = TWAIN__V1__ERROR__INIT;
  Twain__V1__Usage u = TWAIN__V1__USAGE__INIT;
  Twain__V1__Timings t = TWAIN__V1__TIMINGS__INIT;
  e.code = code;
  e.message = msg;
  rep.error = &e;
  rep.done = true;
  rep.finish_reason = code == TWAIN__V1__CODE__CANCELLED ? TWAIN__V1__FINISH_REASON__FINISH_CANCELLED
                                                         : TWAIN__V1__FINISH_REASON__FINISH_ERROR;
  tw_fill_timings(q, tw_msg_clock_ns(), &t, &u);
  rep.usage = &u;
  rep.timings = &t;
  if (!q->stream) { /* what was produced before the failure */
    rep.token_ids = q->out;
    rep.n_token_ids = (size_t)q->n_out;
  }
  tw_router_reply(r, q, &rep);
  tw_metric_add(r->m.errors, 1);
  tw_router_finished(r, q, tw_msg_clock_ns(), rep.finish_reason, code);
  q->done = true;
}

void tw_router_on_tokens(tw_router_t *r, tw_req_t *q, const int32_t *toks, size_t n,
                         bool finished, int finish_reason) {
  if (q->chat && tw_rchat_choosing(q)) { /* tool_choice required: which function */
    bool chosen = false;
    if (tw_rchat_choice_feed(r, q, toks, n, finished, &chosen) != TW_OK) {
      tw_router_fail(r, q, TWAIN__V1__CODE__RESOURCE_EXHAUSTED, "router out of memory");
    } else if (chosen && q->n_prompt > r->max_prompt) {
      tw_router_fail(r, q, TWAIN__V1__CODE__INVALID_ARGUMENT,
                     "rendered prompt of %d tokens (with the "
                     "call's header) exceeds the limit of %d",
                     q->n_prompt, r->max_prompt);
    } else if (chosen && q->max_default && q->n_prompt < r->config.max_position_embeddings &&
               (int64_t)q->n_prompt + q->max_tokens > r->config.max_position_embeddings) {
      /* the call's header took some of what a default max_tokens had left */
      q->max_tokens = r->config.max_position_embeddings - q->n_prompt;
      tw_router_requeue(r, q, !finished, 0);
      q->attempts = 0;
    } else if (chosen && (int64_t)q->n_prompt + q->max_tokens > r->config.max_position_embeddings) {
      tw_router_fail(
          r, q, TWAIN__V1__CODE__INVALID_ARGUMENT,
          "prompt of %d tokens (with the call's header) + max_tokens %d exceeds the model "
          "context of %d",
          q->n_prompt, q->max_tokens, r->config.max_position_embeddings);
    } else if (chosen) { /* now the call itself, from a new prefill */
      tw_router_requeue(r, q, !finished, 0);
      q->attempts = 0;
    }
    return;
  }
  int64_t now = tw_msg_clock_ns();
  size_t room = (size_t)(q->max_tokens - q->n_out);
  if (n > room) n = room; /* never more than asked for */
  for (size_t i = 0; i < n; i++) {
    q->token_ms[q->n_out] = q->n_out ? (float)((now - q->t_last_ns) * 1e-6)
                                     : (float)((now - q->t_arrival_ns) * 1e-6);
    if (q->n_out == 0) {
      q->t_first_ns = now;
      tw_metric_observe(r->m.ttft, (double)(now - q->t_arrival_ns) * 1e-9);
      tw_metric_observe(r->m.v_ttft, (double)(now - q->t_arrival_ns) * 1e-9);
    } else {
      tw_metric_observe(r->m.tpot, (double)(now - q->t_last_ns) * 1e-9);
    }
    q->t_last_ns = now;
    q->out[q->n_out++] = toks[i];
  }
  tw_metric_add(r->m.tokens, (double)n);
  Twain__V1__ServerReply rep = TWAIN__V1__SERVER_REPLY__INIT;
  bool stop_hit = false;
  if (q->chat) stop_hit = tw_rchat_feed(r, q, toks, n, &rep);
  if (stop_hit && !finished) {
    finished = true;
    finish_reason = TWAIN__V1__FINISH_REASON__FINISH_STOP;
    tw_router_cancel_workers(r, q);
  }
  if (q->n_out >= q->max_tokens && !finished) { /* decode will say so too; be safe */
    finished = true;
    finish_reason = TWAIN__V1__FINISH_REASON__FINISH_LENGTH;
    tw_router_cancel_workers(r, q);
  }
  if (!finished) {
    if (q->stream && n) {
      rep.token_ids = (int32_t *)toks;
      rep.n_token_ids = n;
      if (rep.n_token_ids || rep.n_deltas || rep.n_tool_calls) tw_router_reply(r, q, &rep);
    }
    return;
  }
  Twain__V1__Usage u = TWAIN__V1__USAGE__INIT;
  Twain__V1__Timings t = TWAIN__V1__TIMINGS__INIT;
  tw_fill_timings(q, now, &t, &u);
  rep.usage = &u;
  rep.timings = &t;
  rep.done = true;
  rep.finish_reason = finish_reason ? finish_reason : TWAIN__V1__FINISH_REASON__FINISH_STOP;
  /* raw ids for both kinds: the new ones when streaming, else all of them */
  rep.token_ids = q->stream ? (int32_t *)toks : q->out;
  rep.n_token_ids = q->stream ? n : (size_t)q->n_out;
  if (q->chat) tw_rchat_finish(r, q, &rep);
  bool gone = q->done; /* the client vanished before: not a finished request */
  tw_router_reply(r, q, &rep);
  if (!gone) tw_router_finished(r, q, now, rep.finish_reason, 0);
  q->done = true;
}

static TW_NODISCARD tw_status_t tw_sampling_check(const Twain__V1__SamplingParams *s, char *msg,
                                                  size_t len) {
  if (!s) return TW_OK;
  if (s->temperature != s->temperature || s->temperature < 0 || s->temperature > 100) {
    snprintf(msg, len, "temperature %g is outside [0, 100]", (double)s->temperature);
    return TW_ERR_INVALID_ARGUMENT;
  }
  if (s->top_p != s->top_p || s->top_p < 0 || s->top_p > 1) {
    snprintf(msg, len, "top_p %g is outside [0, 1]", (double)s->top_p);
    return TW_ERR_INVALID_ARGUMENT;
  }
  if (s->top_k < 0) {
    snprintf(msg, len, "top_k %d is negative", s->top_k);
    return TW_ERR_INVALID_ARGUMENT;
  }
  return TW_OK;
}

/* The request in flight (not done) that client `from` sent as `rid`, or NULL. */
static tw_req_t *tw_client_req(tw_router_t *r, const tw_msg_t *from, uint64_t rid) {
  for (int32_t i = 0; i < r->n_reqs; i++) {
    tw_req_t *q = r->reqs[i];
    if (!q->done && q->client_rid == rid && q->cid_len == from->id_len &&
        memcmp(q->cid, from->id, from->id_len) == 0)
      return q;
  }
  return NULL;
}

/* A fresh sampling seed for a request that did not give one (splitmix64 over
 * a state drawn from the kernel's random source at start-up). */
static uint64_t tw_router_draw_seed(tw_router_t *r) {
  uint64_t z = (r->seed_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Validate and enqueue a Generate or Chat request. */
static void tw_router_on_request(tw_router_t *r, const tw_msg_t *from, Twain__V1__ClientRequest *cr) {
  char msg[512];
  const Twain__V1__SamplingParams *s =
      cr->body_case == TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE ? cr->generate->sampling
                                                                 : cr->chat->sampling;
  if (r->draining) {
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__UNAVAILABLE, "router is draining");
    return;
  }
  if (r->n_reqs >= r->p->max_requests) {
    snprintf(msg, sizeof msg, "too many concurrent requests: the limit is %d", r->p->max_requests);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__RESOURCE_EXHAUSTED, msg);
    return;
  }
  if (tw_sampling_check(s, msg, sizeof msg) != TW_OK) {
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  const bool stream = cr->body_case == TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE
                          ? cr->generate->stream
                          : cr->chat->stream;
  if (from->delim && stream) { /* a REQ socket: its next request would read this stream's rest */
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT,
                 "stream = true on a REQ socket, which takes one reply a request (the stream's "
                 "later replies would answer its next request): set stream = false, or stream "
                 "on a DEALER socket");
    return;
  }
  if (s && s->n_stop_token_ids > TW_RMAX_USER_STOP) {
    snprintf(msg, sizeof msg, "stop_token_ids: at most %d ids, got %zu", TW_RMAX_USER_STOP,
             s->n_stop_token_ids);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  for (size_t i = 0; s && i < s->n_stop_token_ids; i++) {
    if (s->stop_token_ids[i] >= 0 && s->stop_token_ids[i] < r->config.vocab_size) continue;
    snprintf(msg, sizeof msg, "stop_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
             s->stop_token_ids[i], r->config.vocab_size);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  int32_t max_tokens = s && s->max_tokens ? s->max_tokens : r->p->default_max_tokens;
  /* a default (not the client's number) shrinks to what the context leaves */
  bool max_default = !s || s->max_tokens_is_default || (!s->max_tokens && !s->explicit_max_tokens);
  if (s && (s->max_tokens < 0 || (s->explicit_max_tokens && s->max_tokens == 0))) {
    snprintf(msg, sizeof msg, "max_tokens must be at least 1, got %d", s->max_tokens);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  if (max_tokens > r->max_tokens_limit) {
    snprintf(msg, sizeof msg, "max_tokens %d exceeds this server's limit of %d", max_tokens,
             r->max_tokens_limit);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  if (tw_client_req(r, from, cr->request_id)) { /* replies and cancels name requests by it */
    snprintf(msg, sizeof msg,
             "request_id %llu is already in flight on this connection: request ids must be unique "
             "among a client's requests in flight",
             (unsigned long long)cr->request_id);
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, msg);
    return;
  }
  tw_req_t *q = calloc(1, sizeof *q);
  if (!q) {
    tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__RESOURCE_EXHAUSTED, "router out of memory");
    return;
  }
  q->id = r->next_req_id++;
  memcpy(q->cid, from->id, from->id_len);
  q->cid_len = from->id_len;
  q->cdelim = from->delim;
  q->client_rid = cr->request_id;
  q->t_arrival_ns = tw_msg_clock_ns();
  int64_t dl = cr->deadline_ms ? (int64_t)cr->deadline_ms : (int64_t)r->p->default_deadline_ms;
  q->t_deadline_ns = q->t_arrival_ns + dl * 1000000;
  tw_proto_sampling_from_api(s, &q->sampling);
  /* a seed of the client's: explicit_seed, or any non-zero seed (what
   * clients sent before explicit_seed existed) */
  if (!(s && (s->explicit_seed || s->seed))) q->sampling.seed = tw_router_draw_seed(r);
  tw_status_t st = TW_OK;
  if (cr->body_case == TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE) {
    const Twain__V1__GenerateRequest *g = cr->generate;
    q->stream = g->stream;
    q->n_prompt = (int32_t)g->n_prompt_ids;
    if (g->n_prompt_ids == 0) {
      st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "prompt_ids is empty");
    } else if (g->n_prompt_ids > (size_t)r->max_prompt) {
      st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "prompt of %zu tokens exceeds the limit of %d",
                        g->n_prompt_ids, r->max_prompt);
    } else if (!(q->prompt = malloc(sizeof(int32_t) * g->n_prompt_ids))) {
      st = tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
    } else {
      for (size_t i = 0; i < g->n_prompt_ids && st == TW_OK; i++) {
        if (g->prompt_ids[i] < 0 || g->prompt_ids[i] >= r->config.vocab_size)
          st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "prompt_ids[%zu] = %d is outside [0, %d)", i,
                            g->prompt_ids[i], r->config.vocab_size);
        else
          q->prompt[i] = g->prompt_ids[i];
      }
    }
    for (size_t i = 0; s && i < s->n_stop_token_ids && q->n_stop < TW_RMAX_STOP; i++)
      q->stop_ids[q->n_stop++] = s->stop_token_ids[i];
  } else {
    q->chat = true;
    q->stream = cr->chat->stream;
    st = tw_rchat_start(r, q, cr->chat);
    if (st == TW_OK && q->n_prompt > r->max_prompt)
      st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "rendered prompt of %d tokens exceeds the limit of %d",
                        q->n_prompt, r->max_prompt);
  }
  if (st == TW_OK && max_default && q->n_prompt < r->config.max_position_embeddings &&
      (int64_t)q->n_prompt + max_tokens > r->config.max_position_embeddings)
    max_tokens = r->config.max_position_embeddings - q->n_prompt;
  if (st == TW_OK && (int64_t)q->n_prompt + max_tokens > r->config.max_position_embeddings)
    st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                      "prompt of %d tokens + max_tokens %d exceeds the model context of %d",
                      q->n_prompt, max_tokens, r->config.max_position_embeddings);
  q->max_default = max_default;
  q->max_tokens = st == TW_OK ? tw_rchat_pass_max_tokens(r, q, max_tokens) : max_tokens;
  if (st == TW_OK) {
    q->out = malloc(sizeof(int32_t) * (size_t)max_tokens);
    q->token_ms = malloc(sizeof(float) * (size_t)max_tokens);
    if (!q->out || !q->token_ms) st = tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
  }
  if (st == TW_OK && r->n_reqs == r->cap_reqs) {
    int32_t cap = r->cap_reqs ? r->cap_reqs * 2 : 256;
    tw_req_t **t = realloc(r->reqs, sizeof *t * (size_t)cap);
    if (!t) st = tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
    else {
      r->reqs = t;
      r->cap_reqs = cap;
    }
  }
  if (st != TW_OK) {
    tw_reply_raw(r, from, cr->request_id, tw_status_wire_code(st), tw_last_error());
    tw_req_free(q);
    return;
  }
  q->state = TW_REQ_QUEUED;
  r->reqs[r->n_reqs++] = q;
  tw_metric_add(r->m.requests, 1);
  TW_DEBUG("router", "request %llu: %s, %d prompt tokens, max_tokens %d", (unsigned long long)q->id,
           q->chat ? "chat" : "generate", q->n_prompt, q->max_tokens);
}

static void tw_router_on_cancel(tw_router_t *r, const tw_msg_t *from, const Twain__V1__ClientRequest *cr) {
  uint64_t target = cr->cancel->target_request_id;
  tw_req_t *q = tw_client_req(r, from, target);
  if (q && !q->done && cr->cancel->stopped && !(q->chat && tw_rchat_choosing(q))) {
    /* the client's own stop: a request finished by a stop, its output so far */
    tw_router_cancel_workers(r, q);
    tw_router_on_tokens(r, q, NULL, 0, true, TWAIN__V1__FINISH_REASON__FINISH_STOP);
    tw_reply_raw(r, from, cr->request_id, 0, NULL);
    return;
  }
  if (q) {
    tw_router_fail(r, q, TWAIN__V1__CODE__CANCELLED, "request %llu cancelled by the client",
                   (unsigned long long)target);
    tw_reply_raw(r, from, cr->request_id, 0, NULL);
    return;
  }
  char msg[128];
  snprintf(msg, sizeof msg, "cancel: no running request %llu from this client",
           (unsigned long long)target);
  tw_reply_raw(r, from, cr->request_id, TWAIN__V1__CODE__NOT_FOUND, msg);
}

void tw_router_on_client_msg(tw_router_t *r, tw_msg_t *m) {
  Twain__V1__ClientRequest *cr = twain__v1__client_request__unpack(NULL, m->len, m->data);
  if (!cr) {
    static tw_msg_ratelimit_t rl; /* a bad client must not flood the log */
    uint64_t sup = 0;
    if (tw_msg_ratelimit(&rl, &sup)) {
      if (sup) TW_WARN("router", "suppressed %llu similar warnings", (unsigned long long)sup);
      TW_WARN("router", "malformed protobuf from a client (%zu bytes)", m->len);
    }
    tw_reply_raw(r, m, 0, TWAIN__V1__CODE__INVALID_ARGUMENT,
                 "malformed request: not a twain.v1.ClientRequest protobuf");
    return;
  }
  if (tw_msg_check_strings(&twain__v1__client_request__descriptor, m->data, m->len) != TW_OK) {
    tw_reply_raw(r, m, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT, tw_last_error());
    twain__v1__client_request__free_unpacked(cr, NULL);
    return;
  }
  if (!tw_router_key_ok(r, cr->api_key))
    tw_reply_raw(r, m, cr->request_id, TWAIN__V1__CODE__UNAUTHENTICATED,
                 cr->api_key && cr->api_key[0] ? "api_key is wrong" :
                 "this router requires an API key: set api_key (twain chat: TWAIN_API_KEY)");
  else
    tw_router_dispatch(r, m, cr);
  twain__v1__client_request__free_unpacked(cr, NULL);
}

void tw_router_dispatch(tw_router_t *r, const tw_msg_t *m, Twain__V1__ClientRequest *cr) {
  switch (cr->body_case) {
    case TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE:
    case TWAIN__V1__CLIENT_REQUEST__BODY_CHAT: tw_router_on_request(r, m, cr); break;
    case TWAIN__V1__CLIENT_REQUEST__BODY_CANCEL: tw_router_on_cancel(r, m, cr); break;
    default:
      tw_reply_raw(r, m, cr->request_id, TWAIN__V1__CODE__INVALID_ARGUMENT,
                   "unknown request type: set one of generate, chat or cancel");
  }
}

/* Deadlines, then drop finished requests (the only place requests are freed). */
void tw_router_sweep(tw_router_t *r, int64_t now) {
  int32_t running = 0, queued = 0;
  for (int32_t i = 0; i < r->n_reqs; i++) {
    tw_req_t *q = r->reqs[i];
    if (!q->done && now > q->t_deadline_ns)
      tw_router_fail(r, q, TWAIN__V1__CODE__DEADLINE_EXCEEDED, "deadline of %lld ms exceeded",
                     (long long)((q->t_deadline_ns - q->t_arrival_ns) / 1000000));
    if (!q->done) {
      running += q->state != TW_REQ_QUEUED;
      queued += q->state == TW_REQ_QUEUED;
    }
  }
  int32_t j = 0;
  for (int32_t i = 0; i < r->n_reqs; i++) {
    if (r->reqs[i]->done) tw_req_free(r->reqs[i]);
    else r->reqs[j++] = r->reqs[i];
  }
  r->n_reqs = j;
  tw_metric_set(r->m.running, running);
  tw_metric_set(r->m.queue, queued);
  tw_metric_set(r->m.running_v, running);
  tw_metric_set(r->m.waiting_v, queued);
}

TW_NODISCARD tw_status_t tw_router_init(tw_router_t *r, const tw_router_params_t *p) {
  memset(r, 0, sizeof *r);
  r->p = p;
  /* Client messages of many MiB (a 20 MiB prompt) are allocated and freed per
   * request; with glibc's dynamic mmap threshold they end up in the heap and
   * stay resident after the burst. A fixed threshold keeps every block of
   * 1 MiB or more in its own mapping, returned to the system when freed. */
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  r->next_worker_serial = 1;
  r->next_req_id = 1;
  if (getrandom(&r->seed_state, sizeof r->seed_state, 0) != (ssize_t)sizeof r->seed_state)
    r->seed_state = (uint64_t)tw_msg_clock_ns() ^ ((uint64_t)getpid() << 32);
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", p->model_dir);
  TW_CHECK(tw_config_load(path, &r->config));
  r->max_prompt = p->max_prompt_tokens > 0 ? p->max_prompt_tokens : r->config.max_position_embeddings - 1;
  r->max_tokens_limit =
      p->max_tokens_limit > 0 ? p->max_tokens_limit : r->config.max_position_embeddings - 1;
  TW_CHECK(tw_rchat_init(r));
  r->zctx = zmq_ctx_new();
  if (!r->zctx) return tw_err(TW_ERR_TRANSPORT, "zmq_ctx_new failed: %s", zmq_strerror(errno));
  char cep[256], wep[256];
  TW_CHECK(tw_auth_keys_from_env("router worker socket", &r->keys));
  TW_CHECK(tw_auth_guard_start(r->zctx, &r->keys, "router worker socket", true, &r->guard));
  /* the client socket: a context of its own, so its ZAP handler (any key or
   * an allow-list) is not the worker socket's (only the deployment's key) */
  r->czctx = zmq_ctx_new();
  if (!r->czctx) return tw_err(TW_ERR_TRANSPORT, "zmq_ctx_new failed: %s", zmq_strerror(errno));
  const char *allow =
      p->client_allow_file ? p->client_allow_file : getenv(TW_AUTH_CLIENT_ALLOW_ENV);
  TW_CHECK(tw_auth_socket_keys("router client socket", p->client_keys_file, &r->ckeys));
  TW_CHECK(
      tw_auth_guard_start_clients(r->czctx, &r->ckeys, "router client socket", allow, &r->cguard));
  TW_CHECK(tw_msg_socket_open_auth(r->czctx, ZMQ_ROUTER, p->client_endpoint, true, &r->ckeys, cep,
                                   sizeof cep, &r->csock));
  TW_CHECK(tw_auth_guard_watch(r->cguard, r->csock, "client socket"));
  TW_CHECK(tw_msg_socket_open_auth(r->zctx, ZMQ_ROUTER, p->worker_endpoint, true, &r->keys, wep,
                                   sizeof wep, &r->wsock));
  TW_CHECK(tw_auth_guard_watch(r->guard, r->wsock, "worker socket"));
  TW_CHECK(tw_metrics_create("router", p->metrics_port, p->metrics_addr, &r->metrics));
  tw_metrics_t *M = r->metrics;
  r->m.requests = tw_metrics_counter(M, "router_requests_total", "requests accepted");
  r->m.errors = tw_metrics_counter(M, "router_request_errors_total", "requests answered with an error");
  r->m.ttft = tw_metrics_histogram(M, "router_ttft_seconds", "time to first token",
                                   tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.tpot = tw_metrics_histogram(M, "router_tpot_seconds", "time per output token",
                                   tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.queue = tw_metrics_gauge(M, "router_queue_depth", "requests waiting for a decode worker");
  r->m.running = tw_metrics_gauge(M, "router_running_requests", "requests being served");
  r->m.prefill_workers = tw_metrics_gauge(M, "router_prefill_workers", "registered prefill workers");
  r->m.decode_workers = tw_metrics_gauge(M, "router_decode_workers", "registered decode workers");
  r->m.tokens = tw_metrics_counter(M, "router_tokens_streamed_total", "tokens sent to clients");
  r->m.expired = tw_metrics_counter(M, "router_workers_expired_total", "workers that stopped heartbeating");
  r->m.resumed =
      tw_metrics_counter(M, "router_requests_resumed_total",
                         "streams resumed on another decode worker after theirs was lost");
  r->empty_since_ns[0] = r->empty_since_ns[1] = tw_msg_clock_ns(); /* no worker yet */
  r->m.harmony_unexpected = tw_metrics_counter(M, "router_harmony_unexpected_total",
                                               "model output the Harmony parser did not expect");
  /* vLLM's names (vllm:X is twain_X) with a model_name label: dashboards made
   * for vLLM work on twain by replacing the prefix (docs/operations.md) */
  char model_name[256];
  tw_model_name(p->served_model_name, p->model_dir, model_name, sizeof model_name);
  tw_metrics_set_label(M, "model_name", model_name);
  r->m.prompt_tokens = tw_metrics_counter(M, "prompt_tokens_total", "prompt tokens of finished requests");
  r->m.generation_tokens =
      tw_metrics_counter(M, "generation_tokens_total", "tokens generated for finished requests");
  r->m.v_ttft = tw_metrics_histogram(M, "time_to_first_token_seconds", "time to first token",
                                     tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.v_tpot = tw_metrics_histogram(M, "time_per_output_token_seconds",
                                     "mean time per output token after the first, per request",
                                     tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.e2e = tw_metrics_histogram(M, "e2e_request_latency_seconds", "arrival to the last reply",
                                  tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.queue_time = tw_metrics_histogram(M, "request_queue_time_seconds",
                                         "arrival to the first prefill worker",
                                         tw_metrics_latency_buckets, tw_metrics_latency_n);
  r->m.running_v = tw_metrics_gauge(M, "num_requests_running", "requests in prefill or decode");
  r->m.waiting_v = tw_metrics_gauge(M, "num_requests_waiting", "requests waiting for workers");
  static const char *const reasons[3] = {"stop", "length", "abort"};
  for (int k = 0; k < 3; k++)
    r->m.finished[k] = tw_metrics_counter_labeled(M, "request_success_total",
                                                  "finished requests by finish reason",
                                                  "finished_reason", reasons[k]);
  for (unsigned k = 0; k < twain__v1__code__descriptor.n_values; k++) {
    int v = twain__v1__code__descriptor.values[k].value;
    if (v > 0 && v < (int)(sizeof r->m.by_code / sizeof r->m.by_code[0]))
      r->m.by_code[v] = tw_metrics_counter_labeled(M, "request_errors_total",
                                                   "requests answered with an error, by code", "code",
                                                   twain__v1__code__descriptor.values[k].name);
  }
  TW_CHECK(tw_http_start(r, &r->http));
  tw_router_update_health(r); /* not ready until both pools have a worker */
  TW_INFO("router", "listening: clients %s (%s), workers %s (%s), metrics port %d", cep,
          r->ckeys.plaintext ? "plaintext" : "CURVE", wep,
          r->keys.plaintext ? "PLAINTEXT, unauthenticated" : "CURVE, authenticated",
          tw_metrics_port(r->metrics));
  if (p->on_bound) p->on_bound(p->on_bound_arg, cep, wep);
  return TW_OK;
}

void tw_router_fini(tw_router_t *r) {
  tw_http_stop(r->http); /* first: its connections may still name requests */
  r->http = NULL;
  for (int32_t i = 0; i < r->n_reqs; i++) tw_req_free(r->reqs[i]);
  free(r->reqs);
  for (int32_t i = 0; i < r->n_workers; i++) tw_rworker_free_addrs(&r->workers[i]);
  free(r->workers);
  if (r->csock) zmq_close(r->csock);
  if (r->wsock) zmq_close(r->wsock);
  tw_auth_guard_stop(r->guard);
  tw_auth_guard_stop(r->cguard);
  memset(&r->keys, 0, sizeof r->keys);
  memset(&r->ckeys, 0, sizeof r->ckeys);
  if (r->zctx) zmq_ctx_term(r->zctx);
  if (r->czctx) zmq_ctx_term(r->czctx);
  tw_metrics_destroy(r->metrics);
  tw_rchat_fini(r);
}

static void tw_router_warn_bad_frame(tw_router_t *r) {
  (void)r;
  static tw_msg_ratelimit_t rl;
  uint64_t sup = 0;
  if (!tw_msg_ratelimit(&rl, &sup)) return;
  if (sup) TW_WARN("router", "suppressed %llu similar warnings", (unsigned long long)sup);
  TW_WARN("router", "bad message on the worker socket: %s", tw_last_error());
}

TW_NODISCARD tw_status_t tw_router_run(const tw_router_params_t *p, atomic_int *stop) {
  tw_router_t r;
  tw_status_t st = tw_router_init(&r, p);
  if (st != TW_OK) {
    tw_router_fini(&r);
    return st;
  }
  int64_t drain_since = 0;
  for (;;) {
    int64_t now = tw_msg_clock_ns();
    if (atomic_load(stop) && !r.draining) {
      r.draining = true;
      drain_since = now;
      tw_metrics_set_health(r.metrics, false, "draining");
      TW_INFO("router", "draining: %d requests in flight", r.n_reqs);
    }
    if (r.draining && r.n_reqs > 0 && now - drain_since > (int64_t)p->drain_timeout_s * 1000000000LL) {
      TW_WARN("router", "drain timeout (%d s): failing %d requests", p->drain_timeout_s, r.n_reqs);
      break;
    }
    if (r.draining && r.n_reqs > 0 && atomic_load(stop) >= 2) {
      TW_WARN("router", "second stop signal: failing %d requests", r.n_reqs);
      break;
    }
    if (r.draining && r.n_reqs == 0) break;
    zmq_pollitem_t items[3] = {{.socket = r.csock, .events = ZMQ_POLLIN},
                               {.socket = r.wsock, .events = ZMQ_POLLIN},
                               {.fd = tw_http_fd(r.http), .events = ZMQ_POLLIN}};
    /* idle (nothing in flight): wake only for messages, or every 100 ms to expire
     * workers; sooner where the HTTP server has work ready without a new event */
    int rc = zmq_poll(items, r.http ? 3 : 2, tw_http_wait_ms(r.http, r.n_reqs ? 10 : 100));
    if (rc < 0 && errno != EINTR) {
      st = tw_err(TW_ERR_TRANSPORT, "zmq_poll failed: %s", zmq_strerror(errno));
      break;
    }
    /* workers first: their tokens free capacity for new requests */
    for (int k = 0; k < 4096; k++) {
      tw_msg_t m = {0};
      tw_status_t rs = tw_msg_recv(r.wsock, true, 0, &m);
      if (rs == TW_INPROGRESS) break;
      if (rs == TW_OK) tw_router_on_worker_msg(&r, &m);
      else tw_router_warn_bad_frame(&r);
      tw_msg_fini(&m);
    }
    for (int k = 0; k < 1024; k++) {
      tw_msg_t m = {0};
      tw_status_t rs = tw_msg_recv(r.csock, true, 0, &m);
      if (rs == TW_INPROGRESS) break;
      if (rs == TW_OK) tw_router_on_client_msg(&r, &m);
      else if (rs == TW_ERR_FORMAT && m.id_len)
        tw_reply_raw(&r, &m, 0, TWAIN__V1__CODE__INVALID_ARGUMENT, tw_last_error());
      tw_msg_fini(&m);
    }
    tw_http_run(r.http); /* new HTTP requests; writes what the replies queued */
    now = tw_msg_clock_ns();
    tw_router_expire_workers(&r, now);
    tw_router_schedule(&r, now);
    tw_router_sweep(&r, now);
    if (!r.ready_sent && tw_router_count_workers(&r, TWAIN__INTERNAL__V1__POOL__POOL_PREFILL) >= p->expect_prefill &&
        tw_router_count_workers(&r, TWAIN__INTERNAL__V1__POOL__POOL_DECODE) >= p->expect_decode) {
      /* ready once the prefill workers have connected to the decode pools
       * (KvPeersReady), so the first request does not pay for it; a worker
       * that does not answer delays ready by TW_ROUTER_KV_PEERS_WAIT_MS at most */
      if (!r.ready_wait_ns) r.ready_wait_ns = now;
      int32_t pending = tw_router_kv_peers_pending(&r);
      bool waited = now - r.ready_wait_ns > (int64_t)TW_ROUTER_KV_PEERS_WAIT_MS * 1000000;
      if (pending && waited)
        TW_WARN("router",
                "%d prefill workers did not report their decode kv peers connected in "
                "%d ms: ready anyway (they connect at their first handoff)",
                pending, TW_ROUTER_KV_PEERS_WAIT_MS);
      if (!pending || waited) {
        r.ready_sent = true;
        if (p->on_ready) p->on_ready(p->on_ready_arg);
      }
    }
  }
  for (int32_t i = 0; i < r.n_reqs; i++)
    tw_router_fail(&r, r.reqs[i], TWAIN__V1__CODE__UNAVAILABLE, "router is shutting down");
  tw_http_run(r.http); /* those answers, to HTTP clients */
  TW_INFO("router", "stopped");
  tw_router_fini(&r);
  return st;
}
