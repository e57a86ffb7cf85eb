/* test_tokenizer_unit.c: tokenizer behaviour that needs no reference run, on
 * the tiny model's tokenizer (tracked in tests/fixtures, so it always runs):
 * special tokens found by content (the tiny model numbers them 8000-8020, see
 * its tokenizer.json), invalid UTF-8 refused with the byte offset, the stream
 * decoder's UTF-8 rules (held bytes, U+FFFD per maximal invalid subpart as in
 * the Unicode standard's "best practice" that Rust's from_utf8_lossy follows),
 * skip-special decoding, very long pieces, and loader errors. */
#include "common/base/log.h"
#include "common/text/tokenizer.h"
#include "tests/test_expect.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int32_t byte_token(const tw_tokenizer_t *tok, unsigned char b) {
  for (int32_t id = 0; id < tw_tokenizer_n_ids(tok); id++) {
    const char *s;
    size_t n;
    if (tw_tokenizer_token_bytes(tok, id, &s, &n) == TW_OK && n == 1 && (unsigned char)s[0] == b)
      return id;
  }
  return -1;
}

/* Stream the bytes of `in` one single-byte token each, then finish. */
static void stream_bytes(const tw_tokenizer_t *tok, const char *in, size_t n, tw_tok_buf_t *out,
                         size_t *emitted_after_each) {
  tw_tok_stream_t s;
  tw_tok_stream_init(&s, tok, 0);
  out->len = 0;
  for (size_t i = 0; i < n; i++) {
    if (tw_tok_stream_push(&s, byte_token(tok, (unsigned char)in[i]), out) != TW_OK) fails++;
    if (emitted_after_each) emitted_after_each[i] = out->len;
  }
  if (tw_tok_stream_finish(&s, out) != TW_OK) fails++;
}

#define FFFD "\xef\xbf\xbd"

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  tw_log_init("test_tokenizer_unit", 0);
  tw_tokenizer_t *tok;
  if (tw_tokenizer_load(argv[1], &tok) != TW_OK) {
    fprintf(stderr, "FAIL: load %s: %s\n", argv[1], tw_last_error());
    return 1;
  }
  int32_t id;
  EXPECT(tw_tokenizer_n_ids(tok) == 8021, "n_ids %d", tw_tokenizer_n_ids(tok));
  EXPECT(tw_tokenizer_find_added(tok, "<|start|>", &id) == TW_OK && id == 8008, "<|start|> %d", id);
  EXPECT(tw_tokenizer_find_added(tok, "<|return|>", &id) == TW_OK && id == 8004, "<|return|>");
  EXPECT(tw_tokenizer_find_added(tok, "<|call|>", &id) == TW_OK && id == 8014, "<|call|>");
  EXPECT(tw_tokenizer_find_added(tok, "<|nope|>", &id) == TW_ERR_NOT_FOUND, "unknown added");
  EXPECT(tw_tokenizer_is_special(tok, 8009) && !tw_tokenizer_is_special(tok, 100), "is_special");
  const char *b;
  size_t bn;
  EXPECT(tw_tokenizer_token_bytes(tok, 8021, &b, &bn) == TW_ERR_OUT_OF_RANGE, "id past the end");
  EXPECT(tw_tokenizer_token_bytes(tok, -1, &b, &bn) == TW_ERR_OUT_OF_RANGE, "negative id");
  { /* a model's output id without bytes (past the tokenizer: the embedding is
     * larger) adds nothing to a stream, and what follows decodes as before */
    tw_tok_stream_t s;
    tw_tok_buf_t o;
    tw_tok_buf_init(&o);
    tw_tok_stream_init(&s, tok, 0);
    const int32_t a = byte_token(tok, 'a'), z = byte_token(tok, 'z');
    EXPECT(tw_tok_stream_push(&s, a, &o) == TW_OK && tw_tok_stream_push(&s, 8039, &o) == TW_OK &&
               tw_tok_stream_push(&s, 8021, &o) == TW_OK &&
               tw_tok_stream_push(&s, z, &o) == TW_OK && o.len == 2 && !memcmp(o.data, "az", 2),
           "stream: ids 8021 and 8039 (no bytes) between 'a' and 'z' give \"az\" (%zu bytes)",
           o.len);
    EXPECT(tw_tok_stream_push(&s, -1, &o) == TW_ERR_OUT_OF_RANGE && o.len == 2,
           "stream: a negative id is refused, nothing added");
    tw_tok_buf_fini(&o);
  }

  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  /* invalid UTF-8: refused, nothing appended, the offset named */
  struct { const char *s; size_t n, off; } bad[] = {
      {"ab\xc3(", 4, 2},          /* bad continuation */
      {"\xc0\x80", 2, 0},         /* overlong NUL */
      {"x\xed\xa0\x80", 4, 1},    /* UTF-16 surrogate */
      {"\xf4\x90\x80\x80", 4, 0}, /* above U+10FFFF */
      {"ok\xe2\x82", 4, 2},       /* truncated at the end */
      {"\xff", 1, 0},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    EXPECT_OK(tw_token_ids_push(&ids, 42));
    tw_status_t st = tw_tokenizer_encode(tok, bad[i].s, bad[i].n, 0, &ids);
    char want[64];
    snprintf(want, sizeof want, "offset %zu", bad[i].off);
    EXPECT(st == TW_ERR_INVALID_ARGUMENT && ids.n == 1 && strstr(tw_last_error(), want),
           "bad utf-8 %zu: st %d n %zu msg %s", i, st, ids.n, tw_last_error());
    ids.n = 0;
  }
  EXPECT(tw_tokenizer_encode(tok, "", 0, 0, &ids) == TW_OK && ids.n == 0, "empty text");

  /* special tokens: by content with the flag, as text without */
  const char *sp = "<|start|>user<|message|>hi<|end|>";
  ids.n = 0;
  EXPECT(tw_tokenizer_encode(tok, sp, strlen(sp), TW_TOK_ALLOW_SPECIAL, &ids) == TW_OK &&
             ids.n >= 5 && ids.ids[0] == 8008 && ids.ids[ids.n - 1] == 8009,
         "allow special: %zu ids", ids.n);
  tw_tok_buf_t text;
  tw_tok_buf_init(&text);
  EXPECT(tw_tokenizer_decode(tok, ids.ids, ids.n, TW_TOK_SKIP_SPECIAL, &text) == TW_OK &&
             !strcmp(text.data, "userhi"), "skip special: %s", text.data);
  text.len = 0;
  EXPECT(tw_tokenizer_decode(tok, ids.ids, ids.n, 0, &text) == TW_OK && !strcmp(text.data, sp),
         "decode with specials: %s", text.data);
  ids.n = 0;
  EXPECT_OK(tw_tokenizer_encode(tok, sp, strlen(sp), 0, &ids));
  int n_special = 0;
  for (size_t i = 0; i < ids.n; i++) n_special += tw_tokenizer_is_special(tok, ids.ids[i]);
  EXPECT(n_special == 0, "ordinary encoding made %d special ids", n_special);
  int32_t bad_ids[] = {5, 9000};
  text.len = 0;
  EXPECT(tw_tokenizer_decode(tok, bad_ids, 2, 0, &text) == TW_ERR_OUT_OF_RANGE && text.len == 0,
         "decode of an unknown id");

  /* a very long piece (BPE heap path): decodes back to itself */
  size_t long_n = 100000;
  char *longw = malloc(long_n);
  for (size_t i = 0; i < long_n; i++) longw[i] = "abcdefghij"[(i * 7 + i / 13) % 10];
  ids.n = 0;
  text.len = 0;
  EXPECT(tw_tokenizer_encode(tok, longw, long_n, 0, &ids) == TW_OK &&
             tw_tokenizer_decode(tok, ids.ids, ids.n, 0, &text) == TW_OK && text.len == long_n &&
             !memcmp(text.data, longw, long_n), "long word round trip");
  free(longw);

  /* regression: the BPE heap keeps stale entries; "thethe..." overflowed an
   * n-entry heap (heap corruption, abort at free) before it got 3n entries */
  long_n = 2000000;
  longw = malloc(long_n);
  for (size_t i = 0; i < long_n; i++) longw[i] = "the"[i % 3];
  ids.n = 0;
  text.len = 0;
  EXPECT(tw_tokenizer_encode(tok, longw, long_n, 0, &ids) == TW_OK &&
             tw_tokenizer_decode(tok, ids.ids, ids.n, 0, &text) == TW_OK && text.len == long_n &&
             !memcmp(text.data, longw, long_n), "2 MB 'thethe...' word round trip");
  /* 1 MB whitespace runs (the \s+(?!\S) lookahead backtracks over them) */
  for (size_t i = 0; i < long_n; i++) longw[i] = i < long_n / 2 ? ' ' : '\n';
  longw[long_n - 1] = 'x';
  ids.n = 0;
  text.len = 0;
  EXPECT(tw_tokenizer_encode(tok, longw, long_n, 0, &ids) == TW_OK &&
             tw_tokenizer_decode(tok, ids.ids, ids.n, 0, &text) == TW_OK && text.len == long_n &&
             !memcmp(text.data, longw, long_n), "1 MB blank runs round trip");
  free(longw);

  /* stream decoder */
  size_t after[8];
  stream_bytes(tok, "\xe2\x82\xac", 3, &text, after);
  EXPECT(after[0] == 0 && after[1] == 0 && !strcmp(text.data, "\xe2\x82\xac"),
         "euro held until complete");
  stream_bytes(tok, "\xe2\x82" "A", 3, &text, NULL);
  EXPECT(!strcmp(text.data, FFFD "A"), "E2 82 A -> one U+FFFD then A: %s", text.data);
  stream_bytes(tok, "\xe2" "A", 2, &text, NULL);
  EXPECT(!strcmp(text.data, FFFD "A"), "E2 A -> U+FFFD A");
  stream_bytes(tok, "\xed\xa0\x80", 3, &text, NULL);
  EXPECT(!strcmp(text.data, FFFD FFFD FFFD), "surrogate bytes -> 3 U+FFFD: %s", text.data);
  stream_bytes(tok, "\xf0\x9f", 2, &text, NULL);
  EXPECT(!strcmp(text.data, FFFD), "unfinished at the end -> one U+FFFD at finish");
  stream_bytes(tok, "\xff" "a\xc3\xa9", 4, &text, after);
  EXPECT(!strcmp(text.data, FFFD "a\xc3\xa9") && after[0] == 3, "FF at once, then a, e-acute");
  stream_bytes(tok, "\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", 8, &text, after);
  EXPECT(after[2] == 0 && after[3] == 4 && after[6] == 4 && after[7] == 8,
         "thumbs up + skin tone: whole characters only");

  /* 20 MiB of spaces: the pre-tokenizer's matcher gives up; that is the
   * caller's input (INVALID_ARGUMENT, nothing appended), not an internal error */
  {
    size_t big = (size_t)20 << 20;
    char *spaces = malloc(big);
    memset(spaces, ' ', big);
    size_t before = ids.n;
    tw_status_t bst = tw_tokenizer_encode(tok, spaces, big, 0, &ids);
    EXPECT(bst == TW_OK || (bst == TW_ERR_INVALID_ARGUMENT && ids.n == before &&
                            strstr(tw_last_error(), "cannot be tokenized")),
           "20 MiB of spaces: tokenized or INVALID_ARGUMENT, got %d: %s", (int)bst, tw_last_error());
    free(spaces);
  }

  /* loader errors */
  tw_tokenizer_t *t2;
  EXPECT(tw_tokenizer_load("/nonexistent/tokenizer.json", &t2) == TW_ERR_IO, "missing file");
  /* a FIFO nobody writes (a loader that waits hangs here) and a device: refused at once */
  char fifo[64];
  snprintf(fifo, sizeof fifo, "/tmp/tw_tok_fifo_%d.json", (int)getpid());
  EXPECT(mkfifo(fifo, 0600) == 0, "mkfifo");
  EXPECT(tw_tokenizer_load(fifo, &t2) == TW_ERR_INVALID_ARGUMENT &&
             strstr(tw_last_error(), "is not a regular file"), "FIFO: %s", tw_last_error());
  unlink(fifo);
  EXPECT(tw_tokenizer_load("/dev/zero", &t2) == TW_ERR_INVALID_ARGUMENT &&
             strstr(tw_last_error(), "tokenizer /dev/zero is not a regular file"),
         "/dev/zero: %s", tw_last_error());
  /* a regular file over the cap (sparse: no disk) is refused before any read */
  char huge[64];
  snprintf(huge, sizeof huge, "/tmp/tw_tok_huge_%d.json", (int)getpid());
  int hfd = open(huge, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  EXPECT(hfd >= 0 && ftruncate(hfd, (off_t)TW_TOKENIZER_MAX_FILE_BYTES + 1) == 0, "sparse file");
  if (hfd >= 0) close(hfd);
  EXPECT(tw_tokenizer_load(huge, &t2) == TW_ERR_FORMAT && strstr(tw_last_error(), "is larger than"),
         "a tokenizer.json over %zu bytes: %s", TW_TOKENIZER_MAX_FILE_BYTES, tw_last_error());
  unlink(huge);
  EXPECT(tw_tokenizer_load_json("{", 1, &t2) == TW_ERR_FORMAT, "not JSON");
  const char *no_bpe = "{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}";
  EXPECT(tw_tokenizer_load_json(no_bpe, strlen(no_bpe), &t2) == TW_ERR_FORMAT, "not BPE");
  const char *few = "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                    "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+\"}}}";
  EXPECT(tw_tokenizer_load_json(few, strlen(few), &t2) == TW_ERR_FORMAT &&
             strstr(tw_last_error(), "has no token"), "missing byte tokens: %s", tw_last_error());

  tw_token_ids_fini(&ids);
  tw_tok_buf_fini(&text);
  tw_tokenizer_destroy(tok);
  printf("%s\n", fails ? "FAILED" : "tokenizer unit checks passed");
  return fails ? 1 : 0;
}
