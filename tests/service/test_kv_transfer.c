/* test_kv_transfer.c: the UCX KV handoff between two processes on loopback.
 * A "decode" parent registers a host f32 pool; a forked "prefill" child fills
 * its own pool with a known byte pattern, puts every layer's blocks (full and
 * sliding layers) into the parent's reserved blocks, flushes, and reports
 * per-layer checksums. The parent checks that the received bytes equal the
 * pattern exactly, that nothing outside the reserved blocks changed, and
 * that the checksums of what arrived equal the checksums of what was sent. */
#include "tests/test_io.h"
#include "common/kv_transfer.h"
#include "common/log.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 4
#define NB 32
#define BS 16
#define NKV 2
#define HD 64
#define WINDOW 32
#define NTOK 75 /* 5 blocks, sliding layers need positions >= 43: blocks 2..4 */

#include "tests/test_expect.h"

static tw_kv_layout_t make_layout(void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32, .n_layers = L, .n_blocks = NB, .block_size = BS,
                      .n_kv_heads_local = NKV, .head_dim = HD, .base = base};
  l.block_bytes = 2LL * NKV * BS * HD * 4;
  l.layer_stride_bytes = l.block_bytes * NB;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

/* pattern byte of (layer, logical block j, byte b) */
static uint8_t pat(int layer, int j, int64_t b) { return (uint8_t)(layer * 37 + j * 11 + b * 7 + 1); }


static const int32_t dst_ids[5] = {7, 3, 30, 12, 0};
static const int32_t src_ids[5] = {1, 2, 3, 4, 5};
static const int sliding[L] = {1, 0, 1, 0};

static int child(int rfd, int wfd) {
  size_t alen, rlen;
  tw_kv_remote_layout_t rl;
  if (tw_test_read_all(rfd, &alen, sizeof alen) || tw_test_read_all(rfd, &rlen, sizeof rlen)) return 2;
  uint8_t *addr = malloc(alen), *rkey = malloc(rlen);
  if (tw_test_read_all(rfd, addr, alen) || tw_test_read_all(rfd, rkey, rlen) || tw_test_read_all(rfd, &rl, sizeof rl))
    return 2;
  tw_kv_layout_t src = make_layout(NULL);
  src.base = calloc(1, (size_t)src.total_bytes);
  for (int l = 0; l < L; l++)
    for (int j = 0; j < 5; j++) {
      uint8_t *b = (uint8_t *)src.base + l * src.layer_stride_bytes + src_ids[j] * src.block_bytes;
      for (int64_t k = 0; k < src.block_bytes; k++) b[k] = pat(l, j, k);
    }
  tw_kv_xfer_t *x = NULL;
  tw_kv_peer_t *peer = NULL;
  if (tw_kv_xfer_create(&x) || tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer)) return 3;
  uint64_t sums[L];
  for (int l = 0; l < L; l++) { /* in two calls, as a chunked prefill does */
    int first = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
    sums[l] = TW_KV_FNV_INIT;
    if (tw_kv_xfer_send_layer(x, peer, &src, &rl, l, src_ids, dst_ids, first, 3, &sums[l]) ||
        tw_kv_xfer_send_layer(x, peer, &src, &rl, l, src_ids, dst_ids, 3, 5, &sums[l]))
      return 4;
  }
  if (tw_kv_xfer_flush(x, peer, 10000)) return 5;
  tw_kv_xfer_stats_t s;
  tw_kv_xfer_stats(x, &s);
  if (tw_test_write_all(wfd, sums, sizeof sums) || tw_test_write_all(wfd, &s.bytes_sent, sizeof s.bytes_sent))
    return 6;
  char ack;
  if (tw_test_read_all(rfd, &ack, 1)) return 7; /* keep the endpoint until the parent has checked */
  tw_kv_xfer_destroy(x);
  free(src.base);
  return 0;
}

int main(void) {
  tw_log_init("test_kv_transfer", 0);
  /* sliding-window block selection, by hand: positions >= n - W */
  EXPECT(tw_kv_layer_first_block(75, 16, 1, 32) == 2, "75 tokens, W=32: first block 2");
  EXPECT(tw_kv_layer_first_block(75, 16, 0, 32) == 0, "full layer: block 0");
  EXPECT(tw_kv_layer_first_block(32, 16, 1, 32) == 0, "n = W: block 0");
  EXPECT(tw_kv_layer_first_block(48, 16, 1, 32) == 1, "48 tokens: block 1");
  EXPECT(tw_kv_layer_first_block(47, 16, 1, 32) == 0, "47 tokens: position 15 is needed");

  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed parent */
    if (getppid() == 1) _exit(1);
    close(p2c[1]);
    close(c2p[0]);
    _exit(child(p2c[0], c2p[1]));
  }
  close(p2c[0]);
  close(c2p[1]);
  tw_kv_layout_t pool = make_layout(NULL);
  pool.base = malloc((size_t)pool.total_bytes);
  memset(pool.base, 0xEE, (size_t)pool.total_bytes);
  tw_kv_xfer_t *x = NULL;
  tw_kv_region_t *reg = NULL;
  if (tw_kv_xfer_create(&x) || tw_kv_region_register(x, &pool, &reg)) return 1;
  size_t alen, rlen;
  const void *addr = tw_kv_xfer_address(x, &alen);
  const void *rkey = tw_kv_region_rkey(reg, &rlen);
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(reg, &rl);
  EXPECT(rl.remote_base == (uint64_t)(uintptr_t)pool.base, "host pool registered in place");
  tw_test_write_all(p2c[1], &alen, sizeof alen);
  tw_test_write_all(p2c[1], &rlen, sizeof rlen);
  tw_test_write_all(p2c[1], addr, alen);
  tw_test_write_all(p2c[1], rkey, rlen);
  tw_test_write_all(p2c[1], &rl, sizeof rl);
  uint64_t sums[L];
  int64_t sent = 0;
  /* the child's progress does the work; ours only serves shm/tcp emulation */
  int ok = 0;
  for (int it = 0; it < 200000 && !ok; it++) {
    tw_kv_xfer_progress(x);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(c2p[0], &fds);
    struct timeval tv = {0, 100};
    if (select(c2p[0] + 1, &fds, NULL, NULL, &tv) > 0) ok = 1;
  }
  EXPECT(ok, "child reported within the bound");
  if (!ok || tw_test_read_all(c2p[0], sums, sizeof sums) || tw_test_read_all(c2p[0], &sent, sizeof sent)) {
    fprintf(stderr, "FAIL: child did not report\n");
    kill(pid, 9);
    return 1;
  }
  /* exact bytes, and untouched bytes elsewhere */
  int64_t expect_bytes = 0;
  for (int l = 0; l < L; l++) {
    int first = tw_kv_layer_first_block(NTOK, BS, sliding[l], WINDOW);
    expect_bytes += (5 - first) * pool.block_bytes;
    for (int j = 0; j < 5; j++) {
      const uint8_t *b =
          (uint8_t *)pool.base + l * pool.layer_stride_bytes + dst_ids[j] * pool.block_bytes;
      int64_t bad = -1;
      for (int64_t k = 0; k < pool.block_bytes && bad < 0; k++)
        if (b[k] != (j >= first ? pat(l, j, k) : 0xEE)) bad = k;
      EXPECT(bad < 0, "layer %d block %d (dst %d) byte %lld wrong", l, j, dst_ids[j],
             (long long)bad);
    }
    uint64_t got;
    EXPECT(tw_kv_layer_checksum(&pool, l, dst_ids, first, 5, &got) == TW_OK, "checksum");
    uint64_t want = TW_KV_FNV_INIT;
    for (int j = first; j < 5; j++)
      for (int64_t k = 0; k < pool.block_bytes; k++) {
        uint8_t v = pat(l, j, k);
        want = tw_kv_fnv1a(want, &v, 1);
      }
    EXPECT(got == sums[l], "layer %d: received checksum %016llx != sent %016llx", l,
           (unsigned long long)got, (unsigned long long)sums[l]);
    EXPECT(got == want, "layer %d: checksum of the pattern", l);
  }
  int untouched = 1;
  for (int l = 0; l < L; l++)
    for (int b = 0; b < NB; b++) {
      int reserved = 0;
      for (int j = 0; j < 5; j++) reserved |= dst_ids[j] == b;
      if (reserved) continue;
      const uint8_t *p = (uint8_t *)pool.base + l * pool.layer_stride_bytes + b * pool.block_bytes;
      for (int64_t k = 0; k < pool.block_bytes; k++) untouched &= p[k] == 0xEE;
    }
  EXPECT(untouched, "blocks outside the handoff are untouched");
  EXPECT(sent == expect_bytes, "bytes sent %lld, expected %lld", (long long)sent,
         (long long)expect_bytes);
  tw_test_write_all(p2c[1], "k", 1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit %d", WEXITSTATUS(status));
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  free(pool.base);
  printf("%s: %d failures\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
