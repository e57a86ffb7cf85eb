/* test_dist_group.c: a group of ranks started by tw_dist_spawn's own
 * spawner (the cuda path: fork + exec with RANK / WORLD_SIZE / LOCAL_RANK /
 * TWAIN_RENDEZVOUS), without a collective (TW_COLL_NONE), so it runs here:
 *   1. the control link: rank 0 sends 20 plans of 0..19 KiB; each other rank
 *      answers with the FNV-1a of what it got; rank 0 checks every answer,
 *      then says stop and every rank exits 0;
 *   2. the watchdog: rank 0 tells rank 2 to SIGKILL itself; rank 0's watchdog
 *      must then end rank 0 (SIGKILL), and rank 1 must go too (it loses
 *      rank 0). The test process checks both, within bounded waits;
 *   3. a plan the other ranks cannot read (a decode plan of one sequence
 *      that ends after its header): they leave the group instead of
 *      following on (rank 0 would wait in that step's collectives forever),
 *      so rank 0's watchdog ends rank 0 (SIGKILL) within a bounded wait.
 * Usage: test_dist_group (the driver); the ranks run as
 * test_dist_group rank MODE with MODE plans, die or badplan. */
#include "common/base/log.h"
#include "common/comm/dist.h"
#include "common/engine/dist_engine.h"
#include "common/kv/kv_transfer.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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
  int bad = 0;
  for (int k = 0; k < 20; k++) {
    size_t len = (size_t)k * 1024;
    uint8_t *buf = malloc(len + 1);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 31 + (size_t)k);
    uint64_t want = tw_kv_fnv1a(TW_KV_FNV_INIT, buf, len);
    void *bufs[TW_NRANKS];
    size_t lens[TW_NRANKS];
    if (tw_dist_plan_user(d, buf, len) != TW_OK ||
        tw_dist_replies_recv(d, 10000 * time_scale(), bufs, lens) != TW_OK) {
      free(buf);
      return 6;
    }
    for (int r = 1; r < TW_NRANKS; r++) {
      uint64_t got = 0;
      if (lens[r] == sizeof got) memcpy(&got, bufs[r], sizeof got);
      bad += got != want;
      free(bufs[r]);
    }
    free(buf);
  }
  printf("rank 0: 20 plans to %d ranks, %d wrong answers\n", TW_NRANKS - 1, bad);
  if (strcmp(mode, "die") == 0 || strcmp(mode, "badplan") == 0) {
    const int32_t short_decode[3] = {2 /* DECODE, dist_engine.c */, 1 /* n_seqs */, 0 /* flags */};
    if (strcmp(mode, "die") == 0 ? tw_dist_plan_user(d, "die", 3) != TW_OK
                                 : tw_dist_plan_send(d, short_decode, sizeof short_decode) != TW_OK)
      return 9;
    /* the watchdog ends this process long before 10 s (scaled) */
    for (int i = 0; i < 100 * time_scale(); i++) {
      struct timespec ts = {0, 100000000};
      nanosleep(&ts, NULL);
    }
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

/* Run `self rank MODE` with a clean launcher environment; returns the status. */
static int drive(const char *self, const char *mode, pid_t *pid_p) {
  pid_t pid = fork();
  if (pid == 0) {
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

  int st = drive(self, "plans", &pid);
  printf("plans: group exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
  fails += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  st = drive(self, "die", &pid);
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
  st = drive(self, "badplan", &pid);
  killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
  printf("badplan: the other ranks could not read a plan; rank 0 %s\n",
         killed ? "was ended by its watchdog (SIGKILL)"
                : WIFEXITED(st) && WEXITSTATUS(st) == 7 ? "still waited after 10 s"
                                                        : "did NOT end by SIGKILL");
  fails += !killed;
  printf("%s\n", fails ? "FAIL" : "PASS");
  return fails ? 1 : 0;
}
