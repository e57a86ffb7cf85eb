/* engine_cuda_share.cu: one copy of the weights for the workers on a GPU
 * (engine.h weights_share_dir).
 *
 * The weights live in one device arena made with the CUDA virtual memory API
 * (cuMemCreate, shareable as a POSIX file descriptor; reserved, mapped and
 * made accessible like any device memory). The first engine to take the
 * lock file uploads it; then every engine that holds the arena, the
 * uploader and each one that mapped it, offers it on a UNIX socket in the
 * directory: a worker that connects receives a header (magic, version,
 * device, bytes, model fingerprint) and the file descriptor (SCM_RIGHTS),
 * imports it (cuMemImportFromShareableHandle) and maps it, uploading
 * nothing.
 *
 * Files, in the directory (0700, made by `twain serve` for its workers):
 *   weights-dev<D>-tp<T>r<R>-ep<E>r<Q>.lock         flock(2): held while uploading
 *   weights-dev<D>-tp<T>r<R>-ep<E>r<Q>.<pid>.sock   a holder's socket (0600)
 * A socket is used only when its process is alive and its header matches
 * (device, size, fingerprint); a dead holder's socket is removed by the
 * first worker that finds it.
 *
 * Lifetime: the driver counts the references to the physical memory (each
 * process's handle and mappings), so it lives while any worker maps it: a
 * holder that exits or is killed takes nothing from the others, and a
 * restarted worker maps the copy from a surviving one. (The legacy
 * cudaIpcGetMemHandle memory belonged to its exporter: its importers had to
 * stop when it died.) Where the virtual memory API or its POSIX handles are
 * missing, each engine keeps an own copy (logged).
 *
 * The driver API is reached through cudaGetDriverEntryPointByVersion, so
 * the programs link no libcuda and run on machines without a driver. */
#include "kernels/engine_cuda_impl.h"

#include "common/base/log.h"
#include "kernels/cuda_common.h"

#include <cuda.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define TW_CE_SHARE_MAGIC 0x77737774u /* "twsw" */
#define TW_CE_SHARE_VERSION 2u        /* 1: cudaIpcMemHandle records */
/* an upload of gpt-oss-120b takes about a minute; wait well beyond it */
#define TW_CE_SHARE_WAIT_S 900

typedef struct {
  uint32_t magic, version;
  int32_t pid, device;
  uint64_t bytes;
  uint64_t fingerprint;
} tw_ce_share_hdr_t;

/* ---- the driver's virtual memory API, resolved at run time ---- */
typedef CUresult (*tw_cu_granularity_fn)(size_t *, const CUmemAllocationProp *,
                                         CUmemAllocationGranularity_flags);
typedef CUresult (*tw_cu_create_fn)(CUmemGenericAllocationHandle *, size_t,
                                    const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*tw_cu_reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*tw_cu_map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                 unsigned long long);
typedef CUresult (*tw_cu_set_access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*tw_cu_export_fn)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                    unsigned long long);
typedef CUresult (*tw_cu_import_fn)(CUmemGenericAllocationHandle *, void *,
                                    CUmemAllocationHandleType);
typedef CUresult (*tw_cu_unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*tw_cu_addr_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*tw_cu_release_fn)(CUmemGenericAllocationHandle);

typedef struct {
  int ok;
  tw_cu_granularity_fn granularity;
  tw_cu_create_fn create;
  tw_cu_reserve_fn reserve;
  tw_cu_map_fn map;
  tw_cu_set_access_fn set_access;
  tw_cu_export_fn export_;
  tw_cu_import_fn import_;
  tw_cu_unmap_fn unmap;
  tw_cu_addr_free_fn addr_free;
  tw_cu_release_fn release;
} tw_cu_vmm_t;

static tw_cu_vmm_t g_vmm;
static pthread_once_t g_vmm_once = PTHREAD_ONCE_INIT;

static void tw_cu_vmm_load(void) {
  tw_cu_vmm_t v;
  memset(&v, 0, sizeof v);
  v.granularity = (tw_cu_granularity_fn)tw_cuda_driver_sym("cuMemGetAllocationGranularity");
  v.create = (tw_cu_create_fn)tw_cuda_driver_sym("cuMemCreate");
  v.reserve = (tw_cu_reserve_fn)tw_cuda_driver_sym("cuMemAddressReserve");
  v.map = (tw_cu_map_fn)tw_cuda_driver_sym("cuMemMap");
  v.set_access = (tw_cu_set_access_fn)tw_cuda_driver_sym("cuMemSetAccess");
  v.export_ = (tw_cu_export_fn)tw_cuda_driver_sym("cuMemExportToShareableHandle");
  v.import_ = (tw_cu_import_fn)tw_cuda_driver_sym("cuMemImportFromShareableHandle");
  v.unmap = (tw_cu_unmap_fn)tw_cuda_driver_sym("cuMemUnmap");
  v.addr_free = (tw_cu_addr_free_fn)tw_cuda_driver_sym("cuMemAddressFree");
  v.release = (tw_cu_release_fn)tw_cuda_driver_sym("cuMemRelease");
  v.ok = v.granularity && v.create && v.reserve && v.map && v.set_access && v.export_ &&
         v.import_ && v.unmap && v.addr_free && v.release;
  g_vmm = v;
}

static CUmemAllocationProp tw_ce_vmm_prop(int device) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

/* Reserve an address range for ce->vmm_handle, map it and open it to this
 * device; sets ce->warena. Releases nothing on failure (the caller does). */
static TW_NODISCARD tw_status_t tw_ce_vmm_map(tw_ce_t *ce, int device) {
  CUdeviceptr va = 0;
  CUresult r = g_vmm.reserve(&va, ce->vmm_bytes, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = g_vmm.map(va, ce->vmm_bytes, 0, (CUmemGenericAllocationHandle)ce->vmm_handle, 0);
    if (r == CUDA_SUCCESS) {
      CUmemAccessDesc acc;
      memset(&acc, 0, sizeof acc);
      acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      acc.location.id = device;
      acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = g_vmm.set_access(va, ce->vmm_bytes, &acc, 1);
      if (r == CUDA_SUCCESS) {
        ce->warena = (void *)(uintptr_t)va;
        return TW_OK;
      }
      g_vmm.unmap(va, ce->vmm_bytes);
    }
    g_vmm.addr_free(va, ce->vmm_bytes);
  }
  return tw_err(TW_ERR_CUDA, "cuda engine: mapping the %.2f GiB weight arena failed (CUresult %d)",
                (double)ce->vmm_bytes / TW_MEM_GIB, (int)r);
}

static uint64_t tw_fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* The shapes, this rank's shard and a sample of the bytes of the first and
 * last tensors: two different checkpoints never share an arena. */
static uint64_t tw_ce_share_fingerprint(const tw_ce_t *ce, const tw_model_t *m, size_t bytes) {
  const tw_model_config_t *c = &m->config;
  int64_t v[] = {c->n_layers, c->n_experts, c->n_experts_per_tok, c->vocab_size, c->hidden,
                 c->intermediate, c->head_dim, c->n_heads, c->n_kv_heads, ce->sh.tp_size, ce->sh.tp_rank,
                 ce->sh.ep_size, ce->sh.ep_rank, ce->bf16_experts, (int64_t)bytes};
  uint64_t h = tw_fnv(0xcbf29ce484222325ull, v, sizeof v);
  const tw_tensor_t *ts[2] = {&m->embed, &m->layers[c->n_layers - 1].router_w};
  for (int i = 0; i < 2; i++)
    if (ts[i]->data)
      h = tw_fnv(h, ts[i]->data, (size_t)(ts[i]->n_bytes < 4096 ? ts[i]->n_bytes : 4096));
  return h;
}

/* "<dir>/weights-dev<D>-tp<T>r<R>-ep<E>r<Q>" */
static void tw_ce_share_base(const tw_ce_t *ce, const char *dir, int device, char *out,
                             size_t len) {
  snprintf(out, len, "%s/weights-dev%d-tp%dr%d-ep%dr%d", dir, device, ce->sh.tp_size, ce->sh.tp_rank, ce->sh.ep_size,
           ce->sh.ep_rank);
}

static bool tw_pid_alive(int32_t pid) {
  return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* One header and room for one descriptor (SCM_RIGHTS), for sendmsg and recvmsg. */
typedef struct {
  tw_ce_share_hdr_t h;
  struct iovec io;
  alignas(struct cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
  struct msghdr msg;
} tw_ce_share_msg_t;

static void tw_ce_share_msg_init(tw_ce_share_msg_t *m) {
  memset(m, 0, sizeof *m);
  m->io.iov_base = &m->h;
  m->io.iov_len = sizeof m->h;
  m->msg.msg_iov = &m->io;
  m->msg.msg_iovlen = 1;
  m->msg.msg_control = m->cbuf;
  m->msg.msg_controllen = sizeof m->cbuf;
}

/* The serving thread: each connection gets the header and the descriptor. */
static void *tw_ce_share_serve(void *arg) {
  tw_ce_t *ce = (tw_ce_t *)arg;
  while (!ce->share_stop) {
    struct pollfd pfd = {ce->share_sock, POLLIN, 0};
    if (poll(&pfd, 1, 200) <= 0) continue;
    int c = accept4(ce->share_sock, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) continue;
    struct timeval tv = {2, 0};
    setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    tw_ce_share_msg_t m;
    tw_ce_share_msg_init(&m);
    m.h.magic = TW_CE_SHARE_MAGIC;
    m.h.version = TW_CE_SHARE_VERSION;
    m.h.pid = (int32_t)getpid();
    m.h.device = ce->share_device;
    m.h.bytes = ce->warena_bytes;
    m.h.fingerprint = ce->share_fp;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m.msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &ce->share_mem_fd, sizeof(int));
    if (sendmsg(c, &m.msg, MSG_NOSIGNAL) != (ssize_t)sizeof m.h)
      TW_WARN("engine", "weights: sending the arena to a worker failed: %s", strerror(errno));
    close(c);
  }
  return NULL;
}

/* Offer the arena: the shareable descriptor on <base>.<pid>.sock, served
 * by a thread until tw_ce_share_close. Errors: TW_ERR_CUDA, TW_ERR_IO. */
static TW_NODISCARD tw_status_t tw_ce_share_offer(tw_ce_t *ce, const char *base) {
  if (ce->share_mem_fd < 0) {
    int fd = -1;
    CUresult r = g_vmm.export_(&fd, (CUmemGenericAllocationHandle)ce->vmm_handle,
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS || fd < 0)
      return tw_err(TW_ERR_CUDA, "cuda engine: cuMemExportToShareableHandle of the weights failed "
                    "(CUresult %d)", (int)r);
    ce->share_mem_fd = fd;
  }
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  int n = snprintf(ce->share_path, sizeof ce->share_path, "%s.%d.sock", base, (int)getpid());
  if (n < 0 || (size_t)n >= sizeof a.sun_path)
    return tw_err(TW_ERR_IO, "cuda engine: the weights socket path %s is too long for a UNIX "
                  "socket (%zu bytes at most)", ce->share_path, sizeof a.sun_path - 1);
  memcpy(a.sun_path, ce->share_path, (size_t)n + 1);
  unlink(ce->share_path); /* a dead process with this pid left it */
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  mode_t old = umask(0177); /* the socket 0600 from its creation */
  int rc = s < 0 ? -1 : bind(s, (struct sockaddr *)&a, sizeof a);
  umask(old);
  if (rc != 0 || listen(s, 16) != 0) {
    tw_status_t st = tw_err(TW_ERR_IO, "cuda engine: cannot listen on %s: %s", ce->share_path,
                            strerror(errno));
    if (s >= 0) close(s);
    ce->share_path[0] = 0;
    return st;
  }
  ce->share_sock = s;
  ce->share_stop = 0;
  if (pthread_create(&ce->share_thread, NULL, tw_ce_share_serve, ce) != 0) {
    close(s);
    ce->share_sock = -1;
    unlink(ce->share_path);
    ce->share_path[0] = 0;
    return tw_err(TW_ERR_IO, "cuda engine: cannot start the weights serving thread");
  }
  ce->share_serving = 1;
  return TW_OK;
}

/* Receive a live holder's arena from its socket `path`; 1 when mapped. */
static int tw_ce_share_take(tw_ce_t *ce, const char *path, int device, size_t bytes, uint64_t fp,
                            int32_t *pid_p) {
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  if (strlen(path) >= sizeof a.sun_path) return 0;
  memcpy(a.sun_path, path, strlen(path) + 1);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return 0;
  struct timeval tv = {3, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
    close(s);
    return 0;
  }
  tw_ce_share_msg_t m;
  tw_ce_share_msg_init(&m);
  ssize_t got = recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
  close(s);
  int fd = -1;
  struct cmsghdr *cm = got == (ssize_t)sizeof m.h ? CMSG_FIRSTHDR(&m.msg) : NULL;
  if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
      cm->cmsg_len == CMSG_LEN(sizeof(int)))
    memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  if (fd < 0) return 0;
  const tw_ce_share_hdr_t h = m.h;
  if (h.magic != TW_CE_SHARE_MAGIC || h.version != TW_CE_SHARE_VERSION || h.device != device ||
      h.bytes != bytes || h.fingerprint != fp) {
    close(fd);
    return 0;
  }
  CUmemGenericAllocationHandle hd = 0;
  CUresult r = g_vmm.import_(&hd, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    close(fd);
    TW_WARN("engine", "weights: cannot import the arena of pid %d (CUresult %d)", (int)h.pid,
            (int)r);
    return 0;
  }
  ce->vmm_handle = (unsigned long long)hd;
  if (tw_ce_vmm_map(ce, device) != TW_OK) {
    g_vmm.release(hd);
    close(fd);
    TW_WARN("engine", "weights: %s", tw_last_error());
    return 0;
  }
  ce->warena_vmm = 1;
  ce->share_mem_fd = fd; /* served on this process's socket from now on */
  *pid_p = h.pid;
  return 1;
}

/* Map the arena from any live holder of <base>.<pid>.sock; removes the
 * sockets of dead holders (all of them, also after a live one mapped). 1
 * when mapped. */
static int tw_ce_share_find(tw_ce_t *ce, const char *dir, const char *base, int device,
                            size_t bytes, uint64_t fp) {
  const char *prefix = strrchr(base, '/') ? strrchr(base, '/') + 1 : base;
  size_t plen = strlen(prefix);
  DIR *d = opendir(dir);
  if (!d) return 0;
  int mapped = 0;
  struct dirent *de;
  /* every entry: a holder found early must not leave later stale sockets */
  while ((de = readdir(d)) != NULL) {
    const char *nm = de->d_name;
    int pid = 0, used = 0;
    if (strncmp(nm, prefix, plen) != 0 || nm[plen] != '.' ||
        sscanf(nm + plen + 1, "%d.sock%n", &pid, &used) != 1 || nm[plen + 1 + used] != 0)
      continue;
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", dir, nm);
    if (pid == (int)getpid()) continue;
    if (!tw_pid_alive(pid)) { /* a killed holder's socket */
      unlink(path);
      continue;
    }
    if (mapped) continue;
    int32_t from = 0;
    mapped = tw_ce_share_take(ce, path, device, bytes, fp, &from);
    if (mapped)
      TW_INFO("engine", "weights: %.2f GiB mapped from worker pid %d (%s), nothing uploaded",
              (double)bytes / TW_MEM_GIB, (int)from, path);
  }
  closedir(d);
  return mapped;
}

extern "C" tw_status_t tw_ce_share_open(tw_ce_t *ce, const tw_model_t *m,
                                        const tw_engine_params_t *p, size_t bytes,
                                        int *imported_p) {
  *imported_p = 0;
  pthread_once(&g_vmm_once, tw_cu_vmm_load);
  size_t gran = 0;
  CUmemAllocationProp prop = tw_ce_vmm_prop(p->device);
  if (!g_vmm.ok ||
      g_vmm.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
      gran == 0) {
    TW_WARN("engine", "weights: the CUDA virtual memory API is not available: this worker keeps "
            "an own copy (%.2f GiB)", (double)bytes / TW_MEM_GIB);
    cudaError_t e = cudaMalloc(&ce->warena, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return tw_err(TW_ERR_NO_MEMORY, "cuda engine: cannot allocate %.2f GiB for the weights: %s",
                    (double)bytes / TW_MEM_GIB, cudaGetErrorString(e));
    }
    return TW_OK;
  }
  char lock[1100];
  tw_ce_share_base(ce, p->weights_share_dir, p->device, ce->share_base, sizeof ce->share_base);
  const char *base = ce->share_base;
  ce->share_device = p->device;
  snprintf(lock, sizeof lock, "%s.lock", base);
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
  ce->share_fp = fp;
  ce->vmm_bytes = (bytes + gran - 1) / gran * gran;
  if (tw_ce_share_find(ce, p->weights_share_dir, base, p->device, bytes, fp)) {
    ce->warena_imported = 1;
    tw_status_t st = tw_ce_share_offer(ce, base); /* survivors serve restarted workers */
    if (st != TW_OK)
      TW_WARN("engine", "weights: mapped, but not offered to other workers: %s", tw_last_error());
    flock(fd, LOCK_UN);
    close(fd);
    *imported_p = 1;
    return TW_OK;
  }
  /* this engine uploads and offers: the lock is held until tw_ce_share_publish */
  CUmemGenericAllocationHandle h = 0;
  CUresult r = g_vmm.create(&h, ce->vmm_bytes, &prop, 0);
  if (r != CUDA_SUCCESS) {
    close(fd);
    return tw_err(TW_ERR_NO_MEMORY, "cuda engine: cannot allocate %.2f GiB for the weights "
                  "(cuMemCreate: CUresult %d)", (double)ce->vmm_bytes / TW_MEM_GIB, (int)r);
  }
  ce->vmm_handle = (unsigned long long)h;
  tw_status_t st = tw_ce_vmm_map(ce, p->device);
  if (st != TW_OK) {
    g_vmm.release(h);
    close(fd);
    return st;
  }
  ce->warena_vmm = 1;
  ce->share_fd = fd;
  TW_INFO("engine", "weights: no other worker holds them: uploading %.2f GiB to share (%s)",
          (double)bytes / TW_MEM_GIB, lock);
  return TW_OK;
}

extern "C" tw_status_t tw_ce_share_publish(tw_ce_t *ce, int device) {
  (void)device; /* ce->share_device, from open */
  tw_status_t st = tw_ce_share_offer(ce, ce->share_base);
  if (st == TW_OK) {
    ce->share_exported = 1;
    TW_INFO("engine", "weights: %.2f GiB offered to the other workers on this GPU (%s)",
            (double)ce->warena_bytes / TW_MEM_GIB, ce->share_path);
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
  if (ce->share_serving) {
    ce->share_stop = 1;
    pthread_join(ce->share_thread, NULL);
    ce->share_serving = 0;
  }
  if (ce->share_sock >= 0) {
    close(ce->share_sock);
    ce->share_sock = -1;
  }
  if (ce->share_path[0]) unlink(ce->share_path);
  ce->share_path[0] = 0;
  if (ce->share_mem_fd >= 0) {
    close(ce->share_mem_fd);
    ce->share_mem_fd = -1;
  }
  if (ce->warena_vmm) {
    /* this process's mapping and reference; the memory stays while others map it */
    CUdeviceptr va = (CUdeviceptr)(uintptr_t)ce->warena;
    if (ce->warena) {
      g_vmm.unmap(va, ce->vmm_bytes);
      g_vmm.addr_free(va, ce->vmm_bytes);
    }
    g_vmm.release((CUmemGenericAllocationHandle)ce->vmm_handle);
    ce->warena_vmm = 0;
  } else if (ce->warena) {
    cudaFree(ce->warena);
  }
  ce->warena = NULL;
}
