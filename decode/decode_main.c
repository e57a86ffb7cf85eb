/* decode_main.c: `twain-decode`, the decode worker daemon (decode_worker.h). */
#include "decode/decode_worker.h"

#include "common/install_paths.h"
#include "common/log.h"
#include "common/mem_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

static void usage(void) {
  fprintf(stderr,
          "usage: twain-decode --router tcp://HOST:PORT [--model DIR] [--name NAME]\n"
          "         [--backend auto|cpu|cuda] [--kv-blocks N] [--block-size N] [--max-batch N]\n"
          "           (--kv-blocks and --max-batch default to the memory plan: docs/operations.md)\n"
          "         [--gpu-memory-utilization F (default 0.90)] [--colocated P,D (prefill and\n"
          "           decode workers on this device, this one included; default this one alone)]\n"
          "         [--share-weights DIR (cuda: one copy of the weights for the workers of DIR)]\n"
          "         [--threads N] [--metrics-port P (-1 off, 0 ephemeral)] [--verify-kv]\n"
          "         [--tp N] [--ep N]   tensor / expert parallel ranks (docs/parallelism.md)\n"
          "         [--dp N]   data-parallel attention: N ranks, each a replica with its own\n"
          "           sequences and kv pool; needs --ep N and --tp 1 (cpu backend only)\n"
          "         [--metrics-addr ADDR (default 127.0.0.1; 0.0.0.0 = all interfaces)]\n"
          "         [--drain-timeout SECONDS (default 600: SIGTERM finishes running sequences\n"
          "           for at most this long)]\n"
          "  --model defaults to %s\n",
          tw_default_model_dir(TW_DEFAULT_MODEL_DIR));
}

int main(int argc, char **argv) {
  tw_log_init("twain-decode", 0);
  tw_decode_params_t p = TW_DECODE_PARAMS_DEFAULT;
  p.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--verify-kv")) {
      p.verify_kv = true;
      continue;
    }
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage();
      return 0;
    }
    if (!v) {
      fprintf(stderr, "twain-decode: %s needs a value\n", a);
      usage();
      return 2;
    }
    i++;
    if (!strcmp(a, "--model")) p.model_dir = v;
    else if (!strcmp(a, "--router")) p.router = v;
    else if (!strcmp(a, "--name")) p.name = v;
    else if (!strcmp(a, "--backend")) {
      if (tw_backend_parse(v, &p.backend) != TW_OK) return 2;
    } else if (!strcmp(a, "--kv-blocks")) p.kv_blocks = atoi(v);
    else if (!strcmp(a, "--block-size")) p.block_size = atoi(v);
    else if (!strcmp(a, "--max-batch")) p.max_batch = atoi(v);
    else if (!strcmp(a, "--gpu-memory-utilization")) {
      if (tw_mem_parse_utilization(v, &p.gpu_memory_utilization) != TW_OK) return 2;
    } else if (!strcmp(a, "--colocated")) {
      if (tw_mem_parse_colocated(v, &p.colocated_prefill, &p.colocated_decode) != TW_OK) return 2;
      if (p.colocated_decode < 1) {
        fprintf(stderr, "twain-decode: --colocated %s counts no decode worker (this one)\n", v);
        return 2;
      }
    } else if (!strcmp(a, "--share-weights")) p.share_weights_dir = v;
    else if (!strcmp(a, "--threads")) p.threads = atoi(v);
    else if (!strcmp(a, "--metrics-port")) p.metrics_port = atoi(v);
    else if (!strcmp(a, "--metrics-addr")) p.metrics_addr = v;
    else if (!strcmp(a, "--drain-timeout")) p.drain_timeout_s = atoi(v);
    else if (!strcmp(a, "--tp")) p.tp = atoi(v);
    else if (!strcmp(a, "--ep")) p.ep = atoi(v);
    else if (!strcmp(a, "--dp")) p.dp = atoi(v);
    else {
      fprintf(stderr, "twain-decode: unknown option %s\n", a);
      usage();
      return 2;
    }
  }
  if (p.drain_timeout_s < 0) {
    fprintf(stderr, "twain-decode: --drain-timeout %d < 0\n", p.drain_timeout_s);
    return 2;
  }
  if (!p.router) {
    fprintf(stderr, "twain-decode: missing --router tcp://HOST:PORT (the router's worker endpoint)\n");
    usage();
    return 2;
  }
  p.argc = argc;
  p.argv = argv;
  tw_status_t st = tw_decode_worker_run(&p);
  return st == TW_OK ? 0 : 1;
}
