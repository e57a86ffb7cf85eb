/* kv_blocks.h: the paged KV-cache block manager used by prefill and decode.
 * It hands out block ids of an engine's KV pool (engine.h) to sequences. It
 * owns no KV memory, only the free list and per-block reference counts, so
 * the decode worker can reserve blocks for a handoff before any data arrives.
 * Not thread-safe: one owner thread per manager. */
#ifndef TW_COMMON_KV_BLOCKS_H
#define TW_COMMON_KV_BLOCKS_H

#include "common/base/status.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_kv_blocks tw_kv_blocks_t;

/** Create a manager of `n_blocks` blocks of `block_size` tokens.
 *  Errors: TW_ERR_INVALID_ARGUMENT (n_blocks or block_size <= 0), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_blocks_create(int32_t n_blocks, int32_t block_size,
                                             tw_kv_blocks_t **mgr_p);
/** Create a manager for a pool with the window ring (engine.h): ids
 *  0..n_ring-1 are the blocks the sliding layers hold too; tw_kv_blocks_alloc
 *  gives a sequence's first ring_len blocks from those (its ring) and the
 *  rest from the others first. ring_len 0 (no ring) ignores n_ring: that is
 *  tw_kv_blocks_create. Errors: those of tw_kv_blocks_create,
 *  TW_ERR_INVALID_ARGUMENT (n_ring outside [1, n_blocks], ring_len < 0). */
TW_NODISCARD tw_status_t tw_kv_blocks_create_ring(int32_t n_blocks, int32_t block_size,
                                                  int32_t n_ring, int32_t ring_len,
                                                  tw_kv_blocks_t **mgr_p);
void tw_kv_blocks_destroy(tw_kv_blocks_t *mgr);

/** Blocks needed for n_tokens positions: ceil(n_tokens / block_size). */
int32_t tw_kv_blocks_needed(const tw_kv_blocks_t *mgr, int64_t n_tokens);

/** Whether tw_kv_blocks_alloc of n blocks (one sequence's table) would
 *  succeed now: n free, min(n, ring_len) of them ring-capable. */
bool tw_kv_blocks_can_alloc(const tw_kv_blocks_t *mgr, int32_t n);

/** Allocate one sequence's n blocks into ids_out[n] (all or nothing), in
 *  block table order: with a ring, ids_out[0..min(n, ring_len)) are
 *  ring-capable (< n_ring). A table is allocated whole, never extended.
 *  Errors: TW_ERR_EXHAUSTED (tw_kv_blocks_can_alloc is false; nothing
 *  allocated), TW_ERR_INVALID_ARGUMENT (n < 0). */
TW_NODISCARD tw_status_t tw_kv_blocks_alloc(tw_kv_blocks_t *mgr, int32_t n, int32_t *ids_out);

/** Release blocks (reference count down; freed at zero).
 *  Errors: TW_ERR_INVALID_ARGUMENT (an id out of range or already free:
 *  nothing is changed). */
TW_NODISCARD tw_status_t tw_kv_blocks_free(tw_kv_blocks_t *mgr, int32_t n, const int32_t *ids);

int32_t tw_kv_blocks_free_count(const tw_kv_blocks_t *mgr);
/** With the window ring: the ring-capable ids free now (*free_p), all of
 *  them (*total_p) and the ring length (*len_p: a sequence of n blocks
 *  takes min(n, len) of them); false (nothing set) without a ring. */
bool tw_kv_blocks_ring_counts(const tw_kv_blocks_t *mgr, int32_t *free_p, int32_t *total_p,
                              int32_t *len_p);
int32_t tw_kv_blocks_used_count(const tw_kv_blocks_t *mgr);
int32_t tw_kv_blocks_total(const tw_kv_blocks_t *mgr);
int32_t tw_kv_blocks_block_size(const tw_kv_blocks_t *mgr);

#ifdef __cplusplus
}
#endif
#endif
