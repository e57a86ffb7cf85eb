/* router_cli.c: the router's command line (twain-router and `twain router`):
 * options, signal handling and the "listening"/"ready" lines on stdout that
 * scripts and tests wait for. */
#include "router/router.h"

#include "common/install_paths.h"
#include "common/log.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

static volatile sig_atomic_t tw_router_stop_g = 0;

static void tw_router_on_signal(int sig) {
  (void)sig;
  tw_router_stop_g = 1;
}

static void tw_router_print_bound(void *arg, const char *cep, const char *wep) {
  (void)arg;
  printf("twain-router: listening clients=%s workers=%s\n", cep, wep);
  fflush(stdout);
}

static void tw_router_print_ready(void *arg) {
  (void)arg;
  printf("twain-router: ready\n");
  fflush(stdout);
}

static void tw_router_usage(void) {
  fprintf(stderr,
          "usage: twain-router [--model DIR] [--listen tcp://HOST:PORT] [--workers tcp://HOST:PORT]\n"
          "         [--metrics-port P] [--max-prompt-tokens N] [--max-tokens-limit N]\n"
          "         [--default-max-tokens N] [--max-requests N] [--deadline-ms N]\n"
          "         [--expire-ms N] [--expect-prefill N] [--expect-decode N]\n"
          "         [--prefill-window-tokens N (default 16384: at most this many prompt\n"
          "           tokens handed to one prefill worker at a time, fewer if it is slow:\n"
          "           4 s of its measured work; the rest wait in the router's queue)]\n"
          "         [--metrics-addr ADDR (default 127.0.0.1; 0.0.0.0 = all interfaces)]\n"
          "         [--drain-timeout SECONDS (default 30: SIGTERM lets running requests\n"
          "           finish for at most this long)]\n"
          "         [--http-port P (OpenAI-compatible HTTP API; default -1: off)] [--http-addr ADDR]\n"
          "         [--served-model-name NAME] [--http-max-body BYTES (default 8 MiB)]\n"
          "         [--api-key KEY | --api-key-file PATH (required on the HTTP and protobuf APIs)]\n"
          "  defaults: --listen %s --workers %s, model %s\n",
          TW_ROUTER_CLIENT_ENDPOINT, TW_ROUTER_WORKER_ENDPOINT,
          tw_default_model_dir(TW_DEFAULT_MODEL_DIR));
}

int tw_router_read_key(const char *prog, const char *path, char *key, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "%s: cannot read the API key file %s: %s\n", prog, path, strerror(errno));
    return -1;
  }
  size_t n = fread(key, 1, len - 1, f);
  fclose(f);
  key[n] = '\0';
  key[strcspn(key, "\r\n")] = '\0'; /* the first line */
  if (!key[0]) {
    fprintf(stderr, "%s: the API key file %s is empty\n", prog, path);
    return -1;
  }
  return 0;
}

int tw_router_main(int argc, char **argv) {
  tw_router_params_t p = TW_ROUTER_PARAMS_DEFAULT;
  p.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  p.on_bound = tw_router_print_bound;
  p.on_ready = tw_router_print_ready;
  char key[512];
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      tw_router_usage();
      return 0;
    }
    if (!v) {
      fprintf(stderr, "twain-router: %s needs a value\n", a);
      return 2;
    }
    i++;
    if (!strcmp(a, "--model")) p.model_dir = v;
    else if (!strcmp(a, "--listen")) p.client_endpoint = v;
    else if (!strcmp(a, "--workers")) p.worker_endpoint = v;
    else if (!strcmp(a, "--metrics-port")) p.metrics_port = atoi(v);
    else if (!strcmp(a, "--metrics-addr")) p.metrics_addr = v;
    else if (!strcmp(a, "--drain-timeout")) p.drain_timeout_s = atoi(v);
    else if (!strcmp(a, "--max-prompt-tokens")) p.max_prompt_tokens = atoi(v);
    else if (!strcmp(a, "--max-tokens-limit")) p.max_tokens_limit = atoi(v);
    else if (!strcmp(a, "--default-max-tokens")) p.default_max_tokens = atoi(v);
    else if (!strcmp(a, "--max-requests")) p.max_requests = atoi(v);
    else if (!strcmp(a, "--prefill-window-tokens")) p.prefill_window_tokens = atoi(v);
    else if (!strcmp(a, "--deadline-ms")) p.default_deadline_ms = atoi(v);
    else if (!strcmp(a, "--expire-ms")) p.expire_ms = atoi(v);
    else if (!strcmp(a, "--expect-prefill")) p.expect_prefill = atoi(v);
    else if (!strcmp(a, "--expect-decode")) p.expect_decode = atoi(v);
    else if (!strcmp(a, "--http-port")) p.http_port = atoi(v);
    else if (!strcmp(a, "--http-addr")) p.http_addr = v;
    else if (!strcmp(a, "--served-model-name")) p.served_model_name = v;
    else if (!strcmp(a, "--http-max-body")) p.http_max_body = atoll(v);
    else if (!strcmp(a, "--api-key")) p.api_key = v;
    else if (!strcmp(a, "--api-key-file")) {
      if (tw_router_read_key("twain-router", v, key, sizeof key)) return 2;
      p.api_key = key;
    }
    else {
      fprintf(stderr, "twain-router: unknown option %s\n", a);
      tw_router_usage();
      return 2;
    }
  }
  if (p.drain_timeout_s < 0) {
    fprintf(stderr, "twain-router: --drain-timeout %d < 0\n", p.drain_timeout_s);
    return 2;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = tw_router_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  tw_status_t st = tw_router_run(&p, &tw_router_stop_g);
  if (st != TW_OK) {
    fprintf(stderr, "twain-router: %s: %s\n", tw_status_str(st), tw_last_error());
    return 1;
  }
  return 0;
}
