/* decode_worker.h: the decode worker daemon (ARCHITECTURE.md item 3).
 * It registers with the router with its KV capacity, reserves blocks for each
 * handoff (publishing its UCX address, the rkey of its registered KV pool and
 * the pool layout), admits sequences whose KV the prefill worker has written
 * into a continuously batched decode loop, streams tokens to the router, and
 * frees a sequence's blocks on finish, cancel or failure. With --dp N the
 * N ranks are attention replicas: rank 0 places each sequence on the rank
 * with the most free blocks, whose pool receives its whole KV, and every
 * step runs each rank's own batch (docs/parallelism.md). */
#ifndef TW_DECODE_DECODE_WORKER_H
#define TW_DECODE_DECODE_WORKER_H

#include "common/base/status.h"
#include "common/engine/engine.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct {
  const char *model_dir;
  const char *router;       /* worker endpoint of the router */
  const char *name;         /* NULL: decode-<pid> */
  tw_backend_kind_t backend;
  int32_t kv_blocks;        /* KV pool size in blocks; 0: the memory plan's (mem_plan.h) */
  int32_t kv_window_ring;   /* engine.h kv_window_ring: 1 on, -1 off, 0 the backend's default */
  int32_t prefill_bf16_experts; /* engine.h: the prefill workers' setting (default -1, off),
                                 * for the memory plan */
  int32_t kv_dtype;         /* engine.h kv_dtype (kv_fp8.h): 0 the backend's, 1 fp8 */
  int32_t block_size;
  int32_t max_batch;        /* sequences per step; 0: the memory plan's */
  double gpu_memory_utilization; /* share of the device for its workers; 0: 0.90 */
  int32_t colocated_prefill, colocated_decode; /* workers on this device, this one
                                                * included; 0, 0: this one alone */
  const char *share_weights_dir; /* cuda: one copy of the weights for the workers
                                  * of this directory (engine.h); NULL: own copy */
  int32_t threads;          /* cpu threads; 0 = all cores */
  int metrics_port;         /* -1: none, 0: ephemeral */
  const char *metrics_addr; /* numeric address for /metrics, /healthz, /livez; NULL: 127.0.0.1 */
  int32_t drain_timeout_s;  /* SIGTERM: finish running sequences for at most this long */
  bool verify_kv;           /* check per-layer checksums of received KV */
  int32_t reserve_timeout_ms; /* free a reservation never started after this */
  int32_t tp, ep;           /* ranks of this worker (issue 6): each 1 or the group size */
  int32_t dp;               /* data-parallel attention replicas: 1, or the group size with
                               ep = dp and tp = 1 (cpu backend; docs/parallelism.md) */
  int log_stats_interval_s; /* a stats line every this many seconds while busy; 0: none */
  const char *served_model_name; /* metrics' model_name label; NULL: from model_dir */
  int argc;                 /* the command line, for --tp self-spawn (dist.h) */
  char **argv;
} tw_decode_params_t;

#define TW_DECODE_PARAMS_DEFAULT                                                                   \
  ((tw_decode_params_t){.backend = TW_BACKEND_AUTO,                                                \
                        .kv_blocks = 0,                                                            \
                        .block_size = 16,                                                          \
                        .max_batch = 0,                                                            \
                        .threads = 0,                                                              \
                        .metrics_port = 0,                                                         \
                        .verify_kv = false,                                                        \
                        .reserve_timeout_ms = 60000,                                               \
                        .tp = 1,                                                                   \
                        .ep = 1,                                                                   \
                        .dp = 1,                                                                   \
                        .drain_timeout_s = 600,                                                    \
                        .log_stats_interval_s = 5,                                                 \
                        .prefill_bf16_experts = -1})

#define TW_DECODE_MAX_DP 64 /* data-parallel ranks of one worker (the control link's limit) */
#define TW_DECODE_MAX_BATCH 65536 /* --max-batch: sequences per step (per dp rank) */

/** Run the daemon (common/worker/worker_daemon.h) until SIGTERM/SIGINT, then drain
 *  (finish the running sequences, refuse new ones; at most drain_timeout_s
 *  seconds) and return the process exit code: 0 after the drain (or the
 *  code of the ranks this process started and supervised), 1 for a failure
 *  once serving (a device error in a step), TW_WORKER_EXIT_CONFIG (logged
 *  "cannot start: ...") when it could not start: tp/ep/dp not a valid
 *  combination (named), max_batch outside [0, TW_DECODE_MAX_BATCH], dp > 1
 *  on a backend without data-parallel attention (tw_backend_caps), or what
 *  loading the model, creating the engine, the UCX transfer or the router
 *  connection returned. */
int tw_decode_worker_main(const tw_decode_params_t *params);

#endif
