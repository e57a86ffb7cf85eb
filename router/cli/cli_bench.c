/* cli_bench.c: `twain bench`, the serving benchmark (docs/benchmarks.md
 * "Serving benchmark"). It drives a running service through the twain.v1
 * client API the way `vllm bench serve` drives an OpenAI server: N requests
 * with fixed, uniform or ShareGPT-like input/output lengths, random prompt
 * ids (raw generate: no stop ids, so every output is exactly its length) or
 * rendered chats, sent at a fixed concurrency and/or a Poisson request rate;
 * optionally some are cancelled or their client disconnects mid-stream.
 *
 * One thread, one DEALER socket for every request (replies are matched by
 * request_id) plus one socket per request whose client disconnects (closing
 * it is the disconnect). Every request is accounted for: completed, failed
 * (by v1 code), cancelled, disconnected, or lost (no reply for --timeout-ms).
 * Token counts are those received in the stream, checked against the final
 * reply's usage.completion_tokens. */
#include "router/cli/cli.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg.h"
#include "common/engine/sampling.h"
#include "common/model/config.h"
#include "common/model/model_path.h"
#include "proto/twain_api.pb-c.h"
#include "router/router.h"

#include <cjson/cJSON.h>
#include <zmq.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

/* Request ids: request i is i + 1; the cancel for request i is this + i. */
#define TW_BENCH_CANCEL_ID_BASE (1ULL << 40)
#define TW_BENCH_MAX_CODES 16

typedef enum { TW_DS_RANDOM = 0, TW_DS_SHAREGPT = 1 } tw_bench_dataset_t;

typedef enum {
  TW_BR_PENDING = 0, /* not sent yet */
  TW_BR_RUNNING = 1,
  TW_BR_DONE = 2,
} tw_bench_state_t;

typedef enum {
  TW_BO_COMPLETED = 0,
  TW_BO_FAILED = 1,       /* an error reply (code in .code) */
  TW_BO_CANCELLED = 2,    /* our cancel ended it (CANCELLED) */
  TW_BO_DISCONNECTED = 3, /* we closed its socket mid-stream */
  TW_BO_LOST = 4,         /* no reply for --timeout-ms */
} tw_bench_outcome_t;

typedef struct {
  int32_t in_len, out_len; /* asked for (chat: in_len is words, usage has the tokens) */
  int32_t *prompt;         /* random: in_len ids */
  char *text;              /* chat: the user message */
  int action;              /* 0 none, 1 cancel, 2 disconnect, after action_at tokens */
  int32_t action_at;
  tw_bench_state_t state;
  tw_bench_outcome_t outcome;
  int code;                /* v1 code of a failure */
  char message[160];       /* first words of a failure's message */
  void *sock;              /* own socket (disconnect requests) */
  bool cancel_sent;
  double t_arrive, t_sent, t_first, t_last, t_done; /* seconds since the start */
  int32_t n_recv;          /* tokens received (streamed) */
  int32_t usage_in, usage_out;
  int32_t itl_off, n_itl;  /* gaps between token replies in the shared itl array */
} tw_bench_req_t;

typedef struct {
  const char *endpoint, *model_dir, *json_path;
  int32_t n, concurrency, in_len, out_len;
  double range_ratio, rate, cancel_prob, disconnect_prob;
  tw_bench_dataset_t dataset;
  bool chat, quiet;
  uint64_t seed;
  int timeout_ms, connect_timeout_ms, deadline_ms;
  const char *server_key, *identity; /* CURVE (tw_auth_client_keys) */
} tw_bench_opts_t;

typedef struct {
  tw_bench_opts_t o;
  tw_model_config_t config;
  tw_bench_req_t *r;
  float *itl;
  int32_t n_itl, cap_itl;
  void *ctx, *sock;
  tw_auth_keys_t keys; /* the client socket's CURVE keys, or plaintext */
  const char *api_key; /* $TWAIN_API_KEY: for a router run with --api-key */
  double t0_s;
  int32_t running, n_sent, n_done, next;
  int64_t tokens_out;
  int32_t mismatches; /* requests whose streamed count differs from usage */
} tw_bench_t;

/* ---- deterministic randomness: draw k of a seed is tw_sample_uniform(seed, k) ---- */

typedef struct {
  uint64_t seed;
  int64_t n; /* draws so far */
} tw_bench_rng_t;

/* Uniform in [0, 1). */
static double tw_rng_unit(tw_bench_rng_t *s) { return tw_sample_uniform(s->seed, s->n++); }

/* Uniform integer in [lo, hi]. */
static int32_t tw_rng_range(tw_bench_rng_t *s, int32_t lo, int32_t hi) {
  if (hi <= lo) return lo;
  int32_t v = lo + (int32_t)floor(tw_rng_unit(s) * ((double)hi - lo + 1));
  return v > hi ? hi : v;
}

/* Standard normal (Box-Muller). */
static double tw_rng_normal(tw_bench_rng_t *s) {
  double u1 = tw_rng_unit(s), u2 = tw_rng_unit(s);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

static double tw_bench_now_s(void) { return (double)tw_msg_clock_ns() * 1e-9; }

/* ShareGPT-like lengths: log-normal fits of the ShareGPT V3 conversations as
 * `vllm bench serve --dataset-name sharegpt` samples them (first turn in,
 * its answer out, prompts under 1,024 and prompt + output under 2,048
 * tokens): input median ~130 tokens (mean ~230), output median ~200 (mean
 * ~280). Not the real data set: a local, seeded stand-in with its shape. */
static void tw_bench_sharegpt_len(tw_bench_rng_t *s, int32_t *in, int32_t *out) {
  for (int tries = 0; tries < 64; tries++) {
    int32_t i = (int32_t)lround(exp(4.87 + 1.05 * tw_rng_normal(s)));
    int32_t o = (int32_t)lround(exp(5.30 + 0.80 * tw_rng_normal(s)));
    if (i < 4 || o < 4 || i >= 1024 || i + o >= 2048) continue;
    *in = i;
    *out = o;
    return;
  }
  *in = 130;
  *out = 200;
}

/* Words for rendered chats: common English words, one o200k token each with
 * their leading space, so a message of k words is about k tokens. */
static const char *const tw_bench_words[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "water", "house",
    "word", "dog", "book", "tree", "city", "river", "light", "music", "story", "world", "day"};

static TW_NODISCARD tw_status_t tw_bench_make_requests(tw_bench_t *b) {
  const tw_bench_opts_t *o = &b->o;
  tw_bench_rng_t s = {o->seed, 0};
  b->r = calloc((size_t)o->n, sizeof *b->r);
  if (!b->r) return tw_err(TW_ERR_NO_MEMORY, "bench: out of memory for %d requests", o->n);
  /* prompt ids below the first special token (eos is among them) */
  int32_t hi = b->config.vocab_size;
  if (b->config.eos_token_id > 0 && b->config.eos_token_id < hi) hi = b->config.eos_token_id;
  const int32_t n_words = (int32_t)(sizeof tw_bench_words / sizeof tw_bench_words[0]);
  double t = 0;
  for (int32_t i = 0; i < o->n; i++) {
    tw_bench_req_t *q = &b->r[i];
    if (o->dataset == TW_DS_SHAREGPT) {
      tw_bench_sharegpt_len(&s, &q->in_len, &q->out_len);
    } else {
      double r = o->range_ratio;
      q->in_len = tw_rng_range(&s, (int32_t)floor(o->in_len * (1 - r)), (int32_t)ceil(o->in_len * (1 + r)));
      q->out_len = tw_rng_range(&s, (int32_t)floor(o->out_len * (1 - r)), (int32_t)ceil(o->out_len * (1 + r)));
      if (q->in_len < 1) q->in_len = 1;
      if (q->out_len < 1) q->out_len = 1;
    }
    if (o->chat) {
      size_t cap = (size_t)q->in_len * 8 + 1, len = 0;
      q->text = malloc(cap);
      if (!q->text) return tw_err(TW_ERR_NO_MEMORY, "bench: out of memory for prompts");
      q->text[0] = '\0';
      for (int32_t k = 0; k < q->in_len; k++) {
        const char *w = tw_bench_words[tw_rng_range(&s, 0, n_words - 1)];
        len += (size_t)snprintf(q->text + len, cap - len, "%s%s", k ? " " : "", w);
      }
    } else {
      q->prompt = malloc(sizeof(int32_t) * (size_t)q->in_len);
      if (!q->prompt) return tw_err(TW_ERR_NO_MEMORY, "bench: out of memory for prompts");
      for (int32_t k = 0; k < q->in_len; k++) q->prompt[k] = tw_rng_range(&s, 0, hi - 1);
    }
    double u = tw_rng_unit(&s);
    if (u < o->cancel_prob) q->action = 1;
    else if (u < o->cancel_prob + o->disconnect_prob) q->action = 2;
    q->action_at = tw_rng_range(&s, 1, q->out_len > 1 ? q->out_len - 1 : 1);
    /* Poisson arrivals: exponential gaps of mean 1/rate (all at 0 when unlimited) */
    if (o->rate > 0 && i > 0) t += -log(1.0 - tw_rng_unit(&s)) / o->rate;
    q->t_arrive = t;
  }
  return TW_OK;
}

/* A connected socket (the handshake done), or NULL with why in tw_last_error(). */
static void *tw_bench_socket(tw_bench_t *b) {
  void *s = NULL;
  if (tw_auth_client_open(b->ctx, b->o.endpoint, &b->keys, b->o.connect_timeout_ms, 1000000, &s) !=
      TW_OK)
    return NULL;
  return s;
}

static int tw_bench_send(void *sock, const Twain__V1__ClientRequest *req) {
  size_t len = protobuf_c_message_get_packed_size(&req->base);
  uint8_t *buf = malloc(len ? len : 1);
  if (!buf) return -1;
  protobuf_c_message_pack(&req->base, buf);
  int rc = zmq_send(sock, buf, len, 0);
  free(buf);
  return rc < 0 ? -1 : 0;
}

static void tw_bench_finish(tw_bench_t *b, tw_bench_req_t *q, tw_bench_outcome_t out, int code) {
  if (q->state == TW_BR_DONE) return;
  if (q->state == TW_BR_RUNNING) b->running--; /* a pending one never ran (not sent) */
  q->state = TW_BR_DONE;
  q->outcome = out;
  q->code = code;
  q->t_done = tw_bench_now_s() - b->t0_s;
  if (q->sock) {
    zmq_close(q->sock);
    q->sock = NULL;
  }
  b->n_done++;
}

static int tw_bench_start(tw_bench_t *b, int32_t i) {
  tw_bench_req_t *q = &b->r[i];
  Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
  sp.max_tokens = q->out_len;
  sp.explicit_max_tokens = true;
  Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
  Twain__V1__ChatRequest c = TWAIN__V1__CHAT_REQUEST__INIT;
  Twain__V1__Message m = TWAIN__V1__MESSAGE__INIT;
  Twain__V1__Message *msgs[1] = {&m};
  Twain__V1__ClientRequest req = TWAIN__V1__CLIENT_REQUEST__INIT;
  req.request_id = (uint64_t)i + 1;
  req.deadline_ms = (uint32_t)b->o.deadline_ms;
  if (b->api_key && b->api_key[0]) req.api_key = (char *)b->api_key;
  if (b->o.chat) {
    m.role = "user";
    m.content = q->text;
    c.messages = msgs;
    c.n_messages = 1;
    c.sampling = &sp;
    c.stream = true;
    req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
    req.chat = &c;
  } else {
    g.prompt_ids = q->prompt;
    g.n_prompt_ids = (size_t)q->in_len;
    g.sampling = &sp;
    g.stream = true;
    req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
    req.generate = &g;
  }
  void *sock = b->sock;
  if (q->action == 2 && !(sock = q->sock = tw_bench_socket(b))) {
    fprintf(stderr, "twain bench: %s\n", tw_last_error());
    return -1;
  }
  q->t_sent = tw_bench_now_s() - b->t0_s;
  q->t_last = q->t_sent;
  if (tw_bench_send(sock, &req) != 0) {
    fprintf(stderr, "twain bench: cannot send to %s within %d ms: %s (is `twain serve` running?)\n",
            b->o.endpoint, b->o.connect_timeout_ms, zmq_strerror(zmq_errno()));
    return -1;
  }
  q->state = TW_BR_RUNNING;
  b->running++;
  b->n_sent++;
  return 0;
}

static void tw_bench_itl_add(tw_bench_t *b, float gap_ms) {
  if (b->n_itl == b->cap_itl) {
    int32_t cap = b->cap_itl ? b->cap_itl * 2 : 4096;
    float *t = realloc(b->itl, sizeof *t * (size_t)cap);
    if (!t) return;
    b->itl = t;
    b->cap_itl = cap;
  }
  b->itl[b->n_itl++] = gap_ms;
}

static void tw_bench_on_reply(tw_bench_t *b, const Twain__V1__ServerReply *rep) {
  uint64_t id = rep->request_id;
  if (id >= TW_BENCH_CANCEL_ID_BASE) return; /* a cancel's own answer (ok or NOT_FOUND: it ended first) */
  if (id == 0 || id > (uint64_t)b->o.n) return;
  tw_bench_req_t *q = &b->r[id - 1];
  if (q->state != TW_BR_RUNNING) return;
  double now = tw_bench_now_s() - b->t0_s;
  if (rep->n_token_ids) {
    if (q->n_recv == 0) {
      q->t_first = now;
      q->itl_off = b->n_itl;
    } else {
      tw_bench_itl_add(b, (float)((now - q->t_last) * 1e3));
      q->n_itl++;
    }
    q->n_recv += (int32_t)rep->n_token_ids;
    b->tokens_out += (int64_t)rep->n_token_ids;
  }
  q->t_last = now;
  if (rep->done) {
    if (rep->usage) {
      q->usage_in = rep->usage->prompt_tokens;
      q->usage_out = rep->usage->completion_tokens;
      if (q->usage_out != q->n_recv) b->mismatches++;
    }
    int code = rep->error ? rep->error->code : 0;
    if (code && rep->error->message)
      snprintf(q->message, sizeof q->message, "%s", rep->error->message);
    tw_bench_finish(b, q, !code ? TW_BO_COMPLETED
                          : code == TWAIN__V1__CODE__CANCELLED && q->cancel_sent ? TW_BO_CANCELLED
                                                                                   : TW_BO_FAILED,
                    code);
    return;
  }
  if (q->action && !q->cancel_sent && q->n_recv >= q->action_at) {
    if (q->action == 2) { /* the client goes away mid-stream */
      tw_bench_finish(b, q, TW_BO_DISCONNECTED, 0);
      return;
    }
    Twain__V1__CancelRequest cr = TWAIN__V1__CANCEL_REQUEST__INIT;
    cr.target_request_id = id;
    Twain__V1__ClientRequest req = TWAIN__V1__CLIENT_REQUEST__INIT;
    req.request_id = TW_BENCH_CANCEL_ID_BASE + id;
    req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CANCEL;
    req.cancel = &cr;
    if (tw_bench_send(b->sock, &req) == 0) q->cancel_sent = true;
  }
}

/* Read what is waiting on *sockp (a disconnect closes it and sets it NULL). */
static void tw_bench_drain(tw_bench_t *b, void **sockp) {
  for (int k = 0; k < 4096 && *sockp; k++) {
    tw_msg_t m = {0};
    tw_status_t st = tw_msg_recv(*sockp, false, 0, &m);
    if (st == TW_INPROGRESS) break;
    if (st == TW_OK) {
      Twain__V1__ServerReply *rep = twain__v1__server_reply__unpack(NULL, m.len, m.data);
      if (rep) {
        tw_bench_on_reply(b, rep);
        twain__v1__server_reply__free_unpacked(rep, NULL);
      }
    }
    tw_msg_fini(&m);
    if (st != TW_OK && st != TW_ERR_FORMAT) break;
  }
}

static void tw_bench_progress(tw_bench_t *b, double now, bool last) {
  if (b->o.quiet) return;
  int32_t failed = 0;
  for (int32_t i = 0; i < b->o.n; i++)
    failed += b->r[i].state == TW_BR_DONE && b->r[i].outcome == TW_BO_FAILED;
  fprintf(stderr, "\rtwain bench: %6.1f s  %d/%d done  %d running  %d failed  %.0f output tok/s   %s",
          now, b->n_done, b->o.n, b->running, failed, now > 0 ? (double)b->tokens_out / now : 0.0,
          last ? "\n" : "");
  fflush(stderr);
}

/* The router's connection closed (it stopped or crashed): what runs can get
 * no reply any more (lost, said so now instead of after --timeout-ms), and
 * what was not sent fails UNAVAILABLE; the run ends. */
static void tw_bench_conn_lost(tw_bench_t *b) {
  static const char why[] = "the connection to the router closed (it stopped or crashed)";
  fprintf(stderr, "\ntwain bench: %s: %d requests running are lost, %d not sent\n", why, b->running,
          b->o.n - b->next);
  for (int32_t i = 0; i < b->o.n; i++) {
    tw_bench_req_t *q = &b->r[i];
    if (q->state == TW_BR_RUNNING) {
      snprintf(q->message, sizeof q->message, "%s", why);
      tw_bench_finish(b, q, TW_BO_LOST, 0);
    } else if (q->state == TW_BR_PENDING) {
      snprintf(q->message, sizeof q->message, "not sent: %s", why);
      tw_bench_finish(b, q, TW_BO_FAILED, TWAIN__V1__CODE__UNAVAILABLE);
    }
  }
  b->next = b->o.n;
}

/* The whole run: send on schedule, read replies, time out silent requests. */
static int tw_bench_loop(tw_bench_t *b) {
  const tw_bench_opts_t *o = &b->o;
  zmq_pollitem_t *items = malloc(sizeof *items * (size_t)(o->concurrency + 2));
  int32_t *item_req = malloc(sizeof(int32_t) * (size_t)(o->concurrency + 2));
  if (!items || !item_req) {
    free(items);
    free(item_req);
    fprintf(stderr, "twain bench: out of memory\n");
    return -1;
  }
  b->t0_s = tw_bench_now_s();
  double next_progress = 1.0;
  int rc = 0;
  void *watch = tw_auth_client_watch(b->ctx, b->sock); /* the router's death ends the run */
  while (b->n_done < o->n) {
    double now = tw_bench_now_s() - b->t0_s;
    while (b->next < o->n && b->running < o->concurrency && b->r[b->next].t_arrive <= now) {
      if (tw_bench_start(b, b->next) != 0) {
        rc = -1;
        goto out;
      }
      b->next++;
    }
    int n = 0;
    items[n] = (zmq_pollitem_t){.socket = b->sock, .events = ZMQ_POLLIN};
    item_req[n++] = -1;
    if (watch) {
      items[n] = (zmq_pollitem_t){.socket = watch, .events = ZMQ_POLLIN};
      item_req[n++] = -2;
    }
    for (int32_t i = 0; i < b->next && n < o->concurrency + 2; i++)
      if (b->r[i].sock && b->r[i].state == TW_BR_RUNNING) {
        items[n] = (zmq_pollitem_t){.socket = b->r[i].sock, .events = ZMQ_POLLIN};
        item_req[n++] = i;
      }
    double wait_s = 0.1;
    if (b->next < o->n && b->running < o->concurrency) {
      double dt = b->r[b->next].t_arrive - now;
      if (dt < wait_s) wait_s = dt > 0 ? dt : 0;
    }
    if (zmq_poll(items, n, (long)(wait_s * 1e3)) < 0 && zmq_errno() != EINTR) {
      fprintf(stderr, "twain bench: zmq_poll: %s\n", zmq_strerror(zmq_errno()));
      rc = -1;
      goto out;
    }
    bool lost = false;
    for (int k = 0; k < n; k++)
      if ((items[k].revents & ZMQ_POLLIN) && item_req[k] == -2)
        lost = tw_auth_client_lost(watch);
      else if (items[k].revents & ZMQ_POLLIN)
        tw_bench_drain(b, item_req[k] < 0 ? &b->sock : &b->r[item_req[k]].sock);
    if (lost) {
      tw_bench_drain(b, &b->sock); /* what came before the close */
      tw_bench_conn_lost(b);
      break;
    }
    now = tw_bench_now_s() - b->t0_s;
    for (int32_t i = 0; i < b->next; i++) {
      tw_bench_req_t *q = &b->r[i];
      if (q->state == TW_BR_RUNNING && (now - q->t_last) * 1e3 > o->timeout_ms) {
        snprintf(q->message, sizeof q->message, "no reply for %d ms", o->timeout_ms);
        tw_bench_finish(b, q, TW_BO_LOST, 0);
      }
    }
    if (now >= next_progress) {
      tw_bench_progress(b, now, false);
      next_progress = now + 1.0;
    }
  }
out:
  tw_auth_client_unwatch(b->sock, watch);
  tw_bench_progress(b, tw_bench_now_s() - b->t0_s, true);
  free(items);
  free(item_req);
  return rc;
}

/* ---- statistics ---- */

static int tw_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  double mean, p50, p90, p99;
  int64_t n;
} tw_bench_dist_t;

/* Mean and percentiles with linear interpolation between closest ranks
 * (numpy's default, which `vllm bench serve` reports). Sorts v. */
static tw_bench_dist_t tw_bench_dist(double *v, int64_t n) {
  tw_bench_dist_t d = {0, 0, 0, 0, n};
  if (n == 0) return d;
  qsort(v, (size_t)n, sizeof *v, tw_cmp_double);
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += v[i];
  d.mean = sum / (double)n;
  const double ps[3] = {50, 90, 99};
  double *out[3] = {&d.p50, &d.p90, &d.p99};
  for (int k = 0; k < 3; k++) {
    double x = ps[k] / 100.0 * (double)(n - 1);
    int64_t lo = (int64_t)floor(x);
    int64_t hi = lo + 1 < n ? lo + 1 : lo;
    *out[k] = v[lo] + (v[hi] - v[lo]) * (x - (double)lo);
  }
  return d;
}

static cJSON *tw_bench_dist_json(const tw_bench_dist_t *d) {
  cJSON *j = cJSON_CreateObject();
  cJSON_AddNumberToObject(j, "mean", d->mean);
  cJSON_AddNumberToObject(j, "p50", d->p50);
  cJSON_AddNumberToObject(j, "p90", d->p90);
  cJSON_AddNumberToObject(j, "p99", d->p99);
  return j;
}

static const char *tw_bench_code_name(int code) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&twain__v1__code__descriptor, code);
  return v ? v->name : "UNKNOWN";
}

static const char *const tw_bench_outcome_names[] = {"completed", "failed", "cancelled",
                                                     "disconnected", "lost"};

static int tw_bench_report(tw_bench_t *b) {
  const tw_bench_opts_t *o = &b->o;
  int32_t count[5] = {0}, codes[TW_BENCH_MAX_CODES] = {0};
  const char *first_msg[TW_BENCH_MAX_CODES] = {0}; /* the first failure's message, per code */
  int64_t in_tok = 0, out_tok = 0, out_all = 0;
  double duration = 0;
  double *ttft = malloc(sizeof(double) * (size_t)o->n), *tpot = malloc(sizeof(double) * (size_t)o->n);
  double *e2e = malloc(sizeof(double) * (size_t)o->n);
  double *itl = malloc(sizeof(double) * (size_t)(b->n_itl ? b->n_itl : 1));
  if (!ttft || !tpot || !e2e || !itl) {
    fprintf(stderr, "twain bench: out of memory for the report\n");
    free(ttft), free(tpot), free(e2e), free(itl);
    return 1;
  }
  int64_t n_ttft = 0, n_tpot = 0, n_e2e = 0, n_itl = 0;
  for (int32_t i = 0; i < o->n; i++) {
    const tw_bench_req_t *q = &b->r[i];
    count[q->outcome]++;
    if (q->outcome == TW_BO_FAILED) {
      int c = q->code >= 0 && q->code < TW_BENCH_MAX_CODES ? q->code : 2;
      codes[c]++;
      if (!first_msg[c] && q->message[0]) first_msg[c] = q->message;
    }
    out_all += q->n_recv;
    if (q->t_done > duration) duration = q->t_done;
    if (q->outcome != TW_BO_COMPLETED) continue;
    in_tok += q->usage_in;
    out_tok += q->n_recv;
    if (q->n_recv > 0) ttft[n_ttft++] = (q->t_first - q->t_sent) * 1e3;
    if (q->n_recv > 1) tpot[n_tpot++] = (q->t_last - q->t_first) * 1e3 / (q->n_recv - 1);
    e2e[n_e2e++] = (q->t_done - q->t_sent) * 1e3;
    for (int32_t k = 0; k < q->n_itl; k++) itl[n_itl++] = b->itl[q->itl_off + k];
  }
  tw_bench_dist_t dt = tw_bench_dist(ttft, n_ttft), dp = tw_bench_dist(tpot, n_tpot),
                  di = tw_bench_dist(itl, n_itl), de = tw_bench_dist(e2e, n_e2e);
  double rps = duration > 0 ? count[TW_BO_COMPLETED] / duration : 0;
  double otps = duration > 0 ? (double)out_tok / duration : 0;
  double ttps = duration > 0 ? (double)(in_tok + out_tok) / duration : 0;
  printf("============ Serving Benchmark Result ============\n");
  printf("%-40s %s\n", "Endpoint:", o->endpoint);
  printf("%-40s %d\n", "Requests:", o->n);
  for (int k = 0; k < 5; k++) {
    char label[64];
    snprintf(label, sizeof label, "  %s:", tw_bench_outcome_names[k]);
    printf("%-40s %d\n", label, count[k]);
  }
  for (int c = 0; c < TW_BENCH_MAX_CODES; c++) {
    if (!codes[c]) continue;
    printf("    %-36s %d\n", tw_bench_code_name(c), codes[c]);
    if (first_msg[c]) printf("      (first: %s)\n", first_msg[c]);
  }
  printf("%-40s %.3f\n", "Benchmark duration (s):", duration);
  printf("%-40s %lld\n", "Total input tokens:", (long long)in_tok);
  printf("%-40s %lld\n", "Total generated tokens:", (long long)out_tok);
  printf("%-40s %.2f\n", "Request throughput (req/s):", rps);
  printf("%-40s %.2f\n", "Output token throughput (tok/s):", otps);
  printf("%-40s %.2f\n", "Total token throughput (tok/s):", ttps);
  const char *names[4] = {"TTFT", "TPOT", "ITL", "E2E latency"};
  const tw_bench_dist_t *ds[4] = {&dt, &dp, &di, &de};
  for (int k = 0; k < 4; k++) {
    printf("----- %s (ms) -----\n", names[k]);
    printf("%-40s %.2f\n%-40s %.2f\n%-40s %.2f\n%-40s %.2f\n", "  mean:", ds[k]->mean, "  p50:",
           ds[k]->p50, "  p90:", ds[k]->p90, "  p99:", ds[k]->p99);
  }
  if (b->mismatches)
    printf("%-40s %d\n", "Token count mismatches (stream/usage):", b->mismatches);
  printf("==================================================\n");
  int rc = count[TW_BO_LOST] || b->mismatches ? 1 : 0;
  /* nothing measured: every request that was to complete failed */
  if (count[TW_BO_COMPLETED] == 0 && count[TW_BO_FAILED] > 0) {
    fprintf(stderr, "twain bench: every request failed (%d): nothing was measured\n",
            count[TW_BO_FAILED]);
    rc = 1;
  }
  if (o->json_path) {
    cJSON *j = cJSON_CreateObject();
    cJSON *cfg = cJSON_AddObjectToObject(j, "config");
    cJSON_AddStringToObject(cfg, "endpoint", o->endpoint);
    cJSON_AddStringToObject(cfg, "dataset", o->dataset == TW_DS_SHAREGPT ? "sharegpt" : "random");
    cJSON_AddStringToObject(cfg, "prompts", o->chat ? "chat" : "ids");
    cJSON_AddNumberToObject(cfg, "num_requests", o->n);
    cJSON_AddNumberToObject(cfg, "input_len", o->in_len);
    cJSON_AddNumberToObject(cfg, "output_len", o->out_len);
    cJSON_AddNumberToObject(cfg, "range_ratio", o->range_ratio);
    cJSON_AddNumberToObject(cfg, "concurrency", o->concurrency);
    cJSON_AddNumberToObject(cfg, "request_rate", o->rate); /* 0: unlimited */
    cJSON_AddNumberToObject(cfg, "cancel_prob", o->cancel_prob);
    cJSON_AddNumberToObject(cfg, "disconnect_prob", o->disconnect_prob);
    cJSON_AddNumberToObject(cfg, "seed", (double)o->seed);
    for (int k = 0; k < 5; k++) cJSON_AddNumberToObject(j, tw_bench_outcome_names[k], count[k]);
    cJSON *fc = cJSON_AddObjectToObject(j, "failures");
    for (int c = 0; c < TW_BENCH_MAX_CODES; c++)
      if (codes[c]) cJSON_AddNumberToObject(fc, tw_bench_code_name(c), codes[c]);
    cJSON_AddNumberToObject(j, "duration_s", duration);
    cJSON_AddNumberToObject(j, "total_input_tokens", (double)in_tok);
    cJSON_AddNumberToObject(j, "total_output_tokens", (double)out_tok);
    cJSON_AddNumberToObject(j, "tokens_received", (double)out_all);
    cJSON_AddNumberToObject(j, "token_count_mismatches", b->mismatches);
    cJSON_AddNumberToObject(j, "request_throughput", rps);
    cJSON_AddNumberToObject(j, "output_throughput", otps);
    cJSON_AddNumberToObject(j, "total_token_throughput", ttps);
    cJSON_AddItemToObject(j, "ttft_ms", tw_bench_dist_json(&dt));
    cJSON_AddItemToObject(j, "tpot_ms", tw_bench_dist_json(&dp));
    cJSON_AddItemToObject(j, "itl_ms", tw_bench_dist_json(&di));
    cJSON_AddItemToObject(j, "e2el_ms", tw_bench_dist_json(&de));
    cJSON *reqs = cJSON_AddArrayToObject(j, "requests");
    for (int32_t i = 0; i < o->n; i++) {
      const tw_bench_req_t *q = &b->r[i];
      cJSON *x = cJSON_CreateObject();
      cJSON_AddNumberToObject(x, "input_len", o->chat ? q->usage_in : q->in_len);
      cJSON_AddNumberToObject(x, "max_tokens", q->out_len);
      cJSON_AddNumberToObject(x, "tokens_received", q->n_recv);
      cJSON_AddNumberToObject(x, "completion_tokens", q->usage_out);
      cJSON_AddStringToObject(x, "outcome", tw_bench_outcome_names[q->outcome]);
      if (q->outcome == TW_BO_FAILED) {
        cJSON_AddStringToObject(x, "code", tw_bench_code_name(q->code));
        cJSON_AddStringToObject(x, "message", q->message);
      }
      cJSON_AddNumberToObject(x, "ttft_ms", q->n_recv ? (q->t_first - q->t_sent) * 1e3 : 0);
      cJSON_AddNumberToObject(x, "e2el_ms", (q->t_done - q->t_sent) * 1e3);
      cJSON_AddItemToArray(reqs, x);
    }
    char *txt = cJSON_Print(j);
    FILE *f = fopen(o->json_path, "w");
    if (!f || fputs(txt, f) < 0 || fputc('\n', f) < 0) {
      fprintf(stderr, "twain bench: cannot write %s\n", o->json_path);
      rc = 1;
    }
    if (f) fclose(f);
    free(txt);
    cJSON_Delete(j);
  }
  free(ttft), free(tpot), free(e2e), free(itl);
  return rc;
}

/* --dataset random|sharegpt (common/base/opts.h TW_OPT_FN). */
static int tw_bench_dataset_opt(const char *v, void *dst, char *err, size_t errlen) {
  tw_bench_dataset_t *d = dst;
  if (!strcmp(v, "random")) *d = TW_DS_RANDOM;
  else if (!strcmp(v, "sharegpt")) *d = TW_DS_SHAREGPT;
  else {
    snprintf(err, errlen, "must be random or sharegpt, got '%s'", v);
    return -1;
  }
  return 0;
}

/* Parse the options into o (common/base/opts.h); TW_OPTS_RUN, or the exit code. */
static int tw_bench_parse(int argc, char **argv, tw_bench_opts_t *o) {
  const char *P = "twain bench";
  long long seed = (long long)o->seed;
  tw_opt_t opts[] = {
      TW_OPT_STR("endpoint", &o->endpoint, "EP", "the router's client endpoint"),
      TW_OPT_INT("num-requests", &o->n, 1, 10000000, "N", "requests in all"),
      TW_OPT_INT("concurrency", &o->concurrency, 1, 100000, "C",
                 "at most C at a time (default 1; with --request-rate: unlimited)"),
      TW_OPT_DOUBLE("request-rate", &o->rate, 0, 1e9, "R",
                    "Poisson arrivals of R requests/s (0: all at once)"),
      TW_OPT_FN("dataset", &o->dataset, tw_bench_dataset_opt, "random|sharegpt",
                "lengths: fixed/uniform, or ShareGPT-like (seeded) (default random)"),
      TW_OPT_INT("input-len", &o->in_len, 1, 1 << 24, "N", "prompt tokens (chat: words)"),
      TW_OPT_INT("output-len", &o->out_len, 1, 1 << 24, "N", "max_tokens of each request"),
      TW_OPT_DOUBLE("range-ratio", &o->range_ratio, 0, 0.999, "X",
                    "lengths uniform in [L(1-X), L(1+X)]"),
      TW_OPT_FLAG("chat", &o->chat,
                  "rendered chats of random words instead of random ids\n"
                  "(outputs may stop early)"),
      TW_OPT_LONG("seed", &seed, 0, LLONG_MAX, "S", "random seed"),
      TW_OPT_STR_FN("model", &o->model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "the model whose config.json gives the vocabulary"),
      TW_OPT_DOUBLE("cancel-prob", &o->cancel_prob, 0, 1, "P",
                    "that share of requests is cancelled after a random number of tokens"),
      TW_OPT_DOUBLE("disconnect-prob", &o->disconnect_prob, 0, 1, "P",
                    "that share of clients disconnects after a random number of tokens"),
      TW_OPT_INT("deadline-ms", &o->deadline_ms, 0, INT_MAX, "MS",
                 "each request's deadline (0: the server's)"),
      TW_OPT_INT("timeout-ms", &o->timeout_ms, 1, INT_MAX, "MS",
                 "a request with no reply this long counts as lost (keep it above the\n"
                 "longest wait in the service's queue)"),
      TW_OPT_INT("connect-timeout-ms", &o->connect_timeout_ms, 1, INT_MAX, "MS",
                 "bound on the wait for the server"),
      TW_CLIENT_CURVE_OPT_ROWS(o->server_key, o->identity),
      TW_OPT_STR("json", &o->json_path, "FILE", "write the results as JSON"),
      TW_OPT_FLAG("quiet", &o->quiet, "no progress on stderr"),
  };
  tw_opts_spec_t spec = {
      .prog = P,
      .description =
          "Drive a running service with N requests and report tok/s, req/s, TTFT, TPOT,\n"
          "ITL and E2E percentiles and failures by code. Prompts are random token ids\n"
          "(raw generate: no stop ids, outputs have exactly their length) or, with\n"
          "--chat, rendered chats.",
      .epilog =
          "A router run with --api-key takes the key from $TWAIN_API_KEY.\n"
          "Exit 0 when every request is accounted for and every streamed count equals its\n"
          "usage, 1 otherwise (lost requests, mismatches, every request failed, --json\n"
          "not writable), 2 bad usage.",
      .env_prefix = "TWAIN_BENCH_",
      .opts = opts,
      .n_opts = sizeof opts / sizeof opts[0]};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  o->seed = (uint64_t)seed;
  if (o->cancel_prob + o->disconnect_prob > 1) {
    fprintf(stderr, "%s: --cancel-prob + --disconnect-prob must be at most 1\n", P);
    return 2;
  }
  if (!tw_opts_given(&spec, "concurrency")) o->concurrency = o->rate > 0 ? o->n : 1;
  if (o->concurrency > o->n) o->concurrency = o->n;
  return TW_OPTS_RUN;
}

int tw_cli_bench(int argc, char **argv) {
  static tw_bench_t b; /* zeroed; large enough not to want it on the stack */
  memset(&b, 0, sizeof b);
  b.o = (tw_bench_opts_t){.endpoint = TW_ROUTER_CLIENT_ENDPOINT, .n = 100, .in_len = 1024,
                          .out_len = 128, .seed = 0, .timeout_ms = 600000,
                          .connect_timeout_ms = 5000};
  b.o.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  int pr = tw_bench_parse(argc, argv, &b.o);
  if (pr != TW_OPTS_RUN) return pr;
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", b.o.model_dir);
  if (tw_config_load(path, &b.config) != TW_OK) {
    fprintf(stderr, "twain bench: %s (--model DIR gives the served model's folder)\n", tw_last_error());
    return 2;
  }
  int rc = 1;
  if (b.o.json_path) { /* before the run, not after it: a path that cannot be written */
    FILE *jf = fopen(b.o.json_path, "a");
    if (!jf) {
      fprintf(stderr, "twain bench: cannot write --json %s: %s\n", b.o.json_path, strerror(errno));
      goto out;
    }
    fclose(jf);
  }
  if (tw_bench_make_requests(&b) != TW_OK) {
    fprintf(stderr, "twain bench: %s\n", tw_last_error());
    goto out;
  }
  b.api_key = getenv("TWAIN_API_KEY");
  if (tw_auth_client_keys(b.o.server_key, b.o.identity, &b.keys) != TW_OK) {
    fprintf(stderr, "twain bench: %s\n", tw_last_error());
    goto out;
  }
  b.ctx = zmq_ctx_new();
  if (!b.ctx || !(b.sock = tw_bench_socket(&b))) {
    fprintf(stderr, "twain bench: %s\n", b.ctx ? tw_last_error() : "zmq_ctx_new failed");
    goto out;
  }
  if (!b.o.quiet)
    fprintf(stderr, "twain bench: %d %s requests to %s, concurrency %d, rate %s\n", b.o.n,
            b.o.chat ? "chat" : "generate", b.o.endpoint, b.o.concurrency,
            b.o.rate > 0 ? "Poisson" : "unlimited");
  if (tw_bench_loop(&b) != 0) goto out;
  rc = tw_bench_report(&b);
out:
  for (int32_t i = 0; b.r && i < b.o.n; i++) {
    if (b.r[i].sock) zmq_close(b.r[i].sock);
    free(b.r[i].prompt);
    free(b.r[i].text);
  }
  free(b.r);
  free(b.itl);
  if (b.sock) zmq_close(b.sock);
  if (b.ctx) zmq_ctx_term(b.ctx);
  memset(&b.keys, 0, sizeof b.keys);
  return rc;
}
