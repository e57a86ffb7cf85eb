/* decode_main.c: `twain-decode`, the decode worker daemon (decode_worker.h). */
#include "decode/decode_worker.h"

#include "common/install_paths.h"
#include "common/log.h"
#include "common/msg_worker.h"
#include "common/model_path.h"
#include "common/opts.h"
#include "common/mem_plan.h"

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
      TW_OPT_STR("router", &p.router, "tcp://HOST:PORT", "the router's worker endpoint (required)"),
      TW_OPT_STR_FN("model", &p.model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "checkpoint directory;\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_STR("name", &p.name, "NAME", "routing id (default decode-<pid>)"),
      TW_OPT_FN("backend", &p.backend, tw_backend_opt, "auto|cpu|cuda", "engine backend"),
      TW_OPT_INT("kv-blocks", &p.kv_blocks, 0, INT32_MAX, "N",
                 "KV cache pool size in blocks (0: the memory plan, docs/operations.md)"),
      TW_OPT_INT("block-size", &p.block_size, 1, 1 << 20, "N", "KV block size in tokens"),
      TW_OPT_INT("max-batch", &p.max_batch, 0, TW_DECODE_MAX_BATCH, "N",
                 "sequences per decode step, per dp rank (0: the memory plan)"),
      TW_OPT_DOUBLE("gpu-memory-utilization", &p.gpu_memory_utilization, 0, 1, "F",
                    "share of the device for its workers (0: 0.90)"),
      TW_OPT_FN("colocated", &colocated, tw_mem_colocated_opt, "P,D",
                "prefill and decode workers on this device, this one included\n"
                "(default this one alone)"),
      TW_OPT_STR("share-weights", &p.share_weights_dir, "DIR",
                 "cuda: one copy of the weights for the workers of DIR"),
      TW_OPT_INT("threads", &p.threads, 0, 4096, "N", "cpu threads (0: all cores)"),
      TW_OPT_INT("metrics-port", &p.metrics_port, -1, 65535, "PORT",
                 "/metrics, /healthz, /livez port (-1 off, 0 ephemeral)"),
      TW_OPT_STR("metrics-addr", &p.metrics_addr, "ADDR",
                 "numeric address of the metrics port (default 127.0.0.1; 0.0.0.0: all)"),
      TW_OPT_INT("drain-timeout", &p.drain_timeout_s, 0, INT32_MAX, "SECONDS",
                 "on SIGTERM, finish running sequences for at most this long"),
      TW_OPT_FLAG("verify-kv", &p.verify_kv, "check the per-layer checksums of received KV"),
      TW_OPT_INT("log-stats-interval", &p.log_stats_interval_s, 0, 86400, "SECONDS",
                 "a stats line (running, waiting, KV use, tok/s) this often while busy\n"
                 "(0: none)"),
      TW_OPT_STR("served-model-name", &p.served_model_name, "NAME",
                 "model_name label of the metrics (default: from --model)"),
      TW_OPT_INT("tp", &p.tp, 1, 64, "N", "tensor parallel ranks (docs/parallelism.md)"),
      TW_OPT_INT("ep", &p.ep, 1, 64, "N", "expert parallel ranks"),
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
  if (tw_opts_given(&spec, "colocated") && p.colocated_decode < 1) {
    fprintf(stderr, "twain-decode: --colocated %d,%d counts no decode worker (this one)\n",
            p.colocated_prefill, p.colocated_decode);
    return 2;
  }
  if (!p.router) {
    fprintf(stderr, "twain-decode: missing --router tcp://HOST:PORT (the router's worker endpoint; "
                    "see --help)\n");
    return 2;
  }
  p.argc = argc;
  p.argv = argv;
  tw_status_t st = tw_decode_worker_run(&p);
  if (st != TW_OK && !tw_worker_started_g)
    TW_ERROR("decode", "cannot start: %s: %s", tw_status_str(st), tw_last_error());
  return tw_worker_exit_code(st); /* 78: a configuration error, `twain serve` stops */
}
