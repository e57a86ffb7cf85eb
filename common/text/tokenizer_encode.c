/* tokenizer_encode.c: text -> ids. Added-token split (HF semantics: leftmost,
 * longest), the Split pre-tokenizer regex of spec §5.2 through PCRE2 (UTF, UCP,
 * JIT), then byte-level BPE per piece (spec §5.3): a piece that is a vocab entry
 * is one token; otherwise adjacent pairs merge lowest merge rank first, leftmost
 * on ties (the order of HF's BPE::merge_all and of tiktoken's rank loop).
 *
 * Speed (docs/benchmarks.md "Tokenizer"): no malloc per piece (encoder scratch),
 * the JIT matcher with a reused match context, open-addressing hash maps for
 * byte strings and pairs, an O(n log n) heap merge for very long pieces and a
 * direct-mapped cache for pieces that needed BPE. */
#include "common/text/tokenizer.h"

#include "common/base/log.h"
#include "common/text/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

/* Pieces at most this long use the quadratic scan (faster for short pieces). */
#define TW_TOK_SCAN_MAX 128
/* Pair cache: direct mapped, 16 B a slot: 128 KiB stays near the core while
 * the merge table (16 MiB) does not; natural text repeats its pairs. */
#define TW_TOK_PAIR_CACHE_BITS 13
/* Piece cache: direct mapped; pieces up to 48 bytes, up to 16 ids. */
#define TW_TOK_CACHE_SLOTS 8192
#define TW_TOK_CACHE_BYTES 48
#define TW_TOK_CACHE_IDS 16

typedef struct {
  uint64_t hash;
  uint8_t len, n_ids;
  unsigned char bytes[TW_TOK_CACHE_BYTES];
  int32_t ids[TW_TOK_CACHE_IDS];
} tw_tok_cache_slot_t;

struct tw_tok_encoder {
  const struct tw_tokenizer *tok;
  pcre2_match_data *md;
  pcre2_match_context *mctx;
  pcre2_jit_stack *jit_stack;
  size_t cap;       /* capacity of the scratch arrays below, in symbols */
  int32_t *sym;     /* [cap] current symbols */
  uint32_t *rank;   /* [cap] rank of the pair starting at i */
  int32_t *merged;  /* [cap] id that pair would merge to */
  int32_t *next;    /* [cap] heap mode: linked list */
  int32_t *prev;
  uint64_t *heap;   /* [3 * cap] heap mode: (rank << 32) | pos; stale entries stay
                       until popped: n - 1 initial + 2 per merge < 3n */
  tw_tok_cache_slot_t *cache; /* [TW_TOK_CACHE_SLOTS] */
  tw_tok_pair_slot_t *pcache; /* [1 << TW_TOK_PAIR_CACHE_BITS], key UINT64_MAX = empty */
};

/* tw_tok_pair_find through the encoder's pair cache. */
static inline uint32_t tw_tok_pair_cached(struct tw_tok_encoder *e, int32_t a, int32_t b,
                                          int32_t *id_p) {
  uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
  tw_tok_pair_slot_t *s =
      &e->pcache[(key * 0x9E3779B97F4A7C15ull) >> (64 - TW_TOK_PAIR_CACHE_BITS)];
  if (s->key != key) {
    s->key = key;
    s->rank = tw_tok_pair_find(e->tok, a, b, &s->id);
  }
  *id_p = s->id;
  return s->rank;
}

/* ---- regex ------------------------------------------------------------- */

/* White_Space (Unicode), which is what \s means in Oniguruma and Rust regex;
 * PCRE2's \s with UCP also takes U+180E, so \s and \S are spelled out. */
#define TW_TOK_WS "\\t-\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}" \
                  "\\x{202f}\\x{205f}\\x{3000}"

TW_NODISCARD tw_status_t tw_tok_regex_compile(struct tw_tokenizer *t, const char *pattern) {
  size_t n = strlen(pattern);
  char *pat = malloc(n * 16 + 1);
  if (!pat) return tw_err(TW_ERR_NO_MEMORY, "tokenizer: out of memory for the regex");
  size_t o = 0;
  int in_class = 0;
  for (size_t i = 0; i < n; i++) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < n) {
      char e = pattern[i + 1];
      if (e == 's' || e == 'S') {
        if (in_class && e == 'S') {
          free(pat);
          return tw_err(TW_ERR_UNSUPPORTED, "tokenizer regex: \\S inside a class at offset %zu",
                        i);
        }
        const char *rep = in_class ? TW_TOK_WS : e == 's' ? "[" TW_TOK_WS "]" : "[^" TW_TOK_WS "]";
        size_t rn = strlen(rep);
        memcpy(pat + o, rep, rn);
        o += rn;
      } else {
        pat[o++] = c;
        pat[o++] = e;
      }
      i++;
      continue;
    }
    if (c == '[' && !in_class) in_class = 1;
    else if (c == ']' && in_class) in_class = 0;
    pat[o++] = c;
  }
  pat[o] = '\0';
  int errcode;
  PCRE2_SIZE erroff;
  t->re = pcre2_compile((PCRE2_SPTR)pat, o, PCRE2_UTF | PCRE2_UCP, &errcode, &erroff, NULL);
  free(pat);
  if (!t->re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(errcode, msg, sizeof msg);
    return tw_err(TW_ERR_UNSUPPORTED, "tokenizer regex does not compile with PCRE2 at offset "
                  "%zu: %s", (size_t)erroff, (const char *)msg);
  }
  int rc = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);
  t->re_jit = rc == 0;
  if (!t->re_jit) TW_WARN("tok", "pcre2 jit unavailable (%d): the tokenizer regex runs interpreted",
                          rc);
  return TW_OK;
}

/* ---- encoder ----------------------------------------------------------- */

TW_NODISCARD tw_status_t tw_tok_encoder_create(const tw_tokenizer_t *tok,
                                               tw_tok_encoder_t **enc_p) {
  struct tw_tok_encoder *e = calloc(1, sizeof *e);
  if (!e) return tw_err(TW_ERR_NO_MEMORY, "tokenizer encoder: out of memory");
  e->tok = tok;
  e->md = pcre2_match_data_create(1, NULL);
  e->mctx = pcre2_match_context_create(NULL);
  /* a whitespace run of a few MB backtracks in \s+(?!\S): give JIT room */
  e->jit_stack = tok->re_jit ? pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL) : NULL;
  e->cache = calloc(TW_TOK_CACHE_SLOTS, sizeof *e->cache);
  e->pcache = malloc(((size_t)1 << TW_TOK_PAIR_CACHE_BITS) * sizeof *e->pcache);
  if (!e->md || !e->mctx || (tok->re_jit && !e->jit_stack) || !e->cache || !e->pcache) {
    tw_tok_encoder_destroy(e);
    return tw_err(TW_ERR_NO_MEMORY, "tokenizer encoder: out of memory");
  }
  if (e->jit_stack) pcre2_jit_stack_assign(e->mctx, NULL, e->jit_stack);
  for (size_t i = 0; i < ((size_t)1 << TW_TOK_PAIR_CACHE_BITS); i++) e->pcache[i].key = UINT64_MAX;
  *enc_p = e;
  return TW_OK;
}

void tw_tok_encoder_destroy(tw_tok_encoder_t *e) {
  if (!e) return;
  if (e->md) pcre2_match_data_free(e->md);
  if (e->mctx) pcre2_match_context_free(e->mctx);
  if (e->jit_stack) pcre2_jit_stack_free(e->jit_stack);
  free(e->sym);
  free(e->rank);
  free(e->merged);
  free(e->next);
  free(e->prev);
  free(e->heap);
  free(e->cache);
  free(e->pcache);
  free(e);
}

static TW_NODISCARD tw_status_t tw_tok_scratch(struct tw_tok_encoder *e, size_t n) {
  if (n <= e->cap) return TW_OK;
  size_t cap = e->cap ? e->cap : 256;
  while (cap < n) cap *= 2;
  int32_t *sym = realloc(e->sym, cap * sizeof *sym);
  if (sym) e->sym = sym;
  uint32_t *rank = realloc(e->rank, cap * sizeof *rank);
  if (rank) e->rank = rank;
  int32_t *merged = realloc(e->merged, cap * sizeof *merged);
  if (merged) e->merged = merged;
  int32_t *next = realloc(e->next, cap * sizeof *next);
  if (next) e->next = next;
  int32_t *prev = realloc(e->prev, cap * sizeof *prev);
  if (prev) e->prev = prev;
  uint64_t *heap = realloc(e->heap, 3 * cap * sizeof *heap);
  if (heap) e->heap = heap;
  if (!sym || !rank || !merged || !next || !prev || !heap)
    return tw_err(TW_ERR_NO_MEMORY, "tokenizer: cannot grow BPE scratch to %zu symbols", cap);
  e->cap = cap;
  return TW_OK;
}

/* BPE by repeated scans over the bytes p[0..m): rank[i] for pair (i, i+1).
 * Result in sym[0..*m_p). */
static void tw_tok_bpe_scan(struct tw_tok_encoder *e, const unsigned char *p, size_t *m_p) {
  const struct tw_tokenizer *t = e->tok;
  int32_t *sym = e->sym, *merged = e->merged;
  uint32_t *rank = e->rank;
  size_t m = *m_p;
  for (size_t i = 0; i + 1 < m; i++) {
    uint64_t bp = t->byte_pairs[(unsigned)p[i] << 8 | p[i + 1]];
    rank[i] = (uint32_t)(bp >> 32);
    merged[i] = (int32_t)(uint32_t)bp;
  }
  while (m > 1) {
    uint32_t best = UINT32_MAX;
    size_t bi = 0;
    for (size_t i = 0; i + 1 < m; i++) {
      if (rank[i] < best) {
        best = rank[i];
        bi = i;
      }
    }
    if (best == UINT32_MAX) break;
    sym[bi] = merged[bi];
    memmove(sym + bi + 1, sym + bi + 2, (m - bi - 2) * sizeof *sym);
    if (bi + 2 < m) {
      memmove(rank + bi + 1, rank + bi + 2, (m - bi - 2) * sizeof *rank);
      memmove(merged + bi + 1, merged + bi + 2, (m - bi - 2) * sizeof *merged);
    }
    m--;
    if (bi > 0) rank[bi - 1] = tw_tok_pair_cached(e, sym[bi - 1], sym[bi], &merged[bi - 1]);
    if (bi + 1 < m) rank[bi] = tw_tok_pair_cached(e, sym[bi], sym[bi + 1], &merged[bi]);
  }
  *m_p = m;
}

static void tw_tok_heap_push(uint64_t *h, size_t *n, uint64_t v) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (h[p] <= v) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = v;
}

static uint64_t tw_tok_heap_pop(uint64_t *h, size_t *n) {
  uint64_t top = h[0], v = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && h[c + 1] < h[c]) c++;
    if (v <= h[c]) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = v;
  return top;
}

/* BPE with a heap of (rank, position) over a linked list: O(n log n) for long
 * pieces; the same merge order as the scan (lowest rank, then leftmost).
 * rank[i]/merged[i] hold the current pair starting at symbol i, so a popped
 * entry is checked against them instead of looking the pair up again. */
static void tw_tok_bpe_heap(struct tw_tok_encoder *e, const unsigned char *p, size_t *m_p) {
  const struct tw_tokenizer *t = e->tok;
  int32_t *sym = e->sym, *next = e->next, *prev = e->prev, *merged = e->merged;
  uint32_t *rank = e->rank;
  uint64_t *heap = e->heap;
  size_t m = *m_p, hn = 0;
  for (size_t i = 0; i < m; i++) {
    next[i] = i + 1 < m ? (int32_t)(i + 1) : -1;
    prev[i] = (int32_t)i - 1;
    rank[i] = UINT32_MAX;
  }
  for (size_t i = 0; i + 1 < m; i++) {
    uint64_t bp = t->byte_pairs[(unsigned)p[i] << 8 | p[i + 1]];
    rank[i] = (uint32_t)(bp >> 32);
    merged[i] = (int32_t)(uint32_t)bp;
    if (rank[i] != UINT32_MAX) tw_tok_heap_push(heap, &hn, ((uint64_t)rank[i] << 32) | i);
  }
  while (hn) {
    uint64_t top = tw_tok_heap_pop(heap, &hn);
    uint32_t r = (uint32_t)(top >> 32);
    int32_t i = (int32_t)(uint32_t)top;
    if (sym[i] < 0 || next[i] < 0 || rank[i] != r) continue; /* stale entry */
    int32_t j = next[i];
    sym[i] = merged[i];
    sym[j] = -1;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    int32_t pi = prev[i], ni = next[i];
    rank[i] = UINT32_MAX;
    if (pi >= 0) {
      rank[pi] = tw_tok_pair_cached(e, sym[pi], sym[i], &merged[pi]);
      if (rank[pi] != UINT32_MAX) tw_tok_heap_push(heap, &hn, ((uint64_t)rank[pi] << 32) | (uint32_t)pi);
    }
    if (ni >= 0) {
      rank[i] = tw_tok_pair_cached(e, sym[i], sym[ni], &merged[i]);
      if (rank[i] != UINT32_MAX) tw_tok_heap_push(heap, &hn, ((uint64_t)rank[i] << 32) | (uint32_t)i);
    }
  }
  size_t o = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) sym[o++] = sym[i];
  *m_p = o;
}

/* One pre-tokenized piece whose tw_tok_hash is h -> ids appended to out. */
static TW_NODISCARD tw_status_t tw_tok_piece(struct tw_tok_encoder *e, const unsigned char *p,
                                             size_t n, uint64_t h, tw_token_ids_t *out) {
  const struct tw_tokenizer *t = e->tok;
  if (out->cap - out->n < n) TW_CHECK(tw_token_ids_reserve(out, n));
  int32_t id = t->ignore_merges ? tw_tok_vocab_find_h(t, p, n, h) : -1;
  if (id >= 0) {
    out->ids[out->n++] = id;
    return TW_OK;
  }
  tw_tok_cache_slot_t *slot = NULL;
  if (n <= TW_TOK_CACHE_BYTES) {
    slot = &e->cache[h & (TW_TOK_CACHE_SLOTS - 1)];
    if (slot->hash == h && slot->len == n && slot->n_ids && memcmp(slot->bytes, p, n) == 0) {
      memcpy(out->ids + out->n, slot->ids, slot->n_ids * sizeof *slot->ids);
      out->n += slot->n_ids;
      return TW_OK;
    }
  }
  TW_CHECK(tw_tok_scratch(e, n));
  for (size_t i = 0; i < n; i++) e->sym[i] = t->byte_id[p[i]];
  size_t m = n;
  if (n <= TW_TOK_SCAN_MAX) tw_tok_bpe_scan(e, p, &m);
  else tw_tok_bpe_heap(e, p, &m);
  memcpy(out->ids + out->n, e->sym, m * sizeof *e->sym);
  out->n += m;
  if (slot && m <= TW_TOK_CACHE_IDS) {
    slot->hash = h;
    slot->len = (uint8_t)n;
    slot->n_ids = (uint8_t)m;
    memcpy(slot->bytes, p, n);
    memcpy(slot->ids, e->sym, m * sizeof *e->sym);
  }
  return TW_OK;
}

/* Queue a piece: start loading its vocab slot now, encode the piece queued
 * before it (whose slot had the time of one regex match to arrive). */
static TW_NODISCARD tw_status_t tw_tok_queue(struct tw_tok_encoder *e, const unsigned char *p,
                                             size_t n, const unsigned char **q_p, size_t *qn_p,
                                             uint64_t *qh_p, tw_token_ids_t *out) {
  uint64_t h = 0;
  if (p) {
    h = tw_tok_hash(p, n);
    __builtin_prefetch(&e->tok->vmap[(uint32_t)h & e->tok->vmap_mask]);
  }
  if (*q_p) TW_CHECK(tw_tok_piece(e, *q_p, *qn_p, *qh_p, out));
  *q_p = p;
  *qn_p = n;
  *qh_p = h;
  return TW_OK;
}

/* Ordinary text (no added tokens): regex pieces -> BPE. */
static TW_NODISCARD tw_status_t tw_tok_ordinary(struct tw_tok_encoder *e, const char *text,
                                                size_t len, tw_token_ids_t *out) {
  const struct tw_tokenizer *t = e->tok;
  const unsigned char *s = (const unsigned char *)text;
  PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
  const unsigned char *q = NULL; /* the queued piece */
  size_t qn = 0;
  uint64_t qh = 0;
  size_t pos = 0;
  while (pos < len) {
    int rc = t->re_jit ? pcre2_jit_match(t->re, s, len, pos, PCRE2_NO_UTF_CHECK, e->md, e->mctx)
                       : pcre2_match(t->re, s, len, pos, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) { /* unmatched tail: its own piece */
      TW_CHECK(tw_tok_queue(e, s + pos, len - pos, &q, &qn, &qh, out));
      break;
    }
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      /* the input, not the tokenizer: e.g. megabytes of one whitespace run
       * exceed the matcher's limits; the caller can shorten it */
      if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
          rc == PCRE2_ERROR_HEAPLIMIT || rc == PCRE2_ERROR_JIT_STACKLIMIT)
        return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                            "text cannot be tokenized at byte %zu (%s): a run of %zu bytes the "
                            "pre-tokenizer cannot split within its limits; shorten it",
                            pos, (const char *)msg, len - pos);
      return tw_err(TW_ERR_INTERNAL, "tokenizer regex failed at byte %zu: %s", pos,
                    (const char *)msg);
    }
    size_t a = ov[0], b = ov[1];
    if (a > pos) TW_CHECK(tw_tok_queue(e, s + pos, a - pos, &q, &qn, &qh, out)); /* a gap */
    if (b == a) { /* empty match: cannot happen with §5.2; step one character */
      b = a + 1;
      while (b < len && (s[b] & 0xC0) == 0x80) b++;
    }
    TW_CHECK(tw_tok_queue(e, s + a, b - a, &q, &qn, &qh, out));
    pos = b;
  }
  return tw_tok_queue(e, NULL, 0, &q, &qn, &qh, out); /* flush */
}

/* The longest added token starting at s[0..n), or NULL. */
static const tw_tok_added_t *tw_tok_added_at(const struct tw_tokenizer *t, const char *s,
                                             size_t n) {
  for (size_t i = 0; i < t->n_added; i++) { /* sorted longest first */
    const tw_tok_added_t *a = &t->added[i];
    if (a->len <= n && memcmp(a->content, s, a->len) == 0) return a;
  }
  return NULL;
}

TW_NODISCARD tw_status_t tw_tok_encoder_encode(tw_tok_encoder_t *e, const char *text, size_t len,
                                               unsigned flags, tw_token_ids_t *out) {
  size_t bad;
  if (!tw_utf8_valid(text, len, &bad))
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "text is not valid UTF-8: bad byte 0x%02x at offset "
                  "%zu", (unsigned char)text[bad], bad);
  const struct tw_tokenizer *t = e->tok;
  size_t start_n = out->n;
  tw_status_t st = TW_OK;
  if (!(flags & TW_TOK_ALLOW_SPECIAL) || t->n_added == 0) {
    st = tw_tok_ordinary(e, text, len, out);
  } else {
    size_t seg = 0;
    for (size_t i = 0; i < len && st == TW_OK; i++) {
      if (t->added_first_only >= 0) { /* jump to the next possible start */
        const char *q = memchr(text + i, t->added_first_only, len - i);
        if (!q) break;
        i = (size_t)(q - text);
      } else if (!t->added_first[(unsigned char)text[i]]) {
        continue;
      }
      const tw_tok_added_t *a = tw_tok_added_at(t, text + i, len - i);
      if (!a) continue;
      if (i > seg) st = tw_tok_ordinary(e, text + seg, i - seg, out);
      if (st == TW_OK) st = tw_token_ids_push(out, a->id);
      i += a->len - 1;
      seg = i + 1;
    }
    if (st == TW_OK && seg < len) st = tw_tok_ordinary(e, text + seg, len - seg, out);
  }
  if (st < 0) out->n = start_n;
  return st;
}

TW_NODISCARD tw_status_t tw_tokenizer_encode(const tw_tokenizer_t *tok, const char *text,
                                             size_t len, unsigned flags, tw_token_ids_t *out) {
  tw_tok_encoder_t *e;
  TW_CHECK(tw_tok_encoder_create(tok, &e));
  tw_status_t st = tw_tok_encoder_encode(e, text, len, flags, out);
  tw_tok_encoder_destroy(e);
  return st;
}
