/* decode_main.c: `twain-decode`, the decode worker daemon (decode_worker.h). */
#include "decode/decode_worker.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg_worker.h"
#include "common/engine/mem_plan.h"
#include "common/model/model_path.h"
#include "common/worker/worker_daemon.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

int main(int argc, char **argv) {
  tw_log_init("twain-decode", 0);
  tw_decode_params_t p = TW_DECODE_PARAMS_DEFAULT;
  p.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  tw_mem_colocated_t colocated = {&p.colocated_prefill, &p.colocated_decode};
  tw_opt_t opts[] = {
      TW_WORKER_OPTS(&p, &colocated, "", "decode", "running, waiting, KV use, tok/s"),
      TW_OPT_INT("max-batch", &p.max_batch, 0, TW_DECODE_MAX_BATCH, "N",
                 "sequences per decode step, per dp rank (0: the memory plan)"),
      TW_OPT_INT("drain-timeout", &p.drain_timeout_s, 0, INT32_MAX, "SECONDS",
                 "on SIGTERM, finish running sequences for at most this long"),
      TW_OPT_FLAG("verify-kv", &p.verify_kv, "check the per-layer checksums of received KV"),
      TW_OPT_INT("dp", &p.dp, 1, TW_DECODE_MAX_DP, "N",
                 "data-parallel attention: N ranks, each a replica with its own\n"
                 "sequences and KV pool; needs --ep N and --tp 1 (cpu backend only)"),
  };
  tw_opts_spec_t spec = {.prog = "twain-decode", .synopsis = "--router tcp://HOST:PORT [OPTIONS]",
                         .description = "The decode worker daemon: runs the decode steps of the "
                                        "sequences a router hands it.",
                         .env_prefix = "TWAIN_DECODE_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0], .config = true};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  if (!tw_worker_colocated_ok(&spec, "decode", p.colocated_prefill, p.colocated_decode)) return 2;
  if (!p.router) {
    fprintf(stderr, "twain-decode: missing --router tcp://HOST:PORT (the router's worker endpoint; "
                    "see --help)\n");
    return 2;
  }
  p.argc = argc;
  p.argv = argv;
  return tw_decode_worker_main(&p); /* 78: a configuration error, `twain serve` stops */
}
