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
  int w = snprintf(buf, n,
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

TW_NODISCARD tw_status_t tw_auth_keys_parse(const char *text, tw_auth_keys_t *k) {
  static const char *const names[4] = {"server-public", "server-secret", "client-public",
                                       "client-secret"};
  tw_auth_keys_t out = {0};
  char *dst[4] = {out.server_public, out.server_secret, out.client_public, out.client_secret};
  const char *p = text;
  int line = 0;
  while (*p) {
    line++;
    const char *eol = strchr(p, '\n');
    size_t len = eol ? (size_t)(eol - p) : strlen(p);
    const char *b = p, *e = p + len;
    p = eol ? eol + 1 : p + len;
    while (b < e && (*b == ' ' || *b == '\t' || *b == '\r')) b++;
    while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) e--;
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
      return tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: line %d: unknown name (want %s, %s, %s or %s)",
                    line, names[0], names[1], names[2], names[3]);
    if (!tw_auth_is_z85(v, (size_t)(e - v)))
      return tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: %s is not 40 Z85 characters", names[which]);
    memcpy(dst[which], v, TW_AUTH_KEY_Z85 - 1);
  }
  for (int i = 0; i < 4; i++)
    if (!dst[i][0])
      return tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: %s is missing (make a set with `twain keygen`)",
                    names[i]);
  *k = out;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_keys_load_file(const char *path, tw_auth_keys_t *k) {
  struct stat st;
  if (stat(path, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 077))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "link keys: %s can be read or written by other users (mode %03o): chmod 600 it",
                  path, (unsigned)(st.st_mode & 0777));
  char *buf = NULL;
  size_t len = 0;
  TW_CHECK(tw_file_read(path, TW_AUTH_MAX_FILE, "link keys", &buf, &len));
  tw_status_t s = memchr(buf, '\0', len) ? tw_err(TW_ERR_INVALID_ARGUMENT, "link keys: %s is binary", path)
                                          : tw_auth_keys_parse(buf, k);
  memset(buf, 0, len);
  free(buf);
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
    TW_WARN("auth", "%s: %s=1: NO encryption and NO authentication; anyone who can reach it can "
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

static TW_NODISCARD tw_status_t tw_auth_set(void *sock, int opt, const void *v, size_t n,
                                            const char *name) {
  if (zmq_setsockopt(sock, opt, v, n) != 0)
    return tw_err(TW_ERR_TRANSPORT, "cannot set %s: %s", name, zmq_strerror(errno));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_auth_server(void *sock, const tw_auth_keys_t *k) {
  if (k->plaintext) return TW_OK;
  int one = 1;
  TW_CHECK(tw_auth_set(sock, ZMQ_ZAP_DOMAIN, TW_AUTH_DOMAIN, strlen(TW_AUTH_DOMAIN), "ZMQ_ZAP_DOMAIN"));
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_SERVER, &one, sizeof one, "ZMQ_CURVE_SERVER"));
  return tw_auth_set(sock, ZMQ_CURVE_SECRETKEY, k->server_secret, 40, "ZMQ_CURVE_SECRETKEY");
}

TW_NODISCARD tw_status_t tw_auth_client(void *sock, const tw_auth_keys_t *k) {
  if (k->plaintext) return TW_OK;
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_SERVERKEY, k->server_public, 40, "ZMQ_CURVE_SERVERKEY"));
  TW_CHECK(tw_auth_set(sock, ZMQ_CURVE_PUBLICKEY, k->client_public, 40, "ZMQ_CURVE_PUBLICKEY"));
  return tw_auth_set(sock, ZMQ_CURVE_SECRETKEY, k->client_secret, 40, "ZMQ_CURVE_SECRETKEY");
}

/* ---- the guard thread ---------------------------------------------------------- */

struct tw_auth_guard {
  void *zctx;
  tw_auth_keys_t keys;
  uint8_t client_key[32]; /* binary client public key: the only one accepted */
  char what[64];
  void *zap;              /* REP on inproc://zeromq.zap.01 (guard thread) */
  pthread_mutex_t mu;     /* watch list handover */
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
  if (sup) TW_WARN("auth", "%s: suppressed %llu similar warnings", g->what, (unsigned long long)sup);
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
    if (zmq_msg_recv(&x, g->zap, 0) < 0) more = 0;
    else more = zmq_msg_more(&x);
    zmq_msg_close(&x);
  }
  char addr[64] = "?", mech[16] = "?";
  bool ok = false;
  if (n >= 6) {
    snprintf(addr, sizeof addr, "%.*s", (int)(zmq_msg_size(&f[3]) < 63 ? zmq_msg_size(&f[3]) : 63),
             (const char *)zmq_msg_data(&f[3]));
    snprintf(mech, sizeof mech, "%.*s", (int)(zmq_msg_size(&f[5]) < 15 ? zmq_msg_size(&f[5]) : 15),
             (const char *)zmq_msg_data(&f[5]));
    ok = !strcmp(mech, "CURVE") && n >= 7 && zmq_msg_size(&f[6]) == 32 &&
         !memcmp(zmq_msg_data(&f[6]), g->client_key, 32);
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
    tw_auth_guard_log(g, "refused a peer from %s: mechanism %s without the deployment's client key",
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
    for (int i = 0; i < nm; i++) it[n++] = (zmq_pollitem_t){.socket = g->mon[i], .events = ZMQ_POLLIN};
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

TW_NODISCARD tw_status_t tw_auth_guard_start(void *zctx, const tw_auth_keys_t *keys,
                                             const char *what, bool serve_zap,
                                             tw_auth_guard_t **guard_p) {
  *guard_p = NULL;
  tw_auth_guard_t *g = calloc(1, sizeof *g);
  if (!g) return tw_err(TW_ERR_NO_MEMORY, "auth: out of memory");
  g->zctx = zctx;
  g->keys = *keys;
  snprintf(g->what, sizeof g->what, "%s", what);
  pthread_mutex_init(&g->mu, NULL);
  if (serve_zap && !keys->plaintext) {
    if (!zmq_z85_decode(g->client_key, keys->client_public)) {
      free(g);
      return tw_err(TW_ERR_INVALID_ARGUMENT, "auth: client-public is not a Z85 key");
    }
    g->zap = zmq_socket(zctx, ZMQ_REP);
    int zero = 0;
    if (g->zap) zmq_setsockopt(g->zap, ZMQ_LINGER, &zero, sizeof zero);
    if (!g->zap || zmq_bind(g->zap, "inproc://zeromq.zap.01") != 0) {
      int e = errno;
      if (g->zap) zmq_close(g->zap);
      free(g);
      return tw_err(TW_ERR_TRANSPORT, "auth: cannot start the ZAP handler: %s", zmq_strerror(e));
    }
  }
  if (pthread_create(&g->th, NULL, tw_auth_guard_main, g) != 0) {
    if (g->zap) zmq_close(g->zap);
    free(g);
    return tw_err(TW_ERR_INTERNAL, "auth: cannot start the guard thread");
  }
  g->started = true;
  *guard_p = g;
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
  memset(&g->keys, 0, sizeof g->keys);
  free(g);
}
