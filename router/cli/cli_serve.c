/* cli_serve.c: `twain serve`: the router (in this process, on its own thread)
 * plus N prefill and M decode worker processes on this machine. Prints a line
 * containing "ready" once every worker has registered; on SIGINT/SIGTERM it
 * drains the router (running requests finish, new ones are refused), then
 * sends SIGTERM to every worker, waits for them (SIGKILL after 15 s) and
 * exits 0; a second SIGINT/SIGTERM while it stops makes the stop immediate
 * (the router fails what still runs with UNAVAILABLE, the workers end their
 * drains at once). Worker binaries are found next to this one or in the
 * build tree.
 * Supervision: a worker process that dies is started again (as NAME-rK)
 * after a backoff of 0.5 s doubling to 8 s, at most TW_SERVE_MAX_RESTARTS
 * times in a row (a worker that ran TW_SERVE_STABLE_S resets the count);
 * each death and restart is logged. A worker that exits 0 (it drained after
 * a SIGTERM someone else sent it) is started again after 0.5 s, logged at
 * INFO and not counted as a crash. Restarts are for crashes of a serving
 * worker only: a worker that exits with a usage (2) or configuration error
 * (TW_WORKER_EXIT_CONFIG: bad model, no GPU, ...) at its first start, or
 * dies before the service was ready, stops serve at once (exit
 * TW_WORKER_EXIT_CONFIG, or 1 for a death by signal) after its own error
 * line; a restarted worker that cannot start (the same configuration served
 * before: the cause is passing) is retried like a crash, within the same
 * backoff and limit. Serve also stops by itself when
 * every worker it started has used up its restarts and no worker at all
 * (joined ones included) is registered with the router.
 * Memory: every worker is told how many prefill and decode workers share its
 * device (--colocated P,D) so that each takes its planned share of it
 * (mem_plan.h, docs/operations.md), and on a GPU they share one copy of the
 * weights (--share-weights, a 0700 directory made for this
 * serve and removed when it stops). */
#include "router/cli/cli.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/comm/link_auth.h"
#include "common/comm/msg_worker.h"
#include "common/engine/engine.h"
#include "common/engine/mem_plan.h"
#include "common/kv/kv_fp8.h"
#include "common/model/config.h"
#include "common/model/model_path.h"
#include "router/router.h"
#include "router/serve_mps.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif
#ifndef TW_BUILD_DIR
#define TW_BUILD_DIR "build"
#endif

#define TW_SERVE_MAX_WORKERS 64
#define TW_SERVE_MAX_RESTARTS 5
/* The router's --pool-grace-ms under serve: requests wait this long for a
 * restarted worker (backoff of up to 8 s, then its load: about a minute for
 * gpt-oss-120b on one H200, docs/benchmarks.md) instead of 5 s */
#define TW_SERVE_POOL_GRACE_MS 180000
#define TW_SERVE_STABLE_S 60

/* One worker process serve keeps running. */
typedef struct {
  char *av[48];
  int ac_name;           /* index of the --name value in av */
  char base[64], name[80];
  char mport[16];        /* its --metrics-port */
  pid_t pid;             /* 0: not running */
  int restarts;          /* in a row */
  int generation;        /* restarts ever: the -rN of its name, never reused */
  int64_t started_ns, next_start_ns; /* next_start_ns > 0: restart due then */
  bool gave_up;
  bool drained; /* it exited 0 (drained after a SIGTERM of its own): not a crash */
  const char *env; /* under MPS: its client priority (tw_mps_client_env), or NULL */
} tw_serve_slot_t;

static volatile sig_atomic_t tw_serve_signal_g = 0;
static bool tw_serve_own_keys_g; /* link keys made for this run: no process outside can join */
static void tw_serve_on_signal(int sig) { /* 1: stop, draining; 2: a second signal, stop now */
  (void)sig;
  tw_serve_signal_g = tw_serve_signal_g ? 2 : 1;
}

typedef struct {
  tw_router_params_t rp;
  atomic_int router_stop; /* set by the main thread, read by the router thread */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int bound;      /* 1 bound, -1 failed */
  int router_done; /* tw_router_run returned */
  int ready;
  char worker_ep[256], client_ep[256];
  char http_url[320];   /* "" when the HTTP API is off */
  char metrics[2048];   /* "router http://ADDR:P/metrics, prefill-0 ..." ("" when off) */
  char api_key[512];    /* from --api-key-file */
  tw_status_t router_status;
  int n_registered; /* workers registered with the router (any origin), under mu */
  atomic_int given_up[2]; /* rp.pool_given_up: every prefill [0] / decode [1] worker given up */
} tw_serve_t;

static void tw_serve_workers(void *arg, int32_t np, int32_t nd) {
  tw_serve_t *s = arg;
  pthread_mutex_lock(&s->mu);
  s->n_registered = np + nd;
  pthread_mutex_unlock(&s->mu);
}

static int64_t tw_serve_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void tw_serve_bound(void *arg, const char *cep, const char *wep) {
  tw_serve_t *s = arg;
  pthread_mutex_lock(&s->mu);
  snprintf(s->client_ep, sizeof s->client_ep, "%s", cep);
  snprintf(s->worker_ep, sizeof s->worker_ep, "%s", wep);
  s->bound = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void tw_serve_http(void *arg, const char *url) { /* router thread, before on_ready */
  tw_serve_t *s = arg;
  snprintf(s->http_url, sizeof s->http_url, "OpenAI API at %s, ", url);
}

static void tw_serve_ready(void *arg) {
  tw_serve_t *s = arg;
  printf(
      "twain serve: ready: %d prefill + %d decode workers (%s %s%s), %sclients at %s\n",
      s->rp.expect_prefill, s->rp.expect_decode, tw_serve_own_keys_g ? "workers at" : "join at",
      s->worker_ep,
      tw_serve_own_keys_g ? " with this run's own link keys: others join with TWAIN_KEYS_FILE" : "",
      s->http_url, s->client_ep);
  if (s->metrics[0]) printf("twain serve: metrics: %s\n", s->metrics);
  fflush(stdout);
  pthread_mutex_lock(&s->mu);
  s->ready = 1;
  pthread_mutex_unlock(&s->mu);
}

static void *tw_serve_router_thread(void *arg) {
  tw_serve_t *s = arg;
  s->router_status = tw_router_run(&s->rp, &s->router_stop);
  pthread_mutex_lock(&s->mu);
  if (!s->bound) s->bound = -1;
  s->router_done = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* A free TCP port on addr (127.0.0.1 when NULL) for a daemon's metrics, or 0
 * (ephemeral: that daemon logs its own) when none can be had. */
static int tw_serve_free_port(const char *addr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (addr && inet_pton(AF_INET, addr, &a.sin_addr) != 1) a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

/* Find a sibling program: next to this executable, in ../<dir>/, or in the
 * build tree this binary was configured in. */
static int tw_find_program(const char *dir, const char *name, char *out, size_t len) {
  char self[PATH_MAX / 2];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) *slash = '\0';
    snprintf(out, len, "%s/%s", self, name);
    if (access(out, X_OK) == 0) return 0;
    snprintf(out, len, "%s/../%s/%s", self, dir, name);
    if (access(out, X_OK) == 0) return 0;
  }
  snprintf(out, len, "%s/%s/%s", TW_BUILD_DIR, dir, name);
  return access(out, X_OK) == 0 ? 0 : -1;
}

/* The link keys of this serve's router and workers: the operator's
 * (TWAIN_KEYS / TWAIN_KEYS_FILE), an explicit TWAIN_INSECURE_PLAINTEXT=1, or
 * a fresh set in TWAIN_KEYS that only the processes started here inherit. */
static int tw_serve_link_keys(void) {
  const char *k = getenv(TW_AUTH_KEYS_ENV), *f = getenv(TW_AUTH_KEYS_FILE_ENV);
  const char *p = getenv(TW_AUTH_PLAINTEXT_ENV);
  if ((k && *k) || (f && *f) || (p && !strcmp(p, "1"))) return 0;
  tw_auth_keys_t keys;
  tw_status_t st = tw_auth_keys_generate(&keys);
  if (st == TW_OK) st = tw_auth_keys_export(&keys, TW_AUTH_KEYS_ENV);
  memset(&keys, 0, sizeof keys);
  if (st != TW_OK) {
    fprintf(stderr, "twain serve: %s\n", tw_last_error());
    return -1;
  }
  tw_serve_own_keys_g = true;
  TW_INFO("serve",
          "internal links: CURVE with a key set made for this run (only the workers "
          "started here have it; TWAIN_KEYS_FILE gives one that others can use too)");
  return 0;
}

/* (Re)starts slot w's worker as w->name at `now` (tw_serve_spawn); false
 * when fork failed (w->pid 0: the caller schedules another try). */
static bool tw_serve_slot_spawn(tw_serve_slot_t *w, int64_t now) {
  w->av[w->ac_name] = w->name;
  w->pid = tw_serve_spawn(w->av, -1, -1, SIGKILL, w->env);
  w->started_ns = now;
  w->next_start_ns = 0;
  if (w->pid > 0) return true;
  w->pid = 0;
  return false;
}

/* Each pool's split against the model (docs/parallelism.md): --*-tp must
 * divide the attention and KV heads, --*-ep the experts. pv: prefill tp, ep,
 * decode tp, ep, dp. Returns -1 after printing the rule that fails, 1 when
 * config.json cannot be read (said, before anything starts), 0 otherwise. */
static int tw_serve_check_split(const char *model_dir, const int pv[5]) {
  char path[PATH_MAX];
  tw_model_config_t c;
  snprintf(path, sizeof path, "%s/config.json", model_dir);
  if (tw_config_load(path, &c) != TW_OK) {
    fprintf(stderr, "twain serve: no model at %s: %s (--model DIR|ORG/NAME)\n", model_dir,
            tw_last_error());
    return 1;
  }
  for (int k = 0; k < 2; k++) {
    const char *pool = k ? "decode" : "prefill";
    int tp = pv[2 * k], ep = pv[2 * k + 1];
    if (tp > 1 && (c.n_kv_heads % tp || c.n_heads % tp)) {
      fprintf(stderr, "twain serve: --%s-tp %d does not divide the model's %d KV heads (%d query "
                      "heads): use a divisor (docs/parallelism.md)\n", pool, tp, c.n_kv_heads, c.n_heads);
      return -1;
    }
    if (ep > 1 && c.n_experts % ep) {
      fprintf(stderr, "twain serve: --%s-ep %d does not divide the model's %d experts: use a "
                      "divisor (docs/parallelism.md)\n", pool, ep, c.n_experts);
      return -1;
    }
  }
  return 0;
}

/* The directory of the shared-weights records (engine_cuda_share.cu): made
 * 0700 for this serve; emptied and removed when it stops. "" when none. */
static void tw_serve_share_dir(char *out, size_t len) {
  if (!tw_serve_dir_make(out, len, NULL, "twain-serve")) {
    TW_WARN("serve", "cannot make a directory for sharing the weights (%s): each worker loads "
            "its own copy", strerror(errno));
    out[0] = '\0';
  }
}

static void tw_serve_share_dir_remove(const char *dir) {
  if (dir[0] && !tw_serve_dir_remove(dir, 0))
    TW_WARN("serve", "cannot remove %s: %s", dir, strerror(errno));
}

int tw_cli_serve(int argc, char **argv) {
  static tw_serve_t s; /* shared with the router thread */
  memset(&s, 0, sizeof s);
  s.rp = TW_ROUTER_PARAMS_DEFAULT;
  s.rp.model_dir = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  s.rp.worker_endpoint = "tcp://127.0.0.1:0";
  s.rp.on_bound = tw_serve_bound;
  s.rp.on_bound_arg = &s;
  s.rp.on_ready = tw_serve_ready;
  s.rp.on_ready_arg = &s;
  s.rp.on_workers = tw_serve_workers;
  s.rp.on_http = tw_serve_http;
  s.rp.on_http_arg = &s;
  s.rp.on_workers_arg = &s;
  s.rp.http_port = TW_ROUTER_HTTP_PORT;
  s.rp.pool_grace_ms = TW_SERVE_POOL_GRACE_MS * TW_SLOW_BUILD;
  s.rp.pool_given_up = s.given_up;
  int n_prefill = 1, n_decode = 1, threads = -1, kv_blocks = 0, max_batch = 0;
  int32_t kv_dtype = TW_KV_DTYPE_AUTO, pbf16 = -1;
  double mem_util = 0;
  bool verify = false, no_share = false;
  tw_mps_mode_t mps_mode = TW_MPS_OFF;
  tw_mps_first_t mps_first = TW_MPS_FIRST_PREFILL;
  tw_backend_kind_t bk = TW_BACKEND_AUTO;
  /* prefill tp, ep, decode tp, ep, dp (issue 6) */
  int pv[5] = {1, 1, 1, 1, 1};
  tw_opt_t opts[] = {
      TW_OPT_STR_FN("model", &s.rp.model_dir, tw_model_opt, "DIR|ORG/NAME",
                    "checkpoint directory;\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_STR("listen", &s.rp.client_endpoint, "tcp://HOST:PORT", "client endpoint"),
      TW_OPT_STR("workers", &s.rp.worker_endpoint, "tcp://HOST:PORT",
                 "worker endpoint (port 0: ephemeral, printed in the ready line;\n"
                 "more workers may join there at any time with the same\n"
                 "link keys: TWAIN_KEYS_FILE, docs/operations.md)"),
      TW_OPT_INT("prefill", &n_prefill, 1, TW_SERVE_MAX_WORKERS - 1, "N", "prefill workers"),
      TW_OPT_INT("decode", &n_decode, 1, TW_SERVE_MAX_WORKERS - 1, "M", "decode workers"),
      TW_OPT_FN("backend", &bk, tw_backend_opt, "auto|cpu|cuda",
                "the workers' engine backend (default auto)"),
      TW_OPT_INT("threads", &threads, -1, 4096, "T",
                 "cpu threads per worker (-1: the cores shared between the workers)"),
      TW_OPT_INT("kv-blocks", &kv_blocks, 0, INT32_MAX, "N",
                 "decode workers' KV pool in blocks (0: the memory plan,\n"
                 "docs/operations.md)"),
      TW_OPT_FN("kv-dtype", &kv_dtype, tw_kv_dtype_opt, "bf16|fp8",
                "every worker's KV cache dtype: bf16 (cpu: f32), or fp8 e4m3\n"
                "with a scale per token and kv head (docs/operations.md; default bf16)"),
      TW_OPT_INT("max-batch", &max_batch, 0, INT32_MAX, "N",
                 "decode workers' sequences per step (0: the memory plan)"),
      TW_OPT_FN("prefill-bf16-experts", &pbf16, tw_opts_switch_auto, "0|1|auto",
                "cuda: each prefill worker keeps a bf16 copy of the MXFP4\n"
                "experts for its MoE (default 0; auto: when the memory plan has\n"
                "room; docs/operations.md)"),
      TW_OPT_DOUBLE("gpu-memory-utilization", &mem_util, 0, 1, "F",
                    "share of each GPU for its workers (0: 0.90)"),
      TW_OPT_FLAG("no-share-weights", &no_share,
                  "each worker loads its own copy of the weights (default on a GPU:\n"
                  "one copy shared through CUDA IPC)"),
      TW_OPT_FLAG("verify-kv", &verify, "decode workers check the checksums of received KV"),
      TW_OPT_FN("mps", &mps_mode, tw_mps_mode_opt, "off|auto|on",
                "run the workers sharing a GPU under a private CUDA MPS server\n"
                "(kernels side by side instead of time slices; auto: where it\n"
                "can start; default off: a killed worker takes the other one\n"
                "down with it, docs/operations.md)"),
      TW_OPT_FN("mps-first", &mps_first, tw_mps_first_opt, "prefill|decode|none",
                "under MPS, whose kernels the GPU takes first: the other pool's\n"
                "workers run at below-normal MPS client priority (default\n"
                "prefill: more tokens/s and a lower TTFT, docs/benchmarks.md)"),
      TW_OPT_INT("prefill-tp", &pv[0], 1, 64, "N",
                 "tensor parallel ranks per prefill worker (docs/parallelism.md)"),
      TW_OPT_INT("prefill-ep", &pv[1], 1, 64, "N", "expert parallel ranks per prefill worker"),
      TW_OPT_INT("decode-tp", &pv[2], 1, 64, "N", "tensor parallel ranks per decode worker"),
      TW_OPT_INT("decode-ep", &pv[3], 1, 64, "N", "expert parallel ranks per decode worker"),
      TW_OPT_INT("decode-dp", &pv[4], 1, 64, "N",
                 "data-parallel attention replicas per decode worker\n"
                 "(with --decode-ep N; cpu backend), e.g. --decode-dp 2 --decode-ep 2"),
      TW_OPT_INT("metrics-port", &s.rp.metrics_port, -1, 65535, "PORT",
                 "the router's /metrics port (-1 off, 0 ephemeral)"),
      TW_OPT_STR("metrics-addr", &s.rp.metrics_addr, "ADDR",
                 "numeric address of every metrics port (default 127.0.0.1)"),
      TW_ROUTER_OPT_ROWS(s.rp),
      TW_OPT_INT("http-port", &s.rp.http_port, -1, 65535, "PORT",
                 "OpenAI-compatible HTTP API (-1 off, 0 ephemeral; default\n"
                 "ephemeral when --listen has port 0)"),
  };
  tw_opts_spec_t spec = {
      .prog = "twain serve",
      .description = "The router plus prefill and decode worker processes on this machine.",
      .env_prefix = "TWAIN_SERVE_", .opts = opts, .n_opts = sizeof opts / sizeof opts[0],
      .config = true};
  int prc = tw_opts_parse(&spec, argc, argv, NULL);
  if (prc != TW_OPTS_RUN) return prc;
  size_t el = strlen(s.rp.client_endpoint); /* the HTTP API: ephemeral beside an ephemeral --listen */
  if (!tw_opts_given(&spec, "http-port") && el > 2 && !strcmp(s.rp.client_endpoint + el - 2, ":0"))
    s.rp.http_port = 0;
  const char *backend = tw_backend_name(bk);
  /* each pool's parallelism (issue 6): the decode worker's --dp rule, checked
   * here so that a combination the worker refuses ends serve at once instead
   * of restarting that worker until it gives up */
  if (pv[4] > 1 && (pv[3] != pv[4] || pv[2] != 1)) {
    fprintf(stderr,
            "twain serve: --decode-dp N needs --decode-ep N and --decode-tp 1 (N ranks, each an "
            "attention replica, the experts split over all N; docs/parallelism.md), got "
            "--decode-dp %d --decode-ep %d --decode-tp %d\n",
            pv[4], pv[3], pv[2]);
    return 2;
  }
  int split = tw_serve_check_split(s.rp.model_dir, pv);
  if (split) return split > 0 ? TW_WORKER_EXIT_CONFIG : 2;
  if (bk == TW_BACKEND_CUDA && !tw_backend_usable(bk)) {
    fprintf(stderr, "twain serve: --backend cuda: no CUDA GPU is usable on this machine (none "
                    "visible, or no driver): use --backend cpu, or auto to pick what is there\n");
    return TW_WORKER_EXIT_CONFIG;
  }
  if (pv[4] > 1 && !tw_backend_caps(bk).dp_attention) {
    fprintf(stderr, "twain serve: --decode-dp %d (data-parallel attention) runs on the cpu "
                    "backend only: add --backend cpu, or use --decode-tp/--decode-ep on a GPU\n",
            pv[4]);
    return 2;
  }
  /* Every worker runs on this host: with one rank a worker (the handoff that
   * copies over CUDA IPC, common/kv/kv_transfer.h) a device KV pool is handed
   * over CUDA IPC alone, with no host mirror of it to pin. Multi-rank
   * handoffs put over UCX. TWAIN_KV_PATH set by the operator wins. */
  bool one_rank = pv[0] == 1 && pv[1] == 1 && pv[2] == 1 && pv[3] == 1 && pv[4] == 1;
  if (one_rank && !getenv("TWAIN_KV_PATH") && setenv("TWAIN_KV_PATH", "ipc", 1) != 0) {
    fprintf(stderr, "twain serve: setenv failed\n");
    return 1;
  }
  if (n_prefill < 1 || n_decode < 1 || n_prefill + n_decode > TW_SERVE_MAX_WORKERS) {
    fprintf(stderr, "twain serve: need 1..%d workers, at least one of each pool\n", TW_SERVE_MAX_WORKERS);
    return 2;
  }
  if (threads < 0) { /* share the cores between the workers */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    threads = (int)(cores / (n_prefill + n_decode));
    if (threads < 1) threads = 1;
  }
  char prefill_bin[PATH_MAX], decode_bin[PATH_MAX];
  if (tw_find_program("prefill", "twain-prefill", prefill_bin, sizeof prefill_bin) ||
      tw_find_program("decode", "twain-decode", decode_bin, sizeof decode_bin)) {
    fprintf(stderr, "twain serve: cannot find twain-prefill and twain-decode next to this program\n");
    return 1;
  }
  /* predictable metrics addresses (printed once ready): --metrics-port P
   * gives the router P and the workers P+1, P+2, ... in order; 0 picks free
   * ports here; -1 turns them all off */
  int mport[TW_SERVE_MAX_WORKERS + 1];
  const char *maddr = s.rp.metrics_addr ? s.rp.metrics_addr : "127.0.0.1";
  for (int k = 0; k <= n_prefill + n_decode; k++)
    mport[k] = s.rp.metrics_port < 0 ? -1
               : s.rp.metrics_port > 0 ? s.rp.metrics_port + k
                                       : tw_serve_free_port(s.rp.metrics_addr);
  if (s.rp.metrics_port > 0 && s.rp.metrics_port + n_prefill + n_decode > 65535) {
    fprintf(stderr, "twain serve: --metrics-port %d: the workers' ports (up to %d) pass 65535\n",
            s.rp.metrics_port, s.rp.metrics_port + n_prefill + n_decode);
    return 2;
  }
  s.rp.metrics_port = mport[0];
  for (int k = 0, at = 0; k <= n_prefill + n_decode && mport[0] >= 0; k++) {
    char who[32];
    if (k == 0) snprintf(who, sizeof who, "router");
    else snprintf(who, sizeof who, "%s-%d", k <= n_prefill ? "prefill" : "decode",
                  k <= n_prefill ? k - 1 : k - 1 - n_prefill);
    if (mport[k] > 0 && at < (int)sizeof s.metrics)
      at += snprintf(s.metrics + at, sizeof s.metrics - (size_t)at, "%s%s http://%s:%d/metrics",
                     at ? ", " : "", who, maddr, mport[k]);
  }
  s.rp.expect_prefill = n_prefill;
  s.rp.expect_decode = n_decode;
  if (tw_serve_link_keys() != 0) return 1;
  /* CUDA MPS (router/serve_mps.h): the workers start after the daemon, in
   * its environment; with it they are told --backend cuda, so a worker that
   * cannot reach the GPU through it fails loudly instead of picking the cpu */
  static tw_mps_t mps;
  memset(&mps, 0, sizeof mps);
  {
    bool cuda =
        bk == TW_BACKEND_CUDA || (bk == TW_BACKEND_AUTO && tw_backend_usable(TW_BACKEND_CUDA));
    char bin[PATH_MAX / 2], why[400];
    if (tw_mps_wanted(mps_mode, cuda, one_rank, bin, sizeof bin, why, sizeof why)) {
      if (tw_mps_start(&mps, bin, NULL) == TW_OK) {
        backend = "cuda";
      } else if (mps_mode == TW_MPS_ON) {
        fprintf(stderr, "twain serve: --mps on: %s\n", tw_last_error());
        return 1;
      } else {
        TW_WARN("serve", "cuda mps: not used (the workers take turns on the GPU): %s",
                tw_last_error());
      }
    } else if (mps_mode == TW_MPS_ON) {
      fprintf(stderr, "twain serve: --mps on: %s\n", why);
      return 2;
    } else if (cuda && why[0]) {
      TW_INFO("serve", "cuda mps: not used (the workers take turns on the GPU): %s", why);
    }
  }
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  /* signals: only this thread takes them */
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  pthread_t th;
  if (pthread_create(&th, NULL, tw_serve_router_thread, &s) != 0) {
    fprintf(stderr, "twain serve: cannot start the router thread\n");
    tw_mps_stop(&mps);
    return 1;
  }
  tw_stop_signals_install(tw_serve_on_signal);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_mutex_lock(&s.mu);
  while (!s.bound) pthread_cond_wait(&s.cv, &s.mu);
  pthread_mutex_unlock(&s.mu);
  if (s.bound < 0) {
    pthread_join(th, NULL);
    fprintf(stderr, "twain serve: router failed: %s\n", tw_status_str(s.router_status));
    tw_mps_stop(&mps);
    return 1;
  }
  static tw_serve_slot_t slots[TW_SERVE_MAX_WORKERS];
  int n = n_prefill + n_decode;
  /* numbers passed to every worker: threads, kv-blocks, drain-timeout, tp/ep per pool, dp */
  static char num[8][16];
  const int numv[8] = {threads, kv_blocks, s.rp.drain_timeout_s, pv[0], pv[1], pv[2], pv[3], pv[4]};
  for (int q = 0; q < 8; q++) snprintf(num[q], sizeof num[q], "%d", numv[q]);
  char colo[32], mbuf[16], ubuf[32];
  snprintf(mbuf, sizeof mbuf, "%d", max_batch);
  snprintf(ubuf, sizeof ubuf, "%.17g", mem_util);
  /* every worker of both pools starts on the same device(s): the memory plan
   * splits each between them, and on a GPU they share one weights copy */
  snprintf(colo, sizeof colo, "%d,%d", n_prefill, n_decode);
  static char share_dir[PATH_MAX];
  share_dir[0] = '\0';
  if (!no_share && bk != TW_BACKEND_CPU) tw_serve_share_dir(share_dir, sizeof share_dir);
  for (int k = 0; k < n; k++) {
    bool pre = k < n_prefill;
    tw_serve_slot_t *w = &slots[k];
    memset(w, 0, sizeof *w);
    snprintf(w->base, sizeof w->base, "%s-%d-%d", pre ? "prefill" : "decode", pre ? k : k - n_prefill,
             (int)getpid());
    memcpy(w->name, w->base, sizeof w->base); /* name[80] holds base[64] */
    /* the priority is read by an MPS server only (this serve's, or the
     * operator's named by CUDA_MPS_PIPE_DIRECTORY): harmless elsewhere */
    const bool under_mps = mps.pid > 0 || getenv("CUDA_MPS_PIPE_DIRECTORY");
    w->env = tw_mps_client_env(mps_first, pre);
    if (w->env && under_mps && (k == 0 || k == n_prefill)) /* once: the first it applies to */
      TW_INFO("serve", "cuda mps: %s workers run at below-normal client priority (--mps-first %s)",
              pre ? "prefill" : "decode", mps_first == TW_MPS_FIRST_DECODE ? "decode" : "prefill");
    char **av = w->av;
    int c = 0;
    av[c++] = pre ? prefill_bin : decode_bin;
    av[c++] = "--router";
    av[c++] = s.worker_ep;
    av[c++] = "--model";
    av[c++] = (char *)s.rp.model_dir;
    av[c++] = "--name";
    w->ac_name = c;
    av[c++] = w->name;
    av[c++] = "--backend";
    av[c++] = (char *)backend;
    av[c++] = "--threads";
    av[c++] = num[0];
    if (!pre && kv_blocks) {
      av[c++] = "--kv-blocks";
      av[c++] = num[1];
    }
    if (!pre && max_batch) {
      av[c++] = "--max-batch";
      av[c++] = mbuf;
    }
    av[c++] = "--colocated";
    av[c++] = colo;
    if (mem_util > 0) {
      av[c++] = "--gpu-memory-utilization";
      av[c++] = ubuf;
    }
    if (share_dir[0]) {
      av[c++] = "--share-weights";
      av[c++] = share_dir;
    }
    if (!pre && verify) av[c++] = "--verify-kv";
    if (kv_dtype != TW_KV_DTYPE_AUTO) { /* prefill and decode must agree (KvLayout) */
      av[c++] = "--kv-dtype";
      av[c++] = (char *)tw_kv_dtype_name((tw_kv_dtype_t)kv_dtype);
    }
    /* every worker the same: the decode workers plan around the prefill copies */
    av[c++] = "--prefill-bf16-experts";
    av[c++] = pbf16 > 0 ? "1" : pbf16 < 0 ? "0" : "auto";
    if (!pre && tw_opts_given(&spec, "drain-timeout")) {
      av[c++] = "--drain-timeout";
      av[c++] = num[2];
    }
    if (s.rp.metrics_addr) {
      av[c++] = "--metrics-addr";
      av[c++] = (char *)s.rp.metrics_addr;
    }
    snprintf(w->mport, sizeof w->mport, "%d", mport[k + 1]);
    av[c++] = "--metrics-port";
    av[c++] = w->mport;
    if (s.rp.served_model_name) {
      av[c++] = "--served-model-name";
      av[c++] = (char *)s.rp.served_model_name;
    }
    for (int q = 0; q < 2; q++) { /* --tp / --ep of this pool: the worker starts its ranks */
      int at = (pre ? 0 : 2) + q;
      static const char *const pool_flag[4] = {"prefill-tp", "prefill-ep", "decode-tp", "decode-ep"};
      if (!tw_opts_given(&spec, pool_flag[at])) continue;
      av[c++] = q ? "--ep" : "--tp";
      av[c++] = num[3 + at];
    }
    if (!pre && tw_opts_given(&spec, "decode-dp")) { /* the worker checks it against --ep/--tp */
      av[c++] = "--dp";
      av[c++] = num[7];
    }
    av[c] = NULL;
    if (!tw_serve_slot_spawn(w, tw_serve_now_ns())) w->next_start_ns = w->started_ns + 500000000LL;
  }
  TW_INFO("serve", "started %d workers (%d threads each), waiting for them to register", n, threads);
  int rc = 0, fatal = 0;
  bool mps_retry = false;
  for (;;) { /* supervise the children until a signal */
    if (tw_serve_signal_g) break;
    int status;
    pid_t dead;
    int64_t now = tw_serve_now_ns();
    while ((dead = waitpid(-1, &status, WNOHANG)) > 0) {
      for (int k = 0; k < n; k++) {
        tw_serve_slot_t *w = &slots[k];
        if (w->pid != dead) continue;
        w->pid = 0;
        kill(-dead, SIGKILL); /* ranks it may have started in its process group */
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        pthread_mutex_lock(&s.mu);
        bool was_ready = s.ready;
        pthread_mutex_unlock(&s.mu);
        if (!was_ready && mps.pid > 0 && mps_mode == TW_MPS_AUTO) {
          /* the first start under the MPS server failed: once, every worker
           * again without it (below, after this round of deaths) */
          TW_WARN("serve",
                  "worker %s (pid %d) died before the service was ready (%s %d) under "
                  "cuda mps: starting every worker again without it (--mps off skips this)",
                  w->name, (int)dead, code >= 0 ? "exit status" : "signal",
                  code >= 0 ? code : WTERMSIG(status));
          mps_retry = true;
          continue;
        }
        if (!was_ready || ((code == 2 || code == TW_WORKER_EXIT_CONFIG) && w->restarts == 0)) {
          /* fail fast: restarting cannot fix a configuration, and a worker
           * that never served has no crash to recover from. A restart of a
           * worker that was serving with the same configuration is another
           * matter: its failure to start is the moment's (the GPU still held
           * by a faulted neighbour under MPS, a port not yet free), so it
           * takes the restart path below, backoff and limit included */
          fprintf(stderr, "twain serve: worker %s (pid %d) %s (%s %d; its error is above): stopping\n",
                  w->name, (int)dead,
                  code == 2 || code == TW_WORKER_EXIT_CONFIG
                      ? "could not start: a configuration or environment error"
                      : "died before the service was ready",
                  code >= 0 ? "exit status" : "signal", code >= 0 ? code : WTERMSIG(status));
          w->gave_up = true;
          fatal = code >= 0 ? TW_WORKER_EXIT_CONFIG : 1;
          continue;
        }
        if (now - w->started_ns > (int64_t)TW_SERVE_STABLE_S * 1000000000LL) w->restarts = 0;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) { /* drained (someone's SIGTERM) */
          w->drained = true;
          w->next_start_ns = now + 500000000LL;
          TW_INFO(
              "serve",
              "worker %s (pid %d) drained and exited (status 0): starting a fresh one in 500 ms",
              w->name, (int)dead);
          continue;
        }
        if (w->restarts >= TW_SERVE_MAX_RESTARTS) {
          w->gave_up = true;
          TW_ERROR("serve", "worker %s (pid %d) exited (%s %d) after %d restarts in a row: not restarting it",
                   w->name, (int)dead, WIFEXITED(status) ? "status" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), w->restarts);
          /* the last of its pool: the router stops holding requests for it */
          const bool pre = k < n_prefill;
          bool all = true;
          for (int j = pre ? 0 : n_prefill; j < (pre ? n_prefill : n); j++) all &= slots[j].gave_up;
          if (all) {
            atomic_store(&s.given_up[pre ? 0 : 1], 1);
            TW_ERROR("serve",
                     "no %s worker will be started again: requests that need one now fail "
                     "at once (UNAVAILABLE)",
                     pre ? "prefill" : "decode");
          }
          continue;
        }
        int64_t backoff_ms = 500LL << (w->restarts < 4 ? w->restarts : 4);
        w->next_start_ns = now + backoff_ms * 1000000LL;
        const bool no_start = code == 2 || code == TW_WORKER_EXIT_CONFIG; /* a restart, see above */
        const char *how = no_start ? "exit status" : WIFEXITED(status) ? "status" : "signal";
        TW_WARN("serve",
                "worker %s (pid %d) %s (%s %d%s): restarting it in %lld ms (restart %d of %d)",
                w->name, (int)dead, no_start ? "could not start again" : "exited", how,
                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                no_start ? "; its error is above" : "", (long long)backoff_ms, w->restarts + 1,
                TW_SERVE_MAX_RESTARTS);
      }
    }
    if (mps_retry) {
      for (int k = 0; k < n; k++) /* the others: nothing served yet, nothing to drain */
        if (slots[k].pid > 0) {
          tw_serve_kill(slots[k].pid);
          slots[k].pid = 0;
        }
      tw_mps_stop(&mps);
      for (int k = 0; k < n; k++) {
        tw_serve_slot_t *w = &slots[k];
        memcpy(w->name, w->base, sizeof w->base);
        w->restarts = 0;
        w->gave_up = false;
        atomic_store(&s.given_up[k < n_prefill ? 0 : 1], 0);
        if (!tw_serve_slot_spawn(w, now)) w->next_start_ns = now + 500000000LL;
      }
      mps_retry = false;
    }
    int running = 0;
    for (int k = 0; k < n; k++) {
      tw_serve_slot_t *w = &slots[k];
      if (!w->pid && !w->gave_up && w->next_start_ns && now >= w->next_start_ns) {
        bool drained = w->drained;
        w->drained = false;
        if (!drained) w->restarts++; /* a crash counts toward the limit, a drained exit does not */
        w->generation++;
        char name[sizeof w->name]; /* via a local: -Wrestrict cannot tell name from base */
        /* a fresh routing id: the router may still hold an earlier process
         * under the last one (not yet expired), so never one used before */
        snprintf(name, sizeof name, "%s-r%d", w->base, w->generation);
        memcpy(w->name, name, sizeof name);
        if (tw_serve_slot_spawn(w, now))
          TW_LOG(drained ? TW_LOG_INFO : TW_LOG_WARN, "serve", "restarted worker %s as pid %d",
                 w->name, (int)w->pid);
        else
          w->next_start_ns = now + 1000000000LL;
      }
      running += w->pid > 0 || !w->gave_up;
    }
    if (fatal) {
      rc = fatal;
      break;
    }
    pthread_mutex_lock(&s.mu);
    int router_gone = s.bound < 0, registered = s.n_registered;
    pthread_mutex_unlock(&s.mu);
    if (router_gone) break;
    if (!running && !registered) {
      fprintf(stderr, "twain serve: every worker exited and none is registered; stopping\n");
      rc = 1;
      break;
    }
    struct timespec ts = {0, 50 * 1000000};
    nanosleep(&ts, NULL);
  }
  TW_INFO("serve", "stopping: draining the router, then the workers");
  atomic_store(&s.router_stop, 1);
  bool forced = false; /* a second signal: the router fails what runs, the workers stop now */
  for (;;) {
    pthread_mutex_lock(&s.mu);
    int done = s.router_done;
    pthread_mutex_unlock(&s.mu);
    if (done) break;
    if (tw_serve_signal_g >= 2 && !forced) {
      forced = true;
      TW_WARN("serve", "second stop signal: failing running requests, stopping the workers now");
      atomic_store(&s.router_stop, 2);
    }
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
  }
  pthread_join(th, NULL);
  pthread_mutex_lock(&s.mu);
  bool served = s.ready;
  pthread_mutex_unlock(&s.mu);
  for (int k = 0; k < n; k++) {
    if (slots[k].pid <= 0) continue;
    if (fatal && !served) kill(-slots[k].pid, SIGKILL); /* nothing to drain: do not wait for a load */
    kill(slots[k].pid, fatal && !served ? SIGKILL : SIGTERM);
  }
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int64_t resend_ns = 0;
  for (;;) {
    if (tw_serve_signal_g >= 2 && !forced) {
      forced = true;
      TW_WARN("serve", "second stop signal: stopping the workers now");
    }
    int64_t now = tw_serve_now_ns();
    if (forced && now >= resend_ns) { /* again every 0.2 s: two SIGTERMs pending at once are one */
      resend_ns = now + 200000000LL;
      for (int k = 0; k < n; k++)
        if (slots[k].pid > 0) kill(slots[k].pid, SIGTERM);
    }
    int alive = 0;
    for (int k = 0; k < n; k++) {
      if (slots[k].pid <= 0) continue;
      if (waitpid(slots[k].pid, NULL, WNOHANG) == slots[k].pid) slots[k].pid = 0;
      else alive++;
    }
    if (!alive) break;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 15) {
      for (int k = 0; k < n; k++)
        if (slots[k].pid > 0) {
          TW_WARN("serve", "worker pid %d did not stop in 15 s: killing it", (int)slots[k].pid);
          tw_serve_kill(slots[k].pid); /* its process group: ranks it started too */
          slots[k].pid = 0;
        }
      break;
    }
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
  }
  tw_mps_stop(&mps); /* after the workers: its server goes with its last client */
  tw_serve_share_dir_remove(share_dir);
  printf("twain serve: stopped\n");
  fflush(stdout);
  return rc ? rc : s.router_status == TW_OK ? 0 : 1;
}

int tw_cli_router(int argc, char **argv) { return tw_router_main(argc, argv); }
