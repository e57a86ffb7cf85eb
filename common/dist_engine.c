/* dist_engine.c: step plans for the engine calls of a multi-rank worker
 * (see dist_engine.h). A plan is one control-link message:
 *   u32 kind, then for PREFILL: i32 n_tokens, start_pos, n_blocks, flags
 *   (1 all_logits, 2 logits wanted, 4 token wanted, 8 sample given),
 *   tw_sample_params_t, tokens[n_tokens], block_table[n_blocks];
 *   for DECODE: i32 n_seqs, flags (2 logits or tokens wanted, 8 samples
 *   given), tokens[n], positions[n], n_blocks[n], samples[n]?, then every
 *   block table in order. Every rank runs the same host layout, so the
 *   fields are copied as they are. */
#include "common/dist_engine.h"

#include "common/engine_impl.h"
#include "common/log.h"

#include <stdlib.h>
#include <string.h>

enum { TW_PLAN_PREFILL = 1, TW_PLAN_DECODE = 2, TW_PLAN_STOP = 3, TW_PLAN_USER = 4 };

typedef struct {
  char *p;
  size_t len, cap;
} tw_buf_t;

static int tw_buf_put(tw_buf_t *b, const void *src, size_t n) {
  if (b->len + n > b->cap) {
    size_t c = b->cap ? b->cap : 256;
    while (c < b->len + n) c *= 2;
    char *q = realloc(b->p, c);
    if (!q) return -1;
    b->p = q;
    b->cap = c;
  }
  if (n) memcpy(b->p + b->len, src, n);
  b->len += n;
  return 0;
}

static int tw_buf_i32(tw_buf_t *b, int32_t v) { return tw_buf_put(b, &v, sizeof v); }

typedef struct {
  const char *p;
  size_t len, off;
} tw_rd_t;

static const void *tw_rd(tw_rd_t *r, size_t n) {
  if (r->off + n > r->len) return NULL;
  const void *q = r->p + r->off;
  r->off += n;
  return q;
}

static tw_status_t tw_dist_send_buf(tw_dist_t *d, tw_buf_t *b, int bad) {
  tw_status_t st = bad ? tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a plan")
                       : tw_dist_plan_send(d, b->p, b->len);
  free(b->p);
  return st;
}

tw_status_t tw_dist_engine_prefill(tw_dist_t *d, tw_engine_t *e, const tw_prefill_args_t *a) {
  if (tw_dist_size(d) > 1) {
    tw_buf_t b = {0};
    int32_t flags = (a->all_logits ? 1 : 0) | (a->logits_out ? 2 : 0) |
                    (a->next_token_out ? 4 : 0) | (a->sample ? 8 : 0);
    tw_sample_params_t sp = a->sample ? *a->sample : TW_SAMPLE_PARAMS_GREEDY;
    int bad = tw_buf_i32(&b, TW_PLAN_PREFILL) | tw_buf_i32(&b, a->n_tokens) |
              tw_buf_i32(&b, a->start_pos) | tw_buf_i32(&b, a->n_blocks) | tw_buf_i32(&b, flags) |
              tw_buf_put(&b, &sp, sizeof sp) |
              tw_buf_put(&b, a->tokens, sizeof(int32_t) * (size_t)(a->n_tokens > 0 ? a->n_tokens : 0)) |
              tw_buf_put(&b, a->block_table, sizeof(int32_t) * (size_t)(a->n_blocks > 0 ? a->n_blocks : 0));
    TW_CHECK(tw_dist_send_buf(d, &b, bad));
  }
  return tw_engine_prefill(e, a);
}

tw_status_t tw_dist_engine_decode(tw_dist_t *d, tw_engine_t *e, const tw_decode_args_t *a) {
  if (tw_dist_size(d) > 1) {
    tw_buf_t b = {0};
    int32_t n = a->n_seqs > 0 ? a->n_seqs : 0;
    int32_t flags = (a->logits_out || a->next_tokens_out ? 2 : 0) | (a->sample ? 8 : 0);
    size_t v = sizeof(int32_t) * (size_t)n;
    int bad = tw_buf_i32(&b, TW_PLAN_DECODE) | tw_buf_i32(&b, n) | tw_buf_i32(&b, flags) |
              tw_buf_put(&b, a->tokens, v) | tw_buf_put(&b, a->positions, v) |
              tw_buf_put(&b, a->n_blocks, v);
    if (a->sample) bad |= tw_buf_put(&b, a->sample, sizeof(tw_sample_params_t) * (size_t)n);
    for (int32_t i = 0; i < n && !bad; i++)
      bad |= tw_buf_put(&b, a->block_tables[i], sizeof(int32_t) * (size_t)a->n_blocks[i]);
    TW_CHECK(tw_dist_send_buf(d, &b, bad));
  }
  return tw_engine_decode(e, a);
}

tw_status_t tw_dist_plan_user(tw_dist_t *d, const void *buf, size_t len) {
  if (tw_dist_size(d) == 1) return TW_OK;
  tw_buf_t b = {0};
  int bad = tw_buf_i32(&b, TW_PLAN_USER) | tw_buf_put(&b, buf, len);
  return tw_dist_send_buf(d, &b, bad);
}

tw_status_t tw_dist_plan_stop(tw_dist_t *d) {
  if (tw_dist_size(d) == 1) return TW_OK;
  tw_dist_watchdog_stop(d); /* the others go now: their silence is expected */
  int32_t k = TW_PLAN_STOP;
  return tw_dist_plan_send(d, &k, sizeof k);
}

/* ---- the follower side ------------------------------------------------------ */

static tw_status_t tw_follow_prefill(tw_engine_t *e, tw_rd_t *r) {
  const int32_t *h = tw_rd(r, 4 * sizeof(int32_t));
  const tw_sample_params_t *sp = tw_rd(r, sizeof(tw_sample_params_t));
  if (!h || !sp || h[0] < 0 || h[2] < 0) return tw_err(TW_ERR_FORMAT, "dist: short prefill plan");
  const int32_t *tokens = tw_rd(r, sizeof(int32_t) * (size_t)h[0]);
  const int32_t *table = tw_rd(r, sizeof(int32_t) * (size_t)h[2]);
  if (!tokens || !table) return tw_err(TW_ERR_FORMAT, "dist: short prefill plan");
  int32_t flags = h[3], tok = -1;
  const int64_t V = e->model->config.vocab_size;
  float *logits = NULL;
  if ((flags & 3) == 3) { /* all rows wanted on rank 0: the same rows here (collective unembed) */
    logits = malloc(sizeof(float) * (size_t)h[0] * (size_t)V);
    if (!logits) return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for follower logits");
  }
  tw_prefill_args_t a = {.tokens = tokens, .n_tokens = h[0], .start_pos = h[1],
                         .block_table = table, .n_blocks = h[2], .all_logits = (flags & 1) != 0,
                         .logits_out = logits, .sample = (flags & 8) ? sp : NULL,
                         .next_token_out = (flags & 6) ? &tok : NULL};
  tw_status_t st = tw_engine_prefill(e, &a);
  free(logits);
  return st;
}

static tw_status_t tw_follow_decode(tw_engine_t *e, tw_rd_t *r) {
  const int32_t *h = tw_rd(r, 2 * sizeof(int32_t));
  if (!h || h[0] <= 0) return tw_err(TW_ERR_FORMAT, "dist: short decode plan");
  int32_t n = h[0], flags = h[1];
  size_t v = sizeof(int32_t) * (size_t)n;
  const int32_t *tokens = tw_rd(r, v), *pos = tw_rd(r, v), *nb = tw_rd(r, v);
  const tw_sample_params_t *sp = (flags & 8) ? tw_rd(r, sizeof(tw_sample_params_t) * (size_t)n) : NULL;
  if (!tokens || !pos || !nb || ((flags & 8) && !sp))
    return tw_err(TW_ERR_FORMAT, "dist: short decode plan");
  const int32_t **tabs = malloc(sizeof(*tabs) * (size_t)n);
  int32_t *next = malloc(v);
  if (!tabs || !next) {
    free(tabs);
    free(next);
    return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a decode plan");
  }
  tw_status_t st = TW_OK;
  for (int32_t i = 0; i < n && st == TW_OK; i++) {
    tabs[i] = nb[i] >= 0 ? tw_rd(r, sizeof(int32_t) * (size_t)nb[i]) : NULL;
    if (!tabs[i]) st = tw_err(TW_ERR_FORMAT, "dist: short decode plan (table %d)", i);
  }
  if (st == TW_OK) {
    tw_decode_args_t a = {.n_seqs = n, .tokens = tokens, .positions = pos, .block_tables = tabs,
                          .n_blocks = nb, .sample = sp, .next_tokens_out = (flags & 2) ? next : NULL};
    st = tw_engine_decode(e, &a);
  }
  free(tabs);
  free(next);
  return st;
}

tw_status_t tw_dist_follow(tw_dist_t *d, tw_engine_t *e, tw_dist_hook_fn hook, void *ctx,
                           volatile int *maybe_stop) {
  return tw_dist_follow_idle(d, e, hook, NULL, ctx, maybe_stop);
}

tw_status_t tw_dist_follow_idle(tw_dist_t *d, tw_engine_t *e, tw_dist_hook_fn hook,
                                void (*idle)(void *ctx), void *ctx, volatile int *maybe_stop) {
  for (;;) {
    if (maybe_stop && *maybe_stop) return TW_OK;
    void *buf = NULL;
    size_t len = 0;
    if (idle) idle(ctx);
    tw_status_t st = tw_dist_plan_recv(d, idle ? 2 : 100, &buf, &len);
    if (st == TW_INPROGRESS) continue;
    TW_CHECK(st);
    tw_rd_t r = {.p = buf, .len = len};
    const int32_t *kind = tw_rd(&r, sizeof(int32_t));
    if (!kind) {
      free(buf);
      return tw_err(TW_ERR_FORMAT, "dist: empty plan");
    }
    int k = *kind;
    switch (k) {
    case TW_PLAN_PREFILL: st = tw_follow_prefill(e, &r); break;
    case TW_PLAN_DECODE: st = tw_follow_decode(e, &r); break;
    case TW_PLAN_USER: st = hook ? hook(ctx, r.p + r.off, r.len - r.off) : TW_OK; break;
    case TW_PLAN_STOP: break;
    default: st = tw_err(TW_ERR_FORMAT, "dist: plan of unknown kind %d", k);
    }
    free(buf);
    if (k == TW_PLAN_STOP) {
      tw_dist_watchdog_stop(d); /* rank 0 is going away on purpose */
      return TW_OK;
    }
    if (st != TW_OK)
      TW_WARN("dist", "rank %d: plan %d failed: %s", tw_dist_rank(d), k, tw_last_error());
  }
}
