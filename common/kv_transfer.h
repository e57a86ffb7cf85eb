/* kv_transfer.h: the KV-cache handoff from a prefill worker to a decode
 * worker over UCX one-sided puts (ARCHITECTURE.md "Processes and data flow").
 *
 * The decode side registers its KV pool (ucp_mem_map) and publishes its ucp
 * worker address, the packed rkey and the pool layout. The prefill side
 * connects an endpoint (cached per decode worker), unpacks the rkey and puts
 * each layer's blocks straight into the reserved blocks of the remote pool,
 * layer by layer (tw_kv_xfer_send_layer can be called as each layer's KV is
 * ready). Completion is only reported after an endpoint flush, i.e. when the
 * data is remotely visible (ucp_put_nbx completing locally is not enough).
 *
 * Memory types. Host pools are registered directly. For a device pool the
 * context is asked at run time whether UCX handles CUDA memory
 * (UCP_ATTR_FIELD_MEMORY_TYPES); if not (Debian's UCX), both sides stage
 * through pinned host memory (cudaHostAlloc, loaded with dlopen so the
 * library needs no CUDA at link time): the sender copies a block to a
 * pinned bounce buffer before the put, the receiver registers a pinned host
 * mirror of its pool and copies the received blocks into device memory in
 * tw_kv_region_commit(). Not thread-safe: one thread per tw_kv_xfer_t. */
#ifndef TW_COMMON_KV_TRANSFER_H
#define TW_COMMON_KV_TRANSFER_H

#include "common/engine.h"
#include "common/status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_kv_xfer tw_kv_xfer_t;
typedef struct tw_kv_region tw_kv_region_t;
typedef struct tw_kv_peer tw_kv_peer_t;

/** What a decode worker publishes about its pool (mirrors KvLayout in
 *  proto/twain_internal.proto). */
typedef struct {
  tw_dtype_t dtype;
  bool on_device;
  int32_t n_layers;
  int32_t n_blocks;
  int32_t block_size;
  int32_t n_kv_heads;
  int32_t head_dim;
  int64_t layer_stride_bytes;
  int64_t block_bytes;
  uint64_t remote_base;   /* registered base address in the owner process */
  int64_t total_bytes;
} tw_kv_remote_layout_t;

/** Counters since creation (for metrics). */
typedef struct {
  int64_t bytes_sent;
  int64_t puts;
  int64_t flushes;
  double transfer_seconds;   /* summed wall time from first put to flush done */
} tw_kv_xfer_stats_t;

/** Create a ucp context (RMA feature) and one worker.
 *  Errors: TW_ERR_TRANSPORT (ucp_init/ucp_worker_create failed, with the
 *  UCS status text), TW_ERR_NO_MEMORY. */
tw_status_t tw_kv_xfer_create(tw_kv_xfer_t **xfer_p);
/** Destroy endpoints, regions' rkeys and the worker. NULL does nothing. */
void tw_kv_xfer_destroy(tw_kv_xfer_t *xfer);

/** The worker's address (borrowed, valid until destroy). */
const void *tw_kv_xfer_address(const tw_kv_xfer_t *xfer, size_t *len_p);
/** Whether this UCX handles CUDA device memory natively (run-time query). */
bool tw_kv_xfer_cuda_native(const tw_kv_xfer_t *xfer);
/** Progress the worker once (call from the owner's loop). */
void tw_kv_xfer_progress(tw_kv_xfer_t *xfer);
void tw_kv_xfer_stats(const tw_kv_xfer_t *xfer, tw_kv_xfer_stats_t *stats_p);
/** Progress, then arm the worker's event fd: returns the fd to poll for
 *  input before sleeping (readable when UCX has work: emulated puts and
 *  flushes from a prefill worker need this side's progress), or -1 when the
 *  caller must not sleep (events pending, or no wakeup support). */
int tw_kv_xfer_wait_fd(tw_kv_xfer_t *xfer);

/** Register a KV pool for remote writes. Host pools are mapped in place;
 *  a device pool without native CUDA support gets a pinned host mirror.
 *  Errors: TW_ERR_INVALID_ARGUMENT (empty layout), TW_ERR_TRANSPORT
 *  (ucp_mem_map/ucp_rkey_pack), TW_ERR_UNSUPPORTED (device pool, no native
 *  support and no libcudart), TW_ERR_NO_MEMORY. */
tw_status_t tw_kv_region_register(tw_kv_xfer_t *xfer, const tw_kv_layout_t *layout,
                                  tw_kv_region_t **region_p);
void tw_kv_region_unregister(tw_kv_region_t *region);
/** Packed rkey (borrowed) and the layout to publish in a KvHandoff. */
const void *tw_kv_region_rkey(const tw_kv_region_t *region, size_t *len_p);
void tw_kv_region_remote_layout(const tw_kv_region_t *region, tw_kv_remote_layout_t *out);
/** After PrefillDone: make the received blocks visible to the engine (copy
 *  mirror -> device when staging; nothing for host or native pools).
 *  Errors: TW_ERR_CUDA. */
tw_status_t tw_kv_region_commit(tw_kv_region_t *region, const int32_t *block_ids,
                                int32_t n_blocks);

/** Endpoint to a remote worker by address; cached, so repeated handoffs to the
 *  same decode worker reuse it. The rkey is (re)unpacked if it changed.
 *  Errors: TW_ERR_TRANSPORT (ucp_ep_create/ucp_ep_rkey_unpack), TW_ERR_NO_MEMORY. */
tw_status_t tw_kv_xfer_peer(tw_kv_xfer_t *xfer, const void *address, size_t address_len,
                            const void *rkey, size_t rkey_len, tw_kv_peer_t **peer_p);

/** Which blocks of a prompt of n_tokens a layer needs on the decode side:
 *  all of them for full-attention layers, for sliding layers only those that
 *  hold positions >= n_tokens - window (spec §2.6: position p attends to
 *  p-(W-1)..p, so later positions never read earlier ones). Writes the
 *  first block index (in position order); the last is
 *  ceil(n_tokens/block_size) - 1. */
int32_t tw_kv_layer_first_block(int32_t n_tokens, int32_t block_size, bool sliding,
                                int32_t window);

/** Put one layer's blocks: local blocks src_ids[first..n) of `src` (the prefill
 *  engine's pool) into remote blocks dst_ids[first..n) of the peer's pool,
 *  non-blocking. If maybe_checksum is set, the FNV-1a 64 of the bytes sent
 *  (in block order) continues from *maybe_checksum (start it at
 *  TW_KV_FNV_INIT), so a layer sent in several calls, chunk by chunk, gets
 *  the checksum of all its blocks.
 *  Errors: TW_ERR_UNSUPPORTED (layouts differ in dtype, block size, heads or
 *  head_dim: re-sharding is not implemented), TW_ERR_INVALID_ARGUMENT (block
 *  id out of a pool), TW_ERR_TRANSPORT (ucp_put_nbx failed), TW_ERR_CUDA. */
tw_status_t tw_kv_xfer_send_layer(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer,
                                  const tw_kv_layout_t *src, const tw_kv_remote_layout_t *dst,
                                  int32_t layer, const int32_t *src_ids, const int32_t *dst_ids,
                                  int32_t first, int32_t n, uint64_t *maybe_checksum);

/** Wait until every put to `peer` is remotely complete (ucp_ep_flush_nbx),
 *  progressing the worker, for at most timeout_ms.
 *  Errors: TW_ERR_DEADLINE (timed out), TW_ERR_UNAVAILABLE (the peer failed;
 *  the endpoint is dropped from the cache), TW_ERR_TRANSPORT. */
tw_status_t tw_kv_xfer_flush(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer, int timeout_ms);

/** FNV-1a 64 over bytes, continuing from `h` (start with TW_KV_FNV_INIT). */
#define TW_KV_FNV_INIT 0xcbf29ce484222325ull
uint64_t tw_kv_fnv1a(uint64_t h, const void *data, size_t len);

/** Checksum of blocks ids[first..n) of `layer` in a local pool, computed the
 *  same way as tw_kv_xfer_send_layer (host pools, or device pools through a
 *  copy). Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA, TW_ERR_NO_MEMORY. */
tw_status_t tw_kv_layer_checksum(const tw_kv_layout_t *pool, int32_t layer, const int32_t *ids,
                                 int32_t first, int32_t n, uint64_t *checksum_p);

#ifdef __cplusplus
}
#endif
#endif
