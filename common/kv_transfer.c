/* kv_transfer.c: UCX one-sided KV handoff (see kv_transfer.h). */
#include "common/kv_transfer.h"

#include "common/log.h"

#include <ucp/api/ucp.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define TW_KV_XFER_MAGIC 0x7478666bu /* "kfxt" */
#define TW_KV_MAX_PEERS 64
#define TW_KV_BOUNCE_BYTES (4u << 20)

/* ---- CUDA runtime through dlopen (staging, device checksums) ---- */
typedef int (*tw_cuda_memcpy_fn)(void *, const void *, size_t, int);
typedef int (*tw_cuda_memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef int (*tw_cuda_host_alloc_fn)(void **, size_t, unsigned);
typedef int (*tw_cuda_free_host_fn)(void *);
typedef int (*tw_cuda_stream_create_fn)(void **, unsigned);
typedef int (*tw_cuda_ptr_fn)(void *);
typedef int (*tw_cuda_event_create_fn)(void **, unsigned);
typedef int (*tw_cuda_event_record_fn)(void *, void *);
/* cudaIpcMemHandle_t: 64 opaque bytes, passed by value */
typedef struct {
  char reserved[64];
} tw_cuda_ipc_handle_t;
typedef int (*tw_cuda_ipc_get_fn)(tw_cuda_ipc_handle_t *, void *);
typedef int (*tw_cuda_ipc_open_fn)(void **, tw_cuda_ipc_handle_t, unsigned);
typedef int (*tw_cuda_get_device_fn)(int *);
typedef struct {
  void *lib;
  tw_cuda_memcpy_fn memcpy_;
  tw_cuda_memcpy_async_fn memcpy_async;
  tw_cuda_host_alloc_fn host_alloc;
  tw_cuda_free_host_fn free_host;
  tw_cuda_stream_create_fn stream_create;   /* cudaStreamCreateWithFlags */
  tw_cuda_ptr_fn stream_destroy;
  tw_cuda_event_create_fn event_create;     /* cudaEventCreateWithFlags */
  tw_cuda_event_record_fn event_record;
  tw_cuda_ptr_fn event_sync;                /* cudaEventSynchronize */
  tw_cuda_ptr_fn event_query;               /* cudaEventQuery */
  tw_cuda_ptr_fn event_destroy;
  tw_cuda_ptr_fn free_;                     /* cudaFree(NULL): binds the primary context */
  /* CUDA IPC (the direct path); NULL when the runtime lacks them */
  tw_cuda_ipc_get_fn ipc_get;       /* cudaIpcGetMemHandle */
  tw_cuda_ipc_open_fn ipc_open;     /* cudaIpcOpenMemHandle */
  tw_cuda_ptr_fn ipc_close;         /* cudaIpcCloseMemHandle */
  tw_cuda_get_device_fn get_device; /* cudaGetDevice */
} tw_cudart_t;
enum { TW_CUDA_H2D = 1, TW_CUDA_D2H = 2, TW_CUDA_DEFAULT = 4 };
enum { TW_CUDA_IPC_LAZY_PEER = 1 }; /* cudaIpcMemLazyEnablePeerAccess */
enum { TW_CUDA_STREAM_NON_BLOCKING = 1, TW_CUDA_EVENT_DISABLE_TIMING = 2 };
enum { TW_CUDA_NOT_READY = 600 }; /* cudaErrorNotReady */

/* ---- the direct path over CUDA IPC ----
 * UCX 1.13's RMA puts never reach CUDA memory over cuda_ipc: its rma_bw
 * lanes serve the rendezvous protocols, and a put into a CUDA region is
 * emulated (on the H200 the endpoint between two workers of one GPU lists
 * only sysv/posix lanes, with or without protocols v2). So a decode worker
 * whose pool is device memory also exports the pool with
 * cudaIpcGetMemHandle and appends this descriptor to the rkey blob it
 * publishes; a prefill worker on the same host (same boot id) whose pool is
 * device memory opens it once per decode worker (cudaIpcOpenMemHandle, peer
 * access enabled lazily across GPUs) and copies each run of blocks device to
 * device with cudaMemcpyAsync on its own stream; the flush waits for the
 * copies. A descriptor that cannot be opened (another host, another IPC
 * namespace, no peer access) falls back to the UCX paths, logged once. The
 * decode worker learns from PrefillDone.kv_in_place that nothing is left to
 * commit from its host mirror. */
#define TW_KV_IPC_MAGIC "TWKVIPC1"
typedef struct {
  char boot_id[40];            /* /proc/sys/kernel/random/boot_id of the owner's host */
  int32_t pid;                 /* the owner's process (a process cannot open its own) */
  int32_t device;              /* the owner's CUDA device ordinal */
  tw_cuda_ipc_handle_t handle; /* of the pool's allocation (its base) */
  int64_t pool_bytes;
  uint32_t ucx_rkey_len; /* the bytes before this descriptor */
  uint32_t desc_bytes;   /* sizeof(tw_kv_ipc_desc_t) */
  char magic[8];         /* TW_KV_IPC_MAGIC, last: found from the blob's end */
} tw_kv_ipc_desc_t;

static void tw_kv_boot_id(char out[40]) {
  memset(out, 0, 40);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (!fgets(out, 40, f)) out[0] = 0;
  fclose(f);
  out[strcspn(out, "\n")] = 0;
}

static TW_NODISCARD tw_status_t tw_cudart_load(tw_cudart_t *rt) {
  if (rt->lib) return TW_OK;
  /* the runtime the engine already uses first (same instance, same device
   * and context), then any */
  const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  const int n_names = (int)(sizeof names / sizeof names[0]);
  for (int i = 0; i < n_names && !rt->lib; i++)
    rt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  for (int i = 0; i < n_names && !rt->lib; i++)
    rt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!rt->lib)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "device KV pool needs staging but libcudart cannot be loaded: %s", dlerror());
  rt->memcpy_ = (tw_cuda_memcpy_fn)dlsym(rt->lib, "cudaMemcpy");
  rt->memcpy_async = (tw_cuda_memcpy_async_fn)dlsym(rt->lib, "cudaMemcpyAsync");
  rt->host_alloc = (tw_cuda_host_alloc_fn)dlsym(rt->lib, "cudaHostAlloc");
  rt->free_host = (tw_cuda_free_host_fn)dlsym(rt->lib, "cudaFreeHost");
  rt->stream_create = (tw_cuda_stream_create_fn)dlsym(rt->lib, "cudaStreamCreateWithFlags");
  rt->stream_destroy = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaStreamDestroy");
  rt->event_create = (tw_cuda_event_create_fn)dlsym(rt->lib, "cudaEventCreateWithFlags");
  rt->event_record = (tw_cuda_event_record_fn)dlsym(rt->lib, "cudaEventRecord");
  rt->event_sync = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventSynchronize");
  rt->event_query = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventQuery");
  rt->event_destroy = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaEventDestroy");
  rt->free_ = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaFree");
  rt->ipc_get = (tw_cuda_ipc_get_fn)dlsym(rt->lib, "cudaIpcGetMemHandle");
  rt->ipc_open = (tw_cuda_ipc_open_fn)dlsym(rt->lib, "cudaIpcOpenMemHandle");
  rt->ipc_close = (tw_cuda_ptr_fn)dlsym(rt->lib, "cudaIpcCloseMemHandle");
  rt->get_device = (tw_cuda_get_device_fn)dlsym(rt->lib, "cudaGetDevice");
  if (!rt->memcpy_ || !rt->memcpy_async || !rt->host_alloc || !rt->free_host ||
      !rt->stream_create || !rt->stream_destroy || !rt->event_create || !rt->event_record ||
      !rt->event_sync || !rt->event_query || !rt->event_destroy || !rt->free_) {
    dlclose(rt->lib);
    *rt = (tw_cudart_t){0};
    return tw_err(TW_ERR_UNSUPPORTED, "libcudart lacks the copy, stream or event entry points");
  }
  return TW_OK;
}

/* ---- the sender's bounded ring of bounce buffers ----
 * Used for device sources that cannot be put directly (staged path: the
 * copies run on the ring's own stream, chunk k+1..k+R-1 copying while chunk
 * k is put) and to gather scattered local pieces (re-sharding) into one
 * contiguous put. A slot is reused only once its put completed locally. */
#define TW_KV_RING_SLOTS 4
#define TW_KV_RING_SLOT_BYTES ((int64_t)8 << 20)
typedef struct {
  uint8_t *mem;        /* TW_KV_RING_SLOTS x TW_KV_RING_SLOT_BYTES */
  bool pinned;         /* cudaHostAlloc (device sources) or malloc */
  ucp_mem_h memh;
  void *stream;        /* cudaStream_t of the device-to-host copies */
  void *req[TW_KV_RING_SLOTS];    /* in-flight put from the slot */
  void *event[TW_KV_RING_SLOTS];  /* cudaEvent_t: the copy into the slot is done */
  uint32_t next;       /* next slot to fill */
} tw_kv_ring_t;

struct tw_kv_peer {
  uint8_t *address;
  size_t address_len;
  uint8_t *rkey_buf;
  size_t rkey_len;
  ucp_ep_h ep;
  ucp_rkey_h rkey;
  int failed;
  bool cuda_ipc;          /* the endpoint has an RMA lane over cuda_ipc */
  /* the direct path: the decode worker's device pool mapped here over CUDA
   * IPC (tw_kv_ipc_desc_t in its rkey blob), copied into device to device */
  bool has_ipc; /* the rkey blob carries a descriptor for this host */
  tw_kv_ipc_desc_t ipc;
  void *ipc_ptr;          /* cudaIpcOpenMemHandle of ipc.handle, or NULL */
  bool ipc_failed;        /* opening it failed once: UCX paths from then on */
  bool ipc_pending;       /* copies enqueued since the last flush */
  bool ipc_allowed;       /* the xfer's setting at the last tw_kv_xfer_peer */
  char lanes[160];        /* the endpoint's transports, for logs */
  unsigned logged_paths;  /* bit per tw_kv_path_t already logged */
  int64_t t_first_put_ns; /* 0 when nothing is in flight */
};

struct tw_kv_xfer {
  uint32_t magic;
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_address_t *address;
  size_t address_len;
  bool cuda_native;
  bool proto_v2;      /* UCX protocols v2: puts may go over zero-copy rma_bw lanes */
  tw_kv_peer_t *peers[TW_KV_MAX_PEERS];
  int n_peers;
  tw_cudart_t cudart;
  tw_kv_ring_t ring;
  /* the local device pool registered as CUDA memory (direct puts) */
  void *src_base;
  int64_t src_bytes;
  ucp_mem_h src_memh;
  tw_kv_xfer_stats_t stats;
  bool ipc_allowed; /* tw_kv_xfer_set_direct_ipc */
  void *ipc_stream; /* cudaStream_t of the direct-path copies */
  void *ipc_event;  /* recorded at a flush: the copies are done */
};

/* Commits in flight per staged region (tickets complete in order). */
#define TW_KV_MAX_COMMITS 64

struct tw_kv_region {
  tw_kv_xfer_t *xfer;
  tw_kv_layout_t layout;
  void *registered;   /* the pool itself, or its pinned host mirror */
  bool staged;
  ucp_mem_h memh;
  void *rkey; /* the packed ucx rkey, then a tw_kv_ipc_desc_t when exported */
  size_t rkey_len;
  /* staged: mirror -> device copies on their own stream, one event per commit */
  void *stream;
  void *event[TW_KV_MAX_COMMITS];
  uint64_t next_ticket;  /* the last ticket handed out */
  uint64_t done_ticket;  /* every ticket <= this one is complete */
};

static int64_t tw_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

uint64_t tw_kv_fnv1a(uint64_t h, const void *data, size_t len) {
  const uint8_t *p = data;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/* ucp_init (RMA, WAKEUP) with UCX's configuration from the environment,
 * protocols v2 forced on when `v2`; then whether CUDA memory is supported. */
static TW_NODISCARD tw_status_t tw_kv_ucp_init(tw_kv_xfer_t *x, bool v2) {
  ucp_config_t *cfg = NULL;
  ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
  if (us != UCS_OK)
    return tw_err(TW_ERR_TRANSPORT, "ucp_config_read failed: %s", ucs_status_string(us));
  x->proto_v2 = v2 && ucp_config_modify(cfg, "PROTO_ENABLE", "y") == UCS_OK;
  /* WAKEUP: the receiving side sleeps on the worker's event fd (see
   * tw_kv_xfer_wait_fd); emulated puts and flushes need its progress */
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                         .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
  us = ucp_init(&params, cfg, &x->ctx);
  ucp_config_release(cfg);
  if (us != UCS_OK) {
    x->ctx = NULL;
    return tw_err(TW_ERR_TRANSPORT, "ucp_init failed: %s", ucs_status_string(us));
  }
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  if (ucp_context_query(x->ctx, &attr) == UCS_OK)
    x->cuda_native = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_xfer_create(tw_kv_xfer_t **xfer_p) {
  tw_kv_xfer_t *x = calloc(1, sizeof *x);
  if (!x) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the kv transfer handle");
  x->magic = TW_KV_XFER_MAGIC;
  tw_status_t st = TW_OK;
  /* UCX 1.13's default (v1) RMA protocols put only over lanes with put
   * short/bcopy, which cuda_ipc lacks (it is zero-copy only): a put into CUDA
   * memory would be emulated with active messages. Its protocols v2 put over
   * the zero-copy rma_bw lanes, cuda_ipc included. So with CUDA support, and
   * unless UCX_PROTO_ENABLE says otherwise, the context is made again with
   * v2. */
  const char *proto_env = getenv("UCX_PROTO_ENABLE");
  TW_CHECK_GOTO(tw_kv_ucp_init(x, false), st, fail);
  if (x->cuda_native && !proto_env) {
    ucp_cleanup(x->ctx);
    x->ctx = NULL;
    TW_CHECK_GOTO(tw_kv_ucp_init(x, true), st, fail);
  } else {
    x->proto_v2 = proto_env && (proto_env[0] == 'y' || proto_env[0] == 'Y' ||
                                proto_env[0] == '1' || !strcasecmp(proto_env, "on"));
  }
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  ucs_status_t us = ucp_worker_create(x->ctx, &wp, &x->worker);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_worker_create failed: %s", ucs_status_string(us));
    goto fail;
  }
  us = ucp_worker_get_address(x->worker, &x->address, &x->address_len);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_worker_get_address failed: %s", ucs_status_string(us));
    goto fail;
  }
  /* how device pools travel is logged when one is registered: a CPU worker
   * has none, and must not claim CUDA staging */
  TW_INFO("kvx", "ucx worker up: address %zu bytes, CUDA memory %s, protocols %s",
          x->address_len, x->cuda_native ? "supported" : "not supported", x->proto_v2 ? "v2" : "v1");
  *xfer_p = x;
  return TW_OK;
fail:
  tw_kv_xfer_destroy(x);
  return st;
}

static void tw_kv_ring_free(tw_kv_xfer_t *x);

static void tw_kv_peer_close(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (!p) return;
  if (p->ipc_ptr) {
    if (p->ipc_pending && x->ipc_stream) x->cudart.event_sync(x->ipc_event); /* no copy in flight */
    x->cudart.ipc_close(p->ipc_ptr);
  }
  if (p->rkey) ucp_rkey_destroy(p->rkey);
  if (p->ep) {
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(p->ep, &prm);
    if (UCS_PTR_IS_PTR(req)) {
      for (int i = 0; i < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++)
        ucp_worker_progress(x->worker);
      ucp_request_free(req);
    }
  }
  free(p->address);
  free(p->rkey_buf);
  free(p);
}

void tw_kv_xfer_destroy(tw_kv_xfer_t *x) {
  if (!x) return;
  for (int i = 0; i < x->n_peers; i++) tw_kv_peer_close(x, x->peers[i]);
  if (x->address) ucp_worker_release_address(x->worker, x->address);
  tw_kv_ring_free(x);
  if (x->ipc_event) x->cudart.event_destroy(x->ipc_event);
  if (x->ipc_stream) x->cudart.stream_destroy(x->ipc_stream);
  if (x->src_memh) ucp_mem_unmap(x->ctx, x->src_memh);
  if (x->worker) ucp_worker_destroy(x->worker);
  if (x->ctx) ucp_cleanup(x->ctx);
  if (x->cudart.lib) dlclose(x->cudart.lib);
  x->magic = 0;
  free(x);
}

const void *tw_kv_xfer_address(const tw_kv_xfer_t *x, size_t *len_p) {
  *len_p = x->address_len;
  return x->address;
}
bool tw_kv_xfer_cuda_native(const tw_kv_xfer_t *x) { return x->cuda_native; }
void tw_kv_xfer_set_direct_ipc(tw_kv_xfer_t *x, bool allow) { x->ipc_allowed = allow; }

void tw_kv_xfer_progress(tw_kv_xfer_t *x) {
  while (ucp_worker_progress(x->worker)) {
  }
}
void tw_kv_xfer_stats(const tw_kv_xfer_t *x, tw_kv_xfer_stats_t *out) { *out = x->stats; }

int tw_kv_xfer_wait_fd(tw_kv_xfer_t *x) {
  int fd = -1;
  if (ucp_worker_get_efd(x->worker, &fd) != UCS_OK) return -1;
  for (int i = 0; i < 64; i++) {
    tw_kv_xfer_progress(x);
    ucs_status_t s = ucp_worker_arm(x->worker);
    if (s == UCS_OK) return fd;
    if (s != UCS_ERR_BUSY) return -1;
  }
  return -1; /* events keep coming: do not sleep */
}

/* Append a tw_kv_ipc_desc_t of the device pool to the region's rkey blob
 * (the direct path, see above). Failure only costs the direct path: logged,
 * the blob stays the ucx rkey alone. TWAIN_KV_IPC=0 turns it off. */
static bool tw_kv_ipc_export(tw_kv_region_t *r) {
  const char *off = getenv("TWAIN_KV_IPC");
  if (off && strcmp(off, "0") == 0) {
    TW_INFO("kvx", "kv pool not exported over CUDA IPC (TWAIN_KV_IPC=0)");
    return false;
  }
  tw_cudart_t *rt = &r->xfer->cudart;
  tw_kv_ipc_desc_t d;
  memset(&d, 0, sizeof d);
  if (tw_cudart_load(rt) != TW_OK || !rt->ipc_get || !rt->ipc_open || !rt->ipc_close ||
      !rt->get_device) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: the CUDA runtime lacks IPC");
    return false;
  }
  int e = rt->get_device(&d.device);
  if (e == 0) e = rt->ipc_get(&d.handle, r->layout.base);
  if (e != 0) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: cudaIpcGetMemHandle failed (cuda error %d)",
            e);
    return false;
  }
  tw_kv_boot_id(d.boot_id);
  d.pid = (int32_t)getpid();
  d.pool_bytes = r->layout.total_bytes;
  d.ucx_rkey_len = (uint32_t)r->rkey_len;
  d.desc_bytes = (uint32_t)sizeof d;
  memcpy(d.magic, TW_KV_IPC_MAGIC, sizeof d.magic);
  uint8_t *blob = realloc(r->rkey, r->rkey_len + sizeof d);
  if (!blob) {
    TW_WARN("kvx", "kv pool not exported over CUDA IPC: out of memory");
    return false;
  }
  memcpy(blob + r->rkey_len, &d, sizeof d);
  r->rkey = blob;
  r->rkey_len += sizeof d;
  TW_INFO("kvx",
          "kv pool exported over CUDA IPC (device %d, %lld bytes): prefill workers on "
          "this host copy into it device to device",
          d.device, (long long)d.pool_bytes);
  return true;
}

/* Split a published rkey blob into the ucx rkey and an optional descriptor. */
static size_t tw_kv_rkey_split(const void *blob, size_t len, tw_kv_ipc_desc_t *desc, bool *has) {
  *has = false;
  if (len < sizeof *desc) return len;
  memcpy(desc, (const uint8_t *)blob + len - sizeof *desc, sizeof *desc);
  if (memcmp(desc->magic, TW_KV_IPC_MAGIC, sizeof desc->magic) != 0 ||
      desc->desc_bytes != sizeof *desc || desc->ucx_rkey_len != len - sizeof *desc)
    return len;
  desc->boot_id[sizeof desc->boot_id - 1] = 0;
  *has = true;
  return desc->ucx_rkey_len;
}

/* Open the peer's descriptor once (a device source, same host, another
 * process); on failure the peer keeps the UCX paths. */
static void tw_kv_ipc_open(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (!p->has_ipc || p->ipc_ptr || p->ipc_failed) return;
  p->ipc_failed = true; /* until it opens */
  char boot[40];
  tw_kv_boot_id(boot);
  const char *off = getenv("TWAIN_KV_IPC");
  const char *why = NULL;
  if (off && strcmp(off, "0") == 0)
    why = "TWAIN_KV_IPC=0";
  else if (!boot[0] || strcmp(boot, p->ipc.boot_id) != 0)
    why = "another host";
  else if (p->ipc.pid == (int32_t)getpid())
    why = "the same process";
  else if (tw_cudart_load(&x->cudart) != TW_OK || !x->cudart.ipc_open)
    why = "no CUDA IPC";
  if (!why) {
    if (!x->ipc_stream &&
        (x->cudart.stream_create(&x->ipc_stream, TW_CUDA_STREAM_NON_BLOCKING) != 0 ||
         x->cudart.event_create(&x->ipc_event, TW_CUDA_EVENT_DISABLE_TIMING) != 0)) {
      why = "cannot create its stream";
    } else {
      int e = x->cudart.ipc_open(&p->ipc_ptr, p->ipc.handle, TW_CUDA_IPC_LAZY_PEER);
      if (e != 0) {
        p->ipc_ptr = NULL;
        TW_WARN("kvx",
                "cudaIpcOpenMemHandle of a decode worker's kv pool (pid %d, device %d) "
                "failed (cuda error %d): its handoffs take the ucx path",
                (int)p->ipc.pid, (int)p->ipc.device, e);
        return;
      }
      p->ipc_failed = false;
      TW_INFO("kvx",
              "kv pool of decode worker pid %d (device %d, %lld bytes) mapped over CUDA "
              "IPC: handoffs to it are direct device-to-device copies",
              (int)p->ipc.pid, (int)p->ipc.device, (long long)p->ipc.pool_bytes);
      return;
    }
  }
  TW_INFO("kvx", "a decode worker's CUDA IPC kv descriptor is not used (%s): ucx path", why);
}

TW_NODISCARD tw_status_t tw_kv_region_register(tw_kv_xfer_t *x, const tw_kv_layout_t *layout,
                                               tw_kv_region_t **region_p) {
  if (!layout || !layout->base || layout->total_bytes <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv region: empty pool layout");
  tw_kv_region_t *r = calloc(1, sizeof *r);
  if (!r) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a kv region");
  r->xfer = x;
  r->layout = *layout;
  r->registered = layout->base;
  tw_status_t st = TW_OK;
  ucs_memory_type_t mt = UCS_MEMORY_TYPE_HOST;
  /* TWAIN_KV_PATH=staged: stage even with CUDA transports (prefill workers
   * without them, nodes without a cuda_ipc path, the staged benchmark) */
  const char *want = getenv("TWAIN_KV_PATH");
  bool force_staged = want && strcmp(want, "staged") == 0;
  /* TWAIN_KV_PATH=ipc: one host (twain serve): the device pool is reached
   * over CUDA IPC alone, no ucx registration and no host mirror */
  if (layout->on_device && want && strcmp(want, "ipc") == 0) {
    r->rkey = malloc(1);
    r->rkey_len = 0;
    if (!r->rkey) {
      st = tw_err(TW_ERR_NO_MEMORY, "cannot allocate a kv rkey blob");
      goto fail;
    }
    if (!tw_kv_ipc_export(r)) {
      st = tw_err(TW_ERR_UNSUPPORTED,
                  "TWAIN_KV_PATH=ipc, but the device kv pool cannot be exported "
                  "over CUDA IPC (see the warning above); unset it to use ucx");
      goto fail;
    }
    TW_INFO("kvx",
            "kv handoff mode (receive): device KV pool over CUDA IPC only "
            "(TWAIN_KV_PATH=ipc): prefill workers on this host copy into it, nothing else can");
    *region_p = r;
    return TW_OK;
  }
  if (layout->on_device) {
    if (x->cuda_native && !force_staged) {
      mt = UCS_MEMORY_TYPE_CUDA;
    } else {
      TW_CHECK_GOTO(tw_cudart_load(&x->cudart), st, fail);
      if (x->cudart.host_alloc(&r->registered, (size_t)layout->total_bytes, 0) != 0) {
        r->registered = NULL;
        st = tw_err(TW_ERR_NO_MEMORY, "cudaHostAlloc of a %lld-byte kv mirror failed",
                    (long long)layout->total_bytes);
        goto fail;
      }
      r->staged = true;
      if (x->cudart.stream_create(&r->stream, TW_CUDA_STREAM_NON_BLOCKING) != 0) {
        r->stream = NULL;
        st = tw_err(TW_ERR_CUDA, "cudaStreamCreate for the kv commit copies failed");
        goto fail;
      }
      for (int k = 0; k < TW_KV_MAX_COMMITS; k++)
        if (x->cudart.event_create(&r->event[k], TW_CUDA_EVENT_DISABLE_TIMING) != 0) {
          r->event[k] = NULL;
          st = tw_err(TW_ERR_CUDA, "cudaEventCreate for the kv commit copies failed");
          goto fail;
        }
    }
  }
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = r->registered,
      .length = (size_t)layout->total_bytes,
      .memory_type = mt};
  ucs_status_t us = ucp_mem_map(x->ctx, &mp, &r->memh);
  if (us != UCS_OK) {
    r->memh = NULL;
    st = tw_err(TW_ERR_TRANSPORT, "ucp_mem_map of %lld bytes failed: %s",
                (long long)layout->total_bytes, ucs_status_string(us));
    goto fail;
  }
  void *buf = NULL;
  size_t len = 0;
  us = ucp_rkey_pack(x->ctx, r->memh, &buf, &len);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_rkey_pack failed: %s", ucs_status_string(us));
    goto fail;
  }
  r->rkey = malloc(len);
  if (!r->rkey) {
    ucp_rkey_buffer_release(buf);
    st = tw_err(TW_ERR_NO_MEMORY, "cannot copy a %zu-byte rkey", len);
    goto fail;
  }
  memcpy(r->rkey, buf, len);
  r->rkey_len = len;
  ucp_rkey_buffer_release(buf);
  if (layout->on_device) (void)tw_kv_ipc_export(r); /* optional: logged when it fails */
  TW_INFO("kvx", "registered kv pool: %lld bytes, %d layers x %d blocks, rkey %zu bytes%s",
          (long long)layout->total_bytes, layout->n_layers, layout->n_blocks, len,
          r->staged ? ", pinned host mirror" : "");
  TW_INFO("kvx", "kv handoff mode (receive): %s",
          !layout->on_device ? "host KV pool, registered in place"
          : r->staged ? (x->cuda_native
                             ? "device KV pool STAGED (TWAIN_KV_PATH=staged): puts land in a pinned "
                               "host mirror, copied to the device per handoff"
                             : "device KV pool STAGED: puts land in a pinned host mirror, copied to "
                               "the device per handoff (UCX has no CUDA support)")
                      : "device KV pool DIRECT: registered as CUDA memory (UCX cuda transports)");
  *region_p = r;
  return TW_OK;
fail:
  tw_kv_region_unregister(r);
  return st;
}

void tw_kv_region_unregister(tw_kv_region_t *r) {
  if (!r) return;
  for (int k = 0; k < TW_KV_MAX_COMMITS; k++)
    if (r->event[k]) {
      r->xfer->cudart.event_sync(r->event[k]); /* no copy may still read the mirror */
      r->xfer->cudart.event_destroy(r->event[k]);
    }
  if (r->stream) r->xfer->cudart.stream_destroy(r->stream);
  if (r->memh) ucp_mem_unmap(r->xfer->ctx, r->memh);
  if (r->staged && r->registered) r->xfer->cudart.free_host(r->registered);
  free(r->rkey);
  free(r);
}

const void *tw_kv_region_rkey(const tw_kv_region_t *r, size_t *len_p) {
  *len_p = r->rkey_len;
  return r->rkey;
}

void tw_kv_region_remote_layout(const tw_kv_region_t *r, tw_kv_remote_layout_t *o) {
  const tw_kv_layout_t *l = &r->layout;
  *o = (tw_kv_remote_layout_t){.dtype = l->dtype,
                               .on_device = l->on_device && !r->staged,
                               .n_layers = l->n_layers,
                               .n_blocks = l->n_blocks,
                               .block_size = l->block_size,
                               .n_kv_heads = l->n_kv_heads_local,
                               .head_dim = l->head_dim,
                               .layer_stride_bytes = l->layer_stride_bytes,
                               .block_bytes = l->block_bytes,
                               .remote_base = (uint64_t)(uintptr_t)r->registered,
                               .total_bytes = l->total_bytes};
}

TW_NODISCARD tw_status_t tw_kv_region_commit_poll(tw_kv_region_t *r, uint64_t ticket) {
  if (ticket <= r->done_ticket) return TW_OK;
  if (ticket > r->next_ticket)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv commit ticket %llu was never handed out",
                  (unsigned long long)ticket);
  int e = r->xfer->cudart.event_query(r->event[ticket % TW_KV_MAX_COMMITS]);
  if (e == TW_CUDA_NOT_READY) return TW_INPROGRESS;
  if (e != 0) return tw_err(TW_ERR_CUDA, "a kv commit copy to the device failed (cuda error %d)", e);
  r->done_ticket = ticket; /* one stream: the earlier ones are done too */
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_region_commit_start(tw_kv_region_t *r, const int32_t *ids, int32_t n,
                                                   uint64_t *ticket_p) {
  *ticket_p = 0;
  if (!r->staged) return TW_OK;
  const tw_kv_layout_t *l = &r->layout;
  for (int32_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= l->n_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "kv commit: block %d outside the pool of %d", ids[i],
                    l->n_blocks);
  /* the event slot of the new ticket must be free: its ticket - MAX done */
  uint64_t t = r->next_ticket + 1;
  if (t - r->done_ticket >= TW_KV_MAX_COMMITS) {
    uint64_t old = t - TW_KV_MAX_COMMITS;
    if (r->xfer->cudart.event_sync(r->event[old % TW_KV_MAX_COMMITS]) != 0)
      return tw_err(TW_ERR_CUDA, "a kv commit copy to the device failed");
    r->done_ticket = old;
  }
  tw_cudart_t *rt = &r->xfer->cudart;
  for (int32_t layer = 0; layer < l->n_layers; layer++)
    for (int32_t i = 0, k; i < n; i += k) { /* one copy per run of consecutive blocks */
      k = tw_kv_run_length(ids, ids, i, n);
      int64_t off = layer * l->layer_stride_bytes + (int64_t)ids[i] * l->block_bytes;
      if (rt->memcpy_async((char *)l->base + off, (char *)r->registered + off,
                           (size_t)(k * l->block_bytes), TW_CUDA_H2D, r->stream) != 0)
        return tw_err(TW_ERR_CUDA, "cudaMemcpyAsync of kv blocks %d..%d layer %d to the device failed",
                      ids[i], ids[i] + k - 1, layer);
    }
  if (rt->event_record(r->event[t % TW_KV_MAX_COMMITS], r->stream) != 0)
    return tw_err(TW_ERR_CUDA, "cudaEventRecord after the kv commit copies failed");
  r->next_ticket = t;
  *ticket_p = t;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_region_commit_wait(tw_kv_region_t *r, uint64_t ticket) {
  tw_status_t st = tw_kv_region_commit_poll(r, ticket);
  if (st != TW_INPROGRESS) return st;
  if (r->xfer->cudart.event_sync(r->event[ticket % TW_KV_MAX_COMMITS]) != 0)
    return tw_err(TW_ERR_CUDA, "a kv commit copy to the device failed");
  r->done_ticket = ticket;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_region_commit(tw_kv_region_t *r, const int32_t *ids, int32_t n) {
  uint64_t t = 0;
  TW_CHECK(tw_kv_region_commit_start(r, ids, n, &t));
  return tw_kv_region_commit_wait(r, t);
}

static void tw_kv_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  tw_kv_peer_t *p = arg;
  p->failed = 1;
  TW_WARN("kvx", "ucx endpoint to a decode worker failed: %s", ucs_status_string(status));
}

/* Which transports the endpoint's lanes use, from ucp_ep_print_info (UCX
 * 1.13 has no query for it): "lane[i]:  n:<tl>/<device> md[..] -> ..." per
 * lane, then "put[i]: ..." for each lane that carries puts (RMA, protocols
 * v1). A device pool may only be put into over a lane whose transport
 * reaches CUDA memory (cuda_ipc): without one, UCX emulates the put with
 * active messages and the receiver's UCX writes the payload into the
 * destination address with a host memcpy (ucp rma_sw), a segfault on a
 * device pointer. That is the crash the first direct-path trial hit (decode
 * worker SIGSEGV at the first handoff, the prefill worker's flush timing
 * out): with protocols v1, UCX 1.13 never selects cuda_ipc as an RMA lane
 * (RMA lanes need put short/bcopy; cuda_ipc is zero-copy only), so every put
 * into the registered device pool was emulated. */
#define TW_KV_MAX_LANES 16
static void tw_kv_ep_lanes(tw_kv_peer_t *p, bool proto_v2) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  p->lanes[0] = 0;
  p->cuda_ipc = false;
  if (!f) return;
  ucp_ep_print_info(p->ep, f);
  fclose(f);
  if (!text) return;
  char tl[TW_KV_MAX_LANES][24] = {{0}};
  bool put[TW_KV_MAX_LANES] = {false};
  for (char *line = text, *nl; line && *line; line = nl ? nl + 1 : NULL) {
    nl = strchr(line, '\n');
    if (nl) *nl = 0;
    const char *q;
    int i = -1, n = 0;
    if ((q = strstr(line, "lane[")) && sscanf(q, "lane[%d]: %*d:%n", &i, &n) == 1 && n > 0 &&
        i >= 0 && i < TW_KV_MAX_LANES) {
      size_t k = strcspn(q + n, "/ ");
      snprintf(tl[i], sizeof tl[i], "%.*s", (int)k, q + n);
    } else if ((q = strstr(line, "put[")) && sscanf(q, "put[%d]", &i) == 1 && i >= 0 &&
               i < TW_KV_MAX_LANES) {
      put[i] = true;
    }
  }
  free(text);
  size_t used = 0;
  for (int i = 0; i < TW_KV_MAX_LANES; i++) {
    if (!tl[i][0]) continue;
    /* v1: an RMA lane (put[i]); v2: puts use the zero-copy rma_bw lanes,
     * and with RMA alone a cuda_ipc lane is one of those */
    if ((put[i] || proto_v2) && strcmp(tl[i], "cuda_ipc") == 0) p->cuda_ipc = true;
    int w = snprintf(p->lanes + used, sizeof p->lanes - used, "%s%s%s", used ? " " : "", tl[i],
                     put[i] ? "(put)" : "");
    if (w < 0 || (size_t)w >= sizeof p->lanes - used) break;
    used += (size_t)w;
  }
}

TW_NODISCARD tw_status_t tw_kv_xfer_peer(tw_kv_xfer_t *x, const void *address, size_t address_len,
                                         const void *rkey, size_t rkey_len, tw_kv_peer_t **peer_p) {
  tw_kv_peer_t *p = NULL;
  for (int i = 0; i < x->n_peers; i++) {
    tw_kv_peer_t *q = x->peers[i];
    if (q->address_len == address_len && memcmp(q->address, address, address_len) == 0) {
      if (q->failed) { /* drop and reconnect */
        tw_kv_peer_close(x, q);
        x->peers[i] = x->peers[--x->n_peers];
        break;
      }
      p = q;
      break;
    }
  }
  if (!p) {
    if (x->n_peers == TW_KV_MAX_PEERS) { /* evict the oldest */
      tw_kv_peer_close(x, x->peers[0]);
      memmove(x->peers, x->peers + 1, sizeof x->peers[0] * (size_t)(--x->n_peers));
    }
    p = calloc(1, sizeof *p);
    if (!p || !(p->address = malloc(address_len))) {
      free(p);
      return tw_err(TW_ERR_NO_MEMORY, "cannot allocate a ucx peer");
    }
    memcpy(p->address, address, address_len);
    p->address_len = address_len;
    /* Error mode NONE: UCX 1.13's shared-memory transports (cma, posix, sysv)
     * have no peer-failure support, so PEER mode would leave only TCP with
     * software-emulated puts (~0.05 GB/s measured here vs several GB/s over
     * cma). A dead decode worker is caught by the flush timeout instead, and
     * by the router's heartbeat expiry. */
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)p->address,
        .err_mode = UCP_ERR_HANDLING_MODE_NONE,
        .err_handler = {.cb = tw_kv_ep_error, .arg = p}};
    ucs_status_t us = ucp_ep_create(x->worker, &ep, &p->ep);
    if (us != UCS_OK) {
      free(p->address);
      free(p);
      return tw_err(TW_ERR_TRANSPORT, "ucp_ep_create to a decode worker failed: %s",
                    ucs_status_string(us));
    }
    tw_kv_ep_lanes(p, x->proto_v2);
    x->peers[x->n_peers++] = p;
  }
  if (!p->rkey_buf || p->rkey_len != rkey_len || memcmp(p->rkey_buf, rkey, rkey_len) != 0) {
    tw_kv_ipc_desc_t desc;
    bool has = false;
    size_t ucx_len = tw_kv_rkey_split(rkey, rkey_len, &desc, &has);
    if (p->ipc_ptr && (!has || memcmp(&desc.handle, &p->ipc.handle, sizeof desc.handle) != 0)) {
      if (p->ipc_pending) x->cudart.event_sync(x->ipc_event);
      x->cudart.ipc_close(p->ipc_ptr);
      p->ipc_ptr = NULL;
    }
    if (!has || memcmp(&desc, &p->ipc, sizeof desc) != 0) p->ipc_failed = false;
    p->has_ipc = has;
    if (has) p->ipc = desc;
    if (p->rkey) ucp_rkey_destroy(p->rkey);
    p->rkey = NULL;
    free(p->rkey_buf);
    p->rkey_buf = malloc(rkey_len ? rkey_len : 1);
    if (!p->rkey_buf) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate an rkey copy");
    memcpy(p->rkey_buf, rkey, rkey_len);
    p->rkey_len = rkey_len;
    /* an empty ucx part: a pool reachable over CUDA IPC alone (TWAIN_KV_PATH=ipc) */
    ucs_status_t us = ucx_len ? ucp_ep_rkey_unpack(p->ep, p->rkey_buf, &p->rkey)
                      : has   ? UCS_OK
                              : UCS_ERR_INVALID_PARAM;
    if (us != UCS_OK) {
      p->rkey = NULL;
      p->rkey_len = 0;
      return tw_err(TW_ERR_TRANSPORT, "ucp_ep_rkey_unpack failed: %s", ucs_status_string(us));
    }
  }
  p->ipc_allowed = x->ipc_allowed;
  if (p->ipc_allowed)
    tw_kv_ipc_open(x, p); /* once per descriptor: the path is known before the first put */
  *peer_p = p;
  return TW_OK;
}

int32_t tw_kv_layer_first_block(int32_t n_tokens, int32_t block_size, bool sliding,
                                int32_t window) {
  if (!sliding || n_tokens <= window) return 0;
  return (n_tokens - window) / block_size;
}

int32_t tw_kv_blocks_final(int32_t end, int32_t n_tokens, int32_t n_blocks, int32_t block_size) {
  return end >= n_tokens ? n_blocks : end / block_size;
}

static TW_NODISCARD tw_status_t tw_kv_block_ptr(const tw_kv_layout_t *l, int32_t layer, int32_t id,
                                                char **ptr_p) {
  if (layer < 0 || layer >= l->n_layers || id < 0 || id >= l->n_blocks)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv block %d of layer %d is outside the pool (%d x %d)",
                  id, layer, l->n_layers, l->n_blocks);
  *ptr_p = (char *)l->base + layer * l->layer_stride_bytes + (int64_t)id * l->block_bytes;
  return TW_OK;
}

/* Wait (progressing, at most 10 s) for a put request, then free it. */
static TW_NODISCARD tw_status_t tw_kv_req_wait(tw_kv_xfer_t *x, void **req_p) {
  void *req = *req_p;
  *req_p = NULL;
  if (req == NULL) return TW_OK;
  ucs_status_t s;
  int64_t deadline = tw_now_ns() + 10 * 1000000000LL;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    ucp_worker_progress(x->worker);
    if (tw_now_ns() > deadline) {
      ucp_request_free(req);
      return tw_err(TW_ERR_DEADLINE, "a ucx put from the kv bounce ring did not complete in 10 s");
    }
  }
  ucp_request_free(req);
  if (s != UCS_OK) return tw_err(TW_ERR_TRANSPORT, "ucx put failed: %s", ucs_status_string(s));
  return TW_OK;
}

static void tw_kv_ring_free(tw_kv_xfer_t *x) {
  tw_kv_ring_t *g = &x->ring;
  for (int k = 0; k < TW_KV_RING_SLOTS; k++) {
    TW_IGNORE(tw_kv_req_wait(x, &g->req[k])); /* teardown: a failed put is logged there */
    if (g->event[k]) {
      x->cudart.event_sync(g->event[k]); /* no copy may still write the slot */
      x->cudart.event_destroy(g->event[k]);
    }
  }
  if (g->stream) x->cudart.stream_destroy(g->stream);
  if (g->memh) ucp_mem_unmap(x->ctx, g->memh);
  if (g->mem && g->pinned) x->cudart.free_host(g->mem);
  else free(g->mem);
  *g = (tw_kv_ring_t){0};
}

/* The ring, pinned with its stream and events when it serves device sources. */
static TW_NODISCARD tw_status_t tw_kv_ring_init(tw_kv_xfer_t *x, bool device) {
  tw_kv_ring_t *g = &x->ring;
  if (g->mem && (g->pinned || !device)) return TW_OK;
  if (g->mem) tw_kv_ring_free(x); /* a host ring, now needed for device copies */
  size_t bytes = (size_t)TW_KV_RING_SLOTS * (size_t)TW_KV_RING_SLOT_BYTES;
  if (device) {
    TW_CHECK(tw_cudart_load(&x->cudart));
    void *m = NULL;
    if (x->cudart.host_alloc(&m, bytes, 0) != 0)
      return tw_err(TW_ERR_NO_MEMORY, "cudaHostAlloc of the %zu-byte kv bounce ring failed", bytes);
    g->mem = m;
    g->pinned = true;
    if (x->cudart.stream_create(&g->stream, TW_CUDA_STREAM_NON_BLOCKING) != 0) {
      g->stream = NULL;
      tw_kv_ring_free(x);
      return tw_err(TW_ERR_CUDA, "cudaStreamCreate for the kv bounce ring failed");
    }
    for (int k = 0; k < TW_KV_RING_SLOTS; k++)
      if (x->cudart.event_create(&g->event[k], TW_CUDA_EVENT_DISABLE_TIMING) != 0) {
        g->event[k] = NULL;
        tw_kv_ring_free(x);
        return tw_err(TW_ERR_CUDA, "cudaEventCreate for the kv bounce ring failed");
      }
  } else if (!(g->mem = malloc(bytes))) {
    return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the %zu-byte kv gather ring", bytes);
  }
  /* registered once, so a put from a slot needs no registration of its own */
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = g->mem, .length = bytes, .memory_type = UCS_MEMORY_TYPE_HOST};
  if (ucp_mem_map(x->ctx, &mp, &g->memh) != UCS_OK) g->memh = NULL; /* puts still work */
  TW_DEBUG("kvx", "kv bounce ring: %d slots of %lld bytes, %s", TW_KV_RING_SLOTS,
           (long long)TW_KV_RING_SLOT_BYTES, device ? "pinned" : "pageable");
  return TW_OK;
}

/* Bind the CUDA primary context to this thread (UCX's cuda transports use the
 * driver API in the calling thread) and register the local device pool once
 * as CUDA memory, so a direct put neither detects the memory type nor
 * registers the buffer. Registration failure only costs speed. */
static TW_NODISCARD tw_status_t tw_kv_src_register(tw_kv_xfer_t *x, const tw_kv_layout_t *src) {
  if (x->src_base == src->base && x->src_bytes == src->total_bytes) return TW_OK;
  TW_CHECK(tw_cudart_load(&x->cudart));
  if (x->cudart.free_(NULL) != 0)
    return tw_err(TW_ERR_CUDA, "no CUDA context for the device kv pool in this thread");
  if (x->src_memh) ucp_mem_unmap(x->ctx, x->src_memh);
  x->src_memh = NULL;
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
      .address = src->base, .length = (size_t)src->total_bytes,
      .memory_type = UCS_MEMORY_TYPE_CUDA};
  ucs_status_t us = ucp_mem_map(x->ctx, &mp, &x->src_memh);
  if (us != UCS_OK) {
    x->src_memh = NULL;
    TW_WARN("kvx", "ucp_mem_map of the local device kv pool (%lld bytes) failed: %s; puts "
            "register per request", (long long)src->total_bytes, ucs_status_string(us));
  }
  x->src_base = src->base;
  x->src_bytes = src->total_bytes;
  return TW_OK;
}

/* Stream the concatenated segments through the ring in slot-sized chunks:
 * fill (host memcpy, or cudaMemcpyAsync on the ring's stream for a device
 * source, up to TW_KV_RING_SLOTS chunks ahead), then checksum and (if `put`)
 * put each chunk to raddr + its offset. A slot is refilled only after its
 * previous put completed locally. */
static TW_NODISCARD tw_status_t tw_kv_ring_put(tw_kv_xfer_t *x, tw_kv_peer_t *p, bool device,
                                               const tw_kv_seg_t *segs, int32_t n_segs,
                                               int64_t total, uint64_t raddr, uint64_t *h,
                                               bool put) {
  TW_CHECK(tw_kv_ring_init(x, device));
  tw_kv_ring_t *g = &x->ring;
  const int64_t S = TW_KV_RING_SLOT_BYTES;
  int64_t n_chunks = (total + S - 1) / S, copied = 0, sent = 0, so = 0;
  int32_t si = 0;
  int slot_of[TW_KV_RING_SLOTS];
  while (sent < n_chunks) {
    while (copied < n_chunks && copied < sent + TW_KV_RING_SLOTS) {
      int k = (int)(g->next++ % TW_KV_RING_SLOTS);
      TW_CHECK(tw_kv_req_wait(x, &g->req[k]));
      int64_t len = total - copied * S < S ? total - copied * S : S;
      uint8_t *dst = g->mem + (int64_t)k * S;
      for (int64_t done = 0; done < len && si < n_segs;) {
        int64_t piece = segs[si].bytes - so < len - done ? segs[si].bytes - so : len - done;
        if (device) {
          if (piece > 0 && x->cudart.memcpy_async(dst + done, (const char *)segs[si].ptr + so,
                                                  (size_t)piece, TW_CUDA_D2H, g->stream) != 0)
            return tw_err(TW_ERR_CUDA, "cudaMemcpyAsync of %lld kv bytes to the bounce ring failed",
                          (long long)piece);
        } else if (piece > 0) {
          memcpy(dst + done, (const char *)segs[si].ptr + so, (size_t)piece);
        }
        done += piece;
        so += piece;
        if (so == segs[si].bytes) {
          si++;
          so = 0;
        }
      }
      if (device && x->cudart.event_record(g->event[k], g->stream) != 0)
        return tw_err(TW_ERR_CUDA, "cudaEventRecord on the kv bounce ring failed");
      slot_of[copied % TW_KV_RING_SLOTS] = k;
      copied++;
    }
    int k = slot_of[sent % TW_KV_RING_SLOTS];
    int64_t len = total - sent * S < S ? total - sent * S : S;
    const uint8_t *src = g->mem + (int64_t)k * S;
    if (device && x->cudart.event_sync(g->event[k]) != 0)
      return tw_err(TW_ERR_CUDA, "a kv copy to the bounce ring failed");
    if (h) *h = tw_kv_fnv1a(*h, src, (size_t)len);
    if (put) {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                                 .memory_type = UCS_MEMORY_TYPE_HOST};
      if (g->memh) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = g->memh;
      }
      void *req = ucp_put_nbx(p->ep, src, (size_t)len, raddr + (uint64_t)(sent * S), p->rkey, &prm);
      if (UCS_PTR_IS_ERR(req))
        return tw_err(TW_ERR_TRANSPORT, "ucp_put_nbx of %lld staged kv bytes failed: %s",
                      (long long)len, ucs_status_string(UCS_PTR_STATUS(req)));
      g->req[k] = req;
      x->stats.puts++;
      if (device) x->stats.staged_bytes += len;
    }
    sent++;
  }
  return TW_OK;
}

tw_kv_path_t tw_kv_xfer_path(const tw_kv_peer_t *p, bool src_on_device, bool dst_on_device) {
  if (src_on_device && p->ipc_ptr && p->ipc_allowed) return TW_KV_PATH_DIRECT_CUDA_IPC;
  if (!p->rkey) return TW_KV_PATH_UNREACHABLE; /* a pool exported over CUDA IPC alone */
  if (dst_on_device) return p->cuda_ipc ? TW_KV_PATH_DIRECT_UCX : TW_KV_PATH_UNREACHABLE;
  return src_on_device ? TW_KV_PATH_STAGED : TW_KV_PATH_HOST;
}

const char *tw_kv_path_name(tw_kv_path_t path) {
  switch (path) {
    case TW_KV_PATH_HOST: return "host";
    case TW_KV_PATH_DIRECT_CUDA_IPC: return "direct cuda_ipc";
    case TW_KV_PATH_DIRECT_UCX: return "direct ucx cuda_ipc";
    case TW_KV_PATH_STAGED: return "staged";
    default: return "unreachable";
  }
}

const char *tw_kv_xfer_peer_lanes(const tw_kv_peer_t *p) { return p->lanes; }

TW_NODISCARD tw_status_t tw_kv_xfer_put(tw_kv_xfer_t *x, tw_kv_peer_t *p, const tw_kv_layout_t *src,
                                        const tw_kv_remote_layout_t *dst, const tw_kv_seg_t *segs,
                                        int32_t n_segs, uint64_t raddr, uint64_t *maybe_checksum) {
  if (p->failed) return tw_err(TW_ERR_UNAVAILABLE, "the decode worker's ucx endpoint failed");
  int64_t total = 0;
  const char *lo = src->base, *hi = (const char *)src->base + src->total_bytes;
  for (int32_t i = 0; i < n_segs; i++) {
    const char *a = segs[i].ptr;
    if (segs[i].bytes < 0 || a < lo || a + segs[i].bytes > hi)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "kv put: piece %d (%lld bytes) is outside the local pool",
                    i, (long long)segs[i].bytes);
    total += segs[i].bytes;
  }
  if (total == 0) return TW_OK;
  if (raddr < dst->remote_base || dst->total_bytes < total ||
      raddr - dst->remote_base > (uint64_t)(dst->total_bytes - total))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv put of %lld bytes at remote offset %llu is outside the remote pool (%lld bytes)",
                  (long long)total, (unsigned long long)(raddr - dst->remote_base),
                  (long long)dst->total_bytes);
  tw_kv_path_t path = tw_kv_xfer_path(p, src->on_device, dst->on_device);
  if (path == TW_KV_PATH_DIRECT_CUDA_IPC &&
      (int64_t)(raddr - dst->remote_base) + total > p->ipc.pool_bytes)
    return tw_err(
        TW_ERR_INVALID_ARGUMENT,
        "kv copy of %lld bytes at remote offset %llu is outside the mapped pool (%lld bytes)",
        (long long)total, (unsigned long long)(raddr - dst->remote_base),
        (long long)p->ipc.pool_bytes);
  if (!(p->logged_paths & (1u << path))) {
    p->logged_paths |= 1u << path;
    TW_INFO("kvx", "kv handoff path to a decode worker: %s (%s pool -> %s pool; ucx lanes: %s)",
            tw_kv_path_name(path), src->on_device ? "device" : "host",
            dst->on_device ? "device" : "host", p->lanes[0] ? p->lanes : "unknown");
  }
  if (!p->t_first_put_ns) p->t_first_put_ns = tw_now_ns();
  uint64_t *h = maybe_checksum;
  if (path == TW_KV_PATH_DIRECT_CUDA_IPC) {
    char *d = (char *)p->ipc_ptr + (raddr - dst->remote_base);
    for (int32_t i = 0; i < n_segs; i++) {
      if (segs[i].bytes == 0) continue;
      if (x->cudart.memcpy_async(d, segs[i].ptr, (size_t)segs[i].bytes, TW_CUDA_DEFAULT,
                                 x->ipc_stream) != 0)
        return tw_err(TW_ERR_CUDA,
                      "cudaMemcpyAsync of %lld kv bytes into the decode worker's "
                      "pool (CUDA IPC) failed",
                      (long long)segs[i].bytes);
      d += segs[i].bytes;
      x->stats.puts++;
      x->stats.direct_bytes += segs[i].bytes;
    }
    p->ipc_pending = true;
    if (h) TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, false));
    x->stats.bytes_sent += total;
    return TW_OK;
  }
  switch (path) {
    case TW_KV_PATH_UNREACHABLE:
      if (!p->rkey)
        return tw_err(TW_ERR_UNSUPPORTED,
                      "the decode worker's kv pool is reachable over CUDA IPC only "
                      "(TWAIN_KV_PATH=ipc there) and this worker cannot map it (%s pool here, or "
                      "another host or IPC namespace): unset TWAIN_KV_PATH on the decode worker",
                      src->on_device ? "a device" : "a host");
      return tw_err(TW_ERR_UNSUPPORTED,
                    "the decode worker's kv pool is device memory but no ucx lane to it reaches "
                    "CUDA memory (lanes: %s); a put would be emulated and written by the host "
                    "into device memory. Both workers need the CUDA-enabled UCX "
                    "(deploy/build_ucx_cuda.sh) with cuda_ipc in UCX_TLS, or neither",
                    p->lanes[0] ? p->lanes : "unknown");
    case TW_KV_PATH_STAGED:
      TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, true));
      break;
    case TW_KV_PATH_HOST:
      if (n_segs > 1) { /* gather into one put */
        TW_CHECK(tw_kv_ring_put(x, p, false, segs, n_segs, total, raddr, h, true));
        break;
      }
      __attribute__((fallthrough)); /* one piece: put in place */
    case TW_KV_PATH_DIRECT_CUDA_IPC: /* handled above */
    case TW_KV_PATH_DIRECT_UCX: {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                                 .memory_type = src->on_device ? UCS_MEMORY_TYPE_CUDA
                                                               : UCS_MEMORY_TYPE_HOST};
      if (src->on_device) {
        TW_CHECK(tw_kv_src_register(x, src));
        if (x->src_memh) {
          prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
          prm.memh = x->src_memh;
        }
      }
      uint64_t off = 0;
      for (int32_t i = 0; i < n_segs; i++) {
        if (segs[i].bytes == 0) continue;
        void *req = ucp_put_nbx(p->ep, segs[i].ptr, (size_t)segs[i].bytes, raddr + off, p->rkey, &prm);
        if (UCS_PTR_IS_ERR(req))
          return tw_err(TW_ERR_TRANSPORT, "ucp_put_nbx of %lld kv bytes failed: %s",
                        (long long)segs[i].bytes, ucs_status_string(UCS_PTR_STATUS(req)));
        if (req) ucp_request_free(req); /* completion is tracked by the endpoint flush */
        off += (uint64_t)segs[i].bytes;
        x->stats.puts++;
        if (path == TW_KV_PATH_DIRECT_UCX) x->stats.direct_bytes += segs[i].bytes;
      }
      if (h && src->on_device) /* read back through the ring: no put */
        TW_CHECK(tw_kv_ring_put(x, p, true, segs, n_segs, total, raddr, h, false));
      else if (h)
        for (int32_t i = 0; i < n_segs; i++) *h = tw_kv_fnv1a(*h, segs[i].ptr, (size_t)segs[i].bytes);
      break;
    }
  }
  x->stats.bytes_sent += total;
  ucp_worker_progress(x->worker);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_xfer_send_layer(tw_kv_xfer_t *x, tw_kv_peer_t *p,
                                               const tw_kv_layout_t *src,
                                               const tw_kv_remote_layout_t *dst, int32_t layer,
                                               const int32_t *src_ids, const int32_t *dst_ids,
                                               int32_t first, int32_t n, uint64_t *maybe_checksum) {
  if (src->dtype != dst->dtype || src->block_size != dst->block_size ||
      src->n_kv_heads_local != dst->n_kv_heads || src->head_dim != dst->head_dim ||
      src->block_bytes != dst->block_bytes || src->n_layers != dst->n_layers)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "kv layouts differ (prefill dtype %d bs=%d heads=%d dim=%d, decode dtype %d bs=%d heads=%d "
                  "dim=%d): re-sharding is not implemented",
                  (int)src->dtype, src->block_size, src->n_kv_heads_local, src->head_dim,
                  (int)dst->dtype, dst->block_size, dst->n_kv_heads, dst->head_dim);
  uint64_t h = maybe_checksum ? *maybe_checksum : TW_KV_FNV_INIT;
  for (int32_t i = first; i < n;) {
    int32_t k = tw_kv_run_length(src_ids, dst_ids, i, n);
    char *blk = NULL, *last = NULL;
    TW_CHECK(tw_kv_block_ptr(src, layer, src_ids[i], &blk));
    TW_CHECK(tw_kv_block_ptr(src, layer, src_ids[i] + k - 1, &last));
    if (dst_ids[i] < 0 || dst_ids[i] + k > dst->n_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "remote kv blocks %d..%d outside the pool of %d blocks",
                    dst_ids[i], dst_ids[i] + k - 1, dst->n_blocks);
    tw_kv_seg_t seg = {.ptr = blk, .bytes = (int64_t)k * src->block_bytes};
    uint64_t raddr = dst->remote_base + (uint64_t)(layer * dst->layer_stride_bytes) +
                     (uint64_t)dst_ids[i] * (uint64_t)dst->block_bytes;
    TW_CHECK(tw_kv_xfer_put(x, p, src, dst, &seg, 1, raddr, maybe_checksum ? &h : NULL));
    i += k;
  }
  if (maybe_checksum) *maybe_checksum = h;
  return TW_OK;
}

int32_t tw_kv_run_length(const int32_t *src_ids, const int32_t *dst_ids, int32_t i, int32_t n) {
  int32_t k = 1;
  while (i + k < n && src_ids[i + k] == src_ids[i] + k && dst_ids[i + k] == dst_ids[i] + k) k++;
  return k;
}

TW_NODISCARD tw_status_t tw_kv_xfer_flush(tw_kv_xfer_t *x, tw_kv_peer_t *p, int timeout_ms) {
  if (p->ipc_pending) { /* the direct copies: done on the device once the event is */
    if (x->cudart.event_record(x->ipc_event, x->ipc_stream) != 0)
      return tw_err(TW_ERR_CUDA, "cudaEventRecord after the direct kv copies failed");
    int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
    int e;
    while ((e = x->cudart.event_query(x->ipc_event)) == TW_CUDA_NOT_READY) {
      if (tw_now_ns() > deadline)
        return tw_err(TW_ERR_DEADLINE, "direct kv copies did not complete within %d ms",
                      timeout_ms);
      struct timespec ts = {0, 20000};
      nanosleep(&ts, NULL);
    }
    if (e != 0)
      return tw_err(TW_ERR_CUDA,
                    "a direct kv copy into the decode worker's pool failed (cuda "
                    "error %d)",
                    e);
    p->ipc_pending = false;
  }
  ucp_request_param_t prm = {.op_attr_mask = 0};
  void *req = ucp_ep_flush_nbx(p->ep, &prm);
  if (UCS_PTR_IS_ERR(req)) {
    p->failed = 1;
    return tw_err(TW_ERR_UNAVAILABLE, "ucp_ep_flush_nbx failed: %s",
                  ucs_status_string(UCS_PTR_STATUS(req)));
  }
  ucs_status_t s = UCS_OK;
  if (req) {
    int64_t deadline = tw_now_ns() + (int64_t)timeout_ms * 1000000;
    while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
      ucp_worker_progress(x->worker);
      if (tw_now_ns() > deadline) {
        /* a flush cannot be cancelled: release the request (UCX frees it when
         * it completes or the endpoint is closed) and drop the endpoint */
        ucp_request_free(req);
        p->failed = 1;
        return tw_err(TW_ERR_DEADLINE, "kv transfer flush did not complete within %d ms",
                      timeout_ms);
      }
    }
    ucp_request_free(req);
  }
  if (s != UCS_OK || p->failed) {
    p->failed = 1;
    return tw_err(TW_ERR_UNAVAILABLE, "kv transfer flush failed: %s", ucs_status_string(s));
  }
  for (int k = 0; k < TW_KV_RING_SLOTS; k++) TW_CHECK(tw_kv_req_wait(x, &x->ring.req[k]));
  x->stats.flushes++;
  if (p->t_first_put_ns) {
    x->stats.transfer_seconds += (double)(tw_now_ns() - p->t_first_put_ns) * 1e-9;
    p->t_first_put_ns = 0;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_layer_checksum(const tw_kv_layout_t *pool, int32_t layer,
                                              const int32_t *ids, int32_t first, int32_t n,
                                              uint64_t *checksum_p) {
  uint64_t h = TW_KV_FNV_INIT;
  tw_cudart_t rt = {0};
  uint8_t *copy = NULL;
  tw_status_t st = TW_OK;
  if (pool->on_device && (st = tw_cudart_load(&rt)) == TW_OK &&
      !(copy = malloc((size_t)pool->block_bytes)))
    st = tw_err(TW_ERR_NO_MEMORY, "cannot allocate a %lld-byte kv block copy",
                (long long)pool->block_bytes);
  for (int32_t i = first; i < n && st == TW_OK; i++) {
    char *blk = NULL;
    st = tw_kv_block_ptr(pool, layer, ids[i], &blk);
    if (st == TW_OK && copy && rt.memcpy_(copy, blk, (size_t)pool->block_bytes, TW_CUDA_D2H) != 0)
      st = tw_err(TW_ERR_CUDA, "cudaMemcpy of kv block %d to the host failed", ids[i]);
    if (st == TW_OK) h = tw_kv_fnv1a(h, copy ? (const char *)copy : blk, (size_t)pool->block_bytes);
  }
  free(copy);
  if (rt.lib) dlclose(rt.lib);
  if (st == TW_OK) *checksum_p = h;
  return st;
}
