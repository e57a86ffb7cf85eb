/* worker.h: the prefill worker daemon mode of `twain-prefill` (ARCHITECTURE.md
 * item 2): `twain-prefill --router tcp://HOST:PORT --model DIR ...`.
 * It registers with the router (pool prefill, capacity = queued prompt
 * tokens), runs the queued PrefillRequests' prompts through the engine into
 * its own KV pool, several at a time as one variable-length prefill up to a
 * token budget (--chunk-tokens, --batch-seqs), samples each first token, writes the prompt's KV layer by layer into
 * the blocks the decode worker reserved (UCX puts, sliding layers only their
 * window, kv_transfer.h), flushes for remote completion and only then answers
 * PrefillDone with the first token and per-layer checksums. */
#ifndef TW_PREFILL_WORKER_H
#define TW_PREFILL_WORKER_H

#include "common/engine/engine.h"

#include <stdint.h>

/** The daemon's options (prefill_main.c fills them from the command line). */
typedef struct {
  const char *model_dir, *router, *name; /* router: its worker endpoint; name NULL: prefill-<pid> */
  tw_backend_kind_t backend;
  int32_t kv_blocks, block_size, threads; /* local KV pool (blocks of block_size tokens); threads 0: all cores */
  int32_t kv_window_ring;   /* engine.h kv_window_ring: 1 on, -1 off, 0 the backend's default */
  int32_t prefill_bf16_experts; /* engine.h: 1 on, -1 off (default), 0 the memory plan's rule */
  int32_t kv_dtype;         /* engine.h kv_dtype (kv_fp8.h): 0 the backend's, 1 fp8 */
  int metrics_port;         /* -1 off, 0 ephemeral */
  const char *metrics_addr; /* NULL: 127.0.0.1 */
  int flush_timeout_ms;
  int32_t tp, ep; /* ranks of this worker (issue 6): each 1 or the group size */
  /* tokens of one forward pass: queued prompts are batched up to it (a longer
   * prompt runs alone, split over passes); each layer's blocks are handed off
   * while the next layers compute. 0: the memory plan's token budget */
  int32_t chunk_tokens;
  int32_t batch_seqs; /* most prompts in one batch */
  /* prefill passes of traffic's shapes on throwaway prompts before the
   * worker registers (worker.c tw_prefill_warmup): 1 on, -1 off, 0 (the
   * default) on for a device engine of one rank */
  int32_t warmup;
  double gpu_memory_utilization; /* 0: 0.90 (mem_plan.h) */
  int32_t colocated_prefill, colocated_decode; /* workers on this device; 0, 0: alone */
  const char *share_weights_dir; /* cuda: one copy of the weights (engine.h) */
  int log_stats_interval_s; /* a stats line every this many seconds while busy; 0: none */
  const char *served_model_name; /* metrics' model_name label; NULL: from model_dir */
} tw_prefill_opts_t;

#define TW_PREFILL_OPTS_DEFAULT                                                                    \
  ((tw_prefill_opts_t){.backend = TW_BACKEND_AUTO,                                                 \
                       .kv_blocks = 0,                                                             \
                       .block_size = 16,                                                           \
                       .metrics_port = 0,                                                          \
                       .flush_timeout_ms = 10000,                                                  \
                       .tp = 1,                                                                    \
                       .ep = 1,                                                                    \
                       .chunk_tokens = 0,                                                          \
                       .batch_seqs = 64,                                                           \
                       .log_stats_interval_s = 5,                                                  \
                       .prefill_bf16_experts = -1}) /* 0: planned */

/** Run the daemon with `opts` until SIGTERM/SIGINT (then finish the request
 *  in progress, refuse the queued ones and return). argc/argv: the command
 *  line, for starting --tp/--ep ranks (dist.h). Returns the process exit
 *  code: 0 ok, 1 failure, 2 bad usage (a --tp/--ep combination, named). */
int tw_prefill_worker_main(const tw_prefill_opts_t *opts, int argc, char **argv);

#endif
