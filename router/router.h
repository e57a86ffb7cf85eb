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

#include "common/status.h"

#include <signal.h>
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
  int32_t max_tokens_limit;     /* largest max_tokens accepted */
  int32_t default_max_tokens;   /* when the request leaves it 0 */
  int32_t max_requests;         /* queued + running, beyond: RESOURCE_EXHAUSTED */
  int32_t prefill_window_tokens; /* prompt tokens in flight per prefill worker (reserving or
                                  * prefilling); the rest wait in the router's queue, in order */
  int32_t default_deadline_ms;
  int32_t expire_ms;            /* worker silence before it is expired */
  int32_t expect_prefill, expect_decode; /* print "ready" once this many registered */
  /* OpenAI-compatible HTTP API (router/http_api.h, docs/api.md) */
  int http_port;                /* -1 off, 0 ephemeral */
  const char *http_addr;        /* numeric; NULL: 127.0.0.1 */
  const char *served_model_name;/* /v1/models id; NULL: the model directory's name */
  int64_t http_max_body;        /* bytes; a larger request body gets 413 */
  const char *api_key;          /* NULL: none; else required on both APIs */
  /* maybe NULL: called once the HTTP API listens, with its base URL */
  void (*on_http)(void *arg, const char *url);
  void *on_http_arg;
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

#define TW_ROUTER_PARAMS_DEFAULT                                                      \
  ((tw_router_params_t){.client_endpoint = TW_ROUTER_CLIENT_ENDPOINT,                 \
                        .worker_endpoint = TW_ROUTER_WORKER_ENDPOINT,                 \
                        .metrics_port = 0, .drain_timeout_s = 30,                     \
                        .max_prompt_tokens = 0,                                       \
                        .max_tokens_limit = 4096, .default_max_tokens = 512,          \
                        .max_requests = 2048, .default_deadline_ms = 600000,          \
                        .prefill_window_tokens = 16384,                               \
                        .expire_ms = 1000, .http_port = -1,                           \
                        .http_max_body = 8 << 20})
#define TW_ROUTER_HTTP_PORT 7402 /* `twain serve`'s default HTTP API port */

/** Run until *stop becomes non-zero (SIGTERM/SIGINT in the callers), then
 *  drain: stop accepting requests (UNAVAILABLE), let running ones finish for
 *  up to 10 s, fail the rest, return.
 *  Errors: TW_ERR_TRANSPORT (cannot bind), TW_ERR_IO/TW_ERR_FORMAT (model
 *  config or tokenizer), TW_ERR_NO_MEMORY. */
tw_status_t tw_router_run(const tw_router_params_t *params, volatile sig_atomic_t *stop);

/** Read the API key from the first line of `path` into key[len] (NUL-
 *  terminated, cut at len - 1 bytes). Returns -1 after printing why (cannot
 *  read, empty), else 0. */
int tw_router_read_key(const char *prog, const char *path, char *key, size_t len);

/** `twain-router` / `twain router` command line. Returns the exit code. */
int tw_router_main(int argc, char **argv);

#endif
