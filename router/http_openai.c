/* http_openai.c: OpenAI request JSON -> twain.v1 requests (http_impl.h);
 * the answers are built in http_openai_reply.c.
 *
 * Chat messages and tools go through tw_harmony_conversation_from_openai_json
 * (common/text/harmony_openai.c), Responses input items are first rewritten as
 * chat messages; the router renders and parses Harmony (router_chat.c). Every
 * request is streamed from the router (a non-streamed answer is built from
 * the same deltas). Unknown fields are ignored; a wrong type or an
 * unsupported parameter is a 400 naming it. */
#include "router/http_impl.h"

#include "common/base/log.h"
#include "common/text/harmony.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- request fields ---- */

/* The field a conversation error (tw_harmony_conversation_from_openai_json)
 * is about: tools, tool_choice, or the messages (`input` in Responses). */
static const char *tw_conv_param(const char *msg, const char *messages) {
  /* the conversation reader's messages start with the field they are about */
  static const char *const fields[] = {
      "tool_choice",      "tools",          "reasoning_effort",      "current_date",
      "knowledge_cutoff", "model_identity", "developer_instructions"};
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
    if (!strncmp(msg, fields[i], strlen(fields[i]))) return fields[i];
  return messages;
}

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
  /* above 2^63 (a uint64 seed): its bits, not an out-of-range conversion */
  if (v && v->valuedouble >= 9223372036854775808.0)
    *out = (int64_t)(uint64_t)v->valuedouble;
  else if (v)
    *out = (int64_t)v->valuedouble;
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
typedef enum {
  TW_U_SET,
  TW_U_TRUE,
  TW_U_NONZERO,
  TW_U_NOT_ONE,
  TW_U_NONEMPTY,
  TW_U_NOT_TEXT
} tw_unsup_rule_t;
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
      case TW_U_NOT_ONE: bad = !cJSON_IsNumber(v) || v->valuedouble != 1; break;
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
  /* sampling fields of vLLM's that clients send through extra_body: top_k is
   * served (-1 or 0: no cut), the others would change the output if they
   * were dropped, so they are refused unless they say "off" */
  static const tw_unsup_t extra[] = {{"min_p", TW_U_NONZERO},
                                     {"repetition_penalty", TW_U_NOT_ONE},
                                     {"min_tokens", TW_U_NONZERO},
                                     {"ignore_eos", TW_U_TRUE}};
  int64_t top_k = 0;
  if (!tw_unsupported(c, root, extra, sizeof extra / sizeof extra[0]) ||
      !tw_int(c, root, "top_k", -1, 1e9, &top_k))
    return false;
  if (!tw_num(c, root, "temperature", &temperature) || !tw_num(c, root, "top_p", &top_p) ||
      !tw_int(c, root, "seed", -9.2e18, 1.8e19, &seed))
    return false;
  /* top_p 0 keeps only the most likely token (OpenAI's meaning): greedy, as
   * the sampler's 0 means "no nucleus" (the protobuf default) */
  if (tw_field(root, "top_p") && top_p == 0 && temperature >= 0 && temperature <= 100)
    temperature = 0; /* a temperature out of range stays, for the router to refuse */
  if (!tw_int(c, root, max_key, -1e9, 1e9, &max)) return false;
  if (!max && alt_key && !tw_int(c, root, alt_key, -1e9, 1e9, &max)) return false;
  bool explicit_max = tw_field(root, max_key) || (alt_key && tw_field(root, alt_key));
  c->max_key =
      explicit_max && !tw_field(root, max_key) ? alt_key : max_key; /* as the client named it */
  if (explicit_max && max < 1) {
    tw_http_fail(c, 400, c->max_key, "'%s' must be at least 1, got %lld", c->max_key,
                 (long long)max);
    return false;
  }
  s->sp.temperature = (float)temperature;
  s->sp.top_p = (float)top_p;
  s->sp.top_k = top_k > 0 ? (int32_t)top_k : 0;
  s->sp.seed = (uint64_t)seed;
  s->sp.explicit_seed = tw_field(root, "seed") != NULL;
  s->sp.max_tokens = explicit_max ? (int32_t)max : default_max;
  s->sp.explicit_max_tokens = explicit_max || default_max;
  s->sp.max_tokens_is_default = !explicit_max;
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
 * function ({"type":"function","function":{"name"}} in chat, {"type":
 * "function","name"} in responses): the router enforces the last two by
 * writing the call's header into the prompt (twain_api.proto ChatRequest
 * tool_choice, docs/api.md "Tool choice"). */
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
  for (size_t i = 0; i < nt; i++) { /* none: the router renders no tools */
    const tw_harmony_tool_t *t = &conv->tools[i];
    found |= only && !strcmp(only, t->name);
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
  chat.tool_choice = none       ? TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_NONE
                     : required ? TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_REQUIRED
                     : only     ? TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_FUNCTION
                                : TWAIN__V1__TOOL_CHOICE__TOOL_CHOICE_AUTO;
  chat.tool_choice_name = (char *)(only ? only : "");
  chat.messages = mp;
  chat.n_messages = nm;
  chat.tools = tp;
  chat.reasoning = conv->reasoning_effort == TW_HARMONY_EFFORT_LOW    ? TWAIN__V1__REASONING_EFFORT__REASONING_LOW
                   : conv->reasoning_effort == TW_HARMONY_EFFORT_HIGH ? TWAIN__V1__REASONING_EFFORT__REASONING_HIGH
                                                                      : TWAIN__V1__REASONING_EFFORT__REASONING_MEDIUM;
  chat.date = (char *)(conv->current_date ? conv->current_date : "");
  chat.instructions = (char *)(conv->developer_instructions ? conv->developer_instructions : "");
  s->sp.stop = s->stop;
  s->sp.n_stop = s->n_stop;
  chat.sampling = &s->sp;
  chat.stream = true; /* always: a non-streamed answer is built from the same deltas */
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_CHAT;
  cr.chat = &chat;
  tw_dispatch(c, &cr);
out:
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
    tw_http_fail(c, 400, tw_conv_param(tw_last_error(), "messages"), "%s", tw_last_error());
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
/* Returns NULL, or the reason in err with *status_p the HTTP status: 400
 * for bad input, 500 when out of memory. */
static const char *tw_resp_input(const cJSON *input, cJSON *msgs, char *err, size_t errlen,
                                 unsigned *status_p) {
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
      tw_status_t as = TW_OK;
      for (int pass = 0; pass < 2 && !b.len; pass++) {
        const cJSON *parts = cJSON_GetObjectItemCaseSensitive(it, pass ? "summary" : "content"), *p;
        cJSON_ArrayForEach(p, parts) { /* joined as message parts are (harmony_openai.c) */
          const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
          if (cJSON_IsString(text) && as == TW_OK && b.len) as = tw_tok_buf_append(&b, "\n", 1);
          if (cJSON_IsString(text) && as == TW_OK)
            as = tw_tok_buf_append(&b, text->valuestring, strlen(text->valuestring));
        }
      }
      if (as != TW_OK) {
        snprintf(err, errlen, "input[%d]: %s", i, tw_last_error());
        *status_p = 500;
        tw_tok_buf_fini(&b);
        cJSON_Delete(m);
        return err;
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
  const cJSON *ftype = tw_field(tw_field(text, "format"), "type");
  if (tw_field(text, "format") && !(cJSON_IsString(ftype) && !strcmp(ftype->valuestring, "text"))) {
    tw_http_fail(c, 400, "text.format", "'text.format' other than text is not supported by this server");
    return;
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
  unsigned bad_status = 400;
  const char *bad = tw_resp_input(input, msgs, err, sizeof err, &bad_status);
  const cJSON *tools = tw_field(root, "tools");
  if (tools) cJSON_AddItemToObject(chat, "tools", cJSON_Duplicate(tools, true));
  const cJSON *tool_choice = tw_field(root, "tool_choice");
  c->echo_tool_choice = tool_choice ? cJSON_Duplicate(tool_choice, true) : NULL;
  c->echo_tools = cJSON_IsArray(tools) ? cJSON_Duplicate(tools, true) : NULL;
  const cJSON *effort = tw_field(tw_field(root, "reasoning"), "effort");
  if (effort) cJSON_AddItemToObject(chat, "reasoning_effort", cJSON_Duplicate(effort, true));
  char *txt = bad ? NULL : cJSON_PrintUnformatted(chat);
  cJSON_Delete(chat);
  if (bad) {
    tw_http_fail(c, bad_status, bad_status == 400 ? "input" : NULL, "%s", bad);
    return;
  }
  tw_harmony_conversation_t conv;
  tw_harmony_conversation_init(&conv);
  if (!txt || tw_harmony_conversation_from_openai_json(&conv, txt, strlen(txt)) != TW_OK)
    tw_http_fail(c, 400, txt ? tw_conv_param(tw_last_error(), "input") : NULL, "%s",
                 txt ? tw_last_error() : "out of memory");
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
      if (!tw_http_check(c, tw_token_ids_push(&ids, (int32_t)e->valuedouble))) goto out; /* 500 */
    }
  } else {
    tw_http_fail(c, 400, "prompt", "'prompt' must be a string or an array of token ids");
    goto out;
  }
  if (ids.n == 0) {
    tw_http_fail(c, 400, "prompt", "'prompt' is empty");
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
  /* the usage of an answer cut by a stop string, which ends before the
   * router's last reply (the request is cancelled there) */
  c->prompt_tokens = (int32_t)ids.n;
  Twain__V1__ClientRequest cr = TWAIN__V1__CLIENT_REQUEST__INIT;
  cr.body_case = TWAIN__V1__CLIENT_REQUEST__BODY_GENERATE;
  cr.generate = &g;
  tw_dispatch(c, &cr);
out:
  tw_token_ids_fini(&ids);
}

/* JSON text is UTF-8 (RFC 8259 §8.1), and a string here cannot hold U+0000:
 * cJSON would end the string there and drop the rest, so a NUL byte or
 * "\u0000" is refused rather than cut. False after a 400 saying which. */
static bool tw_body_ok(tw_hconn_t *c) {
  const char *b = c->body.data;
  size_t len = c->body.len, bad = 0;
  if (b && !tw_utf8_valid(b, len, &bad)) {
    tw_http_fail(c, 400, NULL, "the request body is not valid UTF-8 (byte %zu)", bad);
    return false;
  }
  if (b && memchr(b, 0, len)) {
    tw_http_fail(c, 400, NULL, "the request body holds a NUL byte (byte %zu)",
                 (size_t)((const char *)memchr(b, 0, len) - b));
    return false;
  }
  for (size_t i = 0; i + 1 < len; i++) {
    if (b[i] != '\\') continue;
    if (b[i + 1] == 'u' && i + 6 <= len && !memcmp(b + i + 2, "0000", 4)) {
      tw_http_fail(c, 400, NULL,
                   "a string in the request body holds U+0000 (\\u0000 at byte %zu), "
                   "which this server does not accept",
                   i);
      return false;
    }
    i++; /* the escaped character */
  }
  return true;
}

void tw_hoai_submit(tw_hconn_t *c) {
  if (!tw_body_ok(c)) return;
  if (c->body.len == 0) {
    tw_http_fail(c, 400, NULL, "the request body is empty: send a JSON object");
    return;
  }
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(c->body.data, c->body.len, &end, 0);
  size_t rest = root && end ? (size_t)(end - c->body.data) : 0;
  while (root && rest < c->body.len && strchr(" \t\r\n", c->body.data[rest]) && c->body.data[rest])
    rest++;
  if (root && rest < c->body.len) { /* one JSON value, then something else */
    cJSON_Delete(root);
    tw_http_fail(c, 400, NULL,
                 "the request body is not valid JSON: more after the object (at byte %zu)", rest);
    return;
  }
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
