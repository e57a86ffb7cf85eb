/* kv_reshard.c: head-sliced KV puts and per-head checksums (kv_reshard.h).
 * The puts go through tw_kv_xfer_put, so the UCX handling (endpoints, rkeys,
 * paths, the bounce ring, stats) stays in kv_transfer.c. */
#include "common/kv/kv_reshard.h"

#include "common/base/log.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_ring.h"

#include <stdlib.h>

/* Blocks per gathered put when the remote run is contiguous (2 pieces each). */
#define TW_RESHARD_GATHER_BLOCKS 64

static TW_NODISCARD tw_status_t
tw_kv_reshard_runs(tw_kv_xfer_t *x, tw_kv_peer_t *peer, const tw_kv_layout_t *src,
                   const tw_kv_remote_layout_t *dst, const int32_t *src_ids, const int32_t *dst_ids,
                   int32_t first, int32_t n, int32_t src_nb, int32_t dst_nb, const char *lbase,
                   uint64_t rbase, int64_t run, int64_t src_half, int64_t dst_half, bool dst_whole,
                   bool src_whole, tw_kv_seg_t *segs, int64_t *bytes_p);

TW_NODISCARD tw_status_t tw_kv_reshard_send_layer(tw_kv_xfer_t *x, tw_kv_peer_t *peer,
                                                  const tw_kv_layout_t *src,
                                                  const tw_kv_remote_layout_t *dst,
                                                  int32_t dst_head_offset, int32_t layer,
                                                  const int32_t *src_ids, const int32_t *dst_ids,
                                                  int32_t first, int32_t n, int64_t *bytes_p) {
  if (src->dtype != dst->dtype) return tw_kv_dtype_mismatch(src->dtype, dst->dtype);
  if (src->block_size != dst->block_size || src->head_dim != dst->head_dim ||
      src->n_layers != dst->n_layers)
    return tw_err(TW_ERR_UNSUPPORTED,
                  "kv re-sharding: pools differ beyond their heads (dtype %d/%d, block size %d/%d, "
                  "head_dim %d/%d, layers %d/%d)",
                  (int)src->dtype, (int)dst->dtype, src->block_size, dst->block_size,
                  src->head_dim, dst->head_dim, src->n_layers, dst->n_layers);
  if (layer < 0 || layer >= src->n_layers)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv re-sharding: layer %d of %d", layer, src->n_layers);
  int32_t a, b;
  tw_kv_heads_overlap(src->kv_head_offset, src->n_kv_heads_local, dst_head_offset, dst->n_kv_heads,
                      &a, &b);
  if (b <= a) return TW_OK;
  int64_t head_bytes = src->block_bytes / (2ll * src->n_kv_heads_local); /* slots x head_dim */
  int64_t run = (int64_t)(b - a) * head_bytes;
  int64_t dst_half = (int64_t)dst->n_kv_heads * head_bytes; /* K part of a remote block */
  int64_t src_half = (int64_t)src->n_kv_heads_local * head_bytes;
  /* the remote block is exactly [K run | V run] when the overlap is all of
   * its heads: then consecutive remote blocks are one contiguous range */
  bool dst_whole = b - a == dst->n_kv_heads, src_whole = b - a == src->n_kv_heads_local;
  /* the window ring (kv_ring.h): the tables as each pool stores the layer */
  int32_t src_ring = tw_kv_layer_ring(src->ring_layers, src->ring_blocks, layer);
  int32_t dst_ring = tw_kv_layer_ring(dst->ring_layers, dst->ring_blocks, layer);
  int32_t src_nb = src_ring ? src->n_ring_blocks : src->n_blocks;
  int32_t dst_nb = dst_ring ? dst->n_ring_blocks : dst->n_blocks;
  const char *lbase = (const char *)src->base + tw_kv_layer_offset(src, layer) +
                      (int64_t)(a - src->kv_head_offset) * head_bytes;
  uint64_t rbase =
      dst->remote_base +
      (uint64_t)tw_kv_layer_offset_of(layer, dst->block_bytes, dst->n_blocks, dst->n_ring_blocks,
                                      dst->ring_blocks, dst->ring_layers) +
      (uint64_t)((a - dst_head_offset) * head_bytes);
  tw_kv_seg_t segs[2 * TW_RESHARD_GATHER_BLOCKS];
  int32_t *buf = NULL;
  TW_CHECK(
      tw_kv_ring_ids(src_ring, dst_ring, src_ids, dst_ids, &first, n, &src_ids, &dst_ids, &buf));
  tw_status_t st =
      tw_kv_reshard_runs(x, peer, src, dst, src_ids, dst_ids, first, n, src_nb, dst_nb, lbase,
                         rbase, run, src_half, dst_half, dst_whole, src_whole, segs, bytes_p);
  free(buf);
  return st;
}

/* The puts of tw_kv_reshard_send_layer over table entries [first, n) (ids as
 * the pools store them). */
static TW_NODISCARD tw_status_t
tw_kv_reshard_runs(tw_kv_xfer_t *x, tw_kv_peer_t *peer, const tw_kv_layout_t *src,
                   const tw_kv_remote_layout_t *dst, const int32_t *src_ids, const int32_t *dst_ids,
                   int32_t first, int32_t n, int32_t src_nb, int32_t dst_nb, const char *lbase,
                   uint64_t rbase, int64_t run, int64_t src_half, int64_t dst_half, bool dst_whole,
                   bool src_whole, tw_kv_seg_t *segs, int64_t *bytes_p) {
  for (int32_t i = first; i < n;) {
    int32_t k = tw_kv_run_length(src_ids, dst_ids, i, n);
    if (src_ids[i] < 0 || src_ids[i] + k > src_nb || dst_ids[i] < 0 || dst_ids[i] + k > dst_nb)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "kv re-sharding: blocks %d..%d -> %d..%d outside the pools (%d, %d blocks)",
                    src_ids[i], src_ids[i] + k - 1, dst_ids[i], dst_ids[i] + k - 1, src_nb, dst_nb);
    if (dst_whole && src_whole) { /* the same heads: whole blocks, one put per run */
      tw_kv_seg_t seg = {lbase + (int64_t)src_ids[i] * src->block_bytes, (int64_t)k * src->block_bytes};
      TW_CHECK(tw_kv_xfer_put(x, peer, src, dst, &seg, 1,
                              rbase + (uint64_t)dst_ids[i] * (uint64_t)dst->block_bytes, NULL));
      *bytes_p += seg.bytes;
    } else if (dst_whole) { /* remote contiguous, local K and V runs apart: gather */
      for (int32_t j0 = 0; j0 < k; j0 += TW_RESHARD_GATHER_BLOCKS) {
        int32_t m = k - j0 < TW_RESHARD_GATHER_BLOCKS ? k - j0 : TW_RESHARD_GATHER_BLOCKS;
        for (int32_t j = 0; j < m; j++)
          for (int kv = 0; kv < 2; kv++)
            segs[2 * j + kv] = (tw_kv_seg_t){
                lbase + (int64_t)(src_ids[i] + j0 + j) * src->block_bytes + kv * src_half, run};
        TW_CHECK(tw_kv_xfer_put(x, peer, src, dst, segs, 2 * m,
                                rbase + (uint64_t)(dst_ids[i] + j0) * (uint64_t)dst->block_bytes,
                                NULL));
        *bytes_p += 2 * m * run;
      }
    } else { /* the remote K and V runs lie apart: one put each */
      for (int32_t j = 0; j < k; j++)
        for (int kv = 0; kv < 2; kv++) {
          tw_kv_seg_t seg = {lbase + (int64_t)(src_ids[i] + j) * src->block_bytes + kv * src_half,
                             run};
          TW_CHECK(tw_kv_xfer_put(x, peer, src, dst, &seg, 1,
                                  rbase + (uint64_t)(dst_ids[i] + j) * (uint64_t)dst->block_bytes +
                                      (uint64_t)(kv * dst_half),
                                  NULL));
          *bytes_p += run;
        }
    }
    i += k;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_head_checksums(const tw_kv_layout_t *pool, int32_t layer,
                                              const int32_t *ids, int32_t first, int32_t n,
                                              uint64_t *sums_out) {
  if (pool->on_device)
    return tw_err(TW_ERR_UNSUPPORTED, "kv head checksums: device pools are not read here");
  if (layer < 0 || layer >= pool->n_layers)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv head checksums: layer %d of %d", layer,
                  pool->n_layers);
  int32_t nh = pool->n_kv_heads_local;
  int64_t head_bytes = pool->block_bytes / (2ll * nh);
  int32_t ring = tw_kv_layer_ring(pool->ring_layers, pool->ring_blocks, layer); /* kv_ring.h */
  int32_t nb = tw_kv_layer_blocks(pool, layer);
  first = tw_kv_ring_first(first, n, ring);
  for (int32_t g = 0; g < nh; g++) {
    uint64_t h = TW_KV_FNV_INIT;
    for (int32_t i = first; i < n; i++) {
      int32_t id = ids[tw_kv_ring_entry(i, ring)];
      if (id < 0 || id >= nb)
        return tw_err(TW_ERR_INVALID_ARGUMENT, "kv head checksums: block %d outside the pool of %d",
                      id, nb);
      const char *blk = (const char *)pool->base + tw_kv_layer_offset(pool, layer) +
                        (int64_t)id * pool->block_bytes;
      h = tw_kv_fnv1a(h, blk + (int64_t)g * head_bytes, (size_t)head_bytes);
      h = tw_kv_fnv1a(h, blk + (int64_t)(nh + g) * head_bytes, (size_t)head_bytes);
    }
    sums_out[g] = h;
  }
  return TW_OK;
}
