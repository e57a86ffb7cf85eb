/* decode_ranks.c: pools of every rank in the handoff, per-rank KV checks and
 * the follower loop of a multi-rank decode worker (see decode_ranks.h).
 * Pool message (other rank -> 0 at start): u32 address length, address,
 * u32 rkey length, rkey, tw_kv_remote_layout_t, i32 kv_head_offset.
 * ADMIT plan: i32 target (-1: every rank checks its own heads; r: rank r
 * alone checks its whole pool, data-parallel attention), i32 per_layer (1:
 * sums are per layer, 0: per [layer][kv head]), i32 n_prompt, i32 nb,
 * i32 ids[nb], i32 n_sums, u64 sums[] (a commit, target -2: n_prompt is the
 * prompt's length and sums[0] the handoff's tag, its request id);
 * its reply: i32 ok_layers, i32 bad_layers, then a message (a rank that is
 * not the target answers n_layers, 0). */
#include "decode/decode_ranks.h"

#include "common/base/log.h"
#include "common/comm/proto_engine.h"
#include "common/engine/dist_engine.h"
#include "common/kv/kv_reshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Twain__Internal__V1__KvRank *tw_kv_rank_new(const void *addr, size_t alen, const void *rkey,
                                                   size_t rlen, const tw_kv_remote_layout_t *rl,
                                                   int32_t head_offset) {
  Twain__Internal__V1__KvRank *k = calloc(1, sizeof *k);
  Twain__Internal__V1__KvLayout *l = calloc(1, sizeof *l);
  uint8_t *a = malloc(alen ? alen : 1), *r = malloc(rlen ? rlen : 1);
  if (!k || !l || !a || !r) {
    free(k);
    free(l);
    free(a);
    free(r);
    return NULL;
  }
  twain__internal__v1__kv_rank__init(k);
  tw_proto_kv_layout_from_remote(rl, head_offset, l);
  memcpy(a, addr, alen);
  memcpy(r, rkey, rlen);
  k->ucx_address = (ProtobufCBinaryData){.len = alen, .data = a};
  k->rkey = (ProtobufCBinaryData){.len = rlen, .data = r};
  k->layout = l;
  return k;
}

static void tw_kv_rank_free(Twain__Internal__V1__KvRank *k) {
  if (!k) return;
  free(k->ucx_address.data);
  free(k->rkey.data);
  free(k->layout);
  free(k);
}

TW_NODISCARD tw_status_t tw_decode_ranks_init(tw_decode_ranks_t *rk, tw_dist_t *dist,
                                              tw_engine_t *engine, tw_kv_xfer_t *xfer,
                                              tw_kv_region_t *region, const tw_model_t *model) {
  *rk = (tw_decode_ranks_t){.dist = dist, .engine = engine, .xfer = xfer, .region = region,
                            .model = model};
  int32_t size = tw_dist_size(dist);
  if (size == 1) return TW_OK;
  size_t alen, rlen;
  const void *addr = tw_kv_xfer_address(xfer, &alen);
  const void *rkey = tw_kv_region_rkey(region, &rlen);
  tw_kv_remote_layout_t rl;
  tw_kv_region_remote_layout(region, &rl);
  int32_t off = tw_engine_kv_layout(engine)->kv_head_offset;
  if (tw_dist_rank(dist) != 0) {
    size_t len = 8 + alen + rlen + sizeof rl + sizeof off;
    uint8_t *m = malloc(len), *p = m;
    if (!m) return tw_err(TW_ERR_NO_MEMORY, "decode rank: out of memory");
    uint32_t u = (uint32_t)alen;
    memcpy(p, &u, 4), p += 4;
    memcpy(p, addr, alen), p += alen;
    u = (uint32_t)rlen;
    memcpy(p, &u, 4), p += 4;
    memcpy(p, rkey, rlen), p += rlen;
    memcpy(p, &rl, sizeof rl), p += sizeof rl;
    memcpy(p, &off, sizeof off);
    tw_status_t st = tw_dist_reply(dist, m, len);
    free(m);
    return st;
  }
  rk->ranks = calloc((size_t)size, sizeof *rk->ranks);
  if (!rk->ranks) return tw_err(TW_ERR_NO_MEMORY, "decode rank 0: out of memory");
  rk->n_ranks = size;
  rk->ranks[0] = tw_kv_rank_new(addr, alen, rkey, rlen, &rl, off);
  if (!rk->ranks[0]) return tw_err(TW_ERR_NO_MEMORY, "decode rank 0: out of memory");
  void *bufs[64];
  size_t lens[64];
  TW_CHECK(tw_dist_replies_recv(dist, 60000, bufs, lens));
  tw_status_t st = TW_OK;
  for (int32_t r = 1; r < size; r++) {
    const uint8_t *p = bufs[r], *end = p + lens[r];
    uint32_t al = 0, kl = 0;
    if (end - p >= 4) memcpy(&al, p, 4);
    const uint8_t *a = p + 4, *q = a + al;
    if (q + 4 <= end) memcpy(&kl, q, 4);
    const uint8_t *k = q + 4, *lp = k + kl;
    tw_kv_remote_layout_t rrl;
    int32_t roff;
    if (lp + sizeof rrl + sizeof roff != end) {
      if (st == TW_OK) st = tw_err(TW_ERR_FORMAT, "decode rank %d: malformed pool message", r);
    } else {
      memcpy(&rrl, lp, sizeof rrl);
      memcpy(&roff, lp + sizeof rrl, sizeof roff);
      rk->ranks[r] = tw_kv_rank_new(a, al, k, kl, &rrl, roff);
      if (!rk->ranks[r] && st == TW_OK) st = tw_err(TW_ERR_NO_MEMORY, "decode rank 0: out of memory");
      else
        TW_INFO("decode", "rank %d pool: kv heads [%d,%d), %d blocks", r, roff,
                roff + rrl.n_kv_heads, rrl.n_blocks);
    }
    free(bufs[r]);
  }
  return st;
}

void tw_decode_ranks_fini(tw_decode_ranks_t *rk) {
  for (int32_t r = 0; r < rk->n_ranks; r++) tw_kv_rank_free(rk->ranks[r]);
  free(rk->ranks);
  rk->ranks = NULL;
  rk->n_ranks = 0;
}

void tw_decode_ranks_fill_handoff(tw_decode_ranks_t *rk, Twain__Internal__V1__KvHandoff *h) {
  if (rk->n_ranks <= 1) return;
  h->n_ranks = (size_t)rk->n_ranks;
  h->ranks = rk->ranks;
  if (h->layout) h->layout->kv_head_offset = rk->ranks[0]->layout->kv_head_offset;
}

/* Check this rank's whole pool against per-layer sums (as
 * tw_kv_xfer_send_layer computed them): counts of layers matching / not. */
static void tw_decode_check_layers(tw_decode_ranks_t *rk, int32_t n_prompt, const int32_t *ids,
                                   int32_t nb, const uint64_t *sums, size_t n_sums, int *ok,
                                   int *bad, char *msg, size_t msg_len) {
  const tw_model_config_t *c = &rk->model->config;
  const tw_kv_layout_t *l = tw_engine_kv_layout(rk->engine);
  *ok = *bad = 0;
  if (n_sums != (size_t)c->n_layers) {
    snprintf(msg, msg_len, "handoff carries %zu layer checksums, model has %d layers", n_sums,
             c->n_layers);
    *bad = c->n_layers;
    return;
  }
  for (int32_t layer = 0; layer < c->n_layers; layer++) {
    int32_t first = tw_kv_layer_first_block(n_prompt, l->block_size,
                                            c->layer_types[layer] == TW_LAYER_SLIDING,
                                            c->sliding_window);
    uint64_t h = 0;
    if (tw_kv_layer_checksum(l, layer, ids, first, nb, &h) == TW_OK && h == sums[layer]) {
      (*ok)++;
      continue;
    }
    if (!*bad)
      snprintf(msg, msg_len, "kv checksum mismatch in layer %d: received %016llx, sent %016llx",
               layer, (unsigned long long)h, (unsigned long long)sums[layer]);
    (*bad)++;
  }
}

/* Check this rank's heads: counts of layers fully matching / not. */
static void tw_decode_check_own(tw_decode_ranks_t *rk, int32_t n_prompt, const int32_t *ids,
                                int32_t nb, const uint64_t *sums, size_t n_sums, int *ok, int *bad,
                                char *msg, size_t msg_len) {
  const tw_model_config_t *c = &rk->model->config;
  const tw_kv_layout_t *l = tw_engine_kv_layout(rk->engine);
  *ok = *bad = 0;
  if (n_sums != (size_t)c->n_layers * (size_t)c->n_kv_heads || l->n_kv_heads_local > 64) {
    snprintf(msg, msg_len, "handoff carries %zu head checksums, model has %d x %d", n_sums,
             c->n_layers, c->n_kv_heads);
    *bad = c->n_layers;
    return;
  }
  for (int32_t layer = 0; layer < c->n_layers; layer++) {
    int32_t first = tw_kv_layer_first_block(n_prompt, l->block_size,
                                            c->layer_types[layer] == TW_LAYER_SLIDING,
                                            c->sliding_window);
    uint64_t got[64];
    bool same = tw_kv_head_checksums(l, layer, ids, first, nb, got) == TW_OK;
    for (int32_t g = 0; same && g < l->n_kv_heads_local; g++) {
      uint64_t want = sums[(size_t)layer * (size_t)c->n_kv_heads + (size_t)(l->kv_head_offset + g)];
      if (got[g] != want) {
        snprintf(msg, msg_len, "kv checksum mismatch in layer %d kv head %d: received %016llx, sent %016llx",
                 layer, l->kv_head_offset + g, (unsigned long long)got[g], (unsigned long long)want);
        same = false;
      }
    }
    if (same) (*ok)++;
    else (*bad)++;
  }
}

/* The admit plan's target for "copy your staged blocks to the device". */
#define TW_DECODE_TARGET_COMMIT (-2)
/* How long another rank waits for a handoff's pieces to land (its prefill
 * worker has flushed: only the copies out of the ring remain). */
#define TW_DECODE_COMMIT_MS 30000

/* This rank's part of a check: the target alone (or every rank for -1); or
 * of a commit (TW_DECODE_TARGET_COMMIT: the other ranks wait until every
 * byte of handoff sums[0] is in their staged pools; rank 0 polls its own). */
static void tw_decode_check(tw_decode_ranks_t *rk, int32_t target, bool per_layer,
                            int32_t n_prompt, const int32_t *ids, int32_t nb, const uint64_t *sums,
                            size_t n_sums, int *ok, int *bad, char *msg, size_t msg_len) {
  if (target == TW_DECODE_TARGET_COMMIT) {
    *ok = rk->model->config.n_layers;
    *bad = 0;
    int32_t firsts[TW_MAX_LAYERS];
    tw_kv_layer_firsts(&rk->model->config, n_prompt, tw_engine_kv_layout(rk->engine)->block_size,
                       firsts);
    if (tw_dist_rank(rk->dist) != 0 &&
        (n_sums != 1 ||
         tw_kv_region_commit(rk->region, sums[0], ids, nb, firsts, TW_DECODE_COMMIT_MS) != TW_OK)) {
      snprintf(msg, msg_len, "%s", tw_last_error());
      *ok = 0;
      *bad = rk->model->config.n_layers;
    }
  } else if (target >= 0 && target != tw_dist_rank(rk->dist)) {
    *ok = rk->model->config.n_layers; /* neutral for the min / max below */
    *bad = 0;
  } else if (per_layer) {
    tw_decode_check_layers(rk, n_prompt, ids, nb, sums, n_sums, ok, bad, msg, msg_len);
  } else {
    tw_decode_check_own(rk, n_prompt, ids, nb, sums, n_sums, ok, bad, msg, msg_len);
  }
}

bool tw_decode_ranks_verify(tw_decode_ranks_t *rk, int32_t target, bool per_layer, int32_t n_prompt,
                            const int32_t *ids, int32_t nb, const uint64_t *sums, size_t n_sums,
                            int *ok_layers_p, int *bad_layers_p, char *msg, size_t msg_len) {
  int32_t size = tw_dist_size(rk->dist);
  bool others = size > 1 && target != 0; /* rank 0's own pool needs no plan */
  if (others) {
    size_t len = 6 * sizeof(int32_t) + sizeof(int32_t) * (size_t)nb + 8 * n_sums;
    uint8_t *m = malloc(len), *p = m;
    if (!m) {
      snprintf(msg, msg_len, "decode rank 0: out of memory");
      return false;
    }
    int32_t hdr[4] = {target, per_layer, n_prompt, nb}, ns = (int32_t)n_sums;
    memcpy(p, hdr, sizeof hdr), p += sizeof hdr;
    memcpy(p, ids, sizeof(int32_t) * (size_t)nb), p += sizeof(int32_t) * (size_t)nb;
    memcpy(p, &ns, sizeof ns), p += sizeof ns;
    memcpy(p, sums, 8 * n_sums), p += 8 * n_sums;
    tw_status_t st = tw_dist_plan_user(rk->dist, m, (size_t)(p - m));
    free(m);
    if (st != TW_OK) {
      snprintf(msg, msg_len, "%s", tw_last_error());
      return false;
    }
  }
  int ok = 0, bad = 0;
  tw_decode_check(rk, target, per_layer, n_prompt, ids, nb, sums, n_sums, &ok, &bad, msg, msg_len);
  int all_ok = ok, any_bad = bad; /* a layer is ok when every rank's heads of it matched */
  if (others) {
    void *bufs[64];
    size_t lens[64];
    if (tw_dist_replies_recv(rk->dist, 60000, bufs, lens) != TW_OK) {
      snprintf(msg, msg_len, "%s", tw_last_error());
      return false;
    }
    for (int32_t r = 1; r < size; r++) {
      int32_t rr[2] = {0, rk->model->config.n_layers};
      if (lens[r] >= sizeof rr) memcpy(rr, bufs[r], sizeof rr);
      if (rr[0] < all_ok) all_ok = rr[0];
      if (rr[1] > any_bad) any_bad = rr[1];
      if (rr[1] && !msg[0])
        snprintf(msg, msg_len, "rank %d: %.*s", r, (int)(lens[r] - sizeof rr),
                 (const char *)bufs[r] + sizeof rr);
      free(bufs[r]);
    }
  }
  *ok_layers_p = all_ok;
  *bad_layers_p = any_bad;
  return any_bad == 0;
}

TW_NODISCARD tw_status_t tw_decode_ranks_commit(tw_decode_ranks_t *rk, uint64_t tag,
                                                int32_t n_prompt, const int32_t *ids, int32_t nb) {
  if (tw_dist_size(rk->dist) == 1) return TW_OK;
  int ok = 0, bad = 0;
  char msg[256] = "";
  if (!tw_decode_ranks_verify(rk, TW_DECODE_TARGET_COMMIT, false, n_prompt, ids, nb, &tag, 1, &ok,
                              &bad, msg, sizeof msg))
    return tw_err(TW_ERR_CUDA, "kv commit on the decode ranks: %s", msg);
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_decode_ranks_hook(void *ctx, const void *buf, size_t len) {
  tw_decode_ranks_t *rk = ctx;
  const uint8_t *p = buf, *end = p + len;
  int32_t hdr[4] = {0, 0, 0, -1}, ns = -1; /* target, per_layer, n_prompt, nb */
  int ok = 0, bad = rk->model->config.n_layers;
  char msg[256] = "malformed admit plan";
  if (len >= sizeof hdr) memcpy(hdr, p, sizeof hdr);
  const uint8_t *ids = p + sizeof hdr;
  const uint8_t *q = hdr[3] > 0 && len >= sizeof hdr ? ids + sizeof(int32_t) * (size_t)hdr[3] : end;
  if (q + sizeof ns <= end) memcpy(&ns, q, sizeof ns);
  if (ns >= 0 && q + sizeof ns + 8 * (size_t)ns == end) {
    int32_t *idv = malloc(sizeof(int32_t) * (size_t)hdr[3]);
    uint64_t *sv = malloc(8 * (size_t)(ns > 0 ? ns : 1));
    if (idv && sv) {
      memcpy(idv, ids, sizeof(int32_t) * (size_t)hdr[3]);
      memcpy(sv, q + sizeof ns, 8 * (size_t)ns);
      msg[0] = '\0';
      tw_decode_check(rk, hdr[0], hdr[1] != 0, hdr[2], idv, hdr[3], sv, (size_t)ns, &ok, &bad,
                      msg, sizeof msg);
    }
    free(idv);
    free(sv);
  }
  size_t ml = strlen(msg);
  uint8_t reply[8 + sizeof msg];
  int32_t rr[2] = {ok, bad};
  memcpy(reply, rr, sizeof rr);
  memcpy(reply + sizeof rr, msg, ml);
  return tw_dist_reply(rk->dist, reply, sizeof rr + ml);
}

static void tw_decode_ranks_idle(void *ctx) {
  tw_decode_ranks_t *rk = ctx;
  tw_kv_xfer_progress(rk->xfer);
}

TW_NODISCARD tw_status_t tw_decode_ranks_follow(tw_decode_ranks_t *rk) {
  return tw_dist_follow_idle(rk->dist, rk->engine, tw_decode_ranks_hook, tw_decode_ranks_idle, rk,
                             NULL);
}
