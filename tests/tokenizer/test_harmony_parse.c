/* test_harmony_parse.c: the streaming Harmony parser on the failure kinds seen
 * in other engines (spec §4.2 header variants, §4.4 stops, §4.8 tool calls).
 *
 *   test_harmony_parse TOKENIZER_JSON...
 *
 * Runs every case with each tokenizer given (the tiny model's, always present,
 * and the real one when setup.sh fetched it; a missing file is skipped). Input
 * ids are built from a small script: "<|x|>" pieces are the special tokens,
 * other text is encoded as ordinary text, and "{bytes:...}" pieces become one
 * single-byte token per byte (to split characters and arguments across tokens).
 * Expected messages are written out by hand. */
#include "common/base/log.h"
#include "common/text/harmony.h"
#include "common/text/tokenizer.h"
#include "tests/test_expect.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- recorder ----------------------------------------------------------- */

#define MAXM 16
typedef struct {
  char role[16], author[64], recipient[64], channel[32], ctype[32];
  char content[512];
  char deltas[512]; /* concatenated deltas */
  int n_deltas;
} rec_msg_t;

typedef struct {
  rec_msg_t msg[MAXM];
  int n_msg, n_started;
  char call_recipient[4][64], call_args[4][512];
  int n_calls;
  int n_errors;
  char last_error[512];
  int stop; /* tw_harmony_stop_t of the last STOP, -1 if none */
  int n_stops;
  int bad_utf8_delta;
} rec_t;

static void cp(char *dst, size_t cap, const char *s) { snprintf(dst, cap, "%s", s ? s : "-"); }

static void on_event(void *user, const tw_harmony_event_t *ev) {
  rec_t *r = user;
  rec_msg_t *m = r->n_started ? &r->msg[(r->n_started - 1) % MAXM] : &r->msg[0];
  switch (ev->kind) {
    case TW_HARMONY_EV_MESSAGE_START:
      m = &r->msg[r->n_started++ % MAXM];
      memset(m, 0, sizeof *m);
      cp(m->role, sizeof m->role, tw_harmony_role_str(ev->role));
      cp(m->author, sizeof m->author, ev->author);
      cp(m->recipient, sizeof m->recipient, ev->recipient);
      cp(m->channel, sizeof m->channel, ev->channel);
      cp(m->ctype, sizeof m->ctype, ev->content_type);
      break;
    case TW_HARMONY_EV_TEXT_DELTA:
      if (!tw_utf8_valid(ev->text, ev->text_len, NULL) || ev->text_len == 0) r->bad_utf8_delta++;
      strncat(m->deltas, ev->text, sizeof m->deltas - strlen(m->deltas) - 1);
      m->n_deltas++;
      break;
    case TW_HARMONY_EV_MESSAGE_END:
      cp(m->content, sizeof m->content, ev->text);
      r->n_msg++;
      break;
    case TW_HARMONY_EV_TOOL_CALL:
      if (r->n_calls < 4) {
        cp(r->call_recipient[r->n_calls], 64, ev->recipient);
        cp(r->call_args[r->n_calls], 512, ev->text);
      }
      r->n_calls++;
      break;
    case TW_HARMONY_EV_STOP:
      r->stop = (int)ev->stop;
      r->n_stops++;
      break;
    case TW_HARMONY_EV_ERROR:
      r->n_errors++;
      cp(r->last_error, sizeof r->last_error, ev->text);
      break;
  }
}

/* ---- building ids --------------------------------------------------------- */

static int32_t byte_token(const tw_tokenizer_t *tok, unsigned char b) {
  for (int32_t id = 0; id < tw_tokenizer_n_ids(tok); id++) {
    const char *s;
    size_t n;
    if (tw_tokenizer_token_bytes(tok, id, &s, &n) == TW_OK && n == 1 && (unsigned char)s[0] == b &&
        !tw_tokenizer_is_special(tok, id))
      return id;
  }
  return -1;
}

/* Script -> ids: "<|x|>" special, "{bytes:TEXT}" single-byte tokens, else text. */
static void build(const tw_tokenizer_t *tok, const char *script, tw_token_ids_t *ids) {
  ids->n = 0;
  const char *p = script;
  while (*p) {
    if (!strncmp(p, "{bytes:", 7)) {
      const char *e = strchr(p, '}');
      for (const char *q = p + 7; q < e; q++) EXPECT_OK(tw_token_ids_push(ids, byte_token(tok, (unsigned char)*q)));
      p = e + 1;
      continue;
    }
    if (!strncmp(p, "<|", 2)) {
      const char *e = strstr(p, "|>");
      char name[64];
      snprintf(name, sizeof name, "%.*s", (int)(e + 2 - p), p);
      int32_t id;
      if (tw_tokenizer_find_added(tok, name, &id) == TW_OK) {
        EXPECT_OK(tw_token_ids_push(ids, id));
        p = e + 2;
        continue;
      }
    }
    size_t n = 0;
    while (p[n] && strncmp(p + n, "{bytes:", 7) && strncmp(p + n, "<|", 2)) n++;
    if (n == 0) n = 2; /* a "<|" that is not a token: text */
    EXPECT_OK(tw_tokenizer_encode(tok, p, n, 0, ids));
    p += n;
  }
}

static void run(const tw_harmony_t *h, int in_header_of, const tw_token_ids_t *ids, int finish,
                rec_t *r) {
  memset(r, 0, sizeof *r);
  r->stop = -1;
  tw_harmony_parser_t *p;
  if (tw_harmony_parser_create(h, in_header_of, on_event, r, &p) != TW_OK) {
    fails++;
    return;
  }
  for (size_t i = 0; i < ids->n; i++)
    if (tw_harmony_parser_push(p, ids->ids[i]) != TW_OK) fails++;
  if (finish && tw_harmony_parser_finish(p) != TW_OK) fails++;
  tw_harmony_parser_destroy(p);
}

static void check_msg(const rec_t *r, int i, const char *role, const char *recipient,
                      const char *channel, const char *ctype, const char *content) {
  if (i >= r->n_msg) {
    EXPECT(0, "message %d missing (%d messages)", i, r->n_msg);
    return;
  }
  const rec_msg_t *m = &r->msg[i];
  EXPECT(!strcmp(m->role, role), "msg %d role %s, want %s", i, m->role, role);
  EXPECT(!strcmp(m->recipient, recipient), "msg %d recipient %s, want %s", i, m->recipient,
        recipient);
  EXPECT(!strcmp(m->channel, channel), "msg %d channel %s, want %s", i, m->channel, channel);
  EXPECT(!strcmp(m->ctype, ctype), "msg %d content type %s, want %s", i, m->ctype, ctype);
  EXPECT(!strcmp(m->content, content), "msg %d content \"%s\", want \"%s\"", i, m->content,
        content);
  EXPECT(!strcmp(m->deltas, m->content), "msg %d deltas \"%s\" != content", i, m->deltas);
}

static void cases(const tw_tokenizer_t *tok, const tw_harmony_t *h) {
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  rec_t r;
  const int A = TW_HARMONY_ROLE_ASSISTANT;

  tw_test_case = "analysis then final, return";
  build(tok, "<|channel|>analysis<|message|>User asks. Simple.<|end|><|start|>assistant<|channel|>"
             "final<|message|>Answer: caf\xc3\xa9 \xf0\x9f\x98\x80!<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 2 && r.n_errors == 0 && r.stop == TW_HARMONY_STOP_RETURN && r.n_calls == 0,
        "msgs %d errors %d (%s) stop %d", r.n_msg, r.n_errors, r.last_error, r.stop);
  check_msg(&r, 0, "assistant", "-", "analysis", "-", "User asks. Simple.");
  check_msg(&r, 1, "assistant", "-", "final", "-", "Answer: caf\xc3\xa9 \xf0\x9f\x98\x80!");

  tw_test_case = "tool-call arguments split into one token per byte while streaming";
  build(tok, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             "{bytes:{\"location\":\"Z\xc3\xbcrich \xe6\x9d\xb1\xe4\xba\xac\"}}<|call|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.n_errors == 0 && r.stop == TW_HARMONY_STOP_CALL && r.n_calls == 1,
        "msgs %d errors %d (%s) stop %d calls %d", r.n_msg, r.n_errors, r.last_error, r.stop,
        r.n_calls);
  check_msg(&r, 0, "assistant", "functions.get_weather", "commentary", "<|constrain|>json",
            "{\"location\":\"Z\xc3\xbcrich \xe6\x9d\xb1\xe4\xba\xac\"}");
  EXPECT(r.n_calls >= 1 && !strcmp(r.call_recipient[0], "functions.get_weather") &&
        !strcmp(r.call_args[0], "{\"location\":\"Z\xc3\xbcrich \xe6\x9d\xb1\xe4\xba\xac\"}"),
        "call %s %s", r.call_recipient[0], r.call_args[0]);
  EXPECT(r.msg[0].n_deltas >= 20 && r.bad_utf8_delta == 0,
        "%d deltas, %d not whole UTF-8 (split characters must be held back)", r.msg[0].n_deltas,
        r.bad_utf8_delta);

  tw_test_case = "recipient before the channel, bare json content type";
  build(tok, " to=functions.lookup<|channel|>commentary json<|message|>{\"q\": 1}<|call|>", &ids);
  run(h, A, &ids, 1, &r);
  check_msg(&r, 0, "assistant", "functions.lookup", "commentary", "json", "{\"q\": 1}");
  EXPECT(r.n_calls == 1 && r.n_errors == 0 && r.stop == TW_HARMONY_STOP_CALL, "calls %d errors %d",
        r.n_calls, r.n_errors);

  tw_test_case = "recipient inside the channel part, <|constrain|> glued to it";
  build(tok, "<|channel|>commentary to=functions.lookup<|constrain|>json<|message|>{}<|call|>", &ids);
  run(h, A, &ids, 1, &r);
  check_msg(&r, 0, "assistant", "functions.lookup", "commentary", "<|constrain|>json", "{}");
  EXPECT(r.n_calls == 1 && r.n_errors == 0, "calls %d errors %d", r.n_calls, r.n_errors);

  tw_test_case = "tool call ended by <|return|> instead of <|call|>";
  build(tok, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             "{\"city\":\"Paris\"}<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_calls == 1 && !strcmp(r.call_args[0], "{\"city\":\"Paris\"}"),
        "the tool call must not be lost: %d calls", r.n_calls);
  EXPECT(r.stop == TW_HARMONY_STOP_RETURN && r.n_errors == 1, "stop %d errors %d", r.stop,
        r.n_errors);

  tw_test_case = "answer straight to the final channel";
  build(tok, "<|channel|>final<|message|>Paris.<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.n_errors == 0 && r.stop == TW_HARMONY_STOP_RETURN, "msgs %d errors %d",
        r.n_msg, r.n_errors);
  check_msg(&r, 0, "assistant", "-", "final", "-", "Paris.");

  tw_test_case = "<|start|>assistant repeated between messages and at the beginning";
  build(tok, "<|start|>assistant<|channel|>analysis<|message|>hm<|end|><|start|>assistant"
             "<|start|>assistant<|channel|>final<|message|>ok<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 2 && r.n_errors == 0, "msgs %d errors %d (%s)", r.n_msg, r.n_errors,
        r.last_error);
  check_msg(&r, 0, "assistant", "-", "analysis", "-", "hm");
  check_msg(&r, 1, "assistant", "-", "final", "-", "ok");

  tw_test_case = "header without <|start|> after <|end|>";
  build(tok, "<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 2 && r.n_errors == 0, "msgs %d errors %d (%s)", r.n_msg, r.n_errors,
        r.last_error);
  check_msg(&r, 1, "assistant", "-", "final", "-", "b");

  tw_test_case = "text header without <|start|>: an assistant message, reported";
  build(tok, "<|channel|>analysis<|message|>a<|end|>\n\n<|start|>assistant<|channel|>final"
             "<|message|>b<|end|>assistant<|channel|>final<|message|>c<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 3 && r.n_errors == 1, "msgs %d errors %d (%s)", r.n_msg, r.n_errors,
        r.last_error);
  check_msg(&r, 1, "assistant", "-", "final", "-", "b");
  check_msg(&r, 2, "assistant", "-", "final", "-", "c");

  tw_test_case = "multi-turn history with earlier tool calls and results";
  build(tok, "<|start|>user<|message|>Weather in SF?<|end|>"
             "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
             "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
             "<|message|>{\"location\":\"SF\"}<|call|>"
             "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
             "{\"sunny\": true}<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
             "<|start|>user<|message|>Thanks<|end|><|start|>assistant", &ids);
  run(h, -1, &ids, 1, &r);
  EXPECT(r.n_msg == 6 && r.n_errors == 0 && r.n_calls == 1 && r.stop == TW_HARMONY_STOP_CALL,
        "msgs %d errors %d (%s) calls %d", r.n_msg, r.n_errors, r.last_error, r.n_calls);
  check_msg(&r, 0, "user", "-", "-", "-", "Weather in SF?");
  check_msg(&r, 2, "assistant", "functions.get_weather", "commentary", "<|constrain|>json",
            "{\"location\":\"SF\"}");
  check_msg(&r, 3, "tool", "assistant", "commentary", "-", "{\"sunny\": true}");
  EXPECT(!strcmp(r.msg[3].author, "functions.get_weather"), "tool author %s", r.msg[3].author);
  check_msg(&r, 5, "user", "-", "-", "-", "Thanks");

  tw_test_case = "unexpected specials inside content: error events, text kept";
  build(tok, "<|channel|>final<|message|>Hi<|message|> there<|channel|>!<|end|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.n_errors == 2, "msgs %d errors %d", r.n_msg, r.n_errors);
  check_msg(&r, 0, "assistant", "-", "final", "-", "Hi there!");

  tw_test_case = "ids without text (reserved range) are reported, not fatal";
  build(tok, "<|channel|>final<|message|>a", &ids);
  EXPECT_OK(tw_token_ids_push(&ids, tw_tokenizer_n_ids(tok) + 7));
  EXPECT_OK(tw_token_ids_push(&ids, -3));
  {
    tw_token_ids_t tail;
    tw_token_ids_init(&tail);
    build(tok, "b<|return|>", &tail);
    for (size_t i = 0; i < tail.n; i++) EXPECT_OK(tw_token_ids_push(&ids, tail.ids[i]));
    tw_token_ids_fini(&tail);
  }
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.n_errors == 2 && r.stop == TW_HARMONY_STOP_RETURN, "msgs %d errors %d",
        r.n_msg, r.n_errors);
  check_msg(&r, 0, "assistant", "-", "final", "-", "ab");

  tw_test_case = "message not ended before the next <|start|>";
  build(tok, "<|channel|>analysis<|message|>thinking<|start|>assistant<|channel|>final<|message|>"
             "done<|return|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 2 && r.n_errors == 1, "msgs %d errors %d", r.n_msg, r.n_errors);
  check_msg(&r, 0, "assistant", "-", "analysis", "-", "thinking");
  check_msg(&r, 1, "assistant", "-", "final", "-", "done");

  tw_test_case = "garbage header: skipped, parser resynchronises at <|start|>";
  build(tok, "<|start|><|channel|><|message|>lost<|end|><|start|>assistant<|channel|>final"
             "<|message|>found<|return|>", &ids);
  run(h, -1, &ids, 1, &r);
  EXPECT(r.n_msg >= 1 && r.n_errors >= 1, "msgs %d errors %d", r.n_msg, r.n_errors);
  EXPECT(r.n_msg >= 1 && !strcmp(r.msg[r.n_msg - 1].content, "found"), "last message %s",
        r.msg[r.n_msg ? r.n_msg - 1 : 0].content);

  tw_test_case = "cut off inside tool-call arguments (max tokens): no tool call";
  build(tok, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.n_calls == 0 && r.n_errors == 1 && r.stop == -1,
        "msgs %d calls %d errors %d", r.n_msg, r.n_calls, r.n_errors);

  tw_test_case = "an emoji split over four byte tokens comes out in one delta";
  build(tok, "<|channel|>final<|message|>{bytes:\xf0\x9f\x91\x8d}<|end|>", &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_msg == 1 && r.msg[0].n_deltas == 1 && r.bad_utf8_delta == 0,
        "deltas %d", r.msg[0].n_deltas);
  check_msg(&r, 0, "assistant", "-", "final", "-", "\xf0\x9f\x91\x8d");

  tw_test_case = "header bytes that are not UTF-8: fields get U+FFFD, never raw bytes";
  build(tok,
        "<|channel|>commentary to=functions.{bytes:\xbf}f{bytes:\xff} <|constrain|>json"
        "<|message|>{}<|call|>",
        &ids);
  run(h, A, &ids, 1, &r);
  EXPECT(r.n_calls == 1 && !strcmp(r.call_recipient[0],
                                   "functions.\xef\xbf\xbd"
                                   "f\xef\xbf\xbd"),
         "calls %d recipient \"%s\"", r.n_calls, r.call_recipient[0]);
  check_msg(&r, 0, "assistant",
            "functions.\xef\xbf\xbd"
            "f\xef\xbf\xbd",
            "commentary", "<|constrain|>json", "{}");

  tw_token_ids_fini(&ids);
}

int main(int argc, char **argv) {
  tw_log_init("test_harmony_parse", 0);
  int ran = 0;
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) {
      tw_test_skip_part("%s (missing; setup.sh fetches the real tokenizer)", argv[i]);
      continue;
    }
    fclose(f);
    tw_tokenizer_t *tok;
    tw_harmony_t *h;
    if (tw_tokenizer_load(argv[i], &tok) != TW_OK || tw_harmony_create(tok, &h) != TW_OK) {
      fprintf(stderr, "FAIL: load %s: %s\n", argv[i], tw_last_error());
      return 1;
    }
    int before = fails;
    cases(tok, h);
    printf("%s: parser cases %s\n", argv[i], fails == before ? "passed" : "FAILED");
    tw_harmony_destroy(h);
    tw_tokenizer_destroy(tok);
    ran++;
  }
  if (!ran) return TW_TEST_SKIP;
  return tw_test_exit("test_harmony_parse");
}
