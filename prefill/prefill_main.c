/* prefill_main.c: the twain-prefill program. With --router it is the prefill
 * worker daemon (worker.h); with --prompt-tokens it runs the offline mode
 * (offline.h): one prompt, logits dump, greedy continuation. One option table
 * serves both. Exit status: 0 ok, 1 run failed, 2 bad usage. */
#include "offline.h"
#include "worker.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/engine/mem_plan.h"
#include "common/model/model_path.h"
#include "common/worker/worker_daemon.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

/* --stop-ids A,B,...: replaces the list (opts.h TW_OPT_FN). */
static int tw_parse_stop_ids(const char *s, void *dst, char *err, size_t errlen) {
  tw_offline_opts_t *o = dst;
  return tw_opts_id_list(s, o->stop_ids, TW_OFFLINE_MAX_STOP_IDS, &o->n_stop_ids, err, errlen);
}

int main(int argc, char **argv) {
  tw_log_init("twain-prefill", 0);
  tw_prefill_opts_t w = TW_PREFILL_OPTS_DEFAULT;
  w.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  tw_offline_opts_t o = {.block_size = 16};
  tw_mem_colocated_t colocated = {&w.colocated_prefill, &w.colocated_decode};
  tw_opt_t opts[] = {
      TW_WORKER_OPTS(&w, &colocated, "daemon: ", "prefill", "waiting prompts, prompt tok/s"),
      TW_OPT_INT("chunk-tokens", &w.chunk_tokens, 0, INT32_MAX, "N",
                 "daemon: tokens of one forward pass: queued prompts are batched up\n"
                 "to it (a longer prompt runs alone, split over passes; 0: planned)"),
      TW_OPT_INT("batch-seqs", &w.batch_seqs, 1, INT32_MAX, "N",
                 "daemon: most prompts in one batch"),
      TW_OPT_FN("warmup", &w.warmup, tw_opts_switch_auto, "0|1|auto",
                "daemon: prefill passes of traffic's shapes on throwaway prompts\n"
                "before registering, so the first prompts do not load kernels\n"
                "(auto: a GPU worker of one rank)"),
      /* offline mode */
      TW_OPT_STR("prompt-tokens", &o.prompt_tokens_path, "FILE",
                 "offline mode: JSON array of prompt token ids"),
      TW_OPT_STR("dump-logits", &o.maybe_dump_logits_path, "FILE",
                 "offline: write float32 little-endian logits [T, vocab] of every\n"
                 "prompt position"),
      TW_OPT_INT("generate", &o.generate, 0, INT32_MAX, "N",
                 "offline: continue greedily for N tokens and print them as a JSON\n"
                 "array on stdout"),
      TW_OPT_FN("stop-ids", &o, tw_parse_stop_ids, "A,B,...",
                "offline: stop generating after one of these ids"),
  };
  tw_opts_spec_t spec = {
      .prog = "twain-prefill", .synopsis = "--router tcp://HOST:PORT [OPTIONS] | --prompt-tokens FILE [OPTIONS]",
      .description = "Worker daemon mode (--router): serve prefill requests from a router.\n"
                     "Offline mode (--prompt-tokens): run one prompt through the engine.",
      .env_prefix = "TWAIN_PREFILL_", .opts = opts, .n_opts = sizeof opts / sizeof opts[0],
      .config = true};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  if (!tw_worker_colocated_ok(&spec, "prefill", w.colocated_prefill, w.colocated_decode)) return 2;
  if (w.router) return tw_prefill_worker_main(&w, argc, argv);
  if (!o.prompt_tokens_path) {
    fprintf(stderr,
            "twain-prefill: give --prompt-tokens FILE for the offline mode, or --router "
            "tcp://HOST:PORT for the worker daemon (see --help)\n");
    return 2;
  }
  o.model_dir = w.model_dir;
  o.backend = w.backend;
  o.n_threads = w.threads;
  o.block_size = w.block_size;
  tw_status_t st = tw_offline_run(&o, stdout);
  if (st != TW_OK) {
    fprintf(stderr, "twain-prefill: %s: %s\n", tw_status_str(st), tw_last_error());
    return 1;
  }
  return 0;
}
