/* engine_cuda_share.cu: one copy of the weights for the workers on a GPU
 * (engine.h weights_share_dir). The weights live in one device arena
 * (engine_cuda.cu); the first engine to take the lock of the share file
 * allocates and uploads it, then publishes its CUDA IPC handle
 * (cudaIpcGetMemHandle) in the file; the next ones open that handle
 * (cudaIpcOpenMemHandle) and build their weight pointers over the same bytes
 * without uploading anything.
 *
 * Files, in the directory (0700, made by `twain serve` for its workers):
 *   weights-dev<D>-tp<T>r<R>-ep<E>r<Q>.lock   flock(2): held while uploading
 *   weights-dev<D>-tp<T>r<R>-ep<E>r<Q>.ipc    tw_ce_share_rec_t (0600)
 *   weights-dev<D>-tp<T>r<R>-ep<E>r<Q>.users  flock(2): shared by every importer
 * A record is used only when its magic, version, device, size and model
 * fingerprint match and its process is alive; otherwise (a stale file) the
 * engine uploads its own copy and publishes that.
 * Lifetime: the memory belongs to the exporter, and freeing it while another
 * process maps it is undefined (cudaIpcOpenMemHandle). So an importer holds
 * a shared lock on the users file while it maps the arena, and the
 * exporter, when destroyed, first removes its record (no new importer) and
 * then waits for an exclusive lock on the users file (every importer gone,
 * at most TW_CE_SHARE_WAIT_S) before it frees the arena: a draining decode
 * worker keeps its weights while the prefill worker that exported them has
 * stopped. If the exporter dies anyway (killed), each importer's watch
 * thread sees it within a second and ends its process with status 70
 * rather than compute on freed memory; its supervisor restarts it, and the
 * restarted worker finds no live record and uploads a copy again. */
#include "kernels/engine_cuda_impl.h"

#include "common/log.h"
#include "kernels/cuda_common.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TW_CE_SHARE_MAGIC 0x77737774u /* "twsw" */
#define TW_CE_SHARE_VERSION 1u
/* an upload of gpt-oss-120b takes about a minute; wait well beyond it */
#define TW_CE_SHARE_WAIT_S 900

typedef struct {
  uint32_t magic, version;
  int32_t pid, device;
  uint64_t bytes;
  uint64_t fingerprint;
  cudaIpcMemHandle_t handle;
} tw_ce_share_rec_t;

static uint64_t tw_fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* The shapes, this rank's shard and a sample of the bytes of the first and
 * last tensors: two different checkpoints never share a record. */
static uint64_t tw_ce_share_fingerprint(const tw_ce_t *ce, const tw_model_t *m, size_t bytes) {
  const tw_model_config_t *c = &m->config;
  int64_t v[] = {c->n_layers, c->n_experts, c->n_experts_per_tok, c->vocab_size, c->hidden,
                 c->intermediate, c->head_dim, c->n_heads, c->n_kv_heads, ce->tp, ce->tp_rank,
                 ce->ep, ce->ep_rank, ce->bf16_experts, (int64_t)bytes};
  uint64_t h = tw_fnv(0xcbf29ce484222325ull, v, sizeof v);
  const tw_tensor_t *ts[2] = {&m->embed, &m->layers[c->n_layers - 1].router_w};
  for (int i = 0; i < 2; i++)
    if (ts[i]->data)
      h = tw_fnv(h, ts[i]->data, (size_t)(ts[i]->n_bytes < 4096 ? ts[i]->n_bytes : 4096));
  return h;
}

static void tw_ce_share_name(const tw_ce_t *ce, const char *dir, int device, const char *ext,
                             char *out, size_t len) {
  snprintf(out, len, "%s/weights-dev%d-tp%dr%d-ep%dr%d.%s", dir, device, ce->tp, ce->tp_rank,
           ce->ep, ce->ep_rank, ext);
}

/* The importer's watch thread: the exporter's pid, checked every 200 ms. */
static void *tw_ce_share_watch(void *arg) {
  tw_ce_t *ce = (tw_ce_t *)arg;
  int ticks = 0;
  while (!ce->share_stop) {
    struct timespec ts = {0, 200 * 1000000};
    nanosleep(&ts, NULL);
    if (++ticks % 5) continue; /* the pid once a second, the stop flag 5 times */
    if (kill(ce->share_owner, 0) != 0 && errno == ESRCH && !ce->share_stop) {
      TW_ERROR("engine", "the worker that holds the shared weights (pid %d) exited: this "
               "process stops now (status 70) rather than compute on freed memory; it is "
               "restarted with weights of its own", (int)ce->share_owner);
      _exit(70);
    }
  }
  return NULL;
}

static bool tw_ce_share_read(const char *path, tw_ce_share_rec_t *r) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, r, sizeof *r);
  close(fd);
  return n == (ssize_t)sizeof *r;
}

extern "C" tw_status_t tw_ce_share_open(tw_ce_t *ce, const tw_model_t *m,
                                        const tw_engine_params_t *p, size_t bytes,
                                        int *imported_p) {
  char lock[1024];
  *imported_p = 0;
  tw_ce_share_name(ce, p->weights_share_dir, p->device, "lock", lock, sizeof lock);
  tw_ce_share_name(ce, p->weights_share_dir, p->device, "ipc", ce->share_path,
                   sizeof ce->share_path);
  int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0)
    return tw_err(TW_ERR_IO, "cuda engine: cannot open the weights lock %s: %s", lock,
                  strerror(errno));
  /* another worker may be uploading: wait for its lock (bounded) */
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int64_t next_log_s = 15;
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      tw_status_t st = tw_err(TW_ERR_IO, "cuda engine: flock %s: %s", lock, strerror(errno));
      close(fd);
      return st;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t waited = (int64_t)(now.tv_sec - t0.tv_sec);
    if (waited >= TW_CE_SHARE_WAIT_S) {
      close(fd);
      return tw_err(TW_ERR_DEADLINE,
                    "cuda engine: another worker has held %s for %d s while uploading the "
                    "weights: giving up",
                    lock, TW_CE_SHARE_WAIT_S);
    }
    if (waited >= next_log_s) {
      TW_INFO("engine", "waiting %lld s for another worker's weights upload (%s)",
              (long long)waited, lock);
      next_log_s += 15;
    }
    struct timespec ts = {0, 100 * 1000000};
    nanosleep(&ts, NULL);
  }
  uint64_t fp = tw_ce_share_fingerprint(ce, m, bytes);
  tw_ce_share_rec_t r;
  if (tw_ce_share_read(ce->share_path, &r)) {
    bool alive = r.pid > 0 && r.pid != (int32_t)getpid() && (kill(r.pid, 0) == 0 || errno == EPERM);
    if (r.magic == TW_CE_SHARE_MAGIC && r.version == TW_CE_SHARE_VERSION && r.device == p->device &&
        r.bytes == bytes && r.fingerprint == fp && alive) {
      void *ptr = NULL;
      char users[1024];
      tw_ce_share_name(ce, p->weights_share_dir, p->device, "users", users, sizeof users);
      int ufd = open(users, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      /* a shared lock on the users file: the exporter keeps the arena while we map it;
       * refused while the exporter is freeing it */
      bool held = ufd >= 0 && flock(ufd, LOCK_SH | LOCK_NB) == 0;
      cudaError_t ce_err = held ? cudaIpcOpenMemHandle(&ptr, r.handle,
                                                       cudaIpcMemLazyEnablePeerAccess)
                                : cudaErrorInvalidValue;
      if (ce_err == cudaSuccess) {
        ce->warena = ptr;
        ce->warena_imported = 1;
        ce->share_users_fd = ufd;
        ce->share_owner = r.pid;
        if (pthread_create(&ce->share_watch, NULL, tw_ce_share_watch, ce) == 0)
          ce->share_watching = 1;
        else
          TW_WARN("engine", "weights: no watch thread on the exporter (pid %d)", (int)r.pid);
        *imported_p = 1;
        flock(fd, LOCK_UN);
        close(fd);
        TW_INFO("engine", "weights: %.2f GiB mapped from worker pid %d through CUDA IPC (%s), "
                "nothing uploaded", (double)bytes / TW_MEM_GIB, (int)r.pid, ce->share_path);
        return TW_OK;
      }
      cudaGetLastError();
      if (ufd >= 0) close(ufd);
      TW_WARN("engine", "weights: cannot map the weights of pid %d (%s): uploading an own copy",
              (int)r.pid, held ? cudaGetErrorString(ce_err) : "it is freeing them");
    } else {
      TW_INFO("engine", "weights: %s is stale or of another model (pid %d %s): uploading and "
              "exporting a copy", ce->share_path, (int)r.pid, alive ? "alive" : "gone");
    }
  }
  /* this engine uploads and exports: the lock is held until tw_ce_share_publish */
  cudaError_t e = cudaMalloc(&ce->warena, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    close(fd);
    return tw_err(TW_ERR_NO_MEMORY, "cuda engine: cannot allocate %.2f GiB for the weights: %s",
                  (double)bytes / TW_MEM_GIB, cudaGetErrorString(e));
  }
  ce->share_fd = fd;
  ce->share_fp = fp;
  return TW_OK;
}

extern "C" tw_status_t tw_ce_share_publish(tw_ce_t *ce, int device) {
  tw_ce_share_rec_t r;
  memset(&r, 0, sizeof r);
  r.magic = TW_CE_SHARE_MAGIC;
  r.version = TW_CE_SHARE_VERSION;
  r.pid = (int32_t)getpid();
  r.device = device;
  r.bytes = ce->warena_bytes;
  r.fingerprint = ce->share_fp;
  tw_status_t st = TW_OK;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.%d.tmp", ce->share_path, (int)getpid());
  cudaError_t e = cudaIpcGetMemHandle(&r.handle, ce->warena);
  if (e != cudaSuccess) {
    cudaGetLastError();
    st = tw_err(TW_ERR_CUDA, "cuda engine: cudaIpcGetMemHandle of the weights: %s",
                cudaGetErrorString(e));
  } else {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    bool ok = fd >= 0 && write(fd, &r, sizeof r) == (ssize_t)sizeof r;
    if (fd >= 0) ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, ce->share_path) != 0) {
      st = tw_err(TW_ERR_IO, "cuda engine: cannot write the weights record %s: %s",
                  ce->share_path, strerror(errno));
      unlink(tmp);
    } else {
      ce->share_exported = 1;
      TW_INFO("engine", "weights: %.2f GiB exported through CUDA IPC for the other workers on "
              "this GPU (%s)", (double)ce->warena_bytes / TW_MEM_GIB, ce->share_path);
    }
  }
  flock(ce->share_fd, LOCK_UN);
  close(ce->share_fd);
  ce->share_fd = -1;
  return st;
}

extern "C" void tw_ce_share_close(tw_ce_t *ce) {
  if (ce->share_fd >= 0) { /* failed between open and publish */
    flock(ce->share_fd, LOCK_UN);
    close(ce->share_fd);
    ce->share_fd = -1;
  }
  if (ce->warena_imported) {
    ce->share_stop = 1;
    if (ce->share_watching) pthread_join(ce->share_watch, NULL);
    cudaIpcCloseMemHandle(ce->warena);
    close(ce->share_users_fd); /* releases the shared lock: the exporter may free */
  } else if (ce->warena) {
    tw_ce_share_rec_t r;
    if (ce->share_exported) {
      /* no new worker may map memory that is about to be freed; then wait
       * for the workers that map it (bounded) */
      if (tw_ce_share_read(ce->share_path, &r) && r.pid == (int32_t)getpid())
        unlink(ce->share_path);
      char users[1100];
      snprintf(users, sizeof users, "%.*susers", (int)(strlen(ce->share_path) - 3),
               ce->share_path);
      int ufd = open(users, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      struct timespec t0, now;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      int64_t next_log_s = 0;
      while (ufd >= 0 && flock(ufd, LOCK_EX | LOCK_NB) != 0) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t waited = (int64_t)(now.tv_sec - t0.tv_sec);
        if (waited >= TW_CE_SHARE_WAIT_S) {
          TW_WARN("engine", "weights: other workers still map them after %d s: freeing anyway",
                  TW_CE_SHARE_WAIT_S);
          break;
        }
        if (waited >= next_log_s) {
          TW_INFO("engine", "weights: waiting for the other workers on this GPU to stop using "
                  "them before freeing (%lld s)", (long long)waited);
          next_log_s += 15;
        }
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
      }
      if (ufd >= 0) close(ufd);
    }
    cudaFree(ce->warena);
  }
  ce->warena = NULL;
}
