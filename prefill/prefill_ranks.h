/* prefill_ranks.h: a prefill worker made of TP ranks (issue 6).
 * Rank 0 owns the router link and the block manager; for each request it
 * sends the request and its local block ids as a plan to the other ranks
 * (dist_engine.h), then every rank (rank 0 included) runs
 * tw_prefill_rank_run: the engine prefill (the collectives of TP/EP inside),
 * putting its own KV heads into the decode ranks that hold them
 * (kv_reshard.h) layer by layer as the engine reports each layer done
 * (on_layer_done: layer l moves while layers > l compute), then flushes and
 * computes the per-head checksums. The other
 * ranks answer rank 0 with status, bytes and checksums; rank 0 merges them
 * into the PrefillDone. This path also serves a single-rank prefill worker
 * whose decode worker is TP > 1 (KvHandoff.ranks). */
#ifndef TW_PREFILL_PREFILL_RANKS_H
#define TW_PREFILL_PREFILL_RANKS_H

#include "common/comm/dist.h"
#include "common/engine/engine.h"
#include "common/kv/kv_transfer.h"
#include "common/model/model.h"
#include "proto/twain_internal.pb-c.h"

#include <stdint.h>

typedef struct {
  tw_dist_t *dist;          /* borrowed; may be a group of one */
  tw_engine_t *engine;      /* borrowed */
  tw_kv_xfer_t *xfer;       /* borrowed */
  const tw_model_t *model;  /* borrowed */
  int flush_timeout_ms;
  int max_age_ms;           /* refuse to write kv of older requests (0: no check) */
  /* out, of this rank's last handoff: ms from the last layer's compute
   * reported done to every put remotely complete (the handoff's tail) */
  double tail_ms;
  /* out, of this rank's last handoff: put batches of one layer's finished
   * blocks (to every decode rank that holds some of this rank's heads), and
   * of those the ones issued from the engine's on_layer_done */
  int64_t layer_sends, layer_sends_in_engine;
} tw_prefill_ranks_t;

/** Whether request r needs this path: more than one rank here, or a decode
 *  worker of more than one rank. */
int tw_prefill_ranks_wanted(const tw_prefill_ranks_t *rk, const Twain__Internal__V1__PrefillRequest *r);

/** Rank 0: run r over all ranks into local blocks ids[nb]; *first_p the first
 *  token, *bytes_p the kv bytes all ranks put, head_sums [L * NKV] (global
 *  heads) the per-head checksums (kv_reshard.h), *prefill_ms_p / *xfer_ms_p
 *  rank 0's times. Errors: those of the engine and the transfer on any rank
 *  (the message names the rank), TW_ERR_DEADLINE (a rank did not answer). */
TW_NODISCARD tw_status_t tw_prefill_ranks_run(tw_prefill_ranks_t *rk,
                                              const Twain__Internal__V1__PrefillRequest *r,
                                              const int32_t *ids, int32_t nb, int32_t *first_p,
                                              int64_t *bytes_p, uint64_t *head_sums,
                                              double *prefill_ms_p, double *xfer_ms_p);

/** The other ranks' plan hook (tw_dist_follow): ctx is a tw_prefill_ranks_t. */
TW_NODISCARD tw_status_t tw_prefill_ranks_hook(void *ctx, const void *buf, size_t len);

#endif
