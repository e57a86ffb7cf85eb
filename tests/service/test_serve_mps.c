/* test_serve_mps.c: the private CUDA MPS server of `twain serve`
 * (router/serve_mps.h) against stand-ins for nvidia-cuda-mps-control put
 * first on PATH: shell scripts that behave as the control program does where
 * serve relies on it (`-f`: a daemon in the foreground that makes its control
 * pipe in CUDA_MPS_PIPE_DIRECTORY and logs to CUDA_MPS_LOG_DIRECTORY/
 * control.log; no argument: a command read from stdin, "quit" stops the
 * daemon) and record what they were given. Checks: the option's values; when
 * serve starts one and why not (cpu backend, several ranks, the operator's
 * CUDA_MPS_PIPE_DIRECTORY, no control program on PATH); start sets both
 * variables to the new private directories and waits for the control pipe;
 * stop sends quit, reaps the daemon, unsets the variables and removes the
 * directory; a daemon that exits at once, or never makes its pipe, is an
 * error naming its log line with nothing left behind; a private directory
 * is named after its serve's pid and replaces those of serves that no longer
 * run (only those: a live serve's, another name's, another pattern's stay).
 * --mps-first: the pool whose workers get the below-normal client priority,
 * and a worker spawned with it sees it in its environment.
 * Every wait is bounded
 * (the daemon stand-in gives up after 20 s by itself). */
#include "router/serve_mps.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_expect.h"

static char g_tmp[256], g_bin[300], g_record[300];

/* A stand-in control program in g_bin/nvidia-cuda-mps-control: `mode` good
 * (as described above), dies (logs a line and exits 3 at once) or mute (runs
 * but never makes its pipe). Every call appends "ARGS|PIPE|LOG" to g_record,
 * and a command its stdin. */
static void write_fake(const char *mode) {
  char path[400];
  snprintf(path, sizeof path, "%s/%s", g_bin, TW_MPS_CONTROL);
  FILE *f = fopen(path, "w");
  if (!f) {
    EXPECT(0, "cannot write %s: %s", path, strerror(errno));
    return;
  }
  fprintf(f,
          "#!/bin/sh\n"
          "echo \"args=$*|pipe=$CUDA_MPS_PIPE_DIRECTORY|log=$CUDA_MPS_LOG_DIRECTORY\" >> '%s'\n"
          "if [ \"$1\" = -f ]; then\n"
          "  case '%s' in\n"
          "  dies) echo 'fake daemon: cannot open the device' > "
          "\"$CUDA_MPS_LOG_DIRECTORY/control.log\"; "
          "exit 3;;\n"
          "  mute) ;;\n"
          "  *) mkfifo \"$CUDA_MPS_PIPE_DIRECTORY/control\";;\n"
          "  esac\n"
          "  i=0\n"
          "  while [ ! -e \"$CUDA_MPS_PIPE_DIRECTORY/quit\" ] && [ $i -lt 400 ]; do sleep 0.05; "
          "i=$((i+1)); done\n"
          "  exit 0\n"
          "fi\n"
          "read cmd\n"
          "echo \"cmd=$cmd\" >> '%s'\n"
          "[ \"$cmd\" = quit ] && : > \"$CUDA_MPS_PIPE_DIRECTORY/quit\"\n"
          "exit 0\n",
          g_record, mode, g_record);
  fclose(f);
  chmod(path, 0755);
}

static int record_has(const char *needle) {
  FILE *f = fopen(g_record, "r");
  if (!f) return 0;
  char line[1024];
  int hit = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, needle)) hit = 1;
  fclose(f);
  return hit;
}

static int exists(const char *p) { return access(p, F_OK) == 0; }

static void test_mode_opt(void) {
  tw_test_case = "mode option";
  tw_mps_mode_t m = TW_MPS_AUTO;
  char err[128] = "";
  EXPECT(tw_mps_mode_opt("off", &m, err, sizeof err) == 0 && m == TW_MPS_OFF, "off");
  EXPECT(tw_mps_mode_opt("on", &m, err, sizeof err) == 0 && m == TW_MPS_ON, "on");
  EXPECT(tw_mps_mode_opt("auto", &m, err, sizeof err) == 0 && m == TW_MPS_AUTO, "auto");
  EXPECT(tw_mps_mode_opt("yes", &m, err, sizeof err) == -1 && strstr(err, "off, auto or on") &&
             m == TW_MPS_AUTO,
         "bad value: -1, message '%s', value kept", err);
}

/* --mps-first: which pool's workers get the below-normal MPS client priority,
 * and a worker spawned with it (tw_serve_spawn) sees it in its environment */
static void test_first(void) {
  tw_test_case = "mps first";
  tw_mps_first_t f = TW_MPS_FIRST_NONE;
  char err[128] = "";
  EXPECT(tw_mps_first_opt("prefill", &f, err, sizeof err) == 0 && f == TW_MPS_FIRST_PREFILL,
         "prefill");
  EXPECT(tw_mps_first_opt("decode", &f, err, sizeof err) == 0 && f == TW_MPS_FIRST_DECODE,
         "decode");
  EXPECT(tw_mps_first_opt("none", &f, err, sizeof err) == 0 && f == TW_MPS_FIRST_NONE, "none");
  EXPECT(tw_mps_first_opt("both", &f, err, sizeof err) == -1 &&
             strstr(err, "prefill, decode or none") && f == TW_MPS_FIRST_NONE,
         "bad value: -1, message '%s', value kept", err);
  const char *low = "CUDA_MPS_CLIENT_PRIORITY=1";
  const char *e1 = tw_mps_client_env(TW_MPS_FIRST_PREFILL, false);
  const char *e2 = tw_mps_client_env(TW_MPS_FIRST_DECODE, true);
  EXPECT(e1 && !strcmp(e1, low) && !tw_mps_client_env(TW_MPS_FIRST_PREFILL, true),
         "prefill first: decode workers below normal, prefill workers as they are");
  EXPECT(e2 && !strcmp(e2, low) && !tw_mps_client_env(TW_MPS_FIRST_DECODE, false),
         "decode first: prefill workers below normal");
  EXPECT(
      !tw_mps_client_env(TW_MPS_FIRST_NONE, true) && !tw_mps_client_env(TW_MPS_FIRST_NONE, false),
      "none: no worker below normal");
  char out[400], sh[600];
  snprintf(out, sizeof out, "%s/env.txt", g_tmp);
  snprintf(sh, sizeof sh, "echo \"$CUDA_MPS_CLIENT_PRIORITY\" > '%s'", out);
  char *argv[] = {"/bin/sh", "-c", sh, NULL};
  unsetenv("CUDA_MPS_CLIENT_PRIORITY");
  pid_t pid = tw_serve_spawn(argv, -1, -1, SIGKILL, e1);
  EXPECT(pid > 0 && tw_serve_reap(pid, 10000), "the spawned child ran");
  char got[16] = "";
  FILE *fp = fopen(out, "r");
  if (fp) {
    if (!fgets(got, sizeof got, fp)) got[0] = '\0';
    fclose(fp);
  }
  EXPECT(!strcmp(got, "1\n") && !getenv("CUDA_MPS_CLIENT_PRIORITY"),
         "the child saw CUDA_MPS_CLIENT_PRIORITY=1 ('%s'), serve's own environment unchanged", got);
}

static void test_wanted(void) {
  tw_test_case = "wanted";
  char bin[512], why[512];
  unsetenv("CUDA_MPS_PIPE_DIRECTORY");
  EXPECT(!tw_mps_wanted(TW_MPS_OFF, true, true, bin, sizeof bin, why, sizeof why) && !why[0],
         "off: not wanted, no reason (got '%s')", why);
  EXPECT(!tw_mps_wanted(TW_MPS_AUTO, false, true, bin, sizeof bin, why, sizeof why) &&
             strstr(why, "cpu backend"),
         "cpu backend: '%s'", why);
  EXPECT(!tw_mps_wanted(TW_MPS_ON, true, false, bin, sizeof bin, why, sizeof why) &&
             strstr(why, "several ranks"),
         "several ranks: '%s'", why);
  write_fake("good");
  EXPECT(tw_mps_wanted(TW_MPS_AUTO, true, true, bin, sizeof bin, why, sizeof why),
         "control program on PATH: wanted (why '%s')", why);
  char want[400];
  snprintf(want, sizeof want, "%s/%s", g_bin, TW_MPS_CONTROL);
  EXPECT(!strcmp(bin, want), "found %s, want %s", bin, want);
  setenv("CUDA_MPS_PIPE_DIRECTORY", "/operators/own", 1);
  EXPECT(!tw_mps_wanted(TW_MPS_AUTO, true, true, bin, sizeof bin, why, sizeof why) &&
             strstr(why, "CUDA_MPS_PIPE_DIRECTORY is set (/operators/own)"),
         "operator's MPS: '%s'", why);
  unsetenv("CUDA_MPS_PIPE_DIRECTORY");
  const char *path = getenv("PATH");
  char *saved = strdup(path ? path : "");
  setenv("PATH", g_tmp, 1); /* a directory without the program */
  EXPECT(!tw_mps_wanted(TW_MPS_ON, true, true, bin, sizeof bin, why, sizeof why) &&
             strstr(why, "not on PATH"),
         "no control program: '%s'", why);
  setenv("PATH", saved, 1);
  free(saved);
}

static void test_start_stop(void) {
  tw_test_case = "start and stop";
  write_fake("good");
  unlink(g_record);
  char bin[512];
  snprintf(bin, sizeof bin, "%s/%s", g_bin, TW_MPS_CONTROL);
  tw_mps_t m;
  EXPECT_OK(tw_mps_start(&m, bin, g_tmp));
  const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY"), *log = getenv("CUDA_MPS_LOG_DIRECTORY");
  char want_pipe[PATH_MAX], want_log[PATH_MAX], ctl[PATH_MAX + 16];
  snprintf(want_pipe, sizeof want_pipe, "%s/pipe", m.dir);
  snprintf(want_log, sizeof want_log, "%s/log", m.dir);
  snprintf(ctl, sizeof ctl, "%s/control", want_pipe);
  EXPECT(m.pid > 0, "daemon pid %d", (int)m.pid);
  EXPECT(!strncmp(m.dir, g_tmp, strlen(g_tmp)) && strstr(m.dir, "twain-mps-"),
         "private directory %s under %s", m.dir, g_tmp);
  EXPECT(pipe && !strcmp(pipe, want_pipe), "CUDA_MPS_PIPE_DIRECTORY %s, want %s",
         pipe ? pipe : "(unset)", want_pipe);
  EXPECT(log && !strcmp(log, want_log), "CUDA_MPS_LOG_DIRECTORY %s, want %s", log ? log : "(unset)",
         want_log);
  struct stat st;
  EXPECT(stat(m.dir, &st) == 0 && (st.st_mode & 0777) == 0700, "directory mode 0700 (%o)",
         (unsigned)(st.st_mode & 0777));
  EXPECT(exists(ctl), "control pipe %s is up when start returns", ctl);
  char rec[PATH_MAX * 2 + 64];
  snprintf(rec, sizeof rec, "args=-f|pipe=%s|log=%s", want_pipe, want_log);
  EXPECT(record_has(rec), "the daemon ran as '%s'", rec);
  pid_t pid = m.pid;
  char dir[sizeof m.dir];
  memcpy(dir, m.dir, sizeof dir);
  tw_mps_stop(&m);
  EXPECT(record_has("cmd=quit"), "stop sent quit through the control program");
  snprintf(rec, sizeof rec, "args=|pipe=%s|", want_pipe);
  EXPECT(record_has(rec), "the quit command ran with the daemon's pipe directory");
  EXPECT(m.pid == 0 && kill(pid, 0) != 0, "daemon %d reaped", (int)pid);
  EXPECT(!getenv("CUDA_MPS_PIPE_DIRECTORY") && !getenv("CUDA_MPS_LOG_DIRECTORY"),
         "both variables unset after stop");
  EXPECT(!exists(dir), "directory %s removed", dir);
  tw_mps_stop(&m); /* twice: a no-op */
}

static void test_failures(void) {
  char bin[512];
  snprintf(bin, sizeof bin, "%s/%s", g_bin, TW_MPS_CONTROL);
  tw_mps_t m;
  tw_test_case = "daemon exits at once";
  write_fake("dies");
  EXPECT_ERR(tw_mps_start(&m, bin, g_tmp), TW_ERR_IO,
             "exited (status 3) before its control pipe was up; its log: fake daemon: cannot open "
             "the device");
  EXPECT(m.pid == 0 && !m.dir[0], "nothing kept (pid %d, dir '%s')", (int)m.pid, m.dir);
  EXPECT(!getenv("CUDA_MPS_PIPE_DIRECTORY") && !getenv("CUDA_MPS_LOG_DIRECTORY"),
         "variables unset");
  tw_test_case = "no such program";
  EXPECT_ERR(tw_mps_start(&m, "/nonexistent/nvidia-cuda-mps-control", g_tmp), TW_ERR_IO,
             "exited (status 127)");
  tw_test_case = "daemon never makes its pipe";
  write_fake("mute");
  EXPECT_ERR(tw_mps_start(&m, bin, g_tmp), TW_ERR_IO, "showed no control pipe in 10 s");
  EXPECT(m.pid == 0 && !m.dir[0], "nothing kept (pid %d, dir '%s')", (int)m.pid, m.dir);
  EXPECT(!getenv("CUDA_MPS_PIPE_DIRECTORY"), "variable unset");
  /* the temporary directory holds only the stand-in's folder and its record */
  char cmd[600];
  snprintf(cmd, sizeof cmd, "ls -d '%s'/twain-mps-* >/dev/null 2>&1", g_tmp);
  EXPECT(system(cmd) != 0, "no twain-mps-* directory left in %s", g_tmp);
}

static void mkfile(const char *path) {
  FILE *f = fopen(path, "w");
  EXPECT(f != NULL, "cannot write %s: %s", path, strerror(errno));
  if (f) fclose(f);
}

static void test_dir_make(void) {
  tw_test_case = "private directories";
  pid_t dead = fork(); /* a pid that no longer runs: a reaped child's */
  if (dead == 0) _exit(0);
  EXPECT(dead > 0 && waitpid(dead, NULL, 0) == dead, "a child to reap");
  char par[300], p[600], keep[4][600], out[PATH_MAX];
  snprintf(par, sizeof par, "%s/dirs", g_tmp);
  EXPECT(mkdir(par, 0700) == 0, "mkdir %s: %s", par, strerror(errno));
  snprintf(p, sizeof p, "%s/twain-x-%d-aaaaaa", par,
           (int)dead); /* a killed serve's, with a subdir */
  char sub[700], f1[700], f2[800];
  snprintf(sub, sizeof sub, "%s/log", p);
  snprintf(f1, sizeof f1, "%s/record", p);
  snprintf(f2, sizeof f2, "%s/control.log", sub);
  EXPECT(mkdir(p, 0700) == 0 && mkdir(sub, 0700) == 0, "mkdir %s", sub);
  mkfile(f1);
  mkfile(f2);
  snprintf(keep[0], sizeof keep[0], "%s/twain-x-%d-bbbbbb", par, (int)getppid()); /* live */
  snprintf(keep[1], sizeof keep[1], "%s/twain-y-%d-cccccc", par, (int)dead);      /* other name */
  snprintf(keep[2], sizeof keep[2], "%s/twain-x-dddddd", par);                    /* no pid */
  snprintf(keep[3], sizeof keep[3], "%s/twain-x-%d-eeeeee", par, (int)dead);      /* a file */
  for (int k = 0; k < 3; k++) EXPECT(mkdir(keep[k], 0700) == 0, "mkdir %s", keep[k]);
  mkfile(keep[3]);
  /* a serve in another pid namespace: its pid looks dead here, its lock is held */
  char held[600], held_lock[700], unheld[600], unheld_lock[700];
  snprintf(held, sizeof held, "%s/twain-x-%d-ffffff", par, (int)dead);
  snprintf(held_lock, sizeof held_lock, "%s/.lock", held);
  EXPECT(mkdir(held, 0700) == 0, "mkdir %s", held);
  int hfd = open(held_lock, O_RDWR | O_CREAT, 0600);
  EXPECT(hfd >= 0 && flock(hfd, LOCK_EX) == 0, "lock %s", held_lock);
  /* a lock nobody holds: stale even though the pid in its name runs */
  snprintf(unheld, sizeof unheld, "%s/twain-x-%d-gggggg", par, (int)getppid());
  snprintf(unheld_lock, sizeof unheld_lock, "%s/.lock", unheld);
  EXPECT(mkdir(unheld, 0700) == 0, "mkdir %s", unheld);
  mkfile(unheld_lock);
  EXPECT(tw_serve_dir_make(out, sizeof out, par, "twain-x"), "make: %s", strerror(errno));
  EXPECT(!exists(p), "the killed serve's directory %s removed", p);
  for (int k = 0; k < 4; k++) EXPECT(exists(keep[k]), "%s kept", keep[k]);
  EXPECT(exists(held), "%s kept: its lock is held", held);
  EXPECT(!exists(unheld), "%s removed: nobody holds its lock", unheld);
  if (hfd >= 0) close(hfd);
  char want[400];
  snprintf(want, sizeof want, "%s/twain-x-%d-", par, (int)getpid());
  struct stat st;
  EXPECT(!strncmp(out, want, strlen(want)) && strlen(out) == strlen(want) + 6,
         "new directory %s named %sXXXXXX", out, want);
  EXPECT(stat(out, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0700,
         "new directory is there with mode 0700 (%o)", (unsigned)(st.st_mode & 0777));
  char ol[PATH_MAX + 8];
  snprintf(ol, sizeof ol, "%s/.lock", out);
  int ofd = open(ol, O_RDWR);
  EXPECT(ofd >= 0 && flock(ofd, LOCK_EX | LOCK_NB) != 0,
         "its .lock is held while this process runs");
  if (ofd >= 0) close(ofd);
  char again[PATH_MAX];
  EXPECT(
      tw_serve_dir_make(again, sizeof again, par, "twain-x") && exists(out) && strcmp(again, out),
      "a second one (%s) leaves this process's first (%s)", again, out);
  char tiny[8];
  errno = 0;
  EXPECT(!tw_serve_dir_make(tiny, sizeof tiny, par, "twain-x") && errno == ENAMETOOLONG && !tiny[0],
         "a path that does not fit: false, ENAMETOOLONG, \"\" (errno %d)", errno);
  snprintf(p, sizeof p, "%s/none", g_tmp);
  EXPECT(!tw_serve_dir_make(out, sizeof out, p, "twain-x") && errno == ENOENT && !out[0],
         "a parent that is not there: false, ENOENT (errno %d)", errno);
}

int main(void) {
  snprintf(g_tmp, sizeof g_tmp, "/tmp/tw_mps_test_XXXXXX");
  if (!mkdtemp(g_tmp)) {
    perror("mkdtemp");
    return 1;
  }
  snprintf(g_bin, sizeof g_bin, "%s/bin", g_tmp);
  snprintf(g_record, sizeof g_record, "%s/record.txt", g_tmp);
  mkdir(g_bin, 0700);
  const char *path = getenv("PATH");
  char np[8192];
  snprintf(np, sizeof np, "%s:%s", g_bin, path ? path : "/usr/bin:/bin");
  setenv("PATH", np, 1);
  test_mode_opt();
  test_first();
  test_wanted();
  test_start_stop();
  test_failures();
  test_dir_make();
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_tmp);
  return tw_test_exit("test_serve_mps");
}
