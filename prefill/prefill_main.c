/* prefill_main.c: the twain-prefill program. With --prompt-tokens it runs
 * the offline mode (offline.h): one prompt, logits dump, greedy
 * continuation. The worker daemon mode comes later; it will be chosen when
 * --prompt-tokens is absent. Exit status: 0 ok, 1 run failed, 2 bad usage. */
#include "offline.h"
#include "worker.h"

#include "common/install_paths.h"
#include "common/log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

static void tw_prefill_usage(FILE *f) {
  fprintf(f,
          "usage: twain-prefill [options]\n"
          "\n"
          "Offline mode (when --prompt-tokens is given): run one prompt through the engine.\n"
          "  --model DIR           checkpoint directory (default %s)\n"
          "  --backend NAME        auto, cpu or cuda (default auto)\n"
          "  --prompt-tokens FILE  JSON array of prompt token ids\n"
          "  --dump-logits FILE    write float32 little-endian logits [T, vocab] of every\n"
          "                        prompt position\n"
          "  --generate N          continue greedily for N tokens (KV-cache decode) and print\n"
          "                        them as a JSON array on stdout\n"
          "  --stop-ids A,B,...    stop generating after one of these ids (default: none)\n"
          "  --threads N           CPU worker threads (default 0 = all cores)\n"
          "  --block-size N        KV block size in tokens (default 16)\n"
          "  --help                this text\n"
          "\n"
          "Worker daemon mode (when --router is given): serve prefill requests from a router.\n"
          "  --router EP [--model DIR] [--name N] [--backend B] [--kv-blocks N] [--block-size N]\n"
          "  [--threads N] [--metrics-port P]   (prefill/worker.h)\n",
          tw_default_model_dir(TW_DEFAULT_MODEL_DIR));
}

/* Strict integer parse of an option value; -1 status on failure. */
static int tw_parse_int(const char *opt, const char *s, long lo, long hi, int32_t *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "twain-prefill: %s expects an integer in [%ld, %ld], got '%s'\n", opt, lo, hi,
            s);
    return -1;
  }
  *out = (int32_t)v;
  return 0;
}

static int tw_parse_stop_ids(const char *s, tw_offline_opts_t *o) {
  char buf[512];
  if (strlen(s) >= sizeof(buf)) {
    fprintf(stderr, "twain-prefill: --stop-ids list too long\n");
    return -1;
  }
  strcpy(buf, s);
  o->n_stop_ids = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (o->n_stop_ids == TW_OFFLINE_MAX_STOP_IDS) {
      fprintf(stderr, "twain-prefill: at most %d --stop-ids\n", TW_OFFLINE_MAX_STOP_IDS);
      return -1;
    }
    if (tw_parse_int("--stop-ids", tok, 0, INT32_MAX, &o->stop_ids[o->n_stop_ids]) != 0) return -1;
    o->n_stop_ids++;
  }
  return 0;
}

int main(int argc, char **argv) {
  tw_log_init("twain-prefill", 0);
  if (tw_prefill_worker_wanted(argc, argv)) return tw_prefill_worker_main(argc, argv);
  tw_offline_opts_t o = {.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR),
                         .backend = TW_BACKEND_AUTO, .block_size = 16};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      tw_prefill_usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "twain-prefill: unknown option or missing value: %s (see --help)\n", a);
      return 2;
    }
    const char *v = argv[++i];
    int bad = 0;
    if (strcmp(a, "--model") == 0) {
      o.model_dir = v;
    } else if (strcmp(a, "--backend") == 0) {
      bad = tw_backend_parse(v, &o.backend) != TW_OK;
    } else if (strcmp(a, "--prompt-tokens") == 0) {
      o.prompt_tokens_path = v;
    } else if (strcmp(a, "--dump-logits") == 0) {
      o.maybe_dump_logits_path = v;
    } else if (strcmp(a, "--generate") == 0) {
      bad = tw_parse_int(a, v, 0, INT32_MAX, &o.generate) != 0;
    } else if (strcmp(a, "--stop-ids") == 0) {
      bad = tw_parse_stop_ids(v, &o) != 0;
    } else if (strcmp(a, "--threads") == 0) {
      bad = tw_parse_int(a, v, 0, 4096, &o.n_threads) != 0;
    } else if (strcmp(a, "--block-size") == 0) {
      bad = tw_parse_int(a, v, 1, 1 << 20, &o.block_size) != 0;
    } else {
      fprintf(stderr, "twain-prefill: unknown option %s (see --help)\n", a);
      return 2;
    }
    if (bad) return 2;
  }
  if (!o.prompt_tokens_path) {
    fprintf(stderr,
            "twain-prefill: give --prompt-tokens FILE for the offline mode, or --router "
            "tcp://HOST:PORT for the worker daemon (see --help)\n");
    return 2;
  }
  tw_status_t st = tw_offline_run(&o, stdout);
  if (st != TW_OK) {
    fprintf(stderr, "twain-prefill: %s: %s\n", tw_status_str(st), tw_last_error());
    return 1;
  }
  return 0;
}
