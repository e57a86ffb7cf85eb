/* kv_rxring.h: the receiving side's bounded ring of bounce buffers of the
 * staged KV handoff (issue 16 items 4 and 5).
 *
 * When a decode worker's KV pool is device memory that its UCX cannot reach
 * (no CUDA transports), the pool is not registered at all: a prefill worker
 * asks for a slot for each piece of KV (at most one slot long), naming the
 * destination offset in the pool and the handoff it belongs to. The receiver
 * grants a free slot of this ring (a fixed number of pinned host buffers,
 * TWAIN_KV_STAGING_SLOTS x TWAIN_KV_STAGING_SLOT_MB), the sender puts the
 * piece into it, and the receiver copies the slot to the piece's place in
 * the pool on its own stream and frees the slot once that copy is done. A
 * piece that asks while every slot is in use waits in the receiver's queue
 * (a few dozen bytes, not the piece) until one is freed:
 * back-pressure, never an unbounded buffer. The ring only moves bytes between
 * memory it is told about; the transport (kv_transfer.c) and the copy (a
 * function pointer: cudaMemcpyAsync + an event, or memcpy for a host pool in
 * tests and benchmarks) are the caller's.
 *
 * Completion: the ring counts, per (layer, block) of the pool, the bytes of
 * the current handoff whose copies have finished, tagged with that handoff
 * (a piece of another handoff restarts the count). A sequence's blocks are
 * usable once tw_kv_rxring_landed says every byte of every block it was sent
 * is on the destination, which never needs a blocking wait.
 * Not thread-safe: the owner's thread (its UCX progress) drives it. */
#ifndef TW_COMMON_KV_RXRING_H
#define TW_COMMON_KV_RXRING_H

#include "common/base/status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_kv_rxring tw_kv_rxring_t;

/** The copy of a slot to the pool. `start` begins copying len bytes from the
 *  slot's memory `src` to `dst` (asynchronously where it can); `poll` says
 *  TW_OK once the last copy started from `slot` is done, TW_INPROGRESS while
 *  it runs, an error (with tw_err's message) when it failed. */
typedef struct {
  TW_NODISCARD tw_status_t (*start)(void *ctx, int32_t slot, void *dst, const void *src,
                                    size_t len);
  TW_NODISCARD tw_status_t (*poll)(void *ctx, int32_t slot);
  void *ctx;
} tw_kv_rxring_copy_t;

/** What the ring serves: the destination pool ([layer][block] of block_bytes,
 *  layers layer_stride_bytes apart; with the window ring of engine.h the
 *  ring layers hold n_ring_blocks blocks, kv_ring.h), n_slots buffers of
 *  slot_bytes at slots_mem (owned by the caller), and the copy. */
typedef struct {
  void *pool;
  int32_t n_layers;
  int32_t n_blocks;
  int64_t block_bytes;
  int64_t layer_stride_bytes;
  int64_t total_bytes;
  int32_t ring_blocks, n_ring_blocks; /* 0, 0: no window ring */
  uint64_t ring_layers;
  uint8_t *slots_mem;
  int32_t n_slots;
  int64_t slot_bytes;
  tw_kv_rxring_copy_t copy;
} tw_kv_rxring_params_t;

/** Counters since creation (metrics and benchmarks). */
typedef struct {
  int64_t bytes_landed;  /* copied to the pool */
  int64_t pieces;        /* pieces copied */
  int64_t pieces_failed; /* pieces whose receive or copy failed (their bytes never count) */
  int64_t full_waits;    /* pieces that found every slot in use (back-pressure) */
  int32_t slots_in_use;  /* now */
  int32_t slots_peak;    /* the most at once */
  double busy_seconds;   /* wall time with at least one slot in use */
} tw_kv_rxring_stats_t;

/** Default ring: 16 slots of 8 MiB (128 MiB pinned, against a pinned mirror
 *  as large as the pool before). */
#define TW_KV_RXRING_DEFAULT_SLOTS 16
#define TW_KV_RXRING_DEFAULT_SLOT_MB 8

/** The ring size from the environment: TWAIN_KV_STAGING_SLOTS (2..1024) and
 *  TWAIN_KV_STAGING_SLOT_MB (1..1024), each its default when unset.
 *  Errors: TW_ERR_INVALID_ARGUMENT (a value that is not a number in range). */
TW_NODISCARD tw_status_t tw_kv_rxring_size_from_env(int32_t *n_slots_p, int64_t *slot_bytes_p);

/** Create a ring. Errors: TW_ERR_INVALID_ARGUMENT (no pool or slots, fewer
 *  than 1 slot, a block over 2 GiB, a stride shorter than a layer's blocks),
 *  TW_ERR_NO_MEMORY (the per-block counters: 8 bytes per layer and block). */
TW_NODISCARD tw_status_t tw_kv_rxring_create(const tw_kv_rxring_params_t *p,
                                             tw_kv_rxring_t **ring_p);
/** Free the ring's own memory (not the slots or the pool). The caller waits
 *  for the copies first (tw_kv_rxring_drain). NULL does nothing. */
void tw_kv_rxring_destroy(tw_kv_rxring_t *ring);

/** Take a free slot for a piece of `len` bytes bound for pool offset
 *  `offset`, from handoff `tag`: *slot_p and *buf_p (slot memory to receive
 *  into). TW_INPROGRESS when every slot is in use (nothing taken: retry after
 *  tw_kv_rxring_poll freed one). Errors: TW_ERR_INVALID_ARGUMENT (len <= 0,
 *  longer than a slot, or the range outside the pool). */
TW_NODISCARD tw_status_t tw_kv_rxring_acquire(tw_kv_rxring_t *ring, int64_t offset, int64_t len,
                                              uint32_t tag, int32_t *slot_p, void **buf_p);
/** The piece of `slot` has arrived (ok) or its receive failed (!ok: the slot
 *  is freed, its bytes never count). Starts the copy to the pool.
 *  Errors: TW_ERR_INVALID_ARGUMENT (a slot not taken), those of copy.start
 *  (the slot is then freed and the piece counted as failed). */
TW_NODISCARD tw_status_t tw_kv_rxring_filled(tw_kv_rxring_t *ring, int32_t slot, bool ok);
/** Free the slots whose copies are done and count their bytes; never
 *  blocks. *freed_p (may be NULL): slots freed. Errors: the first failed
 *  copy's (its slot is freed, its piece counted as failed). */
TW_NODISCARD tw_status_t tw_kv_rxring_poll(tw_kv_rxring_t *ring, int32_t *freed_p);
/** Poll until no copy runs (teardown), at most timeout_ms.
 *  Errors: TW_ERR_DEADLINE, those of tw_kv_rxring_poll. */
TW_NODISCARD tw_status_t tw_kv_rxring_drain(tw_kv_rxring_t *ring, int timeout_ms);

/** TW_OK when, for every layer l, blocks ids[firsts[l]..n) (firsts NULL:
 *  from 0) hold every byte of handoff `tag`, copied; TW_INPROGRESS while
 *  some are missing. Never blocks.
 *  Errors: TW_ERR_INVALID_ARGUMENT (a block outside the pool). */
TW_NODISCARD tw_status_t tw_kv_rxring_landed(const tw_kv_rxring_t *ring, uint32_t tag,
                                             const int32_t *ids, int32_t n, const int32_t *firsts);

void tw_kv_rxring_stats(const tw_kv_rxring_t *ring, tw_kv_rxring_stats_t *stats_p);
/** Slots and their size (for logs and senders). */
int32_t tw_kv_rxring_slots(const tw_kv_rxring_t *ring);
int64_t tw_kv_rxring_slot_bytes(const tw_kv_rxring_t *ring);

#ifdef __cplusplus
}
#endif
#endif
