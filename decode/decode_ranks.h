/* decode_ranks.h: a decode worker made of TP/EP ranks (issue 6).
 * Every rank has its own KV pool (its kv heads, engine.h) registered with its
 * own UCX worker. At start the other ranks send rank 0 their UCX address,
 * rkey and pool layout; rank 0 lists all of them in each KvHandoff
 * (KvHandoff.ranks) so every prefill rank can put its heads straight into
 * the decode ranks that hold them. Decode steps reach the other ranks as
 * plans (dist_engine.h); the per-head KV checksums of a handoff are checked
 * by each rank on its own heads (an ADMIT plan). The block manager lives on
 * rank 0 only: block ids mean the same blocks in every rank's pool.
 * With data-parallel attention (--dp N) every rank's pool holds every kv
 * head and its own sequences: rank 0 keeps one block manager per rank
 * (decode_worker.c), a handoff names the one rank chosen
 * (KvHandoff.replica; the router puts that rank's pool in fields 1-3) and
 * only that rank checks what it got. */
#ifndef TW_DECODE_DECODE_RANKS_H
#define TW_DECODE_DECODE_RANKS_H

#include "common/comm/dist.h"
#include "common/engine/engine.h"
#include "common/kv/kv_transfer.h"
#include "common/model/model.h"
#include "proto/twain_internal.pb-c.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
  tw_dist_t *dist;            /* borrowed */
  tw_engine_t *engine;        /* borrowed */
  tw_kv_xfer_t *xfer;         /* borrowed */
  tw_kv_region_t *region;     /* borrowed */
  const tw_model_t *model;    /* borrowed */
  /* rank 0: every rank's pool for the handoff (owned) */
  int32_t n_ranks;
  Twain__Internal__V1__KvRank **ranks;
} tw_decode_ranks_t;

/** Fill rk (borrowed handles) and exchange the pools: the other ranks send
 *  theirs, rank 0 collects them (within 60 s). Errors: TW_ERR_DEADLINE,
 *  TW_ERR_FORMAT, TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_decode_ranks_init(tw_decode_ranks_t *rk, tw_dist_t *dist,
                                              tw_engine_t *engine, tw_kv_xfer_t *xfer,
                                              tw_kv_region_t *region, const tw_model_t *model);
/** Free the pool list rk holds (the borrowed handles stay); rk can be
 *  initialised again. Safe on a zeroed rk. */
void tw_decode_ranks_fini(tw_decode_ranks_t *rk);

/** Rank 0: add every rank's pool to a handoff (nothing for one rank): the
 *  pools a decode worker registers (Register.kv_pools). The handoff borrows
 *  rk's storage. */
void tw_decode_ranks_fill_handoff(tw_decode_ranks_t *rk, Twain__Internal__V1__KvHandoff *h);

/** Rank 0: check the KV of a prompt of n_prompt tokens in blocks ids[nb]
 *  against sums[n_sums] on the ranks that hold it: target -1, every rank on
 *  its own heads (sums per [layer][kv head], L * NKV, re-sharded TP
 *  handoffs); target r >= 0, rank r alone on its whole pool (data-parallel
 *  attention, or a single rank), with per_layer sums [L] (as
 *  tw_kv_xfer_send_layer computes them) or per-head sums. Rank 0's own pool
 *  needs no plan. *ok_layers_p / *bad_layers_p count the layers that
 *  matched or not. Returns false with msg set on a mismatch or a failed rank. */
bool tw_decode_ranks_verify(tw_decode_ranks_t *rk, int32_t target, bool per_layer, int32_t n_prompt,
                            const int32_t *ids, int32_t nb, const uint64_t *sums, size_t n_sums,
                            int *ok_layers_p, int *bad_layers_p, char *msg, size_t msg_len);

/** Rank 0 of a TP decode worker whose pools are staged (UCX without CUDA
 *  memory support): wait until every other rank has every byte of handoff
 *  `tag` (the request id) for blocks ids[nb] of a prompt of n_prompt tokens
 *  in its device pool (tw_kv_region_commit there; the prefill worker has
 *  flushed, so only copies out of their bounce rings remain); rank 0 polls
 *  its own pool itself. A group of one: nothing.
 *  Errors: TW_ERR_CUDA (a rank's pieces did not land or a copy failed, or a
 *  rank did not answer; the message names it). */
TW_NODISCARD tw_status_t tw_decode_ranks_commit(tw_decode_ranks_t *rk, uint64_t tag,
                                                int32_t n_prompt, const int32_t *ids, int32_t nb);

/** The other ranks: follow rank 0's plans until it says stop, progressing
 *  UCX between them (received puts may need the target's progress). */
TW_NODISCARD tw_status_t tw_decode_ranks_follow(tw_decode_ranks_t *rk);

#endif
