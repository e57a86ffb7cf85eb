/* tokenizer.c: loading a Hugging Face tokenizer.json (spec §5.1), id/byte
 * queries, decoding and the streaming UTF-8 decoder (spec §5.3, last rule).
 * Encoding lives in tokenizer_encode.c. */
#include "common/text/tokenizer.h"

#include "common/base/file_read.h"

#include "common/base/log.h"
#include "common/text/tokenizer_impl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- vectors ----------------------------------------------------------- */

void tw_token_ids_init(tw_token_ids_t *v) { memset(v, 0, sizeof *v); }

void tw_token_ids_fini(tw_token_ids_t *v) {
  free(v->ids);
  memset(v, 0, sizeof *v);
}

TW_NODISCARD tw_status_t tw_token_ids_reserve(tw_token_ids_t *v, size_t extra) {
  if (v->cap - v->n >= extra) return TW_OK;
  size_t cap = v->cap ? v->cap : 64;
  while (cap - v->n < extra) cap *= 2;
  int32_t *ids = realloc(v->ids, cap * sizeof *ids);
  if (!ids) return tw_err(TW_ERR_NO_MEMORY, "token ids: cannot grow to %zu ids", cap);
  v->ids = ids;
  v->cap = cap;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_token_ids_push(tw_token_ids_t *v, int32_t id) {
  if (v->n == v->cap) TW_CHECK(tw_token_ids_reserve(v, 1));
  v->ids[v->n++] = id;
  return TW_OK;
}

void tw_tok_buf_init(tw_tok_buf_t *b) { memset(b, 0, sizeof *b); }

void tw_tok_buf_fini(tw_tok_buf_t *b) {
  free(b->data);
  memset(b, 0, sizeof *b);
}

/* Room for len more bytes plus the NUL. */
static TW_NODISCARD tw_status_t tw_tok_buf_reserve(tw_tok_buf_t *b, size_t len) {
  if (b->cap - b->len < len + 1) {
    size_t cap = b->cap ? b->cap : 64;
    while (cap - b->len < len + 1) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) return tw_err(TW_ERR_NO_MEMORY, "text buffer: cannot grow to %zu bytes", cap);
    b->data = d;
    b->cap = cap;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_tok_buf_append(tw_tok_buf_t *b, const void *data, size_t len) {
  TW_CHECK(tw_tok_buf_reserve(b, len));
  if (len) memcpy(b->data + b->len, data, len);
  b->len += len;
  b->data[b->len] = '\0';
  return TW_OK;
}

/* ---- UTF-8 ------------------------------------------------------------- */

/* Length of the valid sequence at s[0..n), 0 if invalid, -k if it is a valid
 * but unfinished prefix of k bytes (only possible when it reaches the end). */
static int tw_utf8_seq(const unsigned char *s, size_t n) {
  unsigned c = s[0];
  if (c < 0x80) return 1;
  int len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c == 0xE0) { len = 3; lo = 0xA0; }
  else if (c >= 0xE1 && c <= 0xEC) len = 3;
  else if (c == 0xED) { len = 3; hi = 0x9F; } /* no surrogates */
  else if (c >= 0xEE && c <= 0xEF) len = 3;
  else if (c == 0xF0) { len = 4; lo = 0x90; }
  else if (c >= 0xF1 && c <= 0xF3) len = 4;
  else if (c == 0xF4) { len = 4; hi = 0x8F; }
  else return 0;
  for (int i = 1; i < len; i++) {
    if ((size_t)i >= n) return -i;
    unsigned b = s[i];
    if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

int tw_utf8_valid(const char *str, size_t len, size_t *bad_offset_p) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < len) {
    /* ASCII fast path, 8 bytes at a time */
    while (i + 8 <= len) {
      uint64_t v;
      memcpy(&v, s + i, 8);
      if (v & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= len) break;
    int k = tw_utf8_seq(s + i, len - i);
    if (k <= 0) {
      if (bad_offset_p) *bad_offset_p = i;
      return 0;
    }
    i += (size_t)k;
  }
  return 1;
}

/* ---- loading ----------------------------------------------------------- */

/* GPT-2 bytes_to_unicode, inverted: code point (< 324) -> byte, -1 if none. */
static void tw_tok_byte_decoder(int16_t inv[324]) {
  for (int i = 0; i < 324; i++) inv[i] = -1;
  int n = 0;
  for (int b = 0; b < 256; b++) {
    int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    if (printable) inv[b] = (int16_t)b;
    else inv[256 + n++] = (int16_t)b;
  }
}

/* Convert a byte-level vocab key to raw bytes into dst; returns the length or -1. */
static long tw_tok_key_to_bytes(const int16_t inv[324], const char *key, unsigned char *dst) {
  const unsigned char *s = (const unsigned char *)key;
  long n = 0;
  size_t len = strlen(key);
  for (size_t i = 0; i < len;) {
    int k = tw_utf8_seq(s + i, len - i);
    if (k <= 0) return -1;
    unsigned cp = k == 1 ? s[i] : k == 2 ? ((s[i] & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu) : 0xFFFFu;
    if (cp >= 324 || inv[cp] < 0) return -1;
    dst[n++] = (unsigned char)inv[cp];
    i += (size_t)k;
  }
  return n;
}

static uint32_t tw_pow2_at_least(size_t n) {
  uint32_t c = 1024;
  while (c < n) c *= 2;
  return c;
}

static void tw_tok_vmap_insert(struct tw_tokenizer *t, int32_t id) {
  const unsigned char *p = (const unsigned char *)t->bytes + t->tok_off[id];
  size_t n = t->tok_len[id];
  uint64_t h = tw_tok_hash(p, n);
  uint32_t i = (uint32_t)h & t->vmap_mask;
  while (t->vmap[i].id1) i = (i + 1) & t->vmap_mask;
  t->vmap[i].head = tw_tok_head8(p, n);
  t->vmap[i].id1 = (uint32_t)(id + 1);
  t->vmap[i].len = (uint32_t)n;
}

static int tw_tok_pair_insert(struct tw_tokenizer *t, int32_t a, int32_t b, uint32_t rank,
                              int32_t id) {
  uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
  uint32_t i = tw_tok_pair_hash(key) & t->pmap_mask;
  while (t->pmap[i].key != UINT64_MAX) {
    if (t->pmap[i].key == key) return 0; /* duplicate merge: the first (lowest rank) wins */
    i = (i + 1) & t->pmap_mask;
  }
  t->pmap[i].key = key;
  t->pmap[i].rank = rank;
  t->pmap[i].id = id;
  uint32_t bit = tw_tok_pair_filter_bit(key);
  t->pair_filter[bit >> 6] |= 1ull << (bit & 63);
  return 1;
}

/* Find the Split regex inside the pre_tokenizer (possibly inside a Sequence). */
static const char *tw_tok_find_split_regex(const cJSON *pre) {
  if (!cJSON_IsObject(pre)) return NULL;
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(pre, "type");
  if (cJSON_IsString(type) && strcmp(type->valuestring, "Sequence") == 0) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers");
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
      const char *r = tw_tok_find_split_regex(it);
      if (r) return r;
    }
    return NULL;
  }
  if (cJSON_IsString(type) && strcmp(type->valuestring, "Split") == 0) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(pre, "pattern");
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    if (cJSON_IsString(re)) return re->valuestring;
  }
  return NULL;
}

static int tw_tok_added_cmp(const void *a, const void *b) {
  const tw_tok_added_t *x = a, *y = b;
  if (x->len != y->len) return x->len > y->len ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Split one merges entry into its two parts (["a","b"] or the older "a b"). */
static int tw_tok_merge_parts(const cJSON *m, const char **a_p, const char **b_p, char *tmp,
                              size_t tmp_cap) {
  if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2) {
    const cJSON *a = cJSON_GetArrayItem(m, 0), *b = cJSON_GetArrayItem(m, 1);
    if (!cJSON_IsString(a) || !cJSON_IsString(b)) return 0;
    *a_p = a->valuestring;
    *b_p = b->valuestring;
    return 1;
  }
  if (cJSON_IsString(m)) {
    size_t n = strlen(m->valuestring);
    const char *sp = strchr(m->valuestring, ' ');
    if (!sp || n + 1 > tmp_cap) return 0;
    memcpy(tmp, m->valuestring, n + 1);
    tmp[sp - m->valuestring] = '\0';
    *a_p = tmp;
    *b_p = tmp + (sp - m->valuestring) + 1;
    return 1;
  }
  return 0;
}

static TW_NODISCARD tw_status_t tw_tok_build(struct tw_tokenizer *t, const cJSON *root) {
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
  const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
  if (!cJSON_IsString(mtype) || strcmp(mtype->valuestring, "BPE") != 0)
    return tw_err(TW_ERR_FORMAT, "tokenizer.json: model.type is not \"BPE\"");
  const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
  const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
  const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
  if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
    return tw_err(TW_ERR_FORMAT, "tokenizer.json: model.vocab or model.merges missing");
  /* HF: with ignore_merges a piece found in the vocab is one token (spec §5.3 step 1) */
  t->ignore_merges = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(model, "ignore_merges"));

  /* sizes: ids and bytes */
  long max_id = -1;
  size_t n_vocab = 0, key_bytes = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, vocab) {
    if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble > 16777216)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: vocab entry \"%s\" has no valid id",
                    it->string);
    if (it->valueint > max_id) max_id = it->valueint;
    key_bytes += strlen(it->string);
    n_vocab++;
  }
  cJSON_ArrayForEach(it, added) {
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
    if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > 16777216 ||
        !cJSON_IsString(content) || !content->valuestring[0])
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: an added_tokens entry lacks id or content");
    if (id->valueint > max_id) max_id = id->valueint;
    key_bytes += strlen(content->valuestring);
    t->n_added++;
  }
  if (max_id < 0) return tw_err(TW_ERR_FORMAT, "tokenizer.json: empty vocab");
  t->n_ids = (int32_t)max_id + 1;
  t->tok_off = calloc((size_t)t->n_ids, sizeof *t->tok_off);
  t->tok_len = malloc((size_t)t->n_ids * sizeof *t->tok_len);
  t->tok_flags = calloc((size_t)t->n_ids, 1);
  t->bytes = malloc(key_bytes + 1);
  t->vmap_mask = tw_pow2_at_least(n_vocab * 2) - 1;
  t->vmap = calloc((size_t)t->vmap_mask + 1, sizeof *t->vmap);
  t->added = calloc(t->n_added ? t->n_added : 1, sizeof *t->added);
  if (!t->tok_off || !t->tok_len || !t->tok_flags || !t->bytes || !t->vmap || !t->added)
    return tw_err(TW_ERR_NO_MEMORY, "tokenizer: cannot allocate tables for %d ids", t->n_ids);
  for (int32_t i = 0; i < t->n_ids; i++) t->tok_len[i] = TW_TOK_NO_TOKEN;

  int16_t inv[324];
  tw_tok_byte_decoder(inv);
  size_t off = 0;
  cJSON_ArrayForEach(it, vocab) {
    int32_t id = it->valueint;
    long n = tw_tok_key_to_bytes(inv, it->string, (unsigned char *)t->bytes + off);
    if (n <= 0)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: vocab key \"%s\" (id %d) is not byte-level",
                    it->string, id);
    if (t->tok_len[id] != TW_TOK_NO_TOKEN)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: id %d appears twice in the vocab", id);
    t->tok_off[id] = (uint32_t)off;
    t->tok_len[id] = (uint32_t)n;
    t->tok_flags[id] = TW_TOK_F_VOCAB;
    off += (size_t)n;
    if (tw_tok_vocab_find(t, (const unsigned char *)t->bytes + t->tok_off[id], (size_t)n) < 0)
      tw_tok_vmap_insert(t, id);
  }
  size_t k = 0;
  cJSON_ArrayForEach(it, added) {
    int32_t id = cJSON_GetObjectItemCaseSensitive(it, "id")->valueint;
    const char *content = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
    size_t n = strlen(content);
    memcpy(t->bytes + off, content, n);
    t->tok_off[id] = (uint32_t)off;
    t->tok_len[id] = (uint32_t)n;
    t->tok_flags[id] = TW_TOK_F_ADDED |
                       (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, "special"))
                            ? TW_TOK_F_SPECIAL : 0);
    static const char *const unsupported[] = {"lstrip", "rstrip", "single_word"};
    for (int u = 0; u < 3; u++)
      if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, unsupported[u])))
        TW_WARN("tok", "added token \"%s\" has %s=true, which is not implemented: it matches "
                "only its exact content", content, unsupported[u]);
    t->added[k].id = id;
    t->added[k].len = (uint32_t)n;
    t->added[k].content = t->bytes + off;
    t->added_first[(unsigned char)content[0]] = 1;
    off += n;
    k++;
  }
  qsort(t->added, t->n_added, sizeof *t->added, tw_tok_added_cmp);
  t->added_first_only = t->n_added ? (unsigned char)t->added[0].content[0] : -1;
  for (size_t i = 1; i < t->n_added; i++)
    if ((unsigned char)t->added[i].content[0] != t->added_first_only) t->added_first_only = -1;

  for (int b = 0; b < 256; b++) {
    unsigned char c = (unsigned char)b;
    t->byte_id[b] = tw_tok_vocab_find(t, &c, 1);
    if (t->byte_id[b] < 0)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: byte 0x%02x has no token (byte-level BPE "
                    "needs all 256)", b);
  }

  /* merges: pair -> (rank, merged id) */
  size_t n_merges = (size_t)cJSON_GetArraySize(merges);
  t->pmap_mask = tw_pow2_at_least(n_merges * 2) - 1;
  t->pmap = malloc(((size_t)t->pmap_mask + 1) * sizeof *t->pmap);
  t->pair_filter = calloc((size_t)1 << (TW_TOK_PAIR_FILTER_BITS - 6), sizeof *t->pair_filter);
  if (!t->pmap || !t->pair_filter)
    return tw_err(TW_ERR_NO_MEMORY, "tokenizer: cannot allocate the merge table");
  for (size_t i = 0; i <= t->pmap_mask; i++) t->pmap[i].key = UINT64_MAX;
  unsigned char buf[1024];
  char tmp[1024];
  uint32_t rank = 0;
  cJSON_ArrayForEach(it, merges) {
    const char *a, *b;
    if (!tw_tok_merge_parts(it, &a, &b, tmp, sizeof tmp) || strlen(a) + strlen(b) > 512)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: merge %u is not a pair of strings", rank);
    long na = tw_tok_key_to_bytes(inv, a, buf);
    long nb = na > 0 ? tw_tok_key_to_bytes(inv, b, buf + na) : -1;
    if (nb <= 0)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: merge %u (\"%s\" \"%s\") is not byte-level",
                    rank, a, b);
    int32_t ia = tw_tok_vocab_find(t, buf, (size_t)na);
    int32_t ib = tw_tok_vocab_find(t, buf + na, (size_t)nb);
    int32_t im = tw_tok_vocab_find(t, buf, (size_t)(na + nb));
    if (ia < 0 || ib < 0 || im < 0)
      return tw_err(TW_ERR_FORMAT, "tokenizer.json: merge %u (\"%s\" \"%s\"): a part or the "
                    "result is not in the vocab", rank, a, b);
    tw_tok_pair_insert(t, ia, ib, rank, im);
    rank++;
  }

  t->byte_pairs = malloc(65536 * sizeof *t->byte_pairs);
  if (!t->byte_pairs) return tw_err(TW_ERR_NO_MEMORY, "tokenizer: out of memory (byte pairs)");
  for (int a = 0; a < 256; a++) {
    for (int b = 0; b < 256; b++) {
      int32_t id = -1;
      uint32_t r = tw_tok_pair_find(t, t->byte_id[a], t->byte_id[b], &id);
      t->byte_pairs[a << 8 | b] = ((uint64_t)r << 32) | (uint32_t)id;
    }
  }

  const char *pattern = tw_tok_find_split_regex(cJSON_GetObjectItemCaseSensitive(root,
                                                                                 "pre_tokenizer"));
  if (!pattern)
    return tw_err(TW_ERR_FORMAT, "tokenizer.json: pre_tokenizer has no Split regex");
  return tw_tok_regex_compile(t, pattern);
}

TW_NODISCARD tw_status_t tw_tokenizer_load_json(const char *json, size_t len,
                                                tw_tokenizer_t **tok_p) {
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) return tw_err(TW_ERR_FORMAT, "tokenizer.json: not valid JSON");
  struct tw_tokenizer *t = calloc(1, sizeof *t);
  if (!t) {
    cJSON_Delete(root);
    return tw_err(TW_ERR_NO_MEMORY, "tokenizer: out of memory");
  }
  t->magic = TW_TOKENIZER_MAGIC;
  tw_status_t st = tw_tok_build(t, root);
  cJSON_Delete(root);
  if (st < 0) {
    tw_tokenizer_destroy(t);
    return st;
  }
  *tok_p = t;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_tokenizer_load(const char *path, tw_tokenizer_t **tok_p) {
  char *buf = NULL;
  size_t len = 0;
  TW_CHECK(tw_file_read(path, TW_TOKENIZER_MAX_FILE_BYTES, "tokenizer", &buf, &len));
  tw_status_t st = tw_tokenizer_load_json(buf, len, tok_p);
  free(buf);
  if (st == TW_OK) TW_DEBUG("tok", "loaded %s: %d ids", path, (*tok_p)->n_ids);
  return st;
}

void tw_tokenizer_destroy(tw_tokenizer_t *t) {
  if (!t) return;
  t->magic = 0;
  if (t->re) pcre2_code_free(t->re);
  free(t->tok_off);
  free(t->tok_len);
  free(t->tok_flags);
  free(t->bytes);
  free(t->vmap);
  free(t->pmap);
  free(t->pair_filter);
  free(t->byte_pairs);
  free(t->added);
  free(t);
}

/* ---- queries ----------------------------------------------------------- */

int32_t tw_tokenizer_n_ids(const tw_tokenizer_t *t) { return t->n_ids; }

TW_NODISCARD tw_status_t tw_tokenizer_find_added(const tw_tokenizer_t *t, const char *content,
                                                 int32_t *id_p) {
  size_t n = strlen(content);
  for (size_t i = 0; i < t->n_added; i++) {
    if (t->added[i].len == n && memcmp(t->added[i].content, content, n) == 0) {
      *id_p = t->added[i].id;
      return TW_OK;
    }
  }
  return tw_err_quiet(TW_ERR_NOT_FOUND, "tokenizer has no added token \"%s\"", content);
}

int tw_tokenizer_is_special(const tw_tokenizer_t *t, int32_t id) {
  return id >= 0 && id < t->n_ids && (t->tok_flags[id] & TW_TOK_F_SPECIAL);
}

TW_NODISCARD tw_status_t tw_tokenizer_token_bytes(const tw_tokenizer_t *t, int32_t id,
                                                  const char **bytes_p, size_t *len_p) {
  if (id < 0 || id >= t->n_ids || t->tok_len[id] == TW_TOK_NO_TOKEN)
    return tw_err_quiet(TW_ERR_OUT_OF_RANGE, "token id %d has no bytes (tokenizer has %d ids)",
                        id, t->n_ids);
  *bytes_p = t->bytes + t->tok_off[id];
  *len_p = t->tok_len[id];
  return TW_OK;
}

/* ---- decoding ---------------------------------------------------------- */

TW_NODISCARD tw_status_t tw_tokenizer_decode(const tw_tokenizer_t *t, const int32_t *ids, size_t n,
                                             unsigned flags, tw_tok_buf_t *out) {
  size_t total = 0;
  for (size_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (id < 0 || id >= t->n_ids || t->tok_len[id] == TW_TOK_NO_TOKEN)
      return tw_err_quiet(TW_ERR_OUT_OF_RANGE, "decode: token %zu is id %d, which has no bytes "
                    "(tokenizer has %d ids)", i, id, t->n_ids);
    total += t->tok_len[id];
  }
  TW_CHECK(tw_tok_buf_reserve(out, total));
  for (size_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if ((flags & TW_TOK_SKIP_SPECIAL) && (t->tok_flags[id] & TW_TOK_F_SPECIAL)) continue;
    memcpy(out->data + out->len, t->bytes + t->tok_off[id], t->tok_len[id]);
    out->len += t->tok_len[id];
  }
  out->data[out->len] = '\0';
  return TW_OK;
}

void tw_tok_stream_init(tw_tok_stream_t *s, const tw_tokenizer_t *tok, unsigned flags) {
  memset(s, 0, sizeof *s);
  s->tok = tok;
  s->flags = flags;
}

static const char tw_replacement[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Emit the valid part of p[0..n) to out; return how many trailing bytes form an
 * unfinished sequence (to keep). */
static TW_NODISCARD tw_status_t tw_tok_stream_emit(const unsigned char *p, size_t n,
                                                   tw_tok_buf_t *out, size_t *keep_p) {
  size_t i = 0, run = 0;
  while (i < n) {
    int k = tw_utf8_seq(p + i, n - i);
    if (k > 0) {
      i += (size_t)k;
      continue;
    }
    TW_CHECK(tw_tok_buf_append(out, p + run, i - run));
    if (k < 0) { /* unfinished, reaches the end */
      *keep_p = n - i;
      return TW_OK;
    }
    /* invalid: one U+FFFD for the maximal invalid subpart (lead + valid continuations) */
    size_t j = i + 1;
    unsigned c = p[i];
    int want = (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3
             : (c >= 0xF0 && c <= 0xF4) ? 4 : 1;
    for (int m = 1; m < want && j < n; m++) {
      /* a continuation is part of the subpart only if the prefix so far is valid */
      int kk = tw_utf8_seq(p + i, j + 1 - i);
      if (kk == 0) break;
      j++;
    }
    TW_CHECK(tw_tok_buf_append(out, tw_replacement, 3));
    i = j;
    run = i;
  }
  TW_CHECK(tw_tok_buf_append(out, p + run, n - run));
  *keep_p = 0;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_tok_stream_push(tw_tok_stream_t *s, int32_t id, tw_tok_buf_t *out) {
  const tw_tokenizer_t *t = s->tok;
  if (id < 0) return tw_err_quiet(TW_ERR_OUT_OF_RANGE, "token id %d is negative", id);
  if (id >= t->n_ids || t->tok_len[id] == TW_TOK_NO_TOKEN) return TW_OK; /* no text: skipped */
  if ((s->flags & TW_TOK_SKIP_SPECIAL) && (t->tok_flags[id] & TW_TOK_F_SPECIAL)) return TW_OK;
  const unsigned char *b = (const unsigned char *)t->bytes + t->tok_off[id];
  size_t n = t->tok_len[id];
  size_t keep = 0;
  if (s->n_pending == 0) {
    TW_CHECK(tw_tok_stream_emit(b, n, out, &keep));
    memcpy(s->pending, b + n - keep, keep);
    s->n_pending = (int)keep;
    return TW_OK;
  }
  /* join the held bytes with the head of this token: at most 3 + 3 bytes decide */
  unsigned char tmp[8];
  size_t head = n < 4 ? n : 4;
  size_t np = (size_t)s->n_pending;
  memcpy(tmp, s->pending, np);
  memcpy(tmp + np, b, head);
  int k = tw_utf8_seq(tmp, np + head);
  if (k < 0 && head == n) { /* still unfinished: hold all */
    memcpy(s->pending, tmp, np + head);
    s->n_pending = (int)(np + head);
    return TW_OK;
  }
  size_t used; /* bytes of this token consumed together with the pending ones */
  if (k > 0) {
    TW_CHECK(tw_tok_buf_append(out, tmp, (size_t)k));
    used = (size_t)k - np;
  } else {
    /* the held bytes start an invalid subpart; it takes the bytes of this token
     * that still continue a valid prefix, then one U+FFFD stands for all of it */
    used = 0;
    while (used < head && tw_utf8_seq(tmp, np + used + 1) < 0) used++;
    TW_CHECK(tw_tok_buf_append(out, tw_replacement, 3));
  }
  s->n_pending = 0;
  TW_CHECK(tw_tok_stream_emit(b + used, n - used, out, &keep));
  memcpy(s->pending, b + n - keep, keep);
  s->n_pending = (int)keep;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_utf8_lossy(const char *s, size_t len, tw_tok_buf_t *out) {
  size_t keep = 0;
  TW_CHECK(tw_tok_stream_emit((const unsigned char *)s, len, out, &keep));
  return keep ? tw_tok_buf_append(out, tw_replacement, 3) : TW_OK;
}

TW_NODISCARD tw_status_t tw_tok_stream_finish(tw_tok_stream_t *s, tw_tok_buf_t *out) {
  if (s->n_pending) {
    s->n_pending = 0;
    return tw_tok_buf_append(out, tw_replacement, 3);
  }
  return TW_OK;
}
