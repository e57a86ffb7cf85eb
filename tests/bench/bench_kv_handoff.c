/* bench_kv_handoff.c: the KV handoff of one prompt between two processes on
 * this host over UCX (kv_transfer.h), by prompt length, with gpt-oss-20b's
 * KV shapes: 24 layers, every other one (0, 2, ...) sliding with a 128-token
 * window (only the blocks holding its last 128 positions move, spec §2.6),
 * blocks of 16 tokens x 8 kv heads x 64 dims x K,V in bf16 (32 KiB).
 * A "decode" child registers its pool and sleeps on the UCX event fd as the
 * decode worker does; the "prefill" parent puts every layer's blocks
 * (tw_kv_xfer_send_layer: one put per run of consecutive blocks, ids
 * 0..n-1 on both sides as fresh block managers hand out) and flushes (remote
 * completion); on the staged path the child then waits until every byte has
 * come out of its bounce ring into its pool (tw_kv_region_commit), timed as
 * part of the handoff.
 *
 *   twain-bench-kv-handoff [--device] [--staged] [--tokens N[,N...]] [--reps N]
 *
 * --device  both pools cudaMalloc'd on GPU 0 (libcudart loaded at run time;
 *           exit 77 when no GPU can be used). The path is the one the code
 *           picks: direct cuda_ipc (the decode pool mapped over CUDA IPC,
 *           device-to-device copies) on one host, else direct over UCX when
 *           it has CUDA transports and a
 *           cuda_ipc lane joins the two processes, else staged.
 * --staged  the decode side stages even with CUDA transports
 *           (TWAIN_KV_PATH=staged): the staged path's numbers on a machine
 *           that also has the direct one. With host pools (no --device), the
 *           decode side's host pool receives through the same bounce ring
 *           (copies out of it by memcpy): the ring's protocol cost on a
 *           machine without a GPU. Ring size: TWAIN_KV_STAGING_SLOTS,
 *           TWAIN_KV_STAGING_SLOT_MB.
 * --tokens  prompt lengths (default 1024,8192,32768, and 131072 with --device)
 * --reps    timed handoffs per length after 2 warm-ups (default 10)
 * Prints the path and the endpoint's UCX transports, then per prompt length:
 * KV bytes, puts per handoff, median and min latency, effective GB/s (bytes /
 * median latency).
 *
 * On the GPU machine, both paths in one call (stages this benchmark and the
 * bundle with the CUDA-enabled UCX, deploy/build_ucx_cuda.sh; see
 * tests/gpu/service_gpu.sh and docs/benchmarks.md):
 *   here:  bash deploy/build_ucx_cuda.sh && bash tests/gpu/service_gpu.sh --stage
 *   GPU:   TW_SVC_KV_ONLY=1 bash tests/gpu/service_gpu.sh */
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/msg.h"
#include "common/kv/kv_transfer.h"
#include "tests/cudart_dl.h"

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
#define WINDOW 128
#define MAX_LENGTHS 16

static tw_kv_layout_t layout(int32_t n_blocks, bool device, void *base) {
  tw_kv_layout_t l = {.dtype = TW_DTYPE_BF16, .on_device = device, .n_layers = L,
                      .n_blocks = n_blocks, .block_size = BS, .n_kv_heads_local = NKV,
                      .head_dim = HD, .base = base};
  l.block_bytes = 2LL * NKV * BS * HD * 2;
  l.layer_stride_bytes = l.block_bytes * n_blocks;
  l.total_bytes = l.layer_stride_bytes * L;
  return l;
}

static bool sliding(int32_t layer) { return layer % 2 == 0; }

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The decode side: register, publish, then serve 'c' N T (wait until blocks
 * 0..ceil(N / BS) - 1 of a prompt of N tokens hold handoff T, answer 'k' or
 * 'e') until 'q' or EOF. */
static int decode_side(int32_t n_blocks, bool device, bool staged, int rfd, int wfd) {
  if (staged) setenv("TWAIN_KV_PATH", "staged", 1);
  tw_test_cudart_t rt;
  tw_kv_layout_t pool = layout(n_blocks, device, NULL);
  size_t zero = 0;
  if (device) {
    if (tw_test_cudart_load(&rt) == 0) pool.base = tw_test_device_alloc(&rt, (size_t)pool.total_bytes, 0);
  } else {
    pool.base = calloc(1, (size_t)pool.total_bytes);
  }
  tw_kv_xfer_t *x = NULL;
  tw_kv_region_t *reg = NULL;
  tw_kv_region_params_t rp = {.staging_ring = staged && !device};
  /* transports as a decode worker's: the FIFOs only for a host pool in place */
  if (!pool.base || tw_kv_xfer_create_bound(NULL, !device && !rp.staging_ring, &x) ||
      tw_kv_region_register_ex(x, &pool, &rp, &reg)) {
    if (write(wfd, &zero, sizeof zero) < 0) return 4;
    return pool.base ? 2 : device ? 77 : 2;
  }
  size_t alen, rlen;
  const void *a = tw_kv_xfer_address(x, &alen), *rk = tw_kv_region_rkey(reg, &rlen);
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(reg, &rl);
  if (write(wfd, &alen, sizeof alen) < 0 || write(wfd, &rlen, sizeof rlen) < 0 ||
      write(wfd, a, alen) < 0 || write(wfd, rk, rlen) < 0 || write(wfd, &rl, sizeof rl) < 0)
    return 3;
  int32_t *all = malloc(sizeof(int32_t) * (size_t)n_blocks);
  for (int32_t i = 0; all && i < n_blocks; i++) all[i] = i;
  for (;;) {
    tw_kv_xfer_progress(x);
    int efd = tw_kv_xfer_wait_fd(x);
    struct pollfd pfd[2] = {{.fd = rfd, .events = POLLIN}, {.fd = efd, .events = POLLIN}};
    if (poll(pfd, efd >= 0 ? 2 : 1, efd >= 0 ? 100 : 0) > 0 && (pfd[0].revents & (POLLIN | POLLHUP))) {
      char cmd = 0;
      int32_t n = 0, firsts[L];
      uint64_t tag = 0;
      if (read(rfd, &cmd, 1) != 1 || cmd != 'c') break;
      if (read(rfd, &n, sizeof n) != sizeof n || read(rfd, &tag, sizeof tag) != sizeof tag ||
          !all || (n + BS - 1) / BS > n_blocks)
        break;
      for (int32_t l = 0; l < L; l++)
        firsts[l] = tw_kv_layer_first_block(n, BS, sliding(l), WINDOW);
      tw_status_t cs = tw_kv_region_commit(reg, tag, all, (n + BS - 1) / BS, firsts, 60000);
      if (write(wfd, cs == TW_OK ? "k" : "e", 1) < 0) break;
    }
  }
  free(all);
  tw_kv_region_unregister(reg);
  tw_kv_xfer_destroy(x);
  return 0;
}

/* --tokens N[,N...]: positive prompt lengths (opts.h TW_OPT_FN). */
static int parse_tokens(const char *text, void *dst, char *err, size_t errlen) {
  struct {
    int32_t *v;
    int *n;
  } *t = dst;
  if (tw_opts_id_list(text, t->v, MAX_LENGTHS, t->n, err, errlen)) return -1;
  for (int i = 0; i < *t->n; i++)
    if (t->v[i] < 1) {
      snprintf(err, errlen, "must be positive lengths separated by commas, got '%s'", text);
      return -1;
    }
  return 0;
}

int main(int argc, char **argv) {
  tw_log_init("bench-kv", 0);
  int reps = 10;
  bool device = false, staged = false;
  int32_t lengths[MAX_LENGTHS];
  int n_lengths = 0;
  struct tokens_opt {
    int32_t *v;
    int *n;
  } tok = {lengths, &n_lengths};
  tw_opt_t opts[] = {
      TW_OPT_FLAG("device", &device, "both pools in GPU memory (exit 77 without a GPU)"),
      TW_OPT_FLAG("staged", &staged, "the decode side stages even with CUDA transports"),
      TW_OPT_FN("tokens", &tok, parse_tokens, "N[,N...]",
                "prompt lengths (default 1024,8192,32768, and 131072 with --device)"),
      TW_OPT_INT("reps", &reps, 1, 1000000, "N", "timed handoffs per length after 2 warm-ups"),
  };
  tw_opts_spec_t spec = {.prog = "twain-bench-kv-handoff",
                         .description = "The KV handoff of one prompt between two processes over UCX.",
                         .env_prefix = "TWAIN_BENCH_KV_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0]};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  if (n_lengths == 0) {
    const int32_t def[4] = {1024, 8192, 32768, 131072};
    for (int i = 0; i < (device ? 4 : 3); i++) lengths[n_lengths++] = def[i];
  }
  int32_t max_tokens = 0;
  for (int i = 0; i < n_lengths; i++) max_tokens = lengths[i] > max_tokens ? lengths[i] : max_tokens;
  int32_t max_blocks = (max_tokens + BS - 1) / BS;
  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) return 1;
  fflush(NULL);
  /* --staged: the staged path even where the decode pool is exported over
   * CUDA IPC (the sender then does not map it) */
  if (staged) setenv("TWAIN_KV_IPC", "0", 1);
  pid_t pid = fork(); /* before any CUDA call: a context does not survive fork */
  if (pid == 0) {
    close(p2c[1]);
    close(c2p[0]);
    _exit(decode_side(max_blocks, device, staged, p2c[0], c2p[1]));
  }
  close(p2c[0]);
  close(c2p[1]);
  size_t alen = 0, rlen = 0;
  tw_kv_remote_layout_t rl;
  if (read(c2p[0], &alen, sizeof alen) != sizeof alen || alen == 0) {
    int st = 0;
    waitpid(pid, &st, 0);
    fprintf(stderr, "bench-kv: the decode side could not set up its pool%s\n",
                    device ? " (no usable GPU?)" : "");
    return WIFEXITED(st) && WEXITSTATUS(st) == 77 ? 77 : 1;
  }
  if (read(c2p[0], &rlen, sizeof rlen) != sizeof rlen) return 1;
  uint8_t *addr = malloc(alen), *rkey = malloc(rlen);
  if (read(c2p[0], addr, alen) != (ssize_t)alen || read(c2p[0], rkey, rlen) != (ssize_t)rlen ||
      read(c2p[0], &rl, sizeof rl) != sizeof rl)
    return 1;
  tw_kv_layout_t src = layout(max_blocks, device, NULL);
  tw_test_cudart_t rt;
  if (device) {
    if (tw_test_cudart_load(&rt) == 0) src.base = tw_test_device_alloc(&rt, (size_t)src.total_bytes, 0x5a);
  } else if ((src.base = malloc((size_t)src.total_bytes))) {
    memset(src.base, 0x5a, (size_t)src.total_bytes);
  }
  if (!src.base) {
    fprintf(stderr, "bench-kv: cannot allocate the sending pool%s\n", device ? " on the GPU" : "");
    if (write(p2c[1], "q", 1) < 0) return 1;
    waitpid(pid, NULL, 0);
    return device ? 77 : 1;
  }
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)max_blocks);
  double *t = malloc(sizeof(double) * (size_t)reps);
  if (!ids || !t) return 1;
  for (int32_t i = 0; i < max_blocks; i++) ids[i] = i;
  tw_kv_xfer_t *x;
  tw_kv_peer_t *peer;
  if (tw_kv_xfer_create_bound(NULL, true, &x)) return 1; /* as a prefill worker's */
  tw_kv_xfer_set_direct_ipc(x, true); /* the receiver waits only when the path is staged */
  if (tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer)) return 1;
  tw_kv_path_t path = tw_kv_xfer_path_to(peer, device, &rl);
  /* the receiver's copies out of its ring, unless the bytes went straight into its device pool */
  bool commit = rl.staging_slot_bytes > 0 && path == TW_KV_PATH_STAGED_RECV;
  printf("# kv handoff of one prompt, gpt-oss-20b shapes (%d layers, sliding every other with a "
         "%d-token window, %lld-byte blocks), 2 processes, %s pools\n",
         L, WINDOW, (long long)src.block_bytes, device ? "device" : "host");
  printf("# path: %s%s; ucx lanes: %s; reps %d (+2 warm-ups)\n", tw_kv_path_name(path),
         commit ? " (+ the receiver's copies out of its ring)" : "", tw_kv_xfer_peer_lanes(peer),
         reps);
  if (commit)
    printf(
        "# receiver's ring: slots of %lld MiB (TWAIN_KV_STAGING_SLOTS x "
        "TWAIN_KV_STAGING_SLOT_MB)\n",
        (long long)(rl.staging_slot_bytes >> 20));
  printf("# %8s %10s %8s %11s %11s %8s\n", "tokens", "MiB", "puts", "median_ms", "min_ms", "GB/s");
  for (int s = 0; s < n_lengths; s++) {
    int32_t n_tok = lengths[s], nb = (n_tok + BS - 1) / BS;
    double bytes = 0;
    for (int32_t l = 0; l < L; l++)
      bytes += (double)(nb - tw_kv_layer_first_block(n_tok, BS, sliding(l), WINDOW)) *
               (double)src.block_bytes;
    tw_kv_xfer_stats_t s0, s1;
    for (int r = -2; r < reps; r++) { /* 2 warm-ups */
      rl.handoff_tag = (uint64_t)s * 1000000 + (uint64_t)(r + 3); /* one per handoff */
      tw_kv_xfer_stats(x, &s0);
      int64_t t0 = tw_msg_clock_ns();
      for (int32_t l = 0; l < L; l++)
        if (tw_kv_xfer_send_layer(x, peer, &src, &rl, l, ids, ids,
                                  tw_kv_layer_first_block(n_tok, BS, sliding(l), WINDOW), nb, NULL)) {
          fprintf(stderr, "bench-kv: %s\n", tw_last_error());
          return 1;
        }
      if (tw_kv_xfer_flush(x, peer, 60000)) return 1;
      if (commit) {
        char ack = 0;
        if (write(p2c[1], "c", 1) < 0 || write(p2c[1], &n_tok, sizeof n_tok) < 0 ||
            write(p2c[1], &rl.handoff_tag, sizeof rl.handoff_tag) < 0 ||
            read(c2p[0], &ack, 1) != 1 || ack != 'k')
          return 1;
      }
      if (r >= 0) t[r] = (double)(tw_msg_clock_ns() - t0) * 1e-6;
      tw_kv_xfer_stats(x, &s1);
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_d);
    printf("  %8d %10.1f %8lld %11.3f %11.3f %8.2f\n", n_tok, bytes / (1 << 20),
           (long long)(s1.puts - s0.puts), t[reps / 2], t[0], bytes / (t[reps / 2] * 1e-3) * 1e-9);
    fflush(stdout);
  }
  if (write(p2c[1], "q", 1) < 0) return 1;
  waitpid(pid, NULL, 0);
  tw_kv_xfer_destroy(x);
  if (!device) free(src.base); /* a cudaMalloc'd pool goes with the process */
  free(ids);
  free(t);
  free(addr);
  free(rkey);
  return 0;
}
