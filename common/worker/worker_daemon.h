/* worker_daemon.h: the skeleton of a worker daemon, one for twain-prefill
 * and twain-decode; the daemons supply the work (ops), the skeleton the
 * rest:
 *
 * Start. The ranks of the worker (dist.h): its identity from a launcher,
 * or `ranks` > 1 processes started here (tw_dist_spawn); the log line
 * prefix of this rank; SIGTERM/SIGINT handlers (msg_worker.h); ops->init.
 * A failure up to here is logged once ("cannot start: ...") and is a
 * configuration error (exit TW_WORKER_EXIT_CONFIG, msg_worker.h); from the
 * end of init on, a failure is a crash (exit 1). Ranks other than 0 follow
 * rank 0 (ops->follow) until it stops them.
 *
 * Loop (rank 0), one turn:
 *   1. drain: once SIGTERM/SIGINT came, the worker is draining: /healthz
 *      turns 503 ("draining"), ops->on_drain is told once (it logs what it
 *      will finish and refuse), and from then on every message that asks for
 *      new work must be refused by the daemon (UNAVAILABLE);
 *   2. wait: up to ops->wait_ms for a message from the router or the
 *      daemon's file descriptor (an idle worker costs ~0 CPU; heartbeats
 *      have their own thread); no wait while draining with nothing pending;
 *   3. pump: every message waiting, at most TW_WORKER_PUMP_MAX a turn (so
 *      that work still runs under a flood), each to ops->on_msg; a
 *      RegisterAck ends the pump, and where it says the router had
 *      forgotten this worker (not `known`: expired, a new router),
 *      ops->on_forgotten drops the work of the old registration before a
 *      message of the new one is taken;
 *   4. the drain ends once ops->pending is 0 (after the pump, so that what
 *      arrived meanwhile was refused, not dropped), or, with
 *      drain_timeout_s >= 0, after that long (logged with what is left);
 *   5. work: ops->work; an error it returns is sticky (a device error):
 *      the loop ends and the process exits 1;
 *   6. tick: ops->capacity to the heartbeat thread, registration
 *      (tw_worker_link_tick: again when the router rejected a message as
 *      from an unknown worker, a burst of such rejects read through in one
 *      pump; a late reject of a heartbeat that crossed the registration
 *      costs one more Register, answered `known`, and nothing else).
 * Then the last capacity with draining set goes to the router, ops->on_stop
 * logs how the worker ends, the other ranks are stopped and ops->fini runs.
 *
 * Transport-error policy (the one for both daemons). An undecodable
 * message (TW_ERR_FORMAT) is logged by the link (rate-limited) and skipped.
 * Any other failure to receive (TW_ERR_TRANSPORT: the socket itself failed,
 * which then fails at once on every call; TW_ERR_NO_MEMORY) ends this
 * turn's pump and is logged, at most TW_MSG_WARN_PER_S a second; the turn
 * goes on (work, tick: the heartbeat thread registers again when the router
 * is back), and the next turn, if the worker is idle (ops->wait_ms > 0),
 * sleeps that long instead of polling the failed socket: a failed socket is
 * never spun on, and running work is never held up by it. */
#ifndef TW_COMMON_WORKER_DAEMON_H
#define TW_COMMON_WORKER_DAEMON_H

#include "common/base/metrics.h"
#include "common/base/opts.h"
#include "common/base/status.h"
#include "common/comm/dist.h"
#include "common/comm/msg_worker.h"
#include "common/engine/engine.h"
#include "common/engine/mem_plan.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_ring.h"
#include "common/model/model_path.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The options every worker daemon takes, as the first entries of its
 *  opts.h table (prefill_main.c, decode_main.c): `o` points to the daemon's
 *  options struct, which has these fields: model_dir, backend, threads,
 *  block_size, router, name, kv_blocks, kv_window_ring, kv_dtype, prefill_bf16_experts,
 *  gpu_memory_utilization,
 *  share_weights_dir, metrics_port, metrics_addr, tp, ep,
 *  log_stats_interval_s, served_model_name; `colocated` points to its
 *  tw_mem_colocated_t (mem_plan.h). D is a string literal that starts the
 *  help of each option of the daemon mode ("daemon: " in a program that has
 *  another mode, else ""), ROLE the daemon's role ("prefill": the default
 *  routing id is ROLE-<pid>), STATS what its stats line shows. */
#define TW_WORKER_OPTS(o, colocated, D, ROLE, STATS)                                               \
  TW_OPT_STR_FN("model", &(o)->model_dir, tw_model_opt, "DIR|ORG/NAME",                            \
                "checkpoint directory;\n"                                                          \
                "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),             \
      TW_OPT_FN("backend", &(o)->backend, tw_backend_opt, "auto|cpu|cuda", "engine backend"),      \
      TW_OPT_INT("threads", &(o)->threads, 0, 4096, "N", "cpu threads (0: all cores)"),            \
      TW_OPT_INT("block-size", &(o)->block_size, 1, 1 << 20, "N", "KV block size in tokens"),      \
      TW_OPT_STR("router", &(o)->router, "tcp://HOST:PORT",                                        \
                 D "the router's worker endpoint (required)"),                                     \
      TW_OPT_STR_FN("name", &(o)->name, tw_worker_name_opt, "NAME",                                \
                    D "routing id: letters, digits, '.', '_', '-' (default " ROLE "-<pid>)"),      \
      TW_OPT_INT("kv-blocks", &(o)->kv_blocks, 0, INT32_MAX, "N",                                  \
                 D "KV cache pool in blocks (0: the memory plan, docs/operations.md)"),            \
      TW_OPT_FN("kv-window-ring", &(o)->kv_window_ring, tw_opts_switch_auto, "0|1|auto",           \
                D                                                                                  \
                "sliding layers keep only their window's KV blocks\n"                              \
                "(auto: on; docs/operations.md)"),                                                 \
      TW_OPT_FN("kv-dtype", &(o)->kv_dtype, tw_kv_dtype_opt, "bf16|fp8",                           \
                D                                                                                  \
                "KV cache dtype: bf16 (cpu: f32), or fp8 e4m3 with a scale\n"                      \
                "per token and kv head (~1.9x the tokens; docs/operations.md)"),                   \
      TW_OPT_FN("prefill-bf16-experts", &(o)->prefill_bf16_experts, tw_opts_switch_auto,           \
                "0|1|auto",                                                                        \
                D                                                                                  \
                "cuda: each prefill worker keeps a bf16 copy of the MXFP4\n"                       \
                "experts for its MoE (default 0; auto: when the memory plan has\n"                 \
                "room; give every worker of the device the same; docs/operations.md)"),            \
      TW_OPT_DOUBLE("gpu-memory-utilization", &(o)->gpu_memory_utilization, 0, 1, "F",             \
                    D "share of the device for its workers (0: 0.90)"),                            \
      TW_OPT_FN("colocated", (colocated), tw_mem_colocated_opt, "P,D",                             \
                D                                                                                  \
                "prefill and decode workers on this device, this one\n"                            \
                "included (default this one alone)"),                                              \
      TW_OPT_STR("share-weights", &(o)->share_weights_dir, "DIR",                                  \
                 D "cuda: one copy of the weights for the workers of DIR"),                        \
      TW_OPT_INT("metrics-port", &(o)->metrics_port, -1, 65535, "PORT",                            \
                 D "/metrics, /healthz, /livez port (-1 off, 0 ephemeral)"),                       \
      TW_OPT_STR("metrics-addr", &(o)->metrics_addr, "ADDR",                                       \
                 D                                                                                 \
                 "numeric address of the metrics port (default 127.0.0.1;\n"                       \
                 "0.0.0.0: all)"),                                                                 \
      TW_OPT_INT("tp", &(o)->tp, 1, 64, "N",                                                       \
                 D                                                                                 \
                 "tensor parallel ranks (docs/parallelism.md); started here\n"                     \
                 "(one node) unless a launcher (mpirun, srun, RANK/WORLD_SIZE) did"),              \
      TW_OPT_INT("ep", &(o)->ep, 1, 64, "N", D "expert parallel ranks"),                           \
      TW_OPT_INT("log-stats-interval", &(o)->log_stats_interval_s, 0, 86400, "SECONDS",            \
                 D "a stats line (" STATS                                                          \
                   ") this often while busy\n"                                                     \
                   "(0: none)"),                                                                   \
      TW_OPT_STR("served-model-name", &(o)->served_model_name, "NAME",                             \
                 D "model_name label of the metrics (default: from --model)")

/** After tw_opts_parse of a table with TW_WORKER_OPTS: false, with
 *  "PROG: --colocated P,D counts no ROLE worker (this one)" on stderr (a
 *  usage error: exit 2), when --colocated was given and counts no worker of
 *  this daemon's role ("prefill": n_prefill < 1, else n_decode < 1). */
bool tw_worker_colocated_ok(const tw_opts_spec_t *spec, const char *role, int32_t n_prefill,
                            int32_t n_decode);

/** Messages taken from the router in one loop turn at most. */
#define TW_WORKER_PUMP_MAX 1024

typedef struct tw_worker tw_worker_t;

/** What a daemon does; `arg` is tw_worker_t.arg. Required unless marked. */
typedef struct {
  /* Everything the daemon needs (model, engine, pools); on rank 0 also the
   * metrics and the router link (tw_worker_t.metrics, .link: see
   * tw_worker_metrics_open, tw_worker_connect). w->id is this rank. An
   * error: the daemon cannot start (ops->fini still runs). */
  TW_NODISCARD tw_status_t (*init)(void *arg);
  /* Free what init made (also after a failed init: check what is there). */
  void (*fini)(void *arg);
  /* Ranks != 0: follow rank 0's plans until it stops them (dist.h). */
  TW_NODISCARD tw_status_t (*follow)(void *arg);
  /* Loop step 1: draining began (log what is left; refuse from now on). */
  void (*on_drain)(void *arg);
  /* Step 2: how long to wait for a message (0: work is waiting, do not
   * wait), and in *fd_p (preset -1) a file descriptor that also ends it. */
  int (*wait_ms)(void *arg, int *fd_p);
  /* After step 2 (NULL: none), whether or not it waited. */
  void (*after_wait)(void *arg);
  /* Step 3: one message from the router. true: the daemon took it and owns
   * it (free it with twain__internal__v1__envelope__free_unpacked); false:
   * the daemon takes no message of its type, and the skeleton logs it,
   * answers a Reject (UNIMPLEMENTED) and frees it. */
  bool (*on_msg)(void *arg, Twain__Internal__V1__Envelope *env);
  /* Step 4: what a drain still waits for (queued prompts, running
   * sequences). */
  int32_t (*pending)(void *arg);
  /* Step 5: the work of one turn. An error ends the loop (exit 1). */
  TW_NODISCARD tw_status_t (*work)(void *arg);
  /* Step 6: the capacity the router sees. */
  void (*capacity)(void *arg, Twain__Internal__V1__Capacity *cap);
  /* Step 3 (NULL: none): the router forgot this worker and it registered
   * again (a RegisterAck not `known`): the work it gave before is void. */
  void (*on_forgotten)(void *arg);
  /* The loop ended: one line on how (e.g. blocks still in use). */
  void (*on_stop)(void *arg);
} tw_worker_ops_t;

/** The skeleton's state; daemons embed it and fill the first block. */
struct tw_worker {
  /* filled by the daemon before tw_worker_main */
  const char *prog; /* "twain-prefill": the log's process name */
  const char *role; /* "prefill": the log tag */
  const char *unit; /* "prompts", "sequences": what a drain waits for */
  const char *router; /* the router's worker endpoint: its link keys are tried before
                       * ops->init loads the model (NULL: not tried) */
  int32_t ranks;    /* processes of this worker: max(tp, ep) */
  bool use_mpi;     /* ranks talk over MPI (host backend) rather than NCCL */
  int argc;         /* the command line, to start the ranks */
  char **argv;
  int32_t drain_timeout_s; /* finish pending work for at most this long; < 0: no limit */
  const tw_worker_ops_t *ops;
  void *arg;
  /* set by the skeleton, or by ops->init on rank 0 */
  tw_dist_identity_t id; /* this rank */
  tw_dist_t *dist;       /* ops->init creates it (tw_dist_create) */
  tw_metrics_t *metrics; /* rank 0: tw_worker_metrics_open */
  tw_worker_link_t link; /* rank 0: tw_worker_connect */
  char name[64];         /* rank 0: the routing id (tw_worker_metrics_open) */
  bool draining;         /* SIGTERM/SIGINT came */
  int64_t drain_since_ns;
};

/** The --name option's parser (TW_OPT_STR_FN; dst: const char **): 1 to 48
 *  of [A-Za-z0-9._-] (the routing id; "NAME/hb" is its heartbeat socket's
 *  and serve adds "-rK" to restarts, so no '/'; and it is a metrics label).
 *  0, or -1 with why in err. */
int tw_worker_name_opt(const char *text, void *dst, char *err, size_t errlen);

/** Run the daemon (the header's Start and Loop) and return the process exit
 *  code: 0 after a drain, or the supervised ranks' code in the process that
 *  started them; 1 for a failure after start (a rank's follow, a sticky
 *  work error); TW_WORKER_EXIT_CONFIG when it could not start. */
int tw_worker_main(tw_worker_t *w);

/** From ops->init: the worker's rank group in w->dist (a group of one
 *  without ranks): collectives over NCCL when `backend` computes on a GPU
 *  (tw_backend_caps), else over the host (MPI). Errors: those of
 *  tw_dist_create. */
TW_NODISCARD tw_status_t tw_worker_dist_create(tw_worker_t *w, tw_backend_kind_t backend);

/** Rank 0, from ops->init: the routing id (given `name`, or "<role>-<pid>")
 *  in w->name, and the metrics server (/metrics, /healthz, /livez on port,
 *  -1 none, 0 ephemeral; addr NULL: 127.0.0.1) with the model_name label
 *  (tw_model_name of served_model_name, model_dir). Errors: those of
 *  tw_metrics_create. */
TW_NODISCARD tw_status_t tw_worker_metrics_open(tw_worker_t *w, const char *name, int port,
                                                const char *addr, const char *served_model_name,
                                                const char *model_dir);

/** Rank 0, from ops->init, after tw_worker_metrics_open: the router link
 *  (tw_worker_link_open to `router` as w->name in `pool`) with what
 *  registration tells the router: the worker's ranks, its KV block size and
 *  layers, the vocabulary and the backend's name. Errors: those of
 *  tw_worker_link_open. */
TW_NODISCARD tw_status_t tw_worker_connect(tw_worker_t *w, const char *router,
                                           Twain__Internal__V1__Pool pool, int32_t kv_block_size,
                                           int32_t n_layers, int32_t vocab_size,
                                           const char *backend);

#ifdef __cplusplus
}
#endif
#endif
