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
 * Puts are as large as the layouts allow: a run of blocks that are
 * consecutive in both pools is one put (tw_kv_xfer_send_layer), and pieces
 * that land contiguously on the remote side but lie apart locally (a
 * re-sharded head run, kv_reshard.h) are gathered into one put through a
 * bounded ring of bounce buffers (tw_kv_xfer_put).
 *
 * Paths (chosen per endpoint and pool pair, logged once per pair):
 *  - host: host pool to host pool, put in place;
 *  - direct cuda_ipc: the decode pool is device memory registered as
 *    UCS_MEMORY_TYPE_CUDA (UCX built with CUDA, detected at run time with
 *    UCP_ATTR_FIELD_MEMORY_TYPES); the prefill side's device pool is
 *    registered as CUDA memory too and put device to device. Only over an
 *    endpoint with a cuda_ipc lane that carries puts: otherwise UCX would
 *    emulate the put and its receiver would memcpy into the device pointer
 *    on the host (TW_ERR_UNSUPPORTED instead). UCX 1.13 puts over cuda_ipc
 *    (zero-copy only) with its protocols v2 alone, so a context with CUDA
 *    support is made with UCX_PROTO_ENABLE=y unless the environment sets it;
 *  - staged (sender): a device pool into a host-registered decode pool:
 *    device-to-host copies on the sender ring's own stream, several chunks
 *    ahead of the puts, into a bounded ring (4 x 8 MiB pinned) on the sender;
 *  - staged (receiver's ring): a device decode pool that this UCX cannot
 *    reach (no CUDA transports, or TWAIN_KV_PATH=staged, which stages a
 *    host pool too: the same path on a machine without a GPU, copies out
 *    of the ring by memcpy) is not registered at all, and no pinned mirror
 *    of it exists. The receiver has a bounded ring of slots
 *    (TWAIN_KV_STAGING_SLOTS x TWAIN_KV_STAGING_SLOT_MB, default 16 x 8
 *    MiB) allocated by UCX (shared memory on one host) and pinned for the
 *    device copies, and publishes the ring's rkey. Each piece (at most one
 *    slot, from the sender's pool or its own ring for a device source)
 *    moves in three small eager active messages: the sender asks for a slot
 *    ("want": the pool, the destination offset, the handoff), the receiver
 *    grants a free one over its own endpoint to the sender ("grant"), the
 *    sender puts the piece into the slot, flushes, and says so ("filled").
 *    The receiver (kv_rxring.h) copies the slot to the pool on its own
 *    stream (cudaMemcpyAsync, then an event) and frees the slot when that
 *    event completes. With every slot in use, pieces wait in the
 *    receiver's queue: back-pressure without any unbounded buffer. The
 *    decode worker uses a sequence's blocks once tw_kv_region_landed says
 *    every byte of every block sent for that request is on the device; it
 *    never waits for it. The receiver never waits on UCX for a sender (no
 *    rendezvous, no get): slots granted to a sender that is gone are taken
 *    back (its pid, on one host; no fill within 120 s elsewhere) and its
 *    waiting pieces dropped, so a prefill worker killed mid-handoff leaves
 *    the decode worker serving.
 * The other way round, a decode worker killed while a prefill worker
 * connects to it or hands off into it: the sender's waits are bounded (the
 * greeting 10 s, pieces and flushes their timeouts), and once the receiver
 * answered the greeting with its process, a receiver on this host that no
 * longer runs fails the handoff at once (its pid, checked every 20 ms and at
 * every flush) with TW_ERR_UNAVAILABLE naming its pid; a failed receiver's
 * endpoint, rkey and pieces are let go at once (tw_kv_xfer_stats:
 * endpoints, pieces_in_flight), and the next handoff to that address makes
 * a new one (test_kv_staged receivers).
 * Not thread-safe: one thread per tw_kv_xfer_t. */
#ifndef TW_COMMON_KV_TRANSFER_H
#define TW_COMMON_KV_TRANSFER_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/kv/kv_rxring.h"

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
  /* > 0: the pool takes pieces of at most this many bytes into its bounce
   * bounce ring (staged receive; the rkey is the ring's) */
  int64_t staging_slot_bytes;
  /* the sender's: names the handoff (its request id) in each piece sent to a
   * staged receiver, which counts a block complete for that handoff only */
  uint64_t handoff_tag;
  /* the window ring (engine.h tw_kv_layout_t, kv_ring.h); ring_blocks 0: none */
  int32_t ring_blocks;
  int32_t n_ring_blocks;
  uint64_t ring_layers;
} tw_kv_remote_layout_t;

/** Counters since creation (for metrics). */
typedef struct {
  int64_t bytes_sent;
  int64_t puts;
  int64_t flushes;
  double transfer_seconds;   /* summed wall time from first put to flush done */
  int64_t direct_bytes;      /* of bytes_sent, put device to device (cuda_ipc) */
  int64_t staged_bytes;      /* of bytes_sent, copied through the bounce ring from a device */
  int64_t ring_bytes;        /* of bytes_sent, sent into a receiver's bounce ring (active
                              * messages, counted in puts) */
  /* now, not counters: pieces sent to staged receivers and not yet
   * answered (each holds a pointer into the local pool), and cached
   * endpoints to decode workers that are open (a failed one is closed at
   * once) */
  int32_t pieces_in_flight;
  int32_t endpoints;
} tw_kv_xfer_stats_t;

/** How bytes go from a local pool to a remote one (see the file comment). */
typedef enum {
  TW_KV_PATH_HOST = 0,
  TW_KV_PATH_DIRECT_CUDA_IPC = 1,
  TW_KV_PATH_STAGED = 2,
  TW_KV_PATH_UNREACHABLE = 3, /* device pool, no cuda_ipc lane: refused */
  TW_KV_PATH_DIRECT_UCX = 4,  /* device to device, UCX put over a cuda_ipc lane */
  TW_KV_PATH_STAGED_RECV = 5, /* pieces into the receiver's bounce ring (staged receive) */
} tw_kv_path_t;

/** One piece of a local pool: `bytes` bytes at `ptr`. */
typedef struct {
  const void *ptr;
  int64_t bytes;
} tw_kv_seg_t;

/** Create a ucp context (RMA feature) and one worker. Its transports are
 *  the operator's UCX_TLS when set, else every one UCX finds but its
 *  shared-memory FIFO transports (sysv, posix, xpmem): a sender killed while
 *  UCX writes one of its messages into a receiver's FIFO leaves that
 *  receiver unable to receive from anyone again (docs/operations.md, "Staged
 *  receive"). Two workers use a transport only when both have it, so a
 *  receiver without the FIFOs is reached without them by any sender.
 *  Errors: TW_ERR_TRANSPORT (ucp_init/ucp_worker_create failed, with the
 *  UCS status text), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_xfer_create(tw_kv_xfer_t **xfer_p);
/** As tw_kv_xfer_create, with UCX's network devices bound for a worker
 *  whose router link is `router_endpoint` (a ZeroMQ endpoint): the operator's
 *  UCX_NET_DEVICES when set (UCX reads it; "all" is UCX's default), else
 *  tw_kv_net_devices of the endpoint, so UCX's TCP transport listens only on
 *  the interface the router link uses (loopback for 127.0.0.1). Logged
 *  either way. When no interface can be derived, UCX's default is kept and
 *  a warning says so. NULL endpoint: as tw_kv_xfer_create. `shm_fifo`: keep
 *  the shared-memory FIFO transports where UCX_TLS is not set: for a decode
 *  worker whose host pool takes puts in place (UCX 1.13 puts over them; over
 *  TCP it emulates puts), and for a prefill worker, so that it reaches such
 *  a decode worker with them and any other without. Errors: as
 *  tw_kv_xfer_create. */
TW_NODISCARD tw_status_t tw_kv_xfer_create_bound(const char *router_endpoint, bool shm_fifo,
                                                 tw_kv_xfer_t **xfer_p);
/** UCX_NET_DEVICES for a worker whose router link is `endpoint`: the name of
 *  the local interface that routes to its host ("tcp://HOST:PORT",
 *  "tcp://SRC;HOST:PORT", "[v6]" hosts; ipc:// and inproc:// are this host:
 *  the loopback interface), then every RDMA port (/sys/class/infiniband,
 *  "mlx5_0:1"; RDMA listens on no socket). Writes a NUL-terminated list of at
 *  most cap - 1 bytes to out. Errors: TW_ERR_INVALID_ARGUMENT (not a tcp,
 *  ipc or inproc endpoint, no port), TW_ERR_NOT_FOUND (the host does not
 *  resolve, no route, or no interface holds the local address),
 *  TW_ERR_OUT_OF_RANGE (the list does not fit in cap). */
TW_NODISCARD tw_status_t tw_kv_net_devices(const char *endpoint, char *out, size_t cap);
/** Destroy endpoints, regions' rkeys and the worker. NULL does nothing. */
void tw_kv_xfer_destroy(tw_kv_xfer_t *xfer);

/** The worker's address as it is published (borrowed, valid until
 *  destroy), sealed (kv_seal.h, TW_KV_SEAL_ADDRESS): UCX's worker address,
 *  followed, when this worker's transports are TCP alone and its listener
 *  is up, by a descriptor of that listener (IP, port) that tw_kv_xfer_peer
 *  on TCP alone connects through (kv_transfer.c). */
const void *tw_kv_xfer_address(const tw_kv_xfer_t *xfer, size_t *len_p);
/** Whether this UCX handles CUDA device memory natively (run-time query). */
bool tw_kv_xfer_cuda_native(const tw_kv_xfer_t *xfer);
/** Whether handoffs from this side may take the direct CUDA IPC path (a
 *  decode pool on this host exported in its rkey blob, mapped here and copied
 *  into device to device; see kv_transfer.c). Off by default: only a sender
 *  that tells the receiver the KV is in place (PrefillDone.kv_in_place) turns
 *  it on, since a staged receiver would otherwise copy its stale host mirror
 *  over the blocks. Applies to peers from the next tw_kv_xfer_peer call. */
void tw_kv_xfer_set_direct_ipc(tw_kv_xfer_t *xfer, bool allow);

/** Progress the worker once (call from the owner's loop). */
void tw_kv_xfer_progress(tw_kv_xfer_t *xfer);
void tw_kv_xfer_stats(const tw_kv_xfer_t *xfer, tw_kv_xfer_stats_t *stats_p);
/** Progress, then arm the worker's event fd: returns the fd to poll for
 *  input before sleeping (readable when UCX has work: emulated puts and
 *  flushes from a prefill worker need this side's progress), or -1 when the
 *  caller must not sleep (events pending, or no wakeup support). */
int tw_kv_xfer_wait_fd(tw_kv_xfer_t *xfer);

/** How a region receives (tw_kv_region_register_ex). */
typedef struct {
  /* take pieces into a bounce ring even for a host pool (tests and
   * benchmarks of the staged receive path on a machine without a GPU: the
   * copy out of a slot is then a memcpy) */
  bool staging_ring;
  int32_t n_slots;    /* 0: TWAIN_KV_STAGING_SLOTS or its default (kv_rxring.h) */
  int64_t slot_bytes; /* 0: TWAIN_KV_STAGING_SLOT_MB or its default */
} tw_kv_region_params_t;

/** Register a KV pool for remote writes. Host pools are mapped in place;
 *  a device pool without native CUDA support (or with TWAIN_KV_PATH=staged)
 *  gets the staged receive path: a bounded ring of pinned bounce buffers
 *  (kv_rxring.h), sized by TWAIN_KV_STAGING_SLOTS / _SLOT_MB and logged.
 *  Errors: TW_ERR_INVALID_ARGUMENT (empty layout, a bad ring size setting),
 *  TW_ERR_TRANSPORT (ucp_mem_map/ucp_rkey_pack), TW_ERR_UNSUPPORTED (device
 *  pool, no native support and no libcudart), TW_ERR_CUDA (the ring's stream
 *  or events), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_region_register(tw_kv_xfer_t *xfer, const tw_kv_layout_t *layout,
                                               tw_kv_region_t **region_p);
/** The same with explicit receive parameters (NULL: as tw_kv_region_register). */
TW_NODISCARD tw_status_t tw_kv_region_register_ex(tw_kv_xfer_t *xfer, const tw_kv_layout_t *layout,
                                                  const tw_kv_region_params_t *params,
                                                  tw_kv_region_t **region_p);
/** Unregister; waits (at most 10 s) for the ring's copies. NULL does nothing. */
void tw_kv_region_unregister(tw_kv_region_t *region);
/** The rkey blob to publish in a KvHandoff, sealed (kv_seal.h,
 *  TW_KV_SEAL_RKEY; borrowed): the packed ucx rkey (of the bounce ring for a
 *  staged receiver; empty for a pool reached over CUDA IPC alone), then the
 *  CUDA IPC descriptor of an exported device pool. And the layout. */
const void *tw_kv_region_rkey(const tw_kv_region_t *region, size_t *len_p);
void tw_kv_region_remote_layout(const tw_kv_region_t *region, tw_kv_remote_layout_t *out);
/** Whether every byte of handoff `tag` (the request id) for blocks
 *  ids[firsts[l]..n) of every layer l (firsts NULL: from 0) is in the pool:
 *  TW_OK, or TW_INPROGRESS while pieces are on their way or being copied out
 *  of the ring. Progresses the region's ring (frees slots whose copies are
 *  done, starts waiting pieces); never blocks. Host and native pools: TW_OK
 *  (puts land in place; the sender's flush completed them).
 *  Errors: TW_ERR_INVALID_ARGUMENT (a block outside the pool), TW_ERR_CUDA (a
 *  copy out of the ring failed: its piece never counts). */
TW_NODISCARD tw_status_t tw_kv_region_landed(tw_kv_region_t *region, uint64_t tag,
                                             const int32_t *ids, int32_t n, const int32_t *firsts);
/** tw_kv_region_landed until TW_OK, progressing the worker, at most
 *  timeout_ms. Errors: those of tw_kv_region_landed, TW_ERR_DEADLINE. */
TW_NODISCARD tw_status_t tw_kv_region_commit(tw_kv_region_t *region, uint64_t tag,
                                             const int32_t *ids, int32_t n, const int32_t *firsts,
                                             int timeout_ms);
/** The staged receive ring's counters; false (nothing written) when the
 *  region has none. */
bool tw_kv_region_staging_stats(const tw_kv_region_t *region, tw_kv_rxring_stats_t *stats_p);
/** The first block each layer is sent of a prompt of n_tokens
 *  (tw_kv_layer_first_block per layer type): firsts[c->n_layers]. */
void tw_kv_layer_firsts(const tw_model_config_t *c, int32_t n_tokens, int32_t block_size,
                        int32_t *firsts);

/** The worker's address as it is published (borrowed, valid until
 *  destroy), sealed (kv_seal.h, TW_KV_SEAL_ADDRESS): UCX's worker address,
 *  followed, when this worker's transports are TCP alone and its listener
 *  is up, by a descriptor of that listener (IP, port) that tw_kv_xfer_peer
 *  on TCP alone connects through (kv_transfer.c). */
TW_NODISCARD tw_status_t tw_kv_xfer_peer(tw_kv_xfer_t *xfer, const void *address,
                                         size_t address_len, const void *rkey, size_t rkey_len,
                                         tw_kv_peer_t **peer_p);

/** Which blocks of a prompt of n_tokens a layer needs on the decode side:
 *  all of them for full-attention layers, for sliding layers only those that
 *  hold positions >= n_tokens - window (spec §2.6: position p attends to
 *  p-(W-1)..p, so later positions never read earlier ones). Writes the
 *  first block index (in position order); the last is
 *  ceil(n_tokens/block_size) - 1. */
int32_t tw_kv_layer_first_block(int32_t n_tokens, int32_t block_size, bool sliding,
                                int32_t window);

/** How many of a prompt's n_blocks blocks (n_tokens positions, block_size
 *  per block) are final once positions < end are computed: all of them when
 *  end >= n_tokens, else end / block_size (the block holding position `end`
 *  is still being written). */
int32_t tw_kv_blocks_final(int32_t end, int32_t n_tokens, int32_t n_blocks, int32_t block_size);

/** Put one layer's blocks: local blocks src_ids[first..n) of `src` (the prefill
 *  engine's pool) into remote blocks dst_ids[first..n) of the peer's pool
 *  (src_ids and dst_ids are the sequence's block tables: a ring layer of
 *  either pool, kv_ring.h, stores entry j in the block of entry j % R and
 *  keeps only the last R entries, so only entries from tw_kv_ring_first move),
 *  non-blocking, one put per run of blocks consecutive on both sides
 *  (tw_kv_run_length), over the path tw_kv_xfer_path gives. If maybe_checksum is set, the FNV-1a 64 of the bytes sent
 *  (in block order) continues from *maybe_checksum (start it at
 *  TW_KV_FNV_INIT), so a layer sent in several calls, chunk by chunk, gets
 *  the checksum of all its blocks.
 *  Errors: TW_ERR_UNSUPPORTED (layouts differ in dtype, block size, heads or
 *  head_dim: kv_reshard.h handles that), TW_ERR_INVALID_ARGUMENT (block id
 *  out of a pool), those of tw_kv_xfer_put. */
TW_NODISCARD tw_status_t tw_kv_xfer_send_layer(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer,
                                               const tw_kv_layout_t *src,
                                               const tw_kv_remote_layout_t *dst, int32_t layer,
                                               const int32_t *src_ids, const int32_t *dst_ids,
                                               int32_t first, int32_t n, uint64_t *maybe_checksum);

/** Greet the receiver behind `peer` once per endpoint (a no-op afterwards):
 *  a "hello" message answered by the receiver's worker on the endpoint its
 *  UCX made for ours (with the receiving process: on this host its pid is
 *  watched from then on), waited for (progressing this worker) at most 10 s.
 *  Once answered, the receiver has no UCX wireup message queued towards
 *  this process, so this process dying later cannot abort it through UCX
 *  1.13's TCP connection setup (kv_transfer.c, pieces; docs/operations.md).
 *  The staged path greets before its first piece; a prefill worker greets
 *  when it connects ahead of traffic. The receiver must progress its worker
 *  (a decode worker does, sleeping on its event fd).
 *  Errors: TW_ERR_TRANSPORT (the send failed), TW_ERR_UNAVAILABLE (the
 *  endpoint failed, now or before), TW_ERR_DEADLINE (no answer in 10 s); the
 *  endpoint is then closed at once and made again by the next
 *  tw_kv_xfer_peer. */
TW_NODISCARD tw_status_t tw_kv_xfer_greet(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer);

/** Wait until every put to `peer` is remotely complete (ucp_ep_flush_nbx),
 *  progressing the worker, for at most timeout_ms.
 *  Errors: TW_ERR_DEADLINE (timed out), TW_ERR_UNAVAILABLE (the peer failed,
 *  or its process on this host is gone: checked at every flush; a staged
 *  receiver dropped pieces), TW_ERR_TRANSPORT. On DEADLINE and a failed
 *  peer the endpoint is closed at once (tw_kv_xfer_peer makes a new one). */
TW_NODISCARD tw_status_t tw_kv_xfer_flush(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer, int timeout_ms);

/** The path puts from a local pool (on device or not) to a remote pool take
 *  over this endpoint, from its lanes (ucp_ep_print_info) and the pools. */
tw_kv_path_t tw_kv_xfer_path(const tw_kv_peer_t *peer, bool src_on_device, bool dst_on_device);
/** The path puts from a local pool to the remote pool `dst` take: into its
 *  bounce ring when it is staged (dst->staging_slot_bytes > 0), else
 *  tw_kv_xfer_path's. */
tw_kv_path_t tw_kv_xfer_path_to(const tw_kv_peer_t *peer, bool src_on_device,
                                const tw_kv_remote_layout_t *dst);
const char *tw_kv_path_name(tw_kv_path_t path);
/** The endpoint's transports, e.g. "self posix(put) cuda_ipc(put)" (borrowed). */
const char *tw_kv_xfer_peer_lanes(const tw_kv_peer_t *peer);

/** Put the local pieces segs[n_segs] of `src`, concatenated, into the remote
 *  range [raddr, raddr + their total) of the peer's pool `dst`, non-blocking
 *  (tw_kv_xfer_flush completes it): one put per piece when the pieces can be
 *  put in place, else gathered through the bounce ring, one put per ring slot
 *  (8 MiB). If maybe_checksum is set, the FNV-1a 64 of the bytes continues
 *  from it (device sources are read back through the ring for it).
 *  Errors: TW_ERR_INVALID_ARGUMENT (a piece outside `src`, the range outside
 *  `dst`), TW_ERR_UNSUPPORTED (a device pool without a cuda_ipc lane to it),
 *  TW_ERR_UNAVAILABLE (the endpoint failed, or the receiver's process on
 *  this host is gone), TW_ERR_TRANSPORT (ucp_put_nbx; the endpoint is then
 *  closed),
 *  TW_ERR_CUDA, TW_ERR_NO_MEMORY (the ring), TW_ERR_DEADLINE (a ring slot's
 *  put did not complete in 10 s). */
TW_NODISCARD tw_status_t tw_kv_xfer_put(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer,
                                        const tw_kv_layout_t *src, const tw_kv_remote_layout_t *dst,
                                        const tw_kv_seg_t *segs, int32_t n_segs, uint64_t raddr,
                                        uint64_t *maybe_checksum);

/** Length of the run of blocks starting at index i (< n) that are consecutive
 *  in both id lists: src_ids[i + j] == src_ids[i] + j and the same for
 *  dst_ids, j < result. At least 1. */
int32_t tw_kv_run_length(const int32_t *src_ids, const int32_t *dst_ids, int32_t i, int32_t n);

/** FNV-1a 64 over bytes, continuing from `h` (start with TW_KV_FNV_INIT). */
#define TW_KV_FNV_INIT 0xcbf29ce484222325ull
uint64_t tw_kv_fnv1a(uint64_t h, const void *data, size_t len);

/** Checksum of blocks ids[first..n) of `layer` in a local pool, computed the
 *  same way as tw_kv_xfer_send_layer (host pools, or device pools through a
 *  copy; ids a block table, read as the ring maps it on a ring layer). Errors: TW_ERR_INVALID_ARGUMENT, TW_ERR_CUDA, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_layer_checksum(const tw_kv_layout_t *pool, int32_t layer,
                                              const int32_t *ids, int32_t first, int32_t n,
                                              uint64_t *checksum_p);

#ifdef __cplusplus
}
#endif
#endif
