/* worker_handoff.h: a prompt's prefill and its KV handoff, overlapped layer
 * by layer and chunk by chunk (prefill worker, single rank). The prompt is
 * run through the engine in chunks of `chunk_tokens` positions (as the
 * engine's own chunked prefill does: earlier positions are already in the
 * cache). The engine reports each layer of each chunk as done
 * (tw_prefill_args_t.on_layer_done); from that callback, every block of that
 * layer the chunk completed is put into the decode worker's reserved blocks
 * (non-blocking ucp_put_nbx), so the transfer of layer l runs while layers
 * > l (and the next chunk) compute. Whatever a backend did not report is put
 * after the chunk returns. Sliding-window layers
 * skip the blocks before their window (spec §2.6). After the last chunk the
 * endpoint is flushed: the caller reports PrefillDone only after this returns
 * TW_OK, i.e. once the KV is remotely complete. */
#ifndef TW_PREFILL_WORKER_HANDOFF_H
#define TW_PREFILL_WORKER_HANDOFF_H

#include "common/engine.h"
#include "common/kv_transfer.h"
#include "common/status.h"
#include "proto/twain_internal.pb-c.h"

#include <stdint.h>

typedef struct {
  tw_engine_t *engine;          /* borrowed */
  const tw_model_t *model;      /* borrowed */
  tw_kv_xfer_t *xfer;           /* borrowed */
  int32_t chunk_tokens;         /* positions per engine call (> 0) */
  int flush_timeout_ms;
  int64_t max_age_ms;           /* refuse to write KV for older requests */
} tw_prefill_handoff_ctx_t;

typedef struct {
  int32_t first_token;
  int64_t kv_bytes;             /* bytes put */
  double prefill_ms, transfer_ms; /* engine time; put + flush time */
  int64_t layer_sends;          /* tw_kv_xfer_send_layer calls (one layer, some blocks) */
  int64_t layer_sends_in_engine; /* of those, issued from on_layer_done (overlapped) */
} tw_prefill_handoff_result_t;

/** Prefill r->prompt_ids into the local blocks ids[nb] (covering the
 *  prompt) and hand the KV to r->handoff. sums[n_layers] receives the FNV-1a
 *  64 of each layer's bytes sent. On error *out is untouched.
 *  Errors: from tw_engine_prefill (bad token id: TW_ERR_INVALID_ARGUMENT),
 *  tw_kv_xfer_peer/send_layer/flush (TW_ERR_TRANSPORT, TW_ERR_UNAVAILABLE,
 *  TW_ERR_UNSUPPORTED for a layout mismatch), TW_ERR_DEADLINE (the request
 *  is older than max_age_ms: its blocks may belong to someone else now). */
tw_status_t tw_prefill_handoff_run(const tw_prefill_handoff_ctx_t *ctx,
                                   const Twain__Internal__V1__PrefillRequest *r, const int32_t *ids,
                                   int32_t nb, const tw_sample_params_t *sp, uint64_t *sums,
                                   tw_prefill_handoff_result_t *out);

/** Milliseconds since the router handed request r to a prefill worker
 *  (wall clock - issued_unix_ms; 0 when unset). Time in the router's own
 *  queue is not in it: the router stamps a request when it sends it. */
int64_t tw_prefill_age_ms(const Twain__Internal__V1__PrefillRequest *r);

/** Whether the request is older than max_age_ms (> 0; tw_prefill_age_ms):
 *  the KV-write guard of the prefill worker. */
int tw_prefill_handoff_stale(const Twain__Internal__V1__PrefillRequest *r, int64_t max_age_ms);

#endif
