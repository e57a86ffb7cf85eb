/* handoff_send.h: one prompt's KV handoff from this prefill rank's pool to
 * the decode pools that hold its KV heads, layer by layer as the engine
 * reports layers done. The one send path of the prefill worker: the
 * single-rank batch path (worker_handoff.c) and every rank of a multi-rank
 * worker (prefill_ranks.c) use it, so the transfer of layer l overlaps the
 * compute of the layers after it at any TP.
 *
 * The destinations are KvHandoff.ranks (a decode worker of several ranks),
 * or the one pool of KvHandoff fields 1-3. A destination with exactly this
 * rank's KV heads takes whole blocks, one put per run of blocks consecutive
 * on both sides (tw_kv_xfer_send_layer, with the layer checksums when asked
 * for); one with other heads gets this rank's share of its heads
 * (tw_kv_reshard_send_layer). Sliding-window layers skip the blocks before
 * their window (spec §2.6). */
#ifndef TW_PREFILL_HANDOFF_SEND_H
#define TW_PREFILL_HANDOFF_SEND_H

#include "common/base/status.h"
#include "common/kv/kv_transfer.h"
#include "common/model/config.h"
#include "proto/twain_internal.pb-c.h"

#include <stdbool.h>
#include <stdint.h>

#define TW_HANDOFF_MAX_DST 64

/* A decode pool that holds some of this rank's KV heads. */
typedef struct {
  tw_kv_peer_t *peer; /* cached by the tw_kv_xfer_t */
  tw_kv_remote_layout_t rl;
  int32_t head_offset; /* its first KV head */
  bool same_heads;     /* exactly this rank's heads: whole blocks */
} tw_handoff_dst_t;

typedef struct {
  tw_kv_xfer_t *xfer;                           /* borrowed */
  const Twain__Internal__V1__PrefillRequest *r; /* borrowed; has the handoff */
  const tw_kv_layout_t *src;                    /* this rank's pool */
  const int32_t *ids;                           /* local blocks of the prompt */
  int32_t nb, n, n_layers;
  int64_t max_age_ms; /* tw_proto_kv_write_guard; 0: no check */
  uint64_t *sums;     /* NULL, or [n_layers]: FNV-1a 64 of each layer's bytes put to
                       * a same-heads destination (started at TW_KV_FNV_INIT) */
  bool checksums;     /* sums are computed (else they stay TW_KV_FNV_INIT) */
  tw_handoff_dst_t dst[TW_HANDOFF_MAX_DST];
  int32_t n_dst;
  int32_t sent[TW_MAX_LAYERS];   /* next block to put, per layer */
  int64_t bytes;                 /* bytes put, all destinations */
  int64_t t_put_ns;              /* time in puts and flushes */
  int64_t layer_sends;           /* send calls that put blocks of one layer */
  int64_t layer_sends_in_engine; /* of those, from the engine's on_layer_done */
  int64_t t_last_layer_ns;       /* when the last layer was reported done (0: not yet) */
  tw_status_t st;                /* first error (the engine's callback cannot return one) */
  char msg[256];                 /* its message, naming the decode worker ("" while OK) */
} tw_handoff_send_t;

/** Set s up for request r (r->handoff set) of n_layers layers: its
 *  destinations (a peer each, from the tw_kv_xfer_t's cache) and the first
 *  block each layer puts; sums (NULL or [n_layers]) start at
 *  TW_KV_FNV_INIT and, with checksums, take each layer's checksum (a device
 *  pool's checksums read the KV back to the host: only for a verifier).
 *  s->st is the status returned.
 *  Errors: TW_ERR_INVALID_ARGUMENT (a destination without a layout, UCX
 *  address or rkey), TW_ERR_UNSUPPORTED (no destination holds this rank's
 *  heads; more than TW_HANDOFF_MAX_DST do), those of tw_kv_xfer_peer. */
TW_NODISCARD tw_status_t tw_handoff_send_begin(tw_handoff_send_t *s, tw_kv_xfer_t *xfer,
                                               const Twain__Internal__V1__PrefillRequest *r,
                                               const tw_kv_layout_t *src, const int32_t *ids,
                                               int32_t nb, int32_t n_layers,
                                               const tw_model_config_t *c, int64_t max_age_ms,
                                               uint64_t *sums, bool checksums);

/** Put layer l's blocks that are final once positions < end are computed
 *  (tw_kv_blocks_final) and not yet put, into every destination;
 *  in_engine: called from the engine's on_layer_done (counted as
 *  overlapped). The first error stays in s->st and stops later sends:
 *  TW_ERR_DEADLINE (the request is older than max_age_ms: its blocks may
 *  belong to another request now), those of tw_kv_xfer_send_layer and
 *  tw_kv_reshard_send_layer. */
void tw_handoff_send_layer(tw_handoff_send_t *s, int32_t l, int32_t end, bool in_engine);

/** The engine's on_layer_done for layer l of positions < end: notes when
 *  the last layer was done, then tw_handoff_send_layer(s, l, end, true). */
void tw_handoff_send_on_layer(tw_handoff_send_t *s, int32_t l, int32_t end);

/** After the engine returned: every layer's blocks not yet put (a backend
 *  that reported nothing, or not everything); t_last_layer_ns set to
 *  t_done_ns when no layer was reported. Returns s->st. */
TW_NODISCARD tw_status_t tw_handoff_send_rest(tw_handoff_send_t *s, int64_t t_done_ns);

/** Flush every destination's endpoint (the KV is remotely complete when it
 *  returns TW_OK), timed into t_put_ns. Returns s->st, else the first flush
 *  error (TW_ERR_UNAVAILABLE: the decode worker is gone, TW_ERR_TRANSPORT,
 *  TW_ERR_DEADLINE: those of tw_kv_xfer_flush), also left in s->st.
 *  Whatever fails first, s->msg (and this thread's last error) says so
 *  with the decode worker's name (KvHandoff.decode_worker). */
TW_NODISCARD tw_status_t tw_handoff_send_flush(tw_handoff_send_t *s, int timeout_ms);

/** Connect ahead of traffic to a decode worker's registered pools h
 *  (KvPeers; no block ids) by the path tw_handoff_send_begin takes, through
 *  the same tw_kv_xfer_t cache, so the first handoff reuses the endpoints:
 *  a UCX endpoint and, for a device pool with a CUDA IPC descriptor, its
 *  mapping, to every pool holding some of src's KV heads, each endpoint
 *  greeted (tw_kv_xfer_greet). *n_p: pools connected; *path_p: the path
 *  puts to the first take.
 *  Errors: TW_ERR_NO_MEMORY, those of tw_handoff_send_begin and
 *  tw_kv_xfer_greet (pools before the failing one stay connected). */
TW_NODISCARD tw_status_t tw_handoff_connect(tw_kv_xfer_t *xfer, const tw_kv_layout_t *src,
                                            const Twain__Internal__V1__KvHandoff *h, int32_t *n_p,
                                            tw_kv_path_t *path_p);

/** Whether a and b send to a common peer (a failed flush fails both). */
bool tw_handoff_send_share_peer(const tw_handoff_send_t *a, const tw_handoff_send_t *b);

#endif
