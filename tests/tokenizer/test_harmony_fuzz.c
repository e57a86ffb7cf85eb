/* test_harmony_fuzz.c: random token streams through the Harmony parser.
 *
 *   test_harmony_fuzz TOKENIZER_JSON [SEQUENCES]
 *
 * Seeded (reproducible) sequences mixing Harmony specials (often), other added
 * tokens, single-byte tokens that split UTF-8, ordinary ids, ids without text
 * (reserved range, negative) and well-formed messages. Checked invariants: the
 * parser never fails; every text delta is non-empty valid UTF-8; the deltas of
 * a message add up to its MESSAGE_END text; starts and ends pair up after
 * finish; a TOOL_CALL comes right after a MESSAGE_END with a recipient; every
 * STOP follows a <|return|> or <|call|> token. Bounded: SEQUENCES x 300 ids. */
#include "common/base/log.h"
#include "common/text/harmony.h"
#include "common/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int open;            /* a message started and not ended */
  size_t starts, ends, errors, calls, stops;
  tw_tok_buf_t deltas; /* deltas of the open message */
  int last_was_end_with_recipient;
  int32_t last_token;
  int32_t stop_ids[2];
  int bad;
  char why[256];
} fz_t;

static void fz_fail(fz_t *f, const char *why) {
  if (!f->bad) snprintf(f->why, sizeof f->why, "%s", why);
  f->bad = 1;
}

static void on_event(void *user, const tw_harmony_event_t *ev) {
  fz_t *f = user;
  int after_end = f->last_was_end_with_recipient;
  f->last_was_end_with_recipient = 0;
  switch (ev->kind) {
    case TW_HARMONY_EV_MESSAGE_START:
      if (f->open) fz_fail(f, "start while a message is open");
      f->open = 1;
      f->starts++;
      f->deltas.len = 0;
      break;
    case TW_HARMONY_EV_TEXT_DELTA:
      if (!f->open) fz_fail(f, "delta outside a message");
      if (!ev->text_len || !tw_utf8_valid(ev->text, ev->text_len, NULL))
        fz_fail(f, "delta empty or not UTF-8");
      if (tw_tok_buf_append(&f->deltas, ev->text, ev->text_len) != TW_OK)
        fz_fail(f, "out of memory keeping the deltas");
      break;
    case TW_HARMONY_EV_MESSAGE_END:
      if (!f->open) fz_fail(f, "end without start");
      if (ev->text_len != f->deltas.len || (ev->text_len && memcmp(ev->text, f->deltas.data,
                                                                   ev->text_len)))
        fz_fail(f, "deltas do not add up to the content");
      if (!tw_utf8_valid(ev->text, ev->text_len, NULL)) fz_fail(f, "content not UTF-8");
      f->open = 0;
      f->ends++;
      f->last_was_end_with_recipient = ev->recipient != NULL;
      break;
    case TW_HARMONY_EV_TOOL_CALL:
      if (!after_end || !ev->recipient) fz_fail(f, "tool call not right after its message");
      f->calls++;
      break;
    case TW_HARMONY_EV_STOP:
      if (ev->token != f->stop_ids[0] && ev->token != f->stop_ids[1])
        fz_fail(f, "stop on a token that is not <|return|> or <|call|>");
      f->stops++;
      break;
    case TW_HARMONY_EV_ERROR:
      if (!ev->text_len) fz_fail(f, "error without a message");
      f->errors++;
      f->last_was_end_with_recipient = after_end; /* an error may sit between end and call */
      break;
  }
}

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(uint32_t n) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state % n);
}

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  tw_log_init("test_harmony_fuzz", 0);
  int n_seq = argc > 2 ? atoi(argv[2]) : 3000;
  tw_tokenizer_t *tok;
  tw_harmony_t *h;
  if (tw_tokenizer_load(argv[1], &tok) != TW_OK || tw_harmony_create(tok, &h) != TW_OK) {
    fprintf(stderr, "FAIL: load %s: %s\n", argv[1], tw_last_error());
    return 1;
  }
  const char *names[] = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                         "<|return|>", "<|call|>", "<|endoftext|>", "<|endofprompt|>"};
  int32_t specials[9];
  for (int i = 0; i < 9; i++) specials[i] = tw_harmony_token(h, names[i]);
  int32_t n_ids = tw_tokenizer_n_ids(tok);
  /* fragments of well-formed headers and bodies, as ordinary ids */
  const char *frags[] = {"assistant", "user", " to=functions.get_weather", "commentary", "final",
                         "analysis", "json", " ", "{\"a\": 1}", "functions.x", "caf\xc3\xa9",
                         "\xf0\x9f\x91\x8d", " to=", "to=assistant"};
  tw_token_ids_t frag_ids[14];
  for (int i = 0; i < 14; i++) {
    tw_token_ids_init(&frag_ids[i]);
    if (tw_tokenizer_encode(tok, frags[i], strlen(frags[i]), 0, &frag_ids[i]) != TW_OK) {
      fprintf(stderr, "FAIL: cannot encode \"%s\": %s\n", frags[i], tw_last_error());
      return 1;
    }
  }
  int32_t byte_ids[256];
  for (int b = 0; b < 256; b++) byte_ids[b] = -1;
  for (int32_t c = 0; c < n_ids; c++) {
    const char *bytes;
    size_t bn;
    if (tw_tokenizer_token_bytes(tok, c, &bytes, &bn) == TW_OK && bn == 1 &&
        byte_ids[(unsigned char)bytes[0]] < 0)
      byte_ids[(unsigned char)bytes[0]] = c;
  }
  size_t total_tokens = 0, total_errors = 0, total_msgs = 0, failures = 0;
  for (int s = 0; s < n_seq; s++) {
    fz_t f = {.stop_ids = {specials[5], specials[6]}};
    tw_tok_buf_init(&f.deltas);
    tw_harmony_parser_t *p;
    if (tw_harmony_parser_create(h, rnd(2) ? TW_HARMONY_ROLE_ASSISTANT : -1, on_event, &f, &p) !=
        TW_OK)
      return 1;
    for (int k = 0; k < 300;) {
      uint32_t r = rnd(100);
      if (r < 30) {
        int32_t id = specials[rnd(9)];
        if (tw_harmony_parser_push(p, id) != TW_OK) fz_fail(&f, "push failed");
        k++;
      } else if (r < 60) {
        const tw_token_ids_t *fr = &frag_ids[rnd(14)];
        for (size_t q = 0; q < fr->n; q++, k++)
          if (tw_harmony_parser_push(p, fr->ids[q]) != TW_OK) fz_fail(&f, "push failed");
      } else if (r < 75) { /* a single byte, often part of a multi-byte character */
        unsigned char b = (unsigned char)(r < 70 ? 0x80 + rnd(0x78) : rnd(256));
        if (tw_harmony_parser_push(p, byte_ids[b]) != TW_OK) fz_fail(&f, "push failed");
        k++;
      } else if (r < 95) {
        if (tw_harmony_parser_push(p, (int32_t)rnd((uint32_t)n_ids)) != TW_OK)
          fz_fail(&f, "push failed");
        k++;
      } else {
        int32_t junk = r < 97 ? -(int32_t)rnd(5) - 1 : n_ids + (int32_t)rnd(2000);
        if (tw_harmony_parser_push(p, junk) != TW_OK) fz_fail(&f, "push failed");
        k++;
      }
    }
    if (tw_harmony_parser_finish(p) != TW_OK) fz_fail(&f, "finish failed");
    if (f.open || f.starts != f.ends) fz_fail(&f, "starts and ends do not pair up after finish");
    tw_harmony_parser_destroy(p);
    total_tokens += 300;
    total_errors += f.errors;
    total_msgs += f.ends;
    if (f.bad) {
      if (failures < 5) fprintf(stderr, "FAIL sequence %d: %s\n", s, f.why);
      failures++;
    }
    tw_tok_buf_fini(&f.deltas);
  }
  for (int i = 0; i < 14; i++) tw_token_ids_fini(&frag_ids[i]);
  printf("%d sequences, ~%zu ids: %zu messages, %zu error events, %zu invariant failures\n", n_seq,
         total_tokens, total_msgs, total_errors, failures);
  tw_harmony_destroy(h);
  tw_tokenizer_destroy(tok);
  return failures ? 1 : 0;
}
