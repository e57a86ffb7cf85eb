/* test_kv_transfer.c: the UCX KV handoff between two processes on loopback.
 * A "decode" parent registers a host f32 pool; a forked "prefill" child fills
 * its own pool with a known byte pattern, puts every layer's blocks (full and
 * sliding layers) into the parent's reserved blocks, flushes, and reports
 * per-layer checksums. The parent checks that the received bytes equal the
 * pattern exactly, that nothing outside the reserved blocks changed, and
 * that the checksums of what arrived equal the checksums of what was sent.
 * Runs of blocks consecutive on both sides go as one put each (counted).
 * With this UCX (no CUDA transports in CI) a device destination pool is
 * refused with TW_ERR_UNSUPPORTED before anything is put, never emulated.
 * Then the bounce ring: 48 pieces of 1 MiB, taken from the child's buffer in
 * reverse order, gathered into one remote range (6 ring chunks through 4
 * slots, so slots are reused), must arrive exactly in that order.
 * With the argument "fp8" (ctest test_kv_transfer_fp8) both pools have the
 * fp8 KV cache's layout (kv_fp8.h: e4m3 values and f32 scales, blocks of
 * 2 x heads x (16 x 64 + 16 x 4) bytes): its blocks move as exact bytes the
 * same way. Either way a destination of the other KV dtype is refused
 * (TW_ERR_UNSUPPORTED, nothing put), whole-head and re-sharded. */
#include "common/base/log.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_reshard.h"
#include "common/kv/kv_transfer.h"
#include "tests/test_io.h"

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
#define RING_PIECES 48
#define RING_PIECE ((int64_t)1 << 20)

#include "tests/test_expect.h"

static tw_dtype_t g_dtype = TW_DTYPE_F32; /* "fp8": TW_DTYPE_F8_E4M3 */

static tw_kv_layout_t make_layout(void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32, .n_layers = L, .n_blocks = NB, .block_size = BS,
                      .n_kv_heads_local = NKV, .head_dim = HD, .base = base};
  l.dtype = g_dtype;
  l.block_bytes = 2LL * NKV * tw_kv_head_bytes(g_dtype, BS, HD);
  l.layer_stride_bytes = l.block_bytes * NB;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

/* pattern byte of (layer, logical block j, byte b) */
static uint8_t pat(int layer, int j, int64_t b) { return (uint8_t)(layer * 37 + j * 11 + b * 7 + 1); }

/* one flat "pool" of RING_PIECES pieces (a layout the transfer layer accepts) */
static tw_kv_layout_t flat_layout(void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32, .n_layers = 1, .n_blocks = RING_PIECES,
                      .block_size = BS, .n_kv_heads_local = NKV, .head_dim = HD, .base = base,
                      .block_bytes = RING_PIECE, .layer_stride_bytes = RING_PIECE * RING_PIECES,
                      .total_bytes = RING_PIECE * RING_PIECES};
  return l;
}
static uint8_t ring_pat(int piece, int64_t b) { return (uint8_t)(piece * 29 + b * 3 + (b >> 12)); }


/* runs on both sides: (1,2)->(7,8), 3->30, (4,5)->(12,13) */
static const int32_t dst_ids[5] = {7, 8, 30, 12, 13};
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
  /* puts in place: shared-memory FIFOs kept on both sides, as a prefill
   * worker and a decode worker with a host pool in place have them */
  if (tw_kv_xfer_create_bound(NULL, true, &x) || tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer))
    return 3;
  /* this UCX has no cuda_ipc lane: host paths only, a device pool refused */
  if (tw_kv_xfer_path(peer, false, false) != TW_KV_PATH_HOST ||
      tw_kv_xfer_path(peer, true, false) != TW_KV_PATH_STAGED)
    return 10;
  if (!tw_kv_xfer_cuda_native(x) &&
      tw_kv_xfer_path(peer, false, true) != TW_KV_PATH_UNREACHABLE)
    return 11;
  if (!tw_kv_xfer_peer_lanes(peer)[0]) return 12;
  tw_kv_remote_layout_t dev = rl;
  dev.on_device = true;
  if (!tw_kv_xfer_cuda_native(x) &&
      tw_kv_xfer_send_layer(x, peer, &src, &dev, 0, src_ids, dst_ids, 0, 5, NULL) != TW_ERR_UNSUPPORTED)
    return 13;
  /* out of the pools: refused, nothing put */
  tw_kv_seg_t outside = {(const char *)src.base + src.total_bytes - 8, 16};
  if (tw_kv_xfer_put(x, peer, &src, &rl, &outside, 1, rl.remote_base, NULL) != TW_ERR_INVALID_ARGUMENT)
    return 14;
  tw_kv_seg_t inside = {src.base, 16};
  if (tw_kv_xfer_put(x, peer, &src, &rl, &inside, 1, rl.remote_base + rl.total_bytes - 8, NULL) !=
      TW_ERR_INVALID_ARGUMENT)
    return 15;
  const int32_t tail_src[2] = {0, 1}, tail_dst[2] = {NB - 1, NB};
  if (tw_kv_xfer_send_layer(x, peer, &src, &rl, 0, tail_src, tail_dst, 0, 2, NULL) !=
      TW_ERR_INVALID_ARGUMENT)
    return 16;
  /* the other KV dtype on the decode side (a pair started with different
   * --kv-dtype): refused before anything is put, whole heads or re-sharded */
  tw_kv_remote_layout_t other = rl;
  other.dtype = g_dtype == TW_DTYPE_F32 ? TW_DTYPE_F8_E4M3 : TW_DTYPE_F32;
  other.block_bytes = 2LL * NKV * tw_kv_head_bytes(other.dtype, BS, HD);
  int64_t rs_bytes = 0;
  if (tw_kv_xfer_send_layer(x, peer, &src, &other, 0, src_ids, dst_ids, 0, 5, NULL) !=
          TW_ERR_UNSUPPORTED ||
      !strstr(tw_last_error(), "--kv-dtype"))
    return 18;
  other.n_kv_heads = 1;
  if (tw_kv_reshard_send_layer(x, peer, &src, &other, 0, 0, src_ids, dst_ids, 0, 5, &rs_bytes) !=
          TW_ERR_UNSUPPORTED ||
      rs_bytes != 0 || !strstr(tw_last_error(), "--kv-dtype"))
    return 19;
  tw_kv_xfer_stats_t s0;
  tw_kv_xfer_stats(x, &s0);
  if (s0.puts != 0 || s0.bytes_sent != 0) return 17;
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
  if (tw_test_write_all(wfd, sums, sizeof sums) || tw_test_write_all(wfd, &s.bytes_sent, sizeof s.bytes_sent) ||
      tw_test_write_all(wfd, &s.puts, sizeof s.puts))
    return 6;
  char ack;
  if (tw_test_read_all(rfd, &ack, 1)) return 7; /* keep the endpoint until the parent has checked */
  /* the bounce ring: pieces in reverse order, gathered into one range */
  size_t rlen2;
  tw_kv_remote_layout_t rl2;
  if (tw_test_read_all(rfd, &rlen2, sizeof rlen2)) return 20;
  uint8_t *rkey2 = malloc(rlen2);
  if (tw_test_read_all(rfd, rkey2, rlen2) || tw_test_read_all(rfd, &rl2, sizeof rl2)) return 20;
  tw_kv_layout_t flat = flat_layout(malloc((size_t)RING_PIECE * RING_PIECES));
  tw_kv_seg_t segs[RING_PIECES];
  for (int i = 0; i < RING_PIECES; i++) {
    uint8_t *b = (uint8_t *)flat.base + (int64_t)i * RING_PIECE;
    for (int64_t k = 0; k < RING_PIECE; k++) b[k] = ring_pat(i, k);
    segs[RING_PIECES - 1 - i] = (tw_kv_seg_t){b, RING_PIECE};
  }
  uint64_t h = TW_KV_FNV_INIT;
  if (tw_kv_xfer_peer(x, addr, alen, rkey2, rlen2, &peer) ||
      tw_kv_xfer_put(x, peer, &flat, &rl2, segs, RING_PIECES, rl2.remote_base, &h) ||
      tw_kv_xfer_flush(x, peer, 10000))
    return 21;
  tw_kv_xfer_stats_t s2;
  tw_kv_xfer_stats(x, &s2);
  int64_t ring_puts = s2.puts - s.puts;
  if (tw_test_write_all(wfd, &h, sizeof h) || tw_test_write_all(wfd, &ring_puts, sizeof ring_puts))
    return 22;
  if (tw_test_read_all(rfd, &ack, 1)) return 23;
  tw_kv_xfer_destroy(x);
  free(flat.base);
  free(rkey2);
  free(src.base);
  return 0;
}

/* Progress the kv worker until fd is readable (tw_test_progress_until_readable). */
static void progress_xfer(void *x) { tw_kv_xfer_progress(x); }
static int wait_report(tw_kv_xfer_t *x, int fd) {
  return tw_test_progress_until_readable(fd, progress_xfer, x);
}

/* The checksum against published FNV-1a 64 test vectors (the FNV reference
 * test suite: "" -> offset basis, "a", "foobar"), never against values this
 * code computes: for the bytes, continued across calls, and for a layer whose
 * blocks, taken in block-table order (ids 5 then 2), hold "foo" and "bar". */
static void checksum_known_answers(void) {
  EXPECT(tw_kv_fnv1a(TW_KV_FNV_INIT, "", 0) == 0xcbf29ce484222325ull, "fnv1a64(\"\")");
  EXPECT(tw_kv_fnv1a(TW_KV_FNV_INIT, "a", 1) == 0xaf63dc4c8601ec8cull, "fnv1a64(\"a\")");
  EXPECT(tw_kv_fnv1a(TW_KV_FNV_INIT, "foobar", 6) == 0x85944171f73967e8ull, "fnv1a64(\"foobar\")");
  EXPECT(tw_kv_fnv1a(tw_kv_fnv1a(TW_KV_FNV_INIT, "foo", 3), "bar", 3) == 0x85944171f73967e8ull,
         "fnv1a64 continued: \"foo\" then \"bar\"");
  char mem[2 * 8 * 3];
  memset(mem, 'x', sizeof mem);
  tw_kv_layout_t p = {.dtype = TW_DTYPE_F32, .n_layers = 2, .n_blocks = 8, .block_size = 1,
                      .n_kv_heads_local = 1, .head_dim = 1, .base = mem, .block_bytes = 3,
                      .layer_stride_bytes = 8 * 3, .total_bytes = sizeof mem};
  memcpy(mem + 24 + 5 * 3, "foo", 3); /* layer 1, block 5 */
  memcpy(mem + 24 + 2 * 3, "bar", 3); /* layer 1, block 2 */
  const int32_t ids[3] = {7, 5, 2};
  uint64_t h = 0;
  EXPECT(tw_kv_layer_checksum(&p, 1, ids, 1, 3, &h) == TW_OK && h == 0x85944171f73967e8ull,
         "layer checksum of blocks 5, 2 (\"foo\", \"bar\"): %016llx", (unsigned long long)h);
  EXPECT(tw_kv_layer_checksum(&p, 1, ids, 3, 3, &h) == TW_OK && h == 0xcbf29ce484222325ull,
         "layer checksum of no block: the offset basis");
  EXPECT(tw_kv_layer_checksum(&p, 2, ids, 1, 3, &h) == TW_ERR_INVALID_ARGUMENT, "layer outside the pool");
}

/* UCX's network devices from the router endpoint: loopback here (RDMA ports,
 * if this host has any, follow after a comma). */
static void net_devices(void) {
  char d[256];
  static const char *const lo[] = {"tcp://127.0.0.1:7401", "tcp://lo;127.0.0.1:7401",
                                   "tcp://localhost:9", "ipc:///tmp/twain-router", "inproc://r"};
  for (size_t i = 0; i < sizeof lo / sizeof lo[0]; i++) {
    tw_status_t st = tw_kv_net_devices(lo[i], d, sizeof d);
    EXPECT(st == TW_OK && !strncmp(d, "lo", 2) && (d[2] == '\0' || d[2] == ','),
           "%s: devices \"%s\" start with lo (%s)", lo[i], st == TW_OK ? d : "", tw_last_error());
  }
  EXPECT(tw_kv_net_devices("udp://127.0.0.1:1", d, sizeof d) == TW_ERR_INVALID_ARGUMENT,
         "udp:// is no router endpoint");
  EXPECT(tw_kv_net_devices("tcp://127.0.0.1", d, sizeof d) == TW_ERR_INVALID_ARGUMENT, "no port");
  EXPECT(tw_kv_net_devices("tcp://no-such-host.invalid:1", d, sizeof d) == TW_ERR_NOT_FOUND,
         "a host that does not resolve: NOT_FOUND");
  EXPECT(tw_kv_net_devices("tcp://127.0.0.1:7401", d, 2) == TW_ERR_OUT_OF_RANGE,
         "a list that does not fit: OUT_OF_RANGE");
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "fp8")) g_dtype = TW_DTYPE_F8_E4M3;
  tw_log_init("test_kv_transfer", 0);
  EXPECT(make_layout(NULL).block_bytes == (g_dtype == TW_DTYPE_F32 ? 16384 : 4352),
         "block bytes %lld", (long long)make_layout(NULL).block_bytes);
  checksum_known_answers();
  net_devices();
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
  if (tw_kv_xfer_create_bound(NULL, true, &x) || tw_kv_region_register(x, &pool, &reg)) return 1;
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
  int64_t sent = 0, puts = 0;
  /* the child's progress does the work; ours only serves shm/tcp emulation */
  int ok = wait_report(x, c2p[0]);
  EXPECT(ok, "child reported within the bound");
  if (!ok || tw_test_read_all(c2p[0], sums, sizeof sums) || tw_test_read_all(c2p[0], &sent, sizeof sent) ||
      tw_test_read_all(c2p[0], &puts, sizeof puts)) {
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
  /* full layers: (1,2) + 3 in the first call, (4,5) in the second = 3 puts;
   * sliding layers (from index 2): 3, then (4,5) = 2 puts */
  EXPECT(puts == 3 + 2 + 3 + 2, "puts %lld, expected 10 (one per run of consecutive blocks)",
         (long long)puts);
  tw_test_write_all(p2c[1], "k", 1);
  /* the bounce ring */
  tw_kv_layout_t flat = flat_layout(malloc((size_t)RING_PIECE * RING_PIECES));
  memset(flat.base, 0xEE, (size_t)flat.total_bytes);
  tw_kv_region_t *reg2 = NULL;
  EXPECT(tw_kv_region_register(x, &flat, &reg2) == TW_OK, "register the ring target");
  if (reg2) {
    rkey = tw_kv_region_rkey(reg2, &rlen);
    tw_kv_region_remote_layout(reg2, &rl);
    tw_test_write_all(p2c[1], &rlen, sizeof rlen);
    tw_test_write_all(p2c[1], rkey, rlen);
    tw_test_write_all(p2c[1], &rl, sizeof rl);
    ok = wait_report(x, c2p[0]);
    uint64_t h = 0;
    int64_t ring_puts = 0;
    EXPECT(ok && tw_test_read_all(c2p[0], &h, sizeof h) == 0 &&
               tw_test_read_all(c2p[0], &ring_puts, sizeof ring_puts) == 0,
           "the ring transfer reported");
    int64_t bad = -1;
    uint64_t want = TW_KV_FNV_INIT;
    for (int i = 0; i < RING_PIECES && bad < 0; i++) {
      const uint8_t *b = (const uint8_t *)flat.base + (int64_t)i * RING_PIECE;
      int piece = RING_PIECES - 1 - i;
      for (int64_t k = 0; k < RING_PIECE && bad < 0; k++) {
        uint8_t v = ring_pat(piece, k);
        if (b[k] != v) bad = (int64_t)i * RING_PIECE + k;
      }
    }
    for (int i = RING_PIECES - 1; i >= 0; i--) {
      uint8_t piece_bytes[256];
      for (int64_t k = 0; k < RING_PIECE; k += 256) {
        for (int q = 0; q < 256; q++) piece_bytes[q] = ring_pat(i, k + q);
        want = tw_kv_fnv1a(want, piece_bytes, 256);
      }
    }
    EXPECT(bad < 0, "ring: byte %lld of the gathered range wrong", (long long)bad);
    EXPECT(h == want, "ring: checksum of the gathered bytes");
    /* 48 MiB through 8 MiB slots: 6 puts */
    EXPECT(ring_puts == 6, "ring: %lld puts, expected 6 (one per 8 MiB slot)", (long long)ring_puts);
    tw_test_write_all(p2c[1], "k", 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit %d", WEXITSTATUS(status));
  tw_kv_region_unregister(reg);
  tw_kv_region_unregister(reg2);
  tw_kv_xfer_destroy(x);
  free(pool.base);
  free(flat.base);
  printf("%s: %d failures\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
