/* proto_engine.h: the conversions between the internal protocol
 * (proto/twain_internal.proto, proto/twain_api.proto) and the engine's and
 * the transfer layer's own types, written once for the router, the prefill
 * and the decode daemons: sampling parameters, a decode pool's KV layout,
 * and the age of a request handed to a worker (the prefill worker's KV-write
 * guard). */
#ifndef TW_COMMON_PROTO_ENGINE_H
#define TW_COMMON_PROTO_ENGINE_H

#include "common/base/status.h"
#include "common/engine/sampling.h"
#include "common/kv/kv_transfer.h"
#include "proto/twain_api.pb-c.h"
#include "proto/twain_internal.pb-c.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The engine's sampling parameters of a request's Sampling (NULL: greedy,
 *  TW_SAMPLE_PARAMS_GREEDY). temperature, top_k and seed are taken as they
 *  are; top_p <= 0 (unset on the wire) becomes 1 (no nucleus cut, as
 *  sampling.h reads it). The values were checked by the router
 *  (temperature >= 0, top_p in [0, 1], top_k >= 0). */
tw_sample_params_t tw_proto_sample_params(const Twain__Internal__V1__Sampling *s);

/** The internal Sampling of a client's SamplingParams (NULL: all zero, i.e.
 *  greedy): temperature, top_p, top_k and seed copied; `out` is initialised
 *  first. The stop fields and max_tokens are the router's own business. */
void tw_proto_sampling_from_api(const Twain__V1__SamplingParams *s,
                                Twain__Internal__V1__Sampling *out);

/** The transfer layer's view of a decode pool from its KvLayout on the wire
 *  (every field copied; kv_head_offset is not in tw_kv_remote_layout_t and
 *  stays in `k`). */
void tw_proto_kv_layout_to_remote(const Twain__Internal__V1__KvLayout *k,
                                  tw_kv_remote_layout_t *out);

/** The KvLayout a decode worker publishes for its pool `rl` holding global kv
 *  heads [kv_head_offset, + rl->n_kv_heads); `out` is initialised first. */
void tw_proto_kv_layout_from_remote(const tw_kv_remote_layout_t *rl, int32_t kv_head_offset,
                                    Twain__Internal__V1__KvLayout *out);

/** Wall-clock milliseconds since the Unix epoch (CLOCK_REALTIME): the clock
 *  of PrefillRequest.issued_unix_ms, which the router stamps when it hands
 *  a request to a worker and the worker compares with its own clock (one
 *  host, or hosts kept in step by NTP). */
int64_t tw_proto_unix_ms(void);

/** Milliseconds since issued_unix_ms (tw_proto_unix_ms() - issued_unix_ms);
 *  0 for an unstamped request (issued_unix_ms 0). Time in the router's own
 *  queue is not in it: the router stamps a request when it sends it. */
int64_t tw_proto_age_ms(int64_t issued_unix_ms);

/** The request-staleness rule, the one all workers apply: a request stamped
 *  issued_unix_ms is stale once its age (tw_proto_age_ms) exceeds max_age_ms
 *  (> 0; max_age_ms <= 0 means no limit, an unstamped request is never
 *  stale). *age_ms_p (may be NULL) gets the age. */
bool tw_proto_stale(int64_t issued_unix_ms, int64_t max_age_ms, int64_t *age_ms_p);

/** The prefill worker's KV-write guard on request `request_id` (stamped
 *  issued_unix_ms): TW_OK while it is not stale (tw_proto_stale), else
 *  TW_ERR_DEADLINE with a message naming the request, its age and the limit:
 *  the decode blocks it was given may belong to another request by now, so
 *  none of its KV may be written. */
TW_NODISCARD tw_status_t tw_proto_kv_write_guard(uint64_t request_id, int64_t issued_unix_ms,
                                                 int64_t max_age_ms);

#ifdef __cplusplus
}
#endif
#endif
