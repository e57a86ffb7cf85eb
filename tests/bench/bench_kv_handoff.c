/* bench_kv_handoff.c: KV handoff latency and bandwidth over UCX by size
 * (kv_transfer.h), between two processes on this host: a "decode" child
 * registers a host pool, the "prefill" parent puts N blocks per layer into it
 * and flushes (remote completion), as tw_kv_xfer_send_layer + flush do in a
 * real handoff. Block = 16 tokens x 8 kv heads x 64 dims x K,V in f32
 * (64 KiB, gpt-oss layout), 24 layers as gpt-oss-20b.
 *   twain-bench-kv-handoff [--reps N] [--max-mib M] [--device]
 * --device: both pools in GPU memory (cudaMalloc on device 0, libcudart
 * loaded at run time): registered directly when UCX has CUDA support, else
 * staged through pinned host memory as kv_transfer.h describes (the
 * receiver's mirror-to-device copy, tw_kv_region_commit, is timed as part of
 * each handoff). Exit 77 when no GPU can be used.
 * Prints one line per size: bytes, median and min latency, GB/s. */
#include "common/kv_transfer.h"
#include "common/log.h"
#include "common/opts.h"
#include "common/msg.h"

#include <dlfcn.h>
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

/* cudaMalloc'd memory through a run-time loaded libcudart (NULL: none). */
static void *tw_bench_device_alloc(size_t bytes) {
  const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  void *lib = NULL;
  for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
    lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!lib) return NULL;
  int (*set_device)(int) = (int (*)(int))dlsym(lib, "cudaSetDevice");
  int (*malloc_)(void **, size_t) = (int (*)(void **, size_t))dlsym(lib, "cudaMalloc");
  int (*memset_)(void *, int, size_t) = (int (*)(void *, int, size_t))dlsym(lib, "cudaMemset");
  void *p = NULL;
  if (!set_device || !malloc_ || !memset_ || set_device(0) != 0 || malloc_(&p, bytes) != 0)
    return NULL;
  if (memset_(p, 0x5a, bytes) != 0) return NULL;
  return p; /* freed at exit */
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  tw_log_init("bench-kv", 0);
  int reps = 20, max_mib = 256;
  bool device_flag = false;
  tw_opt_t opts[] = {
      TW_OPT_INT("reps", &reps, 1, 1000000, "N", "repetitions per size"),
      TW_OPT_INT("max-mib", &max_mib, 1, 1 << 20, "M", "largest handoff in MiB"),
      TW_OPT_FLAG("device", &device_flag, "KV in GPU memory"),
  };
  tw_opts_spec_t spec = {.prog = "twain-bench-kv-handoff",
                         .description = "KV handoff over UCX between two processes.",
                         .env_prefix = "TWAIN_BENCH_KV_", .opts = opts,
                         .n_opts = sizeof opts / sizeof opts[0]};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  int device = device_flag;
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
    pool.on_device = device;
    pool.base = device ? tw_bench_device_alloc((size_t)pool.total_bytes)
                       : calloc(1, (size_t)pool.total_bytes);
    tw_kv_xfer_t *x;
    tw_kv_region_t *reg;
    if (!pool.base) {
      size_t zero = 0;
      if (write(c2p[1], &zero, sizeof zero) < 0) _exit(4);
      _exit(device ? 77 : 2);
    }
    if (tw_kv_xfer_create(&x) || tw_kv_region_register(x, &pool, &reg)) _exit(2);
    size_t alen, rlen;
    const void *a = tw_kv_xfer_address(x, &alen), *rk = tw_kv_region_rkey(reg, &rlen);
    tw_kv_remote_layout_t rl;
    tw_kv_region_remote_layout(reg, &rl);
    if (write(c2p[1], &alen, sizeof alen) < 0 || write(c2p[1], &rlen, sizeof rlen) < 0 ||
        write(c2p[1], a, alen) < 0 || write(c2p[1], rk, rlen) < 0 || write(c2p[1], &rl, sizeof rl) < 0)
      _exit(3);
    /* the receiver sleeps on the UCX event fd like the decode worker does, so
     * it does not steal a core from the sender */
    int32_t *all = malloc(sizeof(int32_t) * (size_t)max_blocks);
    for (int32_t i = 0; all && i < max_blocks; i++) all[i] = i;
    for (;;) {
      tw_kv_xfer_progress(x);
      int efd = tw_kv_xfer_wait_fd(x);
      struct pollfd pfd[2] = {{.fd = p2c[0], .events = POLLIN}, {.fd = efd, .events = POLLIN}};
      if (poll(pfd, efd >= 0 ? 2 : 1, efd >= 0 ? 100 : 0) > 0 && (pfd[0].revents & POLLIN)) {
        /* 'c' N: commit blocks 0..N-1 (staged mirror -> device), answer 'k'; 'q': stop */
        char cmd = 0;
        int32_t n = 0;
        if (read(p2c[0], &cmd, 1) != 1 || cmd != 'c') break;
        if (read(p2c[0], &n, sizeof n) != sizeof n || !all) break;
        tw_status_t cs = tw_kv_region_commit(reg, all, n);
        if (write(c2p[1], cs == TW_OK ? "k" : "e", 1) < 0) break;
      }
    }
    free(all);
    tw_kv_region_unregister(reg);
    tw_kv_xfer_destroy(x);
    _exit(0);
  }
  close(p2c[0]);
  close(c2p[1]);
  size_t alen, rlen;
  tw_kv_remote_layout_t rl;
  if (read(c2p[0], &alen, sizeof alen) != sizeof alen) return 1;
  if (alen == 0) {
    int st = 0;
    waitpid(pid, &st, 0);
    fprintf(stderr, "bench-kv: no GPU memory for the receiving pool: skipped\n");
    return WIFEXITED(st) && WEXITSTATUS(st) == 77 ? 77 : 1;
  }
  if (read(c2p[0], &rlen, sizeof rlen) != sizeof rlen) return 1;
  uint8_t *addr = malloc(alen), *rkey = malloc(rlen);
  if (read(c2p[0], addr, alen) != (ssize_t)alen || read(c2p[0], rkey, rlen) != (ssize_t)rlen ||
      read(c2p[0], &rl, sizeof rl) != sizeof rl)
    return 1;
  tw_kv_layout_t src = layout(max_blocks, NULL);
  src.on_device = device;
  src.base = device ? tw_bench_device_alloc((size_t)src.total_bytes) : malloc((size_t)src.total_bytes);
  if (!src.base) {
    fprintf(stderr, "bench-kv: cannot allocate the sending pool%s\n", device ? " on the GPU" : "");
    if (write(p2c[1], "q", 1) < 0) return 1;
    waitpid(pid, NULL, 0);
    return device ? 77 : 1;
  }
  if (!device) memset(src.base, 0x5a, (size_t)src.total_bytes);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)max_blocks);
  for (int32_t i = 0; i < max_blocks; i++) ids[i] = i;
  tw_kv_xfer_t *x;
  tw_kv_peer_t *peer;
  if (tw_kv_xfer_create(&x) || tw_kv_xfer_peer(x, addr, alen, rkey, rlen, &peer)) return 1;
  printf("# kv handoff over UCX, %s, 2 processes; block %lld B, %d layers; reps %d\n",
         !device ? "host memory"
         : tw_kv_xfer_cuda_native(x) ? "device memory DIRECT (UCX cuda transports; sender still "
                                       "stages through a pinned bounce buffer)"
                                     : "device memory STAGED through pinned host memory "
                                       "(+ receiver's mirror->device commit)",
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
      if (device) { /* the receiver makes the blocks visible on its device */
        char ack = 0;
        if (write(p2c[1], "c", 1) < 0 || write(p2c[1], &n, sizeof n) < 0 ||
            read(c2p[0], &ack, 1) != 1 || ack != 'k')
          return 1;
      }
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
  if (!device) free(src.base); /* a cudaMalloc'd pool goes with the process */
  free(ids);
  free(t);
  free(addr);
  free(rkey);
  return 0;
}
