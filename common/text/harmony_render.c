/* harmony_render.c: conversations and the Harmony renderer (spec §4.2-§4.9).
 *
 * Rendering is the harmony-rs order: <|start|>, role (or the tool's name for a
 * tool message) and ":name", " to=RECIPIENT", <|channel|>CHANNEL, the content
 * type (" " <|constrain|> "json" when it carries the marker), <|message|>, the
 * content, then <|call|> for an assistant message with a recipient or <|end|>.
 * Each text piece is encoded on its own as ordinary text (spec §4.2). */
#include "common/text/harmony.h"

#include "common/base/log.h"
#include "common/text/harmony_impl.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_HARMONY_IDENTITY "You are ChatGPT, a large language model trained by OpenAI."
#define TW_HARMONY_CUTOFF "2024-06"

const char *tw_harmony_role_str(tw_harmony_role_t role) {
  switch (role) {
    case TW_HARMONY_ROLE_SYSTEM: return "system";
    case TW_HARMONY_ROLE_DEVELOPER: return "developer";
    case TW_HARMONY_ROLE_USER: return "user";
    case TW_HARMONY_ROLE_ASSISTANT: return "assistant";
    case TW_HARMONY_ROLE_TOOL: return "tool";
  }
  return "unknown";
}

/* ---- the format bound to a tokenizer ------------------------------------ */

TW_NODISCARD tw_status_t tw_harmony_create(const tw_tokenizer_t *tok, tw_harmony_t **h_p) {
  static const char *const names[TW_HT_COUNT] = {
      [TW_HT_START] = "<|start|>",     [TW_HT_END] = "<|end|>",
      [TW_HT_MESSAGE] = "<|message|>", [TW_HT_CHANNEL] = "<|channel|>",
      [TW_HT_CONSTRAIN] = "<|constrain|>", [TW_HT_RETURN] = "<|return|>",
      [TW_HT_CALL] = "<|call|>"};
  tw_harmony_t *h = calloc(1, sizeof *h);
  if (!h) return tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory");
  h->tok = tok;
  for (int i = 0; i < TW_HT_COUNT; i++) {
    if (tw_tokenizer_find_added(tok, names[i], &h->ids[i]) != TW_OK) {
      free(h);
      return tw_err(TW_ERR_FORMAT, "harmony: the tokenizer has no %s token (not a gpt-oss "
                    "tokenizer?)", names[i]);
    }
  }
  *h_p = h;
  return TW_OK;
}

void tw_harmony_destroy(tw_harmony_t *h) { free(h); }

const tw_tokenizer_t *tw_harmony_tokenizer(const tw_harmony_t *h) { return h->tok; }

int32_t tw_harmony_token(const tw_harmony_t *h, const char *content) {
  int32_t id;
  return tw_tokenizer_find_added(h->tok, content, &id) == TW_OK ? id : -1;
}

/* ---- conversation ------------------------------------------------------- */

void tw_harmony_conversation_init(tw_harmony_conversation_t *c) {
  memset(c, 0, sizeof *c);
  c->include_system = 1;
  c->reasoning_effort = TW_HARMONY_EFFORT_MEDIUM;
  c->drop_analysis = TW_HARMONY_DROP_HARMONY;
}

static void tw_free_str(const char *s) { free((void *)(uintptr_t)s); }

void tw_harmony_conversation_fini(tw_harmony_conversation_t *c) {
  tw_free_str(c->model_identity);
  tw_free_str(c->knowledge_cutoff);
  tw_free_str(c->current_date);
  tw_free_str(c->developer_instructions);
  for (size_t i = 0; i < c->n_tools; i++) {
    tw_free_str(c->tools[i].name);
    tw_free_str(c->tools[i].description);
    tw_free_str(c->tools[i].parameters_json);
  }
  for (size_t i = 0; i < c->n_messages; i++) {
    const tw_harmony_message_t *m = &c->messages[i];
    tw_free_str(m->name);
    tw_free_str(m->recipient);
    tw_free_str(m->channel);
    tw_free_str(m->content_type);
    tw_free_str(m->content);
  }
  free(c->tools);
  free(c->messages);
  memset(c, 0, sizeof *c);
}

/* Copy a string that must be UTF-8; `what` names it in the error. */
static TW_NODISCARD tw_status_t tw_dup_utf8(const char *s, const char *what, const char **out_p) {
  if (!s) {
    *out_p = NULL;
    return TW_OK;
  }
  size_t n = strlen(s), bad;
  if (!tw_utf8_valid(s, n, &bad))
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "%s is not valid UTF-8 (bad byte 0x%02x at offset %zu)",
                  what, (unsigned char)s[bad], bad);
  char *d = malloc(n + 1);
  if (!d) return tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory copying %s", what);
  memcpy(d, s, n + 1);
  *out_p = d;
  return TW_OK;
}

bool tw_harmony_date_valid(const char *v) {
  static const int mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  if (!v || strlen(v) != 10 || v[4] != '-' || v[7] != '-') return false;
  for (int k = 0; k < 10; k++)
    if (k != 4 && k != 7 && (v[k] < '0' || v[k] > '9')) return false;
  int y = atoi(v), m = atoi(v + 5), d = atoi(v + 8);
  bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  return m >= 1 && m <= 12 && d >= 1 && d <= mdays[m - 1] && (m != 2 || d < 29 || leap);
}

TW_NODISCARD tw_status_t tw_harmony_conversation_set(tw_harmony_conversation_t *c,
                                                     const char **field, const char *value) {
  const char *d = NULL; /* set by tw_dup_utf8; -O3 cannot tell */
  TW_CHECK(tw_dup_utf8(value, "conversation field", &d));
  tw_free_str(*field);
  *field = d;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_harmony_conversation_add_message(tw_harmony_conversation_t *c,
                                                             const tw_harmony_message_t *msg) {
  if ((unsigned)msg->role > TW_HARMONY_ROLE_TOOL)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "message %zu: unknown role %d", c->n_messages,
                  (int)msg->role);
  if (msg->role == TW_HARMONY_ROLE_TOOL && (!msg->name || !msg->name[0]))
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "message %zu: a tool message needs the tool's name "
                  "(e.g. functions.get_weather)", c->n_messages);
  if (!msg->content)
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "message %zu: content is missing", c->n_messages);
  if (c->n_messages == c->cap_messages_) {
    size_t cap = c->cap_messages_ ? 2 * c->cap_messages_ : 8;
    tw_harmony_message_t *m = realloc(c->messages, cap * sizeof *m);
    if (!m) return tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory for %zu messages", cap);
    c->messages = m;
    c->cap_messages_ = cap;
  }
  tw_harmony_message_t m = {.role = msg->role};
  char what[64];
  tw_status_t st;
  snprintf(what, sizeof what, "message %zu name", c->n_messages);
  TW_CHECK_GOTO(tw_dup_utf8(msg->name, what, &m.name), st, fail);
  snprintf(what, sizeof what, "message %zu recipient", c->n_messages);
  TW_CHECK_GOTO(tw_dup_utf8(msg->recipient, what, &m.recipient), st, fail);
  snprintf(what, sizeof what, "message %zu channel", c->n_messages);
  TW_CHECK_GOTO(tw_dup_utf8(msg->channel, what, &m.channel), st, fail);
  snprintf(what, sizeof what, "message %zu content type", c->n_messages);
  TW_CHECK_GOTO(tw_dup_utf8(msg->content_type, what, &m.content_type), st, fail);
  snprintf(what, sizeof what, "message %zu content", c->n_messages);
  TW_CHECK_GOTO(tw_dup_utf8(msg->content, what, &m.content), st, fail);
  c->messages[c->n_messages++] = m;
  return TW_OK;
fail:
  tw_free_str(m.name);
  tw_free_str(m.recipient);
  tw_free_str(m.channel);
  tw_free_str(m.content_type);
  return st;
}

TW_NODISCARD tw_status_t tw_harmony_conversation_add_tool(tw_harmony_conversation_t *c,
                                                          const tw_harmony_tool_t *tool) {
  if (!tool->name || !tool->name[0])
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "tool %zu: the name is missing", c->n_tools);
  if (tool->parameters_json) {
    cJSON *p = cJSON_Parse(tool->parameters_json);
    int is_obj = cJSON_IsObject(p);
    int parsed = p != NULL;
    cJSON_Delete(p);
    if (!is_obj)
      return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "tool %s: parameters must be a JSON Schema object, "
                    "got %s", tool->name, parsed ? "another JSON value" : "text that is not JSON");
  }
  if (c->n_tools == c->cap_tools_) {
    size_t cap = c->cap_tools_ ? 2 * c->cap_tools_ : 4;
    tw_harmony_tool_t *t = realloc(c->tools, cap * sizeof *t);
    if (!t) return tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory for %zu tools", cap);
    c->tools = t;
    c->cap_tools_ = cap;
  }
  tw_harmony_tool_t t = {0};
  tw_status_t st;
  TW_CHECK_GOTO(tw_dup_utf8(tool->name, "tool name", &t.name), st, fail);
  TW_CHECK_GOTO(tw_dup_utf8(tool->description ? tool->description : "", "tool description",
                            &t.description), st, fail);
  TW_CHECK_GOTO(tw_dup_utf8(tool->parameters_json, "tool parameters", &t.parameters_json), st,
                fail);
  c->tools[c->n_tools++] = t;
  return TW_OK;
fail:
  tw_free_str(t.name);
  tw_free_str(t.description);
  return st;
}

/* ---- system and developer text ------------------------------------------ */

#define APPEND(s) TW_CHECK(tw_tok_buf_append(out, (s), strlen(s)))

TW_NODISCARD tw_status_t tw_harmony_system_text(const tw_harmony_conversation_t *c,
                                                tw_tok_buf_t *out) {
  static const char *const effort[] = {"low", "medium", "high"};
  APPEND(c->model_identity ? c->model_identity : TW_HARMONY_IDENTITY);
  APPEND("\nKnowledge cutoff: ");
  APPEND(c->knowledge_cutoff ? c->knowledge_cutoff : TW_HARMONY_CUTOFF);
  if (c->current_date) {
    APPEND("\nCurrent date: ");
    APPEND(c->current_date);
  }
  APPEND("\n\nReasoning: ");
  APPEND(effort[(unsigned)c->reasoning_effort <= 2 ? c->reasoning_effort : 1]);
  APPEND("\n\n# Valid channels: analysis, commentary, final. Channel must be included for every "
         "message.");
  if (c->n_tools) APPEND("\nCalls to these tools must go to the commentary channel: 'functions'.");
  return TW_OK;
}

/* Lines as Rust's str::lines: split on \n, a trailing \r dropped, no empty last line. */
static TW_NODISCARD tw_status_t tw_comment_lines(const char *text, tw_tok_buf_t *out) {
  const char *p = text;
  while (*p) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    size_t m = n && p[n - 1] == '\r' ? n - 1 : n;
    APPEND("// ");
    TW_CHECK(tw_tok_buf_append(out, p, m));
    APPEND("\n");
    p += n + (nl ? 1 : 0);
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_harmony_developer_text(const tw_harmony_conversation_t *c,
                                                   tw_tok_buf_t *out) {
  int sections = 0;
  if (c->developer_instructions) {
    APPEND("# Instructions\n\n");
    APPEND(c->developer_instructions);
    sections++;
  }
  if (!c->n_tools) return TW_OK;
  if (sections) APPEND("\n\n");
  APPEND("# Tools\n\n## functions\n\nnamespace functions {\n\n");
  for (size_t i = 0; i < c->n_tools; i++) {
    const tw_harmony_tool_t *t = &c->tools[i];
    TW_CHECK(tw_comment_lines(t->description ? t->description : "", out));
    APPEND("type ");
    APPEND(t->name);
    if (t->parameters_json) {
      cJSON *schema = cJSON_Parse(t->parameters_json);
      if (!cJSON_IsObject(schema)) {
        cJSON_Delete(schema);
        return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "tool %s: parameters must be a JSON Schema object",
                      t->name);
      }
      APPEND(" = (_: ");
      tw_status_t st = tw_harmony_schema_to_ts(schema, "", out);
      cJSON_Delete(schema);
      TW_CHECK(st);
      APPEND(") => any;\n\n");
    } else {
      APPEND(" = () => any;\n\n");
    }
  }
  APPEND("} // namespace functions");
  return TW_OK;
}

/* ---- rendering ---------------------------------------------------------- */

typedef struct {
  const tw_harmony_t *h;
  tw_tok_encoder_t *enc;
  tw_token_ids_t *out;
} tw_render_ctx_t;

static TW_NODISCARD tw_status_t tw_text(tw_render_ctx_t *r, const char *s, size_t n) {
  return n ? tw_tok_encoder_encode(r->enc, s, n, 0, r->out) : TW_OK;
}

static TW_NODISCARD tw_status_t tw_text2(tw_render_ctx_t *r, const char *a, const char *b) {
  size_t na = strlen(a), nb = strlen(b);
  char stackbuf[256];
  char *buf = na + nb <= sizeof stackbuf ? stackbuf : malloc(na + nb);
  if (!buf) return tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory");
  memcpy(buf, a, na);
  memcpy(buf + na, b, nb);
  tw_status_t st = tw_text(r, buf, na + nb);
  if (buf != stackbuf) free(buf);
  return st;
}

static TW_NODISCARD tw_status_t tw_special(tw_render_ctx_t *r, int which) {
  return tw_token_ids_push(r->out, r->h->ids[which]);
}

static TW_NODISCARD tw_status_t tw_render_message(tw_render_ctx_t *r, tw_harmony_role_t role,
                                                  const char *name, const char *recipient,
                                                  const char *channel, const char *content_type,
                                                  const char *content, size_t content_len) {
  TW_CHECK(tw_special(r, TW_HT_START));
  if (role == TW_HARMONY_ROLE_TOOL) {
    if (!name) return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "a tool message has no tool name");
    TW_CHECK(tw_text(r, name, strlen(name)));
  } else {
    const char *rs = tw_harmony_role_str(role);
    TW_CHECK(tw_text(r, rs, strlen(rs)));
    if (name) TW_CHECK(tw_text2(r, ":", name));
  }
  if (recipient && strcmp(recipient, "all") != 0) TW_CHECK(tw_text2(r, " to=", recipient));
  if (channel) {
    TW_CHECK(tw_special(r, TW_HT_CHANNEL));
    TW_CHECK(tw_text(r, channel, strlen(channel)));
  }
  if (content_type) {
    static const char marker[] = "<|constrain|>";
    if (strncmp(content_type, marker, sizeof marker - 1) == 0) {
      const char *rest = content_type + sizeof marker - 1;
      TW_CHECK(tw_text(r, " ", 1));
      TW_CHECK(tw_special(r, TW_HT_CONSTRAIN));
      TW_CHECK(tw_text(r, rest, strlen(rest)));
    } else {
      TW_CHECK(tw_text2(r, " ", content_type));
    }
  }
  TW_CHECK(tw_special(r, TW_HT_MESSAGE));
  TW_CHECK(tw_text(r, content, content_len));
  return tw_special(r, role == TW_HARMONY_ROLE_ASSISTANT && recipient ? TW_HT_CALL : TW_HT_END);
}

static TW_NODISCARD tw_status_t tw_render_all(tw_render_ctx_t *r,
                                              const tw_harmony_conversation_t *c) {
  tw_tok_buf_t text;
  tw_tok_buf_init(&text);
  tw_status_t st = TW_OK;
  if (c->include_system) {
    TW_CHECK_GOTO(tw_harmony_system_text(c, &text), st, done);
    TW_CHECK_GOTO(tw_render_message(r, TW_HARMONY_ROLE_SYSTEM, NULL, NULL, NULL, NULL, text.data,
                                    text.len), st, done);
  }
  if (c->developer_instructions || c->n_tools) {
    text.len = 0;
    TW_CHECK_GOTO(tw_harmony_developer_text(c, &text), st, done);
    TW_CHECK_GOTO(tw_render_message(r, TW_HARMONY_ROLE_DEVELOPER, NULL, NULL, NULL, NULL,
                                    text.data ? text.data : "", text.len), st, done);
  }
  /* spec §4.9 (harmony-rs auto_drop_analysis) */
  int last_assistant_final = 0;
  for (size_t i = c->n_messages; i-- > 0;) {
    if (c->messages[i].role == TW_HARMONY_ROLE_ASSISTANT) {
      last_assistant_final = c->messages[i].channel && !strcmp(c->messages[i].channel, "final");
      break;
    }
  }
  size_t first_final = c->n_messages;
  for (size_t i = 0; i < c->n_messages; i++) {
    if (c->messages[i].channel && !strcmp(c->messages[i].channel, "final")) {
      first_final = i;
      break;
    }
  }
  int drop = c->drop_analysis == TW_HARMONY_DROP_HARMONY && last_assistant_final;
  for (size_t i = 0; i < c->n_messages; i++) {
    const tw_harmony_message_t *m = &c->messages[i];
    if (drop && i < first_final && m->channel && !strcmp(m->channel, "analysis")) continue;
    TW_CHECK_GOTO(tw_render_message(r, m->role, m->name, m->recipient, m->channel,
                                    m->content_type, m->content, strlen(m->content)), st, done);
  }
  TW_CHECK_GOTO(tw_special(r, TW_HT_START), st, done);
  TW_CHECK_GOTO(tw_text(r, "assistant", 9), st, done);
done:
  tw_tok_buf_fini(&text);
  return st;
}

TW_NODISCARD tw_status_t tw_harmony_render(const tw_harmony_t *h,
                                           const tw_harmony_conversation_t *c,
                                           tw_tok_encoder_t *maybe_enc, size_t max_prompt_tokens,
                                           tw_token_ids_t *out) {
  tw_render_ctx_t r = {.h = h, .enc = maybe_enc, .out = out};
  if (!r.enc) TW_CHECK(tw_tok_encoder_create(h->tok, &r.enc));
  size_t start = out->n;
  tw_status_t st = tw_render_all(&r, c);
  if (st == TW_OK && max_prompt_tokens && out->n - start > max_prompt_tokens)
    st = tw_err_quiet(TW_ERR_OUT_OF_RANGE, "the prompt is %zu tokens, over the limit of %zu (the context "
                "length less room for the tokens to generate, at least one); "
                "shorten the conversation",
                out->n - start, max_prompt_tokens);
  if (st < 0) out->n = start;
  if (!maybe_enc) tw_tok_encoder_destroy(r.enc);
  return st;
}

TW_NODISCARD tw_status_t tw_harmony_render_call_header(const tw_harmony_t *h, const char *name,
                                                       tw_tok_encoder_t *enc, tw_token_ids_t *out) {
  if (name && !name[0])
    return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "harmony: a call header needs a function name");
  tw_render_ctx_t r = {.h = h, .enc = enc, .out = out};
  size_t start = out->n;
  tw_status_t st = tw_special(&r, TW_HT_CHANNEL);
  if (st == TW_OK && !name) st = tw_text(&r, "commentary to", 13);
  if (st == TW_OK && name) {
    static const char pre[] = "commentary to=functions.";
    size_t n = strlen(name);
    char *t = malloc(sizeof pre + n + 1);
    if (!t)
      st = tw_err(TW_ERR_NO_MEMORY, "harmony: out of memory");
    else {
      memcpy(t, pre, sizeof pre - 1);
      memcpy(t + sizeof pre - 1, name, n);
      t[sizeof pre - 1 + n] = ' ';
      st = tw_text(&r, t, sizeof pre + n); /* "commentary to=functions.NAME " */
      free(t);
    }
    if (st == TW_OK) st = tw_special(&r, TW_HT_CONSTRAIN);
    if (st == TW_OK) st = tw_text(&r, "json", 4);
    if (st == TW_OK) st = tw_special(&r, TW_HT_MESSAGE);
  }
  if (st < 0) out->n = start;
  return st;
}
