/* dist_engine.c: step plans for the engine calls of a multi-rank worker
 * (see dist_engine.h). A plan is one control-link message:
 *   u32 kind, then for DECODE: i32 n_seqs, flags (2 logits or tokens wanted, 8 samples
 *   given), tokens[n], positions[n], n_blocks[n], samples[n]?, then every
 *   block table in order;
 *   for DECODE_DP: i32 size, then per rank i32 pad_block and that rank's
 *   DECODE fields (n may be 0); each other rank replies i32 status, i32 n,
 *   its tokens[n], then a message when status != 0.
 *   Every rank runs the same host layout, so the fields are copied as they
 *   are. */
#include "common/engine/dist_engine.h"

#include "common/base/log.h"
#include "common/base/test_hook.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { /* 1 was a prefill plan: prefill ranks follow their own (prefill_ranks.c) */
       TW_PLAN_DECODE = 2,
       TW_PLAN_STOP = 3,
       TW_PLAN_USER = 4,
       TW_PLAN_DECODE_DP = 5,
};

#define TW_DIST_DP_REPLY_MS 120000 /* a decode step on a loaded 2-core machine, with margin */

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

/* Copy the next n bytes into dst (a value that needs more than 4-byte
 * alignment, such as tw_sample_params_t, sits at any offset in a plan and is
 * never read through a cast pointer); false when the plan is short. */
static bool tw_rd_copy(tw_rd_t *r, void *dst, size_t n) {
  const void *q = tw_rd(r, n);
  if (q && n) memcpy(dst, q, n);
  return q != NULL;
}

static TW_NODISCARD tw_status_t tw_dist_send_buf(tw_dist_t *d, tw_buf_t *b, int bad) {
  tw_status_t st = bad ? tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a plan")
                       : tw_dist_plan_send(d, b->p, b->len);
  free(b->p);
  return st;
}

/* The DECODE fields of one batch (see the file comment). */
static int tw_plan_put_decode(tw_buf_t *b, const tw_decode_args_t *a) {
  int32_t n = a->n_seqs > 0 ? a->n_seqs : 0;
  int32_t flags = (a->logits_out || a->next_tokens_out ? 2 : 0) | (a->sample ? 8 : 0);
  size_t v = sizeof(int32_t) * (size_t)n;
  int bad = tw_buf_i32(b, n) | tw_buf_i32(b, flags) | tw_buf_put(b, a->tokens, v) |
            tw_buf_put(b, a->positions, v) | tw_buf_put(b, a->n_blocks, v);
  if (a->sample) bad |= tw_buf_put(b, a->sample, sizeof(tw_sample_params_t) * (size_t)n);
  for (int32_t i = 0; i < n && !bad; i++)
    bad |= tw_buf_put(b, a->block_tables[i], sizeof(int32_t) * (size_t)a->n_blocks[i]);
  return bad;
}

TW_NODISCARD tw_status_t tw_dist_engine_decode(tw_dist_t *d, tw_engine_t *e,
                                               const tw_decode_args_t *a) {
  if (tw_dist_size(d) > 1) {
    tw_buf_t b = {0};
    int bad = tw_buf_i32(&b, TW_PLAN_DECODE) | tw_plan_put_decode(&b, a);
    TW_CHECK(tw_dist_send_buf(d, &b, bad));
  }
  return tw_engine_decode(e, a);
}

/* This rank's part of a DP step: its batch, or one padding row (token 0 at
 * position 0 in pad_block, no logits) so that it still meets the others in
 * the MoE's collectives. A batch the engine refuses by its argument checks
 * (INVALID_ARGUMENT, OUT_OF_RANGE: made before any collective) is replaced
 * by the padding row too, so one rank's bad batch fails its sequences
 * instead of leaving the other ranks in a collective forever; the refusal
 * is returned (tw_last_error() keeps its message: a success sets none). */
static TW_NODISCARD tw_status_t tw_dp_run(tw_engine_t *e, const tw_decode_args_t *a,
                                          int32_t pad_block) {
  tw_status_t st = TW_OK;
  if (a->n_seqs > 0) {
    st = tw_engine_decode(e, a);
    if (st != TW_ERR_INVALID_ARGUMENT && st != TW_ERR_OUT_OF_RANGE) return st;
  }
  const int32_t tok = 0, pos = 0, nb = 1;
  const int32_t *tab = &pad_block;
  tw_decode_args_t p = {.n_seqs = 1, .tokens = &tok, .positions = &pos, .block_tables = &tab,
                        .n_blocks = &nb};
  tw_status_t ps = tw_engine_decode(e, &p);
  return st != TW_OK ? st : ps;
}

TW_NODISCARD tw_status_t tw_dist_engine_decode_dp(tw_dist_t *d, tw_engine_t *e,
                                                  const tw_dist_dp_batch_t *bt) {
  const int32_t size = tw_dist_size(d);
  int64_t total = 0;
  if (size > 64)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: dp decode over %d ranks (most 64)", size);
  for (int32_t r = 0; r < size; r++) {
    if (bt[r].args.logits_out)
      return tw_err(TW_ERR_INVALID_ARGUMENT,
                    "dist: dp decode returns tokens only (rank %d asked for logits)", r);
    total += bt[r].args.n_seqs > 0 ? bt[r].args.n_seqs : 0;
  }
  if (total == 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "dist: dp decode step without a sequence");
  if (size > 1) {
    tw_buf_t b = {0};
    int bad = tw_buf_i32(&b, TW_PLAN_DECODE_DP) | tw_buf_i32(&b, size);
    for (int32_t r = 0; r < size && !bad; r++)
      bad |= tw_buf_i32(&b, bt[r].pad_block) | tw_plan_put_decode(&b, &bt[r].args);
    TW_CHECK(tw_dist_send_buf(d, &b, bad));
  }
  tw_status_t st = tw_dp_run(e, &bt[0].args, bt[0].pad_block);
  char err[256] = "";
  if (st != TW_OK) snprintf(err, sizeof err, "rank 0: %s", tw_last_error());
  if (size == 1) return st;
  void *bufs[64];
  size_t lens[64];
  tw_status_t rs = tw_dist_replies_recv(d, TW_DIST_DP_REPLY_MS, bufs, lens);
  if (rs != TW_OK) return rs; /* already reported */
  for (int32_t r = 1; r < size; r++) {
    const char *p = bufs[r];
    int32_t hdr[2] = {TW_ERR_FORMAT, -1}, n = bt[r].args.n_seqs > 0 ? bt[r].args.n_seqs : 0;
    if (lens[r] >= sizeof hdr) memcpy(hdr, p, sizeof hdr);
    size_t need = sizeof hdr + sizeof(int32_t) * (size_t)n;
    if (st == TW_OK && hdr[0] != TW_OK) {
      st = hdr[0];
      snprintf(err, sizeof err, "rank %d: %.*s", r,
               (int)(lens[r] > sizeof hdr ? lens[r] - sizeof hdr : 0), p + sizeof hdr);
    } else if (st == TW_OK && (hdr[1] != n || lens[r] < need)) {
      st = TW_ERR_FORMAT;
      snprintf(err, sizeof err, "rank %d: dp decode reply of %zu bytes for %d sequences", r,
               lens[r], n);
    } else if (st == TW_OK && n > 0 && bt[r].args.next_tokens_out) {
      memcpy(bt[r].args.next_tokens_out, p + sizeof hdr, sizeof(int32_t) * (size_t)n);
    }
    free(bufs[r]);
  }
  if (st != TW_OK) return tw_err(st, "%s", err);
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_dist_plan_user(tw_dist_t *d, const void *buf, size_t len) {
  if (tw_dist_size(d) == 1) return TW_OK;
  tw_buf_t b = {0};
  int bad = tw_buf_i32(&b, TW_PLAN_USER) | tw_buf_put(&b, buf, len);
  return tw_dist_send_buf(d, &b, bad);
}

TW_NODISCARD tw_status_t tw_dist_plan_stop(tw_dist_t *d) {
  if (tw_dist_size(d) == 1) return TW_OK;
  tw_dist_watchdog_stop(d); /* the others go now: their silence is expected */
  int32_t k = TW_PLAN_STOP;
  return tw_dist_plan_send(d, &k, sizeof k);
}

/* ---- the follower side ------------------------------------------------------ */

#ifdef TW_TEST_HOOKS
/* Test builds only (TWAIN_TEST_HOOKS): TWAIN_TEST_BAD_PLAN=N makes this
 * rank's N-th decode batch unreadable, as a corrupted or mis-sized plan
 * would be (tests/parallel/test_parallel_bad_plan.py). */
static bool tw_test_bad_plan(void) {
  static tw_test_hook_t h = TW_TEST_HOOK_INIT; /* read once: the hook sits on every decode plan */
  return tw_test_hook_nth(&h, "TWAIN_TEST_BAD_PLAN");
}
#else
static bool tw_test_bad_plan(void) { return false; }
#endif

/* One batch's DECODE fields as views into the plan; the block-table pointers
 * [n], a token buffer [n] and the sampling parameters [n] (copied out of the
 * plan: they need 8-byte alignment) are malloc'd into *tabs_p / *next_p /
 * *samp_p (the caller frees all three, also on error; *samp_p stays NULL
 * without samples). next_tokens_out is set when the plan
 * wants tokens. n 0 only with allow_empty. */
static TW_NODISCARD tw_status_t tw_plan_read_decode(tw_rd_t *r, bool allow_empty,
                                                    tw_decode_args_t *a, const int32_t ***tabs_p,
                                                    int32_t **next_p, tw_sample_params_t **samp_p) {
  const int32_t *h = tw_rd(r, 2 * sizeof(int32_t));
  if (!h || h[0] < 0 || (h[0] == 0 && !allow_empty) || tw_test_bad_plan())
    return tw_err(TW_ERR_FORMAT, "dist: short decode plan");
  int32_t n = h[0], flags = h[1];
  size_t v = sizeof(int32_t) * (size_t)n;
  const int32_t *tokens = tw_rd(r, v), *pos = tw_rd(r, v), *nb = tw_rd(r, v);
  if (!tokens || !pos || !nb) return tw_err(TW_ERR_FORMAT, "dist: short decode plan");
  const int32_t **tabs = malloc(sizeof(*tabs) * (size_t)(n ? n : 1));
  int32_t *next = malloc(v ? v : 1);
  tw_sample_params_t *sp = (flags & 8) ? malloc(sizeof(*sp) * (size_t)(n ? n : 1)) : NULL;
  *tabs_p = tabs;
  *next_p = next;
  *samp_p = sp;
  if (!tabs || !next || ((flags & 8) && !sp))
    return tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a decode plan");
  if (sp && !tw_rd_copy(r, sp, sizeof(*sp) * (size_t)n))
    return tw_err(TW_ERR_FORMAT, "dist: short decode plan");
  for (int32_t i = 0; i < n; i++) {
    tabs[i] = nb[i] >= 0 ? tw_rd(r, sizeof(int32_t) * (size_t)nb[i]) : NULL;
    if (!tabs[i]) return tw_err(TW_ERR_FORMAT, "dist: short decode plan (table %d)", i);
  }
  *a = (tw_decode_args_t){.n_seqs = n, .tokens = tokens, .positions = pos, .block_tables = tabs,
                          .n_blocks = nb, .sample = sp, .next_tokens_out = (flags & 2) ? next : NULL};
  return TW_OK;
}

/* *unread: the plan could not be read (the step was not run). */
static TW_NODISCARD tw_status_t tw_follow_decode(tw_engine_t *e, tw_rd_t *r, bool *unread) {
  tw_decode_args_t a;
  const int32_t **tabs = NULL;
  int32_t *next = NULL;
  tw_sample_params_t *samp = NULL;
  tw_status_t st = tw_plan_read_decode(r, false, &a, &tabs, &next, &samp);
  /* every byte is a field: bytes left over mean the plan was misread */
  if (st == TW_OK && r->off != r->len)
    st = tw_err(TW_ERR_FORMAT, "dist: decode plan of %zu bytes, %zu of them not read", r->len,
                r->len - r->off);
  *unread = st != TW_OK;
  if (st == TW_OK) st = tw_engine_decode(e, &a);
  free(tabs);
  free(next);
  free(samp);
  return st;
}

/* A DP step: skip the sections of the ranks before this one, run ours (or a
 * padding row), answer rank 0 with our tokens; always answer, so rank 0
 * sees a failure here instead of waiting. *unread: the plan could not be
 * read, so this rank ran nothing (rank 0 waits in the step's collectives). */
static TW_NODISCARD tw_status_t tw_follow_decode_dp(tw_dist_t *d, tw_engine_t *e, tw_rd_t *r,
                                                    bool *unread) {
  const int32_t me = tw_dist_rank(d);
  const int32_t *size = tw_rd(r, sizeof(int32_t));
  tw_decode_args_t a = {0};
  const int32_t **tabs = NULL;
  int32_t *next = NULL, pad = -1;
  tw_sample_params_t *samp = NULL;
  tw_status_t st = TW_OK;
  if (!size || *size != tw_dist_size(d))
    st = tw_err(TW_ERR_FORMAT, "dist: dp decode plan for %d ranks, the group has %d",
                size ? *size : -1, tw_dist_size(d));
  for (int32_t k = 0; k <= me && st == TW_OK; k++) {
    const int32_t *pb = tw_rd(r, sizeof(int32_t));
    free(tabs);
    free(next);
    free(samp);
    tabs = NULL;
    next = NULL;
    samp = NULL;
    st = pb ? tw_plan_read_decode(r, true, &a, &tabs, &next, &samp)
            : tw_err(TW_ERR_FORMAT, "dist: short dp decode plan (rank %d)", k);
    if (pb) pad = *pb;
  }
  *unread = st != TW_OK;
  if (st == TW_OK) st = tw_dp_run(e, &a, pad);
  int32_t n = st == TW_OK ? a.n_seqs : 0;
  if (st == TW_OK && n > 0 && !a.next_tokens_out) memset(next, 0, sizeof(int32_t) * (size_t)n);
  char msg[256] = "";
  if (st != TW_OK) snprintf(msg, sizeof msg, "%s", tw_last_error());
  size_t ml = strlen(msg), len = 2 * sizeof(int32_t) + sizeof(int32_t) * (size_t)n + ml;
  char *rep = malloc(len);
  tw_status_t rs;
  if (!rep) {
    rs = tw_err(TW_ERR_NO_MEMORY, "dist: out of memory for a dp decode reply");
  } else {
    int32_t hdr[2] = {st, n};
    memcpy(rep, hdr, sizeof hdr);
    if (n > 0) memcpy(rep + sizeof hdr, next, sizeof(int32_t) * (size_t)n);
    memcpy(rep + sizeof hdr + sizeof(int32_t) * (size_t)n, msg, ml);
    rs = tw_dist_reply(d, rep, len);
  }
  free(rep);
  free(tabs);
  free(next);
  free(samp);
  return st != TW_OK ? st : rs;
}

TW_NODISCARD tw_status_t tw_dist_follow(tw_dist_t *d, tw_engine_t *e, tw_dist_hook_fn hook,
                                        void *ctx, volatile int *maybe_stop) {
  return tw_dist_follow_idle(d, e, hook, NULL, ctx, maybe_stop);
}

TW_NODISCARD tw_status_t tw_dist_follow_idle(tw_dist_t *d, tw_engine_t *e, tw_dist_hook_fn hook,
                                             void (*idle)(void *ctx), void *ctx,
                                             volatile int *maybe_stop) {
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
    bool unread = false;
    switch (k) {
      case TW_PLAN_DECODE: st = tw_follow_decode(e, &r, &unread); break;
      case TW_PLAN_DECODE_DP: st = tw_follow_decode_dp(d, e, &r, &unread); break;
      case TW_PLAN_USER: st = hook ? hook(ctx, r.p + r.off, r.len - r.off) : TW_OK; break;
      case TW_PLAN_STOP: break;
      default: unread = true; st = tw_err(TW_ERR_FORMAT, "dist: plan of unknown kind %d", k);
    }
    free(buf);
    if (k == TW_PLAN_STOP) {
      tw_dist_watchdog_stop(d); /* rank 0 is going away on purpose */
      return TW_OK;
    }
    /* A plan this rank cannot read leaves rank 0 alone in the step's
     * collectives, which never end: leave the group instead; rank 0's
     * watchdog sees the link close and takes the worker down (dist.h), so
     * the router ends or re-places its requests. */
    if (unread) {
      char why[256];
      snprintf(why, sizeof why, "%s", tw_last_error());
      return tw_err(st, "dist: rank %d of %d cannot read plan %d (%s): leaving the group",
                    tw_dist_rank(d), tw_dist_size(d), k, why);
    }
    if (st != TW_OK)
      TW_WARN("dist", "rank %d: plan %d failed: %s", tw_dist_rank(d), k, tw_last_error());
  }
}
