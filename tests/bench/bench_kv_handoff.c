/* bench_kv_handoff.c: KV handoff latency and bandwidth over UCX by size
 * (kv_transfer.h), between two processes on this host: a "decode" child
 * registers a host pool, the "prefill" parent puts N blocks per layer into it
 * and flushes (remote completion), as tw_kv_xfer_send_layer + flush do in a
 * real handoff. Block = 16 tokens x 8 kv heads x 64 dims x K,V in f32
 * (64 KiB, gpt-oss layout), 24 layers as gpt-oss-20b.
 *   twain-bench-kv-handoff [--reps N] [--max-mib M]
 * Prints one line per size: bytes, median and min latency, GB/s. */
#include "common/kv_transfer.h"
#include "common/log.h"
#include "common/msg.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 24
#define BS 16
#define NKV 8
#define HD 64

static tw_kv_layout_t layout(int32_t n_blocks, void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_F32, .n_layers = L, .n_blocks = n_blocks, .block_size = BS,
                      .n_kv_heads_local = NKV, .head_dim = HD, .base = base};
  l.block_bytes = 2LL * NKV * BS * HD * 4;
  l.layer_stride_bytes = l.block_bytes * n_blocks;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  tw_log_init("bench-kv", 0);
  int reps = 20, max_mib = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--max-mib")) max_mib = atoi(argv[i + 1]);
  }
  int64_t block_bytes = 2LL * NKV * BS * HD * 4;
  int32_t max_blocks = (int32_t)(((int64_t)max_mib << 20) / (block_bytes * L));
  if (max_blocks < 1) max_blocks = 1;
  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) return 1;
  pid_t pid = fork();
  if (pid == 0) { /* decode side: register, publish, progress until told to stop */
    close(p2c[1]);
    close(c2p[0]);
    tw_kv_layout_t pool = layout(max_blocks, NULL);
    pool.base = calloc(1, (size_t)pool.total_bytes);
    tw_kv_xfer_t *x;
    tw_kv_region_t *reg;
    if (!pool.base || tw_kv_xfer_create(&x) || tw_kv_region_register(x, &pool, &reg)) _exit(2);
    size_t alen, rlen;
    const void *a = tw_kv_xfer_address(x, &alen), *rk = tw_kv_region_rkey(reg, &rlen);
    tw_kv_remote_layout_t rl;
    tw_kv_region_remote_layout(reg, &rl);
    if (write(c2p[1], &alen, sizeof alen) < 0 || write(c2p[1], &rlen, sizeof rlen) < 0 ||
        write(c2p[1], a, alen) < 0 || write(c2p[1], rk, rlen) < 0 || write(c2p[1], &rl, sizeof rl) < 0)
      _exit(3);
    /* the receiver sleeps on the UCX event fd like the decode worker does, so
     * it does not steal a core from the sender */
    for (;;) {
      tw_kv_xfer_progress(x);
      int efd = tw_kv_xfer_wait_fd(x);
      struct pollfd pfd[2] = {{.fd = p2c[0], .events = POLLIN}, {.fd = efd, .events = POLLIN}};
      if (poll(pfd, efd >= 0 ? 2 : 1, efd >= 0 ? 100 : 0) > 0 && (pfd[0].revents & POLLIN)) break;
    }
    tw_kv_region_unregister(reg);
    tw_kv_xfer_destroy(x);
    _exit(0);
  }
  close(p2c[0]);
  close(c2p[1]);
  size_t alen, rlen;
  tw_kv_remote_layout_t rl;
  if (read(c2p[0], &alen, sizeof alen) != sizeof alen || read(c2p[0], &rlen, sizeof rlen) != sizeof rlen)
    return 1;
  uint8_t *addr = malloc(alen), *rkey = malloc(rlen);
  if (read(c2p[0], addr, alen) != (ssize_t)alen || read(c2p[0], rkey, rlen) != (ssize_t)rlen ||
      read(c2p[0], &rl, sizeof rl) != sizeof rl)
    return 1;
  tw_kv_layout_t src = layout(max_blocks, NULL);
  src.base = malloc((size_t)src.total_bytes);
  memset(src.base, 0x5a, (size_t)src.total_bytes);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)max_blocks);
  for (int32_t i = 0; i < max_blocks; i++) ids[i] = i;
  tw_kv_xfer_t *x;
  tw_kv_peer_t *peer;
  if (tw_kv_xfer_create(&x) || tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer)) return 1;
  printf("# kv handoff over UCX, host memory, 2 processes; block %lld B, %d layers; reps %d\n",
         (long long)block_bytes, L, reps);
  printf("# %10s %8s %8s %12s %12s %10s\n", "bytes", "blocks", "layers", "median_us", "min_us", "GB/s");
  double *t = malloc(sizeof(double) * (size_t)reps);
  /* sizes: 1 block of 1 layer, then n blocks x 24 layers */
  int32_t sizes[32], layers_of[32], ns = 0;
  sizes[ns] = 1;
  layers_of[ns++] = 1;
  for (int32_t n = 1; n <= max_blocks && ns < 32; n *= 4) {
    sizes[ns] = n;
    layers_of[ns++] = L;
  }
  for (int s = 0; s < ns; s++) {
    int32_t n = sizes[s], nl = layers_of[s];
    for (int r = -2; r < reps; r++) { /* 2 warm-ups */
      int64_t t0 = tw_msg_clock_ns();
      for (int32_t l = 0; l < nl; l++)
        if (tw_kv_xfer_send_layer(x, peer, &src, &rl, l, ids, ids, 0, n, NULL)) return 1;
      if (tw_kv_xfer_flush(x, peer, 60000)) return 1;
      if (r >= 0) t[r] = (double)(tw_msg_clock_ns() - t0) * 1e-3;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_d);
    double bytes = (double)n * nl * (double)block_bytes;
    printf("  %10.0f %8d %8d %12.1f %12.1f %10.2f\n", bytes, n, nl, t[reps / 2], t[0],
           bytes / (t[reps / 2] * 1e-6) * 1e-9);
    fflush(stdout);
  }
  if (write(p2c[1], "q", 1) < 0) return 1;
  waitpid(pid, NULL, 0);
  tw_kv_xfer_destroy(x);
  free(src.base);
  free(ids);
  free(t);
  free(addr);
  free(rkey);
  return 0;
}
