/* msg_worker.c: worker side of the router protocol (see msg_worker.h). */
#include "common/comm/msg_worker.h"

#include "common/base/log.h"
#include "proto/twain_api.pb-c.h"

#include <zmq.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

volatile sig_atomic_t tw_worker_stop_g = 0;
volatile sig_atomic_t tw_worker_started_g = 0;

int tw_worker_exit_code(tw_status_t st) {
  return st == TW_OK ? 0 : tw_worker_started_g ? 1 : TW_WORKER_EXIT_CONFIG;
}

static void tw_worker_on_signal(int sig) {
  (void)sig;
  tw_worker_stop_g = tw_worker_stop_g ? 2 : 1; /* only this handler writes it */
}

void tw_stop_signals_install(void (*on_signal)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask); /* one handler at a time: a count of signals loses none */
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

void tw_worker_signals_install(void) { tw_stop_signals_install(tw_worker_on_signal); }

/* immediate: queue nothing while the connection is down (sends fail), so the
 * heartbeat thread notices a router that is gone. */
static void *tw_dealer_open(void *ctx, const char *endpoint, const char *id, int immediate,
                            const tw_auth_keys_t *keys) {
  void *s = zmq_socket(ctx, ZMQ_DEALER);
  if (!s) return NULL;
  if (tw_auth_client(s, keys) != TW_OK) {
    zmq_close(s);
    return NULL;
  }
  int zero = 0, hwm = 100000;
  zmq_setsockopt(s, ZMQ_IMMEDIATE, &immediate, sizeof immediate);
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
  zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
  tw_msg_limit_size(s);
  if (zmq_connect(s, endpoint) != 0) {
    zmq_close(s);
    return NULL;
  }
  return s;
}

/* The heartbeat thread: its own DEALER ("<name>/hb"), the latest capacity
 * snapshot every TW_WORKER_HEARTBEAT_MS. */
static void *tw_worker_hb_main(void *arg) {
  tw_worker_link_t *link = arg;
  char id[80];
  snprintf(id, sizeof id, "%s/hb", link->name);
  void *s = tw_dealer_open(link->zctx, link->endpoint, id, 1, &link->keys);
  if (!s) {
    TW_ERROR("worker", "heartbeat socket to %s failed: %s", link->endpoint, zmq_strerror(errno));
    return NULL;
  }
  while (!atomic_load(&link->hb_stop)) {
    zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, TW_WORKER_HEARTBEAT_MS) > 0) {
      tw_msg_t m = {0};
      if (tw_msg_recv(s, false, 0, &m) == TW_OK) {
        Twain__Internal__V1__Envelope *env =
            twain__internal__v1__envelope__unpack(NULL, m.len, m.data);
        if (env && env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_REJECT)
          atomic_store(&link->need_register, 1);
        if (env) twain__internal__v1__envelope__free_unpacked(env, NULL);
      }
      tw_msg_fini(&m);
    }
    bool lost = atomic_load(&link->router_lost);
    if (!atomic_load(&link->registered_a) && !lost) continue;
    Twain__Internal__V1__Capacity c;
    Twain__Internal__V1__Heartbeat hb = TWAIN__INTERNAL__V1__HEARTBEAT__INIT;
    pthread_mutex_lock(&link->mu);
    c = link->cap;
    hb.draining = link->draining;
    pthread_mutex_unlock(&link->mu);
    hb.capacity = &c;
    hb.worker = link->name;
    Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    /* the heartbeat doubles as the probe of a lost router */
    int64_t now = tw_msg_clock_ns();
    if (tw_msg_send(s, NULL, &env.base) == TW_OK) {
      link->lost_since_ns = 0;
      if (lost) {
        TW_INFO("worker", "the router at %s is reachable again: registering", link->endpoint);
        atomic_store(&link->router_lost, 0);
        atomic_store(&link->need_register, 1);
      }
    } else if (!lost) {
      if (!link->lost_since_ns) link->lost_since_ns = now;
      if (now - link->lost_since_ns > (int64_t)TW_WORKER_EXPIRE_MS * 1000000) {
        TW_WARN("worker", "lost the router at %s (no connection for %d ms): will register again "
                "as soon as it is back", link->endpoint, TW_WORKER_EXPIRE_MS);
        atomic_store(&link->registered_a, 0);
        atomic_store(&link->router_lost, 1);
      }
    }
  }
  zmq_close(s);
  return NULL;
}

TW_NODISCARD tw_status_t tw_worker_link_open(tw_worker_link_t *link, const char *endpoint,
                                             const char *name, Twain__Internal__V1__Pool pool) {
  memset(link, 0, sizeof *link);
  TW_CHECK(tw_auth_keys_from_env("worker link to the router", &link->keys));
  if (getrandom(&link->instance, sizeof link->instance, 0) != (ssize_t)sizeof link->instance)
    link->instance = (uint64_t)tw_msg_clock_ns() ^ ((uint64_t)getpid() << 32); /* unique enough */
  if (!link->instance) link->instance = 1;
  link->zctx = zmq_ctx_new();
  if (!link->zctx) return tw_err(TW_ERR_TRANSPORT, "zmq_ctx_new failed: %s", zmq_strerror(errno));
  snprintf(link->name, sizeof link->name, "%s", name);
  snprintf(link->endpoint, sizeof link->endpoint, "%s", endpoint);
  tw_status_t gs = tw_auth_guard_start(link->zctx, &link->keys, "worker link", false, &link->guard);
  if (gs != TW_OK) {
    zmq_ctx_term(link->zctx);
    link->zctx = NULL;
    return gs;
  }
  link->sock = tw_dealer_open(link->zctx, endpoint, name, 0, &link->keys);
  /* like the router's worker socket: a link whose refused handshakes would
   * go unlogged is not opened (tw_auth_guard_watch logged why) */
  tw_status_t ws = link->sock ? tw_auth_guard_watch(link->guard, link->sock, "router link") : TW_OK;
  if (ws != TW_OK) {
    zmq_close(link->sock);
    link->sock = NULL;
    tw_auth_guard_stop(link->guard);
    link->guard = NULL;
    zmq_ctx_term(link->zctx);
    link->zctx = NULL;
    return ws;
  }
  if (!link->sock) {
    int e = errno;
    tw_auth_guard_stop(link->guard);
    link->guard = NULL;
    zmq_ctx_term(link->zctx);
    link->zctx = NULL;
    return tw_err(TW_ERR_TRANSPORT, "cannot connect to the router at %s: %s", endpoint,
                  zmq_strerror(e));
  }
  link->pool = pool;
  link->ranks = 1;
  twain__internal__v1__capacity__init(&link->cap);
  pthread_mutex_init(&link->mu, NULL);
  if (pthread_create(&link->hb_thread, NULL, tw_worker_hb_main, link) != 0) {
    zmq_close(link->sock);
    tw_auth_guard_stop(link->guard);
    link->guard = NULL;
    zmq_ctx_term(link->zctx);
    link->sock = link->zctx = NULL;
    return tw_err(TW_ERR_INTERNAL, "cannot start the heartbeat thread");
  }
  link->hb_started = true;
  return TW_OK;
}

void tw_worker_link_close(tw_worker_link_t *link) {
  if (link->hb_started) {
    atomic_store(&link->hb_stop, 1);
    pthread_join(link->hb_thread, NULL);
    pthread_mutex_destroy(&link->mu);
    link->hb_started = false;
  }
  if (link->sock) zmq_close(link->sock);
  tw_auth_guard_stop(link->guard);
  link->guard = NULL;
  memset(&link->keys, 0, sizeof link->keys);
  if (link->zctx) zmq_ctx_term(link->zctx);
  link->sock = link->zctx = NULL;
}

TW_NODISCARD tw_status_t tw_worker_link_send(tw_worker_link_t *link,
                                             const Twain__Internal__V1__Envelope *env) {
  return tw_msg_send(link->sock, NULL, &env->base);
}

TW_NODISCARD tw_status_t tw_worker_link_tick(tw_worker_link_t *link,
                                             const Twain__Internal__V1__Capacity *cap,
                                             bool draining, bool force) {
  pthread_mutex_lock(&link->mu);
  link->cap = *cap;
  link->draining = draining;
  pthread_mutex_unlock(&link->mu);
  if (atomic_load(&link->router_lost)) { /* logged once by the heartbeat thread */
    link->registered = false;
    return TW_OK; /* nothing to queue for a router that is not there */
  }
  if (atomic_exchange(&link->need_register, 0) && link->registered) {
    /* once per episode: a stall's queued messages come back rejected in a
     * burst, each asking for this; what was given before is dropped only if
     * the ack says the router had forgotten us (tw_worker_link_recv) */
    TW_WARN("worker", "router does not know %s: registering again", link->name);
    link->registered = false; /* the heartbeats go on: a router that still holds us
                               * must not expire us while the ack is on its way */
    link->last_register_ns = 0;
  }
  if (link->registered) {
    link->unanswered_since_ns = 0;
    return TW_OK;
  }
  int64_t now = tw_msg_clock_ns();
  if (!force && now - link->last_register_ns < 250 * 1000000LL) return TW_OK;
  if (!link->unanswered_since_ns) link->unanswered_since_ns = now;
  int64_t waited = now - link->unanswered_since_ns;
  if (waited > 5000000000LL && now - link->unanswered_warned_ns > 30000000000LL) {
    link->unanswered_warned_ns = now;
    TW_WARN("worker",
            "the router at %s has not answered %s's registration for %lld s: is it up, with this "
            "run's link keys? (a second worker under a name the router already knows is not "
            "heard at all: give each its own --name)",
            link->endpoint, link->name, (long long)(waited / 1000000000LL));
  }
  Twain__Internal__V1__Capacity c = *cap;
  Twain__Internal__V1__Register r = TWAIN__INTERNAL__V1__REGISTER__INIT;
  r.pool = link->pool;
  r.name = link->name;
  r.ranks = link->ranks;
  r.capacity = &c;
  r.pid = (int32_t)getpid();
  r.instance = link->instance;
  r.backend = link->backend;
  r.kv_block_size = link->kv_block_size;
  r.n_layers = link->n_layers;
  r.vocab_size = link->vocab_size;
  r.kv_addresses = link->kv_addresses;
  r.n_kv_addresses = link->n_kv_addresses;
  r.kv_pools = link->kv_pools;
  Twain__Internal__V1__Envelope env = TWAIN__INTERNAL__V1__ENVELOPE__INIT;
  env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER;
  env.register_ = &r;
  link->last_register_ns = now;
  return tw_worker_link_send(link, &env);
}

TW_NODISCARD tw_status_t tw_worker_link_recv(tw_worker_link_t *link, int timeout_ms,
                                             Twain__Internal__V1__Envelope **env_p) {
  tw_msg_t m = {0};
  tw_status_t st = tw_msg_recv(link->sock, false, timeout_ms, &m);
  if (st != TW_OK) {
    tw_msg_fini(&m);
    uint64_t sup = 0;
    if (st == TW_ERR_FORMAT && tw_msg_ratelimit(&link->warn_rl, &sup)) {
      if (sup) TW_WARN("worker", "suppressed %llu similar warnings", (unsigned long long)sup);
      TW_WARN("worker", "dropped a message from the router: %s", tw_last_error());
    }
    return st;
  }
  Twain__Internal__V1__Envelope *env = twain__internal__v1__envelope__unpack(NULL, m.len, m.data);
  tw_msg_fini(&m);
  if (!env) {
    uint64_t sup = 0;
    if (tw_msg_ratelimit(&link->warn_rl, &sup)) {
      if (sup) TW_WARN("worker", "suppressed %llu similar warnings", (unsigned long long)sup);
      TW_WARN("worker", "dropped an undecodable message from the router");
    }
    return TW_ERR_FORMAT;
  }
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_REGISTER_ACK) {
    if (!link->registered) TW_INFO("worker", "registered with the router as %s", link->name);
    /* the router had forgotten us: the work given before this ack is void
     * (it was retried elsewhere); the messages after it are the new
     * registration's (one socket, in order) */
    if (link->ever_registered && !env->register_ack->known) atomic_fetch_add(&link->epoch, 1);
    link->ever_registered = true;
    link->registered = true;
    atomic_store(&link->registered_a, 1);
    /* the rejects read before it answered what was sent before this
     * registration (one socket, in order): moot now; a router that forgets
     * us later rejects a later heartbeat */
    atomic_store(&link->need_register, 0);
    twain__internal__v1__envelope__free_unpacked(env, NULL);
    return TW_INPROGRESS;
  }
  if (env->body_case == TWAIN__INTERNAL__V1__ENVELOPE__BODY_REJECT &&
      env->reject->request_id == 0) {
    if (env->reject->status && env->reject->status->code == TWAIN__V1__CODE__NOT_FOUND)
      atomic_store(&link->need_register, 1); /* said once by the tick that registers */
    else
      TW_WARN(
          "worker", "router rejected a message: %s",
          env->reject->status && env->reject->status->message ? env->reject->status->message : "");
    twain__internal__v1__envelope__free_unpacked(env, NULL);
    *env_p = NULL; /* a stall's backlog comes back as a burst of these: read on */
    return TW_OK;
  }
  *env_p = env;
  return TW_OK;
}

Twain__Internal__V1__Status *tw_reply_status(Twain__Internal__V1__Status *s, int code,
                                             bool worker_failed, const char *message) {
  if (!code) return NULL;
  twain__internal__v1__status__init(s);
  s->code = code;
  s->message = (char *)message;
  s->worker_failed = worker_failed;
  return s;
}

const Twain__Internal__V1__Envelope *tw_reject_msg(tw_reject_msg_t *m, uint64_t request_id,
                                                   int code, const char *message) {
  twain__internal__v1__status__init(&m->status);
  m->status.code = code;
  m->status.message = (char *)message;
  twain__internal__v1__reject__init(&m->reject);
  m->reject.request_id = request_id;
  m->reject.status = &m->status;
  twain__internal__v1__envelope__init(&m->env);
  m->env.body_case = TWAIN__INTERNAL__V1__ENVELOPE__BODY_REJECT;
  m->env.reject = &m->reject;
  return &m->env;
}

TW_NODISCARD tw_status_t tw_worker_link_reject(tw_worker_link_t *link, uint64_t request_id,
                                               int code, const char *message) {
  tw_reject_msg_t m;
  return tw_worker_link_send(link, tw_reject_msg(&m, request_id, code, message));
}

void tw_worker_link_wait(tw_worker_link_t *link, int maybe_fd, int timeout_ms) {
  zmq_pollitem_t it[2] = {{.socket = link->sock, .events = ZMQ_POLLIN},
                          {.socket = NULL, .fd = maybe_fd, .events = ZMQ_POLLIN}};
  zmq_poll(it, maybe_fd >= 0 ? 2 : 1, timeout_ms);
}
