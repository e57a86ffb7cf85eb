/* serve_mps.c: the private CUDA MPS server of `twain serve` (serve_mps.h). */
#include "router/serve_mps.h"

#include "common/base/log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TW_MPS_PIPE_ENV "CUDA_MPS_PIPE_DIRECTORY"
#define TW_MPS_LOG_ENV "CUDA_MPS_LOG_DIRECTORY"
#define TW_MPS_WAIT_MS 10000

int tw_mps_mode_opt(const char *text, void *dst, char *err, size_t errlen) {
  tw_mps_mode_t *m = dst;
  if (!strcmp(text, "off"))
    *m = TW_MPS_OFF;
  else if (!strcmp(text, "auto"))
    *m = TW_MPS_AUTO;
  else if (!strcmp(text, "on"))
    *m = TW_MPS_ON;
  else {
    snprintf(err, errlen, "must be off, auto or on, got '%s'", text);
    return -1;
  }
  return 0;
}

/* The first executable `name` on PATH into out; false if none. */
static bool tw_mps_find(const char *name, char *out, size_t len) {
  const char *path = getenv("PATH");
  if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
  while (*path) {
    const char *end = strchr(path, ':');
    size_t n = end ? (size_t)(end - path) : strlen(path);
    if (n > 0) {
      int w = snprintf(out, len, "%.*s/%s", (int)n, path, name);
      if (w > 0 && (size_t)w < len && access(out, X_OK) == 0) return true;
    }
    path += n + (end ? 1 : 0);
  }
  out[0] = '\0';
  return false;
}

bool tw_mps_wanted(tw_mps_mode_t mode, bool cuda, bool one_gpu, char *bin, size_t binlen, char *why,
                   size_t whylen) {
  why[0] = '\0';
  bin[0] = '\0';
  if (mode == TW_MPS_OFF) return false;
  if (!cuda) {
    snprintf(why, whylen, "the workers run the cpu backend");
    return false;
  }
  if (!one_gpu) {
    snprintf(why, whylen,
             "the workers run several ranks (--*-tp / --*-ep): each pool spreads "
             "over the GPUs");
    return false;
  }
  const char *pipe = getenv(TW_MPS_PIPE_ENV);
  if (pipe) {
    snprintf(why, whylen, "%s is set (%s): the workers use the MPS server it names, if any",
             TW_MPS_PIPE_ENV, pipe);
    return false;
  }
  if (!tw_mps_find(TW_MPS_CONTROL, bin, binlen)) {
    snprintf(why, whylen, "%s is not on PATH (it comes with the NVIDIA driver's utilities)",
             TW_MPS_CONTROL);
    return false;
  }
  return true;
}

static void tw_mps_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int tw_mps_first_opt(const char *text, void *dst, char *err, size_t errlen) {
  tw_mps_first_t *f = dst;
  if (!strcmp(text, "prefill"))
    *f = TW_MPS_FIRST_PREFILL;
  else if (!strcmp(text, "decode"))
    *f = TW_MPS_FIRST_DECODE;
  else if (!strcmp(text, "none"))
    *f = TW_MPS_FIRST_NONE;
  else {
    snprintf(err, errlen, "must be prefill, decode or none, got '%s'", text);
    return -1;
  }
  return 0;
}

const char *tw_mps_client_env(tw_mps_first_t first, bool prefill) {
  const bool low =
      (first == TW_MPS_FIRST_PREFILL && !prefill) || (first == TW_MPS_FIRST_DECODE && prefill);
  return low ? "CUDA_MPS_CLIENT_PRIORITY=1" : NULL; /* 1: below normal (0 is normal) */
}

pid_t tw_serve_spawn(char *const argv[], int in_fd, int out_fd, int death_sig, const char *env) {
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid != 0) return pid;
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  setpgid(0, 0); /* Ctrl-C reaches serve only; serve stops its children in order */
  prctl(PR_SET_PDEATHSIG, death_sig); /* and if serve itself is killed, they stop */
  if (getppid() != parent) _exit(1); /* serve died before prctl: do not linger */
  if (in_fd >= 0) dup2(in_fd, 0);
  if (out_fd >= 0) {
    dup2(out_fd, 1);
    dup2(out_fd, 2);
  }
  if (env) putenv((char *)env); /* the child's own copy of the environment */
  execv(argv[0], argv);
  fprintf(stderr, "twain serve: cannot run %s: %s\n", argv[0], strerror(errno));
  _exit(127);
}

bool tw_serve_reap(pid_t pid, int ms) {
  for (int i = 0; i <= ms / 20; i++) {
    if (waitpid(pid, NULL, WNOHANG) == pid) return true;
    if (i < ms / 20) tw_mps_sleep_ms(20);
  }
  return false;
}

void tw_serve_kill(pid_t pid) {
  kill(-pid, SIGKILL);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

bool tw_serve_dir_remove(const char *dir, int depth) {
  DIR *d = opendir(dir);
  struct dirent *e;
  char path[PATH_MAX];
  while (d && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    int n = snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (n < 0 || (size_t)n >= sizeof path) continue; /* no such path: never a truncated one */
    struct stat st;
    if (depth > 0 && lstat(path, &st) == 0 && S_ISDIR(st.st_mode))
      tw_serve_dir_remove(path, depth - 1);
    else
      unlink(path);
  }
  if (d) closedir(d);
  return rmdir(dir) == 0;
}

/* NAME-PID-...: the pid in the entry `ent` of a directory named NAME-PID-*, or 0. */
static pid_t tw_serve_dir_pid(const char *ent, const char *name) {
  size_t n = strlen(name);
  if (strncmp(ent, name, n) != 0 || ent[n] != '-') return 0;
  char *end;
  errno = 0;
  long pid = strtol(ent + n + 1, &end, 10);
  if (errno || end == ent + n + 1 || *end != '-' || pid <= 0 || pid > INT32_MAX) return 0;
  return (pid_t)pid;
}

bool tw_serve_dir_make(char *out, size_t len, const char *parent, const char *name) {
  const char *rt = parent ? parent : getenv("XDG_RUNTIME_DIR");
  if (!parent && (!rt || !*rt || access(rt, W_OK) != 0)) rt = "/tmp";
  DIR *d = opendir(rt);
  struct dirent *e;
  char path[PATH_MAX];
  while (d && (e = readdir(d)) != NULL) {
    pid_t pid = tw_serve_dir_pid(e->d_name, name);
    if (pid <= 0 || pid == getpid()) continue;
    int n = snprintf(path, sizeof path, "%s/%s", rt, e->d_name);
    struct stat st;
    if (n < 0 || (size_t)n >= sizeof path || lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != getuid())
      continue;
    /* its serve's lock (held while it runs, whatever its pid namespace), or
     * for a directory without one, its pid */
    char lock[PATH_MAX + 8];
    snprintf(lock, sizeof lock, "%s/.lock", path);
    int fd = open(lock, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    bool stale;
    if (fd >= 0) {
      stale = flock(fd, LOCK_EX | LOCK_NB) == 0;
      close(fd);
    } else {
      stale = errno == ENOENT && kill(pid, 0) != 0 && errno == ESRCH;
    }
    if (!stale) continue; /* that serve still runs */
    if (tw_serve_dir_remove(path, 1))
      TW_INFO("serve", "removed %s: left by a serve that no longer runs (pid %d)", path, (int)pid);
  }
  if (d) closedir(d);
  int n = snprintf(out, len, "%s/%s-%d-XXXXXX", rt, name, (int)getpid());
  if (n < 0 || (size_t)n >= len || !mkdtemp(out)) {
    int err = n < 0 || (size_t)n >= len ? ENAMETOOLONG : errno;
    if (len) out[0] = '\0';
    errno = err;
    return false;
  }
  /* the lock that says this serve runs: held (the descriptor kept open)
   * until the process ends, by whatever means */
  char lock[PATH_MAX + 8];
  snprintf(lock, sizeof lock, "%s/.lock", out);
  int fd = open(lock, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0)
    TW_WARN("serve", "cannot lock %s (%s): a later serve may take the directory for a stale one",
            lock, strerror(errno));
  return true;
}

/* The last non-empty line of the daemon's log (control.log) into out ("" if none). */
static void tw_mps_log_tail(const tw_mps_t *m, char *out, size_t len) {
  char path[PATH_MAX];
  out[0] = '\0';
  snprintf(path, sizeof path, "%s/log/control.log", m->dir);
  FILE *f = fopen(path, "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    if (n && len > 0) { /* the last line wins, cut to out's size */
      size_t k = n < len - 1 ? n : len - 1;
      memcpy(out, line, k);
      out[k] = '\0';
    }
  }
  fclose(f);
}

/* `bin [arg]` as a child of serve (tw_serve_spawn), stdin from in_fd (-1:
 * /dev/null), stdout and stderr to /dev/null (the daemon logs to its log
 * directory). */
static pid_t tw_mps_run(const char *bin, const char *arg, int in_fd) {
  char *argv[] = {(char *)bin, (char *)arg, NULL};
  int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  pid_t pid = tw_serve_spawn(argv, in_fd >= 0 ? in_fd : null, null, SIGTERM, NULL);
  if (null >= 0) close(null);
  return pid;
}

tw_status_t tw_mps_start(tw_mps_t *m, const char *bin, const char *parent_dir) {
  memset(m, 0, sizeof *m);
  snprintf(m->bin, sizeof m->bin, "%s", bin);
  if (!tw_serve_dir_make(m->dir, sizeof m->dir, parent_dir, "twain-mps"))
    return tw_err(TW_ERR_IO, "cuda mps: cannot make its directory under %s: %s",
                  parent_dir ? parent_dir : "$XDG_RUNTIME_DIR or /tmp", strerror(errno));
  char pipe[PATH_MAX], log[PATH_MAX], ctl[PATH_MAX + 16];
  snprintf(pipe, sizeof pipe, "%s/pipe", m->dir);
  snprintf(log, sizeof log, "%s/log", m->dir);
  snprintf(ctl, sizeof ctl, "%s/control", pipe);
  if (mkdir(pipe, 0700) != 0 || mkdir(log, 0700) != 0) {
    int e = errno;
    tw_serve_dir_remove(m->dir, 1);
    m->dir[0] = '\0';
    return tw_err(TW_ERR_IO, "cuda mps: cannot make %s: %s", pipe, strerror(e));
  }
  if (setenv(TW_MPS_PIPE_ENV, pipe, 1) != 0 || setenv(TW_MPS_LOG_ENV, log, 1) != 0) {
    unsetenv(TW_MPS_PIPE_ENV);
    tw_serve_dir_remove(m->dir, 1);
    m->dir[0] = '\0';
    return tw_err(TW_ERR_IO, "cuda mps: setenv failed");
  }
  pid_t pid = tw_mps_run(bin, "-f", -1);
  if (pid < 0) {
    int e = errno;
    unsetenv(TW_MPS_PIPE_ENV);
    unsetenv(TW_MPS_LOG_ENV);
    tw_serve_dir_remove(m->dir, 1);
    m->dir[0] = '\0';
    return tw_err(TW_ERR_IO, "cuda mps: cannot start %s: %s", bin, strerror(e));
  }
  m->pid = pid;
  for (int waited = 0;; waited += 20) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      char tail[400];
      m->pid = 0;
      tw_mps_log_tail(m, tail, sizeof tail);
      unsetenv(TW_MPS_PIPE_ENV);
      unsetenv(TW_MPS_LOG_ENV);
      tw_serve_dir_remove(m->dir, 1);
      m->dir[0] = '\0';
      return tw_err(TW_ERR_IO, "cuda mps: %s -f exited (%s %d) before its control pipe was up%s%s",
                    bin, WIFEXITED(status) ? "status" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                    tail[0] ? "; its log: " : "", tail);
    }
    if (access(ctl, F_OK) == 0) break;
    if (waited > TW_MPS_WAIT_MS) {
      tw_mps_stop(m); /* kills it (no pipe to send quit through) and cleans up */
      return tw_err(TW_ERR_IO, "cuda mps: %s -f showed no control pipe in %d s", bin,
                    TW_MPS_WAIT_MS / 1000);
    }
    tw_mps_sleep_ms(20);
  }
  TW_INFO("serve",
          "cuda mps: control daemon %s up (pid %d, pipe %s): the workers' kernels share "
          "the GPU side by side (--mps off: time slices)",
          bin, (int)pid, pipe);
  return TW_OK;
}

void tw_mps_stop(tw_mps_t *m) {
  if (m->pid > 0) {
    char ctl[PATH_MAX];
    snprintf(ctl, sizeof ctl, "%s/pipe/control", m->dir);
    if (access(ctl, F_OK) != 0) { /* no pipe to send quit through */
      kill(-m->pid, SIGTERM);
      kill(m->pid, SIGTERM);
    } else { /* `echo quit | control`: the daemon stops its server, then exits */
      int fds[2];
      if (pipe2(fds, O_CLOEXEC) == 0) {
        pid_t q = tw_mps_run(m->bin, NULL, fds[0]);
        close(fds[0]);
        static const char quit[] = "quit\n";
        ssize_t w = write(fds[1], quit, sizeof quit - 1);
        (void)w;
        close(fds[1]);
        if (q > 0 && !tw_serve_reap(q, TW_MPS_WAIT_MS)) tw_serve_kill(q);
      }
    }
    if (tw_serve_reap(m->pid, TW_MPS_WAIT_MS)) {
      TW_INFO("serve", "cuda mps: control daemon stopped");
    } else {
      TW_WARN("serve", "cuda mps: control daemon pid %d did not quit in %d s: killing it",
              (int)m->pid, TW_MPS_WAIT_MS / 1000);
      tw_serve_kill(m->pid);
    }
    m->pid = 0;
  }
  if (m->dir[0]) {
    unsetenv(TW_MPS_PIPE_ENV);
    unsetenv(TW_MPS_LOG_ENV);
    tw_serve_dir_remove(m->dir, 1);
    m->dir[0] = '\0';
  }
}
