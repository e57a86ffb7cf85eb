/* kv_transfer.c: UCX one-sided KV handoff (see kv_transfer.h). */
#include "common/kv_transfer.h"

#include "common/log.h"

#include <ucp/api/ucp.h>

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TW_KV_XFER_MAGIC 0x7478666bu /* "kfxt" */
#define TW_KV_MAX_PEERS 64
#define TW_KV_BOUNCE_BYTES (4u << 20)

/* ---- CUDA runtime through dlopen (staging only) ---- */
typedef int (*tw_cuda_memcpy_fn)(void *, const void *, size_t, int);
typedef int (*tw_cuda_host_alloc_fn)(void **, size_t, unsigned);
typedef int (*tw_cuda_free_host_fn)(void *);
typedef struct {
  void *lib;
  tw_cuda_memcpy_fn memcpy_;
  tw_cuda_host_alloc_fn host_alloc;
  tw_cuda_free_host_fn free_host;
} tw_cudart_t;
enum { TW_CUDA_H2D = 1, TW_CUDA_D2H = 2 };

static tw_status_t tw_cudart_load(tw_cudart_t *rt) {
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
  rt->host_alloc = (tw_cuda_host_alloc_fn)dlsym(rt->lib, "cudaHostAlloc");
  rt->free_host = (tw_cuda_free_host_fn)dlsym(rt->lib, "cudaFreeHost");
  if (!rt->memcpy_ || !rt->host_alloc || !rt->free_host)
    return tw_err(TW_ERR_UNSUPPORTED, "libcudart lacks cudaMemcpy/cudaHostAlloc/cudaFreeHost");
  return TW_OK;
}

struct tw_kv_peer {
  uint8_t *address;
  size_t address_len;
  uint8_t *rkey_buf;
  size_t rkey_len;
  ucp_ep_h ep;
  ucp_rkey_h rkey;
  int failed;
  int64_t t_first_put_ns; /* 0 when nothing is in flight */
};

struct tw_kv_xfer {
  uint32_t magic;
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_address_t *address;
  size_t address_len;
  bool cuda_native;
  tw_kv_peer_t *peers[TW_KV_MAX_PEERS];
  int n_peers;
  tw_cudart_t cudart;
  uint8_t *bounce;   /* pinned host bounce buffer (device sources, staging) */
  bool send_mode_logged;
  tw_kv_xfer_stats_t stats;
};

struct tw_kv_region {
  tw_kv_xfer_t *xfer;
  tw_kv_layout_t layout;
  void *registered;   /* the pool itself, or its pinned host mirror */
  bool staged;
  ucp_mem_h memh;
  void *rkey;
  size_t rkey_len;
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

tw_status_t tw_kv_xfer_create(tw_kv_xfer_t **xfer_p) {
  tw_kv_xfer_t *x = calloc(1, sizeof *x);
  if (!x) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate the kv transfer handle");
  x->magic = TW_KV_XFER_MAGIC;
  tw_status_t st = TW_OK;
  ucp_config_t *cfg = NULL;
  ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_config_read failed: %s", ucs_status_string(us));
    goto fail;
  }
  /* WAKEUP: the receiving side sleeps on the worker's event fd (see
   * tw_kv_xfer_wait_fd); emulated puts and flushes need its progress */
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                         .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
  us = ucp_init(&params, cfg, &x->ctx);
  ucp_config_release(cfg);
  if (us != UCS_OK) {
    st = tw_err(TW_ERR_TRANSPORT, "ucp_init failed: %s", ucs_status_string(us));
    goto fail;
  }
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  if (ucp_context_query(x->ctx, &attr) == UCS_OK)
    x->cuda_native = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  us = ucp_worker_create(x->ctx, &wp, &x->worker);
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
  TW_INFO("kvx", "ucx worker up: address %zu bytes", x->address_len);
  *xfer_p = x;
  return TW_OK;
fail:
  tw_kv_xfer_destroy(x);
  return st;
}

static void tw_kv_peer_close(tw_kv_xfer_t *x, tw_kv_peer_t *p) {
  if (!p) return;
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
  if (x->worker) ucp_worker_destroy(x->worker);
  if (x->ctx) ucp_cleanup(x->ctx);
  if (x->bounce && x->cudart.free_host) x->cudart.free_host(x->bounce);
  if (x->cudart.lib) dlclose(x->cudart.lib);
  x->magic = 0;
  free(x);
}

const void *tw_kv_xfer_address(const tw_kv_xfer_t *x, size_t *len_p) {
  *len_p = x->address_len;
  return x->address;
}
bool tw_kv_xfer_cuda_native(const tw_kv_xfer_t *x) { return x->cuda_native; }
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

tw_status_t tw_kv_region_register(tw_kv_xfer_t *x, const tw_kv_layout_t *layout,
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
  if (layout->on_device) {
    if (x->cuda_native) {
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
  TW_INFO("kvx", "registered kv pool: %lld bytes, %d layers x %d blocks, rkey %zu bytes%s",
          (long long)layout->total_bytes, layout->n_layers, layout->n_blocks, len,
          r->staged ? ", pinned host mirror" : "");
  TW_INFO("kvx", "kv handoff mode (receive): %s",
          !layout->on_device ? "host KV pool, registered in place"
          : r->staged ? "device KV pool STAGED: puts land in a pinned host mirror, copied to the "
                        "device per handoff (UCX has no CUDA support)"
                      : "device KV pool DIRECT: registered as CUDA memory (UCX cuda transports)");
  *region_p = r;
  return TW_OK;
fail:
  tw_kv_region_unregister(r);
  return st;
}

void tw_kv_region_unregister(tw_kv_region_t *r) {
  if (!r) return;
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

tw_status_t tw_kv_region_commit(tw_kv_region_t *r, const int32_t *ids, int32_t n) {
  if (!r->staged) return TW_OK;
  const tw_kv_layout_t *l = &r->layout;
  for (int32_t layer = 0; layer < l->n_layers; layer++)
    for (int32_t i = 0; i < n; i++) {
      int64_t off = layer * l->layer_stride_bytes + (int64_t)ids[i] * l->block_bytes;
      if (r->xfer->cudart.memcpy_((char *)l->base + off, (char *)r->registered + off,
                                  (size_t)l->block_bytes, TW_CUDA_H2D) != 0)
        return tw_err(TW_ERR_CUDA, "cudaMemcpy of kv block %d layer %d to the device failed",
                      ids[i], layer);
    }
  return TW_OK;
}

static void tw_kv_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  tw_kv_peer_t *p = arg;
  p->failed = 1;
  TW_WARN("kvx", "ucx endpoint to a decode worker failed: %s", ucs_status_string(status));
}

tw_status_t tw_kv_xfer_peer(tw_kv_xfer_t *x, const void *address, size_t address_len,
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
    x->peers[x->n_peers++] = p;
  }
  if (!p->rkey || p->rkey_len != rkey_len || memcmp(p->rkey_buf, rkey, rkey_len) != 0) {
    if (p->rkey) ucp_rkey_destroy(p->rkey);
    p->rkey = NULL;
    free(p->rkey_buf);
    p->rkey_buf = malloc(rkey_len ? rkey_len : 1);
    if (!p->rkey_buf) return tw_err(TW_ERR_NO_MEMORY, "cannot allocate an rkey copy");
    memcpy(p->rkey_buf, rkey, rkey_len);
    p->rkey_len = rkey_len;
    ucs_status_t us = ucp_ep_rkey_unpack(p->ep, p->rkey_buf, &p->rkey);
    if (us != UCS_OK) {
      p->rkey = NULL;
      p->rkey_len = 0;
      return tw_err(TW_ERR_TRANSPORT, "ucp_ep_rkey_unpack failed: %s", ucs_status_string(us));
    }
  }
  *peer_p = p;
  return TW_OK;
}

int32_t tw_kv_layer_first_block(int32_t n_tokens, int32_t block_size, bool sliding,
                                int32_t window) {
  if (!sliding || n_tokens <= window) return 0;
  return (n_tokens - window) / block_size;
}

static tw_status_t tw_kv_block_ptr(const tw_kv_layout_t *l, int32_t layer, int32_t id,
                                   char **ptr_p) {
  if (layer < 0 || layer >= l->n_layers || id < 0 || id >= l->n_blocks)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv block %d of layer %d is outside the pool (%d x %d)",
                  id, layer, l->n_layers, l->n_blocks);
  *ptr_p = (char *)l->base + layer * l->layer_stride_bytes + (int64_t)id * l->block_bytes;
  return TW_OK;
}

/* Host view of a block: the block itself, or a copy in `bounce` for device pools. */
static tw_status_t tw_kv_host_view(tw_cudart_t *rt, uint8_t **bounce, const tw_kv_layout_t *l,
                                   char *blk, const char **view_p) {
  if (!l->on_device) {
    *view_p = blk;
    return TW_OK;
  }
  TW_CHECK(tw_cudart_load(rt));
  if (!*bounce) {
    void *b = NULL;
    if (rt->host_alloc(&b, TW_KV_BOUNCE_BYTES, 0) != 0)
      return tw_err(TW_ERR_NO_MEMORY, "cudaHostAlloc of the kv bounce buffer failed");
    *bounce = b;
  }
  if ((size_t)l->block_bytes > TW_KV_BOUNCE_BYTES)
    return tw_err(TW_ERR_UNSUPPORTED, "kv block of %lld bytes exceeds the bounce buffer",
                  (long long)l->block_bytes);
  if (rt->memcpy_(*bounce, blk, (size_t)l->block_bytes, TW_CUDA_D2H) != 0)
    return tw_err(TW_ERR_CUDA, "cudaMemcpy of a kv block to the host failed");
  *view_p = (const char *)*bounce;
  return TW_OK;
}

/* Wait for one put request (used when the source is a reused bounce buffer). */
static tw_status_t tw_kv_wait(tw_kv_xfer_t *x, void *req) {
  if (req == NULL) return TW_OK;
  if (UCS_PTR_IS_ERR(req))
    return tw_err(TW_ERR_TRANSPORT, "ucp_put_nbx failed: %s",
                  ucs_status_string(UCS_PTR_STATUS(req)));
  ucs_status_t s;
  int64_t deadline = tw_now_ns() + 10 * 1000000000LL;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    ucp_worker_progress(x->worker);
    if (tw_now_ns() > deadline) {
      ucp_request_free(req);
      return tw_err(TW_ERR_DEADLINE, "ucx put of a staged kv block did not complete in 10 s");
    }
  }
  ucp_request_free(req);
  if (s != UCS_OK) return tw_err(TW_ERR_TRANSPORT, "ucx put failed: %s", ucs_status_string(s));
  return TW_OK;
}

tw_status_t tw_kv_xfer_send_layer(tw_kv_xfer_t *x, tw_kv_peer_t *p, const tw_kv_layout_t *src,
                                  const tw_kv_remote_layout_t *dst, int32_t layer,
                                  const int32_t *src_ids, const int32_t *dst_ids, int32_t first,
                                  int32_t n, uint64_t *maybe_checksum) {
  if (src->dtype != dst->dtype || src->block_size != dst->block_size ||
      src->n_kv_heads_local != dst->n_kv_heads || src->head_dim != dst->head_dim ||
      src->block_bytes != dst->block_bytes || src->n_layers != dst->n_layers)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "kv layouts differ (prefill dtype %d bs=%d heads=%d dim=%d, decode dtype %d bs=%d heads=%d "
                  "dim=%d): re-sharding is not implemented",
                  (int)src->dtype, src->block_size, src->n_kv_heads_local, src->head_dim,
                  (int)dst->dtype, dst->block_size, dst->n_kv_heads, dst->head_dim);
  if (p->failed) return tw_err(TW_ERR_UNAVAILABLE, "the decode worker's ucx endpoint failed");
  if (!p->t_first_put_ns) p->t_first_put_ns = tw_now_ns();
  if (!x->send_mode_logged) {
    x->send_mode_logged = true;
    TW_INFO("kvx", "kv handoff mode (send): %s, to a %s pool",
            src->on_device ? "device KV pool STAGED: each block copied to a pinned host bounce "
                             "buffer (cudaMemcpy D2H), then put"
                           : "host KV pool, put in place",
            dst->on_device ? "device (UCX cuda transports)" : "host (or pinned host mirror)");
  }
  uint64_t h = maybe_checksum ? *maybe_checksum : TW_KV_FNV_INIT;
  for (int32_t i = first; i < n; i++) {
    char *blk = NULL;
    TW_CHECK(tw_kv_block_ptr(src, layer, src_ids[i], &blk));
    if (dst_ids[i] < 0 || dst_ids[i] >= dst->n_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "remote kv block %d outside the pool of %d blocks",
                    dst_ids[i], dst->n_blocks);
    const char *view = NULL;
    TW_CHECK(tw_kv_host_view(&x->cudart, &x->bounce, src, blk, &view));
    if (maybe_checksum) h = tw_kv_fnv1a(h, view, (size_t)src->block_bytes);
    uint64_t raddr = dst->remote_base + (uint64_t)(layer * dst->layer_stride_bytes) +
                     (uint64_t)dst_ids[i] * (uint64_t)dst->block_bytes;
    ucp_request_param_t prm = {.op_attr_mask = 0};
    void *req = ucp_put_nbx(p->ep, view, (size_t)src->block_bytes, raddr, p->rkey, &prm);
    if (src->on_device) {
      TW_CHECK(tw_kv_wait(x, req)); /* the bounce buffer is reused by the next block */
    } else if (UCS_PTR_IS_ERR(req)) {
      return tw_err(TW_ERR_TRANSPORT, "ucp_put_nbx of kv block %d layer %d failed: %s",
                    src_ids[i], layer, ucs_status_string(UCS_PTR_STATUS(req)));
    } else if (req) {
      ucp_request_free(req); /* completion is tracked by the endpoint flush */
    }
    x->stats.bytes_sent += src->block_bytes;
    x->stats.puts++;
  }
  if (maybe_checksum) *maybe_checksum = h;
  ucp_worker_progress(x->worker);
  return TW_OK;
}

tw_status_t tw_kv_xfer_flush(tw_kv_xfer_t *x, tw_kv_peer_t *p, int timeout_ms) {
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
  x->stats.flushes++;
  if (p->t_first_put_ns) {
    x->stats.transfer_seconds += (double)(tw_now_ns() - p->t_first_put_ns) * 1e-9;
    p->t_first_put_ns = 0;
  }
  return TW_OK;
}

tw_status_t tw_kv_layer_checksum(const tw_kv_layout_t *pool, int32_t layer, const int32_t *ids,
                                 int32_t first, int32_t n, uint64_t *checksum_p) {
  uint64_t h = TW_KV_FNV_INIT;
  tw_cudart_t rt = {0};
  uint8_t *bounce = NULL;
  tw_status_t st = TW_OK;
  for (int32_t i = first; i < n && st == TW_OK; i++) {
    char *blk = NULL;
    const char *view = NULL;
    st = tw_kv_block_ptr(pool, layer, ids[i], &blk);
    if (st == TW_OK) st = tw_kv_host_view(&rt, &bounce, pool, blk, &view);
    if (st == TW_OK) h = tw_kv_fnv1a(h, view, (size_t)pool->block_bytes);
  }
  if (bounce) rt.free_host(bounce);
  if (rt.lib) dlclose(rt.lib);
  if (st == TW_OK) *checksum_p = h;
  return st;
}
