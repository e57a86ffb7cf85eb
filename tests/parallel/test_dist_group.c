/* test_dist_group.c: a group of ranks started by tw_dist_spawn's own
 * spawner (the cuda path: fork + exec with RANK / WORLD_SIZE / LOCAL_RANK /
 * TWAIN_RENDEZVOUS), without a collective (TW_COLL_NONE), so it runs here:
 *   1. the control link: rank 0 sends 20 plans of 0..19 KiB; each other rank
 *      answers with the FNV-1a of what it got; rank 0 checks every answer,
 *      then says stop and every rank exits 0;
 *   2. the watchdog: rank 0 tells rank 2 to SIGKILL itself; rank 0's watchdog
 *      must then end rank 0 (SIGKILL), and rank 1 must go too (it loses
 *      rank 0). The test process checks both, within bounded waits;
 *   3. intruders: after 10 plans, every TCP socket rank 0 listens on (the
 *      control link and the watchdog's) gets a plaintext peer, a CURVE peer
 *      with a client key of another set, one with the wrong server key (each
 *      claiming to be rank 1 and sending a hello and a forged answer), and a
 *      raw connection writing garbage, for a second. Every one must be
 *      refused (counted by the group's guard, logged: the driver reads rank
 *      0's log), the group must not take a refused peer for a lost rank,
 *      and the same 10 plans after the intrusion must get the same answers;
 *   4. a plan the other ranks cannot read (a decode plan of one sequence
 *      that ends after its header): they leave the group instead of
 *      following on (rank 0 would wait in that step's collectives forever),
 *      so rank 0's watchdog ends rank 0 (SIGKILL) within a bounded wait.
 * Usage: test_dist_group (the driver); the ranks run as
 * test_dist_group rank MODE with MODE plans, die, intrude or badplan. */
#include "common/base/log.h"
#include "common/comm/dist.h"
#include "common/comm/link_auth.h"
#include "common/engine/dist_engine.h"
#include "common/kv/kv_transfer.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define TW_NRANKS 3

/* TWAIN_TEST_TIME_SCALE (tests/CMakeLists.txt: 4 under the sanitizers):
 * every wait here is that many times longer (the ranks' heartbeat loss
 * time, TW_DIST_LOST_MS, is stretched by the same sanitizer build). */
static int time_scale(void) {
  const char *s = getenv("TWAIN_TEST_TIME_SCALE");
  long k = s ? strtol(s, NULL, 10) : 1;
  return k > 1 && k <= 100 ? (int)k : 1;
}

static TW_NODISCARD tw_status_t hook(void *ctx, const void *buf, size_t len) {
  tw_dist_t *d = ctx;
  if (len == 3 && memcmp(buf, "die", 3) == 0) {
    if (tw_dist_rank(d) == 2) raise(SIGKILL);
    return TW_OK;
  }
  uint64_t h = tw_kv_fnv1a(TW_KV_FNV_INIT, buf, len);
  return tw_dist_reply(d, &h, sizeof h);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Rank 0: plans k = 0..n-1 of k KiB each; every other rank's answer must be
 * the FNV-1a of plan k. answers[k] gets rank 1's. Returns the wrong answers,
 * or -1 when a plan or its replies failed. */
static int run_plans(tw_dist_t *d, int n, uint64_t *answers) {
  int bad = 0;
  for (int k = 0; k < n; k++) {
    size_t len = (size_t)k * 1024;
    uint8_t *buf = malloc(len + 1);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 31 + (size_t)k);
    uint64_t want = tw_kv_fnv1a(TW_KV_FNV_INIT, buf, len);
    void *bufs[TW_NRANKS];
    size_t lens[TW_NRANKS];
    if (tw_dist_plan_user(d, buf, len) != TW_OK ||
        tw_dist_replies_recv(d, 10000 * time_scale(), bufs, lens) != TW_OK) {
      free(buf);
      return -1;
    }
    for (int r = 1; r < TW_NRANKS; r++) {
      uint64_t got = 0;
      if (lens[r] == sizeof got) memcpy(&got, bufs[r], sizeof got);
      bad += got != want;
      if (r == 1 && answers) answers[k] = got;
      free(bufs[r]);
    }
    free(buf);
  }
  return bad;
}

/* The TCP ports this process listens on (from /proc: the sockets among its
 * descriptors in LISTEN state); returns how many (at most cap). */
static int own_listen_ports(int *ports, int cap) {
  unsigned long inodes[256];
  int n_in = 0;
  DIR *dir = opendir("/proc/self/fd");
  struct dirent *e;
  while (dir && (e = readdir(dir)) && n_in < 256) {
    char path[300], link[64];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t l = readlink(path, link, sizeof link - 1);
    if (l <= 0) continue;
    link[l] = '\0';
    if (sscanf(link, "socket:[%lu]", &inodes[n_in]) == 1) n_in++;
  }
  if (dir) closedir(dir);
  FILE *f = fopen("/proc/self/net/tcp", "r");
  char line[512];
  int n = 0;
  while (f && fgets(line, sizeof line, f) && n < cap) {
    unsigned addr, port, state;
    unsigned long inode;
    if (sscanf(line, " %*d: %x:%x %*x:%*x %x %*x:%*x %*x:%*x %*x %*d %*d %lu", &addr, &port, &state,
               &inode) != 4 ||
        state != 0x0A)
      continue;
    for (int i = 0; i < n_in; i++)
      if (inodes[i] == inode) ports[n++] = (int)port;
  }
  if (f) fclose(f);
  return n;
}

/* One intruder of each kind at 127.0.0.1:port (see the file comment); the
 * ZeroMQ ones keep reconnecting until closed. socks[] gets the sockets. */
enum { TW_INTRUDERS = 3 };
static int intrude(void *zctx, int port, const tw_auth_keys_t *group, void **socks) {
  char ep[64];
  snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
  tw_auth_keys_t other, wrong_server;
  if (tw_auth_keys_generate(&other) != TW_OK) return -1;
  wrong_server = *group; /* the group's client pair, another server key */
  memcpy(wrong_server.server_public, other.server_public, sizeof other.server_public);
  other.plaintext = false;
  memcpy(other.server_public, group->server_public, sizeof other.server_public);
  for (int i = 0; i < TW_INTRUDERS; i++) {
    void *s = socks[i] = zmq_socket(zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, "r1", 2); /* claims to be rank 1 */
    if (i == 1 && tw_auth_client(s, &other) != TW_OK) return -1;
    if (i == 2 && tw_auth_client(s, &wrong_server) != TW_OK) return -1;
    if (zmq_connect(s, ep) != 0) return -1;
    uint32_t hello[2] = {1, 1};
    uint64_t forged = 0x0123456789abcdefull;
    zmq_send(s, hello, sizeof hello, ZMQ_DONTWAIT);
    zmq_send(s, &forged, sizeof forged, ZMQ_DONTWAIT);
    zmq_send(s, "p", 1, ZMQ_DONTWAIT);
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) return -1;
  static const char junk[] = "\xff\0\0\0\0\0\0\0\x01\x7f GET / HTTP/1.0\r\n\r\n";
  if (write(fd, junk, sizeof junk) < 0) return -1;
  sleep_ms(50);
  close(fd);
  return 0;
}

/* Rank 0 of the intrude mode: plans, intruders on every listening socket,
 * the same plans. Returns 0 when all is as the file comment says. */
static int run_intrude(tw_dist_t *d) {
  uint64_t before[10], after[10];
  int bad = run_plans(d, 10, before);
  int ports[8];
  int n_ports = own_listen_ports(ports, 8);
  printf("intrude: rank 0 listens on %d TCP ports\n", n_ports);
  tw_auth_keys_t group;
  const char *kt = getenv(TW_DIST_KEYS_ENV);
  if (bad != 0 || n_ports != 2 || !kt || tw_auth_keys_parse(kt, &group) != TW_OK) return 10;
  uint64_t refused0 = tw_dist_refused(d);
  void *zctx = zmq_ctx_new();
  void *socks[8][TW_INTRUDERS] = {{0}};
  int rc = 0;
  for (int p = 0; p < n_ports && rc == 0; p++) rc = intrude(zctx, ports[p], &group, socks[p]);
  /* at least: on the control link (watched) each of the four kinds; on the
   * watchdog's socket the peer with another client key (ZAP); bounded wait,
   * then a second more of reconnecting intruders */
  uint64_t want = 5;
  for (int i = 0; i < 100 * time_scale() && tw_dist_refused(d) - refused0 < want; i++) sleep_ms(50);
  sleep_ms(1000);
  uint64_t refused = tw_dist_refused(d) - refused0;
  for (int p = 0; p < n_ports; p++)
    for (int i = 0; i < TW_INTRUDERS; i++)
      if (socks[p][i]) zmq_close(socks[p][i]);
  zmq_ctx_term(zctx);
  printf("intrude: %s; %llu refusals counted (at least %llu expected)\n",
         rc == 0 ? "4 intruders on each port" : "the intruders could not be set up",
         (unsigned long long)refused, (unsigned long long)want);
  sleep_ms(500); /* a watchdog that took a refused peer for a rank would end us now */
  int bad_after = run_plans(d, 10, after);
  int same = bad_after == 0 && memcmp(before, after, sizeof before) == 0;
  printf("intrude: the same 10 plans after: %d wrong answers, %s\n", bad_after,
         same ? "the same answers as before" : "DIFFERENT answers");
  return rc == 0 && refused >= want && same ? 0 : 11;
}

static int run_rank(int argc, char **argv, const char *mode) {
  tw_dist_identity_t id;
  if (tw_dist_identity_from_env(&id) != TW_OK) return 2;
  if (id.size == 1) { /* the first process: start the group, be rank 0 */
    int rc = -1;
    if (tw_dist_spawn(argc, argv, TW_NRANKS, 0, &id, &rc) != TW_OK) return 3;
  }
  tw_log_init("test_dist_group", id.rank);
  tw_dist_t *d = NULL;
  if (tw_dist_create(&id, TW_COLL_NONE, 0, NULL, &d) != TW_OK) return 4;
  if (id.rank != 0) {
    tw_status_t st = tw_dist_follow(d, NULL, hook, d, NULL);
    tw_dist_destroy(d);
    return st == TW_OK ? 0 : 5;
  }
  if (strcmp(mode, "intrude") == 0) {
    int rc = run_intrude(d);
    if (tw_dist_plan_stop(d) != TW_OK) rc = rc ? rc : 12;
    for (int r = 1; r < TW_NRANKS; r++) {
      int status = 0;
      pid_t p = wait(&status);
      if (!(p > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0)) rc = rc ? rc : 13;
    }
    tw_dist_destroy(d);
    return rc;
  }
  int bad = run_plans(d, 20, NULL);
  if (bad < 0) return 6;
  printf("rank 0: 20 plans to %d ranks, %d wrong answers\n", TW_NRANKS - 1, bad);
  if (strcmp(mode, "die") == 0 || strcmp(mode, "badplan") == 0) {
    const int32_t short_decode[3] = {2 /* DECODE, dist_engine.c */, 1 /* n_seqs */, 0 /* flags */};
    if (strcmp(mode, "die") == 0 ? tw_dist_plan_user(d, "die", 3) != TW_OK
                                 : tw_dist_plan_send(d, short_decode, sizeof short_decode) != TW_OK)
      return 9;
    /* the watchdog ends this process long before 10 s (scaled) */
    for (int i = 0; i < 100 * time_scale(); i++) sleep_ms(100);
    return 7; /* not reached when the watchdog works */
  }
  if (tw_dist_plan_stop(d) != TW_OK) bad++;
  int children_ok = 1;
  for (int r = 1; r < TW_NRANKS; r++) {
    int status = 0;
    pid_t p = wait(&status);
    children_ok &= p > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  printf("rank 0: the other ranks exited %s\n", children_ok ? "0" : "with an error");
  tw_dist_destroy(d);
  return bad == 0 && children_ok ? 0 : 8;
}

/* Run `self rank MODE` with a clean launcher environment (stderr into
 * maybe_log when given); returns the status. */
static int drive(const char *self, const char *mode, const char *maybe_log, pid_t *pid_p) {
  pid_t pid = fork();
  if (pid == 0) {
    if (maybe_log) {
      FILE *f = freopen(maybe_log, "w", stderr);
      if (!f) _exit(126);
    }
    const char *vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                          "TWAIN_RENDEZVOUS", "MASTER_ADDR", "MASTER_PORT"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    execl(self, self, "rank", mode, (char *)NULL);
    _exit(127);
  }
  *pid_p = pid;
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "rank") == 0) return run_rank(argc, argv, argv[2]);
  tw_log_init("test_dist_group", 0);
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = '\0';
  int fails = 0;
  pid_t pid;

  int st = drive(self, "plans", NULL, &pid);
  printf("plans: group exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
  fails += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  st = drive(self, "die", NULL, &pid);
  int killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
  printf("die: rank 2 killed itself; rank 0 %s\n",
         killed ? "was ended by its watchdog (SIGKILL)" : "did NOT end by SIGKILL");
  fails += !killed;
  /* rank 1 lost rank 0 (its watchdog, and PR_SET_PDEATHSIG): it must go too;
   * look for our own executable still running "rank die" (bounded: 10 s, scaled) */
  int others_gone = 1;
  for (int i = 0; i < 100 * time_scale(); i++) {
    others_gone = 1;
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "pgrep -f '^%s rank die' >/dev/null", self);
    if (system(cmd) == 0) others_gone = 0;
    if (others_gone) break;
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
  }
  printf("die: the remaining rank %s\n", others_gone ? "is gone" : "is STILL running");
  fails += !others_gone;

  /* intruders on rank 0's sockets: refused, logged, no effect on the group */
  char log[] = "/tmp/test_dist_group_XXXXXX";
  int lfd = mkstemp(log);
  if (lfd < 0) return 1;
  close(lfd);
  st = drive(self, "intrude", log, &pid);
  printf("intrude: group exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
  fails += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  int zap_lines = 0, handshake_lines = 0;
  FILE *lf = fopen(log, "r");
  char line[1024];
  while (lf && fgets(line, sizeof line, lf)) {
    fputs(line, stderr);
    if (!strstr(line, "worker rank links:")) continue;
    zap_lines += strstr(line, "without the deployment's client key") != NULL;
    handshake_lines += strstr(line, "rank control link: handshake with") != NULL;
  }
  if (lf) fclose(lf);
  unlink(log);
  printf("intrude: rank 0 logged %d ZAP refusals and %d failed handshakes on the control link\n",
         zap_lines, handshake_lines);
  fails += zap_lines < 1 || handshake_lines < 1;

  st = drive(self, "badplan", NULL, &pid);
  killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
  printf("badplan: the other ranks could not read a plan; rank 0 %s\n",
         killed                                  ? "was ended by its watchdog (SIGKILL)"
         : WIFEXITED(st) && WEXITSTATUS(st) == 7 ? "still waited after 10 s"
                                                 : "did NOT end by SIGKILL");
  fails += !killed;
  printf("%s\n", fails ? "FAIL" : "PASS");
  return fails ? 1 : 0;
}
