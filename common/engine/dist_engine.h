/* dist_engine.h: the step plan of a multi-rank worker (issue 6 item 1).
 * Rank 0 makes each decode step through tw_dist_engine_decode(_dp): the
 * step's arguments (tokens, positions, block tables, sampling) go to every
 * other rank as a plan over the control link (dist.h), then rank 0 runs the
 * call; the other ranks run tw_dist_follow(), which makes the same call on
 * their engine, so all ranks meet in the same collectives in the same order.
 * Plans of the daemon's own kinds (e.g. "prefill this request and put your
 * KV heads to the decode ranks", prefill/prefill_ranks.c) go through
 * tw_dist_plan_user and reach the other ranks' hook. With a group of one
 * these are plain engine calls. */
#ifndef TW_COMMON_DIST_ENGINE_H
#define TW_COMMON_DIST_ENGINE_H

#include "common/comm/dist.h"
#include "common/engine/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** A daemon-defined plan on a non-zero rank: `buf` (borrowed) is what rank 0
 *  gave tw_dist_plan_user. Returns the status to log; the loop goes on. */
typedef TW_NODISCARD tw_status_t (*tw_dist_hook_fn)(void *ctx, const void *buf, size_t len);

/** Rank 0: plan + tw_engine_decode. Errors as tw_engine_decode, plus
 *  TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_dist_engine_decode(tw_dist_t *dist, tw_engine_t *engine,
                                               const tw_decode_args_t *args);
/** One rank's part of a data-parallel decode step (tw_dist_engine_decode_dp). */
typedef struct {
  tw_decode_args_t args; /* this rank's sequences; n_seqs may be 0; logits_out must be NULL;
                            next_tokens_out [n_seqs] receives their tokens */
  int32_t pad_block;     /* a block of this rank's pool that no sequence uses: with
                            n_seqs 0 the rank runs one padding row (token 0 at position 0)
                            whose K/V land there and whose token is dropped */
} tw_dist_dp_batch_t;

/** Rank 0, data-parallel attention (tw_engine_params_t.dp_attention, every
 *  rank its own sequences and pool): one decode step in which rank r runs
 *  batches[r] (r = 0 .. size-1) on its engine. All ranks call the engine
 *  even when their batch is empty (a padding row, see pad_block), because
 *  the MoE's collectives need every rank; a step with no sequence on any
 *  rank must not be made. Each other rank answers with its tokens, which
 *  land in batches[r].args.next_tokens_out. Plan: u32 kind, i32 size, then
 *  per rank i32 pad_block and the DECODE fields (see dist_engine.c).
 *  Errors: those of tw_engine_decode on any rank (the message names the
 *  rank), TW_ERR_INVALID_ARGUMENT (no sequence at all, logits_out set, more
 *  than 64 ranks), TW_ERR_DEADLINE (a rank did not answer within 120 s),
 *  TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_dist_engine_decode_dp(tw_dist_t *dist, tw_engine_t *engine,
                                                  const tw_dist_dp_batch_t *batches);

/** Rank 0: send a daemon-defined plan (copied) to the other ranks' hook.
 *  Errors: TW_ERR_TRANSPORT, TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_dist_plan_user(tw_dist_t *dist, const void *buf, size_t len);
/** Rank 0: tell the other ranks to return from tw_dist_follow. */
TW_NODISCARD tw_status_t tw_dist_plan_stop(tw_dist_t *dist);

/** Non-zero ranks: run plans until rank 0 says stop (TW_OK) or
 *  *maybe_stop_flag becomes non-zero. Engine errors are logged and the loop
 *  goes on (rank 0 sees the same error from the same call). A plan this
 *  rank cannot read (empty, short, of an unknown kind) ends the loop with
 *  its error: rank 0 would wait for this rank in the step's collectives
 *  forever, so the caller ends the process and rank 0's watchdog takes the
 *  worker down (dist.h).
 *  Errors: TW_ERR_TRANSPORT (the control link failed), TW_ERR_FORMAT (a plan
 *  that does not decode), TW_ERR_NO_MEMORY (no room to read a plan). */
TW_NODISCARD tw_status_t tw_dist_follow(tw_dist_t *dist, tw_engine_t *engine, tw_dist_hook_fn hook,
                                        void *ctx, volatile int *maybe_stop_flag);

/** tw_dist_follow that calls idle(ctx) every 2 ms between plans (e.g. to
 *  progress a UCX worker whose pool receives puts). */
TW_NODISCARD tw_status_t tw_dist_follow_idle(tw_dist_t *dist, tw_engine_t *engine,
                                             tw_dist_hook_fn hook, void (*idle)(void *ctx),
                                             void *ctx, volatile int *maybe_stop_flag);

#ifdef __cplusplus
}
#endif
#endif
