/* probe_ucx_sender_kill.c: does a sender killed (SIGKILL, from outside)
 * while it sends active messages to a receiving UCX worker on the same host
 * leave that worker unable to receive from anyone else?
 *
 * UCX alone, no twain code. The parent is the receiver: one ucp worker with
 * an active message handler. For each round it starts a "flood" child (fork
 * + exec of this program) that connects by worker address and sends active
 * messages in a loop (header 8 bytes, data 0 or 256 bytes: inline and copied
 * sends, as twain's "want" and "filled"), waits until some have arrived,
 * kills the child at a random moment 0-5 ms later, and then starts a "single"
 * child that sends one message with the round's number. That message must
 * arrive within 5 s while the receiver keeps progressing; when it does not,
 * the receiver's worker is blocked (one more round is run to see that it
 * stays so, then the probe stops).
 *
 * Why it may: UCX's shared-memory transports (sysv, posix) deliver active
 * messages through one receive FIFO per receiving interface, shared by every
 * sender; a sender takes an element by moving the FIFO's head (an atomic
 * compare-and-swap), writes it, and only then sets its owner flag. The
 * receiver reads elements in order and waits at one whose flag is not set:
 * a sender killed between the two leaves that element unset forever
 * (src/uct/sm/mm/base/mm_ep.c uct_mm_ep_am_common_send,
 * mm_iface.c uct_mm_iface_poll_fifo, UCX 1.13.1 and master).
 *
 * Build and run by hand (not a ctest: it is a property of UCX):
 *   cc -O2 -o /tmp/probe tests/service/probe_ucx_sender_kill.c -lucp -lucs
 *   /tmp/probe 40            # default transports (shared memory on one host)
 *   UCX_TLS=tcp UCX_NET_DEVICES=lo /tmp/probe 40   # control
 *   UCX_TLS=^mm /tmp/probe 40   # a staged decode worker's default (TCP, cma)
 * Prints one line per round and a summary; exit 1 when a round was blocked. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#define AM_ID 7
#define FLOOD_TAG 0xF10D000000000000ull

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int write_all(int fd, const void *p, size_t n) {
  for (const char *c = p; n;) {
    ssize_t k = write(fd, c, n);
    if (k <= 0) return -1;
    c += k;
    n -= (size_t)k;
  }
  return 0;
}
static int read_all(int fd, void *p, size_t n) {
  for (char *c = p; n;) {
    ssize_t k = read(fd, c, n);
    if (k <= 0) return -1;
    c += k;
    n -= (size_t)k;
  }
  return 0;
}

static int ucx_up(ucp_context_h *ctx, ucp_worker_h *w) {
  ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                    .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  return ucp_init(&p, NULL, ctx) != UCS_OK || ucp_worker_create(*ctx, &wp, w) != UCS_OK ? -1 : 0;
}

/* ---- the receiver's counts ---- */
static uint64_t n_flood, last_single;
static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param) {
  (void)arg, (void)data, (void)length, (void)param;
  uint64_t h = 0;
  if (header_length == sizeof h) memcpy(&h, header, sizeof h);
  if ((h & 0xFFFF000000000000ull) == FLOOD_TAG)
    n_flood++;
  else
    last_single = h;
  return UCS_OK;
}

/* ---- a sender: "flood" (until killed) or "single" (one message, then
 * waits for its stdin to close) ---- */
static int sender(int flood, uint64_t tag, int rfd) {
  size_t alen = 0;
  if (read_all(rfd, &alen, sizeof alen) || alen > (1 << 20)) return 2;
  void *addr = malloc(alen);
  if (!addr || read_all(rfd, addr, alen)) return 2;
  ucp_context_h ctx;
  ucp_worker_h w;
  if (ucx_up(&ctx, &w)) return 3;
  ucp_ep_params_t ep = {
      .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
      .address = addr,
      .err_mode = UCP_ERR_HANDLING_MODE_NONE};
  ucp_ep_h e;
  if (ucp_ep_create(w, &ep, &e) != UCS_OK) return 4;
  static uint8_t data[256];
  uint64_t h = tag;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_EAGER};
  for (uint64_t i = 0;; i++) {
    size_t len = flood && (i & 1) ? sizeof data : 0;
    void *r = ucp_am_send_nbx(e, AM_ID, &h, sizeof h, data, len, &prm);
    if (UCS_PTR_IS_ERR(r)) return 5;
    if (r) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(w);
      ucp_request_free(r);
    }
    ucp_worker_progress(w);
    if (!flood) break;
  }
  char c;
  for (;;) { /* keep the endpoint: progress until the parent closes our pipe */
    ucp_worker_progress(w);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(rfd, &fds);
    struct timeval tv = {0, 1000};
    if (select(rfd + 1, &fds, NULL, NULL, &tv) > 0 && read(rfd, &c, 1) <= 0) break;
  }
  return 0;
}

/* What ucp_worker_arm says for 300 ms of calls made only when
 * ucp_worker_progress found nothing: "ok" (it armed at least once), "BUSY"
 * (never armed: events said to be pending, yet nothing to progress). */
static const char *arm_state(ucp_worker_h w) {
  int armed = 0, busy = 0;
  for (int64_t until = now_ns() + 300 * 1000000LL; now_ns() < until;) {
    if (ucp_worker_progress(w)) continue;
    ucs_status_t s = ucp_worker_arm(w);
    armed += s == UCS_OK;
    busy += s == UCS_ERR_BUSY;
  }
  return armed ? "ok" : busy ? "BUSY" : "other";
}

static pid_t spawn(const char *role, uint64_t tag, const void *addr, size_t alen, int *to) {
  int p[2];
  if (pipe2(p, O_CLOEXEC)) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(p[1]);
    fcntl(p[0], F_SETFD, 0);
    char t[24], fd[16];
    snprintf(t, sizeof t, "%llu", (unsigned long long)tag);
    snprintf(fd, sizeof fd, "%d", p[0]);
    execl("/proc/self/exe", "probe_ucx_sender_kill", role, t, fd, (char *)NULL);
    _exit(127);
  }
  close(p[0]);
  *to = p[1];
  if (write_all(*to, &alen, sizeof alen) || write_all(*to, addr, alen)) return -1;
  return pid;
}

int main(int argc, char **argv) {
  if (argc == 4)
    return sender(strcmp(argv[1], "flood") == 0, strtoull(argv[2], NULL, 10), atoi(argv[3]));
  int rounds = argc == 2 ? atoi(argv[1]) : 20;
  ucp_context_h ctx;
  ucp_worker_h w;
  if (ucx_up(&ctx, &w)) return 3;
  ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                             UCP_AM_HANDLER_PARAM_FIELD_CB |
                                             UCP_AM_HANDLER_PARAM_FIELD_ARG,
                               .id = AM_ID,
                               .cb = on_am,
                               .arg = NULL};
  if (ucp_worker_set_am_recv_handler(w, &hp) != UCS_OK) return 3;
  ucp_address_t *addr;
  size_t alen;
  if (ucp_worker_get_address(w, &addr, &alen) != UCS_OK) return 3;
  srand((unsigned)getpid());
  int blocked = 0, first_blocked = -1;
  for (int round = 1; round <= rounds; round++) {
    int to_flood = -1, to_single = -1;
    uint64_t before = n_flood;
    pid_t f = spawn("flood", FLOOD_TAG | (uint64_t)round, addr, alen, &to_flood);
    int64_t until = now_ns() + 10 * 1000000000LL;
    while (n_flood - before < 200 && now_ns() < until) ucp_worker_progress(w);
    int64_t kill_at = now_ns() + (int64_t)(rand() % 5000) * 1000;
    while (now_ns() < kill_at) ucp_worker_progress(w);
    kill(f, SIGKILL);
    waitpid(f, NULL, 0);
    close(to_flood);
    uint64_t flooded = n_flood - before;
    pid_t s = spawn("single", (uint64_t)round, addr, alen, &to_single);
    until = now_ns() + 5 * 1000000000LL;
    while (last_single != (uint64_t)round && now_ns() < until) ucp_worker_progress(w);
    int got = last_single == (uint64_t)round;
    close(to_single);
    kill(s, SIGKILL);
    waitpid(s, NULL, 0);
    printf(
        "round %d: %llu flood messages received, then the next sender's message %s; "
        "ucp_worker_arm with nothing to progress: %s\n",
        round, (unsigned long long)flooded, got ? "arrived" : "did NOT arrive within 5 s",
        arm_state(w));
    fflush(stdout);
    if (!got) {
      blocked++;
      if (first_blocked < 0) first_blocked = round;
      if (blocked == 2) break; /* it stays so: one more round showed it */
    }
  }
  printf("%d of %d rounds blocked (first: round %d)\n", blocked, rounds, first_blocked);
  return blocked ? 1 : 0;
}
