/* test_weights_share.c: one copy of the weights for worker processes on one
 * GPU (engine.h weights_share_dir, kernels/engine_cuda_share.cu), with the
 * memory plan of co-located workers, and the copy's lifetime: it outlives
 * the worker that uploaded it.
 *
 * The parent never touches CUDA (a forked CUDA context is unusable): it runs
 * this program four times on the tiny MXFP4 fixture model:
 *   A  --child DIR OUT prefill hold: plans as the prefill worker of 1 + 1,
 *      uploads and offers the weights (origin 1), writes its logits, holds;
 *   B  --child DIR OUT decode hold: plans as the decode worker, maps A's
 *      weights (origin 2: nothing uploaded), writes its logits, holds;
 *      then A is killed (SIGKILL) and B, told "again", computes once more on
 *      the weights A uploaded;
 *   D  --child DIR OUT decode: a restarted worker: maps the weights from B,
 *      the surviving holder (origin 2), A's socket being stale;
 *   C  --child - OUT decode: an own copy (origin 0), for reference.
 * Each computation prefills the same 16-token prompt (all logits) and runs
 * one decode step on the greedy token. Checks: the origins, every logit and
 * token of B (before and after A died) and D bit-identical to A's and C's,
 * A's socket 0600 while it holds, removed once D found it stale, and B's
 * removed when B exits. Exits 77 (skipped) without a usable GPU. Every wait
 * is bounded. */
#include "common/base/log.h"
#include "common/engine/engine.h"
#include "common/model/model.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef TW_TEST_FIXTURES_DIR
#define TW_TEST_FIXTURES_DIR "tests/fixtures"
#endif
#define N_PROMPT 16
#define WAIT_S 300

/* Prefill the 16-token prompt (all logits), one decode step; write the
 * logits and both tokens to `out`. 0 when written. */
static int compute(tw_engine_t *e, const tw_model_t *m, const char *out, const char *role) {
  int V = m->config.vocab_size, rc = 0;
  float *lg = malloc(sizeof(float) * (size_t)V * (N_PROMPT + 1));
  int32_t toks[N_PROMPT], table[2] = {0, 1}, next = -1, next2 = -1;
  for (int i = 0; i < N_PROMPT; i++) toks[i] = (i * 37 + 11) % V;
  tw_prefill_args_t pa = {.tokens = toks,
                          .n_tokens = N_PROMPT,
                          .start_pos = 0,
                          .block_table = table,
                          .n_blocks = 2,
                          .all_logits = true,
                          .logits_out = lg,
                          .next_token_out = &next};
  int32_t pos = N_PROMPT, nb = 2;
  const int32_t *tables[1] = {table};
  if (!lg || tw_engine_prefill(e, &pa) != TW_OK) {
    fprintf(stderr, "child %s: prefill failed: %s\n", role, tw_last_error());
    rc = 1;
  } else {
    tw_decode_args_t da = {.n_seqs = 1,
                           .tokens = &next,
                           .positions = &pos,
                           .block_tables = tables,
                           .n_blocks = &nb,
                           .logits_out = lg + (size_t)N_PROMPT * V,
                           .next_tokens_out = &next2};
    if (tw_engine_decode(e, &da) != TW_OK) {
      fprintf(stderr, "child %s: decode: %s\n", role, tw_last_error());
      rc = 1;
    }
  }
  FILE *f = rc ? NULL : fopen(out, "wb");
  if (!rc &&
      (!f ||
       fwrite(lg, sizeof(float), (size_t)V * (N_PROMPT + 1), f) != (size_t)V * (N_PROMPT + 1) ||
       fwrite(&next, 4, 1, f) != 1 || fwrite(&next2, 4, 1, f) != 1))
    rc = 1;
  if (f && fclose(f) != 0) rc = 1;
  free(lg);
  return rc;
}

static int child(const char *dir, const char *out, const char *role, int hold) {
  tw_log_init("test_weights_share", 0);
  int origin_want = !strcmp(dir, "-") ? 0 : !strcmp(role, "prefill") ? 1 : 2;
  if (!tw_backend_usable(TW_BACKEND_CUDA)) return 77;
  tw_model_t *m = NULL;
  char model_dir[1024];
  const char *fixtures = getenv("TW_FIXTURES_DIR"); /* set by tests/gpu/run_gpu.sh */
  snprintf(model_dir, sizeof model_dir, "%s/tiny-gptoss-wordnet-mxfp4",
           fixtures ? fixtures : TW_TEST_FIXTURES_DIR);
  if (tw_model_load(model_dir, &m) != TW_OK) {
    fprintf(stderr, "child %s: load: %s\n", role, tw_last_error());
    return 1;
  }
  tw_engine_params_t p = TW_ENGINE_PARAMS_DEFAULT;
  p.backend = TW_BACKEND_CUDA;
  p.mem_role = !strcmp(role, "prefill") ? 1 : 2;
  p.mem_prefill_workers = 1;
  p.mem_decode_workers = 1;
  p.mem_utilization = 0.25; /* leave the GPU to others: the plan scales */
  /* the same shapes in every child (the prompt in one chunk), so that the
   * kernels and their reductions are the same; the kv pools are planned */
  p.max_batch = 8;
  p.max_prefill_chunk = N_PROMPT;
  p.kv_num_blocks = 0;
  p.weights_share_dir = strcmp(dir, "-") ? dir : NULL;
  tw_engine_t *e = NULL;
  if (tw_engine_create(m, &p, &e) != TW_OK) {
    fprintf(stderr, "child %s: engine: %s\n", role, tw_last_error());
    return 1;
  }
  int origin = tw_engine_weights_origin(e);
  const tw_engine_params_t *ep = tw_engine_params(e);
  fprintf(stderr, "child %s: origin %d, kv blocks %d, max batch %d, chunk %d\n", role, origin,
          ep->kv_num_blocks, ep->max_batch, ep->max_prefill_chunk);
  int rc = origin != origin_want || ep->kv_num_blocks < 2;
  if (rc)
    fprintf(stderr, "child %s: origin %d (want %d), kv blocks %d\n", role, origin, origin_want,
            ep->kv_num_blocks);
  if (!rc) rc = compute(e, m, out, role);
  printf("ready %d\n", rc ? -1 : origin);
  fflush(stdout);
  if (hold) { /* hold the weights; "again": compute once more (OUT.2); EOF: exit */
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
      if (strncmp(line, "again", 5) != 0) continue;
      char out2[1200];
      snprintf(out2, sizeof out2, "%.1100s.2", out);
      int r2 = compute(e, m, out2, role);
      printf("ready %d\n", r2 ? -1 : origin);
      fflush(stdout);
      rc |= r2;
    }
  }
  tw_engine_destroy(e);
  tw_model_destroy(m);
  return rc;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Start `self --child dir out role [hold]`; *in_w: its stdin (hold), *out_r: its stdout. */
static pid_t spawn(const char *self, const char *dir, const char *out, const char *role,
                   int hold, int *in_w, int *out_r) {
  int pin[2], pout[2];
  if (pipe(pin) || pipe(pout)) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pin[0], 0);
    dup2(pout[1], 1);
    close(pin[1]);
    close(pout[0]);
    execl(self, self, "--child", dir, out, role, hold ? "hold" : "once", (char *)NULL);
    _exit(127);
  }
  close(pin[0]);
  close(pout[1]);
  *in_w = pin[1];
  *out_r = pout[0];
  return pid;
}

/* A child's exit status within WAIT_S (killed after: 124). */
static int wait_exit(pid_t pid) {
  double t0 = now_s();
  int st = 0;
  while (now_s() - t0 < WAIT_S) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    if (r < 0) return 127; /* not a child of ours */
    usleep(20000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return 124;
}

/* The child's "ready N" line within WAIT_S: N; or, when it ends without
 * one, -77 for a skip (exit 77, *exit_p set) or -2 (*exit_p set when it
 * exited, else left at -1). */
static int read_ready(pid_t pid, int fd, int *exit_p) {
  char buf[64];
  size_t n = 0;
  double t0 = now_s();
  *exit_p = -1;
  while (now_s() - t0 < WAIT_S && n < sizeof buf - 1) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 500) > 0) {
      ssize_t r = read(fd, buf + n, sizeof buf - 1 - n);
      if (r <= 0) { /* it closed its stdout: it is ending */
        *exit_p = wait_exit(pid);
        return *exit_p == 77 ? -77 : -2;
      }
      n += (size_t)r;
      buf[n] = '\0';
      if (strchr(buf, '\n')) {
        int v = -2;
        return sscanf(buf, "ready %d", &v) == 1 ? v : -2;
      }
    }
  }
  return -2;
}

static long read_all(const char *path, char **data) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  *data = malloc((size_t)n + 1);
  if (!*data || fread(*data, 1, (size_t)n, f) != (size_t)n) n = -1;
  fclose(f);
  return n;
}

int main(int argc, char **argv) {
  if (argc == 6 && !strcmp(argv[1], "--child"))
    return child(argv[2], argv[3], argv[4], !strcmp(argv[5], "hold"));
  char dir[] = "/tmp/twain-share-test-XXXXXX";
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  enum { A, B, D, C, N_OUT };
  char out[N_OUT + 1][1100], sock_a[1100], sock_b[1100];
  const char *names[N_OUT] = {"a", "b", "d", "c"};
  for (int i = 0; i < N_OUT; i++) snprintf(out[i], sizeof out[i], "%s/logits-%s", dir, names[i]);
  snprintf(out[N_OUT], sizeof out[N_OUT], "%.1090s.2", out[B]); /* B after A died */
  int fails = 0, in_a, out_a, in_b, out_b, in_c, out_c, in_d, out_d, xa = -1, xb, xc, xd;
  pid_t a = spawn(argv[0], dir, out[A], "prefill", 1, &in_a, &out_a);
  int ra = read_ready(a, out_a, &xa);
  if (ra == -77) {
    printf("no usable GPU: skipped\n");
    close(in_a);
    rmdir(dir);
    return 77;
  }
  snprintf(sock_a, sizeof sock_a, "%s/weights-dev0-tp1r0-ep1r0.%d.sock", dir, (int)a);
  struct stat sb;
  bool offered = stat(sock_a, &sb) == 0 && S_ISSOCK(sb.st_mode) && (sb.st_mode & 0777) == 0600;
  pid_t b = spawn(argv[0], dir, out[B], "decode", 1, &in_b, &out_b);
  int rb = read_ready(b, out_b, &xb);
  snprintf(sock_b, sizeof sock_b, "%s/weights-dev0-tp1r0-ep1r0.%d.sock", dir, (int)b);
  /* the uploader dies without cleaning up; B keeps computing on its weights */
  kill(a, SIGKILL);
  xa = wait_exit(a);
  close(in_a);
  bool again_sent = write(in_b, "again\n", 6) == 6;
  int rb2 = again_sent ? read_ready(b, out_b, &xb) : -2;
  /* a restarted worker maps the copy from B, the survivor */
  pid_t d = spawn(argv[0], dir, out[D], "decode", 0, &in_d, &out_d);
  int rd = read_ready(d, out_d, &xd);
  close(in_d);
  if (xd < 0) xd = wait_exit(d);
  bool stale_removed = stat(sock_a, &sb) != 0;
  close(in_b);
  if (xb < 0) xb = wait_exit(b);
  bool b_removed = stat(sock_b, &sb) != 0;
  pid_t c = spawn(argv[0], "-", out[C], "decode", 0, &in_c, &out_c);
  int rc_ = read_ready(c, out_c, &xc);
  close(in_c);
  if (xc < 0) xc = wait_exit(c);
  printf(
      "A (uploader): ready %d, killed (exit %d); B: ready %d, again after A died %d, exit %d; "
      "D (after A): ready %d exit %d; C (own copy): ready %d exit %d; A's socket 0600 %d, "
      "removed as stale %d; B's removed at its exit %d\n",
      ra, xa, rb, rb2, xb, rd, xd, rc_, xc, offered, stale_removed, b_removed);
  if (ra != 1 || rb != 2 || rb2 != 2 || xb != 0 || rd != 2 || xd != 0 || rc_ != 0 || xc != 0 ||
      !offered || !stale_removed || !b_removed) {
    printf(
        "FAIL: origins 1/2/2/2/0, clean exits but A's, A's socket offered 0600, then removed "
        "as stale, B's removed at its exit\n");
    fails++;
  }
  char *dd[N_OUT + 1] = {NULL};
  long n[N_OUT + 1];
  for (int i = 0; i <= N_OUT; i++) n[i] = read_all(out[i], &dd[i]);
  int same = n[A] > 8;
  for (int i = 1; i <= N_OUT; i++)
    same = same && n[i] == n[A] && memcmp(dd[A], dd[i], (size_t)n[A]) == 0;
  if (!same) {
    printf("FAIL: logits and tokens differ (A %ld, B %ld, D %ld, C %ld, B after A %ld bytes)\n",
           n[A], n[B], n[D], n[C], n[N_OUT]);
    fails++;
  } else {
    printf("A, B, B after A was killed, D and C: %ld bytes of logits and tokens, bit-identical\n",
           n[A]);
  }
  for (int i = 0; i <= N_OUT; i++) {
    free(dd[i]);
    unlink(out[i]);
  }
  char other[1100];
  snprintf(other, sizeof other, "%s/weights-dev0-tp1r0-ep1r0.lock", dir);
  unlink(other);
  unlink(sock_a);
  unlink(sock_b);
  rmdir(dir);
  printf(fails ? "test_weights_share: FAILED\n" : "test_weights_share: passed\n");
  return fails ? 1 : 0;
}
