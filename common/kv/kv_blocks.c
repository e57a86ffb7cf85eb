/* kv_blocks.c: the paged KV block manager (kv_blocks.h). A LIFO free list of
 * block ids plus a reference count per block. Allocation is all or nothing;
 * a free call is validated as a whole (range, and that no id is released
 * more times than it is held, counting repeats within the call) before any
 * count changes, so a double free leaves the manager exactly as it was.
 * With the window ring (engine.h) ids 0..n_ring-1 have room in the sliding
 * layers too: they have a stack of their own, a sequence's first ring_len
 * blocks come from it and the others from the rest first. */
#include "common/kv/kv_blocks.h"

#include <stdlib.h>

struct tw_kv_blocks {
  int32_t n_blocks;
  int32_t block_size;
  int32_t n_ring, ring_len; /* ring-capable ids 0..n_ring-1; ring_len 0: no ring */
  int32_t n_free;           /* ring ids free: free_ids[0..n_free), top at n_free-1 */
  int32_t n_free_rest;      /* other ids free: free_ids[n_ring..n_ring + n_free_rest) */
  int32_t *free_ids;        /* [n_blocks]: the ring ids' stack, then the others' */
  int32_t *refcount;  /* [n_blocks] */
  int32_t *pending;   /* [n_blocks] scratch for validating a free call; all zero between calls */
};

TW_NODISCARD tw_status_t tw_kv_blocks_create(int32_t n_blocks, int32_t block_size,
                                             tw_kv_blocks_t **mgr_p) {
  return tw_kv_blocks_create_ring(n_blocks, block_size, n_blocks, 0, mgr_p);
}

TW_NODISCARD tw_status_t tw_kv_blocks_create_ring(int32_t n_blocks, int32_t block_size,
                                                  int32_t n_ring, int32_t ring_len,
                                                  tw_kv_blocks_t **mgr_p) {
  if (n_blocks <= 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: n_blocks %d <= 0", n_blocks);
  if (ring_len == 0) n_ring = n_blocks; /* no ring: every id alike */
  if (ring_len < 0 || n_ring < 1 || n_ring > n_blocks)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv blocks: %d ring blocks of %d (rings of %d): want 1 <= ring blocks <= blocks",
                  n_ring, n_blocks, ring_len);
  if (block_size <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: block_size %d <= 0", block_size);
  tw_kv_blocks_t *m = calloc(1, sizeof(*m));
  if (!m) return tw_err(TW_ERR_NO_MEMORY, "kv blocks: out of memory");
  m->free_ids = malloc(sizeof(int32_t) * (size_t)n_blocks);
  m->refcount = calloc((size_t)n_blocks, sizeof(int32_t));
  m->pending = calloc((size_t)n_blocks, sizeof(int32_t));
  if (!m->free_ids || !m->refcount || !m->pending) {
    tw_kv_blocks_destroy(m);
    return tw_err(TW_ERR_NO_MEMORY, "kv blocks: out of memory for %d blocks", n_blocks);
  }
  m->n_blocks = n_blocks;
  m->block_size = block_size;
  m->n_ring = n_ring;
  m->ring_len = ring_len;
  /* stack tops are the lowest ids, so a fresh manager hands out 0, 1, 2, ... */
  for (int32_t i = 0; i < n_ring; i++) m->free_ids[i] = n_ring - 1 - i;
  for (int32_t i = n_ring; i < n_blocks; i++) m->free_ids[i] = n_blocks - 1 - (i - n_ring);
  m->n_free = n_ring;
  m->n_free_rest = n_blocks - n_ring;
  *mgr_p = m;
  return TW_OK;
}

void tw_kv_blocks_destroy(tw_kv_blocks_t *mgr) {
  if (!mgr) return;
  free(mgr->free_ids);
  free(mgr->refcount);
  free(mgr->pending);
  free(mgr);
}

int32_t tw_kv_blocks_needed(const tw_kv_blocks_t *mgr, int64_t n_tokens) {
  if (n_tokens <= 0) return 0;
  return (int32_t)((n_tokens + mgr->block_size - 1) / mgr->block_size);
}

bool tw_kv_blocks_can_alloc(const tw_kv_blocks_t *mgr, int32_t n) {
  int32_t ring = mgr->ring_len < n ? mgr->ring_len : n;
  return n >= 0 && ring <= mgr->n_free && (int64_t)n <= (int64_t)mgr->n_free + mgr->n_free_rest;
}

TW_NODISCARD tw_status_t tw_kv_blocks_alloc(tw_kv_blocks_t *mgr, int32_t n, int32_t *ids_out) {
  if (n < 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: alloc of %d blocks", n);
  if (!tw_kv_blocks_can_alloc(mgr, n))
    return tw_err_quiet(TW_ERR_EXHAUSTED,
                        "kv blocks: %d requested, %d free of %d (%d of the %d "
                        "ring-capable ones free, %d wanted)",
                        n, tw_kv_blocks_free_count(mgr), mgr->n_blocks, mgr->n_free, mgr->n_ring,
                        mgr->ring_len < n ? mgr->ring_len : n);
  for (int32_t i = 0; i < n; i++) {
    int32_t id = i >= mgr->ring_len && mgr->n_free_rest > 0
                     ? mgr->free_ids[mgr->n_ring + --mgr->n_free_rest]
                     : mgr->free_ids[--mgr->n_free];
    mgr->refcount[id] = 1;
    ids_out[i] = id;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_blocks_free(tw_kv_blocks_t *mgr, int32_t n, const int32_t *ids) {
  if (n < 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: free of %d blocks", n);
  tw_status_t st = TW_OK;
  int32_t checked = 0;
  for (; checked < n; checked++) {
    int32_t id = ids[checked];
    if (id < 0 || id >= mgr->n_blocks) {
      st = tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: free of id %d (entry %d) outside [0, %d)",
                  id, checked, mgr->n_blocks);
      break;
    }
    if (mgr->pending[id] >= mgr->refcount[id]) {
      st = tw_err(TW_ERR_INVALID_ARGUMENT, "kv blocks: double free of block %d (entry %d)", id,
                  checked);
      break;
    }
    mgr->pending[id]++;
  }
  for (int32_t i = 0; i < checked; i++) mgr->pending[ids[i]] = 0;
  if (st != TW_OK) return st;
  for (int32_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (--mgr->refcount[id] == 0) {
      if (id < mgr->n_ring)
        mgr->free_ids[mgr->n_free++] = id;
      else
        mgr->free_ids[mgr->n_ring + mgr->n_free_rest++] = id;
    }
  }
  return TW_OK;
}

int32_t tw_kv_blocks_free_count(const tw_kv_blocks_t *mgr) {
  return mgr->n_free + mgr->n_free_rest;
}
int32_t tw_kv_blocks_used_count(const tw_kv_blocks_t *mgr) {
  return mgr->n_blocks - tw_kv_blocks_free_count(mgr);
}
int32_t tw_kv_blocks_total(const tw_kv_blocks_t *mgr) { return mgr->n_blocks; }
int32_t tw_kv_blocks_block_size(const tw_kv_blocks_t *mgr) { return mgr->block_size; }

bool tw_kv_blocks_ring_counts(const tw_kv_blocks_t *mgr, int32_t *free_p, int32_t *total_p,
                              int32_t *len_p) {
  if (!mgr || mgr->ring_len == 0) return false;
  *free_p = mgr->n_free;
  *total_p = mgr->n_ring;
  *len_p = mgr->ring_len;
  return true;
}
