/* bench_router.c: router overhead per streamed token at 1, 64 and 512
 * concurrent streams, over the protobuf API and over the OpenAI-compatible
 * HTTP API. The real router (router.h) runs on its own thread (its HTTP
 * server runs in the same loop); a fake prefill worker answers at once and a
 * fake decode worker streams one token per sequence per step as fast as it
 * can (no engine cost): a Harmony final message ("<|channel|>final<|message|>"
 * then one text id repeated). Clients: one DEALER running S streaming
 * Generate or Chat requests of T tokens, or S HTTP connections each with one
 * streamed /v1/completions or /v1/chat/completions request (SSE, read until
 * "data: [DONE]"). Reported: the router thread's CPU time per token (pthread
 * CPU clock) and the wall-clock token rate seen by the client.
 *   twain-bench-router [--tokens N (per configuration, default 51200)] */
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg.h"
#include "common/text/tokenizer.h"
#include "proto/twain_api.pb-c.h"
#include "proto/twain_internal.pb-c.h"
#include "router/router.h"

#include <zmq.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  tw_auth_keys_t keys; /* the link keys of the router and the fake workers */
  tw_router_params_t p;
  atomic_int stop;
  char cep[256], wep[256];
  volatile int bound;
} tw_bench_t;

/* A failed setup or send leaves the numbers meaningless: stop the run. */
static void must(tw_status_t st, const char *what) {
  if (st == TW_OK) return;
  fprintf(stderr, "bench_router: %s: %s\n", what, tw_last_error());
  exit(1);
}

static void on_bound(void *arg, const char *c, const char *w) {
  tw_bench_t *b = arg;
  snprintf(b->cep, sizeof b->cep, "%s", c);
  snprintf(b->wep, sizeof b->wep, "%s", w);
  __atomic_store_n(&b->bound, 1, __ATOMIC_SEQ_CST);
}

static void *router_main(void *arg) {
  tw_bench_t *b = arg;
  must(tw_router_run(&b->p, &b->stop), "router");
  return NULL;
}

/* ---- fake workers ---- */
typedef struct {
  uint64_t id;
  int32_t left, pos;
} fseq_t;

/* what every sequence generates: script[0..n_script) then script[n_script - 1] */
static int32_t script[8];
static int n_script;

typedef struct {
  tw_bench_t *b;
  atomic_int stop;
  void *ctx;
} fake_t;

static void send_env(void *s, Twain__Internal__V1__Envelope *e) {
  must(tw_msg_send(s, NULL, &e->base), "fake worker send");
}

static void fake_register(void *s, const char *name, Twain__Internal__V1__Pool pool) {
  Twain__Internal__V1__Capacity c = TWAIN__INTERNAL__V1__CAPACITY__INIT;
  c.free_kv_blocks = c.total_kv_blocks = 1 << 24;
  Twain__Internal__V1__Register r = TWAIN__INTERNAL__V1__REGISTER__INIT;
  r.pool = pool;
  r.name = (char *)name;
  r.capacity = &c;
  r.kv_block_size = 16;
  Twain__Internal__V1__Envelope e = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  e.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER;
  e.register_ = &r;
  send_env(s, &e);
}

static void fake_heartbeat(void *s) {
  Twain__Internal__V1__Capacity c = TWAIN__INTERNAL__V1__CAPACITY__INIT;
  c.free_kv_blocks = c.total_kv_blocks = 1 << 24;
  Twain__Internal__V1__Heartbeat h = TWAIN__INTERNAL__V1__HEARTBEAT__INIT;
  h.capacity = &c;
  Twain__Internal__V1__Envelope e = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  e.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
  e.heartbeat = &h;
  send_env(s, &e);
}

static void *fake_main(void *arg) {
  fake_t *f = arg;
  void *pre, *dec;
  must(tw_msg_socket_open_auth(f->ctx, ZMQ_DEALER, f->b->wep, false, &f->b->keys, NULL, 0, &pre),
       "fake prefill socket");
  must(tw_msg_socket_open_auth(f->ctx, ZMQ_DEALER, f->b->wep, false, &f->b->keys, NULL, 0, &dec),
       "fake decode socket");
  fake_register(pre, "fake-prefill", TWAIN__INTERNAL__V1__POOL__POOL_PREFILL);
  fake_register(dec, "fake-decode", TWAIN__INTERNAL__V1__POOL__POOL_DECODE);
  fseq_t *seqs = malloc(sizeof(fseq_t) * 8192);
  int n = 0;
  int64_t last_hb = 0;
  Twain__Internal__V1__KvLayout kl = TWAIN__INTERNAL__V1__KV_LAYOUT__INIT;
  Twain__Internal__V1__KvHandoff h = TWAIN__INTERNAL__V1__KV_HANDOFF__INIT;
  h.layout = &kl;
  while (!atomic_load(&f->stop)) {
    int64_t now = tw_msg_clock_ns();
    if (now - last_hb > 200000000) {
      fake_heartbeat(pre);
      fake_heartbeat(dec);
      last_hb = now;
    }
    void *socks[2] = {pre, dec};
    for (int k = 0; k < 2; k++)
      for (int m = 0; m < 4096; m++) {
        tw_msg_t msg = {0};
        if (tw_msg_recv(socks[k], false, n ? 0 : (k ? 1 : 0), &msg) != TW_OK) break;
        Twain__Internal__V1__Envelope *e = twain__internal__v1__envelope__unpack(NULL, msg.len, msg.data);
        tw_msg_fini(&msg);
        if (!e) continue;
        Twain__Internal__V1__Envelope out = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
        if (e->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVE) {
          Twain__Internal__V1__Reserved r = TWAIN__INTERNAL__V1__RESERVED__INIT;
          r.request_id = e->reserve->request_id;
          r.handoff = &h;
          out.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_RESERVED;
          out.reserved = &r;
          send_env(dec, &out);
        } else if (e->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL) {
          Twain__Internal__V1__PrefillDone d = TWAIN__INTERNAL__V1__PREFILL_DONE__INIT;
          d.request_id = e->prefill->request_id;
          d.first_token = script[0];
          out.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_PREFILL_DONE;
          out.prefill_done = &d;
          send_env(pre, &out);
        } else if (e->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_DECODE && n < 8192) {
          seqs[n].id = e->decode->request_id;
          seqs[n].left = e->decode->max_tokens - 1;
          seqs[n].pos = 1;
          n++;
        }
        twain__internal__v1__envelope__free_unpacked(e, NULL);
      }
    /* one "step": a token for every running sequence */
    for (int i = 0; i < n; i++) {
      int32_t tok = script[seqs[i].pos < n_script ? seqs[i].pos++ : n_script - 1];
      Twain__Internal__V1__Tokens t = TWAIN__INTERNAL__V1__TOKENS__INIT;
      t.request_id = seqs[i].id;
      t.tokens = &tok;
      t.n_tokens = 1;
      t.finished = --seqs[i].left == 0;
      t.finish_reason = t.finished ? TWAIN__V1__FINISH_REASON__FINISH_LENGTH : 0;
      Twain__Internal__V1__Envelope out = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
      out.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_TOKENS;
      out.tokens = &t;
      send_env(dec, &out);
      if (t.finished) seqs[i--] = seqs[--n];
    }
  }
  zmq_close(pre);
  zmq_close(dec);
  free(seqs);
  return NULL;
}

static double thread_cpu_s(pthread_t th) {
  clockid_t cid;
  struct timespec ts;
  if (pthread_getcpuclockid(th, &cid) != 0 || clock_gettime(cid, &ts) != 0) return 0;
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- clients ---- */
typedef enum { B_GENERATE, B_CHAT, B_HTTP_COMPLETIONS, B_HTTP_CHAT } bench_mode_t;
static const char *const mode_name[] = {"protobuf generate", "protobuf chat", "http completions",
                                        "http chat"};
static const int32_t prompt[16] = {8008, 305, 8010, 300, 369, 265, 477, 363, 4404, 6, 280, 30, 8009, 8008, 328};

/* S streaming requests over the protobuf API; returns tokens received, -1 on error */
static long run_protobuf(void *cl, bench_mode_t mode, int S, int T, uint64_t *rid) {
  for (int s = 0; s < S; s++) {
    Twain__V1__SamplingParams sp = TWAIN__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = T;
    Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
    g.prompt_ids = (int32_t *)prompt;
    g.n_prompt_ids = 15;
    g.sampling = &sp;
    g.stream = true;
    Twain__V1__Message m = TWAIN__V1__MESSAGE__INIT;
    m.role = "user";
    m.content = "What does the word dog mean?";
    Twain__V1__Message *mp = &m;
    Twain__V1__ChatRequest ch = TWAIN__V1__CHAT_REQUEST__INIT;
    ch.messages = &mp;
    ch.n_messages = 1;
    ch.sampling = &sp;
    ch.stream = true;
    Twain__V1__ClientRequest r = TWAIN__V1__CLIENT_REQUEST__INIT;
    r.request_id = (*rid)++;
    if (mode == B_GENERATE) {
      r.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
      r.generate = &g;
    } else {
      r.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
      r.chat = &ch;
    }
    must(tw_msg_send(cl, NULL, &r.base), "client send");
  }
  int done = 0;
  long toks = 0;
  while (done < S) {
    tw_msg_t m = {0};
    if (tw_msg_recv(cl, false, 30000, &m) != TW_OK) {
      fprintf(stderr, "bench-router: no reply in 30 s (%d of %d done)\n", done, S);
      return -1;
    }
    Twain__V1__ServerReply *rep = twain__v1__server_reply__unpack(NULL, m.len, m.data);
    tw_msg_fini(&m);
    if (!rep) continue;
    toks += (long)rep->n_token_ids;
    if (rep->done) {
      done++;
      if (rep->error && rep->error->code) {
        fprintf(stderr, "bench-router: error %s\n", rep->error->message);
        return -1;
      }
    }
    twain__v1__server_reply__free_unpacked(rep, NULL);
  }
  return toks;
}

/* S HTTP connections, one streamed request each, read until "data: [DONE]";
 * returns S * T (every stream ends with finish_reason length), -1 on error */
static long run_http(int port, bench_mode_t mode, int S, int T) {
  struct pollfd *p = calloc((size_t)S, sizeof *p);
  char(*tail)[16] = calloc((size_t)S, sizeof *tail);
  bool *ok = calloc((size_t)S, sizeof *ok);
  long ret = -1;
  char body[512], req[1024];
  if (mode == B_HTTP_CHAT)
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"What does the word "
             "dog mean?\"}],\"max_tokens\":%d,\"stream\":true}", T);
  else
    snprintf(body, sizeof body, "{\"prompt\":[8008,305,8010,300,369,265,477,363,4404,6,280,30,8009,8008,"
             "328],\"max_tokens\":%d,\"stream\":true}", T);
  int rl = snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                    mode == B_HTTP_CHAT ? "/v1/chat/completions" : "/v1/completions", strlen(body), body);
  for (int s = 0; s < S; s++) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    p[s].fd = socket(AF_INET, SOCK_STREAM, 0);
    p[s].events = POLLIN;
    if (p[s].fd < 0 || connect(p[s].fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        write(p[s].fd, req, (size_t)rl) != rl) {
      fprintf(stderr, "bench-router: cannot send an HTTP request to port %d\n", port);
      goto out;
    }
  }
  int done = 0;
  char buf[65536];
  while (done < S) {
    int n = poll(p, (nfds_t)S, 30000);
    if (n <= 0) {
      fprintf(stderr, "bench-router: no HTTP data in 30 s (%d of %d done)\n", done, S);
      goto out;
    }
    for (int s = 0; s < S; s++) {
      if (p[s].fd < 0 || !(p[s].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t r = read(p[s].fd, buf, sizeof buf);
      if (r <= 0) {
        fprintf(stderr, "bench-router: stream %d closed before [DONE]\n", s);
        goto out;
      }
      if (!tail[s][0] && strncmp(buf, "HTTP/1.1 200", 12) != 0) {
        fprintf(stderr, "bench-router: HTTP answer %.40s\n", buf);
        goto out;
      }
      char joined[16 + sizeof buf];
      size_t tl = strnlen(tail[s], sizeof tail[s]);
      memcpy(joined, tail[s], tl);
      memcpy(joined + tl, buf, (size_t)r);
      size_t jl = tl + (size_t)r;
      if (memmem(joined, jl, "data: [DONE]", 12)) {
        ok[s] = true;
        close(p[s].fd);
        p[s].fd = -1;
        done++;
        continue;
      }
      size_t keep = jl < 15 ? jl : 15;
      memcpy(tail[s], joined + jl - keep, keep);
      tail[s][keep] = '\0';
      if (!tail[s][0]) tail[s][0] = ' ';
    }
  }
  ret = (long)S * T;
out:
  for (int s = 0; s < S; s++)
    if (p[s].fd >= 0 && !ok[s]) close(p[s].fd);
  free(p);
  free(tail);
  free(ok);
  return ret;
}

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t l = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &l) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

int main(int argc, char **argv) {
  tw_log_init("bench-router", 0);
  long long total = 51200;
  tw_opt_t opts[] = {TW_OPT_LONG("tokens", &total, 1, 1LL << 40, "N", "tokens to stream")};
  tw_opts_spec_t spec = {.prog = "twain-bench-router",
                         .description = "Router overhead: one fake worker, many clients.",
                         .env_prefix = "TWAIN_BENCH_ROUTER_", .opts = opts, .n_opts = 1};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  tw_tokenizer_t *tok;
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  if (tw_tokenizer_load(TW_DEFAULT_MODEL_DIR "/tokenizer.json", &tok) != TW_OK ||
      tw_tokenizer_encode(tok, "<|channel|>final<|message|> dog", 31, TW_TOK_ALLOW_SPECIAL, &ids) != TW_OK ||
      ids.n < 4 || ids.n > 8) {
    fprintf(stderr, "bench-router: cannot encode the Harmony script: %s\n", tw_last_error());
    return 1;
  }
  memcpy(script, ids.ids, sizeof(int32_t) * ids.n);
  n_script = (int)ids.n;
  tw_token_ids_fini(&ids);
  tw_tokenizer_destroy(tok);
  static tw_bench_t b;
  b.p = TW_ROUTER_PARAMS_DEFAULT;
  b.p.model_dir = TW_DEFAULT_MODEL_DIR;
  b.p.client_endpoint = "tcp://127.0.0.1:0";
  b.p.worker_endpoint = "tcp://127.0.0.1:0";
  b.p.metrics_port = -1;
  b.p.http_port = free_port();
  b.p.on_bound = on_bound;
  b.p.on_bound_arg = &b;
  b.p.max_requests = 8192;
  if (tw_auth_keys_generate(&b.keys) != TW_OK || tw_auth_keys_export(&b.keys, TW_AUTH_KEYS_ENV) != TW_OK) {
    fprintf(stderr, "bench-router: %s\n", tw_last_error());
    return 1;
  }
  pthread_t rt, ft;
  pthread_create(&rt, NULL, router_main, &b);
  for (int i = 0; i < 1000 && !__atomic_load_n(&b.bound, __ATOMIC_SEQ_CST); i++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  void *ctx = zmq_ctx_new();
  fake_t f = {.b = &b, .ctx = ctx};
  pthread_create(&ft, NULL, fake_main, &f);
  struct timespec ts = {0, 500000000};
  nanosleep(&ts, NULL);
  void *cl;
  must(tw_msg_socket_open(ctx, ZMQ_DEALER, b.cep, false, NULL, 0, &cl), "client socket");
  printf("# router overhead per streamed token (fake workers, no engine), tcp loopback\n");
  printf("# %-18s %8s %8s %10s %18s %14s\n", "client", "streams", "tokens", "total", "router_cpu_us/tok",
         "client_tok/s");
  const int streams[3] = {1, 64, 512};
  uint64_t rid = 1;
  int rc = 0;
  for (int mode = B_GENERATE; mode <= B_HTTP_CHAT && !rc; mode++)
    for (int c = 0; c < 3 && !rc; c++) {
      int S = streams[c];
      int T = (int)(total / S);
      if (T > 4000) T = 4000;
      double cpu0 = thread_cpu_s(rt);
      int64_t t0 = tw_msg_clock_ns();
      long toks = mode <= B_CHAT ? run_protobuf(cl, mode, S, T, &rid) : run_http(b.p.http_port, mode, S, T);
      if (toks < 0) {
        rc = 1;
        break;
      }
      double wall = (double)(tw_msg_clock_ns() - t0) * 1e-9;
      double cpu = thread_cpu_s(rt) - cpu0;
      printf("  %-18s %8d %8d %10ld %18.2f %14.0f\n", mode_name[mode], S, T, toks,
             cpu / (double)toks * 1e6, (double)toks / wall);
      fflush(stdout);
    }
  zmq_close(cl);
  atomic_store(&f.stop, 1);
  pthread_join(ft, NULL);
  atomic_store(&b.stop, 1);
  pthread_join(rt, NULL);
  zmq_ctx_term(ctx);
  return rc;
}
