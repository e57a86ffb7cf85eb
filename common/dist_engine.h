/* dist_engine.h: the step plan of a multi-rank worker (issue 6 item 1).
 * Rank 0 makes each engine call through tw_dist_engine_prefill/decode: the
 * call's arguments (tokens, positions, block tables, sampling) go to every
 * other rank as a plan over the control link (dist.h), then rank 0 runs the
 * call; the other ranks run tw_dist_follow(), which makes the same call on
 * their engine, so all ranks meet in the same collectives in the same order.
 * Plans of the daemon's own kinds (e.g. "prefill this request and put your
 * KV heads to the decode ranks") go through tw_dist_plan_user and reach the
 * other ranks' hook. With a group of one these are plain engine calls. */
#ifndef TW_COMMON_DIST_ENGINE_H
#define TW_COMMON_DIST_ENGINE_H

#include "common/dist.h"
#include "common/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** A daemon-defined plan on a non-zero rank: `buf` (borrowed) is what rank 0
 *  gave tw_dist_plan_user. Returns the status to log; the loop goes on. */
typedef tw_status_t (*tw_dist_hook_fn)(void *ctx, const void *buf, size_t len);

/** Rank 0: plan + tw_engine_prefill. Errors: those of tw_engine_prefill,
 *  TW_ERR_TRANSPORT (plan not sent), TW_ERR_NO_MEMORY. */
tw_status_t tw_dist_engine_prefill(tw_dist_t *dist, tw_engine_t *engine,
                                   const tw_prefill_args_t *args);
/** Rank 0: plan + tw_engine_decode. Errors as tw_engine_decode, plus
 *  TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
tw_status_t tw_dist_engine_decode(tw_dist_t *dist, tw_engine_t *engine,
                                  const tw_decode_args_t *args);
/** Rank 0: send a daemon-defined plan (copied) to the other ranks' hook.
 *  Errors: TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
tw_status_t tw_dist_plan_user(tw_dist_t *dist, const void *buf, size_t len);
/** Rank 0: tell the other ranks to return from tw_dist_follow. */
tw_status_t tw_dist_plan_stop(tw_dist_t *dist);

/** Non-zero ranks: run plans until rank 0 says stop (TW_OK) or
 *  *maybe_stop_flag becomes non-zero. Engine errors are logged and the loop
 *  goes on (rank 0 sees the same error from the same call).
 *  Errors: TW_ERR_TRANSPORT (the control link failed), TW_ERR_FORMAT (a plan
 *  that does not decode), TW_ERR_NO_MEMORY. */
tw_status_t tw_dist_follow(tw_dist_t *dist, tw_engine_t *engine, tw_dist_hook_fn hook, void *ctx,
                           volatile int *maybe_stop_flag);

/** tw_dist_follow that calls idle(ctx) every 2 ms between plans (e.g. to
 *  progress a UCX worker whose pool receives puts). */
tw_status_t tw_dist_follow_idle(tw_dist_t *dist, tw_engine_t *engine, tw_dist_hook_fn hook,
                                void (*idle)(void *ctx), void *ctx, volatile int *maybe_stop_flag);

#ifdef __cplusplus
}
#endif
#endif
