/* link_auth.c: CURVE keys, the ZAP handler and handshake-failure logging of
 * the internal links (see link_auth.h). */
#include "common/comm/link_auth.h"

#include "common/base/file_read.h"
#include "common/base/log.h"
#include "common/comm/msg.h"

#include <zmq.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TW_AUTH_DOMAIN "twain"
#define TW_AUTH_MAX_WATCH 8

TW_NODISCARD tw_status_t tw_auth_keys_generate(tw_auth_keys_t *k) {
  memset(k, 0, sizeof *k);
  if (!zmq_has("curve"))
    return tw_err(TW_ERR_INTERNAL, "this libzmq has no CURVE support (built without libsodium)");
  if (zmq_curve_keypair(k->server_public, k->server_secret) != 0 ||
      zmq_curve_keypair(k->client_public, k->client_secret) != 0)
    return tw_err(TW_ERR_INTERNAL, "zmq_curve_keypair failed: %s", zmq_strerror(errno));
  return TW_OK;
}

int tw_auth_keys_format(const tw_auth_keys_t *k, char *buf, size_t n) {
  int w =
      snprintf(buf, n,
               "# twain link keys (CURVE, Z85): every process of one deployment holds the same "
               "set; keep it secret\n"
               "server-public = %s\nserver-secret = %s\nclient-public = %s\nclient-secret = %s\n",
               k->server_public, k->server_secret, k->client_public, k->client_secret);
  return w < 0 || (size_t)w >= n ? -1 : w;
}

static bool tw_auth_is_z85(const char *s, size_t n) {
  static const char z85[] =
      "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
  if (n != TW_AUTH_KEY_Z85 - 1) return false;
  for (size_t i = 0; i < n; i++)
    if (!s[i] || !strchr(z85, s[i])) return false;
  return true;
}

/* The next line of the text at *p as [*b, *e) without surrounding blanks;
 * false at the end of the text. Moves *p past the line. */
static bool tw_auth_line(const char **p, const char **b, const char **e) {
  if (!**p) return false;
  const char *eol = strchr(*p, '\n');
  size_t len = eol ? (size_t)(eol - *p) : strlen(*p);
  const char *lb = *p, *le = *p + len;
  *p = eol ? eol + 1 : *p + len;
  while (lb < le && (*lb == ' ' || *lb == '\t' || *lb == '\r')) lb++;
  while (le > lb && (le[-1] == ' ' || le[-1] == '\t' || le[-1] == '\r')) le--;
  *b = lb;
  *e = le;
  return true;
}

TW_NODISCARD tw_status_t tw_auth_keys_parse(const char *text, tw_auth_keys_t *k) {
  return tw_auth_keys_parse_need(text, TW_AUTH_ALL_KEYS, k);
}

TW_NODISCARD tw_status_t tw_auth_keys_parse_need(const char *text, unsigned need,
                                                 tw_auth_keys_t *k) {
  static const char *const names[4] = {"server-public", "server-secret", "client-public",
                                       "client-secret"};
  tw_auth_keys_t out = {0};
  char *dst[4] = {out.server_public, out.server_secret, out.client_public, out.client_secret};
  const char *p = text, *b, *e;
  for (int line = 1; tw_auth_line(&p, &b, &e); line++) {
    if (b == e || *b == '#') continue;
    const char *eq = memchr(b, '=', (size_t)(e - b));
    if (!eq) return tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: line %d is not 'name = key'", line);
    const char *ne = eq, *v = eq + 1;
    while (ne > b && (ne[-1] == ' ' || ne[-1] == '\t')) ne--;
    while (v < e && (*v == ' ' || *v == '\t')) v++;
    int which = -1;
    for (int i = 0; i < 4; i++)
      if ((size_t)(ne - b) == strlen(names[i]) && !memcmp(b, names[i], (size_t)(ne - b))) which = i;
    if (which < 0)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "link keys: line %d: unknown name (want %s, %s, %s or %s)", line, names[0],
                    names[1], names[2], names[3]);
    if (!tw_auth_is_z85(v, (size_t)(e - v)))
      return tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: %s is not 40 Z85 characters",
                    names[which]);
    memcpy(dst[which], v, TW_AUTH_KEY_Z85 - 1);
  }
  for (int i = 0; i < 4; i++)
    if ((need & (1u << i)) && !dst[i][0])
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "link keys: %s is missing (make a set with `twain keygen`)", names[i]);
  *k = out;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_keys_load_file(const char *path, tw_auth_keys_t *k) {
  return tw_auth_keys_load_file_need(path, TW_AUTH_ALL_KEYS, k);
}

TW_NODISCARD tw_status_t tw_auth_keys_load_file_need(const char *path, unsigned need,
                                                     tw_auth_keys_t *k) {
  /* a file holding a secret must be private; a public key alone may be read by all */
  struct stat st;
  bool shared = stat(path, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 077);
  if (shared && (need & (TW_AUTH_SERVER_SECRET | TW_AUTH_CLIENT_SECRET)))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "link keys: %s can be read or written by other users (mode %03o): chmod 600 it",
                  path, (unsigned)(st.st_mode & 0777));
  char *buf = NULL;
  size_t len = 0;
  TW_CHECK(tw_file_read(path, TW_AUTH_MAX_FILE, "link keys", &buf, &len));
  tw_status_t s = memchr(buf, '\0', len)
                      ? tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: %s is binary", path)
                      : tw_auth_keys_parse_need(buf, need, k);
  memset(buf, 0, len);
  free(buf);
  if (s == TW_OK && shared && (k->server_secret[0] || k->client_secret[0])) {
    memset(k, 0, sizeof *k);
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "link keys: %s holds a secret key and can be read or written by other users "
                  "(mode %03o): chmod 600 it",
                  path, (unsigned)(st.st_mode & 0777));
  }
  return s;
}

TW_NODISCARD tw_status_t tw_auth_keys_from_env(const char *what, tw_auth_keys_t *k) {
  memset(k, 0, sizeof *k);
  const char *inl = getenv(TW_AUTH_KEYS_ENV), *file = getenv(TW_AUTH_KEYS_FILE_ENV);
  const char *plain = getenv(TW_AUTH_PLAINTEXT_ENV);
  if (inl && *inl) return tw_auth_keys_parse(inl, k);
  if (file && *file) return tw_auth_keys_load_file(file, k);
  if (plain && !strcmp(plain, "1")) {
    k->plaintext = true;
    TW_WARN("auth",
            "%s: %s=1: NO encryption and NO authentication; anyone who can reach it can "
            "join and read prompts",
            what, TW_AUTH_PLAINTEXT_ENV);
    return TW_OK;
  }
  return tw_err(TW_ERR_INVALID_ARGUMENT,
                "%s: no link keys: set %s to a key file made by `twain keygen FILE` (or %s to its "
                "text); %s=1 runs without encryption or authentication",
                what, TW_AUTH_KEYS_FILE_ENV, TW_AUTH_KEYS_ENV, TW_AUTH_PLAINTEXT_ENV);
}

TW_NODISCARD tw_status_t tw_auth_keys_export(const tw_auth_keys_t *k, const char *env_name) {
  char text[512];
  if (tw_auth_keys_format(k, text, sizeof text) < 0 || setenv(env_name, text, 1) != 0)
    return tw_err(TW_ERR_INTERNAL, "cannot put the link keys into %s", env_name);
  memset(text, 0, sizeof text);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_socket_keys(const char *what, const char *maybe_file,
                                             tw_auth_keys_t *k) {
  memset(k, 0, sizeof *k);
  const unsigned need = TW_AUTH_SERVER_PUBLIC | TW_AUTH_SERVER_SECRET;
  const char *inl = getenv(TW_AUTH_CLIENT_KEYS_ENV), *file = getenv(TW_AUTH_CLIENT_KEYS_FILE_ENV);
  if (maybe_file && *maybe_file) return tw_auth_keys_load_file_need(maybe_file, need, k);
  if (inl && *inl) return tw_auth_keys_parse_need(inl, need, k);
  if (file && *file) return tw_auth_keys_load_file_need(file, need, k);
  k->plaintext = true;
  TW_WARN("auth",
          "%s: plaintext: requests and answers cross the network unencrypted "
          "(--client-keys FILE or %s turns on CURVE)",
          what, TW_AUTH_CLIENT_KEYS_FILE_ENV);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_client_keys(const char *server_key, const char *identity,
                                             tw_auth_keys_t *k) {
  memset(k, 0, sizeof *k);
  if (!server_key || !*server_key) server_key = getenv(TW_AUTH_SERVER_KEY_ENV);
  if (!identity || !*identity) identity = getenv(TW_AUTH_IDENTITY_ENV);
  if (!server_key || !*server_key) {
    if (identity && *identity)
      return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                          "a client key pair (--identity, %s) needs the router's public key too "
                          "(--server-key, %s)",
                          TW_AUTH_IDENTITY_ENV, TW_AUTH_SERVER_KEY_ENV);
    k->plaintext = true;
    return TW_OK;
  }
  tw_auth_keys_t id = {0};
  if (identity && *identity)
    TW_CHECK(
        tw_auth_keys_load_file_need(identity, TW_AUTH_CLIENT_PUBLIC | TW_AUTH_CLIENT_SECRET, &id));
  else if (!zmq_has("curve") || zmq_curve_keypair(id.client_public, id.client_secret) != 0)
    return tw_err_quiet(TW_ERR_INTERNAL,
                        "cannot make a CURVE key pair: this libzmq has no CURVE support");
  if (tw_auth_is_z85(server_key, strlen(server_key))) {
    memcpy(k->server_public, server_key, TW_AUTH_KEY_Z85 - 1);
  } else { /* a file with a server-public line */
    tw_auth_keys_t srv;
    tw_status_t st =
        access(server_key, F_OK) == 0
            ? tw_auth_keys_load_file_need(server_key, TW_AUTH_SERVER_PUBLIC, &srv)
            : tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                           "the server key is neither 40 Z85 characters nor an existing "
                           "key file");
    if (st != TW_OK) {
      memset(&id, 0, sizeof id);
      return st;
    }
    memcpy(k->server_public, srv.server_public, TW_AUTH_KEY_Z85);
    memset(&srv, 0, sizeof srv);
  }
  memcpy(k->client_public, id.client_public, TW_AUTH_KEY_Z85);
  memcpy(k->client_secret, id.client_secret, TW_AUTH_KEY_Z85);
  memset(&id, 0, sizeof id);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_auth_set(void *sock, int opt, const void *v, size_t n,
                                            const char *name) {
  if (zmq_setsockopt(sock, opt, v, n) != 0)
    return tw_err(TW_ERR_TRANSPORT, "cannot set %s: %s", name, zmq_strerror(errno));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_server(void *sock, const tw_auth_keys_t *k) {
  if (k->plaintext) return TW_OK;
  int one = 1;
  TW_CHECK(
      tw_auth_set(sock, ZMQ_ZAP_DOMAIN, TW_AUTH_DOMAIN, strlen(TW_AUTH_DOMAIN), "ZMQ_ZAP_DOMAIN"));
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_SERVER, &one, sizeof one, "ZMQ_CURVE_SERVER"));
  return tw_auth_set(sock, ZMQ_CURVE_SECRETKEY, k->server_secret, 40, "ZMQ_CURVE_SECRETKEY");
}

TW_NODISCARD tw_status_t tw_auth_client(void *sock, const tw_auth_keys_t *k) {
  if (k->plaintext) return TW_OK;
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_SERVERKEY, k->server_public, 40, "ZMQ_CURVE_SERVERKEY"));
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_PUBLICKEY, k->client_public, 40, "ZMQ_CURVE_PUBLICKEY"));
  return tw_auth_set(sock, ZMQ_CURVE_SECRETKEY, k->client_secret, 40, "ZMQ_CURVE_SECRETKEY");
}

/* ---- a client of the router's client socket ------------------------------------ */
/* (errors here are quiet: the client commands print them themselves) */

/* The next event of a socket monitor (its two frames read): the event
 * number, 0 for a message that is not one, or -1 when none is waiting
 * (flags ZMQ_DONTWAIT) or receiving failed. */
static int tw_monitor_event(void *mon, int flags) {
  zmq_msg_t ev, addr;
  zmq_msg_init(&ev);
  zmq_msg_init(&addr);
  int n = zmq_msg_recv(&ev, mon, flags), e = n < 0 ? -1 : 0;
  if (n >= 6 && zmq_msg_recv(&addr, mon, 0) >= 0) {
    uint16_t v;
    memcpy(&v, zmq_msg_data(&ev), sizeof v);
    e = v;
  }
  zmq_msg_close(&ev);
  zmq_msg_close(&addr);
  return e;
}

/* tw_auth_client_open; refused_fails: a refused connection (nothing
 * listens) ends the wait at once with TW_ERR_UNAVAILABLE instead of libzmq
 * retrying it until timeout_ms. */
static TW_NODISCARD tw_status_t tw_auth_client_open_ex(void *ctx, const char *endpoint,
                                                       const tw_auth_keys_t *k, int timeout_ms,
                                                       int hwm, bool refused_fails, void **sock_p) {
  *sock_p = NULL;
  void *s = zmq_socket(ctx, ZMQ_DEALER), *mon = NULL;
  if (!s) return tw_err_quiet(TW_ERR_TRANSPORT, "zmq_socket failed: %s", zmq_strerror(errno));
  int one = 1, zero = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(s, ZMQ_IMMEDIATE, &one, sizeof one); /* nothing queued before the handshake */
  zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
  if (hwm > 0) {
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
  }
  tw_msg_limit_size(s);
  tw_status_t st = tw_auth_client(s, k);
  /* the monitor tells a finished handshake from one the server ended */
  char ep[96];
  static atomic_uint serial;
  snprintf(ep, sizeof ep, "inproc://tw-client-mon-%p-%u", (void *)s, atomic_fetch_add(&serial, 1));
  if (st == TW_OK &&
      (zmq_socket_monitor(s, ep,
                          ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                              ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                              ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                              (refused_fails ? ZMQ_EVENT_CONNECT_RETRIED : 0)) != 0 ||
       !(mon = zmq_socket(ctx, ZMQ_PAIR)) || zmq_connect(mon, ep) != 0))
    st = tw_err_quiet(TW_ERR_TRANSPORT, "cannot watch the connection to %s: %s", endpoint,
                      zmq_strerror(errno));
  if (st == TW_OK && zmq_connect(s, endpoint) != 0)
    st = tw_err_quiet(TW_ERR_FORMAT, "cannot connect to %s: %s", endpoint, zmq_strerror(errno));
  int64_t end = tw_msg_clock_ns() + (int64_t)timeout_ms * 1000000;
  int failed = -1; /* the handshake event that ended the wait */
  while (st == TW_OK && failed < 0) {
    int64_t left = (end - tw_msg_clock_ns()) / 1000000;
    if (left <= 0) {
      st = tw_err_quiet(TW_ERR_UNAVAILABLE,
                        "no answer from %s within %d ms (is `twain serve` running?)", endpoint,
                        timeout_ms);
      break;
    }
    zmq_pollitem_t it = {.socket = mon, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, left) <= 0) continue;
    int e = tw_monitor_event(mon, 0);
    if (e == ZMQ_EVENT_CONNECT_RETRIED) { /* subscribed only with refused_fails */
      st = tw_err_quiet(TW_ERR_UNAVAILABLE, "nothing listens at %s", endpoint);
      break;
    }
    if (e > 0) failed = e == ZMQ_EVENT_HANDSHAKE_SUCCEEDED ? 0 : e;
  }
  if (st == TW_OK && failed == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
    st = tw_err_quiet(
        TW_ERR_INVALID_ARGUMENT,
        "the router at %s refused this client's key: it is not on the router's allow-list "
        "(--identity / %s gives a registered key pair)",
        endpoint, TW_AUTH_IDENTITY_ENV);
  else if (st == TW_OK && failed > 0 && k->plaintext)
    st = tw_err_quiet(
        TW_ERR_INVALID_ARGUMENT,
        "the router at %s ended the connection in the handshake: it requires CURVE; give "
        "its public key (--server-key KEY, or %s)",
        endpoint, TW_AUTH_SERVER_KEY_ENV);
  else if (st == TW_OK && failed > 0)
    st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                      "the CURVE handshake with the router at %s failed: the server key is not the "
                      "router's, or its client socket does not use CURVE",
                      endpoint);
  if (mon) {
    zmq_socket_monitor(s, NULL, 0);
    zmq_close(mon);
  }
  if (st != TW_OK) {
    zmq_close(s);
    return st;
  }
  *sock_p = s;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_client_open(void *ctx, const char *endpoint,
                                             const tw_auth_keys_t *k, int timeout_ms, int hwm,
                                             void **sock_p) {
  return tw_auth_client_open_ex(ctx, endpoint, k, timeout_ms, hwm, false, sock_p);
}

TW_NODISCARD tw_status_t tw_auth_client_probe(void *ctx, const char *endpoint,
                                              const tw_auth_keys_t *k, int timeout_ms) {
  void *s = NULL;
  tw_status_t st = tw_auth_client_open_ex(ctx, endpoint, k, timeout_ms, 0, true, &s);
  if (s) zmq_close(s);
  return st;
}

void *tw_auth_client_watch(void *ctx, void *sock) {
  static atomic_uint serial;
  char ep[96];
  snprintf(ep, sizeof ep, "inproc://tw-client-lost-%p-%u", sock, atomic_fetch_add(&serial, 1));
  if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_DISCONNECTED) != 0) return NULL;
  void *mon = zmq_socket(ctx, ZMQ_PAIR);
  if (!mon || zmq_connect(mon, ep) != 0) {
    if (mon) zmq_close(mon);
    zmq_socket_monitor(sock, NULL, 0);
    return NULL;
  }
  return mon;
}

bool tw_auth_client_lost(void *watch) {
  bool lost = false;
  for (int e; watch && (e = tw_monitor_event(watch, ZMQ_DONTWAIT)) >= 0;)
    lost |= e == ZMQ_EVENT_DISCONNECTED;
  return lost;
}

void tw_auth_client_unwatch(void *sock, void *watch) {
  if (!watch) return;
  zmq_socket_monitor(sock, NULL, 0);
  zmq_close(watch);
}

/* ---- the guard thread ---------------------------------------------------------- */

struct tw_auth_guard {
  void *zctx;
  tw_auth_keys_t keys;
  uint8_t (*allow)[32]; /* binary client public keys accepted (internal links: the
                           * key set's one; client socket: an allow-list) */
  size_t n_allow;
  bool clients; /* the client socket's guard: no list = every key */
  char what[64];
  void *zap;          /* REP on inproc://zeromq.zap.01 (guard thread) */
  pthread_mutex_t mu; /* watch list handover */
  void *mon[TW_AUTH_MAX_WATCH];
  char label[TW_AUTH_MAX_WATCH][48];
  int n_mon;
  pthread_t th;
  bool started;
  atomic_int stop;
  atomic_ullong refused;
  tw_msg_ratelimit_t rl;
};

static void tw_auth_guard_log(tw_auth_guard_t *g, const char *fmt, const char *a, const char *b) {
  uint64_t sup = 0;
  if (!tw_msg_ratelimit(&g->rl, &sup)) return;
  if (sup)
    TW_WARN("auth", "%s: suppressed %llu similar warnings", g->what, (unsigned long long)sup);
  char line[512];
  snprintf(line, sizeof line, fmt, a, b);
  TW_WARN("auth", "%s: %s", g->what, line);
}

/* One ZAP request (RFC 27): version, request id, domain, address, identity,
 * mechanism, credentials...; the reply: version, request id, status code,
 * status text, user id, metadata. */
static void tw_auth_zap_one(tw_auth_guard_t *g) {
  zmq_msg_t f[8];
  int n = 0, more = 1;
  while (more && n < 8) {
    zmq_msg_init(&f[n]);
    if (zmq_msg_recv(&f[n], g->zap, 0) < 0) {
      zmq_msg_close(&f[n]);
      break;
    }
    more = zmq_msg_more(&f[n]);
    n++;
  }
  while (more) { /* more frames than any mechanism sends: drain */
    zmq_msg_t x;
    zmq_msg_init(&x);
    if (zmq_msg_recv(&x, g->zap, 0) < 0)
      more = 0;
    else
      more = zmq_msg_more(&x);
    zmq_msg_close(&x);
  }
  char addr[64] = "?", mech[16] = "?", key[TW_AUTH_KEY_Z85] = "";
  bool ok = false;
  if (n >= 6) {
    snprintf(addr, sizeof addr, "%.*s", (int)(zmq_msg_size(&f[3]) < 63 ? zmq_msg_size(&f[3]) : 63),
             (const char *)zmq_msg_data(&f[3]));
    snprintf(mech, sizeof mech, "%.*s", (int)(zmq_msg_size(&f[5]) < 15 ? zmq_msg_size(&f[5]) : 15),
             (const char *)zmq_msg_data(&f[5]));
    bool curve = !strcmp(mech, "CURVE") && n >= 7 && zmq_msg_size(&f[6]) == 32;
    ok = curve && g->clients && !g->allow;
    for (size_t i = 0; curve && !ok && i < g->n_allow; i++)
      ok = !memcmp(zmq_msg_data(&f[6]), g->allow[i], 32);
    if (curve && !ok && g->clients) zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
  }
  if (n >= 2) {
    const char *code = ok ? "200" : "400", *text = ok ? "OK" : "unknown key";
    zmq_send(g->zap, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(g->zap, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
    zmq_send(g->zap, code, 3, ZMQ_SNDMORE);
    zmq_send(g->zap, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(g->zap, "", 0, ZMQ_SNDMORE);
    zmq_send(g->zap, "", 0, 0);
  }
  for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
  if (!ok) {
    atomic_fetch_add(&g->refused, 1);
    if (key[0])
      tw_auth_guard_log(g, "refused a client from %s: its key %s is not on the allow-list", addr,
                        key);
    else
      tw_auth_guard_log(g,
                        "refused a peer from %s: mechanism %s without the deployment's client key",
                        addr, mech);
  }
}

static void tw_auth_mon_one(tw_auth_guard_t *g, int i) {
  zmq_msg_t ev, addr;
  zmq_msg_init(&ev);
  zmq_msg_init(&addr);
  int got = zmq_msg_recv(&ev, g->mon[i], 0) >= 6 && zmq_msg_recv(&addr, g->mon[i], 0) >= 0;
  if (got) {
    uint16_t event;
    memcpy(&event, zmq_msg_data(&ev), sizeof event);
    char a[128];
    snprintf(a, sizeof a, "%.*s", (int)(zmq_msg_size(&addr) < 127 ? zmq_msg_size(&addr) : 127),
             (const char *)zmq_msg_data(&addr));
    bool server = !g->keys.plaintext && g->zap;
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && !server) {
      tw_auth_guard_log(g, "%s: the server at %s refused our key (are the link keys the same?)",
                        g->label[i], a);
    } else if (event != ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) { /* AUTH on a server: logged by ZAP */
      if (server) atomic_fetch_add(&g->refused, 1);
      tw_auth_guard_log(g, "%s: handshake with %s failed (plaintext or wrong keys on one side)",
                        g->label[i], a);
    }
  }
  zmq_msg_close(&ev);
  zmq_msg_close(&addr);
}

static void *tw_auth_guard_main(void *arg) {
  tw_auth_guard_t *g = arg;
  while (!atomic_load(&g->stop)) {
    zmq_pollitem_t it[1 + TW_AUTH_MAX_WATCH];
    int n = 0;
    if (g->zap) it[n++] = (zmq_pollitem_t){.socket = g->zap, .events = ZMQ_POLLIN};
    pthread_mutex_lock(&g->mu);
    int nm = g->n_mon;
    for (int i = 0; i < nm; i++)
      it[n++] = (zmq_pollitem_t){.socket = g->mon[i], .events = ZMQ_POLLIN};
    pthread_mutex_unlock(&g->mu);
    if (n == 0) {
      usleep(50000);
      continue;
    }
    if (zmq_poll(it, n, 50) <= 0) continue;
    int k = 0;
    if (g->zap && (it[k++].revents & ZMQ_POLLIN)) tw_auth_zap_one(g);
    for (int i = 0; i < nm; i++, k++)
      if (it[k].revents & ZMQ_POLLIN) tw_auth_mon_one(g, i);
  }
  if (g->zap) zmq_close(g->zap);
  g->zap = NULL;
  return NULL;
}

/* Start a guard whose ZAP handler (serve_zap, keys not plaintext) admits the
 * CURVE keys of allow[n_allow] (taken over, freed with the guard; NULL with
 * `clients`: every key). */
static TW_NODISCARD tw_status_t tw_auth_guard_new(void *zctx, const tw_auth_keys_t *keys,
                                                  const char *what, bool serve_zap, bool clients,
                                                  uint8_t (*allow)[32], size_t n_allow,
                                                  tw_auth_guard_t **guard_p) {
  *guard_p = NULL;
  tw_auth_guard_t *g = calloc(1, sizeof *g);
  if (!g) {
    free(allow);
    return tw_err(TW_ERR_NO_MEMORY, "auth: out of memory");
  }
  g->zctx = zctx;
  g->keys = *keys;
  g->clients = clients;
  g->allow = allow;
  g->n_allow = n_allow;
  snprintf(g->what, sizeof g->what, "%s", what);
  pthread_mutex_init(&g->mu, NULL);
  if (serve_zap && !keys->plaintext) {
    g->zap = zmq_socket(zctx, ZMQ_REP);
    int zero = 0;
    if (g->zap) zmq_setsockopt(g->zap, ZMQ_LINGER, &zero, sizeof zero);
    if (!g->zap || zmq_bind(g->zap, "inproc://zeromq.zap.01") != 0) {
      int e = errno;
      if (g->zap) zmq_close(g->zap);
      g->zap = NULL;
      tw_auth_guard_stop(g);
      return tw_err(TW_ERR_TRANSPORT, "auth: cannot start the ZAP handler: %s", zmq_strerror(e));
    }
  }
  if (keys->plaintext) { /* nothing to answer or watch: no thread */
    *guard_p = g;
    return TW_OK;
  }
  if (pthread_create(&g->th, NULL, tw_auth_guard_main, g) != 0) {
    if (g->zap) zmq_close(g->zap);
    tw_auth_guard_stop(g);
    return tw_err(TW_ERR_INTERNAL, "auth: cannot start the guard thread");
  }
  g->started = true;
  *guard_p = g;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_guard_start(void *zctx, const tw_auth_keys_t *keys,
                                             const char *what, bool serve_zap,
                                             tw_auth_guard_t **guard_p) {
  *guard_p = NULL;
  uint8_t(*allow)[32] = NULL;
  if (serve_zap && !keys->plaintext) { /* the deployment's client key, the only one admitted */
    allow = malloc(sizeof *allow);
    if (!allow) return tw_err(TW_ERR_NO_MEMORY, "auth: out of memory");
    if (!zmq_z85_decode(allow[0], keys->client_public)) {
      free(allow);
      return tw_err(TW_ERR_INVALID_ARGUMENT, "auth: client-public is not a Z85 key");
    }
  }
  return tw_auth_guard_new(zctx, keys, what, serve_zap, false, allow, allow ? 1 : 0, guard_p);
}

/* Parse an allow-list (tw_auth_guard_start_clients) into *allow_p[*n_p]. */
static TW_NODISCARD tw_status_t tw_auth_allow_parse(const char *path, const char *text,
                                                    uint8_t (**allow_p)[32], size_t *n_p) {
  size_t cap = 1;
  for (const char *c = text; *c; c++) cap += *c == '\n';
  uint8_t(*allow)[32] = malloc(sizeof *allow * cap);
  if (!allow) return tw_err(TW_ERR_NO_MEMORY, "auth: out of memory");
  size_t n = 0;
  const char *p = text, *b, *e;
  for (int line = 1; tw_auth_line(&p, &b, &e); line++) {
    if (b == e || *b == '#') continue;
    static const char pre[] = "client-public";
    if ((size_t)(e - b) > sizeof pre - 1 &&
        !memcmp(b, pre, sizeof pre - 1)) { /* "client-public = KEY" */
      b += sizeof pre - 1;
      while (b < e && (*b == ' ' || *b == '\t')) b++;
      if (b < e && *b == '=') b++;
      while (b < e && (*b == ' ' || *b == '\t')) b++;
    }
    const char *k = b;
    while (k < e && *k != ' ' && *k != '\t') k++;
    char z[TW_AUTH_KEY_Z85] = "";
    if ((size_t)(k - b) == TW_AUTH_KEY_Z85 - 1) memcpy(z, b, TW_AUTH_KEY_Z85 - 1);
    if (!tw_auth_is_z85(b, (size_t)(k - b)) || !zmq_z85_decode(allow[n], z)) {
      free(allow);
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "client allow-list %s: line %d is not a client public key (40 Z85 "
                    "characters, or client-public = KEY)",
                    path, line);
    }
    n++;
  }
  if (n == 0) {
    free(allow);
    return tw_err(TW_ERR_INVALID_ARGUMENT, "client allow-list %s: no key in it", path);
  }
  *allow_p = allow;
  *n_p = n;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_guard_start_clients(void *zctx, const tw_auth_keys_t *keys,
                                                     const char *what, const char *allow_file,
                                                     tw_auth_guard_t **guard_p) {
  *guard_p = NULL;
  uint8_t(*allow)[32] = NULL;
  size_t n = 0;
  if (allow_file && *allow_file) {
    if (keys->plaintext)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "%s: a client allow-list (%s) needs CURVE on the socket (--client-keys)", what,
                    allow_file);
    char *buf = NULL;
    size_t len = 0;
    TW_CHECK(tw_file_read(allow_file, TW_AUTH_MAX_ALLOW_FILE, "client allow-list", &buf, &len));
    tw_status_t st = memchr(buf, '\0', len) ? tw_err(TW_ERR_INVALID_ARGUMENT,
                                                     "client allow-list %s is binary", allow_file)
                                            : tw_auth_allow_parse(allow_file, buf, &allow, &n);
    free(buf);
    TW_CHECK(st);
  }
  TW_CHECK(tw_auth_guard_new(zctx, keys, what, true, true, allow, n, guard_p));
  if (n)
    TW_INFO("auth", "%s: CURVE; admitted: the %zu client keys of %s", what, n, allow_file);
  else if (!keys->plaintext)
    TW_INFO("auth", "%s: CURVE; admitted: any client key (no allow-list)", what);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_guard_watch(tw_auth_guard_t *g, void *sock, const char *label) {
  if (g->keys.plaintext) return TW_OK;
  pthread_mutex_lock(&g->mu);
  int i = g->n_mon;
  pthread_mutex_unlock(&g->mu);
  if (i >= TW_AUTH_MAX_WATCH)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "auth: more than %d watched sockets", TW_AUTH_MAX_WATCH);
  char ep[96];
  snprintf(ep, sizeof ep, "inproc://tw-auth-mon-%p-%d", (void *)g, i);
  int events = ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
  if (zmq_socket_monitor(sock, ep, events) != 0)
    return tw_err(TW_ERR_TRANSPORT, "auth: zmq_socket_monitor: %s", zmq_strerror(errno));
  void *m = zmq_socket(g->zctx, ZMQ_PAIR);
  if (!m || zmq_connect(m, ep) != 0) {
    int e = errno;
    if (m) zmq_close(m);
    return tw_err(TW_ERR_TRANSPORT, "auth: cannot watch %s: %s", label, zmq_strerror(e));
  }
  int zero = 0;
  zmq_setsockopt(m, ZMQ_LINGER, &zero, sizeof zero);
  pthread_mutex_lock(&g->mu); /* the mutex hands the socket over to the guard thread */
  snprintf(g->label[i], sizeof g->label[i], "%s", label);
  g->mon[i] = m;
  g->n_mon = i + 1;
  pthread_mutex_unlock(&g->mu);
  return TW_OK;
}

uint64_t tw_auth_guard_refused(const tw_auth_guard_t *g) {
  return g ? atomic_load(&((tw_auth_guard_t *)g)->refused) : 0;
}

void tw_auth_guard_stop(tw_auth_guard_t *g) {
  if (!g) return;
  if (g->started) {
    atomic_store(&g->stop, 1);
    pthread_join(g->th, NULL);
  }
  for (int i = 0; i < g->n_mon; i++) zmq_close(g->mon[i]);
  pthread_mutex_destroy(&g->mu);
  free(g->allow);
  memset(&g->keys, 0, sizeof g->keys);
  free(g);
}
