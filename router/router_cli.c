/* router_cli.c: the router's command line (twain-router and `twain router`):
 * options, signal handling and the "listening"/"ready" lines on stdout that
 * scripts and tests wait for. */
#include "router/router.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg_worker.h" /* tw_stop_signals_install */
#include "common/model/model_path.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

/* set by the signal handler: a lock-free atomic is safe to store there */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "atomic_int must be lock-free");
static atomic_int tw_router_stop_g = 0;

static void tw_router_on_signal(int sig) {
  (void)sig;
  atomic_fetch_add(&tw_router_stop_g, 1); /* 1: drain; 2 and more: stop now */
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

int tw_router_key_file_opt(const char *path, void *dst, char *err, size_t errlen) {
  char key[512];
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "cannot read the API key file %s: %s", path, strerror(errno));
    return -1;
  }
  size_t n = fread(key, 1, sizeof key - 1, f);
  fclose(f);
  key[n] = '\0';
  key[strcspn(key, "\r\n")] = '\0'; /* the first line */
  if (!key[0]) {
    snprintf(err, errlen, "the API key file %s is empty", path);
    return -1;
  }
  const char *kept = tw_opts_keep(key); /* valid for the process, like the option strings */
  if (!kept) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  *(const char **)dst = kept;
  return 0;
}

int tw_router_key_opt(const char *text, void *dst, char *err, size_t errlen) {
  if (!text[0]) {
    snprintf(err, errlen,
             "is empty: that would turn the API key off; leave the option out to run "
             "without a key");
    return -1;
  }
  *(const char **)dst = text;
  return 0;
}

/* The router's options (opts.h), shared by twain-router and `twain router`. */
int tw_router_main(int argc, char **argv) {
  tw_router_params_t p = TW_ROUTER_PARAMS_DEFAULT;
  p.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  p.on_bound = tw_router_print_bound;
  p.on_ready = tw_router_print_ready;
  tw_opt_t opts[] = {
      TW_OPT_STR_FN("model", &p.model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "checkpoint directory (config.json, tokenizer.json);\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_STR("listen", &p.client_endpoint, "tcp://HOST:PORT",
                 "client endpoint (port 0: ephemeral)"),
      TW_OPT_STR("workers", &p.worker_endpoint, "tcp://HOST:PORT",
                 "worker endpoint (port 0: ephemeral)"),
      TW_OPT_INT("metrics-port", &p.metrics_port, -1, 65535, "PORT",
                 "/metrics, /healthz, /livez port (-1 off, 0 ephemeral)"),
      TW_OPT_STR("metrics-addr", &p.metrics_addr, "ADDR",
                 "numeric address of the metrics port (0.0.0.0: all interfaces)"),
      TW_ROUTER_OPT_ROWS(p),
      TW_OPT_INT("http-port", &p.http_port, -1, 65535, "PORT",
                 "OpenAI-compatible HTTP API port (-1 off, 0 ephemeral)"),
      TW_OPT_INT("expect-prefill", &p.expect_prefill, 0, INT32_MAX, "N",
                 "print \"ready\" once N prefill (and --expect-decode) workers registered "
                 "and connected to the decode workers' kv pools"),
      TW_OPT_INT("expect-decode", &p.expect_decode, 0, INT32_MAX, "N", "see --expect-prefill"),
  };
  tw_opts_spec_t spec = {.prog = argv[0] && !strcmp(argv[0], "router") ? "twain router" : "twain-router",
                         .description = "The router daemon: clients' requests to prefill and decode workers.",
                         .env_prefix = "TWAIN_ROUTER_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0], .config = true};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  tw_stop_signals_install(tw_router_on_signal);
  tw_status_t st = tw_router_run(&p, &tw_router_stop_g);
  if (st != TW_OK) {
    fprintf(stderr, "twain-router: %s: %s\n", tw_status_str(st), tw_last_error());
    return 1;
  }
  return 0;
}
