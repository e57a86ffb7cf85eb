/* worker_handoff.h: prompts' prefill and their KV handoff, overlapped layer
 * by layer (prefill worker, single rank). A batch of prompts runs through
 * the engine as one variable-length prefill (tw_engine_prefill_batch: passes
 * of at most max_prefill_chunk tokens, a longer prompt split over passes,
 * earlier positions already in the cache). The engine reports each layer of
 * each prompt's part of a pass as done (on_layer_done); from that callback,
 * every block of that layer the pass completed is put into the decode
 * worker's reserved blocks (non-blocking ucp_put_nbx), so the transfer of
 * layer l runs while layers > l (and the next pass) compute. Whatever a
 * backend did not report is put after the engine returns. Sliding-window
 * layers skip the blocks before their window (spec §2.6). Then each
 * prompt's endpoint is flushed: the caller reports PrefillDone only for a
 * prompt whose status is TW_OK, i.e. once its KV is remotely complete. */
#ifndef TW_PREFILL_WORKER_HANDOFF_H
#define TW_PREFILL_WORKER_HANDOFF_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/kv/kv_transfer.h"
#include "proto/twain_internal.pb-c.h"

#include <stdint.h>

typedef struct {
  tw_engine_t *engine;          /* borrowed */
  const tw_model_t *model;      /* borrowed */
  tw_kv_xfer_t *xfer;           /* borrowed */
  int flush_timeout_ms;
  int64_t max_age_ms; /* refuse to write KV for older requests (proto_engine.h) */
  /* Optional (NULL = none): called on the engine's thread from every
   * per-layer callback of a batch, e.g. to finish the previous batch's
   * handoff (tw_prefill_handoff_finish) while this one computes. It must not
   * call the engine. */
  void (*on_layer)(void *arg);
  void *on_layer_arg;
} tw_prefill_handoff_ctx_t;

typedef struct {
  int32_t first_token;
  int64_t kv_bytes;             /* bytes put */
  double prefill_ms, transfer_ms; /* engine time; put + flush time */
  int64_t layer_sends;          /* tw_kv_xfer_send_layer calls (one layer, some blocks) */
  int64_t layer_sends_in_engine; /* of those, issued from on_layer_done (overlapped) */
  double tail_ms;               /* its last layer's compute reported done -> its flush complete */
  bool kv_in_place;             /* copied into the decode worker's device pool (CUDA IPC) */
} tw_prefill_handoff_result_t;

/** One prompt of a batch: in r, ids, nb, sp, sums; out the rest. */
typedef struct {
  const Twain__Internal__V1__PrefillRequest *r; /* borrowed; has prompt and handoff */
  const int32_t *ids;           /* local blocks covering the prompt */
  int32_t nb;
  tw_sample_params_t sp;
  uint64_t *sums;               /* [n_layers]: FNV-1a 64 of each layer's bytes sent (a device
                                 * pool: only when r->handoff->checksums, as they read the KV
                                 * back to the host; else TW_KV_FNV_INIT) */
  tw_status_t st;               /* this prompt's outcome */
  char msg[256];                /* its error message when st != TW_OK */
  tw_prefill_handoff_result_t out; /* valid when st == TW_OK */
  int32_t seq;                  /* internal: its index in the engine batch */
} tw_prefill_handoff_item_t;

/** Prefill items[0..n) as one batch and hand each prompt's KV to its
 *  r->handoff; each item gets its own status (a failed transfer or a stale
 *  request fails that prompt only; requests to a peer whose flush failed
 *  fail with it): TW_ERR_TRANSPORT / TW_ERR_UNAVAILABLE / TW_ERR_DEADLINE
 *  from tw_kv_xfer_peer, send_layer and flush, TW_ERR_UNSUPPORTED for a
 *  layout mismatch, TW_ERR_DEADLINE for a request older than max_age_ms
 *  (its blocks may belong to someone else now). prefill_ms of every item is the batch's engine time
 *  (less the puts made during it), transfer_ms its own puts and flush.
 *  Returns the engine's status: TW_OK, or the tw_engine_prefill_batch error
 *  that every item then carries too (an INVALID_ARGUMENT / OUT_OF_RANGE
 *  from the argument checks means nothing ran: the caller may run the
 *  prompts one by one to find the bad one), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_prefill_handoff_batch(const tw_prefill_handoff_ctx_t *ctx,
                                                  tw_prefill_handoff_item_t *items, int32_t n);

/** tw_prefill_handoff_batch in two halves, so that a batch's flush can wait
 *  until the next batch computes (batch i's handoff overlapped with batch
 *  i+1's compute). start: the engine run and every put, nothing flushed;
 *  returns what tw_prefill_handoff_batch returns and, in *b_p, the batch to
 *  finish (NULL only on TW_ERR_NO_MEMORY / TW_ERR_INTERNAL, every item then
 *  failed with it). ctx and items must stay valid until finish. finish: the
 *  flushes and every item's status and result, then frees b (NULL: nothing). */
typedef struct tw_prefill_handoff_batch tw_prefill_handoff_batch_t;
TW_NODISCARD tw_status_t tw_prefill_handoff_start(const tw_prefill_handoff_ctx_t *ctx,
                                                  tw_prefill_handoff_item_t *items, int32_t n,
                                                  tw_prefill_handoff_batch_t **b_p);
void tw_prefill_handoff_finish(tw_prefill_handoff_batch_t *b);

#endif
