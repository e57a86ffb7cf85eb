/* kv_ring.h: the window ring of the sliding layers' KV cache (engine.h, the
 * top of the file; issue 17). A sliding layer (spec §2.6, window W) only
 * ever reads the last W positions of a sequence, so it keeps only the blocks
 * the window can still reach: a ring of R = ceil(W / block_size) + 1 blocks,
 * the blocks of the sequence's first R block table entries. Position p of a
 * ring layer lives in block table[(p / block_size) % R], slot p % block_size:
 * the R x block_size >= W + block_size slots always hold positions p - W + 1
 * .. p once p is written, so a decode step writes its position and reads its
 * window in place.
 *
 * A prefill chunk longer than R x block_size - W would overwrite keys its own
 * queries still read, so a prefill pass runs each ring layer through a
 * scratch of full-length blocks (tw_kv_ring_pass_t): per segment, the blocks
 * of positions max(0, start - W + 1) .. start + n - 1 get scratch blocks in
 * position order; the ring blocks holding the positions before `start` are
 * copied in, the chunk's K/V written and attended there through the
 * segment's scratch table, and the last R blocks copied back into the ring.
 * Both backends execute the same plan (cpu: memcpy, cuda: a block-copy
 * kernel), so the cpu backend tests the CUDA one's block arithmetic.
 *
 * Pool layout with the ring: [layer][block][...] as in engine.h, but ring
 * layers hold n_ring_blocks blocks and full layers n_blocks, so layer l starts
 * at block_bytes x (n_blocks x full layers before l + n_ring_blocks x ring
 * layers before l). */
#ifndef TW_COMMON_KV_RING_H
#define TW_COMMON_KV_RING_H

#include "common/base/status.h"
#include "common/engine/engine.h"
#include "common/model/config.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Ring blocks a sequence needs for a window of `window` positions:
 *  ceil(window / block_size) + 1 (window p-(W-1)..p spans at most that many
 *  blocks, plus the one being written); 0 when window or block_size <= 0. */
int32_t tw_kv_ring_len(int32_t window, int32_t block_size);

/** Bit l set for every sliding layer l of the model (spec §2.6); 0 when the
 *  model has more than 64 layers (no ring) or no sliding window. */
uint64_t tw_kv_ring_layer_mask(const tw_model_config_t *c);

/** Whether `layer` keeps its K/V in the ring (ring_blocks > 0 and bit layer
 *  of ring_layers set). */
static inline bool tw_kv_is_ring_layer(uint64_t ring_layers, int32_t ring_blocks, int32_t layer) {
  return ring_blocks > 0 && layer >= 0 && layer < 64 && ((ring_layers >> layer) & 1u);
}

/** The ring length layer `layer` uses: ring_blocks for a ring layer, else 0
 *  (for tw_kv_ring_entry / tw_kv_ring_first). */
static inline int32_t tw_kv_layer_ring(uint64_t ring_layers, int32_t ring_blocks, int32_t layer) {
  return tw_kv_is_ring_layer(ring_layers, ring_blocks, layer) ? ring_blocks : 0;
}

/** The first table entry of a layer's entries [first, n) whose blocks still
 *  hold them: with a ring of ring_blocks (> 0) at least n - ring_blocks, the
 *  earlier entries' positions are overwritten in the ring; first itself
 *  otherwise. Transfers and checks of a prompt's blocks start there. */
static inline int32_t tw_kv_ring_first(int32_t first, int32_t n, int32_t ring_blocks) {
  return ring_blocks > 0 && n - ring_blocks > first ? n - ring_blocks : first;
}

/** The layer holding byte `off` of a pool of this geometry, and the offset
 *  inside it (*in_layer_p); n_layers when off is past the last layer. */
int32_t tw_kv_layer_at(int64_t off, int32_t n_layers, int64_t block_bytes, int32_t n_blocks,
                       int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers,
                       int64_t *in_layer_p);

/** Byte offset of layer `layer` in a pool of this geometry (see the top of
 *  this file); layer * n_blocks * block_bytes without the ring. */
int64_t tw_kv_layer_offset_of(int32_t layer, int64_t block_bytes, int32_t n_blocks,
                              int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers);

/** Bytes of a pool of n_layers layers of this geometry. */
int64_t tw_kv_pool_bytes_of(int32_t n_layers, int64_t block_bytes, int32_t n_blocks,
                            int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers);

/** The same for an engine's layout: where layer `layer` starts (bytes from
 *  base) and how many blocks it holds (n_ring_blocks for a ring layer, else
 *  n_blocks). */
int64_t tw_kv_layer_offset(const tw_kv_layout_t *l, int32_t layer);
int32_t tw_kv_layer_blocks(const tw_kv_layout_t *l, int32_t layer);

/** Block table entry that holds entry j of a ring layer: j % ring_blocks
 *  (j itself when ring_blocks is 0). */
static inline int32_t tw_kv_ring_entry(int32_t j, int32_t ring_blocks) {
  return ring_blocks > 0 ? j % ring_blocks : j;
}

/** A layer's table entries [first, n) as the block ids a source and a
 *  destination pool store them in, for transfers and checks: src_ring /
 *  dst_ring the layer's ring length in each (tw_kv_layer_ring; 0: none).
 *  *first_p is moved to tw_kv_ring_first of both (n when nothing is left);
 *  *s_p / *d_p get the ids to use at indices *first_p..n-1: the tables
 *  themselves without a ring, else copies (entry j's block is table[j % R])
 *  in *buf_p, which the caller frees (NULL when none). dst_ids may be NULL
 *  (then *d_p is NULL). Errors: TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_ring_ids(int32_t src_ring, int32_t dst_ring, const int32_t *src_ids,
                                        const int32_t *dst_ids, int32_t *first_p, int32_t n,
                                        const int32_t **s_p, const int32_t **d_p, int32_t **buf_p);

/** A ring layer's view of a block table: out[j] = table[j % ring_blocks]
 *  for j < n (a table the attention reads as a full-length one). */
void tw_kv_ring_view(const int32_t *table, int32_t n, int32_t ring_blocks, int32_t *out);

/** Scratch blocks a prefill pass of at most max_tokens tokens in max_segs
 *  segments needs (an upper bound of tw_kv_ring_pass_plan's n_scratch):
 *  per segment its tokens' blocks plus the window before them. */
int32_t tw_kv_ring_scratch_blocks(int32_t max_tokens, int32_t max_segs, int32_t block_size,
                                  int32_t window);

/** A prefill pass's ring plan (the top of this file). */
typedef struct {
  int32_t n_segs;
  int32_t stride;    /* entries per row of tables (>= the last block index + 1) */
  int32_t n_scratch; /* scratch blocks used: ids 0..n_scratch-1 */
  int32_t *tables;   /* [n_segs][stride]: segment g's table into the scratch;
                         entries before its window's first block repeat that block */
  int32_t n_in, n_out;
  int32_t *copy_in;              /* [n_in][2]: (ring block id, scratch id), before the K/V write */
  int32_t *copy_out;             /* [n_out][2]: (scratch id, ring block id), after it */
  int32_t cap_tables, cap_pairs; /* allocated entries */
} tw_kv_ring_pass_t;

/** Plan a pass of n_segs segments: segment g holds positions start[g] ..
 *  start[g] + n_tok[g] - 1 of the sequence whose block table is tables[g]
 *  (covering them; its first min(R, blocks) entries are its ring). stride:
 *  the row length to use (0: the longest segment's last block index + 1;
 *  else it must be at least that). Reuses the plan's arrays (zero-initialise
 *  a plan once; tw_kv_ring_pass_free frees it).
 *  Errors: TW_ERR_INVALID_ARGUMENT (n_segs < 1, a negative start, n_tok < 1,
 *  window or block_size or ring_blocks <= 0, stride too short, more scratch
 *  than max_scratch > 0 allows), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_kv_ring_pass_plan(tw_kv_ring_pass_t *p, int32_t n_segs,
                                              const int32_t *start, const int32_t *n_tok,
                                              const int32_t *const *tables, int32_t stride,
                                              int32_t block_size, int32_t window,
                                              int32_t ring_blocks, int32_t max_scratch);
void tw_kv_ring_pass_free(tw_kv_ring_pass_t *p);

/** Whether a backend's `kv_window_ring` setting (engine.h: 1 on, -1 off, 0
 *  default) turns the ring on, given the backend's default. */
static inline bool tw_kv_ring_wanted(int32_t setting, bool backend_default) {
  return setting > 0 || (setting == 0 && backend_default);
}

/** Fill the ring fields of a layout for this model and pool: ring_blocks R,
 *  n_ring_blocks (min(kv_ring_blocks, n_blocks) if kv_ring_blocks > 0, as the
 *  memory plan gives it; else n_blocks: every id may be a ring block, the
 *  layout of the ring without its saving), ring_layers; without `on` (or a
 *  model with no sliding layer) the ring is off: ring_blocks 0,
 *  n_ring_blocks = n_blocks. */
void tw_kv_ring_setup(const tw_model_config_t *c, bool on, int32_t n_blocks, int32_t block_size,
                      int32_t kv_ring_blocks, int32_t *ring_blocks_p, int32_t *n_ring_blocks_p,
                      uint64_t *ring_layers_p);

#ifdef __cplusplus
}
#endif
#endif
