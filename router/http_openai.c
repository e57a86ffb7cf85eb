/* http_openai.c: OpenAI request JSON -> twain.v1 requests, and router
 * replies -> OpenAI answers and Server-Sent Events (http_impl.h).
 *
 * Chat messages and tools go through tw_harmony_conversation_from_openai_json
 * (common/harmony_openai.c), Responses input items are first rewritten as
 * chat messages; the router renders and parses Harmony (router_chat.c). Every
 * request is streamed from the router, so a non-streamed answer is built from
 * the same items as a streamed one: each Harmony message becomes one item:
 * analysis -> reasoning, a message with a recipient (on any channel, the
 * recipient before or after the channel) -> a function call, anything else
 * (final, commentary without a recipient) -> content. */
#include "router/http_impl.h"

#include "common/harmony.h"
#include "common/log.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- request fields ---- */

static const cJSON *tw_field(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return v && !cJSON_IsNull(v) ? v : NULL;
}

/* A typed field: true with *v NULL when absent or null, true with *v set
 * when it has the type, false after a 400 naming it otherwise. */
typedef enum { TW_T_NUMBER, TW_T_INTEGER, TW_T_BOOL } tw_jtype_t;

static bool tw_typed(tw_hconn_t *c, const cJSON *o, const char *k, tw_jtype_t t, const cJSON **v) {
  static const char *const want[] = {"a number", "an integer", "true or false"};
  *v = tw_field(o, k);
  bool ok = !*v || (t == TW_T_BOOL ? cJSON_IsBool(*v)
                                   : cJSON_IsNumber(*v) && (t == TW_T_NUMBER ||
                                                           (*v)->valuedouble == floor((*v)->valuedouble)));
  if (!ok) tw_http_fail(c, 400, k, "'%s' must be %s", k, want[t]);
  return ok;
}

static bool tw_num(tw_hconn_t *c, const cJSON *o, const char *k, double *out) {
  const cJSON *v;
  if (!tw_typed(c, o, k, TW_T_NUMBER, &v)) return false;
  if (v) *out = v->valuedouble;
  return true;
}

static bool tw_int(tw_hconn_t *c, const cJSON *o, const char *k, double lo, double hi,
                   int64_t *out) {
  const cJSON *v;
  if (!tw_typed(c, o, k, TW_T_INTEGER, &v)) return false;
  if (v && (v->valuedouble < lo || v->valuedouble > hi)) {
    tw_http_fail(c, 400, k, "'%s' = %.0f is outside [%.0f, %.0f]", k, v->valuedouble, lo, hi);
    return false;
  }
  if (v) *out = (int64_t)v->valuedouble;
  return true;
}

static bool tw_bool(tw_hconn_t *c, const cJSON *o, const char *k, bool *out) {
  const cJSON *v;
  if (!tw_typed(c, o, k, TW_T_BOOL, &v)) return false;
  if (v) *out = cJSON_IsTrue(v);
  return true;
}

/* Parameters this server does not implement: a clear 400 naming them
 * (unknown fields are ignored, as OpenAI's servers do). */
typedef enum { TW_U_SET, TW_U_TRUE, TW_U_NONZERO, TW_U_NONEMPTY, TW_U_NOT_TEXT } tw_unsup_rule_t;
typedef struct {
  const char *key;
  tw_unsup_rule_t rule;
} tw_unsup_t;

static bool tw_unsupported(tw_hconn_t *c, const cJSON *o, const tw_unsup_t *u, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const cJSON *v = tw_field(o, u[i].key);
    if (!v) continue;
    bool bad = true;
    switch (u[i].rule) {
      case TW_U_SET: break;
      case TW_U_TRUE: bad = !cJSON_IsFalse(v); break;
      case TW_U_NONZERO: bad = !cJSON_IsNumber(v) || v->valuedouble != 0; break;
      case TW_U_NONEMPTY: bad = !(cJSON_IsObject(v) || cJSON_IsArray(v)) || cJSON_GetArraySize(v) > 0; break;
      case TW_U_NOT_TEXT: {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        bad = !cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0;
        break;
      }
    }
    if (bad) {
      tw_http_fail(c, 400, u[i].key, "'%s' is not supported by this server", u[i].key);
      return false;
    }
  }
  return true;
}

/* model (must be the served one when given), n (1 only), stream,
 * stream_options.include_usage, temperature, top_p, seed, max tokens under
 * `max_key` (and `alt_key`), stop (strings, up to 4). */
typedef struct {
  Twain__V1__SamplingParams sp;
  char *stop[TW_HTTP_MAX_STOPS];
  size_t n_stop;
} tw_hsampling_t;

static bool tw_common(tw_hconn_t *c, const cJSON *root, const char *max_key, const char *alt_key,
                      int32_t default_max, bool allow_stop, tw_hsampling_t *s) {
  twain__v1__sampling_params__init(&s->sp);
  const cJSON *model = tw_field(root, "model");
  if (model && !cJSON_IsString(model)) {
    tw_http_fail(c, 400, "model", "'model' must be a string");
    return false;
  }
  if (model && strcmp(model->valuestring, c->h->model) != 0) {
    tw_http_fail(c, 404, "model", "The model `%s` does not exist: this server serves `%s`",
                 model->valuestring, c->h->model);
    return false;
  }
  int64_t n = 1, seed = 0, max = 0;
  double temperature = 1.0, top_p = 1.0;
  if (!tw_int(c, root, "n", 0, 1e9, &n)) return false;
  if (n != 1) {
    tw_http_fail(c, 400, "n", "'n' = %lld: only n = 1 is supported", (long long)n);
    return false;
  }
  if (!tw_bool(c, root, "stream", &c->stream)) return false;
  const cJSON *so = tw_field(root, "stream_options");
  if (so && !cJSON_IsObject(so)) {
    tw_http_fail(c, 400, "stream_options", "'stream_options' must be an object");
    return false;
  }
  if (so && !tw_bool(c, so, "include_usage", &c->include_usage)) return false;
  if (!tw_num(c, root, "temperature", &temperature) || !tw_num(c, root, "top_p", &top_p) ||
      !tw_int(c, root, "seed", -9.2e18, 1.8e19, &seed))
    return false;
  if (!tw_int(c, root, max_key, -1e9, 1e9, &max)) return false;
  if (!max && alt_key && !tw_int(c, root, alt_key, -1e9, 1e9, &max)) return false;
  bool explicit_max = tw_field(root, max_key) || (alt_key && tw_field(root, alt_key));
  s->sp.temperature = (float)temperature;
  s->sp.top_p = (float)top_p;
  s->sp.seed = (uint64_t)seed;
  s->sp.max_tokens = explicit_max ? (int32_t)max : default_max;
  s->sp.explicit_max_tokens = explicit_max || default_max;
  const cJSON *stop = tw_field(root, "stop");
  if (stop && !allow_stop) {
    tw_http_fail(c, 400, "stop", "'stop' is not supported here");
    return false;
  }
  if (stop && cJSON_IsString(stop)) {
    if (stop->valuestring[0]) s->stop[s->n_stop++] = stop->valuestring;
  } else if (stop && cJSON_IsArray(stop)) {
    const cJSON *e;
    cJSON_ArrayForEach(e, stop) {
      if (!cJSON_IsString(e) || s->n_stop == TW_HTTP_MAX_STOPS) {
        tw_http_fail(c, 400, "stop", "'stop' must be a string or up to %d strings", TW_HTTP_MAX_STOPS);
        return false;
      }
      if (e->valuestring[0]) s->stop[s->n_stop++] = e->valuestring;
    }
  } else if (stop) {
    tw_http_fail(c, 400, "stop", "'stop' must be a string or an array of strings");
    return false;
  }
  return true;
}

static void tw_dispatch(tw_hconn_t *c, Twain__V1__ClientRequest *cr) {
  cr->request_id = 1;
  tw_msg_t from = {.id_len = TW_HTTP_ID_LEN};
  memcpy(from.id, c->id, TW_HTTP_ID_LEN);
  tw_router_dispatch(c->h->r, &from, cr);
}

/* ---- chat and responses: a conversation to a ChatRequest ---- */

/* tool_choice: auto (default), none (no tools rendered), required or a named
 * function (steered by a line of developer instructions; generation is not
 * constrained). `named` is the function's name in both shapes. */
static void tw_submit_conversation(tw_hconn_t *c, tw_harmony_conversation_t *conv,
                                   const cJSON *tool_choice, tw_hsampling_t *s) {
  const char *only = NULL;
  bool none = false, required = false;
  if (tool_choice && cJSON_IsString(tool_choice)) {
    const char *v = tool_choice->valuestring;
    none = !strcmp(v, "none");
    required = !strcmp(v, "required");
    if (!none && !required && strcmp(v, "auto") != 0) {
      tw_http_fail(c, 400, "tool_choice", "'tool_choice' \"%s\" is not auto, none, required or "
                   "{\"type\":\"function\",...}", v);
      return;
    }
  } else if (tool_choice && cJSON_IsObject(tool_choice)) {
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool_choice, "function");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn ? fn : tool_choice, "name");
    if (!cJSON_IsString(name)) {
      tw_http_fail(c, 400, "tool_choice", "'tool_choice' names no function");
      return;
    }
    only = name->valuestring;
  } else if (tool_choice) {
    tw_http_fail(c, 400, "tool_choice", "'tool_choice' must be a string or an object");
    return;
  }
  if ((required || only) && conv->n_tools == 0) {
    tw_http_fail(c, 400, "tool_choice", "'tool_choice' asks for a tool call but 'tools' is empty");
    return;
  }
  Twain__V1__ChatRequest chat = TWAIN__V1__CHAT_REQUEST__INIT;
  size_t nm = conv->n_messages, nt = conv->n_tools;
  Twain__V1__Message *msgs = calloc(nm + 1, sizeof *msgs);
  Twain__V1__Message **mp = calloc(nm + 1, sizeof *mp);
  Twain__V1__FunctionTool *tools = calloc(nt + 1, sizeof *tools);
  Twain__V1__FunctionTool **tp = calloc(nt + 1, sizeof *tp);
  tw_tok_buf_t instr;
  tw_tok_buf_init(&instr);
  if (!msgs || !mp || !tools || !tp) {
    tw_http_fail(c, 503, NULL, "router out of memory");
    goto out;
  }
  for (size_t i = 0; i < nm; i++) {
    const tw_harmony_message_t *m = &conv->messages[i];
    twain__v1__message__init(&msgs[i]);
    msgs[i].role = (char *)tw_harmony_role_str(m->role);
    msgs[i].name = (char *)(m->name ? m->name : "");
    msgs[i].channel = (char *)(m->channel ? m->channel : "");
    msgs[i].recipient = (char *)(m->recipient ? m->recipient : "");
    msgs[i].content_type = (char *)(m->content_type ? m->content_type : "");
    msgs[i].content = (char *)m->content;
    mp[i] = &msgs[i];
  }
  bool found = !only;
  for (size_t i = 0; i < nt && !none; i++) {
    const tw_harmony_tool_t *t = &conv->tools[i];
    if (only && strcmp(only, t->name) != 0) continue;
    found = true;
    twain__v1__function_tool__init(&tools[chat.n_tools]);
    tools[chat.n_tools].name = (char *)t->name;
    tools[chat.n_tools].description = (char *)(t->description ? t->description : "");
    tools[chat.n_tools].parameters_json = (char *)(t->parameters_json ? t->parameters_json : "");
    tp[chat.n_tools] = &tools[chat.n_tools];
    chat.n_tools++;
  }
  if (!found) {
    tw_http_fail(c, 400, "tool_choice", "'tool_choice' names \"%s\", which is not in 'tools'", only);
    goto out;
  }
  if (conv->developer_instructions)
    tw_tok_buf_append(&instr, conv->developer_instructions, strlen(conv->developer_instructions));
  if (required || only) {
    char note[320];
    if (only) snprintf(note, sizeof note, "Call the function %s now.", only);
    else snprintf(note, sizeof note, "Call one of the functions now.");
    if (instr.len) tw_tok_buf_append(&instr, "\n\n", 2);
    tw_tok_buf_append(&instr, note, strlen(note));
  }
  chat.messages = mp;
  chat.n_messages = nm;
  chat.tools = tp;
  chat.reasoning = conv->reasoning_effort == TW_HARMONY_EFFORT_LOW    ? TWAIN__V1__REASONING_EFFORT__REASONING_LOW
                   : conv->reasoning_effort == TW_HARMONY_EFFORT_HIGH ? TWAIN__V1__REASONING_EFFORT__REASONING_HIGH
                                                                      : TWAIN__V1__REASONING_EFFORT__REASONING_MEDIUM;
  chat.date = (char *)(conv->current_date ? conv->current_date : "");
  chat.instructions = instr.data ? instr.data : (char *)"";
  s->sp.stop = s->stop;
  s->sp.n_stop = s->n_stop;
  chat.sampling = &s->sp;
  chat.stream = true; /* always: a non-streamed answer is built from the same deltas */
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
  cr.chat = &chat;
  tw_dispatch(c, &cr);
out:
  tw_tok_buf_fini(&instr);
  free(msgs);
  free(mp);
  free(tools);
  free(tp);
}

static void tw_submit_chat(tw_hconn_t *c, const cJSON *root) {
  static const tw_unsup_t unsup[] = {
      {"response_format", TW_U_NOT_TEXT}, {"logprobs", TW_U_TRUE}, {"top_logprobs", TW_U_SET},
      {"logit_bias", TW_U_NONEMPTY}, {"presence_penalty", TW_U_NONZERO},
      {"frequency_penalty", TW_U_NONZERO}, {"audio", TW_U_SET}, {"prediction", TW_U_SET},
      {"web_search_options", TW_U_SET}};
  tw_hsampling_t s = {0};
  if (!tw_unsupported(c, root, unsup, sizeof unsup / sizeof unsup[0])) return;
  if (!tw_common(c, root, "max_completion_tokens", "max_tokens", 0, true, &s)) return;
  if (!cJSON_IsArray(tw_field(root, "messages"))) {
    tw_http_fail(c, 400, "messages", "'messages' must be an array of messages");
    return;
  }
  tw_harmony_conversation_t conv;
  tw_harmony_conversation_init(&conv);
  if (tw_harmony_conversation_from_openai_json(&conv, c->body.data, c->body.len) != TW_OK)
    tw_http_fail(c, 400, NULL, "%s", tw_last_error());
  else
    tw_submit_conversation(c, &conv, tw_field(root, "tool_choice"), &s);
  tw_harmony_conversation_fini(&conv);
}

/* Content of a Responses message: a string, or parts with "text". */
static cJSON *tw_resp_content(const cJSON *content) {
  if (!content) return cJSON_CreateString("");
  return cJSON_Duplicate(content, true);
}

/* Responses input -> chat messages (appended to `msgs`); NULL on success,
 * else the message of a 400. */
static const char *tw_resp_input(const cJSON *input, cJSON *msgs, char *err, size_t errlen) {
  if (cJSON_IsString(input)) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", input->valuestring);
    cJSON_AddItemToArray(msgs, m);
    return NULL;
  }
  if (!cJSON_IsArray(input)) return "'input' must be a string or an array of items";
  int i = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, input) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(it, "type");
    const char *t = cJSON_IsString(type) ? type->valuestring : "message";
    cJSON *m = cJSON_CreateObject();
    if (!cJSON_IsObject(it)) {
      snprintf(err, errlen, "input[%d] must be an object", i);
      cJSON_Delete(m);
      return err;
    }
    if (!strcmp(t, "message")) {
      const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
      cJSON_AddStringToObject(m, "role", cJSON_IsString(role) ? role->valuestring : "");
      cJSON_AddItemToObject(m, "content",
                            tw_resp_content(cJSON_GetObjectItemCaseSensitive(it, "content")));
    } else if (!strcmp(t, "function_call")) {
      const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
      const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
      const cJSON *args = cJSON_GetObjectItemCaseSensitive(it, "arguments");
      if (!cJSON_IsString(name)) {
        snprintf(err, errlen, "input[%d].name is missing", i);
        cJSON_Delete(m);
        return err;
      }
      cJSON_AddStringToObject(m, "role", "assistant");
      cJSON_AddStringToObject(m, "content", "");
      cJSON *call = cJSON_CreateObject(), *fn = cJSON_AddObjectToObject(call, "function");
      cJSON_AddStringToObject(call, "id", cJSON_IsString(id) ? id->valuestring : "");
      cJSON_AddStringToObject(call, "type", "function");
      cJSON_AddStringToObject(fn, "name", name->valuestring);
      cJSON_AddStringToObject(fn, "arguments", cJSON_IsString(args) ? args->valuestring : "{}");
      cJSON_AddItemToArray(cJSON_AddArrayToObject(m, "tool_calls"), call);
    } else if (!strcmp(t, "function_call_output")) {
      const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
      cJSON_AddStringToObject(m, "role", "tool");
      cJSON_AddStringToObject(m, "tool_call_id", cJSON_IsString(id) ? id->valuestring : "");
      cJSON_AddItemToObject(m, "content",
                            tw_resp_content(cJSON_GetObjectItemCaseSensitive(it, "output")));
    } else if (!strcmp(t, "reasoning")) { /* earlier reasoning: content, else the summary */
      tw_tok_buf_t b;
      tw_tok_buf_init(&b);
      for (int pass = 0; pass < 2 && !b.len; pass++) {
        const cJSON *parts = cJSON_GetObjectItemCaseSensitive(it, pass ? "summary" : "content"), *p;
        cJSON_ArrayForEach(p, parts) {
          const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
          if (cJSON_IsString(text)) tw_tok_buf_append(&b, text->valuestring, strlen(text->valuestring));
        }
      }
      cJSON_AddStringToObject(m, "role", "assistant");
      cJSON_AddStringToObject(m, "content", "");
      cJSON_AddStringToObject(m, "reasoning_content", b.data ? b.data : "");
      bool empty = !b.len;
      tw_tok_buf_fini(&b);
      if (empty) { /* nothing to carry */
        cJSON_Delete(m);
        i++;
        continue;
      }
    } else {
      snprintf(err, errlen, "input[%d].type \"%s\" is not supported (message, function_call, "
               "function_call_output, reasoning)", i, t);
      cJSON_Delete(m);
      return err;
    }
    cJSON_AddItemToArray(msgs, m);
    i++;
  }
  return NULL;
}

static void tw_submit_responses(tw_hconn_t *c, const cJSON *root) {
  static const tw_unsup_t unsup[] = {
      {"previous_response_id", TW_U_SET}, {"conversation", TW_U_SET}, {"background", TW_U_TRUE},
      {"prompt", TW_U_SET}, {"top_logprobs", TW_U_SET}};
  tw_hsampling_t s = {0};
  if (!tw_unsupported(c, root, unsup, sizeof unsup / sizeof unsup[0])) return;
  const cJSON *text = tw_field(root, "text");
  if (text && tw_field(text, "format")) {
    static const tw_unsup_t fmt[] = {{"format", TW_U_NOT_TEXT}};
    if (!tw_unsupported(c, text, fmt, 1)) return;
  }
  if (!tw_common(c, root, "max_output_tokens", NULL, 0, false, &s)) return;
  const cJSON *input = tw_field(root, "input");
  const cJSON *instructions = tw_field(root, "instructions");
  if (!input) {
    tw_http_fail(c, 400, "input", "'input' is missing");
    return;
  }
  if (instructions && !cJSON_IsString(instructions)) {
    tw_http_fail(c, 400, "instructions", "'instructions' must be a string");
    return;
  }
  cJSON *chat = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(chat, "messages");
  if (instructions) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "developer");
    cJSON_AddStringToObject(m, "content", instructions->valuestring);
    cJSON_AddItemToArray(msgs, m);
  }
  char err[256];
  const char *bad = tw_resp_input(input, msgs, err, sizeof err);
  const cJSON *tools = tw_field(root, "tools");
  if (tools) cJSON_AddItemToObject(chat, "tools", cJSON_Duplicate(tools, true));
  const cJSON *effort = tw_field(tw_field(root, "reasoning"), "effort");
  if (effort) cJSON_AddItemToObject(chat, "reasoning_effort", cJSON_Duplicate(effort, true));
  char *txt = bad ? NULL : cJSON_PrintUnformatted(chat);
  cJSON_Delete(chat);
  if (bad) {
    tw_http_fail(c, 400, "input", "%s", bad);
    return;
  }
  tw_harmony_conversation_t conv;
  tw_harmony_conversation_init(&conv);
  if (!txt || tw_harmony_conversation_from_openai_json(&conv, txt, strlen(txt)) != TW_OK)
    tw_http_fail(c, 400, NULL, "%s", txt ? tw_last_error() : "out of memory");
  else
    tw_submit_conversation(c, &conv, tw_field(root, "tool_choice"), &s);
  tw_harmony_conversation_fini(&conv);
  free(txt);
}

static void tw_submit_completions(tw_hconn_t *c, const cJSON *root) {
  static const tw_unsup_t unsup[] = {
      {"echo", TW_U_TRUE}, {"logprobs", TW_U_SET}, {"suffix", TW_U_SET},
      {"logit_bias", TW_U_NONEMPTY}, {"presence_penalty", TW_U_NONZERO},
      {"frequency_penalty", TW_U_NONZERO}};
  tw_hsampling_t s = {0};
  if (!tw_unsupported(c, root, unsup, sizeof unsup / sizeof unsup[0])) return;
  int64_t best_of = 1;
  if (!tw_int(c, root, "best_of", 0, 1e9, &best_of)) return;
  if (best_of != 1) {
    tw_http_fail(c, 400, "best_of", "'best_of' = %lld: only 1 is supported", (long long)best_of);
    return;
  }
  if (!tw_common(c, root, "max_tokens", NULL, 16, true, &s)) return; /* OpenAI's default: 16 */
  const cJSON *prompt = tw_field(root, "prompt");
  if (cJSON_IsArray(prompt) && cJSON_GetArraySize(prompt) == 1 &&
      (cJSON_IsString(prompt->child) || cJSON_IsArray(prompt->child)))
    prompt = prompt->child; /* a batch of one */
  const tw_tokenizer_t *tok;
  tw_tok_encoder_t *enc;
  tw_rchat_tokenizer(c->h->r, &tok, &enc);
  tw_token_ids_t ids;
  tw_token_ids_init(&ids);
  if (cJSON_IsString(prompt)) {
    if (tw_tok_encoder_encode(enc, prompt->valuestring, strlen(prompt->valuestring), 0, &ids) != TW_OK) {
      tw_http_fail(c, 400, "prompt", "prompt: %s", tw_last_error());
      goto out;
    }
  } else if (cJSON_IsArray(prompt)) {
    const cJSON *e;
    cJSON_ArrayForEach(e, prompt) {
      if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || fabs(e->valuedouble) > 2e9) {
        tw_http_fail(c, 400, "prompt", "'prompt' must be a string or one array of token ids "
                     "(batches of prompts are not supported: send one per request)");
        goto out;
      }
      tw_token_ids_push(&ids, (int32_t)e->valuedouble);
    }
  } else {
    tw_http_fail(c, 400, "prompt", "'prompt' must be a string or an array of token ids");
    goto out;
  }
  for (size_t i = 0; i < s.n_stop; i++) {
    c->stops[c->n_stops] = strdup(s.stop[i]);
    if (!c->stops[c->n_stops]) continue;
    size_t l = strlen(s.stop[i]);
    if (l > c->max_stop) c->max_stop = l;
    c->n_stops++;
  }
  tw_tok_stream_init(&c->dec, tok, TW_TOK_SKIP_SPECIAL);
  tw_tok_buf_init(&c->ctext);
  Twain__V1__GenerateRequest g = TWAIN__V1__GENERATE_REQUEST__INIT;
  g.prompt_ids = ids.ids;
  g.n_prompt_ids = ids.n;
  g.sampling = &s.sp;
  g.stream = true;
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
  cr.generate = &g;
  tw_dispatch(c, &cr);
out:
  tw_token_ids_fini(&ids);
}

void tw_hoai_submit(tw_hconn_t *c) {
  cJSON *root = cJSON_ParseWithLength(c->body.data ? c->body.data : "", c->body.len);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    long off = at && c->body.data && at >= c->body.data && at <= c->body.data + c->body.len
                   ? (long)(at - c->body.data) : -1L;
    tw_http_fail(c, 400, NULL, "the request body is not valid JSON (near byte %ld)", off);
    return;
  }
  if (!cJSON_IsObject(root)) tw_http_fail(c, 400, NULL, "the request body must be a JSON object");
  else if (c->kind == TW_HK_CHAT) tw_submit_chat(c, root);
  else if (c->kind == TW_HK_RESPONSES) tw_submit_responses(c, root);
  else tw_submit_completions(c, root);
  cJSON_Delete(root);
}

/* ---- items from the router's deltas and tool calls ---- */

static const char *tw_fn_name(const char *recipient) {
  return !strncmp(recipient, "functions.", 10) ? recipient + 10 : recipient;
}

static tw_hitem_t *tw_item_new(tw_hconn_t *c, tw_hitem_kind_t kind, const char *recipient) {
  if (c->n_items == c->cap_items) {
    int cap = c->cap_items ? c->cap_items * 2 : 8;
    tw_hitem_t *t = realloc(c->items, sizeof *t * (size_t)cap);
    if (!t) return NULL;
    c->items = t;
    c->cap_items = cap;
  }
  tw_hitem_t *it = &c->items[c->n_items];
  memset(it, 0, sizeof *it);
  it->kind = kind;
  tw_tok_buf_init(&it->text);
  tw_tok_buf_append(&it->text, "", 0);
  static const char *const prefix[] = {"msg", "rs", "call"};
  snprintf(it->id, sizeof it->id, "%s_%llx%04x", prefix[kind], (unsigned long long)c->serial,
           (unsigned)c->n_items);
  if (kind == TW_HI_CALL) it->name = strdup(tw_fn_name(recipient ? recipient : ""));
  c->n_items++;
  return it;
}

/* What a kind of answer does as items open, grow and close. */
typedef struct {
  void (*open)(tw_hconn_t *c, int i);
  void (*delta)(tw_hconn_t *c, int i, const char *text, size_t len);
  void (*call_done)(tw_hconn_t *c, int i);
} tw_item_ops_t;

static void tw_items_feed(tw_hconn_t *c, const Twain__V1__ServerReply *rep, const tw_item_ops_t *ops) {
  for (size_t k = 0; k < rep->n_deltas; k++) {
    const Twain__V1__Delta *d = rep->deltas[k];
    const char *rc = d->recipient ? d->recipient : "";
    tw_hitem_t *it = c->n_items ? &c->items[c->n_items - 1] : NULL;
    if ((d->role && d->role[0]) || !it || it->closed) {
      tw_hitem_kind_t kind = rc[0] ? TW_HI_CALL
                             : d->channel && !strcmp(d->channel, "analysis") ? TW_HI_REASONING
                                                                             : TW_HI_TEXT;
      if (!(it = tw_item_new(c, kind, rc))) continue;
      if (c->stream && ops->open) ops->open(c, c->n_items - 1);
    }
    size_t len = d->content ? strlen(d->content) : 0;
    if (!len) continue;
    tw_tok_buf_append(&it->text, d->content, len);
    if (c->stream && ops->delta) ops->delta(c, c->n_items - 1, d->content, len);
  }
  for (size_t k = 0; k < rep->n_tool_calls; k++) {
    const Twain__V1__ToolCall *t = rep->tool_calls[k];
    tw_hitem_t *it = c->n_items ? &c->items[c->n_items - 1] : NULL;
    const char *args = t->arguments ? t->arguments : "";
    if (it && it->kind == TW_HI_CALL && !it->closed) { /* its arguments were streamed */
      it->text.len = 0;
      tw_tok_buf_append(&it->text, args, strlen(args));
    } else { /* a call without streamed arguments */
      if (!(it = tw_item_new(c, TW_HI_CALL, t->recipient))) continue;
      tw_tok_buf_append(&it->text, args, strlen(args));
      if (c->stream && ops->open) ops->open(c, c->n_items - 1);
    }
    it->closed = true;
    if (c->stream && ops->call_done) ops->call_done(c, c->n_items - 1);
  }
}

static bool tw_has_call(const tw_hconn_t *c) {
  for (int i = 0; i < c->n_items; i++)
    if (c->items[i].kind == TW_HI_CALL && c->items[i].closed) return true;
  return false;
}

static cJSON *tw_usage(const tw_hconn_t *c, bool responses) {
  cJSON *u = cJSON_CreateObject();
  cJSON_AddNumberToObject(u, responses ? "input_tokens" : "prompt_tokens", c->prompt_tokens);
  cJSON_AddNumberToObject(u, responses ? "output_tokens" : "completion_tokens", c->completion_tokens);
  cJSON_AddNumberToObject(u, "total_tokens", c->prompt_tokens + c->completion_tokens);
  if (responses) {
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "input_tokens_details"), "cached_tokens", 0);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "output_tokens_details"), "reasoning_tokens", 0);
  }
  return u;
}

/* ---- chat completions ---- */

/* {id, object, created, model, choices: [choice]} (choice NULL: []), with
 * the choice's logprobs null and finish_reason (NULL: null). */
static cJSON *tw_envelope(const tw_hconn_t *c, const char *id_prefix, const char *object,
                          cJSON *choice, const char *finish) {
  char id[48];
  snprintf(id, sizeof id, "%s%llx", id_prefix, (unsigned long long)c->serial);
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", id);
  cJSON_AddStringToObject(o, "object", object);
  cJSON_AddNumberToObject(o, "created", (double)c->created);
  cJSON_AddStringToObject(o, "model", c->h->model);
  cJSON *arr = cJSON_AddArrayToObject(o, "choices");
  if (!choice) return o;
  cJSON_AddNumberToObject(choice, "index", 0);
  cJSON_AddNullToObject(choice, "logprobs");
  if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
  else cJSON_AddNullToObject(choice, "finish_reason");
  cJSON_AddItemToArray(arr, choice);
  return o;
}

/* The end of a chat or completions stream: the chunk with the finish
 * reason, the usage chunk if asked for, [DONE]. */
static void tw_stream_end(tw_hconn_t *c, const char *id_prefix, const char *object, cJSON *last) {
  tw_http_sse_data(c, last);
  if (c->include_usage) {
    cJSON *o = tw_envelope(c, id_prefix, object, NULL, NULL);
    cJSON_AddItemToObject(o, "usage", tw_usage(c, false));
    tw_http_sse_data(c, o);
  }
  tw_http_out(c, "data: [DONE]\n\n", 14);
  c->finished = true;
}

static cJSON *tw_chat_chunk(tw_hconn_t *c, cJSON *delta, const char *finish) {
  cJSON *ch = cJSON_CreateObject();
  cJSON_AddItemToObject(ch, "delta", delta ? delta : cJSON_CreateObject());
  return tw_envelope(c, "chatcmpl-", "chat.completion.chunk", ch, finish);
}

/* {id, type: function, function: {name, arguments}} of call item `it`. */
static cJSON *tw_call_obj(const tw_hitem_t *it) {
  cJSON *call = cJSON_CreateObject();
  cJSON_AddStringToObject(call, "id", it->id);
  cJSON_AddStringToObject(call, "type", "function");
  cJSON *fn = cJSON_AddObjectToObject(call, "function");
  cJSON_AddStringToObject(fn, "name", it->name ? it->name : "");
  cJSON_AddStringToObject(fn, "arguments", it->text.data ? it->text.data : "");
  return call;
}

static int tw_call_index(const tw_hconn_t *c, int item) {
  int k = 0;
  for (int i = 0; i < item; i++) k += c->items[i].kind == TW_HI_CALL;
  return k;
}

static void tw_chat_open(tw_hconn_t *c, int i) {
  const tw_hitem_t *it = &c->items[i];
  if (it->kind != TW_HI_CALL) return;
  cJSON *d = cJSON_CreateObject(), *call = tw_call_obj(it);
  cJSON_AddNumberToObject(call, "index", tw_call_index(c, i));
  cJSON_AddItemToArray(cJSON_AddArrayToObject(d, "tool_calls"), call);
  tw_http_sse_data(c, tw_chat_chunk(c, d, NULL));
}

static void tw_chat_delta(tw_hconn_t *c, int i, const char *text, size_t len) {
  const tw_hitem_t *it = &c->items[i];
  char *t = strndup(text, len);
  if (!t) return;
  cJSON *d = cJSON_CreateObject();
  if (it->kind == TW_HI_CALL) {
    cJSON *call = cJSON_CreateObject();
    cJSON_AddNumberToObject(call, "index", tw_call_index(c, i));
    cJSON_AddStringToObject(cJSON_AddObjectToObject(call, "function"), "arguments", t);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(d, "tool_calls"), call);
  } else {
    cJSON_AddStringToObject(d, it->kind == TW_HI_REASONING ? "reasoning_content" : "content", t);
  }
  free(t);
  tw_http_sse_data(c, tw_chat_chunk(c, d, NULL));
}

static const char *tw_chat_finish(const tw_hconn_t *c) {
  if (c->finish == TWAIN__V1__FINISH_REASON__FINISH_LENGTH) return "length";
  return tw_has_call(c) ? "tool_calls" : "stop";
}

/* Items of one kind joined, or NULL when there is none. */
static char *tw_join(const tw_hconn_t *c, tw_hitem_kind_t kind) {
  tw_tok_buf_t b;
  tw_tok_buf_init(&b);
  bool any = false;
  for (int i = 0; i < c->n_items; i++)
    if (c->items[i].kind == kind) {
      any = true;
      tw_tok_buf_append(&b, c->items[i].text.data, c->items[i].text.len);
    }
  if (!any) return NULL;
  if (!b.data) tw_tok_buf_append(&b, "", 0);
  return b.data;
}

static void tw_chat_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep) {
  static const tw_item_ops_t ops = {tw_chat_open, tw_chat_delta, NULL};
  if (c->stream && !c->sent_head) {
    c->sent_head = true;
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "role", "assistant");
    cJSON_AddStringToObject(d, "content", "");
    tw_http_sse_data(c, tw_chat_chunk(c, d, NULL));
  }
  tw_items_feed(c, rep, &ops);
  if (!rep->done) return;
  const char *finish = tw_chat_finish(c);
  if (c->stream) {
    tw_stream_end(c, "chatcmpl-", "chat.completion.chunk", tw_chat_chunk(c, NULL, finish));
    return;
  }
  cJSON *ch = cJSON_CreateObject(), *msg = cJSON_AddObjectToObject(ch, "message");
  cJSON_AddStringToObject(msg, "role", "assistant");
  char *content = tw_join(c, TW_HI_TEXT), *reasoning = tw_join(c, TW_HI_REASONING);
  bool calls = false;
  for (int i = 0; i < c->n_items; i++) calls |= c->items[i].kind == TW_HI_CALL;
  if (content || !calls) cJSON_AddStringToObject(msg, "content", content ? content : "");
  else cJSON_AddNullToObject(msg, "content");
  if (reasoning) cJSON_AddStringToObject(msg, "reasoning_content", reasoning);
  else cJSON_AddNullToObject(msg, "reasoning_content");
  free(content);
  free(reasoning);
  if (calls) {
    cJSON *arr = cJSON_AddArrayToObject(msg, "tool_calls");
    for (int i = 0; i < c->n_items; i++)
      if (c->items[i].kind == TW_HI_CALL) cJSON_AddItemToArray(arr, tw_call_obj(&c->items[i]));
  }
  cJSON *o = tw_envelope(c, "chatcmpl-", "chat.completion", ch, finish);
  cJSON_AddItemToObject(o, "usage", tw_usage(c, false));
  tw_http_answer_json(c, o);
}

/* ---- responses ---- */

/* The item id of a call (its call id is "call_X": "fc_X"). */
static void tw_fc_id(const tw_hitem_t *it, char *buf, size_t len) {
  snprintf(buf, len, "fc_%s", it->id + 5);
}

static cJSON *tw_resp_item(const tw_hconn_t *c, int i, bool done) {
  const tw_hitem_t *it = &c->items[i];
  const char *text = done && it->text.data ? it->text.data : "";
  cJSON *o = cJSON_CreateObject();
  if (it->kind == TW_HI_CALL) {
    char fid[48];
    tw_fc_id(it, fid, sizeof fid);
    cJSON_AddStringToObject(o, "type", "function_call");
    cJSON_AddStringToObject(o, "id", fid);
    cJSON_AddStringToObject(o, "call_id", it->id);
    cJSON_AddStringToObject(o, "name", it->name ? it->name : "");
    cJSON_AddStringToObject(o, "arguments", text);
    cJSON_AddStringToObject(o, "status", done ? "completed" : "in_progress");
    return o;
  }
  bool rs = it->kind == TW_HI_REASONING;
  cJSON_AddStringToObject(o, "type", rs ? "reasoning" : "message");
  cJSON_AddStringToObject(o, "id", it->id);
  if (rs) cJSON_AddArrayToObject(o, "summary");
  else cJSON_AddStringToObject(o, "role", "assistant");
  cJSON_AddStringToObject(o, "status", done ? "completed" : "in_progress");
  cJSON *content = cJSON_AddArrayToObject(o, "content");
  if (done || !rs) {
    cJSON *part = cJSON_CreateObject();
    cJSON_AddStringToObject(part, "type", rs ? "reasoning_text" : "output_text");
    cJSON_AddStringToObject(part, "text", text);
    if (!rs) cJSON_AddArrayToObject(part, "annotations");
    if (done || rs) cJSON_AddItemToArray(content, part);
    else cJSON_Delete(part);
  }
  return o;
}

static cJSON *tw_resp_part(const tw_hitem_t *it, bool done) {
  bool rs = it->kind == TW_HI_REASONING;
  cJSON *part = cJSON_CreateObject();
  cJSON_AddStringToObject(part, "type", rs ? "reasoning_text" : "output_text");
  cJSON_AddStringToObject(part, "text", done && it->text.data ? it->text.data : "");
  if (!rs) cJSON_AddArrayToObject(part, "annotations");
  return part;
}

static cJSON *tw_resp_object(const tw_hconn_t *c, const char *status) {
  char id[48];
  snprintf(id, sizeof id, "resp_%llx", (unsigned long long)c->serial);
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "id", id);
  cJSON_AddStringToObject(o, "object", "response");
  cJSON_AddNumberToObject(o, "created_at", (double)c->created);
  cJSON_AddStringToObject(o, "status", status);
  cJSON_AddStringToObject(o, "model", c->h->model);
  cJSON *out = cJSON_AddArrayToObject(o, "output");
  bool done = strcmp(status, "in_progress") != 0;
  for (int i = 0; done && i < c->n_items; i++) cJSON_AddItemToArray(out, tw_resp_item(c, i, true));
  cJSON_AddNullToObject(o, "error");
  if (!strcmp(status, "incomplete"))
    cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "incomplete_details"), "reason",
                            "max_output_tokens");
  else
    cJSON_AddNullToObject(o, "incomplete_details");
  cJSON_AddBoolToObject(o, "parallel_tool_calls", false);
  cJSON_AddStringToObject(o, "tool_choice", "auto");
  cJSON_AddArrayToObject(o, "tools");
  if (done) cJSON_AddItemToObject(o, "usage", tw_usage(c, true));
  else cJSON_AddNullToObject(o, "usage");
  return o;
}

static void tw_resp_end_item(tw_hconn_t *c, int i) {
  tw_hitem_t *it = &c->items[i];
  if (it->ended) return;
  it->ended = true;
  cJSON *e;
  if (it->kind == TW_HI_CALL) {
    char fid[48];
    tw_fc_id(it, fid, sizeof fid);
    e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "item_id", fid);
    cJSON_AddNumberToObject(e, "output_index", i);
    cJSON_AddStringToObject(e, "arguments", it->text.data ? it->text.data : "");
    tw_http_sse_event(c, "response.function_call_arguments.done", e);
  } else {
    bool rs = it->kind == TW_HI_REASONING;
    e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "item_id", it->id);
    cJSON_AddNumberToObject(e, "output_index", i);
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON_AddStringToObject(e, "text", it->text.data ? it->text.data : "");
    tw_http_sse_event(c, rs ? "response.reasoning_text.done" : "response.output_text.done", e);
    e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "item_id", it->id);
    cJSON_AddNumberToObject(e, "output_index", i);
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON_AddItemToObject(e, "part", tw_resp_part(it, true));
    tw_http_sse_event(c, "response.content_part.done", e);
  }
  e = cJSON_CreateObject();
  cJSON_AddNumberToObject(e, "output_index", i);
  cJSON_AddItemToObject(e, "item", tw_resp_item(c, i, true));
  tw_http_sse_event(c, "response.output_item.done", e);
}

static void tw_resp_open(tw_hconn_t *c, int i) {
  for (int k = 0; k < i; k++) tw_resp_end_item(c, k);
  const tw_hitem_t *it = &c->items[i];
  cJSON *e = cJSON_CreateObject();
  cJSON_AddNumberToObject(e, "output_index", i);
  cJSON_AddItemToObject(e, "item", tw_resp_item(c, i, false));
  tw_http_sse_event(c, "response.output_item.added", e);
  if (it->kind == TW_HI_CALL) {
    if (it->text.len) { /* a call that arrived whole */
      char fid[48];
      tw_fc_id(it, fid, sizeof fid);
      e = cJSON_CreateObject();
      cJSON_AddStringToObject(e, "item_id", fid);
      cJSON_AddNumberToObject(e, "output_index", i);
      cJSON_AddStringToObject(e, "delta", it->text.data);
      tw_http_sse_event(c, "response.function_call_arguments.delta", e);
    }
    return;
  }
  e = cJSON_CreateObject();
  cJSON_AddStringToObject(e, "item_id", it->id);
  cJSON_AddNumberToObject(e, "output_index", i);
  cJSON_AddNumberToObject(e, "content_index", 0);
  cJSON_AddItemToObject(e, "part", tw_resp_part(it, false));
  tw_http_sse_event(c, "response.content_part.added", e);
}

static void tw_resp_delta(tw_hconn_t *c, int i, const char *text, size_t len) {
  const tw_hitem_t *it = &c->items[i];
  char *t = strndup(text, len);
  if (!t) return;
  cJSON *e = cJSON_CreateObject();
  if (it->kind == TW_HI_CALL) {
    char fid[48];
    tw_fc_id(it, fid, sizeof fid);
    cJSON_AddStringToObject(e, "item_id", fid);
    cJSON_AddNumberToObject(e, "output_index", i);
    cJSON_AddStringToObject(e, "delta", t);
    tw_http_sse_event(c, "response.function_call_arguments.delta", e);
  } else {
    cJSON_AddStringToObject(e, "item_id", it->id);
    cJSON_AddNumberToObject(e, "output_index", i);
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON_AddStringToObject(e, "delta", t);
    if (it->kind == TW_HI_TEXT) cJSON_AddArrayToObject(e, "logprobs");
    tw_http_sse_event(c, it->kind == TW_HI_REASONING ? "response.reasoning_text.delta"
                                                     : "response.output_text.delta", e);
  }
  free(t);
}

static void tw_resp_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep) {
  static const tw_item_ops_t ops = {tw_resp_open, tw_resp_delta, tw_resp_end_item};
  if (c->stream && !c->sent_head) {
    c->sent_head = true;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddItemToObject(e, "response", tw_resp_object(c, "in_progress"));
    tw_http_sse_event(c, "response.created", e);
    e = cJSON_CreateObject();
    cJSON_AddItemToObject(e, "response", tw_resp_object(c, "in_progress"));
    tw_http_sse_event(c, "response.in_progress", e);
  }
  tw_items_feed(c, rep, &ops);
  if (!rep->done) return;
  const char *status =
      c->finish == TWAIN__V1__FINISH_REASON__FINISH_LENGTH ? "incomplete" : "completed";
  if (!c->stream) {
    tw_http_answer_json(c, tw_resp_object(c, status));
    return;
  }
  for (int i = 0; i < c->n_items; i++) tw_resp_end_item(c, i);
  cJSON *e = cJSON_CreateObject();
  cJSON_AddItemToObject(e, "response", tw_resp_object(c, status));
  tw_http_sse_event(c, strcmp(status, "completed") ? "response.incomplete" : "response.completed", e);
  c->finished = true;
}

/* ---- completions ---- */

static cJSON *tw_cmpl_object(tw_hconn_t *c, const char *text, size_t len, const char *finish) {
  cJSON *ch = cJSON_CreateObject();
  char *t = strndup(text ? text : "", len);
  cJSON_AddStringToObject(ch, "text", t ? t : "");
  free(t);
  return tw_envelope(c, "cmpl-", "text_completion", ch, finish);
}

static void tw_cmpl_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep) {
  bool stop_hit = false;
  for (size_t i = 0; i < rep->n_token_ids && !stop_hit; i++) {
    size_t old = c->ctext.len;
    tw_tok_stream_push(&c->dec, rep->token_ids[i], &c->ctext);
    c->n_seen++;
    size_t from = old >= c->max_stop ? old - c->max_stop + 1 : 0;
    for (int k = 0; k < c->n_stops && c->ctext.len; k++) {
      const char *hit = memmem(c->ctext.data + from, c->ctext.len - from, c->stops[k], strlen(c->stops[k]));
      if (hit && (size_t)(hit - c->ctext.data) <= c->ctext.len) {
        c->ctext.len = (size_t)(hit - c->ctext.data);
        c->ctext.data[c->ctext.len] = '\0';
        stop_hit = true;
      }
    }
  }
  bool done = rep->done || stop_hit;
  if (rep->done && !stop_hit) tw_tok_stream_finish(&c->dec, &c->ctext);
  if (stop_hit && !rep->done) { /* stop the generation too */
    c->want_cancel = true;
    c->h->pending_cancel = true;
  }
  if (stop_hit) c->completion_tokens = c->n_seen; /* what reached the text */
  const char *finish = !done ? NULL
                       : !stop_hit && c->finish == TWAIN__V1__FINISH_REASON__FINISH_LENGTH ? "length"
                                                                                         : "stop";
  if (!c->stream) {
    if (done) {
      cJSON *o = tw_cmpl_object(c, c->ctext.data, c->ctext.len, finish);
      cJSON_AddItemToObject(o, "usage", tw_usage(c, false));
      tw_http_answer_json(c, o);
    }
    return;
  }
  size_t end = c->ctext.len; /* hold back what may be the start of a stop string */
  if (!done && c->max_stop > 1) {
    end = end > c->max_stop - 1 ? end - (c->max_stop - 1) : 0;
    while (end > c->ctext_sent && (c->ctext.data[end] & 0xC0) == 0x80) end--;
  }
  if (end > c->ctext_sent) {
    tw_http_sse_data(c, tw_cmpl_object(c, c->ctext.data + c->ctext_sent, end - c->ctext_sent, NULL));
    c->ctext_sent = end;
  }
  if (done) tw_stream_end(c, "cmpl-", "text_completion", tw_cmpl_object(c, "", 0, finish));
}

void tw_hoai_on_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep) {
  if (rep->error && rep->error->code) {
    tw_http_fail(c, tw_http_status_of_code(rep->error->code), NULL, "%s",
                 rep->error->message && rep->error->message[0] ? rep->error->message : "request failed");
    return;
  }
  if (c->stream) c->sse = true;
  if (rep->usage && rep->done) {
    c->prompt_tokens = rep->usage->prompt_tokens;
    c->completion_tokens = rep->usage->completion_tokens;
  }
  if (rep->done) c->finish = rep->finish_reason;
  if (c->kind == TW_HK_CHAT) tw_chat_reply(c, rep);
  else if (c->kind == TW_HK_RESPONSES) tw_resp_reply(c, rep);
  else tw_cmpl_reply(c, rep);
  if (rep->done) c->finished = true;
}

void tw_hoai_free(tw_hconn_t *c) {
  for (int i = 0; i < c->n_items; i++) {
    free(c->items[i].name);
    tw_tok_buf_fini(&c->items[i].text);
  }
  free(c->items);
  c->items = NULL;
  c->n_items = 0;
  for (int i = 0; i < c->n_stops; i++) free(c->stops[i]);
  c->n_stops = 0;
  if (c->kind == TW_HK_COMPLETIONS) tw_tok_buf_fini(&c->ctext);
}
