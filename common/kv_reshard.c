/* kv_reshard.c: head-sliced KV puts and per-head checksums (kv_reshard.h).
 * The puts go through tw_kv_xfer_put, so the UCX handling (endpoints, rkeys,
 * paths, the bounce ring, stats) stays in kv_transfer.c. */
#include "common/kv_reshard.h"

#include "common/log.h"

/* Blocks per gathered put when the remote run is contiguous (2 pieces each). */
#define TW_RESHARD_GATHER_BLOCKS 64

TW_NODISCARD tw_status_t tw_kv_reshard_send_layer(tw_kv_xfer_t *x, tw_kv_peer_t *peer,
                                                  const tw_kv_layout_t *src,
                                                  const tw_kv_remote_layout_t *dst,
                                                  int32_t dst_head_offset, int32_t layer,
                                                  const int32_t *src_ids, const int32_t *dst_ids,
                                                  int32_t first, int32_t n, int64_t *bytes_p) {
  if (src->dtype != dst->dtype || src->block_size != dst->block_size ||
      src->head_dim != dst->head_dim || src->n_layers != dst->n_layers)
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
  const char *lbase = (const char *)src->base + layer * src->layer_stride_bytes +
                      (int64_t)(a - src->kv_head_offset) * head_bytes;
  uint64_t rbase = dst->remote_base + (uint64_t)(layer * dst->layer_stride_bytes) +
                   (uint64_t)((a - dst_head_offset) * head_bytes);
  tw_kv_seg_t segs[2 * TW_RESHARD_GATHER_BLOCKS];
  for (int32_t i = first; i < n;) {
    int32_t k = tw_kv_run_length(src_ids, dst_ids, i, n);
    if (src_ids[i] < 0 || src_ids[i] + k > src->n_blocks || dst_ids[i] < 0 ||
        dst_ids[i] + k > dst->n_blocks)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "kv re-sharding: blocks %d..%d -> %d..%d outside the pools (%d, %d blocks)",
                    src_ids[i], src_ids[i] + k - 1, dst_ids[i], dst_ids[i] + k - 1, src->n_blocks,
                    dst->n_blocks);
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
  for (int32_t g = 0; g < nh; g++) {
    uint64_t h = TW_KV_FNV_INIT;
    for (int32_t i = first; i < n; i++) {
      if (ids[i] < 0 || ids[i] >= pool->n_blocks)
        return tw_err(TW_ERR_INVALID_ARGUMENT, "kv head checksums: block %d outside the pool of %d",
                      ids[i], pool->n_blocks);
      const char *blk =
          (const char *)pool->base + layer * pool->layer_stride_bytes + (int64_t)ids[i] * pool->block_bytes;
      h = tw_kv_fnv1a(h, blk + (int64_t)g * head_bytes, (size_t)head_bytes);
      h = tw_kv_fnv1a(h, blk + (int64_t)(nh + g) * head_bytes, (size_t)head_bytes);
    }
    sums_out[g] = h;
  }
  return TW_OK;
}
