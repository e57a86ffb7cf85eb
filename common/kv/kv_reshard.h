/* kv_reshard.h: KV handoff between pools that split the KV heads differently
 * (prefill TP p, decode TP d, any of 1, 2, 4, 8; issue 6 item 3).
 *
 * A pool (engine.h) is [layer][block][k|v][kv_head local][slot][head_dim], so
 * within one (layer, block, k|v) the heads a rank holds are one contiguous
 * run. Each prefill rank puts, for every decode rank whose heads overlap its
 * own, the overlapping run straight into that rank's pool with UCX
 * (tw_kv_xfer_put): no rank gathers another's heads. Per-head checksums let each decode rank verify exactly
 * what it received. */
#ifndef TW_COMMON_KV_RESHARD_H
#define TW_COMMON_KV_RESHARD_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/kv/kv_transfer.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Heads [a, b) shared by a source pool holding [s0, s0 + sn) and a
 *  destination holding [d0, d0 + dn); b <= a when they do not overlap. */
static inline void tw_kv_heads_overlap(int32_t s0, int32_t sn, int32_t d0, int32_t dn, int32_t *a,
                                       int32_t *b) {
  *a = s0 > d0 ? s0 : d0;
  *b = s0 + sn < d0 + dn ? s0 + sn : d0 + dn;
}

/** Put blocks src_ids[first..n) of `layer` of the local pool `src` (heads
 *  [src->kv_head_offset, + n_kv_heads_local)) into blocks dst_ids[first..n)
 *  of the remote pool `dst`, which holds heads [dst_head_offset, +
 *  dst->n_kv_heads): only the overlapping heads. Puts per run of blocks
 *  consecutive on both sides (tw_kv_run_length): one when both pools hold
 *  the same heads; one per 64 blocks when the remote pool holds only the
 *  overlap (its blocks are then [K run | V run], contiguous: the local runs
 *  are gathered); else one per (block, k|v), the remote runs lying apart.
 *  Adds the bytes put to *bytes_p. Non-blocking like tw_kv_xfer_send_layer:
 *  tw_kv_xfer_flush(peer) makes them remotely visible.
 *  Errors: TW_ERR_UNSUPPORTED (dtype, block size or head_dim differ),
 *  those of tw_kv_xfer_send_layer. */
TW_NODISCARD tw_status_t tw_kv_reshard_send_layer(tw_kv_xfer_t *xfer, tw_kv_peer_t *peer,
                                                  const tw_kv_layout_t *src,
                                                  const tw_kv_remote_layout_t *dst,
                                                  int32_t dst_head_offset, int32_t layer,
                                                  const int32_t *src_ids, const int32_t *dst_ids,
                                                  int32_t first, int32_t n, int64_t *bytes_p);

/** Per-head checksums of a host pool: for each local head g,
 *  sums_out[g] = FNV-1a 64 over blocks ids[first..n) in order of (the K
 *  slots of g, then the V slots of g) of `layer`. sums_out [n_kv_heads_local].
 *  The same bytes give the same sum whichever pool (and head offset) holds
 *  them. Errors: TW_ERR_INVALID_ARGUMENT (block or layer outside the pool),
 *  TW_ERR_UNSUPPORTED (device pool). */
TW_NODISCARD tw_status_t tw_kv_head_checksums(const tw_kv_layout_t *pool, int32_t layer,
                                              const int32_t *ids, int32_t first, int32_t n,
                                              uint64_t *sums_out);

#ifdef __cplusplus
}
#endif
#endif
