/* serve_mps.h: the CUDA MPS server that `twain serve` runs its workers under
 * when they share one GPU (router/cli/cli_serve.c; docs/operations.md "Both
 * workers on one GPU").
 *
 * Without MPS, two processes on one GPU take turns (time slices): a prefill
 * batch and a decode step never run at the same time. Under an MPS server
 * their kernels run side by side. Measured on one H200 (docs/benchmarks.md,
 * 2026-12-02, 1,024 in / 1,024 out): gpt-oss-20b shapes at concurrency 256
 * 14,051-14,381 output tok/s under MPS against 13,602-13,725 time-sliced;
 * gpt-oss-120b at 512 6,724 against 7,043. It is off by default: under MPS a
 * worker killed with KV puts of the other one in flight into its pool faults
 * that other worker (the puts land in memory freed with the killed client),
 * and the MPS server refuses new clients, the restarted worker included,
 * while the faulted one lives. Serve retries such a restart like a crash
 * (router/cli/cli_serve.c) and the router retries the faulted worker's
 * prompts on its restart, so the service comes back, but only once the
 * faulted worker has exited; time-sliced, the other worker never faults
 * (the kill run of tests/gpu/serve_load.sh, docs/operations.md).
 *
 * The server is private to one serve: its own pipe and log directories (a
 * 0700 temporary directory), the control daemon run in the foreground as a
 * child of serve (so it is stopped with serve, and an operator's own MPS
 * daemon, if any, is left alone). */
#ifndef TW_ROUTER_SERVE_MPS_H
#define TW_ROUTER_SERVE_MPS_H

#include "common/base/status.h"

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/** --mps: off (the default), auto (where the workers share a GPU and the
 *  control program is installed) or on (an error where it cannot start). */
typedef enum { TW_MPS_OFF = 0, TW_MPS_AUTO = 1, TW_MPS_ON = 2 } tw_mps_mode_t;

/** The name of the MPS control program, looked up on PATH. */
#define TW_MPS_CONTROL "nvidia-cuda-mps-control"

/** Option parser (common/base/opts.h TW_OPT_FN) for "off|auto|on" into a
 *  tw_mps_mode_t. Returns 0, or -1 with a message in err. */
int tw_mps_mode_opt(const char *text, void *dst, char *err, size_t errlen);

/** Which role's kernels the GPU takes first when both pools share it under
 *  MPS (`--mps-first`): the other role's workers run as MPS clients of below
 *  normal priority (CUDA_MPS_CLIENT_PRIORITY=1 in their environment, which
 *  only an MPS server reads: serve's own or the operator's). Prefill first is the
 *  default: measured on one H200 (20b, 1,024 in / 1,024 out, concurrency
 *  256), 4% more output tokens/s and a 21% lower TTFT p99 than equal
 *  priorities, and decode first 7% fewer with a 70% higher TTFT p99
 *  (docs/benchmarks.md, 2026-12-05). */
typedef enum {
  TW_MPS_FIRST_PREFILL = 0,
  TW_MPS_FIRST_DECODE = 1,
  TW_MPS_FIRST_NONE = 2
} tw_mps_first_t;

/** The --mps-first option's parser (opts.h TW_OPT_FN; dst: tw_mps_first_t *):
 *  prefill, decode or none. 0, or -1 with why in err. */
int tw_mps_first_opt(const char *text, void *dst, char *err, size_t errlen);

/** The environment entry ("NAME=VALUE", static) a worker of the pool
 *  `prefill` (true) or decode gets under MPS for `first`, or NULL for none. */
const char *tw_mps_client_env(tw_mps_first_t first, bool prefill);

/** A running private MPS control daemon. */
typedef struct {
  pid_t pid;              /* the control daemon (foreground mode), 0: none */
  char dir[PATH_MAX / 2]; /* the 0700 directory holding pipe/ and log/ */
  char bin[PATH_MAX / 2]; /* the control program */
} tw_mps_t;

/**
 * Whether serve runs its workers under a private MPS server.
 * mode: --mps; cuda: the workers run the CUDA backend; one_gpu: every worker
 * is one rank on the same GPU (no --*-tp / --*-ep). On true, `bin` holds the
 * control program's path. On false, `why` says why not in a sentence
 * ("" when mode is off). The environment decides too: where
 * CUDA_MPS_PIPE_DIRECTORY is set, the operator runs MPS (or chose not to
 * for this serve) and serve starts none.
 */
bool tw_mps_wanted(tw_mps_mode_t mode, bool cuda, bool one_gpu, char *bin, size_t binlen, char *why,
                   size_t whylen);

/**
 * Starts `bin -f` (the control daemon in the foreground) as a child with its
 * own pipe and log directories in a new 0700 directory twain-mps-PID-XXXXXX
 * under parent_dir (tw_serve_dir_make: XDG_RUNTIME_DIR or /tmp when NULL;
 * those of killed serves removed first), waits up to 10 s for its control pipe,
 * and sets CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY in this process
 * so that workers started after it connect to it.
 * Errors: TW_ERR_IO (the directory cannot be made, the daemon cannot be
 * started, exits, or shows no control pipe in 10 s: the message holds the last
 * line of its log); nothing is left running or set on error.
 */
TW_NODISCARD tw_status_t tw_mps_start(tw_mps_t *m, const char *bin, const char *parent_dir);

/**
 * Stops a daemon of tw_mps_start (no-op when m->pid is 0): sends it "quit"
 * through `bin` (as `echo quit | nvidia-cuda-mps-control` would), waits up to
 * 10 s for it to exit (then SIGKILL), unsets the two variables and removes the
 * directory. Call after the workers exited.
 */
void tw_mps_stop(tw_mps_t *m);

/** Starts argv[0] (argv NULL-terminated) as a child of serve: signals
 *  unblocked, its own process group (Ctrl-C reaches serve only), `death_sig`
 *  when serve dies (SIGKILL for a worker: its router died with serve, so a
 *  drain would decode for nobody while holding the GPU; SIGTERM for the MPS
 *  control daemon's own shutdown); stdin from in_fd and stdout/stderr to
 *  out_fd where they are >= 0 (else inherited); `env` ("NAME=VALUE", or NULL)
 *  added to its environment. Returns its pid, or -1 when fork fails (errno
 *  set); a program that cannot be run exits 127. */
pid_t tw_serve_spawn(char *const argv[], int in_fd, int out_fd, int death_sig, const char *env);

/** Waits up to `ms` for the child `pid` to exit and reaps it; false if it
 *  still runs then. */
bool tw_serve_reap(pid_t pid, int ms);

/** SIGKILL to the child `pid` and its process group (what it started), then
 *  reaps it. */
void tw_serve_kill(pid_t pid);

/** Removes the directory `dir`: its files, its subdirectories down to
 *  `depth` levels (0: files only), then dir itself. Returns false (errno
 *  set by rmdir) when dir is still there. Serve's private directories (the
 *  MPS server's, the shared weights' records). */
bool tw_serve_dir_remove(const char *dir, int depth);

/** Makes a private directory of this serve, `PARENT/NAME-PID-XXXXXX` (PID:
 *  this process; mode 0700, mkdtemp) holding `.lock`, flock()ed until this
 *  process ends, and writes its path into out[len].
 *  PARENT: `parent`, or when that is NULL $XDG_RUNTIME_DIR where it is
 *  writable, else /tmp. First it removes (tw_serve_dir_remove, depth 1) the
 *  NAME-PID-* directories in PARENT that belong to this user and whose
 *  `.lock` nobody holds (without one: whose PID no longer runs): what a serve
 *  killed with SIGKILL left behind (logged). The lock, not the pid, decides
 *  where serves share PARENT across pid namespaces (containers).
 *  Returns false (errno set; out "") when the directory cannot be made. The
 *  MPS server's directory and the shared weights' records. */
bool tw_serve_dir_make(char *out, size_t len, const char *parent, const char *name);

#endif
