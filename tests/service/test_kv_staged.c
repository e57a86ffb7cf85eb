/* test_kv_staged.c: the staged KV receive path over UCX between processes on
 * loopback, on host memory (the copy out of a slot is a memcpy; on a GPU it
 * is a cudaMemcpyAsync, kv_transfer.h).
 *
 * The parent is the decode side: a host pool registered as a staged
 * receiver with a ring of 3 slots of 64 KiB (the ring's rkey published),
 * filled with 0xEE. Three "prefill" children (fork + exec of this program)
 * in turn:
 *  1. sends handoff 1: 40 blocks of 16 KiB in one run for full layers (10
 *     pieces of 64 KiB each: the ring is full most of the time), the window's
 *     blocks for sliding layers, and a gathered put of 8 pieces taken in
 *     reverse order (through the sender's own ring), then flushes. The parent
 *     checks that handoff 1 is complete only for its own tag, every sent byte
 *     exact, every other byte untouched, and the ring's counters: bytes copied
 *     out equal the bytes sent, back-pressure happened, no slot in use.
 *  2. starts handoff 2 into the same blocks and is killed (SIGKILL) after
 *     half of its layers, with pieces announced and not yet read: the
 *     parent must not abort (UCX 1.13's AM rendezvous, used before, could:
 *     the pieces are now read by the receiver, kv_transfer.c), its ring
 *     must come back to no slot in use, no piece waiting, with handoff 2
 *     never complete. With a count argument N, N senders in turn, killed
 *     after 0 (greeted, no piece sent yet), 1, 2, 3, 0... layers
 *     (test_kv_staged_tcp: over TCP alone, where UCX 1.13's worker-address
 *     connection setup and its emulated puts could abort the receiver; both
 *     sides then connect through the receiver's listener, kv_transfer.c).
 *     "N connecting" (by hand) kills those at 0 layers before their
 *     greeting instead, their connection still being set up: there Debian's
 *     assertion-enabled UCX 1.13.1 can abort the receiver inside its TCP
 *     transport (tcp_ep.c:478, after a refused connect back to the dead
 *     sender; seen once in a CI run of 2026-12-04, 0 in 400 such kills
 *     here, docs/operations.md), which a UCX built without assertions does
 *     not;
 *  3. sends handoff 3 into the same blocks: complete and exact, so the
 *     receiver keeps serving after a sender died mid-transfer.
 *
 * The reverse ("receivers N staged|host"): the parent is the prefill side
 * and the decode sides are children, a staged one (the ring) or a host pool
 * registered in place. A live receiver A takes handoff 1; then N receivers
 * in turn are killed (SIGKILL) at moment k % 7 of their handoff: before the
 * sender connects, after its endpoint is made, 0-3 ms into the greeting (a
 * forked killer: the greeting does not return in between), after the
 * greeting, after 1 and after 3 of the 4 layers (pieces or puts on their
 * way), before the flush. The sender must come back (every wait bounded) with UNAVAILABLE,
 * DEADLINE or TRANSPORT, no piece in flight (none still points into its
 * pool), only A's endpoint open (the dead one dropped), and a handoff to A
 * right after each kill must land exact; at the end a fresh receiver takes
 * one exactly.
 *
 * "outside N" (ctest test_kv_staged_outside: 12; by hand 40): the parent is
 * a staged receiver again; N senders in turn hand off in a loop and are
 * killed from outside (SIGKILL by the parent, 0-5 ms after their pieces
 * flow, at whatever instruction they are on), each followed by a fresh
 * sender whose handoff must land exact. With UCX's shared-memory FIFO
 * transports a kill inside UCX's write of a message into the receiver's
 * FIFO left the receiving worker unable to receive from anyone (UCX 1.13.1
 * and later: probe_ucx_sender_kill.c; 4 of 5 runs of 40); a staged
 * receiver's context now leaves them out unless UCX_TLS names them. */
#include "common/base/log.h"
#include "common/comm/msg.h"
#include "common/kv/kv_transfer.h"
#include "tests/test_io.h"

#include "tests/test_expect.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 4
#define NB 64
#define BS 16
#define NKV 2
#define HD 64
#define WINDOW 64
#define NSENT 40
#define NTOK (NSENT * BS) /* 640 positions: sliding layers need blocks 36..39 */
#define SLOTS 3
#define SLOT_BYTES ((int64_t)64 << 10)
#define GATHER 8 /* gathered pieces, one block each, into blocks 50..57 of layer 0 */

static const int sliding[L] = {1, 0, 1, 0};

static tw_kv_layout_t make_layout(void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32,
                      .n_layers = L,
                      .n_blocks = NB,
                      .block_size = BS,
                      .n_kv_heads_local = NKV,
                      .head_dim = HD,
                      .base = base};
  l.block_bytes = 2LL * NKV * BS * HD * 4;
  l.layer_stride_bytes = l.block_bytes * NB;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

/* pattern byte of handoff t, (layer, logical block j, byte b) */
static uint8_t pat(int t, int layer, int j, int64_t b) {
  return (uint8_t)(t * 101 + layer * 37 + j * 11 + b * 7 + (b >> 8) + 1);
}
static int first_of(int l) { return tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW); }

/* A prefill side: fill its pool for handoff t, send it (all of it, or
 * die after `die_after` layers, or with FLOOD again and again until it is
 * killed), report the stats. */
#define FLOOD (-2)
#define CONNECTING (-3) /* killed before its greeting, its connection being set up */
/* What a decode side published (publish), read from fd. */
typedef struct {
  size_t alen, rlen;
  uint8_t *addr, *rkey;
  tw_kv_remote_layout_t rl;
} published_t;
static int read_published(int fd, published_t *p) {
  *p = (published_t){0};
  if (tw_test_read_all(fd, &p->alen, sizeof p->alen) ||
      tw_test_read_all(fd, &p->rlen, sizeof p->rlen) || p->alen > (1 << 20) || p->rlen > (1 << 20))
    return -1;
  p->addr = malloc(p->alen ? p->alen : 1);
  p->rkey = malloc(p->rlen ? p->rlen : 1);
  return !p->addr || !p->rkey || tw_test_read_all(fd, p->addr, p->alen) ||
                 tw_test_read_all(fd, p->rkey, p->rlen) ||
                 tw_test_read_all(fd, &p->rl, sizeof p->rl)
             ? -1
             : 0;
}

/* Fill blocks of every layer of a source pool with handoff t's pattern. */
static void fill(tw_kv_layout_t *src, int t) {
  for (int l = 0; l < L; l++)
    for (int j = 0; j < NB; j++) {
      uint8_t *b = (uint8_t *)src->base + l * src->layer_stride_bytes + j * src->block_bytes;
      for (int64_t k = 0; k < src->block_bytes; k++) b[k] = pat(t, l, j, k);
    }
}

static int child(int t, int die_after, int rfd, int wfd) {
  published_t pub;
  if (read_published(rfd, &pub)) return 2;
  uint8_t *addr = pub.addr, *rkey = pub.rkey;
  size_t alen = pub.alen, rlen = pub.rlen;
  tw_kv_remote_layout_t rl = pub.rl;
  tw_kv_layout_t src = make_layout(NULL);
  src.base = calloc(1, (size_t)src.total_bytes);
  if (!src.base) return 2;
  fill(&src, t);
  int32_t ids[NSENT];
  for (int j = 0; j < NSENT; j++) ids[j] = j;
  tw_kv_xfer_t *x = NULL;
  tw_kv_peer_t *peer = NULL;
  /* transports as a prefill worker's (shared-memory FIFOs kept) */
  if (tw_kv_xfer_create_bound(NULL, true, &x) || tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer))
    return 3;
  if (tw_kv_xfer_path_to(peer, false, &rl) != TW_KV_PATH_STAGED_RECV) return 4;
  rl.handoff_tag = (uint64_t)t;
  do {
    for (int l = 0; l < L; l++) {
      if (l == die_after || (l == 0 && die_after == CONNECTING)) {
        /* at 0 layers: greeted first (connection setup over), unless
         * CONNECTING (by hand: the setup still under way) */
        if (die_after == 0 && tw_kv_xfer_greet(x, peer)) return 10;
        for (int i = 0; i < 1000; i++) tw_kv_xfer_progress(x); /* some pieces on their way */
        raise(SIGKILL);
      }
      if (tw_kv_xfer_send_layer(x, peer, &src, &rl, l, ids, ids, first_of(l), NSENT, NULL))
        return 5;
    }
    /* the gather: blocks 50..57 of layer 0 from local blocks 57..50 */
    tw_kv_seg_t segs[GATHER];
    for (int i = 0; i < GATHER; i++)
      segs[i] =
          (tw_kv_seg_t){(const char *)src.base + (int64_t)(50 + GATHER - 1 - i) * src.block_bytes,
                        src.block_bytes};
    if (tw_kv_xfer_put(x, peer, &src, &rl, segs, GATHER,
                       rl.remote_base + 50 * (uint64_t)src.block_bytes, NULL))
      return 6;
    if (tw_kv_xfer_flush(x, peer, 20000)) return 7;
  } while (die_after == FLOOD);
  tw_kv_xfer_stats_t s;
  tw_kv_xfer_stats(x, &s);
  if (tw_test_write_all(wfd, &s, sizeof s)) return 8;
  char ack;
  if (tw_test_read_all(rfd, &ack, 1)) return 9; /* keep the endpoint until the parent has checked */
  tw_kv_xfer_destroy(x);
  free(src.base);
  free(addr);
  free(rkey);
  return 0;
}

/* A decode side's pool of 0xEE bytes, its ucp worker and its region: a
 * staged ring of SLOTS x SLOT_BYTES, or (!staged) the pool registered in
 * place. 0, or -1. */
static int decode_side(bool staged, tw_kv_layout_t *pool, tw_kv_xfer_t **x, tw_kv_region_t **reg) {
  *pool = make_layout(NULL);
  pool->base = malloc((size_t)pool->total_bytes);
  if (!pool->base) return -1;
  memset(pool->base, 0xEE, (size_t)pool->total_bytes);
  tw_kv_region_params_t prm = {.staging_ring = true, .n_slots = SLOTS, .slot_bytes = SLOT_BYTES};
  /* transports as a decode worker's: the FIFOs only for puts in place */
  return tw_kv_xfer_create_bound(NULL, !staged, x) ||
                 tw_kv_region_register_ex(*x, pool, staged ? &prm : NULL, reg)
             ? -1
             : 0;
}

/* Progress the kv worker until fd is readable (tw_test_progress_until_readable). */
static void progress_xfer(void *x) { tw_kv_xfer_progress(x); }
static int wait_readable(tw_kv_xfer_t *x, int fd) {
  return tw_test_progress_until_readable(fd, progress_xfer, x);
}

/* Bytes of the pool that differ from handoff t's pattern where it was sent,
 * or from 0xEE elsewhere (with_gather: blocks 50..57 of layer 0 too). */
static int64_t wrong_bytes(const tw_kv_layout_t *pool, int t, bool with_gather) {
  int64_t bad = 0;
  for (int l = 0; l < L; l++)
    for (int b = 0; b < NB; b++) {
      const uint8_t *p =
          (const uint8_t *)pool->base + l * pool->layer_stride_bytes + b * pool->block_bytes;
      bool sent = b < NSENT && b >= first_of(l);
      bool gathered = with_gather && l == 0 && b >= 50 && b < 50 + GATHER;
      for (int64_t k = 0; k < pool->block_bytes; k++) {
        uint8_t want = sent       ? pat(t, l, b, k)
                       : gathered ? pat(t, l, 50 + GATHER - 1 - (b - 50), k)
                                  : 0xEE;
        bad += p[k] != want;
      }
    }
  return bad;
}

/* This program again as a child (a fresh process, exec: UCX state does not
 * survive fork), "test_kv_staged ROLE A B RFD WFD": pipes to and from it. */
static pid_t spawn_self(const char *role, int a, int b, int *to_child, int *from_child) {
  int p2c[2], c2p[2];
  /* close-on-exec: a later child must not hold this one's pipes open */
  if (pipe2(p2c, O_CLOEXEC) || pipe2(c2p, O_CLOEXEC)) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(p2c[1]);
    close(c2p[0]);
    fcntl(p2c[0], F_SETFD, 0); /* its own ends stay */
    fcntl(c2p[1], F_SETFD, 0);
    char v[4][16];
    snprintf(v[0], sizeof v[0], "%d", a);
    snprintf(v[1], sizeof v[1], "%d", b);
    snprintf(v[2], sizeof v[2], "%d", p2c[0]);
    snprintf(v[3], sizeof v[3], "%d", c2p[1]);
    execl("/proc/self/exe", "test_kv_staged", role, v[0], v[1], v[2], v[3], (char *)NULL);
    _exit(127);
  }
  close(p2c[0]);
  close(c2p[1]);
  *to_child = p2c[1];
  *from_child = c2p[0];
  return pid;
}

/* What a decode side publishes (its address, the rkey, the layout), to fd. */
static int publish(int fd, tw_kv_xfer_t *x, tw_kv_region_t *reg) {
  size_t alen, rlen;
  const void *addr = tw_kv_xfer_address(x, &alen);
  const void *rkey = tw_kv_region_rkey(reg, &rlen);
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(reg, &rl);
  return tw_test_write_all(fd, &alen, sizeof alen) || tw_test_write_all(fd, &rlen, sizeof rlen) ||
                 tw_test_write_all(fd, addr, alen) || tw_test_write_all(fd, rkey, rlen) ||
                 tw_test_write_all(fd, &rl, sizeof rl)
             ? -1
             : 0;
}

/* One prefill child for handoff t, given our address and the region's. */
static pid_t spawn(int t, int die_after, tw_kv_xfer_t *x, tw_kv_region_t *reg, int *to_child,
                   int *from_child) {
  pid_t pid = spawn_self("child", t, die_after, to_child, from_child);
  return pid > 0 && publish(*to_child, x, reg) == 0 ? pid : -1;
}

/* ---- the reverse: decode sides killed under a live prefill side ---- */

/* A decode side: a pool of 0xEE, a staged ring or registered in place,
 * published to wfd; then, progressing its worker (a staged receiver grants
 * and copies only then), it answers each handoff tag read from rfd with the
 * wrong bytes of that handoff once it landed (-1: it did not within 10 s),
 * until EOF (exit 0) or 300 s (exit 4). */
static int receiver(bool staged, int rfd, int wfd) {
  tw_kv_layout_t pool;
  tw_kv_xfer_t *x = NULL;
  tw_kv_region_t *reg = NULL;
  if (decode_side(staged, &pool, &x, &reg)) return 3;
  if (publish(wfd, x, reg)) return 2;
  int32_t ids[NSENT], firsts[L];
  for (int j = 0; j < NSENT; j++) ids[j] = j;
  for (int l = 0; l < L; l++) firsts[l] = first_of(l);
  int rc = 4;
  for (int64_t until = tw_msg_clock_ns() + 300 * 1000000000LL; tw_msg_clock_ns() < until;) {
    tw_kv_xfer_progress(x);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(rfd, &fds);
    struct timeval tv = {0, 100};
    if (select(rfd + 1, &fds, NULL, NULL, &tv) <= 0) continue;
    uint64_t tag;
    if (tw_test_read_all(rfd, &tag, sizeof tag)) {
      rc = 0; /* EOF: done */
      break;
    }
    int64_t bad = -1;
    if (tw_kv_region_commit(reg, tag, ids, NSENT, firsts, 10000) == TW_OK)
      bad = wrong_bytes(&pool, (int)tag, false);
    if (tw_test_write_all(wfd, &bad, sizeof bad)) return 2;
  }
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  free(pool.base);
  return rc;
}

/* A decode side as the prefill side sees it. */
typedef struct {
  pid_t pid;
  int to, from;
  published_t pub;
} rx_t;

static int rx_start(bool staged, rx_t *rx) {
  rx->pid = spawn_self("receiver", staged, 0, &rx->to, &rx->from);
  return rx->pid > 0 && read_published(rx->from, &rx->pub) == 0 ? 0 : -1;
}

/* SIGKILL, then wait until it is dead (a zombie: not reaped, as a decode
 * worker whose parent has not looked yet). */
static void rx_kill(rx_t *rx) {
  kill(rx->pid, SIGKILL);
  siginfo_t si;
  while (waitid(P_PID, (id_t)rx->pid, &si, WEXITED | WNOWAIT) < 0 && errno == EINTR) {}
}

/* The wrong bytes of handoff t in rx's pool (-1: it never landed). */
static int64_t rx_check(rx_t *rx, int t) {
  uint64_t tag = (uint64_t)t;
  int64_t bad = -2;
  if (tw_test_write_all(rx->to, &tag, sizeof tag) || tw_test_read_all(rx->from, &bad, sizeof bad))
    return -2;
  return bad;
}

/* EOF to a live receiver, then its exit status (-1 when it did not exit
 * cleanly); a killed one is reaped. */
static int rx_end(rx_t *rx) {
  close(rx->to);
  int st = 0;
  waitpid(rx->pid, &st, 0);
  close(rx->from);
  free(rx->pub.addr);
  free(rx->pub.rkey);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

enum {
  K_NONE = -1,
  K_BEFORE_CONNECT,
  K_CONNECTED,
  K_GREETING,
  K_GREETED,
  K_LAYER1,
  K_LAYER3,
  K_FLUSH,
  K_N
};
static const char *const k_name[K_N] = {"before the sender connects",
                                        "after its endpoint is made",
                                        "0-3 ms into the greeting",
                                        "after the greeting",
                                        "after 1 of 4 layers",
                                        "after 3 of 4 layers",
                                        "before the flush"};

/* Kill rx after delay_us from now, from a forked process (it only sleeps
 * and kills: nothing of UCX runs in it), while this one goes on: a kill
 * inside a call that does not return in between (the greeting). */
static pid_t rx_kill_later(rx_t *rx, int delay_us) {
  pid_t k = fork();
  if (k == 0) {
    usleep((useconds_t)delay_us);
    kill(rx->pid, SIGKILL);
    _exit(0);
  }
  return k;
}

/* Handoff t of src's blocks 0..NSENT-1 into rx as a prefill worker makes
 * it (connect, greet, a layer at a time, flush), rx killed at moment k
 * (K_GREETING: delay_us into the greeting). */
static tw_status_t handoff_to(tw_kv_xfer_t *x, rx_t *rx, tw_kv_layout_t *src, int t, int k,
                              int delay_us) {
  int32_t ids[NSENT];
  for (int j = 0; j < NSENT; j++) ids[j] = j;
  fill(src, t);
  tw_kv_remote_layout_t rl = rx->pub.rl;
  rl.handoff_tag = (uint64_t)t;
  if (k == K_BEFORE_CONNECT) rx_kill(rx);
  tw_kv_peer_t *peer = NULL;
  tw_status_t st =
      tw_kv_xfer_peer(x, rx->pub.addr, rx->pub.alen, rx->pub.rkey, rx->pub.rlen, &peer);
  if (k == K_CONNECTED) rx_kill(rx);
  pid_t killer = k == K_GREETING ? rx_kill_later(rx, delay_us) : -1;
  if (st == TW_OK) st = tw_kv_xfer_greet(x, peer); /* as tw_handoff_connect does */
  if (killer > 0) {                                /* from here on it is dead */
    waitpid(killer, NULL, 0);
    rx_kill(rx);
  }
  for (int l = 0; l < L && st == TW_OK; l++) {
    if ((k == K_GREETED && l == 0) || (k == K_LAYER1 && l == 1) || (k == K_LAYER3 && l == 3))
      rx_kill(rx);
    st = tw_kv_xfer_send_layer(x, peer, src, &rl, l, ids, ids, first_of(l), NSENT, NULL);
  }
  if (k == K_FLUSH) rx_kill(rx);
  if (st == TW_OK) st = tw_kv_xfer_flush(x, peer, 5000);
  return st;
}

static int reverse(int n_kills, bool staged) {
  tw_kv_layout_t src = make_layout(NULL);
  src.base = calloc(1, (size_t)src.total_bytes);
  tw_kv_xfer_t *x = NULL;
  if (!src.base || tw_kv_xfer_create_bound(NULL, true, &x)) return 1; /* as a prefill worker */
  const char *mode = staged ? "staged receiver" : "host pool registered in place";
  rx_t a;
  EXPECT(rx_start(staged, &a) == 0, "receiver A (%s) up", mode);
  EXPECT(handoff_to(x, &a, &src, 1, K_NONE, 0) == TW_OK, "handoff 1 to A: %s", tw_last_error());
  EXPECT(rx_check(&a, 1) == 0, "handoff 1 exact in A");
  int failed_as[3] = {0, 0, 0}; /* UNAVAILABLE, DEADLINE, TRANSPORT */
  for (int i = 0; i < n_kills; i++) {
    int k = i % K_N, t = 100 + i;
    rx_t b;
    EXPECT(rx_start(staged, &b) == 0, "receiver %d up", i);
    int64_t t0 = tw_msg_clock_ns();
    tw_status_t st = handoff_to(x, &b, &src, t, k, (i * 397) % 3000);
    double secs = (double)(tw_msg_clock_ns() - t0) * 1e-9;
    char msg[256];
    snprintf(msg, sizeof msg, "%s", st == TW_OK ? "" : tw_last_error());
    int rc = rx_end(&b);
    printf("receiver %d killed %s: %s after %.2f s (%s)\n", i, k_name[k], tw_status_str(st), secs,
           msg);
    EXPECT(rc == -1, "receiver %d was killed (exit %d)", i, rc);
    EXPECT(st == TW_ERR_UNAVAILABLE || st == TW_ERR_DEADLINE || st == TW_ERR_TRANSPORT,
           "the handoff to receiver %d killed %s fails clearly (%s: %s)", i, k_name[k],
           tw_status_str(st), msg);
    failed_as[st == TW_ERR_UNAVAILABLE ? 0 : st == TW_ERR_DEADLINE ? 1 : 2]++;
    tw_kv_xfer_stats_t s;
    tw_kv_xfer_stats(x, &s);
    EXPECT(s.pieces_in_flight == 0, "after receiver %d: %d pieces still in flight", i,
           s.pieces_in_flight);
    EXPECT(s.endpoints == 1, "after receiver %d: %d endpoints open, want A's alone", i,
           s.endpoints);
    /* the sender keeps serving: the same local blocks into the live A */
    EXPECT(handoff_to(x, &a, &src, t + 50, K_NONE, 0) == TW_OK,
           "after receiver %d: a handoff to A: %s", i, tw_last_error());
    EXPECT(rx_check(&a, t + 50) == 0, "after receiver %d: that handoff exact in A", i);
  }
  printf("%d killed receivers (%s): %d UNAVAILABLE, %d DEADLINE, %d TRANSPORT\n", n_kills, mode,
         failed_as[0], failed_as[1], failed_as[2]);
  rx_t c;
  EXPECT(rx_start(staged, &c) == 0, "fresh receiver C up");
  EXPECT(handoff_to(x, &c, &src, 3, K_NONE, 0) == TW_OK, "handoff 3 to C: %s", tw_last_error());
  EXPECT(rx_check(&c, 3) == 0, "handoff 3 exact in C");
  tw_kv_xfer_stats_t s;
  tw_kv_xfer_stats(x, &s);
  EXPECT(s.pieces_in_flight == 0 && s.endpoints == 2,
         "at the end: %d pieces in flight, %d "
         "endpoints open (A and C)",
         s.pieces_in_flight, s.endpoints);
  EXPECT(rx_end(&a) == 0 && rx_end(&c) == 0, "A and C end cleanly");
  tw_kv_xfer_destroy(x);
  free(src.base);
  return tw_test_exit("test_kv_staged receivers");
}

/* ---- senders killed from outside while they hand off ---- */

/* "outside N": N senders in turn are killed (SIGKILL, by this process: at any
 * instruction, as a prefill worker killed by an operator or the OOM killer)
 * 0-5 ms after their pieces flow, each followed by a fresh sender whose whole
 * handoff must land exact. A sender killed while writing a message into the
 * receiving worker's shared-memory FIFO left UCX unable to deliver anything
 * to that worker again (probe_ucx_sender_kill.c): the receiver here, as a
 * decode worker on the staged ring, has no such transport (decode_side). */
static int outside_kills(int n_kills) {
  tw_kv_layout_t pool;
  tw_kv_xfer_t *x = NULL;
  tw_kv_region_t *reg = NULL;
  if (decode_side(true, &pool, &x, &reg)) return 1;
  int32_t ids[NSENT], firsts[L], gids[GATHER];
  for (int j = 0; j < NSENT; j++) ids[j] = j;
  for (int j = 0; j < GATHER; j++) gids[j] = 50 + j;
  const int32_t gfirsts[L] = {0, GATHER, GATHER, GATHER};
  for (int l = 0; l < L; l++) firsts[l] = first_of(l);
  srand((unsigned)getpid());
  int blocked = 0;
  for (int k = 0; k < n_kills && blocked < 2; k++) {
    int to = -1, from = -1;
    tw_kv_rxring_stats_t rs;
    EXPECT(tw_kv_region_staging_stats(reg, &rs), "staging stats");
    int64_t before = rs.pieces;
    pid_t pid = spawn(200 + k, FLOOD, x, reg, &to, &from);
    EXPECT(pid > 0, "flooding sender %d started", k);
    int64_t until = tw_msg_clock_ns() + 20 * 1000000000LL;
    while (rs.pieces - before < 8 && tw_msg_clock_ns() < until) { /* in full flow */
      tw_kv_xfer_progress(x);
      TW_IGNORE(tw_kv_region_landed(reg, 0, ids, 1, NULL)); /* pumps the ring */
      tw_kv_region_staging_stats(reg, &rs);
    }
    int delay_us = rand() % 5000;
    for (int64_t at = tw_msg_clock_ns() + delay_us * 1000LL; tw_msg_clock_ns() < at;)
      tw_kv_xfer_progress(x);
    kill(pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
    close(to);
    close(from);
    /* its slots come back (its pid is checked every 20 ms) and the worker
     * can sleep again: UCX arms its event fd (it does not while a message
     * is announced in its receive FIFO and not yet readable) */
    bool armed = false;
    until = tw_msg_clock_ns() + 10 * 1000000000LL;
    while (!armed && tw_msg_clock_ns() < until) {
      tw_kv_xfer_progress(x);
      TW_IGNORE(tw_kv_region_landed(reg, 0, ids, 1, NULL));
      tw_kv_region_staging_stats(reg, &rs);
      armed = rs.slots_in_use == 0 && tw_kv_xfer_wait_fd(x) >= 0;
      usleep(200);
    }
    /* a fresh sender: one whole handoff (its greeting waits 10 s at most) */
    int t = 100 + k;
    int64_t t0 = tw_msg_clock_ns();
    pid = spawn(t, -1, x, reg, &to, &from);
    tw_kv_xfer_stats_t s;
    bool reported = pid > 0 && wait_readable(x, from) && tw_test_read_all(from, &s, sizeof s) == 0;
    bool landed = reported &&
                  tw_kv_region_commit(reg, (uint64_t)t, ids, NSENT, firsts, 10000) == TW_OK &&
                  tw_kv_region_commit(reg, (uint64_t)t, gids, GATHER, gfirsts, 10000) == TW_OK &&
                  wrong_bytes(&pool, t, true) == 0;
    if (reported) TW_IGNORE(tw_test_write_all(to, "k", 1)); /* else it is gone: no SIGPIPE */
    int cst = 0;
    waitpid(pid, &cst, 0);
    close(to);
    close(from);
    printf(
        "sender %d killed %.1f ms into its flow (%s), then the receiver %s; the next sender's "
        "handoff: %s after %.2f s (its exit %d)\n",
        k, delay_us / 1000.0, WIFSIGNALED(st) ? "SIGKILL" : "exited first",
        armed ? "idle (armed)" : "NEVER ARMED in 10 s (a message announced, never readable)",
        landed ? "landed exact" : "DID NOT LAND", (double)(tw_msg_clock_ns() - t0) * 1e-9,
        WIFEXITED(cst) ? WEXITSTATUS(cst) : -1);
    EXPECT(landed, "after sender %d killed from outside: the next sender's handoff landed", k);
    blocked += !landed;
  }
  printf("senders killed from outside: %d of the following handoffs did not land\n", blocked);
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  free(pool.base);
  return tw_test_exit("test_kv_staged outside");
}

int main(int argc, char **argv) {
  tw_log_init("test_kv_staged", 0);
  setvbuf(stdout, NULL, _IOLBF, 0); /* lines in order with the log's */
  if (argc == 6 && strcmp(argv[1], "child") == 0)
    return child(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
  if (argc == 3 && strcmp(argv[1], "outside") == 0) {
    int n = atoi(argv[2]);
    if (n < 1 || n > 100) {
      fprintf(stderr, "usage: test_kv_staged outside 1..100\n");
      return 2;
    }
    return outside_kills(n);
  }
  if (argc == 6 && strcmp(argv[1], "receiver") == 0)
    return receiver(atoi(argv[2]) != 0, atoi(argv[4]), atoi(argv[5]));
  if (argc == 4 && strcmp(argv[1], "receivers") == 0) {
    int n = atoi(argv[2]);
    if (n < 1 || n > 100 || (strcmp(argv[3], "staged") && strcmp(argv[3], "host"))) {
      fprintf(stderr, "usage: test_kv_staged receivers 1..100 staged|host\n");
      return 2;
    }
    return reverse(n, strcmp(argv[3], "staged") == 0);
  }
  /* senders killed in phase 2; "connecting": those at 0 layers before their greeting */
  int n_kills = argc >= 2 ? atoi(argv[1]) : 1;
  bool connecting = argc == 3 && strcmp(argv[2], "connecting") == 0;
  if (n_kills < 1 || n_kills > 100 || (argc == 3 && !connecting) || argc > 3) {
    fprintf(stderr, "usage: test_kv_staged [senders to kill, 1..100 [connecting]]\n");
    return 2;
  }
  tw_kv_layout_t pool;
  tw_kv_xfer_t *x = NULL;
  tw_kv_region_t *reg = NULL;
  if (decode_side(true, &pool, &x, &reg)) return 1;
  size_t rlen = 0;
  tw_kv_region_rkey(reg, &rlen);
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(reg, &rl);
  EXPECT(rlen > 0 && rl.staging_slot_bytes == SLOT_BYTES,
         "staged: the ring's rkey (%zu bytes), slots of %lld bytes published", rlen,
         (long long)rl.staging_slot_bytes);
  int32_t ids[NSENT], firsts[L], gids[GATHER];
  for (int j = 0; j < NSENT; j++) ids[j] = j;
  for (int j = 0; j < GATHER; j++) gids[j] = 50 + j;
  const int32_t gfirsts[L] = {0, GATHER, GATHER, GATHER}; /* layer 0 only */
  for (int l = 0; l < L; l++) firsts[l] = first_of(l);
  int64_t want_bytes = (int64_t)GATHER * pool.block_bytes;
  for (int l = 0; l < L; l++) want_bytes += (int64_t)(NSENT - first_of(l)) * pool.block_bytes;

  /* 1: a whole handoff */
  int to = -1, from = -1;
  pid_t pid = spawn(1, -1, x, reg, &to, &from);
  tw_kv_xfer_stats_t s = {0};
  int ok = pid > 0 && wait_readable(x, from) && tw_test_read_all(from, &s, sizeof s) == 0;
  EXPECT(ok, "handoff 1 reported");
  EXPECT(tw_kv_region_landed(reg, 2, ids, NSENT, firsts) == TW_INPROGRESS,
         "handoff 2 is not there");
  EXPECT(tw_kv_region_commit(reg, 1, ids, NSENT, firsts, 10000) == TW_OK &&
             tw_kv_region_commit(reg, 1, gids, GATHER, gfirsts, 10000) == TW_OK,
         "handoff 1 landed");
  EXPECT(wrong_bytes(&pool, 1, true) == 0, "handoff 1: %lld wrong bytes",
         (long long)wrong_bytes(&pool, 1, true));
  tw_kv_rxring_stats_t rs;
  EXPECT(tw_kv_region_staging_stats(reg, &rs), "staging stats");
  printf(
      "handoff 1: %lld bytes in %lld pieces (%lld sent as pieces), %lld waits for a slot, peak %d "
      "slots\n",
      (long long)rs.bytes_landed, (long long)rs.pieces, (long long)s.ring_bytes,
      (long long)rs.full_waits, rs.slots_peak);
  EXPECT(s.bytes_sent == want_bytes && s.ring_bytes == want_bytes,
         "sent %lld bytes as pieces (%lld), want %lld", (long long)s.bytes_sent,
         (long long)s.ring_bytes, (long long)want_bytes);
  EXPECT(rs.bytes_landed == want_bytes, "copied out of the ring: %lld, want %lld",
         (long long)rs.bytes_landed, (long long)want_bytes);
  /* full layers: 40 blocks = 640 KiB = 10 pieces; sliding: 4 blocks = 1 piece; gather: 2 pieces */
  EXPECT(rs.pieces == 2 * 10 + 2 * 1 + 2 && s.puts == rs.pieces,
         "pieces: %lld received, %lld sent, want 24", (long long)rs.pieces, (long long)s.puts);
  EXPECT(rs.full_waits > 0 && rs.slots_peak <= SLOTS,
         "back-pressure: %lld waits, peak %d of %d slots", (long long)rs.full_waits, rs.slots_peak,
         SLOTS);
  EXPECT(rs.slots_in_use == 0 && rs.pieces_failed == 0, "ring idle, nothing failed");
  TW_IGNORE(tw_test_write_all(to, "k", 1)); /* the child ends either way */
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child 1 exit %d",
         WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close(to);
  close(from);

  /* 2: senders killed mid-handoff: after 2 of their 4 layers, or (with a
   * count argument) one after another after 0 (while connecting), 1, 2, 3,
   * 0... layers */
  for (int kill = 0; kill < n_kills; kill++) {
    int die_after = n_kills == 1 ? 2 : kill % L;
    if (die_after == 0 && connecting) die_after = CONNECTING;
    const int layers = die_after == CONNECTING ? 0 : die_after; /* for the messages */
    pid = spawn(2, die_after, x, reg, &to, &from);
    st = 0;
    /* bounded in time (60 s), not in calls: a loaded machine runs the child slowly */
    int64_t until = tw_msg_clock_ns() + 60 * 1000000000LL;
    int64_t pieces_before = rs.pieces;
    while (pid > 0 && waitpid(pid, &st, WNOHANG) == 0 && tw_msg_clock_ns() < until) {
      tw_kv_xfer_progress(x);
      usleep(50);
    }
    EXPECT(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
           "killed sender %d (after %d layers) was killed mid-transfer (exit %d)", kill, layers,
           WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    /* every slot freed and no piece left waiting, within 10 s (the receiver
     * checks a dead local sender's pid every 20 ms) */
    int in_use = -1;
    until = tw_msg_clock_ns() + 10 * 1000000000LL;
    while (tw_msg_clock_ns() < until) {
      tw_kv_xfer_progress(x);
      TW_IGNORE(tw_kv_region_landed(reg, 2, ids, NSENT, firsts)); /* pumps the ring */
      EXPECT(tw_kv_region_staging_stats(reg, &rs), "staging stats");
      in_use = rs.slots_in_use;
      if (in_use == 0 && tw_kv_xfer_wait_fd(x) >= 0) break; /* idle: nothing waits either */
      usleep(200);
    }
    EXPECT(in_use == 0, "after the killed sender: %d slots still in use", in_use);
    EXPECT(tw_kv_xfer_wait_fd(x) >= 0, "after the killed sender: pieces still waiting");
    printf(
        "handoff 2 (sender %d killed after %d layers): %lld pieces copied before it died, %lld "
        "failed so far\n",
        kill, layers, (long long)(rs.pieces - pieces_before), (long long)rs.pieces_failed);
    EXPECT(tw_kv_region_landed(reg, 2, ids, NSENT, firsts) == TW_INPROGRESS,
           "handoff 2 never completes");
    close(to);
    close(from);
  }

  /* 3: the receiver keeps serving */
  pid = spawn(3, -1, x, reg, &to, &from);
  ok = pid > 0 && wait_readable(x, from) && tw_test_read_all(from, &s, sizeof s) == 0;
  EXPECT(ok, "handoff 3 reported");
  EXPECT(tw_kv_region_commit(reg, 3, ids, NSENT, firsts, 10000) == TW_OK &&
             tw_kv_region_commit(reg, 3, gids, GATHER, gfirsts, 10000) == TW_OK,
         "handoff 3 landed");
  EXPECT(wrong_bytes(&pool, 3, true) == 0, "handoff 3: %lld wrong bytes",
         (long long)wrong_bytes(&pool, 3, true));
  EXPECT(tw_kv_region_landed(reg, 1, ids, NSENT, firsts) == TW_INPROGRESS,
         "handoff 1 no longer counts");
  TW_IGNORE(tw_test_write_all(to, "k", 1));
  st = 0;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child 3 exit %d",
         WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  close(to);
  close(from);
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  free(pool.base);
  return tw_test_exit("test_kv_staged");
}
