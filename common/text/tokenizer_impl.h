/* tokenizer_impl.h: the inside of tw_tokenizer_t, shared by tokenizer.c
 * (loading, decoding) and tokenizer_encode.c (pre-tokenizer regex, BPE).
 * Not for other modules: use tokenizer.h. */
#ifndef TW_COMMON_TOKENIZER_IMPL_H
#define TW_COMMON_TOKENIZER_IMPL_H

#include "common/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <string.h>

#define TW_TOKENIZER_MAGIC 0x544f4b31u /* "TOK1" */
#define TW_TOK_NO_TOKEN UINT32_MAX     /* tok_len of an id without bytes */

enum { TW_TOK_F_VOCAB = 1, TW_TOK_F_ADDED = 2, TW_TOK_F_SPECIAL = 4 };

/* A merge: the pair (left id, right id) -> (priority, merged id). */
typedef struct {
  uint64_t key; /* (left << 32) | right; UINT64_MAX when the slot is empty */
  uint32_t rank;
  int32_t id;
} tw_tok_pair_slot_t;

/* A vocab entry in the byte-string map: its first 8 bytes inline. */
typedef struct {
  uint64_t head; /* tw_tok_head8 of the bytes */
  uint32_t id1;  /* id + 1; 0 when the slot is empty */
  uint32_t len;
} tw_tok_vocab_slot_t;

typedef struct {
  int32_t id;
  uint32_t len;
  const char *content; /* points into tw_tokenizer_t.bytes */
} tw_tok_added_t;

struct tw_tokenizer {
  uint32_t magic;
  int32_t n_ids;
  uint32_t *tok_off;        /* [n_ids] offset of the id's bytes in `bytes` */
  uint32_t *tok_len;        /* [n_ids] byte length, TW_TOK_NO_TOKEN if none */
  unsigned char *tok_flags; /* [n_ids] TW_TOK_F_* */
  char *bytes;              /* all token byte strings, back to back */
  tw_tok_vocab_slot_t *vmap; /* vocab byte string -> id, open addressing */
  uint32_t vmap_mask;
  tw_tok_pair_slot_t *pmap; /* merges, open addressing */
  uint32_t pmap_mask;
  /* one bit per hashed pair, set for every merge (512 KiB, stays in L2): most
   * adjacent pairs of a piece have no merge, and this answers them without
   * touching pmap (spec §5.3 loop: "until no adjacent pair is in the vocab") */
  uint64_t *pair_filter;
  int32_t byte_id[256];     /* the token of each single byte */
  /* merges of two single-byte tokens, by (first byte << 8 | second byte):
   * (rank << 32) | merged id, rank UINT32_MAX if none. 512 KiB, stays in L2:
   * the first merges of every piece look here instead of in pmap */
  uint64_t *byte_pairs;
  tw_tok_added_t *added;    /* sorted by content length, longest first */
  size_t n_added;
  unsigned char added_first[256]; /* 1 if some added token starts with this byte */
  int added_first_only;           /* the first byte of every added token if they share
                                     one ('<' for gpt-oss), else -1 */
  pcre2_code *re;                 /* the pre-tokenizer Split regex */
  int re_jit;                     /* 1 if JIT compiled */
  int ignore_merges;              /* model.ignore_merges: a piece in the vocab is one token */
};

/* 64-bit hash of a byte string (8 bytes per step; length mixed into the seed). */
static inline uint64_t tw_tok_hash(const unsigned char *p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  uint64_t v = 0;
  memcpy(&v, p, n);
  h = (h ^ v) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

/* The first min(n, 8) bytes of p as a little-endian word, zero padded. */
static inline uint64_t tw_tok_head8(const unsigned char *p, size_t n) {
  uint64_t v = 0;
  memcpy(&v, p, n < 8 ? n : 8);
  return v;
}

/* The vocab id of the byte string whose hash is h, or -1. One cache miss for
 * tokens up to 8 bytes (the slot holds them), two for longer ones. */
static inline int32_t tw_tok_vocab_find_h(const struct tw_tokenizer *t, const unsigned char *p,
                                          size_t n, uint64_t h) {
  uint64_t head = tw_tok_head8(p, n);
  for (uint32_t i = (uint32_t)h & t->vmap_mask;; i = (i + 1) & t->vmap_mask) {
    const tw_tok_vocab_slot_t *s = &t->vmap[i];
    if (!s->id1) return -1;
    if (s->len == n && s->head == head &&
        (n <= 8 || memcmp(t->bytes + t->tok_off[s->id1 - 1] + 8, p + 8, n - 8) == 0))
      return (int32_t)s->id1 - 1;
  }
}

static inline int32_t tw_tok_vocab_find(const struct tw_tokenizer *t, const unsigned char *p,
                                        size_t n) {
  return tw_tok_vocab_find_h(t, p, n, tw_tok_hash(p, n));
}

static inline uint32_t tw_tok_pair_hash(uint64_t key) {
  key *= 0x9E3779B97F4A7C15ull;
  return (uint32_t)(key >> 32);
}

#define TW_TOK_PAIR_FILTER_BITS 22
static inline uint32_t tw_tok_pair_filter_bit(uint64_t key) {
  return (uint32_t)((key * 0xD6E8FEB86659FD93ull) >> (64 - TW_TOK_PAIR_FILTER_BITS));
}

/* The merge of (a, b): its rank and merged id, or rank UINT32_MAX if none. */
static inline uint32_t tw_tok_pair_find(const struct tw_tokenizer *t, int32_t a, int32_t b,
                                        int32_t *id_p) {
  uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
  uint32_t bit = tw_tok_pair_filter_bit(key);
  if (!(t->pair_filter[bit >> 6] >> (bit & 63) & 1)) return UINT32_MAX;
  for (uint32_t i = tw_tok_pair_hash(key) & t->pmap_mask;; i = (i + 1) & t->pmap_mask) {
    const tw_tok_pair_slot_t *s = &t->pmap[i];
    if (s->key == key) {
      *id_p = s->id;
      return s->rank;
    }
    if (s->key == UINT64_MAX) return UINT32_MAX;
  }
}

/* Compile the pre-tokenizer pattern (Oniguruma/Rust syntax as in tokenizer.json)
 * with PCRE2 (tokenizer_encode.c). */
TW_NODISCARD tw_status_t tw_tok_regex_compile(struct tw_tokenizer *t, const char *pattern);

#endif
