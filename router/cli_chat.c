/* cli_chat.c: `twain chat` and `twain generate`, C clients of the twain.v1
 * API (docs/api.md). One DEALER socket, one request, streamed replies until
 * the one with done = true (bounded by --timeout-ms). */
#include "router/cli.h"

#include "common/log.h"
#include "common/msg.h"
#include "proto/twain_api.pb-c.h"
#include "router/router.h"

#include <cjson/cJSON.h>
#include <zmq.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  const char *endpoint;
  int timeout_ms;
  bool json, show_analysis;
  int32_t max_tokens;
  bool max_tokens_set;
  float temperature;
  uint64_t seed;
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

/* Send `req`, call on_reply for each reply until done. Returns 0, or 1 on an
 * error reply / timeout (message printed). */
typedef void (*tw_on_reply_fn)(void *user, const Twain__V1__ServerReply *rep);
static int tw_client_call(const tw_client_opts_t *o, const Twain__V1__ClientRequest *req,
                          tw_on_reply_fn fn, void *user, const char *prog) {
  void *ctx = zmq_ctx_new();
  void *s = NULL;
  int rc = 1;
  if (tw_msg_socket_open(ctx, ZMQ_DEALER, o->endpoint, false, NULL, 0, &s) != TW_OK) {
    fprintf(stderr, "%s: %s\n", prog, tw_last_error());
    zmq_ctx_term(ctx);
    return 1;
  }
  /* DEALER send blocks until connected; give it the whole timeout */
  int64_t t_end = tw_msg_clock_ns() + (int64_t)o->timeout_ms * 1000000;
  size_t len = protobuf_c_message_get_packed_size(&req->base);
  uint8_t *buf = malloc(len ? len : 1);
  protobuf_c_message_pack(&req->base, buf);
  int sto = o->timeout_ms;
  zmq_setsockopt(s, ZMQ_SNDTIMEO, &sto, sizeof sto);
  if (zmq_send(s, buf, len, 0) < 0) {
    fprintf(stderr, "%s: cannot send to %s: %s\n", prog, o->endpoint, zmq_strerror(zmq_errno()));
    goto out;
  }
  for (;;) {
    int64_t left = (t_end - tw_msg_clock_ns()) / 1000000;
    if (left <= 0) {
      fprintf(stderr, "%s: no answer from %s within %d ms (is `twain serve` running?)\n", prog,
              o->endpoint, o->timeout_ms);
      goto out;
    }
    tw_msg_t m = {0};
    tw_status_t st = tw_msg_recv(s, false, (int)left, &m);
    if (st == TW_INPROGRESS) continue;
    if (st != TW_OK) {
      fprintf(stderr, "%s: %s\n", prog, tw_last_error());
      tw_msg_fini(&m);
      goto out;
    }
    Twain__V1__ServerReply *rep = twain__v1__server_reply__unpack(NULL, m.len, m.data);
    tw_msg_fini(&m);
    if (!rep) {
      fprintf(stderr, "%s: undecodable reply from the router\n", prog);
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
      if (rc)
        fprintf(stderr, "%s: %s: %s\n", prog, tw_code_name(rep->error->code),
                rep->error->message ? rep->error->message : "");
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

/* Common options; returns the index of the first positional, -1 on error. */
static int tw_client_parse(int argc, char **argv, tw_client_opts_t *o, const char *prog,
                           int (*extra)(void *, const char *, const char *), void *extra_user) {
  o->endpoint = TW_ROUTER_CLIENT_ENDPOINT;
  o->timeout_ms = 300000;
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (a[0] != '-' || !strcmp(a, "--")) break;
    if (!strcmp(a, "--json")) { o->json = true; continue; }
    if (!strcmp(a, "--show-analysis")) { o->show_analysis = true; continue; }
    if (!v) {
      fprintf(stderr, "%s: %s needs a value\n", prog, a);
      return -1;
    }
    i++;
    if (!strcmp(a, "--endpoint")) o->endpoint = v;
    else if (!strcmp(a, "--timeout-ms")) o->timeout_ms = atoi(v);
    else if (!strcmp(a, "--max-tokens")) { o->max_tokens = atoi(v); o->max_tokens_set = true; }
    else if (!strcmp(a, "--temperature")) o->temperature = strtof(v, NULL);
    else if (!strcmp(a, "--seed")) o->seed = strtoull(v, NULL, 10);
    else if (!extra || extra(extra_user, a, v) != 0) {
      fprintf(stderr, "%s: unknown option %s\n", prog, a);
      return -1;
    }
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
} tw_chat_state_t;

static void tw_chat_on_reply(void *user, const Twain__V1__ServerReply *rep) {
  tw_chat_state_t *c = user;
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

static int tw_chat_extra(void *user, const char *a, const char *v) {
  Twain__V1__ChatRequest *c = user;
  if (!strcmp(a, "--reasoning")) {
    if (!strcmp(v, "low")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_LOW;
    else if (!strcmp(v, "medium")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_MEDIUM;
    else if (!strcmp(v, "high")) c->reasoning = TWAIN__V1__REASONING_EFFORT__REASONING_HIGH;
    else return -1;
    return 0;
  }
  if (!strcmp(a, "--date")) {
    c->date = (char *)v;
    return 0;
  }
  if (!strcmp(a, "--system")) {
    c->instructions = (char *)v;
    return 0;
  }
  return -1;
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
  int i = tw_client_parse(argc, argv, &o, "twain chat", tw_chat_extra, &chat);
  if (i < 0 || i + 1 != argc) {
    fprintf(stderr,
            "usage: twain chat [--endpoint EP] [--reasoning low|medium|high] [--date YYYY-MM-DD]\n"
            "         [--show-analysis] [--json] [--max-tokens N] [--temperature T] [--seed S]\n"
            "         [--system TEXT] [--timeout-ms N] \"text\"   (default endpoint %s)\n",
            TW_ROUTER_CLIENT_ENDPOINT);
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
  int rc = tw_client_call(&o, &req, tw_chat_on_reply, &st, "twain chat");
  if (o.json && rc == 0) {
    char *txt = cJSON_PrintUnformatted(st.out);
    printf("%s\n", txt);
    free(txt);
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
  if (rep->done && g->o->json) {
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

static int tw_gen_extra(void *user, const char *a, const char *v) {
  tw_gen_extra_t *e = user;
  if (strcmp(a, "--stop-ids")) return -1;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", v);
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && e->n_stop < 16;
       t = strtok_r(NULL, ",", &save))
    e->stop[e->n_stop++] = atoi(t);
  return 0;
}

int tw_cli_generate(int argc, char **argv) {
  tw_client_opts_t o = {0};
  tw_gen_extra_t e = {0};
  int i = tw_client_parse(argc, argv, &o, "twain generate", tw_gen_extra, &e);
  if (i < 0 || i >= argc) {
    fprintf(stderr,
            "usage: twain generate [--endpoint EP] [--max-tokens N] [--stop-ids A,B] [--temperature T]\n"
            "         [--seed S] [--json] [--timeout-ms N] ID [ID...]   (ids may also be one \"1,2,3\")\n");
    return 2;
  }
  int32_t *ids = malloc(sizeof(int32_t) * 65536);
  size_t n = 0;
  for (; i < argc; i++) {
    char *save = NULL, *buf = strdup(argv[i]);
    for (char *t = strtok_r(buf, ", []", &save); t && n < 65536; t = strtok_r(NULL, ", []", &save))
      ids[n++] = atoi(t);
    free(buf);
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
  int rc = tw_client_call(&o, &req, tw_gen_on_reply, &st, "twain generate");
  cJSON_Delete(st.ids);
  free(ids);
  return rc;
}
