/* harmony_parse.c: the streaming Harmony parser (spec §4.2 grammar, §4.4 stops).
 *
 * States: IDLE (between messages) -> HEADER (after <|start|>; text,
 * <|channel|> and <|constrain|> collect into a header string) -> CONTENT
 * (after <|message|>; text decoded by the stream decoder into deltas) and back
 * on <|end|>, <|call|> or <|return|>. DISCARD skips a broken message up to the
 * next <|start|>.
 *
 * Tolerance (what other engines got wrong): the recipient may stand before or
 * after the channel; <|constrain|>json or a bare "json" content type; a tool
 * call ended by <|return|> or <|end|> is still a tool call; <|start|>assistant
 * repeated before a header is accepted; a header without <|start|> (the model
 * writing <|channel|>final... straight after <|end|>) is accepted. Anything
 * else unexpected gives an ERROR event naming the token and parsing resumes at
 * the next <|start|> or message; no token is dropped without an event. */
#include "common/text/harmony.h"

#include "common/base/log.h"
#include "common/text/harmony_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_HARMONY_HEADER_MAX 1024 /* bytes; a longer header is garbage */

typedef enum { TW_PS_IDLE, TW_PS_HEADER, TW_PS_CONTENT, TW_PS_DISCARD } tw_parse_state_t;

struct tw_harmony_parser {
  const tw_harmony_t *h;
  tw_harmony_event_fn fn;
  void *user;
  tw_parse_state_t state;
  int default_role;      /* role of the header being read when it names none, or -1 */
  int implicit_header;   /* the header began without <|start|> */
  size_t n_messages;     /* messages started */
  size_t n_discarded;    /* tokens skipped in DISCARD */
  tw_tok_buf_t header;   /* raw header text, with "<|channel|>"/"<|constrain|>" spelled out */
  tw_tok_buf_t content;  /* the current message's text so far */
  tw_tok_buf_t delta;
  tw_tok_buf_t scratch;
  tw_tok_stream_t stream;
  /* the parsed header of the current message (strings in `fields`) */
  tw_harmony_role_t role;
  char fields[4][TW_HARMONY_HEADER_MAX + 1]; /* author, recipient, channel, content type */
  int has[4];
};

enum { F_AUTHOR, F_RECIPIENT, F_CHANNEL, F_CTYPE };

TW_NODISCARD tw_status_t tw_harmony_parser_create(const tw_harmony_t *h, int in_header_of,
                                                  tw_harmony_event_fn fn, void *user,
                                                  tw_harmony_parser_t **p_p) {
  tw_harmony_parser_t *p = calloc(1, sizeof *p);
  if (!p) return tw_err(TW_ERR_NO_MEMORY, "harmony parser: out of memory");
  p->h = h;
  p->fn = fn;
  p->user = user;
  p->default_role = in_header_of;
  p->state = in_header_of >= 0 ? TW_PS_HEADER : TW_PS_IDLE;
  tw_tok_stream_init(&p->stream, h->tok, 0);
  *p_p = p;
  return TW_OK;
}

void tw_harmony_parser_destroy(tw_harmony_parser_t *p) {
  if (!p) return;
  tw_tok_buf_fini(&p->header);
  tw_tok_buf_fini(&p->content);
  tw_tok_buf_fini(&p->delta);
  tw_tok_buf_fini(&p->scratch);
  free(p);
}

/* ---- events ------------------------------------------------------------- */

static void tw_emit(tw_harmony_parser_t *p, tw_harmony_event_kind_t kind, const char *text,
                    size_t len, tw_harmony_stop_t stop, int32_t token) {
  tw_harmony_event_t ev = {
      .kind = kind,
      .message_index = p->n_messages ? p->n_messages - 1 : 0,
      .role = p->role,
      .author = p->has[F_AUTHOR] ? p->fields[F_AUTHOR] : NULL,
      .recipient = p->has[F_RECIPIENT] ? p->fields[F_RECIPIENT] : NULL,
      .channel = p->has[F_CHANNEL] ? p->fields[F_CHANNEL] : NULL,
      .content_type = p->has[F_CTYPE] ? p->fields[F_CTYPE] : NULL,
      .text = text ? text : "",
      .text_len = text ? len : 0,
      .stop = stop,
      .token = token,
  };
  p->fn(p->user, &ev);
}

static void tw_emit_error(tw_harmony_parser_t *p, int32_t token, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void tw_emit_error(tw_harmony_parser_t *p, int32_t token, const char *fmt, ...) {
  char msg[TW_HARMONY_HEADER_MAX + 256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof msg) n = (int)sizeof msg - 1;
  TW_DEBUG("harmony", "parse error: %s", msg);
  tw_emit(p, TW_HARMONY_EV_ERROR, msg, (size_t)n, TW_HARMONY_STOP_NONE, token);
}

/* A printable name for a token id (its content if special). */
static const char *tw_tok_name(const tw_harmony_parser_t *p, int32_t id, char *buf, size_t cap) {
  const char *b;
  size_t n;
  if (tw_tokenizer_token_bytes(p->h->tok, id, &b, &n) == TW_OK &&
      tw_tokenizer_is_special(p->h->tok, id) && n < cap - 16) {
    snprintf(buf, cap, "%.*s (id %d)", (int)n, b, id);
  } else {
    snprintf(buf, cap, "id %d", id);
  }
  return buf;
}

/* ---- header ------------------------------------------------------------- */

static int tw_is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f'; }

static int tw_role_from(const char *s, size_t n, tw_harmony_role_t *role_p) {
  static const char *const names[] = {"system", "developer", "user", "assistant"};
  for (int i = 0; i < 4; i++) {
    if (strlen(names[i]) == n && memcmp(names[i], s, n) == 0) {
      *role_p = (tw_harmony_role_t)i;
      return 1;
    }
  }
  return 0;
}

static void tw_set_field(tw_harmony_parser_t *p, int f, const char *s, size_t n) {
  if (n > TW_HARMONY_HEADER_MAX) n = TW_HARMONY_HEADER_MAX;
  memcpy(p->fields[f], s, n);
  p->fields[f][n] = '\0';
  p->has[f] = 1;
}

/* Whether the header holds nothing but an optional role name (and blanks). */
static int tw_header_is_bare(const tw_harmony_parser_t *p) {
  const char *s = p->header.data ? p->header.data : "";
  size_t a = 0, b = p->header.len;
  while (a < b && tw_is_space(s[a])) a++;
  while (b > a && tw_is_space(s[b - 1])) b--;
  tw_harmony_role_t r;
  return a == b || tw_role_from(s + a, b - a, &r);
}

/* Parse the collected header (spec §4.2 parsing rules, tolerant). Returns 0 and
 * reports an ERROR if nothing usable is there. */
static int tw_parse_header(tw_harmony_parser_t *p, int32_t token) {
  static const char ch_marker[] = "<|channel|>", ct_marker[] = "<|constrain|>";
  const size_t chn = sizeof ch_marker - 1, ctn = sizeof ct_marker - 1;
  memset(p->has, 0, sizeof p->has);
  /* work on a copy where the channel part is blanked out; the model's bytes
   * may not be UTF-8, the fields (a recipient, a channel) must be */
  p->scratch.len = 0;
  if (tw_utf8_lossy(p->header.data ? p->header.data : "", p->header.len, &p->scratch) != TW_OK ||
      tw_tok_buf_append(&p->scratch, "", 0) != TW_OK)
    return 0;
  char *s = p->scratch.data;
  size_t len = p->scratch.len;
  char *ch = strstr(s, ch_marker);
  if (ch) {
    char *v = ch + chn, *e = v;
    while (*e && !tw_is_space(*e) && *e != '<') e++;
    if (e > v) tw_set_field(p, F_CHANNEL, v, (size_t)(e - v));
    memset(ch, ' ', (size_t)(e - ch));
    /* a second <|channel|> would be garbage in the content type: blank it too */
    for (char *x = strstr(s, ch_marker); x; x = strstr(x, ch_marker)) memset(x, ' ', chn);
  }
  /* normalise: a blank before each "<|constrain|>", none after it, so that
   * "to=x<|constrain|>json" and "<|constrain|> json" both give one part */
  p->delta.len = 0;
  for (size_t i = 0; i < len;) {
    if (!strncmp(s + i, ct_marker, ctn)) {
      if (tw_tok_buf_append(&p->delta, " ", 1) != TW_OK ||
          tw_tok_buf_append(&p->delta, ct_marker, ctn) != TW_OK)
        return 0;
      i += ctn;
      while (i < len && tw_is_space(s[i])) i++;
    } else {
      if (tw_tok_buf_append(&p->delta, s + i, 1) != TW_OK) return 0;
      i++;
    }
  }
  s = p->delta.data ? p->delta.data : "";
  len = p->delta.len;
  /* split on blanks */
  const char *parts[16];
  size_t lens[16], n_parts = 0, extra = 0;
  for (size_t i = 0; i < len;) {
    while (i < len && tw_is_space(s[i])) i++;
    if (i >= len) break;
    size_t j = i;
    while (j < len && !tw_is_space(s[j])) j++;
    if (n_parts < 16) {
      parts[n_parts] = s + i;
      lens[n_parts++] = j - i;
    } else {
      extra++;
    }
    i = j;
  }
  size_t first = 0;
  tw_harmony_role_t role;
  if (n_parts && tw_role_from(parts[0], lens[0], &role)) {
    p->role = role;
    tw_set_field(p, F_AUTHOR, parts[0], lens[0]);
    first = 1;
  } else if (n_parts && strncmp(parts[0], "to=", 3) != 0 && strncmp(parts[0], ct_marker, ctn) != 0 &&
             p->default_role < 0) {
    p->role = TW_HARMONY_ROLE_TOOL; /* an author that is not a role: a tool's name */
    tw_set_field(p, F_AUTHOR, parts[0], lens[0]);
    first = 1;
  } else if (p->default_role >= 0) {
    p->role = (tw_harmony_role_t)p->default_role;
    const char *rs = tw_harmony_role_str(p->role);
    tw_set_field(p, F_AUTHOR, rs, strlen(rs));
  } else if (p->has[F_CHANNEL]) {
    p->role = TW_HARMONY_ROLE_ASSISTANT; /* <|channel|> straight after <|end|>: the model's own */
    tw_set_field(p, F_AUTHOR, "assistant", 9);
  } else {
    tw_emit_error(p, token, "message header \"%.*s\" names no role; message skipped",
                  (int)(p->header.len > 200 ? 200 : p->header.len),
                  p->header.data ? p->header.data : "");
    return 0;
  }
  /* the rest: to=RECIPIENT, <|constrain|>TYPE, or bare words (spec §4.2 rules) */
  size_t rest = n_parts - first;
  for (size_t k = first; k < n_parts; k++) {
    const char *w = parts[k];
    size_t wn = lens[k];
    if (wn > 3 && !strncmp(w, "to=", 3)) {
      tw_set_field(p, F_RECIPIENT, w + 3, wn - 3);
    } else if (wn >= ctn && !strncmp(w, ct_marker, ctn)) {
      tw_set_field(p, F_CTYPE, w, wn);
    } else if (k == n_parts - 1 && rest >= 2 && !p->has[F_CTYPE]) {
      tw_set_field(p, F_CTYPE, w, wn); /* the last of several bare words: content type */
    } else if (!p->has[F_RECIPIENT]) {
      tw_set_field(p, F_RECIPIENT, w, wn);
    } else {
      extra++;
      tw_emit_error(p, token, "unexpected \"%.*s\" in message header; ignored", (int)wn, w);
    }
  }
  if (extra > 0 && n_parts == 16)
    tw_emit_error(p, token, "message header has more than 16 parts; the rest ignored");
  return 1;
}

/* ---- transitions -------------------------------------------------------- */

static void tw_begin_header(tw_harmony_parser_t *p, int default_role) {
  p->state = TW_PS_HEADER;
  p->header.len = 0;
  p->default_role = default_role;
  p->implicit_header = 0;
}

static TW_NODISCARD tw_status_t tw_begin_content(tw_harmony_parser_t *p, int32_t token) {
  /* "<|channel|>final<|message|>" straight after <|end|> is a known variant;
   * a header of other text without <|start|> is reported */
  if (p->implicit_header && (p->header.len < 11 || memcmp(p->header.data, "<|channel|>", 11)))
    tw_emit_error(p, token, "message header \"%.*s\" without <|start|>; read as an assistant "
                  "message", (int)(p->header.len > 200 ? 200 : p->header.len),
                  p->header.data ? p->header.data : "");
  if (!tw_parse_header(p, token)) {
    p->state = TW_PS_DISCARD;
    p->n_discarded = 0;
    return TW_OK;
  }
  p->n_messages++;
  p->state = TW_PS_CONTENT;
  p->content.len = 0;
  tw_tok_stream_init(&p->stream, p->h->tok, 0);
  tw_emit(p, TW_HARMONY_EV_MESSAGE_START, NULL, 0, TW_HARMONY_STOP_NONE, token);
  return TW_OK;
}

/* End the current message. `how`: END/CALL/RETURN token index, or -1 when cut
 * off (no tool call then). */
static TW_NODISCARD tw_status_t tw_end_message(tw_harmony_parser_t *p, int how, int32_t token) {
  p->delta.len = 0;
  TW_CHECK(tw_tok_stream_finish(&p->stream, &p->delta));
  if (p->delta.len) {
    TW_CHECK(tw_tok_buf_append(&p->content, p->delta.data, p->delta.len));
    tw_emit(p, TW_HARMONY_EV_TEXT_DELTA, p->delta.data, p->delta.len, TW_HARMONY_STOP_NONE, token);
  }
  TW_CHECK(tw_tok_buf_append(&p->content, "", 0));
  tw_emit(p, TW_HARMONY_EV_MESSAGE_END, p->content.data, p->content.len, TW_HARMONY_STOP_NONE,
          token);
  if (how >= 0 && p->role == TW_HARMONY_ROLE_ASSISTANT && p->has[F_RECIPIENT] &&
      strcmp(p->fields[F_RECIPIENT], "all") != 0) {
    if (how != TW_HT_CALL)
      tw_emit_error(p, token, "tool call to %s ended by %s instead of <|call|>; taken as a call",
                    p->fields[F_RECIPIENT], how == TW_HT_RETURN ? "<|return|>" : "<|end|>");
    tw_emit(p, TW_HARMONY_EV_TOOL_CALL, p->content.data, p->content.len, TW_HARMONY_STOP_NONE,
            token);
  } else if (how == TW_HT_CALL) {
    tw_emit_error(p, token, "<|call|> ends a message that has no recipient");
  }
  p->state = TW_PS_IDLE;
  if (how == TW_HT_RETURN || how == TW_HT_CALL)
    tw_emit(p, TW_HARMONY_EV_STOP, NULL, 0,
            how == TW_HT_RETURN ? TW_HARMONY_STOP_RETURN : TW_HARMONY_STOP_CALL, token);
  return TW_OK;
}

/* Which Harmony special `token` is (TW_HT_*), or -1. */
static int tw_which(const tw_harmony_parser_t *p, int32_t token) {
  for (int i = 0; i < TW_HT_COUNT; i++)
    if (p->h->ids[i] == token) return i;
  return -1;
}

TW_NODISCARD tw_status_t tw_harmony_parser_push(tw_harmony_parser_t *p, int32_t token) {
  int w = tw_which(p, token);
  char nb[96];
  const char *b;
  size_t bn;
  int has_bytes = tw_tokenizer_token_bytes(p->h->tok, token, &b, &bn) == TW_OK;
  int special = tw_tokenizer_is_special(p->h->tok, token);
  if (!has_bytes) {
    tw_emit_error(p, token, "token id %d has no text (reserved or outside the vocabulary); "
                  "ignored", token);
    return TW_OK;
  }
  switch (p->state) {
    case TW_PS_DISCARD:
      if (w == TW_HT_START) {
        tw_emit_error(p, token, "resynchronised at <|start|> after skipping %zu tokens",
                      p->n_discarded);
        tw_begin_header(p, -1);
      } else if (w == TW_HT_RETURN || w == TW_HT_CALL) {
        p->state = TW_PS_IDLE;
        tw_emit(p, TW_HARMONY_EV_STOP, NULL, 0,
                w == TW_HT_RETURN ? TW_HARMONY_STOP_RETURN : TW_HARMONY_STOP_CALL, token);
      } else {
        p->n_discarded++;
      }
      return TW_OK;
    case TW_PS_IDLE:
      if (w == TW_HT_START) {
        tw_begin_header(p, -1);
      } else if (w == TW_HT_CHANNEL || !special) {
        /* a header without <|start|> (generated: the model's own message) */
        tw_begin_header(p, TW_HARMONY_ROLE_ASSISTANT);
        p->implicit_header = 1;
        return tw_harmony_parser_push(p, token);
      } else if (w == TW_HT_RETURN || w == TW_HT_CALL) {
        tw_emit(p, TW_HARMONY_EV_STOP, NULL, 0,
                w == TW_HT_RETURN ? TW_HARMONY_STOP_RETURN : TW_HARMONY_STOP_CALL, token);
      } else {
        tw_emit_error(p, token, "unexpected %s between messages; ignored",
                      tw_tok_name(p, token, nb, sizeof nb));
      }
      return TW_OK;
    case TW_PS_HEADER:
      if (w == TW_HT_MESSAGE) return tw_begin_content(p, token);
      if (w == TW_HT_START) {
        if (!tw_header_is_bare(p))
          tw_emit_error(p, token, "message header \"%.*s\" not finished before <|start|>; "
                        "dropped", (int)(p->header.len > 200 ? 200 : p->header.len),
                        p->header.data);
        tw_begin_header(p, -1); /* a repeated <|start|>assistant is fine */
        return TW_OK;
      }
      if (w == TW_HT_CHANNEL || w == TW_HT_CONSTRAIN || !special) {
        if (p->header.len + bn > TW_HARMONY_HEADER_MAX) {
          tw_emit_error(p, token, "message header longer than %d bytes; skipping to the next "
                        "<|start|>", TW_HARMONY_HEADER_MAX);
          p->state = TW_PS_DISCARD;
          p->n_discarded = 0;
          return TW_OK;
        }
        return tw_tok_buf_append(&p->header, b, bn);
      }
      if (w == TW_HT_RETURN || w == TW_HT_CALL || w == TW_HT_END) {
        tw_emit_error(p, token, "%s inside a message header \"%.*s\"; message dropped",
                      tw_tok_name(p, token, nb, sizeof nb),
                      (int)(p->header.len > 200 ? 200 : p->header.len),
                      p->header.data ? p->header.data : "");
        p->state = TW_PS_IDLE;
        if (w != TW_HT_END)
          tw_emit(p, TW_HARMONY_EV_STOP, NULL, 0,
                  w == TW_HT_RETURN ? TW_HARMONY_STOP_RETURN : TW_HARMONY_STOP_CALL, token);
        return TW_OK;
      }
      tw_emit_error(p, token, "unexpected %s in a message header; ignored",
                    tw_tok_name(p, token, nb, sizeof nb));
      return TW_OK;
    case TW_PS_CONTENT:
      if (w == TW_HT_END || w == TW_HT_CALL || w == TW_HT_RETURN)
        return tw_end_message(p, w, token);
      if (w == TW_HT_START) {
        tw_emit_error(p, token, "message not ended before <|start|>; ended here");
        TW_CHECK(tw_end_message(p, TW_HT_END, token));
        tw_begin_header(p, -1);
        return TW_OK;
      }
      if (special) {
        tw_emit_error(p, token, "unexpected %s inside message content; ignored",
                      tw_tok_name(p, token, nb, sizeof nb));
        return TW_OK;
      }
      p->delta.len = 0;
      TW_CHECK(tw_tok_stream_push(&p->stream, token, &p->delta));
      if (p->delta.len) {
        TW_CHECK(tw_tok_buf_append(&p->content, p->delta.data, p->delta.len));
        tw_emit(p, TW_HARMONY_EV_TEXT_DELTA, p->delta.data, p->delta.len, TW_HARMONY_STOP_NONE,
                token);
      }
      return TW_OK;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_harmony_parser_finish(tw_harmony_parser_t *p) {
  switch (p->state) {
    case TW_PS_CONTENT:
      tw_emit_error(p, -1, "generation ended inside a message (no <|end|>, <|call|> or "
                    "<|return|>)");
      TW_CHECK(tw_end_message(p, -1, -1));
      break;
    case TW_PS_HEADER:
      if (!tw_header_is_bare(p))
        tw_emit_error(p, -1, "generation ended inside the message header \"%.*s\"",
                      (int)(p->header.len > 200 ? 200 : p->header.len), p->header.data);
      break;
    case TW_PS_DISCARD:
      tw_emit_error(p, -1, "generation ended while skipping a broken message (%zu tokens)",
                    p->n_discarded);
      break;
    case TW_PS_IDLE: break;
  }
  p->state = TW_PS_IDLE;
  return TW_OK;
}
