/* msg_worker.h: the worker side of the router protocol, shared by the
 * prefill and decode daemons: one DEALER socket to the router's worker
 * endpoint, registration (repeated until acknowledged, and again if the
 * router forgets us), heartbeats with capacity every TW_WORKER_HEARTBEAT_MS,
 * and the SIGTERM/SIGINT stop flag for graceful drain.
 * The router expires a worker it has not heard from for
 * TW_WORKER_EXPIRE_MS (proto/twain_internal.proto). A worker whose router
 * goes away (no connection for TW_WORKER_EXPIRE_MS) logs it once, keeps
 * probing with its heartbeat and registers again when a router is back at
 * the same endpoint; it does not exit by itself (stop it with SIGTERM). */
#ifndef TW_COMMON_MSG_WORKER_H
#define TW_COMMON_MSG_WORKER_H

#include "common/base/status.h"
#include "common/comm/msg.h"
#include "proto/twain_internal.pb-c.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_WORKER_HEARTBEAT_MS 200
#define TW_WORKER_EXPIRE_MS (1000 * TW_SLOW_BUILD) /* common/base/status.h */

/** Exit status of a worker daemon that could not start because of its
 *  configuration or environment (a bad option value, a model that is missing
 *  or unreadable, no GPU for --backend cuda, a parallelism the model or the
 *  backend refuses): sysexits.h EX_CONFIG. Restarting cannot help, so
 *  `twain serve` stops at once on it (and on 2, a usage error); any other
 *  failure of a worker that was serving is a crash, and is restarted. */
#define TW_WORKER_EXIT_CONFIG 78

/** Set to 1 by a worker once it has started (model loaded, engine created,
 *  router link open): a failure after that is a crash, before it a
 *  configuration error. tw_worker_exit_code() reads it. */
extern volatile sig_atomic_t tw_worker_started_g;

/** The process exit code for a worker that ends with status `st`: 0 for
 *  TW_OK, 1 once tw_worker_started_g is set, else TW_WORKER_EXIT_CONFIG. */
int tw_worker_exit_code(tw_status_t st);

/** Set by SIGTERM/SIGINT once tw_worker_signals_install() ran: 1 after the
 *  first (drain), 2 after a second one (stop now: the drain ends at once). */
extern volatile sig_atomic_t tw_worker_stop_g;
/** Install SIGTERM/SIGINT handlers that set tw_worker_stop_g (and ignore SIGPIPE). */
void tw_worker_signals_install(void);

/** The stop signals of every daemon (workers, router, twain serve): SIGTERM
 *  and SIGINT call `on_signal` (which must only set a flag: async-signal
 *  safety), SIGPIPE is ignored (a peer that went away is a failed send, not
 *  the end of the process). */
void tw_stop_signals_install(void (*on_signal)(int));

typedef struct {
  void *zctx;       /* owned */
  void *sock;       /* DEALER to the router (main thread only) */
  char name[64];
  char endpoint[256];
  Twain__Internal__V1__Pool pool;
  int32_t ranks;
  int32_t kv_block_size, n_layers, vocab_size;
  char backend[16];
  ProtobufCBinaryData *kv_addresses; /* decode: each rank's UCX address (borrowed), sent in Register */
  size_t n_kv_addresses;
  Twain__Internal__V1__KvHandoff *kv_pools; /* decode: its pools (borrowed), sent in Register */
  bool registered;  /* RegisterAck seen */
  bool ever_registered; /* a RegisterAck seen before (a later one may say we were forgotten) */
  int64_t last_register_ns;
  int64_t
      unanswered_since_ns; /* the first Register of those the router has not answered; 0: none */
  int64_t unanswered_warned_ns; /* when that was last said */
  /* heartbeat thread: its own socket; reads cap/draining under mu */
  pthread_t hb_thread;
  bool hb_started;
  pthread_mutex_t mu;
  Twain__Internal__V1__Capacity cap;
  bool draining;
  atomic_int hb_stop, registered_a, need_register;
  atomic_int router_lost;     /* the heartbeat cannot reach the router (logged once) */
  atomic_uint epoch;          /* +1 each time the router forgot us (a RegisterAck
                               * that is not `known`): the work it gave us before is void */
  tw_msg_ratelimit_t warn_rl; /* malformed-message warnings (main thread) */
  int64_t lost_since_ns;      /* heartbeat thread: router unreachable since (0: reachable) */
  tw_auth_keys_t keys;        /* CURVE client keys of both sockets (common/comm/link_auth.h) */
  tw_auth_guard_t *guard;     /* logs a router that refuses our key */
  uint64_t instance;          /* random per process start, sent in Register */
} tw_worker_link_t;

/** Connect to the router (endpoint e.g. "tcp://127.0.0.1:7401") with the
 *  routing id `name` and start the heartbeat thread (routing id
 *  "<name>/hb"). Both sockets are CURVE clients with the link keys of the
 *  environment (tw_auth_keys_from_env). Errors: TW_ERR_INVALID_ARGUMENT (no
 *  or bad link keys), TW_ERR_TRANSPORT, TW_ERR_INTERNAL (thread). */
TW_NODISCARD tw_status_t tw_worker_link_open(tw_worker_link_t *link, const char *endpoint,
                                             const char *name, Twain__Internal__V1__Pool pool);
void tw_worker_link_close(tw_worker_link_t *link);

/** Send an envelope to the router. Errors as tw_msg_send. */
TW_NODISCARD tw_status_t tw_worker_link_send(tw_worker_link_t *link,
                                             const Twain__Internal__V1__Envelope *env);

/** Publish the capacity for the heartbeat thread and register (every 250 ms
 *  until acknowledged, and again when the router has forgotten us); call
 *  every loop iteration. `force` registers now if not registered. */
TW_NODISCARD tw_status_t tw_worker_link_tick(tw_worker_link_t *link,
                                             const Twain__Internal__V1__Capacity *cap,
                                             bool draining, bool force);

/** Receive one envelope (timeout as tw_msg_recv). TW_OK with *env_p set
 *  (free with twain__internal__v1__envelope__free_unpacked(env, NULL)),
 *  TW_INPROGRESS when none, TW_ERR_FORMAT for an undecodable message
 *  (logged; the caller keeps going). A RegisterAck is handled here and
 *  reported as TW_INPROGRESS (the caller stops there: the work of before
 *  may be void, epoch); a reject of no request (e.g. "unknown worker") is
 *  handled here and reported as TW_OK with *env_p NULL (read on). */
TW_NODISCARD tw_status_t tw_worker_link_recv(tw_worker_link_t *link, int timeout_ms,
                                             Twain__Internal__V1__Envelope **env_p);

/** Wait up to timeout_ms until the router socket has input or maybe_fd
 *  (-1: none) is readable. Returns nothing; callers then receive with 0. */
void tw_worker_link_wait(tw_worker_link_t *link, int maybe_fd, int timeout_ms);

/** The status of a worker's answer (PrefillDone, Tokens, Reject): NULL for
 *  code 0 (success: no status on the wire), else `s` initialised with the
 *  v1 code, the message (borrowed: it must outlive the send) and
 *  worker_failed (the worker's device failed, not the request: the router
 *  retries it elsewhere; twain_internal.proto Status). */
Twain__Internal__V1__Status *tw_reply_status(Twain__Internal__V1__Status *s, int code,
                                             bool worker_failed, const char *message);

/** A Reject envelope (the storage of its parts in one place). */
typedef struct {
  Twain__Internal__V1__Status status;
  Twain__Internal__V1__Reject reject;
  Twain__Internal__V1__Envelope env;
} tw_reject_msg_t;

/** Fill m with a Reject of request_id (0: of a message, not a request)
 *  with a v1 code and message (borrowed: it must outlive the send), as
 *  both ends of the worker link send it; returns &m->env. */
const Twain__Internal__V1__Envelope *tw_reject_msg(tw_reject_msg_t *m, uint64_t request_id,
                                                   int code, const char *message);

/** Send a Reject for request_id with a v1 code and message. */
TW_NODISCARD tw_status_t tw_worker_link_reject(tw_worker_link_t *link, uint64_t request_id,
                                               int code, const char *message);

#ifdef __cplusplus
}
#endif
#endif
