/* test_kv_reshard.c: KV re-sharding in the handoff for every pair of prefill
 * TP p and decode TP d in {1, 2, 4, 8} (issue 6 item 3), over UCX between
 * two processes on loopback.
 *
 * For each (p, d): the parent is the decode side, d pools (one UCX worker and
 * registered region each, heads [r NKV/d, (r+1) NKV/d)), filled with 0xEE; a
 * forked child is the prefill side, p pools (one UCX worker each, heads
 * [r NKV/p, ...)) filled with a pattern that names (layer, logical block, k|v,
 * global head, byte). Every prefill rank puts its heads into every decode
 * rank that holds them (tw_kv_reshard_send_layer), full and sliding layers
 * (the window's blocks only), flushes, and reports the per-head checksums of
 * what it sent and its byte count. The parent checks: every byte of every
 * decode pool is the pattern of the head it holds where a block was sent and
 * 0xEE everywhere else; the per-head checksums of each decode pool equal the
 * prefill side's; the bytes put are exactly the sent blocks' bytes. Twice:
 * with scattered block ids (every block its own run), and with ids
 * consecutive on both sides, where the number of puts is checked: one per
 * layer when both pools hold the same heads, one (gathered) per layer when
 * the decode pool holds fewer, 2 per block when it holds more (its K and V
 * runs lie apart). A third time, scattered ids again, with every decode pool
 * a staged receiver (kv_transfer.h: no rkey, pieces of at most one 1 KiB slot
 * fetched into a ring of 3 slots, copied into the pool, here by memcpy):
 * every pool is checked only once the handoff has landed in it, and the
 * bytes copied out of the rings must equal the bytes put, piece for piece. */
#include "common/base/log.h"
#include "common/kv/kv_reshard.h"
#include "tests/test_io.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 2
#define NB 12
#define BS 4
#define NKV 8
#define HD 8
#define WINDOW 8
#define NTOK 19 /* 5 blocks; the sliding layer needs positions >= 11: blocks 2..4 */
#define NSENT 5

#include "tests/test_expect.h"

static const int32_t scattered_dst[NSENT] = {7, 3, 11, 0, 5};
static const int32_t scattered_src[NSENT] = {1, 2, 3, 4, 6};
static const int32_t run_dst[NSENT] = {3, 4, 5, 6, 7};
static const int32_t run_src[NSENT] = {1, 2, 3, 4, 5};
static const int32_t *dst_ids = scattered_dst, *src_ids = scattered_src;
static int staged; /* the decode pools receive through a bounce ring */
#define TAG 5      /* the handoff's tag (a request id) */
static const int sliding[L] = {1, 0};
#define HEAD_BYTES ((int64_t)BS * HD * 4)

static tw_kv_layout_t layout_of(int32_t nh, int32_t off, void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32, .n_layers = L, .n_blocks = NB, .block_size = BS,
                      .n_kv_heads_local = nh, .kv_head_offset = off, .head_dim = HD,
                      .base = base};
  l.block_bytes = 2LL * nh * HEAD_BYTES;
  l.layer_stride_bytes = l.block_bytes * NB;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

static uint8_t pat(int layer, int j, int kv, int g, int64_t k) {
  return (uint8_t)(layer * 37 + j * 11 + kv * 5 + g * 13 + k * 7 + 1);
}


/* The prefill side: p ranks (one UCX worker each) put into d decode ranks. */
static int child(int p, int d, int rfd, int wfd) {
  uint8_t *addr[8], *rkey[8];
  size_t alen[8], rlen[8];
  tw_kv_remote_layout_t rl[8];
  int32_t roff[8];
  for (int r = 0; r < d; r++) {
    if (tw_test_read_all(rfd, &alen[r], sizeof alen[r]) || tw_test_read_all(rfd, &rlen[r], sizeof rlen[r])) return 2;
    addr[r] = malloc(alen[r]);
    rkey[r] = malloc(rlen[r]);
    if (tw_test_read_all(rfd, addr[r], alen[r]) || tw_test_read_all(rfd, rkey[r], rlen[r]) || tw_test_read_all(rfd, &rl[r], sizeof rl[r]) ||
        tw_test_read_all(rfd, &roff[r], sizeof roff[r]))
      return 2;
  }
  uint64_t sums[L * NKV];
  int64_t bytes = 0, puts = 0;
  tw_kv_xfer_t *x[8] = {0};
  tw_kv_layout_t src[8];
  for (int s = 0; s < p; s++) {
    int nh = NKV / p, off = s * nh;
    src[s] = layout_of(nh, off, NULL);
    src[s].base = calloc(1, (size_t)src[s].total_bytes);
    for (int l = 0; l < L; l++)
      for (int j = 0; j < NSENT; j++)
        for (int kv = 0; kv < 2; kv++)
          for (int g = 0; g < nh; g++) {
            uint8_t *b = (uint8_t *)src[s].base + l * src[s].layer_stride_bytes +
                         src_ids[j] * src[s].block_bytes + (kv * nh + g) * HEAD_BYTES;
            for (int64_t k = 0; k < HEAD_BYTES; k++) b[k] = pat(l, j, kv, off + g, k);
          }
    if (tw_kv_xfer_create_bound(NULL, true, &x[s])) return 3; /* as a prefill worker's */
    for (int r = 0; r < d; r++) {
      rl[r].handoff_tag = TAG;
      tw_kv_peer_t *peer = NULL;
      if (tw_kv_xfer_peer(x[s], addr[r], alen[r], rkey[r], rlen[r], &peer)) return 3;
      for (int l = 0; l < L; l++) {
        int first = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
        if (tw_kv_reshard_send_layer(x[s], peer, &src[s], &rl[r], roff[r], l, src_ids, dst_ids,
                                     first, NSENT, &bytes))
          return 4;
      }
      if (tw_kv_xfer_flush(x[s], peer, 10000)) return 5;
    }
    for (int l = 0; l < L; l++) {
      uint64_t hs[NKV];
      int first = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
      if (tw_kv_head_checksums(&src[s], l, src_ids, first, NSENT, hs)) return 6;
      for (int g = 0; g < nh; g++) sums[l * NKV + off + g] = hs[g];
    }
    tw_kv_xfer_stats_t st;
    tw_kv_xfer_stats(x[s], &st);
    puts += st.puts;
  }
  if (tw_test_write_all(wfd, sums, sizeof sums) || tw_test_write_all(wfd, &bytes, sizeof bytes) ||
      tw_test_write_all(wfd, &puts, sizeof puts))
    return 7;
  char ack;
  if (tw_test_read_all(rfd, &ack, 1)) return 8; /* keep the endpoints until the parent has checked */
  for (int s = 0; s < p; s++) {
    tw_kv_xfer_destroy(x[s]);
    free(src[s].base);
  }
  return 0;
}

static void run_pair(int p, int d) {
  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) {
    EXPECT(0, "pipe");
    return;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(p2c[1]);
    close(c2p[0]);
    _exit(child(p, d, p2c[0], c2p[1]));
  }
  close(p2c[0]);
  close(c2p[1]);
  tw_kv_xfer_t *x[8] = {0};
  tw_kv_region_t *reg[8] = {0};
  tw_kv_layout_t pool[8];
  for (int r = 0; r < d; r++) {
    int nh = NKV / d;
    int32_t off = r * nh;
    pool[r] = layout_of(nh, off, NULL);
    pool[r].base = malloc((size_t)pool[r].total_bytes);
    memset(pool[r].base, 0xEE, (size_t)pool[r].total_bytes);
    tw_kv_region_params_t prm = {.staging_ring = staged, .n_slots = 3, .slot_bytes = 1024};
    if (tw_kv_xfer_create_bound(NULL, !staged, &x[r]) ||
        tw_kv_region_register_ex(x[r], &pool[r], &prm, &reg[r])) {
      EXPECT(0, "decode rank %d: ucx setup", r);
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
      return;
    }
    size_t alen, rlen;
    const void *addr = tw_kv_xfer_address(x[r], &alen);
    const void *rkey = tw_kv_region_rkey(reg[r], &rlen);
    tw_kv_remote_layout_t rl;
    tw_kv_region_remote_layout(reg[r], &rl);
    tw_test_write_all(p2c[1], &alen, sizeof alen);
    tw_test_write_all(p2c[1], &rlen, sizeof rlen);
    tw_test_write_all(p2c[1], addr, alen);
    tw_test_write_all(p2c[1], rkey, rlen);
    tw_test_write_all(p2c[1], &rl, sizeof rl);
    tw_test_write_all(p2c[1], &off, sizeof off);
  }
  int ok = 0;
  for (int it = 0; it < 200000 && !ok; it++) { /* bounded: 200000 x 100 us at most */
    for (int r = 0; r < d; r++) tw_kv_xfer_progress(x[r]);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(c2p[0], &fds);
    struct timeval tv = {0, 100};
    if (select(c2p[0] + 1, &fds, NULL, NULL, &tv) > 0) ok = 1;
  }
  uint64_t sums[L * NKV];
  int64_t bytes = -1, puts = -1;
  if (!ok || tw_test_read_all(c2p[0], sums, sizeof sums) || tw_test_read_all(c2p[0], &bytes, sizeof bytes) ||
      tw_test_read_all(c2p[0], &puts, sizeof puts)) {
    EXPECT(0, "p=%d d=%d: the prefill side did not report", p, d);
    kill(pid, SIGKILL);
  } else {
    int64_t want_bytes = 0, want_puts = 0, landed = 0, pieces = 0;
    int bad_bytes = 0, bad_sums = 0;
    for (int r = 0; r < d && staged; r++) { /* staged: once every piece is in the pool */
      int32_t firsts[L];
      for (int l = 0; l < L; l++) firsts[l] = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
      EXPECT(tw_kv_region_commit(reg[r], TAG, dst_ids, NSENT, firsts, 10000) == TW_OK,
             "p=%d d=%d: the handoff landed in decode rank %d", p, d, r);
      tw_kv_rxring_stats_t rs;
      EXPECT(tw_kv_region_staging_stats(reg[r], &rs) && rs.slots_in_use == 0 && rs.slots_peak <= 3,
             "p=%d d=%d rank %d: ring idle", p, d, r);
      landed += rs.bytes_landed;
      pieces += rs.pieces;
    }
    for (int l = 0; l < L; l++) {
      int first = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
      int64_t nk = NSENT - first;
      want_bytes += nk * 2 * NKV * HEAD_BYTES;
      /* max(p, d) (prefill rank, decode rank) pairs share heads */
      int pairs = p > d ? p : d;
      if (src_ids == run_src) want_puts += pairs * (p > d ? 2 * nk : 1);
      else want_puts += pairs * (p > d ? 2 * nk : nk);
      for (int r = 0; r < d; r++) {
        int nh = NKV / d, off = r * nh;
        for (int b = 0; b < NB; b++) {
          int j = -1;
          for (int q = 0; q < NSENT; q++)
            if (dst_ids[q] == b) j = q;
          for (int kv = 0; kv < 2; kv++)
            for (int g = 0; g < nh; g++) {
              const uint8_t *h = (const uint8_t *)pool[r].base + l * pool[r].layer_stride_bytes +
                                 b * pool[r].block_bytes + (kv * nh + g) * HEAD_BYTES;
              for (int64_t k = 0; k < HEAD_BYTES; k++)
                bad_bytes += h[k] != (j >= first ? pat(l, j, kv, off + g, k) : 0xEE);
            }
        }
        uint64_t hs[NKV];
        EXPECT(tw_kv_head_checksums(&pool[r], l, dst_ids, first, NSENT, hs) == TW_OK, "checksums");
        for (int g = 0; g < nh; g++) bad_sums += hs[g] != sums[l * NKV + off + g];
      }
    }
    printf(
        "prefill TP %d -> decode TP %d (%s ids%s): %lld bytes put (%lld expected) in %lld puts "
        "(%lld expected), %d wrong bytes, %d of %d head checksums differ\n",
        p, d, src_ids == run_src ? "consecutive" : "scattered", staged ? ", staged" : "",
        (long long)bytes, (long long)want_bytes, (long long)puts, (long long)want_puts, bad_bytes,
        bad_sums, L * NKV);
    if (staged) { /* pieces of at most a slot: more than puts */
      EXPECT(landed == want_bytes && pieces == puts && puts >= want_puts,
             "p=%d d=%d staged: %lld bytes landed (want %lld), %lld pieces landed of %lld sent", p,
             d, (long long)landed, (long long)want_bytes, (long long)pieces, (long long)puts);
    } else {
      EXPECT(puts == want_puts, "p=%d d=%d: %lld puts, expected %lld", p, d, (long long)puts,
             (long long)want_puts);
    }
    EXPECT(bytes == want_bytes, "p=%d d=%d: bytes %lld != %lld", p, d, (long long)bytes,
           (long long)want_bytes);
    EXPECT(bad_bytes == 0, "p=%d d=%d: %d wrong bytes", p, d, bad_bytes);
    EXPECT(bad_sums == 0, "p=%d d=%d: %d head checksums differ", p, d, bad_sums);
  }
  char ack = 1;
  tw_test_write_all(p2c[1], &ack, 1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "p=%d d=%d: prefill side exit %d", p, d,
         WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  close(p2c[1]);
  close(c2p[0]);
  for (int r = 0; r < d; r++) {
    tw_kv_region_unregister(reg[r]);
    tw_kv_xfer_destroy(x[r]);
    free(pool[r].base);
  }
}

int main(void) {
  tw_log_init("test_kv_reshard", 0);
  int32_t a, b;
  tw_kv_heads_overlap(2, 2, 0, 4, &a, &b);
  EXPECT(a == 2 && b == 4, "overlap [2,4) & [0,4) = [2,4)");
  tw_kv_heads_overlap(0, 2, 4, 4, &a, &b);
  EXPECT(b <= a, "[0,2) & [4,8) empty");
  const int tps[4] = {1, 2, 4, 8};
  for (int mode = 0; mode < 3; mode++) {
    src_ids = mode == 1 ? run_src : scattered_src;
    dst_ids = mode == 1 ? run_dst : scattered_dst;
    staged = mode == 2;
    for (int i = 0; i < 4; i++)
      for (int k = 0; k < 4; k++) run_pair(tps[i], tps[k]);
  }
  if (fails) fprintf(stderr, "test_kv_reshard: %d failure(s)\n", fails);
  else
    printf("test_kv_reshard: all 16 pairs passed, scattered and consecutive ids, and staged\n");
  return fails ? 1 : 0;
}
