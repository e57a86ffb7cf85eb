/* dist.c: rank identity, `--tp N` spawning, the rank-0 control link and the
 * liveness watchdog of a multi-rank worker (see dist.h). */
#include "common/comm/dist.h"

#include "common/base/log.h"
#include "common/base/proc.h"
#include "common/comm/link_auth.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define TW_DIST_MAGIC 0x74646973u /* "tdis" */
#define TW_DIST_JOIN_MS 60000
#define TW_DIST_MAX_RANKS 64

enum { TW_DIST_MSG_HELLO = 1, TW_DIST_MSG_UID = 2 };

struct tw_dist {
  uint32_t magic;
  tw_dist_identity_t id;
  tw_coll_t *coll;
  void *zctx;
  void *ctrl;          /* rank 0: ROUTER; others: DEALER (main thread) */
  void *hb;            /* the watchdog's socket (watchdog thread) */
  pthread_t wd;
  bool wd_started;
  atomic_int wd_stop;
  tw_dist_lost_fn on_lost;
  int lost_ms;
  char mon_ep[64];     /* inproc endpoint of the hb socket's monitor */
  tw_auth_keys_t keys; /* CURVE: rank 0 serves, the other ranks are clients */
  tw_auth_guard_t *guard;
  /* rank 0: each rank's process from its hello; local[r]: on this host and
   * in this pid namespace (its death is seen in /proc, tw_proc_alive) */
  tw_proc_t rank_proc[TW_DIST_MAX_RANKS];
  bool local[TW_DIST_MAX_RANKS];
};

/* The hello a rank sends rank 0 over the control link. */
typedef struct {
  uint32_t type; /* TW_DIST_MSG_HELLO */
  uint32_t rank;
  tw_proc_t proc;
} tw_dist_hello_t;

/* The group's link keys: TWAIN_DIST_KEYS (a throwaway set tw_dist_spawn made
 * for the ranks it starts), else the deployment's (link_auth.h). */
static TW_NODISCARD tw_status_t tw_dist_keys(tw_auth_keys_t *k) {
  const char *t = getenv(TW_DIST_KEYS_ENV);
  if (t && *t) return tw_auth_keys_parse(t, k);
  return tw_auth_keys_from_env("worker rank links", k);
}

static int64_t tw_dist_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- identity ------------------------------------------------------------- */

static TW_NODISCARD tw_status_t tw_dist_env_int(const char *name, int32_t *out, bool *found) {
  const char *s = getenv(name);
  *found = s && *s;
  if (!*found) return TW_OK;
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 0 || v > 1 << 20)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: %s='%s' is not a rank number", name, s);
  *out = (int32_t)v;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_dist_identity_from_env(tw_dist_identity_t *id_p) {
  static const char *const names[3][3] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
  static const tw_dist_launch_t kinds[3] = {TW_DIST_LAUNCH_MPI, TW_DIST_LAUNCH_ENV,
                                            TW_DIST_LAUNCH_SLURM};
  tw_dist_identity_t id = {.launch = TW_DIST_LAUNCH_NONE, .rank = 0, .size = 1, .local_rank = 0};
  for (int k = 0; k < 3; k++) {
    int32_t r = 0, s = 1, l = 0;
    bool fr, fs, fl;
    TW_CHECK(tw_dist_env_int(names[k][0], &r, &fr));
    TW_CHECK(tw_dist_env_int(names[k][1], &s, &fs));
    TW_CHECK(tw_dist_env_int(names[k][2], &l, &fl));
    if (!fr || !fs) continue;
    if (s < 1 || r >= s)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: %s=%d outside [0, %s=%d)", names[k][0], r,
                    names[k][1], s);
    id = (tw_dist_identity_t){.launch = kinds[k], .rank = r, .size = s, .local_rank = fl ? l : r};
    break;
  }
  const char *rv = getenv("TWAIN_RENDEZVOUS");
  const char *ma = getenv("MASTER_ADDR"), *mp = getenv("MASTER_PORT");
  if (rv && *rv) {
    snprintf(id.rendezvous, sizeof id.rendezvous, "%s", rv);
  } else if (ma && *ma && mp && *mp) {
    snprintf(id.rendezvous, sizeof id.rendezvous, "tcp://%s:%s", ma, mp);
  }
  if (id.size > 1 && id.launch != TW_DIST_LAUNCH_MPI && !id.rendezvous[0])
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "dist: rank %d of %d has no rendezvous: set TWAIN_RENDEZVOUS=tcp://HOST:PORT or "
                  "MASTER_ADDR and MASTER_PORT",
                  id.rank, id.size);
  *id_p = id;
  return TW_OK;
}

/* ---- spawning ----------------------------------------------------------------- */

static volatile sig_atomic_t tw_dist_sup_signal_g; /* supervisor: last SIGTERM/SIGINT */

static void tw_dist_sup_on_signal(int sig) { tw_dist_sup_signal_g = sig; }

/* In a rank: SIGUSR1 (what mpirun forwards from the supervisor) means SIGTERM. */
static void tw_dist_on_usr1(int sig) {
  (void)sig;
  raise(SIGTERM);
}

/* The supervisor of an mpirun-started group: the process the operator (or a
 * test) holds. SIGTERM/SIGINT become SIGUSR1 for mpirun, which forwards it to
 * every rank (rank 0 drains and stops the others); a second one is passed on
 * as SIGTERM. Returns the exit status of mpirun. */
static int tw_dist_supervise(pid_t child) {
  struct sigaction sa = {0};
  sa.sa_handler = tw_dist_sup_on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  int forwarded = 0;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(child, &status, 0);
    if (r == child) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    }
    if (r < 0 && errno != EINTR) return 1;
    if (tw_dist_sup_signal_g) {
      tw_dist_sup_signal_g = 0;
      kill(child, forwarded++ ? SIGTERM : SIGUSR1);
    }
  }
}

TW_NODISCARD tw_status_t tw_dist_spawn(int argc, char **argv, int32_t n, int use_mpi,
                                       tw_dist_identity_t *id_p, int *supervised_rc_p) {
  *supervised_rc_p = -1;
  if (n < 1 || n > TW_DIST_MAX_RANKS)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: --tp %d outside [1, %d]", n, TW_DIST_MAX_RANKS);
  setenv("NCCL_NVLS_ENABLE", "0", 0); /* lent machines: NVLink multicast stays off */
  const char *dk = getenv(TW_DIST_KEYS_ENV);
  if (!dk || !*dk) { /* ranks of this host only: a set nobody else ever sees */
    tw_auth_keys_t k;
    TW_CHECK(tw_auth_keys_generate(&k));
    tw_status_t ks = tw_auth_keys_export(&k, TW_DIST_KEYS_ENV);
    memset(&k, 0, sizeof k);
    TW_CHECK(ks);
  }
  if (use_mpi) {
    char np[16];
    snprintf(np, sizeof np, "%d", n);
    char **av = calloc((size_t)argc + 12, sizeof(char *));
    if (!av) return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory");
    int k = 0;
    const char *mpirun = getenv("TWAIN_MPIRUN");
    av[k++] = (char *)(mpirun && *mpirun ? mpirun : "mpirun");
    av[k++] = "--oversubscribe";
    if (geteuid() == 0) av[k++] = "--allow-run-as-root";
    av[k++] = "--bind-to";
    av[k++] = "none";
    av[k++] = "-np";
    av[k++] = np;
    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl > 0) self[sl] = '\0';
    av[k++] = sl > 0 ? self : argv[0];
    for (int i = 1; i < argc; i++) av[k++] = argv[i];
    av[k] = NULL;
    TW_INFO("dist", "starting %d ranks under %s", n, av[0]);
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0) {
      int e = errno;
      free(av);
      return tw_err(TW_ERR_IO, "dist: fork for mpirun: %s", strerror(e));
    }
    if (child == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM); /* the supervisor gone: mpirun ends the job */
      if (getppid() != parent) _exit(1);
      execvp(av[0], av);
      _exit(127);
    }
    free(av);
    *supervised_rc_p = tw_dist_supervise(child);
    return TW_OK;
  }
  /* our own spawner: rank 0 is this process; the rendezvous is a port the
   * kernel just gave out on 127.0.0.1 unless TWAIN_RENDEZVOUS is set */
  char rv[256];
  const char *env_rv = getenv("TWAIN_RENDEZVOUS");
  if (env_rv && *env_rv) {
    snprintf(rv, sizeof rv, "%s", env_rv);
  } else {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0) {
      int e = errno;
      if (fd >= 0) close(fd);
      return tw_err(TW_ERR_IO, "dist: cannot find a free port for the rendezvous: %s", strerror(e));
    }
    close(fd);
    snprintf(rv, sizeof rv, "tcp://127.0.0.1:%d", (int)ntohs(sa.sin_port));
  }
  char self[4096];
  ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sl <= 0) return tw_err(TW_ERR_IO, "dist: readlink /proc/self/exe: %s", strerror(errno));
  self[sl] = '\0';
  pid_t parent = getpid();
  for (int32_t r = 1; r < n; r++) {
    pid_t pid = fork();
    if (pid < 0) return tw_err(TW_ERR_IO, "dist: fork of rank %d: %s", r, strerror(errno));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL); /* a rank never outlives rank 0 */
      if (getppid() != parent) _exit(1);
      char b[16];
      snprintf(b, sizeof b, "%d", r);
      setenv("RANK", b, 1);
      setenv("LOCAL_RANK", b, 1);
      snprintf(b, sizeof b, "%d", n);
      setenv("WORLD_SIZE", b, 1);
      setenv("TWAIN_RENDEZVOUS", rv, 1);
      execv(self, argv);
      _exit(127);
    }
  }
  setenv("RANK", "0", 1);
  setenv("LOCAL_RANK", "0", 1);
  char b[16];
  snprintf(b, sizeof b, "%d", n);
  setenv("WORLD_SIZE", b, 1);
  *id_p = (tw_dist_identity_t){.launch = TW_DIST_LAUNCH_ENV, .rank = 0, .size = n};
  snprintf(id_p->rendezvous, sizeof id_p->rendezvous, "%s", rv);
  return TW_OK;
}

/* ---- sockets ---------------------------------------------------------------------- */

static void *tw_dist_socket(tw_dist_t *d, int type, int rank) {
  void *s = zmq_socket(d->zctx, type);
  if (!s) return NULL;
  int zero = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
  if ((type == ZMQ_ROUTER ? tw_auth_server(s, &d->keys) : tw_auth_client(s, &d->keys)) != TW_OK) {
    zmq_close(s);
    return NULL;
  }
  if (type == ZMQ_DEALER) {
    char rid[16];
    snprintf(rid, sizeof rid, "r%d", rank);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, rid, strlen(rid));
  }
  return s;
}

/* tcp://HOST:PORT -> bind on every interface at PORT+delta, connect to HOST:PORT+delta */
static TW_NODISCARD tw_status_t tw_dist_endpoints(const char *rv, int delta, char *bind, char *conn,
                                                  size_t n) {
  const char *colon = strrchr(rv, ':');
  if (strncmp(rv, "tcp://", 6) != 0 || !colon || colon < rv + 6)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: rendezvous '%s' is not tcp://HOST:PORT", rv);
  int port = atoi(colon + 1);
  if (port <= 0 || port + delta > 65535)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: rendezvous '%s': bad port", rv);
  /* a loopback rendezvous (one node, tests) binds loopback only, else every interface */
  bool loop = strncmp(rv + 6, "127.", 4) == 0 || strncmp(rv + 6, "localhost:", 10) == 0;
  snprintf(bind, n, "tcp://%s:%d", loop ? "127.0.0.1" : "*", port + delta);
  snprintf(conn, n, "%.*s:%d", (int)(colon - rv), rv, port + delta);
  return TW_OK;
}

/* Rank 0: ROUTER bound to `bind` ("" = 127.0.0.1 ephemeral); the address to
 * connect to is written to conn. */
static TW_NODISCARD tw_status_t tw_dist_bind(tw_dist_t *d, const char *bind, void **sock_p,
                                             char *conn, size_t n) {
  void *s = tw_dist_socket(d, ZMQ_ROUTER, 0);
  if (!s) return tw_err(TW_ERR_TRANSPORT, "dist: zmq_socket: %s", zmq_strerror(errno));
  const char *ep = bind[0] ? bind : "tcp://127.0.0.1:*";
  if (zmq_bind(s, ep) != 0) {
    int e = errno;
    zmq_close(s);
    return tw_err(TW_ERR_TRANSPORT, "dist: rank 0 cannot bind %s: %s", ep, zmq_strerror(e));
  }
  if (!bind[0]) {
    size_t len = n;
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, conn, &len);
  }
  *sock_p = s;
  return TW_OK;
}

/* ---- watchdog ------------------------------------------------------------------- */

/* End this process: the peer is gone. */
static void tw_dist_lost(tw_dist_t *d, const char *why) {
  TW_ERROR("dist", "%s: stopping this worker", why);
  /* a collective waiting for the dead rank never returns, and rank 0's
   * router heartbeat thread would keep the worker registered: end now */
  if (d->on_lost) d->on_lost(why);
  else kill(getpid(), SIGKILL);
  atomic_store(&d->wd_stop, 1);
}

static void *tw_dist_watchdog(void *arg) {
  tw_dist_t *d = arg;
  int64_t start = tw_dist_now_ms(), last_ping = 0;
  /* rank 0: when a connection to its watchdog socket closed (0: none
   * pending), and how long the ranks have to show they are alive */
  int64_t closed_at = 0, closed_last = 0;
  const int64_t confirm_ms = 3 * TW_DIST_PING_MS * TW_SLOW_BUILD < d->lost_ms
                                 ? 3 * TW_DIST_PING_MS * TW_SLOW_BUILD
                                 : d->lost_ms;
  int64_t seen[TW_DIST_MAX_RANKS];
  for (int i = 0; i < TW_DIST_MAX_RANKS; i++) seen[i] = start;
  char why[160];
  /* a dead peer closes its TCP connection at once: the monitor's
   * DISCONNECTED event is the fast path; pings catch a hung peer */
  void *mon = zmq_socket(d->zctx, ZMQ_PAIR);
  if (mon && zmq_connect(mon, d->mon_ep) != 0) {
    zmq_close(mon);
    mon = NULL;
  }
  while (!atomic_load(&d->wd_stop)) {
    zmq_pollitem_t it[2] = {{.socket = d->hb, .events = ZMQ_POLLIN},
                            {.socket = mon, .events = ZMQ_POLLIN}};
    int np = zmq_poll(it, mon ? 2 : 1, 20);
    if (np > 0 && mon && (it[1].revents & ZMQ_POLLIN)) {
      zmq_msg_t ev, addr;
      zmq_msg_init(&ev);
      zmq_msg_init(&addr);
      int got = zmq_msg_recv(&ev, mon, 0) >= 6 && zmq_msg_recv(&addr, mon, 0) >= 0;
      uint16_t event = 0;
      if (got) memcpy(&event, zmq_msg_data(&ev), sizeof event);
      zmq_msg_close(&ev);
      zmq_msg_close(&addr);
      if (got && event == ZMQ_EVENT_DISCONNECTED && !atomic_load(&d->wd_stop)) {
        if (d->id.rank != 0) { /* our one connection, to rank 0 */
          snprintf(why, sizeof why, "rank %d of %d: the connection to rank 0 closed", d->id.rank,
                   d->id.size);
          tw_dist_lost(d, why);
          break;
        }
        /* rank 0 listens: the closed connection may be a peer the guard
         * refused (no or wrong keys, a port scan), not a rank. A rank on
         * this host must be gone from /proc by confirm_ms (its socket
         * closes while it exits: checked every pass until then); any other
         * rank must ping again by then, or it is the one gone. */
        closed_last = tw_dist_now_ms();
        if (!closed_at) closed_at = closed_last;
      }
    }
    if (np > 0 && (it[0].revents & ZMQ_POLLIN)) {
      char id[16] = {0}, body[8];
      if (d->id.rank == 0) {
        int n = zmq_recv(d->hb, id, sizeof id - 1, ZMQ_DONTWAIT);
        zmq_recv(d->hb, body, sizeof body, ZMQ_DONTWAIT);
        int r = n > 1 && id[0] == 'r' ? atoi(id + 1) : -1;
        if (r > 0 && r < d->id.size) seen[r] = tw_dist_now_ms();
      } else {
        zmq_recv(d->hb, body, sizeof body, ZMQ_DONTWAIT);
        seen[0] = tw_dist_now_ms();
      }
    }
    int64_t now = tw_dist_now_ms();
    if (now - last_ping >= TW_DIST_PING_MS) {
      last_ping = now;
      if (d->id.rank == 0) {
        for (int r = 1; r < d->id.size; r++) {
          char rid[16];
          snprintf(rid, sizeof rid, "r%d", r);
          zmq_send(d->hb, rid, strlen(rid), ZMQ_SNDMORE | ZMQ_DONTWAIT);
          zmq_send(d->hb, "p", 1, ZMQ_DONTWAIT);
        }
      } else {
        zmq_send(d->hb, "p", 1, ZMQ_DONTWAIT);
      }
    }
    if (closed_at) {
      bool due = now - closed_at >= confirm_ms;
      int gone = -1;
      for (int r = 1; r < d->id.size && gone < 0; r++)
        if (d->local[r] ? !tw_proc_alive(&d->rank_proc[r])
                        : due && seen[r] < closed_at + TW_DIST_PING_MS / 2)
          gone = r; /* a ping that was on its way when the connection closed does not count */
      if (gone > 0) {
        if (d->local[gone])
          snprintf(why, sizeof why,
                   "rank 0 of %d: the connection to rank %d closed, its process %d is gone",
                   d->id.size, gone, (int)d->rank_proc[gone].pid);
        else
          snprintf(why, sizeof why,
                   "rank 0 of %d: a connection closed and rank %d has not pinged since (%lld ms)",
                   d->id.size, gone, (long long)(now - closed_at));
        tw_dist_lost(d, why);
        break;
      }
    }
    if (closed_at && now - closed_at >= confirm_ms) {
      TW_DEBUG("dist",
               "a connection to the watchdog socket closed, every rank still pings: "
               "not a rank (a refused peer)");
      /* another closed since: check the ranks against that one next */
      closed_at = closed_last > closed_at ? closed_last : 0;
    }
    int lo = d->id.rank == 0 ? 1 : 0, hi = d->id.rank == 0 ? d->id.size : 1;
    for (int r = lo; r < hi; r++) {
      if (now - seen[r] > d->lost_ms) {
        snprintf(why, sizeof why, "rank %d of %d: no ping from rank %d for %lld ms", d->id.rank,
                 d->id.size, r, (long long)(now - seen[r]));
        tw_dist_lost(d, why);
        break;
      }
    }
  }
  if (mon) zmq_close(mon);
  return NULL;
}

/* ---- create / destroy ----------------------------------------------------------- */

static TW_NODISCARD tw_status_t tw_dist_recv_frame(void *s, int timeout_ms, char *id, size_t id_len,
                                                   void **buf_p, size_t *len_p) {
  zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
  int rc = zmq_poll(&it, 1, timeout_ms);
  if (rc < 0 && errno == EINTR) return TW_INPROGRESS; /* a signal: the caller polls again */
  if (rc < 0) return tw_err(TW_ERR_TRANSPORT, "dist: zmq_poll: %s", zmq_strerror(errno));
  if (rc == 0) return TW_INPROGRESS;
  if (id) {
    int n = zmq_recv(s, id, id_len - 1, 0);
    if (n < 0) return tw_err(TW_ERR_TRANSPORT, "dist: zmq_recv: %s", zmq_strerror(errno));
    id[n < (int)id_len - 1 ? n : (int)id_len - 1] = '\0';
  }
  zmq_msg_t m;
  zmq_msg_init(&m);
  if (zmq_msg_recv(&m, s, 0) < 0) {
    zmq_msg_close(&m);
    return tw_err(TW_ERR_TRANSPORT, "dist: zmq_msg_recv: %s", zmq_strerror(errno));
  }
  size_t n = zmq_msg_size(&m);
  void *b = malloc(n ? n : 1);
  if (!b) {
    zmq_msg_close(&m);
    return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a %zu byte message", n);
  }
  memcpy(b, zmq_msg_data(&m), n);
  zmq_msg_close(&m);
  *buf_p = b;
  *len_p = n;
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_dist_send_to(void *s, int32_t rank, const void *buf,
                                                size_t len) {
  char rid[16];
  snprintf(rid, sizeof rid, "r%d", rank);
  if (zmq_send(s, rid, strlen(rid), ZMQ_SNDMORE) < 0 || zmq_send(s, buf, len, 0) < 0)
    return tw_err(TW_ERR_TRANSPORT, "dist: send to rank %d: %s", rank, zmq_strerror(errno));
  return TW_OK;
}

/* Rank 0 waits for a HELLO from every other rank (so plans are never sent
 * before a rank is connected); the others send theirs. */
static TW_NODISCARD tw_status_t tw_dist_hello(tw_dist_t *d) {
  if (d->id.rank != 0) {
    tw_dist_hello_t h = {.type = TW_DIST_MSG_HELLO, .rank = (uint32_t)d->id.rank};
    tw_proc_self(&h.proc);
    if (zmq_send(d->ctrl, &h, sizeof h, 0) < 0)
      return tw_err(TW_ERR_TRANSPORT, "dist: hello to rank 0: %s", zmq_strerror(errno));
    return TW_OK;
  }
  int got = 0;
  int64_t end = tw_dist_now_ms() + TW_DIST_JOIN_MS;
  tw_proc_t self; /* read once: each hello is compared with it */
  tw_proc_self(&self);
  while (got < d->id.size - 1) {
    int64_t left = end - tw_dist_now_ms();
    if (left <= 0)
      return tw_err(TW_ERR_UNAVAILABLE, "dist: %d of %d ranks joined within %d ms", got + 1,
                    d->id.size, TW_DIST_JOIN_MS);
    char id[16];
    void *b = NULL;
    size_t n = 0;
    tw_status_t st = tw_dist_recv_frame(d->ctrl, (int)left, id, sizeof id, &b, &n);
    if (st == TW_INPROGRESS) continue;
    TW_CHECK(st);
    tw_dist_hello_t h;
    memset(&h, 0, sizeof h);
    memcpy(&h, b, n < sizeof h ? n : sizeof h);
    if (n >= 4 && h.type == TW_DIST_MSG_HELLO) got++;
    if (n == sizeof h && h.rank > 0 && h.rank < (uint32_t)d->id.size) {
      d->rank_proc[h.rank] = h.proc;
      d->local[h.rank] = tw_proc_local(&self, &d->rank_proc[h.rank]);
    }
    free(b);
  }
  return TW_OK;
}

/* Rank 0 sends buf to every other rank over the control link; each other
 * rank receives it into buf: a NUL-terminated string of at most cap bytes
 * (text), or exactly cap bytes. Errors: TW_ERR_UNAVAILABLE (nothing from
 * rank 0 in time), TW_ERR_FORMAT (wrong size), TW_ERR_TRANSPORT. */
static TW_NODISCARD tw_status_t tw_dist_share(tw_dist_t *d, void *buf, size_t cap, bool text,
                                              const char *what) {
  if (d->id.rank == 0) {
    size_t len = text ? strlen(buf) + 1 : cap;
    for (int32_t r = 1; r < d->id.size; r++) TW_CHECK(tw_dist_send_to(d->ctrl, r, buf, len));
    return TW_OK;
  }
  void *b = NULL;
  size_t n = 0;
  tw_status_t st = tw_dist_recv_frame(d->ctrl, TW_DIST_JOIN_MS, NULL, 0, &b, &n);
  if (st == TW_INPROGRESS)
    return tw_err(TW_ERR_UNAVAILABLE, "dist: rank %d: no %s from rank 0", d->id.rank, what);
  TW_CHECK(st);
  if (text) {
    snprintf(buf, cap, "%.*s", (int)(n ? n - 1 : 0), (const char *)b);
  } else if (n != cap) {
    free(b);
    return tw_err(TW_ERR_FORMAT, "dist: %s of %zu bytes", what, n);
  } else {
    memcpy(buf, b, cap);
  }
  free(b);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_dist_setup(tw_dist_t *d, tw_coll_kind_t kind, int32_t device) {
  char cbind[288] = "", cconn[288] = "", hconn[288] = "";
  if (kind == TW_COLL_HOST) {
    TW_CHECK(tw_coll_create_host(&d->coll));
    if (tw_coll_size(d->coll) != d->id.size || tw_coll_rank(d->coll) != d->id.rank)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "dist: launcher says rank %d of %d, MPI says %d of %d: cpu ranks need an MPI "
                    "launcher (mpirun, srun --mpi=pmix) or --tp N",
                    d->id.rank, d->id.size, tw_coll_rank(d->coll), tw_coll_size(d->coll));
  } else if (!d->id.rendezvous[0]) {
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: nccl ranks need a rendezvous address");
  }
  if (d->id.rendezvous[0]) TW_CHECK(tw_dist_endpoints(d->id.rendezvous, 0, cbind, cconn, sizeof cbind));
  if (d->id.rank == 0) {
    TW_CHECK(tw_dist_bind(d, cbind, &d->ctrl, cconn, sizeof cconn));
    TW_CHECK(tw_auth_guard_watch(d->guard, d->ctrl, "rank control link"));
    /* the watchdog's socket: an ephemeral port (no second fixed port to
     * collide with another worker's rendezvous), announced after the hello */
    bool loop = !d->id.rendezvous[0] || strncmp(cbind, "tcp://127.0.0.1:", 16) == 0;
    TW_CHECK(tw_dist_bind(d, loop ? "" : "tcp://*:*", &d->hb, hconn, sizeof hconn));
    char last[288] = "";
    size_t ll = sizeof last;
    zmq_getsockopt(d->hb, ZMQ_LAST_ENDPOINT, last, &ll);
    const char *port = strrchr(last, ':'), *host_end = strrchr(cconn, ':');
    if (!port || !host_end)
      return tw_err(TW_ERR_TRANSPORT, "dist: cannot tell the watchdog port (%s, %s)", last, cconn);
    snprintf(hconn, sizeof hconn, "%.*s%s", (int)(host_end - cconn), cconn, port);
  }
  if (!d->id.rendezvous[0]) /* MPI launch without a rendezvous: rank 0's port by broadcast */
    TW_CHECK(tw_coll_broadcast(d->coll, cconn, sizeof cconn, 0));
  if (d->id.rank != 0) {
    d->ctrl = tw_dist_socket(d, ZMQ_DEALER, d->id.rank);
    if (!d->ctrl || zmq_connect(d->ctrl, cconn) != 0)
      return tw_err(TW_ERR_TRANSPORT, "dist: rank %d cannot connect to rank 0 at %s: %s",
                    d->id.rank, cconn, zmq_strerror(errno));
    TW_CHECK(tw_auth_guard_watch(d->guard, d->ctrl, "rank control link"));
  }
  TW_CHECK(tw_dist_hello(d));
  TW_CHECK(tw_dist_share(d, hconn, sizeof hconn, true, "watchdog address"));
  if (d->id.rank != 0) {
    d->hb = tw_dist_socket(d, ZMQ_DEALER, d->id.rank);
    if (!d->hb || zmq_connect(d->hb, hconn) != 0)
      return tw_err(TW_ERR_TRANSPORT, "dist: rank %d cannot connect the watchdog to %s: %s",
                    d->id.rank, hconn, zmq_strerror(errno));
  }
  if (kind == TW_COLL_NCCL) {
    uint8_t uid[TW_COLL_UID_BYTES];
    if (d->id.rank == 0) TW_CHECK(tw_coll_nccl_unique_id(uid));
    TW_CHECK(tw_dist_share(d, uid, sizeof uid, false, "nccl id"));
    TW_CHECK(tw_coll_create_nccl(uid, d->id.rank, d->id.size, device, NULL, &d->coll));
  }
  snprintf(d->mon_ep, sizeof d->mon_ep, "inproc://tw-dist-mon-%p", (void *)d);
  if (zmq_socket_monitor(d->hb, d->mon_ep, ZMQ_EVENT_DISCONNECTED) != 0)
    return tw_err(TW_ERR_TRANSPORT, "dist: zmq_socket_monitor: %s", zmq_strerror(errno));
  if (pthread_create(&d->wd, NULL, tw_dist_watchdog, d) != 0)
    return tw_err(TW_ERR_INTERNAL, "dist: cannot start the watchdog thread");
  d->wd_started = true;
  TW_INFO("dist", "rank %d of %d joined (%s collective, control %s)", d->id.rank, d->id.size,
          kind == TW_COLL_HOST ? "mpi" : kind == TW_COLL_NCCL ? "nccl" : "no", cconn);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_dist_create(const tw_dist_identity_t *id, tw_coll_kind_t kind,
                                        int32_t device, tw_dist_lost_fn on_lost,
                                        tw_dist_t **dist_p) {
  if (!id || id->size < 1 || id->size > TW_DIST_MAX_RANKS || id->rank < 0 || id->rank >= id->size)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: bad identity");
  tw_dist_t *d = calloc(1, sizeof(*d));
  if (!d) return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory");
  d->magic = TW_DIST_MAGIC;
  d->id = *id;
  d->on_lost = on_lost;
  const char *lm = getenv("TWAIN_DIST_LOST_MS");
  d->lost_ms = lm && atoi(lm) > 0 ? atoi(lm) : TW_DIST_LOST_MS;
  if (id->size == 1) {
    *dist_p = d;
    return TW_OK;
  }
  d->zctx = zmq_ctx_new();
  if (!d->zctx) {
    free(d);
    return tw_err(TW_ERR_TRANSPORT, "dist: zmq_ctx_new: %s", zmq_strerror(errno));
  }
  struct sigaction sa = {0};
  sa.sa_handler = tw_dist_on_usr1;
  sigaction(SIGUSR1, &sa, NULL);
  tw_status_t st = tw_dist_keys(&d->keys);
  if (st == TW_OK)
    st = tw_auth_guard_start(d->zctx, &d->keys, "worker rank links", id->rank == 0, &d->guard);
  if (st == TW_OK) st = tw_dist_setup(d, kind, device);
  if (st != TW_OK) {
    tw_dist_destroy(d);
    return st;
  }
  *dist_p = d;
  return TW_OK;
}

void tw_dist_watchdog_stop(tw_dist_t *d) {
  if (!d || d->magic != TW_DIST_MAGIC || !d->wd_started) return;
  atomic_store(&d->wd_stop, 1);
  pthread_join(d->wd, NULL);
  d->wd_started = false;
}

void tw_dist_destroy(tw_dist_t *d) {
  if (!d || d->magic != TW_DIST_MAGIC) return;
  tw_dist_watchdog_stop(d);
  if (d->ctrl) zmq_close(d->ctrl);
  if (d->hb) zmq_close(d->hb);
  tw_auth_guard_stop(d->guard);
  memset(&d->keys, 0, sizeof d->keys);
  if (d->zctx) zmq_ctx_term(d->zctx);
  tw_coll_destroy(d->coll);
  d->magic = 0;
  free(d);
}

int32_t tw_dist_rank(const tw_dist_t *d) { return d ? d->id.rank : 0; }
int32_t tw_dist_size(const tw_dist_t *d) { return d ? d->id.size : 1; }
tw_coll_t *tw_dist_coll(tw_dist_t *d) { return d ? d->coll : NULL; }
uint64_t tw_dist_refused(const tw_dist_t *d) {
  return d && d->guard ? tw_auth_guard_refused(d->guard) : 0;
}

/* ---- plans and replies ----------------------------------------------------------- */

TW_NODISCARD tw_status_t tw_dist_plan_send(tw_dist_t *d, const void *buf, size_t len) {
  if (d->id.rank != 0) return tw_err(TW_ERR_INTERNAL, "dist: plan_send on rank %d", d->id.rank);
  for (int32_t r = 1; r < d->id.size; r++) TW_CHECK(tw_dist_send_to(d->ctrl, r, buf, len));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_dist_plan_recv(tw_dist_t *d, int timeout_ms, void **buf_p,
                                           size_t *len_p) {
  if (d->id.rank == 0) return tw_err(TW_ERR_INTERNAL, "dist: plan_recv on rank 0");
  return tw_dist_recv_frame(d->ctrl, timeout_ms, NULL, 0, buf_p, len_p);
}

TW_NODISCARD tw_status_t tw_dist_reply(tw_dist_t *d, const void *buf, size_t len) {
  if (zmq_send(d->ctrl, buf, len, 0) < 0)
    return tw_err(TW_ERR_TRANSPORT, "dist: reply to rank 0: %s", zmq_strerror(errno));
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_dist_replies_recv(tw_dist_t *d, int timeout_ms, void **bufs,
                                              size_t *lens) {
  for (int32_t r = 0; r < d->id.size; r++) {
    bufs[r] = NULL;
    lens[r] = 0;
  }
  int got = 0;
  int64_t end = tw_dist_now_ms() + timeout_ms;
  tw_status_t st = TW_OK;
  while (got < d->id.size - 1) {
    int64_t left = end - tw_dist_now_ms();
    if (left <= 0) {
      st = tw_err(TW_ERR_DEADLINE, "dist: %d of %d ranks replied within %d ms", got,
                  d->id.size - 1, timeout_ms);
      break;
    }
    char id[16];
    void *b = NULL;
    size_t n = 0;
    st = tw_dist_recv_frame(d->ctrl, (int)left, id, sizeof id, &b, &n);
    if (st == TW_INPROGRESS) {
      st = TW_OK;
      continue;
    }
    if (st != TW_OK) break;
    int r = id[0] == 'r' ? atoi(id + 1) : -1;
    if (r <= 0 || r >= d->id.size || bufs[r]) {
      free(b);
      continue;
    }
    bufs[r] = b;
    lens[r] = n;
    got++;
  }
  if (st != TW_OK) {
    for (int32_t r = 0; r < d->id.size; r++) {
      free(bufs[r]);
      bufs[r] = NULL;
    }
  }
  return st;
}
