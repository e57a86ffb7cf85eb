/* cli_chat.c: `twain chat` and `twain generate`, C clients of the twain.v1
 * API (docs/api.md). One DEALER socket, one request, streamed replies until
 * the one with done = true (bounded by --timeout-ms). */
#include "router/cli/cli.h"
#include "router/cli/cli_text.h"

#include "common/text/harmony.h"

#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg.h"
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
#include <unistd.h>

/* Exit code of `twain chat` when max_tokens cut the answer before the final
 * channel produced any text (docs/api.md "Clients"). */
#define TW_CLI_EXIT_CUT 3
/* Default wait for the connection to the endpoint (--connect-timeout-ms). */
#define TW_CLI_CONNECT_TIMEOUT_MS 5000

typedef struct {
  const char *endpoint;
  int timeout_ms, connect_timeout_ms;
  bool json, show_analysis;
  int32_t max_tokens;
  bool max_tokens_set, seed_set;
  double temperature;
  long long seed;
  const char *api_key; /* $TWAIN_API_KEY: for a router run with --api-key */
  const char *server_key, *identity; /* CURVE (tw_auth_client_keys); NULL: env or plaintext */
} tw_client_opts_t;

#define TW_CLIENT_OPTS_DEFAULT                                                         \
  ((tw_client_opts_t){.endpoint = TW_ROUTER_CLIENT_ENDPOINT, .timeout_ms = 300000,   \
                      .connect_timeout_ms = TW_CLI_CONNECT_TIMEOUT_MS,              \
                      .api_key = getenv("TWAIN_API_KEY")})

/* The options chat and generate share (opts.h rows), on tw_client_opts_t o. */
#define TW_CLIENT_OPT_ROWS(o)                                                                      \
  TW_OPT_STR("endpoint", &(o).endpoint, "EP", "the router's client endpoint"),                     \
      TW_OPT_INT("max-tokens", &(o).max_tokens, 1, INT32_MAX, "N",                                 \
                 "generate at most N tokens (default: the server's)"),                             \
      TW_OPT_DOUBLE("temperature", &(o).temperature, 0, 100, "T", "sampling temperature"),         \
      TW_OPT_LONG("seed", &(o).seed, 0, LLONG_MAX, "S",                                            \
                  "sampling seed: the same tokens every time (default: a fresh one)"),             \
      TW_OPT_FLAG("json", &(o).json, "print one JSON object (ids or messages, usage, finish)"),    \
      TW_OPT_INT("timeout-ms", &(o).timeout_ms, 1, INT_MAX, "MS", "bound on the whole answer"),    \
      TW_OPT_INT("connect-timeout-ms", &(o).connect_timeout_ms, 1, INT_MAX, "MS",                  \
                 "bound on the wait for the server"),                                              \
      TW_CLIENT_CURVE_OPT_ROWS((o).server_key, (o).identity)

/* The v1 code name of a tw_auth_client_open error: the router refused our
 * handshake (CURVE keys) is UNAUTHENTICATED, a malformed endpoint
 * INVALID_ARGUMENT, nobody listening UNAVAILABLE. */
static const char *tw_client_open_code(tw_status_t st) {
  return st == TW_ERR_INVALID_ARGUMENT ? "UNAUTHENTICATED"
         : st == TW_ERR_FORMAT         ? "INVALID_ARGUMENT"
                                       : "UNAVAILABLE";
}

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
  int rc = 1;
  int sto = o->connect_timeout_ms < o->timeout_ms ? o->connect_timeout_ms : o->timeout_ms;
  tw_auth_keys_t keys;
  if (tw_auth_client_keys(o->server_key, o->identity, &keys) != TW_OK) {
    tw_call_fail(err, prog, "INVALID_ARGUMENT", "%s", tw_last_error());
    return 1;
  }
  void *ctx = zmq_ctx_new(), *s = NULL, *watch = NULL;
  tw_status_t os =
      ctx ? tw_auth_client_open(ctx, o->endpoint, &keys, sto, 0, &s)
          : tw_err(TW_ERR_TRANSPORT, "zmq_ctx_new failed: %s", zmq_strerror(zmq_errno()));
  memset(&keys, 0, sizeof keys);
  if (os != TW_OK) { /* nobody listens, or the handshake refused: wrong or missing CURVE keys */
    tw_call_fail(err, prog, tw_client_open_code(os), "%s", tw_last_error());
    if (ctx) zmq_ctx_term(ctx);
    return 1;
  }
  watch = tw_auth_client_watch(ctx, s); /* a router that dies ends the wait at once */
  Twain__V1__ClientRequest keyed = *req;
  if (o->api_key && o->api_key[0]) keyed.api_key = (char *)o->api_key;
  size_t len = protobuf_c_message_get_packed_size(&keyed.base);
  uint8_t *buf = malloc(len ? len : 1);
  protobuf_c_message_pack(&keyed.base, buf);
  if (zmq_send(s, buf, len, 0) < 0) {
    if (zmq_errno() == EAGAIN)
      tw_call_fail(err, prog, "UNAVAILABLE", "no answer from %s within %d ms (%s)", o->endpoint,
                   sto,
                   sto < o->connect_timeout_ms ? "--timeout-ms bounds the connection too"
                                               : "is `twain serve` running?");
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
                   "no answer from %s within %d ms (--timeout-ms: connected, but the answer did "
                   "not end in time)",
                   o->endpoint, o->timeout_ms);
      goto out;
    }
    zmq_pollitem_t it[2] = {{.socket = s, .events = ZMQ_POLLIN},
                            {.socket = watch, .events = ZMQ_POLLIN}};
    if (zmq_poll(it, watch ? 2 : 1, left) > 0 && !(it[0].revents & ZMQ_POLLIN) &&
        tw_auth_client_lost(watch)) {
      tw_call_fail(err, prog, "UNAVAILABLE",
                   "the connection to the router at %s closed before the answer ended (the "
                   "router stopped or crashed)",
                   o->endpoint);
      goto out;
    }
    tw_msg_t m = {0};
    tw_status_t st = tw_msg_recv(s, false, 0, &m);
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
  tw_auth_client_unwatch(s, watch);
  zmq_close(s);
  zmq_ctx_term(ctx);
  return rc;
}

static void tw_client_sampling(const tw_client_opts_t *o, Twain__V1__SamplingParams *s) {
  s->temperature = (float)o->temperature;
  s->seed = (uint64_t)o->seed;
  s->explicit_seed = o->seed_set;
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
  char *final;        /* the final channel's text (interactive: the next turn's history) */
  size_t final_len;
} tw_chat_state_t;

static void tw_chat_keep_final(tw_chat_state_t *c, const char *text) {
  size_t n = strlen(text);
  char *grown = realloc(c->final, c->final_len + n + 1);
  if (!grown) return; /* the history loses this piece; the answer was printed */
  memcpy(grown + c->final_len, text, n + 1);
  c->final = grown;
  c->final_len += n;
}

static void tw_chat_on_reply(void *user, const Twain__V1__ServerReply *rep) {
  tw_chat_state_t *c = user;
  for (size_t i = 0; i < rep->n_deltas; i++)
    if (!strcmp(rep->deltas[i]->channel, "final") && rep->deltas[i]->content[0]) {
      c->got_final = true;
      tw_chat_keep_final(c, rep->deltas[i]->content);
    }
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

/* --date: YYYY-MM-DD with a real month and day (or empty: no date line).
 * 0 ok, -1 not. */
static int tw_date_check(const char *v) {
  if (!v[0] || tw_harmony_date_valid(v)) return 0;
  return -1;
}

/* --reasoning low|medium|high (opts.h TW_OPT_FN; dst: the request's effort). */
static int tw_reasoning_opt(const char *v, void *dst, char *err, size_t errlen) {
  Twain__V1__ReasoningEffort *r = dst;
  if (!strcmp(v, "low")) *r = TWAIN__V1__REASONING_EFFORT__REASONING_LOW;
  else if (!strcmp(v, "medium")) *r = TWAIN__V1__REASONING_EFFORT__REASONING_MEDIUM;
  else if (!strcmp(v, "high")) *r = TWAIN__V1__REASONING_EFFORT__REASONING_HIGH;
  else {
    snprintf(err, errlen, "must be low, medium or high, got '%s'", v);
    return -1;
  }
  return 0;
}

/* --date YYYY-MM-DD (opts.h TW_OPT_FN; dst: the request's date string). */
static int tw_date_opt(const char *v, void *dst, char *err, size_t errlen) {
  if (tw_date_check(v)) {
    snprintf(err, errlen, "must be a date YYYY-MM-DD, got '%s'", v);
    return -1;
  }
  *(const char **)dst = v;
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

/* All of `f` as a string (malloc'ed), NULL on a read error or no memory. */
static char *tw_read_all(FILE *f) {
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
    n += got;
    if (cap - n - 1 == 0) {
      char *grown = realloc(buf, cap * 2);
      if (!grown) free(buf);
      buf = grown;
      cap *= 2;
    }
  }
  if (buf && ferror(f)) {
    free(buf);
    return NULL;
  }
  if (buf) buf[n] = '\0';
  return buf;
}

/* One chat request with `chat`'s messages, printed as it streams (or as
 * JSON); fills st. Returns the exit code (TW_CLI_EXIT_CUT: cut by max_tokens). */
static int tw_chat_once(const tw_client_opts_t *o, Twain__V1__ChatRequest *chat, uint64_t id,
                        tw_chat_state_t *st) {
  Twain__V1__ClientRequest req = TWAIN__V1__CLIENT_REQUEST__INIT;
  req.request_id = id;
  req.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
  req.chat = chat;
  tw_call_err_t err = {{0}, {0}};
  int rc = tw_client_call(o, &req, tw_chat_on_reply, st, "twain chat", &err);
  if (o->json && rc == 0) {
    char *txt = cJSON_PrintUnformatted(st->out);
    printf("%s\n", txt);
    free(txt);
  } else if (o->json) {
    tw_print_json_error(&err);
  }
  if (rc == 0 && !o->json && !st->got_final &&
      st->finish_reason == TWAIN__V1__FINISH_REASON__FINISH_LENGTH) {
    fprintf(stderr,
            "twain chat: no answer: finish reason LENGTH: max_tokens cut the analysis before the "
            "final channel (raise --max-tokens, or see it with --show-analysis)\n");
    rc = TW_CLI_EXIT_CUT;
  }
  return rc;
}

#define TW_CHAT_MAX_TURNS 256

/* One message `text` (in != NULL: none), or a conversation read line by line
 * from `in`: each line is the next user turn, sent with every turn before it
 * and the assistant's final answers; "/exit", "/quit" or end of input ends it. */
static int tw_chat_turns(const tw_client_opts_t *o, Twain__V1__ChatRequest *chat, const char *text,
                         FILE *in) {
  static Twain__V1__Message turns[2 * TW_CHAT_MAX_TURNS];
  static Twain__V1__Message *msgs[2 * TW_CHAT_MAX_TURNS];
  char *owned[2 * TW_CHAT_MAX_TURNS] = {0};
  size_t n = 0;
  int rc = 0;
  char *line = NULL;
  size_t line_cap = 0;
  if (in)
    fprintf(stderr, "twain chat: connected to %s; one message per line, Ctrl-D or /exit ends\n",
            o->endpoint);
  for (uint64_t id = 1;; id++) {
    const char *user_text = text;
    if (in) {
      fprintf(stderr, "> ");
      fflush(stderr);
      ssize_t got = getline(&line, &line_cap, in);
      if (got < 0) {
        fputc('\n', stderr);
        break;
      }
      line[strcspn(line, "\r\n")] = '\0';
      if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
      if (!line[0]) continue;
      if (n + 2 > 2 * TW_CHAT_MAX_TURNS) {
        fprintf(stderr, "twain chat: %d turns: start a new conversation\n", TW_CHAT_MAX_TURNS);
        rc = 1;
        break;
      }
      user_text = owned[n] = strdup(line);
    }
    turns[n] = (Twain__V1__Message)TWAIN__V1__MESSAGE__INIT;
    turns[n].role = "user";
    turns[n].content = (char *)user_text;
    msgs[n] = &turns[n];
    n++;
    chat->messages = msgs;
    chat->n_messages = n;
    tw_chat_state_t st = {.o = o, .out = cJSON_CreateObject()};
    rc = tw_chat_once(o, chat, id, &st);
    cJSON_Delete(st.out);
    if (!in) {
      free(st.final);
      break;
    }
    if (rc != 0 && rc != TW_CLI_EXIT_CUT) { /* the turn failed: the user may retry it */
      free(owned[--n]);
      owned[n] = NULL;
      free(st.final);
      continue;
    }
    turns[n] = (Twain__V1__Message)TWAIN__V1__MESSAGE__INIT;
    turns[n].role = "assistant";
    turns[n].channel = "final";
    owned[n] = st.final ? st.final : strdup("");
    turns[n].content = owned[n];
    msgs[n] = &turns[n];
    n++;
    rc = 0;
  }
  free(line);
  for (size_t k = 0; k < n; k++) free(owned[k]);
  return rc;
}

int tw_cli_chat(int argc, char **argv) {
  tw_client_opts_t o = TW_CLIENT_OPTS_DEFAULT;
  Twain__V1__ChatRequest chat = TWAIN__V1__CHAT_REQUEST__INIT;
  char today[16];
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(today, sizeof today, "%Y-%m-%d", &tm);
  const char *date = today, *system = NULL; /* spec §4.5: "Current date:" in the system message */
  tw_opt_t opts[] = {
      TW_CLIENT_OPT_ROWS(o),
      TW_OPT_FN("reasoning", &chat.reasoning, tw_reasoning_opt, "low|medium|high",
                "reasoning effort (default: the server's)"),
      TW_OPT_FN("date", &date, tw_date_opt, "YYYY-MM-DD", "current date in the system message\n"
                                                           "(default today; empty: none)"),
      TW_OPT_STR("system", &system, "TEXT", "instructions (the developer message)"),
      TW_OPT_FLAG("show-analysis", &o.show_analysis, "print the analysis channel too"),
  };
  char epilog[320];
  snprintf(epilog, sizeof epilog,
           "A router run with --api-key takes the key from $TWAIN_API_KEY.\n"
           "Exit 0 ok, 1 failed, 2 bad usage, %d: max_tokens cut the answer before the final\n"
           "channel.",
           TW_CLI_EXIT_CUT);
  tw_opts_spec_t spec = {.prog = "twain chat", .synopsis = "[OPTIONS] [\"text\"]",
                         .description = "Send a chat request to a running service and print the answer.\n"
                                        "Without text: stdin is the message, or, on a terminal, an\n"
                                        "interactive conversation (one message per line, /exit ends).",
                         .epilog = epilog, .env_prefix = "TWAIN_CHAT_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0], .min_args = 0, .max_args = 1};
  int i = 0, prc = tw_opts_parse(&spec, argc, argv, &i);
  if (prc != TW_OPTS_RUN) return prc;
  o.max_tokens_set = tw_opts_given(&spec, "max-tokens");
  o.seed_set = tw_opts_given(&spec, "seed");
  chat.date = (char *)date;
  chat.instructions = (char *)system;
  Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
  tw_client_sampling(&o, &sp);
  chat.sampling = &sp;
  chat.stream = !o.json;
  if (i < argc) return tw_chat_turns(&o, &chat, argv[i], NULL);
  if (isatty(STDIN_FILENO)) { /* no text on a terminal: an interactive conversation */
    if (o.json) {
      fprintf(stderr, "twain chat: --json needs the text (an argument or stdin)\n");
      return 2;
    }
    return tw_chat_turns(&o, &chat, NULL, stdin);
  }
  char *text = tw_read_all(stdin); /* piped: the whole input is the message */
  if (!text) {
    fprintf(stderr, "twain chat: cannot read the message from stdin\n");
    return 1;
  }
  if (!text[strspn(text, " \t\r\n")]) {
    fprintf(stderr, "twain chat: no message: give the text as an argument or on stdin, or run it on "
                    "a terminal for a conversation\n");
    free(text);
    return 2;
  }
  int rc = tw_chat_turns(&o, &chat, text, NULL);
  free(text);
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
  if (rep->done && !g->o->json && g->n) printf("\n"); /* ends the line of ids, if any */
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
  int n_stop;
} tw_gen_extra_t;

/* --stop-ids A,B,... (opts.h TW_OPT_FN; dst: tw_gen_extra_t, replaced). */
static int tw_stop_ids_opt(const char *v, void *dst, char *err, size_t errlen) {
  tw_gen_extra_t *e = dst;
  return tw_opts_id_list(v, e->stop, 16, &e->n_stop, err, errlen);
}

int tw_cli_generate(int argc, char **argv) {
  tw_client_opts_t o = TW_CLIENT_OPTS_DEFAULT;
  tw_gen_extra_t e = {0};
  tw_opt_t opts[] = {
      TW_CLIENT_OPT_ROWS(o),
      TW_OPT_FN("stop-ids", &e, tw_stop_ids_opt, "A,B,...", "stop after one of these ids"),
  };
  tw_opts_spec_t spec = {.prog = "twain generate",
                         .synopsis = "[OPTIONS] [ID...]",
                         .description =
                             "Send prompt token ids to a running service and print the "
                             "generated ids\n(ids may also be one \"1,2,3\"; none: read "
                             "from stdin, e.g. `twain tokenize | twain generate`).",
                         .epilog = "A router run with --api-key takes the key from $TWAIN_API_KEY.",
                         .env_prefix = "TWAIN_GENERATE_",
                         .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0],
                         .min_args = 0,
                         .max_args = -1};
  int i = 0, prc = tw_opts_parse(&spec, argc, argv, &i);
  if (prc != TW_OPTS_RUN) return prc;
  o.max_tokens_set = tw_opts_given(&spec, "max-tokens");
  o.seed_set = tw_opts_given(&spec, "seed");
  char *piped = NULL; /* no ids as arguments: they come on stdin (not a terminal) */
  if (i >= argc && !isatty(STDIN_FILENO) && !(piped = tw_read_all(stdin))) {
    fprintf(stderr, "twain generate: cannot read the ids from stdin\n");
    return 1;
  }
  /* the ids: each argument, or all of stdin, as tw_cli_parse_ids reads them */
  tw_token_ids_t tv;
  tw_token_ids_init(&tv);
  int bad = 0;
  if (piped) bad = !tw_cli_parse_ids("generate", piped, &tv);
  for (; !piped && i < argc && !bad; i++) bad = !tw_cli_parse_ids("generate", argv[i], &tv);
  free(piped);
  if (!bad && tv.n > 65536) {
    fprintf(stderr, "twain generate: more than 65536 prompt token ids\n");
    bad = 1;
  }
  if (bad || tv.n == 0) {
    if (!bad)
      fprintf(stderr, "twain generate: missing the prompt token ids (arguments, or a JSON array or "
                      "numbers on stdin)\n");
    tw_token_ids_fini(&tv);
    return 2;
  }
  Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
  g.prompt_ids = tv.ids;
  g.n_prompt_ids = tv.n;
  Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
  tw_client_sampling(&o, &sp);
  sp.stop_token_ids = e.stop;
  sp.n_stop_token_ids = (size_t)e.n_stop;
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
  tw_token_ids_fini(&tv);
  return rc;
}
