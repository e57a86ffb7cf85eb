/* kv_ring.c: the window ring of the sliding layers' KV cache (kv_ring.h). */
#include "common/kv/kv_ring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int32_t tw_kv_ring_len(int32_t window, int32_t block_size) {
  if (window <= 0 || block_size <= 0) return 0;
  return (window + block_size - 1) / block_size + 1;
}

uint64_t tw_kv_ring_layer_mask(const tw_model_config_t *c) {
  if (c->n_layers > 64 || c->sliding_window <= 0) return 0;
  uint64_t m = 0;
  for (int32_t l = 0; l < c->n_layers; l++)
    if (c->layer_types[l] == TW_LAYER_SLIDING) m |= (uint64_t)1 << l;
  return m;
}

int64_t tw_kv_layer_offset_of(int32_t layer, int64_t block_bytes, int32_t n_blocks,
                              int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers) {
  int64_t blocks = 0;
  for (int32_t l = 0; l < layer; l++)
    blocks += tw_kv_is_ring_layer(ring_layers, ring_blocks, l) ? n_ring_blocks : n_blocks;
  return blocks * block_bytes;
}

int32_t tw_kv_layer_at(int64_t off, int32_t n_layers, int64_t block_bytes, int32_t n_blocks,
                       int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers,
                       int64_t *in_layer_p) {
  int32_t l = 0;
  for (; l < n_layers; l++) {
    int64_t bytes =
        (tw_kv_is_ring_layer(ring_layers, ring_blocks, l) ? n_ring_blocks : n_blocks) * block_bytes;
    if (off < bytes) break;
    off -= bytes;
  }
  *in_layer_p = off;
  return l;
}

int64_t tw_kv_pool_bytes_of(int32_t n_layers, int64_t block_bytes, int32_t n_blocks,
                            int32_t n_ring_blocks, int32_t ring_blocks, uint64_t ring_layers) {
  return tw_kv_layer_offset_of(n_layers, block_bytes, n_blocks, n_ring_blocks, ring_blocks,
                               ring_layers);
}

int64_t tw_kv_layer_offset(const tw_kv_layout_t *l, int32_t layer) {
  return tw_kv_layer_offset_of(layer, l->block_bytes, l->n_blocks, l->n_ring_blocks, l->ring_blocks,
                               l->ring_layers);
}

int32_t tw_kv_layer_blocks(const tw_kv_layout_t *l, int32_t layer) {
  return tw_kv_is_ring_layer(l->ring_layers, l->ring_blocks, layer) ? l->n_ring_blocks
                                                                    : l->n_blocks;
}

TW_NODISCARD tw_status_t tw_kv_ring_ids(int32_t src_ring, int32_t dst_ring, const int32_t *src_ids,
                                        const int32_t *dst_ids, int32_t *first_p, int32_t n,
                                        const int32_t **s_p, const int32_t **d_p, int32_t **buf_p) {
  *s_p = src_ids;
  *d_p = dst_ids;
  *buf_p = NULL;
  if (!src_ring && !dst_ring) return TW_OK;
  int32_t first = tw_kv_ring_first(tw_kv_ring_first(*first_p, n, src_ring), n, dst_ring);
  if (first >= n) {
    *first_p = n;
    return TW_OK;
  }
  int32_t *buf = malloc(sizeof(int32_t) * 2 * (size_t)n);
  if (!buf) return tw_err(TW_ERR_NO_MEMORY, "kv ring: out of memory for %d block ids", n);
  for (int32_t j = first; j < n; j++) {
    buf[j] = src_ids[tw_kv_ring_entry(j, src_ring)];
    buf[n + j] = dst_ids ? dst_ids[tw_kv_ring_entry(j, dst_ring)] : 0;
  }
  *first_p = first;
  *s_p = buf;
  *d_p = dst_ids ? buf + n : NULL;
  *buf_p = buf;
  return TW_OK;
}

void tw_kv_ring_view(const int32_t *table, int32_t n, int32_t ring_blocks, int32_t *out) {
  for (int32_t j = 0; j < n; j++) out[j] = table[tw_kv_ring_entry(j, ring_blocks)];
}

int32_t tw_kv_ring_scratch_blocks(int32_t max_tokens, int32_t max_segs, int32_t block_size,
                                  int32_t window) {
  if (max_tokens < 1 || max_segs < 1 || block_size < 1) return 0;
  int64_t w = window > 0 ? window : 0;
  int64_t n =
      ((int64_t)max_tokens + (int64_t)max_segs * (w + 2 * block_size)) / block_size + max_segs + 1;
  return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

/* grow *a to hold n ints */
static TW_NODISCARD tw_status_t tw_ring_grow(int32_t **a, int32_t *cap, int64_t n) {
  if (n <= *cap) return TW_OK;
  if (n > INT32_MAX) return tw_err(TW_ERR_NO_MEMORY, "kv ring: plan of %lld entries", (long long)n);
  int32_t *p = realloc(*a, sizeof(int32_t) * (size_t)n);
  if (!p)
    return tw_err(TW_ERR_NO_MEMORY, "kv ring: out of memory for a plan of %lld entries",
                  (long long)n);
  *a = p;
  *cap = (int32_t)n;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_ring_pass_plan(tw_kv_ring_pass_t *p, int32_t n_segs,
                                              const int32_t *start, const int32_t *n_tok,
                                              const int32_t *const *tables, int32_t stride,
                                              int32_t block_size, int32_t window,
                                              int32_t ring_blocks, int32_t max_scratch) {
  if (n_segs < 1 || block_size < 1 || window < 1 || ring_blocks < 1)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv ring: plan of %d segments, block size %d, window %d, ring %d blocks", n_segs,
                  block_size, window, ring_blocks);
  int32_t need_stride = 1;
  int64_t n_scratch = 0, n_pairs = 0;
  for (int32_t g = 0; g < n_segs; g++) {
    if (start[g] < 0 || n_tok[g] < 1)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "kv ring: segment %d at position %d with %d tokens", g,
                    start[g], n_tok[g]);
    int64_t last = (int64_t)start[g] + n_tok[g] - 1;
    int64_t lo = start[g] - window + 1 > 0 ? start[g] - window + 1 : 0;
    int32_t jhi = (int32_t)(last / block_size), jlo = (int32_t)(lo / block_size);
    if (jhi + 1 > need_stride) need_stride = jhi + 1;
    n_scratch += jhi - jlo + 1;
    n_pairs += 2 * ring_blocks;
  }
  if (stride == 0) stride = need_stride;
  if (stride < need_stride || (max_scratch > 0 && n_scratch > max_scratch))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv ring: a pass needs tables of %d entries and %lld scratch blocks, over %d and "
                  "%d",
                  need_stride, (long long)n_scratch, stride, max_scratch);
  TW_CHECK(tw_ring_grow(&p->tables, &p->cap_tables, (int64_t)n_segs * stride));
  /* copy_in and copy_out share one allocation: [in pairs][out pairs] */
  TW_CHECK(tw_ring_grow(&p->copy_in, &p->cap_pairs, 2 * n_pairs));
  p->copy_out = p->copy_in + n_pairs; /* n_pairs entries: ring_blocks pairs a segment each */
  p->n_segs = n_segs;
  p->stride = stride;
  p->n_in = p->n_out = 0;
  int32_t base = 0;
  for (int32_t g = 0; g < n_segs; g++) {
    int64_t s0 = start[g], last = s0 + n_tok[g] - 1;
    int64_t lo = s0 - window + 1 > 0 ? s0 - window + 1 : 0;
    int32_t jhi = (int32_t)(last / block_size), jlo = (int32_t)(lo / block_size);
    int32_t *row = p->tables + (int64_t)g * stride;
    for (int32_t j = 0; j < stride; j++)
      row[j] = base + (j < jlo ? 0 : j > jhi ? jhi - jlo : j - jlo);
    /* in: the blocks holding window positions lo .. s0 - 1 (earlier chunks) */
    if (s0 > lo)
      for (int32_t j = jlo; j <= (int32_t)((s0 - 1) / block_size); j++) {
        p->copy_in[2 * p->n_in] = tables[g][j % ring_blocks];
        p->copy_in[2 * p->n_in + 1] = base + j - jlo;
        p->n_in++;
      }
    /* out: the last R blocks (distinct ring entries), all a later step can read */
    for (int32_t j = jhi - ring_blocks + 1 > jlo ? jhi - ring_blocks + 1 : jlo; j <= jhi; j++) {
      p->copy_out[2 * p->n_out] = base + j - jlo;
      p->copy_out[2 * p->n_out + 1] = tables[g][j % ring_blocks];
      p->n_out++;
    }
    base += jhi - jlo + 1;
  }
  p->n_scratch = base;
  return TW_OK;
}

void tw_kv_ring_pass_free(tw_kv_ring_pass_t *p) {
  if (!p) return;
  free(p->tables);
  free(p->copy_in);
  *p = (tw_kv_ring_pass_t){0};
}

void tw_kv_ring_setup(const tw_model_config_t *c, bool on, int32_t n_blocks, int32_t block_size,
                      int32_t kv_ring_blocks, int32_t *ring_blocks_p, int32_t *n_ring_blocks_p,
                      uint64_t *ring_layers_p) {
  uint64_t mask = on ? tw_kv_ring_layer_mask(c) : 0;
  int32_t R = mask ? tw_kv_ring_len(c->sliding_window, block_size) : 0;
  int64_t nr = n_blocks;
  if (R > 0) {
    nr = kv_ring_blocks > 0 && kv_ring_blocks < n_blocks ? kv_ring_blocks : n_blocks;
  }
  *ring_blocks_p = R;
  *n_ring_blocks_p = (int32_t)nr;
  *ring_layers_p = R > 0 ? mask : 0;
}
