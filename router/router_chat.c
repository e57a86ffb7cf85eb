/* router_chat.c: Chat requests in the router. A twain.v1.ChatRequest becomes
 * a Harmony conversation rendered to prompt ids (spec §4.5-§4.7, through
 * common/text/harmony.h); generated ids go through the streaming Harmony parser
 * and come back as per-channel deltas, tool calls and, at the end, the parsed
 * messages. Generation stops on <|return|> or <|call|> (spec §4.4) or on a
 * stop string in the final channel.
 *
 * tool_choice (twain_api.proto ChatRequest): FUNCTION, and REQUIRED with one
 * tool, append the call's header as the model writes it to the rendered
 * prompt and feed the same ids to the parser, so generation starts inside
 * that call's arguments; the answer ends when the call does (<|call|>, or
 * <|end|>/<|return|>: nothing that follows a forced call is kept). REQUIRED
 * with several tools first runs a choice pass (prompt ending in
 * "<|channel|>commentary to", a few ids, stopped at any Harmony special id,
 * nothing streamed): the function it names becomes the forced call, run from
 * a new prefill (router.c requeues the request). */
#include "router/router_impl.h"

#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/text/harmony.h"
#include "common/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  tw_tokenizer_t *tok;
  tw_tok_encoder_t *enc;
  tw_harmony_t *h;
  int32_t stop_return, stop_call;
  /* the choice pass stops at any of these (after the name comes one of them) */
  int32_t pass_stops[7];
} tw_rchat_ctx_t;

#define TW_RCHAT_MAX 256 /* deltas/tool calls per feed, messages per request */

struct tw_rchat {
  tw_harmony_parser_t *parser;
  /* current message header (owned) */
  char *role, *channel, *recipient, *content_type, *author;
  bool first_delta;
  /* this feed's output (strings owned, freed at the next feed) */
  Twain__V1__Delta deltas[TW_RCHAT_MAX];
  Twain__V1__Delta *dptr[TW_RCHAT_MAX];
  size_t n_deltas;
  Twain__V1__ToolCall calls[TW_RCHAT_MAX];
  Twain__V1__ToolCall *cptr[TW_RCHAT_MAX];
  size_t n_calls;
  char *feed_strings[7 * TW_RCHAT_MAX]; /* 4 per delta, 3 per tool call: never full */
  size_t n_feed_strings;
  /* finished messages (owned) */
  Twain__V1__Message msgs[TW_RCHAT_MAX];
  Twain__V1__Message *mptr[TW_RCHAT_MAX];
  size_t n_msgs;
  /* stop strings on the final channel */
  char **stops;
  size_t n_stops;
  tw_tok_buf_t final_text;
  size_t final_sent; /* bytes of final_text in deltas so far (tw_stop_holdback) */
  bool stop_hit;
  bool stream;
  /* model output the parser did not expect: counted, logged once per request */
  tw_metric_t *unexpected;
  uint64_t req_id;
  int32_t n_unexpected;
  bool finishing; /* in parser_finish: a message cut by max_tokens or a stop is expected */
  bool cut;       /* parser_finish ended a message that had text: it was cut off */
  bool in_analysis; /* inside an analysis message's text (not addressed to a tool) */
  int32_t n_reasoning; /* ids of analysis text, for usage.reasoning_tokens */
  /* tool_choice REQUIRED among several tools: the choice pass (its prompt
   * ends in "<|channel|>commentary to"; the model writes "=functions.NAME") */
  bool choosing;
  bool forced;      /* the answer is the call whose header the router wrote */
  bool forced_done; /* ... and that call ended: the answer is complete */
  char **names;     /* the declared functions (owned) */
  size_t n_names;
  tw_token_ids_t base;            /* the rendered prompt, without the header */
  int32_t max_tokens;             /* the request's, while the pass runs with fewer */
  int32_t stop_ids[TW_RMAX_STOP]; /* the request's stop ids, likewise */
  int32_t n_stop;
  tw_tok_stream_t pick_dec;
  tw_tok_buf_t pick; /* what the pass wrote */
  uint64_t pick_id;  /* the attempt (q->id) it comes from: a retried pass starts over */
};

static char *tw_dup(const char *s) { return s ? strdup(s) : NULL; }

static char *tw_feed_str(struct tw_rchat *c, const char *s, size_t len) {
  if (c->n_feed_strings == sizeof c->feed_strings / sizeof c->feed_strings[0]) return (char *)"";
  char *d = malloc(len + 1);
  if (!d) return (char *)"";
  memcpy(d, s, len);
  d[len] = '\0';
  c->feed_strings[c->n_feed_strings++] = d;
  return d;
}

/* Append text to d->content, a string of this feed's (grown in place: a
 * message's text may come in many pieces within one feed). Out of memory:
 * the piece is dropped and logged. */
static void tw_feed_append(struct tw_rchat *c, Twain__V1__Delta *d, const char *text, size_t len) {
  for (size_t i = c->n_feed_strings; i-- > 0;) {
    if (c->feed_strings[i] != d->content) continue;
    size_t ol = strlen(d->content);
    char *m = realloc(d->content, ol + len + 1);
    if (!m) break;
    memcpy(m + ol, text, len);
    m[ol + len] = '\0';
    c->feed_strings[i] = d->content = m;
    return;
  }
  TW_WARN("router", "request %llu: out of memory: %zu bytes of output text dropped",
          (unsigned long long)c->req_id, len);
}

static void tw_feed_reset(struct tw_rchat *c) {
  for (size_t i = 0; i < c->n_feed_strings; i++) free(c->feed_strings[i]);
  c->n_feed_strings = c->n_deltas = c->n_calls = 0;
}

static void tw_header_set(char **dst, const char *v) {
  free(*dst);
  *dst = tw_dup(v);
}

/* One piece of message text into this feed's deltas: appended to the last
 * delta when it is of the same message, else a new delta. */
static void tw_emit_text(struct tw_rchat *c, const char *text, size_t len) {
  if (!len) return;
  Twain__V1__Delta *d = NULL;
  if (c->n_deltas && !c->first_delta) d = c->dptr[c->n_deltas - 1];
  if (d && d->channel == NULL) d = NULL;
  if (d) { /* same message as the last delta of this feed: concatenate */
    tw_feed_append(c, d, text, len);
    return;
  }
  if (c->n_deltas == TW_RCHAT_MAX) return;
  d = &c->deltas[c->n_deltas];
  twain__v1__delta__init(d);
  d->channel = tw_feed_str(c, c->channel ? c->channel : "", c->channel ? strlen(c->channel) : 0);
  d->recipient = tw_feed_str(c, c->recipient ? c->recipient : "", c->recipient ? strlen(c->recipient) : 0);
  d->content = tw_feed_str(c, text, len);
  d->role = c->first_delta ? tw_feed_str(c, c->role ? c->role : "", c->role ? strlen(c->role) : 0) : (char *)"";
  c->first_delta = false;
  c->dptr[c->n_deltas++] = d;
}

/* The bytes at the end of the final text that may be the start of a stop
 * string (the longest suffix that is a proper prefix of one): held back
 * until the next piece shows whether the stop follows. A stop string
 * starts at a character boundary, so what is sent before it ends at one. */
static size_t tw_stop_holdback(const struct tw_rchat *c) {
  const size_t n = c->final_text.len;
  size_t best = 0;
  for (size_t i = 0; i < c->n_stops; i++) {
    const size_t sl = strlen(c->stops[i]);
    for (size_t k = sl - 1 < n ? sl - 1 : n; k > best; k--)
      if (memcmp(c->final_text.data + n - k, c->stops[i], k) == 0) {
        best = k;
        break;
      }
  }
  return best;
}

/* The final text not sent yet, up to `end` (a stop string's start, or the
 * text's end less what may start one). */
static void tw_final_send(struct tw_rchat *c, size_t end) {
  if (end <= c->final_sent) return;
  tw_emit_text(c, c->final_text.data + c->final_sent, end - c->final_sent);
  c->final_sent = end;
}

static void tw_on_text(struct tw_rchat *c, const char *text, size_t len) {
  if (c->stop_hit || !len) return;
  bool final = c->channel && strcmp(c->channel, "final") == 0;
  if (!final || !c->n_stops) {
    tw_emit_text(c, text, len);
    return;
  }
  /* final text with stop strings: nothing of a stop string reaches the
   * client, not even its first bytes before the rest arrives */
  if (tw_tok_buf_append(&c->final_text, text, len) != TW_OK) { /* out of memory: logged */
    c->stop_hit = true; /* stops can no longer be found: end the answer here */
    return;
  }
  /* a stop cannot start in what was sent (that was never a stop's start),
   * so the search starts there: each piece costs its own length, not the
   * whole answer's */
  size_t end = c->final_text.len;
  for (size_t i = 0; i < c->n_stops; i++) {
    const char *hit = strstr(c->final_text.data + c->final_sent, c->stops[i]);
    if (hit && (size_t)(hit - c->final_text.data) < end) {
      end = (size_t)(hit - c->final_text.data);
      c->stop_hit = true;
    }
  }
  if (!c->stop_hit) end -= tw_stop_holdback(c);
  tw_final_send(c, end);
}

static void tw_on_event(void *user, const tw_harmony_event_t *ev) {
  struct tw_rchat *c = user;
  switch (ev->kind) {
    case TW_HARMONY_EV_MESSAGE_START:
      tw_header_set(&c->role, tw_harmony_role_str(ev->role));
      tw_header_set(&c->author, ev->author);
      tw_header_set(&c->channel, ev->channel);
      tw_header_set(&c->recipient, ev->recipient);
      tw_header_set(&c->content_type, ev->content_type);
      c->first_delta = true;
      c->in_analysis = ev->channel && !strcmp(ev->channel, "analysis") && !ev->recipient;
      break;
    case TW_HARMONY_EV_TEXT_DELTA: tw_on_text(c, ev->text, ev->text_len); break;
    case TW_HARMONY_EV_MESSAGE_END:
      c->in_analysis = false;
      c->cut = c->finishing && !c->first_delta; /* cut inside a message that has shown text */
      /* what was held back as a possible stop string's start: none came */
      if (!c->stop_hit && c->n_stops && c->channel && !strcmp(c->channel, "final"))
        tw_final_send(c, c->final_text.len);
      if (c->n_msgs < TW_RCHAT_MAX) {
        Twain__V1__Message *m = &c->msgs[c->n_msgs];
        twain__v1__message__init(m);
        m->role = tw_dup(tw_harmony_role_str(ev->role));
        m->name = tw_dup(ev->role == TW_HARMONY_ROLE_TOOL && ev->author ? ev->author : "");
        m->channel = tw_dup(ev->channel ? ev->channel : "");
        m->recipient = tw_dup(ev->recipient ? ev->recipient : "");
        m->content_type = tw_dup(ev->content_type ? ev->content_type : "");
        const char *t = ev->text ? ev->text : "";
        size_t tl = ev->text ? ev->text_len : 0;
        if (c->stop_hit && ev->channel && !strcmp(ev->channel, "final") && c->final_text.data) {
          /* cut at the stop string */
          for (size_t i = 0; i < c->n_stops; i++) {
            const char *hit = strstr(c->final_text.data, c->stops[i]);
            if (hit && (size_t)(hit - c->final_text.data) < tl) tl = (size_t)(hit - c->final_text.data);
          }
        }
        m->content = malloc(tl + 1);
        if (m->content) {
          memcpy(m->content, t, tl);
          m->content[tl] = '\0';
        }
        if (m->role && m->name && m->channel && m->recipient && m->content_type && m->content)
          c->mptr[c->n_msgs++] = m;
      }
      break;
    case TW_HARMONY_EV_TOOL_CALL:
      if (c->forced) { /* the forced call ended (<|call|>, or <|end|>: nothing may follow it) */
        c->forced_done = true;
        c->stop_hit = true;
      }
      if (c->n_calls < TW_RCHAT_MAX) {
        Twain__V1__ToolCall *t = &c->calls[c->n_calls];
        twain__v1__tool_call__init(t);
        t->recipient = tw_feed_str(c, ev->recipient ? ev->recipient : "", ev->recipient ? strlen(ev->recipient) : 0);
        t->content_type = tw_feed_str(c, ev->content_type ? ev->content_type : "",
                                      ev->content_type ? strlen(ev->content_type) : 0);
        t->arguments = tw_feed_str(c, ev->text ? ev->text : "", ev->text ? ev->text_len : 0);
        c->cptr[c->n_calls++] = t;
      }
      break;
    case TW_HARMONY_EV_ERROR: /* the text generated so far still reaches the client */
      if (c->finishing) {
        TW_DEBUG("router", "request %llu: harmony parser at the end: %s", (unsigned long long)c->req_id,
                 ev->text ? ev->text : "");
        break;
      }
      tw_metric_add(c->unexpected, 1);
      if (c->n_unexpected++ == 0)
        TW_WARN("router", "request %llu: unexpected model output (token %d): %s; answering with "
                "what was generated", (unsigned long long)c->req_id, ev->token, ev->text ? ev->text : "");
      else
        TW_DEBUG("router", "request %llu: harmony parser: %s", (unsigned long long)c->req_id,
                 ev->text ? ev->text : "");
      break;
    default: break;
  }
}

TW_NODISCARD tw_status_t tw_rchat_init(tw_router_t *r) {
  tw_rchat_ctx_t *x = calloc(1, sizeof *x);
  if (!x) return tw_err(TW_ERR_NO_MEMORY, "router: cannot allocate the chat context");
  r->chat_ctx = x;
  char path[4096];
  snprintf(path, sizeof path, "%s/tokenizer.json", r->p->model_dir);
  TW_CHECK(tw_tokenizer_load(path, &x->tok));
  TW_CHECK(tw_tok_encoder_create(x->tok, &x->enc));
  TW_CHECK(tw_harmony_create(x->tok, &x->h));
  x->stop_return = tw_harmony_token(x->h, "<|return|>");
  x->stop_call = tw_harmony_token(x->h, "<|call|>");
  static const char *const pass[] = {"<|return|>",  "<|call|>",  "<|constrain|>", "<|message|>",
                                     "<|channel|>", "<|start|>", "<|end|>"};
  for (size_t i = 0; i < sizeof pass / sizeof pass[0]; i++)
    x->pass_stops[i] = tw_harmony_token(x->h, pass[i]);
  return TW_OK;
}

void tw_rchat_fini(tw_router_t *r) {
  tw_rchat_ctx_t *x = r->chat_ctx;
  if (!x) return;
  tw_harmony_destroy(x->h);
  tw_tok_encoder_destroy(x->enc);
  tw_tokenizer_destroy(x->tok);
  free(x);
  r->chat_ctx = NULL;
}

void tw_rchat_tokenizer(tw_router_t *r, const tw_tokenizer_t **tok_p, tw_tok_encoder_t **enc_p) {
  tw_rchat_ctx_t *x = r->chat_ctx;
  *tok_p = x->tok;
  *enc_p = x->enc;
}

int32_t tw_rchat_default_stops(tw_router_t *r, int32_t *ids, int32_t cap) {
  tw_rchat_ctx_t *x = r->chat_ctx;
  int32_t n = 0;
  if (x && x->stop_return >= 0 && n < cap) ids[n++] = x->stop_return;
  if (x && x->stop_call >= 0 && n < cap) ids[n++] = x->stop_call;
  return n;
}

static TW_NODISCARD tw_status_t tw_role_parse(const char *s, tw_harmony_role_t *role_p) {
  static const struct { const char *n; tw_harmony_role_t r; } roles[] = {
      {"system", TW_HARMONY_ROLE_SYSTEM}, {"developer", TW_HARMONY_ROLE_DEVELOPER},
      {"user", TW_HARMONY_ROLE_USER},     {"assistant", TW_HARMONY_ROLE_ASSISTANT},
      {"tool", TW_HARMONY_ROLE_TOOL}};
  for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
    if (s && !strcmp(s, roles[i].n)) {
      *role_p = roles[i].r;
      return TW_OK;
    }
  return tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                      "unknown role \"%s\": use system, developer, user, assistant or tool",
                      s ? s : "");
}

static const char *tw_nz(const char *s) { return s && s[0] ? s : NULL; }

/* Feed the ids of a header the router wrote into the parser (which starts in
 * the assistant's header), as if the model had generated them: the call's
 * MESSAGE_START, so the ids generated next are its arguments. */
static TW_NODISCARD tw_status_t tw_parser_prime(struct tw_rchat *c, const int32_t *ids, size_t n) {
  for (size_t i = 0; i < n; i++) TW_CHECK(tw_harmony_parser_push(c->parser, ids[i]));
  tw_feed_reset(c);
  c->forced = true;
  return TW_OK;
}

/* The declared function the choice pass named. Its text (after "to") is
 * "=functions.NAME ..." when the model follows the format: without "=" and
 * "functions.", the longest declared name it starts with that is followed by
 * a character no function name has ([A-Za-z0-9_-] only); else the name that
 * shares the longest prefix with it; the first declared one on a tie. */
static size_t tw_pick_tool(const char *text, char *const *names, size_t n) {
  while (*text == ' ') text++;
  if (*text == '=') text++;
  if (!strncmp(text, "functions.", 10)) text += 10;
  size_t best = 0, best_len = 0;
  bool exact = false;
  for (size_t i = 0; i < n; i++) {
    size_t k = 0;
    while (names[i][k] && names[i][k] == text[k]) k++;
    char next = text[k];
    bool whole = !names[i][k] && !(next == '_' || next == '-' || (next >= '0' && next <= '9') ||
                                   ((next | 0x20) >= 'a' && (next | 0x20) <= 'z'));
    if ((whole && (!exact || k > best_len)) || (!exact && !whole && k > best_len)) {
      best = i;
      best_len = k;
      exact = whole;
    }
  }
  return best;
}

/* True when s has no character other than ASCII whitespace. */
static bool tw_blank(const char *s) {
  for (; *s; s++)
    if (!strchr(" \t\r\n\v\f", *s)) return false;
  return true;
}

TW_NODISCARD tw_status_t tw_rchat_start(tw_router_t *r, tw_req_t *q,
                                        const Twain__V1__ChatRequest *cr) {
  tw_rchat_ctx_t *x = r->chat_ctx;
  if (cr->n_messages == 0) return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "chat: messages is empty");
  struct tw_rchat *c = calloc(1, sizeof *c);
  if (!c) return tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
  q->hchat = c;
  c->stream = cr->stream;
  c->unexpected = r->m.harmony_unexpected;
  c->req_id = q->id;
  tw_tok_buf_init(&c->final_text);
  tw_harmony_conversation_t conv;
  tw_harmony_conversation_init(&conv);
  tw_status_t st = TW_OK;
  if (tw_nz(cr->date) && !tw_harmony_date_valid(cr->date)) /* it goes into the system message */
    st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "chat: date must be a date YYYY-MM-DD (or empty)");
  else if (tw_nz(cr->date)) st = tw_harmony_conversation_set(&conv, &conv.current_date, cr->date);
  switch (cr->reasoning) {
    case TWAIN__V1__REASONING_EFFORT__REASONING_LOW: conv.reasoning_effort = TW_HARMONY_EFFORT_LOW; break;
    case TWAIN__V1__REASONING_EFFORT__REASONING_HIGH: conv.reasoning_effort = TW_HARMONY_EFFORT_HIGH; break;
    default: conv.reasoning_effort = TW_HARMONY_EFFORT_MEDIUM;
  }
  /* leading system/developer messages are the developer instructions */
  tw_tok_buf_t instr;
  tw_tok_buf_init(&instr);
  if (st == TW_OK && tw_nz(cr->instructions))
    st = tw_tok_buf_append(&instr, cr->instructions, strlen(cr->instructions));
  size_t i = 0;
  for (; i < cr->n_messages && st == TW_OK; i++) {
    const Twain__V1__Message *m = cr->messages[i];
    if (!m->role || (strcmp(m->role, "system") && strcmp(m->role, "developer"))) break;
    if (instr.len) st = tw_tok_buf_append(&instr, "\n\n", 2);
    if (st == TW_OK)
      st = tw_tok_buf_append(&instr, m->content ? m->content : "",
                             m->content ? strlen(m->content) : 0);
  }
  if (st == TW_OK && instr.len)
    st = tw_harmony_conversation_set(&conv, &conv.developer_instructions, instr.data);
  tw_tok_buf_fini(&instr);
  /* tool names as OpenAI's API takes them: they become `functions.NAME` in
   * the prompt's TypeScript namespace and the recipient of the model's call */
  for (size_t k = 0; k < cr->n_tools && st == TW_OK; k++) {
    const char *n = cr->tools[k]->name ? cr->tools[k]->name : "";
    size_t len = strlen(n);
    if (len < 1 || len > 64 || strspn(n, TW_ALNUM_CHARS "_-") != len)
      st = tw_err_quiet(
          TW_ERR_INVALID_ARGUMENT,
          "chat: tools[%zu].name \"%.80s\" must be 1 to 64 letters, digits, '_' or '-'", k, n);
  }
  /* tool_choice (twain_api.proto ChatRequest): the call to force, if any */
  const char *forced = NULL;
  int choice = cr->tool_choice;
  if (st == TW_OK && choice > TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_FUNCTION)
    st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                      "chat: tool_choice %d is not AUTO, NONE, REQUIRED "
                      "or FUNCTION",
                      choice);
  if (st == TW_OK && choice >= TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_REQUIRED && cr->n_tools == 0)
    st = tw_err_quiet(
        TW_ERR_INVALID_ARGUMENT,
        "chat: tool_choice %s asks for a tool call but "
        "there are no tools",
        choice == TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_REQUIRED ? "REQUIRED" : "FUNCTION");
  if (st == TW_OK && choice == TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_FUNCTION) {
    for (size_t k = 0; k < cr->n_tools && !forced; k++)
      if (cr->tools[k]->name && cr->tool_choice_name &&
          !strcmp(cr->tools[k]->name, cr->tool_choice_name))
        forced = cr->tools[k]->name;
    if (!forced)
      st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT,
                        "chat: tool_choice_name \"%s\" is not one of the tools",
                        cr->tool_choice_name ? cr->tool_choice_name : "");
  }
  if (st == TW_OK && choice == TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_REQUIRED && cr->n_tools == 1)
    forced = cr->tools[0]->name; /* the only one: nothing to choose */
  else if (st == TW_OK && choice == TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_REQUIRED) {
    c->choosing = true;
    c->names = calloc(cr->n_tools, sizeof *c->names);
    for (size_t k = 0; c->names && k < cr->n_tools; k++)
      if ((c->names[c->n_names] = strdup(cr->tools[k]->name ? cr->tools[k]->name : "")))
        c->n_names++;
    if (c->n_names < cr->n_tools) st = tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
  }
  for (size_t k = 0;
       k < cr->n_tools && st == TW_OK && choice != TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_NONE; k++) {
    tw_harmony_tool_t t = {.name = cr->tools[k]->name,
                           .description = cr->tools[k]->description ? cr->tools[k]->description : "",
                           .parameters_json = tw_nz(cr->tools[k]->parameters_json)};
    st = tw_harmony_conversation_add_tool(&conv, &t);
  }
  for (; i < cr->n_messages && st == TW_OK; i++) {
    const Twain__V1__Message *m = cr->messages[i];
    tw_harmony_message_t hm = {.name = tw_nz(m->name), .recipient = tw_nz(m->recipient),
                               .channel = tw_nz(m->channel), .content_type = tw_nz(m->content_type),
                               .content = m->content ? m->content : ""};
    st = tw_role_parse(m->role, &hm.role);
    if (st == TW_OK && hm.role == TW_HARMONY_ROLE_USER && tw_blank(hm.content))
      st = tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "chat: messages[%zu] (user) is empty or only whitespace", i);
    if (st == TW_OK) st = tw_harmony_conversation_add_message(&conv, &hm);
  }
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  if (st == TW_OK) st = tw_harmony_render(x->h, &conv, x->enc, (size_t)r->max_prompt, &ids);
  tw_harmony_conversation_fini(&conv);
  size_t n_rendered = ids.n;
  tw_token_ids_init(&c->base);
  if (st == TW_OK && c->choosing) {
    for (size_t k = 0; k < ids.n && st == TW_OK; k++) st = tw_token_ids_push(&c->base, ids.ids[k]);
    tw_tok_stream_init(&c->pick_dec, x->tok, 0);
    tw_tok_buf_init(&c->pick);
  }
  if (st == TW_OK && (forced || c->choosing))
    st = tw_harmony_render_call_header(x->h, forced, x->enc, &ids);
  if (st == TW_OK) {
    q->prompt = malloc(sizeof(int32_t) * (ids.n ? ids.n : 1));
    if (!q->prompt) st = tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
    else {
      memcpy(q->prompt, ids.ids, sizeof(int32_t) * ids.n);
      q->n_prompt = (int32_t)ids.n;
    }
  }
  tw_token_ids_fini(&ids);
  if (st == TW_OK)
    st = tw_harmony_parser_create(x->h, TW_HARMONY_ROLE_ASSISTANT, tw_on_event, c, &c->parser);
  if (st == TW_OK && forced)
    st = tw_parser_prime(c, q->prompt + n_rendered, (size_t)q->n_prompt - n_rendered);
  const Twain__V1__SamplingParams *s = cr->sampling;
  if (st == TW_OK && s && s->n_stop) {
    c->stops = calloc(s->n_stop, sizeof(char *));
    for (size_t k = 0; c->stops && k < s->n_stop; k++)
      if (s->stop[k] && s->stop[k][0]) c->stops[c->n_stops++] = strdup(s->stop[k]);
  }
  q->n_stop = tw_rchat_default_stops(r, q->stop_ids, TW_RMAX_STOP);
  for (size_t k = 0; s && k < s->n_stop_token_ids && q->n_stop < TW_RMAX_STOP; k++)
    q->stop_ids[q->n_stop++] = s->stop_token_ids[k];
  if (st == TW_OK && c->choosing) { /* the pass stops after the name */
    memcpy(c->stop_ids, q->stop_ids, sizeof q->stop_ids);
    c->n_stop = q->n_stop;
    q->n_stop = 0;
    for (size_t k = 0; k < sizeof x->pass_stops / sizeof x->pass_stops[0]; k++)
      if (x->pass_stops[k] >= 0) q->stop_ids[q->n_stop++] = x->pass_stops[k];
  }
  return st;
}

bool tw_rchat_choosing(const tw_req_t *q) { return q->hchat && q->hchat->choosing; }

int32_t tw_rchat_pass_max_tokens(tw_router_t *r, tw_req_t *q, int32_t max_tokens) {
  struct tw_rchat *c = q->hchat;
  if (!c || !c->choosing) return max_tokens;
  tw_rchat_ctx_t *x = r->chat_ctx;
  c->max_tokens = max_tokens;
  int32_t most = 1;
  tw_token_ids_t t;
  tw_token_ids_init(&t);
  for (size_t i = 0; i < c->n_names; i++) { /* "=functions.NAME" and the id after it */
    t.n = 0;
    size_t len = strlen(c->names[i]);
    char *s = malloc(len + 12);
    if (!s) continue;
    memcpy(s, "=functions.", 11);
    memcpy(s + 11, c->names[i], len + 1);
    if (tw_tok_encoder_encode(x->enc, s, len + 11, 0, &t) == TW_OK && (int32_t)t.n + 1 > most)
      most = (int32_t)t.n + 1;
    free(s);
  }
  tw_token_ids_fini(&t);
  return most < max_tokens ? most : max_tokens;
}

TW_NODISCARD tw_status_t tw_rchat_choice_feed(tw_router_t *r, tw_req_t *q, const int32_t *toks,
                                              size_t n, bool finished, bool *chosen_p) {
  struct tw_rchat *c = q->hchat;
  tw_rchat_ctx_t *x = r->chat_ctx;
  *chosen_p = false;
  if (c->pick_id != q->id) { /* the first ids of this attempt (the pass may be retried) */
    c->pick_id = q->id;
    c->pick.len = 0;
    tw_tok_stream_init(&c->pick_dec, x->tok, 0);
  }
  bool special = false;
  for (size_t i = 0; i < n && !special; i++) {
    for (size_t k = 0; k < sizeof x->pass_stops / sizeof x->pass_stops[0]; k++)
      special |= toks[i] == x->pass_stops[k];
    if (!special) TW_CHECK(tw_tok_stream_push(&c->pick_dec, toks[i], &c->pick));
  }
  if (!special && !finished) return TW_OK;
  TW_CHECK(tw_tok_stream_finish(&c->pick_dec, &c->pick));
  TW_CHECK(tw_tok_buf_append(&c->pick, "", 0));
  const char *name = c->names[tw_pick_tool(c->pick.data, c->names, c->n_names)];
  for (size_t i = 0; i < c->pick.len; i++) /* one log line, whatever the model wrote */
    if ((unsigned char)c->pick.data[i] < 0x20 || c->pick.data[i] == '"') c->pick.data[i] = '?';
  TW_DEBUG("router",
           "request %llu: tool_choice required: the model wrote \"%s\" after \"to\": "
           "calling functions.%s",
           (unsigned long long)q->id, c->pick.data, name);
  size_t n_base = c->base.n;
  TW_CHECK(tw_harmony_render_call_header(x->h, name, x->enc, &c->base));
  int32_t *p = realloc(q->prompt, sizeof(int32_t) * c->base.n);
  if (!p) return tw_err_quiet(TW_ERR_NO_MEMORY, "router out of memory");
  memcpy(p, c->base.ids, sizeof(int32_t) * c->base.n);
  q->prompt = p;
  q->n_prompt = (int32_t)c->base.n;
  TW_CHECK(tw_parser_prime(c, c->base.ids + n_base, c->base.n - n_base));
  memcpy(q->stop_ids, c->stop_ids, sizeof q->stop_ids);
  q->n_stop = c->n_stop;
  q->max_tokens = c->max_tokens;
  c->choosing = false;
  *chosen_p = true;
  return TW_OK;
}

bool tw_rchat_feed(tw_router_t *r, tw_req_t *q, const int32_t *toks, size_t n,
                   Twain__V1__ServerReply *rep) {
  struct tw_rchat *c = q->hchat;
  if (!c) return false;
  tw_feed_reset(c);
  for (size_t i = 0; i < n && !c->stop_hit; i++) {
    bool was = c->in_analysis;
    /* the parser fails only for want of memory (logged): end the answer there */
    if (tw_harmony_parser_push(c->parser, toks[i]) != TW_OK) c->stop_hit = true;
    c->n_reasoning += was && c->in_analysis; /* a text id of an analysis message */
  }
  rep->deltas = c->dptr;
  rep->n_deltas = c->n_deltas;
  rep->tool_calls = c->cptr;
  rep->n_tool_calls = c->n_calls;
  return c->stop_hit;
}

void tw_rchat_finish(tw_router_t *r, tw_req_t *q, Twain__V1__ServerReply *rep) {
  struct tw_rchat *c = q->hchat;
  if (!c) return;
  c->finishing = true;
  /* reports a message cut off by max_tokens; fails only for want of memory (logged) */
  TW_IGNORE(tw_harmony_parser_finish(c->parser));
  rep->deltas = c->dptr;
  rep->n_deltas = c->stream ? c->n_deltas : 0;
  rep->tool_calls = c->cptr;
  rep->n_tool_calls = c->n_calls;
  rep->messages = c->mptr;
  rep->n_messages = c->n_msgs;
  rep->last_message_cut = c->cut;
  if (rep->usage) rep->usage->reasoning_tokens = c->n_reasoning;
  if (rep->finish_reason == TWAIN__V1__FINISH_REASON__FINISH_STOP && q->n_out > 0) {
    tw_rchat_ctx_t *x = r->chat_ctx;
    if (q->out[q->n_out - 1] == x->stop_call || c->forced_done)
      rep->finish_reason = TWAIN__V1__FINISH_REASON__FINISH_TOOL_CALL;
  }
}

void tw_rchat_free(tw_req_t *q) {
  struct tw_rchat *c = q->hchat;
  if (!c) return;
  tw_feed_reset(c);
  tw_harmony_parser_destroy(c->parser);
  free(c->role);
  free(c->channel);
  free(c->recipient);
  free(c->content_type);
  free(c->author);
  for (size_t i = 0; i < c->n_msgs; i++) {
    Twain__V1__Message *m = c->mptr[i];
    free(m->role);
    free(m->name);
    free(m->channel);
    free(m->recipient);
    free(m->content_type);
    free(m->content);
  }
  for (size_t i = 0; i < c->n_stops; i++) free(c->stops[i]);
  free(c->stops);
  for (size_t i = 0; i < c->n_names; i++) free(c->names[i]);
  free(c->names);
  tw_token_ids_fini(&c->base);
  tw_tok_buf_fini(&c->pick);
  tw_tok_buf_fini(&c->final_text);
  free(c);
  q->hchat = NULL;
}
