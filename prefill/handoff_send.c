/* handoff_send.c: one prompt's layer-by-layer KV handoff to the decode pools
 * that hold its heads (see handoff_send.h). */
#include "prefill/handoff_send.h"

#include "common/comm/msg.h"
#include "common/comm/proto_engine.h"
#include "common/kv/kv_fp8.h"
#include "common/kv/kv_reshard.h"

#include <stdio.h>
#include <stdlib.h>

/* Add the decode pool (layout kl, endpoint addr/rkey) as a destination if it
 * holds some of this rank's heads. */
static TW_NODISCARD tw_status_t tw_handoff_dst_add(tw_handoff_send_t *s, size_t d,
                                                   const Twain__Internal__V1__KvLayout *kl,
                                                   const ProtobufCBinaryData *addr,
                                                   const ProtobufCBinaryData *rkey) {
  /* never hand UCX an empty address; only a staged pool has no rkey */
  if (!kl || !addr->len || (!rkey->len && kl->staging_slot_bytes <= 0))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv handoff destination %zu has no layout, UCX address or rkey", d);
  if ((tw_dtype_t)kl->dtype != s->src->dtype) /* refused before any put (kv_fp8.h) */
    return tw_kv_dtype_mismatch(s->src->dtype, (tw_dtype_t)kl->dtype);
  int32_t a0, a1;
  tw_kv_heads_overlap(s->src->kv_head_offset, s->src->n_kv_heads_local, kl->kv_head_offset,
                      kl->n_kv_heads, &a0, &a1);
  if (a1 <= a0) return TW_OK;
  if (s->n_dst == TW_HANDOFF_MAX_DST)
    return tw_err(TW_ERR_UNSUPPORTED, "kv handoff to more than %d decode ranks",
                  TW_HANDOFF_MAX_DST);
  tw_handoff_dst_t *dd = &s->dst[s->n_dst];
  tw_proto_kv_layout_to_remote(kl, &dd->rl);
  dd->rl.handoff_tag = s->r->request_id; /* names its pieces to a staged receiver */
  dd->head_offset = kl->kv_head_offset;
  dd->same_heads =
      kl->kv_head_offset == s->src->kv_head_offset && kl->n_kv_heads == s->src->n_kv_heads_local;
  TW_CHECK(tw_kv_xfer_peer(s->xfer, addr->data, addr->len, rkey->data, rkey->len, &dd->peer));
  s->n_dst++;
  return TW_OK;
}

/* A transport status as the request's outcome. A decode worker that does
 * not take its staged pieces in time (TW_ERR_DEADLINE from the KV transfer)
 * is that worker's state (stalled, or its ring full), not the request's:
 * UNAVAILABLE, so the router queues the request again without spending one
 * of its attempts (its own deadline bounds the waiting). Only the KV-write
 * guard's DEADLINE_EXCEEDED (tw_proto_kv_write_guard) is the request's. The
 * message, this thread's last error, is kept. */
static tw_status_t tw_handoff_peer_status(tw_status_t st) {
  return st == TW_ERR_DEADLINE ? TW_ERR_UNAVAILABLE : st;
}

/* s->st just failed: its message, with the decode worker it was for, into
 * s->msg and this thread's last error (a later error elsewhere in the
 * batch cannot take its place). */
static void tw_handoff_failed(tw_handoff_send_t *s) {
  if (s->st >= 0 || s->msg[0]) return;
  const Twain__Internal__V1__KvHandoff *h = s->r->handoff;
  const char *dw = h && h->decode_worker && h->decode_worker[0] ? h->decode_worker : "?";
  char why[192];
  snprintf(why, sizeof why, "%s", tw_last_error());
  snprintf(s->msg, sizeof s->msg, "kv handoff to decode worker %s: %s", dw, why);
  s->st = tw_err_quiet(s->st, "%s", s->msg);
}

TW_NODISCARD tw_status_t tw_handoff_send_begin(tw_handoff_send_t *s, tw_kv_xfer_t *xfer,
                                               const Twain__Internal__V1__PrefillRequest *r,
                                               const tw_kv_layout_t *src, const int32_t *ids,
                                               int32_t nb, int32_t n_layers,
                                               const tw_model_config_t *c, int64_t max_age_ms,
                                               uint64_t *sums, bool checksums) {
  *s = (tw_handoff_send_t){.xfer = xfer,
                           .r = r,
                           .src = src,
                           .ids = ids,
                           .nb = nb,
                           .n = (int32_t)r->n_prompt_ids,
                           .n_layers = n_layers,
                           .max_age_ms = max_age_ms,
                           .sums = sums,
                           .checksums = sums && checksums,
                           .st = TW_OK};
  const Twain__Internal__V1__KvHandoff *h = r->handoff;
  if (n_layers > TW_MAX_LAYERS)
    return s->st = tw_err(TW_ERR_INTERNAL, "kv handoff: %d layers, at most %d", n_layers,
                          TW_MAX_LAYERS);
  for (int32_t l = 0; l < n_layers; l++) {
    s->sent[l] = tw_kv_layer_first_block(s->n, src->block_size,
                                         c->layer_types[l] == TW_LAYER_SLIDING, c->sliding_window);
    if (sums) sums[l] = TW_KV_FNV_INIT;
  }
  size_t n_dst = h->n_ranks ? h->n_ranks : 1; /* KvHandoff.ranks, or the one pool of fields 1-3 */
  for (size_t d = 0; d < n_dst && s->st == TW_OK; d++)
    s->st = h->n_ranks ? tw_handoff_dst_add(s, d, h->ranks[d]->layout, &h->ranks[d]->ucx_address,
                                            &h->ranks[d]->rkey)
                       : tw_handoff_dst_add(s, d, h->layout, &h->ucx_address, &h->rkey);
  if (s->st == TW_OK && s->n_dst == 0)
    s->st = tw_err(TW_ERR_UNSUPPORTED, "kv handoff: no decode pool holds kv heads [%d, %d)",
                   src->kv_head_offset, src->kv_head_offset + src->n_kv_heads_local);
  tw_handoff_failed(s);
  return s->st;
}

void tw_handoff_send_layer(tw_handoff_send_t *s, int32_t l, int32_t end, bool in_engine) {
  if (s->st != TW_OK || l < 0 || l >= s->n_layers) return;
  int32_t done = tw_kv_blocks_final(end, s->n, s->nb, s->src->block_size);
  if (done <= s->sent[l]) return;
  int64_t t0 = tw_msg_clock_ns();
  s->st = tw_proto_kv_write_guard(s->r->request_id, s->r->issued_unix_ms, s->max_age_ms);
  const int32_t *rids = s->r->handoff->block_ids;
  for (int32_t d = 0; d < s->n_dst && s->st == TW_OK; d++) {
    tw_handoff_dst_t *dd = &s->dst[d];
    if (dd->same_heads) {
      s->st = tw_kv_xfer_send_layer(s->xfer, dd->peer, s->src, &dd->rl, l, s->ids, rids, s->sent[l],
                                    done, s->checksums ? &s->sums[l] : NULL);
      if (s->st == TW_OK) s->bytes += (int64_t)(done - s->sent[l]) * s->src->block_bytes;
    } else {
      s->st = tw_kv_reshard_send_layer(s->xfer, dd->peer, s->src, &dd->rl, dd->head_offset, l,
                                       s->ids, rids, s->sent[l], done, &s->bytes);
    }
    s->st = tw_handoff_peer_status(s->st);
  }
  if (s->st == TW_OK) {
    s->sent[l] = done;
    s->layer_sends++;
    s->layer_sends_in_engine += in_engine;
  }
  tw_handoff_failed(s);
  s->t_put_ns += tw_msg_clock_ns() - t0;
}

void tw_handoff_send_on_layer(tw_handoff_send_t *s, int32_t l, int32_t end) {
  if (l == s->n_layers - 1) s->t_last_layer_ns = tw_msg_clock_ns();
  tw_handoff_send_layer(s, l, end, true);
}

TW_NODISCARD tw_status_t tw_handoff_send_rest(tw_handoff_send_t *s, int64_t t_done_ns) {
  if (!s->t_last_layer_ns) s->t_last_layer_ns = t_done_ns;
  for (int32_t l = 0; l < s->n_layers; l++) tw_handoff_send_layer(s, l, s->n, false);
  return s->st;
}

TW_NODISCARD tw_status_t tw_handoff_send_flush(tw_handoff_send_t *s, int timeout_ms) {
  int64_t t0 = tw_msg_clock_ns();
  for (int32_t d = 0; d < s->n_dst && s->st == TW_OK; d++)
    s->st = tw_handoff_peer_status(tw_kv_xfer_flush(s->xfer, s->dst[d].peer, timeout_ms));
  tw_handoff_failed(s);
  s->t_put_ns += tw_msg_clock_ns() - t0;
  return s->st;
}

bool tw_handoff_send_share_peer(const tw_handoff_send_t *a, const tw_handoff_send_t *b) {
  for (int32_t i = 0; i < a->n_dst; i++)
    for (int32_t j = 0; j < b->n_dst; j++)
      if (a->dst[i].peer == b->dst[j].peer) return true;
  return false;
}

TW_NODISCARD tw_status_t tw_handoff_connect(tw_kv_xfer_t *xfer, const tw_kv_layout_t *src,
                                            const Twain__Internal__V1__KvHandoff *h, int32_t *n_p,
                                            tw_kv_path_t *path_p) {
  *n_p = 0;
  *path_p = TW_KV_PATH_UNREACHABLE;
  tw_handoff_send_t *s = malloc(sizeof *s);
  if (!s) return tw_err(TW_ERR_NO_MEMORY, "kv connect: out of memory");
  /* a request of no tokens and no layers: begin only makes the destinations */
  Twain__Internal__V1__PrefillRequest r = TWAIN__INTERNAL__V1__PREFILL_REQUEST__INIT;
  r.handoff = (Twain__Internal__V1__KvHandoff *)h;
  tw_status_t st = tw_handoff_send_begin(s, xfer, &r, src, NULL, 0, 0, NULL, 0, NULL, false);
  /* greeted now, while both sides run: the decode worker then holds no UCX
   * wireup message towards this process (tw_kv_xfer_greet) */
  for (int32_t d = 0; d < s->n_dst && st == TW_OK; d++) st = tw_kv_xfer_greet(xfer, s->dst[d].peer);
  *n_p = s->n_dst;
  if (s->n_dst > 0) *path_p = tw_kv_xfer_path_to(s->dst[0].peer, src->on_device, &s->dst[0].rl);
  free(s);
  return st;
}
