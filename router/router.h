/* router.h: the twain router daemon (ARCHITECTURE.md item 1): a ZeroMQ
 * ROUTER for clients (twain.v1, docs/api.md) and one for workers
 * (twain.internal.v1). It keeps the registry of prefill and decode workers
 * (register + heartbeat; silent for TW_WORKER_EXPIRE_MS = expired), schedules
 * each request to the decode worker with the most free KV blocks (admission
 * control: requests wait in a queue while no worker has room) and the prefill
 * worker with the fewest queued prompt tokens, renders/parses Harmony for
 * Chat, streams replies, and enforces limits, deadlines and cancellation.
 * Used by `twain-router` and in-process by `twain serve`. */
#ifndef TW_ROUTER_ROUTER_H
#define TW_ROUTER_ROUTER_H

#include "common/base/opts.h"
#include "common/base/status.h"

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define TW_ROUTER_CLIENT_ENDPOINT "tcp://127.0.0.1:7400"
#define TW_ROUTER_WORKER_ENDPOINT "tcp://127.0.0.1:7401"

typedef struct {
  const char *client_endpoint;  /* bind; port 0 = ephemeral */
  const char *worker_endpoint;  /* bind; port 0 = ephemeral */
  const char *model_dir;        /* config.json + tokenizer.json */
  int metrics_port;             /* -1 off, 0 ephemeral */
  const char *metrics_addr;     /* numeric; NULL: 127.0.0.1 */
  int32_t drain_timeout_s;      /* SIGTERM: running requests get at most this long */
  int32_t max_prompt_tokens;    /* 0: the model's context minus 1 */
  int32_t max_tokens_limit;     /* largest max_tokens accepted; 0: the model's context minus 1 */
  int32_t default_max_tokens;   /* when the request leaves it 0 */
  int32_t max_requests;         /* queued + running, beyond: RESOURCE_EXHAUSTED */
  int32_t prefill_window_tokens; /* prompt tokens in flight per prefill worker (reserving or
                                  * prefilling); the rest wait in the router's queue, in order */
  int32_t default_deadline_ms;
  int32_t expire_ms;            /* worker silence before it is expired */
  int32_t pool_grace_ms;        /* a pool whose last worker expired is waited for this long */
  /* NULL, or [2] set by a supervisor (twain serve): nonzero once no worker
   * of the prefill [0] / decode [1] pool will be started again (it gave up
   * restarting them): requests waiting for that empty pool then fail at
   * once (UNAVAILABLE) instead of after pool_grace_ms */
  const atomic_int *pool_given_up;
  int32_t expect_prefill, expect_decode; /* print "ready" once this many registered */
  /* OpenAI-compatible HTTP API (router/http_api.h, docs/api.md) */
  int http_port;                /* -1 off, 0 ephemeral */
  const char *http_addr;        /* numeric; NULL: 127.0.0.1 */
  const char *http_allow_origin; /* CORS: the browser origin allowed (or "*"); NULL: none */
  const char *served_model_name;/* /v1/models id; NULL: the model directory's name */
  long long http_max_body;      /* bytes; a larger request body gets 413 */
  int http_max_conns;           /* open HTTP connections at most; beyond, new ones wait */
  const char *api_key;          /* NULL: none; else required on both APIs */
  const char *client_keys_file; /* CURVE on the client socket; NULL: env, else plaintext */
  const char *client_allow_file; /* client keys admitted; NULL: env, else any */
  /* maybe NULL: called once the HTTP API listens, with its base URL */
  void (*on_http)(void *arg, const char *url);
  void *on_http_arg;
  bool disable_log_requests;    /* no INFO line per finished request */
  /* called once both sockets are bound, with the actual endpoints */
  void (*on_bound)(void *arg, const char *client_ep, const char *worker_ep);
  void *on_bound_arg;
  /* called once when expect_* workers have registered */
  void (*on_ready)(void *arg);
  void *on_ready_arg;
  /* maybe NULL: called on the router thread whenever the number of
   * registered (not draining) workers per pool changes */
  void (*on_workers)(void *arg, int32_t n_prefill, int32_t n_decode);
  void *on_workers_arg;
} tw_router_params_t;

#define TW_ROUTER_PARAMS_DEFAULT                                                                   \
  ((tw_router_params_t){.client_endpoint = TW_ROUTER_CLIENT_ENDPOINT,                              \
                        .worker_endpoint = TW_ROUTER_WORKER_ENDPOINT,                              \
                        .metrics_port = 0,                                                         \
                        .drain_timeout_s = 30,                                                     \
                        .max_prompt_tokens = 0,                                                    \
                        .max_tokens_limit = 0,                                                     \
                        .default_max_tokens = 512,                                                 \
                        .max_requests = 2048,                                                      \
                        .default_deadline_ms = 600000,                                             \
                        .prefill_window_tokens = 16384,                                            \
                        .expire_ms = 1000 * TW_SLOW_BUILD,                                         \
                        .pool_grace_ms = TW_ROUTER_POOL_GRACE_MS,                                  \
                        .http_port = -1,                                                           \
                        .http_max_body = 8 << 20,                                                  \
                        .http_max_conns = 4096})
#define TW_ROUTER_HTTP_PORT 7402 /* `twain serve`'s default HTTP API port */
/* --pool-grace-ms: twain-router's default outlasts the expiry (status.h); a
 * supervisor that restarts workers sets one that outlasts a restart
 * (`twain serve`: TW_SERVE_POOL_GRACE_MS, router/cli/cli_serve.c) */
#define TW_ROUTER_POOL_GRACE_MS (5000 * TW_SLOW_BUILD)

/** The router's limits as common/base/opts.h rows on a tw_router_params_t `p`:
 *  one list for twain-router and `twain serve`, which passes them all on. */
#define TW_ROUTER_OPT_ROWS(p)                                                                      \
  TW_OPT_INT("drain-timeout", &(p).drain_timeout_s, 0, INT32_MAX, "SECONDS",                       \
             "on SIGTERM, running requests finish for at most this long"),                         \
      TW_OPT_INT("max-prompt-tokens", &(p).max_prompt_tokens, 0, INT32_MAX, "N",                   \
                 "longest prompt accepted (0: the model's context minus 1)"),                      \
      TW_OPT_INT("max-tokens-limit", &(p).max_tokens_limit, 0, INT32_MAX, "N",                     \
                 "largest max_tokens a request may ask for (0: the model's context\n"              \
                 "minus 1)"),                                                                      \
      TW_OPT_INT("default-max-tokens", &(p).default_max_tokens, 1, INT32_MAX, "N",                 \
                 "max_tokens of a request that leaves it 0"),                                      \
      TW_OPT_INT("max-requests", &(p).max_requests, 1, INT32_MAX, "N",                             \
                 "requests queued + running; beyond: RESOURCE_EXHAUSTED"),                         \
      TW_OPT_INT("prefill-window-tokens", &(p).prefill_window_tokens, 1, INT32_MAX, "N",           \
                 "prompt tokens handed to one prefill worker at a time (fewer if it\n"             \
                 "is slow: 4 s of its measured work); the rest wait in the router's queue"),       \
      TW_OPT_INT("deadline-ms", &(p).default_deadline_ms, 1, INT32_MAX, "MS",                      \
                 "deadline of a request that sets none"),                                          \
      TW_OPT_INT("expire-ms", &(p).expire_ms, 1, INT32_MAX, "MS",                                  \
                 "a worker silent this long is expired"),                                          \
      TW_OPT_INT("pool-grace-ms", &(p).pool_grace_ms, 0, INT32_MAX, "MS",                          \
                 "when a pool's last worker expired (a crash, a stall), requests wait\n"           \
                 "this long for one to register before UNAVAILABLE (default 5000;\n"               \
                 "`twain serve`, which restarts its workers: 180000)"),                            \
      TW_OPT_STR("http-addr", &(p).http_addr, "ADDR",                                              \
                 "numeric address of the HTTP API (default 127.0.0.1; 0.0.0.0: all)"),             \
      TW_OPT_STR("http-allow-origin", &(p).http_allow_origin, "ORIGIN",                            \
                 "let web pages from ORIGIN (e.g. https://app.example; * for any)\n"               \
                 "call the HTTP API from a browser (CORS; default: none)"),                        \
      TW_OPT_STR("served-model-name", &(p).served_model_name, "NAME",                              \
                 "the model's name in /v1/models and the metrics' model_name label\n"              \
                 "(default: ORG/NAME of a Hugging Face snapshot, else the directory's name)"),     \
      TW_OPT_LONG("http-max-body", &(p).http_max_body, 1, 1LL << 40, "BYTES",                      \
                  "largest HTTP request body (larger: 413)"),                                      \
      TW_OPT_INT("http-max-connections", &(p).http_max_conns, 1, 1 << 20, "N",                     \
                 "open HTTP connections at most (default 4096); beyond, new ones wait\n"           \
                 "until one closes (logged; twain_router_http_connections)"),                      \
      TW_OPT_STR_FN("api-key", &(p).api_key, tw_router_key_opt, "KEY",                             \
                    "required on the HTTP and protobuf APIs (default: none; an empty KEY\n"        \
                    "is refused rather than taken as none)"),                                      \
      TW_OPT_FN("api-key-file", &(p).api_key, tw_router_key_file_opt, "PATH",                      \
                "read --api-key from the first line of PATH"),                                     \
      TW_OPT_STR("client-keys", &(p).client_keys_file, "FILE",                                     \
                 "CURVE on the client socket with the server pair of this `twain keygen`\n"        \
                 "file (or $TWAIN_CLIENT_KEYS_FILE; default: plaintext)"),                         \
      TW_OPT_STR("client-allow", &(p).client_allow_file, "FILE",                                   \
                 "admit only the client public keys listed in FILE (or\n"                          \
                 "$TWAIN_CLIENT_ALLOW_FILE; default: any key)"),                                   \
      TW_OPT_FLAG("disable-log-requests", &(p).disable_log_requests,                               \
                  "no INFO line per finished request")

/** Run until *stop becomes non-zero (SIGTERM/SIGINT in the callers, or
 *  another thread: an atomic, so a signal handler (lock-free atomic_int) or
 *  a thread may set it without a data race), then
 *  drain: stop accepting requests (UNAVAILABLE), let running ones finish for
 *  up to params->drain_timeout_s, or until *stop reaches 2 (a second
 *  signal), fail the rest (UNAVAILABLE), return.
 *  Errors: TW_ERR_TRANSPORT (cannot bind), TW_ERR_IO/TW_ERR_FORMAT (model
 *  config or tokenizer), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_router_run(const tw_router_params_t *params, atomic_int *stop);

/** The --api-key-file option's parser (common/base/opts.h TW_OPT_FN; dst: const
 *  char **): the first line of the file at `path` (at most 511 bytes; kept for
 *  the process, tw_opts_keep). 0, or -1 with why in err (cannot read, empty). */
int tw_router_key_file_opt(const char *path, void *dst, char *err, size_t errlen);

/** The --api-key option's parser (TW_OPT_STR_FN; dst: const char **): the
 *  key as given; -1 with why in err when it is empty (an unset shell
 *  variable in `--api-key "$KEY"` would otherwise turn authentication off). */
int tw_router_key_opt(const char *text, void *dst, char *err, size_t errlen);

/** `twain-router` / `twain router` command line. Returns the exit code. */
int tw_router_main(int argc, char **argv);

#endif
