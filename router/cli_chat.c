/* cli_chat.c: `twain chat` and `twain generate`, C clients of the twain.v1
 * API (docs/api.md). One DEALER socket, one request, streamed replies until
 * the one with done = true (bounded by --timeout-ms). */
#include "router/cli.h"

#include "common/harmony.h"

#include "common/log.h"
#include "common/msg.h"
#include "proto/twain_api.pb-c.h"
#include "router/router.h"

#include <cjson/cJSON.h>
#include <zmq.h>

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Exit code of `twain chat` when max_tokens cut the answer before the final
 * channel produced any text (docs/api.md "Clients"). */
#define TW_CLI_EXIT_CUT 3
/* Default wait for the connection to the endpoint (--connect-timeout-ms). */
#define TW_CLI_CONNECT_TIMEOUT_MS 5000

int tw_cli_parse_int(const char *prog, const char *flag, const char *text, long long lo,
                     long long hi, long long *out) {
  char *end = NULL;
  errno = 0;
  long long v = text[0] && !isspace((unsigned char)text[0]) ? strtoll(text, &end, 10) : 0;
  if (!end || end == text || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
    fprintf(stderr, "%s: %s must be an integer in [%lld, %lld], got '%s'\n", prog, flag, lo, hi,
            text);
    return -1;
  }
  *out = v;
  return 0;
}

int tw_cli_parse_double(const char *prog, const char *flag, const char *text, double lo, double hi,
                        double *out) {
  char *end = NULL;
  errno = 0;
  double v = text[0] && !isspace((unsigned char)text[0]) ? strtod(text, &end) : 0;
  if (!end || end == text || *end != '\0' || errno == ERANGE || !isfinite(v) || v < lo || v > hi) {
    fprintf(stderr, "%s: %s must be a number in [%g, %g], got '%s'\n", prog, flag, lo, hi, text);
    return -1;
  }
  *out = v;
  return 0;
}

typedef struct {
  const char *endpoint;
  int timeout_ms, connect_timeout_ms;
  bool json, show_analysis;
  int32_t max_tokens;
  bool max_tokens_set;
  float temperature;
  uint64_t seed;
  const char *api_key; /* $TWAIN_API_KEY: for a router run with --api-key */
} tw_client_opts_t;

static const char *tw_code_name(int code) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&twain__v1__code__descriptor, code);
  return v ? v->name : "UNKNOWN";
}

static const char *tw_finish_name(int f) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&twain__v1__finish_reason__descriptor, f);
  return v ? v->name : "FINISH_NONE";
}

/* The error that ended a call: a v1 code name and the message. */
typedef struct {
  char code[40];
  char message[512];
} tw_call_err_t;

static void tw_call_fail(tw_call_err_t *e, const char *prog, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void tw_call_fail(tw_call_err_t *e, const char *prog, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->message, sizeof e->message, fmt, ap);
  va_end(ap);
  snprintf(e->code, sizeof e->code, "%s", code);
  fprintf(stderr, "%s: %s\n", prog, e->message);
}

/* Send `req`, call on_reply for each reply until done. Returns 0, or 1 on an
 * error reply / timeout (message printed and kept in *err). The connection
 * must come up within connect_timeout_ms (ZMQ_IMMEDIATE: nothing is queued
 * for an endpoint nobody listens on); after that the whole exchange gets
 * timeout_ms, so long streams are not cut. */
typedef void (*tw_on_reply_fn)(void *user, const Twain__V1__ServerReply *rep);
static int tw_client_call(const tw_client_opts_t *o, const Twain__V1__ClientRequest *req,
                          tw_on_reply_fn fn, void *user, const char *prog, tw_call_err_t *err) {
  void *ctx = zmq_ctx_new();
  void *s = NULL;
  int rc = 1;
  int sto = o->connect_timeout_ms < o->timeout_ms ? o->connect_timeout_ms : o->timeout_ms;
  int one = 1, zero = 0;
  s = zmq_socket(ctx, ZMQ_DEALER);
  if (s) { /* ZMQ_IMMEDIATE must be set before the connect */
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_IMMEDIATE, &one, sizeof one);
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &sto, sizeof sto);
    tw_msg_limit_size(s);
  }
  if (!s || zmq_connect(s, o->endpoint) != 0) {
    tw_call_fail(err, prog, "INVALID_ARGUMENT", "cannot connect to %s: %s", o->endpoint,
                 zmq_strerror(zmq_errno()));
    if (s) zmq_close(s);
    zmq_ctx_term(ctx);
    return 1;
  }
  Twain__V1__ClientRequest keyed = *req;
  if (o->api_key && o->api_key[0]) keyed.api_key = (char *)o->api_key;
  size_t len = protobuf_c_message_get_packed_size(&keyed.base);
  uint8_t *buf = malloc(len ? len : 1);
  protobuf_c_message_pack(&keyed.base, buf);
  if (zmq_send(s, buf, len, 0) < 0) {
    if (zmq_errno() == EAGAIN)
      tw_call_fail(err, prog, "UNAVAILABLE", "no answer from %s within %d ms (is `twain serve` running?)",
                   o->endpoint, sto);
    else
      tw_call_fail(err, prog, "UNAVAILABLE", "cannot send to %s: %s", o->endpoint,
                   zmq_strerror(zmq_errno()));
    goto out;
  }
  int64_t t_end = tw_msg_clock_ns() + (int64_t)o->timeout_ms * 1000000;
  for (;;) {
    int64_t left = (t_end - tw_msg_clock_ns()) / 1000000;
    if (left <= 0) {
      tw_call_fail(err, prog, "DEADLINE_EXCEEDED",
                   "no answer from %s within %d ms (is `twain serve` running?)", o->endpoint,
                   o->timeout_ms);
      goto out;
    }
    tw_msg_t m = {0};
    tw_status_t st = tw_msg_recv(s, false, (int)left, &m);
    if (st == TW_INPROGRESS) continue;
    if (st != TW_OK) {
      tw_call_fail(err, prog, "UNAVAILABLE", "%s", tw_last_error());
      tw_msg_fini(&m);
      goto out;
    }
    Twain__V1__ServerReply *rep = twain__v1__server_reply__unpack(NULL, m.len, m.data);
    tw_msg_fini(&m);
    if (!rep) {
      tw_call_fail(err, prog, "INTERNAL", "undecodable reply from the router");
      goto out;
    }
    if (rep->request_id != req->request_id) {
      twain__v1__server_reply__free_unpacked(rep, NULL);
      continue;
    }
    fn(user, rep);
    bool done = rep->done;
    if (done) {
      rc = rep->error && rep->error->code ? 1 : 0;
      if (rc) {
        const char *em = rep->error->message ? rep->error->message : "";
        tw_call_fail(err, prog, tw_code_name(rep->error->code), "%s: %s",
                     tw_code_name(rep->error->code), em);
        snprintf(err->message, sizeof err->message, "%s", em); /* the JSON has the code apart */
      }
    }
    twain__v1__server_reply__free_unpacked(rep, NULL);
    if (done) break;
  }
out:
  free(buf);
  zmq_close(s);
  zmq_ctx_term(ctx);
  return rc;
}

/* Options of chat and generate that take a value (others are flags). */
static bool tw_takes_value(const char *a, const char *const *extra_flags) {
  static const char *const common[] = {"--endpoint", "--timeout-ms", "--connect-timeout-ms",
                                       "--max-tokens", "--temperature", "--seed", NULL};
  for (const char *const *f = common; *f; f++)
    if (!strcmp(a, *f)) return true;
  for (const char *const *f = extra_flags; f && *f; f++)
    if (!strcmp(a, *f)) return true;
  return false;
}

/* Common options; returns the index of the first positional, -1 on a usage
 * error (message printed), -2 for --help. `extra` handles the flags in
 * extra_flags: 0 ok, -1 bad value (it printed why). */
static int tw_client_parse(int argc, char **argv, tw_client_opts_t *o, const char *prog,
                           const char *const *extra_flags,
                           int (*extra)(void *, const char *, const char *, const char *),
                           void *extra_user) {
  o->endpoint = TW_ROUTER_CLIENT_ENDPOINT;
  o->timeout_ms = 300000;
  o->connect_timeout_ms = TW_CLI_CONNECT_TIMEOUT_MS;
  o->api_key = getenv("TWAIN_API_KEY");
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (a[0] != '-' || !a[1] || !strcmp(a, "--")) break;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) return -2;
    if (!strcmp(a, "--json")) { o->json = true; continue; }
    if (!strcmp(a, "--show-analysis")) { o->show_analysis = true; continue; }
    if (!tw_takes_value(a, extra_flags)) {
      fprintf(stderr, "%s: unknown option %s\n", prog, a);
      return -1;
    }
    if (!v) {
      fprintf(stderr, "%s: %s needs a value\n", prog, a);
      return -1;
    }
    i++;
    long long n = 0;
    double d = 0;
    int bad = 0;
    if (!strcmp(a, "--endpoint")) o->endpoint = v;
    else if (!strcmp(a, "--timeout-ms")) {
      bad = tw_cli_parse_int(prog, a, v, 1, INT_MAX, &n);
      o->timeout_ms = (int)n;
    } else if (!strcmp(a, "--connect-timeout-ms")) {
      bad = tw_cli_parse_int(prog, a, v, 1, INT_MAX, &n);
      o->connect_timeout_ms = (int)n;
    } else if (!strcmp(a, "--max-tokens")) {
      bad = tw_cli_parse_int(prog, a, v, 0, INT32_MAX, &n);
      o->max_tokens = (int32_t)n;
      o->max_tokens_set = true;
    } else if (!strcmp(a, "--temperature")) {
      bad = tw_cli_parse_double(prog, a, v, 0, 100, &d);
      o->temperature = (float)d;
    } else if (!strcmp(a, "--seed")) {
      bad = tw_cli_parse_int(prog, a, v, 0, LLONG_MAX, &n);
      o->seed = (uint64_t)n;
    } else {
      bad = extra(extra_user, prog, a, v);
    }
    if (bad) return -1;
  }
  if (i < argc && !strcmp(argv[i], "--")) i++;
  return i;
}

static void tw_client_sampling(const tw_client_opts_t *o, Twain__V1__SamplingParams *s) {
  s->temperature = o->temperature;
  s->seed = o->seed;
  s->max_tokens = o->max_tokens;
  s->explicit_max_tokens = o->max_tokens_set;
}

static cJSON *tw_json_usage(const Twain__V1__ServerReply *rep) {
  cJSON *u = cJSON_CreateObject();
  cJSON_AddNumberToObject(u, "prompt_tokens", rep->usage ? rep->usage->prompt_tokens : 0);
  cJSON_AddNumberToObject(u, "completion_tokens", rep->usage ? rep->usage->completion_tokens : 0);
  if (rep->timings) {
    cJSON_AddNumberToObject(u, "ttft_ms", rep->timings->ttft_ms);
    cJSON_AddNumberToObject(u, "mean_tpot_ms", rep->timings->mean_tpot_ms);
  }
  return u;
}

/* ---- chat ---- */

typedef struct {
  const tw_client_opts_t *o;
  const char *last_channel;
  cJSON *out;
  bool newline_due;
  bool got_final;     /* some final-channel text arrived */
  int finish_reason;  /* of the done reply */
} tw_chat_state_t;

static void tw_chat_on_reply(void *user, const Twain__V1__ServerReply *rep) {
  tw_chat_state_t *c = user;
  for (size_t i = 0; i < rep->n_deltas; i++)
    if (!strcmp(rep->deltas[i]->channel, "final") && rep->deltas[i]->content[0]) c->got_final = true;
  for (size_t i = 0; i < rep->n_messages; i++)
    if (!strcmp(rep->messages[i]->channel, "final")) c->got_final = true;
  if (rep->done) c->finish_reason = rep->finish_reason;
  if (!c->o->json) {
    for (size_t i = 0; i < rep->n_deltas; i++) {
      const Twain__V1__Delta *d = rep->deltas[i];
      bool final = !strcmp(d->channel, "final");
      if (!final && !c->o->show_analysis) continue;
      if (c->o->show_analysis && d->role && d->role[0]) {
        printf("%s[%s%s%s] ", c->newline_due ? "\n" : "", d->channel,
               d->recipient[0] ? " to=" : "", d->recipient);
      }
      fputs(d->content, stdout);
      c->newline_due = true;
    }
    fflush(stdout);
    if (rep->done && c->newline_due) printf("\n");
    return;
  }
  if (!rep->done) return;
  cJSON *msgs = cJSON_AddArrayToObject(c->out, "messages");
  for (size_t i = 0; i < rep->n_messages; i++) {
    const Twain__V1__Message *m = rep->messages[i];
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "role", m->role);
    cJSON_AddStringToObject(j, "channel", m->channel);
    cJSON_AddStringToObject(j, "recipient", m->recipient);
    cJSON_AddStringToObject(j, "content", m->content);
    cJSON_AddItemToArray(msgs, j);
  }
  cJSON_AddItemToObject(c->out, "usage", tw_json_usage(rep));
  cJSON_AddStringToObject(c->out, "finish_reason", tw_finish_name(rep->finish_reason));
}

/* --date: YYYY-MM-DD with a real month and day (or empty: no date line). */
static int tw_date_check(const char *prog, const char *v) {
  if (!v[0] || tw_harmony_date_valid(v)) return 0;
  fprintf(stderr, "%s: --date must be a date YYYY-MM-DD, got '%s'\n", prog, v);
  return -1;
}

static int tw_chat_extra(void *user, const char *prog, const char *a, const char *v) {
  Twain__V1__ChatRequest *c = user;
  if (!strcmp(a, "--reasoning")) {
    if (!strcmp(v, "low")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_LOW;
    else if (!strcmp(v, "medium")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_MEDIUM;
    else if (!strcmp(v, "high")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_HIGH;
    else {
      fprintf(stderr, "%s: --reasoning must be low, medium or high, got '%s'\n", prog, v);
      return -1;
    }
    return 0;
  }
  if (!strcmp(a, "--date")) {
    if (tw_date_check(prog, v)) return -1;
    c->date = (char *)v;
    return 0;
  }
  c->instructions = (char *)v; /* --system */
  return 0;
}

/* A failed call under --json: one JSON object with the error on stdout. */
static void tw_print_json_error(const tw_call_err_t *e) {
  cJSON *o = cJSON_CreateObject();
  cJSON *j = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(j, "code", e->code[0] ? e->code : "INTERNAL");
  cJSON_AddStringToObject(j, "message", e->message);
  cJSON_AddStringToObject(o, "finish_reason", "FINISH_ERROR");
  char *txt = cJSON_PrintUnformatted(o);
  printf("%s\n", txt);
  free(txt);
  cJSON_Delete(o);
}

static void tw_chat_usage(FILE *f) {
  fprintf(f,
          "usage: twain chat [--endpoint EP] [--reasoning low|medium|high] [--date YYYY-MM-DD]\n"
          "         [--show-analysis] [--json] [--max-tokens N] [--temperature T] [--seed S]\n"
          "         [--system TEXT] [--timeout-ms N] [--connect-timeout-ms N] \"text\"\n"
          "  default endpoint %s; --connect-timeout-ms (default %d) bounds the wait for the\n"
          "  server, --timeout-ms (default 300000) the whole answer. Exit 0 ok, 1 failed,\n"
          "  2 bad usage, %d: max_tokens cut the answer before the final channel.\n",
          TW_ROUTER_CLIENT_ENDPOINT, TW_CLI_CONNECT_TIMEOUT_MS, TW_CLI_EXIT_CUT);
}

int tw_cli_chat(int argc, char **argv) {
  tw_client_opts_t o = {0};
  Twain__V1__ChatRequest chat = TWAIN__V1__CHAT_REQUEST__INIT;
  char today[16];
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(today, sizeof today, "%Y-%m-%d", &tm);
  chat.date = today; /* spec §4.5: "Current date:" in the system message */
  static const char *const flags[] = {"--reasoning", "--date", "--system", NULL};
  int i = tw_client_parse(argc, argv, &o, "twain chat", flags, tw_chat_extra, &chat);
  if (i == -2) {
    tw_chat_usage(stdout);
    return 0;
  }
  if (i >= 0 && i + 1 != argc)
    fprintf(stderr, "twain chat: %s\n", i >= argc ? "missing the prompt text" : "give the prompt as one argument (quote it)");
  if (i < 0 || i + 1 != argc) {
    tw_chat_usage(stderr);
    return 2;
  }
  Twain__V1__Message user = TWAIN__V1__MESSAGE__INIT;
  user.role = "user";
  user.content = argv[i];
  Twain__V1__Message *msgs[1] = {&user};
  chat.messages = msgs;
  chat.n_messages = 1;
  Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
  tw_client_sampling(&o, &sp);
  chat.sampling = &sp;
  chat.stream = !o.json;
  Twain__V1__ClientRequest req = TWAIN__V1__CLIENT_REQUEST__INIT;
  req.request_id = 1;
  req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
  req.chat = &chat;
  tw_chat_state_t st = {.o = &o, .out = cJSON_CreateObject()};
  tw_call_err_t err = {{0}, {0}};
  int rc = tw_client_call(&o, &req, tw_chat_on_reply, &st, "twain chat", &err);
  if (o.json && rc == 0) {
    char *txt = cJSON_PrintUnformatted(st.out);
    printf("%s\n", txt);
    free(txt);
  } else if (o.json) {
    tw_print_json_error(&err);
  }
  if (rc == 0 && !o.json && !st.got_final &&
      st.finish_reason == TWAIN__V1__FINISH_REASON__FINISH_LENGTH) {
    fprintf(stderr,
            "twain chat: no answer: finish reason LENGTH: max_tokens cut the analysis before the "
            "final channel (raise --max-tokens, or see it with --show-analysis)\n");
    rc = TW_CLI_EXIT_CUT;
  }
  cJSON_Delete(st.out);
  return rc;
}

/* ---- generate ---- */

typedef struct {
  const tw_client_opts_t *o;
  cJSON *ids;
  int n;
} tw_gen_state_t;

static void tw_gen_on_reply(void *user, const Twain__V1__ServerReply *rep) {
  tw_gen_state_t *g = user;
  for (size_t i = 0; i < rep->n_token_ids; i++) {
    if (g->o->json) {
      cJSON_AddItemToArray(g->ids, cJSON_CreateNumber(rep->token_ids[i]));
    } else {
      printf("%s%d", g->n ? " " : "", rep->token_ids[i]);
      fflush(stdout);
    }
    g->n++;
  }
  if (rep->done && !g->o->json) printf("\n");
  if (rep->done && g->o->json && !(rep->error && rep->error->code)) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "token_ids", g->ids);
    g->ids = NULL;
    cJSON_AddItemToObject(o, "usage", tw_json_usage(rep));
    cJSON_AddStringToObject(o, "finish_reason", tw_finish_name(rep->finish_reason));
    char *txt = cJSON_PrintUnformatted(o);
    printf("%s\n", txt);
    free(txt);
    cJSON_Delete(o);
  }
}

typedef struct {
  int32_t stop[16];
  size_t n_stop;
} tw_gen_extra_t;

static int tw_gen_extra(void *user, const char *prog, const char *a, const char *v) {
  tw_gen_extra_t *e = user;
  (void)a; /* --stop-ids */
  char buf[256];
  if (snprintf(buf, sizeof buf, "%s", v) >= (int)sizeof buf) {
    fprintf(stderr, "%s: --stop-ids is too long\n", prog);
    return -1;
  }
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    long long n;
    if (e->n_stop == 16) {
      fprintf(stderr, "%s: --stop-ids takes at most 16 ids\n", prog);
      return -1;
    }
    if (tw_cli_parse_int(prog, "--stop-ids", t, 0, INT32_MAX, &n)) return -1;
    e->stop[e->n_stop++] = (int32_t)n;
  }
  return 0;
}

static void tw_gen_usage(FILE *f) {
  fprintf(f,
          "usage: twain generate [--endpoint EP] [--max-tokens N] [--stop-ids A,B] [--temperature T]\n"
          "         [--seed S] [--json] [--timeout-ms N] [--connect-timeout-ms N] ID [ID...]\n"
          "  (ids may also be one \"1,2,3\"); default endpoint %s; --connect-timeout-ms\n"
          "  (default %d) bounds the wait for the server, --timeout-ms (default 300000) the answer\n",
          TW_ROUTER_CLIENT_ENDPOINT, TW_CLI_CONNECT_TIMEOUT_MS);
}

int tw_cli_generate(int argc, char **argv) {
  tw_client_opts_t o = {0};
  tw_gen_extra_t e = {0};
  static const char *const flags[] = {"--stop-ids", NULL};
  int i = tw_client_parse(argc, argv, &o, "twain generate", flags, tw_gen_extra, &e);
  if (i == -2) {
    tw_gen_usage(stdout);
    return 0;
  }
  if (i >= 0 && i >= argc) fprintf(stderr, "twain generate: missing the prompt token ids\n");
  if (i < 0 || i >= argc) {
    tw_gen_usage(stderr);
    return 2;
  }
  int32_t *ids = malloc(sizeof(int32_t) * 65536);
  size_t n = 0;
  int bad = 0;
  for (; i < argc && !bad; i++) {
    char *save = NULL, *buf = strdup(argv[i]);
    for (char *t = strtok_r(buf, ", []", &save); t && !bad; t = strtok_r(NULL, ", []", &save)) {
      long long v;
      if (n == 65536) {
        fprintf(stderr, "twain generate: more than 65536 prompt token ids\n");
        bad = 1;
      } else if (tw_cli_parse_int("twain generate", "token id", t, 0, INT32_MAX, &v)) {
        bad = 1;
      } else {
        ids[n++] = (int32_t)v;
      }
    }
    free(buf);
  }
  if (bad || n == 0) {
    if (!bad) fprintf(stderr, "twain generate: missing the prompt token ids\n");
    free(ids);
    return 2;
  }
  Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
  g.prompt_ids = ids;
  g.n_prompt_ids = n;
  Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
  tw_client_sampling(&o, &sp);
  sp.stop_token_ids = e.stop;
  sp.n_stop_token_ids = e.n_stop;
  g.sampling = &sp;
  g.stream = true;
  Twain__V1__ClientRequest req = TWAIN__V1__CLIENT_REQUEST__INIT;
  req.request_id = 1;
  req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
  req.generate = &g;
  tw_gen_state_t st = {.o = &o, .ids = cJSON_CreateArray()};
  tw_call_err_t err = {{0}, {0}};
  int rc = tw_client_call(&o, &req, tw_gen_on_reply, &st, "twain generate", &err);
  if (rc && o.json) tw_print_json_error(&err);
  cJSON_Delete(st.ids);
  free(ids);
  return rc;
}
