/* worker_daemon.c: the skeleton of a worker daemon (see worker_daemon.h). */
#include "common/worker/worker_daemon.h"

#include "common/base/log.h"
#include "common/comm/link_auth.h"
#include "common/comm/msg.h"
#include "common/engine/dist_engine.h"
#include "common/model/model_path.h"
#include "proto/twain_api.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

bool tw_worker_colocated_ok(const tw_opts_spec_t *spec, const char *role, int32_t n_prefill,
                            int32_t n_decode) {
  int32_t mine = strcmp(role, "prefill") == 0 ? n_prefill : n_decode;
  if (!tw_opts_given(spec, "colocated") || mine >= 1) return true;
  fprintf(stderr, "%s: --colocated %d,%d counts no %s worker (this one)\n", spec->prog, n_prefill,
          n_decode, role);
  return false;
}

TW_NODISCARD tw_status_t tw_worker_dist_create(tw_worker_t *w, tw_backend_kind_t backend) {
  tw_coll_kind_t kind = tw_backend_caps(backend).on_device ? TW_COLL_NCCL : TW_COLL_HOST;
  return tw_dist_create(&w->id, kind, w->id.local_rank, NULL, &w->dist);
}

TW_NODISCARD tw_status_t tw_worker_metrics_open(tw_worker_t *w, const char *name, int port,
                                                const char *addr, const char *served_model_name,
                                                const char *model_dir) {
  if (name)
    snprintf(w->name, sizeof w->name, "%s", name);
  else
    snprintf(w->name, sizeof w->name, "%s-%d", w->role, (int)getpid());
  TW_CHECK(tw_metrics_create(w->name, port, addr, &w->metrics));
  char model_name[256]; /* the model_name label, as the router's (model_path.h) */
  tw_model_name(served_model_name, model_dir, model_name, sizeof model_name);
  tw_metrics_set_label(w->metrics, "model_name", model_name);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_worker_connect(tw_worker_t *w, const char *router,
                                           Twain__Internal__V1__Pool pool, int32_t kv_block_size,
                                           int32_t n_layers, int32_t vocab_size,
                                           const char *backend) {
  TW_CHECK(tw_worker_link_open(&w->link, router, w->name, pool));
  w->link.ranks = w->id.size;
  w->link.kv_block_size = kv_block_size;
  w->link.n_layers = n_layers;
  w->link.vocab_size = vocab_size;
  snprintf(w->link.backend, sizeof w->link.backend, "%s", backend);
  return TW_OK;
}

/* Step 3: every message waiting (the policy of the header). Returns false
 * when receiving failed (not for an undecodable message). */
static bool tw_worker_pump(tw_worker_t *w) {
  for (int k = 0; k < TW_WORKER_PUMP_MAX; k++) {
    Twain__Internal__V1__Envelope *env = NULL;
    tw_status_t rs = tw_worker_link_recv(&w->link, 0, &env);
    if (rs == TW_OK && !env) continue; /* the link's own (a reject of no request) */
    if (rs == TW_OK) {
      if (!w->ops->on_msg(w->arg, env)) {
        char why[80];
        snprintf(why, sizeof why, "%s worker: unexpected message type", w->role);
        TW_WARN(w->role, "ignoring a message of type %d from the router", (int)env->body_case);
        tw_msg_note_failure(tw_worker_link_reject(&w->link, 0, TWAIN__V1__CODE__UNIMPLEMENTED, why),
                            w->role, "cannot send a reject to the router");
        twain__internal__v1__envelope__free_unpacked(env, NULL);
      }
      continue;
    }
    if (rs == TW_ERR_FORMAT) continue;    /* logged by the link (rate-limited) */
    if (rs == TW_INPROGRESS) return true; /* nothing (more) waiting */
    tw_msg_note_failure(rs, w->role, "router socket");
    return false;
  }
  return true;
}

/* Steps 1-6 of the header until the drain ends or the work fails. */
static TW_NODISCARD tw_status_t tw_worker_loop(tw_worker_t *w) {
  const tw_worker_ops_t *ops = w->ops;
  unsigned epoch = atomic_load(&w->link.epoch);
  bool recv_failed = false;
  Twain__Internal__V1__Capacity cap;
  for (;;) {
    if (tw_worker_stop_g && !w->draining) {
      w->draining = true;
      w->drain_since_ns = tw_msg_clock_ns();
      tw_metrics_set_health(w->metrics, false, "draining");
      ops->on_drain(w->arg);
    }
    int fd = -1;
    int ms = ops->wait_ms(w->arg, &fd);
    if (w->draining && ops->pending(w->arg) == 0) ms = 0; /* only take what is there */
    if (ms > 0 && recv_failed) { /* a failed socket fails at once: do not spin on it */
      struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    } else if (ms > 0) {
      tw_worker_link_wait(&w->link, fd, ms);
    }
    if (ops->after_wait) ops->after_wait(w->arg);
    recv_failed = !tw_worker_pump(w);
    /* right after the RegisterAck that said the router had forgotten us (the
     * pump stops at it): before any message of the new registration is
     * taken, so only old work is dropped */
    if (atomic_load(&w->link.epoch) != epoch) {
      epoch = atomic_load(&w->link.epoch);
      if (ops->on_forgotten) ops->on_forgotten(w->arg);
    }
    if (w->draining) {
      int32_t left = ops->pending(w->arg);
      if (left == 0) break;
      if (tw_worker_stop_g >= 2) {
        TW_WARN(w->role, "second stop signal: stopping with %d %s unfinished", left, w->unit);
        break;
      }
      if (w->drain_timeout_s >= 0 &&
          tw_msg_clock_ns() - w->drain_since_ns > (int64_t)w->drain_timeout_s * 1000000000LL) {
        TW_WARN(w->role, "drain timeout (%d s): stopping with %d %s unfinished", w->drain_timeout_s,
                left, w->unit);
        break;
      }
    }
    tw_status_t st = ops->work(w->arg);
    if (st != TW_OK) return st;
    ops->capacity(w->arg, &cap);
    tw_msg_note_failure(tw_worker_link_tick(&w->link, &cap, w->draining, false), w->role,
                        "cannot register with the router (retried)");
  }
  return TW_OK;
}

int tw_worker_name_opt(const char *text, void *dst, char *err, size_t errlen) {
  size_t n = strlen(text);
  if (n < 1 || n > 48 || strspn(text, TW_ALNUM_CHARS "._-") != n) {
    snprintf(err, errlen,
             "must be 1 to 48 letters, digits, '.', '_' or '-' (it is the routing id)");
    return -1;
  }
  *(const char **)dst = text;
  return 0;
}

/* Before the model is loaded (minutes for a large one): one handshake with
 * the router's worker endpoint using this process's link keys. A router
 * that refuses them (another key set, or plaintext on one side only) stops
 * the worker now with a configuration error instead of after the load,
 * when the link would only log refused handshakes. A router that does not
 * answer within TW_WORKER_PROBE_MS (not started yet) is no error: the link
 * waits for it as before. A handshake ended without a word (libzmq cannot
 * tell keys a router cannot decrypt from a router that died mid-handshake)
 * is tried once more before it counts. */
#define TW_WORKER_PROBE_MS (1500 * TW_SLOW_BUILD)

static TW_NODISCARD tw_status_t tw_worker_probe_router(const tw_worker_t *w) {
  tw_auth_keys_t keys = {0};
  const char *inl = getenv(TW_AUTH_KEYS_ENV), *file = getenv(TW_AUTH_KEYS_FILE_ENV);
  const char *plain = getenv(TW_AUTH_PLAINTEXT_ENV);
  if ((inl && *inl) || (file && *file)) {
    tw_status_t ks = tw_auth_keys_from_env("worker link to the router", &keys);
    if (ks != TW_OK) return ks; /* an unreadable key set: the same error ops->init would give */
  } else if (plain && !strcmp(plain, "1")) {
    keys.plaintext = true; /* ops->init warns about it */
  } else {
    return TW_OK; /* no keys at all: ops->init says how to make them */
  }
  void *zctx = zmq_ctx_new();
  if (!zctx) return TW_OK;
  /* a ZeroMQ handshake, not a bare TCP connect: the router logs a connection
   * closed mid-handshake as refused keys. Nothing listening (not started
   * yet) ends it at once: the link waits for the router after the load.
   * Twice: a router that went away in the middle of the first handshake (a
   * restart) also ends it; refused keys are refused again */
  tw_status_t st = TW_ERR_INVALID_ARGUMENT;
  for (int attempt = 0; attempt < 2 && st == TW_ERR_INVALID_ARGUMENT; attempt++) {
    if (attempt) nanosleep(&(struct timespec){0, 200 * 1000000L}, NULL);
    st = tw_auth_client_probe(zctx, w->router, &keys, TW_WORKER_PROBE_MS);
  }
  zmq_ctx_term(zctx);
  memset(&keys, 0, sizeof keys);
  if (st != TW_ERR_INVALID_ARGUMENT) return TW_OK; /* answered, absent, or for the link to say */
  return tw_err_quiet(
      TW_ERR_INVALID_ARGUMENT,
      "the router at %s refused this worker's link keys in the handshake: every process "
      "of a deployment needs the same key set (%s or %s; `twain serve` makes one for "
      "the workers it starts), or %s=1 on all of them; stopping before the model is "
      "loaded",
      w->router, TW_AUTH_KEYS_ENV, TW_AUTH_KEYS_FILE_ENV, TW_AUTH_PLAINTEXT_ENV);
}

int tw_worker_main(tw_worker_t *w) {
  const tw_worker_ops_t *ops = w->ops;
  tw_status_t st = tw_dist_identity_from_env(&w->id);
  if (st == TW_OK && w->ranks > 1 && w->id.size == 1) {
    int rc = -1;
    st = tw_dist_spawn(w->argc, w->argv, w->ranks, w->use_mpi, &w->id, &rc);
    if (st == TW_OK && rc >= 0) return rc; /* this process supervised the ranks, now done */
  }
  if (st != TW_OK) {
    TW_ERROR(w->role, "cannot start: %s: %s", tw_status_str(st), tw_last_error());
    return tw_worker_exit_code(st);
  }
  tw_log_init(w->prog, w->id.rank);
  tw_worker_signals_install();
  if (w->id.rank == 0 && w->router && (st = tw_worker_probe_router(w)) != TW_OK) {
    TW_ERROR(w->role, "cannot start: %s: %s", tw_status_str(st), tw_last_error());
    return tw_worker_exit_code(st); /* a configuration error: nothing was started */
  }
  st = ops->init(w->arg);
  if (st != TW_OK) {
    TW_ERROR(w->role, "cannot start: %s: %s", tw_status_str(st), tw_last_error());
    ops->fini(w->arg);
    return tw_worker_exit_code(st); /* a configuration error (msg_worker.h) */
  }
  tw_worker_started_g = 1; /* from here on a failure is a crash */
  if (w->id.rank != 0) {   /* follow rank 0's plans until it says stop (or dies: dist.h) */
    TW_INFO(w->role, "rank %d of %d pid %d following rank 0", w->id.rank, w->id.size,
            (int)getpid());
    st = ops->follow(w->arg);
    ops->fini(w->arg);
    return tw_worker_exit_code(st);
  }
  st = tw_worker_loop(w);
  Twain__Internal__V1__Capacity cap;
  ops->capacity(w->arg, &cap);
  tw_msg_note_failure(tw_worker_link_tick(&w->link, &cap, true, true), w->role,
                      "cannot tell the router we stop");
  ops->on_stop(w->arg);
  tw_msg_note_failure(tw_dist_plan_stop(w->dist), w->role, "cannot stop the other ranks");
  ops->fini(w->arg);
  return tw_worker_exit_code(st);
}
