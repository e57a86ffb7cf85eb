/* http_openai_reply.c: router replies -> OpenAI answers and Server-Sent
 * Events (http_impl.h). Each Harmony message of the answer becomes one item:
 * analysis -> reasoning, a message with a recipient (on any channel, the
 * recipient in the role or the channel part of the header, ended by <|call|>
 * or <|return|>) -> a function call, anything else (final, commentary
 * without a recipient) -> content. Streamed and non-streamed answers are
 * built from the same items; usage is the router's count of ids. */
#include "router/http_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- items from the router's deltas and tool calls ---- */

static const char *tw_fn_name(const char *recipient) {
  return !strncmp(recipient, "functions.", 10) ? recipient + 10 : recipient;
}

static tw_hitem_t *tw_item_new(tw_hconn_t *c, tw_hitem_kind_t kind, const char *recipient) {
  if (c->n_items == c->cap_items) {
    int cap = c->cap_items ? c->cap_items * 2 : 8;
    tw_hitem_t *t = realloc(c->items, sizeof *t * (size_t)cap);
    if (!t) {
      tw_http_check(c, tw_err_quiet(TW_ERR_NO_MEMORY, "no memory for %d answer items", cap));
      return NULL;
    }
    c->items = t;
    c->cap_items = cap;
  }
  tw_hitem_t *it = &c->items[c->n_items];
  memset(it, 0, sizeof *it);
  it->kind = kind;
  tw_tok_buf_init(&it->text);
  if (!tw_http_check(c, tw_tok_buf_append(&it->text, "", 0))) return NULL;
  static const char *const prefix[] = {"msg", "rs", "call"};
  snprintf(it->id, sizeof it->id, "%s_%08x%llx%04x", prefix[kind], c->h->boot,
           (unsigned long long)c->serial, (unsigned)c->n_items);
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
      if (!(it = tw_item_new(c, kind, rc))) return; /* c failed (tw_http_check) */
      if (c->stream && ops->open) ops->open(c, c->n_items - 1);
    }
    size_t len = d->content ? strlen(d->content) : 0;
    if (!len) continue;
    if (!tw_http_check(c, tw_tok_buf_append(&it->text, d->content, len))) return;
    if (c->stream && ops->delta) ops->delta(c, c->n_items - 1, d->content, len);
  }
  for (size_t k = 0; k < rep->n_tool_calls; k++) {
    const Twain__V1__ToolCall *t = rep->tool_calls[k];
    tw_hitem_t *it = c->n_items ? &c->items[c->n_items - 1] : NULL;
    const char *args = t->arguments ? t->arguments : "";
    if (it && it->kind == TW_HI_CALL && !it->closed) { /* its arguments were streamed */
      it->text.len = 0;
      if (!tw_http_check(c, tw_tok_buf_append(&it->text, args, strlen(args)))) return;
    } else { /* a call without streamed arguments */
      if (!(it = tw_item_new(c, TW_HI_CALL, t->recipient))) return; /* c failed */
      if (!tw_http_check(c, tw_tok_buf_append(&it->text, args, strlen(args)))) return;
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
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "output_tokens_details"), "reasoning_tokens",
                            c->reasoning_tokens);
  } else if (c->kind == TW_HK_CHAT) {
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "completion_tokens_details"), "reasoning_tokens",
                            c->reasoning_tokens);
  }
  return u;
}

/* ---- chat completions ---- */

/* {id, object, created, model, choices: [choice]} (choice NULL: []), with
 * the choice's logprobs null and finish_reason (NULL: null). */
static cJSON *tw_envelope(const tw_hconn_t *c, const char *id_prefix, const char *object,
                          cJSON *choice, const char *finish) {
  char id[48];
  snprintf(id, sizeof id, "%s%08x%llx", id_prefix, c->h->boot, (unsigned long long)c->serial);
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
/* The text of c's items of `kind` joined; NULL when there is none, or when
 * it could not be stored (c then fails: tw_http_check). */
static char *tw_join(tw_hconn_t *c, tw_hitem_kind_t kind) {
  tw_tok_buf_t b;
  tw_tok_buf_init(&b);
  bool any = false;
  tw_status_t as = TW_OK;
  for (int i = 0; i < c->n_items && as == TW_OK; i++)
    if (c->items[i].kind == kind) {
      any = true;
      as = tw_tok_buf_append(&b, c->items[i].text.data, c->items[i].text.len);
    }
  if (as == TW_OK && any && !b.data) as = tw_tok_buf_append(&b, "", 0);
  if (!tw_http_check(c, as)) {
    tw_tok_buf_fini(&b);
    return NULL;
  }
  if (!any) return NULL;
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
  /* an item that ended is completed, unless the answer ended inside it */
  const char *status = !done                                ? "in_progress"
                       : i == c->n_items - 1 && c->last_cut ? "incomplete"
                                                            : "completed";
  cJSON *o = cJSON_CreateObject();
  if (it->kind == TW_HI_CALL) {
    char fid[48];
    tw_fc_id(it, fid, sizeof fid);
    cJSON_AddStringToObject(o, "type", "function_call");
    cJSON_AddStringToObject(o, "id", fid);
    cJSON_AddStringToObject(o, "call_id", it->id);
    cJSON_AddStringToObject(o, "name", it->name ? it->name : "");
    cJSON_AddStringToObject(o, "arguments", text);
    cJSON_AddStringToObject(o, "status", status);
    return o;
  }
  bool rs = it->kind == TW_HI_REASONING;
  cJSON_AddStringToObject(o, "type", rs ? "reasoning" : "message");
  cJSON_AddStringToObject(o, "id", it->id);
  if (rs) cJSON_AddArrayToObject(o, "summary");
  else cJSON_AddStringToObject(o, "role", "assistant");
  cJSON_AddStringToObject(o, "status", status);
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
  snprintf(id, sizeof id, "resp_%08x%llx", c->h->boot, (unsigned long long)c->serial);
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
  if (c->echo_tool_choice)
    cJSON_AddItemToObject(o, "tool_choice", cJSON_Duplicate(c->echo_tool_choice, true));
  else
    cJSON_AddStringToObject(o, "tool_choice", "auto");
  if (c->echo_tools)
    cJSON_AddItemToObject(o, "tools", cJSON_Duplicate(c->echo_tools, true));
  else
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
    if (!tw_http_check(c, tw_tok_stream_push(&c->dec, rep->token_ids[i], &c->ctext))) return;
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
  if (rep->done && !stop_hit && !tw_http_check(c, tw_tok_stream_finish(&c->dec, &c->ctext))) return;
  if (stop_hit && !rep->done) { /* stop the generation too */
    c->want_cancel = true;
    c->cancel_stopped = true; /* a finished request, not a cancelled one */
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

/* The request field a router error is about (OpenAI's error.param), by what
 * its message names; NULL when none. */
static const char *tw_error_param(const tw_hconn_t *c, const char *msg) {
  const char *input = c->kind == TW_HK_CHAT        ? "messages"
                      : c->kind == TW_HK_RESPONSES ? "input"
                                                   : "prompt";
  if (tw_http_msg_context(msg) || strstr(msg, "prompt of") || !strncmp(msg, "prompt_ids[", 11))
    return input;
  if (!strncmp(msg, "max_tokens", 10)) return c->max_key ? c->max_key : "max_tokens";
  if (!strncmp(msg, "chat: tools[", 12) || !strncmp(msg, "tools[", 6)) return "tools";
  if (!strncmp(msg, "chat: messages", 14)) return input;
  if (!strncmp(msg, "chat: date", 10)) return "current_date";
  if (strstr(msg, "temperature")) return "temperature";
  if (strstr(msg, "top_p")) return "top_p";
  return NULL;
}

void tw_hoai_on_reply(tw_hconn_t *c, const Twain__V1__ServerReply *rep) {
  if (rep->error && rep->error->code) {
    const char *msg =
        rep->error->message && rep->error->message[0] ? rep->error->message : "request failed";
    unsigned status = tw_http_status_of_code(rep->error->code);
    tw_http_fail(c, status, status == 400 ? tw_error_param(c, msg) : NULL, "%s", msg);
    return;
  }
  if (c->stream) c->sse = true;
  if (rep->usage && rep->done) {
    c->prompt_tokens = rep->usage->prompt_tokens;
    c->completion_tokens = rep->usage->completion_tokens;
    c->reasoning_tokens = rep->usage->reasoning_tokens;
  }
  if (rep->done) {
    c->finish = rep->finish_reason;
    c->last_cut = rep->last_message_cut;
  }
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
  cJSON_Delete(c->echo_tool_choice);
  cJSON_Delete(c->echo_tools);
  c->echo_tool_choice = c->echo_tools = NULL;
}
